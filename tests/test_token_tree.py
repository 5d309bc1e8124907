"""Token trees (minillm.token_tree), the masked forward that verifies them (kv_cache.MaskedView) and the
draft-free proposers of minillm.draft_free: the tree mask, one forward scoring every branch as if fed
alone, the accepted path's K/V compacted into place (contiguous and paged), greedy acceptance equal to
plain decoding, lossless sampling over a tree (chi-square), prompt lookup and layer skipping."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stats import P_MIN, chi2_pvalue

from minillm import GPT, GPTConfig, generate, token_tree
from minillm.backend import to_numpy
from minillm.config import LlamaConfig
from minillm.draft_free import LayerSkip, PromptLookup, long_ngram_lookup, ngram_lookup
from minillm.kv_cache import KVCache, MaskedView
from minillm.llama import Llama
from minillm.paged_kv import PagedKVCache
from minillm.sampling import SamplingSettings, logits_to_probs
from minillm.speculative import verify_greedy
from minillm.token_tree import (
    NodeProbs,
    NoProposal,
    Proposal,
    TokenTree,
    judge_tree,
    tree_generate,
    verify_tree,
    verify_tree_greedy,
    verify_tree_typical,
)

# the Llama runs exercises 8.1-8.3 (RoPE, RMSNorm, GQA); a paged sequence runs 6.1 and 6.3 (gather, truncate)
MODEL_KINDS = ["gpt", pytest.param("llama", marks=pytest.mark.uses_exercise("8.1", "8.2", "8.3"))]
CACHE_KINDS = ["contiguous", pytest.param("paged", marks=pytest.mark.uses_exercise("6.1", "6.3"))]
CFG = GPTConfig(vocab_size=11, block_size=48, n_layer=2, n_head=2, n_embd=16)
LLAMA = LlamaConfig(vocab_size=11, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_hidden=24)
PROMPTS = [[1, 2, 3], [4, 4, 4, 4, 5, 6, 4, 4], [7, 1, 7, 1, 7, 2, 9, 0, 3]]


@pytest.fixture(scope="module")
def gpt():
    return GPT.init(CFG, seed=3)


def model_of(kind):
    return GPT.init(CFG, seed=3) if kind == "gpt" else Llama.init(LLAMA, seed=3)


@st.composite
def trees(draw, max_nodes=12, vocab=5):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    return TokenTree(tokens, parents)


# ----------------------------------------------------------------------------------------------
# the tree and its mask


@pytest.mark.exercise("9.1")
def test_tree_mask_worked_example():
    tree = TokenTree.from_paths(0, [[1, 2], [1, 3], [4]])  # 0 -> 1 -> {2, 3}; 0 -> 4
    assert tree.parents == (-1, 0, 1, 1, 0)
    assert tree.depths.tolist() == [0, 1, 2, 2, 1]
    assert tree.mask().astype(int).tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # 2 sees its parent 1 and the root, not its sibling 3
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],  # 4 sees the root only: not the other branch
    ]


@pytest.mark.exercise("9.1")
@settings(max_examples=60, deadline=None)
@given(trees())
def test_tree_mask_is_ancestor_or_self(tree):
    mask = tree.mask()
    for i in range(tree.size):
        assert set(np.flatnonzero(mask[i])) == set(tree.path(i)), i
        for j in range(tree.size):  # siblings (same parent, same position) never see each other
            if i != j and tree.parents[i] == tree.parents[j]:
                assert not mask[i, j]
    assert (mask.sum(axis=1) == tree.depths + 1).all()  # a node sees exactly depth + 1 nodes


@pytest.mark.exercise("9.1")
def test_chain_tree_mask_is_causal():
    assert (TokenTree.chain(5, [1, 2, 3]).mask() == np.tri(4, dtype=bool)).all()


def test_a_chain_is_a_tree_of_one_path():
    assert TokenTree.chain(5, [1, 2, 3]).is_chain and TokenTree((5,), (-1,)).is_chain
    assert TokenTree.from_paths(5, [[1, 2], [1, 2, 3]]).is_chain  # one path after merging
    assert not TokenTree.from_paths(5, [[1, 2], [1, 3]]).is_chain
    assert not TokenTree((5, 1, 2), (-1, 0, 0)).is_chain


@settings(max_examples=40, deadline=None)
@given(trees(), st.integers(1, 12), st.integers(0, 5))
def test_pruned_is_a_tree_with_its_paths(tree, max_nodes, max_depth):
    small = tree.pruned(max_nodes, max_depth)
    assert small.size <= max(1, max_nodes) and small.depth <= max_depth
    full_paths = {tuple(tree.tokens[n] for n in tree.path(i)) for i in range(tree.size)}
    assert {tuple(small.tokens[n] for n in small.path(i)) for i in range(small.size)} <= full_paths


@pytest.mark.parametrize("tokens, parents", [((), ()), ((1, 2), (-1,)), ((1, 2), (0, 0)), ((1, 2, 3), (-1, 0, 2)),
                                             ((1, -2), (-1, 0))])
def test_tree_bad_input(tokens, parents):
    with pytest.raises(ValueError, match="tree"):
        TokenTree(tokens, parents)


# ----------------------------------------------------------------------------------------------
# one masked forward scores every branch as if it had been fed alone


def prefill(model, prompt, cache):
    cache.reset()
    model.forward(np.array([prompt]), cache)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("attention", ["naive", "flash"])
def test_one_forward_scores_each_path_as_if_alone(kind, attention):
    model = model_of(kind)
    model.set_attention(attention)
    prompt = [3, 1, 4, 1, 5]
    tree = TokenTree.from_paths(9, [[2, 6], [2, 5, 3], [7], [8, 2]])
    cache = KVCache(model.config)
    prefill(model, prompt, cache)
    view = MaskedView(cache, tree.depths, tree.mask())
    logits = to_numpy(model.forward(np.array([tree.tokens]), view)[0])  # (n, V)
    for i in range(tree.size):
        alone = model.forward(np.array([prompt + [tree.tokens[n] for n in tree.path(i)]]))[0, -1]
        np.testing.assert_allclose(logits[i], to_numpy(alone), rtol=1e-4, atol=1e-5)


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
def test_positions_are_depths_not_node_indices(gpt):
    """Siblings sit at the same position: feeding node i at prefix + i would change its logits."""
    tree = TokenTree.from_paths(9, [[2], [7], [8]])
    cache = KVCache(CFG)
    prefill(gpt, [3, 1], cache)
    view = MaskedView(cache, tree.depths, tree.mask())
    assert to_numpy(view.positions(4)).tolist() == [2, 3, 3, 3]


@pytest.mark.exercise("9.1")
def test_cuda_attention_refuses_a_tree_mask(gpt):
    model = GPT(CFG, gpt.numpy_params(), attention="cuda")
    with pytest.raises(ValueError, match="mask"):
        tree_generate(model, [1, 2], 3, PromptLookup())


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
def test_masked_view_bad_input(gpt):
    cache = KVCache(CFG)
    with pytest.raises(ValueError, match="mask"):
        MaskedView(cache, [0, 1], np.ones((3, 3), dtype=bool))
    with pytest.raises(ValueError, match="see itself"):
        MaskedView(cache, [0, 1], np.zeros((2, 2), dtype=bool))
    tree = TokenTree.from_paths(1, [[2], [3]])
    view = MaskedView(cache, tree.depths, tree.mask())
    gpt.forward(np.array([tree.tokens]), view)
    with pytest.raises(ValueError, match="consecutive"):
        view.keep([0, 1, 2])  # two siblings are not a path
    eye = np.eye(2, dtype=bool)
    with pytest.raises(ValueError, match=r"seen must be bool \(T=2, P <= 3 cached\)"):
        MaskedView(cache, [0, 1], eye, seen=np.ones((2, 4), dtype=bool))  # more earlier levels than cached
    with pytest.raises(ValueError, match="seen must be bool"):
        MaskedView(cache, [0, 1], eye, seen=np.ones((2, 1)))
    with pytest.raises(ValueError, match="keeps them all"):
        MaskedView(cache, [0, 1], eye, seen=np.ones((2, 1), dtype=bool)).keep([0])


# ----------------------------------------------------------------------------------------------
# compaction: the accepted path's K/V in place, the rest rolled back


CACHES = {
    "contiguous": lambda cfg: KVCache(cfg),
    "paged": lambda cfg: PagedKVCache(cfg, 32, 4).sequence(),
}


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_compaction_equals_a_recompute(kind, cache_kind):
    """Keep a path that is not a prefix of the node list: the cache must hold exactly what feeding
    the prompt and that path would have stored, and continue to the same logits."""
    model = model_of(kind)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    tree = TokenTree.from_paths(6, [[2, 6], [5, 3, 5], [8]])  # nodes: 6 | 2 6 | 5 3 5 | 8
    path = tree.path(5)  # root, 5, 3, 5: nodes 0, 3, 4, 5
    assert path == [0, 3, 4, 5]
    cache = CACHES[cache_kind](model.config)
    prefill(model, prompt, cache)
    view = MaskedView(cache, tree.depths, tree.mask())
    model.forward(np.array([tree.tokens]), view)
    view.keep(path)
    assert cache.length == len(prompt) + len(path)
    kept = [tree.tokens[n] for n in path]
    after = to_numpy(model.forward(np.array([[0, 7]]), cache)[0])
    reference = KVCache(model.config)
    prefill(model, prompt + kept, reference)
    expected = to_numpy(model.forward(np.array([[0, 7]]), reference)[0])
    np.testing.assert_allclose(after, expected, rtol=1e-4, atol=1e-5)
    if cache_kind == "contiguous":
        n = reference.length - 2
        for layer in range(model.config.n_layer):
            for mine, ref in ((cache.k[layer], reference.k[layer]), (cache.v[layer], reference.v[layer])):
                np.testing.assert_allclose(to_numpy(mine[:, :, :n]), to_numpy(ref[:, :, :n]), rtol=1e-5, atol=1e-6)


class TwoBranches(NoProposal):
    """A root with two children: a tree that is not a chain."""

    max_depth = 1

    def propose(self, state):
        return Proposal(TokenTree.from_paths(state.seq[-1], [[1], [2]]))


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("cache_kind", CACHE_KINDS)
def test_a_chain_is_verified_by_the_caches_own_forward(kind, cache_kind, monkeypatch):
    """A chain (prompt lookup's rounds, a plain step) needs no ``MaskedView``: its mask is the causal one and its
    accepted path is its first nodes, so a round runs the cache's own forward and truncates past the path. The
    same rounds forced through a view give the same tokens and leave the same cache; a branching tree still
    takes a view."""
    model = model_of(kind)
    views = []

    class Counted(MaskedView):
        def __init__(self, *args, **kwargs):
            views.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(token_tree, "MaskedView", Counted)
    prompt = [1, 5, 2, 8, 3, 1, 5, 2]  # lookup drafts, some rejected
    caches = [CACHES[cache_kind](model.config) for _ in range(2)]
    fast = tree_generate(model, prompt, 20, PromptLookup(), cache=caches[0])
    assert not views and fast.stats.verified_per_call > 0
    with monkeypatch.context() as m:
        m.setattr(TokenTree, "is_chain", property(lambda self: False))
        masked = tree_generate(model, prompt, 20, PromptLookup(), cache=caches[1])
    assert len(views) == masked.stats.target_calls and fast.tokens == masked.tokens
    after = [to_numpy(model.forward(np.array([[0, 7]]), cache)[0]) for cache in caches]
    np.testing.assert_allclose(after[0], after[1], rtol=1e-4, atol=1e-5)  # the same cache, read back
    assert caches[0].length == caches[1].length
    tree_generate(model, prompt, 4, TwoBranches(), cache=CACHES[cache_kind](model.config))
    assert len(views) > masked.stats.target_calls


# ----------------------------------------------------------------------------------------------
# acceptance


@pytest.mark.exercise("9.2")
@pytest.mark.uses_exercise("5.3")
def test_greedy_walk_on_a_chain_is_verify_greedy(rng):
    for _ in range(50):
        k = int(rng.integers(0, 5))
        drafts = rng.integers(0, 4, size=k).tolist()
        logits = rng.normal(size=(k + 1, 4))
        emitted, path = verify_tree_greedy(TokenTree.chain(1, drafts), logits)
        assert (emitted, len(path) - 1) == verify_greedy(drafts, logits)


@pytest.mark.exercise("9.2")
def test_greedy_walk_follows_the_argmax_branch():
    tree = TokenTree.from_paths(0, [[1, 2], [3, 4], [3, 1]])  # nodes 0 | 1 2 | 3 4 | 1 (under 3)
    V = 6
    logits = np.zeros((tree.size, V))
    logits[0, 3] = logits[3, 1] = logits[5, 5] = 1.0  # root -> 3, then 3 -> 1, then after (3, 1): 5
    logits[1, 2] = logits[4, 0] = 1.0  # the other branches would continue differently
    assert verify_tree_greedy(tree, logits) == ([3, 1, 5], [0, 3, 5])


@pytest.mark.exercise("9.2")
@settings(max_examples=40, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1))
def test_greedy_walk_emits_a_tree_path_plus_the_argmax(tree, seed):
    logits = np.random.default_rng(seed).normal(size=(tree.size, 5))
    emitted, path = verify_tree_greedy(tree, logits)
    assert path == tree.path(path[-1])  # a root-to-node path of the tree
    assert emitted == [tree.tokens[n] for n in path[1:]] + [int(logits[path[-1]].argmax())]
    for parent, child in zip(path, path[1:]):  # every step is the argmax
        assert tree.tokens[child] == logits[parent].argmax()


def tree_target(V, rng):
    """p(. | prefix) for prefixes of up to two tokens after the root: a fixed random table."""
    table = {(): rng.dirichlet(np.ones(V))}
    for a in range(V):
        table[(a,)] = rng.dirichlet(np.ones(V) * 0.5)
        for b in range(V):
            table[(a, b)] = rng.dirichlet(np.ones(V))
    return table


def two_tokens_from_tree(verify_fn, table, V, q, rng, draws=2):
    """One round over a depth-2 tree whose children were drawn from q (i.i.d., SpecInfer), then the
    next round's token when the round emitted only one -> the first two tokens, as a cell a * V + b.

    Equal draws stay separate sibling nodes: each draw's rejection updates the residual.
    """
    tokens, parents = [0], [-1]
    for _ in range(draws):
        tokens.append(int(rng.choice(V, p=q)))
        parents.append(0)
        first = len(tokens) - 1
        for _ in range(draws):
            tokens.append(int(rng.choice(V, p=q)))
            parents.append(first)
    tree = TokenTree(tokens, parents)
    probs = np.array([table[tuple(tree.tokens[n] for n in tree.path(i)[1:])] for i in range(tree.size)])
    emitted, _ = verify_fn(tree, probs, rng, {i: q for i in range(1, tree.size)})
    if len(emitted) == 1:
        emitted.append(int(rng.choice(V, p=table[(emitted[0],)])))
    return emitted[0] * V + emitted[1]


def residual_forgotten(tree, target_probs, rng, draft_probs):
    """The classic mistake: after a rejected child, try the next one against the unchanged p."""
    node, emitted = 0, []
    while True:
        p = target_probs[node]
        for child in tree.children(node):
            x = tree.tokens[child]
            if rng.random() < min(1.0, p[x] / draft_probs[child][x]):
                emitted.append(x)
                node = child
                break
        else:
            emitted.append(int(rng.choice(len(p), p=p)))
            return emitted, None


# verify_tree works on host probabilities: the statistical checks run no device code (host_only)
@pytest.mark.uses_exercise("5.1")
@pytest.mark.host_only
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tree_sampling_is_lossless_and_catches_a_forgotten_residual(temperature):
    """The first two emitted tokens are distributed as the target's (chi-square over V^2 cells); the
    same harness rejects the version that skips the residual update after a rejection."""
    V, n = 4, 5_000
    rng = np.random.default_rng(7)
    table = {key: logits_to_probs(np.log(p) / temperature) for key, p in tree_target(V, rng).items()}
    q = rng.dirichlet(np.ones(V))
    joint = np.concatenate([table[()][a] * table[(a,)] for a in range(V)])
    good = [two_tokens_from_tree(verify_tree, table, V, q, rng) for _ in range(n)]
    assert chi2_pvalue(good, joint) >= P_MIN
    bad = [two_tokens_from_tree(residual_forgotten, table, V, q, rng) for _ in range(n)]
    assert chi2_pvalue(bad, joint) < P_MIN


@pytest.mark.uses_exercise("5.1")
@pytest.mark.host_only
def test_deterministic_candidates_are_lossless(rng):
    """Candidates without a draft distribution (prompt lookup, Medusa's top-k) count as one-hot q."""
    V, n = 5, 20_000
    p = rng.dirichlet(np.ones(V))
    tree = TokenTree.from_paths(0, [[int(np.argsort(p)[-1])], [int(np.argsort(p)[-2])], [0]])
    probs = np.tile(p, (tree.size, 1))
    first = [verify_tree(tree, probs, rng)[0][0] for _ in range(n)]
    assert chi2_pvalue(first, p) >= P_MIN


@pytest.mark.host_only
@pytest.mark.parametrize("rule", [pytest.param("exact", marks=pytest.mark.uses_exercise("5.1")), "typical"])
def test_judging_softmaxes_only_the_rows_its_walk_reaches(rng, rule):
    """A chain of 4 whose first token the target never writes stops at the root: one row of 5 softmaxed; a chain
    the target writes with certainty reads all 5. Either way the emitted tokens are those of the whole (n, V)
    array under the same draws."""
    V = 50
    logits = rng.standard_normal((5, V)).astype(np.float32)
    logits[0, 7] = logits[1, 8] = logits[2, 9] = logits[3, 10] = 40.0  # the target writes 7 8 9 10 ...
    settings = SamplingSettings(1.0)
    verify = {"exact": verify_tree, "typical": verify_tree_typical}[rule]
    for chain, reached in (((3, 8, 9, 10), 1), ((7, 8, 9, 10), 5)):
        tree = TokenTree((1, *chain), (-1, 0, 1, 2, 3))
        probs = NodeProbs(tree, logits, settings)
        lazy = verify(tree, probs, np.random.default_rng(5))
        assert probs.computed == reached
        assert lazy == verify(tree, settings.probs(logits), np.random.default_rng(5))
        assert lazy == judge_tree(tree, logits, settings, np.random.default_rng(5), rule)


def test_typical_acceptance_prefers_likely_candidates(rng):
    """Typical acceptance takes a plausible candidate with probability 1 instead of p(x)."""
    p = np.array([0.5, 0.3, 0.2])
    tree = TokenTree.from_paths(0, [[0]])
    probs = np.tile(p, (2, 1))
    first = [verify_tree_typical(tree, probs, rng)[0][0] for _ in range(2000)]
    assert first.count(0) == 2000  # p(0) = 0.5 > min(0.09, 0.3 exp(-H)): always accepted


# ----------------------------------------------------------------------------------------------
# the decoding loop: greedy output is plain decoding's, for every proposer, near the limit too


def proposers(model):
    return {"none": NoProposal(), "lookup": PromptLookup(), "skip1": LayerSkip(model, 1, 3),
            "skip_all": LayerSkip(model, model.config.n_layer, 4)}


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
@pytest.mark.parametrize("kind", MODEL_KINDS)
@pytest.mark.parametrize("max_len", [None, 12])
def test_loop_greedy_equals_generate(kind, max_len):
    model = model_of(kind)
    for prompt in PROMPTS:
        ref = generate(model, prompt, 30, temperature=0, cache=KVCache(model.config, max_len=max_len))
        for name, proposer in proposers(model).items():
            out = tree_generate(model, prompt, 30, proposer, cache=KVCache(model.config, max_len=max_len))
            assert out.tokens == ref.tokens, (name, prompt)
            assert out.stats.reprefills == ref.stats.reprefills, name


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
def test_loop_counts_the_prompt_tokens_it_drops(gpt):
    """A 40-token prompt in a 12-token cache keeps its last 6, as in generate: the stats count the 34
    dropped (the command line's --speculate reports them from there); a prompt that fits drops none."""
    prompt = [int(t) % CFG.vocab_size for t in range(7, 47)]
    out = tree_generate(gpt, prompt, 5, PromptLookup(), cache=KVCache(CFG, max_len=12))
    assert out.stats.dropped_prompt_tokens == 34
    assert tree_generate(gpt, prompt[:10], 5, PromptLookup()).stats.dropped_prompt_tokens == 0


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "6.1", "6.3", "9.1", "9.2", "9.3")
def test_loop_greedy_on_a_paged_cache(gpt):
    paged = PagedKVCache(CFG, 64, 4)
    ref = generate(gpt, PROMPTS[1], 25, temperature=0)
    out = tree_generate(gpt, PROMPTS[1], 25, PromptLookup(), cache=paged.sequence())
    assert out.tokens == ref.tokens


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
def test_loop_layer_skip_with_all_layers_accepts_everything(gpt):
    """A draft that IS the target (all layers) is always right: every round emits k + 1 tokens."""
    out = tree_generate(gpt, PROMPTS[0], 20, LayerSkip(gpt, CFG.n_layer, 4))
    assert out.stats.alpha == 1.0 and out.stats.target_calls == 4


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3", "9.3")
def test_loop_prompt_lookup_on_a_copy_task_needs_few_calls():
    """A model that continues a repeated pattern: prompt lookup proposes the pattern, so a round
    emits many tokens; plain decoding needs one call per token."""
    model = GPT.init(CFG, seed=3)
    pattern = [1, 5, 2, 8, 3]
    ref = generate(model, pattern * 3, 20, temperature=0).tokens
    out = tree_generate(model, pattern * 3, 20, PromptLookup())
    assert out.tokens == ref
    assert out.stats.target_calls <= 20  # never worse than plain decoding in calls
    assert out.stats.verified_per_call > 0


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
def test_loop_sampling_uses_the_target_distribution_first_token(gpt):
    """At T = 1 the first emitted token of many seeded runs follows the target's distribution."""
    prompt = [1, 5, 2, 1, 5]
    p = logits_to_probs(to_numpy(gpt.forward(np.array([prompt]))[0, -1]))
    first = [tree_generate(gpt, prompt, 1, PromptLookup(), temperature=1.0, seed=s).tokens[0] for s in range(2000)]
    assert chi2_pvalue(first, p) >= P_MIN


@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "9.1", "9.2", "9.3")
def test_loop_bad_input(gpt):
    with pytest.raises(ValueError, match="rule"):
        tree_generate(gpt, [1, 2], 3, PromptLookup(), rule="greedy")

    class WrongRoot(NoProposal):
        def propose(self, state):
            return Proposal(TokenTree((state.seq[-1] + 1,), (-1,)))

    with pytest.raises(ValueError, match="rooted"):
        tree_generate(gpt, [1, 2], 3, WrongRoot())
    with pytest.raises(ValueError, match="layers"):
        LayerSkip(gpt, 3)
    with pytest.raises(ValueError, match="k"):
        LayerSkip(gpt, 1, k=0)


