"""Medusa heads (Cai et al. 2024): small heads on the frozen target's last hidden state guess the tokens after next.

The target's LM head reads the final hidden state h_t and predicts token t+1. Medusa-1 adds K heads
that read the same h_t; head k (0-based) predicts token t+k+2:

    r_k = h + SiLU(h W_k + b_k)          a residual block, W_k and b_k zero-initialized (r_k = h at first)
    logits_k = r_k L_k^T                 a vocabulary projection, L_k initialized from the LM head

At the start every head repeats the LM head's guess; training on hidden states of the frozen target
(computed once) teaches each block how to shift h towards "the token k+1 places further on". The
loss is sum_k 0.8^k CE_k: nearer heads, which decide whether the farther guesses are reached at
all, weigh more. The backward pass is minillm's own (``minillm.train``: ``linear_backward``,
``cross_entropy_backward``, ``AdamW``).

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

import argparse
import hashlib
import itertools
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from .backend import to_numpy, xp
from .batch_speculative import generate_batch
from .checkpoint import (
    HEADER_KEY,
    SHIPPED_DIR,
    CheckpointError,
    atomic_save_npz,
    check_not_shipped,
    encode_header,
    read_npz,
)
from .data import corpus_tokenizer, train_val_split
from .llama import silu
from .model import linear
from .registry import SMOLLM2, SMOLLM2_SHA256, load_model
from .token_tree import Proposal, Round, TokenTree
from .train import (
    AdamW,
    TrainConfig,
    clip_grad_norm,
    cross_entropy_backward,
    cross_entropy_forward,
    linear_backward,
    lr_at,
    run_file,
)

MAX_HEADS = 5  # the Medusa paper's largest K
LOSS_DECAY = 0.8  # head k's loss weight is LOSS_DECAY ** k
HEADS_FORMAT = "minillm-medusa-1"
TOP_K = (4, 3, 2, 2)  # candidates per head for the sparse tree
MAX_NODES = 20  # tree nodes, the root included
HEADS_TRAIN = TrainConfig(batch_size=64, max_steps=600, lr=1e-3, min_lr=1e-4, warmup_steps=20, weight_decay=0.0,
                          eval_every=100, ckpt_every=100, seed=0)


def check_n_heads(n_heads) -> int:
    if not isinstance(n_heads, (int, np.integer)) or isinstance(n_heads, bool) or not 1 <= n_heads <= MAX_HEADS:
        raise ValueError(f"the number of Medusa heads must be an int in 1..{MAX_HEADS}, got {n_heads!r}")
    return int(n_heads)


# ----------------------------------------------------------------------------------------------
# forward/backward of the heads


def silu_backward(dout, x):
    """forward: y = x s(x), s = sigmoid.  -> dx = dout * s (1 + x (1 - s))"""
    s = 0.5 + 0.5 * xp.tanh(0.5 * x)  # sigmoid, as llama.silu computes it
    return dout * s * (1.0 + x * (1.0 - s))


def head_count(params: dict) -> int:
    return sum(1 for name in params if name.endswith(".w"))


def head_residual(params: dict, k: int, h):
    """r_k = h + SiLU(h W_k + b_k).  (N, C) -> (N, C), and z = h W_k + b_k for the backward pass."""
    z = linear(h, params[f"{k}.w"], params[f"{k}.b"])  # (N, C)
    return h + silu(z), z


def heads_forward_backward(params: dict, lm_head, h, targets, decay: float = LOSS_DECAY):
    """loss = sum_k decay^k CE(r_k L_k^T, targets[:, k]) and its gradient for every head parameter.

    params: "{k}.w" (C, C) [in, out], "{k}.b" (C,), "{k}.lm" (V, C) when head k has its own
    projection (else the frozen ``lm_head`` (V, C) is used). h (N, C) frozen hidden states; targets
    (N, K) token ids. -> (loss, [CE_k], grads). Works in the dtype of ``params`` (float64 for gradient checks).
    """
    loss, losses, grads = 0.0, [], {}
    for k in range(head_count(params)):
        L = params.get(f"{k}.lm", lm_head)  # (V, C)
        r, z = head_residual(params, k, h)
        logits = r @ L.T  # (N, V)
        ce, probs = cross_entropy_forward(logits, targets[:, k])
        weight = float(decay) ** k
        loss += weight * ce
        losses.append(ce)
        dlogits = weight * cross_entropy_backward(probs, targets[:, k])  # (N, V)
        dr = dlogits @ L  # forward logits = r L^T: dr = dlogits L ...
        if f"{k}.lm" in params:
            grads[f"{k}.lm"] = dlogits.T @ r  # ... and dL = dlogits^T r (V, C)
        dz = silu_backward(dr, z)  # h is frozen: the residual path gets no gradient
        _, grads[f"{k}.w"], grads[f"{k}.b"] = linear_backward(dz, h, params[f"{k}.w"])
    return loss, losses, grads


# ----------------------------------------------------------------------------------------------
# the heads, bound to their model


def model_identity(model) -> dict:
    """What ties heads to one model: its architecture, config and a sha256 of its LM head's float32 bytes."""
    lm = np.ascontiguousarray(to_numpy(model.lm_head), dtype=np.float32)
    return {"architecture": type(model).__name__, "config": model.config.to_dict(),
            "lm_head_sha256": hashlib.sha256(lm.tobytes()).hexdigest()}


