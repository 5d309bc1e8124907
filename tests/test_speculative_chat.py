"""A chat whose replies speculate (``minillm.speculative_chat``): the replies are plain chat's, turn after turn.

A small random Llama (its LM head scaled so that its greedy text has structure, and the end-of-turn token
likely enough that replies end) with an EAGLE draft and prompt lookup: at
temperature 0 every reply, its finish and the conversation's cache equal plain ``Chat``'s, for each
proposer and for "auto", whose choice is measured and said.
"""

import numpy as np
import pytest
from test_chat import CharChatTokenizer

from minillm.backend import to_numpy
from minillm.chat import Chat
from minillm.config import LlamaConfig
from minillm.draft_free import PromptLookup
from minillm.eagle import EagleDraft, EagleLookup, EagleProposer
from minillm.llama import Llama
from minillm.speculative_chat import SPECULATION_MARGIN, SpeculativeChat

HOST = pytest.mark.host_only  # the chat's bookkeeping is host code; the last test runs on either backend
USES = pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "8.1", "8.2", "8.3",
                                                               "9.1", "9.2", "9.3")
pytestmark = USES
MESSAGES = ["hello there", "and what of the king?", "the king, the king!", "say it again"]


@pytest.fixture(scope="module")
def tok():
    return CharChatTokenizer()


@pytest.fixture(scope="module")
def model(tok):
    cfg = LlamaConfig(vocab_size=len(tok.token_bytes), block_size=512, n_layer=2, n_head=4, n_kv_head=2,
                      n_embd=32, n_hidden=64, tie_embeddings=False)
    m = Llama.init(cfg, seed=2)
    m.params["lm_head.weight"] *= 3.0  # peaked: greedy text repeats itself, which lookup can copy
    m.params["lm_head.weight"][tok.eos_token_id] *= 1.4  # two of the four replies end, inside a path or not
    return m


def proposers(model, tap_layers=(), speculate="auto"):
    """EAGLE (an EAGLE-3 draft with ``tap_layers``: the target hands it those blocks' inputs too) and lookup; for
    "eagle-lookup" the draft's chain with lookup's beside it."""
    draft = EagleDraft.init(model, list(range(0, model.config.vocab_size, 2)), seed=1, tap_layers=tap_layers)
    if tap_layers:  # a fuse that reads its taps
        draft.params["fuse.weight"][...] = np.random.default_rng(3).normal(0.0, 0.1, draft.params["fuse.weight"].shape)
    if speculate == "eagle-lookup":
        return {"eagle-lookup": EagleLookup(EagleProposer(draft, depth=2), 4)}
    return {"eagle": EagleProposer(draft, depth=4), "lookup": PromptLookup()}


def conversation(chat, n_new=40):
    replies = [chat.turn(m, max_new_tokens=n_new, temperature=0.0) for m in MESSAGES]
    return [(r.text, r.finish) for r in replies], chat


def cache_contents(chat):
    return [to_numpy(a)[..., : chat.cache.length, :] for a in (chat.cache.k, chat.cache.v)]


@pytest.fixture(scope="module")
def plain(model, tok):
    return conversation(Chat(model, tok, max_len=512))


@HOST
@pytest.mark.parametrize("speculate,taps", [("eagle", ()), ("lookup", ()), ("eagle-lookup", ()), ("auto", ()),
                                            ("eagle", (1,)), ("auto", (1,))],
                         ids=["eagle", "lookup", "eagle-lookup", "auto", "eagle3", "auto-eagle3"])
