"""The bug zoo: each chapter's tests catch the classic mistakes of that chapter, and every exercise's
grading rejects at least two plausible wrong solutions.

tests/fixtures/bug_zoo.py lists the mutants (one-line edits of the reference made at test time). For
each, the grading command of the exercise it names (or else the node ids it names) runs with -x
against a copy of the project holding the mutant; a mutant is killed when a test fails. A mutant
whose edits all lie inside its exercise's marked region is a wrong solution of that exercise.
The runs are forks of one server process per copy (project_copy.PytestServer), which has imported
the suite's third-party modules once: about 2 s less a mutant.
The mutation score (killed / total) is printed (pytest -s) and recorded in docs/instructors.md.
"""

import ast
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from bug_zoo import MUTANTS
from project_copy import PytestServer, patched

from minillm.tools import course

ROOT = Path(__file__).resolve().parents[1]
# The zoo scores the tests, not a backend: its pytest runs are made once, in the NumPy run.
pytestmark = pytest.mark.host_only
WORKERS = min(2, os.cpu_count() or 1)


def defined_tests(rel: str) -> set:
    """The names of the test functions defined in the test file ``rel``."""
    tree = ast.parse((ROOT / rel).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_chapter_has_three_mutants_that_apply():
    """Each chapter with exercises has >= 3 mutants; each edit matches the current reference once; each
    mutant names an exercise or else node ids of test functions that exist (a renamed test fails here)."""
    chapters = {ex.chapter for ex in course.find_exercises(ROOT)}
    counts = {c: sum(m.chapter == c for m in MUTANTS) for c in chapters}
    assert min(counts.values()) >= 3, counts
    exercises = {ex.id for ex in course.find_exercises(ROOT)}
    for m in MUTANTS:
        assert (m.exercise is None) != (not m.tests), f"{m.name}: name an exercise or the tests, not both"
        assert m.exercise is None or m.exercise in exercises, m
        for node in m.tests:
            rel, _, name = node.partition("::")
            name = name.partition("[")[0]  # a parametrized test's node names one of its parameters
            assert (ROOT / rel).is_file() and name in defined_tests(rel), f"{m.name}: no test {node}"
        assert m.apply((ROOT / m.file).read_text()) != (ROOT / m.file).read_text()


def inside_its_exercise(mutant, ex) -> bool:
    """Every edit of ``mutant`` lies in exercise ``ex``'s marked region (its BEGIN and END lines included)."""
    if mutant.exercise != ex.id or mutant.file != ex.file:
        return False
    lines = (ROOT / ex.file).read_text().splitlines(keepends=True)
    region = "".join(lines[ex.begin - 1 : ex.end])
    return all(old in region for old, _ in mutant.edits)


def test_every_exercise_has_two_wrong_solutions():
    """Each exercise has >= 2 mutants inside its marked region: wrong solutions that its grading command
    must reject (test_mutation_score runs them)."""
    counts = {ex.id: sum(inside_its_exercise(m, ex) for m in MUTANTS) for ex in course.find_exercises(ROOT)}
    short = {ex_id: n for ex_id, n in counts.items() if n < 2}
    assert not short, f"exercises with fewer than two wrong solutions in tests/fixtures/bug_zoo.py: {short}"


def zoo_command(mutant, exercises) -> list:
    """The pytest arguments that must catch ``mutant``."""
    return exercises[mutant.exercise].checks.args if mutant.exercise is not None else list(mutant.tests)


@pytest.mark.slow
def test_mutation_score(tmp_path):
    """Every mutant is killed: the tests it runs fail (exit 1), not error out or pass. Two copies of
    the project take turns (one pytest process each), so both cores work."""
    exercises = {ex.id: ex for ex in course.find_exercises(ROOT)}
    servers = queue.Queue()
    for i in range(WORKERS):
        project = course.copy_project(ROOT, tmp_path / f"project{i}", leave_out=course.INSTRUCTORS_ONLY)
        servers.put(PytestServer(project))

    seconds = {}

    def run(mutant):
        server = servers.get()
        try:
            project = server.project
            t0 = time.perf_counter()
            with patched(project, {mutant.file: mutant.apply((project / mutant.file).read_text())}):
                result = server.run(*zoo_command(mutant, exercises), "-x")
            seconds[mutant.name] = time.perf_counter() - t0
            return result
        finally:
            servers.put(server)

    try:
        with ThreadPoolExecutor(WORKERS) as pool:
            results = list(pool.map(run, MUTANTS))
    finally:
        while not servers.empty():
            servers.get().close()
    rows = [f"| {m.chapter} | {m.name} | `{' '.join(zoo_command(m, exercises))}` | "
            f"{'killed' if r.returncode == 1 else 'SURVIVED'} |" for m, r in zip(MUTANTS, results)]
    killed = sum(r.returncode == 1 for r in results)
    print("\n| chapter | mutant | tests run (-x) | result |\n|---|---|---|---|\n" + "\n".join(rows))
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:5]
    print("slowest mutants: " + "; ".join(f"{name} {s:.1f} s" for name, s in slowest))
    print(f"mutation score: {killed}/{len(MUTANTS)} killed ({100 * killed / len(MUTANTS):.0f}%)")
    survivors = [f"{m.name}: exit {r.returncode}\n{r.stdout[-1500:]}" for m, r in zip(MUTANTS, results)
                 if r.returncode != 1]
    assert not survivors, "\n\n".join(survivors)
