"""Chapter 4, FlashAttention: the specification of online_softmax, flash_attention, the IO model, the kernel.

Every implementation is checked against naive_attention's equation in float64 (on the host) over
awkward shapes: N = 1, one less / equal / one more than the tile (31, 32, 33), several tiles with a
tail (100, 257); head sizes 16, 64, 128; causal on and off; fewer queries than keys (decode,
prefill after a cache). The checks are shown to bite: the classic wrong versions in
minillm/kernels/mutants.py (the real kernel edited at test time to drop a __syncthreads, a tail
bounds check or the rescaling, or to put a barrier in divergent code) and in
tests/fixtures/flash_mutants.py (an online softmax and a tile update without rescaling) are run
through the same checks, and the tests assert that the checks fail for them.

Exercise tests: 4.1 `-k online_softmax`, 4.2 `-k "tile_update or tiled"`, 4.3 `-k io_bytes`.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from host_reference import host_attention as reference

import minillm.flash_attention as fa
from minillm.attention import naive_attention
from minillm.backend import is_cupy, is_gpu, to_numpy, xp
from minillm.kernels import build, launch
from minillm.kernels.mutants import KERNEL_MUTANTS, mutate_kernel, write_kernel_mutant

FIXTURES = Path(__file__).parent / "fixtures"
GRID_N = [1, 31, 32, 33, 100, 257]
GRID_HS = [16, 64, 128]
KERNEL_ATOL = 1e-5  # float32 kernel vs float64 reference
ARRAY_ATOL = 1e-5

MUTANTS = FIXTURES / "flash_mutants.py"  # instructors only: the student edition leaves it out
if MUTANTS.exists():
    _spec = importlib.util.spec_from_file_location("flash_mutants", MUTANTS)
    mutants = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(mutants)
else:
    mutants = None
needs_mutants = pytest.mark.skipif(mutants is None, reason=f"{MUTANTS.name} is for instructors (not in this edition)")


def kernel_mutant(name):
    """The real kernel with one classic bug edited in (minillm.kernels.mutants.KERNEL_MUTANTS)."""
    out = Path(tempfile.gettempdir()) / "minillm-kernel-mutants"
    out.mkdir(exist_ok=True)
    return write_kernel_mutant(name, build.KERNEL_SOURCE, out)

needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None, reason="g++ (C++20) is needed to emulate the kernel"
)
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) not installed")


# ---- shapes and the reference --------------------------------------------------------------------

# (B, nh, Tq, Tk, hs, causal): the square grid N x hs x causal, then fewer queries than keys
SQUARE = [(2, 2, N, N, hs, c) if N <= 33 else (1, 1, N, N, hs, c)
          for N in GRID_N for hs in GRID_HS for c in (True, False)]
RECT_TQ_TK = [(1, 33), (1, 257), (31, 100), (33, 257), (100, 257)]
RECT = [
    (1, 2, Tq, Tk, hs, c) for (Tq, Tk), hs in zip(RECT_TQ_TK, [16, 64, 128, 16, 64]) for c in (True, False)
]
CASES = SQUARE + RECT


def case_id(case):
    B, nh, Tq, Tk, hs, causal = case
    return f"B{B}h{nh}-Tq{Tq}-Tk{Tk}-hs{hs}-{'causal' if causal else 'full'}"


def make_qkv(case, seed=0):
    B, nh, Tq, Tk, hs, _ = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, nh, Tq, hs)).astype(np.float32)
    k = rng.standard_normal((B, nh, Tk, hs)).astype(np.float32)
    v = rng.standard_normal((B, nh, Tk, hs)).astype(np.float32)
    return q, k, v


def on_backend(*arrays):
    """Host arrays -> the backend's arrays (CuPy on a GPU): what the library functions are given."""
    return tuple(xp.asarray(a) for a in arrays)


