"""logits -> probabilities (temperature, top-k, top-p) and probabilities -> token, under one
SamplingSettings object that is checked once, when it is made."""

import math

import numpy as np
import pytest

from minillm import sampling
from minillm.backend import xp
from minillm.sampling import MIN_TEMPERATURE, SamplingSettings, logits_to_probs, next_tokens, sample


def test_temperature_zero_is_greedy():
    probs = logits_to_probs(np.array([[0.1, 3.0, 2.9], [5.0, 0.0, 0.0]]), temperature=0)
    np.testing.assert_array_equal(probs, [[0, 1, 0], [1, 0, 0]])
    rng = np.random.default_rng(0)
    assert all(sample(probs[0], rng) == 1 for _ in range(50))


def test_greedy_one_hot_ties_go_to_the_first_maximum():
    probs = logits_to_probs(np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]), temperature=0)
    np.testing.assert_array_equal(probs, [[0, 1, 0], [1, 0, 0]])  # what argmax picks, exactly one 1 per row
    assert probs.dtype == np.float64


def _next_token_equals_sample_of_logits_to_probs(**kw):
    logits = np.random.default_rng(3).normal(size=(50, 17))
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    settings = SamplingSettings(**kw)
    got = [settings.next_token(row, rng_a) for row in xp.asarray(logits)]  # the loops' logits are on the device
    assert got == [sample(logits_to_probs(row, **kw), rng_b) for row in logits], kw
    assert all(isinstance(t, int) for t in got)


def test_next_token_is_sample_of_logits_to_probs():
    """Greedy takes the argmax without drawing; any other setting draws as sample(logits_to_probs())."""
    for temperature in (0, 0.7, 1.0, 1.3):
        _next_token_equals_sample_of_logits_to_probs(temperature=temperature)
    logits = np.random.default_rng(4).normal(size=17)
    assert len({SamplingSettings().next_token(logits, np.random.default_rng(s)) for s in range(30)}) > 1


def test_next_tokens_of_a_batch_equal_next_token_row_by_row():
    """next_tokens (one transfer to the host for the whole batch) picks, for every row, what next_token
    picks for that row alone with the row's own settings and generator: all greedy, all sampled, mixed."""
    logits = np.random.default_rng(4).normal(size=(6, 17)).astype(np.float32)
    for temperatures in ([0] * 6, [1.0] * 6, [0, 0.7, 1.0, 0, 1.3, 0]):
        settings = [SamplingSettings(t) for t in temperatures]
        alone = [s.next_token(row, np.random.default_rng(b)) for b, (s, row) in enumerate(zip(settings, logits))]
        batch = next_tokens(xp.asarray(logits), settings, [np.random.default_rng(b) for b in range(6)])
        assert batch == alone and all(isinstance(t, int) for t in batch), temperatures


@pytest.mark.exercise("1.1", "1.2")
def test_next_token_passes_top_k_and_top_p_on():
    _next_token_equals_sample_of_logits_to_probs(temperature=1.0, top_k=5)
    _next_token_equals_sample_of_logits_to_probs(temperature=1.3, top_p=0.8)
    _next_token_equals_sample_of_logits_to_probs(temperature=0.9, top_k=4, top_p=0.9)


def test_temperature_scales_logits():
    logits = np.log(np.array([0.5, 0.25, 0.25]))
    np.testing.assert_allclose(logits_to_probs(logits, temperature=1.0), [0.5, 0.25, 0.25])
    sharp = logits_to_probs(logits, temperature=0.5)  # p^2 renormalized
    np.testing.assert_allclose(sharp, np.array([0.25, 0.0625, 0.0625]) / 0.375)

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_probs_are_the_softmax_and_leave_the_logits_as_they_were(dtype, temperature):
    """``probs`` works in place on its own float64 copy: equal bit for bit to the softmax written with
    temporaries, and the caller's logits (a batch of rows, float32 or already float64) unchanged. Fails for a
    copy skipped on float64 input, or the temperature or the row maximum applied to the wrong rows."""
    logits = (np.random.default_rng(3).normal(size=(2, 3, 50)) * 4.0).astype(dtype)
    before = logits.copy()
    scaled = logits.astype(np.float64) / temperature
    expected = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    expected /= expected.sum(axis=-1, keepdims=True)
    np.testing.assert_array_equal(logits_to_probs(logits, temperature=temperature), expected)
    np.testing.assert_array_equal(logits, before)



@pytest.mark.exercise("1.1")
def test_top_k_keeps_exactly_the_k_largest():
    probs = logits_to_probs(np.array([1.0, 4.0, 3.0, 2.0, 0.0]), top_k=2)
    assert (probs > 0).tolist() == [False, True, True, False, False]
    np.testing.assert_allclose(probs.sum(), 1.0)
    np.testing.assert_allclose(probs[1] / probs[2], np.e)


