"""python -m minillm.tools.gpu_check is honest: it fails when CuPy is installed but unusable, checks an install
without a GPU, sizes its benchmark down to any --max-n, and checks every decode path against NumPy before timing."""

import sys

import pytest

from minillm import backend
from minillm.backend import is_gpu
from minillm.tools import gpu_check
from minillm.tools.benchmarks import attention
from minillm.tools.benchmarks.attention import GPU_NS, sizes_up_to

needs_no_cupy = pytest.mark.skipif(backend.is_cupy() or backend.CUPY_PROBLEM is not None, reason="CuPy is here")


def test_installed_but_unusable_cupy_fails_the_check(monkeypatch, capsys):
    """CuPy installed but unusable: exit 1 with the reason and the install table, never 'skipped'."""
    monkeypatch.setattr(gpu_check, "is_cupy", lambda: False)
    monkeypatch.setattr(gpu_check, "CUPY_PROBLEM", "CuPy is installed but it needs cuBLAS, which failed (ImportError)")
    assert gpu_check.main(["--skip-tests"]) == 1
    out = capsys.readouterr().out
    assert "FAILED -- CuPy is installed but it needs cuBLAS" in out and "skipped" not in out


def test_a_driver_without_cupy_fails_the_check(monkeypatch):
    """nvidia-smi on the PATH but no CuPy: this machine has a GPU that the check cannot use."""
    monkeypatch.setattr(gpu_check, "is_cupy", lambda: False)
    monkeypatch.setattr(gpu_check, "CUPY_PROBLEM", None)
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert "an NVIDIA driver is installed" in gpu_check.unusable_gpu()
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    assert gpu_check.unusable_gpu() is None  # no sign of a GPU: skipping is honest


@needs_no_cupy
def test_install_check_without_cupy_fails(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ModuleNotFoundError
    assert gpu_check.main(["--install-only"]) == 1
    out = capsys.readouterr().out
    assert "CuPy  MISSING" in out and backend.GPU_INSTALL_HINT in out


@pytest.mark.uses_exercise("4.1", "4.2", "4.3")
def test_benchmark_sizes_below_the_grid(monkeypatch):
    """--max-n below the smallest benchmark size runs that one size instead of nothing."""
    assert sizes_up_to(GPU_NS, 2048) == [1024, 2048]
    assert sizes_up_to(GPU_NS, 256) == [256]
    assert sizes_up_to(GPU_NS, 10**6) == GPU_NS
    ran = []
    monkeypatch.setattr(attention, "run_gpu", lambda ns, repeat, out_dir: ran.append(ns))
    gpu_check.run_attention_bench(256, 1, None)
    assert ran == [[256]]


def test_headers_must_match_nvrtcs_cuda_version(tmp_path):
    """The CUDA headers are found, and are those of NVRTC's CUDA major version (a CUDA 13 system toolkit
    found before the wheel's CUDA 12 headers would break every kernel compile)."""
    assert gpu_check.headers_check(None, 12).startswith("MISSING")
    assert gpu_check.headers_check(tmp_path, 12).startswith("MISSING")
    (tmp_path / "cuda_runtime.h").write_text("")
    (tmp_path / "cuda_runtime_api.h").write_text("#define CUDART_VERSION  13000\n")
    assert gpu_check.headers_check(tmp_path, 12).startswith("WRONG VERSION: CUDA 13 headers")
    assert gpu_check.headers_check(tmp_path, 13) == f"ok: {tmp_path}"


@pytest.mark.skipif(not is_gpu(), reason="runs the device paths: CuPy, or the strict stand-in")
@pytest.mark.slow
def test_decode_bench_checks_every_path_against_numpy():
    """gpu_check's decode table: each path (array code with each attention, the static step eager and as a
    graph, speculative decoding on static steps, the serving engine) first gives a NumPy run's greedy tokens,
    then is timed."""
    table, _, ok = gpu_check.run_decode_bench(steps=1, models=("target",), attentions=("naive",), repeat=1)
    assert ok, table
    for path in ("array code, attention naive", "static step, fused, CUDA graph", "speculative k=4", "serving engine"):
        assert path in table, table