class MedusaHeads:
    """K Medusa heads on a frozen ``model`` (anything with ``hidden``, ``lm_head`` and ``config``)."""

    def __init__(self, model, params: dict):
        self.model = model
        self.n_heads = check_n_heads(head_count(params))
        C, V = model.config.n_embd, model.config.vocab_size
        for k in range(self.n_heads):
            shapes = {f"{k}.w": (C, C), f"{k}.b": (C,)} | ({f"{k}.lm": (V, C)} if f"{k}.lm" in params else {})
            for name, shape in shapes.items():
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
                params[f"{k}.lm"] = to_numpy(model.lm_head).astype(np.float32)
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
        """Heads saved by ``save``; ValueError (one line) when they were trained for another model."""
        header, arrays = read_npz(path)
        if header.get("format") != HEADS_FORMAT:
            raise CheckpointError(f"{path} is not a Medusa heads file (format {header.get('format')!r})")
        check_same_model(header.get("model", {}), model_identity(model), path)
        return cls(model, arrays)


def shipped_heads_path(model_name: str) -> Path:
    """The heads shipped for a model name: "target" -> minillm/models/medusa_target.npz."""
    return SHIPPED_DIR / f"medusa_{model_name}.npz"


def check_same_model(saved: dict, actual: dict, path) -> None:
    for key in ("architecture", "config", "lm_head_sha256"):
        if saved.get(key) != actual[key]:
            raise ValueError(f"{path}: these Medusa heads were trained for another model ({key} differs: "
                             f"{saved.get(key)!r} vs {actual[key]!r}); train heads for this model with "
                             f"python -m minillm medusa-train")


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


# ----------------------------------------------------------------------------------------------
# training data: hidden states of the frozen model, computed once


def head_data(model, sequences, n_heads: int, starts=None):
    """Hidden states and the tokens +1..+K+1 after them -> (h (N, C) float32, targets (N, K + 1) int64).

    targets[:, 0] is what the LM head predicts (token t+1), targets[:, k + 1] head k's (token t+k+2).
    Row t of a sequence is used from starts[i] (default 0) while t + K + 1 is inside the sequence.
    Example: sequence [5, 6, 7, 8, 9], K = 2 -> rows t = 0, 1 with targets [6, 7, 8] and [7, 8, 9].
    """
    n_heads = check_n_heads(n_heads)
    hs, ys = [], []
    for i, seq in enumerate(sequences):
        seq = np.asarray(seq, dtype=np.int64)
        start = 0 if starts is None else int(starts[i])
        rows = np.arange(start, len(seq) - n_heads - 1)  # (n,)
        if len(rows) == 0:
            continue
        hs.append(to_numpy(model.hidden(xp.asarray(seq[None]))[0])[rows])  # (n, C)
        ys.append(seq[rows[:, None] + 1 + np.arange(n_heads + 1)])  # (n, K + 1)
    if not hs:
        raise ValueError(f"no sequence is long enough for {n_heads} heads (each needs more than {n_heads + 1} tokens)")
    return np.concatenate(hs).astype(np.float32), np.concatenate(ys)


