"""Loading what EAGLE training writes and reads: the draft file, the data parts, the training run's files.

- a draft file is checked before any array is read: its format, the model it was trained for (the
  error names the EAGLE draft, the file, both models and the command that trains one), every
  array's name, shape and dtype; then every number finite;
- ``load_draft`` (``--eagle-draft``): a missing file is "not found", an empty name is refused;
- eagle-data's parts record the run's arguments: ``--resume`` refuses a part of other arguments, a
  truncated part, a part of another model; reading refuses a part with an impossible length, a
  folder with a part missing, and features that are not finite (a data error, not a learning rate);
- eagle-train ``--resume`` never replaces the file at ``--out``;
- held-out accuracy counts every held-out position, fewer than one window of them too;
- eagle-taps (EAGLE-3's lower features): each row is the input of the tapped block as that block reads it,
  joined before the top feature; a taps folder of another model or with a part missing is refused.
"""

import argparse
import re

import numpy as np
import pytest

from minillm.backend import to_numpy
from minillm.checkpoint import HEADER_KEY, CheckpointError, atomic_save_npz, encode_header, read_npz
from minillm.config import LlamaConfig
from minillm.eagle import EagleDraft, load_draft
from minillm.eagle_train import DraftData, held_out_accuracy, read_answers, write_answers, write_taps
from minillm.llama import Llama
from minillm.tools.eagle_cli import written_texts

# the data and the accuracy run the target (a Llama: 8.1-8.3) with its KV cache (3.x)
USES = pytest.mark.uses_exercise("3.1", "3.2", "3.3", "8.1", "8.2", "8.3")

CFG = LlamaConfig(vocab_size=8, block_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_hidden=24)
SUBSET = [0, 2, 3, 5]


@pytest.fixture(scope="module")
def target():
    return Llama.init(CFG, seed=5)


@pytest.fixture
def draft_file(target, tmp_path):
    path = tmp_path / "eagle.npz"
    EagleDraft.init(target, SUBSET, seed=1).save(path)
    return path


def rewrite(path, out, edit):
    """Write ``path``'s header and arrays, changed by ``edit(header, arrays)``, to ``out``."""
    header, arrays = read_npz(path)
    edit(header, arrays)
    atomic_save_npz(out, arrays | {HEADER_KEY: encode_header(header)})
    return out


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------------------------
# the draft file


def test_a_draft_for_another_model_names_the_draft_both_models_and_eagle_train(target, draft_file):
    """EAGLE loaded its draft through Medusa's check: "these Medusa heads were trained for another model ...
    medusa-train". The one check in checkpoint.py names what was loaded and how to train one."""
    other = Llama.init(LlamaConfig(**{**CFG.to_dict(), "n_embd": 32}), seed=5)
    with pytest.raises(CheckpointError) as exc_info:
        EagleDraft.load(other, draft_file)
    message = one_line(exc_info)
    assert "EAGLE draft trained for another model (config differs: n_embd 16 vs 32)" in message
    assert str(draft_file) in message and "n_embd 16" in message and "eagle-train" in message
    assert "Medusa" not in message and "medusa-train" not in message
    with pytest.raises(CheckpointError, match="another model .lm_head_sha256 differs"):
        EagleDraft.load(Llama.init(CFG, seed=6), draft_file)


@pytest.mark.parametrize("edit,message", [
    (lambda h, a: a.update(extra=np.zeros(3, np.float16)), r"unexpected \['extra'\]"),
    (lambda h, a: a.update({"fc.weight": a["fc.weight"].astype(np.complex64)}), "fc.weight is complex64"),
    (lambda h, a: a.update({"fc.weight": a["fc.weight"].astype(np.int8)}), "fc.weight is int8"),
    (lambda h, a: a.update(subset=a["subset"].astype(np.float32)), "subset is float32"),
    (lambda h, a: a.update(subset=a["subset"][:3]), r"subset declares shape \(3,\)"),
    (lambda h, a: h.update(subset_size=10**9), "draft vocabulary size"),
    (lambda h, a: h.update(tap_layers=[1]), r"missing \['fuse.weight'\]"),
    (lambda h, a: h.update(tap_layers=[2]), "tap_layers must list blocks in 1..1"),
], ids=["extra-array", "complex", "int8", "float-subset", "short-subset", "huge-subset", "taps-no-fuse", "bad-tap"])
def test_a_draft_of_other_arrays_is_refused_before_any_array_is_read(target, draft_file, tmp_path, array_reads,
                                                                     edit, message):
    """An extra array (a 9.7 MB draft with 2 GB of zeros beside it peaked at 3.3 GB before it was refused),
    complex or int8 weights (accepted, and cast), a subset of another dtype or size: refused from the
    member headers, with one line naming the array, and no array but the JSON header read."""
    bad = rewrite(draft_file, tmp_path / "bad.npz", edit)
    array_reads.clear()
    with pytest.raises(CheckpointError) as exc_info:
        EagleDraft.load(target, bad)
    assert "bad.npz" in one_line(exc_info)
    assert len(array_reads) == 1 and len(array_reads[0]) == 1, array_reads  # the header only
    assert re.search(message, str(exc_info.value)), str(exc_info.value)


