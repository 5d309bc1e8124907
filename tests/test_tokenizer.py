import pytest

from minillm import CharTokenizer
from minillm.data import corpus_tokenizer, load_corpus

# Text in, Python lists of ids out: no minillm array here, nothing for the strict run.
pytestmark = pytest.mark.host_only


def test_round_trip_and_worked_example():
    tok = CharTokenizer.from_text("hello")
    assert tok.chars == "ehlo"
    assert tok.encode("hole") == [1, 3, 2, 0]
    assert tok.decode(tok.encode("hello hole"[:5])) == "hello"


def test_unknown_characters_are_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'z'.*'é'|'é'.*'z'"):
        tok.encode("abzé")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([3])


def test_serialization_round_trip():
    tok = CharTokenizer.from_text("To be, or not to be")
    again = CharTokenizer.from_dict(tok.to_dict())
    assert again.chars == tok.chars


def test_corpus_vocabulary():
    """The shipped corpus: 84 distinct characters (its provenance note says so)."""
    tok = corpus_tokenizer()
    assert tok.vocab_size == 84
    text = load_corpus()[:5000]
    assert tok.decode(tok.encode(text)) == text


def test_text_stream_holds_back_a_split_utf8_character():
    """A character split across tokens is printed once it is complete, never as replacement bytes."""
    from types import SimpleNamespace

    from minillm.tokenizer import TextStream

    pieces = [b"caf", b"\xc3", b"\xa9 \xf0\x9f", b"\x98\x80", b"\xe2\x82"]  # "café 😀" then half a "€"
    stream = TextStream(SimpleNamespace(token_bytes=pieces))
    out = [stream.push(i) for i in range(len(pieces))]
    assert out == ["caf", "", "é ", "😀", ""] and stream.flush() == "\ufffd"
    assert "".join(TextStream(CharTokenizer("ab")).push(t) for t in [0, 1, 1]) == "abb"
