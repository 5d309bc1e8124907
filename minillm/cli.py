"""Command-line interface: demo (default), generate, train, bench, info.

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


def cmd_bench(args) -> int:
    from .bench import run

    return run(args.topic, args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")

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
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
