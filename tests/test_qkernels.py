"""Quantized products (chapter 13): the packed numba kernels against the NumPy reference, and their
machine code.

``check_product`` is the specification: for every format, ``qkernels.product(x, pack(W))`` equals
``x @ W.dequantize().T`` up to float32 rounding of a reordered sum, for n = 1..17 token rows (every
row tile, the zero-padded ones, and 17 = a second pass), m not a multiple of the panel of 16 and k
not a multiple of the 8 interleaved sums. The assembly test fails when the inner loop is scalar,
and a planted build (numba's default settings) shows that it can fail. The int8 option (x quantized
per block, integer products: not exact) has its own error bound.
"""

import contextlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from minillm.kv_cache import common_prefix_length
from minillm.quantize import BF16, F32, Q4_1, Q8_0, QK, Int8PerChannel, QuantError

qkernels = pytest.importorskip("minillm.qkernels")  # needs numba

pytestmark = pytest.mark.host_only  # numba on the host CPU only

FORMATS = {"F32": F32, "BF16": BF16, "Q8_0": Q8_0, "Q4_1": Q4_1}
TOL = 2e-6  # relative to sum_t |x[i, t] w[j, t]|: float32 rounding of a sum reordered into 8 chains


def check_product(fmt, w, x):
    """product(x, pack(quantize(w))) == x @ dequantize(w).T (float64), row by row."""
    weight = FORMATS[fmt].quantize(w)
    ref_w = weight.dequantize().astype(np.float64)
    y = qkernels.product(x, qkernels.pack(weight))
    assert y.dtype == np.float32 and y.shape == (x.shape[0], w.shape[0])
    ref = x.astype(np.float64) @ ref_w.T
    scale = np.abs(x).astype(np.float64) @ np.abs(ref_w).T
    assert np.all(np.abs(y - ref) <= TOL * scale + 1e-30), f"{fmt} n={x.shape[0]}: {np.abs(y - ref).max()}"


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=pytest.mark.uses_exercise("13.1")) if f == "Q4_1" else f
                                 for f in FORMATS])  # Q4_1.quantize is exercise 13.1
def test_every_format_matches_the_reference_for_1_to_17_rows(fmt):
    """n = 1..17 (tiles 1 to 6, 8, 16, padded tiles, 17 = 16 + 1), m = 37 (three panels, the last
    padded), k = 96 (three blocks; the F32 and BF16 tails need k % 8 != 0, below)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 3 * QK)).astype(np.float32)
    for n in range(1, 18):
        check_product(fmt, w, rng.standard_normal((n, 3 * QK)).astype(np.float32))


@pytest.mark.parametrize("fmt", ["F32", "BF16"])
@pytest.mark.parametrize("n", [1, 3])
def test_float_formats_take_any_inner_size(fmt, n):
    """k = 77 leaves a tail after the interleaved sums (77 is odd: a tail for every U > 1; U = 8 at n = 1 on
    AVX-512, 2 on AVX2)."""
    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((18, 77)).astype(np.float32), rng.standard_normal((n, 77)).astype(np.float32)
    check_product(fmt, w, x)


@pytest.mark.uses_exercise("13.1")
def test_pack_layout_example():
    """A Q4_1 (1536, 576) weight -> dm (96, 18, 2, 16) and qs (96, 18, 16, 16): the file's 20 bytes per block."""
    w = np.random.default_rng(2).standard_normal((1536, 576)).astype(np.float32)
    weight = Q4_1.quantize(w)
    packed = qkernels.pack(weight)
    assert [a.shape for a in packed.arrays] == [(96, 18, 2, 16), (96, 18, 16, 16)]
    assert packed.nbytes == weight.raw.nbytes


