"""Speculative decoding: a cheap draft proposes K tokens, the target checks them all in one forward.

    round:  draft proposes x_0..x_{K-1} ~ q          (K cheap draft steps)
            target computes p_0..p_K in ONE forward   (over pending token + the K drafts)
            accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order
            at the first rejection emit y ~ norm(max(0, p_i - q_i)) and drop the rest,
            if all K are accepted emit a bonus y ~ p_K
            roll both KV caches back past the rejected position (KVCache.truncate, O(1))

Every emitted token is distributed exactly as the target would have sampled it (Leviathan et al.
2023, "Fast Inference from Transformers via Speculative Decoding", Theorem 3.5; Chen et al. 2023),
so the draft changes only the speed. At temperature 0 the check is exact: accept while the draft
token is the target's argmax, so the output is the target's own greedy output, token for token.

The pieces, smallest first:

- ``residual_distribution(p, q)``: norm(max(0, p - q)), the distribution of a token drawn after a
  rejection (falls back to p when p == q up to rounding leaves nothing: no NaN).
- ``verify``: the rejection-sampling core, a pure function of (drafts, q, p, rng).
- ``verify_greedy``: the temperature-0 check on target logits.
- ``propose`` and ``judge``: one round's random choices (the draft's proposal, the target's
  verdict), shared by every loop: this module's two and the batched one of chapter 7.
- ``SequenceState``: one sequence's bookkeeping (what each cache holds, the rollback).
- ``speculative_generate``: the decoding loop with two KV caches. Its naive reference,
  ``speculative_generate_naive``, makes the same random draws without caches (every forward runs
  the whole sequence), so the two must agree token for token. Both return a ``GenerationResult``
  whose stats are a ``SpecStats``.
- ``expected_tokens_per_call`` and ``expected_speedup``: Leviathan et al. Eq. 1 and Theorem 3.8.

Acceptance rate. ``SpecStats.alpha`` is the fraction of *checked* draft tokens that were accepted
(accepted / (accepted + rejections)): draft tokens after the first rejection are never checked, so
dividing by all proposed tokens would underestimate alpha (at alpha = 0.8, K = 8 by half).

Context policy: ``minillm.generate.fit_context``, the one ``generate`` uses. When the target's
pending tokens no longer fit its cache, the cache is reset and the last ``max_len // 2`` tokens are
prefilled again; near the limit a round proposes fewer drafts so that verification never crosses
it. Because the window moves exactly when ``generate`` moves it, greedy speculative decoding equals
``generate`` token for token even past the context length (with caches of the same size). The
draft's window is its own business (any draft is lossless).

``greedy_speculative_generate`` is chapter 12's version: both models on the static steps of ``minillm.fused``,
the target's verify of k drafts one captured step, rollback one copy of the lengths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import synchronize, to_numpy, xp
from .fused import StaticStep, next_id, start_decoding, static_prefill
from .generate import GenerationResult, Throughput, check_prompt, fit_context
from .kv_cache import KVCache
from .sampling import SamplingSettings, sample

# ----------------------------------------------------------------------------------------------
# the rejection-sampling core (pure functions of probability vectors)


def residual_distribution(p, q):
    """norm(max(0, p - q)): where a token is drawn after a rejection.  (V,), (V,) -> (V,) float64

    Tokens the target likes more than the draft get the mass the draft over-proposed elsewhere.
    When p <= q everywhere (p == q up to rounding) nothing is left; a rejection then only happens
    through rounding, and p itself is returned instead of 0/0 = NaN.

    Example: p = [0.5, 0.5, 0, 0], q = [0.25, 0.25, 0.25, 0.25] -> [0.5, 0.5, 0, 0].
    """
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    # EXERCISE 5.1 BEGIN: clip p - q at zero and normalize; return p when nothing is left
    residual = p - q
    np.maximum(residual, 0.0, out=residual)  # in place: on a large vocabulary a temporary costs more than the sum
    total = residual.sum()
    if not total > 0.0:
        return p / p.sum()
    residual /= total
    return residual
    # EXERCISE 5.1 END


def _check_verify_shapes(draft_tokens, draft_probs, target_probs):
    K = len(draft_tokens)
    if draft_probs.shape[:1] != (K,) or draft_probs.ndim != 2:
        raise ValueError(f"draft_probs must be (K, V) = ({K}, V), got {draft_probs.shape}")
    if target_probs.shape != (K + 1, draft_probs.shape[1]):
        raise ValueError(
            f"target_probs must be (K + 1, V) = ({K + 1}, {draft_probs.shape[1]}), "
            f"got {target_probs.shape}"
        )


def verify(draft_tokens, draft_probs, target_probs, rng: np.random.Generator) -> tuple[list[int], int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1): -> (emitted tokens, number accepted).

    draft_tokens (K,) were drawn from draft_probs q (K, V); target_probs p (K + 1, V), row K being
    the bonus position. In order, x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at
    the first rejection a token drawn from ``residual_distribution(p_i, q_i)`` is emitted and the
    rest are dropped; when all K are accepted a bonus token drawn from p_K is emitted. So 1..K+1
    tokens come out, and each is distributed exactly as the target would have drawn it:
        P(y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * residual(y) = p(y).
    Randomness: one uniform per checked draft token, one draw for the final token, all from ``rng``.

    Example: p == q -> every x_i is accepted and K + 1 tokens come out.
    """
    draft_probs = np.asarray(draft_probs, dtype=np.float64)
    target_probs = np.asarray(target_probs, dtype=np.float64)
    _check_verify_shapes(draft_tokens, draft_probs, target_probs)
    # EXERCISE 5.2 BEGIN: accept x_i w.p. min(1, p_i(x_i)/q_i(x_i)); residual at a rejection; bonus
    emitted = []
    for i, x in enumerate(draft_tokens):
        x = int(x)
        p_x, q_x = target_probs[i, x], draft_probs[i, x]
        if not q_x > 0:
            raise ValueError(f"draft token {x} at position {i} has draft probability {q_x}")
        if rng.random() < min(1.0, p_x / q_x):
            emitted.append(x)
            continue
        emitted.append(sample(residual_distribution(target_probs[i], draft_probs[i]), rng))
        return emitted, i
    emitted.append(sample(target_probs[len(draft_tokens)], rng))  # all accepted: the bonus token
    return emitted, len(draft_tokens)
    # EXERCISE 5.2 END