@pytest.mark.parametrize("setting", [
    pytest.param({"top_k": 2}, marks=pytest.mark.exercise("1.1")),
    pytest.param({"top_p": 0.6}, marks=pytest.mark.exercise("1.2")),
    pytest.param({"top_k": 3, "top_p": 0.8}, marks=pytest.mark.exercise("1.1", "1.2")),
])
def test_top_k_and_top_p_filter_each_row_of_a_batch_alone(setting):
    """(B, T, V) logits: every row is filtered as it is alone. Fails for a k-th largest logit or a row's
    mass taken without keeping the row axis (1-D logits only) or over the whole batch."""
    logits = np.random.default_rng(5).normal(size=(2, 3, 7)) * 2.0
    batch = logits_to_probs(logits, **setting)
    alone = [[logits_to_probs(row, **setting) for row in rows] for rows in logits]
    np.testing.assert_allclose(batch, alone, atol=1e-12)


@pytest.mark.exercise("1.2")
def test_top_p_filter_itself_takes_each_row_of_a_batch_alone():
    """top_p_filter on (B, T, V) probabilities directly (``nucleus`` hands it one row at a time; other callers
    may not): every row as it is alone. Fails for a row's running mass taken over the whole batch."""
    probs = SamplingSettings(1.0).probs(np.random.default_rng(5).normal(size=(2, 3, 7)) * 2.0)
    alone = [[sampling.top_p_filter(row, 0.6) for row in rows] for rows in probs]
    np.testing.assert_allclose(sampling.top_p_filter(probs, 0.6), alone, atol=1e-12)