def test_bad_inputs_are_refused():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((20, 64)).astype(np.float32)
    packed = qkernels.pack(Q8_0.quantize(w))
    with pytest.raises(QuantError, match="does not match the weight"):
        qkernels.product(np.ones((2, 63), np.float32), packed)
    with pytest.raises(QuantError, match="does not match the weight"):
        qkernels.product(np.ones((0, 64), np.float32), packed)
    with pytest.raises(QuantError, match="must be float32"):
        qkernels.product(np.ones((2, 64)), packed)
    with pytest.raises(QuantError, match="no kernel for Int8PerChannel"):
        qkernels.pack(Int8PerChannel.quantize(w))
    with pytest.raises(QuantError, match="block of 32"):
        qkernels.pack(Q4_1.quantize(w[:, :48]))
    with pytest.raises(QuantError, match="NaN or inf"):
        qkernels.pack(np.full((4, 8), np.inf, np.float32))


@pytest.mark.parametrize("fmt, rows", [("Q4_1", 1), ("Q8_0", 8)])
def test_inner_loop_is_vector_code(fmt, rows):
    """The kernel's FMAs are vector FMAs (ymm or zmm), none scalar: the settings in vector_compile work."""
    counts = qkernels.vector_fma_count(qkernels.machine_code(fmt, rows))
    assert counts["zmm"] + counts["ymm"] >= rows and counts["scalar"] == 0, counts


needs_int8 = pytest.mark.skipif(qkernels.int8_isa() is None, reason="the int8 kernels need AVX512-VNNI or AVX2")


@needs_int8
@pytest.mark.parametrize("fmt", ["Q8_0", pytest.param("Q4_1", marks=pytest.mark.uses_exercise("13.1"))])
def test_int8_x_stays_within_its_bound_and_is_not_the_default(fmt):
    """int8_x=True quantizes x per block of 32 (dx = max |x| / 127): the product is x_hat @ W.T, so it errs by at
    most sum_b (dx_b / 2) sum_{t in b} |w_t| (+ float32 rounding), n = 1..17 as above. It is a different product:
    somewhere it misses the exact tolerance, which the default path never does."""
    rng = np.random.default_rng(5)
    weight = FORMATS[fmt].quantize(rng.standard_normal((37, 3 * QK)).astype(np.float32))
    ref_w = weight.dequantize().astype(np.float64)
    packed = qkernels.pack(weight)
    beyond_tol = False
    for n in range(1, 18):
        x = rng.standard_normal((n, 3 * QK)).astype(np.float32)
        y = qkernels.product(x, packed, int8_x=True)
        assert y.dtype == np.float32 and y.shape == (n, 37)
        error = np.abs(y - x.astype(np.float64) @ ref_w.T)
        scale = np.abs(x).astype(np.float64) @ np.abs(ref_w).T
        dx = np.abs(x.astype(np.float64)).reshape(n, -1, QK).max(-1) / 127  # (n, nb)
        w_sums = np.abs(ref_w).reshape(37, -1, QK).sum(-1)  # (m, nb)
        bound = (dx / 2) @ w_sums.T + TOL * scale
        assert np.all(error <= bound), f"{fmt} n={n}: {(error / bound).max():.3g} of the bound"
        beyond_tol |= bool(np.any(error > TOL * scale))
    assert beyond_tol, "int8_x gave the exact product: the option did not take the int8 kernels"
    with pytest.raises(QuantError, match="int8_x needs"):
        qkernels.product(np.ones((1, 64), np.float32), qkernels.pack(F32.quantize(np.ones((4, 64), np.float32))),
                         int8_x=True)


@needs_int8
@pytest.mark.parametrize("fmt", ["Q8_0", pytest.param("Q4_1", marks=pytest.mark.uses_exercise("13.1"))])
def test_int8_x_is_the_product_of_the_quantized_x(fmt):
    """The integer sums are exact: the int8_x product equals x_hat @ W.T up to float32 rounding, x_hat being
    quantize_x's own int8 values times their scales (a wrong shuffle of the 4-byte groups, a saturated int16
    pair sum or Q8_0's missing 128 sum(q_x) would be off by far more)."""
    rng = np.random.default_rng(6)
    weight = FORMATS[fmt].quantize(rng.standard_normal((37, 3 * QK)).astype(np.float32))
    ref_w = weight.dequantize().astype(np.float64)
    packed = qkernels.pack(weight)
    for n in (1, 3, 8, 17):
        x = 4 * rng.standard_normal((n, 3 * QK)).astype(np.float32)
        xq, dx, _ = qkernels.quantize_x(x, n)  # (n, k), (nb, n)
        x_hat = (xq.reshape(n, -1, QK) * dx.T[:, :, None].astype(np.float64)).reshape(n, -1)
        scale = np.abs(x_hat) @ np.abs(ref_w).T
        error = np.abs(qkernels.product(x, packed, int8_x=True) - x_hat @ ref_w.T)
        assert np.all(error <= TOL * scale + 1e-30), f"{fmt} n={n}: {(error / scale).max():.3g}"


