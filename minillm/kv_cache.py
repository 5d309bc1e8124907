"""The KV cache: keep every earlier token's keys and values so each decode step computes one token.

Without a cache, generating token N means running all N tokens through the model again: the keys
and values of tokens 0..N-2 are recomputed at every step (O(N^2) work for N tokens). With a cache,
step N computes q, k, v for the one new token, appends k and v, and attends over the cache (O(N)).

- ``KVCache``: per-layer K and V buffers (B, nh, max_len, hs) allocated once; appends write into
  them in place, ``truncate`` rolls back in O(1) (speculative decoding relies on it).
- ``GrowingKVCache``: the naive alternative that concatenates a new array every step, so the
  chapter can measure what pre-allocation saves.
- ``kv_cache_bytes``: the memory formula 2 * n_layer * n_kv_head * head_dim * seq_len * batch * bytes.
- ``PrefixCache``: keeps the KV of earlier prompts and reuses the longest shared prefix, so a
  common system prompt is prefilled once (prompt caching).

Both caches implement the protocol ``GPT.forward`` expects: ``positions(T)``,
``attend(layer, q, k, v, attention)`` and ``advance(T)``.
"""

from __future__ import annotations

from collections import OrderedDict

from .backend import xp


class CacheFullError(RuntimeError):
    """An append would pass the cache's capacity; nothing was written."""


def kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch=1, bytes_per_elem=2) -> int:
    """Bytes to hold K and V for seq_len tokens: 2 (K and V) * layers * kv heads * head dim * tokens.

    Example: GPT-2 small (12 layers, 12 heads of 64) at 1024 tokens in fp16 -> 37,748,736 bytes.
    """
    return 2 * n_layer * n_kv_head * head_dim * seq_len * batch * bytes_per_elem


class KVCache:
    """Preallocated per-layer K and V buffers, (B, nh, max_len, hs) each, filled left to right.

    ``length`` tokens are valid; positions length..max_len-1 hold stale data that is never read.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None, dtype=None):
        max_len = config.block_size if max_len is None else max_len
        if not 1 <= max_len <= config.block_size:
            raise ValueError(
                f"KVCache max_len={max_len} must be in 1..block_size={config.block_size} "
                "(positions past block_size have no embedding)"
            )
        self.config, self.batch_size, self.max_len = config, batch_size, max_len
        shape = (batch_size, config.n_kv_head, max_len, config.head_size)  # (B, n_kv_head, max_len, hs)
        dtype = xp.float32 if dtype is None else dtype
        self.k = [xp.zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [xp.zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0

    def positions(self, T: int):
        """Absolute positions of T new tokens: length .. length+T-1. Refuses to overflow."""
        if self.length + T > self.max_len:
            raise CacheFullError(
                f"KV cache full: {self.length} cached + {T} new tokens > max_len={self.max_len}"
            )
        return xp.arange(self.length, self.length + T)

    def attend(self, layer: int, q, k, v, attention):
        """Write the new k, v (B, nh, T, hs) after the cached ones; attend q over all of them."""
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KV cache holds batch {self.batch_size}, got batch {k.shape[0]}")
        # EXERCISE 3.1 BEGIN: write k, v at positions length..length+T-1, attend over 0..length+T-1
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return attention(q, self.k[layer][:, :, :end], self.v[layer][:, :, :end], causal=True)
        # EXERCISE 3.1 END

    def advance(self, T: int) -> None:
        """Called by forward after the last layer: the T new positions are now cached."""
        self.length += T

    def truncate(self, n: int) -> None:
        """Keep the first n positions (O(1): the data past n is simply no longer valid)."""
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


class GrowingKVCache:
    """The naive alternative: concatenate a new, one-token-longer array at every step.

    Same protocol and same results as ``KVCache``, but each step allocates and copies the whole
    cache again: ``bytes_allocated`` counts that traffic (O(N^2) bytes for N tokens).
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None, dtype=None):
        self.config, self.batch_size = config, batch_size
        self.max_len = config.block_size if max_len is None else max_len
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
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
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


class PrefixCache:
    """Prompt caching: remember the KV of earlier prompts; prefill only what a new prompt adds.

    Because attention is causal, the keys and values of a prompt's first j tokens depend only on
    those j tokens, so any cached prompt that shares j leading tokens with a new prompt supplies
    them. At least the new prompt's last token is always computed: its logits give the first
    output token. Entries are kept in least-recently-used order, at most ``max_entries``.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self.entries: OrderedDict[tuple, tuple[list, list]] = OrderedDict()  # tokens -> (ks, vs)
        self.hits = self.reused_tokens = 0

    def longest_prefix(self, prompt_ids) -> tuple[tuple | None, int]:
        """-> (key of the best entry, tokens reusable), never more than len(prompt) - 1."""
        best, best_n = None, 0
        for key in self.entries:
            n = min(common_prefix_length(key, prompt_ids), len(prompt_ids) - 1)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    def prefill(self, model, prompt_ids, cache: KVCache):
        """Reset ``cache``, load the longest cached prefix, forward the rest -> last logits (V,)."""
        prompt_ids = list(prompt_ids)
        cache.reset()
        key, n = self.longest_prefix(prompt_ids)
        if key is not None:
            self.entries.move_to_end(key)
            ks, vs = self.entries[key]
            for layer in range(len(ks)):
                cache.k[layer][:, :, :n] = ks[layer][:, :, :n]
                cache.v[layer][:, :, :n] = vs[layer][:, :, :n]
            cache.length = n
            self.hits += 1
            self.reused_tokens += n
        logits = model.forward(xp.asarray([prompt_ids[n:]]), cache)[0, -1]
        self.store(prompt_ids, cache)
        return logits, n

    def store(self, prompt_ids, cache: KVCache) -> None:
        """Keep a copy of the cache's first len(prompt_ids) positions under the prompt's tokens."""
        n = len(prompt_ids)
        ks = [a[:, :, :n].copy() for a in cache.k]
        vs = [a[:, :, :n].copy() for a in cache.v]
        self.entries[tuple(prompt_ids)] = (ks, vs)
        self.entries.move_to_end(tuple(prompt_ids))
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
