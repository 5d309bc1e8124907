"""A Llama block's row-wise work on one CPU core: the residual add with RMSNorm, RoPE on q and k, SiLU(gate) * up.

Beside its weight products and its attention, a decode step of SmolLM2 runs, per block, two residual adds each
followed by an RMSNorm, RoPE on the query and key heads, and the MLP's SiLU(gate) * up: a few thousand numbers,
and, as NumPy array code (``nn.rms_norm``, ``nn.apply_rope``, ``nn.silu``), 4 to 8 operations each, every one a
call through the interpreter with its own temporary array. After a block's weights have streamed through the
CPU's caches each of those calls starts cold: timed inside a decode step (Intel Xeon, one thread, 128 cached
tokens) an add and RMSNorm of one 576-wide row took 20 microseconds, RoPE 12 for q or k, SiLU(gate) * up of 1,536
41, about 4 ms of an 18 ms step over SmolLM2's 30 blocks, where the arithmetic is under a microsecond.
Each kernel here does one of those in one call and one pass over its rows:

    add_rms_norm(x, h, w, eps)   s = x + h (x when h is None);  s / sqrt(mean(s^2) + eps) * w   -> (s, normed)
    rope(x, cos, sin)            x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)        -> a new array
    silu_mul(gate_up)            silu(gate) * up, gate and up the two halves of the last axis
    attend(qkv, cos, sin, K, V, start, nh)
                                 RoPE on q and k; k and v written into a KV cache's buffers at start; grouped
                                 causal attention over them (``row_attention``'s loop); the heads merged

A decode step's attention, through ``LlamaOps.attend``, a ``KVCache`` and ``row_attention``, is about 15 NumPy
calls per block (the heads split and merged, two RoPE calls, two slice writes, the scaled copy of q, the scratch):
timed inside a decode step after 128 tokens, 60 microseconds of a block's attention went to 18 in its kernel.
``attend`` is one call; ``llama.LlamaCpuOps`` uses it where the cache lends its buffers (``KVCache.in_place``).

Each returns what its reference returns, within float32 rounding (the RMSNorm's sum of squares is kept in float64;
the sigmoid uses ``row_attention.exp_nonpositive``, the vectorizable exponential, on -|x|). The references stay
the array code in ``minillm.nn`` and ``llama.LlamaOps``; ``llama.LlamaCpuOps`` calls these on a CPU, the models'
default where they match that array code (``llama.kernels_match_reference``), and ``Llama.set_block_ops("array")``
goes back to the reference (``tests/test_block_kernels.py``).
Compiled once per process for float32 arrays (loaded from numba's cache after the first run), called through
their entry points as ``row_attention``'s kernel is.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import types

from . import cpu_target
from .attention import causal_mask
from .qkernels import stack_tile
from .row_attention import FASTMATH, NO_MASK, ROW_GROUP, attend_group, exp_nonpositive, inline

cpu_target.full_width()  # 512-bit vectors on AVX-512, before the first numba function of the process
f32 = numba.float32
# "numpy" errors: a float divided by 0 gives inf instead of raising, so the division's loop has no exit and vectorizes
JIT = {"cache": True, "fastmath": FASTMATH, "nogil": True, "boundscheck": False, "error_model": "numpy"}
ROWS = types.float32[:, ::1]  # (rows, width), C-contiguous


@numba.njit(**JIT)
def add_rms_norm_kernel(x, h, w, eps, add, out_x, out_n):
    """out_x = x + h (x when not ``add``); out_n = out_x / sqrt(mean(out_x^2) + eps) * w, row by row."""
    rows, C = x.shape
    for r in range(rows):
        squares = 0.0  # float64
        for c in range(C):
            s = x[r, c] + h[r, c] if add else x[r, c]
            out_x[r, c] = s
            squares += np.float64(s) * np.float64(s)
        inv = f32(1.0 / np.sqrt(squares / C + eps))
        for c in range(C):
            out_n[r, c] = out_x[r, c] * inv * w[c]


@numba.njit(**JIT)
def silu_mul_kernel(gate_up, out):
    """out[r, j] = silu(gate_up[r, j]) * gate_up[r, H + j] for the H = out.shape[1] columns of each half."""
    rows, H = out.shape
    for r in range(rows):
        for j in range(H):
            g = gate_up[r, j]
            e = exp_nonpositive(-abs(g))  # e^-|g|: the sigmoid from an exponential of a nonpositive number
            sigmoid = f32(1.0) / (f32(1.0) + e) if g >= 0 else e / (f32(1.0) + e)
            out[r, j] = g * sigmoid * gate_up[r, H + j]


@inline
def turn(x, cos, sin, out):
    """out = x cos + rotate_half(x) sin for one head's row x (hs,) and its position's tables (hs,)."""
    half = x.shape[0] // 2
    for d in range(half):
        lo, hi = x[d], x[d + half]
        out[d] = lo * cos[d] - hi * sin[d]
        out[d + half] = hi * cos[d + half] + lo * sin[d + half]


@numba.njit(**JIT)
def rope_kernel(x, cos, sin, out):
    """out = x cos + rotate_half(x) sin for x (B, heads, T, hs) in any layout and the (T, hs) tables."""
    B, heads, T, hs = x.shape
    for b in range(B):
        for head in range(heads):
            for t in range(T):
                turn(x[b, head, t], cos[t], sin[t], out[b, head, t])


@numba.njit(**JIT)
def attend_kernel(qkv, cos, sin, k_all, v_all, start, scale, mask, out, qh, yh, s, rows, dim):
    """A block's attention from its q|k|v product, for every batch row b and key/value head h:

        k_all[b, h, start + t] = rope(k_t);  v_all[b, h, start + t] = v_t           the T new keys and values
        qh[g T + t] = rope(q_t of query head h n_rep + g) * scale                   the group's rows, as ``grouped``
        yh = softmax(qh k_all[b, h, :Tk]^T, masked) v_all[b, h, :Tk]                ``row_attention.attend_group``
        out[b, t, head hs : (head + 1) hs] = yh[g T + t]                             heads merged

    qkv (B, T, (nh + 2 n_kv) hs); cos, sin (T, hs); k_all, v_all (B, n_kv, max_len, hs), a KV cache's buffers,
    Tk = start + T <= max_len; mask (n_rep T, Tk) bool or (0, 0) for none; out (B, T, nh hs); qh, yh (n_rep T, hs)
    and s (R, Tk) scratch. R = rows and hs = dim are compile-time constants."""
    numba.literally(rows)
    numba.literally(dim)
    qs, acc = stack_tile(1, rows, dim), stack_tile(1, rows, dim)
    top, total = stack_tile(1, 1, rows), stack_tile(1, 1, rows)
    B, T = qkv.shape[0], qkv.shape[1]
    n_kv, group = k_all.shape[1], qh.shape[0]
    n_rep = group // T
    q_dim = n_kv * n_rep * dim
    for b in range(B):
        for h in range(n_kv):
            for t in range(T):
                key = q_dim + h * dim
                turn(qkv[b, t, key : key + dim], cos[t], sin[t], k_all[b, h, start + t])
                value = q_dim + (n_kv + h) * dim
                for d in range(dim):
                    v_all[b, h, start + t, d] = qkv[b, t, value + d]
                for g in range(n_rep):
                    head = (h * n_rep + g) * dim
                    turn(qkv[b, t, head : head + dim], cos[t], sin[t], qh[g * T + t])
                    for d in range(dim):
                        qh[g * T + t, d] *= scale
            for r0 in range(0, group, rows):
                attend_group(qh, r0, min(rows, group - r0), k_all[b, h], v_all[b, h], mask, yh, s, qs, top, total, acc)
            for g in range(n_rep):
                head = (h * n_rep + g) * dim
                for t in range(T):
                    for d in range(dim):
                        out[b, t, head + d] = yh[g * T + t, d]


@functools.cache
def compiled(name: str):
    """The kernel called name, compiled for float32 arrays (or loaded from numba's cache) on first use."""
    kernel, signature = {
        "add_rms_norm": (add_rms_norm_kernel, (ROWS, ROWS, types.float32[::1], types.float64, types.boolean,
                                               ROWS, ROWS)),
        "silu_mul": (silu_mul_kernel, (ROWS, ROWS)),
        "rope": (rope_kernel, (types.float32[:, :, :, :], ROWS, ROWS, types.float32[:, :, :, ::1])),
    }[name]
    return kernel.compile(signature)


@functools.cache
def compiled_attend(rows: int, dim: int):
    """``attend_kernel`` for R = rows and hs = dim, compiled (or loaded from numba's cache) on first use."""
    heads, cache = types.float32[:, :, ::1], types.float32[:, :, :, ::1]
    return attend_kernel.compile((heads, ROWS, ROWS, cache, cache, types.int64, types.float32, types.bool_[:, ::1],
                                  heads, ROWS, ROWS, ROWS, types.literal(rows), types.literal(dim)))


def rows_of(a) -> np.ndarray:
    """a (..., width) as C-contiguous float32 rows (rows, width): a view where it already is one."""
    return np.ascontiguousarray(a, dtype=np.float32).reshape(-1, a.shape[-1])


def add_rms_norm(x, h, w, eps: float) -> tuple:
    """(x + h, its RMSNorm scaled by w) for x, h (..., C) (h None: x itself, normed), w (C,) -> two new arrays."""
    C = x.shape[-1]
    if w.shape != (C,) or (h is not None and h.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {x.shape}, h {None if h is None else h.shape}, w {w.shape}")
    out_x, out_n = np.empty(x.shape, dtype=np.float32), np.empty(x.shape, dtype=np.float32)
    rows = rows_of(x)
    compiled("add_rms_norm")(rows, rows if h is None else rows_of(h), np.ascontiguousarray(w, dtype=np.float32),
                             float(eps), h is not None, out_x.reshape(-1, C), out_n.reshape(-1, C))
    return out_x, out_n


def silu_mul(gate_up) -> np.ndarray:
    """silu(gate) * up for gate_up (..., 2H), gate and up its two halves -> (..., H)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: the last axis holds gate and up, two halves; got {gate_up.shape[-1]}")
    H = gate_up.shape[-1] // 2
    out = np.empty((*gate_up.shape[:-1], H), dtype=np.float32)
    compiled("silu_mul")(rows_of(gate_up), out.reshape(-1, H))
    return out


def rope(x, cos, sin) -> np.ndarray:
    """``nn.apply_rope`` for x (B, heads, T, hs) float32 (any layout) and (T, hs) tables -> a new C-contiguous array."""
    T, hs = x.shape[-2:]
    if cos.shape != (T, hs) or sin.shape != (T, hs) or hs % 2:
        raise ValueError(f"rope: x {x.shape} needs (T, hs) = {(T, hs)} tables of an even hs, got {cos.shape}")
    out = np.empty(x.shape, dtype=np.float32)
    compiled("rope")(x, np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32), out)
    return out


def attend(qkv, cos, sin, k_all, v_all, start: int, n_head: int) -> np.ndarray:
    """A Llama block's causal grouped-query attention in one call, the keys and values written in place: the T new
    tokens' k (turned by RoPE) and v go to positions start..start+T-1 of the KV buffers k_all, v_all
    (B, n_kv_head, max_len, hs), and every query head attends over positions 0..start+T-1, as ``LlamaOps.attend``
    through a ``KVCache`` and ``row_attention`` would. qkv (B, T, (n_head + 2 n_kv_head) hs), cos and sin (T, hs)
    -> (B, T, n_head hs), the heads merged."""
    B, T, width = qkv.shape
    n_kv, max_len, hs = k_all.shape[1:]
    n_rep = n_head // max(n_kv, 1)
    if (width != (n_head + 2 * n_kv) * hs or n_rep * n_kv != n_head or cos.shape != (T, hs) or sin.shape != (T, hs)
            or k_all.shape != v_all.shape or k_all.shape[0] != B or not 0 <= start <= max_len - T or hs % 2):
        raise ValueError(f"attend: q|k|v {qkv.shape} of {n_head} query heads, tables {cos.shape}, KV buffers "
                         f"{k_all.shape} at {start}")
    if not all(a.dtype == np.float32 and a.flags.c_contiguous for a in (k_all, v_all)):
        raise ValueError("attend: the KV buffers must be C-contiguous float32, written in place")
    Tk, group = start + T, n_rep * T
    mask = NO_MASK if T == 1 else np.tile(causal_mask(T, Tk), (n_rep, 1))  # row g T + t sees keys 0..start+t
    rows = min(group, ROW_GROUP)
    out = np.empty((B, T, n_head * hs), dtype=np.float32)
    qh, yh = np.empty((group, hs), dtype=np.float32), np.empty((group, hs), dtype=np.float32)
    compiled_attend(rows, hs)(np.ascontiguousarray(qkv, dtype=np.float32), np.ascontiguousarray(cos, dtype=np.float32),
                              np.ascontiguousarray(sin, dtype=np.float32), k_all, v_all, start,
                              np.float32(1.0 / math.sqrt(hs)), mask, out, qh, yh,
                              np.empty((rows, Tk), dtype=np.float32), rows, hs)
    return out
