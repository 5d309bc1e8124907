"""Command-line interface: demo (default), generate, train, bench, info, course.

Every mistake of the user is one line on stderr and no traceback: bad arguments give a usage error
naming the option (exit 2); errors in the input or the files (an unknown character, a missing or
corrupt checkpoint, a benchmark whose validation fails) give ``error: ...`` (exit 1). Arguments are
checked before anything is printed. Ctrl-C stops a command with one line (exit 130, what was already
printed stays); output piped into a reader that stops early (``| head``) ends the command quietly.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import os
import signal
import sys
import threading
from functools import partial
from pathlib import Path

from .options import (
    MAX_NEW_TOKENS,
    add_activations_option,
    add_weights_option,
    chapter_list,
    finite_float,
    new_tokens,
    positive_int,
    seed_int,
    set_activations,
)

DEMO_DEFAULT = "demo"  # `python -m minillm [demo options]` runs the demo
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `yes | head`


def cmd_train(args) -> int:
    from ..train import train

    out = args.out or f"{args.preset}.npz"
    summary = train(args.preset, out, steps=args.steps, resume=args.resume, progress=not args.quiet,
                    overwrite_shipped=args.overwrite_shipped, overwrite=args.overwrite)
    print(
        f"{args.preset}: {summary['params']:,} params, {summary['steps']} steps, "
        f"val loss {summary['val_loss']:.4f} nats/char, "
        f"wall time {summary['wall_time_s'] / 60:.1f} min -> {out}"
    )
    return 0


def cmd_generate(args) -> int:
    from ..backend import set_fast_products
    from ..generate import generate, generate_naive
    from ..kv_cache import KVCache
    from ..registry import load_model
    from ..sampling import SamplingSettings
    from ..tokenizer import TextStream

    SamplingSettings(args.temperature, args.top_k, args.top_p)  # refuses bad values before anything is printed
    model, tok = load_model(args.model, weights=args.weights)
    set_activations(model, args.activations)
    prompt = tok.encode(args.prompt)  # ValueError naming unknown characters
    # a cache just big enough: SmolLM2's full 8192-token context would be 377 MB of float32 K/V
    size = min(model.config.block_size, len(prompt) + args.max_new_tokens)
    if args.no_cache:
        gen = generate_naive
    elif args.speculate:
        set_fast_products(True)  # a verify over a few tokens streams each weight once (minillm.streaming)
        gen = partial(draft_free_generate, proposer=proposer(args, model), cache=KVCache(model.config, max_len=size))
    else:
        gen = partial(generate, cache=KVCache(model.config, max_len=size))
    print(args.prompt, end="", flush=True)
    text = TextStream(tok)

    def show(token):
        print(text.push(token), end="", flush=True)

    result = gen(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed, on_token=show)
    s = result.stats
    if s.dropped_prompt_tokens:
        print(f"\n\nnote: the prompt's first {s.dropped_prompt_tokens} of {len(prompt)} tokens were dropped: "
              f"they do not fit the context; the model saw its last {len(prompt) - s.dropped_prompt_tokens}",
              file=sys.stderr, end="")
    kv = f"{args.speculate}: {s.tokens_per_call:.2f} tokens per target call" if args.speculate else (
        f"KV cache {s.kv_bytes / 1e6:.2f} MB")
    print(
        f"\n\n[{s.new_tokens} tokens | TTFT {s.ttft_s * 1e3:.1f} ms | {s.tpot_s * 1e3:.2f} ms/token | "
        f"{s.tokens_per_s:.0f} tokens/s | {kv}]",
        file=sys.stderr,
    )
    return 0


def proposer(args, model):
    """The draft-free proposer ``--speculate`` names (chapter 9), for ``model``."""
    from ..draft_free import LayerSkip, PromptLookup
    from ..lookahead import Lookahead
    from ..medusa import MedusaHeads, MedusaProposer, shipped_heads_path

    if args.speculate == "eagle":
        return eagle_proposer(model, args.model, args.eagle_draft)
    if args.speculate == "lookup":
        return PromptLookup()
    if args.speculate == "layer-skip":
        return LayerSkip(model, args.draft_layers or max(1, model.config.n_layer // 2))
    if args.speculate == "lookahead":
        return Lookahead()
    path = args.medusa_heads or shipped_heads_path(args.model)
    if not args.medusa_heads and not path.is_file():
        raise ValueError(f"no Medusa heads ship for model {args.model!r}; train them with "
                         f"python -m minillm medusa-train --model {args.model} --out HEADS.npz, "
                         "then pass --medusa-heads HEADS.npz")
    return MedusaProposer(MedusaHeads.load(model, path))


def eagle_proposer(model, model_name, path=None):
    """A chain proposer on the EAGLE draft at ``path`` (default: the one shipped for ``model_name``)."""
    from ..eagle import EagleDraft, EagleProposer, shipped_draft_path

    path = path or shipped_draft_path(model_name)
    if not Path(path).is_file():
        raise ValueError(f"no EAGLE draft ships for model {model_name!r}; train one with python -m minillm "
                         f"eagle-data and eagle-train, then pass --eagle-draft DRAFT.npz")
    return EagleProposer(EagleDraft.load(model, path))


def draft_free_generate(model, prompt, max_new_tokens, proposer, cache, on_token=None, **sampling):
    """``tree_generate`` with ``generate``'s call shape (the tokens are shown once the run is done)."""
    from ..token_tree import tree_generate

    result = tree_generate(model, prompt, max_new_tokens, proposer, cache=cache, **sampling)
    for token in result.tokens:
        on_token(token)
    return result


