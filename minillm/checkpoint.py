"""Checkpoints: one ``.npz`` file holding the weights plus a JSON header (config, tokenizer, notes).

Files are written atomically: to a temporary file in the same folder (``<name>.<8 chars>.tmp``),
flushed, then renamed over the destination, so a crash mid-write never leaves a half-written
checkpoint behind; the temp files a killed writer left are removed by ``remove_stale_temps``.
Loading checks before it trusts: the shapes every array declares (read from the archive's member
headers, before any array is read) against the shapes the config implies, and every weight finite.
``load_model("target")`` and ``load_model("draft")`` load the models shipped in the package.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .config import GPTConfig
from .model import DEFAULT_ATTENTION, GPT
from .tokenizer import CharTokenizer

HEADER_KEY = "__header__.json"
SHIPPED_DIR = Path(__file__).parent / "models"
SHIPPED = ("target", "draft")


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt or inconsistent."""


TEMP_SUFFIX = ".tmp"
HEADER_LIMIT = 1 << 24  # bytes: the largest JSON header a file may declare (a real one is a few kB)


def temp_pattern(path) -> re.Pattern:
    """The names of ``atomic_save_npz``'s temp files for ``path``: "m.npz" -> m.npz.<8 chars>.tmp."""
    return re.compile(re.escape(Path(path).name) + r"\.[A-Za-z0-9_]{8}" + re.escape(TEMP_SUFFIX))


def remove_stale_temps(path) -> list[Path]:
    """Delete the temp files a killed ``atomic_save_npz(path)`` left beside ``path`` -> those deleted.
    Only names of our own pattern for this one file are touched."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = temp_pattern(path)
    stale = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def umask_mode() -> int:
    """The mode a new file gets from open(): 0o666 less the process's umask (mkstemp's own is 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_save_npz(path, arrays: dict) -> None:
    """np.savez to a temp file beside ``path``, fsync, then os.replace: all or nothing. The file gets
    the mode any new file of the user gets (their umask), not the temp file's private 0o600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, umask_mode())
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def encode_header(header: dict) -> np.ndarray:
    return np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)


def member_shapes(archive: zipfile.ZipFile) -> dict:
    """{array name: (shape, dtype)} as each .npy member of an open .npz declares it, read from the
    members' headers only (a few bytes each): nothing is decompressed beyond them."""
    shapes = {}
    for name in archive.namelist():
        with archive.open(name) as member:
            version = np.lib.format.read_magic(member)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else (
                np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(member)
        shapes[name.removesuffix(".npy")] = (tuple(shape), dtype)
    return shapes


def read_npz(path, expected_shapes=None) -> tuple[dict, dict]:
    """Read any minillm .npz -> (header dict, arrays dict); each error is one line naming the file.

    ``expected_shapes(header) -> {name: shape}`` (optional): the arrays the header implies; a file
    that declares other names or shapes is refused before any array is read (a small file must not
    make the loader decompress gigabytes).
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file (.npz)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):  # before np.load, which takes any other file for a pickle
        raise CheckpointError(f"corrupt checkpoint {path}: not an .npz archive (or cut short)")
    try:
        with zipfile.ZipFile(path) as archive:
            shapes = member_shapes(archive)
            header_shape, _ = shapes.pop(HEADER_KEY, ((0,), None))
            if int(np.prod(header_shape)) > HEADER_LIMIT:
                raise ValueError(f"its header declares {int(np.prod(header_shape))} bytes")
            header = json.loads(np.load(archive.open(HEADER_KEY + ".npy"), allow_pickle=False).tobytes().decode())
            if not isinstance(header, dict):
                raise CheckpointError(f"corrupt checkpoint {path}: its header is not a JSON object")
            if expected_shapes is not None:
                check_shapes({k: shape for k, (shape, _) in shapes.items()}, expected_shapes(header), path)
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files if k != HEADER_KEY}
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    return header, arrays


def check_shapes(declared: dict, expected: dict, path) -> None:
    """The arrays a file declares {name: shape} must be exactly those expected; CheckpointError otherwise."""
    missing, extra = sorted(expected.keys() - declared.keys()), sorted(declared.keys() - expected.keys())
    if missing or extra:
        raise CheckpointError(f"inconsistent checkpoint {path}: arrays do not match its config "
                              f"(missing {missing[:3]}, extra {extra[:3]})")
    for name, shape in expected.items():
        if tuple(declared[name]) != tuple(shape):
            raise CheckpointError(f"inconsistent checkpoint {path}: {name} declares shape {declared[name]}, "
                                  f"its config implies {tuple(shape)}")


def check_finite(arrays: dict, path) -> None:
    """Every weight a finite number; CheckpointError naming the first that is not (a diverged run)."""
    for name, array in arrays.items():
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise CheckpointError(f"corrupt checkpoint {path}: {name} holds non-finite values (nan or inf); "
                                  "the training run that wrote it diverged")


def header_section(header: dict, key: str, path) -> dict:
    """``header[key]``, which must be a JSON object; CheckpointError naming the file otherwise."""
    section = header.get(key)
    if not isinstance(section, dict):
        raise CheckpointError(f"inconsistent checkpoint {path}: header {key!r} is not a JSON object")
    return section


def save_model(path, model, tokenizer: CharTokenizer, dtype=np.float32, notes: dict | None = None):
    """Write weights (as ``dtype``; float16 halves the file) + config + tokenizer to ``path``."""
    header = {
        "format": "minillm-checkpoint-1",
        "config": model.config.to_dict(),
        "tokenizer": tokenizer.to_dict(),
        "notes": notes or {},
    }
    arrays = {k: v.astype(dtype) for k, v in model.numpy_params().items()}
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def shipped_path(name: str) -> Path:
    return SHIPPED_DIR / f"{name}.npz"


def check_not_shipped(path, overwrite_shipped: bool = False) -> None:
    """Files shipped in the package's models/ folder (models, Medusa heads) are replaced only when asked."""
    path = Path(path)
    if path.resolve().parent == SHIPPED_DIR.resolve() and path.exists() and not overwrite_shipped:
        raise ValueError(f"{path} is shipped with minillm: write elsewhere (--out PATH), "
                         "or pass --overwrite-shipped to replace it")


def model_config(header: dict, path) -> GPTConfig:
    """The GPTConfig of a model checkpoint's header; CheckpointError (one line) for anything else."""
    if header.get("format") != "minillm-checkpoint-1":
        raise CheckpointError(f"{path} is not a minillm model checkpoint")
    config_dict = header_section(header, "config", path)
    header_section(header, "tokenizer", path)
    try:
        return GPTConfig.from_dict(config_dict)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"inconsistent checkpoint {path}: {exc}") from exc


