"""Weak drafts for speculative decoding: what happens when the draft is cheap but often wrong.

- ``BigramDraft``: no network at all; the next character's log-frequency given the current one,
  counted on the training split of the corpus. Almost free to run (c ~ 0), but it knows one
  character of context, so the target rejects it often.
- ``quantize_weights``: a copy of a GPT whose weight matrices went through symmetric per-tensor
  int8 (or fewer bits) and back: the quantization error is real, the arithmetic stays float32, so
  c is unchanged and only the acceptance rate can move.

Both plug into ``speculative_generate`` as the draft: they have a ``config`` (vocab_size and
block_size are what matter) and ``forward(idx (B, T), cache=None) -> logits (B, T, V)``. The
bigram has no attention, so of the cache contract (``minillm.cache_contract``) it calls only
``positions`` and ``advance``; the decoding loops still truncate and reset its cache as usual.
"""

from __future__ import annotations

import numpy as np

from .backend import xp
from .config import GPTConfig
from .model import GPT

BIGRAM_SMOOTHING = 0.1  # pseudo-count added to every (previous, next) pair: no -inf logits


class BigramDraft:
    """logits[t] = log P(next char | char t), from corpus counts.  (B, T) -> (B, T, V)

    Example: after 'q' almost all the mass is on 'u'.
    """

    def __init__(self, log_probs, block_size: int = 256):
        log_probs = np.asarray(log_probs, dtype=np.float32)
        V = log_probs.shape[0]
        if log_probs.shape != (V, V):
            raise ValueError(f"bigram log_probs must be (V, V), got {log_probs.shape}")
        # only vocab_size and block_size are used: forward only counts positions in a cache (its
        # one-element keys and values are never written)
        self.config = GPTConfig(vocab_size=V, block_size=block_size, n_layer=1, n_head=1, n_embd=1)
        self.table = xp.asarray(log_probs)  # (V, V): row = previous token, column = next token

    @classmethod
    def from_ids(cls, ids, vocab_size: int, block_size: int = 256, smoothing: float = BIGRAM_SMOOTHING):
        """Count consecutive pairs in a token id array -> a BigramDraft."""
        ids = np.asarray(ids, dtype=np.int64)
        counts = np.zeros((vocab_size, vocab_size))
        np.add.at(counts, (ids[:-1], ids[1:]), 1.0)  # counts[prev, next] += 1 for every pair
        counts += smoothing
        return cls(np.log(counts / counts.sum(axis=1, keepdims=True)), block_size)

    @classmethod
    def from_corpus(cls, tokenizer=None, block_size: int = 256):
        """The bigram of the corpus's training split (the same split the shipped models saw)."""
        from .data import corpus_tokenizer, train_val_split

        tokenizer = tokenizer or corpus_tokenizer()
        train_ids, _ = train_val_split(tokenizer)
        return cls.from_ids(train_ids, tokenizer.vocab_size, block_size)

    def forward(self, idx, cache=None):
        """Token ids (B, T) -> logits (B, T, V). A cache only counts positions (no keys to keep)."""
        idx = xp.asarray(idx)
        if idx.ndim != 2 or idx.shape[1] == 0:
            raise ValueError(f"forward expects token ids of shape (B, T >= 1), got {idx.shape}")
        if cache is not None:
            cache.positions(idx.shape[1])  # raises CacheFullError on overflow, like the GPT
            cache.advance(idx.shape[1])
        return self.table[idx]  # (B, T, V)

    def num_params(self) -> int:
        return int(self.table.size)


def quantize_tensor(w, bits: int = 8):
    """Symmetric per-tensor quantization: w -> (ints, scale) with w ~ ints * scale.

    scale = max|w| / (2^(bits-1) - 1); ints = round(w / scale) in [-127, 127] for 8 bits.
    """
    qmax = 2 ** (bits - 1) - 1
    w = np.asarray(w, dtype=np.float32)
    scale = float(np.abs(w).max()) / qmax or 1.0
    ints = np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8)
    return ints, scale


def quantize_weights(model: GPT, bits: int = 8) -> GPT:
    """A copy of ``model`` whose 2-D weight matrices were quantized to ``bits`` and dequantized.

    Biases and LayerNorm parameters stay float32 (as in weight-only int8 schemes). The returned
    model computes in float32 with the rounded weights ("fake quantization"), so its speed is the
    original's and the change in acceptance rate is due to the rounding alone.
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    params = {}
    for name, w in model.numpy_params().items():
        if w.ndim == 2:
            ints, scale = quantize_tensor(w, bits)
            w = ints.astype(np.float32) * np.float32(scale)
        params[name] = w
    return GPT(model.config, params, attention=model.attention_name)
