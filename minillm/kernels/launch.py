"""Launching the CUDA kernels: tiles, shared memory, and the two ways to run each.

v1, kernels/flash_attention.cu (the readable one):
    grid (Tr, nh, B), block (Br,), dynamic shared memory kernel_smem_bytes(Br, Bc, hs) bytes
v2, kernels/flash_attention_v2.cu (the fast one; one kernel per head size 32, 64, 128):
    grid (ceil(Tq / 64), nh, B), block (128,), dynamic shared memory v2_smem_bytes(HS) bytes

- ``flash_attention_cuda`` / ``flash_attention_v2_cuda``: on a GPU, compiled by NVRTC
  (``cupy.RawKernel``, ``compile_raw_kernel``);
- ``flash_attention_emulated`` / ``flash_attention_v2_emulated``: on any CPU, the same .cu compiled by
  g++ against cuda_emu.h;
- ``kernel_attention`` / ``kernel_attention_v2``: whichever of the two this machine can run, with the
  signature of ``minillm.attention.naive_attention`` (the reference all are checked against).

They check the tiles before launching and raise ``SharedMemoryError`` when a tile does not fit, and
``KernelError`` when the kernel itself reports a violated limit.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..backend import is_gpu, to_numpy, xp
from .build import (
    DEFAULT_SMEM_BYTES,
    EMULATED_SMEM_OPTIN,
    HS_MAX,
    KERNEL_NAME,
    KERNEL_SOURCE,
    KERNELS,
    V2_BC,
    V2_BR,
    V2_HEAD_SIZES,
    V2_PAD,
    V2_SOURCE,
    V2_THREADS,
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


def v2_head_size(hs: int) -> int:
    """The head size of the v2 kernel that runs head size hs: the smallest of V2_HEAD_SIZES (32, 64, 128)
    that holds it; smaller heads are padded with zeros, which change no dot product. ValueError above 128."""
    for HS in V2_HEAD_SIZES:
        if hs <= HS:
            return HS
    raise ValueError(f"flash attention v2 takes head sizes 1..{V2_HEAD_SIZES[-1]}, got {hs}")


def v2_smem_bytes(HS: int) -> int:
    """Dynamic shared memory of one v2 block, in BYTES (the kernel's flash2_smem_floats<HS>() times 4).

    Q_i, K_j: 64 x (HS + 4) each (padded rows); V_j: 64 x HS; P: 64 x (64 + 4).
    Examples: HS 32 -> 44,032 bytes; HS 64 -> 68,608 (above 48 KiB: opts in); HS 128 -> 117,760.
    """
    return FLOAT_BYTES * ((V2_BR + V2_BC) * (HS + V2_PAD) + V2_BC * HS + V2_BR * (V2_BC + V2_PAD))


def v2_kernel_name(HS: int) -> str:
    return f"flash_attention_v2_hs{HS}"


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


_raw_kernels: dict = {}  # (source, kernel name, device) -> [compiled RawKernel, the dynamic shared memory it may use]
_smem_limits: dict = {}  # device -> MaxSharedMemoryPerBlockOptin


def compile_raw_kernel(source: Path = KERNEL_SOURCE, smem_bytes: int = 0, name: str = KERNEL_NAME):
    """Kernel ``name`` of ``source`` compiled by NVRTC (``RawKernel`` of the backend, CuPy on a GPU), once per
    source file, kernel and device, allowed to use smem_bytes of dynamic shared memory: above 48 KiB a kernel
    must opt in (a driver call, made only when a launch needs more than the kernel is already allowed)."""
    key = (str(source), name, xp.cuda.runtime.getDevice())
    if key not in _raw_kernels:
        kernel = xp.RawKernel(Path(source).read_text(), name, options=("--std=c++17",))
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


def check_kernel_status(name: str = KERNEL_NAME) -> None:
    """Read the status word (this waits for the GPU) and raise KernelError if kernel ``name`` refused a launch."""
    status = status_word()
    code = int(status.get()[0])
    if code != 0:
        status.fill(0)  # reported once
        raise_status(code, name)


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


def padded_heads(a, HS: int, lib=xp):
    """(..., hs) -> a C-contiguous float32 (..., HS) of array module ``lib`` (the backend's, or NumPy for the
    emulator), zeros in the columns past hs."""
    a = lib.ascontiguousarray(a, dtype=lib.float32)
    if a.shape[-1] == HS:
        return a
    out = lib.zeros(a.shape[:-1] + (HS,), dtype=lib.float32)
    out[..., : a.shape[-1]] = a
    return out


def flash_attention_v2_cuda(q, k, v, causal=True, return_lse: bool = False, source: Path = V2_SOURCE,
                            check_status: bool = True):
    """kernels/flash_attention_v2.cu on the GPU (cupy.RawKernel); same result as ``naive_attention``.

    (B, nh, Tq, hs) x 3 -> (B, nh, Tq, hs) float32 (and L (B, nh, Tq) with return_lse). Runs the kernel for
    head size v2_head_size(hs) (heads padded with zeros up to it); grid (ceil(Tq / 64), nh, B), block (128,),
    dynamic shared memory v2_smem_bytes(HS), opting in above 48 KiB. Raises SharedMemoryError when the
    device has less, KernelError (with check_status) when the kernel refuses the launch.
    """
    if not is_gpu():
        raise RuntimeError("flash_attention_v2_cuda needs a CUDA GPU (CuPy); use flash_attention_v2_emulated")
    B, nh, Tq, Tk, hs = check_inputs(q, k, v)
    HS = v2_head_size(hs)
    smem, name = v2_smem_bytes(HS), v2_kernel_name(HS)
    if smem > device_smem_limit():
        raise SharedMemoryError(f"{name} needs {smem} bytes of shared memory per block; this device offers "
                                f"{device_smem_limit()}")
    kernel = compile_raw_kernel(source, smem, name)
    q, k, v = (padded_heads(t, HS) for t in (q, k, v))
    out = xp.empty((B, nh, Tq, HS), dtype=xp.float32)
    lse = xp.empty((B, nh, Tq), dtype=xp.float32)
    args = (q, k, v, out, lse, status_word(), np.int32(Tq), np.int32(Tk), np.int32(bool(causal)),
            np.float32(1.0 / math.sqrt(hs)))
    kernel((-(-Tq // V2_BR), nh, B), (V2_THREADS,), args, shared_mem=smem)
    if check_status:
        check_kernel_status(name)
    out = out if HS == hs else xp.ascontiguousarray(out[..., :hs])
    return (out, lse) if return_lse else out


# --- on a CPU -----------------------------------------------------------------------------------------


def with_red_zone(a: np.ndarray) -> np.ndarray:
    """A float32 copy of a, followed in memory by RED_ZONE NaNs (like compute-sanitizer's guard bytes)."""
    buf = np.full(a.size + RED_ZONE, np.nan, dtype=np.float32)
    buf[: a.size] = a.reshape(-1)
    return buf


def launch_emulated(q, k, v, causal=True, Br: int = KERNEL_BLOCK_Q, Bc: int = 32,
                    smem_bytes: int | None = None, source: Path = KERNEL_SOURCE, sanitize: str | None = None,
                    race_window_us: int = 0):
    """One emulated launch with explicit tiles and shared memory, no Python-side limit checks.

    Returns (O, L, status): the kernel's own status code is returned, not raised, so tests can check
    that the kernel itself refuses bad launches. Raises KernelError when the emulator reports one
    (diverged barrier, shared memory beyond the emulated device's). ``race_window_us``: see build_emulator.
    """
    B, nh, Tq, Tk, hs = check_inputs(q, k, v)
    smem = kernel_smem_bytes(Br, Bc, hs) if smem_bytes is None else smem_bytes
    return emulate(KERNEL_NAME, source, sanitize, q, k, v, (hs, Bc, int(bool(causal)), 1.0 / math.sqrt(hs)),
                   (-(-Tq // Br), nh, B), Br, smem, DEFAULT_SMEM_BYTES, race_window_us)


def emulate(name: str, source: Path, sanitize: str | None, q, k, v, scalars: tuple, grid: tuple, block_x: int,
            smem: int, device_smem: int, race_window_us: int = 0):
    """One emulated launch of kernel ``name``: q, k, v (their head size is the kernel's) copied to the host
    with red zones, then (Q, K, V, O, L, status, Tq, Tk, *scalars) -> (O, L, status) as NumPy arrays.
    ``device_smem``: the most shared memory the emulated device gives a block."""
    B, nh, Tq, Tk, hs = check_inputs(q, k, v)
    q, k, v = (with_red_zone(np.ascontiguousarray(to_numpy(t), dtype=np.float32)) for t in (q, k, v))
    out = np.full(B * nh * Tq * hs + RED_ZONE, np.nan, dtype=np.float32)
    lse = np.full(B * nh * Tq + RED_ZONE, np.nan, dtype=np.float32)
    status = np.zeros(1, dtype=np.int32)
    args = (q, k, v, out, lse, status, Tq, Tk, *scalars)
    lib = build_emulator(source, sanitize, shared_bytes=device_smem, kernel=KERNELS[name],
                         race_window_us=race_window_us)
    try:
        run_emulated(lib, args, grid, block_x, smem, name)
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


def launch_v2_emulated(q, k, v, causal=True, smem_bytes: int | None = None, block_x: int = V2_THREADS,
                       source: Path = V2_SOURCE, sanitize: str | None = None, race_window_us: int = 0):
    """One emulated launch of v2 (head size padded to its kernel's), no Python-side limit checks -> (O, L,
    status) with O of the padded head size: the kernel's status is returned, not raised. The emulated device
    offers what an H100/H200 block may opt in to (EMULATED_SMEM_OPTIN)."""
    B, nh, Tq, Tk, hs = check_inputs(q, k, v)
    HS = v2_head_size(hs)
    q, k, v = (padded_heads(to_numpy(t), HS, np) for t in (q, k, v))  # the emulator runs on the host
    smem = v2_smem_bytes(HS) if smem_bytes is None else smem_bytes
    return emulate(v2_kernel_name(HS), source, sanitize, q, k, v, (int(bool(causal)), 1.0 / math.sqrt(hs)),
                   (-(-Tq // V2_BR), nh, B), block_x, smem, EMULATED_SMEM_OPTIN, race_window_us)


def flash_attention_v2_emulated(q, k, v, causal=True, return_lse: bool = False, source: Path = V2_SOURCE,
                                sanitize: str | None = None):
    """kernels/flash_attention_v2.cu run on the CPU through cuda_emu.h: (B, nh, Tq, hs) x 3 -> NumPy
    (B, nh, Tq, hs) float32 (and L with return_lse). Each block's 128 threads run as real threads, the warp
    shuffles as warp-wide barriers: for checking, not for speed."""
    out, lse, status = launch_v2_emulated(q, k, v, causal, source=source, sanitize=sanitize)
    raise_status(status, v2_kernel_name(v2_head_size(q.shape[-1])))
    out = np.ascontiguousarray(out[..., : q.shape[-1]])
    return (out, lse) if return_lse else out


def attention_by_kernel(on_gpu, emulated, q, k, v, causal, mask):
    """Attention by one of the CUDA kernels: ``on_gpu`` (its launcher on a GPU, without waiting for the GPU
    mid-forward), else ``emulated`` (the same kernel on the CPU), on the backend's arrays. The kernels know
    the causal rule only: an explicit ``mask`` (a token tree's) is a ValueError."""
    if mask is not None:
        raise ValueError("the CUDA kernels apply the causal mask only; verify token trees with "
                         "attention='auto', 'naive' or 'flash'")
    if is_gpu():
        return on_gpu(q, k, v, causal, check_status=False)
    return xp.asarray(emulated(q, k, v, causal))


def kernel_attention(q, k, v, causal=True, mask=None):
    """softmax(q k^T / sqrt(hs) + mask) v by the CUDA kernel: on a GPU, else the same kernel emulated.

    (B, nh, Tq, hs), (B, nh, Tk, hs) x 2 -> (B, nh, Tq, hs) on the backend's arrays, like ``naive_attention``.
    The kernel knows the causal rule only: an explicit ``mask`` (a token tree's) is refused.
    """
    return attention_by_kernel(flash_attention_cuda, flash_attention_emulated, q, k, v, causal, mask)


def kernel_attention_v2(q, k, v, causal=True, mask=None):
    """``kernel_attention`` with kernels/flash_attention_v2.cu: on a GPU, else the same kernel emulated."""
    return attention_by_kernel(flash_attention_v2_cuda, flash_attention_v2_emulated, q, k, v, causal, mask)
