"""Proposers that need no draft model: the target's own context, or the target's own first layers.

Both plug into ``minillm.token_tree.tree_generate`` (one target forward per round verifies their
candidates, so the output is the target's, token for token at temperature 0):

- ``PromptLookup`` (Saxena 2023, "prompt lookup decoding"): find the longest n-gram (n <= 3) at
  the end of the text that occurred earlier in the prompt or output, and propose the tokens that
  followed it there (up to 10). Free to compute (c ~ 0); it shines when the answer repeats its
  input (summaries, edits, code) and proposes nothing on open-ended text.
- ``LayerSkip`` (self-speculation: Zhang et al. 2024, "Draft & Verify"; Elhoushi et al. 2024,
  "LayerSkip"): the draft is the target's first L layers plus its final norm and LM head. It
  shares the target's KV cache: the first L layers' keys and values of every verified token are
  already there, so the draft never prefills. Its proposals write into the cache past the
  verified tokens and are rolled back before the target's forward.
"""

from __future__ import annotations

from .backend import xp
from .model import check_layers
from .token_tree import Proposal, Round, TokenTree

MAX_NGRAM = 3
MAX_DRAFT = 10
LOOKUP_DRAFT = 5  # prompt lookup's longest chain on the 4-bit kernels (a chat's, a lone served request's): a verify
# of 6 rows, the widest 4-bit kernel below 8. On one core those kernels are compute-bound past one row, so a 10-token
# chain (11 rows, the 16-row kernels: 3.7 steps of products) costs more than its extra accepted tokens bring: grounded
# chats decoded at 10.2 ms/token with 5, 14.0 with 10, plain 14.9 (docs/eagle.md, "On an Intel Xeon with AVX-512")
LOOKUP_MIN_NGRAM = 2  # and its lookups start from a suffix of 2 tokens: from 1, a lone common token matches too often
# in free text to pay for the rows it drafts (chat and code replies at 1.30 / 1.34 of plain's ms/token with lookups
# from 1 token, 1.03-1.04 / 1.08-1.09 from 2, grounded ones alike at 0.46-0.48; docs/eagle.md). EAGLE's chain pairs
# with lookups from 2 tokens as well (``eagle.EagleLookup``)


def ngram_lookup(seq, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest suffix n-gram of ``seq``.

    Tries n = max_ngram .. 1; for each, the suffix seq[-n:] is searched in seq[:-1] (so a match is a
    genuine earlier occurrence, never the suffix itself), latest first; the first hit returns up to
    max_draft tokens that followed it. [] when no suffix n-gram occurred before.
    Example: seq "a b c d a b" (max_ngram 3) -> suffix "a b" occurred at 0 -> ["c", "d", "a", "b"].
    """
    if max_ngram < 1 or max_draft < 1:
        raise ValueError(f"max_ngram and max_draft must be >= 1, got {max_ngram} and {max_draft}")
    seq = list(seq)
    # EXERCISE 9.3 BEGIN: longest suffix n-gram first; latest earlier start i (i + n < len(seq)); what followed
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        for i in range(len(seq) - n - 1, -1, -1):  # starts before the suffix's own start len(seq) - n
            if seq[i : i + n] == suffix:
                return seq[i + n : i + n + max_draft]
    return []
    # EXERCISE 9.3 END


def long_ngram_lookup(seq, min_ngram: int, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT) -> list[int]:
    """``ngram_lookup`` for suffixes of at least ``min_ngram`` tokens only: the same search over the text's windows
    of min_ngram tokens, where a suffix of j windows is one of min_ngram - 1 + j tokens, and each window after a
    match brings one new token (its last).
    Example: seq "a b c a x c" (min_ngram 2) -> [] (only "c" occurred before); "a b c d a b" -> ["c", "d", "a", "b"].
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"min_ngram must be in 1..max_ngram ({max_ngram}), got {min_ngram}")
    if min_ngram == 1:  # windows of one token are the tokens
        return ngram_lookup(seq, max_ngram, max_draft)
    seq = list(seq)
    windows = [tuple(seq[i : i + min_ngram]) for i in range(len(seq) - min_ngram + 1)]
    return [w[-1] for w in ngram_lookup(windows, max_ngram - min_ngram + 1, max_draft)]


class PromptLookup:
    """Prompt-lookup decoding: a chain of the tokens that followed the text's suffix earlier on; with ``min_ngram``
    > 1 only where a suffix of that many tokens or more occurred before (``long_ngram_lookup``)."""

    def __init__(self, max_ngram: int = MAX_NGRAM, max_draft: int = MAX_DRAFT, min_ngram: int = 1):
        long_ngram_lookup([0], min_ngram, max_ngram, max_draft)  # checks the arguments
        self.max_ngram, self.max_draft, self.min_ngram = max_ngram, max_draft, min_ngram
        self.max_depth = max_draft

    def propose(self, state: Round) -> Proposal:
        drafts = long_ngram_lookup(state.seq, self.min_ngram, self.max_ngram, self.max_draft)
        return Proposal(TokenTree.chain(state.seq[-1], drafts[: state.room]))

    def observe(self, state: Round, emitted: list, extra_logits) -> None:
        pass


class LayerSkip:
    """Self-speculation: the target's first ``layers`` blocks (then ln_f and the LM head) draft k tokens greedily.

    Greedy drafts are deterministic candidates, so verification stays exact at any temperature.
    """

    def __init__(self, model, layers: int, k: int = 4):
        self.model, self.layers = model, check_layers(model.config, layers)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k (draft tokens per round) must be an int >= 1, got {k!r}")
        self.max_depth = k
        self.draft_calls = 0

    def propose(self, state: Round) -> Proposal:
        cache, base = state.cache, state.cache.length
        k = min(self.max_depth, state.room)
        feed, drafts = state.seq[-state.n_pending :], []  # the pending tokens, then each new draft
        for _ in range(k):
            h = self.model.hidden(xp.asarray([feed]), cache, layers=self.layers)[0, -1:]  # (1, C)
            self.draft_calls += 1
            drafts.append(int(self.model.logits(h)[0].argmax()))
            feed = drafts[-1:]
        cache.truncate(base)  # the target's forward rewrites these positions
        return Proposal(TokenTree.chain(state.seq[-1], drafts))

    def observe(self, state: Round, emitted: list, extra_logits) -> None:
        pass