@needs_int8
@pytest.mark.parametrize("fmt, rows", [("Q4_1", 1), ("Q8_0", 4)])
def test_int8_kernels_use_integer_dot_products(fmt, rows):
    """The int8 kernels' dot products are this CPU's: zmm vpdpbusd with AVX512-VNNI (8 per block of 16 outputs and
    each row), ymm vpmaddubsw with AVX2 (16 per block of 16 outputs; LLVM keeps the loop over rows a loop)."""
    counts = qkernels.vector_fma_count(qkernels.machine_code(fmt, rows, int8_x=True))
    if qkernels.int8_isa() == "avx512vnni":
        assert counts["vnni"] >= 8 * rows, counts
    else:
        assert counts["maddubs"] >= 16 and counts["vnni"] == 0, counts


def test_the_vector_check_catches_scalar_code(monkeypatch):
    """Planted: the same kernel built with numba's default settings (no vector_compile) is scalar code,
    which the count above rejects."""
    monkeypatch.setattr(qkernels, "vector_compile", contextlib.nullcontext)
    counts = qkernels.vector_fma_count(qkernels.machine_code("F32", 1))
    assert counts["scalar"] > 0 and counts["zmm"] + counts["ymm"] == 0, counts


needs_avx512 = pytest.mark.skipif(qkernels.host_vector()[0] != 16, reason="512-bit vectors need AVX-512")
HALF_WIDTH = "import minillm.qkernels as q; print(q.vector_fma_count(q.machine_code('Q4_1', 16))['zmm'])"


@needs_avx512
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_on_avx512_the_kernels_use_512_bit_vectors(fmt):
    """kernel_shape lays a panel row out as one zmm: every FMA of the inner loop is a zmm one (LLVM's tuning for
    Intel's AVX-512 CPUs would otherwise compile them at 256 bits), and the 16-row kernel's sums stay in the 32
    registers."""
    asm = qkernels.machine_code(fmt, 16)
    assert all("%ymm" not in line for line in qkernels.inner_loop(asm) if "vfmadd" in line)
    assert qkernels.vector_fma_count(asm)["zmm"] >= 16 and qkernels.stack_spills(asm) == 0


