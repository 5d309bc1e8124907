"""Chapter 3, the KV cache: cached generation is exact, the context policy keeps the cache's own
window, prompt caching reuses only what the same model computed, and the classic mistakes are caught."""

import numpy as np
import pytest

from minillm import (
    GPT,
    CacheFullError,
    GPTConfig,
    GrowingKVCache,
    KVCache,
    PrefixCache,
    fit_context,
    generate,
    generate_naive,
    kv_cache_bytes,
)
from minillm.backend import to_numpy

CACHES = [KVCache, GrowingKVCache]


def chunks_logits(model, idx, sizes, cache):
    """Run idx through the cache in chunks of the given sizes -> concatenated logits."""
    out, start = [], 0
    for n in sizes:
        out.append(to_numpy(model.forward(idx[:, start : start + n], cache)))
        start += n
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("cache_cls", [pytest.param(KVCache, marks=pytest.mark.exercise("3.1")), GrowingKVCache])
@pytest.mark.parametrize("sizes", [[32], [1] * 32, [7, 1, 1, 4, 19], [31, 1]])
def test_prefill_decode_verify_equal_full_forward(tiny_model, cache_cls, sizes):
    """Prefill (T tokens), decode (1) and verify (K) through the cache give the logits of one full
    forward pass within 1e-4. Fails for a wrong decode position offset or a missing causal mask
    in the multi-token path (the [7, 1, 1, 4, 19] chunks include a 4-token verify step)."""
    idx = np.random.default_rng(len(sizes)).integers(0, 13, (2, 32))
    full = to_numpy(tiny_model.forward(idx))
    cache = cache_cls(tiny_model.config, batch_size=2)
    np.testing.assert_allclose(chunks_logits(tiny_model, idx, sizes, cache), full, atol=1e-4)
    assert cache.length == 32


@pytest.mark.exercise("3.1")
def test_cache_is_preallocated_and_float32(tiny_config):
    cache = KVCache(tiny_config, batch_size=3)
    assert cache.k[0].shape == (3, 2, 32, 8) and cache.k[0].dtype == np.float32
    assert cache.nbytes == kv_cache_bytes(2, 2, 8, 32, batch=3, bytes_per_elem=4)
    buffers = [id(a) for a in cache.k]
    GPT.init(tiny_config).forward(np.zeros((3, 5), dtype=int), cache)
    assert [id(a) for a in cache.k] == buffers  # appended in place, no new arrays
    assert cache.bytes_used == cache.nbytes * 5 // 32


@pytest.mark.exercise("3.1")
def test_overflow_is_refused_and_loses_nothing(tiny_model):
    """An append past max_len raises CacheFullError before writing: the cache is unchanged."""
    cache = KVCache(tiny_model.config, max_len=10)
    tiny_model.forward(np.zeros((1, 8), dtype=int), cache)
    before = [to_numpy(a).copy() for a in cache.k]
    with pytest.raises(CacheFullError, match="max_len=10"):
        tiny_model.forward(np.ones((1, 3), dtype=int), cache)
    assert cache.length == 8
    for a, b in zip(cache.k, before):
        np.testing.assert_array_equal(to_numpy(a), b)
    with pytest.raises(ValueError, match="block_size"):
        KVCache(tiny_model.config, max_len=33)


@pytest.mark.exercise("3.2")
def test_truncate_alone_sets_the_length(tiny_config):
    """truncate(n) by itself: O(1), the length becomes n and the buffers stay; n outside 0..length is
    refused. Fails for an off-by-one truncate."""
    cache = KVCache(tiny_config)
    cache.advance(10)
    buffers = [id(a) for a in cache.k + cache.v]
    cache.truncate(7)
    assert cache.length == 7 and [id(a) for a in cache.k + cache.v] == buffers
    cache.truncate(7)
    assert cache.length == 7
    for bad in (8, -1):
        with pytest.raises(ValueError):
            cache.truncate(bad)
    cache.truncate(0)
    assert cache.length == 0


