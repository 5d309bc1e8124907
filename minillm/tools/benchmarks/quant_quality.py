"""``python -m minillm bench quant-quality``: what weight formats and an int8 KV cache cost in quality.

    python -m minillm.tools.benchmarks.quant_quality [--model target|smollm2-135m|all] [--tokens 256]
                                                     [--json OUT] [--quick] [--out DIR | --update-docs]

Fake quantization throughout: every weight matrix is quantized to a format and dequantized back with
the format's NumPy reference (``minillm.quantize``), and the float32 model runs with the rounded
weights. That measures what the rounding alone costs; whether a fast kernel computes the same
products is checked against the same references elsewhere (``bench quantized``, the kernel tests).

Quantized: the weight matrix of every linear layer (GPT-2: attn.c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj; Llama: q, k, v, o, gate, up, down), each row (output) of each matrix split into groups
along its inputs. Kept float32: the token and position embeddings (both models tie the LM head to the
token embedding, so the LM head stays float32 too), the norms and the biases.

The models and their reference (KL 0, greedy agreement 1):

- ``target``: the shipped character model (trained in float32, shipped as float16), run in float32.
  Held-out text: windows of its full context (256 characters) spread over the validation split, the
  last 10% of the corpus that training held out.
- ``smollm2-135m``: SmolLM2-135M-Instruct from its Q4_1 GGUF file; the reference is the file's weights
  dequantized to float32 (what minillm runs). Its weights are already Q4_1, so every row measures the
  loss on top of that (Q4_1 itself puts the weights back on the grid they came from). Held-out text:
  the start of the shipped corpus's validation split (Shakespeare) and the source of the running
  Python's ``textwrap.py``.

Per format: held-out loss (mean next-token cross-entropy, nats/token, per text), mean KL(float32 ||
format) per token (nats), top-1 (share of held-out positions whose argmax is float32's), greedy
agreement over ``--tokens`` tokens from a held-out prompt (prefix = tokens before the first divergence
/ tokens; same = positions whose tokens are identical, each run continuing its own text), bits per
quantized weight (scales included) and the bytes of all weights. Formats: BF16, GGUF's Q8_0 and Q4_1,
int8 per channel, int4 per group of 32, 64, 128 (symmetric, or with a minimum "+min"), int4 per tensor
(``Int4PerGroup`` over the whole matrix as one group: one scale), and 3-bit per group of 32 with a
minimum (``Int4PerGroup(bits=3)``: s = (max - min) / 7, n = rint((w - min) / s) in 0..7; its bits per
weight count 3 + two float32 per group). A group size that does not divide a
model's rows is reported as n/a (SmolLM2's 576 inputs and 128).

Then the int8 KV cache (``minillm.kv_quant``) against the float32 ``KVCache`` at long context: the
character model at its full 256, SmolLM2 at 1024 tokens (256 with --quick): bytes per token and the
same quality figures, every attention reading the dequantized keys and values (the prefill's too).

Then the chapter-5 warning measured: the ``draft`` model fake-quantized (int8 per channel, int4 per
group with a minimum, int4 per tensor) drafting for the float32 target, greedy and at T = 1, the same
held-out prompts and seeds for every draft: acceptance rate, tokens per target call, and the speed-up
over the target's own cached decoding (medians of alternating runs). A fake-quantized draft runs at
float32 speed, so only its acceptance changes; on a busy machine the acceptance is the robust number.

Then, for SmolLM2 on a CPU with an int8 kernel (AVX512-VNNI or AVX2), the model in its blocks through the real
kernels (no fake quantization): each product's input exact, or rounded to int8 per block of 32 as llama.cpp
does (``Llama.set_activations("int8")``): the same quality figures against the float32 reference.

``--json OUT`` writes every number to a new file. ``--quick``: fewer windows, tokens and prompts.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...backend import is_gpu, runtime_summary, to_numpy, xp
from ...data import corpus_tokenizer, train_val_split, validation_prompts
from ...generate import generate
from ...gguf import GGUFError
from ...kv_cache import KVCache
from ...kv_quant import Int8KVCache
from ...llama import ACTIVATIONS
from ...measure import time_paired
from ...model import GPT
from ...notebook import format_table
from ...quantize import BF16, F32, Q4_1, Q8_0, Int4PerGroup, Int8PerChannel
from ...registry import SMOLLM2, load_model
from ..options import int_in
from .common import (
    BenchmarkError,
    add_json_arg,
    add_output_args,
    figure_dir,
    new_tokens_in_context,
    save_figure,
    write_json,
)
from .common import parse_args as common_parse_args
from .speculative import run_speculative

MODELS = ("target", SMOLLM2)
EMBEDDINGS = ("wte.weight", "wpe.weight", "embed_tokens.weight")  # kept float32 (and the tied LM head)
PROMPT_TOKENS = 32  # the greedy runs' prompt (at most half a context)
CHUNK_ROWS = 64  # positions per float64 log-softmax (SmolLM2: 64 x 49152 x 8 bytes = 25 MB)
K_DRAFT = 4  # draft tokens per round (chapter 5's default)
DRAFT_FORMATS = ("float32", "int8/channel", "int4 g32 +min", "int4/tensor")


# ---- the formats, as fake quantizers: w (out, in) float32 -> (w rounded, bits per weight) ---------


@dataclass(frozen=True)
class Format:
    name: str
    fake: Callable  # w (out, in) float32 -> (the dequantized w (out, in), bits per stored weight)
    group: int = 1  # a row's inputs must be a multiple of this


def stored(cls, **options):
    """The fake quantizer of a ``minillm.quantize`` format: quantize, dequantize, its bits per weight."""
    def fake(w):
        q = cls.quantize(w, **options)
        return q.dequantize(), float(q.bits_per_weight)

    return fake


def int4_per_tensor(w):
    """int4 with one scale for the whole matrix: ``Int4PerGroup`` (symmetric) over the matrix as one group."""
    m, k = w.shape
    q = Int4PerGroup.quantize(w.reshape(1, m * k), group=m * k, minimum=False)  # (1, m k): one group
    return q.dequantize().reshape(m, k), float(q.bits_per_weight)


FORMATS = [
    Format("float32", stored(F32)),
    Format("BF16", stored(BF16)),
    Format("Q8_0", stored(Q8_0), 32),
    Format("int8/channel", stored(Int8PerChannel)),
    Format("Q4_1", stored(Q4_1), 32),
    *(Format(f"int4 g{g}{' +min' if with_min else ''}", stored(Int4PerGroup, group=g, minimum=with_min), g)
      for g in (32, 64, 128) for with_min in (True, False)),
    Format("int4/tensor", int4_per_tensor),
    Format("3-bit g32 +min", stored(Int4PerGroup, group=32, bits=3), 32),
]
BY_NAME = {f.name: f for f in FORMATS}


# ---- a model with rounded weights ----------------------------------------------------------------


def reference_params(model) -> dict:
    """The model's parameters as NumPy float32 arrays."""
    return {name: to_numpy(p) for name, p in model.params.items()}


