"""Medusa heads (Cai et al. 2024): small heads on the frozen target's last hidden state guess the tokens after next.

The target's LM head reads the final hidden state h_t and predicts token t+1. Medusa-1 adds K heads
that read the same h_t; head k (0-based) predicts token t+k+2:

    r_k = h + SiLU(h W_k + b_k)          a residual block, W_k and b_k zero-initialized (r_k = h at first)
    logits_k = r_k L_k^T                 a vocabulary projection, L_k initialized from the LM head

At the start every head repeats the LM head's guess; training on hidden states of the frozen target
(computed once) teaches each block how to shift h towards "the token k+1 places further on"
(``minillm.medusa_train``).

Design choice, by vocabulary size: a head's own projection L_k has V x C parameters. For the
character model (V = 65, C = 256) that is 17K, a quarter of the residual block, so each head gets
its own L_k and trains it. For SmolLM2-135M (V = 49152, C = 576) it would be 28M parameters per
head, a fifth of the model; there all heads share the frozen LM head and only the residual blocks
(332K parameters each) train. Default: own projections when V <= C, shared otherwise.

Decoding (``MedusaProposer``): after each verification round the target's hidden state at the
accepted node gives every head's top-k candidates; the most likely paths of their cartesian product
form a sparse token tree (``minillm.token_tree``) that the next round verifies in ONE target
forward, with the exact rule (the target's own output) or Medusa's typical acceptance.

    python -m minillm medusa-train --model target --out medusa_target.npz [--resume]
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np

from .backend import to_numpy, xp
from .checkpoint import (
    FLOAT_WEIGHTS,
    HEADER_KEY,
    SHIPPED_DIR,
    CheckpointError,
    atomic_save_npz,
    check_format,
    check_not_shipped,
    check_trained_for,
    encode_header,
    host_float32,
    model_identity,
    read_npz,
    trained_file,
)
from .llama import silu
from .model import linear
from .token_tree import Proposal, Round, TokenTree

MAX_HEADS = 5  # the Medusa paper's largest K
HEADS_FORMAT = "minillm-medusa-1"
TOP_K = (4, 3, 2, 2)  # candidates per head for the sparse tree
MAX_NODES = 20  # tree nodes, the root included
HEADS_KIND = "Medusa heads"
HEADS_RETRAIN = "python -m minillm medusa-train --model MODEL --out HEADS.npz"
HEADS_OPTION = "--medusa-heads HEADS.npz"


def check_n_heads(n_heads) -> int:
    if not isinstance(n_heads, (int, np.integer)) or isinstance(n_heads, bool) or not 1 <= n_heads <= MAX_HEADS:
        raise ValueError(f"the number of Medusa heads must be an int in 1..{MAX_HEADS}, got {n_heads!r}")
    return int(n_heads)


# ----------------------------------------------------------------------------------------------
# a head's forward


def head_count(params: dict) -> int:
    return sum(1 for name in params if name.endswith(".w"))


def head_residual(params: dict, k: int, h):
    """r_k = h + SiLU(h W_k + b_k).  (N, C) -> (N, C), and z = h W_k + b_k for the backward pass."""
    z = linear(h, params[f"{k}.w"], params[f"{k}.b"])  # (N, C)
    return h + silu(z), z


# ----------------------------------------------------------------------------------------------
# the heads, bound to their model


def head_shapes(k: int, C: int, V: int, own_lm_head: bool) -> dict:
    """Head k's parameters: W_k (C, C) [in, out], b_k (C,), and its own projection L_k (V, C) unless shared."""
    return {f"{k}.w": (C, C), f"{k}.b": (C,)} | ({f"{k}.lm": (V, C)} if own_lm_head else {})


