"""Token trees: verify many candidate continuations in ONE target forward, keep the longest that holds.

Chapter 5's draft proposes one chain x_0..x_{K-1}; a rejection at x_0 wastes the whole chain. A
tree proposes several continuations that share prefixes (SpecInfer, Miao et al. 2024; Medusa, Cai
et al. 2024), flattened into a list of nodes:

    tokens  [t, a, b, c, d]      node 0 is the root: the last emitted token, not yet in the cache
    parents [-1, 0, 0, 1, 1]     a and b continue t; c and d continue t a

Node i sits at position prefix + depth(i) (siblings share a position) and may attend to the cached
prefix and its own ancestors only: the *tree attention mask*. One forward over the nodes
(``minillm.kv_cache.MaskedView``) then gives, for every node, the target's distribution of the token
after the path root..node, exactly as if that path alone had been fed.

Acceptance walks down from the root:

- ``verify_tree_greedy``: follow the child that is the target's argmax; the output is the target's
  own greedy continuation (a chain tree is chapter 5's ``verify_greedy``).
- ``verify_tree``: multi-candidate speculative sampling (SpecInfer, "multi-step speculative
  sampling"): try the children in order, accept child x with probability min(1, p(x) / q(x)), and
  after each rejection replace p by the residual norm(max(0, p - q)); when no child is accepted,
  sample from what is left. Lossless: every emitted token is distributed as the target's.
- ``verify_tree_typical``: Medusa's *typical acceptance* (accept x while p(x) > min(eps,
  delta exp(-H(p)))): more tokens per call, but NOT the target's distribution.

``tree_generate`` is the decoding loop for any proposer that builds a tree without a draft model
(``minillm.draft_free``: prompt lookup, layer skipping; Medusa heads; Lookahead's n-gram pool).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from .backend import synchronize, to_numpy, xp
from .generate import GenerationResult, call_cache_len, check_prompt, fit_context
from .kv_cache import KVCache, MaskedView
from .model import CAUSAL_ONLY
from .sampling import SamplingSettings, sample
from .speculative import SpecStats, residual_distribution

TYPICAL_EPS = 0.09  # Medusa's posterior_threshold
TYPICAL_DELTA = 0.3  # Medusa's posterior_alpha (the entropy-scaled threshold's factor)


@dataclass(frozen=True)
class TokenTree:
    """A tree of candidate tokens, flattened: ``parents[i] < i``, node 0 the root (``parents[0] == -1``).

    Because every parent comes before its children, any prefix of the node list is a tree too.
    """

    tokens: tuple
    parents: tuple

    def __post_init__(self):
        tokens, parents = tuple(int(t) for t in self.tokens), tuple(int(p) for p in self.parents)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        if not tokens or len(tokens) != len(parents):
            raise ValueError(f"a token tree needs >= 1 node and one parent per token, got {len(tokens)} "
                             f"tokens and {len(parents)} parents")
        if parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise ValueError(f"tree parents must be -1 for the root and in 0..i-1 for node i, got {parents}")
        if min(tokens) < 0:
            raise ValueError(f"tree tokens must be >= 0, got {tokens}")

    @classmethod
    def chain(cls, root: int, tokens) -> TokenTree:
        """root -> tokens[0] -> tokens[1] -> ...: chapter 5's draft as a tree."""
        tokens = [int(t) for t in tokens]
        return cls((root, *tokens), tuple(range(-1, len(tokens))))

    @classmethod
    def from_paths(cls, root: int, paths) -> TokenTree:
        """The trie of candidate continuations (each a token list after root); shared prefixes merge.

        Nodes appear in order of first appearance, so earlier paths' children are tried first.
        Example: root 0, paths [[1, 2], [1, 3], [4]] -> tokens (0, 1, 2, 3, 4), parents (-1, 0, 1, 1, 0).
        """
        tokens, parents, index = [int(root)], [-1], {}
        for path in paths:
            node = 0
            for t in path:
                key = (node, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                node = index[key]
        return cls(tuple(tokens), tuple(parents))

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Every node's parent is the node before it: one path, which attends as causally as a prompt."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def depths(self) -> np.ndarray:
        """(n,) depth of each node: 0 for the root, parent's + 1 for the others."""
        depths = np.zeros(self.size, dtype=np.int64)
        for i in range(1, self.size):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    @property
    def depth(self) -> int:
        """The longest root-to-leaf path in edges (a chain of K drafts: K)."""
        return int(self.depths.max())

    def children(self, i: int) -> list[int]:
        """Node i's children, in the order they are tried."""
        return [j for j in range(i + 1, self.size) if self.parents[j] == i]

    def path(self, i: int) -> list[int]:
        """The nodes from the root down to node i."""
        nodes = [i]
        while self.parents[nodes[-1]] != -1:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]

    def mask(self) -> np.ndarray:
        """(n, n) bool tree attention mask: mask[i, j] is True when node j is node i or an ancestor of i.

        Example: parents (-1, 0, 0) -> [[1, 0, 0], [1, 1, 0], [1, 0, 1]]: the siblings 1 and 2 sit at
        the same position and must not see each other.
        """
        # EXERCISE 9.1 BEGIN: True where j lies on the path from the root to i (i itself included)
        n = self.size
        mask = np.eye(n, dtype=bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]  # a node sees what its parent sees, and itself
        return mask
        # EXERCISE 9.1 END

    def pruned(self, max_nodes: int, max_depth: int) -> TokenTree:
        """The first max_nodes nodes with depth <= max_depth (a tree again: parents stay kept)."""
        depths = self.depths
        keep = [i for i in range(min(self.size, max(1, max_nodes))) if depths[i] <= max_depth]
        new_index = {old: new for new, old in enumerate(keep)}
        return TokenTree(tuple(self.tokens[i] for i in keep),
                         tuple(-1 if i == 0 else new_index[self.parents[i]] for i in keep))