def test_a_fused_draft_saves_and_loads_its_tap_layers(target, tmp_path):
    fused = EagleDraft.init(target, SUBSET, seed=1, tap_layers=(1,))
    fused.save(tmp_path / "fused.npz")
    back = EagleDraft.load(target, tmp_path / "fused.npz", keep_blocks=False)
    assert back.tap_layers == (1,) and set(back.params) == set(fused.params)
    np.testing.assert_array_equal(to_numpy(back.params["fuse.weight"]),
                                  to_numpy(fused.params["fuse.weight"]).astype(np.float16))


def test_a_nan_draft_is_refused(target, draft_file, tmp_path):
    def nan(header, arrays):
        arrays["layers.0.mlp.down_proj.weight"][0, 0] = np.nan

    with pytest.raises(CheckpointError, match="down_proj.weight holds non-finite values"):
        EagleDraft.load(target, rewrite(draft_file, tmp_path / "nan.npz", nan))


def test_load_draft_says_what_is_missing(target, draft_file, tmp_path):
    """``--eagle-draft /missing`` said that no draft ships for the model; ``--eagle-draft ""`` silently
    loaded the shipped one."""
    with pytest.raises(CheckpointError, match=f"EAGLE draft not found: {tmp_path / 'missing.npz'}"):
        load_draft(target, "smollm2-135m", tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="EAGLE draft file name is empty"):
        load_draft(target, "smollm2-135m", "")
    with pytest.raises(ValueError, match="no EAGLE draft ships for model 'target'; train one .*eagle-train.*"
                       "then pass --eagle-draft DRAFT.npz"):
        load_draft(target, "target")
    assert load_draft(target, "target", draft_file).subset.tolist() == SUBSET


# ----------------------------------------------------------------------------------------------
# eagle-data's parts


class ByteTokenizer:
    """A chat tokenizer for the 8-token target: a character's id is its code mod 8; eos is 7."""

    eos_token_id = 7

    def encode(self, text):
        return [ord(c) % CFG.vocab_size for c in text]

    def apply_chat_template(self, messages):
        return "sys\nuser\n" + messages[0]["content"] + "\n"

    def decode(self, ids):
        return "".join("abcdefgh"[i] for i in ids)


PROMPTS = [{"prompt": p, "kind": "chat"} for p in ("ab", "abc", "b", "cab", "ba", "bca")]


def write(target, out, **kwargs):
    options = {"max_new_tokens": 6, "batch": 2, "seed": 0, "progress": False} | kwargs
    return write_answers(target, ByteTokenizer(), PROMPTS, out, **options)


