"""The layer functions both model families use, one equation each, below the models and the kernels.

``model.py`` (GPT-2) and ``llama.py`` build their blocks from these; ``fused.py`` writes the array code its
kernels replace with them; ``train.py`` differentiates them. The last three are Llama's, chapter 8's
exercises (``rms_norm`` 8.2, ``apply_rope`` 8.1, ``repeat_kv`` 8.3): they live here, below both the model and
the kernels, so that ``fused.py``'s references use them without importing a model.
"""

from __future__ import annotations

import math

from .backend import weight_product, xp

LN_EPS = 1e-5  # GPT-2's LayerNorm epsilon
GELU_C = math.sqrt(2.0 / math.pi)  # a Python float: a NumPy float64 scalar would upcast float32
GELU_A = 0.044715  # the cubic coefficient of the tanh approximation


def layer_norm(x, w, b, eps: float = LN_EPS):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis.  [..., C] -> [..., C]"""
    n = x.shape[-1]  # sum / n, not .mean(): NumPy's mean wrapper costs more than a decode step's math
    xc = x - x.sum(axis=-1, keepdims=True) / n
    var = (xc * xc).sum(axis=-1, keepdims=True) / n  # what x.var computes, without centering x twice
    return xc / xp.sqrt(var + eps) * w + b


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


def rms_norm(x, w, eps: float):
    """x / sqrt(mean(x^2) + eps) * w over the last axis.  [..., C] -> [..., C]"""
    # EXERCISE 8.2 BEGIN: divide x by its root mean square over the last axis (eps inside the root), scale by w
    mean_square = (x * x).sum(axis=-1, keepdims=True) / x.shape[-1]  # (..., 1)
    return x / xp.sqrt(mean_square + eps) * w
    # EXERCISE 8.2 END


def apply_rope(x, cos, sin):
    """Rotate each pair (x_j, x_{j+hs/2}) by its angle: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1).

    (B, nh, T, hs) with cos, sin from ``rope_cos_sin`` -> (B, nh, T, hs). Rotating q at position m and
    k at position n leaves their score depending on n - m only: R(m)q . R(n)k = q . R(n - m)k.
    Weights read from a GGUF file are in this layout once ``gguf.unpermute_rope_rows`` has run.
    """
    # EXERCISE 8.1 BEGIN: rotate dims j and j + hs/2 of each head by the angle in cos, sin (rotate half)
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half: (x1, x2) -> (-x2, x1)
    return x * cos + rotated * sin
    # EXERCISE 8.1 END


def repeat_kv(x, n_rep: int):
    """Grouped-query attention's head mapping: query head h reads key/value head h // n_rep.

    (B, n_kv_head, T, hs) -> (B, n_kv_head * n_rep, T, hs); KV heads [a, b] with n_rep = 2 -> [a, a, b, b].
    """
    # EXERCISE 8.3 BEGIN: repeat each key/value head n_rep times in a row along the head axis
    if n_rep == 1:
        return x
    B, n_kv, T, hs = x.shape
    x = xp.broadcast_to(x[:, :, None], (B, n_kv, n_rep, T, hs))  # (B, n_kv, n_rep, T, hs), no copy yet
    return x.reshape(B, n_kv * n_rep, T, hs)
    # EXERCISE 8.3 END
