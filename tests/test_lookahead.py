"""Chapter 9, Jacobi and Lookahead decoding: both reproduce greedy decoding token for token, a Jacobi
block converges in at most m iterations (in two when the guesses are fed back and the target ignores
them), the lookahead window's mask and positions make every window token compute what plain decoding
of its visible tokens computes, the verification tree never sees the window, and the pool files
n-grams under their first token."""

import functools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import GPT, GPTConfig, KVCache, Llama, LlamaConfig, generate, load_model
from minillm.backend import to_numpy
from minillm.lookahead import Lookahead, NGramPool, jacobi_generate, jacobi_step, window_inputs
from minillm.token_tree import Proposal, TokenTree, round_inputs, tree_generate

CONFIG = GPTConfig(vocab_size=16, block_size=64, n_layer=2, n_head=2, n_embd=32)
WEIGHT_SCALE = 10.0  # a random model with 10x weights writes varied greedy text (at 1x it repeats one token)
PROMPTS = [[1, 2, 3, 4], [7], [5, 5, 5, 5, 5, 5, 9, 0, 3]]


@functools.cache
def varied_model() -> GPT:
    """A tiny random GPT whose greedy text varies, so Jacobi and Lookahead guess wrong as often as right."""
    return GPT(CONFIG, scaled(GPT.init(CONFIG, seed=1).numpy_params()))


def scaled(params: dict) -> dict:
    """Every matrix times WEIGHT_SCALE (norm gains and biases unchanged)."""
    return {k: v * WEIGHT_SCALE if v.ndim == 2 else v for k, v in params.items()}


def greedy(model, prompt, n, max_len=None):
    return generate(model, prompt, n, temperature=0, cache=KVCache(model.config, max_len=max_len)).tokens


# ---- Jacobi decoding ------------------------------------------------------------------------------


@pytest.mark.exercise("9.4")
def test_jacobi_step_worked_example():
    """The exact prefix is the leading matches plus one prediction; the rest are the new guesses."""
    assert jacobi_step([5, 6, 7, 8], [5, 6, 9, 3]) == ([5, 6, 9], [3])
    assert jacobi_step([5, 6, 7, 8], [4, 6, 7, 8]) == ([4], [6, 7, 8])  # only p_0 is known to be exact
    assert jacobi_step([5, 6, 7, 8], [5, 6, 7, 8]) == ([5, 6, 7, 8], [])  # the fixed point
    assert jacobi_step([5], [2]) == ([2], [])


@pytest.mark.exercise("9.4")
@pytest.mark.uses_exercise("3.1", "3.2", "3.3")
@settings(max_examples=12, deadline=None)
@given(prompt=st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=1, max_size=6),
       m=st.integers(1, 6), n=st.integers(0, 24), max_len=st.sampled_from([None, 12, 17]))
def test_jacobi_equals_greedy_and_converges_within_m(prompt, m, n, max_len):
    """Any prompt, block size, length and cache size (12 and 17 force re-prefills): Jacobi's output is
    generate's greedy output, and every block reaches its fixed point in at most m iterations."""
    model = varied_model()
    out = jacobi_generate(model, prompt, n, m=m, cache=KVCache(CONFIG, max_len=max_len))
    assert out.tokens == greedy(model, prompt, n, max_len)
    assert all(1 <= it <= m for it in out.stats.block_iterations)
    assert sum(out.stats.block_iterations) == out.stats.target_calls
    assert out.stats.new_tokens == n


@pytest.mark.exercise("9.4")
def test_jacobi_counts_the_prompt_tokens_it_drops():
    """A 40-token prompt in a 12-token cache keeps its last 6 (``fit_context``): the stats count the
    34 dropped; a prompt that fits drops none."""
    prompt = [int(t) % CONFIG.vocab_size for t in range(7, 47)]
    out = jacobi_generate(varied_model(), prompt, 5, cache=KVCache(CONFIG, max_len=12))
    assert out.stats.dropped_prompt_tokens == 34
    assert jacobi_generate(varied_model(), prompt[:10], 5).stats.dropped_prompt_tokens == 0