class MedusaHeads:
    """K Medusa heads on a frozen ``model`` (anything with ``hidden``, ``lm_head`` and ``config``)."""

    def __init__(self, model, params: dict):
        self.model = model
        self.n_heads = check_n_heads(head_count(params))
        C, V = model.config.n_embd, model.config.vocab_size
        for k in range(self.n_heads):
            for name, shape in head_shapes(k, C, V, f"{k}.lm" in params).items():
                if name not in params or tuple(params[name].shape) != shape:
                    got = tuple(params[name].shape) if name in params else "missing"
                    raise ValueError(f"Medusa head parameter {name}: expected shape {shape}, got {got}")
        self.params = {name: xp.asarray(p, dtype=xp.float32) for name, p in params.items()}
        self.shared_lm_head = "0.lm" not in params

    @classmethod
    def init(cls, model, n_heads: int = 4, share_lm_head: bool | None = None) -> MedusaHeads:
        """W_k = 0, b_k = 0 (each head starts as the LM head); own L_k = a copy of the LM head unless shared.

        share_lm_head None: share when V > C (see the module docstring).
        """
        n_heads, C, V = check_n_heads(n_heads), model.config.n_embd, model.config.vocab_size
        share = V > C if share_lm_head is None else share_lm_head
        params = {}
        for k in range(n_heads):
            params |= {f"{k}.w": np.zeros((C, C), np.float32), f"{k}.b": np.zeros(C, np.float32)}
            if not share:
                params[f"{k}.lm"] = host_float32(model.lm_head)  # a float32 copy (blocks dequantized)
        return cls(model, params)

    def logits(self, h, n_heads: int | None = None):
        """(N, C) hidden states -> (K, N, V) logits of the first ``n_heads`` heads (all by default)."""
        ks = range(self.n_heads if n_heads is None else n_heads)
        r = xp.stack([head_residual(self.params, k, h)[0] for k in ks])  # (K, N, C)
        if self.shared_lm_head:  # one matmul reads the (V, C) head once for all K heads
            return self.model.logits(r)  # (K, N, V)
        return xp.stack([r[k] @ self.params[f"{k}.lm"].T for k in ks])

    def accuracy(self, h, targets, top: tuple = (1, 5)) -> dict:
        """Top-n accuracy of each head: h (N, C) on the host (``head_data``'s) or the device, targets (N, K)
        -> {"head k": {"top1": .., "top5": ..}}."""
        logits = to_numpy(self.logits(xp.asarray(h)))  # (K, N, V)
        ranks = (logits > np.take_along_axis(logits, np.asarray(targets).T[..., None], axis=-1)).sum(-1)  # (K, N)
        return {f"head {k} (+{k + 2})": {f"top{n}": round(float((ranks[k] < n).mean()), 4) for n in top}
                for k in range(self.n_heads)}

    def save(self, path, notes: dict | None = None, overwrite_shipped: bool = False) -> None:
        """Write the heads (float16) and the identity of their model to ``path``, atomically."""
        check_not_shipped(path, overwrite_shipped)
        header = {"format": HEADS_FORMAT, "model": model_identity(self.model), "n_heads": self.n_heads,
                  "shared_lm_head": self.shared_lm_head, "notes": notes or {}}
        arrays = {name: to_numpy(p).astype(np.float16) for name, p in self.params.items()}
        atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})

    @classmethod
    def load(cls, model, path) -> MedusaHeads:
        """Heads saved by ``save``; CheckpointError (one line) for another format, heads trained for another
        model, or an array of another name, shape or dtype (all before any array is read), or not finite."""
        header, arrays = read_npz(path, lambda header: heads_layout(header, model, path), HEADS_KIND)
        return cls(model, arrays)


