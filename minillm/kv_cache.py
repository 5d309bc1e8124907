"""The KV cache: keep every earlier token's keys and values so each decode step computes one token.

Without a cache, generating token N means running all N tokens through the model again: the keys
and values of tokens 0..N-2 are recomputed at every step (O(N^2) work for N tokens). With a cache,
step N computes q, k, v for the one new token, appends k and v, and attends over the cache (O(N)).

- ``KVCache``: per-layer K and V buffers (B, n_kv_head, max_len, hs) allocated once; appends write into
  them in place, ``truncate`` rolls back in O(1) (speculative decoding relies on it).
- ``GrowingKVCache``: the naive alternative that concatenates a new array every step, so the
  chapter can measure what pre-allocation saves.
- ``kv_cache_bytes``: the memory formula 2 * n_layer * n_kv_head * head_dim * seq_len * batch * bytes.
- ``PrefixCache``: keeps the KV of earlier prompts and reuses the longest shared prefix, so a
  common system prompt is prefilled once (prompt caching).
- ``MaskedView``: one forward over new tokens at explicit positions with an explicit mask (a token
  tree), then ``keep`` compacts the accepted tokens' K/V into place in any decode cache.

Both caches are decode caches and ``PrefixCache`` is a prompt cache, as ``minillm.cache_contract``
states them: that module is the one place that says what a cache must do.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from .backend import cache_zeros, xp
from .cache_contract import CacheFullError, DecodeCache, ForwardCache
from .config import check_count


def kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch=1, bytes_per_elem=2) -> int:
    """Bytes to hold K and V for seq_len tokens: 2 (K and V) * layers * kv heads * head dim * tokens.

    Example: GPT-2 small (12 layers, 12 heads of 64) at 1024 tokens in fp16 -> 37,748,736 bytes.
    """
    return 2 * n_layer * n_kv_head * head_dim * seq_len * batch * bytes_per_elem


def cache_capacity(config, max_len: int | None) -> int:
    """The tokens a cache of ``config`` may hold: max_len (default block_size), in 1..block_size."""
    max_len = config.block_size if max_len is None else max_len
    if not 1 <= max_len <= config.block_size:
        raise ValueError(
            f"cache max_len={max_len} must be in 1..block_size={config.block_size} "
            "(positions past block_size have no embedding)"
        )
    return max_len


class KVCache:
    """Preallocated per-layer K and V buffers, (B, n_kv_head, max_len, hs) each, filled left to right.

    ``length`` tokens are valid; positions length..max_len-1 hold stale data that is never read.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None, dtype=None):
        max_len = cache_capacity(config, max_len)
        self.config, self.batch_size, self.max_len = config, batch_size, max_len
        shape = (batch_size, config.n_kv_head, max_len, config.head_size)  # (B, n_kv_head, max_len, hs)
        dtype = xp.float32 if dtype is None else dtype
        self.k = [cache_zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [cache_zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0

    def positions(self, T: int):
        """Absolute positions of T new tokens: length .. length+T-1. Refuses to overflow."""
        if self.length + T > self.max_len:
            raise CacheFullError(
                f"KV cache full: {self.length} cached + {T} new tokens > max_len={self.max_len}"
            )
        return xp.arange(self.length, self.length + T)

    def attend(self, layer: int, q, k, v, attention):
        """Write the new k, v (B, n_kv_head, T, hs) after the cached ones; attend q over all of them."""
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KV cache holds batch {self.batch_size}, got batch {k.shape[0]}")
        # EXERCISE 3.1 BEGIN: write k, v at positions length..length+T-1, attend over 0..length+T-1
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return attention(q, self.k[layer][:, :, :end], self.v[layer][:, :, :end], causal=True)
        # EXERCISE 3.1 END

    def in_place(self, layer: int):
        """``layer``'s (K, V) buffers, (B, n_kv_head, max_len, hs) float32, lent to a caller that writes the new
        tokens' k and v at positions length.. itself and attends over positions 0.. in the same kernel
        (``block_kernels.attend``), as ``attend`` would have; None on a GPU, for a subclass with its own ``attend``,
        and where this class's ``attend`` does not do exactly that (``attends_in_place``: an exercise left to do)."""
        k, v = self.k[layer], self.v[layer]
        if type(self).attend is not KVCache.attend or not isinstance(k, np.ndarray) or k.dtype != np.float32:
            return None
        return (k, v) if attends_in_place() else None

    def advance(self, T: int) -> None:
        """Called by forward after the last layer: the T new positions are now cached."""
        self.length += T

    def truncate(self, n: int) -> None:
        """Keep the first n positions (O(1): the data past n is simply no longer valid)."""
        n = check_count("truncate's n (tokens to keep)", n, 0)  # 2.5 or True is no length
        # EXERCISE 3.2 BEGIN: roll back to n cached positions; refuse n outside 0..length
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n
        # EXERCISE 3.2 END

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V (all of max_len, whatever the length)."""
        return sum(a.nbytes for a in self.k + self.v)

    @property
    def bytes_used(self) -> int:
        """Bytes that hold valid tokens."""
        return self.nbytes * self.length // self.max_len


@functools.cache
def attends_in_place() -> bool:
    """Whether ``KVCache.attend`` writes k and v at positions length.. of its buffers and hands ``attention`` the first
    length + T rows of exactly those buffers, causal, returning what it returns (checked once a process on a small
    probe): what a caller of ``KVCache.in_place`` does in one kernel. False where it raises (an exercise left to do)
    or does something else, so that a model goes through the ``attend`` that is written and its errors show."""
    rng = np.random.default_rng(0)
    cache = KVCache(SimpleNamespace(n_layer=1, n_kv_head=2, head_size=4, block_size=8))
    new = [rng.standard_normal((3, 1, 2, T, 4), dtype=np.float32) for T in (3, 2)]  # (q, k, v) of 3, then 2 tokens
    seen = []

    def attention(q, k, v, causal=False, mask=None):
        seen.append((k, v, causal, mask))
        return q + 1

    try:
        outs = []
        for q, k, v in new:
            outs.append(cache.attend(0, q, k, v, attention))
            cache.advance(k.shape[2])
    except Exception:  # any failure of the reference: run it, where it fails in plain sight
        return False
    stored = [np.concatenate([n[j] for n in new[:i]], axis=2) for i in (1, 2) for j in (1, 2)]  # K, V after each
    return len(seen) == 2 and all(
        np.array_equal(out, q + 1) and causal and mask is None
        and np.shares_memory(k, cache.k[0]) and np.shares_memory(v, cache.v[0])
        and np.array_equal(k, stored[2 * i]) and np.array_equal(v, stored[2 * i + 1])
        for i, ((k, v, causal, mask), out, (q, _, _)) in enumerate(zip(seen, outs, new))) and all(
        np.array_equal(buffer[0][:, :, :5], want) for buffer, want in ((cache.k, stored[2]), (cache.v, stored[3])))


class GrowingKVCache:
    """The naive alternative: concatenate a new, one-token-longer array at every step.

    Same protocol and same results as ``KVCache``, but each step allocates and copies the whole
    cache again: ``bytes_allocated`` counts that traffic (O(N^2) bytes for N tokens).
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None, dtype=None):
        self.config, self.batch_size = config, batch_size
        self.max_len = cache_capacity(config, max_len)
        self.dtype = xp.float32 if dtype is None else dtype
        self.reset()

    def reset(self) -> None:
        self.k = [None] * self.config.n_layer
        self.v = [None] * self.config.n_layer
        self.length = 0
        self.bytes_allocated = 0

    positions = KVCache.positions
    advance = KVCache.advance

    def attend(self, layer: int, q, k, v, attention):
        if self.k[layer] is not None:
            k = xp.concatenate([self.k[layer], k], axis=2)  # a new (B, nh, length+T, hs) array
            v = xp.concatenate([self.v[layer], v], axis=2)
        self.k[layer], self.v[layer] = k.astype(self.dtype), v.astype(self.dtype)
        self.bytes_allocated += self.k[layer].nbytes + self.v[layer].nbytes
        return attention(q, self.k[layer], self.v[layer], causal=True)

    def truncate(self, n: int) -> None:
        KVCache.truncate(self, n)  # the range check and the new length, then drop the arrays' tails
        self.k = [None if a is None else a[:, :, :n] for a in self.k]
        self.v = [None if a is None else a[:, :, :n] for a in self.v]
        self.length = n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v if a is not None)

    @property
    def bytes_used(self) -> int:
        return self.nbytes