def verify_greedy(draft_tokens, target_logits) -> tuple[list[int], int]:
    """Temperature 0: accept while x_i is the target's argmax. -> (emitted tokens, number accepted)

    target_logits (K + 1, V) are the target's logits at the K draft positions plus the bonus one.
    At the first mismatch the target's argmax is emitted instead; when all K match, the argmax of
    row K is the bonus. The output is exactly the target's own greedy continuation.
    (Accepting by the ratio p(x)/q(x) of softmax probabilities instead would not be: the draft's
    one-hot q makes that "accept with probability p(x)", a sample, not the argmax.)

    Example: drafts [3, 5], argmaxes [3, 7, 1] -> ([3, 7], 1).
    """
    target_logits = to_numpy(target_logits)
    if target_logits.ndim != 2 or target_logits.shape[0] != len(draft_tokens) + 1:
        raise ValueError(
            f"target_logits must be (K + 1, V) with K = {len(draft_tokens)}, got {target_logits.shape}"
        )
    # EXERCISE 5.3 BEGIN: accept while draft == target argmax; then the target's argmax (or bonus)
    best = target_logits.argmax(axis=-1)  # (K + 1,) the target's greedy choice at each position
    emitted = []
    for i, x in enumerate(draft_tokens):
        if int(x) != int(best[i]):
            emitted.append(int(best[i]))
            return emitted, i
        emitted.append(int(x))
    emitted.append(int(best[len(draft_tokens)]))
    return emitted, len(draft_tokens)
    # EXERCISE 5.3 END


