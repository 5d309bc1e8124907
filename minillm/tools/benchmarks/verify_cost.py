"""``python -m minillm bench verify-cost``: what one cached forward over n new tokens costs, beside a roofline.

Speculative decoding lives or dies by v(n): the wall time of ONE target forward over n new tokens
(a verification of K = n - 1 drafts) in units of a single-token decode step. Its theory assumes
v(n) = 1; every method of chapters 5 and 9 pays the measured v(n) instead.

Validated first: the cached forward over n tokens gives the logits of a forward over the whole
sequence. Then, in the order printed:

1. a roofline for this machine, measured here under minillm's BLAS thread policy: memory bandwidth
   from a large NumPy copy (read + write bytes per second) and the GEMM peak from a float32 matrix
   product, each the best of many short runs. No forward over n tokens can beat
   max(bytes read / bandwidth, FLOPs / peak);
2. v(n) for n = 1..64 on top of a cache already holding ``--context`` tokens (default 100): every
   round times each n once (the order reversed every other round), so t(n) and t(1) of a round ran
   under the same machine load; v(n) is the median over rounds of t(n) / t(1). Beside it the
   roofline, and the "floor": the v(n) left if only the roofline's work grew with n;
3. where the time goes (the character GPT): each part of the forward swapped for a free stand-in at
   several n (``bench kv-cache``'s ablation), so the growth from n = 1 is attributed to the parts;
4. the weight matrices of one block alone, x (n, in) @ W (in, out) for each: n = 1 is a matrix-vector
   product (BLAS gemv, which streams W once); n > 1 a matrix-matrix product (gemm, which first
   copies W into its own blocked layout, "packing", then multiplies), beside their roofline.
"""

from __future__ import annotations

import argparse

import numpy as np

from ...backend import xp
from ...data import load_corpus
from ...kv_cache import KVCache, kv_cache_bytes
from ...measure import STAND_INS, decode_step_parts, timed
from ...model import GPT
from ...notebook import format_table
from ...registry import load_model
from ..options import positive_int, positive_int_list
from .common import BenchmarkError, add_output_args, figure_dir, parse_args, progress, save_figure

NS = "1,2,3,4,6,8,12,16,24,32,48,64"
PARTS_NS = "1,4,8,16"
EMBEDDING_TABLES = ("wte.weight", "wpe.weight", "embed_tokens.weight")  # read one row per token
COPY_BYTES = 64 * 2**20  # larger than common CPU caches: the copy runs at memory bandwidth
GEMM_SIZE = 512  # (512, 512) @ (512, 512): 0.27 GFLOP, large enough for BLAS to reach its peak
ROOF_REPEAT = 30  # best of 30: short runs, so some of them get the core to themselves on a busy machine
FLOAT32_BYTES = 4


# ---- the roofline: pure arithmetic ---------------------------------------------------------------


def matmul_weights(model) -> list:
    """The weight matrices a forward reads in full: every 2-D parameter but the embedding tables
    (looked up one row per token), plus the LM head (which may be the token embedding, tied)."""
    tables = [a for name, a in model.params.items() if a.ndim == 2 and name not in EMBEDDING_TABLES]
    return [*tables, model.lm_head]


def forward_bytes(weight_bytes: int, config, n: int, context: int) -> int:
    """Bytes one forward over n new tokens must read: the weights once, plus K and V of context + n tokens."""
    return weight_bytes + kv_cache_bytes(config.n_layer, config.n_kv_head, config.head_size, context + n,
                                         bytes_per_elem=FLOAT32_BYTES)


def forward_flops(weight_elements: int, config, n: int, context: int) -> int:
    """FLOPs of one forward over n new tokens with ``context`` cached: 2 per weight per token (a
    multiply and an add), plus q k^T and (weights) v over the Tk = context + n keys, 2 n Tk hs each
    per head and layer.  Example: 1000 weights, 1 layer, 1 head of 4, n = 2, context 3 -> 4000 + 160."""
    keys = context + n
    attention = 2 * 2 * n * keys * config.head_size * config.n_head * config.n_layer
    return 2 * n * weight_elements + attention


def roofline_seconds(nbytes: float, flops: float, bandwidth: float, peak: float) -> float:
    """The time no implementation beats: max(bytes / bandwidth, FLOPs / peak) (Williams et al. 2009)."""
    return max(nbytes / bandwidth, flops / peak)