def cmd_info(args) -> int:
    from .. import backend
    from ..checkpoint import SHIPPED, CheckpointError, load_model, model_notes, shipped_path
    from ..registry import SMOLLM2, gguf_path

    print(f"minillm {__import__('minillm').__version__}")
    print(f"backend: {backend.BACKEND_REASON}")
    if backend.CUPY_PROBLEM:
        print(f"WARNING: running on NumPy because {backend.CUPY_PROBLEM}; for the GPU: {backend.GPU_INSTALL_HINT}")
    stand_in = backend.is_gpu() and not backend.is_cupy()
    stand_in = " (the strict stand-in plays a device: NumPy computes)" if stand_in else ""
    print(f"GPU: {'yes' if backend.is_cupy() else 'no'}{stand_in}")
    print(f"runtime: {backend.runtime_summary()}")
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
    try:
        path = gguf_path(SMOLLM2)  # checked byte for byte: a damaged file is not "available"
        print(f"model {SMOLLM2}: SmolLM2-135M-Instruct (Llama, 4-bit GGUF), {path.stat().st_size / 1e6:.1f} MB "
              f"at {path}")
    except CheckpointError as exc:
        print(f"model {SMOLLM2}: unavailable ({exc})")
    return 0


def cmd_demo(args) -> int:
    from .demo import run

    return run(args)


def cmd_chat(args) -> int:
    from .chat_cli import run

    return run(args)


def cmd_serve_demo(args) -> int:
    from .benchmarks.serving import run_demo

    return run_demo(args)


def cmd_medusa_train(args) -> int:
    from .medusa_cli import run

    return run(args)


def cmd_eagle_data(args) -> int:
    from .eagle_cli import run_data

    return run_data(args)


def cmd_eagle_taps(args) -> int:
    from .eagle_cli import run_taps

    return run_taps(args)


def cmd_eagle_train(args) -> int:
    from .eagle_cli import run_train

    return run_train(args)


def cmd_bench(args) -> int:
    from .benchmarks import run

    return run(args.topic, args.rest)


def cmd_student_edition(args) -> int:
    from .course import student_edition
    from .project import project_root

    exercises = student_edition(project_root(args.root), args.out_dir, chapters=args.chapters,
                                exercises=args.exercises)
    chapters = sorted({ex.chapter for ex in exercises})
    print(f"student edition with {len(exercises)} exercises in {len(chapters)} chapters ({', '.join(chapters)}) "
          f"-> {args.out_dir}; see {args.out_dir}/MANIFEST.md")
    return 0


def cmd_grade(args) -> int:
    from .course import format_grades, grade

    results = grade(args.project_dir, root=args.root, chapters=args.chapters, exercises=args.exercises,
                    manifest_path=args.manifest)
    print(format_grades(results))
    return 0 if all(r.ok for r in results) else 1


