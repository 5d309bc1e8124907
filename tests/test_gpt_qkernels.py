"""Chapter 13's kernels under the character models: a GPT loaded with ``weights="q"`` (each block's four matrices
and the LM head packed once as F32 panels for ``minillm.qkernels``) computes what the float32 GPT (``weights="fp32"``,
the reference) computes, and speculative decoding on it (chapter 5) stays the target's own greedy output.

The panels hold the very float32 values of the arrays, so the two models differ only by the rounding of sums taken
in another order: the logits bound below is float32 rounding, and greedy tokens are identical. A matrix packed
the wrong way round (a GPT weight is stored [in, out], the kernels take [out, in]) or a product that forgets its
bias fails the logits check (the planted versions at the end). On a device (the strict stand-in) "q" keeps the
float32 arrays, so the same checks hold trivially there.
"""

import numpy as np
import pytest

from minillm import GPT, GPTConfig, generate, to_numpy
from minillm.backend import is_gpu
from minillm.checkpoint import host_float32, model_identity, read_npz, save_model, shipped_path
from minillm.kv_cache import KVCache
from minillm.quantize import kept_in_blocks
from minillm.speculative import speculative_generate
from minillm.tokenizer import CharTokenizer

# |logits_q - logits_fp32| <= LOGIT_TOL * max |logits_fp32|. A product on the kernels differs from BLAS's by the
# float32 rounding of a reordered sum; through the shipped target's 6 blocks the difference measured about 5e-7 of
# the largest logit (5e-6 of 11); the bound leaves 20x room. A matrix packed transposed errs by 1e-1 or more.
LOGIT_TOL = 1e-5
GREEDY_TOKENS = 64
TINY = GPTConfig(vocab_size=40, block_size=48, n_layer=2, n_head=2, n_embd=32)

shipped = pytest.mark.skipif(
    not (shipped_path("target").is_file() and shipped_path("draft").is_file()),
    reason="shipped models not trained yet (python -m minillm train --preset target/draft)",
)


def check_same_logits(a, b):
    """a, b (B, T, V) float32: within LOGIT_TOL of b's largest logit (AssertionError naming the gap otherwise)."""
    a, b = to_numpy(a), to_numpy(b)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    error = np.abs(a.astype(np.float64) - b).max()
    assert error <= LOGIT_TOL * np.abs(b).max(), f"{error:.3g} > {LOGIT_TOL} * {np.abs(b).max():.3g}"


def check_same_cached_logits(q, ref, ids, prefill: int, verify: int = 5):
    """Both models through a KV cache: a prefill of ``prefill`` tokens, decode steps of one token, then a
    verification of ``verify`` tokens at once (chapter 5's K + 1 rows), each forward's logits compared."""
    caches = [KVCache(m.config, max_len=len(ids)) for m in (q, ref)]
    steps = [ids[:prefill], *([t] for t in ids[prefill:len(ids) - verify]), ids[len(ids) - verify:]]
    for step in steps:
        check_same_logits(*(m.forward(np.array([step]), cache=c) for m, c in zip((q, ref), caches)))


def greedy(model, prompt, n=GREEDY_TOKENS):
    return generate(model, prompt, n, temperature=0, cache=KVCache(model.config, max_len=len(prompt) + n)).tokens


def tiny_pair(seed=0):
    """A random tiny GPT whose weights are large enough to make peaked logits, as (q, fp32) of the same values."""
    rng = np.random.default_rng(seed)
    params = {name: (rng.standard_normal(shape) * (shape[0] ** -0.5 if len(shape) == 2 else 0.1)).astype(np.float32)
              for name, shape in TINY.param_shapes().items()}
    return GPT(TINY, params, weights="q"), GPT(TINY, params)


@pytest.fixture(scope="module")
def shipped_models():
    """{name: (q, fp32, tokenizer)} for the shipped target and draft."""
    from minillm.checkpoint import load_model

    out = {}
    for name in ("target", "draft"):
        q, tok = load_model(name, weights="q")
        out[name] = (q, load_model(name)[0], tok)
    return out


# ---- what "q" keeps -----------------------------------------------------------------------------------


