"""Attention for a few query rows over a cache (``minillm.row_attention``): the numba kernel against
``naive_attention``, its exponential, its machine code, where ``auto_attention`` uses it, and a bug zoo.

``check_attention`` is the specification: on every row count (one group, a group and its tail, past
``ROW_GROUP``), with the causal rule, an explicit mask, huge scores and a row whose keys are all masked, the
output equals the reference's within float32 rounding. The zoo plants the classic wrong versions (no max
subtracted, the mask ignored, no 1/sqrt(hs), the padded rows' mask taken from the wrong row, a fully
masked row left NaN) and checks that the same function rejects each.
"""

import math

import numba
import numpy as np
import pytest

from minillm import row_attention as ra
from minillm.attention import causal_mask, naive_attention, softmax
from minillm.config import LlamaConfig
from minillm.flash_attention import auto_attention
from minillm.kv_cache import KVCache
from minillm.qkernels import host_vector, vector_fma_count

pytestmark = pytest.mark.host_only  # numba on the host CPU only

ROWS = (1, 3, 6, 7, 13, 48)  # a decode step (SmolLM2: 3 rows), one group, a group and its tail, the limit
TOL = 1e-4  # float32 rounding of scores in the hundreds moves a weight by about 1e-5 of itself


def cases(Tq: int, Tk: int = 96, seed: int = 0):
    """(q, k, v, causal, mask) triples that each catch a different mistake: the causal rule, a random mask with one
    row fully masked, and scores of a few hundred (a softmax without its max overflows); q is a transposed view, as
    a model's heads are."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, Tq, 3, 64), dtype=np.float32).transpose(0, 2, 1, 3)  # as split_heads makes it
    k, v = (rng.standard_normal((1, 3, Tk, 64), dtype=np.float32) for _ in range(2))
    mask = rng.random((Tq, Tk)) < 0.6
    mask[-1] = False  # every key masked for the last row: zeros, as softmax gives
    yield q, k, v, True, None
    yield q, k, v, False, mask
    yield q * 8, k * 8, v, True, None  # scores of a few hundred: e^s overflows float32


def check_attention(attention, Tq: int) -> None:
    for q, k, v, causal, mask in cases(Tq):
        want = naive_attention(q, k, v, causal, mask=mask)
        got = attention(q, k, v, causal, mask=mask)
        assert got.shape == want.shape and np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("Tq", ROWS)
def test_the_kernel_equals_naive_attention(Tq):
    check_attention(ra.row_attention, Tq)


def test_views_of_a_kv_cache_are_read_in_place():
    """The keys a cache hands attention are a prefix of its buffer: ``fits`` takes them, and the kernel reads them
    without a copy (its output matches naive's on the same views)."""
    config = LlamaConfig(vocab_size=16, block_size=256, n_layer=1, n_head=4, n_kv_head=2, n_embd=64)
    cache = KVCache(config, batch_size=2, max_len=200)
    rng = np.random.default_rng(1)
    shape = cache.k[0].shape
    cache.k[0][:] = rng.standard_normal(shape, dtype=np.float32)
    cache.v[0][:] = rng.standard_normal(shape, dtype=np.float32)
    k, v = cache.k[0][:, :, :150], cache.v[0][:, :, :150]
    q = rng.standard_normal((shape[0], shape[1], 2, shape[3]), dtype=np.float32)
    assert not k.flags.c_contiguous and ra.fits(q, k) and ra.cache_buffer(k) is cache.k[0]
    np.testing.assert_allclose(ra.row_attention(q, k, v), naive_attention(q, k, v), rtol=TOL, atol=TOL)
    # a prefix of some of the buffer's batch rows or heads, or another dtype, is copied, never read past its end
    for kk, vv, qq in ((k[:1], v[:1], q[:1]), (k[:, :1], v[:, :1], q[:, :1]), (k, v.astype(np.float64), q)):
        assert ra.cache_buffer(kk) is None or ra.cache_buffer(vv) is None
        np.testing.assert_allclose(ra.row_attention(qq, kk, vv), naive_attention(qq, kk, vv), rtol=TOL, atol=TOL)


def test_auto_attention_takes_the_kernel_for_few_rows_over_many_keys(monkeypatch):
    calls = []
    monkeypatch.setattr(ra, "row_attention", lambda *a, **kw: calls.append(a[0].shape) or naive_attention(*a, **kw))
    rng = np.random.default_rng(2)
    for Tq, Tk in ((1, ra.MIN_KEYS), (ra.MAX_ROWS, 200), (1, ra.MIN_KEYS - 1), (ra.MAX_ROWS + 1, 200)):
        q, k = rng.standard_normal((1, 2, Tq, 16), dtype=np.float32), rng.standard_normal((1, 2, Tk, 16), np.float32)
        auto_attention(q, k, k)
    assert [shape[2] for shape in calls] == [1, ra.MAX_ROWS]
    assert not ra.fits(q.astype(np.float64), k) and not ra.fits(q, k.astype(np.float64))


def test_the_exponential_is_accurate_and_zero_past_float32s_range():
    x = np.linspace(-87.3, 0.0, 4001, dtype=np.float32)
    got = np.array([ra.exp_nonpositive(t) for t in x])
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=4e-7)
    assert [ra.exp_nonpositive(np.float32(t)) for t in (-87.5, -1e4, -np.inf, np.nan)] == [0.0] * 4


