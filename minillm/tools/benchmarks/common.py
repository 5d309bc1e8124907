"""What every benchmark shares: timing (``minillm.measure``, which the notebooks use too), where
figures go, progress, the error.

Every benchmark follows the same discipline (see llm.c's dev/cuda): validate the fast path against
its reference first (``BenchmarkError`` when it disagrees), warm up, then time (synchronizing the GPU
before reading the clock), and print an aligned table with ratios. Benchmarks print numbers; they
never assert timings (tests do not time anything).

Figures go to the folder named by ``--out DIR``, by default a folder in the system's temporary
directory (printed with each figure); ``--update-docs`` regenerates the project's ``docs/figures``.
A benchmark never writes into the package or the checkout unless asked to.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from ...backend import runtime_summary
from ..project import project_root

DEFAULT_FIG_DIR = Path(tempfile.gettempdir()) / "minillm-figures"
DOCS_FIG_DIR = Path("docs") / "figures"  # relative to the project root


class BenchmarkError(RuntimeError):
    """A benchmark's validation failed: a fast path disagrees with its reference, so nothing is timed."""


def add_json_arg(parser, help: str) -> None:
    """``--json OUT``: a file that must not exist yet (argparse's usage error otherwise; a benchmark never
    overwrites a file), written by ``write_json``."""
    def new_file(text: str) -> Path:
        if Path(text).exists():
            raise argparse.ArgumentTypeError(f"{text} exists: name a new file (a benchmark never overwrites one)")
        return Path(text)

    parser.add_argument("--json", type=new_file, default=None, metavar="OUT", help=help)


def write_json(path: Path, report) -> None:
    """Write ``report`` as JSON to the new file ``path``, all or nothing: a temporary file beside it, then a
    hard link to ``path``, which fails rather than replace a file that appeared meanwhile."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "x") as f:
            json.dump(report, f, indent=1)
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"\nwrote {path}")


def new_tokens_in_context(requested: int, prompt_len: int, context: int) -> int:
    """How many tokens a benchmark generates after a prompt: min(requested, context - prompt_len);
    ValueError when the prompt alone fills the model's context. 48-token prompt, context 256 -> <= 208."""
    if prompt_len >= context:
        raise ValueError(f"the prompts ({prompt_len} tokens) are longer than the model's context "
                         f"({context} tokens): use a shorter --prompt-len")
    return min(requested, context - prompt_len)


def progress(iterable, desc: str, total: int | None = None):
    """``iterable`` with a progress bar on stderr (one step per configuration), shown on a terminal only."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=None, leave=False)


# ---- where figures go ----------------------------------------------------------------------------


def add_output_args(parser) -> None:
    """``--out DIR`` and ``--update-docs``: the two ways a benchmark's figures can leave the temp folder."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", default=None, metavar="DIR",
                       help=f"folder for the PNG figures (default {DEFAULT_FIG_DIR})")
    where.add_argument("--update-docs", action="store_true",
                       help="write the figures into the project's docs/figures (regenerates the docs)")


def figure_dir(args) -> Path:
    """The folder ``add_output_args``' options name: --out, the project's docs/figures, or the default."""
    if args.update_docs:
        return project_root() / DOCS_FIG_DIR
    return Path(args.out) if args.out else DEFAULT_FIG_DIR


def save_figure(fig, name: str, out_dir) -> Path:
    """Save a matplotlib figure as ``out_dir/name.png`` (out_dir None: the default folder) and close it."""
    import matplotlib.pyplot as plt

    out = Path(out_dir or DEFAULT_FIG_DIR)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def parse_args(parser, argv):
    """``parser.parse_args(argv)``, then the line that says what the numbers will be measured on:
    backend, BLAS threads, cores, load average (``backend.runtime_summary``; a warning under load).
    Printed after the options are checked, so a usage error prints nothing else."""
    args = parser.parse_args(argv)
    print(runtime_summary(), flush=True)
    return args
