"""Autoregressive generation, two ways: recompute everything (naive) and with a KV cache.

Both share one decode loop (``_decode``); they differ only in how the next logits are computed:

- ``generate_naive``: every step runs the whole context through the model again.
- ``generate``: the first step *prefills* the prompt into a KV cache (slow: the time to first
  token, TTFT); every later step feeds one token (fast: the time per output token, TPOT).

Context policy. ``generate_naive`` crops the context to its last ``block_size`` tokens at every
step (a sliding window). ``generate`` cannot slide a cache cheaply (every cached key was computed at
its absolute position), so when the cache is full it keeps the last ``block_size // 2`` tokens,
resets the cache and prefills them again; this costs one half-window prefill every
``block_size // 2`` tokens. The two agree token for token until the context first passes
``block_size``; after that they condition on different windows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import synchronize, xp
from .kv_cache import KVCache
from .sampling import next_token


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    ttft_s: float  # prompt in -> first new token out (includes the prefill)
    tpot_s: float  # mean time per output token after the first
    total_s: float
    step_times_s: list = field(default_factory=list)  # time of each step, the first is the TTFT
    kv_bytes: int = 0  # bytes of KV cache allocated (0 for naive generation)
    kv_bytes_used: int = 0  # bytes holding valid tokens at the end
    reused_prefix_tokens: int = 0  # prompt tokens taken from a PrefixCache instead of computed
    reprefills: int = 0  # times the context overflowed and the window was prefilled again

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("inf")


@dataclass
class GenerationResult:
    tokens: list  # the new tokens only
    stats: GenerationStats


def _check_args(prompt_ids, max_new_tokens) -> list[int]:
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return prompt_ids


def _decode(first_logits, next_logits, prompt_ids, max_new_tokens, temperature, top_k, top_p,
            seed, on_token) -> tuple[list, list]:  # fmt: skip
    """The loop both generators share: sample, report, compute the next logits.

    first_logits() -> (V,) logits after the prompt; next_logits(tokens) -> (V,) logits after the
    full token list. Returns (new tokens, per-step wall times).
    """
    rng = np.random.default_rng(seed)
    new, times = [], []
    t0 = time.perf_counter()
    logits = first_logits()
    for i in range(max_new_tokens):
        token = next_token(logits, rng, temperature, top_k, top_p)
        new.append(token)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
        if on_token is not None:
            on_token(token)
        if i + 1 < max_new_tokens:
            logits = next_logits(prompt_ids + new)
    synchronize()
    return new, times


def _stats(prompt_ids, tokens, times, **kw) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=len(prompt_ids),
        new_tokens=len(tokens),
        ttft_s=times[0] if times else 0.0,
        tpot_s=float(np.mean(times[1:])) if len(times) > 1 else 0.0,
        total_s=float(sum(times)),
        step_times_s=times,
        **kw,
    )


def generate_naive(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                   seed=0, on_token=None) -> GenerationResult:  # fmt: skip
    """Generate by running the whole context (cropped to block_size) through the model each step.

    The baseline the KV cache beats: step N recomputes K and V for all N earlier tokens.
    """
    prompt_ids = _check_args(prompt_ids, max_new_tokens)
    block = model.config.block_size

    def logits_after(tokens):
        return model.forward(xp.asarray([tokens[-block:]]))[0, -1]  # (V,)

    tokens, times = _decode(lambda: logits_after(prompt_ids), logits_after, prompt_ids,
                            max_new_tokens, temperature, top_k, top_p, seed, on_token)  # fmt: skip
    return GenerationResult(tokens, _stats(prompt_ids, tokens, times))


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, seed=0,
             cache=None, prefix_cache=None, on_token=None) -> GenerationResult:  # fmt: skip
    """Generate with a KV cache: prefill the prompt once, then one token per forward call.

    ``cache``: a KVCache to use (it is reset first; a new one of block_size otherwise).
    ``prefix_cache``: a PrefixCache; the longest cached prefix of the prompt is reused.
    ``on_token(token)`` is called as each token is sampled (streaming).
    Returns the new tokens and stats (TTFT, TPOT, tokens/s, KV bytes).
    """
    prompt_ids = _check_args(prompt_ids, max_new_tokens)
    cache = KVCache(model.config) if cache is None else cache
    cache.reset()  # a cache reused from an earlier generation would otherwise leak its tokens
    keep = max(1, model.config.block_size // 2)  # the window kept when the context overflows
    counters = {"reused": 0, "reprefills": 0}

    def prefill(tokens):
        """Reset the cache and run ``tokens`` (at most a window) through it -> last logits."""
        tokens = tokens[-cache.max_len :]
        if prefix_cache is not None:
            logits, counters["reused"] = prefix_cache.prefill(model, tokens, cache)
            return logits
        cache.reset()
        return model.forward(xp.asarray([tokens]), cache)[0, -1]

    def next_logits(tokens):
        # EXERCISE 3.3 BEGIN: feed only the newest token; re-prefill a half window when full
        if cache.length + 1 > cache.max_len:
            counters["reprefills"] += 1
            cache.reset()
            return model.forward(xp.asarray([tokens[-keep:]]), cache)[0, -1]
        return model.forward(xp.asarray([tokens[-1:]]), cache)[0, -1]
        # EXERCISE 3.3 END

    tokens, times = _decode(lambda: prefill(prompt_ids), next_logits, prompt_ids, max_new_tokens,
                            temperature, top_k, top_p, seed, on_token)  # fmt: skip
    stats = _stats(prompt_ids, tokens, times, kv_bytes=cache.nbytes, kv_bytes_used=cache.bytes_used,
                   reused_prefix_tokens=counters["reused"], reprefills=counters["reprefills"])  # fmt: skip
    return GenerationResult(tokens, stats)
