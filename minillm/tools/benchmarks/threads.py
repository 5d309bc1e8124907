"""``python -m minillm bench threads``: the BLAS thread policy, measured as users run minillm.

Each workload is a real command (the demo, naive generation, a speculative benchmark, a test file)
started as its own process, once with ``MINILLM_BLAS_THREADS=1`` (minillm's default) and once with
``MINILLM_BLAS_THREADS=all`` (NumPy's BLAS on every core, its own default). The two runs of a pair
follow each other, and the pairs are repeated, so both policies see the same machine conditions.
Every workload runs on the idle machine and again beside ``--load`` busy processes (pure-Python
loops, one core each: a browser tab, another notebook), which is what a laptop looks like.

A run that passes ``--timeout`` seconds is stopped and reported as ">timeout" (the slow policy
under load can take tens of minutes otherwise). Every process the benchmark starts dies with it,
however it ends (Ctrl-C, SIGTERM, even SIGKILL on Linux: ``start_child``).

Part 1 (``--forwards``, in this process) shows why: one forward of the shipped target over T tokens
with one BLAS thread and with all of them, idle and loaded, T from a decode step (1) to a prefill
(256); each time is the median of 2 x 5 runs, the two policies alternating.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

from ...backend import BLAS_THREADS_ENV, xp
from ...kv_cache import KVCache
from ...notebook import format_table
from ...registry import load_model
from ..options import count, int_in, list_of, positive_float
from .common import parse_args as common_parse_args

POLICIES = ("1", "all")  # MINILLM_BLAS_THREADS values compared
WORKLOADS = {  # name -> arguments after `python`
    "demo": ["-m", "minillm", "demo"],
    "generate --no-cache (100 tokens)": ["-m", "minillm", "generate", "--prompt", "ROMEO:", "--no-cache",
                                         "--max-new-tokens", "100", "--temperature", "0"],
    "bench speculative (K=4, greedy)": ["-m", "minillm", "bench", "speculative", "--ks", "4", "--temperatures",
                                        "0", "--drafts", "draft", "--prompts", "2", "--repeat", "1", "--no-plot"],
    "pytest tests/test_speculative.py": ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_speculative.py"],
}
BUSY_LOOP = "while True: pass"
MAX_LOAD = 256  # busy processes --load may start
FORWARD_TOKENS = (1, 5, 17, 64, 256)  # a decode step, verifications of K = 4 and 16, prefills
FORWARD_CONTEXT = 100  # tokens already cached when a decode step or a verification is timed


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a Linux process receives when its parent dies


def parent_death_signal():
    """A ``preexec_fn`` that makes Linux SIGKILL the child when this process dies (however it dies);
    None where prctl is not available (there the SIGTERM handler of ``main`` and the finally blocks
    stop the children)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_child(argv: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(argv)`` for a process that must not outlive this one."""
    return subprocess.Popen(argv, preexec_fn=parent_death_signal(), **kwargs)


@contextmanager
def stopped_by_sigterm():
    """Within the block SIGTERM raises SystemExit (exit 143), so the finally blocks stop the children."""
    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def background_load(n: int):
    """Start n busy processes (one core each) for the duration of the block."""
    procs = [start_child([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0)  # let them get scheduled
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_once(args: list[str], threads: str, timeout: float) -> float:
    """Wall seconds of ``python *args`` with MINILLM_BLAS_THREADS=threads (inf if it timed out)."""
    env = {**os.environ, BLAS_THREADS_ENV: threads}
    t0 = time.perf_counter()
    with start_child([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True) as proc:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return float("inf")
        finally:
            if proc.poll() is None:  # interrupted: the run stops with us
                proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"`python {' '.join(args)}` failed (exit {proc.returncode}): {err.strip()[-500:]}")
    return time.perf_counter() - t0


def forward_ms(model, T: int, runs: int = 5) -> list[float]:
    """Wall times (ms) of ``runs`` forwards over T new tokens (after FORWARD_CONTEXT cached ones when
    T < 64, so decode and verification see a realistic cache; from an empty cache for prefills).
    Reported as a median, not the best: a stall that hits most runs is what a user waits for."""
    times = []
    for _ in range(runs):
        cache = KVCache(model.config)
        if T < 64:
            model.forward(xp.zeros((1, FORWARD_CONTEXT), dtype=xp.int64), cache)
        t0 = time.perf_counter()
        model.forward(xp.zeros((1, T), dtype=xp.int64), cache)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def forward_rows(load: int) -> list[dict]:
    """One row per T: the forward's time with one BLAS thread and with all, the two alternating."""
    from threadpoolctl import threadpool_limits

    model, _ = load_model("target")
    cores = os.cpu_count() or 1
    rows = []
    with background_load(load):
        for T in FORWARD_TOKENS:
            times = {1: [], cores: []}
            for _ in range(2):
                for n in times:
                    with threadpool_limits(n, user_api="blas"):
                        times[n] += forward_ms(model, T)
            one, every = statistics.median(times[1]), statistics.median(times[cores])
            rows.append({"busy processes": load, "T": T, "1 thread ms": one, f"{cores} threads ms": every,
                         "ratio": every / one})
    return rows


def fmt_seconds(s: float, timeout: float) -> str:
    return f">{timeout:.0f}" if s == float("inf") else f"{s:.1f}"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minillm bench threads", description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=count, default=2, help="pairs per workload and load (default 2)")
    p.add_argument("--load", type=int_in(0, MAX_LOAD), default=2, help="busy processes in the loaded runs (default 2)")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds before a run is stopped (default 300)")
    p.add_argument("--forwards-only", action="store_true", help="part 1 only (the forwards, in this process)")
    p.add_argument("--workloads", type=list_of(int_in(0, len(WORKLOADS) - 1)),
                   default=",".join(str(i) for i in range(len(WORKLOADS))),
                   help="indices of the workloads to run: " + "; ".join(f"{i} {n}" for i, n in enumerate(WORKLOADS)))
    return common_parse_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with stopped_by_sigterm():
        return run(args)


def run(args) -> int:
    """The benchmark, with parsed options (``main``)."""
    print("1. one forward of the shipped target over T tokens, one BLAS thread vs all, idle and loaded (median ms)")
    print(format_table(forward_rows(0) + forward_rows(args.load)))
    if args.forwards_only:
        return 0
    names = list(WORKLOADS)
    chosen = [names[i] for i in args.workloads]
    print("\n2. the commands users run, each a new process")
    print(f"pairs of runs ({BLAS_THREADS_ENV}=1 then =all), {args.repeat} per row; seconds, median of the pairs\n")
    header = f"{'workload':36s} {'load':>5s} {'1 thread':>9s} {'all':>9s} {'all / 1':>8s}  pairs (1 | all)"
    print(header)
    print("-" * len(header))
    for name in chosen:
        run_once(WORKLOADS[name], POLICIES[0], args.timeout)  # warm-up: file caches, compiled kernels
        for load in dict.fromkeys((0, args.load)):  # idle, then loaded
            times = {policy: [] for policy in POLICIES}
            with background_load(load):
                for _ in range(args.repeat):
                    for policy in POLICIES:
                        times[policy].append(run_once(WORKLOADS[name], policy, args.timeout))
            one, every = statistics.median(times["1"]), statistics.median(times["all"])
            pairs = " ".join(f"{fmt_seconds(a, args.timeout)}|{fmt_seconds(b, args.timeout)}"
                             for a, b in zip(times["1"], times["all"]))
            ratio = every / one if one > 0 else float("nan")
            print(f"{name:36s} {load:>5d} {fmt_seconds(one, args.timeout):>9s} "
                  f"{fmt_seconds(every, args.timeout):>9s} {ratio:>7.2f}x  {pairs}", flush=True)
    return 0
