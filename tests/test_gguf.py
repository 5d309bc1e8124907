"""Chapter 8, the GGUF file: Q8_0 and Q4_1 dequantize bit for bit like llama.cpp's own Python
package (``gguf``), q/k rows are put back in Hugging Face's RoPE order, and a bad file is refused."""

import dataclasses

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf package (pip install gguf)")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from minillm.config import LlamaConfig  # noqa: E402
from minillm.gguf import (  # noqa: E402
    GGUFError,
    dequantize,
    dequantize_q4_1,
    dequantize_q8_0,
    open_gguf,
    read_llama,
    unpermute_rope_rows,
)
from minillm.llama import Llama  # noqa: E402
from minillm.registry import SMOLLM2_SHA256, check_smollm2_file, smollm2_path  # noqa: E402


def same_bits(a, b):
    """Equal float32 bit patterns (stricter than ==: tells -0.0 from 0.0)."""
    same_type = a.dtype == b.dtype == np.float32 and a.shape == b.shape
    return same_type and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def fp16_bytes(x):
    return list(np.float16(x).tobytes())


def test_q8_0_worked_example():
    """One block: d = 0.5, q = [-2, 0, 3, 127, -128, ...] -> x = d * q."""
    q = np.array([-2, 0, 3, 127, -128] + [1] * 27, dtype=np.int8)
    raw = np.array(fp16_bytes(0.5) + list(q.view(np.uint8)), dtype=np.uint8)
    np.testing.assert_array_equal(dequantize_q8_0(raw), 0.5 * q.astype(np.float32))


def test_q4_1_worked_example_low_nibbles_first():
    """d = 0.25, m = -1, byte 0 = 0x3A: element 0 is the low nibble (0.25 * 10 - 1 = 1.5), element 16
    the high nibble (0.25 * 3 - 1 = -0.25). Fails if the nibbles are read high-first or interleaved."""
    packed = [0x3A] + [0x00] * 15
    raw = np.array(fp16_bytes(0.25) + fp16_bytes(-1.0) + packed, dtype=np.uint8)
    x = dequantize_q4_1(raw)
    assert x.shape == (32,) and x[0] == 1.5 and x[16] == -0.25 and x[1] == -1.0


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1])
@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (2, 5, 96)])
def test_synthetic_blocks_match_gguf(qtype, shape, rng):
    """Weights quantized by gguf, then dequantized by minillm and by gguf: the same float32 bits."""
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, shape[:-1] + (1,))).astype(np.float32)
    w[..., :32] = 0.0 if shape[-1] > 32 else w[..., :32]  # an all-zero block (d = 0) where there is room
    raw = gguf_quantize(w, qtype)
    mine = dequantize(raw, qtype.name, shape)
    assert same_bits(mine, gguf_dequantize(raw, qtype).reshape(shape))


@pytest.mark.parametrize("qtype, block_bytes", [(QT.Q8_0, 34), (QT.Q4_1, 20)])
def test_random_bytes_match_gguf(qtype, block_bytes, rng):
    """Arbitrary block contents (any nibble, any int8, finite fp16 d and m): the same bits as gguf."""
    raw = rng.integers(0, 256, (50, block_bytes), dtype=np.uint8)
    for offset in (0, 2)[: 1 + (qtype == QT.Q4_1)]:  # keep d (and m) finite: fp16 exponent bits < 0x7C00
        raw[:, offset + 1] &= 0x7B
    assert same_bits(dequantize(raw, qtype.name, (50, 32)), gguf_dequantize(raw, qtype).reshape(50, 32))


def test_f16_and_f32(rng):
    w = rng.standard_normal((4, 8)).astype(np.float32)
    assert same_bits(dequantize(w, "F32", (4, 8)), w)
    assert same_bits(dequantize(w.astype(np.float16), "F16", (4, 8)), w.astype(np.float16).astype(np.float32))


def test_unsupported_type_is_named():
    with pytest.raises(GGUFError, match="Q4_K"):
        dequantize(np.zeros(144, dtype=np.uint8), "Q4_K", (256,))


def llama_cpp_permute(w, n_head):
    """What llama.cpp's converter does to q and k rows: per head, (2, hs/2) -> (hs/2, 2)."""
    rows, C = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, C).swapaxes(1, 2).reshape(rows, C)


def test_unpermute_rope_rows_inverts_llama_cpp():
    """Per head, file rows [0, hs/2, 1, hs/2 + 1, ...] go back to [0, 1, ..., hs - 1]; the rows of one
    head never move into another head."""
    n_head, hs = 3, 8
    w = np.arange(n_head * hs, dtype=np.float32)[:, None] * np.ones((1, 5), dtype=np.float32)
    permuted = llama_cpp_permute(w, n_head)
    np.testing.assert_array_equal(permuted[:hs, 0], [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_head), w)
    assert not np.array_equal(unpermute_rope_rows(permuted, 1), w)  # the head count matters


