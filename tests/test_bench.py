"""Benchmark helpers: they print numbers, so what is tested is what they time and return."""

import argparse
import time
from types import SimpleNamespace

import numpy as np
import pytest

from minillm import format_table, to_numpy
from minillm import model as model_module
from minillm.measure import STAND_INS, TimedProposer, decode_step_parts, paired_ratio, time_fn, time_paired, time_pairs
from minillm.tools import project
from minillm.tools.benchmarks import common
from minillm.tools.project import project_root


def test_time_paired_alternates_and_returns_the_candidates_result():
    calls = []

    def baseline():
        calls.append("a")
        time.sleep(0.002)

    def candidate():
        calls.append("b")
        return len(calls)

    base_s, cand_s, result = time_paired(baseline, candidate, repeat=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then strictly alternating
    assert result == len(calls)  # the last candidate run's result
    assert base_s >= 0.002 > cand_s >= 0.0

    calls.clear()
    base_times, cand_times, result = time_pairs(baseline, candidate, repeat=4)
    assert calls == ["a", "b"] * 5 and result == 10
    assert len(base_times) == len(cand_times) == 4  # one time per pair, in order
    assert min(base_times) >= 0.002 > max(cand_times)


def test_time_fn_warms_up_then_takes_the_median():
    calls = []
    assert time_fn(lambda: calls.append(1), warmup=2, repeat=5) >= 0.0
    assert len(calls) == 7


@pytest.mark.host_only
def test_paired_ratio_is_the_median_of_the_ratios_of_pairs():
    """Not the ratio of the medians (3 / 3 = 1 here), and pairs must pair: lists of unequal length are refused."""
    assert paired_ratio([2.0, 3.0, 9.0], [1.0, 3.0, 3.0]) == 2.0
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])


@pytest.mark.host_only
def test_timed_proposer_counts_only_propose():
    class Slow:
        max_depth = 3

        def propose(self, state):
            time.sleep(0.002)
            return state

        def observe(self, state, emitted, extra_logits):
            time.sleep(0.01)

    timed_proposer = TimedProposer(Slow())
    assert timed_proposer.propose("s") == "s" and timed_proposer.max_depth == 3
    timed_proposer.observe("s", [1], None)
    assert 0.002 <= timed_proposer.seconds < 0.01
    assert timed_proposer.catch_up_s == 0.0 and timed_proposer.catch_up_calls == 0  # no draft: no catch-up


def test_timed_proposer_keeps_the_drafts_catch_up_apart(monkeypatch):
    """The first propose that runs the draft (it reads the whole prompt) is kept apart, with its forwards; the
    round before it, which drafts nothing (the target reads the prompt), is not it. A clock the draft advances:
    round r with f forwards takes 10 f + r seconds."""
    from minillm import measure

    clock = [0.0]
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Draft:
        max_depth, draft_calls = 1, 0

        def propose(self, state):
            rounds, forwards = state
            self.draft_calls += forwards
            clock[0] += 10 * forwards + rounds
            return state

    timed_proposer = TimedProposer(Draft())
    for state in ((1, 0), (2, 2), (3, 1), (4, 1)):
        timed_proposer.propose(state)
    assert timed_proposer.seconds == 1 + 22 + 13 + 14
    assert timed_proposer.catch_up_s == 22 and timed_proposer.catch_up_calls == 2


def test_format_table_aligns_and_rounds():
    table = format_table([{"name": "a", "x": 1.23456}, {"name": "bbb", "x": 10.0}])
    assert table.splitlines() == ["name      x", "----  -----", "   a  1.235", " bbb     10"]


@pytest.mark.uses_exercise("3.1", "3.2")
def test_decode_step_parts_swaps_each_part_and_then_restores_the_model(tiny_model):
    """Each part is swapped on the model instance only (never in minillm.model), and put back: the
    instance holds no stand-in afterwards and computes what it computed before."""
    idx = np.array([[1, 2, 3, 4, 5]])
    before = to_numpy(tiny_model.forward(idx))
    module_functions = {name: getattr(model_module, name) for name in ("linear", "layer_norm", "gelu")}
    own = dict(vars(tiny_model))
    rows = decode_step_parts(tiny_model, context=6, steps=2, rounds=2)
    assert [r["part"] for r in rows] == ["whole step", *STAND_INS]
    assert rows[0]["share"] == 1.0 and all(r["step us"] > 0 for r in rows)
    assert {name: getattr(model_module, name) for name in module_functions} == module_functions
    assert vars(tiny_model).keys() == own.keys() and tiny_model.attention is own["attention"]
    np.testing.assert_array_equal(to_numpy(tiny_model.forward(idx)), before)  # the real ops and attention are back