@needs_avx512
def test_the_width_check_catches_256_bit_code():
    """Planted: a process whose numba compiles with LLVM's "prefer-256-bit" (the user's NUMBA_CPU_FEATURES wins
    over cpu_target.full_width) gets no zmm FMA, which the test above rejects."""
    from numba.core import codegen

    from minillm import cpu_target

    env = {**os.environ, "NUMBA_CPU_FEATURES": f"{codegen.get_host_cpu_features()},+{cpu_target.PREFER_256}"}
    out = subprocess.run([sys.executable, "-c", HALF_WIDTH], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == 0


AVX2_ONLY = """import json, numpy as np, minillm.qkernels as q
from minillm.quantize import Q4_1
w = Q4_1.quantize(np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32))
x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
err = float(np.abs(q.product(x, q.pack(w)) - x @ w.dequantize().T).max())
print(json.dumps([q.host_vector(), q.row_tiles(), q.int8_isa(), q.vector_fma_count(q.machine_code("Q4_1", 1)), err]))"""


@needs_avx512
@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
def test_numba_cpu_features_without_avx512_lay_the_kernels_out_for_avx2():
    """The user's NUMBA_CPU_FEATURES with AVX-512 turned off: numba compiles for AVX2, and the kernels are laid out for
    it (8 lanes, 16 registers, tiles up to 8 rows, the AVX2 int8 route), with ymm FMAs only and the reference's
    result: AVX2 measured on an AVX-512 CPU."""
    from numba.core import codegen

    features = ",".join(f"-{f[1:]}" if f.startswith("+avx512") else f
                        for f in codegen.get_host_cpu_features().split(","))
    env = {**os.environ, "NUMBA_CPU_FEATURES": features}
    out = subprocess.run([sys.executable, "-c", AVX2_ONLY], env=env, capture_output=True, text=True, check=True)
    vector, tiles, isa, counts, err = json.loads(out.stdout)
    assert vector == [8, 16] and tiles[-1] == 8 and isa == "avx2", out.stdout
    assert counts["zmm"] == 0 and counts["ymm"] > 0 and err < 1e-4, out.stdout


def test_row_tiles():
    """n rows run with the next compiled tile; 16 rows are a tile where they fit the registers (AVX-512)."""
    assert [qkernels.row_tile(n) for n in (1, 2, 3, 5, 6, 7, 8)] == [1, 2, 3, 5, 6, 8, 8]
    assert qkernels.row_tiles() in ((1, 2, 3, 4, 5, 6, 8, 16), (1, 2, 3, 4, 5, 6, 8))
    if qkernels.row_tiles()[-1] == 16:
        assert qkernels.row_tile(9) == qkernels.row_tile(16) == 16


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_chosen_kernel_keeps_its_sums_in_registers(fmt):
    """The kernel for one row with the chains and lanes that kernel_shape chooses for this CPU (AVX-512: 32 zmm,
    a panel row is one vector; AVX2: 16 ymm, two) stores no vector register to the stack in its inner loop: its
    accumulators and its dequantized weights fit in the register file."""
    asm = qkernels.machine_code(fmt, 1)
    assert qkernels.vector_fma_count(asm)["scalar"] == 0
    assert qkernels.stack_spills(asm) == 0, f"{fmt}: {qkernels.stack_spills(asm)} stack loads and stores"


def test_the_spill_check_catches_too_many_sums():
    """Planted: as many sums per output as the CPU has vector registers (32 zmm accumulators on AVX-512, 32 ymm
    on AVX2: the whole panel is two) cannot all live in registers, and the count above sees the spills in the
    inner loop."""
    registers = qkernels.host_vector()[1]
    assert qkernels.stack_spills(qkernels.machine_code("Q8_0", 1, chains=registers, lanes=qkernels.P)) > 0


@pytest.mark.parametrize("host, shapes", [
    ((16, 32), {1: (8, 16), 2: (4, 16), 3: (2, 16), 4: (2, 16), 5: (1, 16), 6: (1, 16), 8: (1, 16),
                16: (1, 16)}),  # AVX-512: U = 8 // R, whole panels
    ((8, 16), {1: (2, 16), 2: (1, 16), 3: (1, 16), 4: (1, 16), 5: (1, 8), 6: (1, 8), 8: (1, 8),
               16: None})])  # AVX2 (Q8_0)
def test_kernel_shape_follows_the_vector_registers(monkeypatch, host, shapes):
    """The rule on either kind of CPU, whichever this one is: the accumulators within a quarter of the register
    file, with the weights within three quarters; on AVX2 a Q4_1 kernel for 4 rows takes sub-panels of 8 lanes
    (its whole-panel weights need 8 ymm) and 16 rows do not fit at all (the product runs in chunks of 8)."""
    monkeypatch.setattr(qkernels, "host_vector", lambda: host)
    caches = (qkernels.kernel_shape, qkernels.block_shape, qkernels.row_tiles)
    for cache in caches:
        cache.cache_clear()
    try:
        assert {r: qkernels.kernel_shape("Q8_0", r) for r in qkernels.ROW_TILES} == shapes
        assert qkernels.kernel_shape("Q4_1", 4) == ((2, 16) if host[1] == 32 else (1, 8))
        assert qkernels.row_tiles()[-1] == (16 if host[1] == 32 else 8)
        # Q4_1's block sums where they fit (block_shape's table), the wide kernel with kernel_shape's rule elsewhere
        blocks = ({r: (2, 16) for r in (1, 2, 3, 4, 5, 6)} | {8: (1, 16), 16: None} if host[1] == 32 else
                  {1: (2, 16), 2: (1, 16), 3: (2, 8), 4: (1, 8), 5: (1, 8), 6: (1, 8), 8: None, 16: None})
        assert {r: qkernels.block_shape(r) for r in qkernels.ROW_TILES} == blocks
        per_block, wide = qkernels.q4_1_kernel, qkernels.q4_1_wide_kernel
        assert [qkernels.source_kernel("Q4_1", r) for r in (1, 8, 16)] == (
            [per_block, per_block, wide] if host[1] == 32 else [per_block, wide, wide])
        assert qkernels.kernel_shape("Q4_1", 16) == ((1, 16) if host[1] == 32 else None)
    finally:
        for cache in caches:
            cache.cache_clear()
        qkernels.row_tiles.cache_clear()


def test_benchmark_pass_and_table(tmp_path, capsys):
    """bench quantized: a pass is SmolLM2's 211 products (134.5 M weights, 538 MB as float32); the table's
    floors follow from bytes, rows and the measured rates; an existing --json file is never overwritten."""
    from minillm.tools.benchmarks import quantized

    shapes = quantized.pass_shapes()
    weights = sum(m * k for m, k in shapes)
    assert len(shapes) == 211 and weights == 134_479_872
    times = {1: (0.010, 0.009), 4: (0.015, 0.014)}
    rows = quantized.format_rows("Q4_1", weights * 5 // 8, times, bandwidth=20e9, fma_rate=100e9)
    assert [r["n"] for r in rows] == [1, 4] and rows[1]["v(n)"] == pytest.approx(1.5)
    assert rows[0]["memory floor ms"] == pytest.approx(1e3 * weights * 5 / 8 / 20e9)
    assert rows[1]["compute floor ms"] == pytest.approx(1e3 * 4 * weights / 100e9)
    assert rows[1]["x floor"] == pytest.approx(15 / max(rows[1]["memory floor ms"], rows[1]["compute floor ms"]))
    existing = tmp_path / "out.json"
    existing.write_text("keep me")
    with pytest.raises(SystemExit):
        quantized.main(["--json", str(existing)])
    with pytest.raises(SystemExit):
        quantized.main(["--formats", "Q5_0"])
    assert existing.read_text() == "keep me" and "exists" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["Q8_0", pytest.param("Q4_1", marks=pytest.mark.uses_exercise("13.1"))])
def test_packed_weight_gives_back_its_blocks(fmt):
    """unpack is pack's inverse (the file's bytes, row by row); rows() dequantizes only the looked-up rows, as
    the blocks' own dequantize does, and refuses ids outside the table;
    row_slice is a view of whole panels (or the rows packed anew); a prefill's product (more rows than
    a chunk of 16) runs in chunks and matches the reference."""
    rng = np.random.default_rng(4)
    weight = FORMATS[fmt].quantize(rng.standard_normal((300, 96)).astype(np.float32))
    packed = qkernels.pack(weight)
    np.testing.assert_array_equal(packed.unpack(np.arange(300)).raw, weight.raw)
    ids = np.array([[299, 0, 17]])
    np.testing.assert_array_equal(packed[ids], weight.dequantize()[ids])
    np.testing.assert_array_equal(packed.rows(np.arange(300)), weight.dequantize())  # every panel and lane, exactly
    for outside in (-1, 300):  # -1 would read the padding of the last panel
        with pytest.raises(IndexError, match="0..299"):
            packed.rows([3, outside])
    view = packed.row_slice(16, 300)
    assert view.arrays[0].base is not None and view.shape == (284, 96)
    for start, stop in ((16, 300), (5, 48)):
        np.testing.assert_array_equal(packed.row_slice(start, stop).unpack(np.arange(stop - start)).raw,
                                      weight.raw[start:stop])
    x = rng.standard_normal((2, 20, 96)).astype(np.float32)  # (B, T, k): 40 rows, three chunks
    ref = x.astype(np.float64) @ weight.dequantize().astype(np.float64).T
    assert np.abs(packed.product(x) - ref).max() <= TOL * np.abs(ref).max() * 96


def test_decode_benchmark_table(tmp_path, capsys):
    """bench quantized --decode: medians per engine, the ratio to llama.cpp, tokens agreeing with fp32 up to
    the first difference, the memory read from /proc; an unknown engine is refused before anything runs."""
    from minillm.tools.benchmarks import quantized

    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2 and common_prefix_length([5], [5, 6]) == 1
    prompts = [[1] * 10, [1] * 20]
    def run(tokens, prefill_s, decode_s):
        return {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s}

    runs = {"fp32": [run([1, 2], 0.1, 0.03)] * 3,
            "q": [run([1, 3], 0.05, 0.01), run([1, 2], 0.05, 0.02), run([1, 2], 0.05, 0.008)],
            "llama.cpp": [run([1, 2], 0.02, 0.01)] * 3}
    mem = {"rss_mb": 200.0, "peak_mb": 250.0}
    rows = quantized.decode_rows(runs, {e: {"after load": mem, "after answering": mem} for e in runs}, prompts)
    q = rows[1]
    assert q["engine"] == "q" and q["decode ms/token"] == pytest.approx(10.0) and q["x llama.cpp"] == pytest.approx(1.0)
    assert q["same tokens as fp32"] == 1 + 2 + 2 and q["prefill tokens/s"] == pytest.approx(200.0)
    now = quantized.memory_mb()
    assert 0 < now["rss_mb"] <= now["peak_mb"]
    with pytest.raises(SystemExit):
        quantized.main(["--decode", "--engines", "vllm"])
    assert "unknown engine" in capsys.readouterr().err


def test_decode_benchmark_engines_load_what_they_name(monkeypatch):
    """"q" loads the blocks as they are; "q-int8" the same blocks with int8 activations; "q-naive" the blocks with the
    reference attention; "fp32" the reference weights."""
    from minillm import registry
    from minillm.tools.benchmarks import quantized

    class Loaded:
        activations = "float32"

        def set_activations(self, name):
            self.activations = name

    loads = []
    monkeypatch.setattr(registry, "load_model",
                        lambda name, weights, attention: (loads.append((weights, attention)) or Loaded(), None))
    engines = {e: quantized.MinillmEngine(e).model.activations for e in ("q", "q-int8", "q-naive", "fp32")}
    assert engines == {"q": "float32", "q-int8": "int8", "q-naive": "float32", "fp32": "float32"}
    assert loads == [("q", "auto"), ("q", "auto"), ("q", "naive"), ("fp32", "auto")]


@pytest.mark.uses_exercise("8.4")  # the BPE tokenizer
def test_decode_benchmark_context_prompts_are_that_many_tokens():
    from minillm.tools.benchmarks import quantized

    prompts = quantized.context_prompt_ids(300)
    assert [len(p) for p in prompts] == [300, 300] and prompts[0] != prompts[1]


def fake_llama_cpp(monkeypatch, llama, lookup=object) -> None:
    """A stand-in for the optional llama-cpp-python: ``llama`` as ``llama_cpp.Llama``, ``lookup`` as its prompt
    lookup, and the benchmark's file and buffer settings out of the way."""
    import types as pytypes

    from minillm import registry
    from minillm.tools.benchmarks import quantized

    fake = pytypes.ModuleType("llama_cpp")
    fake.Llama = llama
    speculative = pytypes.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lookup
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    monkeypatch.setattr(quantized, "no_extra_buffers", lambda: None)
    monkeypatch.setattr(registry, "smollm2_path", lambda: "model.gguf")


def test_llama_cpp_lookup_engine_drafts_with_llama_cpps_own_lookup(monkeypatch):
    """bench chat-speculation's llama.cpp-lookup: llama-cpp-python's LlamaPromptLookupDecoding with the tokens asked
    for, its generate loop greedy (temperature 0), stopped after exactly the tokens wanted (the loop never ends by
    itself); a fake llama_cpp stands in for the optional package."""

    from minillm.tools.benchmarks import quantized

    made, calls = {}, []

    class Lookup:
        def __init__(self, num_pred_tokens):
            made["num_pred_tokens"] = num_pred_tokens

    class Llama:
        def __init__(self, **kwargs):
            made.update(kwargs)

        def reset(self):
            calls.append("reset")

        def generate(self, prompt, temp, reset):
            calls.append(("generate", list(prompt), temp, reset))
            token = 100
            while True:
                token += 1
                yield token

    fake_llama_cpp(monkeypatch, Llama, Lookup)
    engine = quantized.LlamaCppEngine(lookup=4)
    assert made["num_pred_tokens"] == 4 and isinstance(made["draft_model"], Lookup) and made["n_threads"] == 1
    tokens, first_s, per_token_s = engine.answer([1, 2, 3], 5)
    assert tokens == [101, 102, 103, 104, 105] and first_s >= 0 and per_token_s >= 0
    assert calls == ["reset", ("generate", [1, 2, 3], 0.0, True)]
    assert quantized.LlamaCppEngine().llm is not None and made["draft_model"] is None  # plain: no draft


def test_llama_cpp_samples_with_its_own_sampler_when_asked(monkeypatch):
    """bench chat-speculation --temperature: llama.cpp's plain engine samples through its generate loop at that
    temperature and top-p, with its top-k and min-p off (llama-cpp-python's defaults are 40 and 0.05), stopped after
    the tokens wanted; greedy, it reads its logits' argmax after each eval, as before."""

    from minillm.tools.benchmarks import quantized

    calls = []

    class Llama:
        def __init__(self, **kwargs):
            pass

        def reset(self):
            calls.append("reset")

        def generate(self, prompt, reset, **sampler):
            calls.append(("generate", list(prompt), reset, sampler))
            yield from range(101, 200)

    fake_llama_cpp(monkeypatch, Llama)
    tokens, _, _ = quantized.LlamaCppEngine().answer([1, 2], 3, temperature=0.2, top_p=0.9)
    assert tokens == [101, 102, 103]
    assert calls == ["reset", ("generate", [1, 2], True, {"temp": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0})]


def test_chat_benchmark_samples_as_the_chat_does(monkeypatch):
    """bench chat-speculation --temperature / --top-p: each minillm reply is a turn at those settings; llama.cpp's
    prompt lookup, which verifies greedily, is refused at a temperature above 0 before anything loads."""
    from minillm.sampling import SamplingSettings
    from minillm.tools.benchmarks import chat_speculation

    turns = []

    class FakeChat:
        def reset(self):
            turns.append("reset")

        def turn(self, text, max_new_tokens, temperature, top_p):
            turns.append((text, max_new_tokens, temperature, top_p))
            return SimpleNamespace(tokens=[5, 6], stats=SimpleNamespace(tpot_s=0.01))

    run = chat_speculation.reply(FakeChat(), "hi", 8, SamplingSettings(0.2, None, 0.9))
    assert turns == ["reset", ("hi", 8, 0.2, 0.9)] and run == {"tokens": [5, 6], "ms_per_token": 10.0}
    monkeypatch.setattr(chat_speculation, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(chat_speculation, "load_model", lambda name: pytest.fail("loaded before the refusal"))
    with pytest.raises(ValueError, match="llama.cpp-lookup verifies greedily"):
        chat_speculation.main(["--engines", "plain,llama.cpp-lookup", "--temperature", "0.2"])


def test_decode_benchmark_says_when_an_engine_process_dies():
    """An engine whose process dies in native code (llama.cpp on a CPU whose AMX tiles the machine does not grant)
    is one line naming the engine and the exit code, not a traceback of the pipe."""
    import multiprocessing

    from minillm.tools.benchmarks import quantized
    from minillm.tools.benchmarks.common import BenchmarkError

    context = multiprocessing.get_context("spawn")
    worker = object.__new__(quantized.Worker)
    worker.engine, (worker.conn, child) = "llama.cpp", context.Pipe()
    worker.process = context.Process(target=os._exit, args=(3,))
    worker.process.start()
    child.close()
    with pytest.raises(BenchmarkError, match=r"^engine llama.cpp: its process died \(exit code 3\)$"):
        worker.reply()
