"""What a decoded token costs the device, counted: the launch floor of chapter 12.

    model.forward(ids, KVCache), array code     317-443 kernel launches per token (character model)
    fused.StaticStep.run(), fused kernels       9 launches per layer + 6 around them (60)
    StaticStep.step() after capture()           1 graph launch per token

A small model's decode step on a GPU costs what its launches cost the CPU, a few microseconds each, not what
its arithmetic costs the GPU. ``minillm.fused`` cuts the launches by running the model's own block over fused
kernels, each group of elementwise and row-wise work one launch, on a static step whose shapes and addresses
never change; a CUDA graph then records the whole step once and relaunches it with a single call (gpt-fast's
``torch.compile(mode="reduce-overhead")`` and nano-vllm's ``capture_cudagraph`` do this).

The strict stand-in (``MINILLM_BACKEND=strict``) counts what each path asks of the device: ``per_token`` for
``generate`` (the array code), ``static_per_token`` for the static step, eager or replayed from its graph;
``launch_budget`` is what the fused step must fit (tests/test_decode_step.py holds it to that).
"""

from __future__ import annotations

from .backend import xp
from .fused import next_id, start_decoding
from .generate import generate

LAYER_BUDGET, OUTSIDE_BUDGET = 12, 8  # the fused step's launches per layer, and around the layers, per token
COUNTED = ("kernels", "syncs", "copies_to_device", "graph_launches")  # what the strict stand-in counts
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # the prompt the per-token counts decode after


# ---- what a decoded token costs the device, counted by the strict stand-in (MINILLM_BACKEND=strict) -------


def per_token(model, steps: int) -> dict:
    """{kernels, syncs, copies_to_device, graph_launches} per decoded token of ``generate`` (the array code, greedy):
    the counts of 1 + steps new tokens minus those of 1, over steps (the prefill cancels out)."""
    generate(model, PROMPT, 1, temperature=0)  # warm-up: what is made once (the kernel's status word)
    runs = []
    for n in (1, 1 + steps):
        xp.reset_counts()
        generate(model, PROMPT, n, temperature=0)
        runs.append(dict(xp.COUNTS))
    return {k: (runs[1].get(k, 0) - runs[0].get(k, 0)) / steps for k in COUNTED}


def static_per_token(model, steps: int, graph: bool) -> dict:
    """The same counts per decoded token of the static T = 1 step after a prefill, eager or replayed from its
    captured graph."""
    decode = start_decoding(model, PROMPT, len(PROMPT) + steps, graph)
    decode.step()  # the prompt's last token
    xp.reset_counts()
    for _ in range(steps):
        decode.step()
        next_id(decode)
    return {k: xp.COUNTS.get(k, 0) / steps for k in COUNTED}


def launch_budget(config) -> int:
    """The fused step's launch budget per decoded token: 12 per layer plus 8 around the layers."""
    return LAYER_BUDGET * config.n_layer + OUTSIDE_BUDGET
