"""Benchmark: static batching vs continuous batching vs continuous + chunked prefill, on one trace.

    python -m minillm bench serving                        # plots into a temporary folder
    python -m minillm bench serving --update-docs          # plots for the docs
    python -m minillm bench serving --trace my_trace.csv   # replay a saved trace (serving.load_trace)

``demo(argv)`` replays a short trace on one engine with a live status line and prints each request's
metrics and text (the ``serve-demo`` command).

The workload: a seeded Poisson arrival trace (``serving.poisson_trace``; exponential prompt and output
lengths) plus a few long prompts placed in it, with prompts cut from the validation part of the
shipped corpus; greedy decoding with the shipped character model (``--model target``, the default)
or any other model ``minillm.load_model`` knows (``--model smollm2-135m``). The trace is replayed
in real time (a request is handed to the server when its arrival time has passed).

    static       chapter 7's ``generate_batch``: batches of max_num_seqs requests in arrival order; a
                 batch starts when its last member has arrived and the previous batch is done, and
                 runs until its slowest member is done; its tokens come back when the batch ends
    continuous   ``serving.Engine``, prompts prefilled in one step
    chunked      ``serving.Engine`` with prompts prefilled in chunks of --chunk tokens

Validate first: every request gets the same tokens in the three modes, and the first requests equal
``generate`` alone. Then one warm-up request, then the timed replays. Reported: output tokens/s over
the replay, p50/p99 time to first token (TTFT) and inter-token latency (ITL), the longest ITL of a
running request while a long prompt is being prefilled, end-to-end latency, preemptions.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ...batch_speculative import generate_batch
from ...data import load_corpus
from ...generate import generate
from ...notebook import format_table
from ...registry import load_model
from ...serving import (
    Engine,
    RealClock,
    Request,
    RequestMetrics,
    TraceRow,
    load_trace,
    poisson_trace,
    replay,
    save_trace,
)
from ..options import (
    add_weights_option,
    count,
    kv_blocks,
    nonnegative_count,
    nonnegative_float,
    positive_float,
    seed_int,
)
from .common import BenchmarkError, add_output_args, figure_dir, save_figure
from .common import parse_args as common_parse_args

MODES = ("static", "continuous", "chunked")


# --- the workload ----------------------------------------------------------------------------------


def make_trace(n, rate, mean_prompt, mean_output, context, long_prompt, n_long, seed):
    """A Poisson trace whose requests at evenly spaced places get a long prompt (the prefill stall)."""
    rows = poisson_trace(n, rate, mean_prompt, mean_output, context, seed)
    for i in sorted({min(n - 1, (k + 1) * n // (n_long + 1)) for k in range(n_long)}):
        r = rows[i]
        rows[i] = TraceRow(r.arrival_s, long_prompt, min(r.output_tokens, context + 1 - long_prompt))
    return rows


def trace_requests(rows, tokenizer, seed) -> list[Request]:
    """Greedy requests whose prompts are slices of the last tenth of the corpus (seeded offsets)."""
    text = load_corpus()
    ids = tokenizer.encode(text[int(len(text) * 0.9) :])
    offsets = np.random.default_rng(seed).integers(0, len(ids) - max(r.prompt_tokens for r in rows), len(rows))
    return [Request(tuple(ids[o : o + r.prompt_tokens]), r.output_tokens, temperature=0) for r, o in zip(rows, offsets)]


# --- the three servers -----------------------------------------------------------------------------


def static_slots(prompt_lengths, steps) -> list:
    """The padded slots (rows x columns) of each forward of one static batch: the prefill of every
    prompt padded to the longest, then one column per row for steps - 1 decodes."""
    B = len(prompt_lengths)
    return [B * max(prompt_lengths)] + [B] * (steps - 1)


def run_static(model, requests, arrivals, batch_size, clock=None):
    """Static batching on ``generate_batch`` -> (outputs, metrics per request).

    Non-streaming, as the classic static servers: a request's tokens all come back when its batch
    ends, so its TTFT equals its end-to-end latency."""
    clock = RealClock() if clock is None else clock
    start, outputs, metrics = clock.now(), [], []
    for b in range(0, len(requests), batch_size):
        members = range(b, min(b + batch_size, len(requests)))
        clock.wait_until(start + max(arrivals[i] for i in members))  # the batch is full
        longest = max(requests[i].max_new_tokens for i in members)
        rows = generate_batch(model, [requests[i].prompt for i in members], longest, temperature=0).tokens
        for slots in static_slots([len(requests[i].prompt) for i in members], longest):
            clock.advance(slots)  # a simulated clock pays for each forward; real time has passed
        t1 = clock.now()
        for i, row in zip(members, rows):
            outputs.append(row[: requests[i].max_new_tokens])
            metrics.append(RequestMetrics(start + arrivals[i], [t1]))
    return outputs, metrics


def make_engine(model, args, chunk):
    return Engine(
        model,
        num_blocks=args.num_blocks,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunk_size=chunk,
    )


def run_engine(model, requests, arrivals, args, chunk):
    """Replay on a fresh engine -> (outputs, metrics, the engine: its history and counters)."""
    engine = make_engine(model, args, chunk)
    handles = replay(engine, requests, arrivals)
    return [handles[i].output for i in range(len(requests))], [handles[i].metrics for i in range(len(requests))], engine


def replay_all(model, requests, arrivals, args):
    """The trace served three ways -> (metrics per mode, engines, table rows); the tokens must agree."""
    outputs, metrics, engines = {}, {}, {}
    outputs["static"], metrics["static"] = run_static(model, requests, arrivals, args.max_num_seqs)
    for mode, chunk in (("continuous", None), ("chunked", args.chunk)):
        outputs[mode], metrics[mode], engines[mode] = run_engine(model, requests, arrivals, args, chunk)
    mismatched = [
        i for i in range(len(requests)) if not outputs["static"][i] == outputs["continuous"][i] == outputs["chunked"][i]
    ]
    if mismatched:
        raise BenchmarkError(f"requests {mismatched} got different tokens in different modes")
    rows = [
        summarize(
            m, outputs[m], metrics[m], requests, args.long_prompt, None if m == "static" else engines[m].num_preemptions
        )
        for m in MODES
    ]
    return metrics, engines, rows


def median_rows(runs) -> list:
    """Per mode, the median of each numeric column over the replays (text columns from the first)."""
    return [
        {k: float(np.median([run[i][k] for run in runs])) if isinstance(v, (int, float)) else v for k, v in row.items()}
        for i, row in enumerate(runs[0])
    ]


# --- metrics ---------------------------------------------------------------------------------------


def stall_itls(metrics, requests, long_prompt) -> list:
    """ITLs of other requests that end while a long prompt is waiting or being prefilled (from its
    arrival to its first token): the gaps a prefill stall makes."""
    windows = [(m.arrival_s, m.token_times_s[0]) for m, r in zip(metrics, requests) if len(r.prompt) >= long_prompt]
    gaps = []
    for m in metrics:
        t = m.token_times_s
        gaps += [t[i] - t[i - 1] for i in range(1, len(t)) if any(a <= t[i] <= f for a, f in windows)]
    return gaps


def summarize(mode, outputs, metrics, requests, long_prompt, preemptions=None) -> dict:
    """One table row: throughput over the replay, TTFT (s) and ITL (ms) percentiles, the longest ITL
    during a long prefill (ms), median end-to-end latency (s). "-" where a mode streams no tokens."""
    first = min(m.arrival_s for m in metrics)
    makespan = max(m.token_times_s[-1] for m in metrics) - first
    itl = [g * 1000.0 for m in metrics for g in m.itl_s]
    stall = [g * 1000.0 for g in stall_itls(metrics, requests, long_prompt)]
    ttft, e2e = [m.ttft_s for m in metrics], [m.e2e_s for m in metrics]
    return {
        "mode": mode,
        "tok/s": sum(len(o) for o in outputs) / makespan,
        "TTFT p50 s": float(np.percentile(ttft, 50)),
        "TTFT p99 s": float(np.percentile(ttft, 99)),
        "ITL p50 ms": float(np.percentile(itl, 50)) if itl else "-",
        "ITL p99 ms": float(np.percentile(itl, 99)) if itl else "-",
        "max ITL in long prefill ms": max(stall) if stall else "-",
        "e2e p50 s": float(np.percentile(e2e, 50)),
        "preemptions": "-" if preemptions is None else preemptions,
    }


# --- plots -----------------------------------------------------------------------------------------


def plot_engine_history(engines: dict, out_dir):
    """Queue length (waiting, running) and KV blocks in use over time, one column per engine."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(engines), figsize=(6 * len(engines), 5), sharex=True, squeeze=False)
    for col, (name, engine) in enumerate(engines.items()):
        h = engine.history
        t = [r.time_s - h[0].time_s for r in h]
        axes[0, col].step(t, [r.num_waiting for r in h], where="post", label="waiting")
        axes[0, col].step(t, [r.num_running for r in h], where="post", label="running")
        axes[0, col].set(title=name, ylabel="requests")
        axes[0, col].legend()
        axes[1, col].step(t, [r.blocks_used for r in h], where="post", color="C2")
        axes[1, col].axhline(engine.pool.num_blocks, color="gray", ls="--", lw=1, label="pool")
        for r in h:
            if r.preempted:
                axes[1, col].axvline(r.time_s - h[0].time_s, color="C3", lw=0.8)
        axes[1, col].set(xlabel="time (s)", ylabel="KV blocks in use (red: preemption)")
    return save_figure(fig, "serving_queue_blocks", out_dir)


