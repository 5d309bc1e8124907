"""GGUF: llama.cpp's model file, and the 8-bit and 4-bit blocks its weights are stored in.

A .gguf file is a header of key -> value metadata (architecture, sizes, the tokenizer's vocabulary)
followed by tensors. The container is read by the ``gguf`` package (``GGUFReader``); turning the
quantized tensors back into float32 is written here, because that is the idea:

    Q8_0: blocks of 32 weights = fp16 scale d + 32 int8 q               x = d * q        (34 bytes)
    Q4_1: blocks of 32 weights = fp16 scale d, fp16 min m, 32 4-bit q   x = d * q + m    (20 bytes)

A Q4_1 block stores its 32 nibbles in 16 bytes: byte j holds element j in its low nibble and
element j + 16 in its high nibble. Q4_1 keeps 5 bits per weight (4 + 32 bits of d, m per 32), a
6.4x smaller file than float32; each weight is rounded to the nearest of 16 levels d apart.

``read_llama(path, weights)`` maps a Llama-architecture file onto ``LlamaConfig`` and parameters named like
Hugging Face's ``LlamaForCausalLM``, each Q8_0 / Q4_1 matrix kept in its blocks (``weights="q"``, a
``minillm.quantize`` weight) or dequantized to float32 (``"fp32"``), after undoing llama.cpp's RoPE row
permutation of q and k (``unpermute_rope_rows``). The formats and their dequantizers are
``minillm.quantize``'s. Anything else (another architecture or tensor type, a truncated file)
raises ``GGUFError`` naming the problem; the architecture, names, types and shapes are checked
before any weight is dequantized.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError
from .config import LlamaConfig
from .quantize import Q4_1, Q4_1_BYTES, Q8_0, Q8_0_BYTES, QK, Blocks

SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_1")
BLOCK_TYPES = {"Q8_0": Q8_0, "Q4_1": Q4_1}  # kept in their blocks by read_llama(weights="q")
BLOCK_BYTES = {"Q8_0": Q8_0_BYTES, "Q4_1": Q4_1_BYTES}
WEIGHTS = ("q", "fp32")  # read_llama's choices: the file's blocks, or every matrix dequantized to float32
# The reader's exceptions for a file that is truncated or not GGUF (a short buffer viewed as a wider
# dtype, an empty reshape, an unknown enum value, a length past the end ...); QuantError is a ValueError
READER_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, EOFError)


class GGUFError(CheckpointError):
    """A .gguf file is missing, truncated or corrupt, or holds an architecture or type minillm cannot run."""


def blocks_of(raw, type_name: str):
    """Stored Q8_0 / Q4_1 blocks (..., n * block bytes) uint8 -> minillm.quantize's weight of their rows
    (m, n * 32), the bytes as they are (checked: whole blocks, finite scales)."""
    rows = raw.reshape(-1, raw.shape[-1])  # (m, n * block bytes)
    return BLOCK_TYPES[type_name].from_raw(rows, (rows.shape[0], rows.shape[1] // BLOCK_BYTES[type_name] * QK))


def dequantize_q8_0(raw):
    """Q8_0 blocks -> float32: x = d * q (``quantize.Q8_0``).  (..., n * 34) uint8 -> (..., n * 32) float32

    Example: d = 0.5 (fp16 0x3800), q = [-2, 0, 3, ...] -> x = [-1.0, 0.0, 1.5, ...].
    """
    return blocks_of(raw, "Q8_0").dequantize().reshape(*raw.shape[:-1], -1)


def dequantize_q4_1(raw):
    """Q4_1 blocks -> float32: x = d * q + m, q in 0..15 (``quantize.Q4_1``).  (..., n * 20) uint8 -> (..., n * 32)

    Example: d = 0.25, m = -1, first byte 0x3A -> element 0 = 0.25 * 0xA - 1 = 1.5 and
    element 16 = 0.25 * 0x3 - 1 = -0.25.
    """
    return blocks_of(raw, "Q4_1").dequantize().reshape(*raw.shape[:-1], -1)


def stored_weight(raw, type_name: str, shape: tuple[int, ...]):
    """A tensor's stored data -> a float32 array of ``shape`` (F32, F16), or its blocks (Q8_0, Q4_1: a
    minillm.quantize weight of (prod(shape[:-1]), shape[-1]) viewing the stored bytes, nothing dequantized)."""
    raw = np.asarray(raw)
    size = int(np.prod(shape, dtype=np.int64))
    if type_name in BLOCK_TYPES:
        stored = raw.view(np.uint8).reshape(-1)
        if shape[-1] % QK or stored.size * QK != size * BLOCK_BYTES[type_name]:
            raise GGUFError(f"a {type_name} tensor of shape {shape} holds {stored.size} bytes")
        return blocks_of(stored.reshape(size // shape[-1], -1), type_name)  # the file's bytes, not a copy
    if type_name == "F32":
        out = raw.view(np.float32).astype(np.float32)  # a copy: the result never aliases the file
    elif type_name == "F16":
        out = raw.view(np.float16).astype(np.float32)
    else:
        raise GGUFError(f"tensor type {type_name} is not supported: minillm reads {', '.join(SUPPORTED_TYPES)}")
    if out.size != size:
        raise GGUFError(f"a {type_name} tensor of shape {shape} holds {out.size} values")
    return out.reshape(shape)


def dequantize(raw, type_name: str, shape: tuple[int, ...]):
    """A tensor's stored data -> float32 array of ``shape`` (NumPy order: the last axis is contiguous)."""
    out = stored_weight(raw, type_name, shape)
    return out.dequantize().reshape(shape) if isinstance(out, Blocks) else out


