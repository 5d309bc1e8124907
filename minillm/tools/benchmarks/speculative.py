"""``python -m minillm bench speculative``: speed-up of speculative decoding over plain cached decoding.

For the shipped target with each draft (the trained 1-layer draft, its int8-quantized copy and a
corpus bigram), K = 1..8, greedy and temperature 1, every model's matrices kept as ``--weights`` says
(``q``, the default: packed once for chapter 13's CPU kernels, ``minillm.qkernels``; ``fp32``: the float32
arrays through ``backend.weight_product``, the old path), the same weights for plain and speculative decoding:

1. validate: greedy speculative output == ``generate(target, temperature=0)`` for every prompt;
2. measure costs: c = draft decode step / target decode step, and v(K) = target forward over
   K + 1 tokens / target decode step (the theory assumes v = 1), each the median ratio of steps
   timed in alternating pairs (``step_ratio``);
3. time every speculative configuration in alternation with the target's own cached decoding
   (``minillm.measure.time_paired``: same prompts, same number of new tokens, medians of ``--repeat`` runs
   each after a warm-up), so each speed-up compares runs made under the same machine load;
4. print a table: alpha, tokens per target call measured beside (1 - a^(K+1)) / (1 - a), ms per token
   of plain and of speculative decoding (the paired runs), the measured speed-up beside Leviathan
   et al.'s (1 - a^(K+1)) / ((1 - a)(K c + 1)) and beside a cost model that uses the measured v(K);
   save the figure spec_speedup.png.

Prompts come from the validation split (text the models never trained on); prompt + generation
fits the 256-token context, so no window is re-prefilled.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from ...checkpoint import load_model
from ...data import validation_prompts
from ...drafts import BigramDraft, quantize_weights
from ...generate import generate
from ...measure import step_ratio, step_time, time_paired, verify_cost
from ...notebook import format_table
from ...quantize import kept_in_blocks
from ...speculative import expected_speedup, expected_tokens_per_call, speculative_generate
from ..options import add_weights_option, count, nonnegative_float_list, positive_int_list
from .common import BenchmarkError, add_output_args, figure_dir, new_tokens_in_context, progress, save_figure
from .common import (
    parse_args as common_parse_args,
)

DRAFT_NAMES = ("draft", "int8", "bigram")


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m minillm bench speculative", description=__doc__.splitlines()[0]
    )
    p.add_argument("--tokens", type=count, default=200, help="new tokens per prompt (default 200)")
    p.add_argument("--prompts", type=count, default=3, help="prompts from the validation split (default 3)")
    p.add_argument("--prompt-len", type=count, default=48, help="characters per prompt (default 48)")
    p.add_argument("--ks", type=positive_int_list, default="1,2,3,4,5,6,7,8", help="draft lengths K (default 1..8)")
    p.add_argument("--temperatures", type=nonnegative_float_list, default="0,1",
                   help="temperatures (default 0,1; 0 = greedy)")
    p.add_argument("--drafts", default=",".join(DRAFT_NAMES), help="drafts to try: draft,int8,bigram")
    p.add_argument("--repeat", type=count, default=3, help="timed runs per configuration (median)")
    add_output_args(p)
    p.add_argument("--no-plot", action="store_true", help="do not write the figure")
    p.add_argument("--target", default="target", help="target model: 'target' or a .npz path")
    p.add_argument("--draft", default="draft", help="draft model: 'draft' or a .npz path")
    p.add_argument("--quick", action="store_true", help="K in 1,2,4,8; 2 prompts; 1 run each")
    add_weights_option(p)  # every model of every comparison: plain and speculative decoding share them
    args = common_parse_args(p, argv)
    if args.quick:
        args.ks, args.prompts, args.repeat = [1, 2, 4, 8], 2, 1
    args.drafts = [d.strip() for d in args.drafts.split(",")]
    unknown = set(args.drafts) - set(DRAFT_NAMES)
    if unknown or args.tokens < 2 or args.repeat < 1:
        p.error(f"bad options (unknown drafts {sorted(unknown)}; --tokens >= 2; --repeat >= 1)")
    return args


def run_speculative(target, draft, prompts, n_new, k, temperature):
    """Speculative generation over every prompt -> (token lists, pooled counters)."""
    outs, tot = [], dict(new=0, accepted=0, checked=0, calls=0)
    for i, prompt in enumerate(prompts):
        result = speculative_generate(target, draft, prompt, n_new, k=k, temperature=temperature, seed=i)
        s = result.stats
        outs.append(result.tokens)
        tot["new"] += s.new_tokens
        tot["accepted"] += s.accepted
        tot["checked"] += s.checked
        tot["calls"] += s.target_calls
    return outs, tot


def describe_weights(model, weights: str) -> str:
    """One line: which weights every model of the comparison multiplies by (``--weights``), and through what."""
    how = ("every matrix packed once as F32 panels for the CPU kernels (minillm.qkernels)"
           if kept_in_blocks(model.lm_head) else "float32 arrays (backend.weight_product)")
    return f"weights {weights}: {how}, the same for plain and speculative decoding"


def plot(rows, ks, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5.2))
    colors = {"draft": "tab:blue", "int8": "tab:green", "bigram": "tab:red"}
    kk = np.arange(1, max(ks) + 1)
    for (name, temp), group in _groups(rows).items():
        greedy = temp == 0
        label = f"{name}, {'greedy' if greedy else f'T={temp:g}'}"
        measured = dict(color=colors[name], linestyle="-" if greedy else "--", marker="o" if greedy else "^")
        theory = dict(color=colors[name], linestyle=":" if greedy else "-.", lw=1.2, alpha=0.7)
        alpha, c = _pooled_alpha(group), group[0]["c"]
        ax1.plot([r["K"] for r in group], [r["speed-up"] for r in group], **measured, label=f"{label}: measured")
        ax1.plot(kk, [expected_speedup(alpha, k, c) for k in kk], **theory, label=f"{label}: theory")
        ax2.plot([r["K"] for r in group], [r["tok/call"] for r in group], **measured)
        ax2.plot(kk, [expected_tokens_per_call(alpha, k) for k in kk], **theory)
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xlabel="K (draft tokens per round)", ylabel="speed-up over cached decoding",
            title="speed-up (theory: Thm 3.8 at the measured alpha, c)")
    ax2.set(xlabel="K (draft tokens per round)", ylabel="new tokens per target call",
            title="tokens per target call (theory: Eq. 1 at the measured alpha)")
    # one key for both panels: a colour per draft, solid/dashed measured, dotted/dash-dot theory
    handles = dict(zip(*reversed(ax1.get_legend_handles_labels())))  # label -> line
    order = sorted(handles, key=lambda label: list(colors).index(label.split(",")[0]))  # a column per draft
    fig.legend([handles[label] for label in order], order, loc="lower center", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    return save_figure(fig, "spec_speedup", out_dir)


def _groups(rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["draft"], r["T"]), []).append(r)
    return groups


def _pooled_alpha(group):
    return sum(r["_accepted"] for r in group) / max(1, sum(r["_checked"] for r in group))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    target, tok = load_model(args.target, weights=args.weights)
    base_draft, _ = load_model(args.draft, weights=args.weights)
    drafts = {"draft": base_draft, "int8": quantize_weights(base_draft, bits=8).with_weights(args.weights),
              "bigram": BigramDraft.from_corpus(tok)}
    drafts = {name: drafts[name] for name in args.drafts}
    prompts = validation_prompts(tok, args.prompts, args.prompt_len)
    n_new = new_tokens_in_context(args.tokens, max(len(p) for p in prompts), target.config.block_size)
    print(f"target: {target.num_params():,} params; drafts: "
          + ", ".join(f"{n} ({d.num_params():,})" for n, d in drafts.items())
          + f"; {len(prompts)} prompts x {n_new} new tokens; K in {args.ks}")
    print(describe_weights(target, args.weights))

    # 1. validate: greedy speculative decoding is the target's greedy decoding
    reference = [generate(target, p, n_new, temperature=0).tokens for p in prompts]
    if kept_in_blocks(target.lm_head):  # the kernels first: the packed target writes what the float32 one writes
        arrays = target.with_weights("fp32")
        if [generate(arrays, p, n_new, temperature=0).tokens for p in prompts] != reference:
            raise BenchmarkError("the target on the kernels (--weights q) decodes other greedy tokens than with "
                                 "--weights fp32")
    for name, draft in progress(drafts.items(), "validate", total=len(drafts)):
        for k in sorted({min(args.ks), max(args.ks)}):
            outs, _ = run_speculative(target, draft, prompts, n_new, k, 0.0)
            if outs != reference:
                raise BenchmarkError(f"greedy speculative decoding with {name}, K={k} differs from generate()")
    print("validated: greedy speculative output == generate(target, temperature=0) for every draft"
          + (", and the target's greedy output is the float32 target's" if kept_in_blocks(target.lm_head) else ""))

    # 2. costs in target decode steps
    t_step = step_time(target, 1)
    c = {name: step_ratio(d, 1, target) for name, d in drafts.items()}
    v = {k: verify_cost(target, k + 1) for k in args.ks}
    print(f"target decode step {t_step * 1e3:.2f} ms; c = "
          + ", ".join(f"{n} {x:.3f}" for n, x in c.items())
          + "; verify K+1 tokens / step: " + ", ".join(f"K={k}: {x:.2f}" for k, x in v.items()))

    # 3. time the baseline and every configuration
    rows = []
    n_total = n_new * len(prompts)
    for temp in args.temperatures:
        def baseline(t=temp):
            return [generate(target, p, n_new, temperature=t, seed=i) for i, p in enumerate(prompts)]

        base_row = {"draft": "(target alone)", "T": temp, "K": 0, "speed-up": 1.0}
        rows.append(base_row)
        base_times = []
        for name, draft in drafts.items():
            for k in args.ks:
                def run(d=draft, k=k, t=temp):
                    return run_speculative(target, d, prompts, n_new, k, t)

                base_s, wall, (_, tot) = time_paired(baseline, run, args.repeat)  # alternating runs
                base_times.append(base_s)
                alpha = tot["accepted"] / max(1, tot["checked"])
                per_call = tot["new"] / tot["calls"]
                rows.append({
                    "draft": name, "T": temp, "K": k, "alpha": alpha,
                    "tok/call": per_call, "formula": expected_tokens_per_call(alpha, k),
                    "c": c[name], "plain ms/tok": base_s / n_total * 1e3, "ms/tok": wall / n_total * 1e3,
                    "tok/s": n_total / wall, "speed-up": base_s / wall,
                    "theory": expected_speedup(alpha, k, c[name]),
                    "cost model": per_call / (k * c[name] + v[k]),
                    "_accepted": tot["accepted"], "_checked": tot["checked"],
                })
                print(f"  {name:6s} T={temp:g} K={k}: alpha {alpha:.3f}, {per_call:.2f} tok/call, "
                      f"speed-up {base_s / wall:.2f}x", flush=True)
        base_row["tok/s"] = n_total / statistics.median(base_times)  # over every pairing
        base_row["ms/tok"] = base_row["plain ms/tok"] = statistics.median(base_times) / n_total * 1e3

    # 4. report
    columns = ["draft", "T", "K", "alpha", "tok/call", "formula", "c", "plain ms/tok", "ms/tok", "tok/s", "speed-up",
               "theory", "cost model"]
    print()
    print(f"weights {args.weights}; plain ms/tok: the target alone in the runs paired with each row")
    print(format_table(rows, columns))
    for temp in args.temperatures:
        for name in drafts:
            group = [r for r in rows if r["draft"] == name and r["T"] == temp]
            best = max(group, key=lambda r: r["speed-up"])
            print(f"best K for {name}, T={temp:g}: K={best['K']} -> {best['speed-up']:.2f}x "
                  f"(alpha {best['alpha']:.3f}, {best['tok/call']:.2f} tokens per target call)")
    if not args.no_plot:
        path = plot([r for r in rows if r["K"] > 0], args.ks, figure_dir(args))
        print(f"figure: {path}")
    return 0