def test_a_speculative_chat_replies_as_plain_chat(model, tok, plain, speculate, taps):
    want, reference = plain
    chat = SpeculativeChat(model, tok, proposers(model, taps, speculate), speculate, max_len=512, trial_tokens=8)
    got, chat = conversation(chat)
    assert got == want
    assert "end of turn" in {finish for _, finish in want} and "max_new_tokens" in {finish for _, finish in want}
    assert chat.cached_text == reference.cached_text and chat.pending == reference.pending
    assert chat.seq == tok.encode(chat.cached_text)[: chat.cache.length] and len(chat.seq) == chat.cache.length
    for a, b in zip(cache_contents(chat), cache_contents(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@HOST
def test_auto_measures_each_candidate_then_says_what_it_chose(model, tok):
    """At each reply's choice, the fastest candidate where it took at most SPECULATION_MARGIN of plain's ms/token,
    else plain, by the timings of that moment (the chosen one's later rounds add to them)."""
    chat = SpeculativeChat(model, tok, proposers(model), "auto", max_len=512, trial_tokens=8)
    choices, current = [], chat.current

    def choosing():
        undecided = chat.chosen is None
        name = current()
        if undecided and chat.chosen is not None:
            choices.append(({n: chat.ms_per_token(n) for n in chat.measured}, chat.chosen, chat.choice_note))
        return name

    chat.current = choosing
    conversation(chat)
    assert set(chat.measured) == {"plain", "eagle", "lookup"}
    assert all(tokens >= 8 for _, tokens in chat.measured.values())
    assert len(choices) >= 2
    for ms, chosen, note in choices:
        fastest = min(ms, key=ms.get)
        assert chosen == (fastest if ms[fastest] <= SPECULATION_MARGIN * ms["plain"] else "plain"), ms
        assert note.endswith(f"-> {chosen}") and "ms/token" in note


@HOST
@pytest.mark.parametrize("taps, name", [((), "eagle"), ((1,), "eagle"), ((), "eagle-lookup"), ((), "auto")],
                         ids=["eagle", "eagle3", "eagle-lookup", "auto-plain"])
def test_the_draft_reads_every_cached_position_once(model, tok, taps, name, monkeypatch):
    """The rows handed to the EAGLE draft cover the cache: after each turn the draft's synced positions plus
    the rows it has not read equal the target's cache length; an EAGLE-3 draft's rows hold its taps too. So too
    under "auto" when plain decoding wins every reply: a later reply may choose the draft again."""
    if name == "auto":
        monkeypatch.setattr(SpeculativeChat, "ms_per_token", lambda self, candidate: float(candidate != "plain"))
    chat = SpeculativeChat(model, tok, proposers(model, taps, name), name, max_len=512, trial_tokens=4)
    for message in MESSAGES:
        chat.turn(message, max_new_tokens=40, temperature=0.0)
        proposer = chat.proposers["eagle" if name == "auto" else name]
        assert proposer.synced + len(chat.unsynced) == chat.cache.length
        assert chat.unsynced.shape[-1] == (len(taps) + 1) * model.config.n_embd


@HOST
def test_bad_choices_are_one_line_errors(model, tok):
    with pytest.raises(ValueError, match="speculate must be 'auto' or one of"):
        SpeculativeChat(model, tok, proposers(model), "medusa")
    with pytest.raises(ValueError, match="trial_tokens must be an int in 1..4096"):
        SpeculativeChat(model, tok, proposers(model), "auto", trial_tokens=0)


@HOST
def test_the_chat_command_speculates_and_says_what_auto_chose(model, tok, capsys):
    """``chat --speculate lookup`` prints plain chat's reply; ``--speculate auto`` names its measured choice."""
    from minillm.tools.chat_cli import main

    def loader(name, weights):
        return model, tok

    outputs = []
    for speculate in ("off", "lookup"):
        assert main(["--prompt", MESSAGES[1], "--temperature", "0", "--max-new-tokens", "40", "--speculate",
                     speculate], loader=loader) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()
    assert main(["--prompt", MESSAGES[1], "--temperature", "0", "--speculate", "auto"], loader=loader) == 1
    assert "EAGLE draft" in capsys.readouterr().err  # the shipped draft was trained for another model: one line


@pytest.mark.uses_exercise("13.1")
def test_a_draft_in_the_targets_blocks_runs_on_either_backend():
    """On the host its blocks are packed for the kernels; under the strict stand-in (and on a GPU) they are
    uploaded and dequantized there. Either way the greedy output is the target's own."""
    from test_quantized_model import TINY, tiny_params

    from minillm.generate import generate
    from minillm.token_tree import tree_generate

    target = Llama(TINY, tiny_params()[0])
    subset = list(range(0, TINY.vocab_size, 2))
    params = {k: to_numpy(v) for k, v in EagleDraft.init(target, subset).params.items()}
    draft = EagleDraft(target, params, subset, keep_blocks=True)
    prompt = [3, 14, 15, 9, 26, 5]
    out = tree_generate(target, prompt, 16, EagleProposer(draft, depth=3), temperature=0.0)
    assert out.tokens == generate(target, prompt, 16, temperature=0.0).tokens


@HOST
@pytest.mark.parametrize("winner", ["plain", "eagle", "lookup"])
def test_whatever_auto_chooses_the_replies_and_the_cache_stay_plain_chats(model, tok, plain, winner, monkeypatch):
    """The choice made in the middle of a reply (and plain chat's own loop from then on, when plain wins)."""
    monkeypatch.setattr(SpeculativeChat, "ms_per_token", lambda self, name: 0.0 if name == winner else 1.0)
    want, reference = plain
    got, chat = conversation(SpeculativeChat(model, tok, proposers(model), "auto", max_len=512, trial_tokens=5))
    assert chat.chosen == winner and got == want
    assert chat.seq == tok.encode(chat.cached_text)[: chat.cache.length] and len(chat.seq) == chat.cache.length
    for a, b in zip(cache_contents(chat), cache_contents(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_chat_lookup_verifies_at_most_a_row_tile_of_the_4_bit_kernels():
    """A chat's prompt lookup drafts at most LOOKUP_DRAFT tokens even where the text repeats far longer, and the
    verify of such a chain (drafts + the last token) is a row tile of its own: no padded rows, no 16-row pass."""
    from types import SimpleNamespace

    from minillm import qkernels
    from minillm.speculative_chat import LOOKUP_DRAFT, chat_proposers

    lookup = chat_proposers(None, "lookup", "smollm2-135m")["lookup"]
    text = list(range(40))
    tree = lookup.propose(SimpleNamespace(seq=text + text[:3], room=100)).tree
    assert tree.size == LOOKUP_DRAFT + 1 and tree.depth == LOOKUP_DRAFT
    assert qkernels.row_tile(LOOKUP_DRAFT + 1) == LOOKUP_DRAFT + 1
    lone = lookup.propose(SimpleNamespace(seq=text + [7, 99, 3], room=100)).tree  # only "3" occurred before
    assert lone.size == 1  # a chat's lookups start from 2 tokens (LOOKUP_MIN_NGRAM)


def test_chat_eagle_drafts_the_measured_chain_length_and_auto_tries_it_with_lookup():
    """A chat's EAGLE proposer drafts EAGLE_DEPTH tokens a round (the shipped draft, the real model's vocabulary);
    "auto" times that chain with lookup's beside it, and lookup alone."""
    from minillm.registry import load_model
    from minillm.speculative_chat import EAGLE_DEPTH, LOOKUP_DRAFT, LOOKUP_MIN_NGRAM, chat_proposers

    model, _ = load_model("smollm2-135m")
    eagle = chat_proposers(model, "eagle", "smollm2-135m")["eagle"]
    assert eagle.max_depth == EAGLE_DEPTH == 1 and eagle.mode == "chain" and eagle.confidence == 0
    auto = chat_proposers(model, "auto", "smollm2-135m")
    assert set(auto) == {"eagle-lookup", "lookup"} and isinstance(auto["lookup"], PromptLookup)
    both = auto["eagle-lookup"]
    assert isinstance(both, EagleLookup) and both.eagle.max_depth == EAGLE_DEPTH and both.max_draft == LOOKUP_DRAFT
    assert both.min_ngram == auto["lookup"].min_ngram == LOOKUP_MIN_NGRAM == 2


@HOST
@pytest.mark.parametrize("lookup_ms, chosen", [(0.95, "plain"), (0.85, "lookup")])
def test_auto_speculates_only_where_a_proposer_beat_plain_by_the_margin(model, tok, lookup_ms, chosen, monkeypatch):
    """A proposer whose trial was faster than plain's by less than SPECULATION_MARGIN (noise on a busy machine) is
    not chosen; one faster by more is."""
    assert 0.85 < SPECULATION_MARGIN < 0.95
    times = {"plain": 1.0, "eagle": 2.0, "lookup": lookup_ms}
    monkeypatch.setattr(SpeculativeChat, "ms_per_token", lambda self, name: times[name])
    _, chat = conversation(SpeculativeChat(model, tok, proposers(model), "auto", max_len=512, trial_tokens=5))
    assert chat.chosen == chosen and chat.choice_note.endswith(f"-> {chosen}")


@HOST
def test_auto_takes_turns_and_leaves_each_candidates_first_round_untimed(model, tok, monkeypatch):
    """On trial, the candidate with the fewest timed tokens decodes the next round (so the candidates share the
    same stretch of text and the same load on the machine), and each one's first round, where a draft catches up
    on the prompt, adds nothing to its timing."""
    picks, current = [], SpeculativeChat.current

    def recorded(self):
        before = {name: list(m) for name, m in self.measured.items()}
        name = current(self)
        if self.chosen is None:
            picks.append((name, before))
        return name

    monkeypatch.setattr(SpeculativeChat, "current", recorded)
    chat = SpeculativeChat(model, tok, proposers(model), "auto", max_len=512, trial_tokens=8)
    chat.turn(MESSAGES[0], max_new_tokens=60, temperature=0.0)
    assert chat.chosen is not None and len(picks) > 6
    names = [name for name, _ in picks]
    assert names[:6] == ["plain", "plain", "eagle", "eagle", "lookup", "lookup"]
    seen = set()
    for (name, before), (_, after) in zip(picks, picks[1:]):
        on_trial = {n: m[1] for n, m in before.items() if m[1] < 8}
        assert before[name][1] == min(on_trial.values())  # the fewest timed tokens decodes next
        timed = after[name][1] - before[name][1]
        assert (timed > 0) == (name in seen)  # the first round untimed, every later one timed
        seen.add(name)


@HOST
def test_auto_chooses_again_at_every_reply_on_half_of_what_it_measured_before(model, tok, plain, monkeypatch):
    """Each reply halves the timings kept so far (MEMORY) and starts a trial in which every candidate times at least
    half of ``trial_tokens`` again; the choice follows the reply, and the replies stay plain chat's."""
    from minillm.speculative_chat import MEMORY

    winners = ["lookup", "plain", "eagle", "lookup"]
    replies, choices, new_reply = [], [], SpeculativeChat.new_reply

    def recorded_new_reply(self):
        before = {name: list(m) for name, m in self.measured.items()}
        new_reply(self)
        replies.append((before, {name: list(m) for name, m in self.measured.items()}))

    def choose(self):
        deciding = self.chosen is None and not any(self.on_trial(name) for name in self.proposers)
        name = current(self)
        if deciding:
            choices.append((len(replies) - 1, self.chosen, dict(self.in_reply)))
        return name

    current = SpeculativeChat.current
    monkeypatch.setattr(SpeculativeChat, "new_reply", recorded_new_reply)
    monkeypatch.setattr(SpeculativeChat, "current", choose)
    monkeypatch.setattr(SpeculativeChat, "ms_per_token",
                        lambda self, name: 0.0 if name == winners[len(replies) - 1] else 1.0)
    want, _ = plain
    got, chat = conversation(SpeculativeChat(model, tok, proposers(model), "auto", max_len=512, trial_tokens=8))
    assert got == want and len(replies) == len(MESSAGES)
    for before, after in replies:
        assert after == {name: [MEMORY * s, MEMORY * n] for name, (s, n) in before.items()}
    chosen_in = [reply for reply, _, _ in choices]
    assert len(set(chosen_in)) == len(chosen_in) >= 3  # one choice a reply, in most replies
    assert all(chosen == winners[reply] for reply, chosen, _ in choices)
    assert all(n >= 4 for _, _, in_reply in choices for n in in_reply.values())
    assert {chosen for _, chosen, _ in choices} >= {"plain", "eagle"}
    assert chat.chosen in (None, winners[-1])


@HOST
def test_auto_loads_the_kernels_of_every_row_tile_before_its_trial(monkeypatch):
    """Constructing an "auto" chat runs each row tile of the 4-bit kernels through the target and the draft, so that
    no kernel loads (or compiles) inside a timed round."""
    from test_quantized_model import TINY, tiny_params

    from minillm import qkernels

    target = Llama(TINY, tiny_params()[0])
    weights = [*target.params.values(), *target.stacked.values(), target.lm_head]
    formats = {w.format for w in weights if isinstance(w, qkernels.Packed)}
    assert {"Q8_0", "Q4_1"} <= formats
    subset = list(range(0, TINY.vocab_size, 2))
    params = {k: to_numpy(v) for k, v in EagleDraft.init(target, subset).params.items()}
    draft = EagleDraft(target, params, subset, keep_blocks=True)
    loaded = {}
    monkeypatch.setattr(qkernels, "_COMPILED", loaded)
    SpeculativeChat(target, CharChatTokenizer(), {"eagle-lookup": EagleLookup(EagleProposer(draft, depth=1), 5),
                                                  "lookup": PromptLookup()}, "auto", max_len=64)
    assert {(fmt, rows, False) for fmt in formats for rows in qkernels.row_tiles()} <= set(loaded)