@pytest.mark.exercise("1.2")
def test_top_p_keeps_smallest_set_reaching_p():
    base = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(base)
    np.testing.assert_allclose(logits_to_probs(logits, top_p=0.5), [1, 0, 0, 0])  # 0.5 reaches 0.5
    np.testing.assert_allclose(logits_to_probs(logits, top_p=0.6), [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(logits_to_probs(logits, top_p=0.9), np.r_[base[:3], 0] / 0.95)
    np.testing.assert_allclose(logits_to_probs(logits, top_p=0.01), [1, 0, 0, 0])  # top token always kept


def nucleus_rows(size=3000):
    """Rows of ``size`` probabilities whose nucleus lies at each stage of ``sampling.nucleus``'s search: a few
    tokens, hundreds, nearly all (flat), and 400 tokens of one probability straddling where p is reached."""
    rng = np.random.default_rng(8)
    rows = [np.exp(rng.normal(size=size) * scale) for scale in (6.0, 2.0, 0.1)]
    tied = np.full(size, 1e-9)
    tied[rng.choice(size, 400, replace=False)] = 1.0  # 400 equal tokens, scattered: which come first decides
    rows.append(tied)
    return [row / row.sum() for row in rows]


@pytest.mark.exercise("1.2")
@pytest.mark.parametrize("p", [0.3, 0.9, 0.999])
def test_nucleus_keeps_what_top_p_keeps_on_a_large_vocabulary(p):
    """``nucleus`` (top-p on the few tokens it can keep) against top-p over the whole row: the same tokens kept
    and the same probabilities within rounding, for nuclei of a few tokens, hundreds and nearly all, and for
    ties straddling the cut, where sorting keeps the lower ids first; a batch and a row that is not contiguous.
    Fails for candidates whose ties come higher ids first, for a search that stops before their mass reaches p,
    and for candidates put back at the wrong ids."""
    for row in nucleus_rows():
        want = sampling.top_p_filter(row, p)
        got = sampling.nucleus(row.copy(), p)
        np.testing.assert_array_equal(got > 0, want > 0)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    batch = np.stack(nucleus_rows()).reshape(2, 2, -1)
    want = [[sampling.top_p_filter(r, p) for r in rows] for rows in batch]
    np.testing.assert_allclose(sampling.nucleus(batch.copy(), p), want, rtol=1e-12, atol=0)
    strided = np.stack([batch[0, 0], batch[0, 0]], axis=1)[:, 0]  # a view every other float
    np.testing.assert_allclose(sampling.nucleus(strided, p), want[0][0], rtol=1e-12, atol=0)


BAD_SETTINGS = {  # test id -> (arguments, the setting the error names); ids avoid the 1.1/1.2 keywords
    "t_negative": ({"temperature": -1}, "temperature"),
    "t_nan": ({"temperature": math.nan}, "temperature"),
    "t_inf": ({"temperature": math.inf}, "temperature"),
    "t_subnormal": ({"temperature": 1e-320}, "temperature"),  # logits / T overflow: NaN probabilities
    "t_below_min": ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
    "t_string": ({"temperature": "0.5"}, "temperature"),
    "k_zero": ({"temperature": 0, "top_k": 0}, "top_k"),
    "k_float": ({"top_k": 2.5}, "top_k"),
    "k_bool": ({"top_k": True}, "top_k"),
    "p_zero": ({"top_p": 0.0}, "top_p"),
    "p_above_one": ({"top_p": 1.5}, "top_p"),
    "p_nan": ({"top_p": math.nan}, "top_p"),
}


@pytest.mark.parametrize("kw,name", BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
def test_bad_sampling_settings_are_refused_when_made(kw, name):
    """Each bad value is refused with a ValueError naming the setting, by SamplingSettings and by
    logits_to_probs (which builds one); a NaN or subnormal temperature would otherwise emit token 0
    for ever."""
    with pytest.raises(ValueError, match=name):
        SamplingSettings(**kw)
    with pytest.raises(ValueError, match=name):
        logits_to_probs(np.zeros(3), **kw)


def test_good_sampling_settings_are_accepted():
    """Greedy 0 (int or float), the smallest allowed temperature, NumPy scalars, top_k = V, top_p = 1."""
    logits = np.array([1.0, 3.0, 2.0])
    good = [{"temperature": 0}, {"temperature": MIN_TEMPERATURE}, {"temperature": np.float32(0.7)}]
    for kw in good + [{"top_k": np.int64(3)}, {"top_p": 1.0}]:
        probs = SamplingSettings(**kw).probs(logits)
        assert np.all(np.isfinite(probs)) and probs.sum() == pytest.approx(1.0)
    assert SamplingSettings(MIN_TEMPERATURE).probs(logits).tolist() == [0, 1, 0]  # greedy in all but name
    with pytest.raises(TypeError, match="Generator"):
        sample(np.ones(3) / 3, 0)


def test_settings_are_frozen_and_checked_once(tiny_model, monkeypatch):
    """A loop makes one SamplingSettings at its entry and reuses it for every token: 20 tokens, one
    check. The object cannot be changed afterwards (it would skip the check)."""
    from minillm import generate_naive

    made = []
    check = SamplingSettings.__post_init__
    monkeypatch.setattr(sampling.SamplingSettings, "__post_init__", lambda self: made.append(check(self)))
    generate_naive(tiny_model, [1, 2], 20, temperature=0.8, seed=0)
    assert len(made) == 1
    with pytest.raises(AttributeError):
        SamplingSettings().temperature = -1


def test_sample_frequencies_and_never_zero_probability():
    p = np.array([0.2, 0.0, 0.5, 0.3])
    draws = np.array([sample(p, np.random.default_rng(0)) for _ in range(1)] +
                     list(sample(np.tile(p, (40000, 1)), np.random.default_rng(1))))
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[1] == 0
    np.testing.assert_allclose(freq, p, atol=0.01)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    p = np.full(10, 0.1)
    a = [sample(p, np.random.default_rng(7)) for _ in range(3)]
    g1, g2, g3 = (np.random.default_rng(s) for s in (7, 7, 8))
    seq1 = [sample(p, g1) for _ in range(20)]
    assert seq1 == [sample(p, g2) for _ in range(20)]
    assert seq1 != [sample(p, g3) for _ in range(20)]
    assert len(set(a)) == 1  # a fresh generator with the same seed gives the same first draw


@pytest.mark.parametrize("bad", [np.nan, np.inf, "all -inf"])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_non_finite_logits_are_refused_by_every_sampler(bad, temperature):
    """A NaN model made the sampler emit token 0 forever (NaN probabilities sample as 0, and a NaN
    argmax is its first index): next_token, next_tokens and probs refuse a row whose maximum is not
    finite, greedy or not; a row with some -inf (masked) logits is fine."""
    logits = np.array([[0.5, 2.0, -np.inf, 1.0], [1.0, 0.0, 3.0, 2.0]], dtype=np.float32)
    broken = logits.copy()  # numpy here; on a GPU backend the same rows as device arrays below
    if bad == "all -inf":
        broken[0] = -np.inf
    else:
        broken[0, 3] = bad
    logits, broken = xp.asarray(logits), xp.asarray(broken)
    settings, rng = SamplingSettings(temperature), np.random.default_rng(0)
    assert settings.next_token(logits[0], rng) in (0, 1, 3) and len(next_tokens(logits, [settings] * 2, [rng] * 2)) == 2
    for call in (lambda: settings.next_token(broken[0], rng), lambda: next_tokens(broken, [settings] * 2, [rng] * 2),
                 lambda: settings.probs(broken)):
        with pytest.raises(ValueError, match="logits are not finite"):
            call()


@pytest.mark.parametrize("setting", [{"temperature": 10**400}, {"top_p": 10**400}, {"temperature": -(10**400)}])
def test_integers_too_large_for_a_float_are_refused_with_a_value_error(setting):
    """math.isfinite(10**400) raises OverflowError: a setting that large is a ValueError naming its field."""
    with pytest.raises(ValueError, match=next(iter(setting))):
        SamplingSettings(**setting)
