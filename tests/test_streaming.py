"""Streaming weight products (chapter 11): the numba kernels against BLAS, the measured choice, the switch.

BLAS (``x @ w.T``) is the reference. ``check_product`` is the specification: every product must match
it, float32 rounding apart, on awkward shapes (n = 1 and n not a multiple of the kernels' block of 4,
an inner dimension not a multiple of 4 or 8, one output); the bug zoo below plants the classic wrong
kernels and checks that the same function rejects each of them.
"""

import numpy as np
import pytest

from minillm import backend
from minillm.backend import (
    STREAM_MAX_ROWS,
    BackendError,
    blas_product,
    fast_products,
    product_choices,
    requested_fast_products,
    reset_product_choices,
    rows_bucket,
    set_fast_products,
    to_numpy,
    weight_product,
    xp,
)
from minillm.config import GPTConfig, LlamaConfig
from minillm.kv_cache import KVCache
from minillm.llama import Llama
from minillm.model import GPT

streaming = pytest.importorskip("minillm.streaming")  # needs numba

ROWS = (1, 2, 3, 7, 16, 17)  # n: a decode step, blocks of 4 and their tails, past 16
SHAPES = ((5, 9), (7, 577), (1, 33), (130, 64))  # (out, in): in % 4 != 0, a single output, in % 8 == 0
TOL = 1e-5  # relative to the magnitude sum_t |x[i, t] w[j, t]| (float32 rounding of a reordered sum)


@pytest.fixture(autouse=True)
def fresh_policy():
    """Every test starts with the streaming path on and measured, and no measured winners."""
    set_fast_products(True)
    reset_product_choices()
    yield
    set_fast_products(backend.requested_fast_products())
    reset_product_choices()


def as_layout(w, layout: str):
    """w (out, in) with contiguous rows ('rows', Llama) or as the transpose of an [in, out] array ('cols', GPT-2)."""
    return np.ascontiguousarray(w) if layout == "rows" else np.ascontiguousarray(w.T).T


