"""PagedAttention (chapter 6): block allocator, block tables, fork with copy-on-write, truncate,
prefix caching (PrefixBlockCache), paged_attention, and the model running on a PagedKVCache with
each attention implementation.

Each group of tests states what it proves. The last group runs the same checks against the classic
wrong versions (no copy-on-write, a leaked reference, truncate off by one, a fully cached prompt with
nothing left to prefill, wrong position offsets) and shows that each one is caught.
"""

import shutil

import numpy as np
import pytest
from host_reference import host_attention
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import GPT, GPTConfig, KVCache, generate, generate_naive
from minillm.attention import naive_attention
from minillm.backend import is_gpu, to_numpy, xp
from minillm.kv_cache import CacheFullError
from minillm.paged_kv import (
    BlockAllocator,
    OutOfBlocksError,
    PagedKVCache,
    gather_kv,
    num_blocks_for,
    paged_attention,
)
from minillm.prefix_blocks import PrefixBlockCache, block_hash, prefix_block_hashes

# A model-free config for the bookkeeping tests: 2 layers, 1 head of size 2, context 32.
BOOK = GPTConfig(vocab_size=3, block_size=32, n_layer=2, n_head=1, n_embd=2)



def stamp(tokens) -> float:
    """A number that names a prefix (a rolling hash < 2**20, exact in float32).

    A token's K is stamp(all tokens up to and including it), its V is -stamp: like a real model's
    keys, they depend on the whole prefix, so shared prefixes may share blocks and any token read
    from the wrong sequence shows up as a wrong stamp.
    """
    h = 0
    for t in tokens:
        h = (h * 131 + int(t) + 1) % 1_000_003
    return float(h)


def append_tokens(cache, seq, history, new_tokens):
    """Append new_tokens to seq, K/V stamped by prefix (history = the tokens already held)."""
    cfg = cache.config
    T = len(new_tokens)
    k = np.zeros((cfg.n_layer, cfg.n_head, T, cfg.head_size), dtype=np.float32)
    for t in range(T):
        for layer in range(cfg.n_layer):
            k[layer, :, t, :] = stamp(list(history) + list(new_tokens[: t + 1])) + layer * 2**21
    cache.append(seq, k, -k)


def assert_holds(cache, seq, tokens):
    """Sequence seq holds exactly the K/V stamps of `tokens`, in every layer."""
    assert cache.lengths[seq] == len(tokens)
    for layer in range(cache.config.n_layer):
        k, v = (to_numpy(a) for a in cache.read(seq, layer))
        expected = np.array([stamp(tokens[: p + 1]) + layer * 2**21 for p in range(len(tokens))])
        np.testing.assert_array_equal(k[0, :, 0], expected, err_msg=f"seq {seq} layer {layer} keys")
        np.testing.assert_array_equal(v[0, :, 0], -expected, err_msg=f"seq {seq} layer {layer} values")


def assert_refcounts(cache):
    """Every block's count = tables holding it + 1 if the prefix cache holds it; the free list is
    exactly the blocks nobody holds, each once; each table holds ceil(length / page_size) blocks."""
    expected = [0] * cache.num_blocks
    for seq, table in cache.block_tables.items():
        assert len(table) == num_blocks_for(cache.lengths[seq], cache.page_size), f"seq {seq} block count"
        assert len(set(table)) == len(table), f"seq {seq} holds a block twice"
        for b in table:
            expected[b] += 1
    for b in [] if cache.prefix_blocks is None else cache.prefix_blocks.blocks.values():
        expected[b] += 1
    assert cache.allocator.ref_counts == expected, "reference counts != holders: a leaked or lost reference"
    free = list(cache.allocator.free_blocks)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert set(free) == {b for b, n in enumerate(expected) if n == 0}, "leaked or double-freed block"


# --- the allocator --------------------------------------------------------------------------------


def test_allocator_hands_out_each_block_once_then_raises():
    alloc = BlockAllocator(num_blocks=4)
    assert sorted(alloc.allocate() for _ in range(4)) == [0, 1, 2, 3]
    with pytest.raises(OutOfBlocksError, match="out of KV blocks"):
        alloc.allocate()
    assert isinstance(OutOfBlocksError("x"), CacheFullError)  # callers catching CacheFullError see it


def test_allocator_refcounts_and_double_free():
    """A shared block returns to the free list only when its last holder frees it; once more is an error."""
    alloc = BlockAllocator(num_blocks=2)
    b = alloc.allocate()
    alloc.incref(b)
    alloc.free(b)
    assert alloc.ref_counts[b] == 1 and b not in alloc.free_blocks
    alloc.free(b)
    assert alloc.ref_counts[b] == 0 and alloc.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    with pytest.raises(ValueError, match="free"):
        alloc.incref(b)


