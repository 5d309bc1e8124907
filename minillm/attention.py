"""Scaled dot-product attention, written the plain way: the reference for every faster version.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(hs) + M) V        (Vaswani et al. 2017, Eq. 1)

Shapes follow one convention everywhere in minillm: q (B, nh, Tq, hs), k and v (B, nh, Tk, hs)
with Tq <= Tk. The Tq queries are the *last* Tq positions of the sequence, so with ``causal=True``
query i sits at absolute position Tk - Tq + i and may look at keys 0..Tk - Tq + i. This one rule
covers training (Tq = Tk), prefill, decode (Tq = 1) and speculative verification (Tq = K).
An explicit ``mask`` (Tq, Tk), True where query i may see key j, replaces the causal rule: a token
tree verified in one forward (``minillm.token_tree``) needs one in which siblings do not see each other.
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


def sliding_window_mask(Tq: int, Tk: int, window: int):
    """(Tq, Tk) bool: ``causal_mask`` that also hides keys more than window - 1 before each query.

    Local attention (Longformer, Beltagy et al. 2020; Mistral 7B's sliding window): query i, at
    absolute position p = Tk - Tq + i, may attend to keys p - window + 1 .. p. A window of Tk or more
    is the causal mask.

    Example: Tq=2, Tk=4, window=2 -> [[0, 1, 1, 0],
                                       [0, 0, 1, 1]]
    """
    if window < 1:
        raise ValueError(f"sliding_window_mask: window must be >= 1, got {window}")
    # EXERCISE 2.1 BEGIN: True where key j lies in p - window + 1 .. p, p = Tk - Tq + i the query's position
    near = ~xp.tri(Tq, Tk, k=Tk - Tq - window, dtype=bool)  # j > p - window
    return causal_mask(Tq, Tk) & near
    # EXERCISE 2.1 END


def check_mask(mask, Tq: int, Tk: int):
    """An explicit attention mask must be a (Tq, Tk) bool array; -> the mask on the backend."""
    mask = xp.asarray(mask)
    if mask.shape != (Tq, Tk) or mask.dtype != bool:
        raise ValueError(f"attention mask must be bool of shape ({Tq}, {Tk}), got {mask.dtype} {mask.shape}")
    return mask


def attention_weights(q, k, causal=True, window=None, mask=None):
    """softmax(q k^T / sqrt(hs) + mask): the full (Tq, Tk) matrix of attention probabilities.

    (B, nh, Tq, hs), (B, nh, Tk, hs) -> (B, nh, Tq, Tk). Masked scores are set to -inf, so they
    get exactly zero weight; every row sums to 1. ``window``: attend only to each query's last
    ``window`` keys (``sliding_window_mask``; implies causal). ``mask`` (Tq, Tk) bool: attend
    exactly where it is True (replaces ``causal``).
    """
    Tq, Tk, hs = q.shape[-2], k.shape[-2], q.shape[-1]
    if Tq > Tk:
        raise ValueError(f"attention: {Tq} queries but only {Tk} keys (need Tq <= Tk)")
    att = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(hs))  # (B, nh, Tq, Tk)
    if mask is not None:
        att = xp.where(check_mask(mask, Tq, Tk), att, -xp.inf)
    elif window is not None:
        att = xp.where(sliding_window_mask(Tq, Tk, window), att, -xp.inf)
    elif causal and Tq > 1:  # one query (a decode step) is the newest token: it sees every key
        att = xp.where(causal_mask(Tq, Tk), att, -xp.inf)
    return softmax(att)


def attention_entropy(weights):
    """H = -sum_j w_j log w_j of each query's attention row, in nats: how spread out it is.

    (..., Tq, Tk) -> (..., Tq). 0 for a query that looks at one key, log n for one that spreads
    evenly over n keys. Masked keys (w = 0) contribute 0, the limit of w log w, never NaN.
    Example: rows [1, 0, 0] and [0.5, 0.5, 0] -> [0, 0.693].
    """
    # EXERCISE 2.2 BEGIN: sum -w log w over the keys, counting 0 log 0 as 0
    log_w = xp.log(xp.where(weights > 0, weights, 1.0))  # log 1 = 0 stands in where w = 0
    return -(weights * log_w).sum(axis=-1)
    # EXERCISE 2.2 END


def naive_attention(q, k, v, causal=True, mask=None):
    """softmax(q k^T / sqrt(hs) + mask) v, materializing the full (Tq, Tk) score matrix.

    (B, nh, Tq, hs), (B, nh, Tk, hs), (B, nh, Tk, hs) -> (B, nh, Tq, hs). ``mask`` (Tq, Tk) bool,
    if given, replaces the causal rule.
    """
    return attention_weights(q, k, causal, mask=mask) @ v  # (B, nh, Tq, Tk) @ (B, nh, Tk, hs)

