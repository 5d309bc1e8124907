"""``python -m minillm bench kv-cache``: what the KV cache buys, measured on the shipped target.

1. naive (recompute everything) vs cached generation: total time and time per step, 32-token
   prompt, 32..224 new tokens (224 fills the 256-token context exactly);
2. time of each step vs position: growing for naive, flat for cached;
3. time to first token (the prefill) vs prompt length;
4. preallocated vs growing (concatenating) cache: time and bytes allocated;
5. prompt caching: TTFT with and without a PrefixCache for a long shared system prompt;
6. KV memory for real models at long contexts (the formula, no timing);
7. where a decode step's time goes: each part's cost inside the real loop, by ablation.

Every timed configuration is validated first: cached tokens must equal naive tokens (greedy).
"""

from __future__ import annotations

import argparse

import numpy as np

from ...checkpoint import load_model
from ...data import load_corpus
from ...generate import generate, generate_naive
from ...kv_cache import GrowingKVCache, KVCache, PrefixCache, kv_cache_bytes
from ...measure import decode_step_parts, time_fn, time_pairs
from ...notebook import format_table
from ..options import positive_int
from .common import BenchmarkError, add_output_args, figure_dir, parse_args, progress, save_figure

# (name, layers, KV heads, head dim) from the published configs
KV_MODELS = [
    ("GPT-2 small (124M)", 12, 12, 64),
    ("GPT-2 medium (355M)", 24, 16, 64),
    ("GPT-2 large (774M)", 36, 20, 64),
    ("GPT-2 XL (1.5B)", 48, 25, 64),
    ("LLaMA-3-8B (GQA)", 32, 8, 128),
    ("LLaMA-3-70B (GQA)", 80, 8, 128),
]
KV_LENGTHS = [("4K", 4096), ("32K", 32768), ("128K", 131072), ("1M", 1_000_000)]
GIB = 2**30


def kv_memory_rows(shipped=()) -> list[dict]:
    """KV cache size in FP16 (GiB) for each model at 4K..1M tokens, batch 1."""
    models = [(f"minillm {name}", c.n_layer, c.n_head, c.head_size) for name, c in shipped] + KV_MODELS
    rows = []
    for name, layers, heads, head_dim in models:
        row = {"model": name, "KiB/token": kv_cache_bytes(layers, heads, head_dim, 1) / 1024}
        for label, n in KV_LENGTHS:
            row[label] = kv_cache_bytes(layers, heads, head_dim, n) / GIB
        rows.append(row)
    return rows


def prompt_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    """n tokens of real text from the corpus (the validation part, so the model has not seen it)."""
    text = load_corpus()
    start = int(len(text) * 0.95) + offset
    return tokenizer.encode(text[start : start + n])


def naive_vs_cached(model, prompt, lengths, repeat) -> tuple[list[dict], dict]:
    """Time naive and cached generation in alternating pairs. The speed-up is the median of the
    per-pair ratios; "pairs" gives their range, the run-to-run spread on this machine."""
    rows, traces = [], {}
    for n in progress(lengths, "naive vs cached"):
        naive = generate_naive(model, prompt, n, temperature=0)
        cached = generate(model, prompt, n, temperature=0)
        if naive.tokens != cached.tokens:
            raise BenchmarkError(f"cached generation differs from naive at {n} new tokens")
        naive_s, cached_s, _ = time_pairs(lambda n=n: generate_naive(model, prompt, n, temperature=0),
                                          lambda n=n: generate(model, prompt, n, temperature=0), repeat)
        t_naive, t_cached = float(np.median(naive_s)), float(np.median(cached_s))
        ratios = np.divide(naive_s, cached_s)
        rows.append({
            "new tokens": n, "naive s": t_naive, "cached s": t_cached, "speed-up": float(np.median(ratios)),
            "pairs": f"{ratios.min():.1f}-{ratios.max():.1f}x",
            "naive ms/token": 1e3 * t_naive / n, "cached ms/token": 1e3 * t_cached / n,
        })
        traces[n] = (naive.stats.step_times_s, cached.stats.step_times_s)
    return rows, traces