def test_allocator_refuses_ids_that_are_not_its_blocks():
    """free(-1) or incref(-2) would index from the end and corrupt the free list: refused, nothing changed."""
    alloc = BlockAllocator(num_blocks=3)
    a, b = alloc.allocate(), alloc.allocate()
    before = (list(alloc.free_blocks), list(alloc.ref_counts))
    for bad in (-1, -2, 3, 1.0, True):
        with pytest.raises(ValueError, match="not a block of this pool"):
            alloc.free(bad)
        with pytest.raises(ValueError, match="not a block of this pool"):
            alloc.incref(bad)
    assert (list(alloc.free_blocks), list(alloc.ref_counts)) == before
    alloc.free(np.int64(a))  # numpy integers are block ids too
    assert alloc.num_free == 2 and alloc.ref_counts[b] == 1


def test_pool_refuses_bad_sizes():
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(BOOK, num_blocks=4, page_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(BOOK, num_blocks=0, page_size=4)


def test_num_blocks_for_is_a_ceiling():
    assert [num_blocks_for(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


# --- block tables, truncate, free -----------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_append_fills_blocks_and_reads_back(page_size):
    """Appends of awkward sizes hold ceil(length / page_size) blocks and read back in order."""
    cache = PagedKVCache(BOOK, num_blocks=40, page_size=page_size)
    seq, tokens = cache.add_sequence(), []
    for chunk in ([1], [2, 0, 1, 1, 2], [0] * 7, [1]):
        append_tokens(cache, seq, tokens, chunk)
        tokens += chunk
        assert len(cache.block_tables[seq]) == num_blocks_for(len(tokens), page_size)
        assert_holds(cache, seq, tokens)
    assert_refcounts(cache)


@pytest.mark.exercise("6.3")
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 8, 9, 10])
def test_truncate_keeps_exactly_ceil_n_blocks(n):
    """Off by one either way is caught: length 10, block 4 -> truncate(n) holds ceil(n / 4) blocks,
    keeps the first n tokens intact, and appending afterwards continues at position n."""
    cache = PagedKVCache(BOOK, num_blocks=8, page_size=4)
    seq, tokens = cache.add_sequence(), [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    append_tokens(cache, seq, [], tokens)
    cache.truncate(seq, n)
    assert len(cache.block_tables[seq]) == num_blocks_for(n, 4)
    assert cache.allocator.num_free == 8 - num_blocks_for(n, 4)
    assert_holds(cache, seq, tokens[:n])
    append_tokens(cache, seq, tokens[:n], [2, 2, 2])
    assert_holds(cache, seq, tokens[:n] + [2, 2, 2])
    assert_refcounts(cache)


@pytest.mark.exercise("6.3")
def test_truncate_rejects_out_of_range():
    cache = PagedKVCache(BOOK, num_blocks=4, page_size=4)
    seq = cache.add_sequence()
    append_tokens(cache, seq, [], [1, 2])
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(seq, 3)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(seq, -1)


def test_free_returns_every_block():
    cache = PagedKVCache(BOOK, num_blocks=6, page_size=2)
    a, b = cache.add_sequence(), cache.add_sequence()
    append_tokens(cache, a, [], [1, 2, 0])
    append_tokens(cache, b, [], [2])
    cache.free(a)
    cache.free(b)
    assert cache.allocator.num_free == 6 and cache.block_tables == {}
    with pytest.raises(KeyError, match="unknown sequence"):
        cache.free(a)


# --- fork and copy-on-write -----------------------------------------------------------------------


def check_fork_isolation(cache_cls):
    """Parent and child of a fork at a mid-block length each append; each sees only its own tokens."""
    cache = cache_cls(BOOK, num_blocks=10, page_size=4)
    parent, base = cache.add_sequence(), [1, 2, 0, 1, 2, 2]  # 1.5 blocks: the last one is shared
    append_tokens(cache, parent, [], base)
    child = cache.fork(parent)
    assert cache.block_tables[child] == cache.block_tables[parent]  # shared, not copied
    assert cache.allocator.num_free == 8
    append_tokens(cache, parent, base, [0, 0])
    append_tokens(cache, child, base, [1])
    assert_holds(cache, parent, base + [0, 0])
    assert_holds(cache, child, base + [1])
    assert_refcounts(cache)
    return cache, parent, child


@pytest.mark.exercise("6.2")
def test_fork_copy_on_write_isolates_sequences():
    cache, parent, child = check_fork_isolation(PagedKVCache)
    # the full first block is still shared; the half-full second one was copied exactly once
    assert cache.block_tables[parent][0] == cache.block_tables[child][0]
    assert cache.block_tables[parent][1] != cache.block_tables[child][1]
    assert cache.copies == 1


def test_fork_at_block_boundary_copies_nothing():
    """Full blocks are never written again, so a fork at a multiple of page_size never copies."""
    cache = PagedKVCache(BOOK, num_blocks=6, page_size=4)
    parent = cache.add_sequence()
    append_tokens(cache, parent, [], [1, 2, 0, 1])
    child = cache.fork(parent)
    append_tokens(cache, parent, [1, 2, 0, 1], [2])
    append_tokens(cache, child, [1, 2, 0, 1], [0])
    assert cache.copies == 0
    assert_holds(cache, child, [1, 2, 0, 1, 0])


@pytest.mark.exercise("6.2", "6.3")
def test_fork_then_truncate_into_shared_block_copies():
    """Speculative rollback on a forked sequence: truncating into a shared block and appending
    copies it first, so the other holder keeps its tokens."""
    cache = PagedKVCache(BOOK, num_blocks=8, page_size=4)
    a, base = cache.add_sequence(), [1, 2, 0, 1, 2, 0, 1]
    append_tokens(cache, a, [], base)
    b = cache.fork(a)
    cache.truncate(b, 5)
    append_tokens(cache, b, base[:5], [0, 0])
    assert_holds(cache, a, base)
    assert_holds(cache, b, base[:5] + [0, 0])
    assert_refcounts(cache)


@pytest.mark.exercise("6.2")
def test_fork_batch_writes_copy_a_shared_block_once():
    """Parent and child decoding in one batch: one copy, not two (the last writer writes in place),
    so a pool with a single free block suffices."""
    cache = PagedKVCache(BOOK, num_blocks=3, page_size=4)
    a = cache.add_sequence()
    append_tokens(cache, a, [], [1, 2, 0, 1, 2])  # 2 blocks
    b = cache.fork(a)
    k = np.stack([np.full((1, 1, 2), stamp([1, 2, 0, 1, 2, t]), np.float32) for t in (0, 1)])  # (B, nh, T, hs)
    view = cache.view([a, b])
    view.positions(1)  # what forward does: reserve, write every layer, advance
    for layer in range(BOOK.n_layer):
        cache.write(layer, view.slots, *(xp.asarray(t) for t in (k + layer * 2**21, -k - layer * 2**21)))
    view.advance(1)
    assert cache.copies == 1 and cache.allocator.num_free == 0
    assert_refcounts(cache)
    assert_holds(cache, a, [1, 2, 0, 1, 2, 0])
    assert_holds(cache, b, [1, 2, 0, 1, 2, 1])


# --- out of blocks, out of context ----------------------------------------------------------------


def snapshot(cache):
    return (
        {s: list(t) for s, t in cache.block_tables.items()},
        dict(cache.lengths),
        list(cache.allocator.ref_counts),
        list(cache.allocator.free_blocks),
        {} if cache.prefix_blocks is None else dict(cache.prefix_blocks.blocks),
    )


def test_out_of_blocks_raises_clearly_and_changes_nothing():
    cache = PagedKVCache(BOOK, num_blocks=3, page_size=2)
    a = cache.add_sequence()
    append_tokens(cache, a, [], [1, 2, 0])  # 2 blocks, 1 free
    b = cache.fork(a)  # appending to b needs a copy of block 1 plus a new block: 2 > 1 free
    before = snapshot(cache)
    with pytest.raises(OutOfBlocksError, match=r"needs 2 blocks, 1 of 3 are free"):
        append_tokens(cache, b, [1, 2, 0], [1, 1])
    assert snapshot(cache) == before
    assert_holds(cache, a, [1, 2, 0])
    assert_holds(cache, b, [1, 2, 0])


def test_context_overflow_raises_cache_full_and_changes_nothing():
    cache = PagedKVCache(BOOK, num_blocks=40, page_size=4)
    seq = cache.add_sequence()
    append_tokens(cache, seq, [], [0] * 30)
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match="max_len=32"):
        append_tokens(cache, seq, [0] * 30, [1, 1, 1])
    assert snapshot(cache) == before


# --- invariants under random operations (hypothesis) ----------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "fork", "truncate", "free"]),
        st.integers(0, 1000),
        st.lists(st.integers(0, 2), min_size=1, max_size=9),
    ),
    max_size=25,
)


