"""``python -m minillm bench real-speculation``: speculative decoding on SmolLM2-135M, per method and workload.

    python -m minillm bench real-speculation [--prompts FILE.jsonl] [--json OUT] [--methods eagle-chain,lookup]

Methods (all verified by the target in one forward per round, ``token_tree.tree_generate``):

    eagle-chain   the shipped EAGLE draft (``minillm.eagle``), a chain of K tokens per round
    eagle-tree    the same draft growing an EAGLE-2 tree by confidence
    eagle-lookup  the EAGLE chain, and prompt lookup's chain beside it where the text's last 2+ tokens occurred
                  before (``eagle.EagleLookup``, as ``chat --speculate eagle-lookup`` drafts)
    lookup        prompt lookup: draft tokens copied from earlier in the text (``draft_free.PromptLookup``) where
                  its last 2+ tokens occurred before, at most ``draft_free.LOOKUP_DRAFT`` of them, as ``chat
                  --speculate`` drafts (``speculative_chat.chat_lookup``)
    layer-skip    the target's first half of layers drafts (``draft_free.LayerSkip``)
    medusa        the shipped Medusa heads' sparse tree (``medusa.MedusaProposer``)

The model keeps its file's Q8_0 / Q4_1 blocks (``--weights q``, the default: every product is the blocks'
kernel) or dequantizes them to float32 (``--weights fp32``); float32 products, plain and speculative alike, run
on the fast weight products (``backend.weight_product``; ``--products blas`` for the reference). Each prompt
(default: ``workloads.WORKLOADS``; FILE: one {"prompt", "kind"} per line) is put in the chat template. Per
prompt and temperature: plain decoding (``generate``) once, as a warm-up and, greedy, as the reference; it
fixes the reply's length, up to and including its end of turn (at most ``--max-new-tokens``, at least 8):
every run of the prompt writes that many tokens, so nothing past the reply's end is timed. Per method a
warm-up run that gives the counters and, greedy, must equal the reference token for token (``BenchmarkError``
otherwise: nothing wrong is timed); then ``--repeat`` alternating pairs (plain, method), timed. A method's
speed-up for a kind is the median over its prompts of (plain / method) decode time per token after the first
token (after the first round's tokens for the method; ``speedup_with_prefill``: whole runs, prompt included).

The cost model beside it, in decode steps (a cached forward of one token, ``measure.step_time`` at the
workload's context): one round costs a verify of n tokens, v(n) (``measure.verify_cost``), plus the
draft's time, c (the proposer's measured seconds per round), plus the judgement of the target's rows, a
(``SpecStats.accept_s`` per round: the softmax of the rows the walk reaches and the acceptance walk; a
greedy judgement is an argmax); a round emits tau tokens. A plain token costs one step plus its own
sampling, s (``SamplingSettings.next_token`` on one row of logits, timed here; 0 in effect when greedy).
So a prompt's predicted = tau (1 + s) / (v(n) + c + a), from its own round counts; a row's prediction is
the median over its prompts, as its measured speed-up is (the terms printed beside it pool the prompts).
``c_per_forward`` divides the draft's seconds by its forward passes instead (a chain of K tokens: one
forward over the positions the target kept, then K - 1 single steps): the cost of one draft token
against one target step; ``c_after_prompt`` the same without each run's first round that drafts, whose
first forward reads the whole prompt, and ``prompt_catch_up`` that round's draft time in decode steps (the
mean per prompt). ``in_vocab``: the share of the plain replies' tokens that an EAGLE draft's reduced vocabulary
holds (a token outside it is one the draft can never guess).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

import numpy as np

from ...backend import set_fast_products, to_numpy
from ...draft_free import LayerSkip
from ...eagle import HEAD_FORMATS, EagleDraft, EagleProposer, shipped_draft_path
from ...generate import generate
from ...measure import TimedProposer, step_time, time_fn, timed, verify_cost
from ...medusa import MedusaHeads, MedusaProposer, shipped_heads_path
from ...notebook import format_table
from ...registry import SMOLLM2, load_model
from ...sampling import SamplingSettings
from ...speculative_chat import chat_eagle_lookup, chat_lookup
from ...token_tree import tree_generate
from ...workloads import KINDS, WORKLOADS, read_prompts
from ..options import add_weights_option, count, float_in, int_in, list_of
from .common import BenchmarkError, add_json_arg, parse_args, write_json

METHODS = ("eagle-chain", "eagle-tree", "eagle-lookup", "lookup", "layer-skip", "medusa")
TEMPERATURES = (0.0, 0.7, 1.0)


def make_proposer(method: str, model, args):
    if method.startswith("eagle-"):
        draft = EagleDraft.load(model, args.draft or shipped_draft_path(SMOLLM2), head_format=args.draft_head)
        mode = "tree" if method == "eagle-tree" else "chain"
        eagle = EagleProposer(draft, mode, depth=args.depth, max_nodes=args.tree_nodes, confidence=args.confidence)
        return chat_eagle_lookup(eagle) if method == "eagle-lookup" else eagle
    if method == "lookup":
        return chat_lookup()  # as chat --speculate drafts: a verify the kernels take whole
    if method == "layer-skip":
        return LayerSkip(model, model.config.n_layer // 2)
    return MedusaProposer(MedusaHeads.load(model, shipped_heads_path(SMOLLM2)))


COUNTS = ("accepted", "checked", "rounds", "new_tokens", "target_calls", "verified", "draft_s", "draft_calls",
          "accept_s", "catch_up_s", "catch_up_calls")


@dataclass
class Cell:
    """What one (method, kind, temperature) gathered over its prompts: the counters summed, and each prompt's own
    (``prompts``, for its own prediction)."""

    accepted: int = 0
    checked: int = 0
    rounds: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    verified: int = 0
    draft_s: float = 0.0
    draft_calls: int = 0
    accept_s: float = 0.0
    catch_up_s: float = 0.0  # each run's first round that drafts, where the draft reads the prompt, and its forwards
    catch_up_calls: int = 0
    identical: bool = True
    ratios: list = field(default_factory=list)  # plain / method time per token after the first
    whole_ratios: list = field(default_factory=list)  # plain / method seconds of the whole run, prefill included
    prompts: list = field(default_factory=list)  # a Cell per prompt
    reply_tokens: int = 0  # the plain replies' tokens, and those a draft's reduced vocabulary holds
    in_vocab: int = 0

    def add(self, stats, draft_s: float, draft_calls: int, catch_up_s: float = 0.0, catch_up_calls: int = 0) -> None:
        one = Cell(accepted=stats.accepted, checked=stats.checked, rounds=stats.rounds, new_tokens=stats.new_tokens,
                   target_calls=stats.target_calls, verified=stats.verified, draft_s=draft_s,
                   draft_calls=draft_calls, accept_s=stats.accept_s, catch_up_s=catch_up_s,
                   catch_up_calls=catch_up_calls)
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(one, name))
        self.prompts.append(one)

    def terms(self, t_step: float, costs: dict) -> tuple:
        """The cost model's terms: (tau, verified tokens n, v(n), c, a), c and a in decode steps per round."""
        rounds = max(self.rounds, 1)
        tau = (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")
        n = 1 + self.verified / self.target_calls if self.target_calls else 1
        return tau, n, interpolate(costs, n), self.draft_s / rounds / t_step, self.accept_s / rounds / t_step

    def predicted(self, t_step: float, costs: dict, sample_s: float) -> float:
        """tau (1 + s) / (v(n) + c + a)"""
        tau, _, v, draft_c, accept_a = self.terms(t_step, costs)
        return tau * (1 + sample_s) / (v + draft_c + accept_a)


def verify_costs(model, context: int, ns) -> tuple[float, dict]:
    """(seconds of a decode step, {n: v(n) = ``measure.verify_cost``}) at ``context``, on the process's product path."""
    return step_time(model, 1, context, repeat=10), {n: verify_cost(model, n, context, repeat=5) for n in ns}


def sampling_costs(model, ids, temperatures, t_step: float) -> dict:
    """{temperature: s}, a plain token's sampling in decode steps: ``SamplingSettings.next_token`` on the
    model's last row of logits after ``ids`` (the softmax over the vocabulary and the draw; an argmax when
    greedy), the median of 20 calls."""
    row = to_numpy(model.forward(np.asarray([ids]))[0, -1])
    rng, costs = np.random.default_rng(0), {}
    for t in temperatures:
        settings = SamplingSettings(t)
        costs[t] = time_fn(lambda s=settings: s.next_token(row, rng), warmup=2, repeat=20) / t_step
    return costs


def interpolate(costs: dict, n: float) -> float:
    ns = sorted(costs)
    n = min(max(n, ns[0]), ns[-1])
    lo = max(k for k in ns if k <= n)
    hi = min(k for k in ns if k >= n)
    return costs[lo] if lo == hi else costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


MIN_REPLY = 8  # the fewest new tokens a timed run writes


def reply_length(tokens: list, eos: int, longest: int) -> int:
    """New tokens up to and including the first end of turn (all when there is none), at least MIN_REPLY (or
    ``longest`` if fewer)."""
    n = tokens.index(eos) + 1 if eos in tokens else len(tokens)
    return max(n, min(MIN_REPLY, longest))


def run_prompt(model, ids, args, methods, proposers, temperature, cells, kind, seed, eos):
    """One prompt at one temperature: warm-ups, the reply's length, the greedy check, then alternating timed
    pairs."""
    first = generate(model, ids, args.max_new_tokens, temperature=temperature, seed=seed).tokens  # the warm-up
    n_new = reply_length(first, eos, args.max_new_tokens)
    reference = first[:n_new]  # a shorter run writes the same first tokens (the same seed)

    def plain():
        return generate(model, ids, n_new, temperature=temperature, seed=seed)

    for method in methods:
        wrapped = TimedProposer(proposers[method])

        def spec(w=wrapped):
            return tree_generate(model, ids, n_new, w, temperature=temperature, seed=seed)

        calls = getattr(proposers[method], "draft_calls", 0)  # a draft's forwards (a proposer that has one)
        result = spec()
        calls = getattr(proposers[method], "draft_calls", 0) - calls
        cell = cells[(method, kind, temperature)]
        if temperature == 0 and result.tokens != reference:
            cell.identical = False
            raise BenchmarkError(f"{method}: greedy output differs from plain decoding on a {kind} prompt")
        cell.add(result.stats, wrapped.seconds, calls, wrapped.catch_up_s, wrapped.catch_up_calls)
        subset = getattr(getattr(proposers[method], "draft", None), "subset", None)  # an EAGLE draft's vocabulary
        if subset is not None:
            cell.reply_tokens += len(reference)
            cell.in_vocab += int(np.isin(reference, subset).sum())
        plain_runs, spec_runs = [], []
        for _ in range(args.repeat):
            plain_runs.append(timed(plain))
            spec_runs.append(timed(spec))
        cell.ratios.append(statistics.median(r.stats.tpot_s for _, r in plain_runs)
                           / statistics.median(r.stats.tpot_s for _, r in spec_runs))
        cell.whole_ratios.append(statistics.median(s for s, _ in plain_runs)
                                 / statistics.median(s for s, _ in spec_runs))


def rows_of(cells: dict, t_step: float, costs: dict, sampling: dict) -> list[dict]:
    rows = []
    for (method, kind, temperature), c in cells.items():
        if not c.ratios:
            continue
        tau, n, v, draft_c, accept_a = c.terms(t_step, costs)
        sample_s = sampling[temperature]
        rows.append({"method": method, "kind": kind, "temperature": temperature, "identical": c.identical,
                     "alpha": round(c.accepted / c.checked, 3) if c.checked else None, "tau": round(tau, 2),
                     "tokens_per_call": round(c.new_tokens / c.target_calls, 2),
                     "verify_n": round(n, 1), "v_n": round(v, 2), "draft_c": round(draft_c, 2),
                     "c_per_forward": round(c.draft_s / c.draft_calls / t_step, 3) if c.draft_calls else None,
                     "c_after_prompt": round((c.draft_s - c.catch_up_s) / (c.draft_calls - c.catch_up_calls) / t_step,
                                             3) if c.draft_calls > c.catch_up_calls else None,
                     "prompt_catch_up": round(c.catch_up_s / len(c.prompts) / t_step, 2) if c.catch_up_calls else None,
                     "accept_a": round(accept_a, 3), "sample_s": round(sample_s, 3),
                     "in_vocab": round(c.in_vocab / c.reply_tokens, 3) if c.reply_tokens else None,
                     "predicted_speedup": round(statistics.median(p.predicted(t_step, costs, sample_s)
                                                                  for p in c.prompts), 2),
                     "speedup": round(statistics.median(c.ratios), 2),
                     "speedup_with_prefill": round(statistics.median(c.whole_ratios), 2), "prompts": len(c.ratios)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm bench real-speculation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                        help='one {"prompt": "...", "kind": "chat|code|grounded"} per line '
                        "(default: the built-in workloads)")
    add_json_arg(parser, "also write the rows as a JSON list")
    parser.add_argument("--methods", type=list_of(str), default=list(METHODS),
                        help=f"comma-separated, from {', '.join(METHODS)} (default all)")
    parser.add_argument("--kinds", type=list_of(str), default=list(KINDS), help="comma-separated workload kinds")
    parser.add_argument("--temperatures", type=list_of(float_in(0.0, 2.0)),
                        default=list(TEMPERATURES), help="comma-separated (default 0,0.7,1)")
    parser.add_argument("--max-new-tokens", type=count, default=48, help="tokens per answer (default 48)")
    parser.add_argument("--repeat", type=count, default=1, help="timed pairs per prompt after the warm-up (default 1)")
    parser.add_argument("--depth", type=int_in(1, 12), default=4, help="EAGLE: draft tokens per round (default 4)")
    parser.add_argument("--confidence", type=float_in(0.0, 1.0), default=0.0,
                        help="EAGLE chain: go past a token only where the draft gave it this probability or more "
                        "(default 0: always --depth tokens)")
    parser.add_argument("--tree-nodes", type=int_in(2, 64), default=12, help="EAGLE tree: nodes verified (default 12)")
    parser.add_argument("--draft", default=None, help="an EAGLE draft file (default: the one shipped for SmolLM2)")
    parser.add_argument("--draft-head", choices=HEAD_FORMATS, default=None,
                        help="EAGLE: the draft's head requantized to these blocks (default: the target's own rows)")
    add_weights_option(parser)
    parser.add_argument("--products", choices=["fast", "blas"], default="fast",
                        help="weight products of plain and speculative decoding alike: fast (streaming where "
                        "measured faster, the default) or blas (the reference)")
    args = parse_args(parser, argv)
    set_fast_products(args.products == "fast")
    products = "streaming where measured faster" if args.products == "fast" else "BLAS"
    print(f"weights {args.weights}; float32 products for this run: {products} (--products {args.products})",
          flush=True)
    unknown = sorted(set(args.methods) - set(METHODS)) + sorted(set(args.kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown method or kind {unknown[0]!r}: methods {', '.join(METHODS)}; "
                         f"kinds {', '.join(KINDS)}")
    prompts = read_prompts(args.prompts) if args.prompts else list(WORKLOADS)
    prompts = [p for p in prompts if p["kind"] in args.kinds]
    if not prompts:
        raise ValueError(f"no prompt of the kinds {', '.join(args.kinds)}")
    model, tok = load_model(SMOLLM2, weights=args.weights)
    proposers = {m: make_proposer(m, model, args) for m in args.methods}
    encoded = [(p["kind"], tok.encode(tok.apply_chat_template([{"role": "user", "content": p["prompt"]}])))
               for p in prompts]
    context = int(statistics.mean(len(ids) for _, ids in encoded)) + args.max_new_tokens // 2
    t_step, costs = verify_costs(model, context, [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20])
    sampling = sampling_costs(model, encoded[0][1], args.temperatures, t_step)
    print(f"decode step {t_step * 1e3:.1f} ms at {context} tokens of context; v(n) "
          + ", ".join(f"{n}: {v:.2f}" for n, v in costs.items()) + "; a plain token's sampling s(T) "
          + ", ".join(f"{t:g}: {v:.3f}" for t, v in sampling.items()), flush=True)
    cells = {(m, k, t): Cell() for m in args.methods for k in KINDS for t in args.temperatures}
    for i, (kind, ids) in enumerate(encoded):
        for temperature in args.temperatures:
            run_prompt(model, ids, args, args.methods, proposers, temperature, cells, kind, seed=i,
                       eos=tok.eos_token_id)
        print(f"  prompt {i + 1}/{len(encoded)} ({kind}) done", flush=True)
    rows = rows_of(cells, t_step, costs, sampling)
    print(format_table(rows, ["method", "kind", "temperature", "identical", "alpha", "tau", "tokens_per_call",
                              "verify_n", "v_n", "draft_c", "c_per_forward", "c_after_prompt", "prompt_catch_up",
                              "accept_a", "sample_s", "in_vocab", "predicted_speedup", "speedup",
                              "speedup_with_prefill", "prompts"]))
    if args.json:
        keys = ("method", "kind", "temperature", "identical", "alpha", "tau", "tokens_per_call", "predicted_speedup",
                "speedup", "speedup_with_prefill")
        write_json(args.json, [{k: r[k] for k in keys} for r in rows])
    return 0
