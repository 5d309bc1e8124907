"""Chapter 13, the model in its file's blocks: SmolLM2 with every Q8_0 / Q4_1 matrix kept quantized
(``load_model(..., weights="q")``) computes what the float32 reference computes from the same
file (``weights="fp32"``).

The two models hold the same weights: "q" multiplies by the blocks (packed numba kernels on NumPy; on a
device, the blocks dequantized for each product), "fp32" by the same blocks dequantized once at load. So
they differ only by float32 rounding of sums taken in another order: the bound below is float32 rounding,
not quantization error. A tiny random Llama quantized here checks the same on both backends in
milliseconds (on the strict stand-in the quantized product is dequantize + matmul on the "device").
"""

import numpy as np
import pytest

from minillm import generate, to_numpy
from minillm.backend import is_gpu, xp
from minillm.config import LlamaConfig
from minillm.kv_cache import KVCache
from minillm.llama import Llama
from minillm.quantize import Q4_1, Q8_0, Blocks, QuantError, kept_in_blocks

# |logits_q - logits_fp32| <= LOGIT_TOL * max |logits_fp32|. Each product differs from BLAS's by float32
# rounding of a reordered sum (the kernels' own test: 2e-6 of sum |x w|); through 30 blocks the difference
# measured 3e-6 of the largest logit (9e-5 of 27); the bound leaves 30x room.
LOGIT_TOL = 1e-4
GREEDY_TOKENS = 32
PROMPTS = [  # token ids: a chat turn, and a short phrase
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2],
    [504, 3458, 282, 4649, 314],
]
TINY = LlamaConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, n_hidden=96,
                   rope_theta=10000.0)


def close_logits(a, b):
    """a, b (B, T, V) float32: within LOGIT_TOL of b's largest logit."""
    a, b = to_numpy(a), to_numpy(b)
    assert a.dtype == b.dtype == np.float32
    error = np.abs(a.astype(np.float64) - b).max()
    assert error <= LOGIT_TOL * np.abs(b).max(), f"{error:.3g} > {LOGIT_TOL} * {np.abs(b).max():.3g}"


def greedy(model, prompt, n=GREEDY_TOKENS):
    return generate(model, prompt, n, temperature=0, cache=KVCache(model.config, max_len=len(prompt) + n)).tokens


# ---- a tiny random Llama, both backends ---------------------------------------------------------------


