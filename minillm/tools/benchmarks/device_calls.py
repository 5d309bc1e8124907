"""``python -m minillm bench device-calls``: kernel launches and synchronizations per decoded token.

On a GPU a small model's decode step is bound by how many kernels it launches (each costs the CPU a
few microseconds) and how often the host waits for the device (a synchronization drains the queue),
not by its FLOPs. Both are counted without a GPU by the strict CuPy stand-in (``minillm.strict``), so
this benchmark runs itself under ``MINILLM_BACKEND=strict`` (in a subprocess when started without it).

For the shipped model (or --model) and each attention: greedy generation from a short prompt, once
with 1 new token and once with 1 + steps; the difference divided by steps is the cost of one decoded
token (the prefill cancels out).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from ...backend import BACKEND_ENV, xp
from ...checkpoint import load_model
from ...generate import generate
from ...notebook import format_table
from ..options import positive_int
from .common import parse_args

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
COUNTED = ("kernels", "syncs", "copies_to_device")


def per_token(model, steps: int) -> dict:
    """{kernels, syncs, copies_to_device} per decoded token of greedy generation (the stand-in's counts)."""
    generate(model, PROMPT, 1, temperature=0)  # warm-up: what is made once (the kernel's status word)
    runs = []
    for n in (1, 1 + steps):
        xp.reset_counts()
        generate(model, PROMPT, n, temperature=0)
        runs.append(dict(xp.COUNTS))
    return {k: (runs[1].get(k, 0) - runs[0].get(k, 0)) / steps for k in COUNTED}


def seconds_per_token(model, steps: int, repeat: int = 3) -> float:
    """Wall seconds per decoded token of greedy generation on this machine's backend: (time of 1 + steps
    new tokens - time of 1) / steps, the best of ``repeat`` (generate returns the tokens on the host, so
    each timing ends when the device is done)."""
    generate(model, PROMPT, 1, temperature=0)
    per_run = []
    for _ in range(repeat):
        times = []
        for n in (1, 1 + steps):
            t0 = time.perf_counter()
            generate(model, PROMPT, n, temperature=0)
            times.append(time.perf_counter() - t0)
        per_run.append((times[1] - times[0]) / steps)
    return min(per_run)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench device-calls", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="target", help="a shipped model name or a checkpoint path")
    p.add_argument("--steps", type=positive_int, default=8, help="decoded tokens counted")
    if xp.__name__ != "minillm.strict":  # count under the stand-in: start this benchmark again under it
        p.parse_args(argv)  # a usage error stops here, once
        command = [sys.executable, "-m", "minillm", "bench", "device-calls", *argv]
        return subprocess.run(command, env={**os.environ, BACKEND_ENV: "strict"}).returncode
    args = parse_args(p, argv)
    attentions = ["naive", "flash"] + (["cuda", "cuda_v2"] if shutil.which("g++") else [])  # emulated: g++
    rows = []
    for attention in attentions:
        model, _ = load_model(args.model, attention)
        rows.append({"attention": attention, **per_token(model, args.steps)})
    c = model.config
    print(f"\nper decoded token, model {args.model} ({c.n_layer} layers, {c.n_head} heads), greedy, "
          f"prompt {len(PROMPT)} tokens, mean of {args.steps} steps (strict CuPy stand-in)")
    print(format_table(rows, ["attention", *COUNTED]))
    return 0