def cmd_lab(args) -> int:
    from .course import lab, lab_root

    return lab(lab_root(), args.jupyter_args)


def build_parser() -> argparse.ArgumentParser:
    from .benchmarks import TOPICS
    from .benchmarks.serving import add_demo_arguments as add_serve_demo_arguments
    from .chat_cli import add_arguments as add_chat_arguments
    from .demo import add_arguments as add_demo_arguments
    from .eagle_cli import add_data_arguments as add_eagle_data_arguments
    from .eagle_cli import add_taps_arguments as add_eagle_taps_arguments
    from .eagle_cli import add_train_arguments as add_eagle_train_arguments
    from .medusa_cli import add_arguments as add_medusa_arguments
    from .parts import add_arguments as add_parts_arguments
    from .parts import main as parts_main
    from .server import add_arguments as add_serve_arguments
    from .server import serve
    from .site import add_arguments as add_site_arguments
    from .site import main as site_main

    parser = argparse.ArgumentParser(prog="python -m minillm", description=__doc__.splitlines()[0],
                                     epilog="With no command (or only demo options) it runs the demo.")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser(DEMO_DEFAULT, help="the main demo (the default): plain vs speculative decoding")
    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="generate text with a model (the shipped target by default)")
    p.add_argument("--prompt", default="ROMEO:\n", help="the text to continue")
    p.add_argument("--max-new-tokens", type=new_tokens, default=200,
                   help=f"tokens to write, at most {MAX_NEW_TOKENS:,} (default 200)")
    p.add_argument("--temperature", type=finite_float, default=0.8, help="0 means greedy")
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--top-p", type=finite_float, default=None)
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed, 0 to 2**63 - 1 (default 0)")
    p.add_argument("--model", default="target",
                   help="'target', 'draft', 'smollm2-135m', a checkpoint file (.npz) or a Llama .gguf")
    add_weights_option(p)
    add_activations_option(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-cache", action="store_true", help="recompute the whole context each step")
    mode.add_argument("--speculate", choices=["eagle", "lookup", "layer-skip", "medusa", "lookahead"],
                      help="speculate (eagle: the EAGLE draft shipped for smollm2-135m; the others without a "
                      "draft, chapter 9); the output is the model's own")
    p.add_argument("--draft-layers", type=positive_int, default=None,
                   help="--speculate layer-skip: the blocks the draft runs (default: half)")
    p.add_argument("--medusa-heads", metavar="HEADS.npz", default=None,
                   help="--speculate medusa: heads written by medusa-train (default: the heads shipped for --model)")
    p.add_argument("--eagle-draft", metavar="DRAFT.npz", default=None,
                   help="--speculate eagle: a draft written by eagle-train (default: the one shipped for --model)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with the real model (SmolLM2-135M-Instruct), streamed, KV cache kept")
    add_chat_arguments(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("serve-demo", help="a continuous-batching engine replaying a request trace, live")
    add_serve_demo_arguments(p)
    p.set_defaults(func=cmd_serve_demo)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the continuous-batching engine")
    add_serve_arguments(p)
    p.set_defaults(func=serve)

    p = sub.add_parser("site", help="the course as a static site (notebooks and docs), checked in headless Chromium")
    add_site_arguments(p)
    p.set_defaults(func=site_main)

    p = sub.add_parser("parts", help="split a large file into checked parts, or join them (docs/gpu.md)")
    add_parts_arguments(p)
    p.set_defaults(func=parts_main)

    p = sub.add_parser("info", help="backend, GPU, shipped models")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("train", help="train a model from scratch with a shipped model's recipe")
    p.add_argument("--preset", choices=["target", "draft"], required=True)
    p.add_argument("--out", help="model file to write (default: <preset>.npz in the working directory)")
    p.add_argument("--steps", type=positive_int, help="total optimizer steps (default: the preset's)")
    p.add_argument("--resume", action="store_true",
                   help="continue from <out>.train.npz (or write the model of a run that finished training)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace <out> and its <out>.train.npz, <out>.log.json if they exist")
    p.add_argument("--overwrite-shipped", action="store_true",
                   help="allow --out to be a model shipped in the package (replaces it)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("medusa-train", help="train Medusa heads on a frozen model (the char target or SmolLM2)")
    add_medusa_arguments(p)
    p.set_defaults(func=cmd_medusa_train)

    p = sub.add_parser("eagle-data", help="the EAGLE draft's training text: SmolLM2's answers and hidden states")
    add_eagle_data_arguments(p)
    p.set_defaults(func=cmd_eagle_data)

    p = sub.add_parser("eagle-taps", help="EAGLE-3's lower features: two blocks' inputs on eagle-data's text")
    add_eagle_taps_arguments(p)
    p.set_defaults(func=cmd_eagle_taps)

    p = sub.add_parser("eagle-train", help="train an EAGLE draft (one layer, reduced vocabulary) on eagle-data's text")
    add_eagle_train_arguments(p)
    p.set_defaults(func=cmd_eagle_train)

    p = sub.add_parser("bench", help="run a benchmark and print its table (and save plots)")
    p.add_argument("topic", choices=list(TOPICS))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark")
    p.set_defaults(func=cmd_bench)

    from .course import exercise_list

    p = sub.add_parser("course", help="course kit: the student edition (exercises stubbed), grading, notebooks")
    course = p.add_subparsers(dest="action", required=True)
    p = course.add_parser("student-edition", help="copy the project with the exercise regions stubbed")
    p.add_argument("out_dir", metavar="OUT_DIR", help="an empty or new folder outside the project")
    p.add_argument("--chapters", type=chapter_list, default=None, help="stub these chapters, e.g. 3,5")
    p.add_argument("--exercises", type=exercise_list, default=None, help="stub these exercises, e.g. 3.1,5.2")
    p.add_argument("--root", default=None, help="the project to copy (default: this checkout)")
    p.set_defaults(func=cmd_student_edition)
    p = course.add_parser("grade", help="grade a submission with the reference's tests; print a score table")
    p.add_argument("project_dir", metavar="DIR", nargs="?", default=".", help="the submission (default .)")
    p.add_argument("--manifest", default=None, help="grade the exercises of this MANIFEST.json (the one you "
                   "handed out; the submission's own is never read)")
    p.add_argument("--chapters", type=chapter_list, default=None, help="grade these chapters, e.g. 3,5")
    p.add_argument("--exercises", type=exercise_list, default=None, help="grade these exercises, e.g. 3.1,5.2")
    p.add_argument("--root", default=None, help="the reference project whose tests grade (default: this checkout)")
    p.set_defaults(func=cmd_grade)
    p = course.add_parser("lab", help="open the notebooks with this folder's minillm (run it in your edition)")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER,
                   help="jupyter's command and options (default: lab notebooks)")
    p.set_defaults(func=cmd_lab)
    return parser


@contextlib.contextmanager
def interrupts_kept():
    """Ctrl-C that lands while a finalizer runs (a ``__del__``, e.g. llvmlite's when the garbage collector frees
    numba's LLVM objects in the middle of a generation) is printed as "Exception ignored" and lost, and the
    command went on. Within this block such a KeyboardInterrupt is raised again in the main thread, outside the
    finalizer, and nothing is printed for it."""
    previous = sys.unraisablehook

    def again():  # SIGINT to the main thread itself: it also wakes a call blocked in the kernel
        if hasattr(signal, "pthread_kill"):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        else:
            _thread.interrupt_main()

    def hook(unraisable):
        if issubclass(unraisable.exc_type, KeyboardInterrupt):  # a moment later: sent now, it would land in this
            timer = threading.Timer(0.01, again)  # hook and be lost too
            timer.daemon = True
            timer.start()
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = [DEMO_DEFAULT, *argv]  # no command: the demo, with whatever demo options were given
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with interrupts_kept():
            code = args.func(args)
        sys.stdout.flush()  # a reader that has gone shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:  # the reader of our output (`| head`) has gone: stop quietly, as Unix tools do
        with contextlib.suppress(OSError, ValueError):  # (a captured stdout has no file descriptor)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush fails no more
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