SYSTEM_PROMPT = [0, 1, 2, 0, 1, 2, 2, 1]  # "new" prompts start with a piece of it, so prefixes repeat


def run_random_ops(cache, ops):
    """Apply ops, keeping a plain-list reference of each sequence's tokens; check after every op.
    With a prefix-block cache attached, every new sequence shares its prompt's cached blocks first."""
    prefix = cache.prefix_blocks
    ref = {}  # seq -> tokens it should hold
    for op, i, tokens in ops:
        if op == "new":
            tokens = SYSTEM_PROMPT[: i % (len(SYSTEM_PROMPT) + 1)] + tokens
        live = sorted(ref)
        seq = live[i % len(live)] if live else None
        before = snapshot(cache)
        try:
            if op == "new":
                seq = cache.add_sequence()
                ref[seq] = []
                if prefix is not None:
                    ref[seq] = tokens[: prefix.share(seq, tokens)]
                    assert_holds(cache, seq, ref[seq])  # shared blocks hold this prompt's prefix
                before = snapshot(cache)  # the sequence (and its shared prefix) stays if the append fails
                append_tokens(cache, seq, ref[seq], tokens[len(ref[seq]) :])
                ref[seq] = list(tokens)
                if prefix is not None:
                    prefix.store(seq, tokens)
            elif seq is None:
                continue
            elif op == "append":
                append_tokens(cache, seq, ref[seq], tokens)
                ref[seq] = ref[seq] + tokens
            elif op == "fork":
                ref[cache.fork(seq)] = list(ref[seq])
            elif op == "truncate":
                n = i % (len(ref[seq]) + 1)
                cache.truncate(seq, n)
                ref[seq] = ref[seq][:n]
            elif op == "free":
                cache.free(seq)
                del ref[seq]
        except CacheFullError:  # out of blocks or out of context: nothing may have changed
            assert snapshot(cache) == before
        assert_refcounts(cache)
        for s, toks in ref.items():
            assert_holds(cache, s, toks)  # in particular: no fork sees the other's later tokens
    for s in list(ref):
        cache.free(s)
    if prefix is not None:
        prefix.clear()
    assert cache.allocator.num_free == cache.num_blocks, "blocks leaked"
    assert_refcounts(cache)


