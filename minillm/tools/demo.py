"""``python -m minillm``: the main demo, in two parts.

1. A real model: SmolLM2-135M-Instruct (chapter 8), run from its 4-bit GGUF in plain arrays, answers
   a question; the answer streams as it is generated, then its TTFT and tokens/s.
2. Speculative decoding (chapter 5): the shipped character-level target writes a passage twice, once
   with plain cached decoding (``minillm.generate``) and once with speculative decoding (the shipped
   1-layer draft proposing K tokens per target call), then prints both passages and a stats table.

Under greedy decoding (the default) the two passages are identical, token for token: speculative
decoding changes the speed, never the text. At a temperature above 0 each passage is a sample
from the same distribution, so they differ.
"""

from __future__ import annotations

import argparse
import sys

from ..chat import answer, turn_summary
from ..checkpoint import CheckpointError, load_model
from ..generate import generate
from ..notebook import format_table
from ..registry import SMOLLM2
from ..registry import load_model as load_any_model
from ..sampling import SamplingSettings
from ..speculative import speculative_generate
from .chat_cli import check_message
from .options import finite_float, nonnegative_int, positive_int

DEFAULT_PROMPT = "ROMEO:\nBut soft, what light"
DEFAULT_QUESTION = "What is the capital of France?"
WARMUP_TOKENS = 8  # untimed runs first, so neither method pays for first-call overheads


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options, on its own parser or on the CLI's ``demo`` subcommand."""
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text to continue (default {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, help="characters to write (default 200)")
    p.add_argument("--k", type=positive_int, default=4, help="draft tokens per target call (default 4)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="sampling seed (default 0)")
    p.add_argument("--question", default=DEFAULT_QUESTION, help="what the real model is asked (part 1)")
    p.add_argument("--answer-tokens", type=positive_int, default=48, help="longest answer in tokens (default 48)")
    p.add_argument("--no-real-model", action="store_true", help="skip part 1 (SmolLM2)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def real_model_answer(args) -> None:
    """Part 1: SmolLM2 answers ``args.question``, greedy, streamed; a missing model is one line."""
    print(f"=== a real model: {SMOLLM2} (SmolLM2-135M-Instruct, Llama architecture, 4-bit GGUF) ===")
    try:
        model, tok = load_any_model(SMOLLM2)
    except CheckpointError as exc:  # GGUFError: the model package is not installed, or its file is damaged
        print(f"(skipped: {exc})\n")
        return
    print(f"{model.num_params():,} params, {model.config.n_layer} layers, {model.config.n_head} query heads "
          f"sharing {model.config.n_kv_head} KV heads\nuser: {args.question}\nassistant: ", end="", flush=True)
    reply = answer(model, tok, args.question, lambda text: print(text, end="", flush=True), args.answer_tokens)
    print(f"\n{turn_summary(reply)}\n")


def run(args) -> int:
    """The demo with parsed options; an error in them or in the shipped models is one line, exit 1."""
    try:
        SamplingSettings(args.temperature)  # refuses bad values before the models load
        if not args.no_real_model:
            check_message(args.question, "--question")
        target, tok = load_model("target")
        draft, _ = load_model("draft")
        prompt = tok.encode(args.prompt)
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.no_real_model:
        real_model_answer(args)
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
    rows = [
        {"method": "plain cached", "TTFT ms": ps.ttft_s * 1e3, "ms/token": ps.tpot_s * 1e3,
         "tokens/s": ps.tokens_per_s, "target calls": ps.new_tokens, "tokens/call": 1.0,
         "alpha": "", "speed-up": 1.0},
        {"method": f"speculative K={args.k}", "TTFT ms": spec.ttft_s * 1e3, "ms/token": spec.tpot_s * 1e3,
         "tokens/s": spec.tokens_per_s, "target calls": spec.target_calls,
         "tokens/call": spec.tokens_per_call, "alpha": spec.alpha,
         "speed-up": spec.tokens_per_s / ps.tokens_per_s},
    ]
    print()
    print(format_table(rows))
    print("\nTTFT: prompt in -> first token(s) out. ms/token: mean time per token after those. "
          "alpha: share of checked draft tokens the target accepted.")
    return 0 if same or args.temperature > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
