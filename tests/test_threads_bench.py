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


BENCH_UNTIL_LOADED = """
import time
from contextlib import contextmanager
from minillm.tools.benchmarks import threads

real_load, state = threads.background_load, {}

@contextmanager
def load(n):
    with real_load(n):
        state["busy"] = n
        yield

def forward_ms(model, T, runs=5):
    if state.get("busy"):  # the loaded part: its busy processes are running
        print("loaded", flush=True)
        time.sleep(300)
    return [1.0]

threads.background_load, threads.forward_ms, threads.load_model = load, forward_ms, lambda name: (None, None)
threads.FORWARD_TOKENS = (1,)
threads.main(["--forwards-only", "--load", "2"])
"""


def children_of(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``, from /proc."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_busy_processes_die_with_the_benchmark(how):
    """`bench threads` killed with SIGTERM left its two busy processes spinning: they die with it, on
    SIGTERM (the handler ends the run through its finally blocks) and on SIGKILL (Linux's parent-death
    signal, set with prctl)."""
    import signal
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", BENCH_UNTIL_LOADED], stdout=subprocess.PIPE, text=True)
    try:
        assert "loaded" in iter(lambda: proc.stdout.readline().strip(), "")  # reads up to that line
        busy = children_of(proc.pid)
        assert len(busy) == 2
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in busy) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in busy)
    finally:
        proc.kill()
