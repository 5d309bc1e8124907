"""``python -m minillm bench speculation-zoo``: every way to speculate, on three workloads, against plain decoding.

The methods are one table (``zoo``), one entry each; a family lists the knob values it is tried with:

    plain           cached decoding (``generate``): the baseline of every speed-up
    draft           chapter 5's trained 1-layer draft (``speculative_generate``), K in {2, 4, 6}
    int8 target     the target's own weights rounded to int8 as the draft (``drafts.quantize_weights``)
    prompt lookup   draft tokens copied from earlier in the text (``draft_free.PromptLookup``)
    layer skip      the target's first L' layers draft k = 4 tokens (``draft_free.LayerSkip``)
    Medusa exact    the shipped Medusa heads' top-k as a sparse tree (``medusa.MedusaProposer``), exact rule
    Medusa typical  the same trees under Medusa's typical acceptance (not lossless: T = 1 workload only)
    Lookahead       n-grams from a Jacobi window verified as a tree; the window rides in the same forward
                    (``lookahead.Lookahead``, N 5, W 7, G 7)

Workloads on the shipped character target (prompts from the validation split):

    shakespeare     held-out prompts continued greedily
    copy            greedy; the answer repeats text that is in the prompt (``copy_prompts``)
    sample T=1      the held-out prompts sampled at temperature 1

Steps: (1) validate: on both greedy workloads every variant's output equals ``generate(target,
temperature=0)`` token for token (``BenchmarkError`` otherwise), and the same runs give the
hardware-free numbers (acceptance, tokens per target call, tokens verified per call, target
forwards) and pick each family's variant with the shortest wall time; (2) the verify cost: one
target forward over n tokens, in decode steps, as a causal chain (chapter 5's verify) and as a
token tree's masked forward; (3) each family's chosen variant is timed in alternation with plain
decoding (``minillm.measure.time_paired``: medians of ``--repeat`` runs each, after a warm-up); (4) the
table (also as CSV), layer skip's acceptance against L', and the figure speculation_zoo.png.
"""

from __future__ import annotations

import argparse
import csv
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...backend import to_numpy, xp
from ...checkpoint import load_model
from ...data import validation_prompts
from ...draft_free import LayerSkip, PromptLookup
from ...drafts import quantize_weights
from ...generate import GenerationResult, generate
from ...kv_cache import KVCache, MaskedView
from ...lookahead import Lookahead
from ...measure import STEP_CONTEXT, time_paired
from ...medusa import MedusaHeads, MedusaProposer, shipped_heads_path
from ...notebook import format_table
from ...speculative import speculative_generate
from ...token_tree import Proposal, TokenTree, round_inputs, tree_generate
from ..options import positive_int
from .common import BenchmarkError, add_output_args, figure_dir, progress, save_figure
from .common import parse_args as common_parse_args
from .verify_cost import check_cached_forward, forward_seconds, prefix_ids

DRAFT_KS = (2, 4, 6)  # chapter 5's draft and the int8 target: K tried (the fastest is timed)
LAYER_SKIP_K = 4  # draft tokens per round for layer skipping
VERIFY_NS = (1, 2, 4, 8, 16, 32, 64)  # tokens in one verify forward, for its cost in decode steps
VERIFY_ROUNDS, VERIFY_STEPS = 15, 5  # rounds (every n once each) x forwards per timing (bench verify-cost's)
COPY_CUE = 24  # characters of the cue the copy prompts repeat
COPY_ROUNDS = 4  # at most this many greedy passes to reach a copy prompt's fixed point
COPY_SCAN = 4  # cues tried per copy prompt wanted


# ----------------------------------------------------------------------------------------------
# the table of methods


@dataclass(frozen=True)
class Models:
    """What the methods run on: the shipped target, its tokenizer, chapter 5's draft, the int8 target,
    the shipped Medusa heads."""

    target: object
    tok: object
    draft: object
    int8: object
    heads: object


def load_models() -> Models:
    target, tok = load_model("target")
    return Models(target, tok, load_model("draft")[0], quantize_weights(target, bits=8),
                  MedusaHeads.load(target, shipped_heads_path("target")))


@dataclass
class Run:
    """One generation: its result, and the tokens its target forwards carried besides the pending
    ones and the proposals (Lookahead's window), summed over the forwards."""

    result: GenerationResult
    extra_fed: int = 0


