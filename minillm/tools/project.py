"""Where the project's own files are: the checkout that holds ``minillm/``, ``tests/`` and ``docs/``.

The library runs from an installed package too, but the course kit copies the project, ``gpu_check``
runs its tests and ``bench --update-docs`` writes into its ``docs/figures``: those need the checkout.
``project_root()`` finds it (beside this package, else at or above the working directory) or says
how to name it; ``pytest_outcomes`` runs a checkout's tests (the GPU check, the course's grading).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

MARKERS = ("pyproject.toml", "minillm/__init__.py", "tests")  # what a checkout of minillm holds


class ProjectRootError(ValueError):
    """No checkout of the minillm project where one was looked for."""


def is_project_root(folder) -> bool:
    return all((Path(folder) / marker).exists() for marker in MARKERS)


def project_root(root=None) -> Path:
    """``root`` if given (it must be a checkout), else the checkout this package was imported from,
    else the nearest checkout at or above the working directory; ProjectRootError when there is none."""
    if root is not None:
        root = Path(root).resolve()
        if not is_project_root(root):
            raise ProjectRootError(f"{root} is not a minillm project (it needs {', '.join(MARKERS)})")
        return root
    here = Path(__file__).resolve().parents[2]  # minillm/tools/project.py -> the checkout
    cwd = Path.cwd().resolve()
    for candidate in (here, cwd, *cwd.parents):
        if is_project_root(candidate):
            return candidate
    raise ProjectRootError(
        f"no minillm project found beside the installed package or at or above {cwd}: "
        "run this from a checkout of the project (or pass --root DIR)"
    )


@dataclass
class TestCase:
    """One test of a JUnit XML report: its file, its name, what became of it and the failure's report."""

    classname: str  # "tests.test_kv_cache" (empty for a module skipped at collection)
    name: str  # "test_truncate_rolls_back_exactly[KVCache]"
    outcome: str  # "passed" | "failed" | "skipped" (an error counts as failed)
    report: str = ""  # the failure's message and traceback

    @property
    def nodeid(self) -> str:
        return f"{self.classname}::{self.name}"

    @property
    def file(self) -> str:
        """test_kv_cache.py (a module skipped at collection has no classname: its dotted name is its name)."""
        return (self.classname or self.name or "?").split(".")[-1] + ".py"

    def first_error(self) -> str:
        """``tests/test_x.py::test: first line of its error``."""
        message = self.report.strip().splitlines()
        return f"{self.classname.replace('.', '/')}.py::{self.name}: {message[0] if message else '(no message)'}"


def run_pytest(root, args: list[str], timeout: float, env: dict | None = None) -> tuple[list[TestCase], float, str]:
    """Run ``pytest args`` in the checkout ``root``, importing that checkout's minillm (it goes first on
    PYTHONPATH) -> (its tests, seconds, pytest's output). A run past ``timeout`` seconds reports what it
    finished. ``env``: extra environment variables."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=root, env=dict(os.environ, PYTHONPATH=str(root), **(env or {})),
                                  capture_output=True, text=True, timeout=timeout)
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            output = f"pytest timed out after {timeout} s\n{exc.stdout or ''}"
        seconds = time.perf_counter() - t0
        cases = []
        for case in ET.parse(junit).getroot().iter("testcase") if junit.exists() else ():
            problem = next((p for p in (case.find("failure"), case.find("error")) if p is not None), None)
            outcome = "failed" if problem is not None else "skipped" if case.find("skipped") is not None else "passed"
            report = "" if problem is None else f"{problem.get('message') or ''}\n{problem.text or ''}"
            cases.append(TestCase(case.get("classname") or "", case.get("name") or "?", outcome, report))
    return cases, seconds, output


def pytest_outcomes(root, args: list[str], timeout: float) -> tuple[list[tuple[str, str]], float, str]:
    """``run_pytest`` as the GPU check reports it -> ([(test file name, "passed" | "failed" | "skipped"), ...]
    one per test, seconds, output), where output is the first error of each failing test and then the
    tail of pytest's output."""
    cases, seconds, output = run_pytest(root, args, timeout)
    errors = [c.first_error() for c in cases if c.outcome == "failed"]
    head = ["first error of each failing test:", *errors, ""] if errors else []
    return [(c.file, c.outcome) for c in cases], seconds, "\n".join([*head, output[-4000:]])