def quantized_names(params: dict) -> list[str]:
    """The weight matrices a format rounds: every 2-D parameter but the embeddings."""
    return [name for name, p in params.items() if p.ndim == 2 and name not in EMBEDDINGS]


def as_out_in(model, w):
    """A weight as (out, in): GPT-2 stores [in, out] (DESIGN.md), Llama [out, in]. Its own inverse."""
    return w.T if isinstance(model, GPT) else w


def misfit(model, params: dict, fmt: Format) -> str | None:
    """Why ``fmt`` cannot split this model's rows into its groups, or None."""
    ins = sorted({as_out_in(model, params[name]).shape[1] for name in quantized_names(params)})
    bad = [k for k in ins if k % fmt.group]
    return f"{bad[0]} inputs per row: not a multiple of {fmt.group}" if bad else None


def quantized_copy(model, params: dict, fmt: Format):
    """-> (a model of the same class whose weight matrices went through ``fmt`` and back, bytes of all
    weights stored in ``fmt``, bits per quantized weight). Embeddings, norms, biases: float32."""
    names = quantized_names(params)
    rounded, quant_bytes, quant_count = dict(params), 0.0, 0
    for name in names:
        w = np.ascontiguousarray(as_out_in(model, params[name]))  # (out, in)
        w_hat, bits = fmt.fake(w)
        rounded[name] = as_out_in(model, w_hat.astype(np.float32))
        quant_bytes += bits * w.size / 8
        quant_count += w.size
    kept = sum(p.nbytes for name, p in params.items() if name not in names)
    copy = type(model)(model.config, rounded, attention=model.attention_name)
    return copy, int(quant_bytes + kept), 8 * quant_bytes / quant_count


# ---- the measurements ----------------------------------------------------------------------------


