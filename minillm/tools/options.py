"""argparse types shared by the command line, the demo and the benchmarks: each value is checked
when it is parsed, and a bad one is a usage error that names the option (exit 2), not a traceback."""

from __future__ import annotations

import argparse
import math


def int_at_least(lowest: int):
    """An argparse type: an int >= lowest, or a usage error that names the option."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        return value

    parse.__name__ = f"int >= {lowest}"
    return parse


def finite_float(text: str) -> float:
    """An argparse type: a finite float (no nan, no inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


positive_int, nonnegative_int = int_at_least(1), int_at_least(0)


def positive_int_list(text: str) -> list[int]:
    """An argparse type: "1,2,4" -> [1, 2, 4], every value >= 1."""
    return [positive_int(item) for item in text.split(",")]


def chapter_list(text: str) -> list[str]:
    """An argparse type: "3,5,A1" -> ["3", "5", "A1"]."""
    chapters = [c.strip() for c in text.split(",") if c.strip()]
    if not chapters:
        raise argparse.ArgumentTypeError("name at least one chapter, e.g. 3,5")
    return chapters
