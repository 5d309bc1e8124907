"""Batched decoding and batched speculative decoding on a paged KV cache.

A batch runs B sequences through ONE forward per step. On a ``PagedKVCache`` every sequence already
has its own length, block table and positions, so sequences of different lengths batch naturally;
what a batch adds is raggedness within a step: row b feeds n_b new tokens (a prompt, one token, or
its pending token plus K_b drafts). The rows are right-padded to T = max n_b (``pad_batch``) and
run through ``cache.view(seq_ids, new_tokens=n)``: row b's real tokens sit at its own positions
lengths[b] .. lengths[b] + n_b - 1, its padding repeats its last position, is never written to the
cache and is never attended to, and its logits are dropped (``forward_ragged``).

    generate_batch              one token per row per step; row i equals generate() alone
    speculative_generate_batch  per round: every row drafts K_i tokens (one batched draft forward per
                                draft position), the target verifies all rows in ONE padded forward,
                                each row accepts its own number and rolls back only its own caches

Per-sequence bookkeeping (make room, roll back) is ``speculative.SequenceState``, the same code the
single-sequence loop runs; proposals are ``speculative.propose``'s, for all rows at once
(``propose_rows``), and verification is ``speculative.judge`` (``verify`` / ``verify_greedy``) on one host
copy of the verify logits (``rows_to_host``); the context policy is ``generate.fit_context``. A step brings
its rows' tokens or logits to the host in one transfer, never one per row (a GPU would wait B times).
Both loops return a ``BatchResult``: one ``GenerationResult`` per row (the row's tokens and its own
stats, as the row would have them alone) plus the batch's ``BatchStats``.

The cost of batching speculation (the source's warning). A verify forward has B x (max K_b + 1)
positions, but row b keeps only n_b + 1 of them (n_b accepted drafts + the residual or bonus token):
the rest are *rejected* drafts (k_b - n_b) and *padding* (max K - k_b). ``BatchStats.wasted_share``
is that fraction. Policies for K_b:

    "pad"       every row drafts the same k each round (the batch stays rectangular; nothing is
                padded except near the end, every rejection is thrown away)
    "adaptive"  row b's K_b follows its own recent acceptance (``next_draft_length``): +1 after a
                round that accepted every draft, -1 after a rejection, clamped to [1, k]. Short
                rows are padded to the longest, so padding replaces part of the rejections.

Randomness: one ``numpy.random.Generator`` per sequence, ``default_rng(sequence_seeds(seed, B)[i])``.
Row i therefore makes exactly the draws that ``generate`` / ``speculative_generate`` make alone with
``seed=sequence_seeds(seed, B)[i]`` (a ``SeedSequence`` is a valid seed), and its tokens are the same;
under the "pad" policy the per-row statistics are the same too. Every row is lossless on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import synchronize, to_numpy, xp
from .generate import GenerationResult, Throughput, check_prompt, fit_context, step_stats
from .paged_kv import PagedKVCache, num_blocks_for
from .sampling import SamplingSettings, next_tokens, sample
from .speculative import SequenceState, SpecStats, check_speculative_args, judge

POLICIES = ("pad", "adaptive")
PAD_ID = 0  # the token id in padding columns (any valid id: its results are discarded)


def sequence_seeds(seed, batch_size: int) -> list:
    """The per-sequence seeds of a batch: SeedSequence(seed).spawn(batch_size).

    Independent streams, and reproducible one by one: ``generate(..., seed=sequence_seeds(0, 4)[2])``
    makes the draws of row 2 of a batch of 4 seeded with 0."""
    return np.random.SeedSequence(seed).spawn(batch_size)


# ----------------------------------------------------------------------------------------------
# a ragged batch in one forward


def pad_batch(token_lists, pad_id: int = PAD_ID):
    """Right-pad ragged token lists into one array -> (idx (B, T) int64, counts [n_b]), T = max n_b.

    Example: [[5, 6, 7], [8]] -> [[5, 6, 7], [8, 0, 0]], [3, 1].
    """
    # EXERCISE 7.1 BEGIN: right-pad every row to the longest with pad_id; count each row's real tokens
    counts = [len(tokens) for tokens in token_lists]
    idx = np.full((len(token_lists), max(counts)), pad_id, dtype=np.int64)  # (B, T)
    for b, tokens in enumerate(token_lists):
        idx[b, : counts[b]] = tokens
    return idx, counts
    # EXERCISE 7.1 END


def forward_ragged(model, cache: PagedKVCache, seq_ids, token_lists) -> list:
    """One forward in which sequence seq_ids[b] feeds token_lists[b] -> per row its (n_b, V) logits.

    The rows are right-padded (``pad_batch``) and run on ``cache.view(seq_ids, new_tokens=n)``:
    each row at its own positions; padding is neither stored nor attended to; its logits are dropped.
    """
    idx, counts = pad_batch(token_lists)
    logits = model.forward(xp.asarray(idx), cache.view(seq_ids, counts))  # (B, T, V)
    return [logits[b, :n] for b, n in enumerate(counts)]


def last_logits(rows):
    """Each row's last logits, stacked on the device: [(n_b, V)] -> (B, V) (one kernel, no transfer)."""
    return xp.stack([logits[-1] for logits in rows])