def log_softmax(logits) -> np.ndarray:
    """(..., V) -> log p (..., V) in float64."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def window_logits(model, windows, make_cache=None) -> list:
    """The logits (T, V) of each held-out window's first T tokens (window (T + 1,)), one forward each,
    through a fresh ``make_cache(config)`` when one is given."""
    out = []
    for w in windows:
        cache = None if make_cache is None else make_cache(model.config)
        out.append(to_numpy(model.forward(xp.asarray(w[None, :-1]), cache))[0])  # (T, V)
    return out


def compare(ref_logits: list, logits: list, heldout: list) -> dict:
    """Loss per text (nats/token), mean KL(ref || logits) per token and the share of equal argmaxes.

    heldout: [(text name, window (T + 1,)), ...], the windows whose logits these are."""
    loss, count, kl, same = {}, {}, 0.0, 0
    for ref, got, (text, w) in zip(ref_logits, logits, heldout):
        for a in range(0, len(got), CHUNK_ROWS):
            lp, lq = log_softmax(ref[a:a + CHUNK_ROWS]), log_softmax(got[a:a + CHUNK_ROWS])  # (rows, V)
            targets = w[1:][a:a + CHUNK_ROWS]
            loss[text] = loss.get(text, 0.0) - float(lq[np.arange(len(targets)), targets].sum())
            count[text] = count.get(text, 0) + len(targets)
            kl += float((np.exp(lp) * (lp - lq)).sum())
            same += int((lp.argmax(-1) == lq.argmax(-1)).sum())
    n = sum(count.values())
    return {**{f"loss {text}": loss[text] / count[text] for text in loss}, "KL": kl / n, "top-1": same / n}


def agreement(ref_tokens: list, tokens: list) -> dict:
    """Greedy agreement: tokens before the first divergence / tokens, and positions identical.
    [1, 2, 3, 4], [1, 2, 5, 4] -> prefix 0.5, same 3."""
    first = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), len(ref_tokens))
    return {"prefix": first / len(ref_tokens), "same": sum(a == b for a, b in zip(ref_tokens, tokens))}


def greedy(model, prompt, n_tokens: int, make_cache=None) -> list:
    cache = None if make_cache is None else make_cache(model.config)
    return generate(model, prompt, n_tokens, temperature=0, cache=cache).tokens


def weight_quality(model, heldout: list, prompt: list, n_tokens: int, formats=FORMATS) -> list[dict]:
    """One row per format: bits per weight, weight MB, held-out loss, KL, top-1, greedy agreement."""
    params = reference_params(model)
    windows = [w for _, w in heldout]
    ref_logits, ref_tokens = window_logits(model, windows), greedy(model, prompt, n_tokens)
    rows = []
    for fmt in formats:
        reason = misfit(model, params, fmt)
        if reason:
            rows.append({"format": fmt.name, "n/a": reason})
            continue
        copy, nbytes, bits = quantized_copy(model, params, fmt)
        scores = compare(ref_logits, window_logits(copy, windows), heldout)
        rows.append({"format": fmt.name, "bits/w": bits, "weight MB": nbytes / 1e6, **scores,
                     **agreement(ref_tokens, greedy(copy, prompt, n_tokens))})
        del copy
    return rows


def kv_quality(model, heldout: list, prompt: list, n_tokens: int) -> list[dict]:
    """The int8 KV cache against the float32 KVCache: bytes per token, loss, KL, top-1, greedy agreement."""
    windows = [w for _, w in heldout]
    caches = {"float32 KVCache": KVCache, "int8 KVCache": Int8KVCache}
    ref_logits, ref_tokens = window_logits(model, windows, KVCache), greedy(model, prompt, n_tokens, KVCache)
    float_bytes = KVCache(model.config, max_len=1).nbytes
    rows = []
    for name, make in caches.items():
        per_token = make(model.config, max_len=1).nbytes
        rows.append({"cache": name, "bytes/token": per_token, "x float32": per_token / float_bytes,
                     "context": max(len(w) - 1 for w in windows),
                     **compare(ref_logits, window_logits(model, windows, make), heldout),
                     **agreement(ref_tokens, greedy(model, prompt, n_tokens, make))})
    return rows


def activation_quality(ref_model, heldout: list, prompt: list, n_tokens: int) -> list[dict]:
    """SmolLM2 in its blocks (the real kernels, not fake quantization), its products' inputs exact ("float32")
    or rounded to int8 per block of 32 ("int8", llama.cpp's route): loss, KL, top-1, greedy agreement against
    the float32 reference ``ref_model``."""
    windows = [w for _, w in heldout]
    ref_logits, ref_tokens = window_logits(ref_model, windows), greedy(ref_model, prompt, n_tokens)
    model, _ = load_model(SMOLLM2, weights="q")
    rows = []
    for name in ACTIVATIONS:
        model.set_activations(name)
        rows.append({"activations": name, **compare(ref_logits, window_logits(model, windows), heldout),
                     **agreement(ref_tokens, greedy(model, prompt, n_tokens))})
    return rows


def draft_quality(target, draft, prompts: list, n_new: int, repeat: int, temperatures=(0.0, 1.0),
                  formats=DRAFT_FORMATS) -> list[dict]:
    """The draft fake-quantized in each format, drafting for the float32 target: alpha, tokens per
    target call and speed-up over the target's cached decoding (greedy output validated first)."""
    params = reference_params(draft)
    drafts = {name: quantized_copy(draft, params, BY_NAME[name])[0] for name in formats}
    reference = [generate(target, p, n_new, temperature=0).tokens for p in prompts]
    for name, d in drafts.items():
        if run_speculative(target, d, prompts, n_new, K_DRAFT, 0.0)[0] != reference:
            raise BenchmarkError(f"greedy speculative decoding with the {name} draft differs from generate()")
    rows = []
    for temp in temperatures:
        def baseline(t=temp):
            return [generate(target, p, n_new, temperature=t, seed=i) for i, p in enumerate(prompts)]

        for name, d in drafts.items():
            def run(d=d, t=temp):
                return run_speculative(target, d, prompts, n_new, K_DRAFT, t)

            base_s, spec_s, (_, tot) = time_paired(baseline, run, repeat)  # alternating runs, medians
            rows.append({"draft": name, "T": temp, "alpha": tot["accepted"] / max(1, tot["checked"]),
                         "tok/call": tot["new"] / tot["calls"], "speed-up": base_s / spec_s})
    return rows


# ---- the two models' held-out text ----------------------------------------------------------------


@dataclass
class Plan:
    """What one model is measured on."""

    heldout: list  # [(text, window (T + 1,) int64)] for the weight formats
    prompt: list  # the greedy prompt of the weight formats
    long: list  # [(text, window)] at long context, for the KV cache
    long_prompt: list  # its greedy prompt: the long window's start, so the run ends near the context


def long_prompt(window, n_tokens: int) -> list:
    """The first max(context - n_tokens, context // 2) tokens of a long window."""
    context = len(window) - 1
    return [int(t) for t in window[: max(context - n_tokens, context // 2)]]


def target_plan(model, tok, n_windows: int, n_tokens: int) -> Plan:
    """Windows of the full context spread evenly over the validation split; a validation prompt."""
    context = model.config.block_size
    _, val = train_val_split(tok)
    starts = np.linspace(0, len(val) - context - 1, n_windows).astype(int)
    windows = [("val", np.asarray(val[s : s + context + 1], dtype=np.int64)) for s in starts]
    prompt = validation_prompts(tok, 1, min(PROMPT_TOKENS, context // 2))[0]
    return Plan(windows, prompt, windows, long_prompt(windows[0][1], n_tokens))


def smollm2_plan(tok, eval_tokens: int, kv_context: int, n_tokens: int) -> Plan:
    """The start of the corpus's validation split and Python's textwrap.py, as SmolLM2's tokens."""
    chars = corpus_tokenizer()
    shakespeare = np.asarray(tok.encode(chars.decode(train_val_split(chars)[1][: 8 * kv_context])), dtype=np.int64)
    python = np.asarray(tok.encode(Path(textwrap.__file__).read_text(encoding="utf-8")), dtype=np.int64)
    if min(len(shakespeare), len(python)) <= max(eval_tokens, kv_context):
        raise BenchmarkError("the held-out texts are shorter than the windows asked for")
    heldout = [("shakespeare", shakespeare[: eval_tokens + 1]), ("textwrap.py", python[: eval_tokens + 1])]
    long = [("shakespeare", shakespeare[: kv_context + 1])]
    return Plan(heldout, [int(t) for t in shakespeare[:PROMPT_TOKENS]], long, long_prompt(long[0][1], n_tokens))


# ---- the command ---------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="minillm bench quant-quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=(*MODELS, "all"), default="all", help="which model(s) to measure")
    p.add_argument("--tokens", type=int_in(1, 2048), default=256, help="greedy tokens per agreement run")
    p.add_argument("--quick", action="store_true", help="fewer windows, tokens (at most 32) and prompts")
    add_json_arg(p, "also write every number to this new file")
    add_output_args(p)
    args = common_parse_args(p, argv)
    if args.quick:
        args.tokens = min(args.tokens, 32)
    return args


def print_tables(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    done = [r for r in rows if "n/a" not in r]
    print(format_table(done))
    for r in rows:
        if "n/a" in r:
            print(f"  {r['format']}: n/a ({r['n/a']})")


def measure_model(name: str, model, tok, args) -> dict:
    if name == "target":
        plan = target_plan(model, tok, 2 if args.quick else 8, args.tokens)
    else:
        plan = smollm2_plan(tok, 64 if args.quick else 256, 256 if args.quick else 1024, args.tokens)
    texts = ", ".join(f"{t}: {sum(u == t for u, _ in plan.heldout)} x {len(w) - 1} tokens"
                      for t, w in dict(plan.heldout).items())
    print(f"\n== {name}: {sum(p.size for p in model.params.values()):,} parameters; held-out: {texts}; "
          f"greedy: {args.tokens} tokens after a {len(plan.prompt)}-token prompt")
    weights = weight_quality(model, plan.heldout, plan.prompt, args.tokens)
    print_tables("weights, FAKE-QUANTIZED (quantize -> dequantize -> the float32 model); quantized: every "
                 "linear layer's matrix; float32: embeddings (= the tied LM head), norms, biases", weights)
    kv = kv_quality(model, plan.long, plan.long_prompt, args.tokens)
    print_tables(f"KV cache at {len(plan.long[0][1]) - 1} tokens of context (greedy: {args.tokens} tokens "
                 f"after a {len(plan.long_prompt)}-token prompt)", kv)
    report = {"weights": weights, "kv_cache": kv}
    from ...qkernels import int8_isa  # numba, imported when SmolLM2's kernels are measured

    if name == SMOLLM2 and not is_gpu() and int8_isa() is not None:
        report["activations"] = activation_quality(model, plan.heldout, plan.prompt, args.tokens)
        print_tables("SmolLM2 in its Q8_0 / Q4_1 blocks through the CPU kernels: each product's input exact "
                     "(float32) or rounded to int8 per block of 32 (llama.cpp's route)", report["activations"])
    return report


def plot(report: dict, out_dir) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["models"]
    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        rows = [r for r in result["weights"] if r.get("KL", 0) > 0]  # float32 (KL 0) has no place on a log axis
        ax.scatter([r["bits/w"] for r in rows], [r["KL"] for r in rows])
        for r in rows:
            ax.annotate(r["format"], (r["bits/w"], r["KL"]), fontsize=7, xytext=(3, 2), textcoords="offset points")
        ax.set(xscale="log", yscale="log", xlabel="bits per quantized weight (scales included)",
               ylabel="mean KL(float32 || format), nats/token", title=f"{name}: fake-quantized weights")
        ax.set_xticks([3, 4, 5, 6, 8, 12, 16], labels=["3", "4", "5", "6", "8", "12", "16"])
        zero = [r["format"] for r in result["weights"] if r.get("KL") == 0]
        ax.text(0.98, 0.98, "KL = 0 (off the log axis): " + ", ".join(zero), transform=ax.transAxes,
                ha="right", va="top", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, "quant_quality", out_dir)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = {"machine": runtime_summary(), "tokens": args.tokens, "quick": args.quick, "models": {}}
    for name in MODELS if args.model == "all" else (args.model,):
        try:
            model, tok = load_model(name, weights="fp32")  # SmolLM2: the file's blocks dequantized, the reference
        except GGUFError as exc:
            if args.model != "all":
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(f"\n== {name}: skipped ({exc})")
            continue
        report["models"][name] = measure_model(name, model, tok, args)
        if name == "target":
            draft, _ = load_model("draft")
            prompts = validation_prompts(tok, 2 if args.quick else 4, min(PROMPT_TOKENS, model.config.block_size // 2))
            n_new = new_tokens_in_context(args.tokens, max(map(len, prompts)), model.config.block_size)
            rows = draft_quality(model, draft, prompts, n_new, 1 if args.quick else 2)
            print_tables(f"chapter 5's draft, FAKE-QUANTIZED, drafting K={K_DRAFT} for the float32 target "
                         f"({len(prompts)} prompts x {n_new} tokens; speed-up: medians of alternating runs over "
                         "the target's cached decoding, on this machine's load; a fake-quantized draft runs at "
                         "float32 speed, so only its acceptance changes)", rows)
            report["models"][name]["draft"] = rows
        del model
    if report["models"]:
        print(f"\nfigure: {plot(report, figure_dir(args))}")
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