@pytest.mark.exercise("9.4")
@pytest.mark.uses_exercise("3.1", "3.2", "3.3")
def test_jacobi_needs_several_iterations_on_varied_text():
    """The varied model makes Jacobi work: some block takes more than one iteration (the property
    test above is not passing for the trivial reason that every guess is right)."""
    out = jacobi_generate(varied_model(), [1, 2, 3, 4], 30, m=4)
    assert max(out.stats.block_iterations) > 1
    assert out.stats.target_calls < 30  # ... and some iteration confirmed a fed guess


class PositionModel:
    """A stand-in target whose greedy next token depends only on the position: (position + 1) % V.

    It keeps the forward-cache contract (positions, advance) like any model."""

    def __init__(self, config):
        self.config = config

    def forward(self, idx, cache):
        pos = to_numpy(cache.positions(idx.shape[1]))
        cache.advance(idx.shape[1])
        return np.eye(self.config.vocab_size, dtype=np.float32)[None, (pos + 1) % self.config.vocab_size]


@pytest.mark.exercise("9.4")
@pytest.mark.uses_exercise("3.2", "3.3")
def test_jacobi_feeds_back_its_guesses():
    """With a target that ignores the tokens, the first iteration's predictions are all exact, so a
    Jacobi that feeds them back confirms the whole block in the second iteration. One that keeps its
    old guesses (copies of the last token) gains one token per iteration: m iterations per block."""
    model, m = PositionModel(CONFIG), 6
    out = jacobi_generate(model, [0, 1, 2], 24, m=m)
    assert out.tokens == greedy(model, [0, 1, 2], 24)
    assert out.stats.block_iterations == [2] * 4


def test_jacobi_bad_arguments():
    with pytest.raises(ValueError, match="m \\(Jacobi"):
        jacobi_generate(varied_model(), [1], 4, m=0)
    with pytest.raises(ValueError, match="prompt"):
        jacobi_generate(varied_model(), [], 4)


# ---- Lookahead decoding ---------------------------------------------------------------------------


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2")
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("nwg", [(5, 7, 7), (3, 2, 1), (4, 3, 2)])
def test_lookahead_equals_greedy(prompt, nwg):
    """Greedy Lookahead is generate's greedy decoding for every prompt and window shape."""
    N, W, G = nwg
    model = varied_model()
    out = tree_generate(model, prompt, 30, Lookahead(N, W, G))
    assert out.tokens == greedy(model, prompt, 30)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2")
@pytest.mark.parametrize("max_len", [10, 24, 40])
def test_lookahead_equals_greedy_near_the_cache_limit(max_len):
    """Small caches: the window (27 tokens at the defaults) often has no room and sits rounds out,
    the cache is re-prefilled as generate re-prefills it, and the output stays generate's."""
    model = varied_model()
    la = Lookahead(pool_from_prompt=True)
    out = tree_generate(model, PROMPTS[0], 60, la, cache=KVCache(CONFIG, max_len=max_len))
    assert out.tokens == greedy(model, PROMPTS[0], 60, max_len)
    assert out.stats.reprefills > 0
    assert la.window_rounds < out.stats.target_calls  # some rounds ran without the window


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "8.1", "8.2", "8.3", "9.1", "9.2", "9.4")
def test_lookahead_equals_greedy_on_a_tiny_llama():
    """The Llama architecture (RoPE positions from the explicit offsets, grouped KV heads) too:
    Lookahead and Jacobi both give its greedy decoding, also with a cache that forces re-prefills."""
    cfg = LlamaConfig(vocab_size=16, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_hidden=48)
    model = Llama(cfg, scaled(Llama.init(cfg, seed=2).numpy_params()))
    for max_len in (None, 20):
        expected = greedy(model, PROMPTS[0], 30, max_len)
        assert tree_generate(model, PROMPTS[0], 30, Lookahead(N=4, W=3, G=3),
                             cache=KVCache(cfg, max_len=max_len)).tokens == expected
        assert jacobi_generate(model, PROMPTS[0], 30, m=4, cache=KVCache(cfg, max_len=max_len)).tokens == expected