# ----------------------------------------------------------------------------------------------
# acceptance rules: which path of the tree the target keeps, and the token it adds


def check_tree_rows(tree: TokenTree, rows, name: str):
    rows = to_numpy(rows)
    if rows.ndim != 2 or rows.shape[0] != tree.size:
        raise ValueError(f"{name} must be (nodes, V) = ({tree.size}, V), got {rows.shape}")
    if max(tree.tokens) >= rows.shape[1]:
        raise ValueError(f"tree token {max(tree.tokens)} is outside the vocabulary of {rows.shape[1]}")
    return rows


class NodeProbs:
    """The target's probabilities p at a tree's nodes, each row computed from its logits (``settings.probs``) when
    the acceptance walk first asks for it.  ``probs[node]`` -> (V,) float64; ``computed``: the rows made so far.

    A walk reads the rows of its path only (depth + 1 at most; one when the first child is rejected), so a
    chain of 5 verified nodes usually needs 1 or 2 of its 5 softmaxes over the vocabulary. All 5 at once
    took 2.5 ms on a 49,152-token vocabulary, against 0.18 ms for one row (docs/eagle.md)."""

    def __init__(self, tree: TokenTree, logits, settings: SamplingSettings):
        self.logits, self.settings, self.rows = check_tree_rows(tree, logits, "logits"), settings, {}

    def __getitem__(self, node: int):
        if node not in self.rows:
            self.rows[node] = self.settings.probs(self.logits[node])
        return self.rows[node]

    @property
    def computed(self) -> int:
        return len(self.rows)


def node_probs(tree: TokenTree, target_probs):
    """An acceptance rule's p rows: ``NodeProbs`` as they are, an (n, V) array checked against the tree."""
    if isinstance(target_probs, NodeProbs):
        return target_probs
    return np.asarray(check_tree_rows(tree, target_probs, "target_probs"), dtype=np.float64)


def verify_tree_greedy(tree: TokenTree, logits) -> tuple[list[int], list[int]]:
    """Temperature 0 over a tree -> (emitted tokens, accepted path of nodes from the root).

    logits (n, V): the target's logits at every node. From the root, move to the child whose token
    is the target's argmax; where no child is, emit the argmax and stop. The emitted tokens are the
    path's tokens after the root plus that argmax: exactly the target's greedy continuation.
    Example: chain t -> 3 -> 5 with argmaxes [3, 7, 1] -> ([3, 7], [0, 1]).
    """
    best = check_tree_rows(tree, logits, "logits").argmax(axis=-1)  # (n,)
    node, path, emitted = 0, [0], []
    # EXERCISE 9.2 BEGIN: walk down while a child carries the target's argmax; then emit the argmax
    while True:
        nxt = [c for c in tree.children(node) if tree.tokens[c] == best[node]]
        emitted.append(int(best[node]))
        if not nxt:
            return emitted, path
        node = nxt[0]
        path.append(node)
    # EXERCISE 9.2 END