def host_softmax(x):
    """softmax along the last axis in float64 NumPy on the host: the reference for every softmax test."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))  # a fully masked row (-inf) gives zeros
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def test_reference_is_naive_attention():
    """The host reference (tests/fixtures/host_reference.py) is chapter 2's naive_attention, on a causal
    Tq < Tk case."""
    q, k, v = make_qkv((1, 2, 5, 9, 16, True))
    np.testing.assert_allclose(reference(q, k, v, True)[0], to_numpy(naive_attention(*on_backend(q, k, v), True)),
                               atol=1e-5)


def check_attention(fn, cases, atol):
    """Raise AssertionError unless fn(q, k, v, causal) matches the reference on every case (no NaN)."""
    for case in cases:
        q, k, v = make_qkv(case)
        causal = case[-1]
        out = to_numpy(fn(*on_backend(q, k, v), causal))
        ref, _ = reference(q, k, v, causal)
        assert out.shape == ref.shape, case_id(case)
        err = float(np.abs(out - ref).max())  # NaN compares False below
        assert err <= atol, f"{case_id(case)}: max abs error {err:.3g} > {atol}"


# ---- 4.1 online softmax ----------------------------------------------------------------------------


def softmax_inputs(N, seed=0):
    """Rows designed to catch the classic bugs: random, increasing (the max arrives last), huge values,
    a masked tail (-inf), and a fully masked row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((5, N)) * 10
    x[1] = np.linspace(-20, 20, N)  # the running max grows at every block
    x[2] = x[2] * 100 + 1000  # exp overflows without the max subtraction
    x[3, N // 2 + 1 :] = -np.inf  # masked tail
    x[4] = -np.inf  # fully masked row -> zeros
    return x


def check_softmax(fn, N, block):
    x = softmax_inputs(N)
    y = to_numpy(fn(xp.asarray(x), block))
    ref = host_softmax(x)
    assert np.all(np.isfinite(y)), f"N={N}, block={block}: NaN/inf in the output"
    np.testing.assert_allclose(y, ref, atol=1e-12, err_msg=f"N={N}, block={block}")


@pytest.mark.exercise("4.1")
@pytest.mark.parametrize("block", [1, 7, 32])
@pytest.mark.parametrize("N", GRID_N)
def test_online_softmax_matches_softmax(N, block):
    """One streaming pass with a running max and sum equals softmax exactly, for any N and block."""
    check_softmax(fa.online_softmax, N, block)


@pytest.mark.exercise("4.1")
def test_online_softmax_docstring_example_and_shapes():
    """The worked example of the docstring; leading axes are kept; block must be >= 1."""
    y = fa.online_softmax(xp.asarray([1.0, 3.0, 2.0]), 2)
    np.testing.assert_allclose(to_numpy(y), [0.0900, 0.6652, 0.2447], atol=1e-4)
    x = xp.asarray(np.random.default_rng(1).standard_normal((2, 3, 4, 50)).astype(np.float32))
    y = fa.online_softmax(x, 16)
    assert y.shape == x.shape and y.dtype == np.float32
    with pytest.raises(ValueError, match="block"):
        fa.online_softmax(x, 0)


@needs_mutants
def test_online_softmax_check_catches_missing_rescale():
    """The check above fails for the classic bug (running sum not rescaled when the max grows)."""
    with pytest.raises(AssertionError):
        check_softmax(mutants.online_softmax_no_rescale, 100, 7)


# ---- 4.2 tiled attention in array code ---------------------------------------------------------------


@pytest.mark.exercise("4.2")
def test_tile_update_one_tile_is_softmax():
    """From the empty state (m=-inf, l=0, O=0) one tile gives l = sum exp(s - max s), O/l = softmax(s) v."""
    rng = np.random.default_rng(0)
    s, v = rng.standard_normal((3, 5)), rng.standard_normal((5, 4))
    m, l, o = map(to_numpy, fa.flash_tile_update(*on_backend(np.full(3, -np.inf), np.zeros(3), np.zeros((3, 4)), s, v)))
    np.testing.assert_allclose(m, s.max(-1))
    np.testing.assert_allclose(o / l[:, None], host_softmax(s) @ v, atol=1e-12)


@pytest.mark.exercise("4.2")
def test_tile_update_two_tiles_rescale():
    """Two tiles, the max in the second: the first tile's l and O must be rescaled by exp(m_old - m_new)."""
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal((3, 8)), rng.standard_normal((8, 4))
    s[:, 6] += 10  # the row max sits in the second tile
    state = on_backend(np.full(3, -np.inf), np.zeros(3), np.zeros((3, 4)))
    state = fa.flash_tile_update(*state, *on_backend(s[:, :4], v[:4]))
    m, l, o = map(to_numpy, fa.flash_tile_update(*state, *on_backend(s[:, 4:], v[4:])))
    np.testing.assert_allclose(l, np.exp(s - s.max(-1, keepdims=True)).sum(-1), atol=1e-12)
    np.testing.assert_allclose(o / l[:, None], host_softmax(s) @ v, atol=1e-12)


@pytest.mark.exercise("4.2")
def test_tile_update_fully_masked_tile_keeps_state():
    """A tile whose scores are all -inf (causal future) leaves (m, l, O) unchanged and makes no NaN."""
    rng = np.random.default_rng(2)
    m, l, o = np.array([0.5, -np.inf]), np.array([2.0, 0.0]), rng.standard_normal((2, 4))
    o[1] = 0
    new = fa.flash_tile_update(*on_backend(m, l, o, np.full((2, 3), -np.inf), rng.standard_normal((3, 4))))
    m2, l2, o2 = map(to_numpy, new)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(l2, l)
    np.testing.assert_array_equal(o2, o)


def tiled_output(q, k, v, causal, block_q=32, block_k=32):
    return fa.flash_attention(q, k, v, causal, block_q, block_k)[0]


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tiled_matches_naive(case):
    """flash_attention (tiles of 32) == naive_attention over the grid; L is each row's log-sum-exp."""
    q, k, v = make_qkv(case)
    causal = case[-1]
    out, lse = map(to_numpy, fa.flash_attention(*on_backend(q, k, v), causal, 32, 32))
    ref, ref_lse = reference(q, k, v, causal)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert np.abs(out - ref).max() <= ARRAY_ATOL
    assert np.abs(lse - ref_lse).max() <= 1e-4 * max(1.0, np.abs(ref_lse).max())


@pytest.mark.exercise("4.2")
@pytest.mark.parametrize("block_q,block_k", [(1, 1), (7, 5), (64, 16), (512, 512)])
def test_tiled_any_tile_shape(block_q, block_k):
    """Tiles of any shape (1x1, not dividing N, larger than N) give the same result."""
    check_attention(lambda q, k, v, c: tiled_output(q, k, v, c, block_q, block_k),
                    [(1, 2, 100, 100, 16, True), (1, 2, 33, 100, 16, True), (1, 1, 100, 100, 16, False)],
                    ARRAY_ATOL)


@pytest.mark.exercise("4.2")
def test_tiled_skips_future_tiles(monkeypatch):
    """Causal: key tiles entirely in a query tile's future are never computed (4+3+2+1 of 16 tiles)."""
    calls = []
    real = fa.flash_tile_update

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fa, "flash_tile_update", counting)
    q, k, v = on_backend(*make_qkv((1, 1, 256, 256, 16, True)))
    fa.flash_attention(q, k, v, True, 64, 64)
    assert len(calls) == 10
    calls.clear()
    fa.flash_attention(q, k, v, False, 64, 64)
    assert len(calls) == 16
    calls.clear()
    fa.flash_attention(q[:, :, -64:], k, v, True, 64, 64)  # 64 queries at positions 192..255 see all keys
    assert len(calls) == 4


