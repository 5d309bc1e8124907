"""Batched decoding and batched speculative decoding on a paged KV cache (chapter 7).

What the tests prove, group by group:
    test_pad_batch_*          7.1 right-padding a ragged batch
    test_ragged_*             one forward over rows feeding different numbers of tokens gives every
                              row its own logits; padding is never stored nor seen (needs 7.1)
    test_generate_batch_*     plain batched decoding: row i == generate() alone (needs 7.1)
    test_spec_rows_*          batched speculative decoding: row i == speculative_generate() alone,
                              greedy and sampled, tokens and statistics; lossless per row (needs 7.1)
    test_round_waste_*        7.2 the padding / rejection accounting of a round
    test_next_draft_length_*  7.3 the adaptive policy's rule (its worked example opens the file), and
                              the policy in the loop
    test_mistake_*            the classic batching mistakes, each planted in the real code and caught

Every check that guards against a classic mistake is also run with the mistake planted (monkeypatched
into the library inside the test), and the test asserts that the check fails: a check that cannot
fail proves nothing.
"""

import numpy as np
import pytest
from scipy.stats import chi2, ncx2
from stats import P_MIN, chi2_pvalue

from minillm import GPT, GPTConfig, generate
from minillm import batch_speculative as bs
from minillm.backend import to_numpy
from minillm.batch_speculative import (
    BatchStats,
    forward_ragged,
    generate_batch,
    next_draft_length,
    pad_batch,
    round_waste,
    sequence_seeds,
    speculative_generate_batch,
)
from minillm.drafts import quantize_weights
from minillm.kv_cache import CacheFullError
from minillm.paged_kv import BatchView, PagedKVCache
from minillm.sampling import logits_to_probs
from minillm.speculative import speculative_generate

N_PER_PROMPT = 15_000  # rows per prompt in the losslessness test (see its docstring)


# ----------------------------------------------------------------------------------------------
# first, a worked example: 7.3's rule for the next round's draft length (in the loop: the 7.3 section below)


@pytest.mark.exercise("7.3")
def test_next_draft_length_worked_examples():
    """+1 after full acceptance, -1 after a rejection, within [1, k_max]."""
    assert next_draft_length(2, 2, 4) == 3
    assert next_draft_length(4, 4, 4) == 4
    assert next_draft_length(3, 1, 4) == 2
    assert next_draft_length(3, 2, 4) == 2
    assert next_draft_length(1, 0, 4) == 1
    assert next_draft_length(0, 0, 4) == 1


# ----------------------------------------------------------------------------------------------
# the models, prompts and checks the sections below share


def peaked_pair(vocab_size, block_size, n_layer, n_embd, scale, bits, seed):
    """(target, draft): a random GPT with its matrices scaled (peaked, non-uniform distributions)
    and a ``bits``-bit quantized copy of it as the draft."""
    cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=n_embd)
    params = GPT.init(cfg, seed=seed).numpy_params()
    target = GPT(cfg, {k: v * scale if v.ndim == 2 else v for k, v in params.items()})
    return target, quantize_weights(target, bits=bits)


@pytest.fixture(scope="module")
def pair():
    """13 tokens, context 32; the 3-bit draft is accepted 40-70 % of the time, so rounds end both
    ways (rejections and bonus tokens) and rows accept different numbers of drafts."""
    return peaked_pair(13, 32, 2, 16, scale=20, bits=3, seed=5)


# prompts of different lengths; the last one starts near the 32-token context, so it re-prefills
PROMPTS = [[0], [1, 2, 3], [5, 5, 5, 5, 5, 5, 5], [4, 8] * 10]


