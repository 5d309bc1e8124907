"""python -m minillm bench attention: naive vs tiled (FlashAttention) attention, memory and time.

On a CPU (NumPy): peak memory (tracemalloc) and wall time of ``naive_attention`` vs the tiled
``flash_attention`` for one head, hs 64, causal, N = 1K .. 16K. The claim to check: the tiled version
never holds the N x N score matrix, so its peak memory at N = 8192 must be at most 10% of naive's.
On a GPU (CuPy): naive CuPy attention vs the CUDA kernels v1 and v2 (``kernels.launch.flash_attention_cuda``,
``flash_attention_v2_cuda``), GPU time (CUDA events) and achieved TFLOP/s against the device's FP32 peak.
Both: the IO-model plot (HBM bytes vs N and vs SRAM size).

Discipline (see minillm.tools.benchmarks.common): validate every output against the reference first, warm up, then time
(synchronizing the GPU), print aligned tables, save PNGs. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import tracemalloc
from functools import partial

import numpy as np

from ... import flash_attention as fa
from ...attention import naive_attention
from ...backend import is_cupy, synchronize, to_numpy, xp
from ...kernels.launch import flash_attention_cuda, flash_attention_v2_cuda
from ...measure import time_fn
from ...notebook import format_table
from ..options import positive_int
from .common import BenchmarkError, add_output_args, figure_dir, parse_args, save_figure

CPU_NS = [1024, 2048, 4096, 8192, 16384]
GPU_NS = [1024, 2048, 4096, 8192, 16384]


def sizes_up_to(ns: list[int], max_n: int) -> list[int]:
    """The sizes of ``ns`` up to max_n; [max_n] when max_n is below them all (a quick check still runs).

    Example: sizes_up_to([1024, 2048, 4096], 2048) -> [1024, 2048]; (..., 256) -> [256].
    """
    return [n for n in ns if n <= max_n] or [max_n]
HS = 64
CPU_TILE = 256  # query and key tile of the array code on a CPU: big enough to amortize Python overhead
MEMORY_RATIO_BOUND = 0.10  # tiled peak / naive peak at N = 8192
MEMORY_CHECK_N = 8192
VALIDATE_ATOL = 1e-4  # float32 vs float32 over up to 16K keys
MIB = 1024 * 1024


def make_qkv(B, nh, N, hs, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(xp.asarray(rng.standard_normal((B, nh, N, hs)).astype(np.float32)) for _ in range(3))


def peak_bytes(fn) -> int:
    """Peak bytes allocated (NumPy reports to tracemalloc) while fn() runs, above what existed before."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def attention_flops(N: int, hs: int, causal: bool, B: int = 1, nh: int = 1) -> float:
    """Multiply-adds of Q K^T and P V counted as 2 FLOPs: 4 N^2 hs per head, about half when causal."""
    pairs = N * (N + 1) / 2 if causal else N * N
    return 4.0 * pairs * hs * B * nh


# ---- CPU -----------------------------------------------------------------------------------------