@pytest.fixture(scope="module")
def data_dir(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle-data")
    write(target, out)
    return out


def copy_of(data_dir, tmp_path):
    for part in data_dir.iterdir():
        (tmp_path / part.name).write_bytes(part.read_bytes())
    return tmp_path


@USES
def test_parts_read_back_whole(target, data_dir):
    data = read_answers(data_dir, target)
    assert data["parts"] == 3 and len(data["sequences"]) == len(PROMPTS)
    assert all(len(f) == len(s) - 1 for s, f in zip(data["sequences"], data["features"]))


@USES
def test_written_texts_are_the_answers_without_their_end_of_turn(target, data_dir):
    """``eagle-data --source rewrites --texts DIR`` reworks what the target wrote: each answer of the folder as
    text, its end of turn left out (it would be handed back inside the next prompt)."""
    tok = ByteTokenizer()
    data = read_answers(data_dir, target)
    answers = [[int(t) for t in s[p:]] for s, p in zip(data["sequences"], data["prompt_lengths"])]
    assert sum(a[-1] == tok.eos_token_id for a in answers) >= 1  # a reply that ended is there
    assert written_texts(data_dir, target, tok) == [tok.decode(a[:-1] if a[-1] == tok.eos_token_id else a)
                                                     for a in answers]


@USES
@pytest.mark.parametrize("option,message", [({"seed": 1}, "seed 0 vs 1"), ({"max_new_tokens": 5},
                                            "max_new_tokens 6 vs 5")], ids=["seed", "lengths"])
def test_resume_refuses_parts_of_other_arguments(target, data_dir, tmp_path, option, message):
    """eagle-data --resume kept parts written with another seed or answer length, and reported success."""
    out = copy_of(data_dir, tmp_path)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(CheckpointError, match=f"part-00000.npz was written with other arguments .*{message}"):
        write(target, out, resume=True, **option)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@USES
def test_resume_refuses_a_truncated_part_and_another_models_part(target, data_dir, tmp_path):
    """A truncated part was kept as it was and the run reported success; so was a part of another model."""
    out = copy_of(data_dir, tmp_path)
    part = out / "part-00001.npz"
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="corrupt EAGLE data part .*part-00001.npz"):
        write(target, out, resume=True)
    (out / "part-00001.npz").unlink()
    with pytest.raises(CheckpointError, match="EAGLE data part written by another model"):
        write(Llama.init(CFG, seed=6), out, resume=True)
    write(target, out, resume=True)  # the missing part written again, the others kept
    assert read_answers(out, target)["parts"] == 3


@USES
@pytest.mark.parametrize("edit,message", [
    (lambda h, a: h.update(lengths=[-1, *h["lengths"][1:]]), "lengths must be 2 ints in 2..40"),
    (lambda h, a: a["features"].__setitem__((0, 0), np.nan), "features holds non-finite values"),
    (lambda h, a: a["ids"].__setitem__(0, 99), r"token ids outside 0..7"),
], ids=["negative-length", "nan-features", "id-out-of-range"])
def test_reading_refuses_a_part_that_does_not_hold_together(target, data_dir, tmp_path, edit, message):
    """A part with a negative length trained silently; NaN features stopped training with "try a lower
    learning rate" (it is a data error)."""
    out = copy_of(data_dir, tmp_path)
    rewrite(out / "part-00002.npz", out / "part-00002.npz", edit)
    with pytest.raises(CheckpointError) as exc_info:
        read_answers(out, target)
    assert re.search(message, one_line(exc_info)) and "learning rate" not in str(exc_info.value)


@USES
def test_reading_refuses_a_folder_with_a_part_missing(target, data_dir, tmp_path):
    out = copy_of(data_dir, tmp_path)
    (out / "part-00001.npz").unlink()
    with pytest.raises(ValueError, match="lacks part-00001.npz .*eagle-data --resume"):
        read_answers(out, target)
    assert read_answers(out, target, max_parts=1)["parts"] == 1  # the first part alone is whole


TEXTS = [{"prompt": p, "answer": a, "kind": "text"} for p, a in (("a", "bcab"), ("b", "caab"), ("c", "abba"))]


@USES
def test_fixed_texts_are_read_teacher_forced_and_join_the_answers(target, data_dir, tmp_path):
    """A fixed answer (``stdlib_texts``) is read as text, not written by the target: its tokens are the text's
    own and its features are the target's hidden states on them; a second folder joins the first, in order,
    and never lends the held-out set a position of fixed text."""
    write_answers(target, ByteTokenizer(), TEXTS, tmp_path, max_new_tokens=1, batch=2, seed=0, progress=False)
    texts = read_answers(tmp_path, target)
    tok = ByteTokenizer()
    for item, seq, feats in zip(sorted(TEXTS, key=lambda t: t["prompt"]), texts["sequences"], texts["features"]):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": item["prompt"]}]) + item["answer"])
        assert list(seq[:len(ids)]) == ids and len(seq) == len(ids) + 1  # the text, then one token of its own
        expected = to_numpy(target.hidden(np.array([seq[:-1]])))[0].astype(np.float16)
        np.testing.assert_allclose(feats.astype(np.float32), expected.astype(np.float32), atol=2e-3)
    both = read_answers([data_dir, tmp_path], target)
    answers = read_answers(data_dir, target)
    assert texts["parts"] == 3 and read_answers([data_dir, tmp_path], target, [1, 2])["parts"] == 1 + 2  # N per folder
    with pytest.raises(ValueError, match="3 part counts for 2 data folders"):
        read_answers([data_dir, tmp_path], target, [1, 1, 1])
    assert both["parts"] == answers["parts"] + texts["parts"]
    assert both["kinds"] == answers["kinds"] + ["text"] * len(TEXTS)
    for i in range(len(both["sequences"])):
        assert both["sequences"][i].tobytes() == (answers["sequences"] + texts["sequences"])[i].tobytes()
    draft = EagleDraft.init(target, SUBSET, seed=1)
    data = synthetic_data(target, [36] * 40)
    data["kinds"] = ["text"] * 39 + ["chat"]  # every 20th is held out: answers 19 (text) and 39 (chat)
    rows, _, _ = DraftData(data, draft).held
    starts = np.cumsum([0] + [len(f) for f in data["features"]])
    assert len(rows) and (rows >= starts[39]).all()  # only the target's own answer is scored
    with pytest.raises(ValueError, match="no EAGLE data folder given"):
        read_answers([], target)