def batch_matches_alone(target, draft, prompts, n_new, ks=(1, 4), temperature=0.0) -> bool:
    """The batch check: every row of a batch equals the same sequence decoded alone.

    generate_batch row i == generate(seed=sequence_seeds(0, B)[i]); speculative_generate_batch
    row i == speculative_generate(seed=...) in tokens, and (policy "pad", same K) in accepted,
    rejected and draft calls; the adaptive policy's tokens too when greedy.
    """
    seeds = sequence_seeds(0, len(prompts))
    outs = generate_batch(target, prompts, n_new, temperature=temperature).tokens
    if outs != [generate(target, p, n_new, temperature=temperature, seed=s).tokens for p, s in zip(prompts, seeds)]:
        return False
    for k in ks:
        alone = [speculative_generate(target, draft, p, n_new, k=k, temperature=temperature, seed=s)
                 for p, s in zip(prompts, seeds)]
        batch = speculative_generate_batch(target, draft, prompts, n_new, k=k, temperature=temperature)
        if batch.tokens != [r.tokens for r in alone]:
            return False
        counts = [(r.stats.accepted, r.stats.rejected, r.stats.draft_calls, r.stats.reprefills) for r in batch.rows]
        if counts != [(r.stats.accepted, r.stats.rejected, r.stats.draft_calls, r.stats.reprefills) for r in alone]:
            return False
        if temperature == 0:
            adaptive = speculative_generate_batch(target, draft, prompts, n_new, k=k, temperature=0, policy="adaptive")
            if adaptive.tokens != [r.tokens for r in alone]:
                return False
    return True


# ----------------------------------------------------------------------------------------------
# 7.1 a ragged batch


@pytest.mark.exercise("7.1")
def test_pad_batch_worked_example():
    """[[5, 6, 7], [8]] -> [[5, 6, 7], [8, 0, 0]] with counts [3, 1]; pad_id is used for padding."""
    idx, counts = pad_batch([[5, 6, 7], [8]])
    assert idx.dtype == np.int64 and idx.tolist() == [[5, 6, 7], [8, 0, 0]] and counts == [3, 1]
    idx, counts = pad_batch([[1], [2, 3], [4]], pad_id=9)
    assert idx.tolist() == [[1, 9], [2, 3], [4, 9]] and counts == [1, 2, 1]


@pytest.mark.exercise("7.1")
def test_pad_batch_uniform_rows_need_no_padding():
    idx, counts = pad_batch([[1, 2], [3, 4]])
    assert idx.tolist() == [[1, 2], [3, 4]] and counts == [2, 2]


def ragged_setup(model, cached, new, page_size=4):
    """A cache holding sequences of lengths len(cached[b]); one ragged forward of new[b] tokens each."""
    cache = PagedKVCache(model.config, num_blocks=40, page_size=page_size)
    seqs = [cache.add_sequence() for _ in cached]
    for s, tokens in zip(seqs, cached):
        if tokens:
            model.forward(np.array([tokens]), cache.view([s]))
    return cache, seqs, forward_ragged(model, cache, seqs, new)


CACHED = [[1, 2, 3, 4, 5], [], [7] * 9]  # a sequence mid-way, an empty one (a prefill), a longer one
NEW = [[6], [3, 1, 4, 1], [2, 2]]  # 1, 4 and 2 new tokens: padded to 4


@pytest.mark.exercise("7.1")
def test_ragged_forward_gives_each_row_its_own_logits(pair):
    """Rows at lengths 5, 0, 9 feeding 1, 4, 2 tokens in one forward: each row's logits equal a
    no-cache forward of that row's whole sequence alone; each length grows by its own count."""
    target, _ = pair
    cache, seqs, rows = ragged_setup(target, CACHED, NEW)
    for b, (old, new) in enumerate(zip(CACHED, NEW)):
        alone = to_numpy(target.forward(np.array([old + new])))[0, len(old) :]
        assert rows[b].shape == alone.shape and rows[b].dtype == np.float32
        np.testing.assert_allclose(to_numpy(rows[b]), alone, atol=1e-4)
    assert [cache.lengths[s] for s in seqs] == [6, 4, 11]
    cache.check()


