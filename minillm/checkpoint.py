"""Checkpoints: one ``.npz`` file holding the weights plus a JSON header (config, tokenizer, notes).

Files are written atomically: to a temporary file in the same folder (``<name>.<8 chars>.tmp``),
flushed, then renamed over the destination, so a crash mid-write never leaves a half-written
checkpoint behind; the temp files a killed writer left are removed by ``remove_stale_temps``.
Loading checks before it trusts: the name, shape and dtype every array declares (read from the
archive's member headers, before any array is read) against what the file's header implies, then
every number finite. A trained add-on (Medusa heads, an EAGLE draft, their training files) names the
model it belongs to (``model_identity``); ``check_trained_for`` is the one check of it.
``load_model("target")`` and ``load_model("draft")`` load the models shipped in the package.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from .config import GPTConfig
from .model import DEFAULT_ATTENTION, GPT, check_weights, host_float32
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


FLOAT_WEIGHTS = (np.dtype(np.float16), np.dtype(np.float32))  # the dtypes a saved weight may have
TOKEN_IDS = (np.dtype(np.int32), np.dtype(np.int64))  # the dtypes a saved token id may have


def member_layout(archive: zipfile.ZipFile) -> dict:
    """{array name: (shape, dtype)} as each .npy member of an open .npz declares it, read from the
    members' headers only (a few bytes each): nothing is decompressed beyond them. ValueError for a
    member that is not an .npy array, or whose data is not the size its header declares."""
    layout = {}
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            raise ValueError(f"member {info.filename!r} is not an array (.npy)")
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else (
                np.lib.format.read_array_header_2_0)
            shape, _, dtype = read_header(member)
            data_bytes = info.file_size - member.tell()
        if dtype.hasobject or data_bytes != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"member {info.filename!r} declares {shape} {dtype} but holds {data_bytes} bytes")
        layout[info.filename.removesuffix(".npy")] = (tuple(shape), dtype)
    return layout


def read_header(archive: zipfile.ZipFile, layout: dict) -> dict:
    """The JSON header of an open .npz whose ``layout`` declares a uint8 header of at most HEADER_LIMIT bytes."""
    shape, dtype = layout.get(HEADER_KEY, ((0,), None))
    if dtype != np.uint8 or len(shape) != 1 or shape[0] > HEADER_LIMIT:
        raise ValueError(f"its header ({HEADER_KEY}) declares {shape} {dtype}, not at most {HEADER_LIMIT} bytes")
    with archive.open(HEADER_KEY + ".npy") as member:
        header = json.loads(np.lib.format.read_array(member, allow_pickle=False).tobytes().decode())
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header


def read_npz(path, expected=None, kind: str = "checkpoint") -> tuple[dict, dict]:
    """Read any minillm .npz -> (header dict, arrays dict); each error is one line naming ``kind`` and the file.

    ``expected(header) -> {name: (shape, allowed dtypes)}`` (optional): the arrays the header implies.
    It runs on the header alone (it may check the header first: its format, the model a file was
    trained for); a file that declares other names, shapes or dtypes is refused before any array is
    read (a small file must not make the loader allocate gigabytes), and every array it reads must
    hold finite numbers only.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a {kind} file (.npz)")
    if not path.is_file():
        raise CheckpointError(f"{kind} not found: {path}")
    if not zipfile.is_zipfile(path):  # before np.load, which takes any other file for a pickle
        raise CheckpointError(f"corrupt {kind} {path}: not an .npz archive (or cut short)")
    try:
        with zipfile.ZipFile(path) as archive:
            layout = member_layout(archive)
            header = read_header(archive, layout)
            del layout[HEADER_KEY]
            if expected is not None:
                check_layout(layout, expected(header), path, kind)
            arrays = {}
            for name in layout:
                with archive.open(name + ".npy") as member:
                    arrays[name] = np.lib.format.read_array(member, allow_pickle=False)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt {kind} {path}: {exc}") from exc
    if expected is not None:
        check_finite(arrays, path, kind)
    return header, arrays