def run_plain(models, prompt, n_new, temperature, seed) -> Run:
    return Run(generate(models.target, prompt, n_new, temperature=temperature, seed=seed))


def run_draft(models, prompt, n_new, temperature, seed, k, draft) -> Run:
    return Run(speculative_generate(models.target, getattr(models, draft), prompt, n_new, k=k,
                                    temperature=temperature, seed=seed))


def run_tree(models, prompt, n_new, temperature, seed, proposer, rule="exact") -> Run:
    """``tree_generate`` with a fresh proposer from ``proposer(models)`` (proposers may keep state)."""
    proposed_by = proposer(models)
    result = tree_generate(models.target, prompt, n_new, proposed_by, temperature=temperature, seed=seed,
                           rule=rule)
    return Run(result, getattr(proposed_by, "window_tokens", 0))


@dataclass(frozen=True)
class Variant:
    """One way to run a method: its knob ('K=4', "L'=2", '' when it has none) and the call.

    run(models, prompt ids, n_new, temperature, seed) -> Run. ``verify``: the shape of
    its target forwards, 'chain' (causal, chapter 5's loop) or 'tree' (masked, ``tree_generate``).
    ``sampled_only``: a rule that equals another at temperature 0 (typical acceptance is the greedy
    walk there).
    """

    knob: str
    run: Callable
    verify: str = "tree"
    sampled_only: bool = False


