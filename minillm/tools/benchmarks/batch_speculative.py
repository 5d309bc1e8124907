"""``python -m minillm bench batch-speculative``: speculative decoding's speed-up as the batch grows.

For the shipped target and draft, batch sizes 1, 2, 4, 8, 16 (prompts of different lengths from the
validation split), greedy by default:

1. validate: every row of ``generate_batch`` and of ``speculative_generate_batch`` (each policy)
   equals ``generate(target, prompt, temperature=0)`` alone, at the largest batch;
2. measure costs per batch size B, in target decode steps of the same batch: v(B) = one target
   forward over B x (K + 1) tokens / one over B x 1 (the verification; theory assumes v = 1), and
   c(B) = one draft step / one target step (both (B, 1));
3. time batched speculative decoding under each policy in alternation with plain batched decoding
   (``minillm.measure.time_paired``: medians of ``--repeat`` runs each after a warm-up): tokens/s = B x new
   tokens / wall time;
4. print a table: tokens/s, speed-up over plain batched decoding at the same B, alpha, tokens per
   target call per row, the share of verified positions thrown away (padding + rejections), and a
   cost model tok/call / (draft steps per round x c(B) + v(B)); save the figure batch_speculative.png.
"""

from __future__ import annotations

import argparse

import numpy as np

from ...batch_speculative import POLICIES, forward_ragged, generate_batch, speculative_generate_batch
from ...checkpoint import load_model
from ...data import validation_prompts
from ...generate import generate
from ...measure import STEP_CONTEXT, time_fn, time_paired
from ...notebook import format_table
from ...paged_kv import PagedKVCache, num_blocks_for
from ..options import count, nonnegative_float, positive_int_list
from .common import BenchmarkError, add_output_args, figure_dir, save_figure
from .common import parse_args as common_parse_args

PROMPT_STEP = 8  # prompt i is PROMPT_STEP * (i % 4) characters shorter than --prompt-len: ragged rows


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m minillm bench batch-speculative", description=__doc__.splitlines()[0]
    )
    p.add_argument("--batch-sizes", type=positive_int_list, default="1,2,4,8,16", help="default 1,2,4,8,16")
    p.add_argument("--tokens", type=count, default=64, help="new tokens per sequence (default 64)")
    p.add_argument("--k", type=count, default=4, help="draft tokens per round, the adaptive policy's maximum")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies: pad,adaptive")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--prompt-len", type=count, default=48, help="characters of the longest prompt (default 48)")
    p.add_argument("--repeat", type=count, default=3, help="timed runs per configuration (median)")
    add_output_args(p)
    p.add_argument("--no-plot", action="store_true", help="do not write the figure")
    p.add_argument("--quick", action="store_true", help="batch sizes 1,4,16; 32 tokens; 1 run each")
    args = common_parse_args(p, argv)
    if args.quick:
        args.batch_sizes, args.tokens, args.repeat = [1, 4, 16], 32, 1
    args.policies = [s.strip() for s in args.policies.split(",")]
    unknown = set(args.policies) - set(POLICIES)
    if unknown or args.k < 1 or args.tokens < 2 or args.repeat < 1:
        p.error(f"bad options (unknown policies {sorted(unknown)}; k >= 1; --tokens >= 2; "
                "--repeat >= 1)")
    if args.prompt_len <= 3 * PROMPT_STEP:
        p.error(f"--prompt-len must exceed {3 * PROMPT_STEP}")
    return args


def ragged_prompts(tok, n, length):
    """n prompts from the validation split, of lengths length, length - 8, length - 16, length - 24, ..."""
    return [p[: length - PROMPT_STEP * (i % 4)] for i, p in enumerate(validation_prompts(tok, n, length))]


def batch_step_time(model, B, n_tokens, context=STEP_CONTEXT):
    """Median seconds of one forward of B sequences x n_tokens new tokens after ``context`` cached each."""
    cache = PagedKVCache(model.config, num_blocks=B * num_blocks_for(model.config.block_size, 16))
    seqs = [cache.add_sequence() for _ in range(B)]
    forward_ragged(model, cache, seqs, [[0] * context] * B)
    new = [[1] * n_tokens] * B

    def step():
        for s in seqs:
            cache.truncate(s, context)
        forward_ragged(model, cache, seqs, new)

    return time_fn(step, warmup=2, repeat=10)