@dataclass
class Recorded:
    seq: list  # the text when the round was proposed (the root last)
    proposal: Proposal
    level_sizes: list  # the window's level lengths
    extra_logits: object = None  # (E, V), None when the window sat the round out


class Recorder:
    """Wraps a Lookahead proposer and keeps every round's text, proposal, window and window logits."""

    def __init__(self, proposer):
        self.proposer, self.max_depth, self.rounds = proposer, proposer.max_depth, []

    def propose(self, state):
        proposal = self.proposer.propose(state)
        self.rounds.append(Recorded(list(state.seq), proposal, [len(row) for row in self.proposer.levels]))
        return proposal

    def observe(self, state, emitted, extra_logits):
        self.rounds[-1].extra_logits = None if extra_logits is None else to_numpy(extra_logits)
        self.proposer.observe(state, emitted, extra_logits)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2")
def test_lookahead_window_computes_what_plain_decoding_computes():
    """Each window token's logits in the combined forward equal a plain causal forward over the text
    and the window tokens it sees, in position order: its mask and positions are the paper's (the
    tokens it sees sit at the consecutive positions before it)."""
    model = varied_model()
    rec = Recorder(Lookahead(N=4, W=3, G=2))
    tree_generate(model, [1, 2, 3, 4], 12, rec)
    for r in rec.rounds:
        tokens, offsets = r.proposal.extra_tokens, r.proposal.extra_offsets
        for e in range(len(tokens)):
            seen = sorted((offsets[k], tokens[k]) for k in np.flatnonzero(r.proposal.extra_mask[e]))
            assert [o for o, _ in seen] == list(range(1, offsets[e] + 1))
            plain = to_numpy(model.forward(np.asarray([r.seq + [t for _, t in seen]])))[0, -1]
            np.testing.assert_allclose(r.extra_logits[e], plain, rtol=1e-4, atol=1e-4)
    assert len(rec.rounds) > 3  # past the window's filling rounds


def test_lookahead_window_mask_is_the_papers():
    """N = 4, W = 3 with full levels: the chain r a0 a1, then levels b and c. b_j sees the chain up to
    column j and itself; c_j also sees b_j; nothing sees another column's b or c."""
    a, b, c = [10, 11], [20, 21, 22], [30, 31, 32]
    tokens, offsets, mask = window_inputs([a, b, c])
    assert tokens == [*a, *b, *c]
    assert offsets == [1, 2, 1, 2, 3, 2, 3, 4]  # a_i at 1 + i, b_j at 1 + j, c_j at 2 + j
    expected = np.array([
        # a0 a1 b0 b1 b2 c0 c1 c2
        [1, 0, 0, 0, 0, 0, 0, 0],  # a0
        [1, 1, 0, 0, 0, 0, 0, 0],  # a1
        [0, 0, 1, 0, 0, 0, 0, 0],  # b0 (and the root)
        [1, 0, 0, 1, 0, 0, 0, 0],  # b1
        [1, 1, 0, 0, 1, 0, 0, 0],  # b2
        [0, 0, 1, 0, 0, 1, 0, 0],  # c0
        [1, 0, 0, 1, 0, 0, 1, 0],  # c1
        [1, 1, 0, 0, 1, 0, 0, 1],  # c2
    ], dtype=bool)
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.uses_exercise("9.1")
def test_lookahead_branches_do_not_see_each_other():
    """In the round's one forward the verification tree sees the pending tokens and its ancestors only,
    never the window; the window sees the pending tokens and the root, never the tree's other nodes."""
    tokens, offsets, window = window_inputs([[10, 11], [20, 21, 22], [30, 31, 32]])
    tree = TokenTree.from_paths(9, [[1, 2, 3], [1, 4, 5], [6, 7, 8]])
    pending = [40, 41, 9]
    _, _, mask = round_inputs(pending, Proposal(tree, tuple(tokens), tuple(offsets), window))
    n0, n_tree = len(pending) - 1, tree.size
    tree_rows, window_rows = slice(n0, n0 + n_tree), slice(n0 + n_tree, None)
    assert not mask[tree_rows, window_rows].any()
    assert mask[window_rows, :n0].all() and mask[window_rows, n0].all()  # pending and the root
    assert not mask[window_rows, n0 + 1 : n0 + n_tree].any()
    np.testing.assert_array_equal(mask[window_rows, window_rows], window)