def plot_latencies(results: dict, out_dir):
    """CDFs of TTFT (all modes) and ITL (the streaming modes)."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, metrics in results.items():
        ttft = np.sort([m.ttft_s for m in metrics])
        ax1.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=name)
        itl = np.sort([g for m in metrics for g in m.itl_s])
        if len(itl):
            ax2.step(itl * 1000, np.arange(1, len(itl) + 1) / len(itl), where="post", label=name)
    ax1.set(xlabel="time to first token (s)", ylabel="share of requests", title="TTFT")
    ax2.set(xlabel="inter-token latency (ms)", ylabel="share of tokens", title="ITL", xscale="log")
    ax1.legend()
    ax2.legend()
    return save_figure(fig, "serving_latency_cdf", out_dir)


def plot_gantt(ax, metrics, title):
    """One bar per request: waiting (light) from arrival to first token, then generating (dark)."""
    t0 = min(m.arrival_s for m in metrics)
    for i, m in enumerate(metrics):
        first, last = m.token_times_s[0] - t0, m.token_times_s[-1] - t0
        ax.barh(i, first - (m.arrival_s - t0), left=m.arrival_s - t0, color="C1", alpha=0.35)
        ax.barh(i, max(last - first, 1e-3), left=first, color="C0")
    ax.set(title=title, xlabel="time (s)", ylabel="request")
    ax.invert_yaxis()


def plot_timelines(results: dict, out_dir):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 5), sharex=True, sharey=True)
    for ax, (name, metrics) in zip(np.atleast_1d(axes), results.items()):
        plot_gantt(ax, metrics, f"{name}: waiting (light), generating (dark)")
    return save_figure(fig, "serving_gantt", out_dir)


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m minillm bench serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="target", help="'target' (the shipped char model), 'smollm2-135m', ...")
    add_weights_option(p)
    p.add_argument("--requests", type=count, default=40, help="requests in the generated trace")
    p.add_argument("--rate", type=positive_float, default=4.0, help="mean arrivals per second")
    p.add_argument("--mean-prompt", type=positive_float, default=40.0)
    p.add_argument("--mean-output", type=positive_float, default=40.0)
    p.add_argument("--long-prompt", type=count, default=200, help="length of the long prompts placed in the trace")
    p.add_argument("--long-prompts", type=nonnegative_count, default=2, help="how many long prompts")
    p.add_argument("--trace", help="replay this trace CSV instead of generating one")
    p.add_argument("--save-trace", help="write the trace used to this CSV file")
    p.add_argument("--max-num-seqs", type=count, default=8)
    p.add_argument("--max-num-batched-tokens", type=count, default=256)
    p.add_argument("--num-blocks", type=kv_blocks, default=48,
                   help="KV pool blocks (small pools force preemptions)")
    p.add_argument("--page-size", type=count, default=16, help="tokens per KV block")
    p.add_argument("--chunk", type=nonnegative_count, default=32, help="prefill chunk of the chunked mode")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--repeat", type=count, default=3, help="replays of the three modes; the table holds medians")
    add_output_args(p)
    return common_parse_args(p, argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model, tok = load_model(args.model, weights=args.weights)
    context = model.config.block_size
    if args.trace:
        rows = load_trace(args.trace)
    else:
        rows = make_trace(
            args.requests,
            args.rate,
            args.mean_prompt,
            args.mean_output,
            context,
            args.long_prompt,
            args.long_prompts,
            args.seed,
        )
    requests, arrivals = trace_requests(rows, tok, args.seed), [r.arrival_s for r in rows]
    for r in requests:
        make_engine(model, args, args.chunk).check_fits(r)  # a request that can never run: say so now
    if args.save_trace:
        save_trace(rows, args.save_trace)
    out = figure_dir(args)
    prompt_tokens, output_tokens = sum(len(r.prompt) for r in requests), sum(r.max_new_tokens for r in requests)
    print(
        f"trace: {len(rows)} requests over {arrivals[-1]:.1f} s, prompts {prompt_tokens} tokens, outputs "
        f"{output_tokens} tokens; pool {args.num_blocks} blocks of {args.page_size}, max_num_seqs "
        f"{args.max_num_seqs}, budget {args.max_num_batched_tokens} tokens"
    )

    # validate first: the first requests alone, then the same tokens in every mode (below)
    t0 = time.perf_counter()
    for r in requests[:2]:
        solo = generate(model, list(r.prompt), r.max_new_tokens, temperature=0).tokens
        engine = make_engine(model, args, args.chunk)
        h = engine.add_request(r)
        list(engine.stream())
        assert h.output == solo, "the engine disagrees with generate() alone"
    run_engine(model, requests[:1], [0.0], args, args.chunk)  # warm-up
    print(f"validated and warmed up in {time.perf_counter() - t0:.1f} s; replaying ...")

    runs = []
    for rep in range(args.repeat):  # the three modes back to back, repeated: paired under the same load
        metrics, engines, rows_out = replay_all(model, requests, arrivals, args)
        runs.append(rows_out)
        print(f"replay {rep + 1}/{args.repeat}: " + ", ".join(f"{r['mode']} {r['tok/s']:.1f} tok/s" for r in rows_out))
    rows_out = median_rows(runs)
    base = rows_out[0]["tok/s"]
    for r in rows_out:
        r["throughput vs static"] = f"{r['tok/s'] / base:.2f}x"
    print(f"medians over {args.repeat} replay(s):" if args.repeat > 1 else "")
    print(format_table(rows_out))
    print(
        "static batching returns a batch's tokens when the batch ends: its TTFT is its end-to-end "
        "latency, and it has no ITL"
    )
    paths = [plot_engine_history(engines, out), plot_latencies(metrics, out), plot_timelines(metrics, out)]
    print("plots (last replay):", ", ".join(str(p) for p in paths))
    return 0


# --- the live demo ---------------------------------------------------------------------------------


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The serve-demo options, for ``demo``'s own parser and for the CLI's ``serve-demo`` command."""
    p.add_argument("--requests", type=count, default=12)
    p.add_argument("--rate", type=positive_float, default=4.0, help="mean arrivals per second")
    p.add_argument("--chunk", type=nonnegative_count, default=32, help="prefill chunk (0: none)")
    p.add_argument("--num-blocks", type=kv_blocks, default=48)
    p.add_argument("--temperature", type=nonnegative_float, default=0.8)
    p.add_argument("--seed", type=seed_int, default=0)