def test_each_stand_in_really_replaces_its_part(tiny_model):
    """With the matmuls swapped out, the model's output changes: the stand-in is on the forward's path."""
    from minillm.measure import swapped

    idx = np.array([[1, 2, 3]])
    before = to_numpy(tiny_model.forward(idx))
    for name, fn in STAND_INS.values():
        with swapped(tiny_model, name, fn):
            assert not np.array_equal(to_numpy(tiny_model.forward(idx)), before), name


@pytest.mark.uses_exercise("3.1", "8.1", "8.2", "8.3")
def test_llama_stand_ins_replace_every_product_and_leave_the_rest():
    """With the products and the LM head swapped out a Llama's step returns zeros of the right shape and still
    writes its cache (the rest of the step runs); afterwards the model is as before."""
    from minillm.config import LlamaConfig
    from minillm.kv_cache import KVCache
    from minillm.llama import Llama
    from minillm.measure import llama_stand_ins, swapped

    model = Llama.init(LlamaConfig(vocab_size=16, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                                   n_hidden=24))
    idx = np.array([[1, 2, 3]])
    before = to_numpy(model.forward(idx))
    stand_ins = llama_stand_ins(model)
    calls = {}
    for part, (name, fn) in stand_ins.items():
        calls[part] = []
        stand_ins[part] = (name, lambda *a, fn=fn, part=part: calls[part].append(1) or fn(*a))
    cache = KVCache(model.config, max_len=8)
    with swapped(model, *stand_ins["weight products"]), swapped(model, *stand_ins["LM head"]):
        out = to_numpy(model.forward(idx, cache))
    assert out.shape == before.shape and not out.any() and cache.length == 3
    assert len(calls["weight products"]) == 4 * model.config.n_layer and len(calls["LM head"]) == 1
    rows = decode_step_parts(model, context=4, steps=2, rounds=2, stand_ins=llama_stand_ins(model))
    assert [r["part"] for r in rows] == ["whole step", "weight products", "LM head"]
    np.testing.assert_array_equal(to_numpy(model.forward(idx)), before)


def test_figures_go_where_the_options_say(tmp_path, monkeypatch):
    """Default: a folder outside the project; --out DIR: that folder; --update-docs: the project's docs/figures."""
    parser = argparse.ArgumentParser()
    common.add_output_args(parser)
    assert common.figure_dir(parser.parse_args([])) == common.DEFAULT_FIG_DIR
    assert common.figure_dir(parser.parse_args(["--out", str(tmp_path)])) == tmp_path
    assert common.figure_dir(parser.parse_args(["--update-docs"])) == project_root() / "docs" / "figures"
    assert project_root() not in common.DEFAULT_FIG_DIR.resolve().parents


def test_update_docs_outside_a_checkout_names_the_problem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(project, "__file__", str(tmp_path / "site-packages" / "minillm" / "project.py"))
    parser = argparse.ArgumentParser()
    common.add_output_args(parser)
    with pytest.raises(project.ProjectRootError, match="no minillm project found"):
        common.figure_dir(parser.parse_args(["--update-docs"]))


def test_json_output_is_a_new_file_written_whole(tmp_path):
    """--json OUT refuses a path that exists (argparse's usage error, the file unchanged); write_json writes
    all or nothing and never replaces a file that appeared after the options were checked."""
    import json

    p = argparse.ArgumentParser()
    common.add_json_arg(p, "the numbers")
    kept = tmp_path / "kept.json"
    kept.write_text("a user's file")
    with pytest.raises(SystemExit):
        p.parse_args(["--json", str(kept)])
    out = p.parse_args(["--json", str(tmp_path / "new.json")]).json
    common.write_json(out, {"ms": 1.5})
    assert json.loads(out.read_text()) == {"ms": 1.5}
    with pytest.raises(FileExistsError):
        common.write_json(kept, {"ms": 2})
    with pytest.raises(TypeError):
        common.write_json(tmp_path / "half.json", {"ms": object()})  # not JSON: nothing is left behind
    assert kept.read_text() == "a user's file"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["kept.json", "new.json"]