def verify_tree(tree: TokenTree, target_probs, rng: np.random.Generator, draft_probs=None):
    """Lossless acceptance over a tree (SpecInfer's multi-step speculative sampling) -> (emitted, path).

    target_probs (n, V), or ``NodeProbs``: p at every node. draft_probs: {node: q (V,)} the distribution each node's
    token was drawn from; a node not in it is a deterministic candidate (q one-hot on its token,
    so it is accepted with probability p(x) and a rejection removes x from p). At each node the
    children are tried in order: accept child x with probability min(1, p(x) / q(x)) and descend;
    after a rejection p <- norm(max(0, p - q)). When no child is accepted, emit y ~ p (what is left
    of it). Each step is a speculative-sampling step against the current p, so by induction the
    emitted sequence is distributed exactly as the target would sample it. Children drawn i.i.d.
    from q must stay separate nodes even when they are equal (each rejection updates p);
    deterministic candidates may be merged (``from_paths`` does): a second try of a one-hot x
    would change nothing.
    """
    target_probs = node_probs(tree, target_probs)
    draft_probs = draft_probs or {}
    node, path, emitted = 0, [0], []
    while True:
        p = target_probs[node]
        for child in tree.children(node):
            x = tree.tokens[child]
            q = np.asarray(draft_probs[child], dtype=np.float64) if child in draft_probs \
                else (np.arange(len(p)) == x).astype(np.float64)  # one-hot (np.eye(V)[x] would build V x V)
            if not q[x] > 0:
                raise ValueError(f"tree node {child} has token {x} with draft probability {q[x]}")
            if rng.random() < min(1.0, p[x] / q[x]):
                emitted.append(x)
                node = child
                path.append(child)
                break
            p = residual_distribution(p, q)
        else:  # no child accepted (or a leaf): the target's own draw from what is left
            emitted.append(sample(p, rng))
            return emitted, path


def typical_threshold(p, eps: float = TYPICAL_EPS, delta: float = TYPICAL_DELTA) -> float:
    """min(eps, delta * exp(-H(p))): Medusa's bar for a candidate's probability (H in nats)."""
    p = np.asarray(p, dtype=np.float64)
    entropy = -float((p * np.log(np.where(p > 0, p, 1.0))).sum())
    return min(eps, delta * float(np.exp(-entropy)))


def verify_tree_typical(tree: TokenTree, target_probs, rng: np.random.Generator,
                        eps: float = TYPICAL_EPS, delta: float = TYPICAL_DELTA):
    """Medusa's typical acceptance -> (emitted, path): NOT lossless, by design.

    From the root, descend into the first child x with p(x) > ``typical_threshold(p)``; where no
    child passes, emit y ~ p. A plausible candidate is accepted with probability 1 instead of
    p(x), so likely tokens come out more often than the target would emit them (a chi-square
    test against p fails) in exchange for longer accepted paths.
    """
    target_probs = node_probs(tree, target_probs)
    node, path, emitted = 0, [0], []
    while True:
        p = target_probs[node]
        bar = typical_threshold(p, eps, delta)
        passing = [c for c in tree.children(node) if p[tree.tokens[c]] > bar]
        if not passing:
            emitted.append(sample(p, rng))
            return emitted, path
        node = passing[0]
        emitted.append(tree.tokens[node])
        path.append(node)


def judge_tree(tree: TokenTree, logits, settings: SamplingSettings, rng, rule: str = "exact", draft_probs=None):
    """Target logits (n, V) at the tree's nodes -> (emitted, path) by ``rule`` ('exact' or 'typical').

    At temperature 0 both rules are the greedy walk (typical acceptance's limit as T -> 0).
    draft_probs: ``verify_tree``'s {node: q} for sampled nodes (the exact rule only).
    """
    if rule not in ("exact", "typical"):
        raise ValueError(f"acceptance rule must be 'exact' or 'typical', got {rule!r}")
    if settings.greedy:
        return verify_tree_greedy(tree, logits)
    probs = NodeProbs(tree, logits, settings)  # the rows the walk reaches, softmaxed when it reaches them
    if rule == "typical":
        return verify_tree_typical(tree, probs, rng)
    return verify_tree(tree, probs, rng, draft_probs)


# ----------------------------------------------------------------------------------------------
# the decoding loop

ROUND_ROOM = 64  # cache positions past the last token wanted: a round's tree and extra tokens (Lookahead's window)


@dataclass
class Round:
    """What a proposer may look at when it builds a round's tree.

    seq: every token so far (the root of the tree is seq[-1]); cache: the target's decode cache,
    holding seq[:-n_pending]; hidden: the target's final hidden state (C,) at the node whose
    logits chose seq[-1] (None before the first forward); room: the most nodes the tree may add
    to its root (the cache's space and the tokens still wanted); kept_hidden: the target's hidden
    states (m, C) at the last m cached positions, those the previous round kept (hidden is its
    last row; an EAGLE draft reads them all); settings: the sampling settings of the loop.
    """

    seq: list
    n_pending: int
    cache: object
    hidden: object
    room: int
    kept_hidden: object = None
    settings: SamplingSettings = SamplingSettings()