def tiny_params(seed=0):
    """Random weights; every matrix quantized (Q8_0 for the tied embedding, Q4_1 for the blocks, as in
    SmolLM2's file) -> (params with blocks, the same params dequantized to float32)."""
    rng = np.random.default_rng(seed)
    blocks, dense = {}, {}
    for name, shape in TINY.param_shapes().items():
        if len(shape) == 1:
            blocks[name] = dense[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
            continue
        w = (rng.standard_normal(shape) * (1.0 if "embed" in name else shape[1] ** -0.5)).astype(np.float32)
        blocks[name] = (Q8_0 if "embed" in name else Q4_1).quantize(w)
        dense[name] = blocks[name].dequantize()
    return blocks, dense


@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_tiny_quantized_llama_equals_its_dequantized_copy():
    """Logits (a prefill of 20 rows: two chunks of the kernels on NumPy; then decode steps) and 12
    greedy tokens of the model in blocks equal those of the same weights dequantized at load."""
    blocks, dense = tiny_params()
    q, ref = Llama(TINY, blocks), Llama(TINY, dense)
    assert all(not isinstance(w, np.ndarray) for w in q.stacked.values()) and not isinstance(q.lm_head, np.ndarray)
    ids = np.array([[(7 * t) % TINY.vocab_size for t in range(20)]])
    close_logits(q.forward(ids), ref.forward(ids))
    prompt = [3, 14, 15, 92, 65]
    assert greedy(q, prompt, 12) == greedy(ref, prompt, 12)


@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_tiny_quantized_embedding_looks_up_rows():
    """The tied Q8_0 table: a lookup dequantizes only the rows asked for, in the ids' shape, on either backend."""
    blocks, dense = tiny_params(1)
    q = Llama(TINY, blocks)
    ids = np.array([[5, 0, 95], [95, 7, 7]])
    rows = q.params["embed_tokens.weight"][xp.asarray(ids) if is_gpu() else ids]  # (2, 3, C)
    np.testing.assert_array_equal(to_numpy(rows), dense["embed_tokens.weight"][ids])


@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_numpy_params_of_blocks_are_float32_arrays():
    """numpy_params of the model in blocks: float32 arrays in the config's shapes, equal to those of the same
    weights dequantized at load (a stacked q/k/v row slice, a down projection, the tied table, a norm gain).
    Fails for a packed weight handed back as it is (an object, not an array)."""
    blocks, dense = tiny_params(3)
    q, ref = Llama(TINY, blocks).numpy_params(), Llama(TINY, dense).numpy_params()
    for name in ["layers.0.self_attn.k_proj.weight", "layers.1.mlp.down_proj.weight", "embed_tokens.weight",
                 "layers.1.post_attention_layernorm.weight"]:
        assert isinstance(q[name], np.ndarray) and q[name].dtype == np.float32, name
        np.testing.assert_array_equal(q[name], ref[name], err_msg=name)
    assert {n: a.shape for n, a in q.items()} == TINY.param_shapes()


@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_mixed_formats_cannot_share_a_product():
    """q in Q4_1 and k in Q8_0 cannot be stacked into one product: a clear error, nothing half-built."""
    blocks, _ = tiny_params(2)
    k = blocks["layers.0.self_attn.k_proj.weight"]
    blocks["layers.0.self_attn.k_proj.weight"] = Q8_0(Q8_0.quantize(k.dequantize()).raw, k.k)
    with pytest.raises(QuantError, match="share one format"):
        Llama(TINY, blocks)


# int8 activations (llama.cpp's route): each product's input rounded to int8 per block of 32. On the tiny
# model the logits measured within 0.66-0.81 % of the largest exact logit (seeds 4-6), far above the exact
# kernels' rounding (LOGIT_TOL); 5 % leaves 6x room. The kernels themselves are checked against their bound
# in tests/test_qkernels.py.
INT8_LOGIT_TOL = 0.05


@pytest.mark.skipif(is_gpu(), reason="int8 activations switch the NumPy kernels' products")
@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_int8_activations_switch_every_block_product_and_back():
    """set_activations("int8"): every Q8_0 / Q4_1 product (the stacks, the rest, the tied head) takes int8 x,
    the logits move off the exact ones but stay within INT8_LOGIT_TOL with the same argmax almost everywhere;
    "float32" gives the exact logits back bit for bit."""
    from minillm.qkernels import Packed

    blocks, _ = tiny_params(4)
    q = Llama(TINY, blocks)
    ids = np.array([[(5 * t + 3) % TINY.vocab_size for t in range(20)]])
    exact = q.forward(ids)
    q.set_activations("int8")
    packed = [*q.stacked.values(), *(w for w in q.params.values() if isinstance(w, Packed)), q.lm_head]
    assert all(isinstance(w, Packed) and w.int8_x for w in packed) and q.activations == "int8"
    int8 = q.forward(ids)
    assert not np.array_equal(int8, exact), "the switch changed no product"
    error = np.abs(int8 - exact).max()
    assert error <= INT8_LOGIT_TOL * np.abs(exact).max(), f"{error:.3g} > {INT8_LOGIT_TOL} * {np.abs(exact).max():.3g}"
    assert (int8.argmax(-1) == exact.argmax(-1)).mean() >= 0.9
    q.set_activations("float32")
    np.testing.assert_array_equal(q.forward(ids), exact)


@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_int8_activations_are_refused_where_there_are_no_cpu_kernels():
    """A float32 load (and, on a device, any load), or an unknown name: a ValueError naming what to do."""
    blocks, dense = tiny_params(5)
    with pytest.raises(ValueError, match="weights='q'"):
        Llama(TINY, dense).set_activations("int8")
    if is_gpu():
        with pytest.raises(ValueError, match="on NumPy"):
            Llama(TINY, blocks).set_activations("int8")
    with pytest.raises(ValueError, match="choose from float32, int8"):
        Llama(TINY, blocks).set_activations("int4")


# ---- SmolLM2 from its own file -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_pair():
    from minillm import GGUFError
    from minillm.registry import load_model

    try:  # the default load ("q"), and the float32 reference one option away
        return load_model("smollm2-135m")[0], load_model("smollm2-135m", weights="fp32")[0]
    except GGUFError as exc:
        pytest.skip(str(exc))


def test_smollm2_keeps_its_blocks(smollm2_pair):
    """Every matrix of the default ("q") load stays in blocks: no float32 matrix, the file's bytes (98 MB, not 538)."""
    from minillm.registry import DEFAULT_WEIGHTS

    assert DEFAULT_WEIGHTS == "q"
    q, ref = smollm2_pair
    assert all(kept_in_blocks(w) for w in [*q.stacked.values(), q.lm_head])
    matrices = [*q.stacked.values(), *(w for n, w in q.params.items() if n.endswith(("o_proj.weight",
                                                                                     "down_proj.weight")))]
    assert not any(isinstance(w, np.ndarray) for w in [*matrices, q.lm_head, q.params["embed_tokens.weight"]])
    if is_gpu():  # the raw blocks on the device
        assert all(isinstance(w, Blocks) for w in [*matrices, q.lm_head])
    else:  # packed for the kernels: 30 x (q, k, v, o, gate, up, down) in Q4_1 + the Q8_0 table
        kept = sum(w.nbytes for w in matrices) + q.lm_head.nbytes
        assert 96e6 < kept < 97e6, kept
    assert ref.lm_head.dtype == xp.float32 and ref.lm_head.shape == (49152, 576)


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
def test_smollm2_quantized_logits_equal_the_float32_reference(smollm2_pair):
    q, ref = smollm2_pair
    for prompt in PROMPTS:
        ids = np.array([prompt])
        close_logits(q.forward(ids), ref.forward(ids))


@pytest.mark.host_only  # 64 decode steps of each model: the NumPy kernels (the stand-in runs the tiny model)
@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
def test_smollm2_quantized_greedy_equals_the_float32_reference(smollm2_pair):
    """32 greedy tokens after each of two prompts: the same tokens from the blocks and from float32."""
    q, ref = smollm2_pair
    for prompt in PROMPTS:
        assert greedy(q, prompt) == greedy(ref, prompt), prompt


def test_smollm2_fp32_load_holds_float32_arrays(smollm2_pair):
    """weights="fp32": every matrix a float32 array (the reference), none kept in blocks."""
    _, ref = smollm2_pair
    matrices = [*ref.stacked.values(), ref.lm_head, ref.params["layers.0.mlp.down_proj.weight"]]
    assert all(isinstance(to_numpy(w), np.ndarray) and w.dtype == np.float32 for w in matrices)
    assert not any(kept_in_blocks(w) for w in ref.params.values())


@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_smollm2_add_ons_are_trained_for_both_loads(smollm2_pair):
    """A trained add-on names its model by the LM head's float32 values, not by how they are stored: the "q" and
    "fp32" loads of one file have one identity, the shipped EAGLE draft and Medusa heads load onto both, and a
    fresh draft starts from the same float32 copy of the last block (the blocks dequantized). Fails for an identity
    hashed from the storage (the packed bytes), or one that cannot read a weight kept in blocks."""
    from minillm.checkpoint import model_identity
    from minillm.eagle import EagleDraft, load_draft
    from minillm.medusa import load_heads

    q, ref = smollm2_pair
    assert model_identity(q) == model_identity(ref)
    for model in (q, ref):
        load_draft(model, "smollm2-135m")
        load_heads(model, "smollm2-135m")
    subset = np.arange(0, 49152, 97)  # 507 token ids
    fresh_q, fresh_ref = EagleDraft.init(q, subset), EagleDraft.init(ref, subset)
    for name, p in fresh_ref.params.items():
        np.testing.assert_array_equal(to_numpy(fresh_q.params[name]), to_numpy(p), err_msg=name)
