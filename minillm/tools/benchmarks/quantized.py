"""``python -m minillm bench quantized``: one pass over SmolLM2-135M's weight products per format, beside its floors.

A pass is every product of a decode step or a verification of n tokens: 30 blocks of q, k, v, o (576
and 192 outputs of 576 inputs), gate, up (1536 x 576), down (576 x 1536), then the LM head (49152 x
576), 134.5 M weights, each a separate matrix in memory (a pass streams them all, as a forward does).
The weights are random, quantized into each format and packed once (``minillm.qkernels.pack``).

Validated first: each format's kernel against ``x @ W.dequantize().T`` on the largest block shape.
Then, per format and n = 1, 2, 4, 8, 16 token rows, in the order printed:

- ms: the best of ``--repeat`` passes by the wall clock, and "cpu ms" by this thread's CPU time (on a
  busy machine the wall clock also counts the time the thread waited for a core);
- v(n) = t(n) / t(1) of the same format: what a verification of n tokens costs in decode steps;
- GB/s: the format's bytes over the pass's best time, beside the measured bandwidth;
- the floors: memory = bytes / bandwidth (the best of a large sum and a large copy, one thread,
  ``verify_cost.read_bandwidth`` / ``copy_bandwidth``); compute = n m k multiply-adds at the best FMA
  rate observed on this core (BLAS's large float32 GEMM, or the F32 kernel with 16 rows on a weight
  that fits in the cache, whichever is faster); "x floor" = ms / max(the two floors).

Then, where the CPU has an int8 kernel (AVX512-VNNI or AVX2, ``qkernels.int8_isa``), Q8_0 and Q4_1 once more
with ``int8_x`` (rows "Q8_0 int8 x", "Q4_1 int8 x"): x quantized to int8 per block of 32 and integer products,
as llama.cpp does. Not exact: validated against its own bound, sum_b (max_b |x| / 254) sum_{t in b} |w|
(``--no-int8-x`` leaves these rows out).

``--json OUT`` also writes every number. The numbers are only as quiet as the machine: the first
line printed says the load.

``--decode``: SmolLM2-135M itself, greedy, one thread per engine: "fp32" (every matrix dequantized at
load, the reference), "q" (the file's Q8_0 / Q4_1 blocks, the default load), "q-int8" (the same blocks,
each product's input rounded to int8 per block of 32 as llama.cpp does: ``Llama.set_activations``, not
exact; where the CPU has an int8 kernel) and, when ``llama_cpp`` is importable, llama.cpp on the same file.
Each engine runs in a fresh process of its own (its memory is its own: VmRSS after loading, and VmRSS /
VmHWM after answering, from /proc/self/status). After a
warm-up answer each, every chat prompt is answered by every engine in turn, the order alternating from
one prompt to the next, ``--rounds`` times; the table has the medians: decode ms per new token (after
the first), tokens/s, and prefill tokens/s (prompt tokens over the time to the first new token). The
header names the CPU and the load average before and after.

``--decode --context N``: the prompts are instead N tokens of the shipped Shakespeare text (from two places),
so that every step attends over N cached tokens and more; the engine "q-naive" is "q" with the reference
attention (``attention="naive"``, BLAS products and a NumPy softmax) in place of the default's numba kernel for
a few query rows (``minillm.row_attention``).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import platform
import statistics
import subprocess
import time

import numpy as np

from ... import quantize
from ...kv_cache import common_prefix_length
from ...notebook import format_table
from ..options import int_in, list_of
from .common import BenchmarkError, add_json_arg, write_json
from .common import parse_args as common_parse_args
from .verify_cost import copy_bandwidth, gemm_peak, read_bandwidth

N_LAYER = 30
# (out, in) of q, k, v, o, gate, up, down
BLOCK_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
LM_HEAD = (49152, 576)
FORMATS = ("F32", "BF16", "Q8_0", "Q4_1")
ROWS = (1, 2, 4, 8, 16)
TOL = 2e-6  # the kernel tests' tolerance, relative to sum_t |x w|
CACHE_WEIGHT = (256, 576)  # a weight that fits in L2 (590 KB as float32): the kernel's compute rate


def pass_shapes() -> list[tuple[int, int]]:
    """The (out, in) of every product of one pass, in the order a forward runs them."""
    return [shape for _ in range(N_LAYER) for shape in BLOCK_SHAPES] + [LM_HEAD]


def pack_pass(fmt: str, rng) -> list:
    """Every weight of a pass in ``fmt``, packed; one random matrix per shape, each packed copy its own memory."""
    from ...qkernels import pack

    shapes = sorted(set(pass_shapes()))
    quantized = {s: quantize.FORMATS[fmt].quantize(rng.standard_normal(s, dtype=np.float32)) for s in shapes}
    return [pack(quantized[s]) for s in pass_shapes()]


def validate(fmt: str, rng) -> None:
    """The kernel equals x @ W.dequantize().T on gate's shape for n = 1 and 16, else BenchmarkError."""
    from ...qkernels import pack, product

    weight = quantize.FORMATS[fmt].quantize(rng.standard_normal(BLOCK_SHAPES[4], dtype=np.float32))
    ref_w = weight.dequantize().astype(np.float64)
    packed = pack(weight)
    for n in (1, 16):
        x = rng.standard_normal((n, ref_w.shape[1]), dtype=np.float32)
        error = np.abs(product(x, packed) - x.astype(np.float64) @ ref_w.T)
        if np.any(error > TOL * (np.abs(x).astype(np.float64) @ np.abs(ref_w).T)):
            raise BenchmarkError(f"{fmt} kernel disagrees with x @ W.dequantize().T at n = {n}: {error.max():.3g}")


