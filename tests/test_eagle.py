"""The EAGLE draft (``minillm.eagle``) and its training (``minillm.eagle_train``).

- the backward pass of the draft layer (RMSNorm, RoPE, grouped attention, SwiGLU, fc, both losses)
  against central finite differences in float64 (exercises 11.1 and 11.2), and the classic wrong
  backward passes caught by the same check;
- the draft's q over the whole vocabulary (exercise 11.3);
- the reduced vocabulary: the worked examples, and q zero outside the subset;
- lossless: the first two tokens of a round with the real proposer and the target's real forward
  follow the target's joint distribution (chi-square, T = 1 and 0.7, chain and tree), and the same
  harness rejects the classic mistakes (q not renormalized over the subset, subset ids mapped wrong);
- the draft's own cache: each round's chain equals the draft recomputed from scratch over the whole
  history, and the harness rejects the wrong feature position and a cache not rolled back;
- greedy output equals plain decoding token for token, near the context limit too;
- bad input: one-line errors.
"""

from dataclasses import replace

import numpy as np
import pytest
from stats import P_MIN, chi2_pvalue

from minillm.backend import to_numpy
from minillm.checkpoint import CheckpointError
from minillm.config import LlamaConfig
from minillm.draft_free import MAX_NGRAM, long_ngram_lookup
from minillm.eagle import EagleDraft, EagleLookup, EagleProposer, frequency_subset, subset_coverage, token_counts
from minillm.eagle_train import AheadContext, draft_forward_backward, draft_step_loss, rms_norm_backward, rope_backward
from minillm.generate import generate
from minillm.kv_cache import KVCache, MaskedView
from minillm.llama import Llama, apply_rope, rms_norm, rope_cos_sin
from minillm.quantize import Q4_1, as_blocks, block_format, kept_in_blocks
from minillm.sampling import SamplingSettings
from minillm.token_tree import Round, TokenTree, tree_generate, verify_tree

# The harness builds its inputs and mutants with NumPy arrays on the host, so it runs in the NumPy run
# only; the proposer's device path runs under the strict stand-in in tests/test_real_speculation.py.
pytestmark = pytest.mark.host_only
# the draft is a Llama block (8.1-8.3); the loop runs the KV cache (3.x), verification (5.1) and trees (9.x)
USES = pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "8.1", "8.2", "8.3", "9.1", "9.2", "9.3")

CFG = LlamaConfig(vocab_size=8, block_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_hidden=24)
SUBSET = [0, 2, 3, 5]
PROMPT = [1, 4, 2, 6, 3]


@pytest.fixture(scope="module")
def target():
    model = Llama.init(CFG, seed=5)
    model.params["embed_tokens.weight"] *= 6.0  # (the tied LM head too): distributions far from uniform
    return model


@pytest.fixture(scope="module")
def draft(target):
    d = EagleDraft.init(target, SUBSET, seed=1)
    rng = np.random.default_rng(2)  # a draft that is not its initialization: every weight matters
    for p in d.params.values():
        p += rng.normal(0.0, 0.3, p.shape).astype(np.float32)
    return d


@pytest.fixture(scope="module")
def fused(target):
    """An EAGLE-3 draft: it also reads the input of block 1, through its fuse; every weight moved."""
    d = EagleDraft.init(target, SUBSET, seed=1, tap_layers=(1,))
    rng = np.random.default_rng(2)
    for p in d.params.values():
        p += rng.normal(0.0, 0.3, p.shape).astype(np.float32)
    return d


# ----------------------------------------------------------------------------------------------
# the backward pass, by finite differences


def numeric_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + h
        up = f()
        x[i] = old - h
        down = f()
        x[i] = old
        g[i] = (up - down) / (2 * h)
    return g


def rms_norm_backward_error(backward, rng, shape=(3, 8)) -> float:
    """Largest gap between ``backward``'s dx, dw and central differences of sum(rms_norm(x, w) * dy)."""
    x, w, dy = rng.normal(size=shape), rng.normal(size=shape[-1]), rng.normal(size=shape)
    dx, dw = backward(dy, x, w, 1e-5)
    def loss():
        return float((rms_norm(x, w, 1e-5) * dy).sum())
    return max(np.abs(dx - numeric_grad(loss, x)).max(), np.abs(dw - numeric_grad(loss, w)).max())


def rope_backward_error(backward, rng) -> float:
    cos, sin = (c.astype(np.float64) for c in rope_cos_sin(np.arange(5), 8, 100.0))
    q, dq = rng.normal(size=(1, 2, 5, 8)), rng.normal(size=(1, 2, 5, 8))
    return np.abs(backward(dq, cos, sin) - numeric_grad(lambda: float((apply_rope(q, cos, sin) * dq).sum()), q)).max()


@pytest.mark.exercise("11.1")
@pytest.mark.uses_exercise("8.2")
def test_rms_norm_backward_matches_finite_differences(rng):
    assert rms_norm_backward_error(rms_norm_backward, rng) < 1e-7


@pytest.mark.exercise("11.1")
@pytest.mark.uses_exercise("8.2")
def test_rms_norm_backward_of_a_batch_of_sequences(rng):
    """x (B, T, C), as the draft layer calls it: dw sums over every row of every sequence. Fails for a dw
    summed over the first axis only (right for 2-D input alone)."""
    assert rms_norm_backward_error(rms_norm_backward, rng, shape=(2, 3, 8)) < 1e-7


@pytest.mark.exercise("11.2")
@pytest.mark.uses_exercise("8.1")
def test_rope_backward_matches_finite_differences(rng):
    assert rope_backward_error(rope_backward, rng) < 1e-7


# the classic wrong backward passes: each must be caught by the same finite-difference check
def rms_r_held_constant(dy, x, w, eps):  # forgets that r depends on x
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return r * dy * w, (dy * x * r).sum(axis=0)


def rms_dw_without_r(dy, x, w, eps):  # dw = sum dy x: the normalization left out of the scale's gradient
    dx, _ = rms_norm_backward(dy, x, w, eps)
    return dx, (dy * x).sum(axis=0)


