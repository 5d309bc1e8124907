"""The thread-policy benchmark's plumbing: background load, timeouts, failures (no timing asserted)."""

import subprocess

import pytest

from minillm.tools.benchmarks import threads


def test_background_load_starts_and_stops_busy_processes(monkeypatch):
    started = []
    real_popen = subprocess.Popen

    def popen(*a, **kw):
        started.append(real_popen(*a, **kw))
        return started[-1]

    monkeypatch.setattr(threads.subprocess, "Popen", popen)
    with threads.background_load(2):
        assert len(started) == 2 and all(p.poll() is None for p in started)
    assert all(p.poll() is not None for p in started)


def test_run_once_reports_a_timeout_as_infinite_and_a_failure_as_an_error():
    assert threads.run_once(["-c", "import time; time.sleep(5)"], "1", timeout=0.5) == float("inf")
    with pytest.raises(RuntimeError, match="exit 3"):
        threads.run_once(["-c", "raise SystemExit(3)"], "1", timeout=30)
    seconds = threads.run_once(["-c", "import os; assert os.environ['MINILLM_BLAS_THREADS'] == 'all'"], "all", 30)
    assert 0 < seconds < 30


def test_bad_arguments_exit_with_usage():
    with pytest.raises(SystemExit):
        threads.parse_args(["--repeat", "0"])
