"""The Shakespeare corpus shipped with the package, and its 90/10 train/validation split."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .tokenizer import CharTokenizer

CORPUS_PATH = Path(__file__).parent / "data" / "shakespeare.txt"
TRAIN_FRACTION = 0.9


def load_corpus() -> str:
    return CORPUS_PATH.read_text(encoding="utf-8")


def corpus_tokenizer() -> CharTokenizer:
    return CharTokenizer.from_text(load_corpus())


def train_val_split(tokenizer: CharTokenizer | None = None):
    """-> (train ids, val ids) as uint8 arrays: the first 90% of the corpus and the last 10%."""
    text = load_corpus()
    tokenizer = tokenizer or CharTokenizer.from_text(text)
    ids = np.array(tokenizer.encode(text), dtype=np.uint8)
    n = int(len(ids) * TRAIN_FRACTION)
    return ids[:n], ids[n:]


def validation_prompts(tokenizer: CharTokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of ``length`` characters from the validation split (text the models never trained
    on), each starting at a line start, spread evenly over the split."""
    _, val = train_val_split(tokenizer)
    text = tokenizer.decode(val)
    prompts = []
    for i in range(n):
        start = text.index("\n", (i + 1) * len(text) // (n + 1)) + 1
        prompts.append(tokenizer.encode(text[start : start + length]))
    return prompts
