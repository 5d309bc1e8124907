"""Training GPT from scratch: a hand-written backward pass, AdamW and a cosine schedule.

In the spirit of llm.c's train_gpt2.c every layer is a forward/backward pair. The forward pass is
the model's own block (``model.gpt_block``) run over a ``Recording`` table: the model's array code,
keeping a tape of what each op read; the backward pass walks the tape in reverse, one ``*_backward``
per op. Each ``*_backward`` restates its forward as a docstring and returns the gradient for every input.

    python -m minillm train --preset target --out target.npz [--steps N] [--resume]

Training state (weights, AdamW moments, step, the data generator's state, loss history) is saved
atomically every ``ckpt_every`` steps to ``<out>.train.npz``; ``--resume`` continues from it and
draws exactly the batches an uninterrupted run would have drawn. The summary goes to
``<out>.log.json``. Both sit beside ``out``, or in the working directory when ``out`` is a model
shipped in the package, which is replaced only when asked (``overwrite_shipped=True``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from .attention import attention_weights, softmax
from .backend import to_numpy, xp
from .checkpoint import (
    HEADER_KEY,
    SHIPPED_DIR,
    CheckpointError,
    atomic_save_npz,
    check_destination,
    check_not_shipped,
    encode_header,
    model_notes,
    read_npz,
    save_model,
)
from .config import GPTConfig
from .data import corpus_tokenizer, train_val_split
from .model import GPT, GPTOps, gpt_blocks
from .nn import GELU_A, GELU_C, LN_EPS, gelu, layer_norm, merge_heads, split_heads  # noqa: F401  (forwards, beside)

# ----------------------------------------------------------------------------------------------
# forward/backward pairs


def one_hot(idx, n, dtype):
    """(...) int -> (..., n) with a 1 at each index (not eye(n)[idx]: an n x n matrix, 9.7 GB at SmolLM2's n)."""
    return (idx[..., None] == xp.arange(n)).astype(dtype)


def embedding_backward(dout, idx, vocab_size, block_size):
    """forward: x = wte[idx] + wpe[t].  (B, T, C) -> d wte (V, C), d wpe (block_size, C)"""
    B, T, C = dout.shape
    dout2d = dout.reshape(B * T, C)  # (B*T, C)
    dwte = one_hot(idx.reshape(-1), vocab_size, dout.dtype).T @ dout2d  # scatter-add as a matmul
    dwpe = xp.zeros((block_size, C), dtype=dout.dtype)
    dwpe[:T] = dout.sum(axis=0)
    return dwte, dwpe


def layernorm_backward(dout, x, w):
    """forward: y = xhat * w + b with xhat = (x - mean) * rstd, rstd = 1 / sqrt(var + eps).

    -> dx, dw, db. dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dout * w.
    """
    # EXERCISE A1.2 BEGIN: recompute xhat and rstd; dw, db summed over positions; dx by the formula above
    C = x.shape[-1]
    xc = x - x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / xp.sqrt((xc**2).mean(axis=-1, keepdims=True) + LN_EPS)
    xhat = xc * rstd
    dw = (dout * xhat).reshape(-1, C).sum(axis=0)
    db = dout.reshape(-1, C).sum(axis=0)
    dxhat = dout * w
    dx = rstd * (
        dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    )
    return dx, dw, db
    # EXERCISE A1.2 END


def linear_backward(dout, x, w):
    """forward: y = x @ w + b.  -> dx = dout @ w^T, dw = x^T @ dout, db = sum(dout)."""
    dx = dout @ w.T  # (..., out) @ (out, in) -> (..., in)
    dout2d = dout.reshape(-1, dout.shape[-1])  # (N, out)
    dw = x.reshape(-1, x.shape[-1]).T @ dout2d  # (in, N) @ (N, out) -> (in, out)
    return dx, dw, dout2d.sum(axis=0)


def gelu_backward(dout, x):
    """forward: y = 0.5 x (1 + tanh(u)), u = c (x + a x^3), c = GELU_C, a = GELU_A.  -> dx = dout * dy/dx

    Elementwise, any shape. Derive dy/dx with the product rule, then the chain rule through tanh and u.
    """
    # EXERCISE A1.1 BEGIN: the chain rule through 0.5 x (1 + tanh(u)), times the upstream gradient
    t = xp.tanh(GELU_C * (x + GELU_A * x * x * x))
    return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3 * GELU_A * x * x))
    # EXERCISE A1.1 END


