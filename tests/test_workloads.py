"""Training prompts and workloads (``minillm.workloads``): reproducible, distinct, held apart; prompt file errors."""

import json

import pytest

from minillm.workloads import KINDS, WORKLOADS, check_held_out, read_prompts, stdlib_prompts, training_prompts


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


def stdlib_like(root):
    """A tiny standard library: one package module, one module with functions (documented, long, private)."""
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text('"""A package that does several useful things for its users."""\n')
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text('def test_skipped():\n    """Never a prompt: tests are skipped."""\n')
    body = "\n".join(f"    x = x + {i}" for i in range(8))
    (root / "mod.py").write_text(
        '"""Tools for counting things in lists of numbers and strings."""\n\n'
        f'def count_even(xs, start=0):\n    """Count the even numbers of xs from index start on."""\n{body}\n'
        "    return sum(1 for v in xs[start:] if v % 2 == 0)\n\n"
        'def _private(x):\n    """A private helper, never a prompt."""\n    return x\n')
    return root


def test_stdlib_prompts_come_from_docstrings_and_source(tmp_path):
    root = stdlib_like(tmp_path)
    prompts = stdlib_prompts(3, seed=0, root=root)
    assert prompts == stdlib_prompts(3, seed=0, root=root)
    assert {p["kind"] for p in prompts} == {"chat", "code", "grounded"}
    text = "\n".join(p["prompt"] for p in prompts)
    assert "count_even(xs, start=0)" in text and "Count the even numbers of xs from index start on." in text
    assert "pkg" in text or "mod" in text
    assert "_private" not in text and "test_skipped" not in text
    with pytest.raises(ValueError, match="at most 4 standard-library prompts"):
        stdlib_prompts(50, root=root)
