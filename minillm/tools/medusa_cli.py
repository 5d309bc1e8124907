"""``python -m minillm medusa-train``: train Medusa heads for a model and save them with a log.
"""


from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace

import numpy as np

from ..backend import to_numpy, xp
from ..medusa import MAX_HEADS, MedusaHeads, check_n_heads
from ..medusa_train import HEADS_TRAIN, head_data, load_text, save_text, train_heads, training_text
from ..registry import SMOLLM2, SMOLLM2_SHA256, load_model
from ..train import check_add_on_run
from .options import add_weights_option, nonnegative_count, nonnegative_float


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The medusa-train options (for a ``medusa-train`` subcommand of the CLI)."""
    p.add_argument("--model", default="target", help="'target', 'smollm2-135m' or a model path (default target)")
    add_weights_option(p)
    p.add_argument("--out", required=True, help="heads file to write (.npz)")
    p.add_argument("--heads", type=nonnegative_count, default=4, help=f"number of heads, 1..{MAX_HEADS} (default 4)")
    p.add_argument("--steps", type=nonnegative_count, default=HEADS_TRAIN.max_steps, help="optimizer steps")
    p.add_argument("--lr", type=nonnegative_float, default=HEADS_TRAIN.lr,
                   help="peak learning rate (cosine decay to lr / 10)")
    p.add_argument("--batch-size", type=nonnegative_count, default=HEADS_TRAIN.batch_size,
                   help="hidden states per step")
    p.add_argument("--resume", action="store_true",
                   help="reuse the training text of <out>.medusa-text.npz, continue from <out>.medusa-train.npz "
                   "(or write the heads of a run that finished training)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace <out> and its .medusa-train.npz, .medusa-text.npz, .log.json if they exist "
                   "(--resume alone never replaces <out>)")
    p.add_argument("--overwrite-shipped", action="store_true", help="allow --out to replace a shipped heads file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    """Check the options (before any work), make the training text, train, save heads + a log -> 0."""
    n_heads = check_n_heads(args.heads)
    state_path, text_path, log_path = check_add_on_run(args, (".medusa-train.npz", ".medusa-text.npz", ".log.json"))
    t_start = time.perf_counter()
    model, tokenizer = load_model(args.model, weights=args.weights)
    progress = not args.quiet
    tc = replace(HEADS_TRAIN, max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10)
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
    log_path.write_text(json.dumps(notes | {"history": history}, indent=1))
    print(json.dumps(notes, indent=1))
    return 0
