"""The array backend: ``xp`` is CuPy when a CUDA GPU really works, NumPy otherwise.

Every module writes ``from .backend import xp`` and uses ``xp.matmul``, ``xp.exp`` ... so the same
code runs on a laptop (NumPy) and on a GPU (CuPy). The choice is made once, at import:

- ``MINILLM_BACKEND=numpy`` forces NumPy.
- ``MINILLM_BACKEND=cupy`` forces CuPy and raises ``BackendError`` saying why when no GPU works.
- ``MINILLM_BACKEND=strict`` picks the strict CuPy stand-in (``minillm.strict``): NumPy computing under
  CuPy's rules, so code that would break on a GPU breaks on a CPU too.
- unset: CuPy if it imports *and* runs a tiny kernel *and* a matrix product, else NumPy. When CuPy is
  installed but fails one of these, ``CUPY_PROBLEM`` says which step failed and why (``python -m
  minillm info`` prints it), so a broken GPU install is never mistaken for a machine without a GPU.

A working GPU is proven by running code, not by ``import cupy``: each step needs a different part of
the install (``PROBE_STEPS``). With cupy-cuda12x installed and no driver the import succeeds and the
first device call fails (``CUDARuntimeError``); without the CUDA headers (CuPy 14) every kernel fails
to compile; without cuBLAS every matmul fails. ``pip install -r requirements-gpu.txt`` brings them all.

CPU thread policy. NumPy's BLAS (OpenBLAS) starts one thread per core and its threads spin while
they wait for each other. On a small machine that is also running anything else (a browser, a
second notebook, a test runner), a spinning thread that loses its core stalls every matrix product:
a 64-token forward of the shipped model took 744 ms on two threads under a load of two busy
processes, and 51 ms on one; idle, two threads saved 4-16 % (docs/threads.md has the measurements).
So minillm runs BLAS on **one thread** unless ``MINILLM_BLAS_THREADS=N`` asks for N (``all`` keeps
the library's own default). The limit is applied once, at import, for the whole process.

Memory policy. glibc's malloc gives each block of 128 KiB or more a mapping of its own, returned to the
operating system when it is freed, but it raises that threshold to the largest such block freed so far (up to
32 MB). After a model's load has freed temporaries of several MB, a prefill's blocks of a few hundred KB are cut
from the heap instead, and the pages they leave free stay with the process. A load and a chat's reply therefore
end by handing the heap's free pages back (``trim_heap``, glibc's ``malloc_trim``): on an AMD EPYC a chat with
SmolLM2 then held 284 MB after its first answer, against 303-304 MB (docs/quantization.md, "Memory in the
chat"). Fixing the threshold instead would keep the heap as small, but it made array code that frees large
temporaries on every step (training) take 1.6-1.8 times as long. Elsewhere than glibc ``trim_heap`` is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import statistics
import sys
import time

import numpy

BACKEND_ENV = "MINILLM_BACKEND"
BLAS_THREADS_ENV = "MINILLM_BLAS_THREADS"
DEFAULT_BLAS_THREADS = 1  # robust under load; see the module docstring
FAST_PRODUCTS_ENV = "MINILLM_FAST_PRODUCTS"
STREAM_MAX_ROWS = 64  # past this many token rows a product is a prefill: compute-bound, BLAS's job, never timed
CALIBRATION_REPEATS = 3  # the first product of a bucket runs this many times on each path, alternating


class BackendError(RuntimeError):
    """The requested array backend cannot be used on this machine."""


def _fail_at_import(exc: BackendError):
    """Raise a configuration error found at import; if nothing catches it, Python reports it as one
    line ("minillm: ...") instead of a traceback through the import machinery."""
    previous = sys.excepthook

    def one_line(kind, value, tb):
        if value is exc:
            print(f"minillm: {exc}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    sys.excepthook = one_line
    raise exc


GPU_INSTALL_HINT = "pip install -r requirements-gpu.txt"  # CuPy with the CUDA libraries it loads

# (what must work, check(cupy) -> True when it gave the right answer), run in this order
PROBE_STEPS = (
    ("the CUDA driver to see a GPU", lambda cp: cp.cuda.runtime.getDeviceCount() >= 1),
    ("a kernel to compile and run (NVRTC, CUDA headers)",
     lambda cp: int((cp.arange(4, dtype=cp.float32) * 2).sum()) == 12),
    ("a matrix product to run (cuBLAS)",
     lambda cp: float((cp.ones((2, 3), dtype=cp.float32) @ cp.ones((3, 2), dtype=cp.float32))[1, 1]) == 3.0),
)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, at most ``limit`` characters (CuPy's errors span many lines)."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def probe_cupy():
    """(cupy, None) when CuPy runs every ``PROBE_STEPS`` check on a GPU; (None, None) when CuPy is not
    installed; (None, why) when it is installed but cannot be used, why naming the step that failed."""
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            return None, None
        return None, f"its import failed ({first_line(exc)})"
    except Exception as exc:  # a broken CUDA install can raise anything at import
        return None, f"its import failed ({first_line(exc)})"
    for needed, check in PROBE_STEPS:
        try:
            ok = check(cupy)
        except Exception as exc:  # CUDARuntimeError, CompileException, RuntimeError, ImportError ...
            return None, f"it needs {needed}, which failed ({first_line(exc)})"
        if not ok:
            return None, f"it needs {needed}, which failed its check (none found, or a wrong result)"
    return cupy, None


def _select():
    """(xp, why it was chosen, CUPY_PROBLEM) from MINILLM_BACKEND and the probe."""
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced not in ("", "numpy", "cupy", "strict"):
        raise BackendError(f"{BACKEND_ENV}={forced!r}: expected 'numpy', 'cupy' or 'strict' (or unset it)")
    if forced == "numpy":
        return numpy, f"numpy (forced by {BACKEND_ENV})", None
    if forced == "strict":
        from . import strict

        return strict, f"strict (the CuPy stand-in: NumPy under CuPy's rules, {BACKEND_ENV}=strict)", None
    cupy, problem = probe_cupy()
    if cupy is not None:
        return cupy, "cupy (CUDA GPU found)", None
    why = "CuPy is not installed" if problem is None else f"CuPy is installed but {problem}"
    if forced == "cupy":
        raise BackendError(f"{BACKEND_ENV}=cupy was requested; {why}; for a complete install: {GPU_INSTALL_HINT}")
    return numpy, f"numpy ({why})", None if problem is None else why


try:
    # CUPY_PROBLEM: why an installed CuPy cannot be used (None when it works or is not installed)
    xp, BACKEND_REASON, CUPY_PROBLEM = _select()
except BackendError as exc:
    _fail_at_import(exc)


def is_gpu() -> bool:
    """True when arrays live on a device: a CUDA GPU (CuPy), or the strict stand-in that plays one."""
    return xp is not numpy


def is_cupy() -> bool:
    """True when a real CUDA GPU computes (not NumPy, not the strict stand-in)."""
    return xp.__name__ == "cupy"


def on_device(a) -> bool:
    """True for a device array (CuPy's, or the strict stand-in's): one whose way down is ``.get()``."""
    return hasattr(a, "get") and not isinstance(a, numpy.ndarray)


def to_numpy(a):
    """Any array (NumPy or CuPy) or scalar -> a NumPy array on the host."""
    return a.get() if on_device(a) else numpy.asarray(a)


NUMPY_HUGE_PAGES = 4 << 20  # the size from which NumPy asks Linux for 2 MB pages (madvise MADV_HUGEPAGE)


def cache_zeros(shape, dtype):
    """A cache's buffer of zeros, its memory taken as it is first written. On the host (Linux, macOS), from 4 MiB on,
    that is private anonymous memory in 4 KB pages: NumPy asks the kernel for 2 MB pages for every array of 4 MiB or
    more (``madvise``), and in a KV cache of SmolLM2's 8,192 positions, 6.3 MB of keys a layer, the first token
    written into each head then zeroed and mapped 2 MB: a chat's first answer started up to 0.6 s later and held 256 MB
    more (docs/real_model.md). Smaller buffers are NumPy's own zeros; on a device (CuPy, the strict stand-in) and
    on Windows, ``xp.zeros``."""
    if is_gpu() or not hasattr(mmap, "MAP_PRIVATE"):
        return xp.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * numpy.dtype(dtype).itemsize
    if nbytes < NUMPY_HUGE_PAGES:
        return numpy.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous (no file): zeros; a fork copies, not shares
    return numpy.frombuffer(memory, dtype=dtype).reshape(shape)


def synchronize() -> None:
    """Wait for queued GPU work (a no-op on NumPy); call it before reading a timer."""
    if is_gpu():
        xp.cuda.get_current_stream().synchronize()


def requested_blas_threads(value: str | None = None) -> int | None:
    """The BLAS thread count ``MINILLM_BLAS_THREADS`` asks for: unset -> 1, 'all' -> None (leave
    BLAS alone), a positive int -> that int.  Anything else raises ``BackendError``."""
    value = os.environ.get(BLAS_THREADS_ENV, "") if value is None else value
    value = value.strip().lower()
    if value == "":
        return DEFAULT_BLAS_THREADS
    if value == "all":
        return None
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise BackendError(f"{BLAS_THREADS_ENV}={value!r}: expected a positive number of threads or 'all'")


def _blas_controllers():
    """threadpoolctl's handles on the BLAS libraries NumPy loaded (OpenBLAS, MKL, ...)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas").lib_controllers


