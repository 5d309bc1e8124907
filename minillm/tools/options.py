"""argparse types shared by the command line, the demo and the benchmarks: each value is checked
when it is parsed, and a bad one is a usage error that names the option (exit 2), not a traceback.

Every numeric option of every command uses one of these types (tests/test_cli.py walks the parsers
and refuses a raw ``int`` or ``float``): a float is always finite (no nan, no inf), every value is
checked against its range, and a value that sizes memory up front (a KV pool's blocks) has an upper
bound as well as a lower one.
"""

from __future__ import annotations

import argparse
import math

MAX_COUNT = 1_000_000  # the upper bound of counts (tokens, requests, blocks, repeats, ...) unless told


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