@pytest.mark.exercise("3.2")
@pytest.mark.parametrize("cache_cls", CACHES)
def test_truncate_rolls_back_exactly(tiny_model, cache_cls):
    """After truncate(n), feeding tokens n.. again gives the same logits as never having gone
    past n. Fails for an off-by-one truncate (n-1 or n+1 positions kept)."""
    idx = np.random.default_rng(3).integers(0, 13, (1, 20))
    cache = cache_cls(tiny_model.config)
    tiny_model.forward(idx[:, :12], cache)
    wrong = np.random.default_rng(4).integers(0, 13, (1, 5))
    tiny_model.forward(wrong, cache)  # a rejected speculative continuation
    cache.truncate(12)
    assert cache.length == 12
    got = to_numpy(tiny_model.forward(idx[:, 12:], cache))
    np.testing.assert_allclose(got, to_numpy(tiny_model.forward(idx))[:, 12:], atol=1e-4)
    with pytest.raises(ValueError):
        cache.truncate(21)
    with pytest.raises(ValueError):
        cache.truncate(-1)


def test_kv_cache_bytes_formula():
    """2 (K and V) x layers x kv heads x head dim x tokens x batch x bytes per element."""
    assert kv_cache_bytes(12, 12, 64, 1024) == 37_748_736  # GPT-2 small, fp16
    assert kv_cache_bytes(32, 8, 128, 1) == 131_072  # LLaMA-3-8B: 128 KiB per token
    assert kv_cache_bytes(80, 8, 128, 1_000_000) == 327_680_000_000  # LLaMA-3-70B at 1M tokens
    assert kv_cache_bytes(1, 1, 1, 10, batch=3, bytes_per_elem=4) == 240


PROMPTS = [[5], [1, 2, 3], list(range(13)) + [0, 4]]


@pytest.mark.exercise("3.3")
@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("temperature,top_k,top_p", [(0, None, None), (1.0, None, None), (0.8, 5, 0.9)])
def test_cached_generation_equals_naive(tiny_model, prompt, temperature, top_k, top_p):
    """Token for token, greedy and seeded sampling, up to filling the context exactly to
    block_size (32 = prompt + new tokens), including a 1-token prompt."""
    n = tiny_model.config.block_size - len(prompt)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    naive = generate_naive(tiny_model, prompt, n, **kw).tokens
    cached = generate(tiny_model, prompt, n, **kw)
    assert cached.tokens == naive
    assert generate(tiny_model, prompt, n, cache=GrowingKVCache(tiny_model.config), **kw).tokens == naive
    assert cached.stats.new_tokens == n and cached.stats.reprefills == 0


@pytest.mark.exercise("3.3")
def test_generation_feeds_one_token_per_step(tiny_model, monkeypatch):
    """The decode step runs only the newest token; when the cache is full (32) it re-prefills the last
    block_size // 2 = 16 tokens. A GrowingKVCache keeps this test of the decode step apart from 3.1."""
    sizes, forward = [], tiny_model.forward

    def counting(idx, cache=None):
        sizes.append(idx.shape[1])
        return forward(idx, cache)

    monkeypatch.setattr(tiny_model, "forward", counting)
    generate(tiny_model, [1, 2, 3], 40, temperature=0, cache=GrowingKVCache(tiny_model.config))
    assert sizes == [3] + [1] * 29 + [16] + [1] * 9  # prefill, decode to 32 cached, re-prefill, decode


@pytest.mark.exercise("3.3")
def test_cache_reused_across_generations_is_reset(tiny_model):
    """Passing the same cache to two generations gives the same tokens as two fresh caches."""
    cache = KVCache(tiny_model.config)
    first = generate(tiny_model, [1, 2, 3], 10, temperature=0, cache=cache).tokens
    second = generate(tiny_model, [4, 5], 10, temperature=0, cache=cache).tokens
    assert second == generate(tiny_model, [4, 5], 10, temperature=0).tokens
    assert first == generate(tiny_model, [1, 2, 3], 10, temperature=0).tokens


@pytest.mark.exercise("3.3")
def test_generation_past_the_context_keeps_working(tiny_model):
    """Past block_size the cache re-prefills the last half window (the documented policy)."""
    result = generate(tiny_model, [1, 2, 3], 100, temperature=1.0, seed=0)
    assert len(result.tokens) == 100
    assert result.stats.reprefills == 5  # the cache fills at 32, 48, 64, 80, 96 context tokens
    assert len(generate_naive(tiny_model, [1, 2, 3], 40, seed=0).tokens) == 40


