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
    assert r.stdout.strip() in ("numpy", "cupy", "minillm.strict")  # the last under MINILLM_BACKEND=strict


def test_forced_numpy():
    r = run_python("import minillm; print(minillm.xp.__name__)", MINILLM_BACKEND="numpy")
    assert r.stdout.strip() == "numpy"


def test_forced_cupy_without_gpu_says_why():
    if backend.is_gpu():
        return  # on a GPU machine forcing cupy is legitimate
    r = run_python("import minillm", MINILLM_BACKEND="cupy")
    assert r.returncode != 0
    assert "MINILLM_BACKEND=cupy was requested; CuPy is not installed" in r.stderr


def test_bad_backend_name():
    r = run_python("import minillm", MINILLM_BACKEND="jax")
    assert r.returncode != 0 and "expected 'numpy', 'cupy' or 'strict'" in r.stderr


def test_blas_runs_on_one_thread_by_default():
    """The thread policy: one BLAS thread unless MINILLM_BLAS_THREADS asks for more."""
    if backend.is_gpu():
        return
    r = run_python("from minillm import backend; print(backend.blas_threads())", MINILLM_BLAS_THREADS="")
    assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
    r = run_python("from minillm import backend; print(backend.blas_threads())", MINILLM_BLAS_THREADS="2")
    assert r.stdout.strip() == "2", r.stderr


GLIBC = backend._glibc() is not None
@pytest.mark.host_only
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_trim_heap_hands_free_pages_back():
    """40 MB of heap blocks freed between live ones stay resident (free gives back only the heap's top); trim_heap
    gives their pages back."""
    r = run_python("""
import numpy as np
from minillm import backend

def rss_mb():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024

blocks, kept = [], []
for _ in range(400):
    blocks.append(np.ones(100 << 10, dtype=np.uint8))  # under glibc's 128 KiB mmap threshold: from the heap
    kept.append(np.ones(4 << 10, dtype=np.uint8))  # a live block after each
del blocks
before = rss_mb()
print(backend.trim_heap(), before - rss_mb())
""")
    assert r.returncode == 0, r.stderr
    trimmed, freed_mb = r.stdout.split()
    assert trimmed == "True" and float(freed_mb) > 30, r.stdout


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


# ---- the CuPy probe: each part of a GPU install, failing on its own (a stand-in `cupy` made of NumPy) ----


class FakeCuda:
    """cupy.cuda with a runtime whose device count is given, or raises."""

    def __init__(self, devices):
        self.runtime = self
        self.devices = devices

    def getDeviceCount(self):
        if isinstance(self.devices, Exception):
            raise self.devices
        return self.devices


def fake_cupy(devices=1, kernel_error=None, matmul_error=None, wrong_kernel=False):
    """A module shaped like the part of cupy the probe uses, made of NumPy; each argument breaks one step."""
    import types

    def arange(n, dtype):
        if kernel_error:
            raise kernel_error
        return np.arange(n, dtype=dtype) + (1 if wrong_kernel else 0)

    class Matrix(np.ndarray):
        def __matmul__(self, other):
            if matmul_error:
                raise matmul_error
            return np.asarray(self) @ np.asarray(other)

    ones = lambda shape, dtype: np.ones(shape, dtype).view(Matrix)  # noqa: E731
    return types.SimpleNamespace(cuda=FakeCuda(devices), arange=arange, ones=ones, float32=np.float32)


HEADERS_ERROR = RuntimeError("Failed to find CUDA headers (cuda_runtime.h).\nTry: pip install cupy-cuda12x[ctk]")
CUBLAS_ERROR = ImportError('Failure finding "libcublasLt.so.13 or libcublasLt.so.12"')


@pytest.mark.parametrize("fake, step, message", [
    (dict(devices=RuntimeError("cudaErrorNoDevice: no CUDA-capable device")), "CUDA driver", "cudaErrorNoDevice"),
    (dict(devices=0), "CUDA driver", "failed its check"),
    (dict(kernel_error=HEADERS_ERROR), "kernel to compile", "RuntimeError: Failed to find CUDA headers"),
    (dict(wrong_kernel=True), "kernel to compile", "failed its check"),
    (dict(matmul_error=CUBLAS_ERROR), "matrix product", "ImportError: Failure finding"),
], ids=["no-driver", "no-device", "no-headers", "wrong-kernel", "no-cublas"])
def test_probe_names_the_failing_step(monkeypatch, fake, step, message):
    """A GPU install missing the driver, the CUDA headers or cuBLAS fails the probe at that step, and the
    reason names the step and quotes the first line of CuPy's error (one line)."""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(**fake))
    cupy, why = backend.probe_cupy()
    assert cupy is None and step in why and message in why
    assert "\n" not in why and "pip install" not in why  # only the first line of a multi-line error


def test_probe_passes_only_when_every_step_works(monkeypatch):
    fake = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert backend.probe_cupy() == (fake, None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ModuleNotFoundError
    assert backend.probe_cupy() == (None, None)  # not installed: not a problem, just no GPU


BROKEN_CUPY = '''
class runtime:
    @staticmethod
    def getDeviceCount():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")
class cuda:
    runtime = runtime
'''


def test_installed_but_unusable_cupy_is_reported(tmp_path):
    """With a CuPy that imports but cannot run: `minillm info` warns and says why (the run goes on with
    NumPy), and MINILLM_BACKEND=cupy stops with one line on stderr, no traceback."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(BROKEN_CUPY)
    path = os.pathsep.join([str(tmp_path), os.getcwd()])
    r = subprocess.run([sys.executable, "-c", "from minillm.tools import cli; cli.cmd_info(None)"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": path, "MINILLM_BACKEND": ""}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "WARNING: running on NumPy because CuPy is installed but it needs the CUDA driver" in r.stdout
    assert "cudaErrorInsufficientDriver" in r.stdout and backend.GPU_INSTALL_HINT in r.stdout
    r = run_python("import minillm", PYTHONPATH=path, MINILLM_BACKEND="cupy")
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "MINILLM_BACKEND=cupy was requested; CuPy is installed but" in r.stderr