def check_product(product, n: int, out: int, inner: int, layout: str, seed: int = 0) -> None:
    """product(x, w) == x @ w.T for x (n, in), w (out, in) in ``layout``, within float32 rounding of the
    magnitude of each sum (computed in float64)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, inner), dtype=np.float32)
    w = as_layout(rng.standard_normal((out, inner), dtype=np.float32), layout)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64) + 1e-30
    got = np.asarray(product(x, w))
    assert got.shape == (n, out) and got.dtype == np.float32, (got.shape, got.dtype)
    err = np.abs(got - want) / scale
    assert err.max() <= TOL, f"n={n} out={out} in={inner} {layout}: max relative error {err.max():.2e}"


@pytest.mark.parametrize("layout", ["rows", "cols"])
@pytest.mark.parametrize("out, inner", SHAPES)
@pytest.mark.parametrize("n", ROWS)
def test_the_streaming_kernel_matches_blas(n, out, inner, layout):
    """Both kernels, every tail: n % 4 token rows, out % 4 weight rows (rows), in % 4 weight rows (cols)."""
    check_product(streaming.stream_product, n, out, inner, layout)


def test_blas_itself_passes_the_check():
    check_product(blas_product, 3, 7, 577, "rows")


# ---- the bug zoo: classic wrong kernels, each rejected by check_product -------------------------


def transposed_weight(x, w):  # reads w[t, j] for w[j, t]: right shape only when out == in
    return (x @ w).astype(np.float32)


def missing_inner_tail(x, w):  # the blocked loop's tail (in % 4 columns) forgotten
    k = (x.shape[1] // 4) * 4
    return (x[:, :k] @ w[:, :k].T).astype(np.float32)


def missing_row_tail(x, w):  # the last out % 4 weight rows never written (left as they were: zero here)
    y = np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    m = (w.shape[0] // 4) * 4
    y[:, :m] = x @ w[:m].T
    return y


def uninitialised_output(x, w):  # sums added into an output that held something before (np.empty)
    y = np.full((x.shape[0], w.shape[0]), 0.5, dtype=np.float32)  # what a reused buffer might hold
    y += x @ w.T
    return y


def one_token_row_for_all(x, w):  # the token loop's index stuck at row 0
    return np.repeat(x[:1] @ w.T, x.shape[0], axis=0).astype(np.float32)


@pytest.mark.parametrize("wrong", [transposed_weight, missing_inner_tail, missing_row_tail, uninitialised_output,
                                   one_token_row_for_all])
def test_the_check_rejects_the_classic_wrong_kernels(wrong):
    """Square weights catch a transpose; in = 9 and out = 9 catch a forgotten tail; n = 3 a stuck row."""
    with pytest.raises(AssertionError):
        for layout in ("rows", "cols"):
            check_product(wrong, 3, 9, 9, layout)


# ---- backend.weight_product: batch shapes, the measured choice, the switch -----------------------


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (1, 17), (4, 16)])
@pytest.mark.parametrize("layout", ["rows", "cols"])
def test_weight_product_keeps_batch_dims_on_both_paths(shape, layout):
    """(B, T, in) -> (B, T, out), streamed (measure=False) and by BLAS, equal within float32 rounding."""
    rng = np.random.default_rng(1)
    x = xp.asarray(rng.standard_normal((*shape, 577), dtype=np.float32))
    w = xp.asarray(as_layout(rng.standard_normal((13, 577), dtype=np.float32), layout))
    want = to_numpy(blas_product(x, w))
    set_fast_products(True, measure=False)
    got = to_numpy(weight_product(x, w))
    assert got.shape == (*shape, 13)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(backend.is_gpu(), reason="the streaming path is NumPy's; CuPy and the stand-in keep their @")
def test_the_first_product_of_a_bucket_measures_and_answers_like_the_later_ones():
    """The measurement runs on the real product and records a winner per (out, in, layout, bucket); the
    first call already answers with the winner's bits, so a repeated forward repeats them exactly;
    n = 3 and n = 4 share a bucket, n = 5 does not."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((40, 24), dtype=np.float32)
    x = rng.standard_normal((1, 3, 24), dtype=np.float32)
    first = weight_product(x, w)
    assert set(product_choices()) == {(40, 24, "rows", 4)}
    winner = product_choices()[(40, 24, "rows", 4)]
    expected = x @ w.T if winner == "blas" else streaming.stream_product(x[0], w)[None]
    assert np.array_equal(first, expected) and np.array_equal(weight_product(x, w), first)
    weight_product(x[:, :1].repeat(4, axis=1), w)  # n = 4: the same bucket, nothing new measured
    weight_product(x[:, :1].repeat(5, axis=1), w)  # n = 5: bucket 8
    assert set(product_choices()) == {(40, 24, "rows", 4), (40, 24, "rows", 8)}


@pytest.mark.skipif(backend.is_gpu(), reason="the streaming path is NumPy's")
def test_prefills_other_dtypes_and_other_layouts_stay_on_blas_unmeasured():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 16), dtype=np.float32)
    big = rng.standard_normal((STREAM_MAX_ROWS + 1, 16), dtype=np.float32)
    assert np.array_equal(weight_product(big, w), big @ w.T)  # a prefill: BLAS, never timed
    x64 = rng.standard_normal((2, 16))
    assert weight_product(x64, w).dtype == np.float64  # float64 in: BLAS, NumPy's promotion
    strided = rng.standard_normal((8, 32), dtype=np.float32)[:, ::2]  # neither rows nor columns contiguous
    x = rng.standard_normal((2, 16), dtype=np.float32)
    assert np.array_equal(weight_product(x, strided), x @ strided.T)
    assert product_choices() == {}


def test_the_switch_turns_the_streaming_path_off():
    """set_fast_products(False): BLAS's bits exactly, nothing measured; the env var says the same."""
    set_fast_products(False)
    assert not fast_products()
    rng = np.random.default_rng(4)
    x, w = (xp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in ((2, 5, 12), (6, 12)))
    assert bool((weight_product(x, w) == x @ w.T).all()) and product_choices() == {}
    assert requested_fast_products("0") is False and requested_fast_products("") is False
    assert requested_fast_products("1") is True
    with pytest.raises(BackendError, match="MINILLM_FAST_PRODUCTS='maybe'"):
        requested_fast_products("maybe")


def test_cupy_and_the_strict_stand_in_keep_their_own_products():
    assert fast_products() is (not backend.is_gpu())