# ----------------------------------------------------------------------------------------------
# prompt lookup


@pytest.mark.exercise("9.3")
def test_ngram_worked_example():
    assert ngram_lookup(list("abcdab")) == list("cdab")
    assert ngram_lookup(list("abcdab"), max_draft=2) == list("cd")


@pytest.mark.exercise("9.3")
def test_ngram_prefers_the_longest_then_the_latest_match():
    #          0 1 2 3 4 5 6 7 8 9
    seq = list("xbcQabcRbc")  # suffix "bc" (2-gram) occurs at 1 and 5 -> latest (5) -> "R b c"
    assert ngram_lookup(seq, max_ngram=2) == list("Rbc")
    seq = list("abcQxbcRabc")  # 3-gram "abc" at 0 beats the later 2-gram "bc" at 5
    assert ngram_lookup(seq) == list("QxbcRabc")


@pytest.mark.exercise("9.3")
def test_ngram_never_matches_itself():
    assert ngram_lookup(list("abcd")) == []  # no suffix n-gram occurred before
    assert ngram_lookup([7]) == []
    assert ngram_lookup(list("aa")) == ["a"]  # "a" occurred at 0, followed by "a"


def lookup_from(seq, min_ngram, max_ngram):
    """The reference: try n = max_ngram .. min_ngram, the latest earlier start of the suffix n-gram, what followed."""
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i : i + n] == seq[-n:]:
                return seq[i + n :]
    return []


