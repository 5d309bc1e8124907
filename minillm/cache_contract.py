"""The cache contract: what ``GPT.forward``, the decoding loops and prompt caching ask of a cache.

Stated once, here; every cache (``KVCache``, ``GrowingKVCache``, the paged ``SequenceView`` and
``BatchView``) conforms, and tests/test_cache_contract.py checks each against it. The model and
the caches never import each other: they meet only through these three protocols.

``ForwardCache``: what ``forward(idx (B, T), cache)`` calls, in this order, for T new tokens:

    positions(T)                     -> absolute positions of the T new tokens, (T,) or (B, T)
                                        (one row per sequence when rows have their own lengths);
                                        raises CacheFullError before anything is written
    attend(layer, q, k, v, attention) -> (B, n_head, T, hs), once per layer: store the new
                                        k, v (B, n_kv_head, T, hs) after the cached ones, then
                                        return attention(q, K, V, causal=True) over every stored
                                        key of the sequence, the new ones included
    advance(T)                       -> after the last layer: the T new positions are cached

    q has config.n_head heads; k, v and what the cache stores have config.n_kv_head heads
    (n_kv_head == n_head for GPT-2, fewer for grouped-query attention). The cache hands the
    stored K, V (B, n_kv_head, L, hs) unchanged to the ``attention`` callable it is given: mapping
    query heads to KV heads is the model's attention callable's job, and the cache uses the
    callable it is given (any of ``minillm.model.ATTENTION``), never one of its own choosing.

A cache may also lend its buffers, so that a model writes the new keys and values and attends in one kernel:

    in_place(layer)                  -> (K, V) (B, n_kv_head, max_len, hs), or None: the model then writes the T
                                        new k, v at positions length..length+T-1 and attends over
                                        0..length+T-1 itself, exactly as ``attend`` would have (``KVCache``;
                                        ``llama.LlamaCpuOps.attend``); a cache without it, or answering None,
                                        is reached through ``attend``

``DecodeCache``: a ForwardCache that one decoding loop owns for one sequence (batch row):

    length, max_len                  tokens cached now; the most it can hold
    reset()                          forget everything (length 0)
    truncate(n)                      keep the first n tokens; n an int in 0..length, else ValueError
                                     (speculative decoding's rollback)
    nbytes, bytes_used               bytes allocated for K and V; bytes holding valid tokens

``PromptCache``: reuses the keys and values of earlier prompts (``PrefixCache``, and the paged
cache's prefix blocks):

    prefill(model, prompt_ids, cache) -> (logits (V,) after the prompt's last token, tokens reused)
                                        resets ``cache`` (a DecodeCache) and leaves the prompt in it
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class CacheFullError(RuntimeError):
    """An append would pass the cache's capacity; nothing was written."""


@runtime_checkable
class ForwardCache(Protocol):
    """What ``GPT.forward(idx, cache)`` calls (see the module docstring for shapes)."""

    def positions(self, T: int): ...

    def attend(self, layer: int, q, k, v, attention): ...

    def advance(self, T: int) -> None: ...


@runtime_checkable
class DecodeCache(ForwardCache, Protocol):
    """A ForwardCache for one decoding loop: its length, capacity, reset, rollback and bytes."""

    @property
    def length(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    def reset(self) -> None: ...

    def truncate(self, n: int) -> None: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def bytes_used(self) -> int: ...


@runtime_checkable
class PromptCache(Protocol):
    """Prompt caching: prefill a prompt into a DecodeCache, reusing what earlier prompts computed."""

    def prefill(self, model, prompt_ids, cache) -> tuple: ...