def ttft_rows(model, tokenizer, lengths, repeat) -> list[dict]:
    rows = []
    for n in progress(lengths, "TTFT"):
        prompt = prompt_ids(tokenizer, n)
        ttft = time_fn(lambda p=prompt: generate(model, p, 1, temperature=0), warmup=1, repeat=repeat)
        tpot = generate(model, prompt, 9, temperature=0).stats.tpot_s
        rows.append({"prompt tokens": n, "TTFT ms": 1e3 * ttft, "TPOT ms": 1e3 * tpot, "TTFT/TPOT": ttft / tpot})
    return rows


def prealloc_vs_growing(model, prompt, n, repeat) -> list[dict]:
    """The same generation with a growing and a preallocated cache, timed in alternating pairs."""
    caches = {"growing (concatenate)": GrowingKVCache(model.config), "preallocated KVCache": KVCache(model.config)}
    runs = [lambda c=c: generate(model, prompt, n, temperature=0, cache=c) for c in caches.values()]
    times = dict(zip(caches, time_pairs(*runs, repeat)[:2]))
    rows = []
    for name, cache in caches.items():
        allocated = cache.bytes_allocated if isinstance(cache, GrowingKVCache) else cache.nbytes
        t = float(np.median(times[name]))
        rows.append({"cache": name, "total s": t, "ms/token": 1e3 * t / n, "MB allocated": allocated / 1e6,
                     "MB held at end": cache.nbytes / 1e6})
    ratios = np.divide(*times.values())  # growing / preallocated, pair by pair
    rows[0]["time vs preallocated"] = f"{np.median(ratios):.3f}x (pairs {ratios.min():.2f}-{ratios.max():.2f})"
    rows[1]["time vs preallocated"] = "1x"
    return rows


def prefix_cache_rows(model, tokenizer, repeat) -> list[dict]:
    """A 200-token shared system prompt + 8 different 24-token questions."""
    system = prompt_ids(tokenizer, 200, offset=5000)
    questions = [prompt_ids(tokenizer, 24, offset=9000 + 100 * i) for i in range(8)]
    rows = []
    for label, use_cache in (("no prefix cache", False), ("PrefixCache", True)):
        pc = PrefixCache() if use_cache else None
        if pc is not None:
            generate(model, system + questions[0], 1, temperature=0, prefix_cache=pc)  # warm the cache
        ttfts, outputs = [], []
        for q in questions[1:]:
            ttft = time_fn(lambda q=q, pc=pc: generate(model, system + q, 1, temperature=0, prefix_cache=pc),
                           warmup=0, repeat=repeat)
            ttfts.append(ttft)
            outputs.append(generate(model, system + q, 16, temperature=0, prefix_cache=pc).tokens)
        rows.append({"prompt": label, "prompt tokens": len(system) + 24,
                     "tokens prefilled": 24 if use_cache else len(system) + 24,
                     "mean TTFT ms": 1e3 * float(np.mean(ttfts)), "_outputs": outputs})
    if rows[0]["_outputs"] != rows[1]["_outputs"]:
        raise BenchmarkError("prefix caching changed the generated tokens")
    for r in rows:
        del r["_outputs"]
    rows[1]["TTFT speed-up"] = rows[0]["mean TTFT ms"] / rows[1]["mean TTFT ms"]
    return rows


def plot_steps(traces, n, out_dir):
    import matplotlib.pyplot as plt

    naive, cached = traces[n]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(np.arange(1, n + 1), 1e3 * np.array(naive), label="naive: recompute the whole context")
    ax.plot(np.arange(1, n + 1), 1e3 * np.array(cached), label="KV cache: one new token per step")
    ax.set_xlabel("output token #")
    ax.set_ylabel("ms for this token")
    ax.set_yscale("log")
    ax.set_title("Time per step (step 1 includes the 32-token prefill)")
    ax.legend()
    return save_figure(fig, "kv_cache_step_times", out_dir)


