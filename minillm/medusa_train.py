"""Training Medusa heads (``minillm.medusa``) on the frozen target: loss, backward pass, data, loop.

The target never changes, so its hidden states are computed once (``head_data``); each step draws a
batch of them, and only the heads learn. The loss is sum_k 0.8^k CE_k (nearer heads, which decide
whether the farther guesses are reached at all, weigh more); its backward pass is minillm's own
(``minillm.train``: ``linear_backward``, ``cross_entropy_backward``, ``AdamW``).

What a model trains on (``training_text``): the character model, windows of the Shakespeare training
split; a chat model, its own greedy answers to a few prompts (self-distillation: the heads learn the
text greedy decoding will meet). The state is checkpointed atomically so a run can ``resume``.
The command that runs all this: ``python -m minillm medusa-train`` (``minillm.tools.medusa_cli``).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from .backend import to_numpy, xp
from .batch_speculative import generate_batch
from .checkpoint import (
    FLOAT_WEIGHTS,
    HEADER_KEY,
    TOKEN_IDS,
    CheckpointError,
    atomic_save_npz,
    check_format,
    check_trained_for,
    encode_header,
    host_float32,
    model_identity,
    read_npz,
)
from .data import corpus_tokenizer, train_val_split
from .medusa import MedusaHeads, check_n_heads, head_count, head_residual
from .quantize import kept_in_blocks
from .train import (
    AdamW,
    TrainConfig,
    check_step,
    clip_grad_norm,
    cross_entropy_backward,
    cross_entropy_forward,
    linear_backward,
    lr_at,
)

STATE_FORMAT, STATE_KIND = "minillm-medusa-train-1", "Medusa training state"
TEXT_FORMAT, TEXT_KIND = "minillm-medusa-text-1", "Medusa training text"
LOSS_DECAY = 0.8  # head k's loss weight is LOSS_DECAY ** k
HEADS_TRAIN = TrainConfig(batch_size=64, max_steps=600, lr=1e-3, min_lr=1e-4, warmup_steps=20, weight_decay=0.0,
                          eval_every=100, ckpt_every=100, seed=0)


# ----------------------------------------------------------------------------------------------
# forward/backward of the heads


def silu_backward(dout, x):
    """forward: y = x s(x), s = sigmoid.  -> dx = dout * s (1 + x (1 - s))"""
    s = 0.5 + 0.5 * xp.tanh(0.5 * x)  # sigmoid, as llama.silu computes it
    return dout * s * (1.0 + x * (1.0 - s))


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
    ``resume`` continues from it (a state already at tc.max_steps comes back as it is, for a crashed
    export to be finished). ValueError as soon as the loss diverges (``train.check_step``).
    """
    from tqdm import tqdm

    h, targets = head_data(model, sequences, n_heads, starts)
    h, targets = xp.asarray(h), xp.asarray(targets[:, 1:])  # the heads' columns
    heads = heads or MedusaHeads.init(model, n_heads)
    lm_head = model.lm_head  # (V, C): the backward multiplies by it both ways, so blocks are dequantized once
    lm_head = xp.asarray(host_float32(lm_head)) if kept_in_blocks(lm_head) else lm_head
    opt = AdamW(heads.params, (tc.beta1, tc.beta2), weight_decay=tc.weight_decay)
    rng, start, history, elapsed0 = np.random.default_rng(tc.seed), 0, [], 0.0
    if resume and Path(state_path).exists():  # (a run stopped before its first checkpoint starts over)
        start, history, elapsed0 = load_state(state_path, model, heads, opt, rng)
    if start > tc.max_steps or (start == tc.max_steps and not resume):
        raise ValueError(f"{state_path} is already at step {start} of {tc.max_steps}: nothing to train")
    t0 = time.perf_counter()
    bar = tqdm(range(start, tc.max_steps), initial=start, total=tc.max_steps, disable=not progress,
               desc="medusa heads", mininterval=2.0)
    for step in bar:
        rows = xp.asarray(rng.integers(0, len(h), size=tc.batch_size))
        loss, losses, grads = heads_forward_backward(heads.params, lm_head, h[rows], targets[rows])
        check_step(loss, clip_grad_norm(grads, tc.grad_clip), step + 1)
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
    header = {"format": STATE_FORMAT, "model": model_identity(heads.model), "step": step,
              "adam_t": opt.t, "rng_state": rng.bit_generator.state, "history": history,
              "elapsed_s": history[-1]["elapsed_s"]}
    arrays = {f"param/{k}": to_numpy(v) for k, v in heads.params.items()}
    arrays |= {f"m/{k}": to_numpy(v) for k, v in opt.m.items()} | {f"v/{k}": to_numpy(v) for k, v in opt.v.items()}
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def save_text(path, parts: dict) -> None:
    """{name: (sequences, starts or None)} -> one atomic .npz (a resumed run trains on the same text)."""
    arrays, header = {}, {"format": TEXT_FORMAT, "starts": {}, "lengths": {}}
    for name, (sequences, starts) in parts.items():
        arrays[f"{name}/ids"] = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])
        header["lengths"][name] = [len(s) for s in sequences]
        header["starts"][name] = None if starts is None else [int(s) for s in starts]
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def text_layout(header: dict, path) -> dict:
    """The arrays a training-text file's header implies: {"<part>/ids": ((sum of its lengths,), dtypes)}."""
    check_format(header, TEXT_FORMAT, path, TEXT_KIND)
    lengths = header.get("lengths")
    if not isinstance(lengths, dict) or not isinstance(header.get("starts"), dict) or lengths.keys() != header[
            "starts"].keys() or not all(isinstance(n, int) and n >= 0 for ns in lengths.values() for n in ns):
        raise CheckpointError(f"inconsistent {TEXT_KIND} {path}: its lengths and starts do not match")
    return {f"{name}/ids": ((sum(ns),), TOKEN_IDS) for name, ns in lengths.items()}


def load_text(path) -> dict:
    """``save_text``'s file -> {name: (sequences, starts)}."""
    header, arrays = read_npz(path, lambda header: text_layout(header, path), TEXT_KIND)
    return {name: (np.split(arrays[f"{name}/ids"], np.cumsum(header["lengths"][name])[:-1]), starts)
            for name, starts in header["starts"].items()}


def state_layout(header: dict, model, heads, path) -> dict:
    """The arrays a training state's header implies: the heads' parameters and both AdamW moments, shaped
    like ``heads.params``, once its format and the model it was trained for are checked."""
    check_format(header, STATE_FORMAT, path, STATE_KIND)
    check_trained_for(header, model, path, STATE_KIND, "medusa-train without --resume (a new run)")
    return {f"{group}/{name}": (tuple(p.shape), FLOAT_WEIGHTS) for group in ("param", "m", "v")
            for name, p in heads.params.items()}


def load_state(path, model, heads, opt, rng):
    """Restore heads, AdamW and the generator from ``save_state``'s file -> (step, history, elapsed_s)."""
    header, arrays = read_npz(path, lambda header: state_layout(header, model, heads, path), STATE_KIND)
    for name in heads.params:
        heads.params[name][...] = xp.asarray(arrays[f"param/{name}"])
        opt.m[name][...] = xp.asarray(arrays[f"m/{name}"])
        opt.v[name][...] = xp.asarray(arrays[f"v/{name}"])
    opt.t = header["adam_t"]
    rng.bit_generator.state = header["rng_state"]
    return header["step"], header["history"], header["elapsed_s"]


# ----------------------------------------------------------------------------------------------
# what each model trains on


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