def rope_forward_rotation(dy, cos, sin):  # rotates the gradient forward instead of back (R, not R^T)
    return apply_rope(dy, cos, sin)


def rope_cos_only(dy, cos, sin):  # drops the rotate_half term
    return dy * cos


@pytest.mark.uses_exercise("8.2")
@pytest.mark.parametrize("bug", [rms_r_held_constant,
                                 pytest.param(rms_dw_without_r, marks=pytest.mark.uses_exercise("11.1"))])
def test_the_check_catches_rms_norm_backward_bugs(bug, rng):
    assert rms_norm_backward_error(bug, rng) > 1e-2


@pytest.mark.uses_exercise("8.1")
@pytest.mark.parametrize("bug", [rope_forward_rotation, rope_cos_only])
def test_the_check_catches_rope_backward_bugs(bug, rng):
    assert rope_backward_error(bug, rng) > 1e-2


def check_draft_backward(P: dict, target, subset, rng, width: int):
    """draft_forward_backward's gradient of every parameter in P (float64), a few entries each, against central
    differences on a batch whose input features are ``width`` wide -> (the batch, the gradients)."""
    embed = to_numpy(target.params["embed_tokens.weight"]).astype(np.float64)
    lm = embed[subset]
    B, T, C = 2, 5, CFG.n_embd
    batch = (rng.normal(size=(B, T, width)), rng.integers(0, CFG.vocab_size, (B, T)), rng.normal(size=(B, T, C)),
             rng.integers(-1, len(SUBSET), (B, T)))
    assert (batch[3] == -1).any()
    _, parts, grads = draft_forward_backward(P, CFG, embed, lm, *batch)
    assert parts["token"] > 0 and parts["feature"] > 0
    assert set(grads) == set(P)
    for name, p in P.items():
        flat = p.reshape(-1)
        for i in rng.choice(flat.size, size=min(4, flat.size), replace=False):
            old, h = flat[i], 1e-6
            flat[i] = old + h
            up = draft_forward_backward(P, CFG, embed, lm, *batch)[0]
            flat[i] = old - h
            down = draft_forward_backward(P, CFG, embed, lm, *batch)[0]
            flat[i] = old
            np.testing.assert_allclose(grads[name].reshape(-1)[i], (up - down) / (2 * h), rtol=1e-4, atol=1e-8,
                                       err_msg=name)
    return (embed, lm, *batch), grads


@USES
@pytest.mark.uses_exercise("11.1", "11.2")
def test_draft_backward_matches_finite_differences(target, draft, rng):
    """Every parameter's gradient, a few entries each, float64; targets -1 (outside the subset) included."""
    P = {k: to_numpy(v).astype(np.float64) for k, v in draft.params.items()}
    check_draft_backward(P, target, draft.subset, rng, CFG.n_embd)


@USES
@pytest.mark.uses_exercise("11.1", "11.2")
def test_fused_draft_backward_matches_finite_differences(target, rng):
    """EAGLE-3's fused input: step 1 reads [taps; f] through the fuse, every parameter's gradient, the fuse's
    too, against central differences; a second step reads its own f^ (no fuse: its gradient is step 1's)."""
    fused = EagleDraft.init(target, SUBSET, seed=3, tap_layers=(1,))
    P = {k: to_numpy(v).astype(np.float64) + rng.normal(0.0, 0.3, v.shape) for k, v in fused.params.items()}
    assert P["fuse.weight"].shape == (CFG.n_embd, 2 * CFG.n_embd)
    inputs, grads = check_draft_backward(P, target, fused.subset, rng, 2 * CFG.n_embd)
    two = draft_forward_backward(P, CFG, *inputs, ahead=2)[2]
    np.testing.assert_array_equal(two["fuse.weight"], grads["fuse.weight"])
    assert np.abs(two["fc.weight"] - grads["fc.weight"]).max() > 1e-3