def zoo(n_layer: int, quick: bool = False) -> dict[str, list[Variant]]:
    """The methods: name -> the variants tried. 'plain' first: it is the baseline of every speed-up."""
    ks = (4,) if quick else DRAFT_KS
    skip_layers = (n_layer // 2,) if quick else tuple(range(1, n_layer))
    return {
        "plain": [Variant("", run_plain, verify="chain")],
        "draft": [Variant(f"K={k}", functools.partial(run_draft, k=k, draft="draft"), "chain") for k in ks],
        "int8 target": [Variant(f"K={k}", functools.partial(run_draft, k=k, draft="int8"), "chain") for k in ks],
        "prompt lookup": [Variant("", functools.partial(run_tree, proposer=lambda m: PromptLookup()))],
        "layer skip": [Variant(f"L'={n}", functools.partial(
            run_tree, proposer=lambda m, n=n: LayerSkip(m.target, n, k=LAYER_SKIP_K))) for n in skip_layers],
        "Medusa exact": [Variant("", functools.partial(run_tree, proposer=lambda m: MedusaProposer(m.heads)))],
        "Medusa typical": [Variant("", functools.partial(run_tree, proposer=lambda m: MedusaProposer(m.heads),
                                                         rule="typical"), sampled_only=True)],
        "Lookahead": [Variant("N=5 W=7 G=7", functools.partial(run_tree, proposer=lambda m: Lookahead()))],
    }


# ----------------------------------------------------------------------------------------------
# workloads


@dataclass(frozen=True)
class Workload:
    """Prompts (token id lists), new tokens per prompt, temperature (0 = greedy). ``answers``: the
    greedy output each prompt must give, when known in advance (the copy workload's)."""

    name: str
    prompts: list
    n_new: int
    temperature: float
    answers: list | None = None


def greedy_text(target, tok, text: str, n_new: int) -> str:
    return tok.decode(generate(target, tok.encode(text), n_new, temperature=0).tokens)


def copy_prompts(target, tok, cues, n: int, answer_len: int, rounds: int = COPY_ROUNDS) -> list[tuple[str, str]]:
    """n prompts whose greedy answer repeats text in the prompt -> [(prompt text, answer text)].

    The shipped character model does not copy text it did not write (``copy_fidelity``); what it
    repeats is its own greedy text. From a cue c (of ``cues``, in order): a = greedy(c), then
    a <- greedy(c + a + blank line + c) until a stops changing (a fixed point, at most ``rounds``
    passes). The prompt is c + a + blank line + c, and its greedy answer is a, the passage after the
    first c. Cues without a fixed point are skipped; BenchmarkError when fewer than n cues reach one.
    """
    found = []
    for cue in cues:
        answer = greedy_text(target, tok, cue, answer_len)
        for _ in range(rounds):
            prompt = f"{cue}{answer}\n\n{cue}"
            again = greedy_text(target, tok, prompt, answer_len)
            if again == answer:
                found.append((prompt, answer))
                break
            answer = again
        if len(found) == n:
            return found
    raise BenchmarkError(f"only {len(found)} of {len(cues)} cues gave a copy prompt (a greedy fixed point) "
                         f"with answers of {answer_len} tokens; try a shorter --copy-tokens")


def copy_fidelity(target, tok, passages, cue_len: int = COPY_CUE) -> float:
    """Mean characters the target copies of a passage it did not write, when the prompt is the passage,
    a blank line and its first cue_len characters again (a perfect copier: len(passage) - cue_len)."""
    copied = []
    for passage in passages:
        rest = passage[cue_len:]
        out = greedy_text(target, tok, f"{passage}\n\n{passage[:cue_len]}", len(rest))
        copied.append(next((i for i, (a, b) in enumerate(zip(out, rest)) if a != b), len(rest)))
    return float(np.mean(copied))


def workloads(models: Models, n_prompts: int, n_new: int, prompt_len: int, copy_len: int) -> list[Workload]:
    held_out = validation_prompts(models.tok, n_prompts, prompt_len)
    cues = [models.tok.decode(ids) for ids in validation_prompts(models.tok, n_prompts * COPY_SCAN, COPY_CUE)]
    copies = copy_prompts(models.target, models.tok, cues, n_prompts, copy_len)
    encode = models.tok.encode
    return [
        Workload("shakespeare", held_out, n_new, 0.0),
        Workload("copy", [encode(p) for p, _ in copies], copy_len, 0.0, [encode(a) for _, a in copies]),
        Workload("sample T=1", held_out, n_new, 1.0),
    ]


# ----------------------------------------------------------------------------------------------
# running and counting


@dataclass
class Pooled:
    """Counters of one method summed over a workload's prompts."""

    new: int = 0  # new tokens
    calls: int = 0  # target forwards (plain decoding: one per new token)
    accepted: int = 0  # proposed tokens accepted
    checked: int = 0  # proposed tokens the target judged
    verified: int = 0  # proposed tokens sent to the target
    extra_fed: int = 0  # other tokens the target forwards carried (Lookahead's window)
    seconds: float = 0.0  # wall time of the generations
    verify: str = "chain"  # the shape of the target forwards: 'chain' or 'tree' (``Variant.verify``)

    def add(self, run: Run) -> None:
        stats = run.result.stats
        self.extra_fed += run.extra_fed
        self.new += stats.new_tokens
        self.calls += getattr(stats, "target_calls", stats.new_tokens)
        self.accepted += getattr(stats, "accepted", 0)
        self.checked += getattr(stats, "checked", 0)
        self.verified += getattr(stats, "verified", 0)
        self.seconds += stats.total_s

    @property
    def alpha(self) -> float:
        return self.accepted / self.checked if self.checked else float("nan")

    @property
    def tokens_per_call(self) -> float:
        return self.new / self.calls

    @property
    def verified_per_call(self) -> float:
        return self.verified / self.calls

    @property
    def fed_per_call(self) -> float:
        """Tokens in one target forward, on average: the pending token (or tree root), the proposals
        and any extra tokens (a round's pending chain after a re-prefill is not counted)."""
        return 1 + (self.verified + self.extra_fed) / self.calls


def run_workload(variant: Variant, models: Models, work: Workload) -> tuple[list, Pooled]:
    """One variant over every prompt of a workload (seed i for prompt i) -> (token lists, counters)."""
    outs, pooled = [], Pooled(verify=variant.verify)
    for i, prompt in enumerate(work.prompts):
        run = variant.run(models, prompt, work.n_new, work.temperature, i)
        outs.append(run.result.tokens)
        pooled.add(run)
    return outs, pooled


def survey(methods: dict, models: Models, works: list[Workload]) -> dict:
    """Run every variant once on every workload -> {(workload, method, knob): Pooled}.

    On a greedy workload every output must equal plain greedy decoding's (and the workload's known
    answers): a BenchmarkError before anything is timed.
    """
    found = {}
    configs = [(w, name, v) for w in works for name, vs in methods.items() for v in vs
               if w.temperature > 0 or not v.sampled_only]
    reference = {}
    for work, name, variant in progress(configs, "validate"):
        outs, pooled = run_workload(variant, models, work)
        found[work.name, name, variant.knob] = pooled
        if work.temperature > 0:
            continue
        if name == "plain":
            reference[work.name] = outs
            if work.answers is not None and outs != work.answers:
                raise BenchmarkError(f"the {work.name} prompts' greedy answers are not the passages they repeat")
        elif outs != reference[work.name]:
            raise BenchmarkError(f"{name} {variant.knob} on {work.name}: greedy output differs from generate()")
    return found


class TreeVerify:
    """The target with ``forward`` replaced by one token-tree round over its input (a chain): a masked
    forward (``round_inputs``, ``MaskedView``), the logits of every node, and the compaction of the
    whole path. What ``tree_generate`` pays per round, timed by the same loop as a plain forward."""

    def __init__(self, model):
        self.model, self.config = model, model.config

    def forward(self, idx, cache=None):
        """(1, T) ids -> (1, T, V) logits, the tokens kept in ``cache`` as a plain forward keeps them."""
        tokens = [int(t) for t in np.asarray(to_numpy(idx))[0]]
        _, offsets, mask = round_inputs([tokens[0]], Proposal(TokenTree.chain(tokens[0], tokens[1:])))
        view = MaskedView(KVCache(self.config) if cache is None else cache, offsets, mask)
        logits = self.model.logits(self.model.hidden(xp.asarray([tokens]), view)[0])  # (T, V)
        view.keep(range(len(tokens)))
        return logits[None]


def verify_costs(model, tok, ns, rounds: int = VERIFY_ROUNDS) -> dict:
    """{'step_s': s, 'chain': {n: v}, 'tree': {n: v}}: one verify of n tokens after STEP_CONTEXT cached
    tokens of real text, in single-token decode steps (``verify_cost.forward_seconds``: every n once
    per round, medians; the library's default weight products). chain: a causal forward (chapter 5's
    verify); tree: ``TreeVerify``."""
    ns = sorted({1, *ns})
    prefix = prefix_ids(tok, STEP_CONTEXT)
    costs = {}
    for kind, verifier in (("chain", model), ("tree", TreeVerify(model))):
        check_cached_forward(verifier, prefix, [(3 * t + 2) % model.config.vocab_size for t in range(max(ns))])
        times = forward_seconds(verifier, prefix, ns, rounds, VERIFY_STEPS, paths=("default",))["default"]
        if kind == "chain":
            costs["step_s"] = float(np.median(times[1]))
        costs[kind] = {n: float(np.median(times[n])) / costs["step_s"] for n in ns}
    return costs


def verify_cost(costs: dict, kind: str, n: float) -> float:
    """Cost of a verify of n tokens (n may be fractional: a mean), interpolated in the measured n."""
    ns = sorted(costs[kind])
    return float(np.interp(n, ns, [costs[kind][m] for m in ns]))


# ----------------------------------------------------------------------------------------------
# the report


def result_row(work: Workload, name: str, knob: str, pooled: Pooled, costs: dict) -> dict:
    """The hardware-free columns of one (workload, method) and the verify cost they imply."""
    cost = verify_cost(costs, pooled.verify, pooled.fed_per_call)
    return {"workload": work.name, "method": name, "knob": knob, "alpha": pooled.alpha,
            "tok/call": pooled.tokens_per_call, "verified/call": pooled.verified_per_call,
            "fed/call": pooled.fed_per_call, "target fwd": pooled.calls, "verify cost": cost,
            "bound": pooled.tokens_per_call / cost}


COLUMNS = ["workload", "method", "knob", "alpha", "tok/call", "verified/call", "fed/call", "target fwd",
           "verify cost", "bound", "tok/s", "speed-up"]


def time_methods(methods: dict, models: Models, works: list[Workload], found: dict, costs: dict,
                 repeat: int) -> list[dict]:
    """Per workload: each family's fastest variant in ``found`` timed in alternation with plain decoding
    (``time_paired``, medians of ``repeat``) -> table rows (``result_row`` plus tok/s and speed-up)."""
    rows = []
    for work in works:
        n_total = work.n_new * len(work.prompts)

        def baseline(w=work):
            return run_workload(methods["plain"][0], models, w)

        plain_row = result_row(work, "plain", "", found[work.name, "plain", ""], costs)
        rows.append(plain_row)
        base_times = []
        for name, variants in methods.items():
            variants = [v for v in variants if work.temperature > 0 or not v.sampled_only]
            if name == "plain" or not variants:
                continue
            variant = min(variants, key=lambda v: found[work.name, name, v.knob].seconds)
            base_s, wall, _ = time_paired(baseline, lambda v=variant, w=work: run_workload(v, models, w), repeat)
            base_times.append(base_s)
            row = result_row(work, name, variant.knob, found[work.name, name, variant.knob], costs)
            row.update({"tok/s": n_total / wall, "speed-up": base_s / wall})
            rows.append(row)
            print(f"  {work.name:11s} {name:13s} {variant.knob:5s}: {row['tok/call']:.2f} tok/call, "
                  f"speed-up {row['speed-up']:.2f}x", flush=True)
        plain_row.update({"tok/s": n_total / float(np.median(base_times)), "speed-up": 1.0})
    return rows


def survey_rows(found: dict, works: list[Workload], costs: dict) -> list[dict]:
    """Every variant's hardware-free columns (``result_row``), workload by workload, in the zoo's order."""
    by_name = {w.name: w for w in works}
    return [result_row(by_name[w], name, knob, pooled, costs) for (w, name, knob), pooled in found.items()]


def layer_skip_rows(found: dict, works: list[Workload]) -> list[dict]:
    """Layer skip's acceptance and tokens per call against L', one column pair per workload."""
    knobs = sorted({k for (_, name, k) in found if name == "layer skip"})
    rows = []
    for knob in knobs:
        row = {"L'": knob.split("=")[1]}
        for w in works:
            pooled = found[w.name, "layer skip", knob]
            row[f"alpha {w.name}"] = pooled.alpha
            row[f"tok/call {w.name}"] = pooled.tokens_per_call
        rows.append(row)
    return rows


def write_csv(rows: list[dict], columns: list[str], path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def zoo_figure(rows, costs, skip_rows, works):
    """The four panels: tokens per target call, measured speed-up, the verify cost, layer skip's alpha vs L'."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (ax_calls, ax_speed), (ax_verify, ax_skip) = axes
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "plain"]
    width = 0.8 / len(works)
    x = np.arange(len(methods))
    for i, w in enumerate(works):
        by_method = {r["method"]: r for r in rows if r["workload"] == w.name}
        for ax, column in ((ax_calls, "tok/call"), (ax_speed, "speed-up")):
            heights = [by_method[m][column] if m in by_method else np.nan for m in methods]
            ax.bar(x + (i - (len(works) - 1) / 2) * width, heights, width, label=w.name, color=f"C{i}")
    for ax, label, title in ((ax_calls, "new tokens per target forward",
                              "tokens per target call (hardware-free; the timed variant)"),
                             (ax_speed, "speed-up over plain cached decoding",
                              "measured wall-clock speed-up (paired, medians)")):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(x, [f"{m}" for m in methods], rotation=20, fontsize=8)
        ax.set(xlabel="method", ylabel=label, title=title)
        ax.legend(fontsize=8, title="workload")
    for kind, style in (("chain", "o-"), ("tree", "s--")):
        ns = sorted(costs[kind])
        label = "causal chain (draft models)" if kind == "chain" else "token tree, masked (draft-free)"
        ax_verify.plot(ns, [costs[kind][n] for n in ns], style, label=label)
    ax_verify.axhline(1.0, color="gray", lw=0.8, label="what the theory assumes")
    ax_verify.set_xscale("log", base=2)
    ax_verify.set(xlabel="tokens in one verify forward n", ylabel="cost in single-token decode steps",
                  title=f"the verify cost (decode step {costs['step_s'] * 1e3:.2f} ms)")
    ax_verify.legend(fontsize=8)
    ls = [int(r["L'"]) for r in skip_rows]
    for i, w in enumerate(works):
        ax_skip.plot(ls, [r[f"alpha {w.name}"] for r in skip_rows], "o-", color=f"C{i}", label=w.name)
    ax_skip.set_xticks(ls)
    ax_skip.set(xlabel="L' (target layers the draft runs)", ylabel="acceptance alpha",
                title=f"layer skip: acceptance vs L' (k = {LAYER_SKIP_K})", ylim=(0, 1))
    ax_skip.legend(fontsize=8, title="workload")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minillm bench speculation-zoo", description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=positive_int, default=3, help="prompts per workload (default 3)")
    p.add_argument("--tokens", type=positive_int, default=128,
                   help="new tokens per prompt, shakespeare and sampling (default 128)")
    p.add_argument("--copy-tokens", type=positive_int, default=64,
                   help="length of the copy workload's answers (default 64)")
    p.add_argument("--prompt-len", type=positive_int, default=48, help="characters per held-out prompt (default 48)")
    p.add_argument("--repeat", type=positive_int, default=3, help="timed runs per configuration (median)")
    add_output_args(p)
    p.add_argument("--no-plot", action="store_true", help="do not write the figure")
    p.add_argument("--quick", action="store_true",
                   help="1 prompt, 24 tokens, one K and one L', 1 timed run: a smoke test")
    args = common_parse_args(p, argv)
    if args.quick:
        args.prompts, args.tokens, args.copy_tokens, args.repeat = 1, 24, 24, 1
    if args.tokens < 2 or args.copy_tokens < 2:
        p.error("--tokens and --copy-tokens must be >= 2")
    if 2 * COPY_CUE + 2 + 2 * args.copy_tokens > 256 or args.prompt_len + args.tokens > 256:
        p.error("a prompt plus its answer must fit the shipped target's 256-token context")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    models = load_models()
    methods = zoo(models.target.config.n_layer, args.quick)
    works = workloads(models, args.prompts, args.tokens, args.prompt_len, args.copy_tokens)
    passage_ids = validation_prompts(models.tok, args.prompts, COPY_CUE + args.copy_tokens)
    passages = [models.tok.decode(ids) for ids in passage_ids]
    fidelity = copy_fidelity(models.target, models.tok, passages)
    print(f"target {models.target.num_params():,} params; {args.prompts} prompts per workload; "
          f"methods: {', '.join(methods)}")
    print(f"copy prompts: the target's greedy answer repeats the passage in the prompt ({args.copy_tokens} tokens); "
          f"given a held-out passage instead it copies {fidelity:.1f} of {args.copy_tokens} characters")

    # 1. validate (and count): every greedy output == generate(target, temperature=0)
    found = survey(methods, models, works)
    print("validated: on both greedy workloads every method's output == generate(target, temperature=0)")

    # 2. the verify cost, in decode steps
    ns = (1, 4, 16, 64) if args.quick else VERIFY_NS
    costs = verify_costs(models.target, models.tok, ns, rounds=3 if args.quick else VERIFY_ROUNDS)
    print(f"decode step {costs['step_s'] * 1e3:.2f} ms; one verify of n tokens costs (decode steps): "
          + "; ".join(f"{kind} " + ", ".join(f"n={n}: {costs[kind][n]:.2f}" for n in ns) for kind in ("chain", "tree")))

    # 3. time each family's fastest variant in alternation with plain decoding
    rows = time_methods(methods, models, works, found, costs, args.repeat)

    # 4. report
    every = survey_rows(found, works, costs)
    print()
    print("every variant, untimed (hardware-free; the fastest of each family is timed below)")
    print(format_table(every, COLUMNS[:-2]))
    print()
    print(format_table(rows, COLUMNS))
    print("verify cost: one target forward over fed/call tokens, in decode steps; "
          "bound = tok/call / verify cost (the speed-up if proposing were free)")
    skip_rows = layer_skip_rows(found, works)
    print()
    print(f"layer skip, k = {LAYER_SKIP_K}: acceptance and tokens per target call against L'")
    print(format_table(skip_rows))
    out = figure_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, COLUMNS, out / "speculation_zoo.csv")
    write_csv(every, COLUMNS[:-2], out / "speculation_zoo_variants.csv")
    print(f"tables: {out / 'speculation_zoo.csv'}, {out / 'speculation_zoo_variants.csv'}")
    if not args.no_plot:
        import matplotlib

        matplotlib.use("Agg")
        print(f"figure: {save_figure(zoo_figure(rows, costs, skip_rows, works), 'speculation_zoo', out)}")
    return 0