def rows_to_host(rows) -> list:
    """Ragged device rows [(n_b, V)] -> their NumPy copies, with one transfer to the host (not one per row)."""
    ends = np.cumsum([len(logits) for logits in rows])[:-1]
    return np.split(to_numpy(xp.concatenate(rows)), ends)


def propose_rows(logits, settings: SamplingSettings, rngs) -> tuple[list, list]:
    """Draft logits (B, V) -> (B tokens, B q rows or None): ``propose`` for every row, with one transfer to
    the host: greedy, the rows' argmaxes are taken on the device (``next_tokens``); sampled, the rows'
    probabilities are computed at once on the host and row b is drawn with its own generator."""
    if settings.greedy:
        return next_tokens(logits, [settings] * len(rngs), rngs), [None] * len(rngs)
    q = settings.probs(logits)  # (B, V) float64 on the host
    return [sample(row, rng) for row, rng in zip(q, rngs)], list(q)


def _pool(config, batch_size: int, page_size: int) -> PagedKVCache:
    """A pool with room for every sequence at full context (padding is never stored)."""
    return PagedKVCache(config, num_blocks=batch_size * num_blocks_for(config.block_size, page_size),
                        page_size=page_size)


def _check_batch(prompts) -> list:
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    return list(prompts)


# ----------------------------------------------------------------------------------------------
# statistics of a batch


def round_waste(k_rounds, accepted) -> tuple[int, int, int]:
    """The verify positions of one batched round -> (slots, padded, rejected).

    Row b verifies k_b + 1 positions (its pending token's and its drafts'), padded to the batch's
    max K + 1, and keeps n_b + 1 of them (the accepted drafts and the residual or bonus token):
    slots = B (max K + 1), padded = sum(max K - k_b), rejected = sum(k_b - n_b).
    Example: k = [4, 2, 4], accepted = [4, 0, 1] -> (15, 2, 5); kept = 5 + 1 + 2 = 8 = 15 - 2 - 5.
    """
    # EXERCISE 7.2 BEGIN: count the padded slots and the slots of rejected drafts of one round
    k_max = max(k_rounds)
    slots = len(k_rounds) * (k_max + 1)
    padded = sum(k_max - k for k in k_rounds)
    rejected = sum(k - n for k, n in zip(k_rounds, accepted))
    return slots, padded, rejected
    # EXERCISE 7.2 END


@dataclass
class BatchStats(Throughput):
    """Counters of one batched generation (plain or speculative), for the batch as a whole.

    ``rounds`` (speculative only): per round, the draft length and the number accepted of each
    sequence still running; ``slots``, ``padded``, ``rejected`` sum ``round_waste`` over them.
    """

    batch_size: int
    new_tokens: int = 0
    target_calls: int = 0  # batched target forward passes
    draft_calls: int = 0  # batched draft forward passes
    total_s: float = 0.0
    rounds: list = field(default_factory=list)  # [(k per running row, accepted per running row)]

    def _waste(self) -> np.ndarray:
        return np.array([round_waste(k, n) for k, n in self.rounds]).reshape(-1, 3).sum(axis=0)

    @property
    def slots(self) -> int:
        """Verify positions computed (B x (max K + 1) per round)."""
        return int(self._waste()[0])

    @property
    def padded(self) -> int:
        return int(self._waste()[1])

    @property
    def rejected(self) -> int:
        return int(self._waste()[2])

    @property
    def wasted_share(self) -> float:
        """(padded + rejected) / slots: the share of verified positions thrown away."""
        slots, padded, rejected = self._waste()
        return float((padded + rejected) / slots) if slots else float("nan")


