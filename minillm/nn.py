"""The layer functions both model families use, one equation each, below the models and the kernels.

``model.py`` (GPT-2) and ``llama.py`` build their blocks from these; ``fused.py`` writes the array code its
kernels replace with them; ``train.py`` differentiates them. Chapter 8's own three (``rms_norm``,
``apply_rope``, ``repeat_kv``) stay in ``llama.py``, where its exercises are.
"""

from __future__ import annotations

import math

from .backend import weight_product, xp

LN_EPS = 1e-5  # GPT-2's LayerNorm epsilon
GELU_C = math.sqrt(2.0 / math.pi)  # a Python float: a NumPy float64 scalar would upcast float32
GELU_A = 0.044715  # the cubic coefficient of the tanh approximation


def layer_norm(x, w, b):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis.  [..., C] -> [..., C]"""
    n = x.shape[-1]  # sum / n, not .mean(): NumPy's mean wrapper costs more than a decode step's math
    xc = x - x.sum(axis=-1, keepdims=True) / n
    var = (xc * xc).sum(axis=-1, keepdims=True) / n  # what x.var computes, without centering x twice
    return xc / xp.sqrt(var + LN_EPS) * w + b


def gelu(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's tanh approximation."""
    return 0.5 * x * (1.0 + xp.tanh(GELU_C * (x + GELU_A * x * x * x)))  # x*x*x: pow is slow


def silu(x):
    """x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2 (no exp overflow for large |x|)."""
    return x * (0.5 + 0.5 * xp.tanh(0.5 * x))


def linear(x, w, b=None):
    """x @ w (+ b) with w stored [in, out].  [..., in] -> [..., out]

    Every weight product of both models goes through here: ``weight_product(x, w.T)`` is x @ w through
    BLAS or, for a few token rows on a CPU, a kernel that streams w once (``minillm.backend``): the same
    numbers up to float32 rounding. A Llama weight stored [out, in] comes in as its transposed view."""
    y = weight_product(x, w.T)
    return y if b is None else y + b


def split_heads(x, n_head):
    """(B, T, C) -> (B, nh, T, hs)"""
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def merge_heads(y):
    """(B, nh, T, hs) -> (B, T, C)"""
    B, nh, T, hs = y.shape
    return y.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


def rope_cos_sin(pos, head_size: int, theta: float):
    """cos and sin of each position's angles pos * theta^(-2j/hs), j = 0..hs/2-1, for the rotate-half layout.

    Dimension j and j + hs/2 share angle j, so each table is [angles | angles] along the last axis.
    pos (T,) -> two (T, hs) float32 tables; pos (B, T) (a ragged batch) -> (B, 1, T, hs), one per row.
    Computed in float64: at position 8000 a float32 angle would be off by ~5e-4 rad.
    """
    inv_freq = theta ** (-xp.arange(0, head_size, 2, dtype=xp.float64) / head_size)  # (hs/2,)
    angles = xp.asarray(pos, dtype=xp.float64)[..., None] * inv_freq  # (..., T, hs/2)
    angles = xp.concatenate([angles, angles], axis=-1)  # (..., T, hs)
    if angles.ndim == 3:
        angles = angles[:, None]  # (B, 1, T, hs): broadcast over heads
    return xp.cos(angles).astype(xp.float32), xp.sin(angles).astype(xp.float32)
