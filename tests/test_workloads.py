"""Training prompts, fixed texts and workloads (``minillm.workloads``): reproducible, distinct, held apart;
prompt file errors."""

import ast
import json

import pytest

from minillm.workloads import (
    ADVICE_FORMS,
    ADVICE_SITUATIONS,
    KINDS,
    LINE,
    OPINION_CHOICES,
    OPINION_FORMS,
    PLAN_FORMS,
    PLAN_OCCASIONS,
    PROGRAM_FORMS,
    PROGRAMS,
    REWRITE_FORMS,
    SHORTEST_TEXT,
    TEXT_CHARS,
    UTILITIES,
    WHY_FACTS,
    WHY_FORMS,
    WORKLOADS,
    WRITING_FORMS,
    advice_prompts,
    check_held_out,
    opinion_prompts,
    plan_prompts,
    program_prompts,
    read_prompts,
    rewrite_prompts,
    source_pieces,
    source_segment,
    stdlib_prompts,
    stdlib_texts,
    training_prompts,
    utility_prompts,
    whole_sentences,
    why_prompts,
    writing_prompts,
)


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


CHAT_UNSEEN = {"neighbour", "neighbour's", "dog", "barks", "pack", "hiking", "bread", "stale", "fresh", "studying",
               "focused"}

GROUNDED_UNSEEN = {"quarterly", "review", "projector", "slides", "windmill", "village", "mill", "landlord", "heating",
                   "rent", "machine", "tank", "filter"}

CODE_UNSEEN = {"chunks", "chunk", "bank", "account", "deposit", "withdraw", "balance", "csv", "column", "sorted",
               "length"}


@pytest.mark.parametrize("make, subjects, forms, kind, what, unseen", [
    (advice_prompts, ADVICE_SITUATIONS, ADVICE_FORMS, "chat", "advice prompts", CHAT_UNSEEN),
    (why_prompts, WHY_FACTS, WHY_FORMS, "chat", "why prompts", CHAT_UNSEEN),
    (program_prompts, PROGRAMS, PROGRAM_FORMS, "code", "program prompts", CODE_UNSEEN),
    (utility_prompts, UTILITIES, PROGRAM_FORMS, "code", "utility prompts", CODE_UNSEEN),
    (plan_prompts, PLAN_OCCASIONS, PLAN_FORMS, "chat", "plan prompts", CHAT_UNSEEN | {"trip", "travel", "packing"}),
    (opinion_prompts, OPINION_CHOICES, OPINION_FORMS, "chat", "opinion prompts",
     CHAT_UNSEEN | {"trip", "travel", "packing"}),
    (writing_prompts, PLAN_OCCASIONS, WRITING_FORMS, "chat", "writing prompts", CHAT_UNSEEN | GROUNDED_UNSEEN),
])
def test_pair_prompts_are_one_kind_reproducible_and_keep_the_unseen_prompts_unseen(make, subjects, forms, kind, what,
                                                                                    unseen):
    """Every subject x form once, all of one kind, a reproducible draw; none is a workload prompt, and no subject
    shares a content word with the main subjects of docs/unseen_prompts.jsonl's prompts of that kind (their
    neighbour's dog, packing for a hike, stale bread, studying at home; chunks of a list, a bank account, a CSV
    column, words by length), so a speed-up measured there stays unseen."""
    every = make(len(subjects) * len(forms), seed=3)
    assert every == make(len(every), seed=3) != make(len(every), seed=4)
    assert len({p["prompt"] for p in every}) == len(every) and {p["kind"] for p in every} == {kind}
    check_held_out(WORKLOADS, every)
    assert not [s for s in subjects if unseen & set(s.lower().replace(",", " ").split())]
    with pytest.raises(ValueError, match=f"at most {len(every)} {what}"):
        make(len(every) + 1)


def test_writing_forms_share_no_word_with_the_unseen_prompts():
    """The texts the target writes for ``rewrite_prompts`` start from these requests: none names a subject of the
    unseen chat or grounded prompts (a form once invited "a neighbour")."""
    words = {w.strip(".,").lower() for form in WRITING_FORMS for w in form.split()}
    assert not words & (CHAT_UNSEEN | GROUNDED_UNSEEN)