def unpermute_rope_rows(w, n_head: int):
    """Undo llama.cpp's RoPE row order of a q or k projection.  (n_head * hs, C) -> (n_head * hs, C)

    RoPE turns pairs of a head's dimensions by position-dependent angles. Hugging Face (and minillm)
    pair dimension j with j + hs/2 ("rotate half"); llama.cpp pairs adjacent dimensions 2j, 2j + 1.
    When llama.cpp's converter writes a Hugging Face checkpoint to GGUF it reorders the rows of the
    q and k projections so that its adjacent-pair rotation computes the same thing: within each
    head, row 2j of the file is row j of the original and row 2j + 1 is row j + hs/2. The rows of
    a head in the file are therefore [0, hs/2, 1, hs/2 + 1, ...]; reading them as (hs/2, 2) and
    transposing to (2, hs/2) restores [0, 1, ..., hs/2 - 1 | hs/2, ..., hs - 1].

    Only q and k are permuted (v and the output projection never meet RoPE), and k uses its own
    head count (n_kv_head). Without this step every q.k score mixes the wrong pairs and the model
    produces fluent-looking nonsense, not an error.
    Example, one head with hs = 4: file rows [a0, a2, a1, a3] -> [a0, a1, a2, a3].
    """
    rows, C = w.shape
    hs = rows // n_head
    return w.reshape(n_head, hs // 2, 2, C).swapaxes(1, 2).reshape(rows, C)  # (nh, hs/2, 2) -> (nh, 2, hs/2)


def open_gguf(path):
    """Parse a .gguf file's header -> gguf.GGUFReader; GGUFError for a missing, truncated or non-GGUF file."""
    from gguf import GGUFReader  # the container reader (pip install gguf)

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    try:
        return GGUFReader(path)
    except READER_ERRORS as exc:
        raise GGUFError(f"corrupt or truncated GGUF file {path}: {type(exc).__name__}: {exc}") from exc


def read_metadata(reader) -> dict:
    """key -> value (str, int, float, bool, or a list of them) for every metadata field of the file."""
    return {key: field.contents() for key, field in reader.fields.items()}


# GGUF tensor name -> Hugging Face Llama parameter name ({i}: the block number)
LLAMA_TENSORS = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.down_proj.weight",
}