@USES
def test_a_fused_draft_reads_its_taps_through_the_fuse(target, rng):
    """Fresh, the fuse passes the top feature on: the taps change nothing until training moves them; after,
    step reads [taps; f] @ fuse^T in place of f, and its own f^ as it is."""
    fused = EagleDraft.init(target, SUBSET, seed=3, tap_layers=(1,))
    plain = EagleDraft(target, {k: v for k, v in fused.params.items() if k != "fuse.weight"}, SUBSET)
    f, taps, x = rng.normal(size=(4, CFG.n_embd)), rng.normal(size=(4, CFG.n_embd)), [1, 2, 3, 4]
    fused.params["fuse.weight"][:, : CFG.n_embd] = 0.0
    np.testing.assert_allclose(to_numpy(fused.step(np.concatenate([taps, f], axis=1), x)[1]),
                               to_numpy(plain.step(f, x)[1]), rtol=1e-5, atol=1e-5)
    fused.params["fuse.weight"][...] = rng.normal(size=fused.params["fuse.weight"].shape)
    g = np.concatenate([taps, f], axis=1) @ to_numpy(fused.params["fuse.weight"]).T
    np.testing.assert_allclose(to_numpy(fused.step(np.concatenate([taps, f], axis=1), x)[1]),
                               to_numpy(plain.step(g, x)[1]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(to_numpy(fused.step(f, x)[1]), to_numpy(plain.step(f, x)[1]), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# EAGLE-3's training-time test: later steps on the draft's own features


class PeekingContext(AheadContext):  # step 2 also sees step 1's key one position ahead
    @staticmethod
    def mask(R, T, step):
        return np.concatenate([np.tri(R, T, 1, dtype=bool)] + [np.eye(R, dtype=bool)] * (step - 1), axis=1)


class ShortContext(AheadContext):  # step 2 misses its own round's first guess (step 1's key at row i)
    @staticmethod
    def mask(R, T, step):
        return np.concatenate([np.tri(R, T, -1, dtype=bool)] + [np.eye(R, dtype=bool)] * (step - 1), axis=1)


def second_guess_error(draft, rng, context_class=AheadContext) -> float:
    """Largest gap between step 2 of a training-time test (every row at once) and the drafting path: for
    row i, a cache of step 1's rows 0..i, then the draft's own feature f^_{i+1} with x_{i+2}."""
    T = 6
    f = rng.normal(size=(T, CFG.n_embd)).astype(np.float32)
    x = rng.integers(0, CFG.vocab_size, T)  # x[j] = x_{j+1}, the token after f_j
    context = context_class()
    first, _ = draft.step(f, x, context)
    second, _ = draft.step(first[:-1], x[1:], context)
    gap = 0.0
    for i in range(T - 1):
        cache = draft.new_cache(T + 1)
        f1, _ = draft.step(f[: i + 1], x[: i + 1], cache)
        f2, _ = draft.step(f1[i:], x[i + 1 : i + 2], cache)
        gap = max(gap, float(np.abs(to_numpy(second[i]) - to_numpy(f2[0])).max()))
    return gap


@USES
def test_training_time_test_attends_as_drafting_does(draft, rng):
    assert second_guess_error(draft, rng) < 1e-5


@USES
@pytest.mark.parametrize("context_class", [PeekingContext, ShortContext])
def test_the_check_catches_a_training_time_test_with_the_wrong_mask(draft, rng, context_class):
    assert second_guess_error(draft, rng, context_class) > 1e-3


@USES
@pytest.mark.uses_exercise("11.1", "11.2")
def test_second_step_backward_matches_finite_differences(target, draft, rng):
    """Step 2 of a training-time test, after a fixed step 1 (its keys and features held: the gradient stops
    there), against central differences in float64; its gradient joins step 1's in draft_forward_backward."""
    import copy

    P = {k: to_numpy(v).astype(np.float64) for k, v in draft.params.items()}
    embed = to_numpy(target.params["embed_tokens.weight"]).astype(np.float64)
    lm = embed[draft.subset]
    B, T, C = 2, 5, CFG.n_embd
    f, x, f_next = rng.normal(size=(B, T, C)), rng.integers(0, CFG.vocab_size, (B, T)), rng.normal(size=(B, T, C))
    y = rng.integers(-1, len(SUBSET), (B, T))
    first = AheadContext()
    loss1, _, grads1, f_hat = draft_step_loss(P, CFG, embed, lm, f, x, f_next, y, first)
    step2 = (f_hat[:, :-1], x[:, 1:], f_next[:, 1:], y[:, 1:])
    loss2, _, grads2, _ = draft_step_loss(P, CFG, embed, lm, *step2, copy.deepcopy(first))
    loss, parts, grads = draft_forward_backward(P, CFG, embed, lm, f, x, f_next, y, ahead=2)
    assert loss == pytest.approx(loss1 + loss2) and set(parts) == {"token", "feature", "token_2", "feature_2"}
    for name, p in P.items():
        np.testing.assert_allclose(grads[name], grads1[name] + grads2[name], rtol=1e-12, err_msg=name)
        flat = p.reshape(-1)
        for i in rng.choice(flat.size, size=min(4, flat.size), replace=False):
            old, h = flat[i], 1e-6
            flat[i] = old + h
            up = draft_step_loss(P, CFG, embed, lm, *step2, copy.deepcopy(first))[0]
            flat[i] = old - h
            down = draft_step_loss(P, CFG, embed, lm, *step2, copy.deepcopy(first))[0]
            flat[i] = old
            np.testing.assert_allclose(grads2[name].reshape(-1)[i], (up - down) / (2 * h), rtol=1e-4, atol=1e-8,
                                       err_msg=name)
    with pytest.raises(ValueError, match="training-time test of 5 steps"):
        draft_forward_backward(P, CFG, embed, lm, f, x, f_next, y, ahead=5)


# ----------------------------------------------------------------------------------------------
# the reduced vocabulary


def test_frequency_subset_worked_examples():
    counts = np.array([5, 0, 9, 1])
    assert frequency_subset(counts, 2).tolist() == [0, 2]
    assert frequency_subset(counts, 2, always=(3,)).tolist() == [2, 3]
    assert token_counts([[0, 0, 3], [3, 1]], 4).tolist() == [2, 1, 0, 2]
    assert subset_coverage([6, 3, 1], [1, 2, 3]) == {1: 0.6, 2: 0.9, 3: 1.0}


@pytest.mark.exercise("11.3")
def test_full_probs_places_each_column_at_its_token_id(draft):
    q = draft.full_probs(np.array([[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, 0.0, 0.0]]))  # SUBSET = [0, 2, 3, 5]
    np.testing.assert_array_equal(q, [[0.1, 0, 0.2, 0.3, 0, 0.4, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]])


@USES
@pytest.mark.uses_exercise("11.3")
def test_draft_q_is_zero_outside_the_subset(draft):
    _, logits = draft.step(np.zeros((1, CFG.n_embd), np.float32), [3])
    q = draft.full_probs(SamplingSettings(1.0).probs(to_numpy(logits[0])))
    outside = np.setdiff1d(np.arange(CFG.vocab_size), SUBSET)
    assert q[outside].sum() == 0 and q.sum() == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------
# lossless: one round with the real proposer and the target's real forward


def round_state(target, prompt, settings, room=2):
    cache = KVCache(target.config)
    h = target.hidden(np.array([prompt[:-1]]), cache)[0]
    return Round(list(prompt), 1, cache, h[-1], room, h, settings)


def target_table(target, prompt, settings):
    """p(. | prompt + path) for paths of up to two tokens, from the target's forward."""
    V = target.config.vocab_size
    table = {}
    for path in [(), *((a,) for a in range(V)), *((a, b) for a in range(V) for b in range(V))]:
        logits = to_numpy(target.forward(np.array([[*prompt, *path]]))[0, -1])
        table[path] = settings.probs(logits)
    return table


def first_two_tokens(target, proposer, prompt, settings, table, n, seed):
    rng, cells = np.random.default_rng(seed), []
    V = target.config.vocab_size
    for _ in range(n):
        proposal = proposer.propose(round_state(target, prompt, settings))
        tree = proposal.tree
        probs = np.array([table[tuple(tree.tokens[j] for j in tree.path(i)[1:])] for i in range(tree.size)])
        emitted, _ = verify_tree(tree, probs, rng, proposal.draft_probs)
        if len(emitted) == 1:  # the next round starts from the target's own p(. | a)
            emitted.append(int(rng.choice(V, p=table[(emitted[0],)])))
        cells.append(emitted[0] * V + emitted[1])
    return cells


def joint(table, V):
    return np.concatenate([table[()][a] * table[(a,)] for a in range(V)])


CONFIDENT = 0.5  # a chain that goes past a token only where the draft gave it half of its mass or more
MODES = {"chain": ("chain", 0.0), "tree": ("tree", 0.0), "sized chain": ("chain", CONFIDENT)}


@USES
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.uses_exercise("11.3")) if "chain" in m else m
                                  for m in MODES])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("kind", ["draft", "fused"])