@needs_mutants
def test_tiled_check_catches_missing_rescale(monkeypatch):
    """The grid check fails when the tile update forgets to rescale l and O (the classic bug)."""
    monkeypatch.setattr(fa, "flash_tile_update", mutants.flash_tile_update_no_rescale)
    with pytest.raises(AssertionError):
        check_attention(tiled_output, [(1, 1, 100, 100, 16, True)], ARRAY_ATOL)


@pytest.mark.exercise("4.2")
@pytest.mark.skipif(is_cupy(), reason="tracemalloc measures host memory; on a GPU the arrays live on the device")
def test_tiled_memory_stays_small():
    """Peak memory of the tiled version is a small fraction of the (N, N) score matrix naive builds."""
    q, k, v = on_backend(*make_qkv((1, 1, 1024, 1024, 16, True)))
    score_bytes = 1024 * 1024 * 4
    tracemalloc.start()
    fa.flash_attention(q, k, v, True, 64, 64)
    tiled_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    naive_attention(q, k, v, True)
    naive_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert naive_peak >= score_bytes
    assert tiled_peak < score_bytes / 10


@pytest.mark.exercise("4.2")
def test_auto_attention_is_naive_when_small_and_tiled_when_large(monkeypatch):
    """attention="auto" (the models' default) runs naive_attention while the (B, nh, Tq, Tk) scores
    ``naive_fits`` (at most NAIVE_MAX_SCORES) and the tiles past it, with the same output: a long
    prefill that built its whole score matrix by default (6 GB for a 7,000-token SmolLM2 prompt) is
    caught here. 'naive' and 'flash' stay what they name."""
    from minillm.model import DEFAULT_ATTENTION, get_attention

    assert get_attention("auto") is fa.auto_attention and DEFAULT_ATTENTION == "auto"
    assert get_attention("naive") is naive_attention and get_attention("flash") is fa.tiled_attention
    limit = fa.NAIVE_MAX_SCORES
    assert fa.naive_fits(1, 4, limit // 4, 1) and not fa.naive_fits(1, 4, limit // 4, 2)
    assert fa.naive_fits(1, 9, 1024, 1024) and not fa.naive_fits(1, 9, 7000, 7000)  # the docstring's example
    q, k, v = on_backend(*make_qkv((1, 2, 50, 100, 16, True)))  # more query rows than row_attention takes
    want = to_numpy(naive_attention(q, k, v, True))
    ran, flash = [], fa.flash_attention
    monkeypatch.setattr(fa, "flash_attention", lambda *a, **kw: ran.append(kw["block_q"]) or flash(*a, **kw))
    np.testing.assert_allclose(to_numpy(fa.auto_attention(q, k, v)), want, atol=ARRAY_ATOL)
    assert ran == []  # 10,000 scores: naive
    monkeypatch.setattr(fa, "NAIVE_MAX_SCORES", 2 * 50 * 100 - 1)
    np.testing.assert_allclose(to_numpy(fa.auto_attention(q, k, v)), want, atol=ARRAY_ATOL)
    assert ran == [fa.AUTO_BLOCK]  # one score past the threshold: tiled


def test_tiled_rejects_bad_shapes():
    q, k, v = make_qkv((1, 1, 8, 4, 16, True))
    with pytest.raises(ValueError, match="Tq <= Tk"):
        fa.flash_attention(q, k, v)
    q, k, v = make_qkv((1, 1, 4, 4, 16, True))
    with pytest.raises(ValueError, match="tile"):
        fa.flash_attention(q, k, v, block_q=0)


# ---- 4.3 the IO model ----------------------------------------------------------------------------------


@pytest.mark.exercise("4.3")
def test_io_bytes_counts_by_hand():
    """N=8, d=2, SRAM of 64 bytes = 16 floats -> tiles of 2: the counts worked out in the docstring."""
    io = fa.attention_io_bytes(8, 2, 64)
    assert (io["Br"], io["Bc"]) == (2, 2)
    assert io["standard"] == 4 * (4 * 8 * 2 + 4 * 8 * 8)  # 1280
    assert io["flash"] == 4 * (2 * 8 * 2 + 8 + 2 * 2 * 8 * 4)  # 672: 4 query tiles read all 8 keys
    causal = fa.attention_io_bytes(8, 2, 64, causal=True)
    assert causal["flash"] == 4 * (2 * 8 * 2 + 8 + 2 * 2 * (2 + 4 + 6 + 8))  # 480: tile i reads keys 0..2i+1
    tail = fa.attention_io_bytes(7, 2, 64, causal=True)  # the last query tile holds one row and reads 7 keys, not 8
    assert tail["flash"] == 4 * (2 * 7 * 2 + 7 + 2 * 2 * (2 + 4 + 6 + 7))


@pytest.mark.exercise("4.3")
def test_io_bytes_scaling_theorem_2():
    """Standard grows like N^2 and ignores M; tiled grows like N^2 d^2 / M and wins for a large SRAM."""
    d, M = 64, 192 * 1024
    small, big = fa.attention_io_bytes(8192, d, M), fa.attention_io_bytes(16384, d, M)
    assert big["standard"] / small["standard"] == pytest.approx(4, rel=0.01)
    assert big["flash"] / small["flash"] == pytest.approx(4, rel=0.02)
    twice_sram = fa.attention_io_bytes(16384, d, 2 * M)
    assert twice_sram["standard"] == big["standard"]
    assert big["flash"] / twice_sram["flash"] == pytest.approx(2, rel=0.05)
    assert big["flash"] < big["standard"] / 5
    causal = fa.attention_io_bytes(16384, d, M, causal=True)
    assert causal["flash"] == pytest.approx(big["flash"] / 2, rel=0.05)  # half the key tiles


# ---- the kernel, emulated on the CPU --------------------------------------------------------------------


@pytest.fixture(scope="session")
def emulator():
    """Build (or find in the cache) the emulated kernel once per session."""
    if shutil.which("g++") is None:
        pytest.skip("g++ (C++20) is needed to emulate the kernel")
    return build.build_emulator()


def emulated(source=build.KERNEL_SOURCE):
    return lambda q, k, v, causal: launch.flash_attention_emulated(q, k, v, causal, source=source)


# The CPU emulation (host arrays through ctypes), ThreadSanitizer and nvcc builds run no device code: they are
# host_only (the strict run launches the same kernel through RawKernel in the gpu tests below).
@pytest.mark.host_only
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_kernel_matches_naive(emulator, case):
    """The real .cu, run on the CPU through cuda_emu.h, matches naive_attention within 1e-5 (and L too)."""
    check_kernel_case(launch.flash_attention_emulated, case)


def check_kernel_case(launcher, case, inputs=lambda *a: a):
    """launcher(q, k, v, causal, return_lse=True) on one shape of the grid, given inputs(q, k, v), returns
    float32 O within 1e-5 of the float64 reference and L within 1e-4 (relative) of its log-sum-exp."""
    q, k, v = make_qkv(case)
    causal = case[-1]
    out, lse = (to_numpy(a) for a in launcher(*inputs(q, k, v), causal, return_lse=True))
    ref, ref_lse = reference(q, k, v, causal)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert np.abs(out - ref).max() <= KERNEL_ATOL
    assert np.abs(lse - ref_lse).max() <= 1e-4 * max(1.0, np.abs(ref_lse).max())


@needs_gxx
def test_emulated_grid_catches_missing_tail_check():
    """Without the tail bounds check the last K/V tile reads past the end (into a NaN red zone): caught."""
    bad = emulated(kernel_mutant("no_tail_check"))
    with pytest.raises(AssertionError):
        check_attention(bad, [(1, 1, 33, 33, 16, False), (1, 1, 100, 100, 64, True)], KERNEL_ATOL)
    check_attention(bad, [(1, 1, 64, 64, 16, False)], KERNEL_ATOL)  # N a multiple of the tile hides the bug


@needs_gxx
def test_emulated_grid_catches_missing_rescale():
    """A kernel that never rescales O_i and l_i by exp(m_old - m_new) fails the grid check."""
    with pytest.raises(AssertionError):
        check_attention(emulated(kernel_mutant("no_rescale")), [(1, 1, 100, 100, 16, True)], KERNEL_ATOL)


def test_kernel_mutants_edit_the_current_kernel_once():
    """Every mutant chapter 4 runs is the current kernel with its edits applied exactly once; an unknown
    name or an edit the kernel no longer contains is refused, naming the mutant."""
    kernel = build.KERNEL_SOURCE.read_text()
    for name in KERNEL_MUTANTS:
        assert mutate_kernel(name, kernel) != kernel
    with pytest.raises(ValueError, match="unknown kernel mutant 'no_such_bug'"):
        mutate_kernel("no_such_bug", kernel)
    with pytest.raises(ValueError, match="'no_tail_check'.* occurs 0 times"):
        mutate_kernel("no_tail_check", kernel.replace("kr < Tk", "kr >= 0 && kr < Tk"))


@needs_gxx
def test_emulator_catches_divergent_syncthreads():
    """A __syncthreads() inside `if (row_valid)` is reached by only some threads of a tail tile: the
    emulator's barrier reports the divergence (on a GPU: undefined behaviour, often a hang)."""
    bad = emulated(kernel_mutant("divergent_sync"))
    with pytest.raises(build.KernelError, match="diverged"):
        bad(*make_qkv((1, 1, 33, 33, 16, True))[:3], True)
    check_attention(bad, [(1, 1, 64, 64, 16, True)], KERNEL_ATOL)  # no tail, every thread takes the branch


@needs_gxx
def test_emulated_kernel_checks_its_limits():
    """The kernel itself refuses head sizes over HS_MAX and too little shared memory (status codes),
    and the launchers raise clear errors before launching."""
    q, k, v = make_qkv((1, 1, 8, 8, build.HS_MAX + 1, True))
    assert launch.launch_emulated(q, k, v, True, 32, 1)[2] == 1  # FLASH_BAD_HEAD_DIM
    with pytest.raises(ValueError, match="head sizes"):
        launch.flash_attention_emulated(q, k, v)
    q, k, v = make_qkv((1, 1, 8, 8, 64, True))
    need = launch.kernel_smem_bytes(32, 32, 64)
    assert launch.launch_emulated(q, k, v, True, 32, 32, smem_bytes=need)[2] == 0  # the formula is the kernel's
    assert launch.launch_emulated(q, k, v, True, 32, 32, smem_bytes=need - 4)[2] == 3  # FLASH_SMEM_TOO_SMALL
    with pytest.raises(build.KernelError, match="shared memory"):
        launch.launch_emulated(q, k, v, True, 32, 32, smem_bytes=build.DEFAULT_SMEM_BYTES + 4)
    q, k, v = make_qkv((1, 1, 8, 8, 128, True))
    with pytest.raises(launch.SharedMemoryError, match="bytes of shared memory"):
        launch.flash_attention_emulated(q, k, v, block_k=32)
    assert launch.launch_emulated(q, k, v, True, 32, 0)[2] == 2  # FLASH_BAD_BLOCK
    with pytest.raises(ValueError, match="block_k"):
        launch.flash_attention_emulated(q, k, v, block_k=0)


@pytest.mark.host_only
@needs_gxx
def test_emulator_build_error_is_clear(tmp_path):
    """A kernel that does not compile raises KernelError carrying g++'s message (no silent fallback)."""
    broken = tmp_path / "broken.cu"
    broken.write_text('extern "C" __global__ void flash_attention_forward() { this is not C++ }\n')
    with pytest.raises(build.KernelError, match="could not build"):
        build.build_emulator(broken)


def test_cuda_launcher_without_gpu_says_so(monkeypatch):
    monkeypatch.setattr(launch, "is_gpu", lambda: False)  # what the launcher sees on a machine without one
    q, k, v = make_qkv((1, 1, 4, 4, 16, True))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        launch.flash_attention_cuda(q, k, v)


def test_kernel_tiles_fit_shared_memory():
    """The launcher's tile choice fits the 48 KiB every GPU offers (sized in BYTES, not floats)."""
    for hs in (1, 16, 64, 100, 128):
        Br, Bc = launch.kernel_tiles(hs)
        assert Br == 32 and Bc >= 8
        assert launch.kernel_smem_bytes(Br, Bc, hs) <= build.DEFAULT_SMEM_BYTES
    assert launch.kernel_smem_bytes(32, 32, 64) == 4 * (2 * 32 * 65 + 2 * 32 * 64 + 32 * 33)
    with pytest.raises(launch.SharedMemoryError):
        launch.kernel_tiles(128, block_k=64)


# ---- ThreadSanitizer: no data race in the kernel, and a missing __syncthreads() is found --------------

TSAN_SCRIPT = """
import sys
import tempfile
import numpy as np
from minillm.kernels.launch import launch_emulated
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float32) for n in (40, 70, 70))
out, lse, status = launch_emulated(q, k, v, True, 32, 32, source=sys.argv[1], sanitize="thread")
assert status == 0 and np.isfinite(out).all()
"""


def run_under_tsan(source, script=TSAN_SCRIPT, kernel=build.V1, shared_bytes=build.DEFAULT_SMEM_BYTES):
    """Run ``script`` (by default one emulated launch of v1: Tq 40, Tk 70, two query tiles, tails, causal)
    with the kernel file ``source`` (of ``kernel``, built for an emulated device with ``shared_bytes``) under
    ThreadSanitizer -> (exit code, output)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the ThreadSanitizer build")
    libtsan = subprocess.run(
        ["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not Path(libtsan).is_file():
        pytest.skip("libtsan is not installed")
    build.build_emulator(source, sanitize="thread", shared_bytes=shared_bytes, kernel=kernel)  # outside TSan
    root = str(Path(fa.__file__).parents[1])
    env = dict(os.environ, LD_PRELOAD=libtsan, TSAN_OPTIONS="exitcode=66", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", script, str(source)], capture_output=True, text=True,
                          env=env, timeout=300)
    out = proc.stdout + proc.stderr
    if proc.returncode not in (0, 66) and "ThreadSanitizer" in out and "data race" not in out:
        pytest.skip(f"ThreadSanitizer cannot run here: {out[-500:]}")
    return proc.returncode, out


@pytest.mark.host_only
def test_tsan_reports_no_data_race():
    """The kernel built with -fsanitize=thread runs with no report: every shared access is ordered."""
    rc, out = run_under_tsan(build.KERNEL_SOURCE)
    assert "data race" not in out, out[-3000:]
    assert rc == 0, out[-3000:]


@pytest.mark.host_only
def test_tsan_catches_missing_syncthreads():
    """Remove the __syncthreads() that protects K_j, V_j from the next load: TSan reports the race."""
    rc, out = run_under_tsan(kernel_mutant("missing_sync"))
    assert rc == 66 and "WARNING: ThreadSanitizer: data race" in out


# ---- nvcc: the kernel builds for Ampere and Hopper without register spills ----------------------------


@pytest.mark.host_only
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvcc_builds_without_spills(arch):
    """nvcc -Xptxas -v: no spill stores or loads, no stack frame (nothing in slow local memory)."""
    report = build.nvcc_resource_report(arch)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report["report"]
    assert report["stack_frame"] == 0, report["report"]
    assert report["registers"] <= 128, report["report"]


@pytest.mark.host_only
@needs_nvcc
def test_nvcc_spill_check_bites():
    """Squeezed to 16 registers the same kernel spills, and the report shows it."""
    report = build.nvcc_resource_report("sm_90", extra_flags=("-maxrregcount=16",))
    assert report["spill_stores"] > 0


def test_parse_ptxas_report():
    text = (
        "ptxas info: Function properties\n"
        "    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers"
    )
    want = {"registers": 255, "stack_frame": 0, "spill_stores": 8, "spill_loads": 12}
    assert build.parse_ptxas_report(text) == want
    with pytest.raises(ValueError, match="ptxas report"):
        build.parse_ptxas_report("ptxas info    : Used 40 registers")


# ---- the model: every attention implementation gives the same logits -----------------------------------


def check_model_logits(model, name):
    """GPT logits with attention=name equal 'naive' within 1e-4, for a full prompt and for cached
    decoding (prefill 20 tokens, then one: Tq < Tk)."""
    from minillm import KVCache

    idx = np.random.default_rng(0).integers(0, 13, (2, 29))
    results = {}
    for impl in ("naive", name):
        model.set_attention(impl)
        cache = KVCache(model.config, batch_size=2)
        results[impl] = [to_numpy(model.forward(idx)), to_numpy(model.forward(idx[:, :20], cache)),
                         to_numpy(model.forward(idx[:, 20:21], cache))]
    model.set_attention("naive")
    for got, want in zip(results[name], results["naive"]):
        assert got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-4


@pytest.mark.exercise("4.2")
def test_model_logits_tiled_equal_naive(tiny_model):
    """attention='flash' (the tiled array code) gives the model's naive logits."""
    check_model_logits(tiny_model, "flash")


@pytest.mark.uses_exercise("3.1")
@pytest.mark.gpu
def test_model_logits_kernel_equal_naive(tiny_model):
    """attention='cuda' gives the naive logits: the kernel on a GPU, the same kernel emulated on a CPU."""
    if not is_gpu() and shutil.which("g++") is None:
        pytest.skip("the 'cuda' attention on a CPU runs the emulated kernel, which needs g++")
    check_model_logits(tiny_model, "cuda")


def test_model_registry_names_this_chapter():
    """GPT's attention='flash' is the tiled array code and 'cuda' the kernel (emulated on a CPU)."""
    from minillm.model import get_attention

    assert get_attention("flash") is fa.tiled_attention
    assert get_attention("cuda") is launch.kernel_attention


def test_kernel_limits_are_read_from_the_sources():
    """HS_MAX, the FLASH_* status codes and the 48 KiB come from the #defines of the .cu and cuda_emu.h."""
    assert build.HS_MAX == 128 and build.DEFAULT_SMEM_BYTES == 48 * 1024
    assert set(build.KERNEL_STATUS) == {1, 2, 3}
    assert build.KERNEL_STATUS[3].startswith("FLASH_SMEM_TOO_SMALL")
    with pytest.raises(build.KernelError, match="FLASH_BAD_HEAD_DIM"):
        build.raise_status(1)
    build.raise_status(0)


def test_kernel_cache_dir_is_a_user_folder(monkeypatch, tmp_path):
    """Built kernels go to $MINILLM_KERNEL_CACHE, else $XDG_CACHE_HOME/minillm/kernels: never into the
    installed package (which may be read-only); an unwritable choice falls back to a temporary folder."""
    monkeypatch.delenv(build.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.kernel_cache_dir() == tmp_path / "xdg" / "minillm" / "kernels"
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "mine"))
    assert build.kernel_cache_dir() == tmp_path / "mine"
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(build.CACHE_ENV, str(blocked / "sub"))
    fallback = build.kernel_cache_dir()
    assert fallback.is_dir() and build.KERNEL_DIR not in fallback.parents