def llama_config(metadata: dict, tensor_names, path) -> LlamaConfig:
    """LlamaConfig from the ``llama.*`` metadata; GGUFError for another architecture or a missing key."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (minillm runs 'llama')")

    def get(key, default=None):
        value = metadata.get(f"llama.{key}", default)
        if value is None:
            raise GGUFError(f"{path}: metadata key llama.{key} is missing")
        return value

    n_embd, n_head = get("embedding_length"), get("attention.head_count")
    vocab = get("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())) or None)
    try:
        config = LlamaConfig(
            vocab_size=vocab, block_size=get("context_length"), n_layer=get("block_count"), n_head=n_head,
            n_kv_head=get("attention.head_count_kv", n_head), n_embd=n_embd, n_hidden=get("feed_forward_length"),
            rope_theta=get("rope.freq_base", 10000.0), norm_eps=get("attention.layer_norm_rms_epsilon"),
            tie_embeddings="output.weight" not in tensor_names,
        )
    except ValueError as exc:
        raise GGUFError(f"{path}: {exc}") from exc
    if get("rope.dimension_count", config.head_size) != config.head_size:
        raise GGUFError(f"{path}: RoPE over {get('rope.dimension_count')} of {config.head_size} dims is not supported")
    if "llama.rope.scaling.type" in metadata:
        raise GGUFError(f"{path}: RoPE scaling {metadata['llama.rope.scaling.type']!r} is not supported")
    return config


def llama_param_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'layers.3.self_attn.q_proj.weight'; None for a name Llama does not have."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        pattern = LLAMA_TENSORS.get(".".join(["blk", "{i}", *parts[2:]]))
        return None if pattern is None else pattern.format(i=parts[1])
    return LLAMA_TENSORS.get(gguf_name)


def read_llama(path, weights: str = "fp32") -> tuple[LlamaConfig, dict, dict]:
    """A Llama .gguf -> (LlamaConfig, params named like Hugging Face, metadata).

    ``weights="fp32"``: every param a float32 array. ``weights="q"``: every Q8_0 / Q4_1 matrix stays in the
    file's blocks (a ``minillm.quantize`` weight); the rest is float32.
    Pass 1 checks everything (architecture, names, types, shapes) and dequantizes nothing;
    pass 2 undoes the RoPE row order of q and k on the stored rows (whole rows of blocks) and reads each tensor.
    """
    if weights not in WEIGHTS:
        raise GGUFError(f"weights={weights!r}: choose from {', '.join(WEIGHTS)}")
    reader = open_gguf(path)
    metadata = read_metadata(reader)
    config = llama_config(metadata, {t.name for t in reader.tensors}, path)
    expected = config.param_shapes()
    plan = []  # (tensor, param name, type name, shape) in file order
    for tensor in reader.tensors:  # pass 1
        name, type_name = llama_param_name(tensor.name), tensor.tensor_type.name
        if name not in expected:
            raise GGUFError(f"{path}: unexpected tensor {tensor.name} for a Llama model")
        if type_name not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{path}: tensor {tensor.name} has type {type_name}; minillm reads {', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the contiguous axis first
        if shape != expected[name]:
            raise GGUFError(f"{path}: tensor {tensor.name} has shape {shape}, the config says {expected[name]}")
        plan.append((tensor, name, type_name, shape))
    missing = sorted(expected.keys() - {name for _, name, _, _ in plan})
    if missing:
        raise GGUFError(f"{path}: tensors missing for {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    heads = {"q_proj": config.n_head, "k_proj": config.n_kv_head}  # k uses its own head count
    params = {}
    for tensor, name, type_name, shape in plan:  # pass 2
        try:
            stored = tensor.data
            n_head = heads.get(name.split(".")[-2])  # "layers.3.self_attn.q_proj.weight" -> "q_proj"
            if n_head is not None:
                stored = unpermute_rope_rows(stored, n_head)  # (rows, values or block bytes): rows reordered
            w = stored_weight(stored, type_name, shape)
        except READER_ERRORS as exc:  # the memory map ends before the tensor does
            raise GGUFError(f"corrupt or truncated GGUF file {path}: tensor {tensor.name}: {exc}") from exc
        if isinstance(w, Blocks) and (weights == "fp32" or len(shape) != 2):
            w = w.dequantize().reshape(shape)
        params[name] = w
    return config, params, metadata
