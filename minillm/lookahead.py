"""Jacobi decoding, and Lookahead decoding built on it: guess future tokens in parallel, keep what the target confirms.

**Jacobi decoding** (Song et al. 2021; Santilli et al. 2023) writes greedy decoding of the next m
tokens as m equations, y_i = argmax p(. | text, y_0..y_{i-1}), and solves them by fixed-point
iteration: guess all m, run them in ONE causal forward after the cached text, replace every guess
by the argmax at its position, repeat. The first argmax is always exact (its context is known
text), and a guess that equals its own new argmax is exact when every guess before it is; so each
iteration fixes at least one more token, a block of m reaches the fixed point in at most m
iterations, and the output is ``generate``'s greedy output token for token. In practice one wrong
guess spoils the predictions after it, and plain Jacobi gains little over one token per forward.

**Lookahead decoding** (Fu, Bailis, Stoica and Zhang 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding", LMSYS / UC San Diego) keeps Jacobi's parallel guessing but
does not wait for it to converge. Each round's ONE forward holds two branches:

- the *lookahead branch*: a 2-D window of W columns and N - 1 levels, Jacobi-updated every round.
  Its columns are Jacobi trajectories: each column's tokens, read down the levels, form an N-gram
  the target itself produced (each token the argmax after the ones above it), and every round's
  N-grams go into an *n-gram pool* keyed by their first token.
- the *verification branch*: up to G (N-1)-grams from the pool that start with the current token,
  verified as a token tree (``minillm.token_tree``); what it accepts is exact.

The window, drawn for N = 4, W = 3 (t is the position of the root r, the last emitted token):

    position    t    t+1   t+2   t+3   t+4   t+5
    level 0     r    a0    a1                       a causal chain: r and W - 1 guesses
    level 1          b0    b1    b2
    level 2                c0    c1    c2
    argmax                       d0    d1    d2     this round's new level

Column j holds (level 0's column j, b_j, c_j) at consecutive positions; b_j sees r, a_0..a_{j-1} and
itself, c_j sees those and b_j: each token sees the chain up to its column and its own column's
earlier levels. Column j's N-gram is (a_{j-1} or r, b_j, c_j, d_j). Next round the levels move up
(level 0 <- b_1..b_{W-1}, level 1 <- c, level 2 <- d) while the root moves on; the window's first
N - 2 rounds only fill its levels. Greedy output equals ``generate``'s: only the tree is verified.

``jacobi_generate`` is plain Jacobi decoding, a loop of its own: its update needs the argmax at
every guess, accepted or not. ``Lookahead`` is a proposer for ``minillm.token_tree.tree_generate``:
the window rides along as the round's extra tokens (scored in the same forward, never cached).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import synchronize, to_numpy, xp
from .config import check_count
from .generate import GenerationResult, check_prompt, fit_context
from .kv_cache import KVCache
from .speculative import SpecStats
from .token_tree import Proposal, Round, TokenTree

JACOBI_M = 4  # guesses per Jacobi block
LOOKAHEAD_N = 5  # n-gram size: the window has N - 1 levels, candidates are N - 1 tokens after the root
LOOKAHEAD_W = 7  # window columns
LOOKAHEAD_G = 7  # candidates verified per round (and n-grams the pool keeps per first token)
MIN_N = 3  # the window needs a level besides the causal chain (the paper's code needs LEVEL >= 3 too)


# ----------------------------------------------------------------------------------------------
# Jacobi decoding


def jacobi_step(guesses, predictions) -> tuple[list[int], list[int]]:
    """One parallel Jacobi update -> (tokens now exact, guesses for the positions after them).

    guesses y_0..y_{n-1} were fed after the known text; predictions p_0..p_{n-1} are the argmaxes,
    p_i made after y_0..y_{i-1}. With k the number of leading i where y_i == p_i, p_0..p_k are exact
    (p_0's context is known; y_i == p_i confirms y_i once y_0..y_{i-1} are); every later p_i is
    the new guess for its position. k == n is the fixed point: all n are exact.
    Example: y [5, 6, 7, 8], p [5, 6, 9, 3] -> ([5, 6, 9], [3]).
    """
    # EXERCISE 9.4 BEGIN: count leading matches k; emit predictions[:k + 1]; the rest are the new guesses
    k = 0
    while k < len(guesses) and guesses[k] == predictions[k]:
        k += 1
    return [int(t) for t in predictions[: k + 1]], [int(t) for t in predictions[k + 1 :]]
    # EXERCISE 9.4 END


@dataclass
class JacobiStats(SpecStats):
    """``SpecStats`` of a Jacobi run (a round = one iteration = one target call), plus iterations per block."""

    block_iterations: list = field(default_factory=list)


def jacobi_generate(model, prompt_ids, max_new_tokens, m: int = JACOBI_M, cache=None) -> GenerationResult:
    """Greedy decoding by Jacobi iteration: blocks of m guesses, each solved in at most m target calls.

    A block starts as m copies of the last token. Each iteration feeds the pending tokens and the
    guesses y_0..y_{n-2} (y_{n-1} only receives a prediction) in one causal forward, ``jacobi_step``
    emits the exact prefix and re-guesses the rest, and the cache keeps the K/V of the emitted
    tokens that were fed (their context was exact), dropping the others. The context policy is
    ``fit_context``, applied exactly where ``generate`` applies it, with fewer guesses near the
    cache's end, so the output equals ``generate(..., temperature=0)`` token for token.
    Stats: ``JacobiStats`` (target_calls = iterations; ``block_iterations`` per block).
    """
    prompt_ids = check_prompt(prompt_ids, max_new_tokens)
    m = check_count("m (Jacobi guesses per block)", m, 1)
    cache = KVCache(model.config) if cache is None else cache
    cache.reset()
    stats = JacobiStats(k=m, prompt_tokens=len(prompt_ids))
    seq, pending = list(prompt_ids), list(prompt_ids)
    stop = len(seq) + max_new_tokens
    t0 = time.perf_counter()
    while len(seq) < stop:
        guesses, iterations = [seq[-1]] * min(m, stop - len(seq)), 0
        while guesses:
            pending, reprefilled = fit_context(cache, seq, pending)
            stats.reprefills += reprefilled
            if stats.target_calls == 0:  # the first iteration feeds the prompt, cropped if too long
                stats.dropped_prompt_tokens = len(prompt_ids) - len(pending)
            guesses = guesses[: cache.max_len - cache.length - len(pending) + 1]  # the fed ones must fit
            base, fed = cache.length, pending + guesses[:-1]
            logits = model.forward(xp.asarray([fed]), cache)[0, len(pending) - 1 :]  # (n, V)
            emitted, next_guesses = jacobi_step(guesses, to_numpy(logits.argmax(axis=-1)).tolist())
            cache.truncate(base + len(pending) + len(emitted) - 1)  # pending and the emitted guesses fed
            stats.target_calls += 1
            stats.record_round(len(guesses) - 1, len(emitted) - 1)
            seq += emitted
            pending, guesses, iterations = [emitted[-1]], next_guesses, iterations + 1
            synchronize()
            t1 = time.perf_counter()
            stats.round_times_s.append(t1 - t0)
            t0 = t1
        stats.block_iterations.append(iterations)
    return stats.finish(seq[len(prompt_ids) :])


# ----------------------------------------------------------------------------------------------
# Lookahead decoding: the n-gram pool, the window, the proposer


class NGramPool:
    """N-grams keyed by their first token: at most ``capacity`` per key, the least recently seen dropped.

    Example (capacity 2): add (1, 2, 3), (1, 4, 5), (2, 3, 4), (1, 2, 3), (1, 6, 7)
    -> candidates(1) == [(6, 7), (2, 3)] (newest first), candidates(2) == [(3, 4)].
    """

    def __init__(self, capacity: int):
        self.capacity = check_count("pool capacity", capacity, 1)
        self.grams: dict[int, list[tuple]] = {}

    def add(self, ngram) -> None:
        """File ``ngram`` (>= 2 tokens) under its first token; a repeat moves to the newest place."""
        key, rest = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        kept = self.grams.setdefault(key, [])
        if rest in kept:
            kept.remove(rest)
        kept.append(rest)
        del kept[: -self.capacity]

    def candidates(self, token: int) -> list[tuple]:
        """The continuations filed under ``token``, newest first."""
        return self.grams.get(int(token), [])[::-1]

    def __len__(self) -> int:
        return sum(len(v) for v in self.grams.values())


def window_inputs(levels) -> tuple[list, list, np.ndarray]:
    """The window as extra tokens -> (tokens, offsets from the root's position, mask (E, E) bool).

    levels[0]: the causal chain's guesses after the root (columns 1..S-1); levels[1:]: S tokens each,
    level l's column j at offset l + j. A level-0 token sees the chain up to itself; level l's
    column j sees the chain up to column j and levels 1..l of column j (the root is seen by all:
    ``round_inputs`` adds it). Example: levels [[a0], [b0, b1]] -> tokens [a0, b0, b1],
    offsets [1, 1, 2], mask [[1, 0, 0], [0, 1, 0], [1, 0, 1]].
    """
    tokens, offsets, where = [], [], {}  # where[(level, column)] = index among the extras
    for level, row in enumerate(levels):
        for i, token in enumerate(row):
            column = i + 1 if level == 0 else i
            where[level, column] = len(tokens)
            tokens.append(int(token))
            offsets.append(level + column)
    mask = np.zeros((len(tokens), len(tokens)), dtype=bool)
    for (level, column), e in where.items():
        for c in range(1, column + 1):  # the chain up to this column (level 0 at column 0 is the root)
            mask[e, where[0, c]] = True
        for lv in range(1, level + 1):  # this column's earlier levels, and itself
            mask[e, where[lv, column]] = True
    return tokens, offsets, mask


class Lookahead:
    """Lookahead decoding as a ``tree_generate`` proposer: window of W columns x (N - 1) levels, G candidates.

    ``propose``: the pool's (N-1)-grams that start with the root, as a token tree, plus the window
    as extra tokens (``window_inputs``). ``observe``: the argmax of the window's last level is the
    new level; once the window is full, each column's N-gram goes into the pool. The first window
    is W + N - 3 tokens drawn from the prompt (``seed``). ``pool_from_prompt``: also file every
    N-gram of the prompt and of the output (the paper code's POOL_FROM_PROMPT). One proposer per
    generation: the window and the pool belong to one text.
    Defaults N 5, W 7, G 7: the paper's code (``lade.config_lade(LEVEL=5, WINDOW_SIZE=7, GUESS_SET_SIZE=7)``).
    """

    def __init__(self, N: int = LOOKAHEAD_N, W: int = LOOKAHEAD_W, G: int = LOOKAHEAD_G, seed: int = 0,
                 pool_from_prompt: bool = False):
        self.N = check_count("N (n-gram size)", N, MIN_N)
        self.W = check_count("W (window columns)", W, 1)
        self.G = check_count("G (candidates per round)", G, 1)
        self.max_depth = self.N - 1
        self.pool = NGramPool(self.G)
        self.rng = np.random.default_rng(seed)
        self.pool_from_prompt = pool_from_prompt
        self.levels = None  # made from the prompt at the first round
        self.context = []  # the last N - 1 tokens when the round was proposed (the root last)
        self.window_rounds = self.window_tokens = 0  # rounds whose forward carried the window; its tokens

    def start(self, seq) -> None:
        """The first window: level 0 of W + N - 3 tokens drawn from the text; the pool from the prompt."""
        self.levels = [[int(t) for t in self.rng.choice(np.asarray(seq), self.W + self.N - 3)]]
        if self.pool_from_prompt:
            for i in range(len(seq) - self.N + 1):
                self.pool.add(seq[i : i + self.N])

    def propose(self, state: Round) -> Proposal:
        if self.levels is None:
            self.start(state.seq)
        root = state.seq[-1]
        self.context = list(state.seq[-(self.N - 1) :])
        tree = TokenTree.from_paths(root, self.pool.candidates(root))  # at most G: the pool keeps no more
        tokens, offsets, mask = window_inputs(self.levels)
        return Proposal(tree, tuple(tokens), tuple(offsets), mask)

    def observe(self, state: Round, emitted: list, extra_logits) -> None:
        if self.pool_from_prompt:  # the N-grams that end in the emitted tokens
            text = self.context + list(emitted)
            for end in range(len(self.context) + 1, len(text) + 1):
                if end >= self.N:
                    self.pool.add(text[end - self.N : end])
        if extra_logits is None:  # no room in the cache this round: the window sat it out
            return
        self.window_rounds += 1
        self.window_tokens += sum(len(row) for row in self.levels)
        last = len(self.levels[-1])
        new = to_numpy(extra_logits[-last:].argmax(axis=-1)).tolist()  # the argmax after each last-level token
        self.levels = self.next_levels(self.context[-1], new)

    def next_levels(self, root: int, new: list) -> list:
        """The window after a round, given the root it was proposed at and the argmax of its last level.

        Filling (fewer than N - 1 levels): every level drops its first column and ``new`` becomes a
        level (S shrinks by one each round, from W + N - 2 to W). Full: file column j's N-gram
        (chain[j], level_1[j], .., level_{N-2}[j], new[j]) in the pool, then move the levels up.
        """
        levels = self.levels
        if len(levels) < self.N - 1:
            return [row[1:] for row in levels] + [new if len(levels) == 1 else new[1:]]
        chain = [root, *levels[0]]
        for j in range(self.W):
            self.pool.add([chain[j], *(row[j] for row in levels[1:]), new[j]])
        return [levels[1][1:], *levels[2:], new]
