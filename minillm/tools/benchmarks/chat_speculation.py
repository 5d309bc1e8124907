"""``python -m minillm bench chat-speculation``: SmolLM2's chat replies, plain and speculative, beside llama.cpp.

    python -m minillm bench chat-speculation [--prompts FILE.jsonl]
                                             [--engines plain,eagle,lookup,eagle-lookup,auto,llama.cpp,llama.cpp-lookup]
                                             [--activations float32|int8]

Engines, each answering every prompt in a fresh conversation, greedy unless ``--temperature`` (and ``--top-p``)
say otherwise, one thread, the order alternating prompt by prompt:

    plain       ``chat.Chat``: one token per forward, the file's blocks on chapter 13's kernels
    eagle       ``speculative_chat.SpeculativeChat`` with the shipped EAGLE draft (kept in the target's blocks)
    lookup      the same with prompt lookup
    eagle-lookup   the same with the EAGLE draft's guess and prompt lookup's chain beside it (``eagle.EagleLookup``)
    auto        the same, timing plain, eagle-lookup and lookup at the start of every reply and keeping the fastest
                for the rest of it (the table counts what it chose in the timed replies of each kind)
    llama.cpp   the same GGUF through llama-cpp-python (when installed), plain decoding, as many tokens as
                minillm's plain reply
    llama.cpp-lookup   the same with llama-cpp-python's own prompt lookup (``LlamaPromptLookupDecoding``,
                ``--lookup-tokens`` guessed per round) in its ``generate`` loop; its replies are compared with
                llama.cpp's plain ones (the table counts the tokens they share), not required to equal them

``--activations int8`` gives every minillm engine, plain and speculative alike, llama.cpp's arithmetic (each
product's input rounded to int8 per block of 32); float32, exact, by default.

A reply's ms/token is its decode time after the first token over the tokens after the first; an engine's
figure is the median over prompts and repeats, beside llama.cpp's. Greedy, with float32 activations, every
speculative reply must equal the plain reply token for token (``BenchmarkError`` otherwise: nothing wrong
is timed). With int8 they need not: rounding each product's input to int8 turns the float32 rounding
differences between a verify over n tokens and n single steps (1e-6) into whole quantization steps, so
the table counts the tokens each engine's replies share with plain's, up to each reply's first difference.
Sampled (``--temperature 0.2 --top-p 0.9``, what ``python -m minillm chat`` does), each reply is a draw and
nothing is compared; llama.cpp samples with its own sampler (temperature and top-p, no top-k, no min-p), and
its prompt lookup, which llama-cpp-python verifies greedily, is not run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

from ...chat import Chat
from ...kv_cache import common_prefix_length
from ...notebook import format_table
from ...registry import SMOLLM2, load_model
from ...sampling import SamplingSettings
from ...speculative_chat import SpeculativeChat, chat_proposers
from ...workloads import KINDS, WORKLOADS, read_prompts
from ..options import add_activations_option, count, float_in, list_of, set_activations
from .common import BenchmarkError, add_json_arg, parse_args, write_json
from .quantized import LlamaCppEngine, cpu_name, llama_cpp_available

MINILLM = ("plain", "eagle", "lookup", "eagle-lookup", "auto")
LLAMA_CPP = ("llama.cpp", "llama.cpp-lookup")
ENGINES = MINILLM + LLAMA_CPP


def new_chat(engine: str, model, tok, draft_path=None):
    if engine == "plain":
        return Chat(model, tok)
    return SpeculativeChat(model, tok, chat_proposers(model, engine, SMOLLM2, draft_path), engine)


def reply(chat, text: str, max_new_tokens: int, settings: SamplingSettings) -> dict:
    """One turn in a fresh conversation at ``settings``' temperature and top-p -> {tokens, ms/token after the first}."""
    chat.reset()
    r = chat.turn(text, max_new_tokens, temperature=settings.temperature, top_p=settings.top_p)
    return {"tokens": r.tokens, "ms_per_token": 1e3 * r.stats.tpot_s}


