"""``python -m minillm bench verify-cost``: what one cached forward over n new tokens costs, beside a roofline.

Speculative decoding lives or dies by v(n): the wall time of ONE target forward over n new tokens
(a verification of K = n - 1 drafts) in units of a single-token decode step. Its theory assumes
v(n) = 1; every method of chapters 5 and 9 pays the measured v(n) instead.

Validated first: the cached forward over n tokens gives the logits of a forward over the whole
sequence. Then, in the order printed:

1. a roofline for this machine, measured here under minillm's BLAS thread policy: the single-thread
   streaming bandwidth from a large NumPy copy (read + write bytes per second) and a large sum (bytes
   read per second), the faster of the two as the roof, and the GEMM peak from a float32 matrix
   product, each the best of many short runs. No forward over n tokens can beat
   max(bytes read / bandwidth, FLOPs / peak);
2. v(n) for n = 1..32 on top of a cache already holding ``--context`` tokens (default 100), for both
   weight-product paths (``backend.weight_product``): "blas" (the streaming path off) and "stream"
   (on: the streaming kernel wherever the library measured it faster). Every round times each
   (path, n) once (the order reversed every other round), so all times of a round ran under the same
   machine load; each path's v(n) = median over rounds of its t(n) / its own t(1) (``measure.
   paired_ratio``, the definition of ``measure.verify_cost``), and "stream/blas" compares the paths'
   times directly. Beside it the roofline in steps of t_best(1), the faster single-token step of
   the two, and the "floor": the v(n) left if only the roofline's work grew with n. ``--load N``
   repeats it beside N busy processes;
3. where the time goes (the character GPT): each part of the forward swapped for a free stand-in at
   several n (``bench kv-cache``'s ablation), so the growth from n = 1 is attributed to the parts;
4. the weight matrices of one block alone, as the forward multiplies them (``weight_product``), on
   both paths: n = 1 is a matrix-vector product (BLAS gemv, which streams W once); n > 1 a
   matrix-matrix product (gemm, which first copies W into its own blocked layout, "packing", then
   multiplies), or the streaming kernel (which never packs), beside their roofline.

The model's matrices are kept as ``--weights`` says. Sections 3 and 4 time the float32 products, so they run
only where the matrices are float32 arrays (``--weights fp32``); where they are kept for the kernels (``q``),
every product is the weight's own on both paths, and sections 1 and 2 give v(n) of those kernels.
"""

from __future__ import annotations

import argparse

import numpy as np

from ...backend import fast_products, product_choices, runtime_summary, set_fast_products, weight_product, xp
from ...data import load_corpus
from ...kv_cache import KVCache, kv_cache_bytes
from ...measure import STAND_INS, decode_step_parts, paired_ratio, timed
from ...model import GPT
from ...notebook import format_table
from ...quantize import kept_in_blocks
from ...registry import load_model
from ..options import add_weights_option, int_in, positive_int, positive_int_list
from .common import (
    BenchmarkError,
    add_json_arg,
    add_output_args,
    figure_dir,
    parse_args,
    progress,
    save_figure,
    write_json,
)
from .threads import MAX_LOAD, background_load, stopped_by_sigterm

NS = "1,2,3,4,6,8,12,16,24,32"
PATHS = ("blas", "stream")  # backend.weight_product with the streaming path off, and on (measured)
PARTS_NS = "1,4,8,16"
EMBEDDING_TABLES = ("wte.weight", "wpe.weight", "embed_tokens.weight")  # read one row per token
COPY_BYTES = 64 * 2**20  # larger than common CPU caches: the copy runs at memory bandwidth
GEMM_SIZE = 512  # (512, 512) @ (512, 512): 0.27 GFLOP, large enough for BLAS to reach its peak
ROOF_REPEAT = 30  # best of 30: short runs, so some of them get the core to themselves on a busy machine
FLOAT32_BYTES = 4


# ---- the roofline: pure arithmetic ---------------------------------------------------------------


