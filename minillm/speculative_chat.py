"""A chat whose replies speculate, the method chosen by measuring it: ``SpeculativeChat``.

A reply is decoded in rounds (``token_tree.verify_round``): a proposer drafts (EAGLE's draft,
``minillm.eagle``; prompt lookup, ``minillm.draft_free``), the target verifies the drafts in one forward,
and the accepted path stays in the conversation's KV cache, which lives from turn to turn as in
``chat.Chat``. The exact rule keeps the target's distribution: at temperature 0 the reply is plain
chat's token for token, at any other its tokens are distributed as plain chat's.

Speculation pays only when enough drafts are accepted to cover what drafting and the wider
verification cost, and that depends on the conversation (a question about a pasted text suits prompt
lookup, free chat suits neither on some CPUs). So ``speculate="auto"`` measures instead of guessing, reply by reply:
the candidates -- plain decoding and each proposer (``chat_proposers``: the EAGLE draft's chain with prompt
lookup's beside it, and lookup alone) -- take turns round by round at the start of every reply, the one with the
fewest tokens timed in this reply next, until each has timed ``trial_tokens`` tokens in all and half that many in
this reply; the fastest decodes the rest of the reply, if it beat plain decoding by ``SPECULATION_MARGIN``. Every
reply's timings are kept, and a new reply halves what came before it (``MEMORY``): a conversation that turns
from free chat to questions about a pasted text tries lookup again on its first tokens of that turn, and the
first reply's choice is not kept for good. Taking turns pairs the candidates on the same stretch of the reply
and the same load on the machine. What would bias the comparison stays out of it: the kernels of every row count
a candidate verifies are loaded before the trial (``warm_up``), and each candidate's first round of a reply,
where a draft catches up on the new message, is not timed. ``choice_note`` says which won and by what numbers
(``python -m minillm chat`` prints it when the choice changes). A named proposer ("eagle", "lookup",
"eagle-lookup") decodes every reply; its ms/token is in ``measured``.

An EAGLE draft reads the target's hidden state at every cached position. This chat keeps the rows the
draft has not read yet (``unsynced``: the prefill's, and every round's while another candidate
decodes, plain decoding included) and hands them to the draft's next round, so the draft's own cache stays
aligned with the target's across turns and candidates.
"""

from __future__ import annotations

import time

from .backend import xp
from .chat import Chat
from .draft_free import LOOKUP_DRAFT, LOOKUP_MIN_NGRAM, PromptLookup
from .eagle import EagleLookup, EagleProposer, load_draft
from .generate import PREFILL_CHUNK
from .kv_cache import KVCache
from .qkernels import row_tiles
from .token_tree import NoProposal, Round, target_rows, verify_round

PLAIN = "plain"
DRAFTS = (EagleProposer, EagleLookup)  # the proposers whose draft reads the target's hidden states
TRIAL_TOKENS = 16  # timed tokens each candidate needs before "auto" compares them (half of them in the reply): 32
# spent half of a 96-token reply on the trial, and auto at 16 was 0.86-0.91x plain on chat and code against 0.97x
# at 32 (docs/eagle.md, "A shorter trial")
MEMORY = 0.5  # what "auto" keeps of its timings at a new reply: each reply weighs as much as all before it
SPECULATION_MARGIN = 0.9  # "auto" speculates only where a proposer's trial took at most 0.9 of plain's ms/token:
# a trial of 32 tokens per candidate is noisy on a busy machine (lookup 23.6 against plain 24.3 chose lookup, which
# then decoded 1.2 times slower than plain; docs/eagle.md)
EAGLE_DEPTH = 1  # EAGLE's chain in a chat: one draft token per round. At the shipped draft's acceptance (0.3-0.4 on
# chat, 0.5-0.6 on code) a longer chain's verify costs more than its extra tokens bring: on unseen prompts a chain of
# 1 decoded at 1.09x / 1.25x plain (chat / code), of 2 at 0.97x / 1.15x (docs/eagle.md, "A verify's grouped-query
# attention without copies"); of 4 at 0.81x / 1.10x before that change ("Why things happen, and programs"). A chain of
# up to 3 sized by the draft's confidence (``EagleProposer``'s confidence 0.85) took code replies to 0.95-0.96 of a
# chain of one's time in the chat, and chat and grounded replies to 1.00-1.06 ("A chain as long as the draft is sure")