def llama_cpp_reply(engine, tok, text: str, n: int, settings: SamplingSettings) -> dict:
    ids = tok.encode_pieces(tok.chat_pieces([{"role": "user", "content": text}]))
    tokens, _, decode_s = engine.answer(ids, max(n, 2), settings.temperature, settings.top_p)
    return {"tokens": tokens, "ms_per_token": 1e3 * decode_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm bench chat-speculation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                   help='one {"prompt": "...", "kind": "chat|code|grounded"} per line (default: the workloads)')
    p.add_argument("--engines", type=list_of(str), default=None,
                   help=f"comma-separated, from {', '.join(ENGINES)} (default: all available)")
    p.add_argument("--kinds", type=list_of(str), default=list(KINDS), help="comma-separated workload kinds")
    p.add_argument("--max-new-tokens", type=count, default=96, help="longest reply (default 96)")
    p.add_argument("--temperature", type=float_in(0.0, 2.0), default=0.0,
                   help="0 is greedy (the default); the chat samples at 0.2")
    p.add_argument("--top-p", type=float_in(0.0, 1.0, open_low=True), default=None,
                   help="nucleus mass when sampling (the chat's 0.9; default none)")
    p.add_argument("--repeat", type=count, default=1, help="timed answers per prompt and engine (default 1)")
    p.add_argument("--draft", default=None, help="an EAGLE draft file (default: the one shipped for SmolLM2)")
    p.add_argument("--lookup-tokens", type=count, default=10,
                   help="llama.cpp-lookup's tokens per guess (default 10, llama-cpp-python's own)")
    add_activations_option(p)
    add_json_arg(p, "also write the rows and the replies' timings as JSON")
    args = parse_args(p, argv)
    engines = args.engines or [e for e in ENGINES if e not in LLAMA_CPP or llama_cpp_available()]
    unknown = sorted(set(engines) - set(ENGINES)) + sorted(set(args.kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown engine or kind {unknown[0]!r}: engines {', '.join(ENGINES)}; "
                         f"kinds {', '.join(KINDS)}")
    if set(LLAMA_CPP) & set(engines) and not llama_cpp_available():
        raise ValueError("the llama.cpp engines need llama-cpp-python (pip install llama-cpp-python)")
    settings = SamplingSettings(args.temperature, None, args.top_p)
    if not settings.greedy and "llama.cpp-lookup" in engines:
        raise ValueError("llama.cpp-lookup verifies greedily: run it with --temperature 0")
    prompts = [q for q in (read_prompts(args.prompts) if args.prompts else WORKLOADS) if q["kind"] in args.kinds]
    if not prompts:
        raise ValueError(f"no prompt of the kinds {', '.join(args.kinds)}")
    load_before = os.getloadavg()[0]
    model, tok = load_model(SMOLLM2)
    set_activations(model, args.activations)
    chats = {e: new_chat(e, model, tok, args.draft) for e in engines if e in MINILLM}
    cpp = {e: LlamaCppEngine(args.lookup_tokens if e == "llama.cpp-lookup" else None)
           for e in engines if e in LLAMA_CPP}
    plain = Chat(model, tok)
    runs, same = {e: [] for e in engines}, {(e, k): 0 for e in engines for k in args.kinds}
    exact = args.activations == "float32" and settings.greedy  # sampled replies are draws: nothing to compare
    t0 = time.perf_counter()
    cpp_replies = {}  # (engine, prompt) -> a llama.cpp engine's first reply, for the tokens lookup shares with plain
    for i, q in enumerate(prompts):
        reference = reply(plain, q["prompt"], args.max_new_tokens, settings)  # the warm-up, and the tokens to match
        for engine, chat in chats.items():
            tokens = reply(chat, q["prompt"], args.max_new_tokens, settings)["tokens"]
            same[engine, q["kind"]] += common_prefix_length(tokens, reference["tokens"])
            if exact and tokens != reference["tokens"]:
                raise BenchmarkError(f"engine {engine}: its greedy reply to prompt {i} differs from plain chat's")
        for r in range(args.repeat):
            order = engines if (i + r) % 2 == 0 else engines[::-1]
            for engine in order:
                run = (llama_cpp_reply(cpp[engine], tok, q["prompt"], len(reference["tokens"]), settings)
                       if engine in cpp else reply(chats[engine], q["prompt"], args.max_new_tokens, settings))
                if engine == "auto":
                    run["chose"] = chats["auto"].chosen or "none (the reply ended on trial)"
                runs[engine].append({"kind": q["kind"], "prompt": i, **run})
                if engine in cpp:
                    cpp_replies.setdefault((engine, i), run["tokens"])
        if ("llama.cpp", i) in cpp_replies and ("llama.cpp-lookup", i) in cpp_replies:
            reference_cpp = cpp_replies["llama.cpp", i]
            same["llama.cpp-lookup", q["kind"]] += common_prefix_length(cpp_replies["llama.cpp-lookup", i],
                                                                          reference_cpp)
            same["llama.cpp", q["kind"]] += len(reference_cpp)
    base = {k: statistics.median(r["ms_per_token"] for r in runs["llama.cpp"] if r["kind"] == k)
            for k in args.kinds} if "llama.cpp" in cpp else {}
    rows = []
    for engine in engines:
        for kind in args.kinds:
            ms = statistics.median(r["ms_per_token"] for r in runs[engine] if r["kind"] == kind)
            row = {"engine": engine, "kind": kind, "ms/token": ms, "x llama.cpp": ms / base[kind] if base else None}
            if engine == "auto":
                chose = Counter(r["chose"] for r in runs[engine] if r["kind"] == kind)
                row["chose"] = ", ".join(f"{name} {n}" for name, n in chose.most_common())
            if not exact and settings.greedy:
                shared = f"{same[engine, kind]} of {same['plain', kind]}" if engine in chats else ""
                row["same tokens as plain"] = shared
            if engine == "llama.cpp-lookup" and "llama.cpp" in cpp:
                row["same tokens as llama.cpp"] = f"{same[engine, kind]} of {same['llama.cpp', kind]}"
            rows.append(row)
    load_after = os.getloadavg()[0]
    how = "greedy" if settings.greedy else f"temperature {settings.temperature}, top-p {settings.top_p or 1}"
    print(f"SmolLM2-135M chat replies, {how}, {args.activations} activations, up to {args.max_new_tokens} tokens, "
          f"{len(prompts)} prompts x {args.repeat}, one thread each; {cpu_name()}, {os.cpu_count()} cores, "
          f"load average {load_before:.2f} before, {load_after:.2f} after, {time.perf_counter() - t0:.0f} s")
    print("every speculative reply equal to plain chat's, token for token" if exact else
          "int8 activations: replies need not equal plain chat's (the last column counts what they share)"
          if settings.greedy else "sampled: each reply a draw, none compared")
    print(format_table(rows, list(dict.fromkeys(k for row in rows for k in row))))
    if args.json:
        write_json(args.json, {"cpu": cpu_name(), "activations": args.activations, "temperature": settings.temperature,
                               "top_p": settings.top_p, "load_before": load_before,
                               "load_after": load_after,
                               "rows": rows, "runs": {e: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                                                      for e, rs in runs.items()}})
    return 0
