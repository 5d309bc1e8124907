"""Prefix caching on a paged KV cache: a prompt's full blocks, named by a hash chain, reused by later prompts.

Because attention is causal, the keys and values of a prompt's first j tokens depend only on those j
tokens. A *full* block of a prompt is named by hash(parent block's hash, its token ids), so the name
covers the whole prefix up to the block's end; after a prefill the prompt's full blocks go into a
table hash -> block, and a later prompt that starts with the same tokens points its block table at
the blocks it finds instead of recomputing them (vLLM's automatic prefix caching, Kwon et al. 2023,
section 4.4). The last prompt token is always computed: its logits give the first output token.

``PrefixBlockCache(paged_cache)`` attaches to one ``PagedKVCache``, whose memory manager it never
replaces: it holds one reference on each block it keeps (so a block outlives its sequence), and when
the pool's free list is empty it gives back the least recently used block that no sequence holds.
Its ``prefill(model, prompt_ids, view) -> (last logits, tokens reused)`` is the prompt-cache call
``generate(..., prefix_cache=...)`` makes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from .backend import xp
from .paged_kv import PagedKVCache, SequenceView, num_blocks_for


def block_hash(parent_hash: str | None, token_ids) -> str:
    """sha256 of (the parent block's hash, this block's token ids): names a block by its whole prefix.

    Two blocks with the same tokens but different prefixes get different hashes (their keys and
    values differ: attention saw different earlier tokens). A cryptographic hash rather than Python's
    ``hash`` because a collision would silently hand one prompt another prompt's keys.
    Example: block_hash(None, [1, 2]) != block_hash(block_hash(None, [0, 0]), [1, 2]).
    """
    # EXERCISE 6.4 BEGIN: hash the parent's hash together with this block's token ids
    payload = f"{parent_hash}|{','.join(str(int(t)) for t in token_ids)}"
    return hashlib.sha256(payload.encode()).hexdigest()
    # EXERCISE 6.4 END


def prefix_block_hashes(token_ids, page_size: int) -> list[str]:
    """The chained hashes of the *full* blocks of a prompt (a partial last block has none).

    Example, page_size 2: [5, 6, 7, 8, 9] -> [h0 = block_hash(None, [5, 6]), block_hash(h0, [7, 8])]
    """
    hashes, parent = [], None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[start : start + page_size])
        hashes.append(parent)
    return hashes


class PrefixBlockCache:
    """hash -> block for the full prompt blocks of one PagedKVCache, least recently used first.

    ``match`` finds the cached blocks of a prompt's prefix, ``share`` points an empty sequence at them,
    ``store`` caches a prefilled prompt's full blocks, ``clear`` drops them all, ``prefill`` does the
    three around one forward pass. Eviction policy: a cached block that no sequence holds is evicted
    only when the pool needs a block and its free list is empty, least recently used first; a prompt's
    chain is touched leaf first, so within a chain the deepest block goes before its parents (a cached
    block whose parent is gone could never be matched). The blocks hold one model's keys and values:
    ``prefill`` refuses a second model.
    """

    def __init__(self, cache: PagedKVCache):
        if cache.prefix_blocks is not None:
            raise ValueError("this PagedKVCache already has a prefix-block cache")
        self.cache, self.page_size = cache, cache.page_size
        self.blocks: OrderedDict[str, int] = OrderedDict()  # hash -> block, least recently used first
        self.hashes: dict[int, str] = {}  # block -> its hash, for the blocks in self.blocks
        self.model = None  # whose keys and values the blocks hold, set by the first prefill
        self.evictions = self.reused_tokens = 0  # counters for the notebook and the benchmark
        cache.prefix_blocks = self

    # -- what the pool asks of its prefix-block cache --
    def held_blocks(self) -> list[int]:
        """The blocks this cache holds a reference on."""
        return list(self.blocks.values())

    def evictable(self, block: int) -> bool:
        return self.cache.allocator.ref_counts[block] == 1  # this cache is its only holder

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence holds: the pool may take them back."""
        return sum(1 for block in self.blocks.values() if self.evictable(block))

    def evict(self) -> None:
        """Return the least recently used block no sequence holds to the pool's free list (if any)."""
        for h, block in self.blocks.items():  # least recently used first
            if self.evictable(block):
                del self.blocks[h], self.hashes[block]
                self.cache.allocator.free(block)
                self.evictions += 1
                return

    # -- matching and caching prompts --
    def touch(self, hashes) -> None:
        """Mark a chain most recently used, leaf first so the parents end up the most recent."""
        for h in reversed(hashes):
            self.blocks.move_to_end(h)

    def match(self, token_ids) -> list[int]:
        """The cached blocks holding the longest run of full leading blocks of ``token_ids``."""
        blocks = []
        for h in prefix_block_hashes(token_ids, self.page_size):
            if h not in self.blocks:
                break
            blocks.append(self.blocks[h])
        return blocks

    def share(self, seq_id: int, token_ids) -> int:
        """Point an empty sequence at the cached blocks of its prompt -> number of tokens reused.

        At most len(token_ids) - 1 tokens are reused: the last prompt token must be computed, since
        its logits give the first output token (a prompt entirely in cache would otherwise leave
        nothing to prefill). Reusing a partial block is fine: the write of the first computed token
        copies it first, because this cache still holds it.
        """
        cache = self.cache
        cache.check_seq(seq_id)
        if cache.lengths[seq_id] or cache.block_tables[seq_id]:
            raise ValueError(f"share needs an empty sequence; {seq_id} holds {cache.lengths[seq_id]} tokens")
        blocks = self.match(token_ids)
        reused = min(len(blocks) * self.page_size, len(token_ids) - 1)
        blocks = blocks[: num_blocks_for(reused, self.page_size)]
        for block in blocks:
            cache.allocator.incref(block)
        cache.block_tables[seq_id], cache.lengths[seq_id] = list(blocks), reused
        self.touch([self.hashes[b] for b in blocks])
        self.reused_tokens += reused
        return reused

    def store(self, seq_id: int, token_ids) -> int:
        """Make the full blocks of a prefilled prompt findable by later prompts -> blocks added.

        ``token_ids`` are the tokens the sequence holds (its prompt). This cache takes one reference
        on each newly cached block, so it outlives the sequence until evicted.
        """
        cache = self.cache
        n_full = min(len(token_ids), cache.lengths[seq_id]) // self.page_size
        hashes = prefix_block_hashes(token_ids[: n_full * self.page_size], self.page_size)
        added = 0
        for h, block in zip(hashes, cache.block_tables[seq_id]):
            if h in self.blocks or block in self.hashes:
                continue  # already cached (perhaps as another physical block with the same content)
            cache.allocator.incref(block)
            self.blocks[h], self.hashes[block] = block, h
            added += 1
        self.touch([h for h in hashes if h in self.blocks])
        return added

    def clear(self) -> None:
        """Drop every reference this cache holds; blocks no sequence holds return to the free list."""
        for block in self.blocks.values():
            self.cache.allocator.free(block)
        self.blocks.clear()
        self.hashes.clear()
        self.model = None

    # -- the prompt-cache call of generate --
    def prefill(self, model, prompt_ids, view: SequenceView):
        """Prefill a prompt reusing cached prefix blocks -> (last logits (V,), tokens reused).

        Resets the view's sequence, points it at the cached blocks of the prompt's prefix (``share``),
        runs the rest of the prompt (at least its last token) and caches the prompt's full blocks
        (``store``). ``generate(model, prompt, n, cache=view, prefix_cache=this)`` calls it.
        """
        if view.cache is not self.cache:
            raise ValueError("prefill: the view belongs to another PagedKVCache than this prefix-block cache")
        if self.model is not None and model is not self.model:
            raise ValueError("prefill: these cached blocks hold another model's keys and values; clear() first")
        self.model = model
        prompt_ids = [int(t) for t in prompt_ids]
        view.reset()
        reused = self.share(view.seq_id, prompt_ids)
        logits = model.forward(xp.asarray([prompt_ids[reused:]]), view)[0, -1]  # at least one token
        self.store(view.seq_id, prompt_ids)
        return logits, reused