# ----------------------------------------------------------------------------------------------
# theory (Leviathan et al. 2023, section 3)


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """E[tokens per target call] = (1 - alpha^(k+1)) / (1 - alpha)   (Leviathan et al. Eq. 1).

    Each draft token is accepted with probability alpha until the first rejection; the round emits
    the accepted ones plus one (the residual or bonus token): 1 + alpha + ... + alpha^k.
    Example: alpha = 0.8, k = 4 -> 3.3616; alpha = 1 -> k + 1; alpha = 0 -> 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    # EXERCISE 5.4 BEGIN: the geometric series 1 + alpha + ... + alpha^k in closed form
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    # EXERCISE 5.4 END


def expected_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Walltime improvement (1 - alpha^(k+1)) / ((1 - alpha)(k c + v))   (Leviathan et al. Thm 3.8).

    A round costs k draft steps (c target steps each) plus one target verification of k + 1
    tokens, v = v(k + 1) target decode steps (the paper assumes v = 1; ``measure.verify_cost``
    measures it); it yields ``expected_tokens_per_call(alpha, k)`` tokens.
    Example: alpha = 0.8, k = 4, c = 0.1 -> 3.3616 / 1.4 = 2.401; with v = 2: 3.3616 / 2.4 = 1.401.
    """
    if c < 0 or not v > 0:
        raise ValueError(f"c must be >= 0 and v > 0, got c={c}, v={v}")
    return expected_tokens_per_call(alpha, k) / (k * c + v)


# ----------------------------------------------------------------------------------------------
# statistics of a run


@dataclass
class SpecStats(Throughput):
    """Counters of one speculative generation.

    Per draft position i (0..k-1): ``reached_at[i]`` counts rounds whose check got to x_i (all
    earlier drafts accepted), ``accepted_at[i]`` those where x_i was accepted.
    """

    k: int
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    target_calls: int = 0  # target forward passes (one per round)
    draft_calls: int = 0  # draft forward passes
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    rejected: int = 0  # rounds that ended at a rejection (the others ended with a bonus token)
    verified: int = 0  # tokens sent to the target to check: the drafts, or a token tree's nodes past its root
    accepted_at: list = field(default_factory=list)
    reached_at: list = field(default_factory=list)
    reprefills: int = 0  # times the target's context window was prefilled again
    dropped_prompt_tokens: int = 0  # leading prompt tokens never fed: the prompt was longer than the window
    first_round_tokens: int = 0  # tokens the first round emitted (all available at the TTFT)
    ttft_s: float = 0.0  # prompt in -> first round's tokens out (includes both prefills)
    total_s: float = 0.0
    round_times_s: list = field(default_factory=list)
    accept_s: float = 0.0  # seconds spent judging the target's rows (a token tree's loop: softmax, acceptance)

    def __post_init__(self):
        self.accepted_at = self.accepted_at or [0] * self.k
        self.reached_at = self.reached_at or [0] * self.k

    def record_round(self, k_round: int, n_accepted: int, verified: int | None = None) -> None:
        """One round proposed k_round drafts (a tree: its depth) and accepted the first n_accepted.

        ``verified``: tokens the target checked (default k_round; a tree checks all its nodes).
        """
        if self.rounds == 0:
            self.first_round_tokens = n_accepted + 1
        self.rounds += 1
        self.proposed += k_round
        self.verified += k_round if verified is None else verified
        self.accepted += n_accepted
        self.rejected += n_accepted < k_round
        for i in range(min(n_accepted + 1, k_round)):
            self.reached_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def checked(self) -> int:
        """Draft tokens the target actually judged (those after a rejection never are)."""
        return self.accepted + self.rejected

    @property
    def alpha(self) -> float:
        """Acceptance rate: P(a checked draft token is accepted) = accepted / checked."""
        return self.accepted / self.checked if self.checked else float("nan")

    @property
    def accepted_per_proposed(self) -> float:
        """Accepted / proposed: the share of the draft's work that was kept (<= alpha)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def tokens_per_call(self) -> float:
        """New tokens per target forward pass (plain decoding: 1)."""
        return self.new_tokens / self.target_calls if self.target_calls else float("nan")

    @property
    def verified_per_call(self) -> float:
        """Tokens checked per target forward (besides the one every decode step feeds)."""
        return self.verified / self.target_calls if self.target_calls else float("nan")

    @property
    def acceptance_by_position(self) -> list:
        """P(x_i accepted | x_i checked) for each draft position i (NaN where never checked)."""
        return [a / r if r else float("nan") for a, r in zip(self.accepted_at, self.reached_at)]

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first round's tokens."""
        n = self.new_tokens - self.first_round_tokens
        return (self.total_s - self.ttft_s) / n if n > 0 else 0.0

    def finish(self, tokens) -> GenerationResult:
        """Close the run: count its new tokens and its time -> GenerationResult(tokens, self)."""
        self.new_tokens = len(tokens)
        self.total_s = float(sum(self.round_times_s))
        self.ttft_s = self.round_times_s[0] if self.round_times_s else 0.0
        return GenerationResult(tokens, self)


