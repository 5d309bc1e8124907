"""Checkpoints: one ``.npz`` file holding the weights plus a JSON header (config, tokenizer, notes).

Files are written atomically: to a temporary file in the same folder, flushed, then renamed over
the destination, so a crash mid-write never leaves a half-written checkpoint behind.
``load_model("target")`` and ``load_model("draft")`` load the models shipped in the package.
"""

from __future__ import annotations

import json
import os
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


def atomic_save_npz(path, arrays: dict) -> None:
    """np.savez to a temp file beside ``path``, fsync, then os.replace: all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
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


def read_npz(path) -> tuple[dict, dict]:
    """Read any minillm .npz -> (header dict, arrays dict); each error is one line naming the file."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file (.npz)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):  # before np.load, which takes any other file for a pickle
        raise CheckpointError(f"corrupt checkpoint {path}: not an .npz archive (or cut short)")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        header = json.loads(arrays.pop(HEADER_KEY).tobytes().decode())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt checkpoint {path}: its header is not a JSON object")
    return header, arrays


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


def load_model(name_or_path, attention: str = DEFAULT_ATTENTION):
    """'target', 'draft' or a path -> (GPT, CharTokenizer); weights come back as float32."""
    name = str(name_or_path)
    path = shipped_path(name) if name in SHIPPED else Path(name)
    if name in SHIPPED and not path.is_file():
        raise CheckpointError(
            f"shipped model {name!r} not found at {path}; "
            f"train it with: python -m minillm train --preset {name} --out {path}"
        )
    header, arrays = read_npz(path)
    if header.get("format") != "minillm-checkpoint-1":
        raise CheckpointError(f"{path} is not a minillm model checkpoint")
    config_dict, tokenizer_dict = (header_section(header, key, path) for key in ("config", "tokenizer"))
    try:
        config = GPTConfig.from_dict(config_dict)
        tokenizer = CharTokenizer.from_dict(tokenizer_dict)
        model = GPT(config, arrays, attention=attention)
    except (KeyError, TypeError, ValueError) as exc:
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