def run_cpu(ns, repeat, out_dir, plot=True):
    rows, ok = [], True
    tiled = lambda q, k, v: fa.flash_attention(q, k, v, True, CPU_TILE, CPU_TILE)[0]  # noqa: E731
    for N in ns:
        q, k, v = make_qkv(1, 1, N, HS)
        ref = naive_attention(q, k, v, True)  # 1. validate (this is also the warm-up)
        out = tiled(q, k, v)
        err = float(np.abs(out - ref).max())
        if err > VALIDATE_ATOL:
            raise BenchmarkError(f"N={N}: tiled output differs from naive_attention by {err:.2g} > {VALIDATE_ATOL}")
        del ref, out
        naive, flash = partial(naive_attention, q, k, v, True), partial(tiled, q, k, v)
        naive_peak, tiled_peak = peak_bytes(naive), peak_bytes(flash)  # 2. memory
        reps = repeat if N <= 4096 else 1  # 3. time (each 16K naive call takes seconds)
        t_naive = time_fn(naive, warmup=0, repeat=reps)
        t_tiled = time_fn(flash, warmup=0, repeat=reps)
        rows.append({"N": N, "naive MiB": naive_peak / MIB, "tiled MiB": tiled_peak / MIB,
                     "mem tiled/naive": tiled_peak / naive_peak, "naive ms": 1e3 * t_naive,
                     "tiled ms": 1e3 * t_tiled, "time tiled/naive": t_tiled / t_naive,
                     "max |err|": err})
        print(f"  N={N}: done", flush=True)
    tiles = f"{CPU_TILE}x{CPU_TILE}"
    print(f"\nCPU (NumPy), one head, hs {HS}, causal, float32; tiled = flash_attention with {tiles} tiles;")
    print("peak memory by tracemalloc (inputs excluded); time: median wall time after a warm-up call")
    print(format_table(rows))
    check = [r for r in rows if r["N"] == MEMORY_CHECK_N]
    if check:
        r = check[0]
        verdict = "PASS" if r["mem tiled/naive"] <= MEMORY_RATIO_BOUND else "FAIL"
        print(
            f"\ncheck: tiled peak memory <= {MEMORY_RATIO_BOUND:.0%} of naive at N = {MEMORY_CHECK_N}: "
            f"{r['tiled MiB']:.1f} MiB vs {r['naive MiB']:.1f} MiB = {r['mem tiled/naive']:.2%}  {verdict}"
        )
        ok &= verdict == "PASS"
    if plot:
        print("saved", plot_cpu(rows, out_dir))
    return ok