@pytest.mark.exercise("3.3")
def test_stats(tiny_model):
    streamed = []
    r = generate(tiny_model, [1, 2], 6, temperature=0, on_token=streamed.append)
    assert streamed == r.tokens
    s = r.stats
    assert s.prompt_tokens == 2 and s.new_tokens == 6 and len(s.step_times_s) == 6
    assert s.ttft_s == s.step_times_s[0] and s.total_s >= s.ttft_s > 0 and s.tokens_per_s > 0
    assert s.kv_bytes == KVCache(tiny_model.config, max_len=8).nbytes and 0 < s.kv_bytes_used < s.kv_bytes


def test_bad_generation_arguments(tiny_model):
    with pytest.raises(ValueError, match="at least one token"):
        generate(tiny_model, [], 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_naive(tiny_model, [1], -1)


@pytest.mark.uses_exercise("3.1", "3.3")
def test_prefix_cache_reuses_longest_shared_prefix(tiny_model):
    """Prompt caching: the second prompt reuses the shared prefix, the output is identical."""
    system = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    pc = PrefixCache()
    a = generate(tiny_model, system + [7, 7], 8, temperature=0, prefix_cache=pc)
    b = generate(tiny_model, system + [8], 8, temperature=0, prefix_cache=pc)
    assert a.stats.reused_prefix_tokens == 0
    assert b.stats.reused_prefix_tokens == len(system)
    assert b.tokens == generate(tiny_model, system + [8], 8, temperature=0).tokens
    # a prompt entirely in the cache still computes its last token (its logits give token 1)
    c = generate(tiny_model, system + [8], 8, temperature=0, prefix_cache=pc)
    assert c.stats.reused_prefix_tokens == len(system) and c.tokens == b.tokens


@pytest.mark.uses_exercise("3.1", "3.3")
def test_prefix_cache_evicts_least_recently_used(tiny_model):
    pc = PrefixCache(max_entries=2)
    for prompt in ([1, 1, 1], [2, 2, 2], [3, 3, 3]):
        generate(tiny_model, prompt, 1, temperature=0, prefix_cache=pc)
    assert [tokens for _, tokens in pc.entries] == [(2, 2, 2), (3, 3, 3)]
    assert pc.longest_prefix(tiny_model, [1, 1, 1, 1]) == (None, 0)
    assert pc.longest_prefix(tiny_model, [3, 3, 3, 0]) == ((id(tiny_model), (3, 3, 3)), 3)


@pytest.mark.uses_exercise("3.1", "3.3")
def test_prefix_cache_hit_with_a_growing_cache(tiny_model):
    """A prefix hit goes through the cache contract (it replays the stored keys and values with
    positions/attend/advance), so it works with any decode cache: a GrowingKVCache gives the tokens
    of a fresh run (writing cache.k[layer] directly would fail on its list of None)."""
    system = [3, 1, 4, 1, 5, 9, 2, 6]
    pc = PrefixCache()
    for prompt in (system + [7], system + [8, 8]):
        hit = generate(tiny_model, prompt, 8, temperature=0, prefix_cache=pc, cache=GrowingKVCache(tiny_model.config))
    assert hit.stats.reused_prefix_tokens == len(system)
    assert hit.tokens == generate(tiny_model, system + [8, 8], 8, temperature=0).tokens


@pytest.mark.uses_exercise("3.1", "3.3")
def test_prefix_cache_never_reuses_another_models_keys(tiny_config):
    """Two models of the same shape: a prefix that model A filled is not reused for model B (its
    keys and values would fit and be wrong): B's logits and tokens are those of B alone."""
    a, b = GPT.init(tiny_config, seed=0), GPT.init(tiny_config, seed=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    pc = PrefixCache()
    generate(a, prompt, 4, temperature=0, prefix_cache=pc)
    alone = generate(b, prompt, 12, temperature=0)
    shared = generate(b, prompt, 12, temperature=0, prefix_cache=pc)
    assert shared.stats.reused_prefix_tokens == 0 and shared.tokens == alone.tokens
    logits, reused = pc.prefill(b, prompt + [0], KVCache(tiny_config))  # now B's own prefix is cached
    assert reused == len(prompt)
    np.testing.assert_allclose(to_numpy(logits), to_numpy(b.forward(np.array([prompt + [0]])))[0, -1], atol=1e-4)


# ----------------------------------------------------------------------------------------------
# the context policy: fit_context, the one function every decoding loop uses


@pytest.mark.exercise("3.3")
def test_context_policy_worked_examples(tiny_config):
    """Pending tokens that fit are fed as they are; otherwise the cache is reset and the last
    max_len // 2 tokens of the sequence are fed (the cache's max_len, not the model's block_size);
    a prompt longer than the window starts the same way but is not counted as a re-prefill."""
    seq = list(range(20))
    cache = KVCache(tiny_config, max_len=8)
    assert fit_context(cache, seq, seq) == (seq[-4:], False)  # a prompt longer than the window
    cache.advance(5)
    assert fit_context(cache, seq, [18, 19]) == ([18, 19], False) and cache.length == 5
    assert fit_context(cache, seq, [18, 19], extra=2) == (seq[-4:], True) and cache.length == 0
    cache.advance(8)
    assert fit_context(cache, seq, [19]) == (seq[-4:], True) and cache.length == 0
    one = KVCache(tiny_config, max_len=1)
    one.advance(1)
    assert fit_context(one, seq, [19]) == ([19], True)  # at least one token


@pytest.mark.exercise("3.3")
def test_context_policy_follows_the_caches_max_len(tiny_model, monkeypatch):
    """generate with a cache of max_len 10 (the model's context is 32): no CacheFullError, and one
    re-prefill of 10 // 2 = 5 tokens every 5 tokens, not one at every step (a window of
    block_size // 2 = 16 does not fit in the cache; a window of max_len re-prefills every step)."""
    sizes, forward = [], tiny_model.forward

    def counting(idx, cache=None):
        sizes.append(idx.shape[1])
        return forward(idx, cache)

    monkeypatch.setattr(tiny_model, "forward", counting)
    result = generate(tiny_model, [1, 2, 3], 200, temperature=0, cache=KVCache(tiny_model.config, max_len=10))
    assert len(result.tokens) == 200
    assert sizes == [3] + [1] * 7 + ([5] + [1] * 5) * 32  # prefill, decode to 10 cached, then every 6 steps
    assert result.stats.reprefills == 32


@pytest.mark.exercise("3.3")
def test_context_policy_counts_the_prompt_tokens_it_drops(tiny_model):
    """A prompt longer than the window keeps only its last tokens (``fit_context``); the stats say how
    many were dropped, so a caller can tell its user (they were dropped silently before). generate
    with a cache of 10 keeps 5 of 25; generate_naive keeps the context's 32 of 40; a prompt that fits
    drops none."""
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 13, 40)]
    cropped = generate(tiny_model, prompt[:25], 3, temperature=0, cache=KVCache(tiny_model.config, max_len=10))
    assert cropped.stats.dropped_prompt_tokens == 20
    assert cropped.tokens == generate(tiny_model, prompt[20:25], 3, temperature=0).tokens
    assert generate_naive(tiny_model, prompt, 2, temperature=0).stats.dropped_prompt_tokens == 8
    assert generate(tiny_model, prompt[:20], 3, temperature=0).stats.dropped_prompt_tokens == 0
    assert generate_naive(tiny_model, prompt[:20], 3, temperature=0).stats.dropped_prompt_tokens == 0


