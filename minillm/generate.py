"""Autoregressive generation, two ways: recompute everything (naive) and with a KV cache.

Both share one decode loop (``_decode``); they differ only in how the next logits are computed:

- ``generate_naive``: every step runs the whole context through the model again.
- ``generate``: the first step *prefills* the prompt into a KV cache (slow: the time to first
  token, TTFT); every later step feeds one token (fast: the time per output token, TPOT).

Context policy (``fit_context``, the one function every decoding loop uses: ``generate``,
``speculative_generate``, ``generate_batch``, ``speculative_generate_batch``). ``generate_naive``
crops the context to its last ``block_size`` tokens at every step (a sliding window). A cache cannot
slide cheaply (every cached key was computed at its absolute position), so when the tokens to feed
no longer fit, the cache is reset and the last ``cache.max_len // 2`` tokens are prefilled again;
this costs one half-window prefill every ``max_len // 2`` tokens. The two agree token for token
until the context first passes the window; after that they condition on different windows. A prompt
longer than the window loses its first tokens the same way: every loop's stats count them
(``dropped_prompt_tokens``), so that a caller can say so.

``greedy_generate`` is chapter 12's loop: greedy decoding on the static steps of ``minillm.fused`` (fused
kernels, a CUDA graph per step), the same tokens as ``generate`` at temperature 0, within one block_size.

Every loop returns a ``GenerationResult`` (tokens, stats); the batched loops one per row plus the
batch's stats (``minillm.batch_speculative.BatchResult``). ``Throughput`` gives every stats class
its ``tokens_per_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import synchronize, xp
from .cache_contract import DecodeCache
from .fused import next_id, start_decoding
from .kv_cache import KVCache
from .sampling import SamplingSettings


class Throughput:
    """``tokens_per_s`` for any stats with ``new_tokens`` and ``total_s`` (every loop's stats)."""

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time (inf when no time was measured)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("inf")


@dataclass
class GenerationStats(Throughput):
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
    dropped_prompt_tokens: int = 0  # leading prompt tokens never fed: the prompt was longer than the window


@dataclass
class GenerationResult:
    """What every decoding loop returns for one sequence: the new tokens and the run's statistics."""

    tokens: list  # the new tokens only
    stats: Throughput  # GenerationStats (generate, generate_batch) or SpecStats (speculative)


def check_prompt(prompt_ids, max_new_tokens) -> list[int]:
    """The arguments every loop checks: a non-empty prompt (-> a list of ints), max_new_tokens >= 0."""
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return prompt_ids


def fit_context(cache: DecodeCache, seq, pending, extra: int = 0) -> tuple[list, bool]:
    """The context policy of every decoding loop -> (tokens to feed ``cache`` now, re-prefilled?).

    ``pending``: the tokens at the end of ``seq`` that the cache has not seen (the whole prompt at
    the start); ``extra``: positions the same forward pass adds after them (a round's drafts).
    If length + len(pending) + extra <= max_len they fit and are fed as they are. Otherwise the
    cache is reset and the last max(1, max_len // 2) tokens of ``seq`` are fed instead: half the
    window stays free, so this happens once every max_len // 2 tokens, not at every step. The flag
    is True when cached tokens were thrown away (a prompt longer than the window is not counted):
    every loop adds it to its stats' ``reprefills`` counter, which the tests check.
    Example: max_len 8, length 8, pending [t] -> the cache is reset; feed seq[-4:], True.
    """
    # EXERCISE 3.3 BEGIN: feed pending if it fits; otherwise reset the cache and feed the last half window
    if cache.length + len(pending) + extra <= cache.max_len:
        return pending, False
    reprefilled = cache.length > 0
    cache.reset()
    return seq[-max(1, cache.max_len // 2) :], reprefilled
    # EXERCISE 3.3 END


def call_cache_len(config, prompt_ids, max_new_tokens: int) -> int:
    """Cache positions one call needs: len(prompt) + max_new_tokens, capped at block_size.

    A short answer gets a short cache instead of a full-context one; once the call would pass the
    window the cap makes it the block_size cache, so ``fit_context`` re-prefills exactly as before.
    Example: block_size 1024, a 7-token prompt, 20 new tokens -> 27.
    """
    return min(len(prompt_ids) + max_new_tokens, config.block_size)


def _decode(
    first_logits, next_logits, prompt_ids, max_new_tokens, settings: SamplingSettings, seed, on_token
) -> tuple[list, list]:
    """The loop both generators share: sample, report, compute the next logits.

    first_logits() -> (V,) logits after the prompt; next_logits(tokens) -> (V,) logits after the
    full token list. Returns (new tokens, per-step wall times).
    """
    rng = np.random.default_rng(seed)
    new, times = [], []
    t0 = time.perf_counter()
    logits = first_logits()
    for i in range(max_new_tokens):
        token = settings.next_token(logits, rng)
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


def step_stats(prompt_ids, tokens, times, **kw) -> GenerationStats:
    """GenerationStats of a run from its per-step wall times (the first step's is the TTFT)."""
    return GenerationStats(
        prompt_tokens=len(prompt_ids),
        new_tokens=len(tokens),
        ttft_s=times[0] if times else 0.0,
        tpot_s=float(np.mean(times[1:])) if len(times) > 1 else 0.0,
        total_s=float(sum(times)),
        step_times_s=times,
        **kw,
    )


PREFILL_CHUNK = 512  # prompt tokens per forward in ``prefill``: bounds the (chunk, V) logits it returns


def prefill(model, tokens, cache, chunk: int = PREFILL_CHUNK):
    """Feed a prompt to ``cache`` in pieces of at most ``chunk`` tokens -> the last position's logits (V,).

    The logits equal one forward over the whole prompt: each piece is a prefill after a cache, its
    query i at position Tk - Tq + i, seeing everything before it. What changes is memory: a forward
    returns logits for every position it is given, (T, V) floats -- for a 7,000-token message and
    SmolLM2's 49,152-token vocabulary, 1.4 GB -- and pieces bound that to (chunk, V).
    Example: 1,200 tokens, chunk 512 -> forwards over 512, 512 and 176 tokens.
    """
    *pieces, last = range(0, len(tokens), chunk)  # the start of each piece
    for start in pieces:
        model.forward(xp.asarray([tokens[start : start + chunk]]), cache)
    return model.forward(xp.asarray([tokens[last:]]), cache)[0, -1]


def generate_naive(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                   seed=0, on_token=None) -> GenerationResult:
    """Generate by running the whole context (cropped to block_size) through the model each step.

    The baseline the KV cache beats: step N recomputes K and V for all N earlier tokens.
    """
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    settings = SamplingSettings(temperature, top_k, top_p)
    block = model.config.block_size

    def logits_after(tokens):
        return model.forward(xp.asarray([tokens[-block:]]))[0, -1]  # (V,)

    tokens, times = _decode(
        lambda: logits_after(prompt_ids), logits_after, prompt_ids, max_new_tokens, settings, seed, on_token
    )
    dropped = len(prompt_ids) - len(prompt_ids[-block:])
    return GenerationResult(tokens, step_stats(prompt_ids, tokens, times, dropped_prompt_tokens=dropped))


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, seed=0,
             cache=None, prefix_cache=None, on_token=None) -> GenerationResult:
    """Generate with a KV cache: prefill the prompt once, then one token per forward call.

    ``cache``: a decode cache to use (it is reset first). Without one, a new KVCache sized to what
    this call needs: the prompt's window plus max_new_tokens, at most block_size (``call_cache_len``).
    ``prefix_cache``: a prompt cache (``PrefixCache``, or a ``PagedKVCache`` for its view); the
    longest cached prefix of the prompt is reused.
    ``on_token(token)`` is called as each token is sampled (streaming).
    Returns the new tokens and stats (TTFT, TPOT, tokens/s, KV bytes, re-prefills, prompt tokens
    dropped because the prompt was longer than the cache).
    """
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    settings = SamplingSettings(temperature, top_k, top_p)
    if cache is None:
        cache = KVCache(model.config, max_len=call_cache_len(model.config, prompt_ids, max_new_tokens))
    cache.reset()  # a cache reused from an earlier generation would otherwise leak its tokens
    counters = {"reused": 0, "reprefills": 0, "dropped": 0}

    def prefill_window(prompt):
        """Run the prompt (its window, ``fit_context``) through the empty cache -> last logits."""
        tokens, _ = fit_context(cache, prompt, prompt)
        counters["dropped"] = len(prompt) - len(tokens)
        if prefix_cache is not None:
            logits, counters["reused"] = prefix_cache.prefill(model, tokens, cache)
            return logits
        return prefill(model, tokens, cache)

    def next_logits(tokens):
        """Feed only the newest token (after a re-prefill of a half window when the cache is full)."""
        feed, reprefilled = fit_context(cache, tokens, tokens[-1:])
        counters["reprefills"] += reprefilled
        return model.forward(xp.asarray([feed]), cache)[0, -1]

    tokens, times = _decode(
        lambda: prefill_window(prompt_ids), next_logits, prompt_ids, max_new_tokens, settings, seed, on_token
    )
    stats = step_stats(
        prompt_ids, tokens, times, kv_bytes=cache.nbytes, kv_bytes_used=cache.bytes_used,
        reused_prefix_tokens=counters["reused"], reprefills=counters["reprefills"],
        dropped_prompt_tokens=counters["dropped"],
    )
    return GenerationResult(tokens, stats)


def greedy_generate(model, prompt_ids, max_new_tokens: int, graph: bool = False) -> list:
    """Greedy decoding on static steps (``minillm.fused``, chapter 12): the prompt but its last token in one
    eager step, then one T = 1 step per token, replayed from a CUDA graph with ``graph=True``. The host waits
    once per token, for its id.

    The same tokens as ``generate(model, prompt_ids, max_new_tokens, temperature=0).tokens`` (the reference);
    prompt and new tokens must fit in the model's block_size (the static cache does not slide a window).
    """
    prompt = check_prompt(prompt_ids, max_new_tokens)
    if max_new_tokens == 0:
        return []
    decode = start_decoding(model, prompt, len(prompt) + max_new_tokens - 1, graph)
    tokens = []
    while len(tokens) < max_new_tokens:
        decode.step()
        tokens.append(next_id(decode))
    decode.cache.check_status()
    return tokens