def demo(argv=None, out=None) -> int:
    """Replay a short trace on one engine in real time: a live status line per step, then every
    request's metrics and the start of its text. ``out``: where to print (default stdout)."""
    p = argparse.ArgumentParser(prog="python -m minillm serve-demo", description=demo.__doc__.split("\n")[0])
    add_demo_arguments(p)
    return run_demo(p.parse_args(argv), out)


def run_demo(args, out=None) -> int:
    """``demo`` with parsed options."""
    out = out or sys.stdout
    model, tok = load_model("target")
    rows = poisson_trace(args.requests, args.rate, 30, 40, model.config.block_size, args.seed)
    requests = [
        Request(r.prompt, r.max_new_tokens, temperature=args.temperature, seed=args.seed + i)
        for i, r in enumerate(trace_requests(rows, tok, args.seed))
    ]
    engine = Engine(model, num_blocks=args.num_blocks, page_size=16, max_num_seqs=8, chunk_size=args.chunk or None)
    live, made = out.isatty(), 0

    def status(new):
        nonlocal made
        made += len(new)
        if not engine.history:
            return
        r = engine.history[-1]
        line = (
            f"t={r.time_s - engine.history[0].time_s:6.2f}s  running {r.num_running}  waiting {r.num_waiting}  "
            f"done {len(engine.finished)}/{len(requests)}  blocks {r.blocks_used}/{args.num_blocks}  "
            f"tokens {made}  preemptions {engine.num_preemptions}"
        )
        if live:
            print("\r" + line, end="", file=out, flush=True)
        elif len(engine.history) % 20 == 1:
            print(line, file=out)

    handles = replay(engine, requests, [r.arrival_s for r in rows], on_step=status)
    if live:
        print(file=out)  # end the status line
    table = [
        {
            "request": i,
            "prompt": len(requests[i].prompt),
            "tokens": len(h.output),
            "TTFT ms": h.metrics.ttft_s * 1000,
            "mean ITL ms": float(np.mean(h.metrics.itl_s) * 1000) if h.metrics.itl_s else "-",
            "e2e s": h.metrics.e2e_s,
            "preempted": h.preemptions,
            "text": repr(tok.decode(h.output[:24])),
        }
        for i, h in sorted(handles.items())
    ]
    print(format_table(table), file=out)
    return 0