def check_layout(declared: dict, expected: dict, path, kind: str = "checkpoint") -> None:
    """The arrays a file declares {name: (shape, dtype)} must be exactly those expected {name: (shape,
    allowed dtypes)}; CheckpointError otherwise."""
    missing, extra = sorted(expected.keys() - declared.keys()), sorted(declared.keys() - expected.keys())
    if missing or extra:
        raise CheckpointError(f"inconsistent {kind} {path}: its arrays do not match its header "
                              f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for name, (shape, dtypes) in expected.items():
        got_shape, got_dtype = declared[name]
        if got_shape != tuple(shape):
            raise CheckpointError(f"inconsistent {kind} {path}: {name} declares shape {got_shape}, "
                                  f"its header implies {tuple(shape)}")
        if got_dtype not in dtypes:
            raise CheckpointError(f"inconsistent {kind} {path}: {name} is {got_dtype}, "
                                  f"expected {' or '.join(str(d) for d in dtypes)}")


def check_finite(arrays: dict, path, kind: str = "checkpoint") -> None:
    """Every number finite; CheckpointError naming the first array that is not (nan or inf)."""
    for name, array in arrays.items():
        if not np.isfinite(array).all():
            raise CheckpointError(f"corrupt {kind} {path}: {name} holds non-finite values (nan or inf)")


def check_format(header: dict, fmt: str, path, kind: str) -> None:
    """``header["format"]`` must be ``fmt``; CheckpointError naming the file, the kind and the format found."""
    if header.get("format") != fmt:
        article = "an" if kind[:1] in "AEIOU" else "a"
        raise CheckpointError(f"{path} is not {article} {kind} file ({fmt}, found format {header.get('format')!r})")


def header_section(header: dict, key: str, path) -> dict:
    """``header[key]``, which must be a JSON object; CheckpointError naming the file otherwise."""
    section = header.get(key)
    if not isinstance(section, dict):
        raise CheckpointError(f"inconsistent checkpoint {path}: header {key!r} is not a JSON object")
    return section


# ----------------------------------------------------------------------------------------------
# trained add-ons (Medusa heads, an EAGLE draft): files that belong to one model


def model_identity(model) -> dict:
    """What ties a trained add-on to one model: its architecture, config and a sha256 of its LM head's float32 values.

    The values, not the storage: a GGUF model loaded with weights "q" (blocks) or "fp32" (dequantized at load) is
    one model within float32 rounding, so an add-on trained on either serves both and both get one identity."""
    lm = host_float32(model.lm_head)
    return {"architecture": type(model).__name__, "config": model.config.to_dict(),
            "lm_head_sha256": hashlib.sha256(lm.tobytes()).hexdigest()}


def describe_identity(identity: dict) -> str:
    """A model_identity in a few words: "Llama (n_layer 2, n_embd 16, vocab_size 8, LM head sha256 1a2b3c4d5e6f)"."""
    config = identity.get("config") if isinstance(identity.get("config"), dict) else {}
    sizes = ", ".join(f"{k} {config.get(k)}" for k in ("n_layer", "n_embd", "vocab_size"))
    return f"{identity.get('architecture')} ({sizes}, LM head sha256 {str(identity.get('lm_head_sha256'))[:12]})"


def check_trained_for(header: dict, model, path, kind: str, retrain: str, made: str = "trained for") -> None:
    """A trained add-on's file (``kind``: "EAGLE draft", "Medusa heads", ...) must name ``model`` as the
    model it was trained for (``made``: or written by); CheckpointError (one line) naming the file, both
    models and ``retrain``, the command that makes one for this model."""
    saved, actual = header.get("model"), model_identity(model)
    if not isinstance(saved, dict):
        raise CheckpointError(f"inconsistent {kind} {path}: its header names no model it was trained for")
    for key in ("architecture", "config", "lm_head_sha256"):
        if saved.get(key) != actual[key]:
            if key == "config" and isinstance(saved.get(key), dict):
                diff = [k for k in actual[key] if saved[key].get(k) != actual[key][k]]
                what = ", ".join(f"{k} {saved[key].get(k)!r} vs {actual[key][k]!r}" for k in diff[:3])
            else:
                what = f"{str(saved.get(key))[:12]} vs {actual[key][:12]}"
            raise CheckpointError(f"{path}: {kind} {made} another model ({key} differs: {what}): {made} "
                                  f"{describe_identity(saved)}, this model is {describe_identity(actual)}; "
                                  f"make one for this model with {retrain}")


def trained_file(path, shipped: Path, model_name: str, kind: str, retrain: str, option: str) -> Path:
    """The file of a trained add-on: ``path`` when one is given, else ``shipped``, the one shipped for
    ``model_name``; ValueError (one line) for an empty path, and when none is given and none ships (its
    hint: train one with ``retrain``, then pass ``option``)."""
    if path is None:
        if not shipped.is_file():
            plural = kind.endswith("s")  # "Medusa heads"
            raise ValueError(f"no {kind} {'ship' if plural else 'ships'} for model {model_name!r}; train "
                             f"{'them' if plural else 'one'} with {retrain}, then pass {option}")
        return shipped
    if not str(path).strip():
        raise ValueError(f"the {kind} file name is empty: name a file (.npz), or leave it out for the shipped one")
    return Path(path)


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


def load_model(name_or_path, attention: str = DEFAULT_ATTENTION, weights: str = "fp32"):
    """'target', 'draft' or a path -> (GPT, CharTokenizer). The file's weights are read as float32 and kept as
    ``weights`` says: "fp32", the arrays (the reference); "q", packed once for the CPU kernels
    (``model.keep_weights``)."""
    check_weights(weights)
    name = str(name_or_path)
    path = shipped_path(name) if name in SHIPPED else Path(name)
    if name in SHIPPED and not path.is_file():
        raise CheckpointError(
            f"shipped model {name!r} not found at {path}; "
            f"train it with: python -m minillm train --preset {name} --out {path}"
        )
    header, arrays = read_npz(path, expected=lambda header: {
        name: (shape, FLOAT_WEIGHTS) for name, shape in model_config(header, path).param_shapes().items()})
    config = model_config(header, path)
    try:
        tokenizer = CharTokenizer.from_dict(header_section(header, "tokenizer", path))
        model = GPT(config, arrays, attention=attention, weights=weights)
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
