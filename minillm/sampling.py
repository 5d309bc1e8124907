"""From logits to a token, in two separate steps.

1. ``logits_to_probs``: logits -> a probability vector, shaped by temperature, top-k and top-p.
   Temperature 0 means greedy: all mass on the argmax.
2. ``sample``: probabilities -> token ids, using an explicit ``numpy.random.Generator``.

``next_token`` does both for one row, and takes the argmax directly when decoding is greedy.

Keeping them apart matters for speculative decoding, which compares the draft's and the target's
probability vectors *after* the same transform. Sampling runs on the host in float64: the vectors
are small (V entries per row) and float64 keeps the statistical tests honest.
"""

from __future__ import annotations

import numpy as np

from .backend import to_numpy


def check_sampling_args(temperature, top_k, top_p) -> None:
    """Raise ValueError for a negative temperature, top_k < 1 or top_p outside (0, 1]."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def logits_to_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """(..., V) logits -> (..., V) float64 probabilities on the host.

    - temperature: divide logits by it; 0 puts all mass on the argmax (greedy).
    - top_k: keep the k most likely tokens (ties with the k-th are kept too).
    - top_p: keep the smallest set of most likely tokens whose mass reaches top_p (nucleus);
      the most likely token is always kept.

    Example: logits [2, 1, 0], top_k=2 -> [0.731, 0.269, 0].
    """
    check_sampling_args(temperature, top_k, top_p)
    logits = to_numpy(logits).astype(np.float64)
    if temperature == 0:  # one-hot at the argmax (not np.eye(V)[argmax]: that builds a V x V matrix)
        return (np.arange(logits.shape[-1]) == logits.argmax(axis=-1)[..., None]).astype(np.float64)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        logits = top_k_filter(logits, top_k)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1:
        probs = top_p_filter(probs, top_p)
    return probs


def top_k_filter(logits, k):
    """Set every logit below the k-th largest of its row to -inf.  [2, 1, 0], k=2 -> [2, 1, -inf]"""
    # EXERCISE 1.1 BEGIN: keep the k largest logits of each row (ties with the k-th kept), -inf elsewhere
    kth = np.sort(logits, axis=-1)[..., -k, None]  # the k-th largest logit of each row
    return np.where(logits >= kth, logits, -np.inf)
    # EXERCISE 1.1 END


def top_p_filter(probs, p):
    """Nucleus filter: keep the most likely tokens until their mass reaches p, renormalize.

    [0.5, 0.3, 0.15, 0.05], p=0.6 -> [0.625, 0.375, 0, 0]
    """
    # EXERCISE 1.2 BEGIN: keep a token while the mass of the more likely ones is below p; renormalize
    order = np.argsort(-probs, axis=-1, kind="stable")  # most likely first
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = np.zeros(probs.shape, dtype=bool)
    np.put_along_axis(keep, order, mass_before < p, axis=-1)
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum(axis=-1, keepdims=True)
    # EXERCISE 1.2 END


def sample(probs, rng: np.random.Generator):
    """Draw one token per row by inverting the CDF with one uniform number per row.

    (V,) -> int, or (..., V) -> (...) int array. Never returns a zero-probability token.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError("sample needs an explicit numpy.random.Generator")
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[:-1] + (1,)) * cdf[..., -1:]  # uniform in [0, total mass)
    idx = (cdf <= u).sum(axis=-1)  # the first index whose CDF exceeds u
    last_nonzero = probs.shape[-1] - 1 - np.argmax(probs[..., ::-1] > 0, axis=-1)
    idx = np.minimum(idx, last_nonzero)  # guard against u landing on a rounding sliver
    return int(idx) if idx.ndim == 0 else idx


def next_token(logits, rng: np.random.Generator, temperature=1.0, top_k=None, top_p=None) -> int:
    """One row of logits (V,) -> one token: ``sample(logits_to_probs(...))``, except that greedy
    decoding (temperature 0) takes the argmax directly; it needs no probability vector.
    """
    if temperature == 0:
        check_sampling_args(temperature, top_k, top_p)  # logits_to_probs checks them otherwise
        return int(logits.argmax())
    return sample(logits_to_probs(logits, temperature, top_k, top_p), rng)
