"""The array backend: ``xp`` is CuPy when a CUDA GPU really works, NumPy otherwise.

Every module writes ``from .backend import xp`` and uses ``xp.matmul``, ``xp.exp`` ... so the same
code runs on a laptop (NumPy) and on a GPU (CuPy). The choice is made once, at import:

- ``MINILLM_BACKEND=numpy`` forces NumPy.
- ``MINILLM_BACKEND=cupy`` forces CuPy and raises ``BackendError`` saying why when no GPU works.
- unset: CuPy if it imports *and* a tiny kernel launch succeeds, else NumPy, silently.

A working GPU is proven by a launch, not by ``import cupy``: with cupy-cuda12x installed and no
driver, the import succeeds and only the first device call fails (``CUDARuntimeError``).
"""

from __future__ import annotations

import os

import numpy

BACKEND_ENV = "MINILLM_BACKEND"


class BackendError(RuntimeError):
    """The requested array backend cannot be used on this machine."""


def _probe_cupy():
    """Return (cupy module, None) when a tiny kernel runs on the GPU, else (None, reason)."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything at import
        return None, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device"
        if int((cupy.arange(4, dtype=cupy.float32) * 2).sum()) != 12:  # a real launch
            return None, "a test kernel on the GPU returned a wrong result"
    except Exception as exc:  # CUDARuntimeError (a RuntimeError) when there is no driver
        return None, f"no usable CUDA GPU ({type(exc).__name__}: {exc})"
    return cupy, None


def _select():
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced not in ("", "numpy", "cupy"):
        raise BackendError(f"{BACKEND_ENV}={forced!r}: expected 'numpy' or 'cupy'")
    if forced == "numpy":
        return numpy, f"numpy (forced by {BACKEND_ENV})"
    cupy, reason = _probe_cupy()
    if cupy is not None:
        return cupy, "cupy (CUDA GPU found)"
    if forced == "cupy":
        raise BackendError(f"{BACKEND_ENV}=cupy was requested but {reason}")
    return numpy, f"numpy ({reason})"


xp, BACKEND_REASON = _select()


def is_gpu() -> bool:
    """True when arrays live on a CUDA GPU (the backend is CuPy)."""
    return xp is not numpy


def to_numpy(a):
    """Any array (NumPy or CuPy) or scalar -> a NumPy array on the host."""
    if hasattr(a, "get") and not isinstance(a, numpy.ndarray):  # cupy.ndarray
        return a.get()
    return numpy.asarray(a)


def synchronize() -> None:
    """Wait for queued GPU work (a no-op on NumPy); call it before reading a timer."""
    if is_gpu():
        xp.cuda.get_current_stream().synchronize()
