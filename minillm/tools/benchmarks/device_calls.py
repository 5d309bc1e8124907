"""``python -m minillm bench device-calls``: kernel launches and synchronizations per decoded token.

On a GPU a small model's decode step is bound by how many kernels it launches (each costs the CPU a
few microseconds) and how often the host waits for the device (a synchronization drains the queue),
not by its FLOPs. Both are counted without a GPU by the strict CuPy stand-in (``minillm.strict``), so
this benchmark runs itself under ``MINILLM_BACKEND=strict`` (in a subprocess when started without it).

For the shipped model (or --model, e.g. smollm2-135m), per decoded token of greedy generation:

- the array code, ``model.forward`` with a KVCache, for each attention: greedy generation from a short
  prompt, once with 1 new token and once with 1 + steps; the difference divided by steps is the cost of
  one decoded token (the prefill cancels out);
- the static decode step, ``fused.StaticStep`` with the fused kernels, eager (counted by
  ``minillm.decode_step``): its launches against the budget of 12 per layer plus 8 around the layers;
- the same step captured as a CUDA graph: one graph launch per token.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

from ...backend import BACKEND_ENV, xp
from ...decode_step import COUNTED, LAYER_BUDGET, OUTSIDE_BUDGET, PROMPT, launch_budget, per_token, static_per_token
from ...notebook import format_table
from ...registry import load_model
from ..options import add_weights_option, positive_int
from .common import parse_args


def seconds_per_token(decode, steps: int, repeat: int = 3) -> float:
    """Wall seconds per decoded token of ``decode(n)`` (a greedy generation of n new tokens that returns them on
    the host, so each timing ends when the device is done) on this machine's backend: (time of 1 + steps new
    tokens - time of 1) / steps, the best of ``repeat``; what each call sets up once (a prefill, a graph
    capture) cancels out."""
    decode(1)
    per_run = []
    for _ in range(repeat):
        times = []
        for n in (1, 1 + steps):
            t0 = time.perf_counter()
            decode(n)
            times.append(time.perf_counter() - t0)
        per_run.append((times[1] - times[0]) / steps)
    return min(per_run)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench device-calls", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="target", help="a model name (target, smollm2-135m, ...) or a checkpoint path")
    p.add_argument("--steps", type=positive_int, default=8, help="decoded tokens counted")
    add_weights_option(p)
    if xp.__name__ != "minillm.strict":  # count under the stand-in: start this benchmark again under it
        p.parse_args(argv)  # a usage error stops here, once
        command = [sys.executable, "-m", "minillm", "bench", "device-calls", *argv]
        return subprocess.run(command, env={**os.environ, BACKEND_ENV: "strict"}).returncode
    args = parse_args(p, argv)
    emulated = shutil.which("g++") is not None  # the kernels run through the g++ emulation
    rows = []
    for attention in ["naive", "flash"] + (["cuda", "cuda_v2"] if emulated else []):
        model, _ = load_model(args.model, attention, args.weights)
        rows.append({"path": f"array code, attention {attention}", **per_token(model, args.steps)})
    if emulated:
        for graph in (False, True):
            path = "static step, fused kernels" + (", CUDA graph" if graph else "")
            rows.append({"path": path, **static_per_token(model, args.steps, graph)})
    c = model.config
    for row in rows:
        row["budget"] = launch_budget(c)
    print(f"\nper decoded token, model {args.model} ({c.n_layer} layers, {c.n_head} heads), greedy, "
          f"prompt {len(PROMPT)} tokens, mean of {args.steps} steps (strict CuPy stand-in); budget: "
          f"{LAYER_BUDGET} launches per layer + {OUTSIDE_BUDGET}")
    print(format_table(rows, ["path", *COUNTED, "budget"]))
    return 0