# ---- on the device (a GPU, or the strict stand-in): the same grid through RawKernel ----------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.gpu
@pytest.mark.skipif(not is_gpu(), reason="needs a CUDA GPU (CuPy)")
def test_gpu_kernel_matches_naive(case):
    """flash_attention_cuda on the GPU matches naive_attention within 1e-5, and L the log-sum-exp."""
    check_kernel_case(launch.flash_attention_cuda, case, on_backend)


@pytest.mark.gpu
@pytest.mark.skipif(not is_gpu(), reason="needs a CUDA GPU (CuPy)")
def test_gpu_kernel_refuses_too_much_shared_memory():
    """A tile needing more shared memory than the device has raises SharedMemoryError naming the bytes."""
    q, k, v = on_backend(*make_qkv((1, 1, 64, 64, 128, True)))
    with pytest.raises(launch.SharedMemoryError, match="bytes of shared memory"):
        launch.flash_attention_cuda(q, k, v, block_k=4096)


@pytest.mark.gpu
@pytest.mark.skipif(not is_gpu(), reason="needs a CUDA GPU (CuPy)")
def test_gpu_kernel_with_opt_in_shared_memory():
    """block_k=64 at hs=128 needs more than 48 KiB: the launcher opts in, and the result is still right."""
    q, k, v = make_qkv((1, 2, 100, 257, 128, True))
    out = launch.flash_attention_cuda(*on_backend(q, k, v), True, block_k=64)
    assert np.abs(to_numpy(out) - reference(q, k, v, True)[0]).max() <= KERNEL_ATOL