def validate_int8(fmt: str, rng) -> None:
    """The int8_x product is within sum_b (dx_b / 2) sum_{t in b} |w| of x @ W.dequantize().T (dx_b = max_b |x| / 127)
    on gate's shape for n = 1 and 16, else BenchmarkError."""
    from ...qkernels import pack, product

    weight = quantize.FORMATS[fmt].quantize(rng.standard_normal(BLOCK_SHAPES[4], dtype=np.float32))
    ref_w = weight.dequantize().astype(np.float64)
    packed = pack(weight)
    for n in (1, 16):
        x = rng.standard_normal((n, ref_w.shape[1]), dtype=np.float32)
        error = np.abs(product(x, packed, int8_x=True) - x.astype(np.float64) @ ref_w.T)
        dx = np.abs(x.astype(np.float64)).reshape(n, -1, quantize.QK).max(-1) / 127  # (n, nb)
        bound = (dx / 2) @ np.abs(ref_w).reshape(ref_w.shape[0], -1, quantize.QK).sum(-1).T
        if np.any(error > bound + TOL * (np.abs(x).astype(np.float64) @ np.abs(ref_w).T)):
            raise BenchmarkError(f"{fmt} int8_x kernel is outside its bound at n = {n}: {error.max():.3g}")


def time_pass(packed: list, n: int, repeat: int, rng, int8_x: bool = False) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds of this thread) of ``repeat`` passes over n token rows."""
    from ...qkernels import product

    xs = {k: rng.standard_normal((n, k), dtype=np.float32) for k in {p.shape[1] for p in packed}}
    for p in packed:  # warm-up: compiles or loads the kernel, touches every page
        product(xs[p.shape[1]], p, int8_x)
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.thread_time()
        for p in packed:
            product(xs[p.shape[1]], p, int8_x)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.thread_time() - c0)
    return min(wall), min(cpu)


def kernel_fma_rate(rng, repeat: int) -> float:
    """Multiply-adds per second of the F32 kernel over 16 rows on a weight that stays in the cache."""
    from ...qkernels import MAX_ROWS, pack, product

    packed = pack(rng.standard_normal(CACHE_WEIGHT, dtype=np.float32))
    x = rng.standard_normal((MAX_ROWS, CACHE_WEIGHT[1]), dtype=np.float32)
    product(x, packed)
    best = min(_timed(lambda: product(x, packed)) for _ in range(repeat))
    return MAX_ROWS * CACHE_WEIGHT[0] * CACHE_WEIGHT[1] / best


def kernel_choices(formats: list[str], rows_n: list[int]) -> str:
    """What the kernels chose on this CPU (``qkernels.kernel_shape``): U sums x L outputs at once, per format and n."""
    from ...qkernels import host_vector, kernel_shape, row_tile, row_tiles

    lanes, registers = host_vector()
    chunk = row_tiles()[-1]

    def shape(fmt: str, n: int) -> str:
        u, width = kernel_shape(fmt, row_tile(min(n, chunk)))
        passes = -(-n // chunk)
        return f"{n}: {u}x{width}" + (f" ({passes} chunks of {chunk} rows)" if passes > 1 else "")

    return "\n".join([f"kernels for {registers} vector registers of {lanes} float32 lanes, U sums x L outputs by n:"]
                     + [f"  {fmt:>4}  " + ", ".join(shape(fmt, n) for n in rows_n) for fmt in formats])


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def format_rows(fmt: str, nbytes: int, times: dict, bandwidth: float, fma_rate: float) -> list[dict]:
    """{n: (wall s, cpu s)} of one format -> table rows with v(n), GB/s and the floors."""
    weights = sum(m * k for m, k in pass_shapes())
    rows = []
    for n, (wall, cpu) in times.items():
        memory, compute = nbytes / bandwidth, n * weights / fma_rate
        rows.append({"format": fmt, "n": n, "ms": 1e3 * wall, "cpu ms": 1e3 * cpu, "v(n)": wall / times[ROWS[0]][0],
                     "GB/s": nbytes / wall / 1e9, "memory floor ms": 1e3 * memory, "compute floor ms": 1e3 * compute,
                     "x floor": wall / max(memory, compute)})
    return rows


# ---- --decode: the model itself, side by side with llama.cpp ------------------------------------------

ENGINES = ("fp32", "q", "q-int8", "q-naive", "llama.cpp")  # minillm's loads of the same file, and llama.cpp
DEFAULT_ENGINES = ("fp32", "q", "q-int8", "llama.cpp")  # without --context (q-naive is q after short prompts)
CHAT_PROMPTS = ("What is the capital of France?", "Give me three tips for sleeping better.",
                "Write a haiku about the sea.", "Explain what a CPU cache is in two sentences.",
                "How do I boil an egg?")
NEW_TOKENS = 64
LLAMA_CPP_CONTEXT = 512  # tokens: a chat prompt and its answer fit


def memory_mb() -> dict:
    """This process's resident memory now and at its peak (VmRSS, VmHWM in /proc/self/status), in MB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return {"rss_mb": fields.get("VmRSS"), "peak_mb": fields.get("VmHWM")}