def validate(target, draft, prompts, n_new, k, policies) -> str | None:
    """None if every batched row equals generate() alone (greedy), else what differs."""
    reference = [generate(target, p, n_new, temperature=0).tokens for p in prompts]
    if generate_batch(target, prompts, n_new, temperature=0).tokens != reference:
        return "generate_batch"
    for policy in policies:
        result = speculative_generate_batch(target, draft, prompts, n_new, k=k, temperature=0, policy=policy)
        if result.tokens != reference:
            return f"speculative_generate_batch, policy {policy}"
    return None


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.3))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for n, method in enumerate(methods):
        group = [r for r in rows if r["method"] == method]
        bb, color = [r["B"] for r in group], f"C{n}"  # one colour per method in every panel
        ax1.plot(bb, [r["tok/s"] for r in group], "o-", color=color, label=method)
        if method != "plain":
            ax2.plot(bb, [r["speed-up"] for r in group], "o-", color=color, label=f"{method} measured")
            ax2.plot(bb, [r["cost model"] for r in group], ":", color=color, label=f"{method} cost model")
            ax3.plot(bb, [r["rejected %"] for r in group], "o-", color=color, label=f"{method}: rejected")
            ax3.plot(bb, [r["wasted %"] for r in group], "s--", color=color,
                     label=f"{method}: rejected + padding")
    ax2.axhline(1.0, color="gray", lw=0.8)
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["B"] for r in rows}), [str(b) for b in sorted({r["B"] for r in rows})])
        ax.minorticks_off()
        ax.set_xlabel("batch size B")
        ax.legend(fontsize=7)
    ax1.set(ylabel="tokens/s (all rows)", title="throughput")
    ax2.set(ylabel="speed-up over plain batched decoding", title="speculative speed-up vs batch size")
    ax3.set(ylabel="% of verified positions thrown away", title="padding and rejections")
    return save_figure(fig, "batch_speculative", out_dir)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    target, tok = load_model("target")
    draft, _ = load_model("draft")
    prompts = ragged_prompts(tok, max(args.batch_sizes), args.prompt_len)
    n_new = min(args.tokens, target.config.block_size - args.prompt_len)
    print(f"target {target.num_params():,} params, draft {draft.num_params():,}; batch sizes {args.batch_sizes}; "
          f"prompts of {sorted({len(p) for p in prompts})} tokens x {n_new} new tokens; K = {args.k}; "
          f"T = {args.temperature:g}; policies {args.policies}")

    # 1. validate
    wrong = validate(target, draft, prompts, n_new, args.k, args.policies)
    if wrong:
        raise BenchmarkError(f"{wrong} differs from generate() alone")
    print(f"validated: at B = {len(prompts)} every row of every batched method == generate(target) alone")

    # 2. costs per batch size, in target decode steps of the same batch
    costs = {}
    for B in args.batch_sizes:
        step = batch_step_time(target, B, 1)
        costs[B] = dict(step=step, v=batch_step_time(target, B, args.k + 1) / step,
                        c=batch_step_time(draft, B, 1) / step)
        print(f"  B={B}: target step {step * 1e3:.2f} ms; verify of K+1 = {args.k + 1} tokens = "
              f"{costs[B]['v']:.2f} steps; draft step c = {costs[B]['c']:.3f}", flush=True)

    # 3. time
    rows = []
    for B in args.batch_sizes:
        batch = prompts[:B]

        def plain(b=batch):
            return generate_batch(target, b, n_new, temperature=args.temperature)

        plain_row = {"B": B, "method": "plain", "speed-up": 1.0}
        rows.append(plain_row)
        plain_times = []
        for policy in args.policies:
            def run(b=batch, policy=policy):
                return speculative_generate_batch(target, draft, b, n_new, k=args.k, temperature=args.temperature,
                                                  policy=policy)

            plain_s, wall, result = time_paired(plain, run, args.repeat)  # alternating runs
            stats, bst = [row.stats for row in result.rows], result.stats
            plain_times.append(plain_s)
            per_call = float(np.mean([s.tokens_per_call for s in stats]))
            draft_steps = bst.draft_calls / bst.target_calls  # batched draft forwards per round
            rows.append({
                "B": B, "method": policy, "tok/s": B * n_new / wall, "speed-up": plain_s / wall,
                "alpha": sum(s.accepted for s in stats) / max(1, sum(s.checked for s in stats)),
                "tok/call": per_call, "wasted %": 100 * bst.wasted_share,
                "padded %": 100 * bst.padded / bst.slots, "rejected %": 100 * bst.rejected / bst.slots,
                "v(B)": costs[B]["v"], "c(B)": costs[B]["c"],
                "cost model": per_call / (draft_steps * costs[B]["c"] + costs[B]["v"]),
            })
            print(f"  B={B:2d} {policy:8s}: {rows[-1]['tok/s']:.0f} tok/s, speed-up {rows[-1]['speed-up']:.2f}x, "
                  f"thrown away {rows[-1]['wasted %']:.1f} %", flush=True)
        plain_row["tok/s"] = B * n_new / float(np.median(plain_times))  # over every pairing

    # 4. report
    columns = ["B", "method", "tok/s", "speed-up", "alpha", "tok/call", "wasted %", "padded %", "rejected %",
               "v(B)", "c(B)", "cost model"]
    print()
    print(format_table(rows, columns))
    if not args.no_plot:
        print(f"figure: {plot(rows, figure_dir(args))}")
    return 0