def plot_cpu(rows, out_dir):
    import matplotlib.pyplot as plt

    ns = [r["N"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.loglog(ns, [r["naive MiB"] for r in rows], "o-", label="naive (N x N scores)")
    a.loglog(ns, [r["tiled MiB"] for r in rows], "s-", label=f"tiled ({CPU_TILE}x{CPU_TILE} tiles)")
    a.set(xlabel="sequence length N", ylabel="peak memory (MiB)", title="Peak memory, one head, hs 64")
    b.loglog(ns, [r["naive ms"] for r in rows], "o-", label="naive")
    b.loglog(ns, [r["tiled ms"] for r in rows], "s-", label="tiled")
    b.set(xlabel="sequence length N", ylabel="time (ms)", title="Wall time on CPU (NumPy)")
    for ax in (a, b):
        ax.set_xticks(ns, [f"{n // 1024}K" for n in ns])
        ax.legend()
        ax.grid(alpha=0.3, which="both")
    return save_figure(fig, "flash_cpu_memory_time", out_dir)


# ---- the IO model --------------------------------------------------------------------------------


def plot_io_model(out_dir):
    """HBM bytes of standard vs tiled attention (attention_io_bytes): vs N at two SRAM sizes, and vs M."""
    import matplotlib.pyplot as plt

    d = HS
    ns = [2**p for p in range(9, 16)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.loglog(ns, [fa.attention_io_bytes(n, d, 48 * 1024)["standard"] for n in ns], "o-", label="standard")
    for M in (48 * 1024, 192 * 1024):
        a.loglog(
            ns,
            [fa.attention_io_bytes(n, d, M)["flash"] for n in ns],
            "s-",
            label=f"tiled, M = {M // 1024} KiB",
        )
    a.set(xlabel="sequence length N", ylabel="HBM bytes moved", title=f"IO vs N (one head, d = {d}, fp32)")
    N = 8192
    ms = [2**p * 1024 for p in range(4, 11)]
    b.loglog(
        [m / 1024 for m in ms],
        [fa.attention_io_bytes(N, d, m)["standard"] for m in ms],
        "o-",
        label="standard",
    )
    b.loglog([m / 1024 for m in ms], [fa.attention_io_bytes(N, d, m)["flash"] for m in ms], "s-",
             label="tiled  ~ N^2 d^2 / M")
    b.set(xlabel="SRAM per block M (KiB)", ylabel="HBM bytes moved", title=f"IO vs SRAM size (N = {N}, d = {d})")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3, which="both")
    return save_figure(fig, "flash_io_model", out_dir)


def io_table():
    rows = []
    for N in (1024, 4096, 16384):
        for M in (48 * 1024, 192 * 1024):
            io = fa.attention_io_bytes(N, HS, M)
            rows.append({"N": N, "M KiB": M // 1024, "Br x Bc": f"{io['Br']}x{io['Bc']}",
                         "standard MB": io["standard"] / 1e6, "tiled MB": io["flash"] / 1e6,
                         "standard/tiled": io["standard"] / io["flash"]})
    return format_table(rows)


# ---- GPU -----------------------------------------------------------------------------------------


def fp32_peak_tflops() -> tuple[float, str]:
    """FP32 (non-tensor-core) peak: SMs x FP32 lanes per SM x 2 (FMA) x boost clock; NaN if unknown."""
    import cupy

    dev = cupy.cuda.Device()
    cc = dev.compute_capability  # e.g. "90"
    major, minor = int(cc[:-1]), int(cc[-1])
    lanes = 64 if (major, minor) in ((7, 0), (8, 0)) else 128  # V100, A100: 64; GA10x, Ada, Hopper: 128
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    try:
        sms, clock_khz = dev.attributes["MultiProcessorCount"], dev.attributes["ClockRate"]
    except KeyError:  # an attribute this CUDA version no longer reports
        return float("nan"), f"{name}: clock rate unknown"
    peak = sms * lanes * 2 * clock_khz * 1e3 / 1e12
    return peak, f"{name}: {sms} SMs x {lanes} FP32 lanes x 2 x {clock_khz / 1e6:.2f} GHz"


def gpu_pool_bytes(fn) -> int:
    """Bytes CuPy's memory pool holds after fn() starting from an empty pool: a proxy for peak memory."""
    import cupy

    pool = cupy.get_default_memory_pool()
    synchronize()
    pool.free_all_blocks()
    base = pool.total_bytes()  # the inputs q, k, v (still referenced)
    fn()
    synchronize()
    return pool.total_bytes() - base


GPU_KERNELS = {"v1": flash_attention_cuda, "v2": flash_attention_v2_cuda}  # kernels/flash_attention{,_v2}.cu
GPU_B, GPU_NH = 2, 16  # 32 heads: N = 1024 gives v2 512 blocks, about four per SM of an H100/H200


def event_time(fn, warmup: int = 2, repeat: int = 5) -> float:
    """Median GPU time of fn() in seconds, measured with CUDA events recorded before and after each call
    (after ``warmup`` calls): the device's time, not the host's."""
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(np.median(times))


def run_gpu(ns, repeat, out_dir, B=GPU_B, nh=GPU_NH, plot=True):
    """Naive CuPy attention vs kernels v1 and v2: each output validated against naive (or, where naive runs
    out of memory, the tiled array code), then timed with CUDA events -> rows."""
    import cupy

    peak, how = fp32_peak_tflops()
    rows = []
    for N in ns:
        q, k, v = make_qkv(B, nh, N, HS)
        naive = partial(naive_attention, q, k, v, True)
        try:  # 1. the reference (naive may not fit: its N x N matrices)
            ref, reference = naive(), "naive"
        except cupy.cuda.memory.OutOfMemoryError:
            cupy.get_default_memory_pool().free_all_blocks()
            ref, reference = fa.flash_attention(q, k, v, True, 256, 256)[0], "tiled array code"
        row = {"N": N, "checked vs": reference}
        flops = attention_flops(N, HS, True, B, nh)
        for name, kernel in GPU_KERNELS.items():  # 2. validate each kernel (its status read back), then time it
            err = float(to_numpy(xp.abs(kernel(q, k, v, True) - ref).max()))
            if err > VALIDATE_ATOL:
                raise BenchmarkError(f"N={N}: kernel {name} differs from {reference} attention by {err:.2g}")
            timed_call = partial(kernel, q, k, v, True, check_status=False)  # timed: no wait per call
            seconds = event_time(timed_call, repeat=repeat)
            row |= {f"{name} ms": 1e3 * seconds, f"{name} TFLOP/s": flops / seconds / 1e12,
                    f"{name} % peak": 100 * flops / seconds / 1e12 / peak, f"{name} max |err|": err,
                    f"{name} pool MiB": gpu_pool_bytes(timed_call) / MIB}
        del ref
        if reference == "naive":
            seconds = event_time(naive, repeat=repeat)
            row |= {"naive ms": 1e3 * seconds, "naive TFLOP/s": flops / seconds / 1e12,
                    "naive pool MiB": gpu_pool_bytes(naive) / MIB, "v2 / naive": seconds / (row["v2 ms"] / 1e3)}
        else:
            row |= {"naive ms": "OOM", "naive TFLOP/s": "-", "naive pool MiB": "OOM", "v2 / naive": "-"}
        row["v2 / v1"] = row["v1 ms"] / row["v2 ms"]
        rows.append(row)
        del q, k, v, naive
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"\nGPU: naive CuPy vs kernels/flash_attention.cu (v1) and flash_attention_v2.cu (v2), B {B}, nh {nh}, "
          f"hs {HS}, causal, float32")
    print(f"FP32 peak {peak:.1f} TFLOP/s ({how}); FLOPs = 4 N^2 hs / 2 per head (causal); times: CUDA events, "
          f"median of {repeat} after 2 warm-ups; speed-ups: how many times faster v2 is")
    print(format_table(rows, ["N", "naive ms", "v1 ms", "v2 ms", "naive TFLOP/s", "v1 TFLOP/s", "v2 TFLOP/s",
                              "v1 % peak", "v2 % peak", "v2 / naive", "v2 / v1"]))
    print("\npool MiB: what CuPy's memory pool holds after one call from empty (outputs + temporaries)")
    print(format_table(rows, ["N", "naive pool MiB", "v1 pool MiB", "v2 pool MiB", "v1 max |err|", "v2 max |err|",
                              "checked vs"]))
    if plot:
        print("saved", plot_gpu(rows, out_dir, peak))
    return rows


def plot_gpu(rows, out_dir, peak):
    import matplotlib.pyplot as plt

    ns = [r["N"] for r in rows]
    timed = [r for r in rows if isinstance(r["naive ms"], float)]  # naive may have run out of memory
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.loglog([r["N"] for r in timed], [r["naive ms"] for r in timed], "o-", label="naive (CuPy)")
    b.semilogx([r["N"] for r in timed], [r["naive TFLOP/s"] for r in timed], "o-", label="naive (CuPy)")
    for name, marker in (("v1", "s-"), ("v2", "^-")):
        a.loglog(ns, [r[f"{name} ms"] for r in rows], marker, label=f"kernel {name}")
        b.semilogx(ns, [r[f"{name} TFLOP/s"] for r in rows], marker, label=f"kernel {name}")
    a.set(xlabel="N", ylabel="time (ms)", title="GPU time")
    b.axhline(peak, color="gray", ls="--", label=f"FP32 peak {peak:.0f}")
    b.set(xlabel="N", ylabel="TFLOP/s", title="Achieved FP32 throughput")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3, which="both")
    return save_figure(fig, "flash_gpu_time", out_dir)


# ---- entry point ---------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench attention", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="N up to 4096, one timing repeat")
    p.add_argument("--max-n", type=positive_int, default=None, help="largest N to run (default 16384)")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed repeats (median); 1 for N > 4096 on CPU")
    add_output_args(p)
    p.add_argument("--no-plots", action="store_true", help="print tables only")
    args = parse_args(p, argv)
    out_dir = figure_dir(args)
    max_n = args.max_n or (4096 if args.quick else 16384)
    repeat = 1 if args.quick else args.repeat
    plot = not args.no_plots

    print("IO model (attention_io_bytes), one head, d = 64, float32:")
    print(io_table())
    if plot:
        print("saved", plot_io_model(out_dir))
    if is_cupy():  # a real GPU (the strict stand-in times nothing real)
        run_gpu(sizes_up_to(GPU_NS, max_n), repeat, out_dir, plot=plot)
        return 0
    return 0 if run_cpu(sizes_up_to(CPU_NS, max_n), repeat, out_dir, plot=plot) else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
