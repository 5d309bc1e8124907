"""kernels/quant.cu (minillm.qcuda) equals x @ W.dequantize().T for both GGUF block formats, Q8_0 and Q4_1, on the
shapes that break such kernels: every n from 1 to 16 token rows, a row count m that leaves warps of the last block
without rows, one block per row (k = 32), SmolLM2's k = 576 (x staged in two tiles) and its MLP's k = 1536, rows whose
fp16 scales are subnormal. Each classic mistake (kernels.mutants.QUANT_MUTANTS: the nibbles read the wrong way round,
the scale of the next block, the minimum dropped, a warp that leaves before the barriers) fails these checks; the
launcher and the kernel itself refuse n > 16 and k that is not a whole number of blocks. nvcc builds it for Ampere
and Hopper without spills.

The emulated launches run no device code (host_only); on a device (CuPy, or MINILLM_BACKEND=strict, where the
stand-in's RawKernel runs the same emulation) the product runs the kernel from the backend's arrays."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from minillm import qcuda, strict
from minillm.backend import is_gpu, to_numpy, xp
from minillm.kernels import build
from minillm.kernels.build import KernelError
from minillm.kernels.mutants import QUANT_MUTANTS, mutate_kernel, write_kernel_mutant
from minillm.quantize import F32, Q4_1, Q8_0, QK

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation compiles quant.cu with g++")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not installed")
EMULATED = [pytest.mark.host_only, needs_gxx]
FORMATS = {"Q8_0": Q8_0, "Q4_1": Q4_1}


def marked(value, fmt: str):
    """A parameter whose case quantizes with Q4_1.quantize, exercise 13.1, carries that exercise's mark."""
    return pytest.param(value, marks=pytest.mark.uses_exercise("13.1")) if fmt == "Q4_1" else value


FORMAT_PARAMS = [marked(fmt, fmt) for fmt in FORMATS]
TERM_TOL = 1e-6  # float32 sums of k terms in another order: within a millionth of the sum of the |terms|