def shakespeare_windows(split, n_windows: int, block_size: int, seed: int) -> list:
    """n_windows non-overlapping windows of block_size characters from a corpus split (uint8 ids)."""
    starts = np.random.default_rng(seed).permutation(len(split) // block_size)[:n_windows] * block_size
    return [split[s : s + block_size] for s in sorted(starts)]


CHAT_PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that reverses a string.",
    "Summarize the story of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "What are the health benefits of regular exercise?",
    "Describe a day in the life of a cat.",
    "How does a computer store numbers?",
    "Suggest a name for a bakery and explain why.",
    "What should I pack for a weekend hiking trip?",
    "Explain what a black hole is.",
    "Write an email asking my manager for a day off.",
    "How do vaccines work?",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
    "What is the water cycle?",
    "Explain recursion with an example.",
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of climate change?",
    "How can I improve my sleep?",
    "Describe the city of Tokyo.",
    "What is the difference between weather and climate?",
    "Explain how a bicycle works.",
    "List five fruits that are high in vitamin C.",
    "What is democracy?",
    "How do I write a good resume?",
    "Why do leaves change color in the fall?",
    "Explain the rules of chess briefly.",
    "What is the Pythagorean theorem?",
    "Write a thank-you note to a teacher.",
    "How do airplanes stay in the air?",
    "What are some good habits for studying?",
    "Describe the life cycle of a butterfly.",
    "What is an API in programming?",
    "How does the internet work?",
    "Give me ideas for a birthday party.",
    "What is the role of the heart in the body?",
    "Explain supply and demand.",
    "Write a limerick about a dog.",
    "What are renewable energy sources?",
    "How do I start running as a beginner?",
    "What is the difference between a virus and a bacterium?",
    "Describe the planet Mars.",
    "How do I save money on groceries?",
)
HELD_OUT_PROMPTS = (
    "What is machine learning?",
    "Tell me a fun fact about elephants.",
    "How do plants drink water?",
    "Write a haiku about autumn leaves.",
    "Explain how a rainbow forms.",
    "What makes a good friend?",
)
DISTILL_BATCH = 16  # answers generated together (one batched forward per token)
CHAR_WINDOWS = (256, 16)  # Shakespeare windows of block_size characters: training split, validation split


def self_distillation(model, tokenizer, prompts, max_new_tokens: int = 160, temperature: float = 0.0,
                      seed: int = 0, progress: bool = True):
    """Text the model itself writes: its chat answer to each prompt -> (sequences, starts).

    Answers are decoded DISTILL_BATCH at a time (``generate_batch``; greedy by default, the text
    greedy decoding will meet) and cut after their end-of-turn token. Each sequence is the templated
    prompt's tokens plus the answer; starts[i] is the last prompt position, whose hidden state
    predicts the answer's first tokens.
    """
    from tqdm import tqdm

    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]
    sequences, starts = [], []
    for i in tqdm(range(0, len(prompts), DISTILL_BATCH), desc="self-distillation", disable=not progress):
        batch = prompt_ids[i : i + DISTILL_BATCH]
        answers = generate_batch(model, batch, max_new_tokens, temperature=temperature, seed=seed + i).tokens
        for ids, answer in zip(batch, answers):
            eos = tokenizer.eos_token_id
            answer = answer[: answer.index(eos) + 1] if eos in answer else answer
            sequences.append([*ids, *answer])
            starts.append(len(ids) - 1)
    return sequences, starts


# ----------------------------------------------------------------------------------------------
# training