@dataclass
class BatchResult:
    """What both batched loops return: one GenerationResult per prompt, in order, and the batch's stats."""

    rows: list  # GenerationResult per row: its new tokens and its own stats (GenerationStats or SpecStats)
    stats: BatchStats

    @property
    def tokens(self) -> list[list[int]]:
        """The new tokens of every row."""
        return [row.tokens for row in self.rows]


# ----------------------------------------------------------------------------------------------
# plain batched decoding


def generate_batch(model, prompts, max_new_tokens, temperature=1.0, top_k=None, top_p=None, seed=0,
                   page_size=16) -> BatchResult:
    """Decode B prompts of any lengths together: one forward per step -> BatchResult.

    Step 1 prefills every prompt in one ragged forward; each later step feeds one token per row at
    that row's own position. Sampling options are ``generate``'s; row i uses its own generator
    (``sequence_seeds``), so it equals ``generate(model, prompts[i], ..., seed=sequence_seeds(seed,
    B)[i])`` token for token, greedy or sampled. Context policy as ``generate`` (``fit_context``),
    row by row, inside the batched forward. Row i's stats are a ``GenerationStats`` timed by the
    batch's steps.
    """
    prompts = [check_prompt(p, max_new_tokens) for p in _check_batch(prompts)]
    settings = SamplingSettings(temperature, top_k, top_p)
    B = len(prompts)
    pool = _pool(model.config, B, page_size)
    views = [pool.sequence() for _ in prompts]
    rngs = [np.random.default_rng(s) for s in sequence_seeds(seed, B)]
    seqs = [list(p) for p in prompts]
    pending = [list(p) for p in prompts]  # what each row's cache has not seen yet
    reprefills, dropped = [0] * B, [0] * B
    stats = BatchStats(batch_size=B)
    times = []
    t0 = time.perf_counter()
    for _ in range(max_new_tokens):
        for b, view in enumerate(views):  # the context policy, row by row
            pending[b], reprefilled = fit_context(view, seqs[b], pending[b])
            reprefills[b] += reprefilled
            if not times:  # the first step feeds the prompt, cropped to the window if too long
                dropped[b] = len(prompts[b]) - len(pending[b])
        rows = forward_ragged(model, pool, [v.seq_id for v in views], pending)
        stats.target_calls += 1
        for b, token in enumerate(next_tokens(last_logits(rows), [settings] * B, rngs)):  # one transfer
            seqs[b].append(token)
            pending[b] = [token]
        synchronize()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    stats.total_s = float(sum(times))
    stats.new_tokens = B * max_new_tokens
    results = []
    for p, seq, view, n, d in zip(prompts, seqs, views, reprefills, dropped):
        tokens = seq[len(p) :]
        row = step_stats(p, tokens, times, kv_bytes=view.nbytes, kv_bytes_used=view.bytes_used, reprefills=n,
                         dropped_prompt_tokens=d)
        results.append(GenerationResult(tokens, row))
    return BatchResult(results, stats)


# ----------------------------------------------------------------------------------------------
# batched speculative decoding


def next_draft_length(k_round: int, n_accepted: int, k_max: int) -> int:
    """The adaptive policy: the draft length a sequence asks for in its next round.

    One more after a round that accepted every draft, one fewer after a rejection, within [1, k_max].
    Examples (k_max 4): (2, 2) -> 3; (4, 4) -> 4; (3, 1) -> 2; (1, 0) -> 1; (0, 0) -> 1.
    """
    # EXERCISE 7.3 BEGIN: grow by one after full acceptance, shrink by one after a rejection; clamp
    k_next = k_round + 1 if n_accepted == k_round else k_round - 1
    return min(max(k_next, 1), k_max)
    # EXERCISE 7.3 END