@pytest.mark.uses_exercise("9.3")
@pytest.mark.parametrize("min_ngram, max_ngram", [(1, 3), (2, 3), (3, 3), (2, 4)])
def test_long_ngram_lookup_matches_only_suffixes_of_min_ngram_tokens_or_more(min_ngram, max_ngram):
    """On random texts over 2 or 3 symbols: the reference search limited to n >= min_ngram, up to 4 tokens. Fails for a
    window's first token taken as the new one, a match of min_ngram - 1 tokens let through, or the windows' n-grams
    counted as tokens (max_ngram windows: a suffix of max_ngram + min_ngram - 1 tokens)."""
    rng = np.random.default_rng(min_ngram * 10 + max_ngram)
    hits = 0
    for _ in range(400):
        seq = [int(t) for t in rng.integers(0, rng.integers(2, 4), rng.integers(1, 30))]
        out = long_ngram_lookup(seq, min_ngram, max_ngram, max_draft=4)
        assert out == lookup_from(seq, min_ngram, max_ngram)[:4], seq
        hits += bool(out)
    assert hits > 40  # the texts do repeat themselves


@pytest.mark.uses_exercise("9.3")
def test_long_ngram_lookup_worked_example():
    assert long_ngram_lookup(list("abcaxc"), 2) == []  # only the 1-gram "c" occurred before
    assert ngram_lookup(list("abcaxc")) == list("axc")
    assert long_ngram_lookup(list("abcdab"), 2) == list("cdab")
    with pytest.raises(ValueError, match="min_ngram"):
        long_ngram_lookup([1, 2], 0)
    with pytest.raises(ValueError, match="min_ngram"):
        long_ngram_lookup([1, 2], 4, max_ngram=3)


