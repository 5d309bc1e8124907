"""python -m minillm.tools.gpu_check: every GPU test and the GPU benchmarks, in one command, in under 5 minutes.

Run it from a checkout of the project whenever a CUDA GPU is available (see docs/gpu.md):

    python -m minillm.tools.gpu_check                      # tests marked gpu + the attention benchmark
    python -m minillm.tools.gpu_check --record docs/gpu.md # ... and append the summary to docs/gpu.md
    python -m minillm.tools.gpu_check --root PATH          # the checkout whose tests to run
    python -m minillm.tools.gpu_check --install-only       # is the GPU install complete? (needs no GPU)

0. install: CuPy imports, with its cuBLAS module; the CUDA runtime headers of NVRTC's CUDA version are
           where CuPy 14 looks for them (cuda.pathfinder), and NVRTC, cuBLAS and cuBLASLt load. Printed
           by ``--install-only`` (which stops there) and whenever CuPy is installed but cannot run.
1. device: name, compute capability, SMs, memory, shared memory per block, CuPy / CUDA versions
2. tests:  ``pytest -m gpu tests/`` of the checkout in a subprocess (every test marked ``gpu``: the
           CUDA kernel over the whole shape grid, the model with each attention, generation, speculative
           decoding, the paged cache and batches on the device), counted per test file, with the first
           error of each failure
3. bench:  ``python -m minillm bench attention`` on the GPU (validates kernels v1 and v2 against naive
           attention, then times all three with CUDA events; TFLOP/s against the FP32 peak)
4. decode: milliseconds per decoded token, greedy, of the shipped target (and of SmolLM2 when installed), loaded
           as ``--weights`` says, by path: the array code with each attention, the static step with fused kernels,
           eager and replayed from a CUDA graph, and speculative decoding; each path's tokens first checked against
           NumPy's
5. quant:  the products from Q8_0 and Q4_1 blocks (kernels/quant.cu) against cuBLAS on the dequantized float32
           weight, SmolLM2-135M's weight shapes, n = 1 and 16 token rows: checked against cuBLAS, then timed
Then a compact table. Exit status 1 when anything fails, including a CuPy that is installed but cannot
be used; 0 with "skipped" only on a machine without CuPy and without an NVIDIA driver.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import re
import shutil
import time
from functools import partial
from pathlib import Path

from ..backend import BACKEND_REASON, CUPY_PROBLEM, GPU_INSTALL_HINT, first_line, is_cupy
from .benchmarks.common import BenchmarkError, add_output_args, figure_dir
from .options import add_weights_option, count, positive_int
from .project import ProjectRootError, project_root, pytest_outcomes

TIME_BUDGET_S = 300
TEST_TIMEOUT_S = 180


# the shared libraries minillm needs CuPy to load, by cuda.pathfinder's names -> what needs them
NEEDED_LIBRARIES = {"nvrtc": "every kernel is compiled by it", "cublas": "every matmul",
                    "cublasLt": "every matmul (cuBLAS's backend)"}
HEADER = "cuda_runtime.h"  # CuPy 14 compiles every kernel against the CUDA runtime headers
VERSION_HEADER = "cuda_runtime_api.h"  # defines CUDART_VERSION, e.g. 12090 for CUDA 12.9


def headers_check(folder, nvrtc_major: int) -> str:
    """"ok: folder" when folder holds the CUDA runtime headers of NVRTC's CUDA major version, else what is wrong
    (a system toolkit of another CUDA version can be found before the wheel's headers)."""
    if folder is None or not (Path(folder) / HEADER).is_file():
        return f"MISSING: no {HEADER} (the cudart headers)"
    found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", (Path(folder) / VERSION_HEADER).read_text())
    major = int(found.group(1)) // 1000 if found else None
    if major != nvrtc_major:
        return f"WRONG VERSION: CUDA {major} headers in {folder}, but NVRTC is CUDA {nvrtc_major}"
    return f"ok: {folder}"


def install_checks() -> list[tuple[str, str]]:
    """(part of a GPU install, "ok: ..." | "MISSING: ...") for each part, found the way CuPy 14 finds it
    (cuda.pathfinder), without a GPU: CuPy, its cuBLAS module, the CUDA headers, NVRTC, cuBLAS, cuBLASLt."""
    try:
        import cupy
    except Exception as exc:
        return [("CuPy", f"MISSING: {first_line(exc)}")]
    rows = [("CuPy", f"ok: {cupy.__version__}")]
    try:
        rows.append(("CuPy's cuBLAS module", f"ok: {cupy.cuda.cublas.__name__}"))  # CuPy's own loader
    except Exception as exc:
        rows.append(("CuPy's cuBLAS module", f"MISSING: {first_line(exc)}"))
    from cuda import pathfinder  # a dependency of CuPy 14

    try:
        rows.append(("CUDA headers", headers_check(pathfinder.find_nvidia_header_directory("cudart"),
                                                   cupy.cuda.nvrtc.getVersion()[0])))
    except Exception as exc:
        rows.append(("CUDA headers", f"MISSING: {first_line(exc)}"))
    for name, why in NEEDED_LIBRARIES.items():
        try:
            rows.append((f"lib {name}", f"ok: {pathfinder.load_nvidia_dynamic_lib(name).abs_path}"))
        except Exception as exc:
            rows.append((f"lib {name}", f"MISSING ({why}): {first_line(exc)}"))
    return rows


def report_install() -> bool:
    """Print install_checks() as a table -> True when every part is there."""
    rows = install_checks()
    width = max(len(part) for part, _ in rows)
    for part, result in rows:
        print(f"  {part:<{width}}  {result}")
    ok = all(result.startswith("ok") for _, result in rows)
    if not ok:
        print(f"the GPU install is incomplete: {GPU_INSTALL_HINT}")
    return ok


def unusable_gpu() -> str | None:
    """Why this machine should run the GPU checks but cannot: CuPy installed but unusable, or an NVIDIA
    driver (nvidia-smi) without CuPy. None when there is a working GPU, or no sign of one."""
    if is_cupy():
        return None
    if CUPY_PROBLEM:
        return CUPY_PROBLEM
    if shutil.which("nvidia-smi"):
        return f"an NVIDIA driver is installed (nvidia-smi) but {BACKEND_REASON}"
    return None


def device_summary() -> list[tuple[str, str]]:
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    free, total = cupy.cuda.runtime.memGetInfo()
    return [
        ("device", props["name"].decode()),
        ("compute capability", ".".join(dev.compute_capability)),
        ("SMs", str(dev.attributes["MultiProcessorCount"])),
        ("memory", f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} free)"),
        (
            "shared memory / block",
            f"{dev.attributes['MaxSharedMemoryPerBlock']} B, "
            f"{dev.attributes['MaxSharedMemoryPerBlockOptin']} B opt-in",
        ),
        ("CuPy / CUDA runtime", f"{cupy.__version__} / {cupy.cuda.runtime.runtimeGetVersion()}"),
    ]