def test_ragged_positions_are_per_row_and_padding_repeats_the_last():
    """Lengths 5 and 2 feeding 1 and 3 tokens: positions [[5, 5, 5], [2, 3, 4]]; only real tokens
    are reserved (a block for row 1's positions 4, none for row 0's padding)."""
    cfg = GPTConfig(vocab_size=3, block_size=32, n_layer=1, n_head=1, n_embd=2)
    cache = PagedKVCache(cfg, num_blocks=4, page_size=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.lengths[a], cache.block_tables[a] = 5, [cache.allocator.allocate(), cache.allocator.allocate()]
    cache.lengths[b], cache.block_tables[b] = 2, [cache.allocator.allocate()]
    view = cache.view([a, b], new_tokens=[1, 3])
    np.testing.assert_array_equal(view.positions(3), [[5, 5, 5], [2, 3, 4]])
    assert view.valid.tolist() == [[True, False, False], [True, True, True]]
    assert cache.allocator.num_free == 0 and len(cache.block_tables[b]) == 2
    view.advance(3)
    assert cache.lengths == {a: 6, b: 5}


@pytest.mark.exercise("7.1")
def test_ragged_padding_never_leaks(pair):
    """Whatever the padding holds (pad id 0 or 12), the real rows' logits and every cached key and
    value are identical: padding is neither written to the cache nor attended to."""
    target, _ = pair
    results = []
    for pad_id in (0, 12):
        cache = PagedKVCache(target.config, num_blocks=40, page_size=4)
        seqs = [cache.add_sequence() for _ in CACHED]
        for s, tokens in zip(seqs, CACHED):
            if tokens:
                target.forward(np.array([tokens]), cache.view([s]))
        idx, counts = pad_batch(NEW, pad_id=pad_id)
        logits = to_numpy(target.forward(idx, cache.view(seqs, counts)))
        kv = [to_numpy(a) for s in seqs for layer in range(2) for a in cache.read(s, layer)]
        results.append(([logits[b, :n] for b, n in enumerate(counts)], kv))
    for first, second in zip(results[0][0] + results[0][1], results[1][0] + results[1][1]):
        np.testing.assert_array_equal(first, second)


def test_ragged_view_rejects_bad_counts(pair):
    target, _ = pair
    cache = PagedKVCache(target.config, num_blocks=8, page_size=4)
    seqs = [cache.add_sequence(), cache.add_sequence()]
    with pytest.raises(ValueError, match="counts"):
        cache.view(seqs, new_tokens=[1])
    with pytest.raises(ValueError, match="exceed"):
        target.forward(np.zeros((2, 2), dtype=np.int64), cache.view(seqs, new_tokens=[3, 1]))
    with pytest.raises(ValueError, match="at least one"):
        target.forward(np.zeros((2, 2), dtype=np.int64), cache.view(seqs, new_tokens=[2, 0]))
    assert cache.lengths == {0: 0, 1: 0} and cache.allocator.num_free == 8


# ----------------------------------------------------------------------------------------------
# plain batched decoding


@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, None, None), (1.0, None, None), (0.8, 5, 0.9)])
def test_generate_batch_equals_generate_alone(pair, temperature, top_k, top_p):
    """4 prompts of lengths 1, 3, 7, 20 decode 30 tokens together (the last passes the 32-token
    context and re-prefills inside the batch): row i == generate(..., seed=sequence_seeds(0, 4)[i])
    token for token, with one batched forward per step."""
    target, _ = pair
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    result = generate_batch(target, PROMPTS, 30, **kw)
    for p, s, row in zip(PROMPTS, sequence_seeds(0, len(PROMPTS)), result.rows):
        alone = generate(target, p, 30, seed=s, **kw)
        assert row.tokens == alone.tokens and row.stats.reprefills == alone.stats.reprefills
        assert row.stats.prompt_tokens == len(p) and row.stats.new_tokens == 30 and len(row.stats.step_times_s) == 30
    stats = result.stats
    assert stats.target_calls == 30 and stats.new_tokens == 120 and stats.tokens_per_s > 0
    assert result.rows[-1].stats.reprefills > 0  # the 20-token prompt passes the 32-token context


@pytest.mark.exercise("7.1")
def test_generate_batch_rows_are_independent_draws(pair):
    """The same prompt twice in a batch gives two different samples (one generator per row), and a
    batch of one is generate() with seed sequence_seeds(seed, 1)[0]."""
    target, _ = pair
    outs = generate_batch(target, [[1, 2], [1, 2]], 20, temperature=1.0, seed=4).tokens
    assert outs[0] != outs[1]
    one = generate_batch(target, [[1, 2]], 20, temperature=1.0, seed=4).tokens
    assert one[0] == generate(target, [1, 2], 20, temperature=1.0, seed=sequence_seeds(4, 1)[0]).tokens