@pytest.mark.exercise("3.1")
def test_float32_throughout(tiny_model):
    cache = KVCache(tiny_model.config)
    logits = tiny_model.forward(np.array([[1, 2, 3]]), cache)
    assert logits.dtype == np.float32 and cache.v[1].dtype == np.float32


@pytest.mark.exercise("3.1")
def test_bigger_head_count_config():
    """Heads of different size: the cache layout follows the config."""
    cfg = GPTConfig(vocab_size=7, block_size=12, n_layer=1, n_head=4, n_embd=32)
    m = GPT.init(cfg, seed=2)
    idx = np.random.default_rng(0).integers(0, 7, (1, 12))
    got = chunks_logits(m, idx, [5, 1, 6], KVCache(cfg))
    np.testing.assert_allclose(got, to_numpy(m.forward(idx)), atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 5, 8, 20])
def test_prefill_in_pieces_equals_one_forward_and_feeds_at_most_chunk_tokens(tiny_model, monkeypatch, chunk):
    """A prompt fed in pieces of at most ``chunk`` tokens (a piece is a prefill after a cache) gives the
    last logits of one forward over it, and no forward sees more than ``chunk`` tokens, so the (T, V)
    logits a long prompt would return stay (chunk, V). Fails for a piece that skips or repeats tokens
    (20 = the prompt: one piece; 8 divides it; 5 and 1 leave none or a short last piece)."""
    from minillm.generate import prefill

    prompt = np.random.default_rng(0).integers(0, 13, 20).tolist()
    one = to_numpy(tiny_model.forward(np.asarray([prompt]))[0, -1])
    sizes, forward = [], tiny_model.forward

    def counting(idx, cache=None):
        sizes.append(idx.shape[1])
        return forward(idx, cache)

    monkeypatch.setattr(tiny_model, "forward", counting)
    cache = GrowingKVCache(tiny_model.config)
    np.testing.assert_allclose(to_numpy(prefill(tiny_model, prompt, cache, chunk=chunk)), one, atol=1e-4)
    assert sum(sizes) == len(prompt) == cache.length and max(sizes) <= chunk