def attention_backward(dy, q, k, v, att):
    """forward: att = softmax(q k^T / sqrt(hs) + mask), y = att @ v.  -> dq, dk, dv.

    Softmax backward: ds = att * (datt - sum_j(datt * att)); masked entries have att = 0.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = att.swapaxes(-1, -2) @ dy  # (B, nh, Tk, Tq) @ (B, nh, Tq, hs) -> (B, nh, Tk, hs)
    datt = dy @ v.swapaxes(-1, -2)  # (B, nh, Tq, hs) @ (B, nh, hs, Tk) -> (B, nh, Tq, Tk)
    ds = att * (datt - (datt * att).sum(axis=-1, keepdims=True)) * scale
    dq = ds @ k  # (B, nh, Tq, Tk) @ (B, nh, Tk, hs)
    dk = ds.swapaxes(-1, -2) @ q  # (B, nh, Tk, Tq) @ (B, nh, Tq, hs)
    return dq, dk, dv


def cross_entropy_forward(logits, targets):
    """loss = mean over positions of logsumexp(logits) - logits[target].  -> loss, probs"""
    probs = softmax(logits)  # (B, T, V)
    picked = (probs * one_hot(targets, logits.shape[-1], probs.dtype)).sum(axis=-1)  # (B, T)
    return float(-xp.log(picked).mean()), probs


def cross_entropy_backward(probs, targets):
    """d loss / d logits = (probs - one_hot(target)) / number of positions."""
    return (probs - one_hot(targets, probs.shape[-1], probs.dtype)) / targets.size


class Recording:
    """A table of ops that runs a model's array-code table and keeps a tape of what each op read.

    The block over this table is the model's own (``model.gpt_block``, ``llama.llama_block``); ``backward``
    then walks the tape in reverse, each op's backward pair in turn. A block is a chain of ops whose residual
    adds sit inside ``add_norm``, so two gradients flow back: the residual stream's, and the op chain's
    between two norms (at each add_norm both receive the stream's gradient: x + h feeds both terms alike).
    A family's recording says how its norm, activation and attention go back (``GPTRecording`` here,
    ``eagle_train.LlamaRecording``).
    """

    def __init__(self, table):
        self.table, self.tape = table, []
        table.attention = self.attention  # the table's attention records its probabilities here

    def product(self, x, name):
        self.tape.append(("product", name, x))
        return self.table.product(x, name)

    def add_norm(self, x, h, name):
        x, n = self.table.add_norm(x, h, name)
        self.tape.append(("add_norm", name, x))
        return x, n

    def act(self, h):
        self.tape.append(("act", None, h))
        return self.table.act(h)

    def attend(self, layer, qkv, cache, *rope):
        return self.table.attend(layer, qkv, cache, *rope)

    def attention(self, q, k, v, causal=True, mask=None):
        """softmax(q k^T / sqrt(hs) + mask) v, its probabilities kept.  (B, nh, Tq, hs) x 3 -> (B, nh, Tq, hs)"""
        att = attention_weights(q, k, causal=causal, mask=mask)  # (B, nh, Tq, Tk)
        self.tape.append(("attention", None, (q, k, v, att)))
        return att @ v

    def backward(self, dout) -> tuple:
        """d loss / d (the blocks' output) -> (d loss / d (their input), {parameter name: gradient})."""
        grads, d_stream, d = {}, 0.0, dout
        for op, name, saved in reversed(self.tape):
            if op == "add_norm":  # forward: x = x + h;  n = norm(x)
                d_stream = d_stream + self.norm_backward(d, saved, name, grads)
                d = d_stream
            elif op == "product":  # forward: y = x @ w + b
                w, b = self.table.weight(name)
                d, dw, db = linear_backward(d, saved, w)
                self.weight_grads(grads, name, dw, None if b is None else db)
            elif op == "act":
                d = self.act_backward(d, saved)
            else:  # the attention inside attend: back to the q|k|v product
                d = self.attend_backward(d, *saved)
        return d_stream, grads


class GPTRecording(Recording):
    """GPT-2's ops on the tape: LayerNorm, GELU, multi-head attention."""

    def __init__(self, config: GPTConfig, params: dict):
        super().__init__(GPTOps(config, params, None))

    def norm_backward(self, d, x, name, grads):
        w = self.table.params[name + ".weight"]
        dx, grads[name + ".weight"], grads[name + ".bias"] = layernorm_backward(d, x, w)
        return dx

    def weight_grads(self, grads, name, dw, db):
        grads[name + ".weight"], grads[name + ".bias"] = dw, db

    def act_backward(self, d, h):
        return gelu_backward(d, h)

    def attend_backward(self, dy, q, k, v, att):
        """(B, T, C) merged heads -> (B, T, 3C): d q | d k | d v."""
        dq, dk, dv = attention_backward(split_heads(dy, self.table.config.n_head), q, k, v, att)
        return xp.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)