@pytest.mark.exercise("6.2", "6.3")
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, page_size=st.sampled_from([1, 2, 4]))
def test_invariants_random_append_fork_truncate_free(ops, page_size):
    """Random append/fork/truncate/free: counts = holders, no leak, no double free, forks isolated,
    a failed append changes nothing, and freeing everything returns every block."""
    run_random_ops(PagedKVCache(BOOK, num_blocks=12, page_size=page_size), ops)


@pytest.mark.exercise("6.1", "6.2", "6.3", "6.4")
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, page_size=st.sampled_from([1, 2, 4]))
def test_invariants_random_ops_with_prefix_cache(ops, page_size):
    """The same with prefix caching on a small pool: prompts share cached blocks (counted once more
    for the cache's hold), eviction makes room, and a shared prefix always holds the right keys."""
    cache = PagedKVCache(BOOK, num_blocks=10, page_size=page_size)
    PrefixBlockCache(cache)
    run_random_ops(cache, ops)


# --- paged_attention ------------------------------------------------------------------------------


def random_cache(config, page_size, lengths, rng, num_blocks=64):
    """A cache holding random K/V for sequences of the given lengths (blocks interleaved across
    sequences, so a table is never just 0, 1, 2...) and the same K/V contiguous (B lists)."""
    cache = PagedKVCache(config, num_blocks=num_blocks, page_size=page_size)
    seqs = [cache.add_sequence() for _ in lengths]
    kv = {s: [] for s in seqs}
    for step in range(max(lengths)):
        for s, n in zip(seqs, lengths):
            if step < n:
                shape = (config.n_layer, config.n_head, 1, config.head_size)
                k = rng.standard_normal(shape, dtype=np.float32)
                v = rng.standard_normal(shape, dtype=np.float32)
                cache.append(s, k, v)
                kv[s].append((k, v))
    contiguous = {s: (np.concatenate([k for k, _ in kv[s]], 2), np.concatenate([v for _, v in kv[s]], 2))
                  for s in seqs}
    return cache, seqs, contiguous


@pytest.mark.exercise("6.1")
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_gather_kv_reads_through_the_block_tables(tiny_config, rng, page_size):
    cache, seqs, contiguous = random_cache(tiny_config, page_size, [7, 20, 1], rng)
    for layer in range(tiny_config.n_layer):
        k, v, lens = gather_kv(cache, seqs, layer)
        assert k.shape == (3, tiny_config.n_head, 20, tiny_config.head_size)
        for b, s in enumerate(seqs):
            n = cache.lengths[s]
            np.testing.assert_array_equal(to_numpy(k[b, :, :n]), contiguous[s][0][layer])
            np.testing.assert_array_equal(to_numpy(v[b, :, :n]), contiguous[s][1][layer])