def test_a_round_is_lossless(target, request, kind, mode, temperature):
    draft = request.getfixturevalue(kind)
    settings = SamplingSettings(temperature)
    table = target_table(target, PROMPT, settings)
    mode, confidence = MODES[mode]
    proposer = EagleProposer(draft, mode, depth=2, top_k=2, width=2, max_nodes=6, seed=3, confidence=confidence)
    cells = first_two_tokens(target, proposer, PROMPT, settings, table, 3000, seed=4)
    assert chi2_pvalue(cells, joint(table, CFG.vocab_size)) >= P_MIN


class Unnormalized(EagleDraft):
    """Bug: q over the vocabulary is the subset's softmax scaled by a share of the mass (as if the
    probabilities of the full softmax were cut to the subset and not renormalized)."""

    def full_probs(self, subset_probs):
        return 0.5 * super().full_probs(subset_probs)


class IdsShifted(EagleDraft):
    """Bug: q is scattered to the wrong vocabulary ids (the subset's index i taken as id subset[i + 1])."""

    def full_probs(self, subset_probs):
        q = np.zeros((*np.shape(subset_probs)[:-1], self.target.config.vocab_size))
        q[..., np.roll(self.subset, -1)] = subset_probs
        return q


@USES
@pytest.mark.parametrize("bug", [pytest.param(Unnormalized, marks=pytest.mark.uses_exercise("11.3")), IdsShifted])
def test_the_harness_rejects_a_wrong_draft_distribution(target, draft, bug):
    broken = bug(target, {k: to_numpy(v) for k, v in draft.params.items()}, SUBSET)
    settings = SamplingSettings(1.0)
    table = target_table(target, PROMPT, settings)
    cells = first_two_tokens(target, EagleProposer(broken, "chain", depth=2, seed=3), PROMPT, settings, table,
                             3000, seed=4)
    assert chi2_pvalue(cells, joint(table, CFG.vocab_size)) < P_MIN


def peaked(top: float, at: int, size: int) -> np.ndarray:
    """Logits over ``size`` tokens whose softmax gives token ``at`` probability ``top``, the rest the same share."""
    probs = np.full(size, (1.0 - top) / (size - 1))
    probs[at] = top
    return np.log(probs).astype(np.float32)


class Scripted:
    """A stand-in draft whose forwards return the given logits rows in turn (its features are zeros)."""

    def __init__(self, draft, rows):
        self.subset, self.full_probs, self.rows, self.steps = draft.subset, draft.full_probs, list(rows), 0

    def step(self, features, tokens, cache=None, last=False):
        self.steps += 1
        return np.zeros_like(features), self.rows.pop(0)[None]


@pytest.mark.parametrize("confidence, length", [(0.0, 4), (0.3, 4), (0.5, 2), (0.9, 2), (0.95, 1), (1.0, 1)])
def test_a_chain_goes_past_a_token_only_where_the_draft_is_that_sure_of_it(draft, confidence, length):
    """Greedy, draft probabilities 0.9, 0.4, 0.95, 0.6 for the chain's four argmax tokens: the chain stops after the
    first token the draft gave less than ``confidence``, and drafts no further (one forward fewer than its tokens)."""
    likeliest = [1, 3, 0, 2]  # the subset index the draft favours at each step
    rows = [peaked(p, j, len(SUBSET)) for p, j in zip([0.9, 0.4, 0.95, 0.6], likeliest)]
    proposer = EagleProposer(draft, "chain", depth=4, confidence=confidence)
    proposer.draft = Scripted(draft, rows[1:])
    proposal = proposer.chain(7, np.zeros(CFG.n_embd, dtype=np.float32), rows[0], 4, SamplingSettings(0.0))
    assert list(proposal.tree.tokens) == [7, *(SUBSET[j] for j in likeliest[:length])]
    assert proposer.draft.steps == length - 1


@pytest.mark.uses_exercise("11.3")
@pytest.mark.parametrize("confidence", [0.3, 0.5, 0.7])
def test_a_sampled_chain_goes_past_a_token_only_where_q_gave_it_that_much(draft, confidence):
    """At temperature 1 each token is drawn from q (top token 0.6, the others 0.4 / 3 each): over 200 rounds of
    depth 4, a chain goes past each drawn token exactly where q gave it ``confidence`` or more."""
    rng = np.random.default_rng(0)
    proposer = EagleProposer(draft, "chain", depth=4, confidence=confidence, seed=1)
    lengths = set()
    for _ in range(200):
        rows = [peaked(0.6, int(rng.integers(len(SUBSET))), len(SUBSET)) for _ in range(4)]
        proposer.draft = Scripted(draft, rows[1:])
        proposal = proposer.chain(7, np.zeros(CFG.n_embd, dtype=np.float32), rows[0], 4, SamplingSettings(1.0))
        tokens, q = proposal.tree.tokens[1:], proposal.draft_probs
        sure = [q[i + 1][token] >= confidence for i, token in enumerate(tokens)]
        assert all(sure[:-1]) and (len(tokens) == 4 or not sure[-1]), (tokens, sure)
        assert proposer.draft.steps == len(tokens) - 1
        lengths.add(len(tokens))
    assert lengths == ({1, 2, 3, 4} if confidence <= 0.6 else {1})


