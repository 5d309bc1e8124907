"""CharTokenizer: one token per character, the vocabulary being the sorted characters of a text."""

from __future__ import annotations


class CharTokenizer:
    """Maps characters to ids and back.

    Example: CharTokenizer.from_text("hello") has chars "ehlo"; encode("hole") -> [1, 3, 2, 0].
    """

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: duplicate characters in the vocabulary")
        self.chars = chars
        self.stoi = {ch: i for i, ch in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """str -> token ids; raises ValueError naming every character outside the vocabulary."""
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise ValueError(
                f"characters not in the vocabulary: {', '.join(repr(c) for c in unknown)}"
            )
        return [self.stoi[ch] for ch in text]

    def decode(self, ids) -> str:
        """token ids -> str; raises ValueError for an id outside 0..vocab_size-1."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.chars):
                raise ValueError(f"token id {i} is outside the vocabulary (size {len(self.chars)})")
            out.append(self.chars[i])
        return "".join(out)

    def to_dict(self) -> dict:
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict) -> CharTokenizer:
        if d.get("type") != "char":
            raise ValueError(f"unknown tokenizer type {d.get('type')!r}")
        return cls(d["chars"])