def common_prefix_length(a, b) -> int:
    """Number of leading tokens two sequences share.  ([1, 2, 3], [1, 2, 4, 5]) -> 2"""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def store_only(q, k, v, causal=True):
    """An attention callable that reads nothing: ``attend`` given it only stores k and v."""
    return None


def append_kv(cache: ForwardCache, ks, vs) -> None:
    """Append known keys and values through the contract: forward's three calls, minus the math.

    ks[layer], vs[layer]: (B, n_kv_head, n, hs) for every layer. ``positions(n)`` refuses an
    overflow before anything is written, ``attend`` stores each layer's k, v (``store_only`` as the
    attention: q is not read), ``advance(n)`` counts them.
    """
    n = ks[0].shape[2]
    cache.positions(n)
    for layer, (k, v) in enumerate(zip(ks, vs)):
        cache.attend(layer, k, k, v, store_only)
    cache.advance(n)


class KVRecorder:
    """A forward cache that passes every call on to ``cache`` and keeps a copy of each layer's new k, v.

    After ``model.forward(idx, recorder)``: ``recorder.ks[layer]``, ``recorder.vs[layer]``
    (B, n_kv_head, T, hs) are what the forward stored for its T tokens.
    """

    def __init__(self, cache: ForwardCache):
        self.cache, self.ks, self.vs = cache, {}, {}

    def positions(self, T: int):
        return self.cache.positions(T)

    def attend(self, layer: int, q, k, v, attention):
        self.ks[layer], self.vs[layer] = k.copy(), v.copy()
        return self.cache.attend(layer, q, k, v, attention)

    def advance(self, T: int) -> None:
        self.cache.advance(T)