@pytest.mark.exercise("6.1")
@pytest.mark.parametrize("page_size,length,Tq", [(1, 1, 1), (4, 9, 1), (4, 9, 3), (16, 16, 16), (16, 21, 5)])
def test_paged_attention_matches_naive_attention(tiny_config, rng, page_size, length, Tq):
    """One sequence: paged_attention == naive_attention on the contiguous K/V (query i at L - Tq + i)."""
    cache, seqs, contiguous = random_cache(tiny_config, page_size, [length], rng)
    q = rng.standard_normal((1, tiny_config.n_head, Tq, tiny_config.head_size), dtype=np.float32)
    for layer in range(tiny_config.n_layer):
        k, v = contiguous[seqs[0]][0][layer][None], contiguous[seqs[0]][1][layer][None]
        expected, _ = host_attention(q, k, v)
        out = to_numpy(paged_attention(xp.asarray(q), cache, seqs, layer))
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.exercise("6.1")
@pytest.mark.parametrize("Tq", [1, 2])
def test_paged_attention_batch_of_different_lengths(tiny_config, rng, Tq):
    """Sequences of lengths 2, 13, 5 in one call: each query sees only its own sequence's keys,
    up to its own position (what batched speculative decoding needs)."""
    cache, seqs, contiguous = random_cache(tiny_config, 4, [2, 13, 5], rng)
    q = rng.standard_normal((3, tiny_config.n_head, Tq, tiny_config.head_size), dtype=np.float32)
    out = to_numpy(paged_attention(xp.asarray(q), cache, seqs, 1))
    for b, s in enumerate(seqs):
        k, v = contiguous[s][0][1][None], contiguous[s][1][1][None]
        np.testing.assert_allclose(out[b : b + 1], host_attention(q[b : b + 1], k, v)[0], atol=1e-5)


# --- the model on a paged cache -------------------------------------------------------------------