def bound(nbytes: float, flops: float, bandwidth: float, peak: float) -> str:
    """Which roof holds: 'memory' when moving the bytes takes longer than the arithmetic, else 'compute'."""
    return "memory" if nbytes / bandwidth >= flops / peak else "compute"


def cost_rows(times: dict, roofline: dict, bounds: dict) -> list[dict]:
    """{n: [seconds per round]} (n = 1 included), {n: roofline seconds}, {n: bound} -> one row per n.

    v = median over rounds of t(n) / t(1), pairs = its range; floor = 1 + (roof(n) - roof(1)) / t(1),
    the v(n) a forward would have if only its unavoidable work (the roofline) grew with n.
    """
    step = float(np.median(times[1]))
    rows = []
    for n in sorted(times):
        ratios = np.divide(times[n], times[1])  # paired by round
        t = float(np.median(times[n]))
        rows.append({
            "n": n, "ms": 1e3 * t, "v (steps)": float(np.median(ratios)),
            "pairs": f"{ratios.min():.2f}-{ratios.max():.2f}", "ms/token": 1e3 * t / n,
            "roofline ms": 1e3 * roofline[n], "bound": bounds[n], "measured/roofline": t / roofline[n],
            "floor (steps)": 1 + (roofline[n] - roofline[1]) / step,
        })
    return rows


def matmul_rows(times: dict, weight_elements: int, bandwidth: float, peak: float) -> list[dict]:
    """{n: [seconds per round]} of the products x (n, in) @ W over ``weight_elements`` float32 weights
    -> rows: the best round in microseconds, times the n = 1 product, GFLOP/s reached, the roofline.

    The best round, not the median: these products take 0.1-1 ms, and on a busy machine a timeslice
    lost to another process costs several ms, so the median would measure the scheduler."""
    one = min(times[1])
    rows = []
    for n in sorted(times):
        t = min(times[n])
        flops = 2 * n * weight_elements
        roof = roofline_seconds(FLOAT32_BYTES * weight_elements, flops, bandwidth, peak)
        rows.append({"n": n, "us": 1e6 * t, "x n=1": t / one, "GFLOP/s": flops / t / 1e9,
                     "roofline us": 1e6 * roof, "measured/roofline": t / roof})
    return rows


def parts_rows(parts: dict) -> list[dict]:
    """{n: decode_step_parts rows} -> one row per part, its cost in microseconds at each n and its
    growth from the smallest n; "everything else" is the whole forward minus the swapped parts."""
    ns = sorted(parts)
    table = {}
    for n in ns:
        costs = {r["part"]: r["part us"] for r in parts[n]}
        costs["everything else"] = costs["whole step"] - sum(costs[p] for p in STAND_INS)
        for part, us in costs.items():
            table.setdefault(part, {})[n] = us
    rows = []
    for part, by_n in table.items():
        row = {"part": "whole forward" if part == "whole step" else part}
        row |= {f"n={n} us": round(by_n[n]) for n in ns}
        row[f"growth {ns[0]}->{ns[-1]} us"] = round(by_n[ns[-1]] - by_n[ns[0]])
        rows.append(row)
    return rows


