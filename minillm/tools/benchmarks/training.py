"""``python -m minillm bench training-curves``: the shipped models' loss curves, from their checkpoints' notes.

No training and no timing: ``train`` stores each step's loss (and the periodic validation estimates)
in the checkpoint it writes; this draws them as training_curves.png (``--out DIR`` or ``--update-docs``).
"""

from __future__ import annotations

import argparse

import numpy as np

from ...checkpoint import SHIPPED, model_notes
from .common import add_output_args, figure_dir, parse_args, save_figure

SMOOTH_STEPS = 25  # steps in the moving average of the training loss


def curves_figure(names=SHIPPED):
    """Train (smoothed) and validation loss against the step, one pair of lines per model."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        history = model_notes(name)["history"]
        steps = np.array([r["step"] for r in history])
        loss = np.array([r["loss"] for r in history])
        smooth = np.convolve(loss, np.ones(SMOOTH_STEPS) / SMOOTH_STEPS, mode="valid")
        offset = SMOOTH_STEPS // 2
        ax.plot(steps[offset : offset + len(smooth)], smooth, label=f"{name}: train ({SMOOTH_STEPS}-step mean)")
        val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
        ax.plot(*zip(*val), "o--", label=f"{name}: val (estimate)")
    ax.set_xlabel("step (16 x 256 characters)")
    ax.set_ylabel("loss, nats per character")
    ax.set_ylim(1.2, 3.2)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench training-curves", description=__doc__.splitlines()[0])
    add_output_args(p)
    args = parse_args(p, argv)
    print(f"figure: {save_figure(curves_figure(), 'training_curves', figure_dir(args))}")
    return 0
