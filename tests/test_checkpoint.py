"""Checkpoints: round trip, atomic writes, and clear errors for missing or corrupt files."""

import numpy as np
import pytest

from minillm import CharTokenizer, CheckpointError, checkpoint, load_model, save_model
from minillm.backend import to_numpy
from minillm.checkpoint import HEADER_KEY, atomic_save_npz, encode_header, read_npz


def test_round_trip_float32_and_float16(tmp_path, tiny_model):
    tok = CharTokenizer("abcdefghijklm")
    idx = np.array([[1, 2, 3, 4]])
    for dtype, atol in ((np.float32, 0), (np.float16, 1e-2)):
        path = tmp_path / f"m-{np.dtype(dtype).name}.npz"
        save_model(path, tiny_model, tok, dtype=dtype, notes={"val_loss": 1.5})
        model, tok2 = load_model(path)
        assert tok2.chars == tok.chars and model.config == tiny_model.config
        assert model.params["wte.weight"].dtype == np.float32  # loading restores float32
        np.testing.assert_allclose(to_numpy(model.forward(idx)), to_numpy(tiny_model.forward(idx)), atol=atol)


def test_missing_and_corrupt_files_name_the_file(tmp_path, tiny_model):
    with pytest.raises(CheckpointError, match="not found.*nope.npz"):
        load_model(tmp_path / "nope.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"this is not a zip file")
    with pytest.raises(CheckpointError, match="corrupt.*bad.npz"):
        load_model(bad)
    good = tmp_path / "good.npz"
    save_model(good, tiny_model, CharTokenizer("abcdefghijklm"))
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated.npz"):
        load_model(truncated)


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, tiny_model, monkeypatch):
    """Atomic save: if writing dies midway, the old file is untouched and no temp file is left."""
    path = tmp_path / "m.npz"
    tok = CharTokenizer("abcdefghijklm")
    save_model(path, tiny_model, tok)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(path, tiny_model, tok)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.npz"]


def test_unknown_name_lists_the_models_and_the_checkpoint_layer_treats_it_as_a_path():
    with pytest.raises(CheckpointError, match="unknown model 'no-such-model': use one of target, draft, smollm2-135m"):
        load_model("no-such-model")
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.load_model("no-such-model")


def write_checkpoint(path, header, arrays):
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda h: h | {"tokenizer": {"type": "char", "chars": "abcdefghijkl"}},
         "tokenizer has 12 tokens, its config vocab_size 13"),
        (lambda h: [h], "header is not a JSON object"),
        (lambda h: h | {"config": "GPT-2"}, "header 'config' is not a JSON object"),
        (lambda h: h | {"tokenizer": ["a", "b"]}, "header 'tokenizer' is not a JSON object"),
        (lambda h: h | {"config": h["config"] | {"n_layer": "two"}}, "inconsistent checkpoint"),
    ],
    ids=["tokenizer-vs-vocab", "header-list", "config-string", "tokenizer-list", "config-bad-value"],
)
def test_inconsistent_headers_are_one_line_checkpoint_errors(tmp_path, tiny_model, edit, message):
    """A header of the wrong shape, or a tokenizer that does not fit the model's vocabulary, fails at
    load time (not mid-generation, not with an AttributeError) with one line naming the file."""
    good = tmp_path / "good.npz"
    save_model(good, tiny_model, CharTokenizer("abcdefghijklm"))
    header, arrays = read_npz(good)
    bad = tmp_path / "bad.npz"
    write_checkpoint(bad, edit(header), arrays)
    with pytest.raises(CheckpointError) as exc_info:
        load_model(bad)
    assert message in one_line(exc_info) and "bad.npz" in str(exc_info.value)


def test_a_text_file_or_a_folder_is_not_a_checkpoint(tmp_path):
    text = tmp_path / "notes.npz"
    text.write_text("these are my notes, not a model\n")
    with pytest.raises(CheckpointError, match="notes.npz: not an .npz archive") as exc_info:
        load_model(text)
    assert "allow_pickle" not in one_line(exc_info)
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file"):
        load_model(tmp_path)


def test_files_are_written_with_the_users_umask_not_0600(tmp_path, tiny_model):
    """mkstemp makes its temp file 0o600, and the rename kept that mode: a model the user saved could
    not be read by their group. A written file gets 0o666 less the umask, as open() would give it."""
    old = checkpoint.os.umask(0o022)
    try:
        save_model(tmp_path / "m.npz", tiny_model, CharTokenizer("abcdefghijklm"))
    finally:
        checkpoint.os.umask(old)
    assert (tmp_path / "m.npz").stat().st_mode & 0o777 == 0o644