def warm_up(model, proposers: dict) -> None:
    """One forward of each row tile of the 4-bit kernels (``qkernels.row_tiles``: 1 to 6, 8 and 16 token rows)
    through the target and through each EAGLE draft among ``proposers``, on throwaway caches, so that every kernel
    a candidate runs is ready before "auto" times anything. A kernel is compiled on the first product of its row
    tile after an install and loaded from numba's cache in every later process; left to the trial, that fell on
    whichever candidate first verified that many rows: with nothing cached the trial timed the EAGLE chain with
    lookup's beside it at 105.6 ms/token against plain's 12.0 (docs/eagle.md, "What auto measures")."""
    cache = KVCache(model.config, max_len=row_tiles()[-1])
    drafts = {id(p.draft): p.draft for p in proposers.values() if isinstance(p, DRAFTS)}.values()
    for n in row_tiles():
        cache.truncate(0)
        model.forward(xp.zeros((1, n), dtype=xp.int64), cache)
        for draft in drafts:
            width = (len(draft.tap_layers) + 1) * model.config.n_embd  # the rows a draft reads: [taps; f]
            draft.step(xp.zeros((n, width), dtype=xp.float32), [0] * n, draft.new_cache(n))


def chat_proposers(model, speculate: str, model_name: str, draft_path=None) -> dict:
    """The proposers ``speculate`` names: "eagle" (the draft at ``draft_path``, or the one shipped for
    ``model_name``), "lookup" (prompt lookup), "eagle-lookup" (the draft's chain with lookup's beside it,
    ``eagle.EagleLookup``), or "eagle-lookup" and "lookup" for "auto": the draft's chain alone never measured
    faster than with lookup's beside it, on any kind of prompt (docs/eagle.md)."""
    proposers = {}
    if speculate in ("eagle", "eagle-lookup", "auto"):
        eagle = chat_eagle(load_draft(model, model_name, draft_path))
        if speculate == "eagle":
            proposers["eagle"] = eagle
        else:
            proposers["eagle-lookup"] = chat_eagle_lookup(eagle)
    if speculate in ("lookup", "auto"):
        proposers["lookup"] = chat_lookup()
    return proposers


def chat_eagle(draft) -> EagleProposer:
    """EAGLE's chain as a chat drafts it: EAGLE_DEPTH tokens a round."""
    return EagleProposer(draft, "chain", depth=EAGLE_DEPTH)


def chat_lookup() -> PromptLookup:
    """Prompt lookup as a chat drafts it: chains of at most LOOKUP_DRAFT tokens after a suffix of LOOKUP_MIN_NGRAM
    tokens or more."""
    return PromptLookup(max_draft=LOOKUP_DRAFT, min_ngram=LOOKUP_MIN_NGRAM)


def chat_eagle_lookup(eagle: EagleProposer) -> EagleLookup:
    """EAGLE's chain with lookup's beside it, as a chat drafts them (lookup's chains as in ``chat_lookup``)."""
    return EagleLookup(eagle, LOOKUP_DRAFT, LOOKUP_MIN_NGRAM)


