"""A chat with a model, the conversation kept in one KV cache across turns.

A turn renders the whole conversation with the chat template, but feeds the model only the text
its cache does not hold yet: on the first turn the system prompt, the message and the assistant
header; on later turns the end of the previous reply, the new message and the header. The
conversation prefix is never recomputed, so the time to first token (TTFT) of turn n depends on
the length of message n, not on the length of the conversation.

The reply is decoded one token at a time until the model ends its turn (the tokenizer's eos,
``<|im_end|>`` for ChatML) or writes max_new_tokens. Text is printed as it comes; a token can end
inside a multi-byte UTF-8 character (🤗 is 4 bytes spread over 3 tokens), so the bytes go through
an incremental UTF-8 decoder that holds an incomplete character until its last byte arrives.

What the user types is text, never control tokens: the chat template comes in pieces
(``chat_pieces``: its own <|im_start|> and <|im_end|>, and the messages' text between them), and
``encode_pieces`` spells a message that contains "<|im_end|><|im_start|>system" as ordinary tokens,
so typing it cannot end the turn or open a system message.

The model is any ``forward(idx, cache)`` model; the tokenizer needs ``encode``, ``decode``,
``token_bytes`` (id -> bytes), ``chat_pieces``, ``encode_pieces`` and ``eos_token_id``
(``minillm.bpe``).
The command ``python -m minillm chat`` is ``minillm.tools.chat_cli``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .backend import trim_heap, xp
from .generate import GenerationStats, prefill
from .kv_cache import CacheFullError, KVCache
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
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(f"this model is not a chat model: its tokenizer ({type(tokenizer).__name__}) has no "
                             f"chat template; chat with {DEFAULT_MODEL}, or continue text with generate")
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
        pieces = self.tokenizer.chat_pieces([*self.messages, {"role": "user", "content": message}],
                                            add_generation_prompt=True)
        full = "".join(text for text, _ in pieces)
        if not full.startswith(self.cached_text):
            raise ValueError("the chat template rewrites earlier turns; the cached conversation cannot be extended")
        ids = self.pending + self.tokenizer.encode_pieces(pieces_after(pieces, len(self.cached_text)))
        if self.cache.length + len(ids) >= self.cache.max_len:
            raise CacheFullError(f"the conversation needs {self.cache.length + len(ids)} tokens plus a reply but the "
                                 f"context holds {self.cache.max_len}: /reset to start over")
        logits = self.feed(ids)
        self.messages.append({"role": "user", "content": message})
        self.cached_text, self.pending = full, []
        return logits, len(ids)

    def feed(self, ids: list):
        """Run the turn's new tokens into the cache (in pieces, ``generate.prefill``) -> the last one's logits (V,)."""
        return prefill(self.model, ids, self.cache)

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
            reply = self.reply(message, max_new_tokens, settings, on_text)
        except KeyboardInterrupt:
            self.cache.truncate(before[0])
            del self.messages[before[1] :]
            self.cached_text, self.pending = before[2:]
            raise
        trim_heap()  # the reply's free heap pages go back to the system (backend's memory policy)
        return reply

    def reply(self, message, max_new_tokens, settings: SamplingSettings, on_text) -> Reply:
        """The turn itself: prefill the new tokens, then ``decode`` the reply, streaming its text."""
        t0, cached = time.perf_counter(), self.cache.length
        logits, fed = self.prefill(message)
        text = TextStream(self.tokenizer)
        emit = (lambda token: on_text(text.push(token))) if on_text is not None else (lambda token: None)
        tokens, times, finish = self.decode(logits, max_new_tokens, settings, emit, t0)
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

    def decode(self, logits, max_new_tokens: int, settings: SamplingSettings, emit, t0: float) -> tuple:
        """Sample, ``emit`` and feed one token at a time from the first token's logits (V,) until the end of the
        turn -> (tokens, the time of each sample since t0, why it ended). A reply cut short leaves its last
        token in ``pending`` (sampled, not fed: the next turn feeds it first)."""
        tokens, times = [], []
        while True:  # each pass samples a token; the reply grows until one of the two returns
            token = settings.next_token(logits, self.rng)
            times.append(time.perf_counter() - t0)
            if token == self.tokenizer.eos_token_id:
                return tokens, times, "end of turn"
            tokens.append(token)
            emit(token)
            cache_full = self.cache.length == self.cache.max_len
            if cache_full or len(tokens) == max_new_tokens:
                self.pending = [token]
                return tokens, times, "context full" if cache_full else "max_new_tokens"
            logits = self.model.forward(xp.asarray([[token]]), self.cache)[0, -1]  # (V,)


def pieces_after(pieces, n: int) -> list:
    """A rendering's (text, is_control) pieces without its first n characters (those the cache holds).

    Example: [("<s>", True), ("user\\nHi", False)], n = 5 -> [("er\\nHi", False)]; a control piece
    cut in part is no longer its token, so what is left of it is text.
    """
    out = []
    for text, control in pieces:
        if n >= len(text):
            n -= len(text)
            continue
        out.append((text[n:], control and n == 0))
        n = 0
    return out


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
