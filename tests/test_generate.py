"""Chapter 3, ``generate``'s own cache: sized to what the call needs, with the same tokens as a full one."""

import pytest

from minillm import KVCache, generate


@pytest.mark.uses_exercise("3.1", "3.3")  # the cache's attend and the context policy of every loop
@pytest.mark.parametrize(
    "prompt_len, new, cache_len",
    # fits; no new token; exactly full; overflows; a prompt longer than the window
    [(2, 6, 8), (1, 0, 1), (10, 22, 32), (20, 40, 32), (40, 5, 32)],
)
def test_own_cache_is_sized_to_the_call(tiny_model, prompt_len, new, cache_len):
    """Without a cache, generate allocates len(prompt) + max_new_tokens positions, at most block_size (32):
    a short answer does not pay for a full-context cache (a block_size cache fails the first case).
    Greedy tokens, re-prefills and dropped prompt tokens equal a run on a block_size cache."""
    prompt = [(3 * i + 1) % 13 for i in range(prompt_len)]
    own = generate(tiny_model, prompt, new, temperature=0)
    full = generate(tiny_model, prompt, new, temperature=0, cache=KVCache(tiny_model.config))
    assert own.stats.kv_bytes == KVCache(tiny_model.config, max_len=cache_len).nbytes
    assert own.tokens == full.tokens
    assert (own.stats.reprefills, own.stats.dropped_prompt_tokens) == (
        full.stats.reprefills, full.stats.dropped_prompt_tokens)
