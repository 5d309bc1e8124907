"""``bench real-speculation``'s own logic on a tiny Llama: the cost model, the greedy identity check
before timing (a method whose output differs is refused, nothing timed), every run ending with the reply's end
of turn, and the JSON keys."""

import argparse
from types import SimpleNamespace

import numpy as np
import pytest

from minillm.config import LlamaConfig
from minillm.draft_free import PromptLookup
from minillm.eagle import EagleDraft, EagleProposer
from minillm.llama import Llama
from minillm.tools.benchmarks import real_speculation as rs
from minillm.tools.benchmarks.common import BenchmarkError

CFG = LlamaConfig(vocab_size=16, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_hidden=24)
ARGS = argparse.Namespace(max_new_tokens=12, repeat=1)
USES = pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "8.1", "8.2", "8.3", "9.1", "9.2", "9.3")


def stats(accepted, rounds, verified, accept_s, checked=None, new_tokens=None):
    return SimpleNamespace(accepted=accepted, checked=accepted + 5 if checked is None else checked, rounds=rounds,
                           new_tokens=accepted + rounds if new_tokens is None else new_tokens, target_calls=rounds,
                           verified=verified, accept_s=accept_s)


def test_interpolate_and_the_cost_model():
    costs = {1: 1.0, 2: 1.2, 4: 1.6}
    assert rs.interpolate(costs, 3) == pytest.approx(1.4)
    assert rs.interpolate(costs, 9) == 1.6 and rs.interpolate(costs, 0.5) == 1.0
    cell = rs.Cell(ratios=[1.5, 1.7, 1.6], whole_ratios=[1.2, 1.3, 1.1])
    cell.add(stats(20, 10, 30, 0.05, checked=25, new_tokens=30), draft_s=0.1, draft_calls=40, catch_up_s=0.022,
             catch_up_calls=1)
    sampling = {0.0: 0.001, 1.0: 0.03}
    (row,) = rs.rows_of({("eagle-chain", "chat", 0.0): cell}, t_step=0.05, costs=costs, sampling=sampling)
    # tau = (20 + 10) / 10 = 3; n = 1 + 30 / 10 = 4 -> v 1.6; c = 0.1 / 10 / 0.05 = 0.2; a = 0.05 / 10 / 0.05 = 0.1
    assert row["tau"] == 3.0 and row["v_n"] == 1.6 and row["draft_c"] == 0.2 and row["accept_a"] == 0.1
    assert row["predicted_speedup"] == pytest.approx(3 * 1.001 / 1.9, abs=0.01) and row["speedup"] == 1.6
    (hot,) = rs.rows_of({("eagle-chain", "chat", 1.0): cell}, t_step=0.05, costs=costs, sampling=sampling)
    assert hot["sample_s"] == 0.03 and hot["predicted_speedup"] == pytest.approx(3 * 1.03 / 1.9, abs=0.01)
    assert row["speedup_with_prefill"] == 1.2
    assert row["alpha"] == 0.8
    assert row["c_per_forward"] == pytest.approx(0.1 / 40 / 0.05)  # a draft forward against a target step
    assert row["c_after_prompt"] == pytest.approx(0.078 / 39 / 0.05)  # without the first forward, over the prompt
    assert row["prompt_catch_up"] == pytest.approx(0.022 / 0.05, abs=0.01)  # that forward in steps, per prompt
    no_draft = rs.Cell(ratios=[1.0], whole_ratios=[1.0])
    no_draft.add(stats(0, 1, 0, 0.0), draft_s=0.1, draft_calls=0)
    (lookup,) = rs.rows_of({("lookup", "chat", 0.0): no_draft}, t_step=0.05, costs=costs, sampling=sampling)
    assert lookup["c_per_forward"] is None and lookup["c_after_prompt"] is None and lookup["prompt_catch_up"] is None


def test_the_prediction_is_the_median_of_each_prompts_own():
    """Like the measured speed-up (a median of per-prompt ratios), the prediction is the median of per-prompt
    predictions, not one from the pooled counts: prompts with tau 1, 1 and 4 predict 1, 1 and 4 (median 1) at
    v = 1, where the pooled tau ((0 + 0 + 3 accepted + 3 rounds) / 3 rounds = 2) would predict 2."""
    costs = {1: 1.0, 16: 1.0}
    cell = rs.Cell(ratios=[1.0, 1.0, 4.0], whole_ratios=[1.0, 1.0, 1.0])
    for accepted in (0, 0, 3):
        cell.add(stats(accepted, 1, 3, 0.0), draft_s=0.0, draft_calls=0)
    (row,) = rs.rows_of({("lookup", "code", 0.0): cell}, t_step=0.05, costs=costs, sampling={0.0: 0.0})
    assert row["tau"] == 2.0 and row["predicted_speedup"] == 1.0


