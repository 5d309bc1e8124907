"""The bug zoo: each chapter's tests catch the classic mistakes of that chapter.

tests/fixtures/bug_zoo.py lists the mutants (one-line edits of the reference made at test time). For
each, the grading command of the exercise it names (or else all of its chapter's test files) runs
with -x against a copy of the project holding the mutant; a mutant is killed when a test fails.
The mutation score (killed / total) is printed (pytest -s) and recorded in docs/instructors.md.
"""

from pathlib import Path

import pytest
from bug_zoo import MUTANTS
from project_copy import patched, run_pytest

from minillm import course

ROOT = Path(__file__).resolve().parents[1]


def test_every_chapter_has_three_mutants_that_apply():
    """Each chapter with exercises has >= 3 mutants; each edit matches the current reference once."""
    chapters = {ex.chapter for ex in course.find_exercises(ROOT)}
    counts = {c: sum(m.chapter == c for m in MUTANTS) for c in chapters}
    assert min(counts.values()) >= 3, counts
    exercises = {ex.id for ex in course.find_exercises(ROOT)}
    for m in MUTANTS:
        assert m.exercise is None or m.exercise in exercises, m
        assert m.apply((ROOT / m.file).read_text()) != (ROOT / m.file).read_text()


def zoo_command(mutant, exercises) -> list:
    """The pytest arguments that must catch ``mutant``."""
    if mutant.exercise is not None:
        checks = exercises[mutant.exercise].checks
        return [checks.tests, "-k", checks.keyword]
    return sorted({ex.checks.tests for ex in exercises.values() if ex.chapter == mutant.chapter})


@pytest.mark.slow
def test_mutation_score(tmp_path):
    """Every mutant is killed: the tests it runs fail (exit 1), not error out or pass."""
    project = course.copy_project(ROOT, tmp_path / "project", leave_out=course.INSTRUCTORS_ONLY)
    exercises = {ex.id: ex for ex in course.find_exercises(ROOT)}
    rows, survivors = [], []
    for m in MUTANTS:
        args = zoo_command(m, exercises)
        with patched(project, {m.file: m.apply((project / m.file).read_text())}):
            r = run_pytest(project, *args, "-x")
        killed = r.returncode == 1
        rows.append(f"| {m.chapter} | {m.name} | `{' '.join(args)}` | {'killed' if killed else 'SURVIVED'} |")
        if not killed:
            survivors.append(f"{m.name}: exit {r.returncode}\n{r.stdout[-1500:]}")
    score = sum(not s.endswith("SURVIVED |") for s in rows)
    print("\n| chapter | mutant | tests run (-x) | result |\n|---|---|---|---|\n" + "\n".join(rows))
    print(f"mutation score: {score}/{len(MUTANTS)} killed ({100 * score / len(MUTANTS):.0f}%)")
    assert not survivors, "\n\n".join(survivors)
