"""Byte-level BPE, the tokenizer of GPT-2, Llama 3 and SmolLM2: text -> UTF-8 bytes -> merged tokens.

encode(text) runs three steps:

1. Special tokens. Control tokens such as ``<|im_start|>`` are cut out of the text first; each
   becomes one id, whatever characters it is spelled with.
2. Pre-tokenization. The rest is split into words by regular expressions, so a merge never
   crosses a word boundary: "Hello world 42" -> ["Hello", " world", " ", "4", "2"] for SmolLM2,
   which puts every digit in a word of its own.
3. Byte-pair merges. Each word becomes its UTF-8 bytes, each byte spelled as one printable
   character (``bytes_to_unicode``), and adjacent symbols are merged, always the pair with the
   lowest rank first (the merge learned earliest), until no pair in the word has a rank. Each
   symbol left is one token.

decode(ids) reverses it: each id's symbol -> its bytes (the inverse map) -> UTF-8 text, so
decode(encode(text)) == text for any text whose bytes the vocabulary spells.

The vocabulary, the merges and the special tokens come from a GGUF file's metadata
(``bpe_from_metadata``): ``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges`` ("Ġ t" means the pair
("Ġ", "t"), rank = position in the list) and ``tokenizer.ggml.token_type`` (3 marks a control token).
"""

from __future__ import annotations

import regex

from .tokenizer import check_ids

CONTROL = 3  # tokenizer.ggml.token_type of a control token such as <|im_start|>
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML's control tokens: a message's start and end
WORD_CACHE_SIZE = 100_000  # words remembered with their ids; cleared when full

