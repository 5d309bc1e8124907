"""Backend selection: NumPy without a GPU, a clear error when CuPy is forced and cannot work."""

import os
import subprocess
import sys

import numpy as np

import minillm
from minillm import backend


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


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


def test_blas_runs_on_one_thread_by_default():
    """The thread policy: one BLAS thread unless MINILLM_BLAS_THREADS asks for more."""
    if backend.is_gpu():
        return
    r = run_python("from minillm import backend; print(backend.blas_threads())", MINILLM_BLAS_THREADS="")
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    r = run_python("from minillm import backend; print(backend.blas_threads())", MINILLM_BLAS_THREADS="2")
    assert r.stdout.strip() == "2", r.stderr


def test_requested_blas_threads_parses_and_refuses():
    assert backend.requested_blas_threads("") == backend.DEFAULT_BLAS_THREADS == 1
    assert backend.requested_blas_threads(" 3 ") == 3
    assert backend.requested_blas_threads("ALL") is None
    for bad in ("0", "-1", "two", "1.5"):
        try:
            backend.requested_blas_threads(bad)
        except backend.BackendError as exc:
            assert "MINILLM_BLAS_THREADS" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_runtime_summary_reports_threads_and_warns_under_load(monkeypatch):
    line = backend.runtime_summary()
    assert "cores" in line and ("BLAS threads" in line or "GPU" in line)
    monkeypatch.setattr(backend, "load_average", lambda: 64.0)
    assert "WARNING: the load average (64.0) exceeds" in backend.runtime_summary()


def test_cli_reports_a_bad_environment_in_one_line():
    """python -m minillm with a bogus MINILLM_BACKEND: one line on stderr, no traceback."""
    for env in ({"MINILLM_BACKEND": "bogus"}, {"MINILLM_BLAS_THREADS": "many"}):
        r = subprocess.run([sys.executable, "-m", "minillm", "info"], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=120)
        assert r.returncode != 0
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert next(iter(env)) in r.stderr