def forward_backward(params: dict, config: GPTConfig, idx, targets):
    """Loss and the gradient of every parameter for one batch.  idx, targets (B, T) -> (loss, grads)

    Works in the dtype of ``params`` (float32 for training, float64 for gradient checks).
    """
    p = params
    T = idx.shape[1]
    tape = GPTRecording(config, params)
    x = p["wte.weight"][idx] + p["wpe.weight"][:T]  # (B, T, C)
    xf = gpt_blocks(tape, x, None, config.n_layer)  # the model's blocks, recorded
    logits = xf @ p["wte.weight"].T  # (B, T, V)
    loss, probs = cross_entropy_forward(logits, targets)
    dlogits = cross_entropy_backward(probs, targets)  # (B, T, V)
    dwte_head = dlogits.reshape(-1, config.vocab_size).T @ xf.reshape(-1, config.n_embd)  # (V, C)
    dx, g = tape.backward(dlogits @ p["wte.weight"])  # the tape in reverse, from d xf (B, T, C)
    dwte_emb, g["wpe.weight"] = embedding_backward(dx, idx, config.vocab_size, config.block_size)
    g["wte.weight"] = dwte_head + dwte_emb  # the tied weight collects both gradients
    return loss, g


# ----------------------------------------------------------------------------------------------
# optimizer and schedule


class AdamW:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019), decay on matrices only."""

    def __init__(self, params: dict, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1):
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.m = {k: xp.zeros_like(v) for k, v in params.items()}
        self.v = {k: xp.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def step(self, params: dict, grads: dict, lr: float) -> None:
        """m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p)

        In place: ``self.m``, ``self.v`` and ``params``' arrays are updated, not replaced (the model
        holds the same arrays). ``self.t`` counts the steps taken: m_hat = m / (1 - b1^t), v_hat =
        v / (1 - b2^t). Weight decay applies to matrices (ndim >= 2) only.
        """
        # EXERCISE A1.3 BEGIN: update the moments in place, bias-correct them, decay matrices, step
        b1, b2 = self.betas
        self.t += 1
        c1, c2 = 1.0 - b1**self.t, 1.0 - b2**self.t  # bias corrections
        for name, param in params.items():
            grad, m, v = grads[name], self.m[name], self.v[name]
            m *= b1
            m += (1.0 - b1) * grad
            v *= b2
            v += (1.0 - b2) * grad * grad
            if param.ndim >= 2:
                param -= (lr * self.weight_decay) * param
            param -= lr * (m / c1) / (xp.sqrt(v / c2) + self.eps)
        # EXERCISE A1.3 END


def clip_grad_norm(grads: dict, max_norm: float) -> float:
    """Scale all gradients together so their global L2 norm is at most max_norm; -> the norm."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    if norm > max_norm:
        for g in grads.values():
            g *= max_norm / norm
    return norm