@USES
def test_taps_are_the_tapped_blocks_input_as_it_reads_it(target, data_dir, tmp_path):
    """Tap of block 1 = the stream after block 0, RMS-normed with block 1's input_layernorm: the same unit
    vector as the model's own final norm after one block, under another weight; joined before f."""
    summary = write_taps(target, data_dir, tmp_path / "taps", layers=(1,), progress=False)
    assert summary["parts"] == 3 and summary["tokens_written"] == sum(len(s) for s in read_answers(
        data_dir, target)["sequences"])
    plain, fused = read_answers(data_dir, target), read_answers(data_dir, target, taps_dirs=[tmp_path / "taps"],
                                                                  tap_layers=(1,))
    C, p = CFG.n_embd, target.params
    w_tap, w_norm = to_numpy(p["layers.1.input_layernorm.weight"]), to_numpy(p["norm.weight"])
    for seq, f, f3 in zip(plain["sequences"], plain["features"], fused["features"]):
        assert f3.shape == (len(seq) - 1, 2 * C)
        np.testing.assert_array_equal(f3[:, C:], f)  # the top feature, as it was
        one_block = to_numpy(target.hidden(np.array([seq[:-1]]), layers=1))[0]
        np.testing.assert_allclose(f3[:, :C].astype(np.float32) / w_tap, one_block / w_norm, rtol=1e-2, atol=1e-2)
        assert np.abs(f3[:, :C].astype(np.float32) / w_tap - f.astype(np.float32) / w_norm).max() > 0.1  # not the top
    (tmp_path / "taps" / "part-00001.npz").unlink()
    with pytest.raises(ValueError, match="lacks taps parts .*eagle-taps --resume"):
        read_answers(data_dir, target, taps_dirs=[tmp_path / "taps"], tap_layers=(1,))
    with pytest.raises(ValueError, match="already holds 2 taps parts"):
        write_taps(target, data_dir, tmp_path / "taps", layers=(1,), progress=False)
    part = tmp_path / "taps" / "part-00002.npz"
    rewrite(part, tmp_path / "kept.npz", lambda h, a: None)
    rewrite(part, part, lambda h, a: h.update(lengths=h["lengths"][::-1]))  # another part's answers
    with pytest.raises(CheckpointError, match="part-00002.npz does not match its data part: its lengths differ"):
        write_taps(target, data_dir, tmp_path / "taps", layers=(1,), resume=True, progress=False)
    (tmp_path / "kept.npz").replace(part)
    write_taps(target, data_dir, tmp_path / "taps", layers=(1,), resume=True, progress=False)  # the missing one
    assert len(read_answers(data_dir, target, taps_dirs=[tmp_path / "taps"], tap_layers=(1,))["features"]) == 6
    with pytest.raises(ValueError, match="tap layers must be distinct blocks in 1..1"):
        write_taps(target, data_dir, tmp_path / "other", layers=(2,), progress=False)


# ----------------------------------------------------------------------------------------------
# training on the data


def synthetic_data(target, lengths, seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, CFG.vocab_size, n) for n in lengths]
    feats = [to_numpy(target.hidden(np.array([s]))[0, :-1]).astype(np.float16) for s in seqs]
    return {"sequences": seqs, "features": feats, "kinds": ["chat"] * len(seqs),
            "temperatures": [0.0] * len(seqs), "prompt_lengths": [4] * len(seqs)}


