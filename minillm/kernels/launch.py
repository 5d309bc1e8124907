"""Launching kernels/flash_attention.cu: tiles, shared memory, and the two ways to run it.

    grid (Tr, nh, B), block (Br,), dynamic shared memory kernel_smem_bytes(Br, Bc, hs) bytes

- ``flash_attention_cuda``: on a GPU, compiled by NVRTC (``cupy.RawKernel``, ``compile_raw_kernel``);
- ``flash_attention_emulated``: on any CPU, the same .cu compiled by g++ against cuda_emu.h;
- ``kernel_attention``: whichever of the two this machine can run, with the signature of
  ``minillm.attention.naive_attention`` (the reference both are checked against).

Both pick the tiles with ``kernel_tiles`` and raise ``SharedMemoryError`` before launching when a
tile does not fit, and ``KernelError`` when the kernel itself reports a violated limit.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..backend import is_gpu, to_numpy, xp
from .build import (
    DEFAULT_SMEM_BYTES,
    HS_MAX,
    KERNEL_NAME,
    KERNEL_SOURCE,
    KernelError,
    build_emulator,
    raise_status,
    run_emulated,
)

KERNEL_BLOCK_Q = 32  # Br: query rows per tile = threads per block (one warp)
FLOAT_BYTES = 4
RED_ZONE = 8192  # NaN floats after each input buffer: a read past the end turns the output into NaN


class SharedMemoryError(ValueError):
    """The requested tile needs more shared memory than the device offers a block."""


def kernel_smem_bytes(Br: int, Bc: int, hs: int) -> int:
    """Dynamic shared memory of one block, in BYTES (the kernel's flash_smem_floats times 4).

    Q_i, O_i: Br x (hs + 1) each (padded rows); K_j, V_j: Bc x hs each; S_i: Br x (Bc + 1).
    Example: Br = Bc = 32, hs = 64 -> 37,248 bytes.
    """
    return FLOAT_BYTES * (2 * Br * (hs + 1) + 2 * Bc * hs + Br * (Bc + 1))


def kernel_tiles(hs: int, smem_limit: int = DEFAULT_SMEM_BYTES, block_k: int | None = None) -> tuple[int, int]:
    """(Br, Bc) for the kernel: Br = 32 (one warp), Bc the largest of 32, 16, 8, ... that fits in smem_limit.

    With block_k given, use it and raise SharedMemoryError when it does not fit.
    Examples (48 KiB): hs 16 -> (32, 32), hs 64 -> (32, 32), hs 128 -> (32, 8).
    """
    if not 1 <= hs <= HS_MAX:
        raise ValueError(f"the flash attention kernel takes head sizes 1..{HS_MAX}, got {hs}")
    if block_k is not None and block_k < 1:
        raise ValueError(f"block_k (keys per tile) must be at least 1, got {block_k}")
    Br = KERNEL_BLOCK_Q
    candidates = [block_k] if block_k is not None else [32, 16, 8, 4, 2, 1]
    for Bc in candidates:
        if kernel_smem_bytes(Br, Bc, hs) <= smem_limit:
            return Br, Bc
    raise SharedMemoryError(
        f"the flash attention tile Br={Br} x Bc={candidates[-1]} at head size {hs} needs "
        f"{kernel_smem_bytes(Br, candidates[-1], hs)} bytes of shared memory, but the device offers "
        f"{smem_limit} bytes per block; use a smaller block_k"
    )


def check_inputs(q, k, v) -> tuple[int, int, int, int, int]:
    """q (B, nh, Tq, hs), k and v (B, nh, Tk, hs) with 1 <= Tq <= Tk -> (B, nh, Tq, Tk, hs); else ValueError."""
    same_heads = q.ndim == k.ndim == 4 and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
    if not same_heads or k.shape != v.shape:
        shapes = f"{q.shape}, {k.shape}, {v.shape}"
        raise ValueError(f"expected q (B, nh, Tq, hs) and k, v (B, nh, Tk, hs), got {shapes}")
    B, nh, Tq, hs = q.shape
    Tk = k.shape[2]
    if Tq > Tk:
        raise ValueError(f"flash attention: {Tq} queries but only {Tk} keys (need Tq <= Tk)")
    if Tq < 1:
        raise ValueError("flash attention needs at least one query")
    return B, nh, Tq, Tk, hs


# --- on a GPU ---------------------------------------------------------------------------------------


_raw_kernels: dict = {}  # (source, device) -> [compiled RawKernel, the dynamic shared memory it may use]
_smem_limits: dict = {}  # device -> MaxSharedMemoryPerBlockOptin


def compile_raw_kernel(source: Path = KERNEL_SOURCE, smem_bytes: int = 0):
    """The kernel compiled by NVRTC (``RawKernel`` of the backend, CuPy on a GPU), once per source file and
    device, allowed to use smem_bytes of dynamic shared memory: above 48 KiB a kernel must opt in (a driver
    call, made only when a launch needs more than the kernel is already allowed)."""
    key = (str(source), xp.cuda.runtime.getDevice())
    if key not in _raw_kernels:
        kernel = xp.RawKernel(Path(source).read_text(), KERNEL_NAME, options=("--std=c++17",))
        _raw_kernels[key] = [kernel, DEFAULT_SMEM_BYTES]
    entry = _raw_kernels[key]
    if smem_bytes > entry[1]:
        entry[0].max_dynamic_shared_size_bytes = smem_bytes
        entry[1] = smem_bytes
    return entry[0]


def device_smem_limit() -> int:
    """Most dynamic shared memory a block may use on this GPU after opting in (e.g. 232,448 on H100/H200).

    Read once per device, as one attribute (``Device().attributes`` would query about a hundred)."""
    device = xp.cuda.runtime.getDevice()
    if device not in _smem_limits:
        attribute = xp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin
        _smem_limits[device] = int(xp.cuda.runtime.deviceGetAttribute(attribute, device))
    return _smem_limits[device]


_status_words: dict = {}  # device -> the int32 status word its launches share


def status_word():
    """This device's kernel status word: zeroed once, written by the kernel only when it refuses a launch,
    so every launch can share it and none has to clear it."""
    device = xp.cuda.runtime.getDevice()
    if device not in _status_words:
        _status_words[device] = xp.zeros(1, dtype=xp.int32)
    return _status_words[device]


def check_kernel_status() -> None:
    """Read the status word (this waits for the GPU) and raise KernelError if a launch was refused."""
    status = status_word()
    code = int(status.get()[0])
    if code != 0:
        status.fill(0)  # reported once
        raise_status(code)


def flash_attention_cuda(q, k, v, causal=True, block_k: int | None = None, return_lse: bool = False,
                         source: Path = KERNEL_SOURCE, check_status: bool = True):
    """kernels/flash_attention.cu on the GPU (cupy.RawKernel); same result as ``naive_attention``.

    (B, nh, Tq, hs) x 3 -> (B, nh, Tq, hs) float32 (and L (B, nh, Tq) with return_lse).
    Grid (Tr, nh, B), block (Br,), dynamic shared memory kernel_smem_bytes(Br, Bc, hs). Raises
    SharedMemoryError when the tile needs more shared memory than the device has, KernelError when
    the kernel reports a violated limit. The launch is asynchronous: only ``check_status`` reads the
    kernel's status back, which waits for the GPU. The launcher refuses beforehand every launch the
    kernel would refuse, so the model's forward pass (``kernel_attention``) skips that wait.
    """
    if not is_gpu():
        raise RuntimeError("flash_attention_cuda needs a CUDA GPU (CuPy); use flash_attention_emulated")
    B, nh, Tq, Tk, hs = check_inputs(q, k, v)
    Br, Bc = kernel_tiles(hs, DEFAULT_SMEM_BYTES if block_k is None else device_smem_limit(), block_k)
    smem = kernel_smem_bytes(Br, Bc, hs)
    kernel = compile_raw_kernel(source, smem)
    q, k, v = (xp.ascontiguousarray(t, dtype=xp.float32) for t in (q, k, v))
    out = xp.empty((B, nh, Tq, hs), dtype=xp.float32)
    lse = xp.empty((B, nh, Tq), dtype=xp.float32)
    Tr = (Tq + Br - 1) // Br
    args = (q, k, v, out, lse, status_word(), np.int32(Tq), np.int32(Tk), np.int32(hs), np.int32(Bc),
            np.int32(bool(causal)), np.float32(1.0 / math.sqrt(hs)))
    kernel((Tr, nh, B), (Br,), args, shared_mem=smem)
    if check_status:
        check_kernel_status()
    return (out, lse) if return_lse else out


# --- on a CPU -----------------------------------------------------------------------------------------


def with_red_zone(a: np.ndarray) -> np.ndarray:
    """A float32 copy of a, followed in memory by RED_ZONE NaNs (like compute-sanitizer's guard bytes)."""
    buf = np.full(a.size + RED_ZONE, np.nan, dtype=np.float32)
    buf[: a.size] = a.reshape(-1)
    return buf


def launch_emulated(q, k, v, causal=True, Br: int = KERNEL_BLOCK_Q, Bc: int = 32,
                    smem_bytes: int | None = None, source: Path = KERNEL_SOURCE, sanitize: str | None = None):
    """One emulated launch with explicit tiles and shared memory, no Python-side limit checks.

    Returns (O, L, status): the kernel's own status code is returned, not raised, so tests can check
    that the kernel itself refuses bad launches. Raises KernelError when the emulator reports one
    (diverged barrier, shared memory beyond the emulated device's).
    """
    B, nh, Tq, Tk, hs = check_inputs(q, k, v)
    q, k, v = (with_red_zone(np.ascontiguousarray(to_numpy(t), dtype=np.float32)) for t in (q, k, v))
    out = np.full(B * nh * Tq * hs + RED_ZONE, np.nan, dtype=np.float32)
    lse = np.full(B * nh * Tq + RED_ZONE, np.nan, dtype=np.float32)
    status = np.zeros(1, dtype=np.int32)
    smem = kernel_smem_bytes(Br, Bc, hs) if smem_bytes is None else smem_bytes
    Tr = (Tq + Br - 1) // Br
    args = (q, k, v, out, lse, status, Tq, Tk, hs, Bc, int(bool(causal)), 1.0 / math.sqrt(hs))
    try:
        run_emulated(build_emulator(source, sanitize), args, (Tr, nh, B), Br, smem)
    except KernelError as exc:
        raise KernelError(f"emulated launch of {Path(source).name} failed: {exc}") from None
    n = B * nh * Tq
    return out[: n * hs].reshape(B, nh, Tq, hs), lse[:n].reshape(B, nh, Tq), int(status[0])


def flash_attention_emulated(q, k, v, causal=True, block_k: int | None = None, return_lse: bool = False,
                             source: Path = KERNEL_SOURCE, sanitize: str | None = None):
    """kernels/flash_attention.cu run on the CPU through cuda_emu.h: the real kernel without a GPU.

    (B, nh, Tq, hs) x 3 -> NumPy (B, nh, Tq, hs) float32 (and L (B, nh, Tq) with return_lse).
    Same tiles and checks as ``flash_attention_cuda`` against an emulated device with 48 KiB of shared
    memory per block. Blocks run one after another, each block's Br threads as real threads; builds are
    cached (``build_emulator``). Slow (about a microsecond per multiply-add): for checking, not for speed.
    """
    Br, Bc = kernel_tiles(q.shape[-1], DEFAULT_SMEM_BYTES, block_k)
    out, lse, status = launch_emulated(q, k, v, causal, Br, Bc, source=source, sanitize=sanitize)
    raise_status(status)
    return (out, lse) if return_lse else out


def kernel_attention(q, k, v, causal=True, mask=None):
    """softmax(q k^T / sqrt(hs) + mask) v by the CUDA kernel: on a GPU, else the same kernel emulated.

    (B, nh, Tq, hs), (B, nh, Tk, hs) x 2 -> (B, nh, Tq, hs) on the backend's arrays, like ``naive_attention``.
    The kernel knows the causal rule only: an explicit ``mask`` (a token tree's) is refused.
    """
    if mask is not None:
        raise ValueError("the CUDA kernel applies the causal mask only; verify token trees with "
                         "attention='naive' or 'flash'")
    if is_gpu():
        return flash_attention_cuda(q, k, v, causal, check_status=False)  # no wait for the GPU mid-forward
    return xp.asarray(flash_attention_emulated(q, k, v, causal))