@pytest.mark.exercise("7.1")
def test_generate_batch_rows_count_the_prompt_tokens_they_drop(pair):
    """Row by row, a prompt longer than the 32-token context keeps its last 16 (``fit_context``) and its
    stats count the dropped ones, as generate's do; a row whose prompt fits drops none."""
    target, _ = pair
    long = [int(t) % 13 for t in range(7, 47)]
    rows = generate_batch(target, [long, [1, 2]], 3, temperature=0).rows
    assert [r.stats.dropped_prompt_tokens for r in rows] == [24, 0]
    assert rows[0].tokens == generate(target, long, 3, temperature=0).tokens


def test_generate_batch_bad_input(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="prompts"):
        generate_batch(target, [], 5)
    with pytest.raises(ValueError, match="prompt"):
        generate_batch(target, [[1], []], 5)
    assert generate_batch(target, [[1], [2, 3]], 0).tokens == [[], []]
    with pytest.raises(ValueError, match="temperature"):
        generate_batch(target, [[1]], 5, temperature=float("nan"))


# ----------------------------------------------------------------------------------------------
# batched speculative decoding


@pytest.mark.exercise("7.1", "7.3")
def test_spec_rows_greedy_equal_alone(pair):
    """Greedy, K = 1 and 4, both policies: every row == speculative_generate alone == generate
    alone, token for token (rows of lengths 1..20, one passing the context); with policy "pad" the
    per-row accepted, rejected, draft-call and re-prefill counts are those of the row alone."""
    target, draft = pair
    assert batch_matches_alone(target, draft, PROMPTS, 30, ks=(1, 4))
    result = speculative_generate_batch(target, draft, PROMPTS, 30, k=4, temperature=0)
    stats = [row.stats for row in result.rows]
    for p, out in zip(PROMPTS, result.tokens):
        assert out == generate(target, p, 30, temperature=0).tokens
    assert len({s.accepted for s in stats}) > 1 and all(s.rejected > 0 for s in stats)  # ragged acceptance
    assert stats[-1].reprefills > 0


@pytest.mark.exercise("7.1")
def test_spec_rows_sampled_draws_equal_alone(pair):
    """Temperature 1 and (0.8, top-k 5): policy "pad" row i makes exactly the random draws of
    speculative_generate(..., seed=sequence_seeds(0, B)[i]) alone: same tokens, same counts."""
    target, draft = pair
    assert batch_matches_alone(target, draft, PROMPTS, 24, ks=(3,), temperature=1.0)
    seeds = sequence_seeds(7, len(PROMPTS))
    outs = speculative_generate_batch(target, draft, PROMPTS, 24, k=2, temperature=0.8, top_k=5, seed=7).tokens
    for p, s, out in zip(PROMPTS, seeds, outs):
        assert out == speculative_generate(target, draft, p, 24, k=2, temperature=0.8, top_k=5, seed=s).tokens


@pytest.mark.exercise("7.1", "7.2")
def test_spec_rows_bonus_token_every_round_when_draft_is_target(pair):
    """draft == target: every draft is accepted, so every round of every row ends with a bonus
    token: K + 1 = 5 tokens per target call, 5 rounds for 25 tokens, for rows of any length."""
    target, _ = pair
    result = speculative_generate_batch(target, target, PROMPTS[:3], 25, k=4, temperature=0)
    batch = result.stats
    for p, out, s in zip(PROMPTS, result.tokens, [row.stats for row in result.rows]):
        assert out == generate(target, p, 25, temperature=0).tokens
        assert s.alpha == 1.0 and s.target_calls == 5 and s.tokens_per_call == 5.0
    assert batch.target_calls == 5 and batch.rejected == 0 and batch.wasted_share == 0.0


def target_joint(target, prompt, n):
    """The target's exact distribution of its first n tokens after prompt, over V**n cells."""
    V = target.config.vocab_size
    joint = np.ones(1)
    prefixes = [list(prompt)]
    for _ in range(n):
        p = logits_to_probs(target.forward(np.array(prefixes))[:, -1])  # (V**i, V): p(next | prefix)
        joint = (joint[:, None] * p).ravel()
        prefixes = [pre + [t] for pre in prefixes for t in range(V)]
    return joint