def apply_thread_policy() -> None:
    """Limit NumPy's BLAS to ``requested_blas_threads()`` threads (a no-op on CuPy or for 'all')."""
    n = requested_blas_threads()
    if n is None or is_cupy():
        return
    for lib in _blas_controllers():
        lib.set_num_threads(n)


def blas_threads() -> int:
    """Threads NumPy's BLAS uses now (the largest count over its BLAS libraries; 0 on CuPy)."""
    return 0 if is_cupy() else max((lib.num_threads for lib in _blas_controllers()), default=1)


def load_average() -> float | None:
    """The 1-minute load average (None where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def runtime_summary() -> str:
    """One line for benchmark headers: backend, BLAS threads, cores and the current load, plus a
    warning line when the load exceeds the cores (timings then measure the contention)."""
    cores, load = os.cpu_count() or 1, load_average()
    setting = os.environ.get(BLAS_THREADS_ENV, "")
    threads = "GPU" if is_cupy() else f"BLAS threads {blas_threads()} ({BLAS_THREADS_ENV}={setting!r})"
    products = "streamed where measured faster" if fast_products() else "BLAS only"
    line = f"backend {xp.__name__}, {threads}, weight products {products} ({FAST_PRODUCTS_ENV}), {cores} cores"
    if load is None:
        return line
    line += f", load average {load:.2f}"
    if load > cores:
        line += f"\nWARNING: the load average ({load:.1f}) exceeds the {cores} cores: timings will be slow and noisy"
    return line


@functools.cache
def _glibc():
    """The C library when it is glibc (it has ``malloc_trim``), else None (macOS, Windows, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") else None


def trim_heap() -> bool:
    """Hand the heap's free pages back to the operating system (glibc's ``malloc_trim(0)``); True when some
    were, False when none were or the C library is not glibc."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1


try:
    apply_thread_policy()
except BackendError as exc:
    _fail_at_import(exc)


# ---- weight products: BLAS, or a streaming kernel where it measured faster --------------------


def blas_product(x, w):
    """x @ w.T, the reference (BLAS on NumPy, cuBLAS on CuPy).  x (..., in), w (out, in) -> (..., out)"""
    return x @ w.T


def requested_fast_products(value: str | None = None) -> bool:
    """Whether ``MINILLM_FAST_PRODUCTS`` allows the streaming path: '1' -> True, unset or '0' -> False.

    Off by default: the kernel makes a verify of a few tokens cheaper, but a single-token decode step
    only ties BLAS, and the per-bucket choice is timed with the weights warm in the cache."""
    value = os.environ.get(FAST_PRODUCTS_ENV, "") if value is None else value
    value = value.strip().lower()
    if value in ("1", "on", "true"):
        return True
    if value in ("", "0", "off", "false"):
        return False
    raise BackendError(f"{FAST_PRODUCTS_ENV}={value!r}: expected 1 (streaming products allowed) or 0 (BLAS only)")


class _ProductPolicy:
    """The streaming path's switch and the winner measured per (out, in, layout, row bucket)."""

    def __init__(self):
        self.enabled = requested_fast_products()
        self.measure = True  # False: stream every product the kernel can take (tests, experiments)
        self.choices = {}  # (out, in, layout, bucket) -> "blas" | "stream"
        self.streaming = None  # the minillm.streaming module, imported on first need (it imports numba)


try:
    _POLICY = _ProductPolicy()
except BackendError as exc:
    _fail_at_import(exc)


def set_fast_products(enabled: bool, measure: bool = True) -> None:
    """Allow (True) or forbid (False) the streaming path for this process; BLAS runs when forbidden.

    ``measure=False`` skips the measurement and streams every product the kernel can take (up to
    STREAM_MAX_ROWS float32 rows): for tests and experiments that must exercise the kernel."""
    _POLICY.enabled, _POLICY.measure = bool(enabled), bool(measure)


def fast_products() -> bool:
    """True when a product may take the streaming path: NumPy backend, allowed, numba installed."""
    return _POLICY.enabled and xp is numpy and _streaming() is not None


def product_choices() -> dict:
    """{(out, in, layout, rows bucket): 'blas' | 'stream'} measured so far in this process."""
    return dict(_POLICY.choices)


def reset_product_choices() -> None:
    """Forget the measured winners (the next products of each bucket measure again)."""
    _POLICY.choices.clear()


def _streaming():
    """minillm.streaming, or None when numba is not installed (then every product is BLAS)."""
    if _POLICY.streaming is None:
        try:
            from . import streaming
        except ImportError:
            streaming = False
        _POLICY.streaming = streaming
    return _POLICY.streaming or None


def rows_bucket(n: int) -> int:
    """The bucket a product over n token rows is measured in: n rounded up to a power of two
    (1, 2, 4, 8, ..., STREAM_MAX_ROWS).  3 -> 4, 5 -> 8, 16 -> 16, 17 -> 32."""
    return 1 << (n - 1).bit_length()


def _calibrate(key, x2, w, streaming):
    """The first product of a bucket: run it on both paths, alternating, ``CALIBRATION_REPEATS`` times
    each, timing every run; record the winner (``stream_wins``) and return the winner's own result.

    Deciding before the first result leaves keeps every product of a bucket on one path, the first
    included, so a repeated forward repeats its bits exactly (tests compare forwards bit for bit)."""
    runs = {"blas": lambda: x2 @ w.T, "stream": lambda: streaming.stream_product(x2, w)}
    samples, results = {"blas": [], "stream": []}, {}
    for _ in range(CALIBRATION_REPEATS):
        for path, run in runs.items():
            start = time.perf_counter()
            results[path] = run()
            samples[path].append(time.perf_counter() - start)
    _POLICY.choices[key] = winner = stream_wins(samples["blas"], samples["stream"])
    return results[winner]


def stream_wins(blas: list[float], stream: list[float]) -> str:
    """'stream' when the kernel's runs beat BLAS's on both the best and the median run, else 'blas'.

    The best run is what a product costs when nothing interrupts it; the median guards against one
    lucky run. A tie, or a split verdict (the two paths within the noise), keeps the reference.
    Example: blas [5, 6, 9], stream [4, 5, 8] -> 'stream'; stream [4, 8, 9] -> 'blas' (median 8 > 6)."""
    faster = min(stream) < min(blas) and statistics.median(stream) < statistics.median(blas)
    return "stream" if faster else "blas"


def weight_product(x, w):
    """x @ w.T through the faster of BLAS and the streaming kernel, as measured on this machine.

    x (..., in) float32, w (out, in) -> (..., out). w's rows contiguous (Llama, the LM heads) or its
    columns (a GPT-2 weight stored [in, out], passed as ``w_in_out.T``). The reference is
    ``blas_product``; it runs on CuPy, on the strict stand-in, for other dtypes or layouts, past
    STREAM_MAX_ROWS rows, and whenever the streaming path is off or measured slower.

    A weight kept in its file's blocks (minillm.quantize's Q8_0 / Q4_1, or minillm.qkernels's packed form)
    is not an array: it knows its own product, ``w.product(x)``, which runs here.
    """
    if hasattr(w, "product"):
        return w.product(x)
    if not fast_products() or x.dtype != numpy.float32:
        return blas_product(x, w)
    streaming = _streaming()
    layout = streaming.layout(w)
    x2 = x.reshape(-1, x.shape[-1])  # (B, T, in) -> (B*T, in): every token row is one row of the product
    n = x2.shape[0]
    if layout is None or n > STREAM_MAX_ROWS or x2.shape[1] != w.shape[1]:
        return blas_product(x, w)
    key = (w.shape[0], w.shape[1], layout, rows_bucket(n))
    choice = _POLICY.choices.get(key) if _POLICY.measure else "stream"
    if choice is None:
        y = _calibrate(key, x2, w, streaming)  # the bucket's first product
    elif choice == "stream":
        y = streaming.stream_product(x2, w)
    else:
        return blas_product(x, w)
    return y.reshape(*x.shape[:-1], w.shape[0])  # (B*T, out) -> (..., out)