# ---- measurements ------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = COPY_BYTES, repeat: int = ROOF_REPEAT) -> float:
    """Bytes per second (read + written) of the best of ``repeat`` copies of an ``nbytes`` float32 array."""
    src = xp.ones(nbytes // FLOAT32_BYTES, dtype=xp.float32)
    dst = xp.empty_like(src)
    xp.copyto(dst, src)  # first touch: the pages of dst are mapped here, not in a timed copy
    best = min(timed(lambda: xp.copyto(dst, src))[0] for _ in range(repeat))
    return 2 * nbytes / best


def gemm_peak(size: int = GEMM_SIZE, repeat: int = ROOF_REPEAT) -> float:
    """FLOP/s of the best of ``repeat`` float32 products of two (size, size) matrices (2 size^3 FLOPs)."""
    rng = np.random.default_rng(0)
    a, b = (xp.asarray(rng.standard_normal((size, size), dtype=np.float32)) for _ in range(2))
    a @ b  # warm-up
    best = min(timed(lambda: a @ b)[0] for _ in range(repeat))
    return 2 * size**3 / best


def block_matmul_seconds(model, ns: list[int], rounds: int, steps: int) -> tuple[dict, int]:
    """x (n, in) @ W (in, out) for every weight matrix W of block 0 -> ({n: [seconds, one per round]},
    the number of weights in those matrices). Timed like ``forward_seconds``."""
    prefix = "h.0." if isinstance(model, GPT) else "layers.0."
    weights = [a for name, a in model.params.items() if name.startswith(prefix) and a.ndim == 2]
    rng = np.random.default_rng(0)
    xs = {n: [xp.asarray(rng.standard_normal((n, w.shape[0]), dtype=np.float32)) for w in weights] for n in ns}

    def run(n):
        for _ in range(steps):
            for x, w in zip(xs[n], weights):
                x @ w

    return alternating_rounds(run, ns, rounds, steps, "block matmuls"), sum(int(w.size) for w in weights)


def prefix_ids(tokenizer, n: int) -> list[int]:
    """n tokens of real text (the corpus's validation end): a realistic prefix for the cache."""
    text = load_corpus()
    start = int(len(text) * 0.95)
    ids = tokenizer.encode(text[start : start + 8 * n])[:n]  # a token covers at least one character
    if len(ids) < n:
        raise BenchmarkError(f"the corpus gave {len(ids)} tokens, fewer than the {n} asked for")
    return ids


def check_cached_forward(model, prefix: list[int], new: list[int]) -> None:
    """The timed path is right: a cached forward over ``new`` after ``prefix`` gives the last rows of
    a forward over prefix + new (float32 rounding apart)."""
    cache = KVCache(model.config, max_len=len(prefix) + len(new))
    model.forward(xp.asarray([prefix]), cache)
    cached = model.forward(xp.asarray([new]), cache)[0]
    full = model.forward(xp.asarray([prefix + new]))[0, -len(new) :]
    if not xp.allclose(cached, full, atol=1e-3, rtol=1e-3):
        raise BenchmarkError(f"a cached forward over {len(new)} tokens differs from the full forward")


def forward_seconds(model, prefix: list[int], ns: list[int], rounds: int, steps: int) -> dict:
    """{n: [seconds of one cached forward over n new tokens, one per round]} after ``prefix`` is cached.

    Each timing runs ``steps`` forwards (rolling the cache back to the prefix before each); every
    round times every n, in reverse order every other round.
    """
    context, vocab = len(prefix), model.config.vocab_size
    cache = KVCache(model.config, max_len=context + max(ns))
    model.forward(xp.asarray([prefix]), cache)
    new = {n: xp.asarray([[(7 * t + 1) % vocab for t in range(n)]]) for n in ns}

    def run(n):
        for _ in range(steps):
            cache.truncate(context)
            model.forward(new[n], cache)

    return alternating_rounds(run, ns, rounds, steps, "rounds (every n once)")


def alternating_rounds(run, ns: list[int], rounds: int, steps: int, label: str) -> dict:
    """{n: [seconds per step, one per round]}: ``run(n)`` (``steps`` steps) once per n as a warm-up,
    then every round times every n, in reverse order every other round (so a load spell hits all n)."""
    for n in ns:
        run(n)  # warm-up
    times = {n: [] for n in ns}
    for r in progress(range(rounds), label):
        for n in ns[:: 1 if r % 2 else -1]:
            times[n].append(timed(lambda n=n: run(n))[0] / steps)
    return times


def plot(rows, out_dir):
    import matplotlib.pyplot as plt

    n = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(n, [r["v (steps)"] for r in rows], "o-", label="measured: one forward over n new tokens")
    ax.plot(n, [r["floor (steps)"] for r in rows], "s--", label="floor: only the roofline work grows")
    ax.axhline(1.0, color="gray", lw=0.8, label="the theory's assumption v = 1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens n in one forward (a verification of K = n - 1 drafts)")
    ax.set_ylabel("cost in single-token decode steps")
    ax.set_title("The cost of verifying n tokens")
    ax.legend(fontsize=8)
    return save_figure(fig, "verify_cost", out_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench verify-cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="target", help="a registry model: target (default), draft, smollm2-135m, ...")
    p.add_argument("--context", type=positive_int, default=100, help="tokens already cached (default 100)")
    p.add_argument("--ns", type=positive_int_list, default=NS, help=f"new tokens per forward (default {NS})")
    p.add_argument("--rounds", type=positive_int, default=15, help="timing rounds, each n once per round (default 15)")
    p.add_argument("--steps", type=positive_int, default=5, help="forwards per timing (default 5)")
    p.add_argument("--parts-ns", type=positive_int_list, default=PARTS_NS,
                   help=f"n at which the parts are ablated (default {PARTS_NS}; GPT models only)")
    p.add_argument("--parts-rounds", type=positive_int, default=20, help="rounds of the ablation (default 20)")
    p.add_argument("--no-parts", action="store_true", help="skip the ablation")
    p.add_argument("--no-plot", action="store_true", help="do not write the figure")
    p.add_argument("--quick", action="store_true", help="n in 1,4,8,16; 5 rounds; ablation at 1,8 with 6 rounds")
    add_output_args(p)
    args = parse_args(p, argv)
    if args.quick:
        args.ns, args.rounds, args.parts_ns, args.parts_rounds = [1, 4, 8, 16], 5, [1, 8], 6
    ns = sorted(set(args.ns) | {1})  # v(n) is in units of n = 1
    model, tok = load_model(args.model)
    cfg = model.config
    largest = max(ns + ([] if args.no_parts else args.parts_ns))
    if args.context + largest > cfg.block_size:
        p.error(f"--context {args.context} + n up to {largest} exceeds block_size={cfg.block_size}")
    prefix = prefix_ids(tok, args.context)
    weights = matmul_weights(model)
    w_bytes, w_elems = sum(int(a.nbytes) for a in weights), sum(int(a.size) for a in weights)
    print(f"model {args.model}: {model.num_params():,} params, {cfg.n_layer} layers, width {cfg.n_embd}; "
          f"{w_elems:,} weights in matrices ({w_bytes / 2**20:.1f} MiB float32); {args.context} tokens cached\n")

    check_cached_forward(model, prefix, [(3 * t + 2) % cfg.vocab_size for t in range(max(ns))])
    print("validated: a cached forward over n tokens == the last n rows of a full forward\n")

    bandwidth, peak = copy_bandwidth(), gemm_peak()
    cached_bandwidth = copy_bandwidth(w_bytes)
    print(f"1. the roofline of this machine (best of {ROOF_REPEAT} each)")
    print(f"   memory bandwidth {bandwidth / 1e9:.1f} GB/s (a {COPY_BYTES // 2**20} MiB copy, read + write); "
          f"a copy the size of the weights: {cached_bandwidth / 1e9:.1f} GB/s")
    print(f"   GEMM peak {peak / 1e9:.1f} GFLOP/s (float32 {GEMM_SIZE}^3 product)")
    step_bytes = forward_bytes(w_bytes, cfg, 1, args.context)
    per_token = forward_flops(w_elems, cfg, 1, args.context)
    print(f"   per forward: {step_bytes / 2**20:.1f} MiB read -> {1e3 * step_bytes / bandwidth:.2f} ms; "
          f"per token {per_token / 1e6:.1f} MFLOP -> {1e3 * per_token / peak:.3f} ms; "
          f"memory-bound up to n ~ {step_bytes / bandwidth / (per_token / peak):.1f}\n")

    print(f"2. one cached forward over n new tokens ({args.rounds} rounds x {args.steps} forwards; "
          "v = median of the per-round ratios t(n) / t(1))")
    times = forward_seconds(model, prefix, ns, args.rounds, args.steps)
    sizes = {n: (forward_bytes(w_bytes, cfg, n, args.context), forward_flops(w_elems, cfg, n, args.context))
             for n in ns}
    roofline = {n: roofline_seconds(b, f, bandwidth, peak) for n, (b, f) in sizes.items()}
    bounds = {n: bound(b, f, bandwidth, peak) for n, (b, f) in sizes.items()}
    rows = cost_rows(times, roofline, bounds)
    print(format_table(rows))
    if not args.no_plot:
        print("  ", plot(rows, figure_dir(args)))

    if not args.no_parts and isinstance(model, GPT):
        print(f"\n3. where the time goes: each part swapped for a free stand-in ({args.parts_rounds} rounds "
              "in alternation; microseconds per forward)")
        parts = {n: decode_step_parts(model, args.context, steps=args.steps, rounds=args.parts_rounds, tokens=n)
                 for n in progress(args.parts_ns, "parts at n")}
        print(format_table(parts_rows(parts)))

    mm_times, block_weights = block_matmul_seconds(model, ns, 3 * args.rounds, steps=1)
    block_bandwidth = copy_bandwidth(FLOAT32_BYTES * block_weights)
    print(f"\n4. the weight matrices of block 0 alone: x (n, in) @ W (in, out) for each (best of {3 * args.rounds} "
          f"rounds; the roofline with the bandwidth of a copy that size, {block_bandwidth / 1e9:.1f} GB/s)")
    print(format_table(matmul_rows(mm_times, block_weights, block_bandwidth, peak)))
    return 0
