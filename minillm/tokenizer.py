"""CharTokenizer: one token per character, the vocabulary being the sorted characters of a text.

``TextStream`` turns tokens into text as they are generated, for any tokenizer with ``token_bytes``
(this one, and the byte-level BPE of ``minillm.bpe``).
"""

from __future__ import annotations

import codecs

from .config import is_int


def check_ids(ids, vocab_size: int | None = None) -> list[int]:
    """Token ids -> a list of ints, each an int (``is_int``) in 0..vocab_size-1 (>= 0 when vocab_size
    is None), or a ValueError naming the first one that is not.

    Example: check_ids([3, np.int64(1)], 5) -> [3, 1]; [3, 5], [-1] or [2.5] -> ValueError.
    """
    ids = list(ids)
    for i in ids:
        if not is_int(i) or i < 0 or (vocab_size is not None and i >= vocab_size):
            rule = "be ints >= 0" if vocab_size is None else f"lie in 0..{vocab_size - 1}"
            problem = "is not an int" if not is_int(i) else "is outside the vocabulary"
            raise ValueError(f"token ids must {rule}: {i!r} {problem}")
    return [int(i) for i in ids]


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
        return "".join(self.chars[i] for i in check_ids(ids, len(self.chars)))

    @property
    def token_bytes(self) -> list[bytes]:
        """id -> the UTF-8 bytes of its character."""
        return [ch.encode() for ch in self.chars]

    def to_dict(self) -> dict:
        return {"type": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict) -> CharTokenizer:
        if d.get("type") != "char":
            raise ValueError(f"unknown tokenizer type {d.get('type')!r}")
        return cls(d["chars"])


class TextStream:
    """Tokens in, printable text out, one token at a time.

    A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is often 2-3 tokens),
    so a token cannot be decoded on its own: the incomplete bytes wait for the next token.
    Example (BPE): "é" split into tokens b"\\xc3" and b"\\xa9" -> push() gives "" then "é".
    """

    def __init__(self, tokenizer):
        self.token_bytes = tokenizer.token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text that ``token`` completes (possibly "")."""
        return self.utf8.decode(self.token_bytes[int(token)])

    def flush(self) -> str:
        """At the end of the text: whatever bytes are left (an incomplete character becomes U+FFFD)."""
        return self.utf8.decode(b"", final=True)
