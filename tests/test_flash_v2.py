"""Kernel v2 (minillm/kernels/flash_attention_v2.cu) passes the checks v1 passes: the same shape grid
against the float64 reference, emulated on the CPU (warps, shuffles and all) and on the device; its own
limits; ThreadSanitizer; nvcc for Ampere and Hopper without spills. Its classic mistakes are caught: a row
max not shared across the row's lanes, a missing __syncwarp(), a missing tail check, a shuffle inside a
branch."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
from test_flash_attention import (
    CASES,
    KERNEL_ATOL,
    case_id,
    check_attention,
    check_kernel_case,
    check_model_logits,
    make_qkv,
    needs_gxx,
    needs_nvcc,
    on_backend,
    reference,
    run_under_tsan,
)

from minillm.backend import is_gpu, to_numpy
from minillm.kernels import build, launch
from minillm.kernels.mutants import V2_MUTANTS, mutate_kernel, write_kernel_mutant

pytestmark = needs_gxx
# The emulated launches, sanitizer and nvcc builds below run no device code (host_only: not in the strict
# run); the strict run launches v2 through RawKernel in the model test and the device tests at the end.


def v2_mutant(name):
    """flash_attention_v2.cu with one classic bug edited in (minillm.kernels.mutants.V2_MUTANTS)."""
    out = Path(tempfile.gettempdir()) / "minillm-kernel-mutants"
    out.mkdir(exist_ok=True)
    return write_kernel_mutant(name, build.V2_SOURCE, out, V2_MUTANTS)


def emulated_v2(source=build.V2_SOURCE):
    return lambda q, k, v, causal: launch.flash_attention_v2_emulated(q, k, v, causal, source=source)


@pytest.mark.host_only
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_v2_matches_naive(case):
    """v2, run on the CPU through cuda_emu.h, matches the float64 reference within 1e-5 (and L too)."""
    check_kernel_case(launch.flash_attention_v2_emulated, case)


@pytest.mark.host_only
def test_v2_head_sizes_and_shared_memory():
    """Head sizes pad up to the kernel's (32, 64, 128); the shared memory is the kernel's own formula."""
    assert build.V2_HEAD_SIZES == (32, 64, 128)
    assert [launch.v2_head_size(h) for h in (1, 16, 32, 33, 64, 100, 128)] == [32, 32, 32, 64, 64, 128, 128]
    with pytest.raises(ValueError, match="1..128"):
        launch.v2_head_size(129)
    assert [launch.v2_smem_bytes(h) for h in (32, 64, 128)] == [44_032, 68_608, 117_760]
    q, k, v = make_qkv((1, 1, 70, 70, 64, True))
    need = launch.v2_smem_bytes(64)
    assert launch.launch_v2_emulated(q, k, v, smem_bytes=need)[2] == 0
    assert launch.launch_v2_emulated(q, k, v, smem_bytes=need - 4)[2] == 2  # FLASH2_SMEM_TOO_SMALL


@pytest.mark.host_only
def test_v2_checks_its_limits():
    """A block that is not 128 threads, too little shared memory, a pointer off a 16-byte boundary: the
    kernel refuses each with its status code, and the launcher raises naming it."""
    q, k, v = make_qkv((1, 1, 40, 40, 32, True))
    assert launch.launch_v2_emulated(q, k, v, block_x=64)[2] == 1  # FLASH2_BAD_BLOCK
    with pytest.raises(build.KernelError, match="FLASH2_BAD_BLOCK"):
        build.raise_status(1, "flash_attention_v2_hs32")
    # misaligned: Q starts 4 bytes into its buffer, so its float4 loads would straddle 16-byte boundaries
    buf = np.zeros(40 * 32 + 1, dtype=np.float32)
    qm = buf[1:]
    out, lse, status = np.zeros(40 * 32, np.float32), np.zeros(40, np.float32), np.zeros(1, np.int32)
    kk, vv = (np.ascontiguousarray(t.reshape(-1)) for t in (k, v))
    lib = build.build_emulator(build.V2_SOURCE, shared_bytes=build.EMULATED_SMEM_OPTIN, kernel=build.V2)
    assert qm.ctypes.data % 16 != 0
    build.run_emulated(lib, (qm, kk, vv, out, lse, status, 40, 40, 1, 0.2), (1, 1, 1), 128,
                       launch.v2_smem_bytes(32), "flash_attention_v2_hs32")
    assert status[0] == 3  # FLASH2_MISALIGNED


@pytest.mark.host_only
def test_v2_status_codes_are_read_from_the_source():
    assert build.V2.status[3].startswith("FLASH2_MISALIGNED")
    assert (build.V2_THREADS, build.V2_BR, build.V2_BC) == (128, 64, 64)


@pytest.mark.host_only
def test_v2_mutants_edit_the_current_kernel_once():
    kernel = build.V2_SOURCE.read_text()
    for name in V2_MUTANTS:
        assert mutate_kernel(name, kernel, V2_MUTANTS) != kernel


@pytest.mark.host_only
@pytest.mark.parametrize("name", ["v2_no_row_max", "v2_no_tail_check"])
def test_v2_output_check_catches(name):
    """Without the row max shared across the row's 8 lanes, or without the tail check, the output is wrong
    on a shape whose rows see several key tiles and whose length is not a multiple of 64."""
    with pytest.raises(AssertionError):
        check_attention(emulated_v2(v2_mutant(name)), [(1, 1, 100, 100, 32, True)], KERNEL_ATOL)


@pytest.mark.host_only
def test_v2_emulator_catches_a_shuffle_in_a_branch():
    """The row-sum shuffle inside `if (row < Tq)`: with Tq = 42, lanes of the warp holding rows 40-43 differ
    (two lanes' rows are past Tq), and the emulator's warp barrier reports the divergence (on a GPU:
    undefined behaviour, often a hang)."""
    q, k, v = make_qkv((1, 1, 42, 42, 32, True))
    with pytest.raises(build.KernelError, match="diverged"):
        launch.flash_attention_v2_emulated(q, k, v, True, source=v2_mutant("v2_shuffle_in_branch"))


TSAN_V2_SCRIPT = """
import sys
import numpy as np
from minillm.kernels.launch import launch_v2_emulated
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, 70, 32)).astype(np.float32) for _ in range(3))
out, lse, status = launch_v2_emulated(q, k, v, True, source=sys.argv[1], sanitize="thread")
assert status == 0 and np.isfinite(out).all()
"""


def run_v2_under_tsan(source):
    return run_under_tsan(source, TSAN_V2_SCRIPT, build.V2, build.EMULATED_SMEM_OPTIN)


@pytest.mark.host_only
def test_v2_tsan_reports_no_data_race():
    """v2 under ThreadSanitizer (two query tiles, two key tiles, tails, causal): no report. Every shared
    access is ordered by a __syncthreads(), a __syncwarp() or a shuffle."""
    rc, out = run_v2_under_tsan(build.V2_SOURCE)
    assert "data race" not in out, out[-3000:]
    assert rc == 0, out[-3000:]


@pytest.mark.host_only
def test_v2_tsan_catches_missing_syncwarp():
    """Remove the __syncwarp() between writing P and reading it: ThreadSanitizer reports the race."""
    rc, out = run_v2_under_tsan(v2_mutant("v2_missing_syncwarp"))
    assert rc == 66 and "WARNING: ThreadSanitizer: data race" in out


@pytest.mark.host_only
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_v2_nvcc_builds_without_spills(arch):
    """Each of v2's three kernels: no spill stores or loads, no stack frame, at most 255 registers."""
    report = build.nvcc_resource_report(arch, build.V2_SOURCE)
    assert set(report["functions"]) == set(build.V2.names)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, report["report"]
    assert report["stack_frame"] == 0 and report["registers"] <= 255, report["report"]


@pytest.mark.uses_exercise("3.1")
def test_model_logits_kernel_v2_equal_naive(tiny_model):
    """attention='cuda_v2' gives the naive logits (full prompt; prefill then one decode step, Tq < Tk)."""
    check_model_logits(tiny_model, "cuda_v2")


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.gpu
@pytest.mark.skipif(not is_gpu(), reason="needs a CUDA GPU (CuPy)")
def test_gpu_v2_matches_naive(case):
    """flash_attention_v2_cuda on the device matches the float64 reference within 1e-5, and L too."""
    check_kernel_case(launch.flash_attention_v2_cuda, case, on_backend)


@pytest.mark.gpu
@pytest.mark.skipif(not is_gpu(), reason="needs a CUDA GPU (CuPy)")
def test_gpu_v2_opts_in_above_48_kib():
    """Head size 128 needs 117,760 bytes of shared memory: the launcher opts in, and the result holds."""
    case = (1, 2, 130, 130, 128, True)
    q, k, v = make_qkv(case)
    out = launch.flash_attention_v2_cuda(*on_backend(q, k, v), True)
    assert np.abs(to_numpy(out) - reference(q, k, v, True)[0]).max() <= KERNEL_ATOL
