"""From logits to a token, in two separate steps, under one settings object checked once.

0. ``SamplingSettings(temperature, top_k, top_p)``: frozen, validated when it is made; every
   decoding loop builds one at its entry and passes it on, so nothing is re-checked per token.
1. ``settings.probs(logits)``: logits -> a probability vector, shaped by temperature, top-k and
   top-p. Temperature 0 means greedy: all mass on the argmax.
2. ``sample``: probabilities -> token ids, using an explicit ``numpy.random.Generator``.

``settings.next_token`` does both for one row, and takes the argmax directly when decoding is
greedy. ``next_tokens`` does it for a batch of rows with one transfer to the host (a GPU waits once
per step, not once per row). ``logits_to_probs(logits, temperature=..., ...)`` is step 1 for one-off use.

Every path refuses logits that are not finite (``check_finite_rows``: a row whose maximum is nan,
+inf or -inf, as a diverged model gives), where a sampler would otherwise turn NaN probabilities
into token 0 forever. The check is one row maximum the sampler computes anyway, and no extra
transfer from the device.

Keeping them apart matters for speculative decoding, which compares the draft's and the target's
probability vectors *after* the same transform. Sampling runs on the host in float64: the vectors
are small (V entries per row) and float64 keeps the statistical tests honest.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .backend import to_numpy

# The smallest positive temperature. Below it sampling is greedy decoding in all but name (a logit
# gap of 1e-3 is already a factor e^-1000 = 0 in float64), and dividing by a subnormal such as
# 1e-320 turns logits into inf and the probabilities into NaN. Use 0 for greedy decoding.
MIN_TEMPERATURE = 1e-6
# ``nucleus``: how the candidates' cut falls, and how far past p their mass must be (top-p's "mass before" of
# the next token is that mass plus and minus the token's own probability, rounded: an ulp or two below it at worst)
NUCLEUS_STEP, NUCLEUS_MARGIN = 1 / 16, 1e-12


def finite_real(x) -> bool:
    """A real number (not a bool) that a float holds finitely: 10**400 is refused, not an OverflowError."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True)
class SamplingSettings:
    """How logits become a token: temperature (0 = greedy), top-k, top-p. Checked once, here.

    Refused with ValueError: a temperature that is not a finite number, negative, or positive but
    below MIN_TEMPERATURE; top_k not an integer >= 1; top_p outside (0, 1].
    Example: SamplingSettings(0.8, top_k=40).probs(logits) -> (V,) float64.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not finite_real(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {k!r}")
        if p is not None and (not finite_real(p) or not 0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits):
        """(..., V) logits -> (..., V) float64 probabilities on the host.

        - temperature: divide logits by it; 0 puts all mass on the argmax (greedy).
        - top_k: keep the k most likely tokens (ties with the k-th are kept too).
        - top_p: keep the smallest set of most likely tokens whose mass reaches top_p (nucleus);
          the most likely token is always kept.

        Example: logits [2, 1, 0], top_k=2 -> [0.731, 0.269, 0].
        """
        logits = to_numpy(logits).astype(np.float64)
        best = check_finite_rows(checked_argmax(logits))
        if self.greedy:  # one-hot at the argmax (not np.eye(V)[argmax]: that builds a V x V matrix)
            return (np.arange(logits.shape[-1]) == best[..., None]).astype(np.float64)
        # in place on the one float64 copy: on SmolLM2's 49,152 tokens each (V,) temporary costs more in page
        # faults than its arithmetic (a row's probs took 0.11 ms so against 0.30 with temporaries)
        if self.temperature != 1:
            logits /= self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            logits = top_k_filter(logits, self.top_k)
        logits -= logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits, out=logits)
        probs /= probs.sum(axis=-1, keepdims=True)
        if self.top_p is not None and self.top_p < 1:
            probs = nucleus(probs, self.top_p)
        return probs

    def next_token(self, logits, rng: np.random.Generator) -> int:
        """One row of logits (V,) -> one token: ``sample(self.probs(logits), rng)``, except that
        greedy decoding takes the argmax directly; it needs no probability vector."""
        if self.greedy:
            return int(check_finite_rows(to_numpy(checked_argmax(logits))))
        return sample(self.probs(logits), rng)


def next_tokens(logits, settings, rngs) -> list[int]:
    """(B, V) logits, one SamplingSettings and one generator per row -> B tokens, ``next_token`` row by
    row, with ONE transfer to the host: when every row is greedy, one argmax over the rows on the device
    and the B ids come down; otherwise the logits come down once and each row is drawn on the host.
    (Calling next_token per device row would wait for the device B times per step.)
    """
    if all(s.greedy for s in settings):
        return check_finite_rows(to_numpy(checked_argmax(logits))).tolist()
    return [s.next_token(row, rng) for s, row, rng in zip(settings, to_numpy(logits), rngs)]


NOT_FINITE = -1  # what checked_argmax gives for a row whose maximum is not finite


def checked_argmax(logits):
    """(..., V) logits -> (...) the argmax of each row, NOT_FINITE where the row's maximum is nan, +inf
    or -inf. Computed where the logits are (device or host), so it costs no extra transfer."""
    top = logits.max(axis=-1)
    finite = (top > -math.inf) & (top < math.inf)  # False for nan too
    return logits.argmax(axis=-1) * finite + NOT_FINITE * ~finite


def check_finite_rows(ids):
    """``checked_argmax``'s ids on the host -> the same ids; ValueError when a row was not finite."""
    if np.any(np.asarray(ids) == NOT_FINITE):
        raise ValueError("the model's logits are not finite (nan or inf): its weights are broken, "
                         "e.g. by a diverged training run")
    return ids


