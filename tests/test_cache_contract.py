"""The cache contract (minillm.cache_contract), checked against every cache that claims it.

Each test runs the same specification over the contiguous ``KVCache``, the naive ``GrowingKVCache``
and one sequence of a ``PagedKVCache`` (parameter ids "contiguous", "growing", "paged"): whatever a
decoding loop or prompt caching may rely on, every cache does. The exercises of chapters 3 and 6
live inside these caches, so each cache's parameter carries the ``uses_exercise`` marks of the
exercises it runs.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from test_kv_cache import chunks_logits

from minillm import GPT, GPTConfig, GrowingKVCache, KVCache, PagedKVCache, PrefixCache
from minillm.backend import to_numpy, xp
from minillm.cache_contract import CacheFullError, DecodeCache, ForwardCache, PromptCache
from minillm.prefix_blocks import PrefixBlockCache

CACHES = {  # id -> a decode cache for a config (max_len: the contiguous caches' capacity)
    "contiguous": lambda cfg, max_len=None: KVCache(cfg, max_len=max_len),
    "growing": lambda cfg, max_len=None: GrowingKVCache(cfg, max_len=max_len),
    "paged": lambda cfg, max_len=None: PagedKVCache(cfg, 64, 4).sequence(),  # max_len: the context
}
# each cache as a parameter, marked with the exercises whose code it runs (KVCache: attend and truncate;
# a paged sequence: gather and truncate)
CONTIGUOUS = pytest.param(CACHES["contiguous"], id="contiguous", marks=pytest.mark.uses_exercise("3.1", "3.2"))
GROWING = pytest.param(CACHES["growing"], id="growing")
PAGED = pytest.param(CACHES["paged"], id="paged", marks=pytest.mark.uses_exercise("6.1", "6.3"))
each_cache = pytest.mark.parametrize("make", [CONTIGUOUS, GROWING, PAGED])
# GrowingKVCache.truncate calls KVCache.truncate
GROWING_TRUNCATES = pytest.param(CACHES["growing"], id="growing", marks=pytest.mark.uses_exercise("3.2"))


@pytest.fixture
def model():
    """A 12-token context, so that the paged cache (whose max_len is the context) fills quickly."""
    return GPT.init(GPTConfig(vocab_size=13, block_size=12, n_layer=2, n_head=2, n_embd=16), seed=3)


def test_every_cache_keeps_the_protocols(model):
    """The three protocols, by isinstance: decode caches (KVCache, GrowingKVCache, a paged
    sequence), a forward cache (a paged batch view), prompt caches (PrefixCache, PrefixBlockCache)."""
    cfg = model.config
    paged = PagedKVCache(cfg, 8, 4)
    for cache in (KVCache(cfg), GrowingKVCache(cfg), paged.sequence()):
        assert isinstance(cache, DecodeCache) and isinstance(cache, ForwardCache)
    assert isinstance(paged.view([paged.add_sequence()]), ForwardCache)
    assert isinstance(PrefixCache(), PromptCache) and isinstance(PrefixBlockCache(paged), PromptCache)
    assert not isinstance(object(), ForwardCache) and not isinstance(KVCache(cfg), PromptCache)


@each_cache
def test_prefill_decode_verify_through_the_cache_equal_one_forward(model, make):
    """positions/attend/advance: chunks of 5, 1, 4 and 2 tokens (prefill, decode, a verify of 4)
    give the logits of one forward pass without a cache; length counts them."""
    idx = np.random.default_rng(0).integers(0, 13, (1, 12))
    cache = make(model.config)
    want = to_numpy(model.forward(idx))
    np.testing.assert_allclose(chunks_logits(model, idx, [5, 1, 4, 2], cache), want, atol=1e-4)
    assert cache.length == 12 == cache.max_len


@each_cache
def test_positions_refuse_an_overflow_before_writing(model, make):
    """positions(T) past max_len raises CacheFullError and the cache is as it was: the same tokens
    then fit and give the logits of one forward pass."""
    idx = np.random.default_rng(1).integers(0, 13, (1, 12))
    cache = make(model.config)
    model.forward(idx[:, :9], cache)
    with pytest.raises(CacheFullError):
        model.forward(idx[:, :4], cache)
    assert cache.length == 9
    got = to_numpy(model.forward(idx[:, 9:], cache))
    np.testing.assert_allclose(got, to_numpy(model.forward(idx))[:, 9:], atol=1e-4)


@pytest.mark.parametrize("make", [CONTIGUOUS, GROWING_TRUNCATES, PAGED])
def test_truncate_reset_and_bytes(model, make):
    """truncate(n) keeps the first n tokens (feeding the rest again gives the full forward's
    logits) and refuses n outside 0..length without changing anything; reset() empties the
    cache; 0 <= bytes_used <= nbytes, and bytes_used grows with the tokens held."""
    idx = np.random.default_rng(2).integers(0, 13, (1, 12))
    cache = make(model.config)
    model.forward(idx[:, :9], cache)
    used = cache.bytes_used
    assert 0 < used <= cache.nbytes
    for bad in (10, -1):
        with pytest.raises(ValueError):
            cache.truncate(bad)
        assert cache.length == 9
    cache.truncate(4)
    assert cache.length == 4 and cache.bytes_used <= used
    got = to_numpy(model.forward(idx[:, 4:], cache))
    np.testing.assert_allclose(got, to_numpy(model.forward(idx))[:, 4:], atol=1e-4)
    cache.reset()
    assert cache.length == 0 and cache.bytes_used <= used


@each_cache
@pytest.mark.parametrize("bad", [2.5, True, 4.0, "4", None])
def test_rollback_refuses_what_is_not_an_int(model, make, bad):
    """truncate(n) (the rollback) takes an int: 2.5 (a float in range), True (a bool, 1 to Python) or 4.0 set the
    length to a non-integer or slipped through as a count before; each is a ValueError naming n,
    and the cache is unchanged."""
    cache = make(model.config)
    model.forward(np.arange(9)[None] % 13, cache)
    with pytest.raises(ValueError, match="truncate's n"):
        cache.truncate(bad)
    assert cache.length == 9 and type(cache.length) is int


@each_cache
def test_prefix_cache_replays_through_the_contract(model, make):
    """PrefixCache reaches a cache only through the contract, so a prefix hit works with every
    decode cache: the reused tokens are counted and the logits are those of a fresh prefill."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    pc = PrefixCache()
    pc.prefill(model, prompt, make(model.config))
    cache = make(model.config)
    logits, reused = pc.prefill(model, prompt[:6] + [0, 7], cache)
    assert reused == 6 and cache.length == 8
    full = to_numpy(model.forward(np.array([prompt[:6] + [0, 7]])))[0, -1]
    np.testing.assert_allclose(to_numpy(logits), full, atol=1e-4)