def case(fmt: str, n: int, m: int, k: int, seed: int = 0):
    """x (n, k) and W (m, k) in format ``fmt``: blocks scaled by factors 0.25..4 (neighbouring blocks have
    different scales), centred away from 0 (Q4_1's minimum matters), row 0 tiny (its fp16 scales subnormal)."""
    rng = np.random.default_rng(seed)
    factors = np.repeat(rng.uniform(0.25, 4.0, (m, k // QK)), QK, axis=1)  # (m, k): one factor per block
    W = (rng.standard_normal((m, k)) + 0.5) * factors
    W[0] *= 1e-4
    return rng.standard_normal((n, k)).astype(np.float32), FORMATS[fmt].quantize(W.astype(np.float32))


def assert_equals_reference(y, x, w):
    """y = x @ W.dequantize().T (computed in float64) within TERM_TOL of each output's sum of |x w|."""
    want = qcuda.reference(x.astype(np.float64), w)
    bound = TERM_TOL * (np.abs(x).astype(np.float64) @ np.abs(w.dequantize()).T)
    assert y.shape == want.shape and y.dtype == np.float32
    excess = np.abs(y - want) - bound
    assert np.all(excess <= 0), f"off by {np.nanmax(np.abs(y - want)):.3g} (bound {bound.max():.3g})"


# ---- the emulated kernel equals the reference ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
@pytest.mark.parametrize("n", range(1, 17))
@pytest.mark.host_only
@needs_gxx
def test_every_row_count_equals_the_reference(fmt, n):
    """n = 1..16 token rows through one block per row (k = 32); m = 5 leaves warp 2 one row and warp 3 none."""
    x, w = case(fmt, n, 5, QK, seed=n)
    assert_equals_reference(qcuda.quant_product(x, w, emulated=True), x, w)


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
@pytest.mark.parametrize("n, m, k", [(1, 13, 576), (16, 13, 576), (2, 3, 1536)])
@pytest.mark.host_only
@needs_gxx
def test_smollm2_widths_equal_the_reference(fmt, n, m, k):
    """SmolLM2-135M's k = 576 (x in two tiles, 512 + 64 columns) and 1536 (three), over two blocks of rows."""
    x, w = case(fmt, n, m, k)
    assert_equals_reference(qcuda.quant_product(x, w, emulated=True), x, w)


# ---- refusals: the launcher before launching, the kernel through its status word --------------------------------


@pytest.mark.host_only
def test_the_launcher_refuses_what_the_kernel_cannot_take():
    """n outside 1..16, x whose k is not the weight's (not even a whole number of blocks), a format the kernel
    does not read: one clear error each, before anything is built or launched."""
    x, w = case("Q8_0", 1, 3, QK)
    with pytest.raises(ValueError, match=r"1\.\.16 token rows .* got 17"):
        qcuda.quant_product(np.zeros((17, QK), np.float32), w, emulated=True)
    with pytest.raises(ValueError, match="1..16 token rows"):
        qcuda.quant_product(np.zeros((0, QK), np.float32), w, emulated=True)
    with pytest.raises(ValueError, match="33 inputs per row but the weight"):
        qcuda.quant_product(np.zeros((1, 33), np.float32), w, emulated=True)
    with pytest.raises(ValueError, match="2-D float array"):
        qcuda.quant_product(x[0], w, emulated=True)
    with pytest.raises(TypeError, match="Q8_0 or Q4_1 weights"):
        qcuda.quant_product(x, F32.quantize(np.ones((3, QK), np.float32)), emulated=True)


@pytest.mark.parametrize("n, k, code", [(17, 32, "QUANT_BAD_ROWS"), (0, 32, "QUANT_BAD_ROWS"),
                                        (1, 33, "QUANT_BAD_K"), (1, 16, "QUANT_BAD_K")])
@pytest.mark.host_only
@needs_gxx
def test_the_kernel_refuses_through_its_status_word(n, k, code):
    """Launched without the launcher's checks, the kernel itself writes its QUANT_* code, writes no output, and
    build.raise_status names the limit."""
    _, w = case("Q8_0", 1, 3, QK)
    x = np.ones((max(n, 1), k), np.float32)
    y, status = qcuda.launch_emulated("q8_0_product", qcuda.block_words(w.raw), x, n, 3, k)
    assert status == build.QUANT_DEFINES[code][0]
    assert np.isnan(y).all()  # nothing written
    with pytest.raises(KernelError, match=f"q8_0_product refused the launch: {code}"):
        build.raise_status(status, "q8_0_product")


@pytest.mark.host_only
def test_block_words_keep_the_bytes_in_order():
    """One Q8_0 block (34 bytes) -> 9 int32 words: the 34 bytes as they are, 2 zero bytes, then the red zone."""
    _, w = case("Q8_0", 1, 1, QK)
    words = qcuda.block_words(w.raw, red_zone=2)
    assert words.dtype == np.int32 and words.size == 9 + 2
    np.testing.assert_array_equal(words[:9].view(np.uint8)[:34], w.raw.reshape(-1))
    np.testing.assert_array_equal(words[:9].view(np.uint8)[34:], [0, 0])
    np.testing.assert_array_equal(words[9:], [-1, -1])


@pytest.mark.host_only
def test_every_kernel_of_the_file_has_a_format():
    assert set(qcuda.KERNEL_OF.values()) == set(build.QUANT.names)


# ---- on a device: the backend's arrays --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not is_gpu(), reason="the kernel on a device: CuPy, or MINILLM_BACKEND=strict")
@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_the_kernel_runs_from_the_backends_arrays(fmt):
    """quant_product on device arrays, the weight uploaded once: the reference's result; under the strict stand-in
    (the same emulation behind its RawKernel) bit for bit the emulated kernel's."""
    x, w = case(fmt, 3, 13, 576)
    blocks = qcuda.to_device(w)
    y = qcuda.quant_product(xp.asarray(x), blocks)
    assert type(y) is type(blocks.words)  # the backend's array: it stayed on the device
    assert_equals_reference(to_numpy(y), x, w)
    if xp is strict:
        np.testing.assert_array_equal(to_numpy(y), qcuda.quant_product(x, w, emulated=True))


# ---- the bug zoo: every classic mistake fails the same checks ---------------------------------------------------

MUTANT_CASES = {  # mutant -> (format, n, m, k) of the case that catches it
    "q4_1_nibbles_swapped": ("Q4_1", 2, 5, 64),
    "q8_0_next_block_scale": ("Q8_0", 2, 5, 64),
    "q4_1_no_min": ("Q4_1", 2, 5, 64),
    "warp_leaves_early": ("Q8_0", 1, 5, QK),
}


def mutant(name) -> Path:
    out = Path(tempfile.gettempdir()) / "minillm-kernel-mutants"
    out.mkdir(exist_ok=True)
    return write_kernel_mutant(name, build.QUANT_SOURCE, out, QUANT_MUTANTS)


@pytest.mark.host_only
def test_every_mutant_has_a_case_and_edits_the_current_kernel_once():
    assert set(MUTANT_CASES) == set(QUANT_MUTANTS)
    for name in QUANT_MUTANTS:
        mutate_kernel(name, build.QUANT_SOURCE.read_text(), QUANT_MUTANTS)


@pytest.mark.parametrize("name", [marked(name, MUTANT_CASES[name][0]) for name in sorted(QUANT_MUTANTS)])
@pytest.mark.host_only
@needs_gxx
def test_the_checks_catch_each_mutant(name):
    """The case passes on the real kernel and fails on the mutant: a wrong output, or (the warp that leaves early)
    the emulator's report of threads waiting at __syncthreads() for threads that left."""
    x, w = case(*MUTANT_CASES[name], seed=7)
    assert_equals_reference(qcuda.quant_product(x, w, emulated=True), x, w)
    if name == "warp_leaves_early":
        with pytest.raises(KernelError, match="left the kernel|already left"):
            qcuda.quant_product(x, w, source=mutant(name))
    else:
        with pytest.raises(AssertionError, match="off by"):
            assert_equals_reference(qcuda.quant_product(x, w, source=mutant(name)), x, w)


# ---- nvcc: builds for Ampere and Hopper without register spills ------------------------------------------------


@pytest.mark.host_only
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_builds_without_spills(arch):
    """Both kernels: no spill stores or loads, no stack frame (the sums stay in registers), at most 255 registers."""
    report = build.nvcc_resource_report(arch, build.QUANT_SOURCE)
    assert set(report["functions"]) == set(build.QUANT.names)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report["report"]
    assert report["stack_frame"] == 0 and report["registers"] <= 255, report["report"]


@pytest.mark.skipif(not is_gpu(), reason="the kernel on a device: CuPy, or MINILLM_BACKEND=strict")
def test_gpu_checks_quantized_section_checks_each_product_against_cublas(monkeypatch):
    """gpu_check's table of the quantized products: each one first equal to the float32 product of the dequantized
    weight on the device (cuBLAS on a GPU), then timed; a product that differs is reported, not timed."""
    from minillm.tools import gpu_check

    timings = []

    def timer(fn):
        fn()
        timings.append(fn)
        return 1e-3

    table, _, ok = gpu_check.run_quant_bench(shapes=[(13, 576)], rows=(1, 16), repeat=1, timer=timer)
    assert ok, table
    assert len(timings) == 2 * 2 * 2  # two formats x two row counts x (kernel, cuBLAS)
    for fmt in ("Q8_0", "Q4_1"):
        assert fmt in table, table
    monkeypatch.setattr(gpu_check, "dense_product", lambda x, w: x @ w.T + 1.0)
    table, _, ok = gpu_check.run_quant_bench(shapes=[(13, 576)], rows=(1,), repeat=1, timer=timer)
    assert not ok and " NO " in table, table
