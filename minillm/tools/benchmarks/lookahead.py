"""python -m minillm bench lookahead: Jacobi and Lookahead decoding vs plain cached decoding, greedy.

For the character model (``--model target``, prompts from the validation split) or SmolLM2-135M
(``--model smollm2-135m``, chat prompts): first every method's output is checked to be
``generate(temperature=0)``'s, then each is timed against plain decoding in paired alternating runs
(``minillm.measure.time_pairs``). Columns: new tokens per target call, target calls, tokens in one forward
(pending + tree + window), verified tree nodes per call, the cost of one forward of that many
tokens in decode steps (which is why a method that emits 1.8 tokens per call can still be slower),
and the wall-clock speed-up (median of the paired ratios).
"""

from __future__ import annotations

import argparse
import statistics

from ...backend import xp
from ...data import validation_prompts
from ...generate import generate
from ...kv_cache import KVCache
from ...lookahead import LOOKAHEAD_G, LOOKAHEAD_N, LOOKAHEAD_W, Lookahead, jacobi_generate
from ...measure import STEP_CONTEXT, time_pairs
from ...notebook import format_table
from ...registry import SMOLLM2, load_model
from ...token_tree import tree_generate
from ..options import add_weights_option, count, nonnegative_count, positive_int, positive_int_list
from .common import BenchmarkError, new_tokens_in_context, parse_args

FORWARD_PAIRS = 15  # alternating (1-token, n-token) forward pairs per cost measurement

CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a KV cache is in two sentences.",
    "List three fruits and their colours.",
]


def triple(text: str) -> tuple[int, int, int]:
    """'5:7:7' -> (5, 7, 7): N, W, G of a Lookahead configuration."""
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected N:W:G, got {text!r}")
    return tuple(positive_int(p) for p in parts)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m minillm bench lookahead", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="target", help=f"'target' (characters) or '{SMOLLM2}'")
    add_weights_option(p)
    p.add_argument("--tokens", type=count, default=200, help="new tokens per prompt (default 200)")
    p.add_argument("--prompts", type=count, default=3, help="prompts (default 3)")
    p.add_argument("--prompt-len", type=count, default=48, help="characters per validation prompt (default 48)")
    p.add_argument("--ms", type=positive_int_list, default="4,8", help="Jacobi block sizes m (default 4,8)")
    p.add_argument("--configs", type=lambda s: [triple(t) for t in s.split(",")],
                   default=f"{LOOKAHEAD_N}:{LOOKAHEAD_W}:{LOOKAHEAD_G},4:5:5,3:3:3",
                   help="Lookahead N:W:G configurations, comma-separated (default 5:7:7,4:5:5,3:3:3)")
    p.add_argument("--repeat", type=nonnegative_count, default=3,
                   help="paired timed runs per method (median; 0: no timing)")
    return p


def prompts_for(args, tok) -> list:
    if args.model == SMOLLM2:
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
                for q in CHAT_PROMPTS[: args.prompts]]
    return validation_prompts(tok, args.prompts, args.prompt_len)


def forward_cost(model, n: int, repeat: int = FORWARD_PAIRS) -> float:
    """One cached forward over n tokens in decode steps: the median ratio of alternately timed
    (1-token, n-token) forwards after the same cached context (robust to the load drifting)."""
    context = max(1, min(STEP_CONTEXT, model.config.block_size - n))
    cache = KVCache(model.config)
    model.forward(xp.zeros((1, context), dtype=xp.int64), cache)

    def forward(k):
        tokens = xp.ones((1, k), dtype=xp.int64)

        def run():
            cache.truncate(context)
            model.forward(tokens, cache)

        return run

    one, many, _ = time_pairs(forward(1), forward(n), repeat)
    return statistics.median(b / a for a, b in zip(one, many))


def methods(model, args) -> dict:
    """name -> run(prompt, n) -> GenerationResult (plus the Lookahead proposer's window counters)."""
    out = {}
    for m in args.ms:
        out[f"jacobi m={m}"] = lambda p, n, m=m: (jacobi_generate(model, p, n, m=m), None)
    for N, W, G in args.configs:
        for from_prompt in (False, True):
            name = f"lookahead {N}:{W}:{G}" + (" +prompt pool" if from_prompt else "")

            def run(p, n, N=N, W=W, G=G, from_prompt=from_prompt):
                la = Lookahead(N, W, G, pool_from_prompt=from_prompt)
                return tree_generate(model, p, n, la), la

            out[name] = run
    return out


def main(argv: list[str]) -> int:
    args = parse_args(build_parser(), argv)
    model, tok = load_model(args.model, weights=args.weights)
    prompts = prompts_for(args, tok)
    n_new = new_tokens_in_context(args.tokens, max(len(p) for p in prompts), model.config.block_size)
    print(f"model {args.model}: {model.num_params():,} params; {len(prompts)} prompts x {n_new} new tokens, greedy")

    reference = [generate(model, p, n_new, temperature=0).tokens for p in prompts]
    runs = methods(model, args)
    rows = []
    for name, run in runs.items():
        results = [run(p, n_new) for p in prompts]
        if [r.tokens for r, _ in results] != reference:
            raise BenchmarkError(f"{name}: greedy output differs from generate(temperature=0)")
        calls = sum(r.stats.target_calls for r, _ in results)
        verified = sum(r.stats.verified for r, _ in results)
        window = sum(la.window_tokens for _, la in results if la is not None)
        fed = (verified + window) / calls + 1  # + the root (or the pending token)
        rows.append({"method": name, "tokens/call": n_new * len(prompts) / calls, "calls": calls,
                     "tokens/forward": fed, "tree nodes/call": verified / calls,
                     "forward cost (steps)": forward_cost(model, round(fed))})
    print("validated: every method's greedy output == generate(temperature=0)")

    if args.repeat > 0:
        for row in rows:
            run = runs[row["method"]]
            base, cand, _ = time_pairs(lambda: [generate(model, p, n_new, temperature=0) for p in prompts],
                                       lambda run=run: [run(p, n_new) for p in prompts], args.repeat)
            row["plain s"], row["method s"] = statistics.median(base), statistics.median(cand)
            row["speed-up"] = statistics.median(b / c for b, c in zip(base, cand))
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
