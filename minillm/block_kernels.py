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

import numba
import numpy as np
from numba import types

from . import cpu_target
from .row_attention import FASTMATH, exp_nonpositive

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


@numba.njit(**JIT)
def rope_kernel(x, cos, sin, out):
    """out = x cos + rotate_half(x) sin for x (B, heads, T, hs) in any layout and the (T, hs) tables."""
    B, heads, T, hs = x.shape
    half = hs // 2
    for b in range(B):
        for head in range(heads):
            for t in range(T):
                for d in range(half):
                    lo, hi = x[b, head, t, d], x[b, head, t, d + half]
                    out[b, head, t, d] = lo * cos[t, d] - hi * sin[t, d]
                    out[b, head, t, d + half] = hi * cos[t, d + half] + lo * sin[t, d + half]


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
