"""``python -m minillm bench serve-speculation``: the serving engine's speculation for a lone request, on SmolLM2.

    python -m minillm bench serve-speculation [--prompts FILE.jsonl] [--max-new-tokens 64] [--repeat 3] [--json OUT]

One greedy request at a time (each prompt in the chat template) on two engines kept for the whole run, as a
server keeps its one: one with plain steps, one with ``speculate=True`` (``serve --speculate``: a request
running alone feeds its last token and what prompt lookup copies from earlier in its text,
``Engine._speculative_step``, while the engine's ``LoneTimer`` measures that faster; ``--always``: at every
step). Per prompt: a warm-up on both that must give the same tokens (``BenchmarkError`` otherwise: nothing
wrong is timed), then ``--repeat`` alternating timed pairs (plain, speculating), the prompt's prefill included. A
kind's speed-up is the median over its prompts of (plain seconds / speculating seconds); tokens per step
is the speculating engine's tokens after the first over its decode steps.
"""

from __future__ import annotations

import argparse
import statistics

from ...measure import timed
from ...notebook import format_table
from ...paged_kv import num_blocks_for
from ...registry import SMOLLM2, load_model
from ...serving import Engine, LoneTimer, Request
from ...workloads import KINDS, WORKLOADS, read_prompts
from ..options import add_weights_option, count
from .common import BenchmarkError, add_json_arg, parse_args, write_json

PAGE_SIZE = 16


class AlwaysSpeculates(LoneTimer):
    """--always: the engine speculates at every lone step, whatever its clock says (the mechanism alone)."""

    def speculates(self) -> bool:
        return True


def new_engine(model, max_tokens: int, speculate: bool, always: bool = False) -> Engine:
    """An engine for one request at a time of up to ``max_tokens`` tokens, kept across requests as a server keeps
    its one (its ``LoneTimer`` learns from every request)."""
    engine = Engine(model, num_blocks=num_blocks_for(max_tokens, PAGE_SIZE), page_size=PAGE_SIZE,
                    max_num_batched_tokens=max_tokens, max_num_seqs=1, speculate=speculate)
    if always:
        engine.lone_timer = AlwaysSpeculates()
    return engine


def run_alone(engine: Engine, ids: list, max_new_tokens: int) -> tuple[list, int]:
    """One greedy request, alone on ``engine`` -> (its output tokens, its decode steps)."""
    start = len(engine.history)
    state = engine.add_request(Request(tuple(ids), max_new_tokens, temperature=0))
    while engine.has_unfinished:
        engine.step()
    engine.finished.pop(state.id)
    return state.output, sum(1 for r in engine.history[start:] if r.prefill_tokens == 0)


def timed_pairs(engines: tuple, ids: list, max_new_tokens: int, repeat: int) -> tuple[float, float]:
    """``repeat`` alternating runs (plain, speculating) -> (median plain seconds, median speculating seconds)."""
    plain, spec = engines
    pairs = [(timed(lambda: run_alone(plain, ids, max_new_tokens))[0],
              timed(lambda: run_alone(spec, ids, max_new_tokens))[0]) for _ in range(repeat)]
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench serve-speculation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                   help='one {"prompt": "...", "kind": "chat|code|grounded"} per line (default: the workloads)')
    p.add_argument("--max-new-tokens", type=count, default=64, help="tokens per answer (default 64)")
    p.add_argument("--repeat", type=count, default=3, help="timed pairs per prompt after the warm-up (default 3)")
    p.add_argument("--always", action="store_true",
                   help="speculate at every lone step (default: as served, while the engine's clock says it pays)")
    add_weights_option(p)
    add_json_arg(p, "also write the rows as JSON")
    args = parse_args(p, argv)
    prompts = read_prompts(args.prompts) if args.prompts else list(WORKLOADS)
    model, tok = load_model(SMOLLM2, weights=args.weights)
    encoded = [tok.encode(tok.apply_chat_template([{"role": "user", "content": item["prompt"]}])) for item in prompts]
    longest = max(len(ids) for ids in encoded) + args.max_new_tokens
    engines = (new_engine(model, longest, False), new_engine(model, longest, True, args.always))
    cells = {kind: {"ratios": [], "plain_s": 0.0, "spec_s": 0.0, "tokens": 0, "decoded": 0, "steps": 0}
             for kind in KINDS}
    for i, (item, ids) in enumerate(zip(prompts, encoded)):
        plain, _ = run_alone(engines[0], ids, args.max_new_tokens)
        spec, steps = run_alone(engines[1], ids, args.max_new_tokens)
        if spec != plain:
            raise BenchmarkError(f"prompt {i + 1}: the speculating engine's tokens differ from plain steps'")
        plain_s, spec_s = timed_pairs(engines, ids, args.max_new_tokens, args.repeat)
        cell = cells[item["kind"]]
        cell["ratios"].append(plain_s / spec_s)
        cell["plain_s"] += plain_s
        cell["spec_s"] += spec_s
        cell["tokens"] += len(spec)
        cell["decoded"] += len(spec) - 1  # the first token comes from the prefill's step
        cell["steps"] += steps
        print(f"  prompt {i + 1}/{len(prompts)} ({item['kind']}) done", flush=True)
    rows = [{"kind": kind, "prompts": len(c["ratios"]), "identical": True,
             "plain_ms_per_token": round(1e3 * c["plain_s"] / c["tokens"], 2),
             "speculating_ms_per_token": round(1e3 * c["spec_s"] / c["tokens"], 2),
             "tokens_per_step": round(c["decoded"] / max(c["steps"], 1), 2),
             "speedup": round(statistics.median(c["ratios"]), 2)}
            for kind, c in cells.items() if c["ratios"]]
    print(format_table(rows, list(rows[0])))
    if args.json:
        write_json(args.json, rows)
    return 0