def heads_layout(header: dict, model, path) -> dict:
    """The arrays a heads file's header implies for ``model``: {name: (shape, dtypes)}, once the header is
    checked (its format, the model the heads were trained for, their number)."""
    check_format(header, HEADS_FORMAT, path, HEADS_KIND)
    check_trained_for(header, model, path, HEADS_KIND, HEADS_RETRAIN)
    shared = header.get("shared_lm_head")
    if not isinstance(shared, bool):
        raise CheckpointError(f"inconsistent {HEADS_KIND} {path}: shared_lm_head is {shared!r}, not true or false")
    C, V = model.config.n_embd, model.config.vocab_size
    return {name: (shape, FLOAT_WEIGHTS) for k in range(check_n_heads(header.get("n_heads")))
            for name, shape in head_shapes(k, C, V, not shared).items()}


def shipped_heads_path(model_name: str) -> Path:
    """The heads shipped for a model name: "target" -> minillm/models/medusa_target.npz."""
    return SHIPPED_DIR / f"medusa_{model_name}.npz"


def load_heads(model, model_name: str, path=None) -> MedusaHeads:
    """The heads at ``path`` (``--medusa-heads``), or when none is given those shipped for ``model_name``."""
    path = trained_file(path, shipped_heads_path(model_name), model_name, HEADS_KIND, HEADS_RETRAIN, HEADS_OPTION)
    return MedusaHeads.load(model, path)


# ----------------------------------------------------------------------------------------------
# proposing a sparse tree


def sparse_tree_paths(probs, top_k, budget: int) -> list[list[int]]:
    """The ``budget`` most likely paths of the heads' top-k cartesian product, most likely first.

    probs (D, V): head d's distribution of the token at depth d + 1. A path picks one of head d's
    top_k[d] tokens at each depth d < its length; its score is the product of their probabilities.
    Scores only shrink along a path, so the top ``budget`` (ties: shorter first) is prefix-closed: a tree.
    Example: head 0 {a: .6, b: .2}, head 1 {c: .5, d: .3}, top_k (2, 2), budget 4 ->
    [a] .6, [a c] .3, [b] .2, [a d] .18.
    """
    candidates = [np.argsort(-p, kind="stable")[:k] for p, k in zip(probs, top_k)]
    scored = []
    for depth in range(1, len(candidates) + 1):
        for path in itertools.product(*candidates[:depth]):
            score = math.prod(float(probs[d][t]) for d, t in enumerate(path))
            scored.append((-score, depth, [int(t) for t in path]))
    scored.sort(key=lambda s: (s[0], s[1]))
    return [path for _, _, path in scored[:budget]]


class MedusaProposer:
    """Each round: the heads read the target's hidden state at the accepted node; their top-k form a sparse tree.

    top_k[d]: candidates of head d (len(top_k) heads are used, the tree's depth); max_nodes: tree
    size with its root. Before the first target forward there is no hidden state: the root alone.
    """

    def __init__(self, heads: MedusaHeads, top_k=TOP_K, max_nodes: int = MAX_NODES):
        top_k = tuple(top_k)
        if not 1 <= len(top_k) <= heads.n_heads:
            raise ValueError(f"top_k needs one entry per head used, 1..{heads.n_heads}, got {len(top_k)}")
        if any(not isinstance(k, (int, np.integer)) or k < 1 for k in top_k):
            raise ValueError(f"top_k entries must be ints >= 1, got {top_k}")
        if not isinstance(max_nodes, (int, np.integer)) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an int >= 1 (the root counts), got {max_nodes!r}")
        self.heads, self.top_k, self.max_nodes = heads, top_k, int(max_nodes)
        self.max_depth = len(top_k)

    def propose(self, state: Round) -> Proposal:
        root = state.seq[-1]
        if state.hidden is None or state.room < 1 or self.max_nodes == 1:
            return Proposal(TokenTree((root,), (-1,)))
        logits = to_numpy(self.heads.logits(state.hidden[None], self.max_depth))[:, 0]  # (D, V)
        e = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)  # (D, V)
        paths = sparse_tree_paths(probs[: state.room], self.top_k, self.max_nodes - 1)
        return Proposal(TokenTree.from_paths(root, paths))

    def observe(self, state: Round, emitted: list, extra_logits) -> None:
        pass