def matmul_weights(model) -> list:
    """The weight matrices a forward reads in full: every 2-D parameter but the embedding tables
    (looked up one row per token), plus the LM head (which may be the token embedding, tied); arrays, or
    weights kept for the CPU kernels (``--weights q``)."""
    tables = [a for name, a in model.params.items() if len(a.shape) == 2 and name not in EMBEDDING_TABLES]
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
    """{path: {n: [seconds per round]}} (n = 1 included), {n: roofline seconds}, {n: bound} -> one row per n.

    "<path> v" = the median over rounds of that path's t(n) / its own t(1) (every ratio from one
    round: ``paired_ratio``), "stream/blas" the median of the per-round ratios of the two paths'
    t(n). Per round, t_best(1) is the faster single-token step of the paths; "roof (steps)" =
    roofline(n) / t_best(1), and "floor (steps)" = 1 + (roof(n) - roof(1)) / t_best(1), the v(n) a
    forward would have if only its unavoidable work grew with n.
    """
    paths = list(times)
    best_one = np.min([times[path][1] for path in paths], axis=0)  # (rounds,): t_best(1) of each round
    step = float(np.median(best_one))
    rows = []
    for n in sorted(times[paths[0]]):
        row = {"n": n}
        for path in paths:
            row[f"{path} ms"] = 1e3 * float(np.median(times[path][n]))
            row[f"{path} v"] = paired_ratio(times[path][n], times[path][1])
        if {"blas", "stream"} <= set(paths):
            ratios = np.divide(times["stream"][n], times["blas"][n])  # paired by round
            row["stream/blas"] = float(np.median(ratios))
            row["pairs"] = f"{ratios.min():.2f}-{ratios.max():.2f}"
        row |= {"roofline ms": 1e3 * roofline[n], "bound": bounds[n], "roof (steps)": roofline[n] / step,
                "floor (steps)": 1 + (roofline[n] - roofline[1]) / step}
        rows.append(row)
    return rows


def matmul_rows(times: dict, weight_elements: int, bandwidth: float, peak: float) -> list[dict]:
    """{path: {n: [seconds per round]}} of the products x (n, in) @ W over ``weight_elements`` float32
    weights -> rows: per path the best round in microseconds and GFLOP/s reached, beside the roofline;
    "x n=1" is each n's best time over the best single-row product of either path.

    The best round, not the median: these products take 0.1-1 ms, and on a busy machine a timeslice
    lost to another process costs several ms, so the median would measure the scheduler."""
    paths = list(times)
    one = min(min(times[path][1]) for path in paths)
    rows = []
    for n in sorted(times[paths[0]]):
        flops = 2 * n * weight_elements
        roof = roofline_seconds(FLOAT32_BYTES * weight_elements, flops, bandwidth, peak)
        row = {"n": n}
        for path in paths:
            t = min(times[path][n])
            row |= {f"{path} us": 1e6 * t, f"{path} x n=1": t / one, f"{path} GFLOP/s": flops / t / 1e9}
        row |= {"roofline us": 1e6 * roof}
        rows.append(row)
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


def read_bandwidth(nbytes: int = COPY_BYTES, repeat: int = ROOF_REPEAT) -> float:
    """Bytes read per second by the best of ``repeat`` sums of an ``nbytes`` float32 array (a forward
    only reads its weights; a copy also writes)."""
    src = xp.ones(nbytes // FLOAT32_BYTES, dtype=xp.float32)
    src.sum()  # warm-up
    best = min(timed(lambda: src.sum())[0] for _ in range(repeat))
    return nbytes / best


def gemm_peak(size: int = GEMM_SIZE, repeat: int = ROOF_REPEAT) -> float:
    """FLOP/s of the best of ``repeat`` float32 products of two (size, size) matrices (2 size^3 FLOPs)."""
    rng = np.random.default_rng(0)
    a, b = (xp.asarray(rng.standard_normal((size, size), dtype=np.float32)) for _ in range(2))
    a @ b  # warm-up
    best = min(timed(lambda: a @ b)[0] for _ in range(repeat))
    return 2 * size**3 / best


def block_weights(model) -> list:
    """The weight matrices of block 0 as the forward hands them to ``weight_product`` (w (out, in)):
    GPT-2's [in, out] weights as transposed views, Llama's stacked q/k/v and gate/up, o and down."""
    if isinstance(model, GPT):
        return [model.params[f"h.0.{name}.weight"].T for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                   "mlp.c_proj")]
    p = model.params
    return [model.stacked["layers.0.qkv"], p["layers.0.self_attn.o_proj.weight"], model.stacked["layers.0.gate_up"],
            p["layers.0.mlp.down_proj.weight"]]


