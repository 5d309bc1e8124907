"""Benchmark: how much reserved KV memory holds real tokens, contiguous vs paged; prefix-caching TTFT.

    python -m minillm bench paged                   # both parts, plots paged_*.png (--out DIR)
    python -m minillm bench paged --no-ttft         # memory part only (no model, a second or two)

Part 1, memory (no model). A seeded workload of requests with random prompt and output lengths
(exponential, i.e. long-tailed like chat traffic; clipped so prompt + output <= max_len). While a
request runs, its cache holds t = P, P+1, ..., P+O-1 tokens (the prompt, then one more per decode
step). Policies, as in the paper's Figure 2 (Kwon et al. 2023):

    contiguous, max_len   reserve max_len slots per request (what ``KVCache(config)`` does; Orca "Max")
    contiguous, pow2      reserve the next power of two >= P + O                         (Orca "Pow2")
    contiguous, oracle    reserve exactly P + O, as if the output length were known      (Orca "Oracle")
    paged, page size b    hold ceil(t / b) blocks of b slots (``PagedKVCache``)                 (vLLM)

"KV usage" = slots holding a token / slots reserved, summed over every step of every request (the
share of memory a snapshot of the server would find in use). "Fit" = how many requests of the
workload, admitted in order and each at its peak length, fit at once in a fixed budget of slots;
for paged caches this is counted by a real ``PagedKVCache`` raising ``OutOfBlocksError``. Before any
number is printed, a real ``PagedKVCache`` replays the first requests step by step and its allocator
must agree with the formula (validate first).

Part 2, prefix caching (the shipped target model, or random weights of the same shape). One system
prompt shared by several questions; TTFT of each question with a paged cache, without and with
prefix caching (the system prompt's blocks were cached by an earlier request), and the contiguous
KVCache as a reference. The generated tokens must be identical in all three.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from ...config import GPTConfig
from ...kv_cache import KVCache
from ...notebook import format_table
from ...paged_kv import OutOfBlocksError, PagedKVCache, num_blocks_for
from ...prefix_blocks import PrefixBlockCache
from ..options import positive_float, positive_int, positive_int_list, seed_int
from .common import BenchmarkError, add_output_args, figure_dir, parse_args, progress, save_figure

PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tokens per KV block
PAPER_CONTIGUOUS = {"Max": 20.4, "Pow2": 26.8, "Oracle": 38.2}  # % of KV memory holding tokens, Fig. 2
PAPER_VLLM = 96.3  # %, 16 tokens per block, Fig. 2
SYSTEM_PROMPT = (
    "You are a player at the Globe. Answer in the voice of the play: in verse where you can, "
    "with the names and manners of the court of Verona, and never break the scene. Speak briefly.\n\n"
)
QUESTIONS = (
    "FIRST CITIZEN:\nWhat news from the court?\n\nROMEO:\n",
    "NURSE:\nWhere is my lady?\n\nJULIET:\n",
    "KING:\nWho comes here?\n\nGLOUCESTER:\n",
    "QUEEN:\nIs the war done?\n\nHAMLET:\n",
    "MERCUTIO:\nWhy so sad?\n\nROMEO:\n",
)
WARMUP_QUESTION = "CLOWN:\nGood morrow, sir!\n\nDUKE:\n"


# --- part 1: memory --------------------------------------------------------------------------------


def make_workload(n: int, max_len: int, mean_prompt: float, mean_output: float, seed: int):
    """n requests -> (prompt lengths, output lengths), int arrays; 1 <= P, 1 <= O, P + O <= max_len."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.ceil(rng.exponential(mean_prompt, n)), 1, max_len - 1).astype(int)
    output = np.ceil(rng.exponential(mean_output, n)).astype(int)
    output = np.clip(output, 1, max_len - prompt)
    return prompt, output


def held_tokens(P: int, O: int) -> np.ndarray:
    """Tokens a request's cache holds at each step of its life: P, P+1, ..., P+O-1."""
    return np.arange(P, P + O)


def contiguous_reservation(policy: str, P: int, O: int, max_len: int) -> int:
    if policy == "max_len":
        return max_len
    if policy == "pow2":
        return min(max_len, 1 << int(P + O - 1).bit_length())
    if policy == "oracle":
        return P + O
    raise ValueError(f"unknown contiguous policy {policy!r}")