@pytest.mark.uses_exercise("9.3")
def test_prompt_lookup_from_min_ngram_tokens_drafts_only_after_such_a_suffix():
    """``PromptLookup(min_ngram=2)`` proposes nothing where only the last token occurred before, and lookup's chain
    where the last two did; the default (1) drafts after a lone token too."""
    def drafted(proposer, text):
        tree = proposer.propose(SimpleNamespace(seq=[ord(c) for c in text], room=10)).tree
        return "".join(chr(t) for t in tree.tokens[1:])

    assert drafted(PromptLookup(min_ngram=2), "abcaxc") == ""
    assert drafted(PromptLookup(), "abcaxc") == "axc"
    assert drafted(PromptLookup(min_ngram=2), "abcdab") == "cdab"
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(min_ngram=4)


def test_ngram_bad_input():
    with pytest.raises(ValueError, match="max_ngram"):
        ngram_lookup([1, 2], max_ngram=0)
    with pytest.raises(ValueError, match="max_draft"):
        PromptLookup(max_draft=0)


@pytest.mark.uses_exercise("9.3")
def test_prompt_lookup_proposes_the_continuation():
    from minillm.token_tree import Round

    proposal = PromptLookup().propose(Round([1, 2, 3, 9, 1, 2], 1, None, None, room=2))
    assert proposal.tree == TokenTree.chain(2, [3, 9])