# ----------------------------------------------------------------------------------------------
# one round's random choices, shared by the fast loop, its naive reference and the batched loop


def propose(logits, settings: SamplingSettings, rng: np.random.Generator):
    """Draft logits (V,) -> (token, q row or None). Greedy needs no probabilities."""
    if settings.greedy:
        return int(logits.argmax()), None
    q = settings.probs(logits)
    return sample(q, rng), q


def judge(drafts, q_rows, target_logits, settings: SamplingSettings, rng: np.random.Generator):
    """Target logits (k + 1, V) for the k drafts -> (emitted tokens, number accepted)."""
    if settings.greedy:
        return verify_greedy(drafts, target_logits)
    p = settings.probs(target_logits)  # the same transform as q
    q = np.array(q_rows).reshape(len(drafts), p.shape[-1])  # (k, V)
    return verify(drafts, q, p, rng)


def check_speculative_args(target, draft, prompt_ids, max_new_tokens, k) -> list[int]:
    """``check_prompt``, plus k >= 1 and one vocabulary for both models -> the prompt as a list."""
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    if not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k (draft tokens per round) must be an int >= 1, got {k!r}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft.config.vocab_size}) != target vocabulary "
            f"({target.config.vocab_size}): speculative decoding needs the same tokenizer"
        )
    return prompt_ids


# ----------------------------------------------------------------------------------------------
# one sequence's bookkeeping: what each model's cache holds, and the rollback


@dataclass
class SequenceState:
    """One sequence being decoded speculatively: its tokens, and what each model has not seen yet.

    Each model keeps a decode cache (``minillm.cache_contract``: a ``KVCache``, one sequence of a
    ``PagedKVCache``, ...) plus a list of *pending* tokens it has not seen yet; a forward call feeds
    only those. Invariant between rounds: each cache holds ``seq`` minus its pending tokens (or a
    later window of it after a re-prefill).
    ``plan`` (pass 1) and ``commit`` (pass 4) are the per-sequence halves of a round; the forward
    passes in between are the caller's, so the batched loop (``minillm.batch_speculative``) runs
    the same bookkeeping for every sequence of a batch.
    """

    seq: list  # prompt + every token emitted so far
    n_prompt: int  # len(prompt)
    stop: int  # len(seq) at which generation ends
    tcache: object  # the target's decode cache
    dcache: object  # the draft's decode cache
    t_pending: list  # tokens the target has not seen yet
    d_pending: list  # tokens the draft has not seen yet
    t_base: int = 0  # set by plan(): the target's cache length once it has seen t_pending
    d_base: int = 0  # set by plan(): the draft's cache length once it has seen d_pending

    @classmethod
    def start(cls, prompt_ids, max_new_tokens, tcache, dcache) -> SequenceState:
        """Both caches empty; both models have the whole prompt pending (``plan`` fits it to the window)."""
        tcache.reset()
        dcache.reset()
        seq = list(prompt_ids)
        return cls(seq, len(seq), len(seq) + max_new_tokens, tcache, dcache, list(seq), list(seq))

    @property
    def done(self) -> bool:
        return len(self.seq) >= self.stop

    @property
    def new_tokens(self) -> list:
        return self.seq[self.n_prompt :]

    def plan(self, k: int, stats: SpecStats) -> int:
        """Pass 1: make room -> how many tokens to draft this round (at most k).

        Each model's pending tokens go through ``fit_context`` (``generate``'s context policy); the
        draft's with room for the proposals it will feed itself. A round never drafts past
        max_new_tokens nor past either cache."""
        tcache, dcache = self.tcache, self.dcache
        self.t_pending, reprefilled = fit_context(tcache, self.seq, self.t_pending)
        stats.reprefills += reprefilled
        if stats.target_calls == 0:  # the first round feeds the prompt, cropped to the window if too long
            stats.dropped_prompt_tokens = self.n_prompt - len(self.t_pending)
        room = tcache.max_len - tcache.length - len(self.t_pending)  # target positions left after pending
        k_round = min(k, self.stop - len(self.seq) - 1, room)  # never draft past max_new_tokens or the room
        self.d_pending, _ = fit_context(dcache, self.seq, self.d_pending, extra=k_round - 1)  # feeds x_0..x_{k-2}
        k_round = min(k_round, dcache.max_len - dcache.length - len(self.d_pending) + 1)
        self.t_base = tcache.length + len(self.t_pending)  # the drafts start here in the target's cache
        self.d_base = dcache.length + len(self.d_pending)  # and here in the draft's
        return k_round

    def commit(self, drafts, emitted, n: int) -> None:
        """Pass 4: keep x_0..x_{n-1} in both caches (roll back the rest); the last emitted token
        (residual or bonus) is pending for both models."""
        self.tcache.truncate(self.t_base + n)  # keeps x_0..x_{n-1}
        self.t_pending = [emitted[-1]]
        if not drafts:
            self.d_pending = self.d_pending + emitted
        elif n < len(drafts):  # the draft saw x_0..x_{k-2}; keep x_0..x_{n-1}
            self.dcache.truncate(self.d_base + n)
            self.d_pending = [emitted[-1]]
        else:  # all accepted: the draft has not seen x_{k-1} nor the bonus token yet
            self.d_pending = [drafts[-1], emitted[-1]]
        self.seq += emitted


