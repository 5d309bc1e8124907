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


def first_errors(junit: Path) -> list[str]:
    """One line per failing test of a JUnit XML report: ``file::test: first line of its error``."""
    lines = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        problem = case.find("failure")
        problem = case.find("error") if problem is None else problem
        if problem is not None:
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            name = (case.get("classname") or "?").replace(".", "/") + ".py::" + (case.get("name") or "?")
            lines.append(f"{name}: {message[0] if message else '(no message)'}")
    return lines


def pytest_outcomes(root, args: list[str], timeout: float) -> tuple[list[tuple[str, str]], float, str]:
    """Run ``pytest args`` in the checkout ``root``, importing that checkout's minillm ->
    ([(test file name, "passed" | "failed" | "skipped"), ...] one per test, seconds, output), where output
    is the first error of each failing test (``first_errors``) and then the tail of pytest's output.
    Errors count as failures; a run past ``timeout`` seconds reports what it finished."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
        env = dict(os.environ, PYTHONPATH=str(root))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            output = f"pytest timed out after {timeout} s\n{exc.stdout or ''}"
        seconds = time.perf_counter() - t0
        outcomes, errors = [], []
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                # a module skipped at collection has no classname, and its dotted path as its name
                name = (case.get("classname") or case.get("name") or "?").split(".")[-1] + ".py"
                if case.find("failure") is not None or case.find("error") is not None:
                    outcomes.append((name, "failed"))
                else:
                    outcomes.append((name, "skipped" if case.find("skipped") is not None else "passed"))
            errors = first_errors(junit)
    head = ["first error of each failing test:", *errors, ""] if errors else []
    return outcomes, seconds, "\n".join([*head, output[-4000:]])