def buffer_flags(a) -> list:
    """The ``VmFlags`` of the mapping that holds array ``a``'s first byte, from /proc/self/smaps."""
    address, found = a.ctypes.data, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:  # a mapping's first line: "start-end perms ..."
                start, end = (int(x, 16) for x in head[0].split("-"))
                found = start <= address < end
            elif found and head[0] == "VmFlags:":
                return head[1:]
    return []


def resident_kb(a) -> int:
    """kB of array ``a``'s own pages in memory, from the present bits of /proc/self/pagemap (a mapping's Rss would
    count its neighbours too: the kernel merges adjacent anonymous mappings)."""
    import os
    import struct

    page = os.sysconf("SC_PAGE_SIZE")
    first, last = a.ctypes.data // page, (a.ctypes.data + a.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", entries)) * page // 1024


@pytest.mark.host_only
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/pagemap"), reason="reads Linux's /proc/self")
def test_a_long_cache_takes_its_memory_as_it_is_written():
    """A KV cache as long as SmolLM2's context (8,192 positions, 3 heads of 64: 6.3 MB a layer's keys) holds only the
    pages its tokens were written to: its buffers are not marked for 2 MB pages (``VmFlags`` hg, what NumPy asks of
    every array of 4 MiB or more), and after a token in every head a layer's keys hold under 64 kB. The same for the
    int8 cache (three sequences) and the paged pool. Fails for buffers made with ``np.zeros`` (up to 0.6 s more before
    a chat's first answer and 256 MB more resident, where the kernel grants 2 MB pages on request)."""
    from minillm.config import LlamaConfig
    from minillm.kv_quant import Int8KVCache
    from minillm.paged_kv import PagedKVCache

    cfg = LlamaConfig(vocab_size=16, block_size=8192, n_layer=1, n_head=9, n_kv_head=3, n_embd=576, n_hidden=64)
    for buffers in (KVCache(cfg).k, Int8KVCache(cfg, batch_size=3).k, PagedKVCache(cfg, num_blocks=512).k):
        keys = buffers[0]
        assert keys.nbytes >= 4 << 20
        keys[0, :, 0] = 1  # a token in every head of the first sequence (of the pool's first block)
        flags, resident = buffer_flags(keys), resident_kb(keys)  # before anything reads the rest
        assert "hg" not in flags and resident < 64, (flags, resident)
        assert keys.sum() == keys.shape[1] * keys.shape[3]  # zeros but for what was written


@pytest.mark.host_only
@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_cache_written_in_a_forked_child_stays_the_parents():
    """A cache's buffers are the process's own memory: a child forked from it (a server's worker) that writes into
    them changes its copy only. Fails for buffers mapped shared."""
    import os

    cache = KVCache(GPTConfig(vocab_size=16, block_size=8192, n_layer=1, n_head=2, n_embd=128))  # 4 MiB of keys
    pid = os.fork()
    if pid == 0:  # the child: write, and leave without running the parent's cleanup
        cache.k[0][...] = 7.0
        os._exit(0)
    os.waitpid(pid, 0)
    assert not cache.k[0].any()