@USES
def test_held_out_accuracy_counts_a_held_out_set_shorter_than_a_window(target):
    """With fewer than 128 held-out positions (one window) the accuracy read 0.0: it counts them all."""
    draft = EagleDraft.init(target, SUBSET, seed=1)
    data = DraftData(synthetic_data(target, [36] * 6), draft)
    rows, x1, y = data.held
    assert 0 < len(rows) < data.window
    _, logits = draft.step(data.features[rows].astype(np.float32), x1)
    expected = float((to_numpy(logits).argmax(axis=-1) == y).mean())
    assert expected > 0
    assert held_out_accuracy(draft, data) == pytest.approx(expected)
    f, hits = data.features[rows].astype(np.float32), 0  # the second guess of a round from each row i:
    for i in range(len(rows) - 1):  # a cache of rows 0..i, then the draft's own feature of row i
        cache = draft.new_cache(len(rows))
        f_hat, _ = draft.step(f[: i + 1], x1[: i + 1], cache)
        _, logits = draft.step(f_hat[i:], x1[i + 1 : i + 2], cache)
        hits += int(to_numpy(logits).argmax() == y[i + 1])
    assert held_out_accuracy(draft, data, step=2) == pytest.approx(hits / (len(rows) - 1))


@USES
def test_train_tokens_draws_whole_answers_from_every_folder(target):
    """A data-scaling run's first N positions were the first folder's alone (the templates' chat, then the
    standard library's code, then fixed text): N positions now come from whole answers drawn across all."""
    draft = EagleDraft.init(target, SUBSET, seed=1)
    data = synthetic_data(target, [36] * 40)
    data["kinds"] = ["chat"] * 20 + ["code"] * 20  # two folders, one after the other
    every = DraftData(data, draft)
    some = DraftData(data, draft, 200)
    rows = some.train[0]
    assert len(rows) == 200 and set(rows) <= set(every.train[0])
    answers = np.searchsorted(some.starts, rows, side="right") - 1
    assert answers.min() < 20 <= answers.max()  # both folders
    whole = np.bincount(np.searchsorted(every.starts, every.train[0], side="right") - 1, minlength=40)
    drawn = np.bincount(answers, minlength=40)
    assert ((drawn == 0) | (drawn == whole)).sum() >= 39  # whole answers, but for the one the count cuts
    assert len(DraftData(data, draft, 10**6).train[0]) == len(every.train[0])


@USES
def test_data_with_nothing_to_score_or_nan_features_is_refused(target):
    draft = EagleDraft.init(target, SUBSET, seed=1)
    data = synthetic_data(target, [36] * 5 + [2])  # the held-out answer (the last) has no pair
    with pytest.raises(ValueError, match="hold no position to score"):
        DraftData(data, draft)
    data = synthetic_data(target, [36] * 6)
    data["features"][2][3, 1] = np.nan
    with pytest.raises(ValueError, match="features hold nan or inf: the data is broken") as exc_info:
        DraftData(data, draft)
    assert "lower learning rate" not in str(exc_info.value)


@pytest.mark.host_only
def test_eagle_train_resume_never_replaces_the_output(tmp_path):
    """eagle-train --resume with no state file trained from scratch and replaced an existing precious.npz:
    the file at --out is replaced only with --overwrite, checked before the model is loaded."""
    from minillm.tools.eagle_cli import add_train_arguments, run_train

    precious = tmp_path / "precious.npz"
    precious.write_bytes(b"mine")
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    argv = ["--data", str(tmp_path), "--out", str(precious), "--model", "no-such-model"]
    with pytest.raises(ValueError, match="precious.npz already exists: pass --overwrite"):
        run_train(p.parse_args([*argv, "--resume"]))
    with pytest.raises(CheckpointError, match="unknown model 'no-such-model'"):  # past the check
        run_train(p.parse_args([*argv, "--overwrite"]))
    assert precious.read_bytes() == b"mine"
    parsed = p.parse_args([*argv, "--parts", "3", "4", "--ahead", "2"])  # one part count per folder
    assert parsed.parts == [3, 4] and parsed.ahead == 2
    with pytest.raises(SystemExit):
        p.parse_args([*argv, "--ahead", "9"])
