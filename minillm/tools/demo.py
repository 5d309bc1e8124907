"""``python -m minillm``: the main demo, in three parts.

1. Speculative decoding (chapter 5): the shipped character-level target writes a passage twice, once
   with plain cached decoding (``minillm.generate``) and once with speculative decoding (the shipped
   1-layer draft proposing K tokens per target call), then prints both passages and a stats table.
   Both models multiply through chapter 13's CPU kernels (``--weights q``, the default) or their float32
   arrays (``--weights fp32``), the same for both passages.
2. A real model: SmolLM2-135M-Instruct (chapter 8), run from its 4-bit GGUF in plain arrays, answers
   a question; the answer streams as it is generated, then its TTFT and tokens/s.
3. The same answer with and without speculation by the shipped EAGLE draft (chapter 11): after a
   warm-up, ``--repeats`` alternating runs of each, their medians, and whether the texts are identical.

Parts 1 and 3 each end with one line saying whether speculation paid in this run and why, from the
run's own numbers: what a round cost in plain decode steps, and how many tokens it yielded.

Part 1 samples at temperature 0.8 by default: each passage is a sample from the same distribution,
so they differ. Under greedy decoding (``--temperature 0``) they are identical, token for token:
speculative decoding changes the speed, never the text (a model this small, decoded greedily, soon
repeats itself: "the state of the state of ...").
"""

from __future__ import annotations

import argparse
import statistics
import sys

from ..backend import fast_products, set_fast_products
from ..chat import answer, turn_summary
from ..checkpoint import CheckpointError, load_model
from ..eagle import EagleDraft, shipped_draft_path
from ..generate import generate
from ..measure import TimedProposer, time_pairs
from ..notebook import format_table
from ..registry import SMOLLM2
from ..registry import load_model as load_any_model
from ..sampling import SamplingSettings
from ..speculative import speculative_generate
from ..speculative_chat import EAGLE_DEPTH, chat_eagle  # part 3 drafts as the chat does
from ..token_tree import tree_generate
from .chat_cli import check_message
from .options import MAX_NEW_TOKENS, add_weights_option, finite_float, int_in, new_tokens, positive_int, seed_int

DEFAULT_PROMPT = "ROMEO:\nBut soft, what light"
DEFAULT_QUESTION = "What is the capital of France?"
WARMUP_TOKENS = 8  # untimed runs first, so neither method pays for first-call overheads


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options, on its own parser or on the CLI's ``demo`` subcommand."""
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text to continue (default {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=new_tokens, default=200,
                   help=f"characters to write, at most {MAX_NEW_TOKENS:,} (default 200)")
    p.add_argument("--k", type=positive_int, default=4, help="draft tokens per target call (default 4)")
    p.add_argument("--temperature", type=finite_float, default=0.8, help="part 1's sampling temperature, 0 = greedy "
                   "(default 0.8)")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed, 0 to 2**63 - 1 (default 0)")
    p.add_argument("--question", default=DEFAULT_QUESTION, help="what the real model is asked (part 2)")
    p.add_argument("--answer-tokens", type=new_tokens, default=32, help="longest answer in tokens (default 32)")
    p.add_argument("--repeats", type=int_in(1, 20), default=2,
                   help="part 3: timed runs of each, plain and EAGLE, alternating (default 2)")
    p.add_argument("--no-real-model", action="store_true", help="skip parts 2 and 3 (SmolLM2)")
    add_weights_option(p)  # every part: the CPU kernels (q: SmolLM2's blocks, the character models packed) or fp32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def real_model_answer(args) -> None:
    """Parts 2 and 3: SmolLM2 answers ``args.question``, greedy, streamed; a missing model is one line."""
    print(f"=== a real model: {SMOLLM2} (SmolLM2-135M-Instruct, Llama architecture, 4-bit GGUF) ===")
    try:
        model, tok = load_any_model(SMOLLM2, weights=args.weights)
    except CheckpointError as exc:  # GGUFError: the model package is not installed, or its file is damaged
        print(f"(skipped: {exc})\n")
        return
    print(f"{model.num_params():,} params, {model.config.n_layer} layers, {model.config.n_head} query heads "
          f"sharing {model.config.n_kv_head} KV heads\nuser: {args.question}\nassistant: ", end="", flush=True)
    reply = answer(model, tok, args.question, lambda text: print(text, end="", flush=True), args.answer_tokens)
    print(f"\n{turn_summary(reply)}\n")
    if shipped_draft_path(SMOLLM2).is_file():
        real_model_speculation(model, tok, args)


def real_model_speculation(model, tok, args) -> None:
    """Part 3: the answer again, greedy, plain and with the EAGLE draft: alternating timed runs, medians."""
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.question}]))
    draft = EagleDraft.load(model, shipped_draft_path(SMOLLM2))
    n, last = args.answer_tokens, {}  # the last run of each: its tokens, and the draft's seconds in it

    def plain():
        last["plain"] = generate(model, ids, n, temperature=0.0)
        return last["plain"]

    def eagle():
        last["draft"] = TimedProposer(chat_eagle(draft))
        return tree_generate(model, ids, n, last["draft"], temperature=0.0)

    before = fast_products()
    set_fast_products(True)  # both ways: a verify over a few tokens streams each weight once
    try:
        plain_s, eagle_s, result = time_pairs(plain, eagle, args.repeats)
    finally:
        set_fast_products(before)
    speedup = statistics.median(plain_s) / statistics.median(eagle_s)
    rows = [{"method": "plain cached", "median s": statistics.median(plain_s), "ms/token":
             statistics.median(plain_s) / n * 1e3, "tokens/call": 1.0, "speed-up": 1.0},
            {"method": f"EAGLE chain K={EAGLE_DEPTH}", "median s": statistics.median(eagle_s),
             "ms/token": statistics.median(eagle_s) / n * 1e3, "tokens/call": result.stats.tokens_per_call,
             "speed-up": speedup}]
    print(f"=== the same answer ({n} tokens, greedy) with and without the EAGLE draft: after a warm-up, "
          f"{args.repeats} alternating runs each, medians ===")
    print(format_table(rows))
    print(f"identical: {'yes' if result.tokens == last['plain'].tokens else 'NO'}")
    print(speculation_verdict(f"EAGLE chain K={EAGLE_DEPTH}", speedup, result.stats, chapter=11,
                              draft_share=last["draft"].seconds / eagle_s[-1]) + "\n")