def lr_at(step: int, tc: TrainConfig) -> float:
    """Linear warm-up over warmup_steps, then cosine decay from lr to min_lr at max_steps."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------
# data and evaluation


def get_batch(data: np.ndarray, batch_size: int, block_size: int, rng: np.random.Generator):
    """B random windows of the token stream -> inputs and next-token targets, (B, T) each."""
    offsets = rng.integers(0, len(data) - block_size, size=batch_size)
    rows = offsets[:, None] + np.arange(block_size)  # (B, T)
    return xp.asarray(data[rows].astype(np.int64)), xp.asarray(data[rows + 1].astype(np.int64))


def batch_loss(model: GPT, idx, targets) -> float:
    return cross_entropy_forward(model.forward(idx), targets)[0]


def estimate_loss(model: GPT, data, batch_size, n_batches, seed) -> float:
    """Mean loss over n_batches random windows, always the same windows for a given seed."""
    rng = np.random.default_rng(seed)
    T = model.config.block_size
    return float(np.mean([batch_loss(model, *get_batch(data, batch_size, T, rng)) for _ in range(n_batches)]))


def evaluate(model: GPT, data: np.ndarray, tokens_per_batch: int = 4096) -> float:
    """Mean next-character loss (nats) over every non-overlapping full window of ``data``."""
    T = model.config.block_size
    n, batch_size = (len(data) - 1) // T, max(1, tokens_per_batch // T)
    inputs = data[: n * T].reshape(n, T).astype(np.int64)
    targets = data[1 : n * T + 1].reshape(n, T).astype(np.int64)
    total = 0.0
    for s in range(0, n, batch_size):
        x, y = xp.asarray(inputs[s : s + batch_size]), xp.asarray(targets[s : s + batch_size])
        total += batch_loss(model, x, y) * len(x)
    return total / n


# ----------------------------------------------------------------------------------------------
# the training loop


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 16  # sequences per step, each block_size tokens
    max_steps: int = 2000
    lr: float = 2e-3  # peak learning rate
    min_lr: float = 2e-4  # end of the cosine decay
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_every: int = 200  # steps between validation estimates
    eval_batches: int = 8
    ckpt_every: int = 100  # steps between atomic training-state checkpoints
    seed: int = 1337


def preset(name: str, vocab_size: int) -> tuple[GPTConfig, TrainConfig]:
    """The two shipped models: a 6-layer target and a 1-layer draft 1/20 its size."""
    if name == "target":
        return GPTConfig(vocab_size, block_size=256, n_layer=6, n_head=4, n_embd=256), TrainConfig(
            max_steps=1600, lr=1.5e-3, min_lr=1.5e-4
        )
    if name == "draft":
        return GPTConfig(vocab_size, block_size=256, n_layer=1, n_head=4, n_embd=128), TrainConfig(
            max_steps=2400, lr=3e-3, min_lr=3e-4
        )
    raise ValueError(f"unknown preset {name!r}: use 'target' or 'draft'")


def run_file(out, suffix: str) -> Path:
    """Where a run's training state (".train.npz") or log (".log.json") goes: beside ``out``, or in
    the working directory when ``out`` lies in the package (its shipped models stay alone there)."""
    out = Path(out)
    package = SHIPPED_DIR.resolve().parent  # minillm/, which holds models/
    return (Path.cwd() if package in out.resolve().parents else out.parent) / (out.stem + suffix)


def state_path(out) -> Path:
    return run_file(out, ".train.npz")


def check_step(loss: float, grad_norm: float, step: int) -> None:
    """Stop a diverged run before it saves anything: ValueError when the loss or the gradient norm
    of ``step`` is not finite (the weights would be NaN from this step on)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise ValueError(f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; "
                         "nothing was saved from this step on (try a lower learning rate)")


