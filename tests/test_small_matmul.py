"""The few-row C matrix product (minillm/kernels/small_matmul.c) against x @ w in float64, and the model's
``matmul`` that uses it: which products go to the kernel, how to turn it off, what happens without a compiler."""

import numpy as np
import pytest

from minillm import GPT, GPTConfig
from minillm.backend import is_gpu, to_numpy, xp
from minillm.kernels import small_matmul as sm
from minillm.kernels.build import CACHE_ENV

pytestmark = pytest.mark.skipif(is_gpu(), reason="the C kernel serves the NumPy backend only")
KB = 8  # the kernel's block of weight rows (#define KB in small_matmul.c)


def reference(x, w):
    """x @ w in float64: the oracle."""
    return x.astype(np.float64) @ w.astype(np.float64)


def random_pair(rng, n, k, m):
    return rng.standard_normal((n, k), dtype=np.float32), rng.standard_normal((k, m), dtype=np.float32)


def assert_close(y, ref):
    """float32 products of length k: errors grow like sqrt(k) eps |x| |w|; 1e-5 of the scale is generous."""
    assert y.dtype == np.float32 and y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * (1 + np.abs(ref).max()))


# n: one row, the bound and past it; k: below, at and past the kernel's block of KB rows; m: vector tails
@pytest.mark.parametrize("n", [1, 2, 3, sm.MAX_ROWS, sm.MAX_ROWS + 1])
@pytest.mark.parametrize("k, m", [(1, 1), (KB - 1, 5), (KB, 16), (KB + 1, 13), (2 * KB + 3, 33), (40, 40)])
def test_matches_float64_reference(rng, n, k, m):
    """Every row and column is right: blocks of w rows with their tail (k % KB), out not a multiple of any
    vector width, a square w (where reading it transposed still runs, and is wrong)."""
    x, w = random_pair(rng, n, k, m)
    assert_close(sm.small_matmul(x, w), reference(x, w))


def test_rows_do_not_depend_on_each_other(rng):
    """Each y[i] is one sum over k in order: the same bits whether row i comes alone or with others (so a
    verification of n tokens and the decode of one give the same rows)."""
    x, w = random_pair(rng, sm.MAX_ROWS, 3 * KB + 5, 37)
    y = sm.small_matmul(x, w)
    for i in range(len(x)):
        assert np.array_equal(y[i], sm.small_matmul(x[i : i + 1], w)[0])


def test_non_contiguous_x(rng):
    """A strided or transposed view of x gives the product of its values (x is made contiguous first)."""
    big, w = rng.standard_normal((4, 2 * 21), dtype=np.float32), rng.standard_normal((21, 19), dtype=np.float32)
    for x in (big[:, ::2], big[:, ::2].T.copy().T, np.asfortranarray(big[:, :21])):
        assert_close(sm.small_matmul(x, w), reference(x, w))


def test_bad_input_is_refused(rng):
    """A shape mismatch, another dtype or a strided w: ValueError naming the problem, nothing computed."""
    x, w = random_pair(rng, 2, 6, 4)
    for bad_x, bad_w, match in [(x, w[:5], "expected x"), (x[0], w, "expected x"), (x.astype(np.float64), w, "float32"),
                                (x, w[:, ::2], "C-contiguous"), (x[:, :0], w[:0], "non-empty")]:
        with pytest.raises(ValueError, match=match):
            sm.small_matmul(bad_x, bad_w)


def test_matmul_uses_the_kernel_for_few_rows_only(rng, monkeypatch):
    """matmul(x, w) == x @ w for any leading shape; the kernel takes 2..MAX_ROWS rows (B x T of them), not one
    row (BLAS gemv), not more, not a strided w; MINILLM_SMALL_MATMUL=0 turns it off, anything but 0/1 is refused."""
    calls = []
    monkeypatch.setattr(sm, "small_matmul", lambda x, w: calls.append(len(x)) or x @ w)
    w = rng.standard_normal((6, 5), dtype=np.float32)
    for shape, expected in [((1, 1, 6), []), ((1, 2, 6), [2]), ((2, 3, 6), [6]), ((sm.MAX_ROWS, 6), [sm.MAX_ROWS]),
                            ((1, sm.MAX_ROWS + 1, 6), [])]:
        calls.clear()
        x = rng.standard_normal(shape, dtype=np.float32)
        y = sm.matmul(x, w)
        assert calls == expected, shape
        assert y.shape == shape[:-1] + (5,) and np.allclose(y, x @ w, atol=1e-6)
    calls.clear()
    x = rng.standard_normal((3, 6), dtype=np.float32)
    sm.matmul(x, np.asfortranarray(w))
    monkeypatch.setenv(sm.ENV, "0")
    sm.matmul(x, w)
    assert calls == [] and "MINILLM_SMALL_MATMUL=0" in sm.small_matmul_status()
    monkeypatch.setenv(sm.ENV, "yes")
    with pytest.raises(ValueError, match=sm.ENV):
        sm.matmul(x, w)


def test_without_a_compiler_numpy_computes_and_says_why(rng, monkeypatch, tmp_path):
    """No C compiler: matmul still returns x @ w, with one RuntimeWarning naming the missing compiler."""
    monkeypatch.setattr(sm, "COMPILER", "no-such-cc")
    monkeypatch.setattr(sm, "LOADED", {})
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    x, w = random_pair(rng, 3, 6, 5)
    with pytest.warns(RuntimeWarning, match="no-such-cc not found"):
        y = sm.matmul(x, w)
    assert np.array_equal(y, x @ w)
    assert "no-such-cc not found" in sm.small_matmul_status()


@pytest.mark.parametrize("n", [2, 5])
def test_model_logits_with_and_without_the_kernel(monkeypatch, n):
    """A cached forward over n tokens gives the same logits (float32 tolerance) and the same argmax with the
    kernel as with NumPy's product, and they stay float32."""
    cfg = GPTConfig(vocab_size=29, block_size=32, n_layer=2, n_head=2, n_embd=32)
    model = GPT.init(cfg, seed=1)
    idx = xp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=(1, n)))
    logits = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(sm.ENV, setting)
        logits[setting] = to_numpy(model.forward(idx))
    assert logits["1"].dtype == np.float32
    np.testing.assert_allclose(logits["1"], logits["0"], rtol=1e-4, atol=1e-5)
    assert np.array_equal(logits["1"].argmax(-1), logits["0"].argmax(-1))
