"""Checkpoints: round trip, atomic writes, and clear errors for missing or corrupt files."""

import numpy as np
import pytest

from minillm import CharTokenizer, CheckpointError, load_model, save_model
from minillm.backend import to_numpy


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


def test_unknown_shipped_name_is_treated_as_path():
    with pytest.raises(CheckpointError, match="not found"):
        load_model("no-such-model")
