"""x @ w for a few token rows in C, reading every weight once, with no packing (``small_matmul.c``).

A speculative verification multiplies n = 2..8 token rows by every weight matrix. NumPy's BLAS
copies ("packs") the whole weight matrix before each such product, which costs more than the
arithmetic when n is small (docs/verify_cost.md). ``matmul`` sends those products to a small C kernel
that streams the weight rows once, like the one-row product does; everything else stays ``x @ w``:

- only on the NumPy backend (CuPy and the strict stand-in never use it), float32, w C-contiguous;
- only for 2 <= rows <= ``MAX_ROWS``: one row is BLAS's matrix-vector product, which already streams
  w once; past the roofline's ridge (about 9 rows on a CPU core) the arithmetic dominates and BLAS's
  blocked product uses the multiply-add units better;
- ``MINILLM_SMALL_MATMUL=0`` turns it off (``1``, the default, leaves it on);
- the kernel is compiled by the C compiler (``cc``) at first use, for this CPU (-march=native), and
  cached (``build.build_library``); without a working compiler ``matmul`` uses NumPy and says why
  once (a RuntimeWarning; ``small_matmul_status()`` for a benchmark header).

The reference is ``x @ w`` in float64 (tests/test_small_matmul.py).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import warnings

import numpy

from .build import KERNEL_DIR, KernelError, build_library

SOURCE = KERNEL_DIR / "small_matmul.c"
COMPILER = "cc"  # the system's C compiler: gcc on Linux, clang on macOS
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-shared", "-fPIC"]  # vectorized for this CPU, with FMAs
ENV = "MINILLM_SMALL_MATMUL"  # "0" turns the kernel off, "1" (default) leaves it on
MAX_ROWS = 8  # below the roofline's ridge on a CPU core (docs/verify_cost.md): a weight-streaming problem
LOADED: dict = {}  # "fn": the loaded entry point; "problem": why it cannot be built here (one line)


def enabled() -> bool:
    """Whether ``MINILLM_SMALL_MATMUL`` allows the kernel: unset or '1' -> True, '0' -> False; else ValueError."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 1 (use the C kernel for few-row products) or 0 (NumPy only)")
    return value == "1"


def native_target(compiler: str) -> bytes:
    """What the compiler knows of this CPU (its predefined macros under -march=native): part of the cache
    key, so a cache folder shared by two machines never hands one the other's instructions."""
    proc = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c", os.devnull], capture_output=True)
    return proc.stdout + proc.stderr


def load_kernel():
    """The ``small_matmul`` entry point, compiled and loaded on first use; KernelError saying why it cannot be."""
    if "fn" not in LOADED:
        cc = shutil.which(COMPILER)  # None: build_library says that no compiler was found
        lib = build_library("small_matmul", SOURCE.read_text(), ".c", FLAGS, COMPILER,
                            (native_target(cc) if cc else b"",),
                            SOURCE.name, "the few-row matrix product (minillm/kernels/small_matmul.c) is C")
        fn = ctypes.CDLL(str(lib)).small_matmul
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3  # x, w, y, n, in, out
        fn.restype = None
        LOADED["fn"] = fn
    return LOADED["fn"]


def small_matmul(x, w):
    """y = x @ w by the C kernel.  x (n, in), w (in, out) float32 NumPy arrays -> y (n, out) float32.

    x may be any view (it is made contiguous); w must be C-contiguous (copying it would cost what the
    kernel saves). Example: x = [[1, 2]], w = [[1, 0, 2], [0, 1, 3]] -> [[1, 2, 8]].
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or 0 in x.shape + w.shape:
        raise ValueError(f"small_matmul: expected x (n, in) and w (in, out), non-empty, got {x.shape} and {w.shape}")
    if x.dtype != numpy.float32 or w.dtype != numpy.float32 or not w.flags.c_contiguous:
        raise ValueError(f"small_matmul: expected float32 arrays and a C-contiguous w, got {x.dtype}, {w.dtype}")
    x = numpy.ascontiguousarray(x)
    y = numpy.empty((x.shape[0], w.shape[1]), dtype=numpy.float32)
    load_kernel()(x.ctypes.data, w.ctypes.data, y.ctypes.data, *x.shape, w.shape[1])
    return y


def kernel_applies(x, w) -> bool:
    """True when ``matmul`` sends x @ w to the C kernel (the conditions in the module docstring)."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if not (2 <= rows <= MAX_ROWS and type(x) is numpy.ndarray and type(w) is numpy.ndarray and enabled()):
        return False
    if x.dtype != numpy.float32 or w.dtype != numpy.float32 or w.ndim != 2 or not w.flags.c_contiguous:
        return False
    return kernel_available()


def kernel_available() -> bool:
    """Whether the kernel builds and loads here; the first failure is reported once, as a RuntimeWarning."""
    if "problem" in LOADED:
        return False
    try:
        load_kernel()
    except (KernelError, OSError) as exc:
        LOADED["problem"] = str(exc).splitlines()[0]
        warnings.warn(f"minillm: {LOADED['problem']}; few-row matrix products use NumPy", RuntimeWarning,
                      stacklevel=3)
        return False
    return True


def matmul(x, w):
    """x @ w with w stored [in, out].  [..., in] -> [..., out]; 2..MAX_ROWS rows on NumPy go to ``small_matmul``."""
    if kernel_applies(x, w):
        return small_matmul(x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + w.shape[-1:])
    return x @ w


def small_matmul_status() -> str:
    """One line for a benchmark header: whether few-row products use the C kernel, and if not, why."""
    if not enabled():
        return f"few-row products: NumPy ({ENV}=0)"
    if not kernel_available():
        return f"few-row products: NumPy ({LOADED['problem']})"
    return f"few-row products: the C kernel for 2..{MAX_ROWS} rows (small_matmul.c; {ENV}=0 turns it off)"
