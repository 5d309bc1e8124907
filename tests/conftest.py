"""Shared fixtures (small random models that run in milliseconds on a CPU) and the exercises' grading.

A test that grades an exercise says so: ``@pytest.mark.exercise("3.1")``; a test that runs an
exercise's code without grading it, so that it fails until the exercise is solved, says
``@pytest.mark.uses_exercise("3.1", "3.3")`` (both may sit on one parameter: ``pytest.param(...,
marks=...)``). ``python -m pytest tests/test_kv_cache.py --exercise 3.1`` runs exercise 3.1's grading
tests; ``--uses-exercise 3.1`` the others that run its code. EXERCISE_DEPENDS below is the one table
of what each exercise's grading tests also run. The course kit (minillm.tools.course) reads the
marks and the table from the source; docs/instructors.md explains them.
"""

import numpy as np
import pytest
from hypothesis import Phase, settings

from minillm import GPT, GPTConfig

# exercise -> the other exercises its grading tests run (solve those first), found by running each
# exercise's grading tests in a student edition where it is solved and every other exercise is
# stubbed (tests/test_course.py checks each entry the same way)
EXERCISE_DEPENDS = {
    "1.1": "1.2",
    "1.2": "1.1",
    "3.2": "3.1",
    "3.3": "1.1, 1.2, 3.1",
    "4.2": "3.1",
    "5.2": "5.1",
    "5.3": "3.1, 3.2, 3.3, 5.1, 5.2",
    "6.1": "1.1, 1.2, 3.1, 3.3, 4.2, 6.2, 6.3, 6.4",
    "6.2": "6.1, 6.3, 6.4",
    "6.3": "6.1, 6.2, 6.4",
    "6.4": "3.1, 3.3, 6.1, 6.2, 6.3",
    "7.1": "1.1, 1.2, 3.1, 3.2, 3.3, 5.1, 5.2, 5.3, 6.1, 6.3, 7.2, 7.3",
    "7.2": "3.1, 3.3, 5.1, 5.2, 5.3, 6.1, 6.3, 7.1, 7.3",
    "7.3": "3.1, 3.2, 3.3, 5.1, 5.2, 5.3, 6.1, 6.3, 7.1, 7.2",
    "8.1": "3.1, 3.2, 3.3, 4.2, 5.3, 6.1, 7.1, 8.2, 8.3",
    "8.3": "8.1, 8.2",
    "9.1": "9.3",
    "9.2": "5.3",
    "9.4": "3.1, 3.2, 3.3",
    "10.1": "1.1, 3.1, 3.3, 6.1, 6.4, 7.1, 10.2, 10.3",
    "10.2": "3.1, 3.3, 6.1, 7.1, 10.1, 10.3",
    "10.3": "1.1, 3.1, 3.3, 6.1, 7.1, 10.1, 10.2",
    "11.1": "8.2",
    "11.2": "8.1",
    "12.1": "8.3",
    "12.2": "3.1, 8.1, 8.2, 8.3, 12.1",
}


def pytest_addoption(parser):
    group = parser.getgroup("minillm exercises")
    group.addoption("--exercise", action="append", default=[], metavar="ID",
                    help="run only the tests that grade exercise ID (@pytest.mark.exercise), e.g. 3.1")
    group.addoption("--uses-exercise", action="append", default=[], metavar="ID",
                    help="run only the tests that run exercise ID's code (@pytest.mark.uses_exercise)")


def marked_exercises(item, marker: str) -> set:
    return {ex_id for mark in item.iter_markers(marker) for ex_id in mark.args}


def pytest_collection_modifyitems(config, items):
    wanted = {marker: set(config.getoption(option)) for marker, option in
              (("exercise", "exercise"), ("uses_exercise", "uses_exercise"))}
    if not any(wanted.values()):
        return
    keep = [item for item in items if any(marked_exercises(item, m) & ids for m, ids in wanted.items())]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def pytest_report_header(config):
    lines = []
    for ex_id in config.getoption("exercise"):
        depends = EXERCISE_DEPENDS.get(ex_id)
        lines.append(f"exercise {ex_id}: its tests also run exercise(s) {depends}" if depends else
                     f"exercise {ex_id}")
    return lines


@pytest.fixture
def tiny_config():
    return GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture
def tiny_model(tiny_config):
    return GPT.init(tiny_config, seed=0)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def array_reads(monkeypatch):
    """The shapes of the .npy arrays read while the test runs (a file's JSON header is one of them): a test of
    "refused before any array is read" clears the list after writing its file, then loads it."""
    reads, real = [], np.lib.format.read_array

    def counted(*args, **kwargs):
        array = real(*args, **kwargs)
        reads.append(array.shape)
        return array

    monkeypatch.setattr(np.lib.format, "read_array", counted)
    return reads


# Hypothesis's "explain" phase (with the patch file it writes) takes ~40 s per failing property test
# here, which a student edition hits at once; the shrunk failing example is what a reader needs.
settings.register_profile("minillm", phases=[p for p in Phase if p is not Phase.explain])
settings.load_profile("minillm")
