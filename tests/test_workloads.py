"""Training prompts and workloads (``minillm.workloads``): reproducible, distinct, held apart; prompt file errors."""

import json

import pytest

from minillm.workloads import KINDS, WORKLOADS, check_held_out, read_prompts, training_prompts


def test_training_prompts_are_reproducible_distinct_and_of_every_kind():
    a, b = training_prompts(300, seed=1), training_prompts(300, seed=1)
    assert a == b and len({p["prompt"] for p in a}) == 300
    assert {p["kind"] for p in a} == set(KINDS)
    assert training_prompts(300, seed=2) != a


def test_workloads_are_held_out_and_the_check_catches_a_shared_prompt():
    check_held_out(WORKLOADS, training_prompts(1200))
    assert {w["kind"] for w in WORKLOADS} == set(KINDS)
    with pytest.raises(ValueError, match="1 workload prompts are also training prompts"):
        check_held_out(WORKLOADS, [{"prompt": WORKLOADS[3]["prompt"], "kind": "chat"}])


def test_read_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt": "Hi?", "kind": "chat"}), "", json.dumps({"prompt": "x", "kind": "code"})]
    path.write_text("\n".join(lines))
    assert read_prompts(path) == [{"prompt": "Hi?", "kind": "chat"}, {"prompt": "x", "kind": "code"}]
    for text, message in [("{oops", "p.jsonl:1: not a JSON object"), ('{"prompt": "a", "kind": "poem"}', "kind must"),
                          ('{"text": "a"}', 'expected {"prompt"'), ("", "holds no prompts")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_prompts(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="int >= 1"):
        training_prompts(0)
