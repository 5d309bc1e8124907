"""Benchmark helpers and the ``python -m minillm bench <topic>`` dispatcher.

Every benchmark follows the same discipline (see llm.c's dev/cuda): validate the fast path against
its reference first, warm up, then time (synchronizing the GPU before reading the clock), and print
an aligned table with ratios. Plots go to ``docs/figures/`` by default. Benchmarks print numbers;
they never assert timings (tests do not time anything).
"""

from __future__ import annotations

import importlib
import statistics
import time
from pathlib import Path

from .backend import synchronize

TOPICS = {
    "kv-cache": "minillm.benchmarks.kv_cache",
    "attention": "minillm.benchmarks.attention",
    "speculative": "minillm.benchmarks.speculative",
    "paged": "minillm.benchmarks.paged",
    "batch-speculative": "minillm.benchmarks.batch_speculative",
    "threads": "minillm.benchmarks.threads",
}
DEFAULT_FIG_DIR = Path("docs") / "figures"


def _timed(fn):
    """Run ``fn()`` once -> (wall seconds, its result), the GPU synchronized before both clock reads."""
    synchronize()
    t0 = time.perf_counter()
    value = fn()
    synchronize()
    return time.perf_counter() - t0, value


def time_fn(fn, warmup: int = 1, repeat: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(_timed(fn)[0] for _ in range(repeat))


def time_pairs(baseline, candidate, repeat: int = 3):
    """Time two ways of doing the same work in alternation -> (baseline times, candidate times,
    candidate's last result), ``repeat`` wall times each in seconds, after one warm-up call each.

    Alternating the runs puts both of a pair under the same machine conditions, so their ratio does
    not drift with background load the way two medians timed minutes apart do (on a shared 2-core
    machine that drift reached 20 %).
    """
    baseline()
    result = candidate()
    base_times, cand_times = [], []
    for _ in range(repeat):
        base_times.append(_timed(baseline)[0])
        seconds, result = _timed(candidate)
        cand_times.append(seconds)
    return base_times, cand_times, result


def time_paired(baseline, candidate, repeat: int = 3):
    """``time_pairs`` reduced to medians -> (baseline s, candidate s, candidate's last result)."""
    base_times, cand_times, result = time_pairs(baseline, candidate, repeat)
    return statistics.median(base_times), statistics.median(cand_times), result


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts -> an aligned text table (floats with 4 significant digits)."""
    columns = columns or list(rows[0])

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def save_figure(fig, name: str, out_dir=None) -> Path:
    """Save a matplotlib figure as PNG under out_dir (default docs/figures) and close it."""
    import matplotlib.pyplot as plt

    out = Path(out_dir or DEFAULT_FIG_DIR)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def run(topic: str, argv: list[str]) -> int:
    """Run one benchmark topic: its module's ``main(argv)``."""
    if topic not in TOPICS:
        raise ValueError(f"unknown benchmark {topic!r}; choose from {', '.join(TOPICS)}")
    return importlib.import_module(TOPICS[topic]).main(argv)