def test_q_packs_every_matrix_on_the_host_and_keeps_arrays_on_a_device():
    """On NumPy the four matrices of each block and the LM head are packed F32 weights [out, in]; the embedding
    tables and the 1-D parameters stay float32 arrays (the lookups read them). On a device nothing is packed."""
    q, ref = tiny_pair()
    matrices = [f"h.{i}.{m}.weight" for i in range(TINY.n_layer)
                for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    arrays = [name for name in q.params if name not in matrices]
    assert all(not kept_in_blocks(q.params[name]) for name in arrays) and "wte.weight" in arrays
    if is_gpu():
        assert not kept_in_blocks(q.lm_head) and all(not kept_in_blocks(q.params[n]) for n in matrices)
        return
    assert all(q.params[n].format == "F32" and q.params[n].shape == ref.params[n].shape[::-1] for n in matrices)
    assert q.lm_head.format == "F32" and q.lm_head.shape == (TINY.vocab_size, TINY.n_embd)
    assert q.weights == "q" and ref.weights == "fp32" and not kept_in_blocks(ref.lm_head)


def test_a_packed_matrix_has_no_in_out_array():
    """A packed model is for inference: asking it for a matrix's [in, out] array (what training and the static
    step's array products read) is a TypeError that names the float32 load."""
    q, _ = tiny_pair()
    if is_gpu():
        assert q.weight("h.0.attn.c_attn")[0].shape == (TINY.n_embd, 3 * TINY.n_embd)
        return
    with pytest.raises(TypeError, match="weights='fp32'"):
        q.weight("h.0.attn.c_attn")


def test_weights_must_be_q_or_fp32():
    from minillm.checkpoint import load_model

    with pytest.raises(ValueError, match="choose from q, fp32"):
        GPT.init(TINY, weights="int4")
    with pytest.raises(ValueError, match="choose from q, fp32"):
        load_model("no-such-model.npz", weights="Q4_1")  # before the file is looked for


# ---- the same model: logits, greedy tokens, speculative decoding --------------------------------------------


@pytest.mark.parametrize("T", [1, 7, 16, 17, 48])
def test_tiny_q_logits_equal_fp32(T):
    """Without a cache, T tokens: 1 (a decode step), 7 and 16 (one pass of the kernels), 17 and 48 (chunks of 16)."""
    q, ref = tiny_pair()
    ids = np.random.default_rng(T).integers(0, TINY.vocab_size, (2, T))
    check_same_logits(q.forward(ids), ref.forward(ids))


@pytest.mark.uses_exercise("3.1")
@pytest.mark.parametrize("prefill", [1, 20])
def test_tiny_q_cached_logits_equal_fp32(prefill):
    q, ref = tiny_pair(1)
    check_same_cached_logits(q, ref, [(5 * t + 3) % TINY.vocab_size for t in range(40)], prefill)


@shipped
@pytest.mark.parametrize("name", ["target", "draft"])
@pytest.mark.parametrize("T", [1, 17, 100])
def test_shipped_q_logits_equal_fp32(shipped_models, name, T):
    q, ref, tok = shipped_models[name]
    ids = np.array([tok.encode(("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 3)[:T])])
    check_same_logits(q.forward(ids), ref.forward(ids))


@shipped
@pytest.mark.uses_exercise("3.1")
@pytest.mark.parametrize("name", ["target", "draft"])
def test_shipped_q_cached_logits_equal_fp32(shipped_models, name):
    q, ref, tok = shipped_models[name]
    check_same_cached_logits(q, ref, tok.encode("ROMEO:\nBut soft, what light through yonder window"), 12)


@shipped
@pytest.mark.uses_exercise("3.1", "3.3")
@pytest.mark.parametrize("name", ["target", "draft"])
def test_shipped_q_greedy_tokens_identical(shipped_models, name):
    """64 greedy tokens from two prompts: token for token the float32 model's."""
    q, ref, tok = shipped_models[name]
    for text in ("ROMEO:\n", "KING RICHARD II:\nNo"):
        assert greedy(q, tok.encode(text)) == greedy(ref, tok.encode(text))


@shipped
@pytest.mark.uses_exercise("3.1", "3.2", "3.3", "5.1", "5.2", "5.3")
def test_shipped_speculative_on_q_is_plain_greedy(shipped_models):
    """Chapter 5 on the kernels: the q target verifying the q draft's proposals writes the float32 target's greedy
    tokens, for K = 1, 4 and 8."""
    q_target, ref_target, tok = shipped_models["target"]
    q_draft = shipped_models["draft"][0]
    prompt = tok.encode("First Citizen:\nWe are")
    want = greedy(ref_target, prompt)
    for k in (1, 4, 8):
        result = speculative_generate(q_target, q_draft, prompt, GREEDY_TOKENS, k=k, temperature=0)
        assert result.tokens == want, k
        assert result.stats.accepted > 0  # the draft did propose tokens the target kept


# ---- saving and identity read the float32 values back -----------------------------------------------------


def test_saving_a_q_model_writes_its_float32_arrays(tmp_path):
    """numpy_params of a packed model are the float32 [in, out] arrays it was made from, exactly; a checkpoint saved
    from it (float32 or float16) holds what one saved from the float32 model holds, and both have one identity."""
    q, ref = tiny_pair(2)
    tok = CharTokenizer("".join(chr(ord("0") + i) for i in range(TINY.vocab_size)))
    for name, a in ref.numpy_params().items():
        got = q.numpy_params()[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, a, err_msg=name)
    np.testing.assert_array_equal(host_float32(q.lm_head), to_numpy(ref.lm_head))
    assert model_identity(q) == model_identity(ref)
    for dtype in (np.float32, np.float16):
        save_model(tmp_path / "q.npz", q, tok, dtype=dtype)
        save_model(tmp_path / "ref.npz", ref, tok, dtype=dtype)
        (_, saved), (_, want) = read_npz(tmp_path / "q.npz"), read_npz(tmp_path / "ref.npz")
        assert saved.keys() == want.keys()
        for name in want:
            assert saved[name].dtype == dtype
            np.testing.assert_array_equal(saved[name], want[name], err_msg=name)
    back = q.with_weights("q")
    check_same_logits(back.forward(np.array([[1, 2, 3]])), ref.forward(np.array([[1, 2, 3]])))


def test_registry_loads_a_character_model_either_way():
    """``load_model("draft", weights=...)``: "q" packs, "fp32" and the default (None) keep the arrays."""
    from minillm.registry import load_model

    if not shipped_path("draft").is_file():
        pytest.skip("the shipped draft is not trained yet")
    packed = not is_gpu()
    assert kept_in_blocks(load_model("draft", weights="q")[0].lm_head) == packed
    assert not kept_in_blocks(load_model("draft", weights="fp32")[0].lm_head)
    assert not kept_in_blocks(load_model("draft")[0].lm_head)


# ---- the checks can fail: planted wrong versions ---------------------------------------------------------


@pytest.mark.skipif(is_gpu(), reason='on a device "q" packs nothing, so there is nothing to pack wrongly')
@pytest.mark.parametrize("wrong", ["a square [in, out] matrix packed as if it were [out, in]",
                                   "a packed product that forgets its bias"])
def test_the_logits_check_catches_a_wrong_q_model(wrong):
    """attn.c_proj (C, C) packed without its transpose runs without a shape error (a non-square matrix would stop
    at the product's shape check), and a product without its bias runs too: both must fail the logits check."""
    from minillm.qkernels import pack

    q, ref = tiny_pair(3)
    name = "h.1.attn.c_proj"
    if wrong.startswith("a square"):
        q.params[name + ".weight"] = pack(to_numpy(ref.params[name + ".weight"]))  # [in, out] read as [out, in]
    else:
        q.params[name + ".bias"] = np.zeros_like(q.params[name + ".bias"])  # what weight_product(x, w) alone adds
    ids = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, 9))
    with pytest.raises(AssertionError):
        check_same_logits(q.forward(ids), ref.forward(ids))


@pytest.mark.host_only
def test_the_benchmark_and_the_demo_take_weights(monkeypatch):
    """``bench speculative`` and the demo's character part: --weights q|fp32, default q (SmolLM2's default)."""
    from minillm.registry import DEFAULT_WEIGHTS
    from minillm.tools import demo
    from minillm.tools.benchmarks import common, speculative

    monkeypatch.setattr(common, "parse_args", lambda parser, argv: parser.parse_args(argv))  # no runtime line
    assert speculative.parse_args([]).weights == DEFAULT_WEIGHTS == "q"
    assert speculative.parse_args(["--weights", "fp32"]).weights == "fp32"
    asked = []

    def loader(name, attention=None, weights=None):
        asked.append((name, weights))
        raise demo.CheckpointError("stop")

    monkeypatch.setattr(demo, "load_model", loader)
    assert demo.main(["--no-real-model", "--weights", "fp32"]) == 1
    assert asked == [("target", "fp32")]