def check_run_files(files: list, overwrite: bool, resume: bool) -> None:
    """Before step 1: every file a run writes can be written, and none exists unless ``overwrite`` or
    ``resume`` (a resumed run writes its own files again); stale temp files of each are removed."""
    for path in files:
        check_destination(path, overwrite or resume)


def check_add_on_run(args, suffixes: tuple) -> list[Path]:
    """The opening of a run that trains an add-on for a frozen model (``eagle-train``, ``medusa-train``), before
    any work: its steps, batch and learning rate in range, ``args.out`` not a shipped file unless
    ``--overwrite-shipped``, and replaced only with ``--overwrite``; its own files (``suffixes``, beside
    ``out``: state, log, ...) new unless resumed or overwritten -> their paths, in order."""
    if args.steps < 1 or args.batch_size < 1:
        raise ValueError(f"--steps and --batch-size must be >= 1, got {args.steps} and {args.batch_size}")
    if not 0 < args.lr < 1:
        raise ValueError(f"--lr must be in (0, 1), got {args.lr}")
    check_not_shipped(args.out, args.overwrite_shipped)
    files = [run_file(args.out, suffix) for suffix in suffixes]
    overwrite = args.overwrite or args.overwrite_shipped
    check_destination(args.out, overwrite)  # the add-on: replaced only when asked, --resume or not
    check_run_files(files, overwrite, args.resume)  # the run's own files: --resume continues them
    return files


def read_state(path, fmt: str = "minillm-train-state-1") -> tuple[dict, dict]:
    """``read_npz`` of a run's state file of format ``fmt``, refused (one line) when the file is
    something else (a model, another run's file)."""
    header, arrays = read_npz(path)
    if header.get("format") != fmt:
        raise CheckpointError(f"{path} is not a training state ({fmt}, found {header.get('format')!r}); "
                              "--resume continues from the files an interrupted run left beside --out")
    return header, arrays


def already_exported(out, history) -> bool:
    """Whether ``out`` holds the model of this run's last state (its notes carry the same history)."""
    try:
        return model_notes(out).get("history") == history
    except CheckpointError:
        return False


def save_state(path, model, opt, tc, step, rng, history, elapsed):
    header = {
        "format": "minillm-train-state-1",
        "config": model.config.to_dict(),
        "train_config": asdict(tc),
        "step": step,
        "adam_t": opt.t,
        "rng_state": rng.bit_generator.state,
        "history": history,
        "elapsed_s": elapsed,
    }
    arrays = {f"param/{k}": to_numpy(v) for k, v in model.params.items()}
    arrays |= {f"m/{k}": to_numpy(v) for k, v in opt.m.items()}
    arrays |= {f"v/{k}": to_numpy(v) for k, v in opt.v.items()}
    atomic_save_npz(path, arrays | {HEADER_KEY: encode_header(header)})