@pytest.mark.exercise("7.1", "7.3")
def test_spec_rows_lossless_per_sequence():
    """Sampling (T = 1, adaptive policy, K = 2, 3 new tokens): in one batch of 30,000 rows, two
    prompts of lengths 1 and 4 interleaved, each row's first token and its first three tokens
    (V**3 = 64 cells) follow the target's exact distributions for that row's prompt (chi-square).
    N = 15,000 rows per prompt detects a 2 % shift between two tokens with power >= 0.9; the 1 %
    resolution of the rejection step itself is chapter 5's test, and the equality tests above show
    that a row makes exactly the draws of speculative_generate alone."""
    target, draft = peaked_pair(4, 16, 1, 8, scale=8, bits=2, seed=1)
    prompts = [[1], [2, 3, 0, 1]]
    rows = prompts * N_PER_PROMPT
    result = speculative_generate_batch(
        target, draft, rows, 3, k=2, temperature=1.0, seed=11, policy="adaptive", page_size=4
    )
    outs, stats = result.tokens, [row.stats for row in result.rows]
    assert 0.5 < sum(s.accepted for s in stats) / sum(s.checked for s in stats) < 0.95
    for g, prompt in enumerate(prompts):
        mine = np.array(outs[g :: len(prompts)])  # (N, 3)
        p3 = target_joint(target, prompt, 3)
        p1 = p3.reshape(4, 16).sum(axis=1)
        assert chi2_pvalue(mine[:, 0], p1) >= P_MIN
        assert chi2_pvalue(mine @ [16, 4, 1], p3) >= P_MIN
        shifted = p1.copy()  # the power claim, for the two most likely first tokens
        a, b = np.argsort(p1)[-2:]
        lam = N_PER_PROMPT * 0.02**2 * (1 / p1[a] + 1 / p1[b])
        assert ncx2.sf(chi2.isf(P_MIN, 3), 3, lam) >= 0.9
        shifted[a], shifted[b] = p1[a] + 0.02, p1[b] - 0.02
        assert chi2_pvalue(mine[:, 0], shifted) < P_MIN


@pytest.mark.exercise("7.1", "7.2")
def test_spec_rows_stats_add_up(pair):
    """Per row: tokens = accepted + rounds, one target call per round. Per batch: one verify forward
    per round for all running rows, slots = kept + padded + rejected, and rows finish at different
    rounds (ragged acceptance), so later rounds run fewer rows."""
    target, draft = pair
    result = speculative_generate_batch(target, draft, PROMPTS, 20, k=3, temperature=1.0, seed=2)
    outs, stats, batch = result.tokens, [row.stats for row in result.rows], result.stats
    for out, s in zip(outs, stats):
        assert len(out) == s.new_tokens == 20 == s.accepted + s.rounds and s.target_calls == s.rounds
        assert s.total_s > 0 and len(s.round_times_s) == s.rounds
    assert batch.target_calls == len(batch.rounds) == max(s.rounds for s in stats)
    assert len({len(k) for k, _ in batch.rounds}) > 1  # the batch shrank as rows finished
    kept = sum(s.new_tokens for s in stats)
    assert batch.slots == kept + batch.padded + batch.rejected and batch.new_tokens == kept
    assert batch.rejected == sum(s.proposed - s.accepted for s in stats)


@pytest.mark.exercise("7.1")
def test_spec_rows_bad_input(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="policy"):
        speculative_generate_batch(target, draft, PROMPTS, 5, policy="greedy")
    with pytest.raises(ValueError, match="prompts"):
        speculative_generate_batch(target, draft, [], 5)
    with pytest.raises(ValueError, match="k"):
        speculative_generate_batch(target, draft, PROMPTS, 5, k=0)
    result = speculative_generate_batch(target, draft, [[1], [2, 3]], 1, k=4, temperature=0)
    assert [len(o) for o in result.tokens] == [1, 1] and all(row.stats.proposed == 0 for row in result.rows)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate_batch(target, draft, PROMPTS, 5, temperature=1e-320)


# ----------------------------------------------------------------------------------------------
# 7.2 the accounting of a round


@pytest.mark.exercise("7.2")
def test_round_waste_worked_example():
    """k = [4, 2, 4], accepted = [4, 0, 1]: 15 slots, 2 padded, 5 rejected, 8 kept."""
    assert round_waste([4, 2, 4], [4, 0, 1]) == (15, 2, 5)
    assert round_waste([3], [3]) == (4, 0, 0)  # one row, all accepted: nothing thrown away
    assert round_waste([0, 2], [0, 1]) == (6, 2, 1)