@pytest.mark.exercise("6.1")
def test_forward_batch_of_different_lengths_matches_one_by_one(tiny_model, tiny_config, rng):
    """One forward over 3 sequences at lengths 5, 11, 1 (positions per sequence, (B, T)) gives each
    sequence the logits of running it alone without a cache."""
    cache = PagedKVCache(tiny_config, num_blocks=30, page_size=4)
    prompts = [rng.integers(0, 13, n).tolist() for n in (5, 11, 1)]
    seqs = [cache.add_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        tiny_model.forward(np.array([p]), cache.view([s]))
    new = rng.integers(0, 13, (3, 2))
    view = cache.view(seqs)
    np.testing.assert_array_equal(view.positions(2), [[5, 6], [11, 12], [1, 2]])  # (reserving is idempotent)
    logits = to_numpy(tiny_model.forward(new, view))
    assert logits.dtype == np.float32
    for b, p in enumerate(prompts):
        full = to_numpy(tiny_model.forward(np.array([p + new[b].tolist()])))[0, -2:]
        np.testing.assert_allclose(logits[b], full, atol=1e-5)
    assert view.lengths == [7, 13, 3]


def check_positions(cache_cls, model, config):
    """Prefill 6 tokens, then feed 3 more: the logits equal a no-cache forward of all 9 tokens."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    cache = cache_cls(config, num_blocks=8, page_size=4)
    view = cache.sequence()
    model.forward(np.array([ids[:6]]), view)
    out = to_numpy(model.forward(np.array([ids[6:]]), view))
    np.testing.assert_allclose(out[0], to_numpy(model.forward(np.array([ids])))[0, 6:], atol=1e-5)


@pytest.mark.exercise("6.1")
def test_positions_continue_after_cached_tokens(tiny_model, tiny_config):
    check_positions(PagedKVCache, tiny_model, tiny_config)


@pytest.mark.exercise("6.1")
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_generation_identical_greedy(tiny_model, tiny_config, page_size):
    """Paged == contiguous KVCache == naive recompute, token for token (20 tokens, inside the context)."""
    prompt = [1, 5, 2, 7, 3]
    cache = PagedKVCache(tiny_config, num_blocks=40, page_size=page_size)
    paged = generate(tiny_model, prompt, 20, temperature=0, cache=cache.sequence())
    contiguous = generate(tiny_model, prompt, 20, temperature=0, cache=KVCache(tiny_config))
    naive = generate_naive(tiny_model, prompt, 20, temperature=0)
    assert paged.tokens == contiguous.tokens == naive.tokens
    assert paged.stats.kv_bytes == num_blocks_for(24, page_size) * cache.block_bytes


@pytest.mark.exercise("6.1")
def test_generation_identical_seeded_sampling(tiny_model, tiny_config):
    prompt = [4, 4, 0, 12]
    kw = dict(temperature=0.9, top_k=6, top_p=0.95, seed=7)
    paged = generate(tiny_model, prompt, 24, cache=PagedKVCache(tiny_config, 20, 4).sequence(), **kw)
    assert paged.tokens == generate(tiny_model, prompt, 24, **kw).tokens
    assert paged.tokens == generate_naive(tiny_model, prompt, 24, **kw).tokens


@pytest.mark.exercise("6.1")
def test_generation_past_the_context_releases_blocks(tiny_model, tiny_config):
    """70 tokens through a 32-token context: the cache re-prefills (reset frees the sequence's
    blocks) exactly like the contiguous cache, and no block leaks."""
    cache = PagedKVCache(tiny_config, num_blocks=8, page_size=4)  # exactly one context's worth
    view = cache.sequence()
    paged = generate(tiny_model, [1, 2, 3], 70, temperature=0, cache=view)
    contiguous = generate(tiny_model, [1, 2, 3], 70, temperature=0)
    assert paged.tokens == contiguous.tokens and paged.stats.reprefills == contiguous.stats.reprefills > 0
    view.free()
    assert cache.allocator.num_free == 8


@pytest.mark.exercise("6.1")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["naive", "flash", "cuda"])
def test_forward_with_every_attention_gives_the_same_logits_paged_or_not(tiny_config, name):
    """GPT(attention=name) on a paged cache (blocks of 4; three sequences of lengths 5, 11, 1 prefilled
    one by one, then one ragged batched step of 2, 1, 2 new tokens) gives the logits the same model
    gives on a contiguous KVCache. 'cuda' runs the kernel (on a CPU: the same kernel, emulated)."""
    if name == "cuda" and not is_gpu() and shutil.which("g++") is None:
        pytest.skip("the 'cuda' attention on a CPU runs the emulated kernel, which needs g++")
    model = GPT.init(tiny_config, seed=0, attention=name)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 13, n).tolist() for n in (5, 11, 1)]
    new, counts = rng.integers(0, 13, (3, 2)), [2, 1, 2]
    cache = PagedKVCache(tiny_config, num_blocks=30, page_size=4)
    seqs = [cache.add_sequence() for _ in prompts]
    paged_prefill = [to_numpy(model.forward(np.array([p]), cache.view([s]))) for s, p in zip(seqs, prompts)]
    paged_step = to_numpy(model.forward(new, cache.view(seqs, counts)))  # (3, 2, V), padding columns ignored
    for b, (p, n) in enumerate(zip(prompts, counts)):
        kv = KVCache(tiny_config)
        np.testing.assert_allclose(paged_prefill[b], to_numpy(model.forward(np.array([p]), kv)), atol=1e-5)
        np.testing.assert_allclose(paged_step[b, :n], to_numpy(model.forward(new[b : b + 1, :n], kv))[0], atol=1e-5)


@pytest.mark.exercise("6.1")
def test_forward_runs_the_models_own_attention_per_sequence(tiny_model, tiny_config):
    """A paged forward calls the model's own attention function, once per sequence and layer, on that
    sequence's real queries and all its keys (query t at kv_len - n + t). A view that ignored it would
    silently run the naive math whatever attention the model was given."""
    calls = []

    def recording(q, k, v, causal=True):
        calls.append((q.shape[2], k.shape[2], causal))
        return naive_attention(q, k, v, causal)

    cache = PagedKVCache(tiny_config, num_blocks=30, page_size=4)
    seqs = [cache.add_sequence() for _ in range(2)]
    for s, p in zip(seqs, ([1, 2, 3], [4, 5, 6, 7, 8])):
        tiny_model.forward(np.array([p]), cache.view([s]))
    tiny_model.attention = recording
    logits = to_numpy(tiny_model.forward(np.array([[9, 10], [11, 0]]), cache.view(seqs, [2, 1])))
    assert calls == [(2, 5, True), (1, 6, True)] * tiny_config.n_layer
    tiny_model.set_attention("naive")
    full = to_numpy(tiny_model.forward(np.array([[4, 5, 6, 7, 8, 11]])))[0, -1]
    np.testing.assert_allclose(logits[1, 0], full, atol=1e-5)


@pytest.mark.exercise("6.1", "6.3")
def test_speculative_style_rollback_then_continue(tiny_model, tiny_config):
    """Feed 4 tokens, truncate 3 of them away, feed others: logits as if the 3 never happened."""
    cache = PagedKVCache(tiny_config, num_blocks=10, page_size=4)
    view = cache.sequence()
    tiny_model.forward(np.array([[1, 2, 3, 4, 5, 6]]), view)
    tiny_model.forward(np.array([[7, 8, 9, 10]]), view)
    view.truncate(7)
    out = to_numpy(tiny_model.forward(np.array([[11, 12]]), view))
    ref = to_numpy(tiny_model.forward(np.array([[1, 2, 3, 4, 5, 6, 7, 11, 12]])))[0, -2:]
    np.testing.assert_allclose(out[0], ref, atol=1e-5)
    cache.check()


# --- prefix caching -------------------------------------------------------------------------------


@pytest.mark.exercise("6.1", "6.4")
def test_block_hash_names_the_whole_prefix():
    h = block_hash(None, [1, 2])
    assert h == block_hash(None, [1, 2]) and isinstance(h, str)
    assert h != block_hash(None, [2, 1])  # order matters
    assert block_hash(h, [3, 4]) != block_hash(None, [3, 4])  # the parent matters
    assert block_hash(block_hash(None, [0, 0]), [1, 2]) != h
    assert block_hash(None, [1, 23]) != block_hash(None, [12, 3])  # token boundaries matter
    assert block_hash(None, np.array([1, 2])) == h  # numpy ints hash like Python ints


@pytest.mark.exercise("6.1", "6.4")
def test_prefix_hashes_cover_full_blocks_only():
    assert prefix_block_hashes([5, 6, 7], 4) == []
    hashes = prefix_block_hashes([5, 6, 7, 8, 9], 2)
    assert hashes == [block_hash(None, [5, 6]), block_hash(block_hash(None, [5, 6]), [7, 8])]


def prefill(prefix, model, prompt):
    view = prefix.cache.sequence()
    logits, reused = prefix.prefill(model, prompt, view)
    return view, to_numpy(logits), reused


@pytest.mark.exercise("6.1", "6.4")
@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_reuse_gives_the_same_logits(tiny_model, tiny_config, page_size):
    """A second prompt sharing 9 tokens reuses the full cached blocks of those 9 and computes the
    rest at the right positions: logits equal a prefill from scratch."""
    cache = PagedKVCache(tiny_config, num_blocks=30, page_size=page_size)
    prefix = PrefixBlockCache(cache)
    system = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    first, _, reused0 = prefill(prefix, tiny_model, system + [10, 11])
    second, logits, reused = prefill(prefix, tiny_model, system + [12, 0, 5])
    assert reused0 == 0 and reused == (9 // page_size) * page_size
    expected = to_numpy(tiny_model.forward(np.array([system + [12, 0, 5]])))[0, -1]
    np.testing.assert_allclose(logits, expected, atol=1e-5)
    shared = reused // page_size
    assert first.block_table[:shared] == second.block_table[:shared]
    assert_refcounts(cache)


def check_fully_cached_prompt(prefix_cls, model, config, length):
    """The same prompt twice: the second is entirely in cache, yet its last token is computed."""
    cache = PagedKVCache(config, num_blocks=20, page_size=4)
    prefix = prefix_cls(cache)
    prompt = [7, 1, 3, 3, 0, 2, 9, 8, 4, 4, 1, 6][:length]
    _, logits0, _ = prefill(prefix, model, prompt)
    _, logits, reused = prefill(prefix, model, prompt)
    assert reused == length - 1
    np.testing.assert_allclose(logits, logits0, atol=1e-5)
    assert_refcounts(cache)


@pytest.mark.exercise("6.1", "6.2", "6.4")
@pytest.mark.parametrize("length", [8, 12, 9])
def test_prefix_fully_cached_prompt_still_computes_last_token(tiny_model, tiny_config, length):
    """Lengths 8 and 12 are whole blocks: every block is cached, zero tokens would be left to
    prefill; the last token is recomputed into a copy of the last (shared) block."""
    check_fully_cached_prompt(PrefixBlockCache, tiny_model, tiny_config, length)


@pytest.mark.exercise("6.1", "6.4")
def test_prefix_generate_identical_tokens(tiny_model, tiny_config):
    """generate with the paged cache as its prefix cache: the same tokens as without, and the
    shared system prompt's blocks are reused (reported in the stats)."""
    cache = PagedKVCache(tiny_config, num_blocks=40, page_size=4)
    prefix = PrefixBlockCache(cache)
    view = cache.sequence()
    system = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    for question in ([9, 7], [9, 3, 2], [1]):
        prompt = system + question
        with_prefix = generate(tiny_model, prompt, 10, temperature=0, cache=view, prefix_cache=prefix)
        plain = generate(tiny_model, prompt, 10, temperature=0, cache=KVCache(tiny_config))
        assert with_prefix.tokens == plain.tokens
    assert with_prefix.stats.reused_prefix_tokens == 12
    assert_refcounts(cache)


@pytest.mark.exercise("6.1", "6.4")
def test_prefix_cached_blocks_outlive_the_sequence_and_are_evicted_lru(tiny_model, tiny_config):
    """Freed prompts leave their full blocks cached (count 1, the cache's hold); when the pool runs
    dry the least recently used cached block goes first, leaf before parent."""
    cache = PagedKVCache(tiny_config, num_blocks=6, page_size=4)
    prefix = PrefixBlockCache(cache)
    a, _, _ = prefill(prefix, tiny_model, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks: [1234][5678][9]
    b, _, _ = prefill(prefix, tiny_model, [0, 0, 0, 0, 1])  # blocks: [0000][1]
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    a.free()
    b.free()
    assert len(prefix.blocks) == 3 and cache.allocator.num_free == 3 and cache.num_free_blocks == 6
    assert all(cache.allocator.ref_counts[blk] == 1 for blk in prefix.blocks.values())
    # a new 16-token sequence needs 4 blocks: 3 free + 1 evicted: a's leaf [5678], the LRU chain's leaf
    c = cache.sequence()
    tiny_model.forward(np.array([[10] * 16]), c)
    assert prefix.evictions == 1
    assert a_blocks[1] not in prefix.blocks.values()
    assert a_blocks[0] in prefix.blocks.values() and b_blocks[0] in prefix.blocks.values()
    assert prefix.match([1, 2, 3, 4, 5, 6, 7, 8]) == [a_blocks[0]]
    assert_refcounts(cache)
    with pytest.raises(OutOfBlocksError):
        tiny_model.forward(np.array([[1] * 16]), cache.sequence())  # 4 blocks: 0 free + 2 evictable


@pytest.mark.exercise("6.1", "6.4")
def test_prefix_block_cache_refuses_another_model_or_pool(tiny_model, tiny_config):
    """Cached blocks hold one model's keys: a second model of the same shape must not reuse them
    (its logits would be silently wrong); a view of another pool and a second cache are refused too."""
    cache = PagedKVCache(tiny_config, num_blocks=20, page_size=4)
    prefix = PrefixBlockCache(cache)
    prefill(prefix, tiny_model, [1, 2, 3, 4, 5, 6])
    other = GPT.init(tiny_config, seed=1)
    with pytest.raises(ValueError, match="another model"):
        prefix.prefill(other, [1, 2, 3, 4, 5, 6], cache.sequence())
    with pytest.raises(ValueError, match="another PagedKVCache"):
        prefix.prefill(tiny_model, [1, 2], PagedKVCache(tiny_config, num_blocks=4, page_size=4).sequence())
    with pytest.raises(ValueError, match="already has"):
        PrefixBlockCache(cache)
    prefix.clear()  # forget the blocks: now the other model may fill the cache
    _, logits, reused = prefill(prefix, other, [1, 2, 3, 4, 5, 6])
    assert reused == 0
    np.testing.assert_allclose(logits, to_numpy(other.forward(np.array([[1, 2, 3, 4, 5, 6]])))[0, -1], atol=1e-5)


# --- the classic mistakes, each shown to be caught ------------------------------------------------


class NoCopyOnWrite(PagedKVCache):
    def _copy_on_write(self, seq_id, i):
        pass  # writes go straight into the shared block


class LeakyFree(PagedKVCache):
    def free(self, seq_id):
        del self.block_tables[seq_id], self.lengths[seq_id]  # forgets the blocks' references


class TruncateKeepsOneBlockTooFew(PagedKVCache):
    def truncate(self, seq_id, n):
        for b in self.block_tables[seq_id][n // self.page_size :]:  # floor instead of ceil
            self.allocator.free(b)
        del self.block_tables[seq_id][n // self.page_size :]
        self.lengths[seq_id] = n


class TruncateKeepsOneBlockTooMany(PagedKVCache):
    def truncate(self, seq_id, n):
        keep = n // self.page_size + 1
        for b in self.block_tables[seq_id][keep:]:
            self.allocator.free(b)
        del self.block_tables[seq_id][keep:]
        self.lengths[seq_id] = n


class ReusesWholePrompt(PrefixBlockCache):
    def share(self, seq_id, token_ids):
        blocks = self.match(token_ids)
        for b in blocks:
            self.cache.allocator.incref(b)
        self.cache.block_tables[seq_id], self.cache.lengths[seq_id] = list(blocks), len(blocks) * self.page_size
        return len(blocks) * self.page_size  # may be the whole prompt: nothing left to compute


class PositionsFromZero(PagedKVCache):
    def reserve(self, seq_ids, T):
        super().reserve(seq_ids, T)
        return np.array([list(range(T)) for _ in seq_ids])  # forgets the cached tokens


def test_mistake_no_copy_on_write_is_caught():
    with pytest.raises(AssertionError):
        check_fork_isolation(NoCopyOnWrite)


def test_mistake_leaked_reference_is_caught():
    with pytest.raises(AssertionError, match="leaked"):
        run_random_ops(LeakyFree(BOOK, num_blocks=12, page_size=2),
                       [("new", 0, [1, 2, 0]), ("fork", 0, [0]), ("free", 0, [0])])


@pytest.mark.parametrize("mutant,n", [(TruncateKeepsOneBlockTooFew, 5), (TruncateKeepsOneBlockTooMany, 8)])
def test_mistake_truncate_off_by_one_is_caught(mutant, n):
    cache = mutant(BOOK, num_blocks=8, page_size=4)
    seq = cache.add_sequence()
    append_tokens(cache, seq, [], [0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    cache.truncate(seq, n)
    with pytest.raises(AssertionError, match="block count"):
        assert_refcounts(cache)


@pytest.mark.exercise("6.4")
def test_mistake_fully_cached_prompt_is_caught(tiny_model, tiny_config):
    with pytest.raises(ValueError, match="at least one token"):
        check_fully_cached_prompt(ReusesWholePrompt, tiny_model, tiny_config, 8)


@pytest.mark.exercise("6.1")
def test_mistake_wrong_position_offsets_are_caught(tiny_model, tiny_config):
    with pytest.raises(AssertionError):
        check_positions(PositionsFromZero, tiny_model, tiny_config)