class PrefixEntry(NamedTuple):
    model: object  # the model that computed ks and vs (held, so that its id stays its own)
    ks: list  # per layer (1, n_kv_head, len(prompt), hs)
    vs: list


class PrefixCache:
    """Prompt caching: remember the KV of earlier prompts; prefill only what a new prompt adds.

    Because attention is causal, the keys and values of a prompt's first j tokens depend only on
    those j tokens, so any cached prompt that shares j leading tokens with a new prompt supplies
    them. At least the new prompt's last token is always computed: its logits give the first
    output token. Entries belong to the model that computed them (keys and values of another
    model of the same shape would fit the cache and be silently wrong), are kept in
    least-recently-used order, at most ``max_entries``, and reach a cache only through the cache
    contract (``append_kv`` replays them, a ``KVRecorder`` records them), so any decode cache works.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self.entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()  # (id(model), tokens) -> entry
        self.hits = self.reused_tokens = 0

    def longest_prefix(self, model, prompt_ids) -> tuple[tuple | None, int]:
        """-> (key of model's best entry, tokens reusable), never more than len(prompt) - 1."""
        best, best_n = None, 0
        for key in self.entries:
            if key[0] != id(model):
                continue
            n = min(common_prefix_length(key[1], prompt_ids), len(prompt_ids) - 1)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def prefill(self, model, prompt_ids, cache: DecodeCache):
        """Reset ``cache``, replay the longest cached prefix, forward the rest -> (last logits (V,), reused)."""
        prompt_ids = [int(t) for t in prompt_ids]
        cache.reset()
        key, n = self.longest_prefix(model, prompt_ids)
        if key is not None:
            self.entries.move_to_end(key)
            entry = self.entries[key]
            ks, vs = [k[:, :, :n] for k in entry.ks], [v[:, :, :n] for v in entry.vs]
            append_kv(cache, ks, vs)
            self.hits += 1
            self.reused_tokens += n
        recorder = KVRecorder(cache)
        logits = model.forward(xp.asarray([prompt_ids[n:]]), recorder)[0, -1]
        new_ks, new_vs = list(recorder.ks.values()), list(recorder.vs.values())  # in layer order
        if n:  # the entry holds the whole prompt: the replayed prefix, then what was computed
            new_ks = [xp.concatenate([a, b], axis=2) for a, b in zip(ks, new_ks)]
            new_vs = [xp.concatenate([a, b], axis=2) for a, b in zip(vs, new_vs)]
        self.store(model, prompt_ids, new_ks, new_vs)
        return logits, n

    def store(self, model, prompt_ids, ks, vs) -> None:
        """Keep a prompt's keys and values, per layer (1, n_kv_head, len(prompt_ids), hs), for ``model``."""
        key = (id(model), tuple(prompt_ids))
        self.entries[key] = PrefixEntry(model, ks, vs)
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


class MaskedView:
    """One forward over T new tokens at explicit positions under an explicit mask; then keep some.

    Token i sits at absolute position base + offsets[i] (base = cache.length when the view is
    made) and sees every cached token plus the new tokens j with mask[i, j]. For a token tree the
    offsets are the depths and the mask says "ancestor or self", so one forward scores every
    branch. The view passes the forward-cache contract through to ``cache`` (any decode cache,
    contiguous or paged), handing the attention callable the full (T, base + T) mask, and records
    each layer's new k, v. Afterwards ``keep(indices)`` compacts: the cache is rolled back to base
    and the kept tokens' keys and values are appended in order (``append_kv``), so kept token j
    lands in slot base + j, which must be its position (offsets[indices[j]] == j: a root-to-node
    path). Everything else the forward wrote is dropped.

    ``seen`` (T, P) bool: the last P cached tokens are a tree's earlier levels, not the prefix; token i
    sees those with seen[i] (its ancestors), and offsets count from the first of them (base - P). A
    tree drafted level by level feeds only each level's new nodes this way, their K/V left in the
    cache for the next level (``advance``, no ``keep``); the caller truncates back when it is done.
    """

    def __init__(self, cache: DecodeCache, offsets, mask, seen=None):
        self.offsets = np.asarray(offsets, dtype=np.int64)  # (T,)
        mask = np.asarray(mask)
        T = len(self.offsets)
        if mask.shape != (T, T) or mask.dtype != bool:
            raise ValueError(f"MaskedView: mask must be bool of shape ({T}, {T}), got {mask.dtype} {mask.shape}")
        if T and (self.offsets.min() < 0 or not mask[np.arange(T), np.arange(T)].all()):
            raise ValueError("MaskedView: offsets must be >= 0 and every token must see itself")
        self.cache, self.base = cache, cache.length
        cached = np.ones((T, self.base), dtype=bool)  # the prefix: seen by every new token
        seen = np.zeros((T, 0), dtype=bool) if seen is None else np.asarray(seen)
        if seen.dtype != bool or seen.ndim != 2 or seen.shape[0] != T or seen.shape[1] > self.base:
            raise ValueError(f"MaskedView: seen must be bool (T={T}, P <= {self.base} cached), got {seen.dtype} "
                             f"{seen.shape}")
        self.start = self.base - seen.shape[1]  # where the offsets count from
        cached[:, self.start:] = seen
        self.full_mask = xp.asarray(np.concatenate([cached, mask], axis=1))
        self.recorder = KVRecorder(cache)

    def positions(self, T: int):
        if T != len(self.offsets):
            raise ValueError(f"MaskedView made for {len(self.offsets)} tokens, forward got {T}")
        self.cache.positions(T)  # refuses an overflow before anything is written
        return xp.asarray(self.start + self.offsets)

    def attend(self, layer: int, q, k, v, attention):
        def masked(q, k, v, causal=True):
            return attention(q, k, v, mask=self.full_mask)

        return self.recorder.attend(layer, q, k, v, masked)

    def advance(self, T: int) -> None:
        self.cache.advance(T)

    def keep(self, indices) -> None:
        """Roll the cache back to base, then append the K/V of new tokens ``indices`` (in that order)."""
        indices = [int(i) for i in indices]
        if self.start != self.base:
            raise ValueError("MaskedView.keep: a view over a tree's earlier levels (seen) keeps them all (advance)")
        if [int(self.offsets[i]) for i in indices] != list(range(len(indices))):
            raise ValueError(f"MaskedView.keep: tokens {indices} do not sit at consecutive positions from base")
        self.cache.truncate(self.base)
        if indices:
            layers = sorted(self.recorder.ks)
            append_kv(self.cache, [self.recorder.ks[i][:, :, indices] for i in layers],
                      [self.recorder.vs[i][:, :, indices] for i in layers])