@dataclass
class Proposal:
    """A round's input: the tree to verify, plus optional extra tokens scored in the same forward.

    extra_tokens (E,) sit at root position + extra_offsets (>= 1) and see the cached prefix, the
    pending tokens and the root, and each other where extra_mask (E, E) says so; no tree node sees
    them and their keys and values are dropped after the forward. Lookahead decoding's window uses this.
    draft_probs {node: q (V,)}: the distribution a node's token was sampled from (``verify_tree``);
    nodes not in it are deterministic candidates.
    """

    tree: TokenTree
    extra_tokens: tuple = ()
    extra_offsets: tuple = ()
    extra_mask: object = None
    draft_probs: dict = None


class Proposer(Protocol):
    """Builds each round's candidates without a draft model; ``observe`` sees the round's outcome."""

    max_depth: int

    def propose(self, state: Round) -> Proposal: ...

    def observe(self, state: Round, emitted: list, extra_logits) -> None: ...


def round_inputs(pending: list, proposal: Proposal):
    """The forward's tokens, position offsets and mask: pending[:-1] as a causal chain, the tree
    (root = pending[-1]) below it, then the extra tokens.  -> (tokens, offsets, mask (T, T) bool)"""
    tree, n0 = proposal.tree, len(pending) - 1
    n_tree, n_extra = tree.size, len(proposal.extra_tokens)
    T = n0 + n_tree + n_extra
    mask = np.zeros((T, T), dtype=bool)
    mask[:, :n0] = True  # everything sees the pending chain ...
    mask[:n0, :n0] = np.tri(n0, dtype=bool)  # ... causally within it
    mask[n0 : n0 + n_tree, n0 : n0 + n_tree] = tree.mask()
    offsets = [*range(n0), *(n0 + tree.depths)]
    if n_extra:
        mask[n0 + n_tree :, n0] = True  # the extras see the root
        mask[n0 + n_tree :, n0 + n_tree :] = np.asarray(proposal.extra_mask, dtype=bool)
        offsets += [n0 + int(o) for o in proposal.extra_offsets]
    tokens = [*pending[:-1], *tree.tokens, *proposal.extra_tokens]
    return tokens, offsets, mask


def target_rows(model, tokens: list, cache, tap_layers=()) -> tuple:
    """The target's forward over ``tokens`` through ``cache`` -> (h (T, C), the rows a draft reads): h itself,
    or with ``tap_layers`` (an EAGLE-3 draft's) [each tapped block's input; h] ((T, (taps + 1) C))."""
    if not tap_layers:
        h = model.hidden(xp.asarray([tokens]), cache)[0]
        return h, h
    h, taps = model.hidden_taps(xp.asarray([tokens]), cache, tap_layers)
    return h[0], xp.concatenate([t[0] for t in taps] + [h[0]], axis=-1)


def verify_round(model, state: Round, proposer: Proposer, rng, rule: str, cache_room: int, tap_layers=None,
                 stats: SpecStats | None = None) -> tuple:
    """One round of any loop that speculates: the proposer's tree (pruned to ``state.room``; its extra tokens
    too when ``cache_room`` positions after the root hold them), one target forward over the pending tokens
    and the tree through a ``MaskedView``, the judgement, and the accepted path's K/V compacted into place. A
    chain with no extra tokens is causal and its accepted path is its first nodes: it runs the cache's own
    forward, and the cache is truncated past the path (no mask, no copies).

    -> (emitted tokens, appended to ``state.seq`` too; the tree verified; the accepted path's node ids; the
    target's rows (m, C) at the m positions the cache gained: ``target_rows``' for ``tap_layers``, by default
    the proposer's if it has any). The last emitted token is not in the cache: it is the next round's root.
    ``stats``: its ``accept_s`` gains the judgement's seconds."""
    seq, cache, room = state.seq, state.cache, state.room
    pending = seq[len(seq) - state.n_pending:]
    proposal = proposer.propose(state)
    if proposal.tree.tokens[0] != seq[-1]:
        raise ValueError(f"the proposer's tree must be rooted at the last token {seq[-1]}, "
                         f"got {proposal.tree.tokens[0]}")
    tree = proposal.tree.pruned(room + 1, room)
    if tree.size - 1 + len(proposal.extra_tokens) <= cache_room:
        proposal = replace(proposal, tree=tree)
    else:  # no room for the extra tokens: they sit this round out
        proposal = Proposal(tree)
    tokens, offsets, mask = round_inputs(pending, proposal)
    causal = tree.is_chain and not proposal.extra_tokens  # the mask is the causal one: the cache's own forward
    base = cache.length
    view = cache if causal else MaskedView(cache, offsets, mask)
    taps = getattr(proposer, "tap_layers", ()) if tap_layers is None else tap_layers
    h, rows = target_rows(model, tokens, view, taps)  # (T, C), what a draft reads
    n0 = len(pending) - 1
    logits = model.logits(h[n0 : n0 + tree.size])  # (n, V)
    t0 = time.perf_counter()
    emitted, path = judge_tree(tree, logits, state.settings, rng, rule, proposal.draft_probs)
    if stats is not None:
        stats.accept_s += time.perf_counter() - t0
    kept = [*range(n0), *(n0 + i for i in path)]
    if causal:  # a chain's accepted path is its first nodes: their K/V already sit where they belong
        cache.truncate(base + len(kept))
    else:
        view.keep(kept)
    extra_logits = model.logits(h[n0 + tree.size :]) if proposal.extra_tokens else None
    seq += emitted
    proposer.observe(state, emitted, extra_logits)
    return emitted, tree, path, rows[xp.asarray(kept)]