def train(
    preset_name: str,
    out,
    steps: int | None = None,
    resume: bool = False,
    train_config: TrainConfig | None = None,
    model_config: GPTConfig | None = None,
    progress: bool = True,
    overwrite_shipped: bool = False,
    overwrite: bool = False,
) -> dict:
    """Train a preset (or explicit configs) for ``steps`` optimizer steps in all (default: the
    preset's) and write the model to ``out``; -> summary dict. ValueError, before any work, for
    steps < 1, a resumed run already at ``steps`` whose model is written, ``out`` being a shipped
    model (unless ``overwrite_shipped``), or any file of the run (``out``, its state, its log)
    existing (unless ``overwrite``; a resumed run reuses its own) or not writable. A resumed run whose
    last state is complete but whose model was never written (a crash in the final export) exports it.
    ValueError as soon as the loss diverges (``check_step``)."""
    from tqdm import tqdm

    check_not_shipped(out, overwrite_shipped)
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    spath = state_path(out)
    check_run_files([out, spath, run_file(out, ".log.json")], overwrite or overwrite_shipped, resume)
    tokenizer = corpus_tokenizer()
    train_data, val_data = train_val_split(tokenizer)
    cfg, tc = preset(preset_name, tokenizer.vocab_size)
    cfg, tc = model_config or cfg, train_config or tc
    if resume:
        header, arrays = read_state(spath)
        cfg, tc = GPTConfig.from_dict(header["config"]), TrainConfig(**header["train_config"])
        model = GPT(cfg, {k[6:]: v for k, v in arrays.items() if k.startswith("param/")})
        opt = AdamW(model.params, (tc.beta1, tc.beta2), weight_decay=tc.weight_decay)
        for name in model.params:
            opt.m[name][...] = xp.asarray(arrays[f"m/{name}"])
            opt.v[name][...] = xp.asarray(arrays[f"v/{name}"])
        opt.t, start, history = header["adam_t"], header["step"], header["history"]
        elapsed0 = header["elapsed_s"]
        rng = np.random.default_rng()
        rng.bit_generator.state = header["rng_state"]
    else:
        model = GPT.init(cfg, seed=tc.seed)
        opt = AdamW(model.params, (tc.beta1, tc.beta2), weight_decay=tc.weight_decay)
        start, history, elapsed0 = 0, [], 0.0
        rng = np.random.default_rng(tc.seed)
    if steps is not None:
        tc = replace(tc, max_steps=steps)
    export_only = start == tc.max_steps and not already_exported(out, history)  # the final export crashed
    if start >= tc.max_steps and not export_only:
        raise ValueError(f"{spath} is already at step {start} of {tc.max_steps}: nothing to train")

    t0 = time.perf_counter()
    bar = tqdm(range(start, tc.max_steps), initial=start, total=tc.max_steps, disable=not progress,
               desc=f"train {preset_name}", mininterval=2.0)
    for step in bar:
        lr = lr_at(step, tc)
        idx, targets = get_batch(train_data, tc.batch_size, cfg.block_size, rng)
        loss, grads = forward_backward(model.params, cfg, idx, targets)
        norm = clip_grad_norm(grads, tc.grad_clip)
        check_step(loss, norm, step + 1)
        opt.step(model.params, grads, lr)
        record = {"step": step + 1, "loss": round(loss, 4), "lr": lr, "grad_norm": round(norm, 3)}
        last = step + 1 == tc.max_steps
        if (step + 1) % tc.eval_every == 0 or last:
            val = estimate_loss(model, val_data, tc.batch_size, tc.eval_batches, tc.seed + 1)
            record["val_loss"] = round(val, 4)
        record["elapsed_s"] = round(elapsed0 + time.perf_counter() - t0, 1)
        history.append(record)
        bar.set_postfix(loss=f"{loss:.3f}", val=history_val(history))
        if (step + 1) % tc.ckpt_every == 0 or last:
            save_state(spath, model, opt, tc, step + 1, rng, history, record["elapsed_s"])
    bar.close()
    return export(model, tokenizer, out, preset_name, tc, history, val_data)


def history_val(history) -> str:
    vals = [r["val_loss"] for r in history if "val_loss" in r]
    return f"{vals[-1]:.3f}" if vals else "-"


def export(model, tokenizer, out, preset_name, tc, history, val_data) -> dict:
    """Save the model in float16 (one atomic write) with its val loss measured *as shipped*:
    on the weights rounded to float16, as loading the file gives them back."""
    rounded = GPT(model.config, {k: v.astype(np.float16) for k, v in model.numpy_params().items()})
    val_loss = evaluate(rounded, val_data)
    summary = {
        "preset": preset_name,
        "params": model.num_params(),
        "steps": history[-1]["step"] if history else 0,
        "tokens_seen": (history[-1]["step"] if history else 0) * tc.batch_size * model.config.block_size,
        "train_loss_last50": float(np.mean([r["loss"] for r in history[-50:]])) if history else None,
        "val_loss": round(val_loss, 4),
        "wall_time_s": history[-1]["elapsed_s"] if history else 0.0,
        "train_config": asdict(tc),
        "history": history,
    }
    save_model(out, model, tokenizer, dtype=np.float16, notes=summary)
    run_file(out, ".log.json").write_text(json.dumps(summary, indent=1))
    return summary