@pytest.mark.parametrize("text, whole", [
    ("Hi all. The party is on Friday! Bring a", "Hi all. The party is on Friday!"),
    ("- buy cake\n- call Tom\n- chairs fr", "- buy cake\n- call Tom"),
    ("Is it ready? Yes", "Is it ready?"),
    ("  Done.  ", "Done."),
    ("no end at all", ""),
])
def test_whole_sentences_cut_an_answer_after_its_last_sentence(text, whole):
    assert whole_sentences(text) == whole


def test_rewrite_prompts_rework_the_written_texts_whole_and_long_enough():
    """Each prompt is one of REWRITE_FORMS around one text cut to whole sentences; a text too short once cut, and a
    repeated one, are left out; every text x form at most once, reproducibly."""
    long_a, long_b = "A" * SHORTEST_TEXT + ". Then", "We meet at noon. " * 10
    texts = [long_a, long_b, long_b, "Too short. " + "and on without an end " * 10, "x" * 500]
    every = rewrite_prompts(texts, 2 * len(REWRITE_FORMS), seed=1)
    assert every == rewrite_prompts(texts, len(every), seed=1) != rewrite_prompts(texts, len(every), seed=2)
    kept = {"A" * SHORTEST_TEXT + ".", long_b.strip()}
    assert {p["kind"] for p in every} == {"grounded"} and len({p["prompt"] for p in every}) == len(every)
    assert {(f, t) for p in every for f in REWRITE_FORMS for t in kept if p["prompt"] == f.format(s=t)} == {
        (f, t) for f in REWRITE_FORMS for t in kept}
    with pytest.raises(ValueError, match=f"at most {len(every)} rewrite prompts"):
        rewrite_prompts(texts, len(every) + 1)


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


def test_source_segment_is_asts_on_every_line_ending_and_wide_characters():
    """ast.get_source_segment splits the whole source again on every call (53 s over the standard library);
    the segment from lines split once must be the same, for \\r\\n, \\r, form feeds and non-ASCII columns."""
    source = ('def f(x):\r\n    """Größe."""\r\n    return x\n\x0c\nclass C:\r    def g(self, é="ü"): return é\n'
              'y = [1,\n     2]  # no newline at the end')
    lines = LINE.findall(source)
    assert "".join(lines) == source
    nodes = [n for n in ast.walk(ast.parse(source)) if hasattr(n, "end_col_offset")]
    assert len(nodes) > 15
    for node in nodes:
        assert source_segment(lines, node) == ast.get_source_segment(source, node), ast.dump(node)


def test_stdlib_texts_answer_questions_with_the_librarys_own_text(tmp_path):
    root = stdlib_like(tmp_path)
    doc = "Read and write the tables of a spreadsheet, one row at a time, in any of its three dialects."
    (root / "sheet.py").write_text(f'"""{doc}"""\n\nclass Reader:\n    """{doc}"""\n')
    texts = stdlib_texts(4, seed=0, root=root)  # two modules' source, sheet's two docstrings
    assert texts == stdlib_texts(4, seed=0, root=root) and {t["kind"] for t in texts} == {"text"}
    by_prompt = {t["prompt"]: t["answer"] for t in texts}
    assert by_prompt["Show me part of the source code of the Python module mod."] in (root / "mod.py").read_text()
    assert by_prompt["What is the Python module sheet for?"] == doc == by_prompt["What does sheet.Reader do?"]
    assert "What is the Python module mod for?" not in by_prompt  # its docstring is under 80 characters
    assert "test_skipped" not in "".join(by_prompt.values())
    sheet = by_prompt["Show me part of the source code of the Python module sheet."]
    assert sheet == (root / "sheet.py").read_text().strip("\n")
    with pytest.raises(ValueError, match="at most 4 standard-library texts"):
        stdlib_texts(5, root=root)
    long = "".join(f"line {i:04d} of a module's source\n" for i in range(200))
    pieces = source_pieces(long)
    assert "\n".join(pieces) == long.strip("\n") and max(map(len, pieces)) <= TEXT_CHARS