# ----------------------------------------------------------------------------------------------
# the decoding loop


def speculative_generate(
    target, draft, prompt_ids, max_new_tokens, k=4, temperature=1.0, top_k=None, top_p=None, seed=0,
    cache=None, draft_cache=None,
) -> GenerationResult:
    """Generate with the target's distribution, drafting k tokens per target forward pass.

    ``target`` and ``draft``: anything with ``config`` (vocab_size, block_size) and
    ``forward(idx (1, T), cache) -> logits (1, T, V)`` (a GPT, or a ``drafts.BigramDraft``).
    Sampling options are those of ``minillm.generate``; temperature 0 is greedy and gives exactly
    ``generate(target, ...)``'s tokens. ``cache``, ``draft_cache``: the decode caches to use (reset
    first; a KVCache of each model's block_size otherwise). Returns a ``GenerationResult`` whose
    stats are a ``SpecStats``.

    Each model keeps a KVCache plus a list of *pending* tokens it has not seen yet; a forward call
    feeds only those (the first round's pending list is the prompt, so the target's prefill and
    first verification are one call). Per round: the draft runs k times (pending, then its own
    proposals x_0..x_{k-2}), the target runs once over pending + x_0..x_{k-1}, and both caches are
    truncated to keep only accepted tokens. The reference that makes the same random draws without
    caches is ``speculative_generate_naive``.
    """
    prompt_ids = check_speculative_args(target, draft, prompt_ids, max_new_tokens, k)
    settings = SamplingSettings(temperature, top_k, top_p)
    rng = np.random.default_rng(seed)
    stats = SpecStats(k=k, prompt_tokens=len(prompt_ids))
    tcache = KVCache(target.config) if cache is None else cache
    dcache = KVCache(draft.config) if draft_cache is None else draft_cache
    state = SequenceState.start(prompt_ids, max_new_tokens, tcache, dcache)
    t0 = time.perf_counter()
    while not state.done:
        k_round = state.plan(k, stats)  # pass 1: make room

        # pass 2: the draft proposes k_round tokens, one forward each (it never re-reads its cache)
        drafts, q_rows = [], []
        if k_round > 0:
            logits = draft.forward(xp.asarray([state.d_pending]), state.dcache)[0, -1]  # (V,)
            stats.draft_calls += 1
            for i in range(k_round):
                token, q = propose(logits, settings, rng)
                drafts.append(token)
                q_rows.append(q)
                if i < k_round - 1:  # the last proposal's logits are not needed this round
                    logits = draft.forward(xp.asarray([[token]]), state.dcache)[0, -1]
                    stats.draft_calls += 1

        # pass 3: the target scores pending + drafts in ONE forward: rows for positions x_0..x_k
        logits = target.forward(xp.asarray([state.t_pending + drafts]), state.tcache)[0, -(k_round + 1) :]
        stats.target_calls += 1
        emitted, n = judge(drafts, q_rows, logits, settings, rng)

        state.commit(drafts, emitted, n)  # pass 4: roll back past the first rejected draft
        stats.record_round(k_round, n)
        synchronize()
        t1 = time.perf_counter()
        stats.round_times_s.append(t1 - t0)
        t0 = t1
    return stats.finish(state.new_tokens)