GQA = SimpleNamespace(n_layer=1, n_head=4, n_kv_head=2, head_size=8, block_size=16)  # 2 query heads per KV head
@pytest.mark.parametrize("make", [CONTIGUOUS, GROWING,  # no truncate here
                                  pytest.param(CACHES["paged"], id="paged", marks=pytest.mark.uses_exercise("6.1"))])
def test_attend_hands_the_stored_kv_unchanged_to_the_attention_it_is_given(make):
    """Grouped-query shapes: q has n_head = 4 heads, k and v n_kv_head = 2. attend stores k, v
    and calls the attention callable it was given with q and every stored key and value, in order,
    still with 2 heads (mapping query heads to KV heads is the attention's job), and returns its
    result."""
    rng = np.random.default_rng(0)
    cache, calls = make(GQA), []

    def spy(q, k, v, causal=True):
        calls.append((q, to_numpy(k), to_numpy(v), causal))
        return "output"

    ks, vs = [], []
    for T in (3, 1, 2):
        q = xp.asarray(rng.normal(size=(1, 4, T, 8)).astype(np.float32))
        k, v = (rng.normal(size=(1, 2, T, 8)).astype(np.float32) for _ in range(2))
        ks.append(k)
        vs.append(v)
        cache.positions(T)
        assert cache.attend(0, q, xp.asarray(k), xp.asarray(v), spy) == "output"
        cache.advance(T)
        got_q, got_k, got_v, causal = calls[-1]
        assert got_q is q and causal
        np.testing.assert_array_equal(got_k, np.concatenate(ks, axis=2))  # (1, 2, L, 8)
        np.testing.assert_array_equal(got_v, np.concatenate(vs, axis=2))
