"""Command-line interface: demo (default), generate, train, bench, info, course.

Bad arguments print a usage error (exit 2); errors in the input (an unknown character, a missing
checkpoint) print one line naming the problem (exit 1). Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import sys


def cmd_train(args) -> int:
    from .checkpoint import shipped_path
    from .train import train

    out = args.out or shipped_path(args.preset)
    summary = train(args.preset, out, steps=args.steps, resume=args.resume, progress=not args.quiet)
    print(
        f"{args.preset}: {summary['params']:,} params, {summary['steps']} steps, "
        f"val loss {summary['val_loss']:.4f} nats/char, "
        f"wall time {summary['wall_time_s'] / 60:.1f} min -> {out}"
    )
    return 0


def cmd_generate(args) -> int:
    from .checkpoint import load_model
    from .generate import generate, generate_naive

    model, tok = load_model(args.model)
    prompt = tok.encode(args.prompt)  # ValueError naming unknown characters
    print(args.prompt, end="", flush=True)
    gen = generate_naive if args.no_cache else generate

    def show(token):
        print(tok.decode([token]), end="", flush=True)

    result = gen(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed, on_token=show)  # fmt: skip
    s = result.stats
    print(
        f"\n\n[{s.new_tokens} tokens | TTFT {s.ttft_s * 1e3:.1f} ms | {s.tpot_s * 1e3:.2f} ms/token | "
        f"{s.tokens_per_s:.0f} tokens/s | KV cache {s.kv_bytes / 1e6:.2f} MB]",
        file=sys.stderr,
    )
    return 0


def cmd_info(args) -> int:
    from . import backend
    from .checkpoint import SHIPPED, CheckpointError, load_model, model_notes, shipped_path

    print(f"minillm {__import__('minillm').__version__}")
    print(f"backend: {backend.BACKEND_REASON}")
    print(f"GPU: {'yes' if backend.is_gpu() else 'no'}")
    for name in SHIPPED:
        path = shipped_path(name)
        try:
            model, tok = load_model(name)
        except CheckpointError as exc:
            print(f"model {name}: unavailable ({exc})")
            continue
        c, notes = model.config, model_notes(name)
        val = notes.get("val_loss", "?")
        print(
            f"model {name}: {model.num_params():,} params, {c.n_layer} layers, width {c.n_embd}, "
            f"{c.n_head} heads, context {c.block_size}, vocab {tok.vocab_size}, "
            f"val loss {val} nats/char, {path.stat().st_size / 1e6:.1f} MB on disk"
        )
    return 0


def cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main(args.rest)


def cmd_bench(args) -> int:
    from .bench import run

    return run(args.topic, args.rest)


def cmd_course(args) -> int:
    from .course import ROOT, student_edition

    exercises = student_edition(ROOT, args.out_dir)
    chapters = sorted({ex.chapter for ex in exercises})
    print(f"student edition with {len(exercises)} exercises in {len(chapters)} chapters ({', '.join(chapters)}) "
          f"-> {args.out_dir}; see {args.out_dir}/MANIFEST.md")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("demo", help="the main demo (the default): plain vs speculative decoding")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the demo")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate text with a model (the shipped target by default)")
    p.add_argument("--prompt", default="ROMEO:\n", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="target", help="'target', 'draft' or a checkpoint path")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context each step")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("info", help="backend, GPU, shipped models")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("train", help="train a shipped model from scratch")
    p.add_argument("--preset", choices=["target", "draft"], required=True)
    p.add_argument("--out", help="model file to write (default: the shipped model's path)")
    p.add_argument("--steps", type=int, help="total optimizer steps (default: the preset's)")
    p.add_argument("--resume", action="store_true", help="continue from <out>.train.npz")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    from .bench import TOPICS

    p = sub.add_parser("bench", help="run a benchmark and print its table (and save plots)")
    p.add_argument("topic", choices=list(TOPICS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("course", help="course kit: write the student edition (exercises stubbed, a manifest)")
    course = p.add_subparsers(dest="action", required=True)
    p = course.add_parser("student-edition", help="copy the project with every exercise region stubbed")
    p.add_argument("out_dir", metavar="OUT_DIR", help="an empty or new folder")
    p.set_defaults(func=cmd_course)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no arguments: the main demo
        args = parser.parse_args(["demo"])
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
