"""Backend selection: NumPy without a GPU, a clear error when CuPy is forced and cannot work."""

import os
import subprocess
import sys

import numpy as np

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
