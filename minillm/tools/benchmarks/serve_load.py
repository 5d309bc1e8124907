"""Open-loop load on an OpenAI-compatible server (``python -m minillm serve``): Poisson arrivals.

Requests arrive at ``--rate`` per second (exponential gaps, seeded) for ``--duration`` seconds, at
most ``--max-requests``, each a streamed completion of ``--max-tokens`` tokens, greedy. Arrivals do
not wait for answers (open loop), except that at most ``--concurrency`` are open at once (a client's
connection limit; a request past it waits for a slot, and its wait counts in its TTFT).
``--shared-prefix N`` puts the same N-character preamble before every prompt (the prefix cache's
case). ``--kill F`` is the fault run: each request, with probability F, hangs up after a random
number of tokens; afterwards the server must hold no KV block, and every answer that was not cut
must equal the answer to its prompt asked alone.

Reported: throughput (requests and tokens per second), TTFT and inter-token latency p50/p90/p99,
goodput (requests per second that met both SLOs: ``--slo-ttft`` and ``--slo-itl``, the p90 of a
request's gaps), errors by kind.

    python -m minillm serve --model target --port 8000 &
    python -m minillm bench serve-load --url http://127.0.0.1:8000 --rate 4 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...notebook import format_table
from ..options import count, float_in, list_of, nonnegative_int, positive_float, seed_int
from .common import add_json_arg, add_output_args, figure_dir, parse_args, save_figure, write_json

PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:\nWe", "KING HENRY:", "To be, or", "HAMLET:\nAy",
           "Tell me about the sea.", "What is a prime number?", "Write a short poem about rain.",
           "Name three colours.", "How do birds fly?", "Explain what a cache is."]
PREAMBLE = "The following is a conversation in the voice of a play, told plainly and briefly. "
EXIT_BAD_URL = 2  # as argparse's usage errors: the --url given names no server that answers


class Unreachable(Exception):
    """The server at --url does not answer, or does not answer as an OpenAI-compatible server."""


@dataclass
class Outcome:
    prompt: str
    start: float
    first: float | None = None  # time of the first token
    times: list = field(default_factory=list)  # time of every text delta
    text: str = ""
    finish: str | None = None
    error: str | None = None  # its kind: http 429, http 400, connection, ...
    killed: bool = False  # the client hung up on purpose (--kill)


def make_prompt(shared_prefix: int, rng: random.Random) -> str:
    base = PROMPTS[rng.randrange(len(PROMPTS))]
    if shared_prefix <= 0:
        return base
    preamble = (PREAMBLE * (shared_prefix // len(PREAMBLE) + 1))[:shared_prefix]
    return preamble + base


async def one_request(http, url, model, prompt, max_tokens, stop_after, outcome: Outcome) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    import httpx

    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                outcome.error = f"http {r.status_code}"
                await r.aread()
                return
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome.error = f"stream error: {event['error'].get('code') or event['error']['type']}"
                    return
                choice = event["choices"][0]
                now = time.perf_counter()
                if choice["text"]:
                    outcome.first = outcome.first or now
                    outcome.times.append(now)
                    outcome.text += choice["text"]
                    n += 1
                if choice["finish_reason"] is not None:
                    outcome.finish = choice["finish_reason"]
                if stop_after is not None and n >= stop_after:
                    outcome.killed = True
                    return  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        outcome.error = f"connection: {type(exc).__name__}"


async def get(http, url: str):
    """GET ``url`` -> the response with status 200; Unreachable (one line) if the server does not answer so."""
    import httpx

    try:
        r = await http.get(url)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise Unreachable(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise Unreachable(f"{url} answered HTTP {r.status_code}: is it a minillm server?")
    return r


async def served_model(http, args) -> str:
    """--model, or else the first model of /v1/models; asked first either way, so a server that does not
    answer is one line before the load starts."""
    r = await get(http, args.url + "/v1/models")
    try:
        listed = [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        listed = []
    if not listed:
        raise Unreachable(f"{args.url}/v1/models lists no model: is it an OpenAI-compatible server?")
    return args.model or listed[0]


async def run_load(args, rate: float) -> tuple[list, float, dict]:
    import httpx

    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    outcomes, tasks = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as http:
        model = await served_model(http, args)
        slots = asyncio.Semaphore(args.concurrency)

        async def client(prompt, stop_after, outcome):
            async with slots:
                await one_request(http, args.url, model, prompt, args.max_tokens, stop_after, outcome)

        t0 = time.perf_counter()
        t = 0.0
        for _ in range(args.max_requests):
            t += rng.expovariate(rate)
            if t > args.duration:
                break
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            stop_after = rng.randint(1, max(1, args.max_tokens - 1)) if rng.random() < args.kill else None
            outcome = Outcome(make_prompt(args.shared_prefix, rng), time.perf_counter())
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(client(outcome.prompt, stop_after, outcome)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        faults = await check_after_faults(http, args, model, outcomes) if args.kill > 0 else {}
    return outcomes, wall, faults


async def check_after_faults(http, args, model, outcomes) -> dict:
    """Every answer not cut equals its prompt asked alone; the server then holds no KV block."""
    survivors = [o for o in outcomes if not o.killed and o.error is None]
    alone = {}
    for prompt in sorted({o.prompt for o in survivors}):
        solo = Outcome(prompt, time.perf_counter())
        await one_request(http, args.url, model, prompt, args.max_tokens, None, solo)
        alone[prompt] = solo.text
    deadline = time.perf_counter() + 10
    while True:
        metrics = (await get(http, args.url + "/metrics")).text
        values = dict(line.split(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        used, open_ = int(float(values["minillm_kv_blocks_used"])), int(float(values["minillm_requests_in_flight"]))
        if (used == 0 and open_ == 0) or time.perf_counter() > deadline:
            break
        await asyncio.sleep(0.1)
    return {"hung_up": sum(o.killed for o in outcomes), "survivors": len(survivors),
            "survivors_wrong": sum(o.text != alone[o.prompt] for o in survivors), "blocks_held_after": used}


def summarize(outcomes: list, wall: float, args, rate: float) -> dict:
    done = [o for o in outcomes if o.error is None and not o.killed and o.first is not None]
    ttft = [o.first - o.start for o in done]
    itl = [b - a for o in done for a, b in zip(o.times, o.times[1:])]
    good = [o for o in done if o.first - o.start <= args.slo_ttft and
            (len(o.times) < 2 or np.percentile(np.diff(o.times), 90) * 1e3 <= args.slo_itl)]
    errors = {}
    for o in outcomes:
        if o.error is not None:
            errors[o.error] = errors.get(o.error, 0) + 1

    def pct(xs, q, scale=1.0):
        return float(np.percentile(xs, q) * scale) if xs else "-"

    return {"rate": rate, "shared_prefix": args.shared_prefix, "requests": len(outcomes),
            "completed": len(done), "killed": sum(o.killed for o in outcomes),
            "req_per_s": len(done) / wall, "tok_per_s": sum(len(o.times) for o in done) / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50, 1e3), "itl_p90_ms": pct(itl, 90, 1e3), "itl_p99_ms": pct(itl, 99, 1e3),
            "goodput_req_per_s": len(good) / wall, "errors": ", ".join(f"{k}: {v}" for k, v in errors.items()) or "-"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm bench serve-load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the first of /v1/models)")
    parser.add_argument("--rate", type=list_of(positive_float), required=True,
                        help="requests per second (Poisson); a comma-separated list runs each in turn")
    parser.add_argument("--duration", type=float_in(0, 3600, open_low=True), default=30.0,
                        help="seconds of arrivals (default 30)")
    parser.add_argument("--max-requests", type=count, default=1000, help="at most this many requests (default 1000)")
    parser.add_argument("--concurrency", type=count, default=64, help="connections open at once (default 64)")
    parser.add_argument("--max-tokens", type=count, default=32, help="tokens per answer (default 32)")
    parser.add_argument("--shared-prefix", type=nonnegative_int, default=0,
                        help="characters of a preamble every prompt shares (default 0)")
    parser.add_argument("--kill", type=float_in(0, 1), default=0.0,
                        help="fault run: the share of clients that hang up mid-stream (default 0)")
    parser.add_argument("--slo-ttft", type=positive_float, default=1.0, help="goodput's TTFT bound, s (default 1)")
    parser.add_argument("--slo-itl", type=positive_float, default=200.0,
                        help="goodput's bound on a request's p90 gap, ms (default 200)")
    parser.add_argument("--timeout", type=positive_float, default=120.0, help="seconds per request (default 120)")
    parser.add_argument("--seed", type=seed_int, default=0, help="arrivals and prompts (default 0)")
    add_json_arg(parser, "also write the row as JSON (a new file)")
    parser.add_argument("--plot", action="store_true", help="save serve_load.png: latency and goodput by rate")
    add_output_args(parser)
    args = parse_args(parser, argv)
    rows = []
    for rate in args.rate:
        try:
            outcomes, wall, faults = asyncio.run(run_load(args, rate))
        except Unreachable as exc:
            print(f"error: argument --url: {exc}", file=sys.stderr)
            return EXIT_BAD_URL
        row = summarize(outcomes, wall, args, rate)
        if faults:
            print(f"fault run at {rate}/s: {faults['hung_up']} clients hung up mid-stream; of {faults['survivors']} "
                  f"answers not cut, {faults['survivors_wrong']} differ from their prompt asked alone; KV blocks "
                  f"held afterwards: {faults['blocks_held_after']}", flush=True)
            row |= {"fault_" + k: v for k, v in faults.items()}
        rows.append(row)
    print(format_table(rows, list(rows[0])))
    if args.plot:
        print(f"figure: {plot(rows, figure_dir(args))}")
    if args.json:
        write_json(args.json, rows if len(rows) > 1 else rows[0])
    return 0


def plot(rows: list, out_dir) -> Path:
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["ttft_p50_s"] != "-"]
    rates = [r["rate"] for r in done]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for key, style in (("ttft_p50_s", "o-"), ("ttft_p90_s", "s--"), ("ttft_p99_s", "^:")):
        a.plot(rates, [r[key] for r in done], style, label=key.replace("ttft_", "TTFT ").replace("_s", ""))
    a.set_xlabel("arrival rate (requests/s)"), a.set_ylabel("seconds"), a.set_yscale("log"), a.legend()
    b.plot(rates, rates, "k:", label="offered")
    b.plot(rates, [r["req_per_s"] for r in done], "o-", label="completed")
    b.plot(rates, [r["goodput_req_per_s"] for r in done], "s--", label="goodput (met the SLOs)")
    b.set_xlabel("arrival rate (requests/s)"), b.set_ylabel("requests/s"), b.legend()
    fig.tight_layout()
    return save_figure(fig, "serve_load", out_dir)