def _draft_batch(draft, pool, states, k_round, settings, rngs, stats):
    """Pass 2 for a batch: sequence i proposes k_round[i] tokens -> (drafts, q rows, forwards run).

    Forward j runs the sequences still drafting: first each one's pending tokens (ragged), then its
    previous proposal; like the single-sequence loop, the last proposal's logits are never needed.
    """
    drafts, q_rows = {i: [] for i in k_round}, {i: [] for i in k_round}
    feed = {i: states[i].d_pending for i in k_round}
    calls = 0
    for j in range(max(k_round.values())):
        rows = [i for i in k_round if k_round[i] > j]
        logits = forward_ragged(draft, pool, [states[i].dcache.seq_id for i in rows], [feed[i] for i in rows])
        calls += 1
        tokens, qs = propose_rows(last_logits(logits), settings, [rngs[i] for i in rows])  # one transfer
        for i, token, q in zip(rows, tokens, qs):
            stats[i].draft_calls += 1
            drafts[i].append(token)
            q_rows[i].append(q)
            feed[i] = [token]
    return drafts, q_rows, calls


def speculative_generate_batch(target, draft, prompts, max_new_tokens, k=4, temperature=1.0, top_k=None,
                               top_p=None, seed=0, policy="pad", page_size=16) -> BatchResult:
    """Speculative decoding for B prompts at once -> BatchResult (row i's stats: a SpecStats).

    Per round: each running sequence plans its draft length (``SequenceState.plan``: the policy's
    K_i, clamped to what is left and to the context), the draft proposes in batched forwards, the
    target scores every row's pending token + drafts in ONE ragged forward, then each row is judged
    with its own generator and rolls back only its own caches (``SequenceState.commit``). A
    sequence that has all its tokens leaves the batch. ``policy``: "pad" or "adaptive" (see the
    module docstring). Greedy (temperature 0): row i equals ``speculative_generate(target, draft,
    prompts[i], ...)`` and thus ``generate(target, ...)`` token for token; sampled, it is lossless.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    prompts = [check_speculative_args(target, draft, p, max_new_tokens, k) for p in _check_batch(prompts)]
    settings = SamplingSettings(temperature, top_k, top_p)
    B = len(prompts)
    tpool, dpool = _pool(target.config, B, page_size), _pool(draft.config, B, page_size)
    states = [SequenceState.start(p, max_new_tokens, tpool.sequence(), dpool.sequence()) for p in prompts]
    rngs = [np.random.default_rng(s) for s in sequence_seeds(seed, B)]
    stats = [SpecStats(k=k, prompt_tokens=len(p)) for p in prompts]
    batch = BatchStats(batch_size=B)
    want = [k] * B  # the draft length each sequence asks for next round (the policy's state)
    t0 = time.perf_counter()
    while running := [i for i in range(B) if not states[i].done]:
        k_round = {i: states[i].plan(want[i], stats[i]) for i in running}  # pass 1, per sequence
        drafts, q_rows, calls = _draft_batch(draft, dpool, states, k_round, settings, rngs, stats)
        batch.draft_calls += calls

        # pass 3: the target scores every row's pending + drafts in ONE forward (right-padded)
        rows = rows_to_host(forward_ragged(target, tpool, [states[i].tcache.seq_id for i in running],
                                           [states[i].t_pending + drafts[i] for i in running]))  # one transfer
        batch.target_calls += 1
        accepted = []
        for i, logits in zip(running, rows):
            emitted, n = judge(drafts[i], q_rows[i], logits[-(k_round[i] + 1) :], settings, rngs[i])
            states[i].commit(drafts[i], emitted, n)  # pass 4: this row's rollback, no other's
            stats[i].target_calls += 1
            stats[i].record_round(k_round[i], n)
            accepted.append(n)
            if policy == "adaptive":
                want[i] = next_draft_length(k_round[i], n, k)
        batch.rounds.append(([k_round[i] for i in running], accepted))
        synchronize()
        t1 = time.perf_counter()
        for i in running:
            stats[i].round_times_s.append(t1 - t0)
        batch.total_s += t1 - t0
        t0 = t1
    rows = [s.finish(state.new_tokens) for s, state in zip(stats, states)]
    batch.new_tokens = sum(len(row.tokens) for row in rows)
    return BatchResult(rows, batch)