@USES
def test_the_sampling_and_judging_terms_are_measured():
    """s: a plain token's softmax and draw costs time at T = 1 (positive, finite); a: every round's judgement is
    timed into ``SpecStats.accept_s``."""
    model = Llama.init(CFG, seed=1)
    s = rs.sampling_costs(model, [1, 2, 3], [0.0, 1.0], t_step=1e-3)
    assert set(s) == {0.0, 1.0} and all(0 < v < 1e3 for v in s.values())
    result = rs.tree_generate(model, [1, 2, 3, 1, 2], 10, PromptLookup(), temperature=1.0, seed=0)
    assert result.stats.rounds > 0 and result.stats.accept_s > 0


@USES
def test_a_method_that_changes_the_greedy_output_is_refused(monkeypatch):
    model = Llama.init(CFG, seed=1)
    draft = EagleDraft.init(model, np.arange(0, 16, 2))
    proposers = {"eagle-chain": EagleProposer(draft), "lookup": PromptLookup()}
    cells = {(m, "chat", 0.0): rs.Cell() for m in proposers}
    ids = [1, 2, 3, 4, 1, 2]
    rs.run_prompt(model, ids, ARGS, list(proposers), proposers, 0.0, cells, "chat", seed=0, eos=-1)
    assert all(c.identical and len(c.ratios) == 1 and c.rounds > 0 for c in cells.values())
    assert cells[("eagle-chain", "chat", 0.0)].draft_calls >= cells[("eagle-chain", "chat", 0.0)].rounds
    reply = rs.generate(model, ids, ARGS.max_new_tokens, temperature=0.0).tokens  # the draft holds the even ids
    eagle = cells[("eagle-chain", "chat", 0.0)]
    assert (eagle.reply_tokens, eagle.in_vocab) == (len(reply), sum(t % 2 == 0 for t in reply))
    assert cells[("lookup", "chat", 0.0)].reply_tokens == 0  # no vocabulary to hold them
    real = rs.tree_generate

    def off_by_one(*args, **kwargs):
        result = real(*args, **kwargs)
        result.tokens[-1] = (result.tokens[-1] + 1) % CFG.vocab_size
        return result

    monkeypatch.setattr(rs, "tree_generate", off_by_one)
    with pytest.raises(BenchmarkError, match="eagle-chain: greedy output differs from plain decoding"):
        rs.run_prompt(model, ids, ARGS, list(proposers), proposers, 0.0, cells, "chat", seed=0, eos=-1)


def test_reply_length_ends_with_the_end_of_turn():
    assert rs.reply_length([5, 3, 7, 9, 1, 2, 3, 4, 5, 6, 7, 8], eos=6, longest=12) == 10  # through the eos
    assert rs.reply_length([5, 3, 7, 9, 1, 2, 3, 4, 5, 6], eos=15, longest=10) == 10  # none: all of them
    assert rs.reply_length([5, 7, 9], eos=7, longest=12) == rs.MIN_REPLY  # a reply of 2: still 8 timed tokens
    assert rs.reply_length([5, 7, 9], eos=7, longest=4) == 4


@USES
def test_every_run_stops_at_the_replys_end_of_turn():
    """The model wrote on past its end of turn and those tokens were timed too: a reply shorter than
    --max-new-tokens put whatever came after it into every speed-up."""
    model = Llama.init(CFG, seed=1)
    proposers = {"lookup": PromptLookup()}
    ids = [1, 2, 3, 4, 1, 2]
    tokens = rs.generate(model, ids, ARGS.max_new_tokens, temperature=0.0).tokens
    eos = tokens[9]
    want = rs.reply_length(tokens, eos, ARGS.max_new_tokens)
    assert rs.MIN_REPLY <= want < ARGS.max_new_tokens, (tokens, want)  # the reply ends before the limit
    cells = {("lookup", "chat", 0.0): rs.Cell()}
    rs.run_prompt(model, ids, ARGS, ["lookup"], proposers, 0.0, cells, "chat", seed=0, eos=eos)
    assert cells[("lookup", "chat", 0.0)].new_tokens == want


@USES
def test_the_chains_depth_and_confidence_reach_the_proposer(monkeypatch):
    """--depth and --confidence size EAGLE's chain, alone and with lookup's beside it; --draft-head reaches the
    draft's load."""
    model = Llama.init(CFG, seed=1)
    heads = []

    def load(cls, target, path, head_format):
        heads.append(head_format)
        return EagleDraft.init(target, [0, 3, 5])

    monkeypatch.setattr(EagleDraft, "load", classmethod(load))
    args = argparse.Namespace(draft="draft.npz", depth=3, tree_nodes=12, confidence=0.85, draft_head="Q4_1")
    chain = rs.make_proposer("eagle-chain", model, args)
    assert (chain.mode, chain.max_depth, chain.confidence) == ("chain", 3, 0.85)
    assert heads == ["Q4_1"]
    joined = rs.make_proposer("eagle-lookup", model, args).eagle
    assert (joined.max_depth, joined.confidence) == (3, 0.85)