class SpeculativeChat(Chat):
    """``Chat`` with replies decoded by ``proposers`` ({name: proposer}); ``speculate``: one name, or "auto"."""

    def __init__(self, model, tokenizer, proposers: dict, speculate: str = "auto", system: str | None = None,
                 max_len: int | None = None, seed: int = 0, trial_tokens: int = TRIAL_TOKENS):
        if speculate != "auto" and speculate not in proposers:
            raise ValueError(f"speculate must be 'auto' or one of {sorted(proposers)}, got {speculate!r}")
        if not isinstance(trial_tokens, int) or not 1 <= trial_tokens <= 4096:
            raise ValueError(f"trial_tokens must be an int in 1..4096, got {trial_tokens!r}")
        self.proposers = ({PLAIN: NoProposal()} | proposers) if speculate == "auto" else {
            speculate: proposers[speculate]}
        self.chosen = None if speculate == "auto" else speculate
        self.trial_tokens = trial_tokens
        self.measured = {name: [0.0, 0.0] for name in self.proposers}  # seconds, tokens emitted (timed rounds)
        self.in_reply = dict.fromkeys(self.proposers, 0)  # tokens timed in this reply
        self.rounds = dict.fromkeys(self.proposers, 0)  # rounds decoded by each in this reply, the first untimed
        self.choice_note = None
        self.auto = speculate == "auto"
        if speculate == "auto":
            warm_up(model, proposers)
        super().__init__(model, tokenizer, system=system, max_len=max_len, seed=seed)

    # ---- what the cache holds, and the rows the draft has not read ------------------------------------

    def reset(self) -> None:
        super().reset()
        self.seq = []  # the token ids the cache holds, in order (a proposer reads them)
        self.unread = []  # pieces (m_i, C) of the target's rows (``target_rows``) the draft has not read, in order

    @property
    def unsynced(self):
        """(m, C): the target's rows at the last m cached positions, which the draft has not read (None: none)."""
        if len(self.unread) > 1:
            self.unread = [xp.concatenate(self.unread)]  # once, when read: a plain stretch adds a row a token
        return self.unread[0] if self.unread else None

    def reads_features(self) -> bool:
        return any(isinstance(p, DRAFTS) for p in self.proposers.values())

    def tap_layers(self) -> tuple:
        """The blocks whose inputs an EAGLE-3 candidate reads beside the top state (none for the others)."""
        return next((p.tap_layers for p in self.proposers.values() if isinstance(p, DRAFTS)), ())

    def keep_rows(self, h, read: bool) -> None:
        """The hidden states h (m, C) of the m positions the cache just gained; ``read``: the draft read
        those before them this round (its round ran), so they replace the unread rows."""
        if not self.reads_features():
            return
        if read:
            self.unread = []
        self.unread.append(h)

    def feed(self, ids: list):
        """The turn's new tokens into the cache in pieces, their hidden states kept -> the last one's logits (V,)."""
        pieces = [target_rows(self.model, ids[start : start + PREFILL_CHUNK], self.cache, self.tap_layers())
                  for start in range(0, len(ids), PREFILL_CHUNK)]
        self.seq += ids
        self.keep_rows(xp.concatenate([rows for _, rows in pieces]), read=False)
        return self.model.logits(pieces[-1][0][-1:])[0]

    def turn(self, message: str, *args, **kwargs):
        seq = list(self.seq)
        try:
            return super().turn(message, *args, **kwargs)
        except KeyboardInterrupt:  # the base class truncated the cache back; the draft starts over (lossless)
            self.seq, self.unread = seq, []
            raise

    # ---- the choice ------------------------------------------------------------------------------------

    def ms_per_token(self, name: str) -> float:
        seconds, tokens = self.measured[name]
        return 1e3 * seconds / max(tokens, 1)

    def new_reply(self) -> None:
        """A reply starts: "auto" halves its timings (``MEMORY``) and chooses again; every candidate's first round
        of the reply goes untimed."""
        self.rounds = dict.fromkeys(self.proposers, 0)
        self.in_reply = dict.fromkeys(self.proposers, 0)
        if self.auto:
            self.chosen, self.choice_note = None, None
            for timing in self.measured.values():
                timing[0] *= MEMORY
                timing[1] *= MEMORY

    def on_trial(self, name: str) -> bool:
        """Whether ``name`` still needs timed tokens: ``trial_tokens`` in all, and half that many in this reply."""
        return self.measured[name][1] < self.trial_tokens or 2 * self.in_reply[name] < self.trial_tokens

    def current(self) -> str:
        """The proposer of the next round: the chosen one, else the candidate still on trial with the fewest tokens
        timed in this reply (the first of them in order on a tie); once no candidate is on trial, the fastest is
        chosen if it beat plain decoding by the margin (else plain), and ``choice_note`` says so."""
        if self.chosen is None:
            on_trial = [name for name in self.proposers if self.on_trial(name)]
            if on_trial:
                return min(on_trial, key=lambda name: self.in_reply[name])
            fastest = min(self.proposers, key=self.ms_per_token)
            plain = self.ms_per_token(PLAIN)
            self.chosen = fastest if self.ms_per_token(fastest) <= SPECULATION_MARGIN * plain else PLAIN
            self.choice_note = "speculation measured: " + ", ".join(
                f"{name} {self.ms_per_token(name):.1f} ms/token" for name in self.proposers) + f" -> {self.chosen}"
        return self.chosen

    # ---- the reply ---------------------------------------------------------------------------------------

    def decode(self, logits, max_new_tokens: int, settings, emit, t0: float) -> tuple:
        """``Chat.decode``'s contract, in rounds of the current proposer; a plain round keeps its hidden state for
        the draft, which a later reply may ask to draft."""
        self.new_reply()
        tokens, times = [], []
        token = settings.next_token(logits, self.rng)
        times.append(time.perf_counter() - t0)
        self.seq.append(token)  # the first round's root: sampled, not yet in the cache
        while True:
            if token == self.tokenizer.eos_token_id:
                self.seq.pop()
                return tokens, times, "end of turn"
            tokens.append(token)
            emit(token)
            cache_room = self.cache.max_len - self.cache.length - 1  # positions after the root
            if cache_room < 0 or len(tokens) == max_new_tokens:
                self.seq.pop()
                self.pending = [token]  # sampled, not fed: the next turn feeds it first
                return tokens, times, "context full" if cache_room < 0 else "max_new_tokens"
            name = self.current()
            start, cached = time.perf_counter(), self.cache.length
            if name == PLAIN:  # plain chat's step, its hidden state kept for the draft
                h, kept = target_rows(self.model, [token], self.cache, self.tap_layers())  # (1, C), its rows
                emitted = [settings.next_token(self.model.logits(h)[-1], self.rng)]
                self.seq += emitted
            else:
                room = min(cache_room, max_new_tokens - len(tokens) - 1)  # a path of depth d emits d + 1 tokens
                state = Round(self.seq, 1, self.cache, None, room, self.unsynced, settings)
                proposer = self.proposers[name]
                emitted, _, _, kept = verify_round(self.model, state, proposer, self.rng, "exact", cache_room,
                                                   self.tap_layers())  # the rows the draft reads, whoever drafts
            now = time.perf_counter()
            self.keep_rows(kept, read=getattr(self.proposers[name], "synced", None) == cached)  # the draft read them
            if self.rounds[name] > 0:  # a candidate's first round of a reply is its warm-up
                self.measured[name][0] += now - start
                self.measured[name][1] += len(emitted)
                self.in_reply[name] += len(emitted)
            self.rounds[name] += 1
            times += [now - t0] * len(emitted)
            if self.tokenizer.eos_token_id in emitted[:-1]:  # the turn ended inside the path: drop what follows
                end = emitted.index(self.tokenizer.eos_token_id)
                drop = len(emitted) - 1 - end  # cached entries from the eos on
                self.cache.truncate(self.cache.length - drop)
                if self.unread:
                    self.unread = [self.unsynced[: len(self.unsynced) - drop]]
                del self.seq[len(self.seq) - (len(emitted) - end):]
                for t in emitted[:end]:
                    tokens.append(t)
                    emit(t)
                del times[len(times) - (len(emitted) - end) + 1:]
                return tokens, times, "end of turn"
            for t in emitted[:-1]:
                tokens.append(t)
                emit(t)
            token = emitted[-1]  # the next root, in seq, not in the cache
