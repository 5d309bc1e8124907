"""minillm: a small GPT in plain array code, with its inference optimizations as readable modules.

    >>> import minillm
    >>> model, tok = minillm.load_model("target")
    >>> out = minillm.generate(model, tok.encode("HAMLET."), max_new_tokens=200, temperature=0.6, seed=1)
    >>> print(tok.decode(out.tokens))

    >>> model, tok = minillm.load_model("smollm2-135m")   # a real pretrained chat model (chapter 8)
"""

from .backend import is_gpu, to_numpy, xp
from .batch_speculative import BatchResult, BatchStats, generate_batch, speculative_generate_batch
from .cache_contract import CacheFullError, DecodeCache, ForwardCache, PromptCache
from .checkpoint import CheckpointError, save_model
from .config import GPTConfig, LlamaConfig
from .generate import GenerationResult, GenerationStats, fit_context, generate, generate_naive
from .gguf import GGUFError
from .kv_cache import GrowingKVCache, KVCache, PrefixCache, kv_cache_bytes
from .kv_quant import Int8KVCache
from .llama import Llama
from .measure import step_ratio, step_time, time_fn, time_paired, time_pairs, timed
from .model import GPT
from .notebook import format_table, show, skip_unsolved_exercises
from .paged_kv import BlockAllocator, OutOfBlocksError, PagedKVCache, paged_attention
from .prefix_blocks import PrefixBlockCache
from .registry import load_model
from .sampling import SamplingSettings
from .speculative import (
    SpecStats,
    expected_speedup,
    expected_tokens_per_call,
    speculative_generate,
    verify,
    verify_greedy,
)
from .tokenizer import CharTokenizer

__version__ = "0.1.0"

__all__ = [
    "GPT", "GPTConfig", "Llama", "LlamaConfig", "GGUFError", "CharTokenizer",
    "KVCache", "GrowingKVCache", "PrefixCache", "PrefixBlockCache", "Int8KVCache",
    "ForwardCache", "DecodeCache", "PromptCache", "CacheFullError", "CheckpointError",
    "SamplingSettings", "GenerationResult", "GenerationStats", "fit_context", "generate",
    "generate_naive", "kv_cache_bytes", "load_model", "save_model", "is_gpu", "to_numpy", "xp",
    "BlockAllocator", "OutOfBlocksError", "PagedKVCache", "paged_attention",
    "SpecStats", "expected_speedup", "expected_tokens_per_call", "speculative_generate", "verify", "verify_greedy",
    "BatchResult", "BatchStats", "generate_batch", "speculative_generate_batch",
    "format_table", "show", "skip_unsolved_exercises",
    "timed", "time_fn", "time_pairs", "time_paired", "step_time", "step_ratio",
]