def logits_to_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """(..., V) logits -> (..., V) float64 probabilities: ``SamplingSettings(...).probs(logits)``."""
    return SamplingSettings(temperature, top_k, top_p).probs(logits)


def top_k_filter(logits, k):
    """Set every logit below the k-th largest of its row to -inf.  [2, 1, 0], k=2 -> [2, 1, -inf]"""
    # EXERCISE 1.1 BEGIN: keep the k largest logits of each row (ties with the k-th kept), -inf elsewhere
    kth = np.partition(logits, -k, axis=-1)[..., -k, None]  # the k-th largest logit of each row (no full sort)
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


def nucleus(probs, p):
    """``top_p_filter`` run on each row's few tokens that can be kept, in place (``probs`` is the caller's own
    array, ``SamplingSettings.probs``'): the same tokens kept, their probabilities within rounding (the
    renormalizing sum runs over fewer zeros).  (..., V) -> (..., V), ``probs`` itself where it is contiguous

    Sorting a row of SmolLM2's 49,152 probabilities took 4.4 ms, 40 % of a decode step, where the nucleus of
    p = 0.9 at a chat's temperature holds a few tokens. The candidates are the tokens at least 1/16 as likely as
    the most likely one, then 1/256, ... (ties all in: the first tokens of the sorted row) until their mass
    passes p, each a single comparison over the row; every token after them has that mass before it, so top-p
    drops it either way. Past a quarter of the row the whole row is taken."""
    size = probs.shape[-1]
    rows = np.ascontiguousarray(probs).reshape(-1, size)  # probs itself, unless it was not laid out in rows
    for row in rows:
        cut, candidates = row.max(), None
        while candidates is None:
            cut *= NUCLEUS_STEP
            these = np.flatnonzero(row >= cut)
            if len(these) > size // 4:
                candidates = np.arange(size)
            elif np.cumsum(np.sort(row[these])[::-1])[-1] >= p + NUCLEUS_MARGIN:  # their mass, summed as top-p
                candidates = these
        kept = top_p_filter(row[candidates], p)
        row[:] = 0.0
        row[candidates] = kept
    return rows.reshape(probs.shape)


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