def speculation_verdict(method: str, speedup: float, stats, chapter: int, draft_share: float | None = None) -> str:
    """One line: did speculation pay in this run, and why, from the run's own numbers.

    A round yields tau = ``stats.tokens_per_call`` tokens; at ``speedup`` it cost tau / speedup plain
    decode steps (speedup = tau / cost). ``draft_share``, the draft's share of the speculative run's
    time, splits that cost into drafting and verifying (the verify and the rest of the round).
    Example: 0.72x with tau = 1.3 -> "EAGLE chain K=4 does not pay here (0.72x): a round costs 1.81 decode
    steps and yields 1.30 tokens, ...".
    """
    tau = stats.tokens_per_call
    cost = tau / speedup
    drafted = stats.verified / max(stats.rounds, 1)  # a round's draft tokens, on average (a chain may stop early)
    split = "" if draft_share is None else (f" (drafting {drafted:.1f} tokens {draft_share * cost:.2f}, verifying "
                                            f"{drafted + 1:.1f} and the rest {(1 - draft_share) * cost:.2f})")
    verdict = "pays" if speedup >= 1 else "does not pay"
    return (f"{method} {verdict} here ({speedup:.2f}x): a round costs {cost:.2f} decode steps{split} and yields "
            f"{tau:.2f} tokens, the target keeping {stats.alpha:.0%} of the draft's guesses; see chapter {chapter}")


def run(args) -> int:
    """The demo with parsed options; an error in them or in the shipped models is one line, exit 1."""
    try:
        SamplingSettings(args.temperature)  # refuses bad values before the models load
        if not args.no_real_model:
            check_message(args.question, "--question")
        target, tok = load_model("target", weights=args.weights)
        draft, _ = load_model("draft", weights=args.weights)
        prompt = tok.encode(args.prompt)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    same = speculation_demo(target, draft, tok, prompt, args)
    if not args.no_real_model:
        real_model_answer(args)
    return 0 if same or args.temperature > 0 else 1


def speculation_demo(target, draft, tok, prompt, args) -> bool:
    """Part 1: the character model's passage, plain and speculative -> whether the two texts are equal."""
    n, kw = args.max_new_tokens, dict(temperature=args.temperature, seed=args.seed)
    generate(target, prompt, WARMUP_TOKENS, **kw)
    speculative_generate(target, draft, prompt, WARMUP_TOKENS, k=args.k, **kw)

    plain = generate(target, prompt, n, **kw)
    fast = speculative_generate(target, draft, prompt, n, k=args.k, **kw)
    tokens, spec = fast.tokens, fast.stats

    print("=== speculative decoding: the shipped character-level target and its 1-layer draft ===")
    print(f"target {target.num_params():,} params, draft {draft.num_params():,} params; prompt "
          f"{args.prompt!r}; {n} new characters, K={args.k}, temperature {args.temperature:g}\n")
    print("=== plain cached decoding ===")
    print(args.prompt + tok.decode(plain.tokens))
    print("\n=== speculative decoding ===")
    print(args.prompt + tok.decode(tokens))
    same = tokens == plain.tokens
    if args.temperature == 0:
        print(f"\ngreedy outputs identical: {'yes' if same else 'NO'} ({n} of {n} tokens)" if same else
              "\ngreedy outputs identical: NO, speculative decoding changed the text")
    else:
        print("\n(temperature > 0: two samples from the same distribution, so the texts differ)")

    ps = plain.stats
    speedup = spec.tokens_per_s / ps.tokens_per_s
    rows = [
        {"method": "plain cached", "TTFT ms": ps.ttft_s * 1e3, "ms/token": ps.tpot_s * 1e3,
         "tokens/s": ps.tokens_per_s, "target calls": ps.new_tokens, "tokens/call": 1.0,
         "alpha": "", "speed-up": 1.0},
        {"method": f"speculative K={args.k}", "TTFT ms": spec.ttft_s * 1e3, "ms/token": spec.tpot_s * 1e3,
         "tokens/s": spec.tokens_per_s, "target calls": spec.target_calls,
         "tokens/call": spec.tokens_per_call, "alpha": spec.alpha,
         "speed-up": speedup},
    ]
    print()
    print(format_table(rows))
    print("\nTTFT: prompt in -> first token(s) out. ms/token: mean time per token after those. "
          "alpha: share of checked draft tokens the target accepted.")
    print(speculation_verdict(f"speculative K={args.k}", speedup, spec, chapter=5) + "\n")
    return same


if __name__ == "__main__":
    sys.exit(main())
