"""Attention for a few query rows over a long cache, on one CPU core: one pass over K, one over V.

    out[r] = sum_t softmax_t(q[r] . k[t] / sqrt(hs)) v[t]        q (R, hs), k and v (Tk, hs) of one head

A decode step asks this for R = 1 query row per query head (SmolLM2's grouped attention stacks the 3
query heads of a key/value head, R = 3), a verification of n drafted tokens for R = 3n. The reference,
``naive_attention``, is two BLAS products and a softmax in NumPy. At these shapes BLAS is slow: the
product q @ k^T with 3 rows over 1,000 keys took 88 microseconds a head on an Intel Xeon, where its
256 KB of keys take about 15 from memory, because OpenBLAS's path for small products stops near 65,536
multiply-adds and its general path packs k into its own layout first. The decode step then grew
9.1 ms per thousand cached tokens, llama.cpp's 5.0 (docs/quantization.md, "Decode at long context").

The kernel reads each key and each value once and keeps everything else in registers or the L1 cache:

    for each key t:   s[r, t] = (q[r] * scale) . k[t];  m[r] = max(m[r], s[r, t])   for the R rows   (scores)
    for each row r:   p[r, t] = exp(s[r, t] - m[r]);  l[r] = sum_t p[r, t]                          (softmax)
    for each key t:   acc[r] += p[r, t] v[t]                                        for the R rows   (values)
    out[r] = acc[r] / l[r]

The scaled query rows and the R x hs accumulators are register tiles (``qkernels.stack_tile``, R at most
ROW_GROUP; more rows run in groups); the scores of one group, R x Tk floats, stay in the L1 or L2 cache. A
masked key (an explicit (Tq, Tk) mask, or the causal rule) gets weight exactly 0, and a row with every key
masked gives zeros, as ``attention.softmax`` does. Each step asks the CPU for the key or value 16 rows ahead
(``qkernels.prefetch``). One call covers every head of a layer, and a KV cache's buffers are read in place
(``cache_buffer``): the keys a cache hands attention are the first Tk rows of each head of its
(B, nh, max_len, hs) array.

The exponential is computed here, not by a library call, so that LLVM can vectorize its loop (numba
has no vector ``exp`` without Intel's SVML): e^x = 2^n e^r with n = round(x / ln 2) and |r| <= ln2 / 2,
e^r a degree-7 polynomial (Cephes' ``expf`` coefficients), and 2^n built from its exponent bits. Relative
error below 3e-7 over [-87.3, 0]; any x below -87.3 (e^x under float32's smallest normal) gives 0.

Compiled by numba per (R, hs) with ``fastmath`` flags that allow reordering sums (``reassoc``: a dot
product over hs becomes 16-lane partial sums) but not ``nnan``/``ninf``: the masked scores are -inf and
must stay so. The result differs from ``naive_attention`` by float32 rounding only; ``tests/
test_row_attention.py`` checks it against the reference for every row count, masks and causal rules,
huge scores, and fully masked rows, and reads the machine code for 512- or 256-bit FMAs.
``flash_attention.auto_attention`` (the models' default) calls it on a CPU for ``fits`` shapes;
attention="naive" is the reference one option away.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import types

from . import cpu_target
from .attention import causal_mask, check_mask
from .qkernels import bits_to_f32, prefetch, stack_tile

ROW_GROUP = 6  # query rows per kernel call: 6 x hs / 16 zmm accumulators (24 at hs = 64) plus a key's 4
MAX_ROWS = 48  # auto_attention's limit: a verify of 16 tokens with SmolLM2's 3 query heads per key head
MIN_KEYS = 64  # below this many keys BLAS's small-matrix path is as fast (measured, docs/quantization.md)
AHEAD = 1024  # floats ahead of the loads the kernel asks the CPU for (4 KB: 16 keys of 64)
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}  # reordered sums, no "nnan"/"ninf": -inf is a mask
LOG2E, LN2_HI, LN2_LO = np.float32(1.4426950408889634), np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_MIN = np.float32(-87.3)  # e^x below float32's smallest normal number: 0
NO_MASK = np.zeros((0, 0), dtype=bool)  # the kernel's mask argument when every key is visible
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)

cpu_target.full_width()  # 512-bit vectors on AVX-512, before the first numba function of the process
f32 = numba.float32
inline = numba.njit(inline="always", fastmath=FASTMATH)


@inline
def exp_nonpositive(x):
    """e^x for x <= 0 in float32 operations only (vectorizable); 0 below EXP_MIN, and for -inf or NaN."""
    n = np.floor(x * LOG2E + f32(0.5))  # x = n ln2 + r, |r| <= ln2 / 2
    r = x - n * LN2_HI - n * LN2_LO  # ln2 in two parts: n * LN2_HI is exact
    p = f32(EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + f32(c)
    p = p * r * r + r + f32(1.0)  # e^r = 1 + r + r^2 (1/2 + r/6 + ...)
    scale = bits_to_f32(numba.uint32((numba.int32(max(n, f32(-126.0))) + 127) << 23))  # 2^n: exponent bits
    return p * scale if x >= EXP_MIN else f32(0.0)


@inline
def attend_group(q, r0, n, k, v, mask, out, s, qs, top, total, acc):
    """out[r0 .. r0 + n - 1] for n <= R query rows of one head over its first Tk keys and values (rows of k and v).
    q (Tq, hs), already scaled; mask (Tq, Tk) bool or (0, 0); s (R, Tk) scratch; the tiles qs (1, R, hs), top and
    total (1, 1, R), acc (1, R, hs) live in registers."""
    rows, dim, Tk = qs.shape[1], qs.shape[2], s.shape[1]
    for r in range(rows):  # rows past n repeat the last one: computed, never written
        for d in range(dim):
            qs[0, r, d] = q[r0 + min(r, n - 1), d]
        top[0, 0, r] = -np.inf
    masked = mask.shape[0] > 0
    for t in range(Tk):  # scores: each key read once, dotted with every row
        for line in range(0, dim * 4, 64):
            prefetch(k, (t * dim + AHEAD) * 4 + line)
        for r in range(rows):
            dot = f32(0.0)
            for d in range(dim):
                dot += qs[0, r, d] * k[t, d]
            if masked and not mask[r0 + min(r, n - 1), t]:
                dot = -np.inf
            s[r, t] = dot
            top[0, 0, r] = max(top[0, 0, r], dot)
    for r in range(rows):
        m, l = top[0, 0, r], f32(0.0)
        for t in range(Tk):
            e = exp_nonpositive(s[r, t] - m)  # 0 for a masked key; 0 everywhere when the row is all -inf
            s[r, t] = e
            l += e
        total[0, 0, r] = l
        for d in range(dim):
            acc[0, r, d] = 0.0
    for t in range(Tk):  # values: each read once, added into every row
        for line in range(0, dim * 4, 64):
            prefetch(v, (t * dim + AHEAD) * 4 + line)
        for r in range(rows):
            p = s[r, t]
            for d in range(dim):
                acc[0, r, d] += p * v[t, d]
    for r in range(n):
        l = total[0, 0, r]
        inv = f32(1.0) / l if l > 0 else f32(0.0)  # a row with every key masked: zeros
        for d in range(dim):
            out[r0 + r, d] = acc[0, r, d] * inv


@numba.njit(cache=True, fastmath=FASTMATH, nogil=True, boundscheck=False)
def rows_kernel(q, k, v, mask, out, s, rows, dim):
    """out[g] = softmax(q[g] k[b, h, :Tk]^T, masked) v[b, h, :Tk] for every head g = b nh + h, R query rows at a time.
    q (B nh, Tq, hs) scaled by 1/sqrt(hs); k and v (B, nh, max_len, hs) with max_len >= Tk (a KV cache's buffers);
    mask (Tq, Tk) bool or (0, 0) for none; out (B nh, Tq, hs); s (R, Tk) scratch. R = rows and hs = dim are
    compile-time constants."""
    numba.literally(rows)
    numba.literally(dim)
    qs, acc = stack_tile(1, rows, dim), stack_tile(1, rows, dim)
    top, total = stack_tile(1, 1, rows), stack_tile(1, 1, rows)  # each row's largest score, its softmax's sum
    Tq, nh = q.shape[1], k.shape[1]
    for b in range(k.shape[0]):
        for h in range(nh):
            for r0 in range(0, Tq, rows):
                g = b * nh + h
                attend_group(q[g], r0, min(rows, Tq - r0), k[b, h], v[b, h], mask, out[g], s, qs, top, total, acc)


@functools.cache
def compiled(rows: int, dim: int):
    """``rows_kernel`` for R = rows and hs = dim, compiled (or loaded from numba's cache) on first use; calls go to
    the entry point (the dispatcher would resolve the literal arguments again on every call)."""
    return rows_kernel.compile(signature(rows, dim))


def signature(rows: int, dim: int) -> tuple:
    """``rows_kernel``'s argument types for R = rows and hs = dim: the arrays, then the two literals."""
    matrix, heads, cache = types.float32[:, ::1], types.float32[:, :, ::1], types.float32[:, :, :, ::1]
    return (heads, cache, cache, types.bool_[:, ::1], heads, matrix, types.literal(rows), types.literal(dim))


def cache_buffer(a):
    """The C-contiguous float32 (B, nh, max_len, hs) array whose first Tk rows per head are a (B, nh, Tk, hs): a
    itself, or the KV cache buffer a is a prefix view of, read in place; None for any other array (another dtype,
    a view of some of a buffer's heads or batch rows, or any other layout)."""
    if a.dtype != np.float32:
        return None
    if a.flags.c_contiguous:
        return a
    base = a.base
    if (isinstance(base, np.ndarray) and base.flags.c_contiguous and base.dtype == a.dtype
            and base.shape[:2] == a.shape[:2] and base.shape[3] == a.shape[3] and base.strides == a.strides
            and base.__array_interface__["data"][0] == a.__array_interface__["data"][0]):
        return base
    return None


def fits(q, k) -> bool:
    """Whether ``auto_attention`` runs ``row_attention`` on this NumPy call: float32, at most MAX_ROWS query rows
    and at least MIN_KEYS keys."""
    return q.dtype == k.dtype == np.float32 and fits_shape(q.shape[-2], k.shape[-2])


def fits_shape(rows: int, keys: int) -> bool:
    """``fits``'s rule on the shape alone: at most MAX_ROWS query rows (a grouped head's rows) over at least MIN_KEYS
    keys."""
    return rows <= MAX_ROWS and keys >= MIN_KEYS


def row_attention(q, k, v, causal=True, mask=None):
    """``naive_attention``'s output through ``rows_kernel``, one call for every head: (B, nh, Tq, hs),
    (B, nh, Tk, hs) x 2 -> (B, nh, Tq, hs), NumPy float32. ``mask`` (Tq, Tk) bool replaces the causal rule, as in
    ``naive_attention``."""
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    if Tq > Tk:
        raise ValueError(f"attention: {Tq} queries but only {Tk} keys (need Tq <= Tk)")
    if mask is not None:
        mask = np.ascontiguousarray(check_mask(mask, Tq, Tk))
    elif causal and Tq > 1:
        mask = causal_mask(Tq, Tk)
    qs = np.multiply(q, np.float32(1.0 / math.sqrt(hs)), dtype=np.float32, order="C").reshape(B * nh, Tq, hs)
    k_all, v_all = cache_buffer(k), cache_buffer(v)
    if k_all is None or v_all is None or k_all.shape != v_all.shape:  # another layout: contiguous copies
        k_all, v_all = (np.ascontiguousarray(a, dtype=np.float32) for a in (k, v))
    out = np.empty((B * nh, Tq, hs), dtype=np.float32)
    rows = min(Tq, ROW_GROUP)
    compiled(rows, hs)(qs, k_all, v_all, NO_MASK if mask is None else mask, out, np.empty((rows, Tk), dtype=np.float32),
                       rows, hs)
    return out.reshape(B, nh, Tq, hs)