def cpu_name() -> str:
    """lscpu's model name (platform.processor() where there is no lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.processor() or "unknown CPU"


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class MinillmEngine:
    """SmolLM2 through minillm's own forward, greedy (``generate`` with a cache of prompt + answer)."""

    def __init__(self, engine: str):
        from ...registry import SMOLLM2, load_model

        weights, _, option = engine.partition("-")  # "q-int8" -> the blocks, int8 activations
        self.model, _ = load_model(SMOLLM2, weights=weights, attention="naive" if option == "naive" else "auto")
        if option == "int8":
            self.model.set_activations(option)

    def answer(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
        """-> (new tokens, seconds to the first new token (the prefill), seconds per later token)."""
        from ...generate import generate
        from ...kv_cache import KVCache

        cache = KVCache(self.model.config, max_len=len(prompt) + new_tokens)
        result = generate(self.model, prompt, new_tokens, temperature=0, cache=cache)
        return result.tokens, result.stats.ttft_s, result.stats.tpot_s


@functools.cache  # once per process: a second call would wrap the wrapper
def no_extra_buffers() -> None:
    """Load llama.cpp models in this process without its extra buffer types (``use_extra_bufts``, a field of
    the C struct that ``llama_cpp.Llama`` does not take as an argument): on a CPU with AMX they repack the
    weights into AMX tiles, and on a virtual machine that does not grant the tiles to the process the first
    evaluation dies of a segmentation fault. Without them llama.cpp multiplies with AVX-512 VNNI or AVX2."""
    from llama_cpp import llama_cpp as lib

    if "use_extra_bufts" not in dict(lib.llama_model_params._fields_):
        return
    defaults = lib.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params  # read by llama_cpp.Llama when it loads the model


class LlamaCppEngine:
    """The same file through llama.cpp (llama-cpp-python), one thread, greedy: argmax of its logits.

    ``lookup`` (tokens per guess): llama-cpp-python's own prompt lookup (``LlamaPromptLookupDecoding``, its
    draft model matching the last 2 tokens earlier in the context) through its ``generate`` loop at
    temperature 0, which verifies the guessed tokens in one evaluation."""

    def __init__(self, lookup: int | None = None, context: int = LLAMA_CPP_CONTEXT):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ...registry import smollm2_path

        no_extra_buffers()
        draft = None if lookup is None else LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.llm = llama_cpp.Llama(model_path=str(smollm2_path()), n_threads=1, n_threads_batch=1,
                                   n_ctx=context, verbose=False, draft_model=draft)
        self.lookup = lookup

    def next_token(self) -> int:
        """argmax of the last evaluated token's logits (llama.cpp's own buffer, read in place)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def answer(self, prompt: list[int], new_tokens: int, temperature: float = 0.0,
               top_p: float | None = None) -> tuple[list[int], float, float]:
        """-> (new_tokens tokens, seconds to the first, seconds per token after it). At a temperature above 0 the
        tokens are llama.cpp's own sampler's (its ``generate`` loop: temperature, top-p, no top-k and no min-p)."""
        self.llm.reset()
        start = time.perf_counter()
        if self.lookup is not None or temperature > 0:
            tokens, first = [], None
            sampler = {"temp": temperature} | ({"top_p": top_p or 1.0, "top_k": 0, "min_p": 0.0} if temperature else {})
            for token in self.llm.generate(prompt, reset=True, **sampler):
                tokens.append(int(token))
                first = first or time.perf_counter()
                if len(tokens) == new_tokens:
                    break
        else:
            self.llm.eval(prompt)
            tokens = [self.next_token()]
            first = time.perf_counter()
            for _ in range(new_tokens - 1):
                self.llm.eval(tokens[-1:])
                tokens.append(self.next_token())
        end = time.perf_counter()
        return tokens, first - start, (end - first) / max(1, new_tokens - 1)


def engine_worker(engine: str, context: int, conn) -> None:
    """A fresh process for one engine (llama.cpp's with room for ``context`` tokens): load, say the memory, then
    answer ("answer", prompt, n) requests until ("stop",); every reply is a dict (an "error" key when something
    failed)."""
    try:
        runner = LlamaCppEngine(context=context) if engine == "llama.cpp" else MinillmEngine(engine)
        conn.send({"loaded": memory_mb()})
        while (request := conn.recv())[0] == "answer":
            tokens, prefill_s, decode_s = runner.answer(request[1], request[2])
            conn.send({"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s})
        conn.send({"answered": memory_mb()})
    except Exception as exc:  # reported by the parent as one line
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


class Worker:
    """The parent's handle on one engine's process."""

    def __init__(self, engine: str, context: int = LLAMA_CPP_CONTEXT):
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no memory of the parent's
        self.engine, (self.conn, child) = engine, spawn.Pipe()
        self.process = spawn.Process(target=engine_worker, args=(engine, context, child), daemon=True)
        self.process.start()
        self.loaded = self.reply()["loaded"]

    def reply(self) -> dict:
        try:
            message = self.conn.recv()
        except EOFError:  # the process died without a word (a crash in native code)
            self.process.join(5)
            code = self.process.exitcode
            raise BenchmarkError(f"engine {self.engine}: its process died (exit code {code})") from None
        if "error" in message:
            raise BenchmarkError(f"engine {self.engine}: {message['error']}")
        return message

    def answer(self, prompt: list[int], new_tokens: int) -> dict:
        self.conn.send(("answer", prompt, new_tokens))
        return self.reply()

    def stop(self) -> dict:
        self.conn.send(("stop",))
        answered = self.reply()["answered"]
        self.process.join(timeout=30)
        return answered


def chat_prompt_ids() -> list[list[int]]:
    """The chat prompts as SmolLM2's ChatML token ids (a user turn, then the assistant's header)."""
    from ...registry import SMOLLM2, load_tokenizer

    tok = load_tokenizer(SMOLLM2)
    return [tok.encode_pieces(tok.chat_pieces([{"role": "user", "content": text}])) for text in CHAT_PROMPTS]


def context_prompt_ids(context: int) -> list[list[int]]:
    """Two prompts of ``context`` SmolLM2 tokens each: the shipped Shakespeare text from its start and its middle."""
    from ...data import CORPUS_PATH
    from ...registry import SMOLLM2, load_tokenizer

    text = CORPUS_PATH.read_text()
    tok = load_tokenizer(SMOLLM2)
    starts = (0, len(text) // 2)
    return [tok.encode(text[start : start + 8 * context])[:context] for start in starts]  # ~4 characters a token


def decode_runs(engines: list[str], prompts: list[list[int]], rounds: int, new_tokens: int) -> tuple[dict, dict]:
    """Answer every prompt by every engine, ``rounds`` times, the engines' order alternating prompt by
    prompt, after one warm-up answer each -> ({engine: [run dicts]}, {engine: memory})."""
    context = max(LLAMA_CPP_CONTEXT, max(map(len, prompts)) + new_tokens)
    workers = {engine: Worker(engine, context) for engine in engines}
    try:
        for worker in workers.values():
            worker.answer(prompts[0], new_tokens)  # warm-up: compiles or loads the kernels, touches every page
        runs = {engine: [] for engine in engines}
        for turn in range(rounds * len(prompts)):
            order = engines if turn % 2 == 0 else engines[::-1]
            for engine in order:
                runs[engine].append(workers[engine].answer(prompts[turn % len(prompts)], new_tokens))
        memory = {engine: {"after load": w.loaded, "after answering": w.stop()} for engine, w in workers.items()}
    finally:
        for worker in workers.values():
            worker.process.kill() if worker.process.is_alive() else None
    return runs, memory


def decode_rows(runs: dict, memory: dict, prompts: list[list[int]]) -> list[dict]:
    """The medians per engine, beside llama.cpp's decode time when it ran, and how many of its greedy
    tokens agree with the fp32 reference's (on the same prompt, counted up to the first difference)."""
    reference = runs.get("fp32")
    base = statistics.median(r["decode_s"] for r in runs["llama.cpp"]) if "llama.cpp" in runs else None
    rows = []
    for engine, engine_runs in runs.items():
        decode = statistics.median(r["decode_s"] for r in engine_runs)
        prefill = statistics.median(len(prompts[i % len(prompts)]) / r["prefill_s"] for i, r in enumerate(engine_runs))
        row = {"engine": engine, "decode ms/token": 1e3 * decode, "tokens/s": 1 / decode,
               "prefill tokens/s": prefill, "x llama.cpp": decode / base if base else None,
               "RSS loaded MB": memory[engine]["after load"]["rss_mb"],
               "RSS answered MB": memory[engine]["after answering"]["rss_mb"],
               "peak MB": memory[engine]["after answering"]["peak_mb"]}
        if reference is not None:
            pairs = zip(engine_runs, reference)
            row["same tokens as fp32"] = sum(common_prefix_length(r["tokens"], f["tokens"]) for r, f in pairs)
        rows.append(row)
    return rows


def decode_main(args, engines: list[str]) -> int:
    load_before = os.getloadavg()[0]
    prompts = context_prompt_ids(args.context) if args.context else chat_prompt_ids()
    runs, memory = decode_runs(engines, prompts, args.rounds, args.new_tokens)
    rows = decode_rows(runs, memory, prompts)
    load_after = os.getloadavg()[0]
    kind = f"prompts of {args.context} tokens" if args.context else "chat prompts"
    print(f"SmolLM2-135M greedy decode, {len(prompts)} {kind} x {args.rounds} rounds, {args.new_tokens} new "
          f"tokens, one thread each; {cpu_name()}, {os.cpu_count()} cores, load average {load_before:.2f} "
          f"before, {load_after:.2f} after")
    print(format_table(rows))
    if args.json:
        write_json(args.json, {"cpu": cpu_name(), "load_before": load_before, "load_after": load_after,
                                     "prompts": prompts, "new_tokens": args.new_tokens, "rows": rows})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="minillm bench quantized", description=__doc__.split("\n")[0])
    p.add_argument("--decode", action="store_true",
                   help="SmolLM2 greedy decode per weight format beside llama.cpp (when importable), not the pass")
    p.add_argument("--engines", type=list_of(str), default=None,
                   help=f"with --decode, comma-separated from {', '.join(ENGINES)} (default: all available)")
    p.add_argument("--rounds", type=int_in(1, 20), default=2, help="with --decode, answers per prompt and engine")
    p.add_argument("--new-tokens", type=int_in(2, 512), default=NEW_TOKENS, help="with --decode, tokens per answer")
    p.add_argument("--context", type=int_in(16, 7680), default=None,
                   help="with --decode, prompts of this many tokens of Shakespeare instead of the chat prompts")
    p.add_argument("--formats", type=list_of(str), default=list(FORMATS),
                   help=f"comma-separated, from {', '.join(FORMATS)}")
    p.add_argument("--rows", type=list_of(int_in(1, 16)), default=list(ROWS), help="token rows n per pass (1..16)")
    p.add_argument("--repeat", type=int_in(1, 100), default=5, help="timed passes per (format, n); the best counts")
    p.add_argument("--no-int8-x", action="store_true",
                   help="leave out the rows of the int8_x option (x quantized to int8; Q8_0 and Q4_1; AVX512-VNNI "
                        "or AVX2)")
    add_json_arg(p, "also write the table and the floors as JSON")
    args = common_parse_args(p, argv)
    if args.decode:
        from ...qkernels import int8_isa

        available = {"llama.cpp": llama_cpp_available(), "q-int8": int8_isa() is not None}
        defaults = ENGINES if args.context else DEFAULT_ENGINES
        engines = args.engines or [e for e in defaults if available.get(e, True)]
        unknown = sorted(set(engines) - set(ENGINES))
        if unknown:
            p.error(f"unknown engine(s) {', '.join(unknown)}: choose from {', '.join(ENGINES)}")
        if "llama.cpp" in engines and not available["llama.cpp"]:
            p.error("engine llama.cpp needs llama-cpp-python (pip install llama-cpp-python)")
        if "q-int8" in engines and not available["q-int8"]:
            p.error("engine q-int8 needs a CPU with AVX512-VNNI or AVX2")
        return decode_main(args, engines)
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        p.error(f"unknown format(s) {', '.join(unknown)}: choose from {', '.join(FORMATS)}")
    from ...qkernels import INT8_KERNELS, int8_isa

    rows_n = sorted(set(args.rows) | {1})  # v(n) needs t(1)
    rng = np.random.default_rng(0)
    int8_formats = [] if args.no_int8_x or not int8_isa() else [f for f in args.formats if f in INT8_KERNELS]
    for fmt in args.formats:
        validate(fmt, rng)
    for fmt in int8_formats:
        validate_int8(fmt, rng)
    bandwidth = max(read_bandwidth(), copy_bandwidth())
    fma_rate = max(gemm_peak() / 2, kernel_fma_rate(rng, args.repeat))
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s (one thread), FMA rate {fma_rate / 1e9:.1f} G/s (one core)")
    print(kernel_choices(args.formats, rows_n))
    table = []
    for fmt in args.formats:
        packed = pack_pass(fmt, rng)
        times = {n: time_pass(packed, n, args.repeat, rng) for n in rows_n}
        table += format_rows(fmt, sum(q.nbytes for q in packed), times, bandwidth, fma_rate)
        if fmt in int8_formats:
            times = {n: time_pass(packed, n, args.repeat, rng, int8_x=True) for n in rows_n}
            table += format_rows(f"{fmt} int8 x", sum(q.nbytes for q in packed), times, bandwidth, fma_rate)
        del packed
    print(format_table(table))
    if args.json:
        write_json(args.json, {"bandwidth": bandwidth, "fma_rate": fma_rate, "rows": table})
    return 0