# ---- the real file ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        return smollm2_path()
    except GGUFError as exc:
        pytest.skip(str(exc))


@pytest.mark.host_only  # reads and dequantizes the file on the host: no device code
def test_installed_file_is_the_pinned_one(smollm2):
    check_smollm2_file(smollm2)  # size and sha256
    assert SMOLLM2_SHA256.startswith("b179c952")


@pytest.mark.host_only  # reads and dequantizes the file on the host: no device code
def test_real_tensors_match_gguf(smollm2):
    """The Q8_0 token embedding, Q4_1 projections and an F32 norm of SmolLM2: bit for bit gguf's."""
    reader = open_gguf(smollm2)
    tensors = {t.name: t for t in reader.tensors}
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.17.ffn_down.weight", "blk.29.ffn_norm.weight"):
        t = tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))
        mine = dequantize(t.data, t.tensor_type.name, shape)
        assert same_bits(mine, gguf_dequantize(t.data, t.tensor_type).reshape(shape)), name


# ---- files written here: a tiny Llama in every supported type, and broken files ----------------

TINY = LlamaConfig(vocab_size=40, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, n_hidden=96,
                   rope_theta=10000.0, tie_embeddings=False)
GGUF_NAMES = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(name):
    """'layers.1.self_attn.q_proj.weight' -> 'blk.1.attn_q.weight'"""
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"blk.{i}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
    return GGUF_NAMES[name.removesuffix(".weight")] + ".weight"


def write_llama_gguf(path, config, params, qtype_of, arch="llama"):
    """Write params as llama.cpp's converter would: permuted q/k rows, each tensor in qtype_of(name)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.n_layer)
    w.add_context_length(config.block_size)
    w.add_embedding_length(config.n_embd)
    w.add_feed_forward_length(config.n_hidden)
    w.add_head_count(config.n_head)
    w.add_head_count_kv(config.n_kv_head)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_vocab_size(config.vocab_size)
    for name, x in params.items():
        if "q_proj" in name or "k_proj" in name:
            x = llama_cpp_permute(x, config.n_head if "q_proj" in name else config.n_kv_head)
        qtype = qtype_of(name) if x.ndim == 2 else QT.F32
        w.add_tensor(gguf_name(name), gguf_quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_qtype(name):
    return {"embed_tokens.weight": QT.Q8_0, "lm_head.weight": QT.F16}.get(name, QT.Q4_1)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    params = Llama.init(TINY, seed=1).numpy_params()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, TINY, params, tiny_qtype)
    return path, params


def test_tiny_file_round_trip(tiny_file):
    """A Q8_0/Q4_1/F16/F32 file written like llama.cpp's converter loads back: the config, q/k rows in
    Hugging Face order (within quantization error of the originals), an untied LM head."""
    path, original = tiny_file
    config, params, metadata = read_llama(path)
    assert config == dataclasses.replace(TINY, norm_eps=float(np.float32(TINY.norm_eps)))  # stored as float32
    assert metadata["general.architecture"] == "llama"
    for name, x in original.items():
        tol = {1: 0, 2: 0.02}[x.ndim] if "lm_head" not in name else 1e-3  # Q4_1 steps of ~0.01 here
        np.testing.assert_allclose(params[name], x, atol=tol, err_msg=name)
    assert config.param_shapes() == {name: x.shape for name, x in params.items()}


def test_other_architecture_is_refused(tmp_path, tiny_file):
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(path, TINY, tiny_file[1], tiny_qtype, arch="gpt2")
    with pytest.raises(GGUFError, match="architecture 'gpt2'"):
        read_llama(path)


def test_other_tensor_type_is_refused_by_name(tmp_path, tiny_file):
    path = tmp_path / "q5.gguf"
    write_llama_gguf(path, TINY, tiny_file[1], lambda name: QT.Q5_0 if "v_proj" in name else tiny_qtype(name))
    with pytest.raises(GGUFError, match="blk.0.attn_v.weight has type Q5_0"):
        read_llama(path)


@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.01, 0.3, 0.7, 0.9999])
def test_truncated_file_is_refused(tmp_path, tiny_file, fraction):
    """A file cut anywhere (header, metadata, tensor infos, tensor data) -> GGUFError, never another
    exception or a model with missing weights."""
    data = tiny_file[0].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(GGUFError, match="cut.gguf"):
        read_llama(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are not weights\n" * 10)
    with pytest.raises(GGUFError, match="corrupt or truncated"):
        read_llama(path)
    with pytest.raises(GGUFError, match="not found"):
        read_llama(tmp_path / "missing.gguf")
