"""The GPT-2 forward pass: shapes, dtype, causality, and equality with two independent oracles."""

import math

import numpy as np
import pytest

from minillm import GPT, GPTConfig
from minillm.backend import to_numpy


def test_config_validation_and_param_count():
    """A bad config is refused by name; the count matches GPT-2 small's published 124M."""
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer"):
        GPTConfig(n_layer=0)
    gpt2 = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    assert gpt2.num_params() == 124_439_808


def test_init_statistics():
    """GPT-2 init: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layer)."""
    cfg = GPTConfig(vocab_size=50, block_size=64, n_layer=4, n_head=4, n_embd=128)
    p = GPT.init(cfg, seed=0).params
    assert abs(float(p["h.0.mlp.c_fc.weight"].std()) - 0.02) < 0.001
    assert abs(float(p["h.0.attn.c_proj.weight"].std()) - 0.02 / math.sqrt(8)) < 0.0005
    assert float(np.abs(to_numpy(p["h.0.attn.c_attn.bias"])).max()) == 0.0
    assert float(to_numpy(p["ln_f.weight"]).min()) == 1.0


def test_params_checked_against_config(tiny_config, tiny_model):
    params = dict(tiny_model.params)
    params.pop("ln_f.bias")
    with pytest.raises(ValueError, match="missing"):
        GPT(tiny_config, params)
    params = dict(tiny_model.params, **{"wte.weight": np.zeros((3, 3))})
    with pytest.raises(ValueError, match="wte.weight"):
        GPT(tiny_config, params)


@pytest.mark.parametrize("B,T", [(1, 1), (2, 7), (3, 32)])
def test_forward_shape_and_dtype(tiny_model, B, T):
    """Logits are (B, T, V) float32: no silent float64 promotion (NumPy 2 scalar rules)."""
    idx = np.random.default_rng(B).integers(0, 13, (B, T))
    logits = tiny_model.forward(idx)
    assert logits.shape == (B, T, 13)
    assert logits.dtype == np.float32


def test_forward_rejects_bad_input(tiny_model):
    with pytest.raises(ValueError, match="block_size"):
        tiny_model.forward(np.zeros((1, 33), dtype=int))
    with pytest.raises(ValueError, match="token ids"):
        tiny_model.forward(np.array([[0, 13]]))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        tiny_model.forward(np.array([1, 2, 3]))


def test_no_future_leakage(tiny_model):
    """Changing token t+1 leaves the logits at positions <= t unchanged (the causal mask works)."""
    rng = np.random.default_rng(1)
    idx = rng.integers(0, 13, (1, 20))
    base = to_numpy(tiny_model.forward(idx))
    for t in (0, 5, 18):
        changed = idx.copy()
        changed[0, t + 1] = (changed[0, t + 1] + 1) % 13
        out = to_numpy(tiny_model.forward(changed))
        np.testing.assert_array_equal(out[0, : t + 1], base[0, : t + 1])
        assert not np.allclose(out[0, t + 1 :], base[0, t + 1 :])


# --- an independent float64 re-implementation, written from the GPT-2 paper's equations --------


def reference_gpt2_logits(params: dict, cfg: GPTConfig, idx: np.ndarray) -> np.ndarray:
    """Plain loops over heads, float64, erf-free tanh GELU; shares no code with minillm."""
    p = {k: to_numpy(v).astype(np.float64) for k, v in params.items()}

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        sd = np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        return (x - mu) / sd * w + b

    T = idx.shape[1]
    out = []
    for seq in idx:
        x = p["wte.weight"][seq] + p["wpe.weight"][:T]
        for i in range(cfg.n_layer):
            pre = f"h.{i}."
            a = ln(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"])
            qkv = a @ p[pre + "attn.c_attn.weight"] + p[pre + "attn.c_attn.bias"]
            C, hs = cfg.n_embd, cfg.head_size
            heads = []
            for h in range(cfg.n_head):
                q = qkv[:, h * hs : (h + 1) * hs]
                k = qkv[:, C + h * hs : C + (h + 1) * hs]
                v = qkv[:, 2 * C + h * hs : 2 * C + (h + 1) * hs]
                s = q @ k.T / np.sqrt(hs)
                s[np.triu_indices(T, 1)] = -np.inf
                w = np.exp(s - s.max(-1, keepdims=True))
                heads.append((w / w.sum(-1, keepdims=True)) @ v)
            x = x + np.concatenate(heads, -1) @ p[pre + "attn.c_proj.weight"] + p[pre + "attn.c_proj.bias"]
            m = ln(x, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"])
            f = m @ p[pre + "mlp.c_fc.weight"] + p[pre + "mlp.c_fc.bias"]
            f = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f**3)))
            x = x + f @ p[pre + "mlp.c_proj.weight"] + p[pre + "mlp.c_proj.bias"]
        out.append(ln(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["wte.weight"].T)
    return np.stack(out)


def random_params(cfg, seed=0):
    """Non-trivial weights: random biases and LayerNorm gains too, so every term is exercised."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in cfg.param_shapes().items():
        gain = 1.0 if "ln_" in name and name.endswith("weight") else 0.0
        params[name] = (gain + rng.normal(0, 0.3 if len(shape) == 1 else 0.1, shape)).astype(np.float32)
    return params


def test_matches_float64_reference():
    """Logits equal an independent float64 implementation within 1e-4."""
    cfg = GPTConfig(vocab_size=21, block_size=24, n_layer=3, n_head=4, n_embd=32)
    params = random_params(cfg)
    idx = np.random.default_rng(2).integers(0, 21, (2, 24))
    ours = to_numpy(GPT(cfg, params).forward(idx))
    np.testing.assert_allclose(ours, reference_gpt2_logits(params, cfg, idx), atol=1e-4, rtol=0)


@pytest.mark.oracle
def test_matches_huggingface_gpt2():
    """Hugging Face's GPT2LMHeadModel, fed the same weights under the same names, gives the same
    logits (max abs diff <= 1e-4): our parameter layout *is* GPT-2's."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = GPTConfig(vocab_size=37, block_size=40, n_layer=2, n_head=4, n_embd=32)
    params = random_params(cfg, seed=3)
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
        layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    state = {"transformer." + k: torch.from_numpy(v) for k, v in params.items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected
    assert all(k.endswith((".attn.bias", ".attn.masked_bias")) for k in missing), missing
    idx = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(idx)).logits.numpy()
    ours = to_numpy(GPT(cfg, params).forward(idx))
    assert np.abs(ours - theirs).max() <= 1e-4
