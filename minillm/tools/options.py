"""argparse types shared by the command line, the demo and the benchmarks: each value is checked
when it is parsed, and a bad one is a usage error that names the option (exit 2), not a traceback.

Every numeric option of every command uses one of these types (tests/test_cli.py walks the parsers
and refuses a raw ``int`` or ``float``): a float is always finite (no nan, no inf), every value is
checked against its range, and a value that sizes memory up front (a KV pool's blocks) has an upper
bound as well as a lower one. What several values size together, the KV pool (blocks times bytes per
block, which depend on the model), is checked by ``check_kv_pool`` once the model's shape is known and
before the pool is built.
"""

from __future__ import annotations

import argparse
import math

MAX_COUNT = 1_000_000  # the upper bound of counts (tokens, requests, blocks, repeats, ...) unless told
MAX_NEW_TOKENS = 100_000  # the longest text generate, chat and the demo write (generate's window slides on)
MAX_NUM_SEQS = 1024  # requests in the serving engine's running batch
MAX_KV_BLOCKS = 65_536  # blocks in a KV pool: its free list is built up front
MAX_KV_POOL_BYTES = 16 * 10**9  # K and V of every layer in float32: the largest pool a command builds


def int_in(lowest: int, highest: int | None = None):
    """An argparse type: an int in [lowest, highest] (no upper bound when highest is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        if highest is not None and value > highest:
            raise argparse.ArgumentTypeError(f"must be <= {highest}, got {value}")
        return value

    parse.__name__ = f"int >= {lowest}" if highest is None else f"int in [{lowest}, {highest}]"
    return parse


def int_at_least(lowest: int):
    """An argparse type: an int >= lowest, or a usage error that names the option."""
    return int_in(lowest)


def float_in(lowest: float | None = None, highest: float | None = None, open_low: bool = False,
             open_high: bool = False):
    """An argparse type: a finite float (nan and inf refused) within the bounds given (None: unbounded;
    ``open_low``/``open_high``: that bound itself is excluded). float_in(0, 1, open_low=True) is (0, 1]."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if lowest is not None and (value < lowest or (open_low and value == lowest)):
            raise argparse.ArgumentTypeError(f"must be {'>' if open_low else '>='} {lowest}, got {value}")
        if highest is not None and (value > highest or (open_high and value == highest)):
            raise argparse.ArgumentTypeError(f"must be {'<' if open_high else '<='} {highest}, got {value}")
        return value

    parse.__name__ = "finite float"
    return parse


finite_float = float_in()
positive_float, nonnegative_float = float_in(0, open_low=True), float_in(0)
positive_int, nonnegative_int = int_at_least(1), int_at_least(0)
count, nonnegative_count = int_in(1, MAX_COUNT), int_in(0, MAX_COUNT)  # sizes of loops and pools
seed_int = int_in(0, 2**63 - 1)  # what numpy.random.default_rng takes
new_tokens = int_in(1, MAX_NEW_TOKENS)  # --max-new-tokens of every command that generates
num_seqs = int_in(1, MAX_NUM_SEQS)  # --max-num-seqs
kv_blocks = int_in(1, MAX_KV_BLOCKS)  # --num-blocks


def check_kv_pool(config, num_blocks: int, page_size: int) -> int:
    """The bytes of a KV pool of num_blocks blocks of page_size tokens for a model of ``config`` (K and V of
    every layer, float32) -> those bytes; ValueError, before anything is allocated, when the pool has more
    than MAX_KV_BLOCKS blocks or MAX_KV_POOL_BYTES bytes (the engine builds its free list and zeroes its pool
    at once). The character target (6 layers, 4 KV heads of 64) at 48 blocks of 16 tokens -> 9,437,184 bytes."""
    from ..kv_cache import kv_cache_bytes

    size = kv_cache_bytes(config.n_layer, config.n_kv_head, config.head_size, num_blocks * page_size,
                          bytes_per_elem=4)
    if num_blocks > MAX_KV_BLOCKS or size > MAX_KV_POOL_BYTES:
        raise ValueError(f"a KV pool of {num_blocks:,} blocks of {page_size} tokens ({size / 1e9:,.1f} GB for this "
                         f"model) is over the limit of {MAX_KV_BLOCKS:,} blocks and {MAX_KV_POOL_BYTES / 1e9:g} GB: "
                         "lower --num-blocks, --page-size, --max-num-seqs or --context")
    return size


def add_weights_option(p: argparse.ArgumentParser) -> None:
    """``--weights q|fp32``, for every command that loads a model by name: how the model keeps its weight matrices
    (``registry.load_model``): q for the CPU kernels (a GGUF model's quantized blocks, smollm2-135m or a .gguf; a
    character model's float32 matrices packed once), fp32 as float32 arrays, the reference."""
    from ..model import WEIGHTS
    from ..registry import DEFAULT_WEIGHTS

    p.add_argument("--weights", choices=WEIGHTS, default=DEFAULT_WEIGHTS,
                   help="how the model keeps its weight matrices: q, for the CPU kernels (the default: a GGUF "
                   "model's quantized blocks as the file holds them, a character model's float32 matrices "
                   "packed once), or fp32, float32 arrays (a GGUF's dequantized at load: the reference)")


def add_activations_option(p: argparse.ArgumentParser) -> None:
    """``--activations float32|int8``: what a GGUF model's products by its Q8_0 / Q4_1 blocks multiply
    (``Llama.set_activations``); ``set_activations`` applies it."""
    from ..llama import ACTIVATIONS

    p.add_argument("--activations", choices=ACTIVATIONS, default=ACTIVATIONS[0],
                   help="float32 (exact, the default) or int8: each product's input rounded to int8 per block of "
                   "32 as llama.cpp does, faster and not exact (docs/quantization.md); a GGUF model with --weights q")


def set_activations(model, name: str) -> None:
    """``model.set_activations(name)``; float32 for any model; ValueError for int8 on a model without blocks."""
    if name == "float32":
        return
    if not hasattr(model, "set_activations"):
        raise ValueError(f"--activations {name} is for a GGUF model in its blocks (smollm2-135m or a .gguf)")
    model.set_activations(name)


def list_of(item):
    """An argparse type: a comma-separated list, each value checked by the type ``item``."""

    def parse(text: str) -> list:
        return [item(part) for part in text.split(",")]

    parse.__name__ = f"list of {item.__name__}"
    return parse


positive_int_list = list_of(positive_int)  # "1,2,4" -> [1, 2, 4], every value >= 1
nonnegative_float_list = list_of(nonnegative_float)  # "0,1" -> [0.0, 1.0], every value finite and >= 0


def chapter_list(text: str) -> list[str]:
    """An argparse type: "3,5,A1" -> ["3", "5", "A1"]."""
    chapters = [c.strip() for c in text.split(",") if c.strip()]
    if not chapters:
        raise argparse.ArgumentTypeError("name at least one chapter, e.g. 3,5")
    return chapters
