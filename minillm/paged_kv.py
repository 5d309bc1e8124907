"""PagedAttention: the KV cache in fixed-size blocks, found through a per-sequence block table.

A contiguous cache (``KVCache``) reserves ``max_len`` positions per sequence up front; a sequence
that stops after 40 tokens leaves the rest of its reservation empty. PagedAttention (Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023,
the vLLM paper) does what an operating system does with virtual memory:

    one pool per layer:  K, V  (num_blocks, nh, page_size, hs)      the physical "pages"
    per sequence:        block table [7, 2, 9]                      logical block i -> physical block
                         token at position p  ->  block table[p // page_size], slot p % page_size

A sequence holds ceil(length / page_size) blocks, so at most page_size - 1 slots are wasted per
sequence (paper section 4.2). Because blocks are found by indirection, two sequences can point at the
same physical block (section 4.4): ``fork`` makes a child sequence that shares all of its parent's
blocks (reference counts go up); the first write into a shared block copies it (copy-on-write), so
neither sequence ever sees the other's later tokens. Parallel sampling and beam search rely on this;
so does prefix caching (``minillm.prefix_blocks``), which keeps a prompt's full blocks for later
prompts that start with the same tokens.

The pieces, bottom-up:

- ``BlockAllocator``: a free list and a reference count per block.
- ``PagedKVCache``: the memory manager: the pools, the block tables and lengths, ``add_sequence``,
  ``reserve``/``write`` (what a forward pass does), ``append``, ``fork``, ``truncate``, ``free``.
- ``gather_kv`` / ``paged_attention``: read K and V through the block tables; the reference is
  ``naive_attention`` on the same keys laid out contiguously.
- ``BatchView`` / ``SequenceView``: what ``GPT.forward`` is given as its ``cache``. A batch view runs
  sequences of *different* lengths in one forward: positions are per sequence (B, T), and each
  query only sees its own sequence's keys, through the model's own attention implementation.

Invariants (checked by ``PagedKVCache.check``; the tests drive them with random operations):
every block's reference count equals the number of block tables holding it plus one if the prefix
cache holds it; the free list holds exactly the blocks with count 0, each once; a block whose count
is above 1 is never written.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from .attention import naive_attention, softmax
from .backend import cache_zeros, xp
from .cache_contract import CacheFullError
from .config import check_count
from .flash_attention import auto_attention, naive_fits


class OutOfBlocksError(CacheFullError):
    """The block pool has no free (or evictable) block left; nothing was changed."""


def num_blocks_for(n_tokens: int, page_size: int) -> int:
    """Blocks that hold n_tokens: ceil(n_tokens / page_size).  (0, 16) -> 0, (16, 16) -> 1, (17, 16) -> 2"""
    return -(-n_tokens // page_size)


# --- the allocator --------------------------------------------------------------------------------


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 from a free list and counts the holders of each block.

    ``allocate`` -> a block with reference count 1; ``incref`` adds a holder (a forked sequence, the
    prefix cache); ``free`` removes one holder and returns the block to the free list when none is
    left. Example with 2 blocks: allocate() -> 0, incref(0), free(0) (count 1, still in use),
    free(0) (count 0, free again), free(0) -> ValueError (double free); free(-1) or free(2) ->
    ValueError (not a block of this pool).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"need num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_blocks = deque(range(num_blocks))  # handed out from the left, returned on the right
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        """A free block, now held once. Raises OutOfBlocksError when none is free."""
        if not self.free_blocks:
            raise OutOfBlocksError(f"out of KV blocks: all {self.num_blocks} blocks are in use")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def check_id(self, block) -> None:
        """Refuse anything but a block id 0..num_blocks-1 (a negative index would wrap around)."""
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block!r} is not a block of this pool (ids 0..{self.num_blocks - 1})")

    def incref(self, block: int) -> None:
        """One more holder of an allocated block."""
        self.check_id(block)
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free: it cannot be shared")
        self.ref_counts[block] += 1

    def free(self, block: int) -> None:
        """One holder fewer; the last one returns the block to the free list."""
        self.check_id(block)
        if self.ref_counts[block] < 1:
            raise ValueError(f"double free of block {block}: its reference count is already 0")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


# --- reading K/V through the block tables --------------------------------------------------------


def gather_kv(cache: PagedKVCache, seq_ids, layer: int, kv_lens=None):
    """K and V of a batch of sequences laid out contiguously, read through their block tables.

    -> k, v (B, nh, L, hs) with L = max(kv_lens), and kv_lens (B,). Sequence b's keys are valid
    at positions 0..kv_lens[b]-1; past that (shorter sequences) the values are padding to be masked.
    ``kv_lens`` defaults to the sequences' lengths; forward passes length + T (the T new keys are
    written before the lengths advance).
    """
    bs = cache.page_size
    kv_lens = [cache.lengths[s] for s in seq_ids] if kv_lens is None else [int(n) for n in kv_lens]
    L = max(kv_lens)
    nb = num_blocks_for(L, bs)  # blocks per row of the padded table
    rows = []
    for s, n in zip(seq_ids, kv_lens):
        table = cache.block_tables[s][: num_blocks_for(n, bs)]
        rows.append(table + [0] * (nb - len(table)))  # pad short tables with block 0 (masked later)
    tables = xp.asarray(rows, dtype=xp.int64).reshape(len(rows), nb)  # (B, nb)
    k_pool, v_pool = cache.k[layer], cache.v[layer]  # (num_blocks, nh, bs, hs) each
    # EXERCISE 6.1 BEGIN: gather the blocks named by `tables` and lay them out as (B, nh, L, hs)
    B, nh, hs = len(rows), k_pool.shape[1], k_pool.shape[3]
    k = k_pool[tables]  # (B, nb, nh, bs, hs): row b holds sequence b's blocks in logical order
    v = v_pool[tables]
    k = k.transpose(0, 2, 1, 3, 4).reshape(B, nh, nb * bs, hs)[:, :, :L]  # (B, nh, L, hs)
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, nh, nb * bs, hs)[:, :, :L]
    # EXERCISE 6.1 END
    return k, v, xp.asarray(kv_lens)


def paged_attention(q, cache: PagedKVCache, seq_ids, layer: int, kv_lens=None, q_pos=None):
    """softmax(q k^T / sqrt(hs) + M) v with k, v read through the block tables (``gather_kv``).

    q (B, nh, Tq, hs) -> (B, nh, Tq, hs). The Tq queries of sequence b are its last Tq positions:
    query t sits at absolute position kv_lens[b] - Tq + t and sees keys 0..that position, so
    sequences of different lengths run together (shorter ones simply see fewer keys). For one
    sequence this is ``naive_attention`` on the gathered K/V, term for term (the reference).
    ``q_pos`` (B, Tq) gives the query positions explicitly instead (a ragged batch: a row with fewer
    new tokens is right-padded, and its padding queries repeat its last position).
    A serving engine fuses the gather into the attention kernel instead of materializing K and V.
    """
    k, v, kv_lens = gather_kv(cache, seq_ids, layer, kv_lens)  # (B, nh, L, hs) x 2, (B,)
    Tq, hs, L = q.shape[2], q.shape[3], k.shape[2]
    if q_pos is None:
        if int(kv_lens.min()) < Tq:
            raise ValueError(f"paged_attention: {Tq} queries but a sequence holds only {int(kv_lens.min())} keys")
        q_pos = kv_lens[:, None] - Tq + xp.arange(Tq)[None, :]  # (B, Tq) absolute query positions
    q_pos = xp.asarray(q_pos)
    visible = xp.arange(L)[None, None, :] <= q_pos[:, :, None]  # (B, Tq, L): causal, own keys only
    att = (q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(hs))  # (B, nh, Tq, L)
    att = xp.where(visible[:, None], att, -xp.inf)  # mask broadcast over heads
    return softmax(att) @ v  # (B, nh, Tq, L) @ (B, nh, L, hs) -> (B, nh, Tq, hs)


# --- the cache ------------------------------------------------------------------------------------


class PagedKVCache:
    """K and V pools of fixed-size blocks shared by many sequences, each with its own block table.

    ``k[layer]``, ``v[layer]``: (num_blocks, n_kv_head, page_size, hs). ``block_tables[seq]``: the
    physical blocks of a sequence in logical order; ``lengths[seq]``: its number of cached tokens.
    Positions past ``config.block_size`` (the model's context) have no embedding, so a sequence holds
    at most that many tokens.

    ``prefix_blocks``: the prefix-block cache attached to this pool (``minillm.prefix_blocks``), or
    None. It is one more holder of the blocks it keeps; when the free list is empty, an allocation
    asks it to evict one of its blocks that no sequence holds.
    """

    def __init__(self, config, num_blocks: int, page_size: int = 16, dtype=None):
        if page_size < 1:
            raise ValueError(f"page_size (tokens per KV block) must be >= 1, got {page_size}")
        self.config, self.page_size, self.num_blocks = config, page_size, num_blocks
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, config.n_kv_head, page_size, config.head_size)  # (num_blocks, n_kv_head, bs, hs)
        dtype = xp.float32 if dtype is None else dtype
        self.k = [cache_zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [cache_zeros(shape, dtype=dtype) for _ in range(config.n_layer)]
        self.max_len = config.block_size  # tokens per sequence (the model's context)
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self._next_seq_id = 0
        self.prefix_blocks = None  # a PrefixBlockCache attaches itself here
        self.copies = 0  # copy-on-write copies, for the notebook and the benchmark

    # -- sizes --
    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V: 2 * n_layer * nh * page_size * hs * itemsize."""
        return 2 * len(self.k) * self.k[0][0].nbytes

    @property
    def token_bytes(self) -> int:
        return self.block_bytes // self.page_size

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (allocated once, whatever is in use)."""
        return self.num_blocks * self.block_bytes

    @property
    def bytes_used(self) -> int:
        """Bytes of the blocks held by a sequence or the prefix cache."""
        return (self.num_blocks - self.allocator.num_free) * self.block_bytes

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get: the free list plus prefix blocks no sequence holds."""
        evictable = 0 if self.prefix_blocks is None else self.prefix_blocks.num_evictable
        return self.allocator.num_free + evictable

    # -- sequences --
    def add_sequence(self) -> int:
        """A new, empty sequence -> its id."""
        seq = self._next_seq_id
        self._next_seq_id += 1
        self.block_tables[seq], self.lengths[seq] = [], 0
        return seq

    def sequence(self, seq_id: int | None = None) -> SequenceView:
        """A one-sequence view (a new sequence when seq_id is None) that ``generate`` can use as its cache."""
        return SequenceView(self, self.add_sequence() if seq_id is None else seq_id)

    def view(self, seq_ids, new_tokens=None) -> BatchView:
        """The cache ``GPT.forward`` uses to run the sequences ``seq_ids`` (possibly of different lengths).

        ``new_tokens``: how many of the T columns of each row are real tokens (a ragged batch, right-
        padded); by default all T are."""
        return BatchView(self, seq_ids, new_tokens)

    def check_seq(self, seq_id: int) -> None:
        """KeyError unless seq_id is a live sequence of this pool."""
        if seq_id not in self.block_tables:
            raise KeyError(f"unknown sequence {seq_id} (freed, or never added)")

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing all of seq_id's blocks (no copy): -> the child's id.

        Both sequences keep appending independently: the first write into a shared block copies
        it (see ``_copy_on_write``).
        """
        self.check_seq(seq_id)
        child = self.add_sequence()
        for block in self.block_tables[seq_id]:
            self.allocator.incref(block)
        self.block_tables[child] = list(self.block_tables[seq_id])  # a copy of the table, not of data
        self.lengths[child] = self.lengths[seq_id]
        return child

    def truncate(self, seq_id: int, n: int) -> None:
        """Keep the first n tokens of a sequence and release the blocks past them (speculative rollback).

        Example, page_size 4, length 10 (3 blocks): truncate to 8 keeps 2 blocks, to 5 keeps 2,
        to 4 keeps 1, to 0 keeps none. A kept block that is shared stays shared; the next write into
        it is copied first, so the other holders keep their tokens.
        """
        self.check_seq(seq_id)
        n = check_count("truncate's n (tokens to keep)", n, 0)  # 2.5 or True is no length
        # EXERCISE 6.3 BEGIN: refuse n outside 0..length; free the blocks past ceil(n / page_size)
        if not 0 <= n <= self.lengths[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id} of length {self.lengths[seq_id]} to {n}")
        table = self.block_tables[seq_id]
        keep = num_blocks_for(n, self.page_size)
        for block in table[keep:]:
            self.allocator.free(block)
        del table[keep:]
        self.lengths[seq_id] = n
        # EXERCISE 6.3 END

    def reset_sequence(self, seq_id: int) -> None:
        """Release all blocks of a sequence; it stays registered, empty."""
        self.check_seq(seq_id)
        for block in self.block_tables[seq_id]:
            self.allocator.free(block)
        self.block_tables[seq_id], self.lengths[seq_id] = [], 0

    def free(self, seq_id: int) -> None:
        """Release all blocks of a sequence and forget it."""
        self.reset_sequence(seq_id)
        del self.block_tables[seq_id], self.lengths[seq_id]

    # -- writing --
    def _new_blocks_needed(self, seq_ids, counts) -> int:
        """Blocks an append of counts[b] tokens to sequence b must allocate: blocks past the tables,
        plus copies of shared blocks. A block shared by r holders, m of them writing now, is copied
        min(m, r - 1) times: once r copies are down to one holder, the last writer writes in place."""
        needed, writers = 0, {}
        for s, T in zip(seq_ids, counts):
            table, length = self.block_tables[s], self.lengths[s]
            for i in range(length // self.page_size, num_blocks_for(length + T, self.page_size)):
                if i >= len(table):
                    needed += 1
                else:
                    writers[table[i]] = writers.get(table[i], 0) + 1
        return needed + sum(min(m, self.allocator.ref_counts[b] - 1) for b, m in writers.items())

    def reserve(self, seq_ids, T):
        """Make room for T more tokens in each sequence -> their absolute positions (B, T).

        ``T`` may also be one count per sequence (a ragged batch): the positions are then (B, max T),
        and a row with fewer tokens repeats its last position in its padding columns (example:
        lengths [5, 2], T = [1, 3] -> [[5, 5, 5], [2, 3, 4]]).
        Pass 1 checks everything and changes nothing: the positions fit the context, and the pool
        has a block for every new block and every copy. Pass 2 allocates: each block the new tokens
        land in is then present and held by this sequence alone (copy-on-write), so writes are safe.
        """
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a batch cannot hold the same sequence twice: {list(seq_ids)}")
        counts = [int(n) for n in T] if np.ndim(T) else [int(T)] * len(seq_ids)
        if min(counts) < 1:
            raise ValueError(f"every sequence of a batch needs at least one new token, got {counts}")
        for s, T in zip(seq_ids, counts):  # pass 1
            self.check_seq(s)
            if self.lengths[s] + T > self.max_len:
                raise CacheFullError(
                    f"sequence {s}: {self.lengths[s]} cached + {T} new tokens > max_len={self.max_len}"
                )
        needed = self._new_blocks_needed(seq_ids, counts)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"out of KV blocks: appending {sum(counts)} tokens to {len(seq_ids)} sequence(s) needs "
                f"{needed} blocks, {self.num_free_blocks} of {self.num_blocks} are free"
            )
        for s, T in zip(seq_ids, counts):  # pass 2
            table, length = self.block_tables[s], self.lengths[s]
            for i in range(length // self.page_size, num_blocks_for(length + T, self.page_size)):
                if i == len(table):
                    table.append(self._allocate_block())
                elif self.allocator.ref_counts[table[i]] > 1:
                    self._copy_on_write(s, i)
        T = max(counts)
        return np.array([[self.lengths[s] + min(t, n - 1) for t in range(T)] for s, n in zip(seq_ids, counts)])

    def _copy_on_write(self, seq_id: int, i: int) -> None:
        """Give seq_id a private copy of its i-th block, which other holders share.

        The new block comes from ``_allocate_block`` and receives the shared block's K and V in every
        layer; this sequence's reference to the shared block is dropped with ``allocator.free``;
        ``self.copies`` counts the copies made (the tests and the notebook read it).
        """
        # EXERCISE 6.2 BEGIN: copy the shared block table[i] into a new block; drop the shared one
        table = self.block_tables[seq_id]
        shared, private = table[i], self._allocate_block()
        for layer in range(len(self.k)):
            self.k[layer][private] = self.k[layer][shared]  # (nh, bs, hs)
            self.v[layer][private] = self.v[layer][shared]
        self.allocator.free(shared)  # one holder fewer; the others keep it
        table[i] = private
        self.copies += 1
        # EXERCISE 6.2 END

    def slot_mapping(self, seq_ids, positions):
        """Absolute positions, one row per sequence (rows may differ in length) -> (blocks, slots),
        each flat (N,) in row order: where each new token is written."""
        bs = self.page_size
        blocks = [self.block_tables[s][int(p) // bs] for s, row in zip(seq_ids, positions) for p in row]
        offsets = [int(p) % bs for row in positions for p in row]
        return xp.asarray(blocks, dtype=xp.int64), xp.asarray(offsets, dtype=xp.int64)

    def write(self, layer: int, slots, k, v, valid=None) -> None:
        """Store new k, v (B, nh, T, hs) at the (blocks, slots) of ``slot_mapping``.

        ``valid`` (B, T) bool marks the real tokens of a ragged batch; padding is not stored."""
        blocks, offsets = slots
        B, nh, T, hs = k.shape
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, T, nh, hs): token-major
        if valid is not None:
            k, v = k[xp.asarray(valid)], v[xp.asarray(valid)]  # (N, nh, hs): the real tokens only
        self.k[layer][blocks, :, offsets] = k.reshape(-1, nh, hs)
        self.v[layer][blocks, :, offsets] = v.reshape(-1, nh, hs)

    def append(self, seq_id: int, k, v) -> None:
        """Append T tokens' keys and values for every layer: k, v (n_layer, nh, T, hs).

        The same path forward takes (reserve, write per layer, advance), without a model; the
        tests and the notebook use it. Raises before changing anything if the blocks do not fit.
        """
        view = self.view([seq_id])
        view.positions(k.shape[2])
        for layer in range(len(self.k)):
            self.write(layer, view.slots, xp.asarray(k[layer])[None], xp.asarray(v[layer])[None])
        view.advance(k.shape[2])

    def read(self, seq_id: int, layer: int):
        """A sequence's cached K and V, contiguous: (nh, length, hs) each.

        One token at a time, the obvious way: the reference ``gather_kv`` is checked against.
        """
        self.check_seq(seq_id)
        table, bs = self.block_tables[seq_id], self.page_size
        pool_k, pool_v = self.k[layer], self.v[layer]  # (num_blocks, nh, bs, hs)
        n = self.lengths[seq_id]
        k = xp.zeros((pool_k.shape[1], n, pool_k.shape[3]), dtype=pool_k.dtype)  # (nh, length, hs)
        v = xp.zeros_like(k)
        for p in range(n):
            k[:, p] = pool_k[table[p // bs], :, p % bs]  # block table[p // bs], slot p % bs
            v[:, p] = pool_v[table[p // bs], :, p % bs]
        return k, v

    def _allocate_block(self) -> int:
        """A free block; when the free list is empty, the prefix-block cache gives one of its blocks back."""
        if self.allocator.num_free == 0 and self.prefix_blocks is not None:
            self.prefix_blocks.evict()
        return self.allocator.allocate()

    # -- inspection --
    def check(self) -> None:
        """Raise AssertionError if a reference count, the free list or a table is inconsistent."""
        expected = [0] * self.num_blocks
        for seq, table in self.block_tables.items():
            assert len(set(table)) == len(table), f"sequence {seq} holds a block twice: {table}"
            assert len(table) == num_blocks_for(self.lengths[seq], self.page_size), (
                f"sequence {seq}: {len(table)} blocks for {self.lengths[seq]} tokens"
            )
            for block in table:
                expected[block] += 1
        for block in [] if self.prefix_blocks is None else self.prefix_blocks.held_blocks():
            expected[block] += 1
        assert self.allocator.ref_counts == expected, "reference counts != holders (tables + prefix cache)"
        free = list(self.allocator.free_blocks)
        assert len(set(free)) == len(free), "a block is on the free list twice (double free)"
        assert set(free) == {b for b, n in enumerate(expected) if n == 0}, "free list != unheld blocks (leak)"

    def describe(self) -> str:
        """The block tables as text, one line per sequence: 'seq 0 (len 5): [3, 1] (refcounts 2, 1)'."""
        lines = []
        for seq, table in self.block_tables.items():
            counts = ", ".join(str(self.allocator.ref_counts[b]) for b in table)
            lines.append(f"seq {seq} (len {self.lengths[seq]}): {table} (refcounts {counts})")
        free = self.allocator.num_free
        cached = 0 if self.prefix_blocks is None else len(self.prefix_blocks.held_blocks())
        lines.append(f"free blocks: {free}/{self.num_blocks}, cached for reuse: {cached}")
        return "\n".join(lines)


# --- the views GPT.forward uses -------------------------------------------------------------------


class BatchView:
    """A batch of sequences of a PagedKVCache seen as one cache by ``GPT.forward``.

    forward(idx (B, T), view) runs B sequences together, each at its own length:
    ``positions(T)`` -> (B, T) with row b = lengths[b] .. lengths[b]+T-1 (reserving the blocks first),
    ``attend`` writes the new k, v into each sequence's blocks and attends with the model's attention
    implementation over each sequence's keys, ``advance(T)`` adds T to every length.

    A ragged batch (``new_tokens``: row b holds n_b <= T real tokens, right-padded to T): row b's
    padding columns repeat its last position, are never written to the cache and never counted in
    its length, so no real query can see them; their outputs are to be discarded.
    """

    def __init__(self, cache: PagedKVCache, seq_ids, new_tokens=None):
        self.cache, self.seq_ids = cache, [int(s) for s in seq_ids]
        self.new_tokens = None if new_tokens is None else [int(n) for n in new_tokens]
        if self.new_tokens is not None and len(self.new_tokens) != len(self.seq_ids):
            raise ValueError(f"{len(self.new_tokens)} new-token counts for {len(self.seq_ids)} sequences")
        self.slots = None  # (blocks, slots) of the tokens being written, set by positions()
        self.q_pos = self.valid = None  # (B, T) query positions and real-token mask, set by positions()

    @property
    def lengths(self) -> list[int]:
        return [self.cache.lengths[s] for s in self.seq_ids]

    def counts(self, T: int) -> list[int]:
        """Real tokens per row when the batch has T columns."""
        if self.new_tokens is None:
            return [T] * len(self.seq_ids)
        if max(self.new_tokens) > T:
            raise ValueError(f"new_tokens {self.new_tokens} exceed the batch's {T} columns")
        return self.new_tokens

    def positions(self, T: int):
        counts = self.counts(T)
        positions = self.cache.reserve(self.seq_ids, T if self.new_tokens is None else counts)  # (B, T)
        self.valid = np.arange(T)[None, :] < np.array(counts)[:, None]  # (B, T): False on padding
        self.slots = self.cache.slot_mapping(self.seq_ids, [row[:n] for row, n in zip(positions, counts)])
        self.q_pos = positions
        return positions

    def attend(self, layer: int, q, k, v, attention=None):
        """Store k, v (B, nh, T, hs); attend q over each sequence's own keys -> (B, nh, T, hs).

        ``attention``: the model's implementation, f(q, k, v, causal) like ``naive_attention``. The
        naive one (or None, or "auto" while the batch's scores ``naive_fits``) runs as
        ``paged_attention``, the whole batch at once; any other runs once
        per sequence on its keys gathered through its block table (``gather_kv``), its n real queries
        being the last n of its keys (query t at kv_len - n + t, the usual causal offset). A ragged
        batch's padding columns then get zeros: their outputs are discarded anyway.
        """
        if k.shape[0] != len(self.seq_ids):
            raise ValueError(f"the view holds {len(self.seq_ids)} sequences, got batch {k.shape[0]}")
        if self.slots is None:
            raise RuntimeError("attend before positions(): forward reserves the blocks first")
        counts = self.counts(k.shape[2])
        self.cache.write(layer, self.slots, k, v, None if self.new_tokens is None else self.valid)
        kv_lens = [n + c for n, c in zip(self.lengths, counts)]  # the new keys are written, not yet counted
        if attention is auto_attention and naive_fits(len(counts), q.shape[1], q.shape[2], max(kv_lens)):
            attention = naive_attention  # "auto" on a small batch: the naive math, all rows at once
        if attention is None or attention is naive_attention:
            return paged_attention(q, self.cache, self.seq_ids, layer, kv_lens, self.q_pos)
        T = q.shape[2]
        rows = []
        for b, (seq, n, kv_len) in enumerate(zip(self.seq_ids, counts, kv_lens)):
            k_b, v_b, _ = gather_kv(self.cache, [seq], layer, [kv_len])  # (1, n_kv_head, kv_len, hs) each
            q_b = q if len(counts) == 1 and n == T else q[b : b + 1, :, :n]  # (1, nh, n, hs)
            rows.append(attention(q_b, k_b, v_b, causal=True))
        if len(rows) == 1 and counts[0] == T:
            return rows[0]  # one sequence, no padding: the attention's own result, as a KVCache returns it
        out = xp.zeros(q.shape, dtype=q.dtype)  # (B, nh, T, hs)
        for b, (row, n) in enumerate(zip(rows, counts)):
            out[b, :, :n] = row[0]  # (nh, n, hs)
        return out

    def advance(self, T: int) -> None:
        for s, n in zip(self.seq_ids, self.counts(T)):
            self.cache.lengths[s] += n
        self.slots = None


class SequenceView(BatchView):
    """One sequence of a PagedKVCache with the interface of a ``KVCache`` (for ``generate``).

    ``length``, ``max_len``, ``reset()`` (release its blocks), ``truncate(n)``, ``nbytes`` (its
    blocks) and ``bytes_used`` (its tokens), ``fork()`` -> a view of a child sharing its blocks.
    """

    def __init__(self, cache: PagedKVCache, seq_id: int):
        cache.check_seq(seq_id)
        super().__init__(cache, [seq_id])
        self.seq_id = seq_id

    @property
    def length(self) -> int:
        return self.cache.lengths[self.seq_id]

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    @property
    def block_table(self) -> list[int]:
        return self.cache.block_tables[self.seq_id]

    def reset(self) -> None:
        self.cache.reset_sequence(self.seq_id)

    def truncate(self, n: int) -> None:
        self.cache.truncate(self.seq_id, n)

    def free(self) -> None:
        self.cache.free(self.seq_id)

    def fork(self) -> SequenceView:
        return SequenceView(self.cache, self.cache.fork(self.seq_id))

    @property
    def nbytes(self) -> int:
        return len(self.block_table) * self.cache.block_bytes

    @property
    def bytes_used(self) -> int:
        return self.length * self.cache.token_bytes