def check_destination(path, overwrite: bool = False) -> None:
    """Before any work: ``path`` can be written (a file, not a folder, in a writable folder) and does
    not exist unless ``overwrite``; ValueError (one line) otherwise. Then its stale temp files go."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: name the file to write")
    folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())  # the first that exists
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {path}: {folder} is not a writable folder")
    if path.exists() and not overwrite:
        raise ValueError(f"{path} already exists: pass --overwrite to replace it, or write elsewhere")
    remove_stale_temps(path)


def load_model(name_or_path, attention: str = DEFAULT_ATTENTION):
    """'target', 'draft' or a path -> (GPT, CharTokenizer); weights come back as float32."""
    name = str(name_or_path)
    path = shipped_path(name) if name in SHIPPED else Path(name)
    if name in SHIPPED and not path.is_file():
        raise CheckpointError(
            f"shipped model {name!r} not found at {path}; "
            f"train it with: python -m minillm train --preset {name} --out {path}"
        )
    header, arrays = read_npz(path, expected_shapes=lambda header: model_config(header, path).param_shapes())
    check_finite(arrays, path)
    config = model_config(header, path)
    try:
        tokenizer = CharTokenizer.from_dict(header_section(header, "tokenizer", path))
        model = GPT(config, arrays, attention=attention)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"inconsistent checkpoint {path}: {exc}") from exc
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"inconsistent checkpoint {path}: its tokenizer has {tokenizer.vocab_size} tokens, "
                              f"its config vocab_size {config.vocab_size}")
    return model, tokenizer


def model_notes(name_or_path) -> dict:
    """The notes saved with a checkpoint (training command, losses, ...)."""
    name = str(name_or_path)
    path = shipped_path(name) if name in SHIPPED else name
    header, _ = read_npz(path)
    return header_section(header, "notes", path) if "notes" in header else {}
