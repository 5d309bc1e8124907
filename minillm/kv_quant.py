"""An int8 KV cache: keys and values stored as int8, one float32 scale per (head, position).

A float32 cache stores 4 bytes per number; at long context it outgrows the weights (SmolLM2-135M at
8192 tokens: 2 * 30 layers * 3 heads * 64 * 8192 * 4 bytes = 377 MB, beside 135 M weights). Each
key (and value) vector of one head at one position, x (hs,), is stored as

    s = max_j |x_j| / 127,   q_j = rint(x_j / s) in -127..127 (int8),   x_j ~ s * q_j

so a vector costs hs bytes + 4 bytes of scale instead of 4 hs bytes: (hs + 4) / (4 hs) of the float32
cache, 0.266 for hs = 64. The rounding error of each element is at most s / 2 = max |x| / 254.

Why a scale per position and not one per head: a head's key and value vectors differ in size from
token to token (in SmolLM2-135M's middle layer the largest absmax of a head over 512 tokens of
Shakespeare is 1.5 to 1.9 times the median), so one scale for a head's whole sequence is set by its largest
vector and leaves the typical one fewer of the 255 levels (tests/test_kv_quant.py measures the
difference in the logits). A per-position scale also makes the stored bytes of a token independent of
how tokens were grouped into forward calls (prefill, decode, a verification of K tokens), so
speculative decoding's rollback and re-verification see the same keys as plain decoding.

    model.forward(idx, cache) -> cache.attend(layer, q, k, v, attention)
        -> quantize k, v into the int8 buffers -> attention(q, dequantized K, dequantized V)

``Int8KVCache`` is a decode cache as ``minillm.cache_contract`` states it (the calls of ``KVCache``:
positions, attend, advance, truncate, reset, length, max_len, nbytes, bytes_used, plus
``bytes_per_token``). Attention itself still runs in float32 over the dequantized keys and values:
the cache saves memory, not arithmetic.
"""

from __future__ import annotations

from .backend import cache_zeros, xp
from .kv_cache import KVCache, cache_capacity
from .quantize import INT8_MAX

SCALE_FLOOR = 1e-30  # a scale below any a nonzero float32 row produces: an all-zero row quantizes to zeros


def quantize_rows(x):
    """absmax int8 over the last axis: s = max |x| / 127, q = rint(x / s).

    (..., hs) float32 -> (q (..., hs) int8, s (..., 1) float32). The same rule as
    ``quantize.Int8PerChannel`` applied to each (head, position) vector, which the tests check.
    Example: x = [0.5, -1.27, 0.01] -> s = 0.01, q = [50, -127, 1].
    """
    # EXERCISE 13.3 BEGIN: one scale per vector (the last axis): s = max |x| / 127, q = rint(x / s) as int8
    s = xp.abs(x).max(axis=-1, keepdims=True) / float(INT8_MAX)  # (..., 1)
    q = xp.clip(xp.rint(x * (1.0 / xp.maximum(s, SCALE_FLOOR))), -INT8_MAX, INT8_MAX)  # (..., hs)
    return q.astype(xp.int8), s
    # EXERCISE 13.3 END


def dequantize_rows(q, s):
    """x = s * q.  (..., hs) int8, (..., 1) float32 -> (..., hs) float32"""
    return q.astype(xp.float32) * s


class Int8KVCache:
    """Preallocated per-layer int8 K and V, (B, n_kv_head, max_len, hs), with float32 scales (B, n_kv_head, max_len, 1).

    Filled left to right like ``KVCache`` (its positions, advance, truncate and reset are used as they
    are: rollback is O(1) here too); ``attend`` quantizes the new keys and values as it stores them
    and hands ``attention`` the dequantized float32 K, V of every stored position.
    """

    quantize = staticmethod(quantize_rows)  # (..., hs) -> (int8 (..., hs), float32 scale (..., 1))

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None):
        max_len = cache_capacity(config, max_len)
        self.config, self.batch_size, self.max_len = config, batch_size, max_len
        shape = (batch_size, config.n_kv_head, max_len, config.head_size)  # (B, n_kv_head, max_len, hs)
        scale_shape = shape[:3] + (1,)  # (B, n_kv_head, max_len, 1): one scale per head and position
        self.k = [cache_zeros(shape, dtype=xp.int8) for _ in range(config.n_layer)]
        self.v = [cache_zeros(shape, dtype=xp.int8) for _ in range(config.n_layer)]
        self.k_scale = [cache_zeros(scale_shape, dtype=xp.float32) for _ in range(config.n_layer)]
        self.v_scale = [cache_zeros(scale_shape, dtype=xp.float32) for _ in range(config.n_layer)]
        self.length = 0

    positions = KVCache.positions
    advance = KVCache.advance
    truncate = KVCache.truncate
    reset = KVCache.reset
    bytes_used = KVCache.bytes_used

    def attend(self, layer: int, q, k, v, attention):
        """Quantize the new k, v (B, n_kv_head, T, hs) into positions length..length+T-1; attend q over
        the dequantized keys and values of positions 0..length+T-1."""
        if k.shape[0] != self.batch_size:
            raise ValueError(f"KV cache holds batch {self.batch_size}, got batch {k.shape[0]}")
        start, end = self.length, self.length + k.shape[2]
        self.k[layer][:, :, start:end], self.k_scale[layer][:, :, start:end] = self.quantize(k)
        self.v[layer][:, :, start:end], self.v_scale[layer][:, :, start:end] = self.quantize(v)
        keys = dequantize_rows(self.k[layer][:, :, :end], self.k_scale[layer][:, :, :end])  # (B, n_kv_head, end, hs)
        values = dequantize_rows(self.v[layer][:, :, :end], self.v_scale[layer][:, :, :end])
        return attention(q, keys, values, causal=True)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K, V and their scales (all of max_len, whatever the length)."""
        return sum(a.nbytes for a in self.k + self.v + self.k_scale + self.v_scale)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence takes: 2 (K and V) * layers * kv heads * (hs int8 + a float32 scale)."""
        return self.nbytes // (self.batch_size * self.max_len)