@pytest.mark.exercise("7.2")
def test_round_waste_sums_into_batch_stats():
    """BatchStats adds the rounds up; wasted_share = (padded + rejected) / slots."""
    stats = BatchStats(batch_size=3, rounds=[([4, 2, 4], [4, 0, 1]), ([3, 1], [0, 1])])
    assert (stats.slots, stats.padded, stats.rejected) == (23, 4, 8)
    assert stats.wasted_share == pytest.approx(12 / 23)
    assert np.isnan(BatchStats(batch_size=1).wasted_share)


# ----------------------------------------------------------------------------------------------
# 7.3 the adaptive policy


@pytest.mark.exercise("7.1", "7.2", "7.3")
def test_next_draft_length_drives_the_adaptive_policy(pair):
    """In the loop: with draft == target every row stays at k (full acceptance); with the weak draft
    rows draft different lengths in the same round, the shorter ones padded; each row's draft
    length follows next_draft_length of its previous round."""
    target, draft = pair
    batch = speculative_generate_batch(target, target, PROMPTS[:3], 20, k=3, temperature=0, policy="adaptive").stats
    assert all(k == 3 for ks, _ in batch.rounds for k in ks)
    batch = speculative_generate_batch(target, draft, PROMPTS, 30, k=4, temperature=0, policy="adaptive").stats
    assert any(len(set(ks)) > 1 for ks, _ in batch.rounds) and batch.padded > 0
    for (ks, ns), (next_ks, _) in zip(batch.rounds, batch.rounds[1:]):
        if len(next_ks) == len(ks):  # no row finished: rows line up
            for k, n, k_next in zip(ks, ns, next_ks):
                assert k_next <= next_draft_length(k, n, 4)  # <=: clamped near the end or the context


# ----------------------------------------------------------------------------------------------
# the classic mistakes, each planted in the real code and caught by the batch check


@pytest.mark.exercise("7.1")
def test_mistake_rollback_of_every_row_is_caught(pair, monkeypatch):
    """One row's rejection truncates every row of the pool to its length: caught."""
    target, draft = pair
    real = PagedKVCache.truncate

    def truncate_every_row(cache, seq_id, n):
        for s in list(cache.lengths):
            real(cache, s, min(n, cache.lengths[s]))

    monkeypatch.setattr(PagedKVCache, "truncate", truncate_every_row)
    assert not batch_matches_alone(target, draft, PROMPTS[:3], 16, ks=(3,))


@pytest.mark.exercise("7.1")
def test_mistake_padding_leaking_into_attention_is_caught(pair, monkeypatch):
    """The padded batch treated as dense (padding written to the cache and counted in each row's
    length, so later tokens attend to it): caught (or the padding overflows a row's context)."""
    target, draft = pair
    monkeypatch.setattr(BatchView, "counts", lambda view, T: [T] * len(view.seq_ids))
    try:
        assert not batch_matches_alone(target, draft, PROMPTS[:3], 16, ks=(3,))
    except CacheFullError:
        pass


@pytest.mark.exercise("7.1")
def test_mistake_lost_bonus_token_is_caught(pair, monkeypatch):
    """A row whose drafts were all accepted drops its bonus token: caught."""
    target, draft = pair
    real = bs.judge

    def judge_dropping_bonus(drafts, *args):
        emitted, n = real(drafts, *args)
        return (emitted[:-1], n) if 0 < n == len(drafts) else (emitted, n)

    monkeypatch.setattr(bs, "judge", judge_dropping_bonus)
    assert not batch_matches_alone(target, draft, PROMPTS[:3], 16, ks=(3,))


@pytest.mark.exercise("7.1")
@pytest.mark.parametrize("how", ["shifted_by_row", "one_counter"])
def test_mistake_per_row_positions_are_caught(pair, monkeypatch, how):
    """Position ids handed to the model shifted by one per row (row b at +b), or one counter for the
    whole batch (every row at row 0's positions, as if all rows had the same length): caught."""
    target, draft = pair
    real = BatchView.positions

    def wrong_positions(view, T):
        pos = real(view, T)
        if how == "shifted_by_row":
            return pos + np.arange(len(pos))[:, None]
        return np.repeat(pos[:1], len(pos), axis=0)

    monkeypatch.setattr(BatchView, "positions", wrong_positions)
    assert not batch_matches_alone(target, draft, PROMPTS[:3], 16, ks=(3,))