def train_heads(model, sequences, n_heads: int = 4, starts=None, tc: TrainConfig = HEADS_TRAIN, heads=None,
                held_out=None, state_path=None, resume: bool = False, progress: bool = True):
    """Train Medusa heads on the frozen ``model``'s hidden states of ``sequences`` -> (heads, history).

    Hidden states are computed once (``head_data``); each step draws tc.batch_size rows, runs
    ``heads_forward_backward``, clips and takes an AdamW step (cosine schedule, ``train.lr_at``).
    held_out: (h, targets) scored every tc.eval_every steps. state_path: the training state (heads,
    AdamW moments, step, generator, history) is saved there atomically every tc.ckpt_every steps;
    ``resume`` continues from it.
    """
    from tqdm import tqdm

    h, targets = head_data(model, sequences, n_heads, starts)
    h, targets = xp.asarray(h), xp.asarray(targets[:, 1:])  # the heads' columns
    heads = heads or MedusaHeads.init(model, n_heads)
    opt = AdamW(heads.params, (tc.beta1, tc.beta2), weight_decay=tc.weight_decay)
    rng, start, history, elapsed0 = np.random.default_rng(tc.seed), 0, [], 0.0
    if resume and Path(state_path).exists():  # (a run stopped before its first checkpoint starts over)
        start, history, elapsed0 = load_state(state_path, model, heads, opt, rng)
    if start >= tc.max_steps:
        raise ValueError(f"{state_path} is already at step {start} of {tc.max_steps}: nothing to train")
    t0 = time.perf_counter()
    bar = tqdm(range(start, tc.max_steps), initial=start, total=tc.max_steps, disable=not progress,
               desc="medusa heads", mininterval=2.0)
    for step in bar:
        rows = xp.asarray(rng.integers(0, len(h), size=tc.batch_size))
        loss, losses, grads = heads_forward_backward(heads.params, model.lm_head, h[rows], targets[rows])
        clip_grad_norm(grads, tc.grad_clip)
        opt.step(heads.params, grads, lr_at(step, tc))
        record = {"step": step + 1, "loss": round(loss, 4), "head_losses": [round(x, 4) for x in losses],
                  "elapsed_s": round(elapsed0 + time.perf_counter() - t0, 1)}
        last = step + 1 == tc.max_steps
        if held_out is not None and ((step + 1) % tc.eval_every == 0 or last):
            record["held_out"] = heads.accuracy(*held_out)
        history.append(record)
        bar.set_postfix(loss=f"{loss:.3f}")
        if state_path is not None and ((step + 1) % tc.ckpt_every == 0 or last):
            save_state(state_path, heads, opt, step + 1, rng, history)
    bar.close()
    return heads, history


def save_state(path, heads, opt, step, rng, history) -> None:
    """Heads, AdamW moments, step, generator state and history, in one atomic file."""
    header = {"format": "minillm-medusa-train-1", "model": model_identity(heads.model), "step": step,
              "adam_t": opt.t, "rng_state": rng.bit_generator.state, "history": history,
              "elapsed_s": history[-1]["elapsed_s"]}
    arrays = {f"param/{k}": to_numpy(v) for k, v in heads.params.items()}
    arrays |= {f"m/{k}": to_numpy(v) for k, v in opt.m.items()} | {f"v/{k}": to_numpy(v) for k, v in opt.v.items()}
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def save_text(path, parts: dict) -> None:
    """{name: (sequences, starts or None)} -> one atomic .npz (a resumed run trains on the same text)."""
    arrays, header = {}, {"format": "minillm-medusa-text-1", "starts": {}}
    for name, (sequences, starts) in parts.items():
        arrays[f"{name}/ids"] = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
        arrays[f"{name}/lengths"] = np.array([len(s) for s in sequences], dtype=np.int64)
        header["starts"][name] = None if starts is None else [int(s) for s in starts]
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def load_text(path) -> dict:
    """``save_text``'s file -> {name: (sequences, starts)}."""
    header, arrays = read_npz(path)
    return {name: (np.split(arrays[f"{name}/ids"], np.cumsum(arrays[f"{name}/lengths"])[:-1]), starts)
            for name, starts in header["starts"].items()}


def load_state(path, model, heads, opt, rng):
    """Restore heads, AdamW and the generator from ``save_state``'s file -> (step, history, elapsed_s)."""
    header, arrays = read_npz(path)
    check_same_model(header["model"], model_identity(model), path)
    for name in heads.params:
        heads.params[name][...] = xp.asarray(arrays[f"param/{name}"])
        opt.m[name][...] = xp.asarray(arrays[f"m/{name}"])
        opt.v[name][...] = xp.asarray(arrays[f"v/{name}"])
    opt.t = header["adam_t"]
    rng.bit_generator.state = header["rng_state"]
    return header["step"], header["history"], header["elapsed_s"]


# ----------------------------------------------------------------------------------------------
# the command: python -m minillm medusa-train