def block_matmul_seconds(model, ns: list[int], rounds: int, steps: int) -> tuple[dict, int]:
    """x (n, in) @ W.T through ``weight_product`` for every weight matrix W of block 0, on each path ->
    ({path: {n: [seconds, one per round]}}, the number of weights in those matrices)."""
    weights = block_weights(model)
    rng = np.random.default_rng(0)
    xs = {n: [xp.asarray(rng.standard_normal((n, w.shape[1]), dtype=np.float32)) for w in weights] for n in ns}

    def run(key):
        path, n = key
        set_fast_products(path == "stream")
        for _ in range(steps):
            for x, w in zip(xs[n], weights):
                weight_product(x, w)

    keys, before = [(path, n) for n in ns for path in PATHS], fast_products()
    try:
        flat = alternating_rounds(run, keys, rounds, steps, "block matmuls")
    finally:
        set_fast_products(before)
    return by_path(flat), sum(int(w.size) for w in weights)


def by_path(flat: dict) -> dict:
    """{(path, n): values} -> {path: {n: values}}."""
    out = {}
    for (path, n), values in flat.items():
        out.setdefault(path, {})[n] = values
    return out


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


def forward_seconds(model, prefix: list[int], ns: list[int], rounds: int, steps: int, paths=PATHS) -> dict:
    """{path: {n: [seconds of one cached forward over n new tokens, one per round]}} after ``prefix``
    is cached, for each weight-product path in ``paths``: "blas", "stream" (``PATHS``), or "default"
    (the streaming switch as the process has it, ``MINILLM_FAST_PRODUCTS``).

    Each timing runs ``steps`` forwards (rolling the cache back to the prefix before each); every
    round times every (path, n), in reverse order every other round. The warm-up's first "stream"
    forward is where the library measures its choices (``backend.product_choices``).
    """
    context, vocab = len(prefix), model.config.vocab_size
    cache = KVCache(model.config, max_len=context + max(ns))
    model.forward(xp.asarray([prefix]), cache)
    new = {n: xp.asarray([[(7 * t + 1) % vocab for t in range(n)]]) for n in ns}

    def run(key):
        path, n = key
        if path in PATHS:  # else ("default"): the switch as the process has it
            set_fast_products(path == "stream")
        for _ in range(steps):
            cache.truncate(context)
            model.forward(new[n], cache)

    keys, before = [(path, n) for n in ns for path in paths], fast_products()
    try:
        return by_path(alternating_rounds(run, keys, rounds, steps, "rounds (every n, both paths)"))
    finally:
        set_fast_products(before)  # as the process had it (MINILLM_FAST_PRODUCTS)