def plot_ttft(rows, out_dir):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = [r["prompt tokens"] for r in rows]
    ax.plot(x, [r["TTFT ms"] for r in rows], "o-", label="TTFT (prefill the prompt)")
    ax.plot(x, [r["TPOT ms"] for r in rows], "s-", label="TPOT (one decode step)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    ax.set_title("The first token pays for the prompt")
    ax.legend()
    return save_figure(fig, "kv_cache_ttft", out_dir)


def memory_figure():
    """KV cache size (FP16, batch 1) against context length for KV_MODELS, one line style each (GPT-2 XL
    and LLaMA-3-70B hold 300 and 320 KiB per token: their lines nearly coincide), and the 2-4 GB band."""
    import matplotlib.pyplot as plt

    n = np.logspace(3, 6, 50)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    by_size = sorted(KV_MODELS, key=lambda m: -kv_cache_bytes(*m[1:], 1))  # legend in the lines' order, top down
    styles = [("black", "-", "x"), ("tab:red", "--", "D"), ("tab:green", "-.", "^"), ("tab:purple", ":", "v"),
              ("tab:orange", "--", "s"), ("tab:blue", "-", "o")]
    for i, ((name, layers, heads, head_dim), (color, ls, marker)) in enumerate(zip(by_size, styles)):
        kib = kv_cache_bytes(layers, heads, head_dim, 1) / 1024
        ax.loglog(n, kv_cache_bytes(layers, heads, head_dim, n) / GIB, color=color, linestyle=ls, marker=marker,
                  markevery=(i % 2 * 3, 7), markersize=5, lw=1.6, label=f"{name}: {kib:.0f} KiB/token")
    ax.axhspan(2, 4, color="grey", alpha=0.2, label='"about 2-4 GB"')
    ax.set_xlabel("tokens in context")
    ax.set_ylabel("KV cache, GiB (FP16, batch 1)")
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_memory(out_dir):
    return save_figure(memory_figure(), "kv_cache_memory", out_dir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm bench kv-cache", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="target")
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer lengths, one repeat")
    add_output_args(parser)
    args = parse_args(parser, argv)
    out_dir = figure_dir(args)
    repeat = 1 if args.quick else args.repeat
    model, tok = load_model(args.model)
    T = model.config.block_size
    prompt = prompt_ids(tok, 32)
    lengths = [32, T - 32] if args.quick else [32, 64, 128, T - 32]

    print(f"model {args.model}: {model.num_params():,} params, {model.config.n_layer} layers, context {T}\n")
    print("1. naive (recompute) vs KV-cached generation, 32-token prompt, greedy (outputs checked equal);")
    print(f"   {repeat} alternating pairs each: medians, speed-up = median of the pair ratios, pairs = their range")
    rows, traces = naive_vs_cached(model, prompt, lengths, repeat)
    print(format_table(rows), "\n")
    print("2. time per step vs position:", plot_steps(traces, lengths[-1], out_dir))
    naive, cached = (1e3 * np.array(t) for t in traces[lengths[-1]])
    print(f"   ms per step, tokens 2-9 -> the last 8: naive {naive[1:9].mean():.2f} -> {naive[-8:].mean():.2f}, "
          f"cached {cached[1:9].mean():.2f} -> {cached[-8:].mean():.2f}\n")
    print("3. time to first token vs prompt length")
    ttft = ttft_rows(model, tok, [16, 64, 128, 255] if args.quick else [16, 32, 64, 128, 192, 255], repeat)
    print(format_table(ttft))
    print("  ", plot_ttft(ttft, out_dir), "\n")
    print(f"4. preallocated vs growing cache ({lengths[-1]} new tokens)")
    print(format_table(prealloc_vs_growing(model, prompt, lengths[-1], repeat)), "\n")
    print("5. prompt caching: 200-token shared system prompt + 24-token questions (outputs checked equal)")
    print(format_table(prefix_cache_rows(model, tok, repeat)), "\n")
    print("6. KV cache size in FP16 (GiB), batch 1 -- kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len)")
    target = [("target", model.config)]
    print(format_table(kv_memory_rows(target)))
    print("  ", plot_memory(out_dir), "\n")
    context = (32 + T) // 2  # the mean context of section 1's longest run
    print(f"7. where a decode step's time goes ({context} tokens cached): each part swapped for a free stand-in")
    steps, rounds = (10, 4) if args.quick else (30, 40)
    print(format_table(decode_step_parts(model, context, steps, rounds)))
    return 0
