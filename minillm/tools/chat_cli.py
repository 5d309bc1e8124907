"""``python -m minillm chat``: talk to a model in the terminal (``minillm.chat.Chat``), or answer one message."""

from __future__ import annotations

import argparse
import sys

from ..chat import COMMANDS, DEFAULT_MODEL, Chat, turn_summary
from ..kv_cache import CacheFullError
from ..registry import load_model
from ..sampling import SamplingSettings
from .options import (
    MAX_NEW_TOKENS,
    add_activations_option,
    add_weights_option,
    finite_float,
    new_tokens,
    positive_int,
    seed_int,
    set_activations,
)

SPECULATE = ("off", "eagle", "lookup", "eagle-lookup", "auto")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The chat options, for this module's parser and for a ``chat`` subcommand of the CLI."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or .gguf path (default {DEFAULT_MODEL})")
    add_weights_option(p)
    add_activations_option(p)
    p.add_argument("--system", help="system prompt (default: the model's own)")
    p.add_argument("--temperature", type=finite_float, default=0.2, help="0 = greedy (default 0.2)")
    p.add_argument("--top-p", type=finite_float, default=0.9, help="nucleus sampling mass (default 0.9)")
    p.add_argument("--max-new-tokens", type=new_tokens, default=256,
                   help=f"longest reply in tokens, at most {MAX_NEW_TOKENS:,} and the context (default 256)")
    p.add_argument("--context", type=positive_int, help="KV cache length in tokens (default: the model's context)")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed, 0 to 2**63 - 1 (default 0)")
    p.add_argument("--prompt", help="answer this one message and exit (no interactive loop)")
    p.add_argument("--speculate", choices=SPECULATE, default="off",
                   help="decode replies speculatively: eagle (the EAGLE draft), lookup (prompt lookup), eagle-lookup "
                   "(the draft's guess, and lookup's where the text repeats), auto (plain, eagle-lookup and lookup "
                   "each timed on the first replies, the fastest kept); the replies are the model's own (default off)")
    p.add_argument("--eagle-draft", metavar="DRAFT.npz", default=None,
                   help="--speculate eagle, eagle-lookup or auto: a draft written by eagle-train (default: the one "
                   "shipped)")


def new_chat(args, model, tokenizer):
    """A ``Chat``, or with ``--speculate`` a ``SpeculativeChat`` on the proposers it names."""
    options = {"system": args.system, "max_len": args.context, "seed": args.seed}
    if args.speculate == "off":
        return Chat(model, tokenizer, **options)
    from ..speculative_chat import SpeculativeChat, chat_proposers

    proposers = chat_proposers(model, args.speculate, args.model, args.eagle_draft)
    return SpeculativeChat(model, tokenizer, proposers, args.speculate, **options)


def replace_bad_bytes(stream) -> None:
    """Make ``input()`` read a byte that is not valid in the stream's encoding as U+FFFD.

    With strict decoding (``PYTHONIOENCODING=utf-8``) one such byte raised UnicodeDecodeError and
    ended the session; now the message goes to the model with a replacement character.
    """
    if hasattr(stream, "reconfigure"):  # a text stream over bytes (a terminal, a pipe, a file)
        stream.reconfigure(errors="replace")


def check_message(text: str, option: str) -> str:
    """A message given on the command line must have some text; ValueError naming the option."""
    if not text.strip():
        raise ValueError(f"{option} is empty: give the message to answer")
    return text


def run(args, loader=load_model, read=input) -> int:
    """Check the options (ValueError, before loading anything), load the model, chat.

    ``loader(name, weights=...) -> (model, tokenizer)`` and ``read(prompt) -> str`` can be swapped in tests;
    reading with ``input``, stdin's undecodable bytes become U+FFFD (``replace_bad_bytes``).
    """
    SamplingSettings(args.temperature, None, args.top_p)  # refuses bad values before the model loads
    if args.prompt is not None:
        check_message(args.prompt, "--prompt")
    model, tokenizer = loader(args.model, weights=args.weights)
    set_activations(model, args.activations)
    chat = new_chat(args, model, tokenizer)
    told = [None]  # the choice last said

    def say(message: str) -> int:
        """Stream the reply to stdout, its summary to stderr -> 0; a bad message: one line on stderr -> 1."""
        try:
            reply = chat.turn(message, args.max_new_tokens, args.temperature, top_p=args.top_p,
                              on_text=lambda s: print(s, end="", flush=True))
        except (ValueError, CacheFullError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\n(interrupted: that message is forgotten)", file=sys.stderr)
            return 1
        print()
        print(turn_summary(reply), file=sys.stderr)
        note = getattr(chat, "choice_note", None)
        if note and told[0] != chat.chosen:  # --speculate auto chooses each reply: said when the choice changes
            print(f"[{note}]", file=sys.stderr)
            told[0] = chat.chosen
        return 0

    if args.prompt is not None:
        return say(args.prompt)
    if read is input:
        replace_bad_bytes(sys.stdin)
    print(f"chatting with {args.model} (context {chat.cache.max_len} tokens); {COMMANDS}", file=sys.stderr)
    while True:
        try:
            message = read("you> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if message.strip() in ("/quit", "/exit"):
            return 0
        if message.strip() == "/reset":
            chat.reset()
            print("(new conversation)", file=sys.stderr)
            continue
        say(message)


def main(argv=None, loader=load_model, read=input) -> int:
    """``python -m minillm chat [options]``: a bad option or input prints one line (exit 1), no traceback."""
    p = argparse.ArgumentParser(prog="python -m minillm chat", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args, loader, read)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