def alternating_rounds(run, ns: list, rounds: int, steps: int, label: str) -> dict:
    """{n: [seconds per step, one per round]}: ``run(n)`` (``steps`` steps) once per n as a warm-up,
    then every round times every n, in reverse order every other round (so a load spell hits all n).
    n may be any key (here an int, or a (path, n) pair)."""
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
    for path, style in zip(PATHS, ("o-", "^-")):
        if f"{path} v" in rows[0]:
            ax.plot(n, [r[f"{path} v"] for r in rows], style, label=f"measured, {path}: one forward over n new tokens")
    ax.plot(n, [r["floor (steps)"] for r in rows], "s--", label="floor: only the roofline work grows")
    ax.axhline(1.0, color="gray", lw=0.8, label="the theory's assumption v = 1")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens n in one forward (a verification of K = n - 1 drafts)")
    ax.set_ylabel("cost in single-token decode steps (each path's own)")
    ax.set_title("The cost of verifying n tokens")
    ax.legend(fontsize=8)
    return save_figure(fig, "verify_cost", out_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench verify-cost", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="target", help="a registry model: target (default), draft, smollm2-135m, ...")
    add_weights_option(p)
    p.add_argument("--context", type=positive_int, default=100, help="tokens already cached (default 100)")
    p.add_argument("--ns", type=positive_int_list, default=NS, help=f"new tokens per forward (default {NS})")
    p.add_argument("--rounds", type=positive_int, default=15, help="timing rounds, each n once per round (default 15)")
    p.add_argument("--steps", type=positive_int, default=5, help="forwards per timing (default 5)")
    p.add_argument("--load", type=int_in(0, MAX_LOAD), default=0,
                   help="also run section 2 beside this many busy processes (default 0: idle only)")
    add_json_arg(p, "also write the tables and the roofline as JSON")
    p.add_argument("--parts-ns", type=positive_int_list, default=PARTS_NS,
                   help=f"n at which the parts are ablated (default {PARTS_NS}; GPT models only)")
    p.add_argument("--parts-rounds", type=positive_int, default=20, help="rounds of the ablation (default 20)")
    p.add_argument("--no-parts", action="store_true", help="skip the ablation")
    p.add_argument("--no-plot", action="store_true", help="do not write the figure")
    p.add_argument("--quick", action="store_true", help="n in 1,2,4,8,16; 5 rounds; ablation at 1,8 with 6 rounds")
    add_output_args(p)
    args = parse_args(p, argv)
    if args.quick:
        args.ns, args.rounds, args.parts_ns, args.parts_rounds = [1, 2, 4, 8, 16], 5, [1, 8], 6
    ns = sorted(set(args.ns) | {1})  # v(n) is in units of n = 1
    model, tok = load_model(args.model, weights=args.weights)
    cfg = model.config
    largest = max(ns + ([] if args.no_parts else args.parts_ns))
    if args.context + largest > cfg.block_size:
        p.error(f"--context {args.context} + n up to {largest} exceeds block_size={cfg.block_size}")
    with stopped_by_sigterm():
        return run(args, model, tok, ns)


def run(args, model, tok, ns) -> int:
    cfg = model.config
    prefix = prefix_ids(tok, args.context)
    weights = matmul_weights(model)
    w_bytes, w_elems = sum(int(a.nbytes) for a in weights), sum(int(np.prod(a.shape)) for a in weights)
    kept = any(kept_in_blocks(a) for a in weights)  # --weights q: the products are the kernels', on both paths
    print(f"model {args.model}: {model.num_params():,} params, {cfg.n_layer} layers, width {cfg.n_embd}; "
          f"{w_elems:,} weights in matrices ({w_bytes / 2**20:.1f} MiB, "
          f"{'kept for the CPU kernels' if kept else 'float32'}); {args.context} tokens cached\n")
    if kept:
        print("--weights q: every product is the weight's own (w.product: the CPU kernels, on a device the blocks "
              "dequantized), whichever float32 path is switched on, so the two paths time the same code; sections 3 "
              "and 4 time the float32 products: --weights fp32\n")

    check_cached_forward(model, prefix, [(3 * t + 2) % cfg.vocab_size for t in range(max(ns))])
    print("validated: a cached forward over n tokens == the last n rows of a full forward\n")

    copy, read, peak = copy_bandwidth(), read_bandwidth(), gemm_peak()
    bandwidth = max(copy, read)  # the fastest stream measured: no forward reads its weights faster
    cached_bandwidth = copy_bandwidth(w_bytes)
    print(f"1. the roofline of this machine (best of {ROOF_REPEAT} each, one thread)")
    print(f"   streaming bandwidth {bandwidth / 1e9:.1f} GB/s: a {COPY_BYTES // 2**20} MiB copy {copy / 1e9:.1f} GB/s "
          f"(read + write), a sum {read / 1e9:.1f} GB/s (read); "
          f"a copy the size of the weights: {cached_bandwidth / 1e9:.1f} GB/s")
    print(f"   GEMM peak {peak / 1e9:.1f} GFLOP/s (float32 {GEMM_SIZE}^3 product)")
    step_bytes = forward_bytes(w_bytes, cfg, 1, args.context)
    per_token = forward_flops(w_elems, cfg, 1, args.context)
    print(f"   per forward: {step_bytes / 2**20:.1f} MiB read -> {1e3 * step_bytes / bandwidth:.2f} ms; "
          f"per token {per_token / 1e6:.1f} MFLOP -> {1e3 * per_token / peak:.3f} ms; "
          f"memory-bound up to n ~ {step_bytes / bandwidth / (per_token / peak):.1f}\n")

    sizes = {n: (forward_bytes(w_bytes, cfg, n, args.context), forward_flops(w_elems, cfg, n, args.context))
             for n in ns}
    roofline = {n: roofline_seconds(b, f, bandwidth, peak) for n, (b, f) in sizes.items()}
    bounds = {n: bound(b, f, bandwidth, peak) for n, (b, f) in sizes.items()}
    report = {"model": args.model, "runtime": runtime_summary(), "context": args.context,
              "copy bandwidth": copy, "read bandwidth": read, "gemm peak": peak, "weight bytes": w_bytes}
    loads = [0] + ([args.load] if args.load else [])
    for load in loads:
        where = "no added load" if load == 0 else f"beside {load} busy processes"
        print(f"2. one cached forward over n new tokens, {where} ({args.rounds} rounds x {args.steps} forwards; "
              "v = median of the per-round ratios t(n) / t(1), each path over its own step)")
        with background_load(load):
            times = forward_seconds(model, prefix, ns, args.rounds, args.steps)
        rows = cost_rows(times, roofline, bounds)
        print(format_table(rows))
        report[f"forward, load {load}"] = rows
        if load == 0 and not args.no_plot:
            print("  ", plot(rows, figure_dir(args)))
        print()
    choices = product_choices()
    print(f"   the library's measured choices (first product of each bucket): {describe_choices(choices)}")
    report["choices"] = [{"out": k[0], "in": k[1], "layout": k[2], "rows bucket": k[3], "path": v}
                         for k, v in sorted(choices.items())]

    if not kept:
        float32_sections(args, model, ns, peak, report)
    if args.json:
        write_json(args.json, report)
    return 0


def float32_sections(args, model, ns, peak, report) -> None:
    """Sections 3 and 4, which time the float32 products (their stand-ins and their roofline assume arrays)."""
    if not args.no_parts and isinstance(model, GPT):
        print(f"\n3. where the time goes: each part swapped for a free stand-in ({args.parts_rounds} rounds "
              "in alternation; microseconds per forward)")
        parts = {n: decode_step_parts(model, args.context, steps=args.steps, rounds=args.parts_rounds, tokens=n)
                 for n in progress(args.parts_ns, "parts at n")}
        print(format_table(parts_rows(parts)))

    mm_times, block_elems = block_matmul_seconds(model, ns, 3 * args.rounds, steps=1)
    block_bandwidth = copy_bandwidth(FLOAT32_BYTES * block_elems)
    print(f"\n4. the weight matrices of block 0 alone, on both paths (best of {3 * args.rounds} rounds; the "
          f"roofline with the bandwidth of a copy that size, {block_bandwidth / 1e9:.1f} GB/s)")
    mm_rows = matmul_rows(mm_times, block_elems, block_bandwidth, peak)
    print(format_table(mm_rows))
    report["block 0 products"] = mm_rows


def describe_choices(choices: dict) -> str:
    """{(out, in, layout, rows bucket): path} -> per bucket, how many weight shapes chose the stream.

    Example: {(8, 4, "rows", 1): "stream", (4, 8, "rows", 1): "blas"} -> 'rows 1: 1/2 stream'."""
    buckets = sorted({key[3] for key in choices})
    parts = []
    for b in buckets:
        picks = [path for key, path in choices.items() if key[3] == b]
        parts.append(f"rows {b}: {picks.count('stream')}/{len(picks)} stream")
    return ", ".join(parts) if parts else "none (the streaming path is off or unavailable)"