def speculative_generate_naive(
    target, draft, prompt_ids, max_new_tokens, k=4, temperature=1.0, top_k=None, top_p=None, seed=0,
) -> GenerationResult:
    """The reference for ``speculative_generate``: the same rounds and random draws, no caches.

    Every forward runs the whole sequence, so there is nothing to roll back; the fast loop must
    give the same tokens at the same seed. Contexts must fit: len(prompt) + max_new_tokens <=
    block_size of both models.
    """
    prompt_ids = check_speculative_args(target, draft, prompt_ids, max_new_tokens, k)
    settings = SamplingSettings(temperature, top_k, top_p)
    limit = min(target.config.block_size, draft.config.block_size)
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceed the context "
            f"length {limit}; the naive reference does not slide a window"
        )
    rng = np.random.default_rng(seed)
    stats = SpecStats(k=k, prompt_tokens=len(prompt_ids))
    seq = list(prompt_ids)
    stop = len(seq) + max_new_tokens
    t0 = time.perf_counter()
    while len(seq) < stop:
        k_round = min(k, stop - len(seq) - 1)
        drafts, q_rows = [], []
        for _ in range(k_round):
            token, q = propose(draft.forward(xp.asarray([seq + drafts]))[0, -1], settings, rng)
            drafts.append(token)
            q_rows.append(q)
            stats.draft_calls += 1
        logits = target.forward(xp.asarray([seq + drafts]))[0, -(k_round + 1) :]  # (k + 1, V)
        stats.target_calls += 1
        emitted, n = judge(drafts, q_rows, logits, settings, rng)
        seq += emitted
        stats.record_round(k_round, n)
        t1 = time.perf_counter()
        stats.round_times_s.append(t1 - t0)
        t0 = t1
    return stats.finish(seq[len(prompt_ids) :])


def greedy_speculative_generate(target, draft, prompt_ids, max_new_tokens: int, k: int = 4,
                                graph: bool = False) -> list:
    """Greedy speculative decoding on static steps (``minillm.fused``, chapter 12): per round the draft's T = 1
    step proposes k tokens and the target's T = k + 1 step verifies them in one forward; with ``graph`` both steps
    are replayed from their graphs (one per model, per fixed k). Same tokens as ``generate(target, ...,
    temperature=0)``.

    Both caches hold every token but the last one emitted (``last``). A round feeds the target [last, d_1..d_k];
    its argmaxes g_0..g_k accept the drafts while d_i == g_(i-1); the first mismatch, or g_k after k matches, is
    the new ``last``. Rollback is one copy of each cache's lengths to the device (``StaticCache.set_lengths``).
    """
    prompt = check_prompt(prompt_ids, max_new_tokens)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k (drafts per round) must be an int >= 1, got {k!r}")
    max_len = len(prompt) + max_new_tokens + k  # the last round may verify k + 1 tokens past the emitted ones
    propose = start_decoding(draft, prompt, max_len, graph)
    verify = StaticStep(target, static_prefill(target, prompt[:-1], max_len), T=k + 1)
    if graph:
        verify.capture()
    tokens, last = [], prompt[-1]
    while len(tokens) < max_new_tokens:
        length = int(verify.cache.host_lengths[0])  # tokens both caches hold: everything before `last`
        propose.set_ids([[last]])
        drafts = []
        for _ in range(k):
            propose.step()
            drafts.append(next_id(propose))
        verify.set_ids([[last, *drafts]])
        verify.step()
        greedy = to_numpy(verify.next_ids)[0].tolist()  # (k + 1,) the target's argmax after each fed token
        accepted = next((i for i, d in enumerate(drafts) if d != greedy[i]), k)
        tokens += drafts[:accepted] + [greedy[accepted]]
        verify.cache.set_lengths(length + 1 + accepted)  # last and the accepted drafts
        if accepted == k:  # the draft has not seen d_k yet: feed it
            propose.set_ids([[drafts[-1]]])
            propose.step()
        else:
            propose.cache.set_lengths(length + 1 + accepted)
        last = greedy[accepted]
    verify.cache.check_status()
    return tokens[:max_new_tokens]