def run_gpu_tests(root: Path, extra: list[str]) -> tuple[list[dict], float, str]:
    """pytest -m gpu tests/ in the checkout ``root`` -> per-file rows {file, passed, failed, skipped},
    seconds, output tail."""
    outcomes, seconds, out = pytest_outcomes(root, ["tests", "-m", "gpu", *extra], TEST_TIMEOUT_S)
    rows: dict[str, dict] = {}
    for name, outcome in outcomes:
        row = rows.setdefault(name, {"file": name, "passed": 0, "failed": 0, "skipped": 0})
        row[outcome] += 1
    if not rows:
        rows["?"] = {"file": "(pytest produced no report)", "passed": 0, "failed": 1, "skipped": 0}
    return list(rows.values()), seconds, out


def run_attention_bench(max_n: int, repeat: int, out_dir: Path) -> tuple[bool, str, float]:
    """The attention benchmark on the GPU -> (validated, its output, seconds)."""
    from .benchmarks import attention

    buf = io.StringIO()
    t0 = time.perf_counter()
    ok = True
    with contextlib.redirect_stdout(buf):
        print(attention.io_table())
        try:
            attention.run_gpu(attention.sizes_up_to(attention.GPU_NS, max_n), repeat, out_dir)
        except BenchmarkError as exc:
            print(f"validation failed: {exc}")
            ok = False
    return ok, buf.getvalue(), time.perf_counter() - t0