# GPT-2's word pattern: contractions, letters, numbers, other symbols (each with one optional
# leading space), then whitespace. \s+(?!\S) leaves the last space of a run to start the next word.
GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Each tokenizer.ggml.pre splits with a sequence of patterns, the next one cutting the pieces the
# previous one left (as llama.cpp does). SmolLM2 first isolates every digit, so "2024" is 4 words.
PRE_TOKENIZERS = {
    "gpt2": (GPT2_WORDS,),
    "smollm": (r"\p{N}", GPT2_WORDS),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte 0..255 to one printable character.

    Printable Latin-1 bytes stand for themselves ("A" -> "A", "é"'s bytes 0xC3 0xA9 -> "Ã", "©");
    the other 68 (controls, space, 0x7F-0xA0, 0xAD) are moved to 256, 257, ... in order, so
    a space (0x20) is "Ġ" (U+0120) and a newline (0x0A) is "Ċ" (U+010A). Tokens are written in
    these characters, so merges and the vocabulary never contain raw whitespace or control bytes.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    spelling = {b: chr(b) for b in printable}
    spelling.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return spelling


BYTE_TO_UNICODE = bytes_to_unicode()
UNICODE_TO_BYTE = {ch: b for b, ch in BYTE_TO_UNICODE.items()}


def compile_isolating(pattern: str):
    """A regex whose ``split`` keeps the matches as pieces: split("a1b") with \\p{N} -> ["a", "1", "b"]."""
    return regex.compile(f"({pattern})")


def pre_tokenize(text: str, splitters) -> list[str]:
    """Cut text into words with each splitter in turn (a compiled isolating regex).

    With PRE_TOKENIZERS["smollm"]: "In 2024,  we" -> ["In", " ", "2", "0", "2", "4", ",", " ", " we"].
    """
    pieces = [text]
    for splitter in splitters:
        pieces = [word for piece in pieces for word in splitter.split(piece) if word]
    return pieces


def merge_lowest_rank(symbols: list[str], ranks: dict) -> list[str] | None:
    """One BPE step: merge every occurrence of the adjacent pair with the lowest rank, left to right.

    Returns the new symbol list, or None when no adjacent pair has a rank (the word is done).
    ranks = {("a", "b"): 0, ("b", "c"): 1, ("ab", "c"): 2}:
    ["a", "b", "c", "a", "b"] -> ["ab", "c", "ab"] -> ["abc", "ab"] -> None
    (("b", "c") never merges: once "a", "b" became "ab" no "b", "c" pair is left.)
    """
    # EXERCISE 8.4 BEGIN: find the adjacent pair with the lowest rank; merge its occurrences left to right
    ranked = [pair for pair in zip(symbols, symbols[1:]) if pair in ranks]
    if not ranked:
        return None
    best = min(ranked, key=ranks.__getitem__)
    merged, i = [], 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
            merged.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            merged.append(symbols[i])
            i += 1
    return merged
    # EXERCISE 8.4 END


def bpe(symbols: list[str], ranks: dict) -> list[str]:
    """Apply merges until none applies.  ["l", "o", "w"] with ranks {("l","o"): 0, ("lo","w"): 1} -> ["low"]

    Each step scans the whole word, so a word of n symbols costs O(n^2), like GPT-2's own encoder:
    nothing for words, about 3 s for 4,000 letters without a space (a heap of pairs would fix it).
    """
    while (merged := merge_lowest_rank(symbols, ranks)) is not None:
        symbols = merged
    return symbols


class BPETokenizer:
    """Byte-level BPE with special tokens and a ChatML chat template.

    tokens: the vocabulary, id -> symbol (in the byte alphabet; special tokens as written).
    merges: ["Ġ t", ...], rank = index. special: the ids of control tokens, matched whole in text.
    """

    def __init__(self, tokens: list[str], merges: list[str], special: list[int], pre: str = "smollm",
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 default_system: str | None = None):
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"unknown pre-tokenizer {pre!r}; known: {', '.join(sorted(PRE_TOKENIZERS))}")
        self.tokens = list(tokens)
        self.ids = {tok: i for i, tok in enumerate(self.tokens)}
        if len(self.ids) != len(self.tokens):
            raise ValueError("BPETokenizer: duplicate tokens in the vocabulary")
        self.ranks = {}
        for rank, merge in enumerate(merges):
            left, space, right = merge.partition(" ")
            if not space or left + right not in self.ids:
                raise ValueError(f"merge {rank} ({merge!r}) does not make a token of the vocabulary")
            self.ranks[(self.spelling(left), self.spelling(right))] = rank
        self.special = {self.tokens[i]: i for i in special}
        by_length = sorted(self.special, key=len, reverse=True)  # the longest match wins
        self.special_splitter = compile_isolating("|".join(regex.escape(s) for s in by_length)) if by_length else None
        self.splitters = [compile_isolating(p) for p in PRE_TOKENIZERS[pre]]
        self.pre = pre
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.default_system = default_system
        self.token_bytes = [self.spelled_bytes(i) for i in range(len(self.tokens))]  # id -> bytes
        self.word_cache: dict[str, list[int]] = {}

    def spelling(self, symbol: str) -> str:
        """The vocabulary's own string object for symbol (symbol itself if it is not a token): the merge table's
        98k symbols then share the vocabulary's strings instead of holding copies, 5 MB for SmolLM2."""
        i = self.ids.get(symbol)
        return symbol if i is None else self.tokens[i]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def spelled_bytes(self, i: int) -> bytes:
        """The bytes token i stands for: "Ġthe" -> b" the"; a special token -> its UTF-8 text."""
        token = self.tokens[i]
        if token in self.special:
            return token.encode("utf-8")
        return bytes(UNICODE_TO_BYTE[ch] for ch in token)

    # ---- encode

    def encode_word(self, word: str) -> list[int]:
        """One pre-token -> ids: its bytes in the byte alphabet, merged by rank.  " the" -> [260] ("Ġthe")"""
        ids = self.word_cache.get(word)
        if ids is None:
            symbols = [BYTE_TO_UNICODE[b] for b in word.encode("utf-8")]
            unknown = [ch for ch in word if any(BYTE_TO_UNICODE[b] not in self.ids for b in ch.encode("utf-8"))]
            if unknown:
                raise ValueError(f"characters the vocabulary cannot spell: {', '.join(map(repr, unknown))}")
            ids = [self.ids[symbol] for symbol in bpe(symbols, self.ranks)]
            if len(self.word_cache) >= WORD_CACHE_SIZE:
                self.word_cache.clear()
            self.word_cache[word] = ids
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Text -> ids, special tokens' text treated as ordinary text."""
        return [i for word in pre_tokenize(text, self.splitters) for i in self.encode_word(word)]

    def encode(self, text: str) -> list[int]:
        """Text -> ids, each special token's text (e.g. "<|im_end|>") becoming its single id.

        "<|im_start|>user\\nHi<|im_end|>" -> [1, 4093, 198, 26843, 2] for SmolLM2. For text that
        holds what someone typed, use ``chat_pieces`` and ``encode_pieces``: there the typed text
        stays text.
        """
        if self.special_splitter is None:
            return self.encode_ordinary(text)
        ids = []
        for piece in self.special_splitter.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                ids.extend(self.encode_ordinary(piece))
        return ids

    def encode_pieces(self, pieces) -> list[int]:
        """(text, is_control) pieces (``chat_pieces``) -> ids: a control piece is its one special id;
        the text between two control pieces is encoded as one text, ``encode_ordinary``, so a
        special token's text inside it ("<|im_end|>" in a message) is spelled as ordinary tokens.

        For a rendering whose messages hold no special token's text, encode_pieces(pieces) ==
        encode("".join(text for text, _ in pieces)).
        """
        ids, text = [], ""
        for piece, control in pieces:
            if not control:
                text += piece
                continue
            if piece not in self.special:
                raise ValueError(f"{piece!r} is not a special token of this vocabulary")
            ids += self.encode_ordinary(text) + [self.special[piece]]
            text = ""
        return ids + self.encode_ordinary(text)

    # ---- decode

    def decode_bytes(self, ids) -> bytes:
        """ids -> the bytes they stand for (possibly ending inside a multi-byte character)."""
        return b"".join(self.token_bytes[i] for i in check_ids(ids, len(self.tokens)))

    def decode(self, ids) -> str:
        """ids -> text; bytes that do not form valid UTF-8 (a cut character) become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ---- chat

    def chat_pieces(self, messages: list[dict], add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
        """ChatML in pieces (text, is_control): per message <|im_start|>, "{role}\\n{content}", <|im_end|>, "\\n".

        Only the template's own <|im_start|> and <|im_end|> are control pieces; roles and contents
        are text, so a message cannot end its turn or open a system turn by typing "<|im_end|>".
        A conversation that does not start with a system message gets the model's default one
        first; add_generation_prompt appends <|im_start|>, "assistant\\n", where the reply starts.
        """
        if not messages:
            raise ValueError("a conversation needs at least one message")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"a chat message is a dict with string 'role' and 'content', got {m!r}")
        if self.default_system is not None and messages and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.default_system}, *messages]
        pieces = []
        for m in messages:
            pieces += [(IM_START, True), (f"{m['role']}\n{m['content']}", False), (IM_END, True), ("\n", False)]
        return pieces + [(IM_START, True), ("assistant\n", False)] if add_generation_prompt else pieces

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """ChatML as one text: "<|im_start|>{role}\\n{content}<|im_end|>\\n" per message (``chat_pieces``).

        [{"role": "user", "content": "Hi"}] ->
        "<|im_start|>system\\n{default}<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
        """
        return "".join(text for text, _ in self.chat_pieces(messages, add_generation_prompt))


# ------------------------------------------------------------------------------------------------
# loading from a GGUF file

CHATML_SYSTEM = regex.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", regex.DOTALL)


def bpe_from_metadata(meta: dict) -> BPETokenizer:
    """A BPETokenizer from GGUF metadata values ({"tokenizer.ggml.tokens": [...], ...})."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer {model!r} is not byte-level BPE ('gpt2')")
    template = meta.get("tokenizer.chat_template", "")
    if "<|im_start|>" not in template:
        raise ValueError("the chat template is not ChatML (<|im_start|>role ... <|im_end|>)")
    default_system = CHATML_SYSTEM.search(template)
    types = meta["tokenizer.ggml.token_type"]
    return BPETokenizer(
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.merges"],
        special=[i for i, t in enumerate(types) if t == CONTROL],
        pre=meta.get("tokenizer.ggml.pre", "gpt2"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        default_system=default_system.group(1) if default_system else None,
    )
