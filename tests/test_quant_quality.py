"""The quantization-quality benchmark (minillm.tools.benchmarks.quant_quality) on tiny random models.

It must round the right matrices along the right axis (a GPT-2 weight is stored [in, out], a Llama
weight [out, in]), keep the embeddings float32, give exactly zero KL for float32 and a positive one
for int4, and run end to end (--quick, --json) without touching a file it did not create.
"""

import json

import numpy as np
import pytest

from minillm import GPT, GPTConfig, Llama, LlamaConfig
from minillm.backend import to_numpy
from minillm.quantize import Int4PerGroup, Int8PerChannel
from minillm.tools.benchmarks import quant_quality as qq


def tiny_char_models():
    """A target and a draft of the character vocabulary (84), 32 positions: the shipped models' shapes, shrunk."""
    target = GPT.init(GPTConfig(vocab_size=84, block_size=32, n_layer=2, n_head=2, n_embd=64), seed=0)
    draft = GPT.init(GPTConfig(vocab_size=84, block_size=32, n_layer=1, n_head=2, n_embd=32), seed=1)
    return {"target": target, "draft": draft}


@pytest.mark.uses_exercise("13.1", "13.2", "13.3")  # every format, and the int8 KV cache
def test_quick_run_on_tiny_models(monkeypatch, tmp_path):
    """--model target --quick on tiny random models: float32 is the reference (KL 0, every greedy token
    the same), int4 costs something (KL > 0), a group of 128 does not split 64 inputs (n/a), the int8
    KV cache takes (hs + 4) / (4 hs) of the bytes, every draft's alpha is a probability; the JSON is
    written, and an existing --json file is refused, unchanged."""
    models = tiny_char_models()
    from minillm import backend
    from minillm.data import corpus_tokenizer

    monkeypatch.setattr(qq, "load_model", lambda name, weights="fp32": (models[name], corpus_tokenizer()))
    # BLAS for every float32 product: the streaming path's measured choice per shape can differ between the
    # reference's forward and the copy's (whichever tests ran first in this process), 1e-16 of a KL apart
    monkeypatch.setattr(backend, "fast_products", lambda: False)
    out = tmp_path / "q.json"
    assert qq.main(["--model", "target", "--quick", "--json", str(out), "--out", str(tmp_path)]) == 0
    report = json.loads(out.read_text())["models"]["target"]
    rows = {r["format"]: r for r in report["weights"]}
    assert rows["float32"]["KL"] == 0 and rows["float32"]["top-1"] == 1 and rows["float32"]["prefix"] == 1
    assert rows["int4 g32 +min"]["KL"] > 0 and rows["int4/tensor"]["KL"] > 0
    assert "n/a" in rows["int4 g128"] and rows["BF16"]["bits/w"] == 16
    assert rows["int4 g32"]["weight MB"] < rows["int8/channel"]["weight MB"] < rows["float32"]["weight MB"]
    kv = {r["cache"]: r for r in report["kv_cache"]}
    hs = models["target"].config.head_size
    assert kv["int8 KVCache"]["x float32"] == pytest.approx((hs + 4) / (4 * hs)) and kv["float32 KVCache"]["KL"] == 0
    assert all(0 <= r["alpha"] <= 1 for r in report["draft"]) and (tmp_path / "quant_quality.png").exists()
    with pytest.raises(SystemExit):
        qq.main(["--model", "target", "--quick", "--json", str(out)])
    assert json.loads(out.read_text())["models"]["target"]["weights"] == report["weights"]


def test_gpt_weights_are_rounded_along_their_inputs():
    """GPT-2 stores c_attn as [in, out]: int8 per channel must give one scale per OUTPUT (a column of the
    stored matrix). The copy's weight is Int8PerChannel of W.T, transposed back; embeddings, norms and
    biases are untouched; the bytes count 8 + 32/in bits per quantized weight plus float32 for the rest."""
    model = tiny_char_models()["target"]
    params = qq.reference_params(model)
    copy, nbytes, bits = qq.quantized_copy(model, params, qq.BY_NAME["int8/channel"])
    w = params["h.0.attn.c_attn.weight"]  # (C, 3C) [in, out]
    np.testing.assert_array_equal(to_numpy(copy.params["h.0.attn.c_attn.weight"]),
                                  Int8PerChannel.quantize(np.ascontiguousarray(w.T)).dequantize().T)
    for name in ("wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.bias"):
        np.testing.assert_array_equal(to_numpy(copy.params[name]), params[name])
    names = qq.quantized_names(params)
    assert "wte.weight" not in names and len(names) == 4 * model.config.n_layer
    quantized = sum(Int8PerChannel.quantize(np.ascontiguousarray(params[n].T)).bits_per_weight * params[n].size / 8
                    for n in names)
    assert nbytes == int(quantized + sum(p.nbytes for n, p in params.items() if n not in names))
    assert 8 < bits < 8.5


@pytest.mark.uses_exercise("13.2")
def test_llama_weights_quantized_in_place_of_out_in():
    """A Llama's weights are [out, in] already: the copy's q_proj is Int4PerGroup's round trip of it as
    stored; float32 gives KL 0 and identical greedy tokens, int4 a positive KL."""
    cfg = LlamaConfig(vocab_size=17, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_hidden=64)
    model = Llama.init(cfg, seed=3)
    params = qq.reference_params(model)
    copy, _, _ = qq.quantized_copy(model, params, qq.BY_NAME["int4 g32 +min"])
    w = params["layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(to_numpy(copy.params["layers.1.self_attn.q_proj.weight"]),
                                  Int4PerGroup.quantize(w, group=32, minimum=True).dequantize())
    window = np.random.default_rng(0).integers(0, 17, 25)
    rows = qq.weight_quality(model, [("text", window)], [1, 2, 3], 8,
                             [qq.BY_NAME["float32"], qq.BY_NAME["int4 g32 +min"]])
    assert rows[0]["KL"] == 0 and rows[0]["same"] == 8 and rows[1]["KL"] > 0


@pytest.mark.host_only
@pytest.mark.uses_exercise("13.2")
def test_three_bit_and_per_tensor_quantizers():
    """3-bit with a minimum: at most 8 levels per group of 32, error at most half a step, the docstring's
    example; int4 per tensor: one scale for the whole matrix (at most 15 distinct values)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 64)).astype(np.float32)
    three_bit = qq.stored(Int4PerGroup, group=32, bits=3)
    w_hat, bits = three_bit(w)
    groups, rounded = w.reshape(4, 2, 32), w_hat.reshape(4, 2, 32)
    step = (groups.max(-1) - groups.min(-1)) / 7
    assert all(len(np.unique(g)) <= 8 for g in rounded.reshape(-1, 32)) and bits == 5.0
    assert (np.abs(rounded - groups).max(-1) <= step / 2 * (1 + 1e-5)).all()
    example, _ = three_bit(np.array([[0, 0.65, 1.4] + [0.0] * 29], dtype=np.float32))
    np.testing.assert_allclose(example[0, :3], [0, 0.6, 1.4], atol=1e-6)
    tensor_hat, tensor_bits = qq.int4_per_tensor(w)
    assert len(np.unique(tensor_hat)) <= 15 and tensor_bits == 4 + 32 / w.size


@pytest.mark.host_only
def test_greedy_agreement_counts():
    """Prefix: tokens before the first divergence over all; same: positions identical anyway."""
    assert qq.agreement([1, 2, 3, 4], [1, 2, 5, 4]) == {"prefix": 0.5, "same": 3}
    assert qq.agreement([1, 2], [1, 2]) == {"prefix": 1.0, "same": 2}