@pytest.mark.parametrize("confidence", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_a_chains_confidence_is_a_probability(draft, confidence):
    with pytest.raises(ValueError, match="confidence is a probability"):
        EagleProposer(draft, "chain", confidence=confidence)


# ----------------------------------------------------------------------------------------------
# EAGLE's chain with prompt lookup's beside it

REPEATING = [1, 4, 2, 6, 1, 4]  # its last two tokens occurred before: lookup proposes 2, 6, ...


class CopiedFirst(EagleLookup):
    """Bug: lookup's path put first in the joined tree, so the draft's q, kept by node number, lands on lookup's
    tokens: a copied token is accepted with min(1, p(x) / q(x)) for a q it was never drawn from."""

    def propose(self, state):
        proposal = self.eagle.propose(state)
        copied = long_ngram_lookup(state.seq, self.min_ngram, MAX_NGRAM, self.max_draft)[: state.room]
        return replace(proposal, tree=TokenTree.from_paths(state.seq[-1], [copied, list(proposal.tree.tokens[1:])]))


@USES
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_eagle_with_lookup_is_lossless(target, draft, temperature):
    """The draft's sampled chain of 2 and lookup's deterministic [2, 6] in one tree: the first two tokens are
    distributed as the target's (chi-square over all 64 pairs); the harness rejects ``CopiedFirst``."""
    settings = SamplingSettings(temperature)
    table = target_table(target, REPEATING, settings)
    expected = joint(table, CFG.vocab_size)
    proposal = EagleLookup(EagleProposer(draft, "chain", depth=2, seed=3), 2).propose(
        round_state(target, REPEATING, settings))
    assert TokenTree.chain(4, [2, 6]).tokens[1:] == tuple(proposal.tree.tokens[i] for i in proposal.tree.path(
        proposal.tree.size - 1)[1:])  # lookup's path is in the tree
    for proposer, copied, ok in ((EagleLookup, 2, True), (CopiedFirst, 1, False)):  # the bug: lookup's token 2 only
        cells = first_two_tokens(target, proposer(EagleProposer(draft, "chain", depth=2, seed=3), copied), REPEATING,
                                 settings, table, 3000, seed=4)
        assert (chi2_pvalue(cells, expected) >= P_MIN) == ok, proposer.__name__


@USES
@pytest.mark.parametrize("depth", [1, 3])
def test_eagle_with_lookup_greedy_is_plain_decoding(target, draft, depth):
    """Greedy output equals plain decoding's (past block_size: the window slides), and lookup's chain joined the
    draft's in some rounds (a tree wider than the draft's chain)."""
    proposer = EagleLookup(EagleProposer(draft, "chain", depth=depth), 4)
    sizes, propose = [], proposer.propose

    def recorded(state):
        proposal = propose(state)
        sizes.append(proposal.tree.size)
        return proposal

    proposer.propose = recorded
    out = tree_generate(target, REPEATING, 60, proposer, temperature=0.0)
    assert out.tokens == generate(target, REPEATING, 60, temperature=0.0).tokens
    assert max(sizes) > 1 + depth


def test_eagle_with_lookup_extends_a_chain_only(draft):
    with pytest.raises(ValueError, match="chain"):
        EagleLookup(EagleProposer(draft, "tree"), 4)
    with pytest.raises(ValueError, match="min_ngram"):
        EagleLookup(EagleProposer(draft), 4, min_ngram=0)


# ----------------------------------------------------------------------------------------------
# the draft's own cache: every round as if recomputed from scratch


def reference_chain(target, draft, seq, depth):
    """The draft's greedy chain after seq, with no cache: all pairs (f_j, x_{j+1}) in one forward (a fused
    draft's f_j: its fuse of [the tapped blocks' inputs; f_j], computed here)."""
    f, taps = target.hidden_taps(np.array([seq[:-1]]), tap_layers=draft.tap_layers)  # every position but the root's
    f = to_numpy(f[0])
    if draft.tap_layers:
        f = np.concatenate([to_numpy(t[0]) for t in taps] + [f], axis=1) @ to_numpy(draft.params["fuse.weight"]).T
    feats, tokens = list(f), list(seq[1:])
    chain = []
    for _ in range(depth):
        f_hat, logits = draft.step(np.array(feats), tokens)
        chain.append(int(draft.subset[int(np.argmax(to_numpy(logits[-1])))]))
        feats.append(to_numpy(f_hat[-1]))
        tokens.append(chain[-1])
    return chain


class Recording(EagleProposer):
    def propose(self, state):
        proposal = super().propose(state)
        if proposal.tree.size > 1:
            self.rounds.append((list(state.seq), list(proposal.tree.tokens[1:])))
        return proposal


class WrongPosition(Recording):
    """Bug: the draft reads f_{j-1} beside x_{j+1} (features one position late)."""

    def sync(self, state):
        kept = state.kept_hidden
        shifted = kept[np.maximum(np.arange(len(kept)) - 1, 0)]
        return super().sync(Round(state.seq, state.n_pending, state.cache, state.hidden, state.room, shifted,
                                  state.settings))


class NotRolledBack(Recording):
    """Bug: the draft's speculative entries stay in its cache after a round."""

    def sync(self, state):
        self.synced = self.cache.length if self.cache is not None and self.synced else self.synced
        return super().sync(state)


def drafted_rounds(target, draft, cls):
    proposer = cls(draft, "chain", depth=3)
    proposer.rounds = []
    tree_generate(target, PROMPT, 14, proposer, temperature=0.0)
    return proposer.rounds


@USES
@pytest.mark.parametrize("kind", ["draft", "fused"])
def test_each_round_drafts_what_a_recompute_drafts(target, request, kind):
    """A fused draft too: the target hands over the tapped block's input at every position it keeps."""
    draft = request.getfixturevalue(kind)
    rounds = drafted_rounds(target, draft, Recording)
    assert len(rounds) >= 3
    for seq, chain in rounds:
        assert chain == reference_chain(target, draft, seq, len(chain))


@USES
@pytest.mark.parametrize("bug", [WrongPosition, NotRolledBack])
def test_the_recompute_check_catches_cache_bugs(target, draft, bug):
    rounds = drafted_rounds(target, draft, bug)
    assert any(chain != reference_chain(target, draft, seq, len(chain)) for seq, chain in rounds)


@USES
def test_a_catch_up_reads_the_head_for_its_last_row_only(target, draft, monkeypatch):
    """The first round feeds the draft the whole prompt and later rounds the accepted path; the chain needs
    the logits of the last row only, and the head is half the draft's bytes, so no call of a chain's round
    runs the head on more than one row (the recompute test above checks what that row holds)."""
    rows, logits = [], draft.layer.logits
    monkeypatch.setattr(draft.layer, "logits", lambda h: rows.append(h.shape[-2]) or logits(h))
    fed = []
    proposer = EagleProposer(draft, "chain", depth=3)
    sync = proposer.sync
    monkeypatch.setattr(proposer, "sync", lambda state: fed.append(len(state.kept_hidden)) or sync(state))
    tree_generate(target, PROMPT, 14, proposer, temperature=0.0)
    assert fed[0] == len(PROMPT) and max(fed[1:]) >= 2  # catch-ups of several rows did happen
    assert rows and set(rows) == {1}


def reference_tree(target, draft, seq, depth, top_k, width, max_nodes):
    """EAGLE-2's tree after seq with no cache: every node's logits from one forward over the prefix's pairs and
    the pairs along its path (the feature a node reads is its parent's f^). -> (the tree's tokens after the
    root, each level's logits of its new nodes in the order they were drafted, the last level's left out)."""
    prefix_f = list(to_numpy(target.hidden(np.array([seq[:-1]]))[0]))
    def expand(path_f, path_x):  # -> (f^, logits) of the path's last node
        f_hat, logits = draft.step(np.array(prefix_f + path_f), list(seq[1:]) + path_x)
        return to_numpy(f_hat[-1]), to_numpy(logits[-1]).astype(np.float64)

    f_root, logits_root = expand([], [])
    nodes = [((), (), 0.0, f_root, logits_root)]  # (path tokens, path features, log p, f^, logits); 0 the root
    open_nodes, levels = [0], []
    for level in range(depth):
        new = []
        for n in sorted(open_nodes, key=lambda n: -nodes[n][2])[:width]:
            path_x, path_f, lp, f_hat, lg = nodes[n]
            logp = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
            for j in np.argsort(-logp, kind="stable")[:top_k]:
                x, fs = (*path_x, int(draft.subset[j])), (*path_f, f_hat)
                nodes.append((x, fs, lp + float(logp[j]), *(expand(list(fs), list(x)) if level + 1 < depth else
                                                            (None, None))))
                new.append(len(nodes) - 1)
        if level + 1 < depth:
            levels.append(np.stack([nodes[n][4] for n in new]))
        open_nodes = new
    best = sorted(sorted(range(1, len(nodes)), key=lambda n: (-nodes[n][2], n))[: max_nodes - 1])
    return [nodes[n][0][-1] for n in best], levels


class TreeRecording(EagleProposer):
    """Records each round: the sequence, the tree's tokens after the root, its depth, and each draft forward's
    logits (one row per token it was fed; the catch-up's last row only)."""

    def propose(self, state):
        calls, step = [], self.draft.step
        def recorded(features, tokens, cache=None, last=False):
            f_hat, logits = step(features, tokens, cache, last)
            calls.append(to_numpy(logits))
            return f_hat, logits
        self.draft.step = recorded
        try:
            proposal = super().propose(state)
        finally:
            del self.draft.step
        if proposal.tree.size > 1:
            depth = min(self.max_depth, state.room)
            self.rounds.append((list(state.seq), list(proposal.tree.tokens[1:]), depth, calls))
        return proposal


@USES
def test_tree_grows_level_by_level_as_a_recompute_grows_it(target, draft):
    """Each level of the EAGLE-2 tree feeds only its new nodes, its ancestors read from the draft's cache:
    every round's tree, and every drafted node's logits, equal those recomputed from scratch, and a round's
    forwards take the rows synced (one per kept position), then top_k x width per level (depth 4, top_k 3,
    width 2: 3, 6, 6 rows), not every node drafted so far (3, 9, 15)."""
    proposer = TreeRecording(draft, "tree", depth=4, top_k=3, width=2, max_nodes=10)
    proposer.rounds = []
    tree_generate(target, PROMPT, 12, proposer, temperature=0.0)
    assert sum(depth == 4 for _, _, depth, _ in proposer.rounds) >= 2
    for seq, drafted, depth, calls in proposer.rounds:
        tokens, levels = reference_tree(target, draft, seq, depth, 3, 2, 10)
        assert drafted == tokens
        assert [len(c) for c in calls[1:]] == [3, 6, 6][: depth - 1]
        for got, want in zip(calls[1:], levels, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@USES
def test_a_tree_fed_level_by_level_equals_one_forward_over_every_node(target, draft):
    """The draft over a tree, each level's nodes fed alone with the earlier levels in its cache (MaskedView's
    ``seen``: ancestors only), gives every node the f^ and logits of one masked forward over all nodes; a node
    that sees a cousin, or sits one position late, does not."""
    tree = TokenTree((3, 0, 2, 5, 3, 0, 2, 3), (-1, 0, 0, 1, 1, 2, 4, 6))  # depths 1, 1, 2, 2, 2, 3, 4
    feats = np.random.default_rng(3).normal(size=(tree.size, CFG.n_embd)).astype(np.float32)
    prefix = np.random.default_rng(4).normal(size=(5, CFG.n_embd)).astype(np.float32)

    def synced():
        cache = draft.new_cache(40)
        draft.step(prefix, PROMPT, cache)
        return cache

    cache = synced()
    view = MaskedView(cache, tree.depths[1:] - 1, tree.mask()[1:, 1:])
    f_all, logits_all = (to_numpy(a) for a in draft.step(feats[1:], list(tree.tokens[1:]), view))

    def by_level(seen_of=lambda anc: anc, offset=1):
        cache, fed, out = synced(), [], {}
        for d in range(1, int(tree.depths.max()) + 1):
            new = [int(n) for n in np.flatnonzero(tree.depths == d)]
            seen = seen_of(tree.mask()[np.ix_(new, fed)].reshape(len(new), len(fed)))
            lv = MaskedView(cache, tree.depths[new] - offset, np.eye(len(new), dtype=bool), seen=seen)
            f_hat, logits = draft.step(feats[new], [tree.tokens[n] for n in new], lv)
            out |= {n: (to_numpy(f_hat[i]), to_numpy(logits[i])) for i, n in enumerate(new)}
            fed += new
        return np.stack([out[n][0] for n in range(1, tree.size)]), np.stack([out[n][1] for n in range(1, tree.size)])

    f_lv, logits_lv = by_level()
    np.testing.assert_allclose(f_lv, f_all, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits_lv, logits_all, rtol=1e-5, atol=1e-5)
    for wrong in (by_level(seen_of=np.ones_like), by_level(offset=0)):
        assert not np.allclose(wrong[1], logits_all, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# greedy output is plain decoding's


@USES
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n_new", [10, 60])  # 60 runs past block_size = 40: the window slides
@pytest.mark.parametrize("kind", ["draft", "fused"])
def test_greedy_output_is_plain_decoding(target, request, kind, mode, n_new):
    draft = request.getfixturevalue(kind)
    mode, confidence = MODES[mode]
    proposer = EagleProposer(draft, mode, depth=4, top_k=2, width=2, max_nodes=8, confidence=confidence)
    out = tree_generate(target, PROMPT, n_new, proposer, temperature=0.0)
    assert out.tokens == generate(target, PROMPT, n_new, temperature=0.0).tokens


# ----------------------------------------------------------------------------------------------
# a draft kept in the target's blocks


@pytest.fixture(scope="module")
def block_pair():
    """A Llama kept in Q8_0 / Q4_1 blocks (SmolLM2's layout) and, on it, a draft loaded to draft (keep_blocks)
    beside the float32 draft of the same dequantized weights: (target, draft in blocks, its float32 reference)."""
    from test_quantized_model import TINY, tiny_params

    target = Llama(TINY, tiny_params()[0])
    subset = list(range(0, TINY.vocab_size, 3))
    params = {k: to_numpy(v) for k, v in EagleDraft.init(target, subset, seed=1).params.items()}
    rng = np.random.default_rng(4)
    params = {k: v + rng.normal(0.0, 0.05, v.shape).astype(np.float32) for k, v in params.items()}
    blocks = EagleDraft(target, params, subset, keep_blocks=True)
    dense = {k: as_blocks(v).dequantize() if kept_in_blocks(v) else to_numpy(v) for k, v in blocks.params.items()}
    return target, blocks, EagleDraft(target, dense, subset)


@pytest.mark.uses_exercise("13.1", "8.1", "8.2", "8.3")
def test_a_draft_in_blocks_keeps_the_targets_formats_and_head_bytes(block_pair):
    """Every matrix of the draft in the format of the target's matching matrix (fc: its q_proj's), the norms
    float32, and the head E_S the target's own blocks of the rows S, byte for byte (not requantized)."""
    target, draft, _ = block_pair
    last = f"layers.{target.config.n_layer - 1}."
    for name, p in draft.params.items():
        if len(p.shape) == 1:
            assert not kept_in_blocks(p), name
            continue
        like = target.params[last + ("self_attn.q_proj.weight" if name == "fc.weight" else name[len("layers.0."):])]
        assert block_format(p) is block_format(like), name
    head = draft.layer.lm_head
    assert kept_in_blocks(head)
    np.testing.assert_array_equal(as_blocks(head).raw, as_blocks(target.lm_head).unpack(draft.subset).raw)


@USES
@pytest.mark.uses_exercise("13.1")
def test_a_draft_head_requantized_to_q4_1_is_its_logits_and_stays_lossless(block_pair):
    """head_format="Q4_1": the head is Q4_1's quantizer applied to the target's rows S (the reference dequantizer's
    floats), the subset logits of a step are f^ times that head, and greedy speculation still writes the target's
    tokens. Refused: a format outside HEAD_FORMATS, and a head_format on a float32 draft (for training)."""
    target, _, dense = block_pair
    params = {k: to_numpy(v) for k, v in dense.params.items()}
    draft = EagleDraft(target, params, dense.subset, keep_blocks=True, head_format="Q4_1")
    want = Q4_1.quantize(as_blocks(target.lm_head).unpack(dense.subset).dequantize())
    assert block_format(draft.layer.lm_head) is Q4_1
    np.testing.assert_array_equal(as_blocks(draft.layer.lm_head).raw, want.raw)
    feats = np.random.default_rng(2).normal(0.0, 1.0, (3, target.config.n_embd)).astype(np.float32)
    f_hat, logits = draft.step(feats, [1, 4, 2], draft.new_cache(8))
    ref = to_numpy(f_hat) @ want.dequantize().T
    assert np.abs(to_numpy(logits) - ref).max() <= 2e-4 * np.abs(ref).max()
    out = tree_generate(target, PROMPT, 16, EagleProposer(draft, "chain", depth=3), temperature=0.0)
    assert out.tokens == generate(target, PROMPT, 16, temperature=0.0).tokens
    with pytest.raises(ValueError, match="head format must be one of"):
        EagleDraft(target, params, dense.subset, keep_blocks=True, head_format="Q2_K")
    with pytest.raises(ValueError, match="for drafting"):
        EagleDraft(target, params, dense.subset, head_format="Q4_1")


@pytest.mark.uses_exercise("13.1", "8.1", "8.2", "8.3", "3.1", "3.3")
def test_a_draft_in_blocks_steps_as_its_dequantized_self(block_pair):
    """The kernels' products against the float32 products of the same weights: features and subset logits
    within float32 rounding, on a prefill and on cached single steps."""
    target, blocks, dense = block_pair
    rng = np.random.default_rng(0)
    feats = rng.normal(0.0, 1.0, (7, target.config.n_embd)).astype(np.float32)
    tokens = [int(t) for t in rng.integers(0, target.config.vocab_size, 7)]
    caches = [d.new_cache(16) for d in (blocks, dense)]
    for rows in (slice(0, 5), slice(5, 6), slice(6, 7)):
        (fq, lq), (fd, ld) = (d.step(feats[rows], tokens[rows], c) for d, c in zip((blocks, dense), caches))
        for got, want in ((fq, fd), (lq, ld)):
            got, want = to_numpy(got), to_numpy(want)
            assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()


@USES
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_a_draft_in_blocks_is_lossless_greedy(block_pair, mode):
    target, draft, _ = block_pair
    proposer = EagleProposer(draft, mode, depth=4, top_k=2, width=2, max_nodes=8)
    out = tree_generate(target, PROMPT, 24, proposer, temperature=0.0)
    assert out.tokens == generate(target, PROMPT, 24, temperature=0.0).tokens


@pytest.mark.uses_exercise("13.1")  # the block pair quantizes
def test_a_draft_in_blocks_is_not_saved(block_pair, tmp_path):
    with pytest.raises(ValueError, match="keeps its weights in blocks"):
        block_pair[1].save(tmp_path / "d.npz")
    assert not (tmp_path / "d.npz").exists()


# ----------------------------------------------------------------------------------------------
# bad input


def test_bad_input_one_line_errors(target, draft, tmp_path):
    with pytest.raises(ValueError, match="draft depth K must be an int in 1..12"):
        EagleProposer(draft, depth=0)
    with pytest.raises(ValueError, match="max_nodes must be an int in 2..64"):
        EagleProposer(draft, "tree", max_nodes=1000)
    with pytest.raises(ValueError, match="'chain' or 'tree'"):
        EagleProposer(draft, "beam")
    with pytest.raises(ValueError, match="distinct token ids"):
        EagleDraft(target, {k: to_numpy(v) for k, v in draft.params.items()}, [0, 0, 2, 3])
    with pytest.raises(ValueError, match="vocabulary size V' must be an int"):
        frequency_subset(np.ones(100), 5000)
    path = tmp_path / "eagle.npz"
    draft.save(path)
    other = Llama.init(CFG, seed=6)
    with pytest.raises(ValueError, match="trained for another model"):
        EagleDraft.load(other, path)
    assert EagleDraft.load(target, path).subset.tolist() == SUBSET


# ----------------------------------------------------------------------------------------------
# training data and the training loop


@USES
def test_answer_batch_features_are_the_targets_own(target):
    """Each answer's features are the target's hidden states of the whole sequence (one forward), the
    padded batch included: the data is what decoding will meet."""
    from minillm.eagle_train import answer_batch, pad_prompts

    prompts = pad_prompts([[1, 2, 3, 4], [5, 6, 7]], at=1, pad_id=0)
    assert prompts == [[1, 2, 3, 4], [5, 0, 6, 7]]
    for temperature in (0.0, 1.0):
        for tokens, feats in answer_batch(target, prompts, 6, temperature, eos=7, seed=0):
            assert len(feats) == len(tokens) - 1
            full = to_numpy(target.hidden(np.array([tokens]))[0, :-1])
            np.testing.assert_allclose(feats.astype(np.float32), full, atol=2e-2, rtol=2e-2)  # float16 storage


def synthetic_data(target, n_seqs=6, length=40, seed=0):
    """Sequences that repeat a pattern of 5 tokens: a draft learns them in a few steps."""
    rng = np.random.default_rng(seed)
    seqs = [np.tile(rng.permutation(CFG.vocab_size)[:5], length // 5) for _ in range(n_seqs)]
    feats = [to_numpy(target.hidden(np.array([s]))[0, :-1]).astype(np.float16) for s in seqs]
    return {"sequences": seqs, "features": feats, "kinds": ["chat"] * n_seqs, "temperatures": [0.0] * n_seqs,
            "prompt_lengths": [4] * n_seqs}


@USES
@pytest.mark.uses_exercise("11.1", "11.2")
def test_training_resumes_where_it_stopped(target, tmp_path):
    """6 steps in one go == 3 steps, a stop, and --resume to 6 (parameters, bit for bit)."""
    from dataclasses import replace

    from minillm.eagle_train import EAGLE_TRAIN, DraftData, train_draft

    tc = replace(EAGLE_TRAIN, max_steps=6, batch_size=2, ckpt_every=3, eval_every=3, warmup_steps=2, lr=3e-3)
    data = synthetic_data(target)
    straight = EagleDraft.init(target, SUBSET)
    history = train_draft(straight, DraftData(data, straight), tc, tmp_path / "a.npz", progress=False)
    assert history[-1]["loss"] < history[0]["loss"]
    stopped = EagleDraft.init(target, SUBSET)
    train_draft(stopped, DraftData(data, stopped), replace(tc, max_steps=3), tmp_path / "b.npz", progress=False)
    resumed = EagleDraft.init(target, SUBSET)
    train_draft(resumed, DraftData(data, resumed), tc, tmp_path / "b.npz", resume=True, progress=False)
    for name in straight.params:
        np.testing.assert_array_equal(to_numpy(resumed.params[name]), to_numpy(straight.params[name]), err_msg=name)
    with pytest.raises(CheckpointError, match="trained with --ahead 1, not 2"):
        train_draft(resumed, DraftData(data, resumed), tc, tmp_path / "b.npz", resume=True, progress=False, ahead=2)
