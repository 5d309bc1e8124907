"""Scaled dot-product attention, written the plain way: the reference for every faster version.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(hs) + M) V        (Vaswani et al. 2017, Eq. 1)

Shapes follow one convention everywhere in minillm: q (B, nh, Tq, hs), k and v (B, nh, Tk, hs)
with Tq <= Tk. The Tq queries are the *last* Tq positions of the sequence, so with ``causal=True``
query i sits at absolute position Tk - Tq + i and may look at keys 0..Tk - Tq + i. This one rule
covers training (Tq = Tk), prefill, decode (Tq = 1) and speculative verification (Tq = K).
"""

from __future__ import annotations

import math

from .backend import xp


def softmax(x, axis=-1):
    """exp(x_i - max x) / sum_j exp(x_j - max x) along ``axis``.

    Subtracting the row max makes huge logits safe (softmax([1000, 1000]) = [0.5, 0.5], no inf).
    A row that is entirely -inf (fully masked) gives zeros instead of NaN.
    """
    m = x.max(axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)  # a fully masked row has max -inf; keep exp() at 0
    e = xp.exp(x - m)
    s = e.sum(axis=axis, keepdims=True)
    return e / xp.where(s == 0, 1, s)


def causal_mask(Tq: int, Tk: int):
    """(Tq, Tk) bool, True where query i (absolute position Tk - Tq + i) may attend to key j.

    Example: Tq=2, Tk=4 -> [[1, 1, 1, 0],
                            [1, 1, 1, 1]]
    """
    return xp.tri(Tq, Tk, k=Tk - Tq, dtype=bool)


def attention_weights(q, k, causal=True):
    """softmax(q k^T / sqrt(hs) + mask): the full (Tq, Tk) matrix of attention probabilities.

    (B, nh, Tq, hs), (B, nh, Tk, hs) -> (B, nh, Tq, Tk). Masked scores are set to -inf, so they
    get exactly zero weight; every row sums to 1.
    """
    Tq, Tk, hs = q.shape[-2], k.shape[-2], q.shape[-1]
    if Tq > Tk:
        raise ValueError(f"attention: {Tq} queries but only {Tk} keys (need Tq <= Tk)")
    att = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(hs))  # (B, nh, Tq, Tk)
    if causal and Tq > 1:  # one query (a decode step) is the newest token: it sees every key
        att = xp.where(causal_mask(Tq, Tk), att, -xp.inf)
    return softmax(att)


def naive_attention(q, k, v, causal=True):
    """softmax(q k^T / sqrt(hs) + mask) v, materializing the full (Tq, Tk) score matrix.

    (B, nh, Tq, hs), (B, nh, Tk, hs), (B, nh, Tk, hs) -> (B, nh, Tq, hs).
    """
    return attention_weights(q, k, causal) @ v  # (B, nh, Tq, Tk) @ (B, nh, Tk, hs)


def get_attention(name: str):
    """Attention implementation by name: 'naive', 'flash' (tiled, array code) or 'cuda' (kernel).

    Every implementation has the signature f(q, k, v, causal=True) -> (B, nh, Tq, hs).
    """
    if name == "naive":
        return naive_attention
    if name in ("flash", "cuda"):
        from . import flash_attention  # imported lazily: chapter 4 builds on this one

        return flash_attention.attention_function(name)
    raise ValueError(f"unknown attention implementation {name!r}: use 'naive', 'flash' or 'cuda'")