def slot_steps(prompts, outputs, reserved_at) -> tuple[int, int, int]:
    """Sums over every step of every request -> (tokens held, slots reserved, steps).

    reserved_at(P, O, t) -> the slots a request reserves when it holds t tokens (t an array of steps).
    """
    held = reserved = steps = 0
    for P, O in zip(prompts, outputs):
        t = held_tokens(P, O)
        held += int(t.sum())
        reserved += int(np.sum(np.broadcast_to(reserved_at(P, O, t), t.shape)))
        steps += len(t)
    return held, reserved, steps


def paged_fit(prompts, outputs, page_size: int, budget: int, config) -> int:
    """Requests (in order, each at its peak length P+O) a real PagedKVCache of `budget` slots holds."""
    cache = PagedKVCache(config, num_blocks=budget // page_size, page_size=page_size)
    for count, (P, O) in enumerate(zip(prompts, outputs)):
        seq = cache.add_sequence()
        try:
            cache.append(seq, *[np.zeros((1, 1, P + O, 1), np.float32)] * 2)
        except OutOfBlocksError:
            return count
    return len(prompts)


def validate_paged_formula(prompts, outputs, page_sizes, config, n: int = 20) -> None:
    """Replay the first n requests step by step in a real PagedKVCache; its allocator must hold
    ceil(t / page_size) blocks at every step and get every block back at the end."""
    one = np.zeros((1, 1, 1, 1), np.float32)
    for bs in page_sizes:
        cache = PagedKVCache(config, num_blocks=num_blocks_for(config.block_size, bs), page_size=bs)
        for P, O in list(zip(prompts, outputs))[:n]:
            seq = cache.add_sequence()
            cache.append(seq, *[np.zeros((1, 1, P, 1), np.float32)] * 2)
            for step, t in enumerate(held_tokens(P, O)):
                if step:
                    cache.append(seq, one, one)
                held = cache.num_blocks - cache.allocator.num_free
                if held != num_blocks_for(int(t), bs):
                    raise BenchmarkError(f"page size {bs}: {held} blocks for {t} tokens")
            cache.free(seq)
            if cache.allocator.num_free != cache.num_blocks:
                raise BenchmarkError(f"page size {bs}: blocks leaked")


def memory_rows(prompts, outputs, max_len: int, budget: int, page_sizes):
    """One row per policy: KV usage, waste, requests that fit at peak and in a steady state."""
    config = GPTConfig(vocab_size=1, block_size=max_len, n_layer=1, n_head=1, n_embd=1)  # 1 number per slot
    rows = []

    def row(name, page_size, reserved_at, peak_fit):
        held, reserved, steps = slot_steps(prompts, outputs, reserved_at)
        rows.append({"KV cache": name, "page size": page_size, "KV usage %": 100 * held / reserved,
                     "waste %": 100 * (1 - held / reserved), "fit (peak)": peak_fit,
                     "fit (steady)": budget / (reserved / steps)})

    for policy in ("max_len", "pow2", "oracle"):
        res = [contiguous_reservation(policy, P, O, max_len) for P, O in zip(prompts, outputs)]
        peak_fit = int(np.searchsorted(np.cumsum(res), budget, side="right"))
        row(f"contiguous, {policy}", "-", lambda P, O, t, p=policy: contiguous_reservation(p, P, O, max_len),
            peak_fit)
    for bs in page_sizes:
        paged_at = lambda P, O, t, b=bs: num_blocks_for(t, b) * b  # noqa: E731
        row("paged", bs, paged_at, paged_fit(prompts, outputs, bs, budget, config))
    base = rows[0]["fit (steady)"]
    for r in rows:
        r["steady vs max_len"] = f"{r['fit (steady)'] / base:.2f}x"
    return rows


def memory_figures(rows):
    """-> (usage figure, fit figure) for the rows of ``memory_rows``."""
    import matplotlib.pyplot as plt

    paged = [r for r in rows if r["KV cache"] == "paged"]
    contiguous = [r for r in rows if r["KV cache"] != "paged"]
    xs = [r["page size"] for r in paged]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["KV usage %"] for r in paged], "o-", color="C0", label="paged (ours)")
    for r, color in zip(contiguous, ("C3", "C1", "C2")):
        ax.axhline(r["KV usage %"], color=color, ls="--", label=f"{r['KV cache']} (ours)")
    ax.axhspan(min(PAPER_CONTIGUOUS.values()), max(PAPER_CONTIGUOUS.values()), color="0.85",
               label="paper: contiguous (Orca) 20.4-38.2%")
    ax.plot([16], [PAPER_VLLM], "k*", ms=12, label=f"paper: vLLM, page size 16 ({PAPER_VLLM}%)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(0, 105)
    ax.set_xlabel("page size (tokens per block)")
    ax.set_ylabel("reserved KV memory holding tokens (%)")
    ax.set_title("KV memory usage: contiguous reservation vs paged blocks")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    usage_fig = fig

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([str(x) for x in xs], [r["fit (steady)"] for r in paged], "o-", color="C0",
            label="paged, steady state")
    ax.bar([str(x) for x in xs], [r["fit (peak)"] for r in paged], color="C0", alpha=0.35,
           label="paged, all at peak length")
    for r, color in zip(contiguous, ("C3", "C1", "C2")):
        ax.axhline(r["fit (steady)"], color=color, ls="--", label=f"{r['KV cache']}, steady state")
    ax.set_xlabel("page size (tokens per block)")
    ax.set_ylabel("requests held at once")
    ax.set_title("Requests that fit in the same KV budget")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return usage_fig, fig


def plot_memory(rows, out_dir):
    usage_fig, fit_fig = memory_figures(rows)
    return [save_figure(usage_fig, "paged_memory_usage", out_dir),
            save_figure(fit_fig, "paged_requests_fit", out_dir)]


# --- part 2: prefix caching TTFT ---------------------------------------------------------------------


def load_target(name: str):
    """The model ``name`` names and its tokenizer, or random weights of the target's shape (--model
    random); a model that cannot be loaded is an error (CheckpointError), not random weights."""
    from ...checkpoint import load_model
    from ...model import GPT
    from ...tokenizer import CharTokenizer

    if name != "random":
        model, tok = load_model(name)
        return model, tok, name
    text = (Path(__file__).resolve().parent.parent / "data" / "shakespeare.txt").read_text()
    return GPT.init(GPTConfig(84, 256, 6, 4, 256), seed=0), CharTokenizer.from_text(text), "random"


def median_ttft(run, repeat: int):
    """Run `run()` -> GenerationResult `repeat` times -> (median TTFT s, last result)."""
    results = [run() for _ in range(repeat)]
    return statistics.median(r.stats.ttft_s for r in results), results[-1]


def ttft_rows(model, tok, new_tokens: int, repeat: int, page_size: int, n_questions: int):
    from ...generate import generate

    cfg = model.config
    n_blocks = 2 * num_blocks_for(cfg.block_size, page_size)
    system = tok.encode(SYSTEM_PROMPT)
    rows, tokens = [], {}
    for question in progress(QUESTIONS[:n_questions], "prefix-caching TTFT"):
        prompt = system + tok.encode(question)
        if len(prompt) + new_tokens > cfg.block_size:
            raise ValueError(f"prompt of {len(prompt)} + {new_tokens} new tokens exceeds the context")

        def contiguous(prompt=prompt):
            return generate(model, prompt, new_tokens, temperature=0, cache=KVCache(cfg))

        def paged(prompt=prompt):
            cache = PagedKVCache(cfg, n_blocks, page_size)
            return generate(model, prompt, new_tokens, temperature=0, cache=cache.sequence())

        def paged_prefix(prompt=prompt):
            cache = PagedKVCache(cfg, n_blocks, page_size)
            prefix = PrefixBlockCache(cache)
            warm = cache.sequence()  # an earlier request with the same system prompt, then done
            prefix.prefill(model, system + tok.encode(WARMUP_QUESTION), warm)
            warm.free()
            view = cache.sequence()
            return generate(model, prompt, new_tokens, temperature=0, cache=view, prefix_cache=prefix)

        generate(model, prompt, 2, temperature=0)  # warm-up (allocations, BLAS threads)
        t_contig, r_contig = median_ttft(contiguous, repeat)
        t_paged, r_paged = median_ttft(paged, repeat)
        t_prefix, r_prefix = median_ttft(paged_prefix, repeat)
        same = r_contig.tokens == r_paged.tokens == r_prefix.tokens
        tokens[question] = r_prefix.tokens
        rows.append({
            "question": question.split("\n")[0], "prompt tok": len(prompt),
            "reused tok": r_prefix.stats.reused_prefix_tokens,
            "contiguous ms": 1e3 * t_contig, "paged ms": 1e3 * t_paged,
            "paged+prefix ms": 1e3 * t_prefix, "speedup": f"{t_paged / t_prefix:.1f}x",
            "same tokens": "yes" if same else "NO",
        })
    return rows, tokens


def ttft_figure(rows, label):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["paged ms"] for r in rows], 0.4, color="C3", label="paged, no prefix caching")
    ax.bar(x + 0.2, [r["paged+prefix ms"] for r in rows], 0.4, color="C0", label="paged + prefix caching")
    labels = [f"{r['question'].rstrip(':')}\n{r['prompt tok']} tokens\n{r['reused tok']} reused"
              for r in rows]
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"TTFT with a shared system prompt ({label} model)")
    ax.legend(fontsize=8)
    return fig