def test_the_kernel_compiles_to_vector_fmas():
    """numba's default settings would leave the dot products scalar; the kernel's fastmath flags let LLVM split each
    sum into vector lanes. Read the machine code: FMAs on full-width registers, few scalar ones."""
    kernel = numba.njit(fastmath=ra.FASTMATH, nogil=True, boundscheck=False)(ra.rows_kernel.py_func)
    kernel.compile(ra.signature(3, 64))
    counts = vector_fma_count(kernel.inspect_asm(kernel.signatures[0]))
    wide = "zmm" if host_vector()[0] == 16 else "ymm"
    assert counts[wide] >= 12, counts  # the 3 x 64 accumulators of the values' loop, 4 (or 8) vectors a row


# ---- the bug zoo: wrong versions ``check_attention`` must reject ----------------------------------------------


def no_max(q, k, v, causal=True, mask=None):
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    mask = mask if mask is not None else causal_mask(q.shape[2], k.shape[2])
    e = np.where(mask, np.exp(s), 0)
    return (e / np.where(e.sum(-1, keepdims=True) == 0, 1, e.sum(-1, keepdims=True))) @ v


def mask_ignored(q, k, v, causal=True, mask=None):
    return naive_attention(q, k, v, causal, mask=None)


def no_scale(q, k, v, causal=True, mask=None):
    return naive_attention(q * math.sqrt(q.shape[-1]), k, v, causal, mask=mask)


def padded_rows_mask_from_row_0(q, k, v, causal=True, mask=None):
    mask = mask if mask is not None else causal_mask(q.shape[2], k.shape[2]) if causal else None
    return naive_attention(q, k, v, causal, mask=None if mask is None else np.broadcast_to(mask[:1], mask.shape))


def fully_masked_row_nan(q, k, v, causal=True, mask=None):
    s = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    s = np.where(mask if mask is not None else causal_mask(q.shape[2], k.shape[2]), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True) @ v


@pytest.mark.parametrize("wrong", [no_max, mask_ignored, no_scale, padded_rows_mask_from_row_0, fully_masked_row_nan])
def test_the_zoo_is_rejected(wrong):
    with np.errstate(all="ignore"), pytest.raises(AssertionError):
        check_attention(wrong, 7)


def test_softmax_reference_gives_zeros_for_a_fully_masked_row():
    assert np.all(softmax(np.full((1, 4), -np.inf, dtype=np.float32)) == 0)
