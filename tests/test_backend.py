"""Backend selection: NumPy without a GPU, a clear error when CuPy is forced and cannot work."""

import os
import subprocess
import sys

import numpy as np
import pytest

import minillm
from minillm import backend


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)  # fmt: skip


def test_numpy_without_gpu():
    if not backend.is_gpu():
        assert backend.xp is np
        assert "numpy" in backend.BACKEND_REASON
    assert isinstance(backend.to_numpy(minillm.xp.ones(3)), np.ndarray)


def test_import_is_silent_without_cuda():
    """Importing minillm prints nothing (no tracebacks) whether or not CuPy/CUDA exist."""
    r = run_python("import minillm; print(minillm.xp.__name__)")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.strip() in ("numpy", "cupy")


def test_forced_numpy():
    r = run_python("import minillm; print(minillm.xp.__name__)", MINILLM_BACKEND="numpy")
    assert r.stdout.strip() == "numpy"


def test_forced_cupy_without_gpu_says_why():
    if backend.is_gpu():
        return  # on a GPU machine forcing cupy is legitimate
    r = run_python("import minillm", MINILLM_BACKEND="cupy")
    assert r.returncode != 0
    assert "MINILLM_BACKEND=cupy was requested but" in r.stderr


def test_bad_backend_name():
    r = run_python("import minillm", MINILLM_BACKEND="jax")
    assert r.returncode != 0 and "expected 'numpy' or 'cupy'" in r.stderr


def test_blas_threads_sets_and_restores():
    libs = backend._blas_libraries()
    if backend.is_gpu() or not libs:
        pytest.skip("no NumPy BLAS to control")
    before = [lib.get_num_threads() for lib in libs]
    with backend.blas_threads(1):
        assert [lib.get_num_threads() for lib in libs] == [1] * len(libs)
    assert [lib.get_num_threads() for lib in libs] == before
    with pytest.raises(KeyError), backend.blas_threads(1):
        raise KeyError("restored even when the block raises")
    assert [lib.get_num_threads() for lib in libs] == before
    with backend.blas_threads(None):
        assert [lib.get_num_threads() for lib in libs] == before


def test_one_token_forward_runs_on_matvec_threads(monkeypatch):
    """A decode step (B*T == 1) asks for MATVEC_THREADS; prefill and batches keep the default."""
    from minillm import model as model_mod
    from minillm.config import GPTConfig

    seen = []
    real = model_mod.blas_threads
    monkeypatch.setattr(model_mod, "blas_threads", lambda n: seen.append(n) or real(n))
    m = model_mod.GPT.init(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    m.forward(np.zeros((1, 1), dtype=np.int64))
    m.forward(np.zeros((1, 3), dtype=np.int64))
    m.forward(np.zeros((2, 1), dtype=np.int64))
    assert seen == [model_mod.MATVEC_THREADS, None, None]