def test_stale_temp_files_of_one_destination_are_removed(tmp_path):
    """A writer killed mid-write (kill -9) leaves m.npz.<8 chars>.tmp behind; remove_stale_temps(m.npz)
    deletes those, and only those: not another file's temp files, not a name of another pattern."""
    names = ["m.npz.ab_cd123.tmp", "m.npz.x1y2z3w4.tmp", "other.npz.ab_cd123.tmp", "m.npz.notes.tmp", "m.npz"]
    for name in names:
        (tmp_path / name).write_text("x")
    removed = checkpoint.remove_stale_temps(tmp_path / "m.npz")
    assert sorted(p.name for p in removed) == ["m.npz.ab_cd123.tmp", "m.npz.x1y2z3w4.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.npz", "m.npz.notes.tmp", "other.npz.ab_cd123.tmp"]


def test_declared_shapes_are_checked_before_any_array_is_read(tmp_path, tiny_model, array_reads):
    """A small compressed file whose wte declares a huge shape (here 13 x 2,000,000 zeros, 40 kB on
    disk, 104 MB once read) was decompressed in full before the model refused it: the member headers
    are checked against the config first, and no array is read."""
    save_model(tmp_path / "good.npz", tiny_model, CharTokenizer("abcdefghijklm"))
    header, arrays = read_npz(tmp_path / "good.npz")
    arrays["wte.weight"] = np.zeros((13, 2_000_000), dtype=np.float32)
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, **arrays, **{HEADER_KEY: encode_header(header)})
    assert bomb.stat().st_size < 1_000_000

    array_reads.clear()
    with pytest.raises(CheckpointError) as exc_info:
        load_model(bomb)
    assert "wte.weight declares shape (13, 2000000)" in one_line(exc_info) and "bomb.npz" in str(exc_info.value)
    assert len(array_reads) == 1 and array_reads[0][0] < 10_000  # the JSON header alone


@pytest.mark.parametrize("dtype", [np.int8, np.complex64, np.float64])
def test_weights_of_another_dtype_are_refused_before_any_array_is_read(tmp_path, tiny_model, array_reads, dtype):
    """int8 or complex weights were cast to float32 and ran (complex ones losing their imaginary part):
    a weight must be float16 or float32, as save_model writes it, checked from the member headers."""
    save_model(tmp_path / "good.npz", tiny_model, CharTokenizer("abcdefghijklm"))
    header, arrays = read_npz(tmp_path / "good.npz")
    arrays["ln_f.weight"] = arrays["ln_f.weight"].astype(dtype)
    write_checkpoint(tmp_path / "bad.npz", header, arrays)
    array_reads.clear()
    with pytest.raises(CheckpointError) as exc_info:
        load_model(tmp_path / "bad.npz")
    assert f"ln_f.weight is {np.dtype(dtype).name}, expected float16 or float32" in one_line(exc_info)
    assert len(array_reads) == 1


def test_a_member_that_is_not_the_size_it_declares_is_refused_unread(tmp_path, array_reads):
    """An .npy member whose header declares 2 GB over 16 bytes of data made np.load allocate the 2 GB
    before the read failed; so did any file read without expected shapes. A member that is not an
    array at all is refused too."""
    import io
    import zipfile

    lying = tmp_path / "lying.npz"
    write_checkpoint(lying, {"format": "x"}, {})
    npy = io.BytesIO()
    np.lib.format.write_array_header_1_0(npy, {"descr": "<f8", "fortran_order": False, "shape": (268435456,)})
    with zipfile.ZipFile(lying, "a") as archive:
        archive.writestr("a.npy", npy.getvalue() + bytes(16))
    array_reads.clear()
    with pytest.raises(CheckpointError, match=r"corrupt checkpoint .*lying.npz: member 'a.npy' declares "
                       r"\(268435456,\) float64 but holds 16 bytes"):
        read_npz(lying)
    assert array_reads == []
    with_notes = tmp_path / "notes.npz"
    write_checkpoint(with_notes, {"format": "x"}, {"a": np.zeros(2)})
    with zipfile.ZipFile(with_notes, "a") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(CheckpointError, match="member 'notes.txt' is not an array"):
        read_npz(with_notes)


def test_non_finite_weights_are_refused_when_loading(tmp_path, tiny_model):
    """A diverged run's model (NaN weights) loaded silently, and generate printed token 0 forever:
    loading refuses it, naming the file and the weight."""
    tiny_model.params["h.0.mlp.c_fc.weight"][0, 0] = np.nan
    save_model(tmp_path / "nan.npz", tiny_model, CharTokenizer("abcdefghijklm"))
    with pytest.raises(CheckpointError) as exc_info:
        load_model(tmp_path / "nan.npz")
    assert "h.0.mlp.c_fc.weight holds non-finite values" in one_line(exc_info) and "nan.npz" in str(exc_info.value)
