"""``python -m minillm bench quantized``: one pass over SmolLM2-135M's weight products per format, beside its floors.

A pass is every product of a decode step or a verification of n tokens: 30 blocks of q, k, v, o (576
and 192 outputs of 576 inputs), gate, up (1536 x 576), down (576 x 1536), then the LM head (49152 x
576), 134.5 M weights, each a separate matrix in memory (a pass streams them all, as a forward does).
The weights are random, quantized into each format and packed once (``minillm.qkernels.pack``).

Validated first: each format's kernel against ``x @ W.dequantize().T`` on the largest block shape.
Then, per format and n = 1, 2, 4, 8, 16 token rows, in the order printed:

- ms: the best of ``--repeat`` passes by the wall clock, and "cpu ms" by this thread's CPU time (on a
  busy machine the wall clock also counts the time the thread waited for a core);
- v(n) = t(n) / t(1) of the same format: what a verification of n tokens costs in decode steps;
- GB/s: the format's bytes over the pass's best time, beside the measured bandwidth;
- the floors: memory = bytes / bandwidth (the best of a large sum and a large copy, one thread,
  ``verify_cost.read_bandwidth`` / ``copy_bandwidth``); compute = n m k multiply-adds at the best FMA
  rate observed on this core (BLAS's large float32 GEMM, or the F32 kernel with 16 rows on a weight
  that fits in the cache, whichever is faster); "x floor" = ms / max(the two floors).

``--json OUT`` also writes every number. The numbers are only as quiet as the machine: the first
line printed says the load.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from ... import quantize
from ...notebook import format_table
from ..options import int_in, list_of
from .common import BenchmarkError
from .common import parse_args as common_parse_args
from .verify_cost import copy_bandwidth, gemm_peak, read_bandwidth

N_LAYER = 30
# (out, in) of q, k, v, o, gate, up, down
BLOCK_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
LM_HEAD = (49152, 576)
FORMATS = ("F32", "BF16", "Q8_0", "Q4_1")
ROWS = (1, 2, 4, 8, 16)
TOL = 2e-6  # the kernel tests' tolerance, relative to sum_t |x w|
CACHE_WEIGHT = (256, 576)  # a weight that fits in L2 (590 KB as float32): the kernel's compute rate


def pass_shapes() -> list[tuple[int, int]]:
    """The (out, in) of every product of one pass, in the order a forward runs them."""
    return [shape for _ in range(N_LAYER) for shape in BLOCK_SHAPES] + [LM_HEAD]


def pack_pass(fmt: str, rng) -> list:
    """Every weight of a pass in ``fmt``, packed; one random matrix per shape, each packed copy its own memory."""
    from ...qkernels import pack

    shapes = sorted(set(pass_shapes()))
    quantized = {s: quantize.FORMATS[fmt].quantize(rng.standard_normal(s, dtype=np.float32)) for s in shapes}
    return [pack(quantized[s]) for s in pass_shapes()]


def validate(fmt: str, rng) -> None:
    """The kernel equals x @ W.dequantize().T on gate's shape for n = 1 and 16, else BenchmarkError."""
    from ...qkernels import pack, product

    weight = quantize.FORMATS[fmt].quantize(rng.standard_normal(BLOCK_SHAPES[4], dtype=np.float32))
    ref_w = weight.dequantize().astype(np.float64)
    packed = pack(weight)
    for n in (1, 16):
        x = rng.standard_normal((n, ref_w.shape[1]), dtype=np.float32)
        error = np.abs(product(x, packed) - x.astype(np.float64) @ ref_w.T)
        if np.any(error > TOL * (np.abs(x).astype(np.float64) @ np.abs(ref_w).T)):
            raise BenchmarkError(f"{fmt} kernel disagrees with x @ W.dequantize().T at n = {n}: {error.max():.3g}")


def time_pass(packed: list, n: int, repeat: int, rng) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds of this thread) of ``repeat`` passes over n token rows."""
    from ...qkernels import product

    xs = {k: rng.standard_normal((n, k), dtype=np.float32) for k in {p.shape[1] for p in packed}}
    for p in packed:  # warm-up: compiles or loads the kernel, touches every page
        product(xs[p.shape[1]], p)
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.thread_time()
        for p in packed:
            product(xs[p.shape[1]], p)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)
    return min(wall), min(cpu)


def kernel_fma_rate(rng, repeat: int) -> float:
    """Multiply-adds per second of the F32 kernel over 16 rows on a weight that stays in the cache."""
    from ...qkernels import MAX_ROWS, pack, product

    packed = pack(rng.standard_normal(CACHE_WEIGHT, dtype=np.float32))
    x = rng.standard_normal((MAX_ROWS, CACHE_WEIGHT[1]), dtype=np.float32)
    product(x, packed)
    best = min(_timed(lambda: product(x, packed)) for _ in range(repeat))
    return MAX_ROWS * CACHE_WEIGHT[0] * CACHE_WEIGHT[1] / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def format_rows(fmt: str, nbytes: int, times: dict, bandwidth: float, fma_rate: float) -> list[dict]:
    """{n: (wall s, cpu s)} of one format -> table rows with v(n), GB/s and the floors."""
    weights = sum(m * k for m, k in pass_shapes())
    rows = []
    for n, (wall, cpu) in times.items():
        memory, compute = nbytes / bandwidth, n * weights / fma_rate
        rows.append({"format": fmt, "n": n, "ms": 1e3 * wall, "cpu ms": 1e3 * cpu, "v(n)": wall / times[ROWS[0]][0],
                     "GB/s": nbytes / wall / 1e9, "memory floor ms": 1e3 * memory, "compute floor ms": 1e3 * compute,
                     "x floor": wall / max(memory, compute)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minillm bench quantized", description=__doc__.split("\n")[0])
    p.add_argument("--formats", type=list_of(str), default=list(FORMATS),
                   help=f"comma-separated, from {', '.join(FORMATS)}")
    p.add_argument("--rows", type=list_of(int_in(1, 16)), default=list(ROWS), help="token rows n per pass (1..16)")
    p.add_argument("--repeat", type=int_in(1, 100), default=5, help="timed passes per (format, n); the best counts")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the table and the floors as JSON")
    args = common_parse_args(p, argv)
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        p.error(f"unknown format(s) {', '.join(unknown)}: choose from {', '.join(FORMATS)}")
    if args.json and Path(args.json).exists():
        p.error(f"--json {args.json} exists: name a new file (a benchmark never overwrites one)")
    rows_n = sorted(set(args.rows) | {1})  # v(n) needs t(1)
    rng = np.random.default_rng(0)
    for fmt in args.formats:
        validate(fmt, rng)
    bandwidth = max(read_bandwidth(), copy_bandwidth())
    fma_rate = max(gemm_peak() / 2, kernel_fma_rate(rng, args.repeat))
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s (one thread), FMA rate {fma_rate / 1e9:.1f} G/s (one core)")
    table = []
    for fmt in args.formats:
        packed = pack_pass(fmt, rng)
        times = {n: time_pass(packed, n, args.repeat, rng) for n in rows_n}
        table += format_rows(fmt, sum(q.nbytes for q in packed), times, bandwidth, fma_rate)
        del packed
    print(format_table(table))
    if args.json:
        write_json(Path(args.json), {"bandwidth": bandwidth, "fma_rate": fma_rate, "rows": table})
    return 0


def write_json(path: Path, report: dict) -> None:
    """Write ``report`` to a new file at ``path`` atomically (a temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "x") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
    print(f"\nwrote {path}")