DECODE_ATTENTIONS = ("naive", "flash", "cuda", "cuda_v2")
DECODE_PROMPTS = {"target": [1, 2, 3, 4, 5, 6, 7, 8], "smollm2-135m": [1, 504, 3575, 282, 4649, 314, 260, 1345]}
HOST_TOKENS = """import json, sys
from minillm import generate, load_model
model, _ = load_model(sys.argv[1], weights=sys.argv[4])
print(json.dumps(generate(model, json.loads(sys.argv[2]), int(sys.argv[3]), temperature=0).tokens))"""


def host_tokens(model_name: str, prompt: list, n: int, weights: str) -> list:
    """Greedy tokens of the model (its weights kept as ``weights`` says) computed by NumPy, in a subprocess: the
    reference the device must give."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MINILLM_BACKEND": "numpy"}
    out = subprocess.run([sys.executable, "-c", HOST_TOKENS, model_name, json.dumps(prompt), str(n), weights], env=env,
                         capture_output=True, text=True, timeout=TEST_TIMEOUT_S, check=True)
    return json.loads(out.stdout)


def decode_paths(model, model_name: str, draft=None, attentions=DECODE_ATTENTIONS) -> dict:
    """{path: decode(n) -> the n greedy tokens}: the array code with each attention, the static step eager and
    replayed from its graph, and speculative decoding (a draft model on static steps, or the shipped EAGLE
    draft for SmolLM2)."""
    from ..generate import generate, greedy_generate
    from ..speculative import greedy_speculative_generate

    prompt = DECODE_PROMPTS[model_name]

    def array_code(attention):
        def decode(n):
            model.set_attention(attention)
            return generate(model, prompt, n, temperature=0).tokens

        return decode

    paths = {f"array code, attention {a}": array_code(a) for a in attentions}
    paths["static step, fused kernels"] = lambda n: greedy_generate(model, prompt, n)
    paths["static step, fused, CUDA graph"] = lambda n: greedy_generate(model, prompt, n, graph=True)
    if draft is not None:
        paths["speculative k=4, static steps + graphs"] = lambda n: greedy_speculative_generate(
            model, draft, prompt, n, k=4, graph=True)
    else:
        from ..eagle import EagleDraft, EagleProposer, shipped_draft_path
        from ..token_tree import tree_generate

        eagle = EagleDraft.load(model, shipped_draft_path(model_name))
        paths["EAGLE chain k=4, array code"] = lambda n: tree_generate(
            model, prompt, n, EagleProposer(eagle, "chain", depth=4), temperature=0.0).tokens
    return paths


def engine_decode(model, prompt: list):
    """decode(n) through chapter 10's continuous-batching engine: the prompt and two of its prefixes decoded
    together, greedy; it returns the full prompt's tokens (per token: a step of the three)."""
    from ..serving import Engine, Request

    def decode(n):
        engine = Engine(model, num_blocks=3 * (len(prompt) + n) // 16 + 6, page_size=16)
        states = [engine.add_request(Request(tuple(prompt[:cut]), n, temperature=0.0)) for cut in (len(prompt), 5, 3)]
        while engine.has_unfinished:
            engine.step()
        return list(states[0].output)

    return decode


def run_decode_bench(steps: int = 32, models=("target", "smollm2-135m"), attentions=DECODE_ATTENTIONS,
                     repeat: int = 3, weights: str | None = None) -> tuple[str, float, bool]:
    """ms per decoded token on the GPU, greedy, for the shipped target (with its draft) and SmolLM2 (with its
    EAGLE draft) when installed, by path, every model loaded with ``weights`` (``--weights``; default
    ``registry.DEFAULT_WEIGHTS``); every path's tokens are first checked against a NumPy run's of the same
    load -> (table, seconds, every path gave the host's tokens)."""
    from ..gguf import GGUFError
    from ..notebook import format_table
    from ..registry import DEFAULT_WEIGHTS, SMOLLM2, load_model
    from .benchmarks.device_calls import seconds_per_token

    weights = DEFAULT_WEIGHTS if weights is None else weights
    t0, rows, ok = time.perf_counter(), [], True
    for name, draft_name in (("target", "draft"), (SMOLLM2, None)):
        if name not in models:
            continue
        try:
            model, _ = load_model(name, weights=weights)
        except GGUFError as exc:
            rows.append({"model": name, "path": f"skipped: {first_line(exc)}"})
            continue
        draft = load_model(draft_name, weights=weights)[0] if draft_name else None
        want = host_tokens(name, DECODE_PROMPTS[name], steps + 1, weights)
        paths = decode_paths(model, name, draft, attentions)
        paths["serving engine, 3 requests at once"] = engine_decode(model, DECODE_PROMPTS[name])
        for path, decode in paths.items():
            same = decode(steps + 1) == want
            ok &= same
            ms = 1e3 * seconds_per_token(decode, steps, repeat) if same else float("nan")
            rows.append({"model": name, "path": path, "tokens = NumPy's": "yes" if same else "NO", "ms / token": ms})
    title = f"decode on the GPU: greedy, prompt 8 tokens, {steps} steps, best of {repeat}, weights {weights}"
    table = format_table(rows, ["model", "path", "tokens = NumPy's", "ms / token"])
    return f"{title}\n{table}", time.perf_counter() - t0, ok


QUANT_ROWS = (1, 16)  # token rows of the quantized products: a decode step, a verification of 16 tokens
QUANT_TOL = 1e-5  # kernel vs cuBLAS, relative to each output's sum of |x w| (float32 sums in two orders)


def dense_product(x, w):
    return x @ w.T


def run_quant_bench(shapes=None, rows=QUANT_ROWS, repeat: int = 5, timer=None) -> tuple[str, float, bool]:
    """kernels/quant.cu (minillm.qcuda) against cuBLAS on the dequantized float32 weight, on the device: each of
    SmolLM2-135M's weight shapes (``bench quantized``'s pass) unless ``shapes`` are given, Q8_0 and Q4_1, n token
    rows. Each product is first checked against cuBLAS's, then both are timed (``timer(fn)`` -> seconds; CUDA
    events, the median of ``repeat``) -> (table, seconds, every product matched). GB/s: the weight's bytes in
    its format (float32 for cuBLAS) over the time."""
    import numpy as np

    from ..backend import to_numpy, xp
    from ..notebook import format_table
    from ..qcuda import quant_product, to_device
    from ..quantize import Q4_1, Q8_0
    from .benchmarks.attention import event_time
    from .benchmarks.quantized import pass_shapes

    timer = timer or partial(event_time, repeat=repeat)
    t0, table, ok, rng = time.perf_counter(), [], True, np.random.default_rng(0)
    for m, k in shapes or sorted(set(pass_shapes())):
        weight = rng.standard_normal((m, k)).astype(np.float32)
        for fmt in (Q8_0, Q4_1):
            w = fmt.quantize(weight)
            host_dense = w.dequantize()
            blocks, dense = to_device(w), xp.asarray(host_dense)
            for n in rows:
                host_x = rng.standard_normal((n, k)).astype(np.float32)
                x = xp.asarray(host_x)
                error = np.abs(to_numpy(quant_product(x, blocks)) - to_numpy(dense_product(x, dense)))
                same = bool(np.all(error <= QUANT_TOL * (np.abs(host_x) @ np.abs(host_dense).T)))
                ok &= same
                t_kernel = timer(partial(quant_product, x, blocks, check_status=False)) if same else float("nan")
                t_cublas = timer(partial(dense_product, x, dense))
                table.append({"W (m x k)": f"{m} x {k}", "format": fmt.__name__, "n": n, "= cuBLAS": "yes" if same
                              else "NO", "kernel us": 1e6 * t_kernel, "cuBLAS f32 us": 1e6 * t_cublas,
                              "cuBLAS / kernel": t_cublas / t_kernel, "kernel GB/s": w.raw.nbytes / t_kernel / 1e9,
                              "cuBLAS GB/s": host_dense.nbytes / t_cublas / 1e9})
    title = f"quantized products on the device: kernels/quant.cu vs cuBLAS on the float32 weight, median of {repeat}"
    return f"{title}\n{format_table(table)}", time.perf_counter() - t0, ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.tools.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--max-n", type=positive_int, default=16384, help="largest N of the attention benchmark")
    p.add_argument("--repeat", type=count, default=5, help="timed repeats per benchmark point")
    p.add_argument("--root", default=None, help="the project checkout whose GPU tests to run (default: found)")
    add_weights_option(p)  # the decode section's models
    add_output_args(p)
    p.add_argument("--record", default=None, help="append the summary to this markdown file (docs/gpu.md)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--install-only", action="store_true", help="only check the GPU install (works without a GPU)")
    p.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = p.parse_args(argv)

    if args.install_only:
        print("gpu_check: the GPU install (no GPU needed)")
        return 0 if report_install() else 1
    problem = unusable_gpu()
    if problem:
        print(f"gpu_check: FAILED -- {problem}")
        report_install()
        return 1
    if not is_cupy():
        print(f"gpu_check: skipped -- no CuPy and no NVIDIA driver here ({BACKEND_REASON}). Nothing to check.")
        return 0
    try:
        root = None if args.skip_tests else project_root(args.root)
        out_dir = figure_dir(args)
    except ProjectRootError as exc:
        p.error(str(exc))
    t_start = time.perf_counter()
    lines = [f"gpu_check {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"]
    lines += [f"  {k:<22} {v}" for k, v in device_summary()]

    summary = []  # (check, result, seconds)
    test_tail = ""
    if not args.skip_tests:
        rows, secs, test_tail = run_gpu_tests(root, args.pytest_args)
        for r in rows:
            result = "FAIL" if r["failed"] else "ok"
            summary.append((f"tests {r['file']}", f"{result}: {r['passed']} passed, {r['failed']} failed, "
                                                  f"{r['skipped']} skipped", None))
        summary.append(("tests (all, -m gpu)", "", secs))

    ok_bench, bench_out, secs = run_attention_bench(args.max_n, args.repeat, out_dir)
    summary.append(("bench attention (kernel vs naive)", "ok" if ok_bench else "FAIL (validation)", secs))

    decode_table, secs, ok_decode = run_decode_bench(weights=args.weights)
    summary.append(("decode (ms per token)", "ok" if ok_decode else "FAIL (tokens differ from NumPy's)", secs))

    quant_table, secs, ok_quant = run_quant_bench(repeat=args.repeat)
    summary.append(("quantized products (vs cuBLAS)", "ok" if ok_quant else "FAIL (differs from cuBLAS)", secs))

    total = time.perf_counter() - t_start
    width = max(len(c) for c, _, _ in summary)
    lines.append("")
    lines += [f"  {c:<{width}}  {r:<45} {'' if s is None else f'{s:6.1f} s'}" for c, r, s in summary]
    lines.append(f"  {'total':<{width}}  {'within budget' if total <= TIME_BUDGET_S else 'OVER BUDGET':<45} "
                 f"{total:6.1f} s")
    lines.append("")
    lines.append(bench_out.rstrip())
    lines += ["", decode_table, "", quant_table]
    failed = any(r.startswith("FAIL") for _, r, _ in summary)
    if failed and test_tail:
        lines += ["", "pytest output:", test_tail]
    report = "\n".join(lines)
    print(report)
    if args.record:
        stamp = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
        with open(args.record, "a") as f:
            f.write(f"\n### Run of {stamp}\n\n```\n{report}\n```\n")
        print(f"\nappended to {args.record}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