def test_the_stream_must_win_on_the_best_and_the_median_run():
    """The docstring's example; a tie keeps BLAS, the reference."""
    assert backend.stream_wins([5, 6, 9], [4, 5, 8]) == "stream"
    assert backend.stream_wins([5, 6, 9], [4, 8, 9]) == "blas"  # best faster, median slower: within the noise
    assert backend.stream_wins([5, 6, 9], [5, 6, 9]) == "blas"


def test_rows_buckets_are_powers_of_two():
    assert [rows_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [1, 2, 4, 4, 8, 8, 16, 16, 32, 64]


# ---- the models: logits and greedy tokens with the streaming path on and off ---------------------

GPT_CFG = GPTConfig(vocab_size=37, block_size=32, n_layer=2, n_head=2, n_embd=20)  # in = 20, 60, 80
LLAMA_CFG = LlamaConfig(vocab_size=41, n_layer=2, n_head=3, n_kv_head=1, n_embd=18, n_hidden=34,
                        block_size=32)  # in = 18 and 34: not multiples of 4 or 8


def logits_both_ways(model, ids):
    """Logits of a prefill and of a cached 3-token verify, BLAS only and streaming every product."""
    out = {}
    for fast in (False, True):
        set_fast_products(fast, measure=False)
        cache = KVCache(model.config, max_len=len(ids) + 3)
        first = to_numpy(model.forward(xp.asarray([ids]), cache))
        then = to_numpy(model.forward(xp.asarray([[1, 2, 3]]), cache))
        out[fast] = (first, then)
    return out


@pytest.mark.parametrize("make", [
    pytest.param(lambda: GPT.init(GPT_CFG, seed=1), id="gpt", marks=pytest.mark.uses_exercise("3.1")),
    pytest.param(lambda: Llama.init(LLAMA_CFG, seed=1), id="llama",
                 marks=pytest.mark.uses_exercise("3.1", "8.1", "8.2", "8.3")),
])
def test_model_logits_are_the_same_with_the_streaming_path_on_and_off(make):
    model = make()
    out = logits_both_ways(model, [5, 0, 9, 3, 7, 2, 11])
    for blas, fast in zip(out[False], out[True]):
        assert fast.dtype == np.float32
        np.testing.assert_allclose(fast, blas, atol=1e-5 * max(1.0, float(np.abs(blas).max())), rtol=1e-4)


def greedy(model, ids, steps):
    cache = KVCache(model.config, max_len=len(ids) + steps)
    logits = to_numpy(model.forward(xp.asarray([ids]), cache))[0, -1]
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = to_numpy(model.forward(xp.asarray([[tokens[-1]]]), cache))[0, -1]
    return tokens


@pytest.mark.uses_exercise("3.1")
def test_greedy_tokens_of_the_shipped_model_are_identical_with_the_streaming_path_on_and_off():
    from minillm.registry import load_model

    model, tok = load_model("target")
    ids = tok.encode("ROMEO:\nWhat say")
    set_fast_products(False)
    want = greedy(model, ids, 12)
    set_fast_products(True, measure=False)
    assert greedy(model, ids, 12) == want


def test_llama_stacks_qkv_and_gate_up_as_views_that_keep_the_parameters():
    """q, k, v (and gate, up) are row blocks of one matrix: same values, names and shapes; an in-place
    change of a parameter reaches the stacked matrix the forward reads."""
    model = Llama.init(LLAMA_CFG, seed=2)
    p, h = model.params, "layers.1."
    q_dim = LLAMA_CFG.n_head * LLAMA_CFG.head_size
    qkv = model.stacked[h + "qkv"]
    assert p[h + "self_attn.q_proj.weight"].shape == (q_dim, LLAMA_CFG.n_embd)
    assert bool((qkv[:q_dim] == p[h + "self_attn.q_proj.weight"]).all())
    p[h + "self_attn.q_proj.weight"][0, 0] = 7.0
    assert float(qkv[0, 0]) == 7.0
    assert model.stacked[h + "gate_up"].shape == (2 * LLAMA_CFG.n_hidden, LLAMA_CFG.n_embd)


def test_without_numba_every_product_is_blas(monkeypatch):
    """A machine where numba does not import (``_streaming`` found none) runs BLAS, measuring nothing."""
    monkeypatch.setattr(backend._POLICY, "streaming", False)
    assert not fast_products()
    x, w = np.ones((2, 8), dtype=np.float32), np.ones((3, 8), dtype=np.float32)
    assert np.array_equal(weight_product(x, w), x @ w.T) and product_choices() == {}