def training_text(model, tokenizer, seed: int, progress: bool):
    """-> (train sequences, train starts, held-out sequences, held-out starts) for a model.

    The character model: windows of the Shakespeare training split, held out: of the validation
    split. SmolLM2 (or any chat model): its own answers to CHAT_PROMPTS, held out: HELD_OUT_PROMPTS.
    """
    if hasattr(tokenizer, "apply_chat_template"):
        train_seqs, train_starts = self_distillation(model, tokenizer, CHAT_PROMPTS, seed=seed, progress=progress)
        held, held_starts = self_distillation(model, tokenizer, HELD_OUT_PROMPTS, seed=seed + 1000,
                                              progress=progress)
        return train_seqs, train_starts, held, held_starts
    train, val = train_val_split(corpus_tokenizer())
    T = model.config.block_size
    n_train, n_val = CHAR_WINDOWS
    return shakespeare_windows(train, n_train, T, seed), None, shakespeare_windows(val, n_val, T, seed), None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The medusa-train options (for a ``medusa-train`` subcommand of the CLI)."""
    p.add_argument("--model", default="target", help="'target', 'smollm2-135m' or a model path (default target)")
    p.add_argument("--out", required=True, help="heads file to write (.npz)")
    p.add_argument("--heads", type=int, default=4, help=f"number of heads, 1..{MAX_HEADS} (default 4)")
    p.add_argument("--steps", type=int, default=HEADS_TRAIN.max_steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=HEADS_TRAIN.lr, help="peak learning rate (cosine decay to lr / 10)")
    p.add_argument("--batch-size", type=int, default=HEADS_TRAIN.batch_size, help="hidden states per step")
    p.add_argument("--resume", action="store_true",
                   help="reuse the training text of <out>.medusa-text.npz, continue from <out>.medusa-train.npz")
    p.add_argument("--overwrite-shipped", action="store_true", help="allow --out to replace a shipped heads file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    """Check the options (before any work), make the training text, train, save heads + a log -> 0."""
    n_heads = check_n_heads(args.heads)
    if args.steps < 1 or args.batch_size < 1:
        raise ValueError(f"--steps and --batch-size must be >= 1, got {args.steps} and {args.batch_size}")
    if not 0 < args.lr < 1:
        raise ValueError(f"--lr must be in (0, 1), got {args.lr}")
    check_not_shipped(args.out, args.overwrite_shipped)
    t_start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    state_path, progress = run_file(args.out, ".medusa-train.npz"), not args.quiet
    tc = replace(HEADS_TRAIN, max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10)
    text_path = run_file(args.out, ".medusa-text.npz")
    if args.resume:
        parts = load_text(text_path)
    else:
        train_text = training_text(model, tokenizer, tc.seed, progress)
        parts = {"train": train_text[:2], "held_out": train_text[2:]}
        save_text(text_path, parts)
    (sequences, starts), (held, held_starts) = parts["train"], parts["held_out"]
    held_h, held_y = head_data(model, held, n_heads, held_starts)
    heads, history = train_heads(model, sequences, n_heads, starts, tc, held_out=(held_h, held_y[:, 1:]),
                                 state_path=state_path, resume=args.resume, progress=progress)
    rounded = MedusaHeads(model, {k: to_numpy(v).astype(np.float16) for k, v in heads.params.items()})
    notes = {
        "model": str(args.model), "gguf_sha256": SMOLLM2_SHA256 if str(args.model) == SMOLLM2 else None,
        "train_tokens": int(sum(len(s) for s in sequences)), "held_out_rows": int(len(held_h)),
        "lm_head_top1": round(float((to_numpy(model.logits(xp.asarray(held_h))).argmax(-1) == held_y[:, 0]).mean()), 4),
        "held_out": rounded.accuracy(held_h, held_y[:, 1:]),  # measured as shipped: float16 weights
        "train_time_s": history[-1]["elapsed_s"], "total_time_s": round(time.perf_counter() - t_start, 1),
        "train_config": asdict(tc), "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
    }
    rounded.save(args.out, notes, args.overwrite_shipped)
    run_file(args.out, ".log.json").write_text(json.dumps(notes | {"history": history}, indent=1))
    print(json.dumps(notes, indent=1))
    return 0