def test_ngram_pool_is_keyed_by_first_token():
    """The pool's worked example: continuations filed under the first token, newest first, at most
    capacity per key, a repeat refreshed instead of duplicated."""
    pool = NGramPool(2)
    for gram in [(1, 2, 3), (1, 4, 5), (2, 3, 4), (1, 2, 3), (1, 6, 7)]:
        pool.add(gram)
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    assert pool.candidates(2) == [(3, 4)]
    assert pool.candidates(3) == []
    assert len(pool) == 3


def test_lookahead_files_each_column_under_its_first_token():
    """Once the window is full, a round files one N-gram per column: column 0's under the root, the
    others under the chain token of their column, each continued by the column's levels and the argmax."""
    la = Lookahead(N=4, W=3, G=5)
    la.levels, la.context = [[10, 11], [20, 21, 22], [30, 31, 32]], [1, 2, 9]
    levels = la.next_levels(9, [40, 41, 42])
    assert la.pool.candidates(9) == [(20, 30, 40)]
    assert la.pool.candidates(10) == [(21, 31, 41)]
    assert la.pool.candidates(11) == [(22, 32, 42)]
    assert levels == [[21, 22], [30, 31, 32], [40, 41, 42]]


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2")
def test_lookahead_pool_from_prompt_holds_every_ngram_of_the_text():
    """pool_from_prompt: every N-gram of the prompt and of the output is filed (a pool big enough to
    forget nothing), besides the window's."""
    model, prompt, N = varied_model(), [3, 1, 4, 1, 5, 9, 2, 6], 3
    la = Lookahead(N=N, W=2, G=1000, pool_from_prompt=True)
    text = prompt + tree_generate(model, prompt, 20, la).tokens
    for i in range(len(text) - N + 1):
        assert tuple(text[i + 1 : i + N]) in la.pool.candidates(text[i])


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2")
def test_lookahead_window_fills_its_levels_first():
    """The window starts as one chain of W + N - 3 guesses and gains a level per round, every level one
    column shorter each time, until it holds W - 1 chain tokens and N - 2 levels of W."""
    model = varied_model()
    la = Lookahead(N=5, W=4, G=3)
    rec = Recorder(la)
    tree_generate(model, [1, 2, 3], 8, rec)
    assert [r.level_sizes for r in rec.rounds[:5]] == [[6], [5, 6], [4, 5, 5], [3, 4, 4, 4], [3, 4, 4, 4]]


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "9.1", "9.2")
def test_lookahead_on_the_char_target():
    """The shipped character model: greedy Lookahead is its greedy decoding, and the pool's n-grams
    are accepted often enough to emit more than one token per target call."""
    model, tok = load_model("target")
    prompt = tok.encode("ROMEO:\nI will")
    out = tree_generate(model, prompt, 40, Lookahead())
    assert out.tokens == generate(model, prompt, 40, temperature=0).tokens
    assert out.stats.accepted > 0 and out.stats.tokens_per_call > 1


@pytest.mark.parametrize("kwargs, name", [({"N": 2}, "N"), ({"W": 0}, "W"), ({"G": 0}, "G"),
                                          ({"N": 5.0}, "N"), ({"W": True}, "W")])
def test_lookahead_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        Lookahead(**kwargs)
