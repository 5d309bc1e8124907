"""softmax and naive_attention: the reference every faster attention is checked against."""

import numpy as np
import pytest

from minillm.attention import attention_weights, causal_mask, naive_attention, softmax
from minillm.backend import to_numpy


def test_softmax_huge_logits_are_safe():
    """Subtracting the max keeps exp() finite: [1000, 1000] -> [0.5, 0.5], not NaN."""
    out = to_numpy(softmax(np.array([[1000.0, 1000.0], [-1000.0, 0.0], [3.0, 1e30]], dtype=np.float32)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0], [0.5, 0.5])
    np.testing.assert_allclose(out[2], [0.0, 1.0])
    np.testing.assert_allclose(out.sum(-1), 1.0, rtol=1e-6)


def test_softmax_fully_masked_row_is_zero_not_nan():
    out = to_numpy(softmax(np.array([[-np.inf, -np.inf], [0.0, -np.inf]])))
    np.testing.assert_array_equal(out, [[0.0, 0.0], [1.0, 0.0]])


def test_causal_mask_offset():
    """Query i of Tq sits at absolute position Tk - Tq + i."""
    np.testing.assert_array_equal(to_numpy(causal_mask(2, 4)), [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(to_numpy(causal_mask(3, 3)), np.tril(np.ones((3, 3))))


def reference(q, k, v, causal):
    """Loop-over-rows float64 attention, independent of minillm."""
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    out = np.zeros((B, nh, Tq, hs))
    for b in range(B):
        for h in range(nh):
            for i in range(Tq):
                last = Tk - Tq + i if causal else Tk - 1
                s = k[b, h, : last + 1] @ q[b, h, i] / np.sqrt(hs)
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h, : last + 1]
    return out


@pytest.mark.parametrize("Tq,Tk", [(1, 1), (1, 9), (4, 9), (9, 9)])
@pytest.mark.parametrize("causal", [True, False])
def test_naive_attention_matches_loops(Tq, Tk, causal):
    rng = np.random.default_rng(Tq * 10 + Tk)
    q, k, v = (rng.normal(size=(2, 3, T, 8)) for T in (Tq, Tk, Tk))
    ours = to_numpy(naive_attention(q, k, v, causal))
    np.testing.assert_allclose(ours, reference(q, k, v, causal), atol=1e-12)


def test_tq_less_than_tk_equals_tail_of_full():
    """The last Tq rows of full causal attention == attention of those Tq queries over all keys:
    the rule that makes decode (Tq=1) and verify (Tq=K) exact."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 2, 10, 4)) for _ in range(3))
    full = to_numpy(naive_attention(q, k, v))
    np.testing.assert_allclose(to_numpy(naive_attention(q[:, :, -3:], k, v)), full[:, :, -3:], atol=1e-12)


def test_rows_sum_to_one_and_masked_weights_are_exactly_zero():
    rng = np.random.default_rng(1)
    w = to_numpy(attention_weights(rng.normal(size=(1, 1, 5, 4)), rng.normal(size=(1, 1, 5, 4))))
    np.testing.assert_allclose(w.sum(-1), 1.0)
    assert (w[0, 0][np.triu_indices(5, 1)] == 0).all()


def test_more_queries_than_keys_is_refused():
    with pytest.raises(ValueError, match="Tq <= Tk"):
        naive_attention(np.zeros((1, 1, 3, 4)), np.zeros((1, 1, 2, 4)), np.zeros((1, 1, 2, 4)))


def test_get_attention_rejects_unknown_name():
    from minillm.attention import get_attention

    with pytest.raises(ValueError, match="unknown attention"):
        get_attention("fast")
