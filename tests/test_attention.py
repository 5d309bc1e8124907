"""softmax and naive_attention: the reference every faster attention is checked against."""

import numpy as np
import pytest

from minillm.attention import (
    attention_entropy,
    attention_weights,
    causal_mask,
    naive_attention,
    sliding_window_mask,
    softmax,
)
from minillm.backend import to_numpy, xp


def test_softmax_huge_logits_are_safe():
    """Subtracting the max keeps exp() finite: [1000, 1000] -> [0.5, 0.5], not NaN."""
    out = to_numpy(softmax(xp.asarray([[1000.0, 1000.0], [-1000.0, 0.0], [3.0, 1e30]], dtype=np.float32)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0], [0.5, 0.5])
    np.testing.assert_allclose(out[2], [0.0, 1.0])
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-6)


def test_softmax_fully_masked_row_is_zero_not_nan():
    out = to_numpy(softmax(xp.asarray([[-np.inf, -np.inf], [0.0, -np.inf]])))
    np.testing.assert_array_equal(out, [[0.0, 0.0], [1.0, 0.0]])


def test_causal_mask_offset():
    """Query i of Tq sits at absolute position Tk - Tq + i."""
    np.testing.assert_array_equal(to_numpy(causal_mask(2, 4)), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(to_numpy(causal_mask(3, 3)), np.tril(np.ones((3, 3))))


def reference(q, k, v, causal, window=None):
    """Loop-over-rows float64 attention, independent of minillm. ``window``: keys last-window+1..last."""
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    out = np.zeros((B, nh, Tq, hs))
    for b in range(B):
        for h in range(nh):
            for i in range(Tq):
                last = Tk - Tq + i if causal else Tk - 1
                first = 0 if window is None else max(0, last - window + 1)
                s = k[b, h, first : last + 1] @ q[b, h, i] / np.sqrt(hs)
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h, first : last + 1]
    return out


@pytest.mark.parametrize("Tq,Tk", [(1, 1), (1, 9), (4, 9), (9, 9)])
@pytest.mark.parametrize("causal", [True, False])
def test_naive_attention_matches_loops(Tq, Tk, causal):
    rng = np.random.default_rng(Tq * 10 + Tk)
    q, k, v = (rng.normal(size=(2, 3, T, 8)) for T in (Tq, Tk, Tk))
    ours = to_numpy(naive_attention(*map(xp.asarray, (q, k, v)), causal))
    np.testing.assert_allclose(ours, reference(q, k, v, causal), atol=1e-12)


def test_tq_less_than_tk_equals_tail_of_full():
    """The last Tq rows of full causal attention == attention of those Tq queries over all keys:
    the rule that makes decode (Tq=1) and verify (Tq=K) exact."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 2, 10, 4)) for _ in range(3))
    q, k, v = (xp.asarray(t) for t in (q, k, v))
    full = to_numpy(naive_attention(q, k, v))
    np.testing.assert_allclose(to_numpy(naive_attention(q[:, :, -3:], k, v)), full[:, :, -3:], atol=1e-12)


def test_rows_sum_to_one_and_masked_weights_are_exactly_zero():
    rng = np.random.default_rng(1)
    q, k = (xp.asarray(rng.normal(size=(1, 1, 5, 4))) for _ in range(2))
    w = to_numpy(attention_weights(q, k))
    np.testing.assert_allclose(w.sum(-1), 1.0)
    assert (w[0, 0][np.triu_indices(5, 1)] == 0).all()


def test_more_queries_than_keys_is_refused():
    with pytest.raises(ValueError, match="Tq <= Tk"):
        naive_attention(xp.zeros((1, 1, 3, 4)), xp.zeros((1, 1, 2, 4)), xp.zeros((1, 1, 2, 4)))


def test_model_registry_names_naive_attention_and_rejects_unknown_names():
    """GPT(attention='naive') is this chapter's naive_attention; a name not in the table is refused."""
    from minillm.model import get_attention

    assert get_attention("naive") is naive_attention
    with pytest.raises(ValueError, match="unknown attention implementation 'fast'"):
        get_attention("fast")


# ---- 2.1 the sliding-window mask ---------------------------------------------------------------------


@pytest.mark.exercise("2.1")
def test_sliding_window_mask_examples():
    """The docstring's example; a window of Tk or more is the causal mask; window 1 is the diagonal.
    Fails for a window counted from the wrong end or off by one (window + 1 or window - 1 keys)."""
    np.testing.assert_array_equal(to_numpy(sliding_window_mask(2, 4, 2)), [[0, 1, 1, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(to_numpy(sliding_window_mask(6, 6, 6)), to_numpy(causal_mask(6, 6)))
    np.testing.assert_array_equal(to_numpy(sliding_window_mask(3, 7, 50)), to_numpy(causal_mask(3, 7)))
    np.testing.assert_array_equal(to_numpy(sliding_window_mask(4, 4, 1)), np.eye(4))
    np.testing.assert_array_equal(to_numpy(sliding_window_mask(1, 6, 3)), [[0, 0, 0, 1, 1, 1]])  # decode
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(2, 2, 0)


@pytest.mark.exercise("2.1")
@pytest.mark.parametrize("Tq,Tk,window", [(1, 9, 4), (4, 9, 3), (9, 9, 1), (9, 9, 5), (5, 9, 20)])
def test_sliding_window_attention_matches_loops(Tq, Tk, window):
    """attention_weights(..., window) @ v equals the loops over each query's last `window` keys,
    including fewer queries than keys (the queries are the last Tq positions)."""
    rng = np.random.default_rng(Tq * 100 + Tk * 10 + window)
    q, k, v = (rng.normal(size=(2, 3, T, 8)) for T in (Tq, Tk, Tk))
    ours = to_numpy(attention_weights(xp.asarray(q), xp.asarray(k), window=window) @ xp.asarray(v))
    np.testing.assert_allclose(ours, reference(q, k, v, True, window), atol=1e-12)


# ---- 2.2 the entropy of attention ----------------------------------------------------------------------


@pytest.mark.exercise("2.2")
def test_attention_entropy_extremes():
    """One key -> 0; n keys evenly -> log n; masked zeros count 0 (no NaN, no warning)."""
    w = np.array([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.25] * 4])
    with np.errstate(all="raise"):
        h = to_numpy(attention_entropy(xp.asarray(w)))
    np.testing.assert_allclose(h, [0.0, np.log(2), np.log(4)], atol=1e-12)


@pytest.mark.exercise("2.2")
def test_attention_entropy_of_real_weights():
    """On causal attention weights (B, nh, T, T) -> (B, nh, T), equal to -sum w log w over the keys
    each query sees; the first query sees one key, so its entropy is 0."""
    rng = np.random.default_rng(3)
    w = attention_weights(xp.asarray(rng.normal(size=(2, 3, 6, 4))), xp.asarray(rng.normal(size=(2, 3, 6, 4))))
    h, w = to_numpy(attention_entropy(w)), to_numpy(w)
    assert h.shape == (2, 3, 6)
    expected = [[[-(r[: i + 1] * np.log(r[: i + 1])).sum() for i, r in enumerate(head)] for head in b] for b in w]
    np.testing.assert_allclose(h, expected, atol=1e-12)
    np.testing.assert_allclose(h[..., 0], 0.0, atol=1e-12)
