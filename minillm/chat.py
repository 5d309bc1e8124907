"""``python -m minillm chat``: talk to a model, the conversation kept in one KV cache across turns.

A turn renders the whole conversation with the chat template, but feeds the model only the text
its cache does not hold yet: on the first turn the system prompt, the message and the assistant
header; on later turns the end of the previous reply, the new message and the header. The
conversation prefix is never recomputed, so the time to first token (TTFT) of turn n depends on
the length of message n, not on the length of the conversation.

The reply is decoded one token at a time until the model ends its turn (the tokenizer's eos,
``<|im_end|>`` for ChatML) or writes max_new_tokens. Text is printed as it comes; a token can end
inside a multi-byte UTF-8 character (🤗 is 4 bytes spread over 3 tokens), so the bytes go through
an incremental UTF-8 decoder that holds an incomplete character until its last byte arrives.

The model is any ``forward(idx, cache)`` model; the tokenizer needs ``encode``, ``decode``,
``token_bytes`` (id -> bytes), ``apply_chat_template`` and ``eos_token_id`` (``minillm.bpe``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from .backend import xp
from .generate import GenerationStats
from .kv_cache import CacheFullError, KVCache
from .registry import load_model
from .sampling import SamplingSettings
from .tokenizer import TextStream

DEFAULT_MODEL = "smollm2-135m"
COMMANDS = "/reset starts a new conversation, /quit (or Ctrl-D) ends"


@dataclass
class Reply:
    text: str
    tokens: list  # the reply's tokens, without the end-of-turn token
    finish: str  # "end of turn", "max_new_tokens" or "context full"
    stats: GenerationStats  # prompt_tokens: fed this turn; reused_prefix_tokens: already cached


class Chat:
    """One conversation with a model; its tokens stay in a KV cache from turn to turn.

    ``cached_text`` is the conversation text the cache holds, plus ``pending``: the reply's last
    token when the reply was cut short (it was sampled but not yet fed; the next turn feeds it).
    """

    def __init__(self, model, tokenizer, system: str | None = None, max_len: int | None = None, seed: int = 0):
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.cache = KVCache(model.config, max_len=max_len)
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self) -> None:
        """Start a new conversation: only the system message, an empty cache."""
        self.messages = [] if self.system is None else [{"role": "system", "content": self.system}]
        self.cache.reset()
        self.cached_text, self.pending = "", []

    def prefill(self, message: str):
        """Feed the model the tokens its cache lacks for conversation + message + assistant header.

        -> (logits (V,) for the first reply token, tokens fed). Raises CacheFullError, changing
        nothing, when they would leave no room for a reply.
        """
        full = self.tokenizer.apply_chat_template([*self.messages, {"role": "user", "content": message}],
                                                  add_generation_prompt=True)
        if not full.startswith(self.cached_text):
            raise ValueError("the chat template rewrites earlier turns; the cached conversation cannot be extended")
        ids = self.pending + self.tokenizer.encode(full[len(self.cached_text) :])
        if self.cache.length + len(ids) >= self.cache.max_len:
            raise CacheFullError(f"the conversation needs {self.cache.length + len(ids)} tokens plus a reply but the "
                                 f"context holds {self.cache.max_len}: /reset to start over")
        logits = self.model.forward(xp.asarray([ids]), self.cache)[0, -1]  # (V,)
        self.messages.append({"role": "user", "content": message})
        self.cached_text, self.pending = full, []
        return logits, len(ids)

    def turn(self, message: str, max_new_tokens: int = 256, temperature: float = 0.2, top_k=None, top_p=None,
             on_text=None) -> Reply:
        """Add a user message and reply to it; ``on_text(str)`` receives the reply as it is written.

        Interrupted (Ctrl-C), the turn is forgotten: the cache is truncated back and the
        conversation is what it was before the message.
        """
        if not message.strip():
            raise ValueError("empty message: type some text (/reset starts over, /quit ends)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        settings = SamplingSettings(temperature, top_k, top_p)
        before = (self.cache.length, len(self.messages), self.cached_text, self.pending)
        try:
            return self.reply(message, max_new_tokens, settings, on_text)
        except KeyboardInterrupt:
            self.cache.truncate(before[0])
            del self.messages[before[1] :]
            self.cached_text, self.pending = before[2:]
            raise

    def reply(self, message, max_new_tokens, settings: SamplingSettings, on_text) -> Reply:
        """The turn itself: prefill the new tokens, then sample, stream and feed one token at a time."""
        t0, cached = time.perf_counter(), self.cache.length
        logits, fed = self.prefill(message)
        tokens, times = [], []
        text = TextStream(self.tokenizer)
        while True:  # each pass samples a token; the reply grows until one of the two breaks
            token = settings.next_token(logits, self.rng)
            times.append(time.perf_counter() - t0)
            if token == self.tokenizer.eos_token_id:
                finish = "end of turn"
                break
            tokens.append(token)
            if on_text is not None:
                on_text(text.push(token))
            cache_full = self.cache.length == self.cache.max_len
            if cache_full or len(tokens) == max_new_tokens:
                finish = "context full" if cache_full else "max_new_tokens"
                self.pending = [token]  # sampled, not fed: the next turn feeds it first
                break
            logits = self.model.forward(xp.asarray([[token]]), self.cache)[0, -1]  # (V,)
        if on_text is not None:
            on_text(text.flush())
        text = self.tokenizer.decode(tokens)
        self.messages.append({"role": "assistant", "content": text})
        self.cached_text += text
        steps = np.diff([0.0, *times])  # the first is the TTFT
        stats = GenerationStats(prompt_tokens=fed, new_tokens=len(times), ttft_s=times[0],
                                tpot_s=float(steps[1:].mean()) if len(steps) > 1 else 0.0, total_s=times[-1],
                                step_times_s=steps.tolist(), kv_bytes=self.cache.nbytes,
                                kv_bytes_used=self.cache.bytes_used, reused_prefix_tokens=cached)
        return Reply(text, tokens, finish, stats)


def answer(model, tokenizer, question: str, stream=None, max_new_tokens: int = 128, temperature: float = 0.0,
           system: str | None = None) -> Reply:
    """One question, one streamed answer (greedy by default): ``stream(str)`` gets the text as it comes."""
    return Chat(model, tokenizer, system=system).turn(question, max_new_tokens, temperature, on_text=stream)


def turn_summary(reply: Reply) -> str:
    """One line: tokens, why the reply ended, TTFT, the cache reuse, speed."""
    s = reply.stats
    return (f"[{len(reply.tokens)} tokens, {reply.finish} | TTFT {s.ttft_s * 1e3:.0f} ms for {s.prompt_tokens} new "
            f"prompt tokens ({s.reused_prefix_tokens} cached) | {s.tpot_s * 1e3:.1f} ms/token | "
            f"{s.tokens_per_s:.1f} tokens/s]")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The chat options, for this module's parser and for a ``chat`` subcommand of the CLI."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or .gguf path (default {DEFAULT_MODEL})")
    p.add_argument("--system", help="system prompt (default: the model's own)")
    p.add_argument("--temperature", type=float, default=0.2, help="0 = greedy (default 0.2)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest reply in tokens (default 256)")
    p.add_argument("--context", type=int, help="KV cache length in tokens (default: the model's context)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--prompt", help="answer this one message and exit (no interactive loop)")


def run(args, loader=load_model, read=input) -> int:
    """Check the options (ValueError, before loading anything), load the model, chat.

    ``loader(name) -> (model, tokenizer)`` and ``read(prompt) -> str`` can be swapped in tests.
    """
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    SamplingSettings(args.temperature, None, args.top_p)  # refuses bad values before the model loads
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty: give the message to answer")
    model, tokenizer = loader(args.model)
    chat = Chat(model, tokenizer, system=args.system, max_len=args.context, seed=args.seed)

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
        return 0

    if args.prompt is not None:
        return say(args.prompt)
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
