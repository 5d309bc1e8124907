"""``python -m minillm eagle-data`` and ``eagle-train``: the EAGLE draft's training text, then the draft.

    python -m minillm eagle-data --out DIR [--prompts 1200] [--resume]
                                 [--source templates|stdlib|texts|advice|why|programs|utilities|plans|opinions|writings]
    python -m minillm eagle-data --out DIR --source rewrites --texts WRITINGS_DIR [--prompts 1200] [--resume]
    python -m minillm eagle-taps --data DIR --out TAPS [--resume]
    python -m minillm eagle-train --data DIR [DIR ...] --out eagle.npz [--vocab 4096] [--steps 1500] [--ahead 2]
                                  [--taps TAPS [TAPS ...]] [--resume]

Both run for minutes to an hour on a laptop CPU; both write atomically as they go (data: one part
file per batch of answers; training: a state file every 100 steps), so ``--resume`` continues a
stopped run where it stopped.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace

import numpy as np

from ..backend import to_numpy
from ..eagle import DEFAULT_SUBSET, EagleDraft, frequency_subset, subset_coverage, token_counts
from ..eagle_train import (
    ANSWER_TOKENS,
    EAGLE_TRAIN,
    TAP_LAYERS,
    DraftData,
    held_out_accuracy,
    read_answers,
    train_draft,
    write_answers,
    write_taps,
)
from ..registry import SMOLLM2, SMOLLM2_SHA256, load_model
from ..train import check_add_on_run
from ..workloads import (
    WORKLOADS,
    advice_prompts,
    check_held_out,
    opinion_prompts,
    plan_prompts,
    program_prompts,
    rewrite_prompts,
    stdlib_prompts,
    stdlib_texts,
    training_prompts,
    utility_prompts,
    why_prompts,
    writing_prompts,
)
from .options import add_weights_option, int_in, nonnegative_count, nonnegative_float

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
PROMPT_SOURCES = {"templates": training_prompts, "stdlib": stdlib_prompts, "texts": stdlib_texts,
                  "advice": advice_prompts, "why": why_prompts, "programs": program_prompts,
                  "plans": plan_prompts, "opinions": opinion_prompts, "utilities": utility_prompts,
                  "writings": writing_prompts, "rewrites": rewrite_prompts}
AHEAD_STEPS = (1, 2, 3)  # eagle-train --ahead: each step costs one more pass of the draft per window
FIXED_TEXT_TOKENS = 1  # --source texts: the answer is fixed text, read teacher-forced; one token of the target's own


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SMOLLM2, help=f"the target (default {SMOLLM2})")
    add_weights_option(p)
    p.add_argument("--out", required=True, help="folder for the data parts")
    p.add_argument("--prompts", type=nonnegative_count, default=1200, help="training prompts (default 1200)")
    p.add_argument("--source", choices=PROMPT_SOURCES, default="templates",
                   help="where the prompts come from: templates (topics x question forms, code tasks, passages of "
                   "the corpus), stdlib (the Python standard library's docstrings and source), texts (questions "
                   "about the standard library answered with its own source and docstrings: fixed text the target "
                   "reads, a prefill each), advice (everyday requests for advice, situations x ways of asking), why "
                   "(why everyday things happen), programs (small programs asked for as people ask), utilities (more "
                   "of them), plans (plans and lists for an occasion), opinions (an opinion on a choice), writings "
                   "(everyday texts for an occasion) or rewrites (requests to rework the texts --texts holds; "
                   "default templates)")
    p.add_argument("--texts", default=None, metavar="DIR",
                   help="--source rewrites: a folder eagle-data --source writings wrote; its answers are the texts")
    p.add_argument("--max-new-tokens", type=nonnegative_count, default=None,
                   help=f"most tokens per answer (default {ANSWER_TOKENS}; {FIXED_TEXT_TOKENS} for --source texts)")
    p.add_argument("--seed", type=nonnegative_count, default=0, help="the prompts' draw and the sampled answers")
    p.add_argument("--resume", action="store_true", help="keep the parts already in --out, write the rest")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_data(args) -> int:
    new_tokens = args.max_new_tokens
    if new_tokens is None:
        new_tokens = FIXED_TEXT_TOKENS if args.source == "texts" else ANSWER_TOKENS
    if args.prompts < 1 or new_tokens < 1:
        raise ValueError(f"--prompts and --max-new-tokens must be >= 1, got {args.prompts} and {args.max_new_tokens}")
    if (args.source == "rewrites") != (args.texts is not None):
        raise ValueError("--texts DIR goes with --source rewrites, and --source rewrites needs it")
    model, tokenizer = load_model(args.model, weights=args.weights)
    source = PROMPT_SOURCES[args.source]
    prompts = (source(written_texts(args.texts, model, tokenizer), args.prompts, args.seed) if args.texts
               else source(args.prompts, args.seed))
    check_held_out(WORKLOADS, prompts)
    summary = write_answers(model, tokenizer, prompts, args.out, new_tokens, seed=args.seed,
                            resume=args.resume, progress=not args.quiet)
    print(json.dumps(summary))
    return 0


def written_texts(data_dir, model, tokenizer) -> list[str]:
    """The answers in an eagle-data folder, as text: what the target wrote after each prompt, up to its end of turn."""
    data = read_answers(data_dir, model)
    texts = []
    for ids, start in zip(data["sequences"], data["prompt_lengths"]):
        answer = [int(t) for t in ids[start:]]
        if tokenizer.eos_token_id in answer:
            answer = answer[: answer.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(answer))
    return texts


def add_taps_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SMOLLM2, help=f"the target (default {SMOLLM2})")
    add_weights_option(p)
    p.add_argument("--data", required=True, help="a folder written by eagle-data")
    p.add_argument("--out", required=True, help="folder for the taps parts (one per data part)")
    p.add_argument("--resume", action="store_true", help="keep the parts already in --out, write the rest")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_taps(args) -> int:
    model, _ = load_model(args.model, weights=args.weights)
    print(json.dumps(write_taps(model, args.data, args.out, TAP_LAYERS, args.resume, progress=not args.quiet)))
    return 0


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SMOLLM2, help=f"the target (default {SMOLLM2})")
    add_weights_option(p)  # either load: one model, one identity (checkpoint.model_identity)
    p.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="folders written by eagle-data (e.g. the target's answers, then fixed texts)")
    p.add_argument("--out", required=True, help="draft file to write (.npz)")
    p.add_argument("--vocab", type=nonnegative_count, default=DEFAULT_SUBSET,
                   help=f"V': the draft's vocabulary, the most frequent tokens of the data (default {DEFAULT_SUBSET})")
    p.add_argument("--steps", type=nonnegative_count, default=EAGLE_TRAIN.max_steps, help="optimizer steps")
    p.add_argument("--batch-size", type=nonnegative_count, default=EAGLE_TRAIN.batch_size,
                   help="windows of 128 positions per step")
    p.add_argument("--lr", type=nonnegative_float, default=EAGLE_TRAIN.lr, help="peak learning rate")
    p.add_argument("--parts", type=nonnegative_count, nargs="+", default=None, metavar="N",
                   help="read only the first N data parts of each folder, or of each in turn with one N per folder "
                   "(answers are written by temperature: greedy first)")
    p.add_argument("--ahead", type=int_in(AHEAD_STEPS[0], AHEAD_STEPS[-1]), default=1,
                   help="steps of EAGLE-3's training-time test: 2 or more also trains the draft on its own "
                   "features, as its later guesses of a round read them (default 1: EAGLE's teacher forcing)")
    p.add_argument("--train-tokens", type=nonnegative_count, default=None,
                   help="train on N positions only: whole answers drawn evenly from every folder "
                   "(a data-scaling curve)")
    p.add_argument("--taps", nargs="+", default=None, metavar="TAPS",
                   help="eagle-taps folders, one per --data folder: the draft also reads the target's lower blocks "
                   "(EAGLE-3's fused features) and the target hands them over at every verify")
    p.add_argument("--resume", action="store_true", help="continue from <out>.eagle-train.npz")
    p.add_argument("--overwrite", action="store_true",
                   help="replace <out> and its .eagle-train.npz, .log.json (--resume alone never replaces <out>)")
    p.add_argument("--overwrite-shipped", action="store_true", help="allow --out to replace the shipped draft")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_train(args) -> int:
    state_path, log_path = check_add_on_run(args, (".eagle-train.npz", ".log.json"))
    t_start = time.perf_counter()
    model, tokenizer = load_model(args.model, weights=args.weights)
    data = read_answers(args.data, model, args.parts, args.taps)
    n = len(data["sequences"])
    counts = token_counts(data["sequences"][: n - max(1, n // 20)], model.config.vocab_size)
    subset = frequency_subset(counts, args.vocab, always=(tokenizer.eos_token_id,))
    tap_layers = TAP_LAYERS if args.taps else ()
    draft = EagleDraft.init(model, subset, tap_layers=tap_layers)
    pairs = DraftData(data, draft, args.train_tokens)
    tc = replace(EAGLE_TRAIN, max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr=args.lr / 10)
    history = train_draft(draft, pairs, tc, state_path, args.resume, progress=not args.quiet, ahead=args.ahead)
    rounded = EagleDraft(model, {k: to_numpy(v).astype(np.float16) for k, v in draft.params.items()}, subset,
                         tap_layers=tap_layers)
    notes = {
        "model": str(args.model), "gguf_sha256": SMOLLM2_SHA256 if str(args.model) == SMOLLM2 else None,
        "subset_size": int(len(subset)), "coverage": subset_coverage(counts, COVERAGE_SIZES),
        "data_parts": data["parts"], "answers": len(data["sequences"]),
        "train_positions": int(len(pairs.train[0])), "held_out_positions": int(len(pairs.held[0])),
        "held_out_top1": round(held_out_accuracy(rounded, pairs), 4),  # as shipped: float16 weights
        "held_out_second_guess": round(held_out_accuracy(rounded, pairs, step=2), 4), "ahead": args.ahead,
        "tap_layers": list(tap_layers),
        "train_time_s": history[-1]["elapsed_s"], "total_time_s": round(time.perf_counter() - t_start, 1),
        "train_config": asdict(tc), "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
        "history": history[:: max(1, len(history) // 100)] + history[-1:],  # the curve, about 100 points
    }
    rounded.save(args.out, notes, args.overwrite_shipped)
    log_path.write_text(json.dumps(notes | {"history": history}, indent=1))
    print(json.dumps({k: v for k, v in notes.items() if k != "history"}, indent=1))
    return 0