def tree_generate(model, prompt_ids, max_new_tokens, proposer: Proposer, temperature=0.0, top_k=None,
                  top_p=None, seed=0, cache=None, rule: str = "exact") -> GenerationResult:
    """Speculative decoding without a draft model: each round the target verifies a token tree in ONE forward.

    Per round: ``fit_context`` (the context policy of every loop), the proposer builds a tree
    rooted at the last token (pruned to the cache's room and the tokens still wanted), one forward
    over pending + tree through a ``MaskedView``, ``judge_tree`` picks the accepted path and the
    next token, and ``MaskedView.keep`` compacts the path's K/V into place (``verify_round``; a chain
    needs neither the view nor the compaction). At temperature 0 with
    rule 'exact' the output is ``generate``'s greedy output token for token; at any temperature
    'exact' keeps the target's distribution. Stats: a ``SpecStats`` (k = the proposer's max_depth;
    ``verified`` counts tree tokens sent past the root).
    """
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    settings = SamplingSettings(temperature, top_k, top_p)
    if rule not in ("exact", "typical"):
        raise ValueError(f"acceptance rule must be 'exact' or 'typical', got {rule!r}")
    if model.attention_name in CAUSAL_ONLY:
        raise ValueError("tree verification needs an attention with explicit masks: use 'auto', 'naive' or 'flash'")
    rng = np.random.default_rng(seed)
    if cache is None:  # sized as ``generate`` sizes it, plus a round's room: zeroing SmolLM2's 8,192 positions took
        # 0.03-0.3 s a call
        cache = KVCache(model.config, max_len=call_cache_len(model.config, prompt_ids, max_new_tokens + ROUND_ROOM))
    cache.reset()
    stats = SpecStats(k=proposer.max_depth, prompt_tokens=len(prompt_ids))
    seq, pending, hidden, kept_hidden = list(prompt_ids), list(prompt_ids), None, None
    stop = len(seq) + max_new_tokens
    t0 = time.perf_counter()
    while len(seq) < stop:
        pending, reprefilled = fit_context(cache, seq, pending)
        stats.reprefills += reprefilled
        if stats.target_calls == 0:  # the first round feeds the prompt, cropped to the window if too long
            stats.dropped_prompt_tokens = len(prompt_ids) - len(pending)
        cache_room = cache.max_len - cache.length - len(pending)  # positions left after the root
        room = min(cache_room, stop - len(seq) - 1)  # a path of depth d emits d + 1 tokens
        state = Round(seq, len(pending), cache, hidden, room, kept_hidden, settings)
        emitted, tree, path, kept_hidden = verify_round(model, state, proposer, rng, rule, cache_room, stats=stats)
        stats.target_calls += 1
        stats.record_round(tree.depth, len(path) - 1, verified=tree.size - 1)
        hidden = kept_hidden[-1, -model.config.n_embd :]  # the top state (the row ends with it)
        pending = [emitted[-1]]
        synchronize()
        t1 = time.perf_counter()
        stats.round_times_s.append(t1 - t0)
        t0 = t1
    return stats.finish(seq[len(prompt_ids) :])


class NoProposal:
    """The empty proposer: a root alone, i.e. plain cached decoding through the tree loop (a baseline)."""

    max_depth = 1

    def propose(self, state: Round) -> Proposal:
        return Proposal(TokenTree((state.seq[-1],), (-1,)))

    def observe(self, state: Round, emitted: list, extra_logits) -> None:
        pass