def plot_ttft(rows, label, out_dir):
    return save_figure(ttft_figure(rows, label), "paged_prefix_ttft", out_dir)


# --- main -------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm bench paged", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=positive_int, default=200, help="requests in the workload")
    ap.add_argument("--seed", type=seed_int, default=0)
    ap.add_argument("--max-len", type=positive_int, default=256, help="context length (contiguous reservation)")
    ap.add_argument("--mean-prompt", type=positive_float, default=32.0, help="mean prompt length (tokens)")
    ap.add_argument("--mean-output", type=positive_float, default=64.0, help="mean output length (tokens)")
    ap.add_argument("--budget", type=positive_int, default=4096, help="KV budget in token slots (16 x 256)")
    ap.add_argument("--page-sizes", type=positive_int_list, default=list(PAGE_SIZES),
                    help="tokens per KV block, comma-separated")
    ap.add_argument("--no-ttft", action="store_true", help="skip part 2 (no model)")
    ap.add_argument("--model", default="target", help="'target' (shipped), a checkpoint path, or 'random'")
    ap.add_argument("--questions", type=positive_int, default=len(QUESTIONS))
    ap.add_argument("--new-tokens", type=positive_int, default=20)
    ap.add_argument("--repeat", type=positive_int, default=5, help="timed runs per measurement (median)")
    ap.add_argument("--ttft-page-size", type=positive_int, default=16, help="tokens per KV block in part 2")
    add_output_args(ap)
    ap.add_argument("--no-plots", action="store_true")
    args = parse_args(ap, argv)
    page_sizes = args.page_sizes
    if not args.no_ttft:
        model, tok, label = load_target(args.model)  # a model that cannot load: one line, before any table

    prompts, outputs = make_workload(args.requests, args.max_len, args.mean_prompt, args.mean_output,
                                     args.seed)
    one_slot = GPTConfig(vocab_size=1, block_size=args.max_len, n_layer=1, n_head=1, n_embd=1)
    validate_paged_formula(prompts, outputs, page_sizes, one_slot)
    total = prompts + outputs
    print(f"workload: {args.requests} requests (seed {args.seed}), prompt mean {prompts.mean():.1f} tokens, "
          f"output mean {outputs.mean():.1f}, total mean {total.mean():.1f} / max_len {args.max_len} "
          f"(max {total.max()}); budget {args.budget} token slots")
    print("validated: a real PagedKVCache holds ceil(t / page size) blocks at every step and frees them all\n")
    rows = memory_rows(prompts, outputs, args.max_len, args.budget, page_sizes)
    print(format_table(rows))
    print(f"\npaper (Kwon et al. 2023, Fig. 2): contiguous {PAPER_CONTIGUOUS['Max']}% (Max), "
          f"{PAPER_CONTIGUOUS['Pow2']}% (Pow2), {PAPER_CONTIGUOUS['Oracle']}% (Oracle); "
          f"vLLM {PAPER_VLLM}% (page size 16)")
    paths = [] if args.no_plots else plot_memory(rows, figure_dir(args))

    if not args.no_ttft:
        print(f"\nprefix caching, {label} model: system prompt {len(tok.encode(SYSTEM_PROMPT))} tokens, "
              f"greedy, {args.new_tokens} new tokens, page size {args.ttft_page_size}, "
              f"median of {args.repeat}")
        trows, _ = ttft_rows(model, tok, args.new_tokens, args.repeat, args.ttft_page_size, args.questions)
        print(format_table(trows))
        if not args.no_plots:
            paths.append(plot_ttft(trows, label, figure_dir(args)))
        if any(r["same tokens"] != "yes" for r in trows):
            raise BenchmarkError("prefix caching changed the generated tokens")
    for p in paths:
        print(f"saved {p}")
    return 0
