"""FlashAttention: exact attention without the N x N matrix, by tiling and an online softmax.

    O = softmax(Q K^T / sqrt(hs) + mask) V          (Dao et al. 2022, "FlashAttention")

Standard attention (``minillm.attention.naive_attention``, the reference for everything here) writes
the (Tq, Tk) score matrix to memory, reads it back for the softmax, writes the probabilities and
reads them again: O(N^2) memory traffic and O(N^2) memory. FlashAttention streams K and V past each
query tile in blocks small enough for on-chip SRAM and keeps, per query row, a running max m, a
running sum l and an unnormalized output O (the online softmax), rescaling them whenever the max
grows. The result equals the full softmax exactly (up to float rounding).

This module holds the chapter in the order of the notebook (notebooks/04_flash_attention.ipynb):

1. ``online_softmax``        the streaming softmax of Milakov & Gimelshein (2018)
2. ``flash_attention``       the tiled algorithm in array code (NumPy/CuPy), laid out like the kernel
3. ``attention_io_bytes``    the HBM traffic model of standard vs tiled attention (paper, Theorem 2)
4. the CUDA kernel ``kernels/flash_attention.cu`` and its two launchers:
   ``flash_attention_cuda``  (a GPU, through cupy.RawKernel) and ``flash_attention_emulated``
   (any CPU: the same .cu compiled by g++ against ``kernels/cuda_emu.h``)
5. ``attention_function``    name -> implementation, used by ``minillm.attention.get_attention``
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from .attention import naive_attention  # noqa: F401  (the reference; named in the docstrings)
from .backend import is_gpu, to_numpy, xp

KERNEL_DIR = Path(__file__).parent / "kernels"
KERNEL_SOURCE = KERNEL_DIR / "flash_attention.cu"
EMU_HEADER = KERNEL_DIR / "cuda_emu.h"
KERNEL_NAME = "flash_attention_forward"
HS_MAX = 128  # the kernel's HS_MAX
KERNEL_BLOCK_Q = 32  # Br: query rows per tile = threads per block (one warp)
DEFAULT_SMEM_BYTES = 48 * 1024  # shared memory every NVIDIA GPU gives a block without opting in
EMU_SMEM_BYTES = 48 * 1024  # the emulated device's shared memory per block (cuda_emu.h)
FLOAT_BYTES = 4
KERNEL_STATUS = {  # the kernel's FLASH_* codes
    1: f"head size out of range (the kernel takes 1..{HS_MAX})",
    2: "bad block shape (Bc < 1, or a 2-D/3-D block)",
    3: "the launch gave less dynamic shared memory than the tiles need",
}


class SharedMemoryError(ValueError):
    """The requested tile needs more shared memory than the device offers a block."""


class KernelError(RuntimeError):
    """A kernel launch failed: a limit the kernel checks, a compile error, a diverged barrier."""


# ------------------------------------------------------------------------------------------------
# 1. online softmax
# ------------------------------------------------------------------------------------------------


def online_softmax(x, block: int = 32):
    """softmax(x) along the last axis, reading x in blocks with a running max m and running sum l.

    Milakov & Gimelshein (2018), "Online normalizer calculation for softmax", Algorithm 3:
        m_new = max(m, max(x_blk))
        l_new = l * exp(m - m_new) + sum(exp(x_blk - m_new))     # rescale the old sum!
    then y = exp(x - m) / l. One pass computes (m, l); the classic safe softmax needs two
    (max, then sum). Shapes: (..., N) -> (..., N); any N >= 1 and any block >= 1.
    A row that is entirely -inf gives zeros, like ``minillm.attention.softmax``.

    Example, block=2: x = [1, 3, 2]
        block [1, 3]: m = 3, l = e^-2 + 1                     = 1.1353
        block [2]:    m = 3, l = 1.1353 * e^0 + e^-1          = 1.5032
        y = exp(x - 3) / 1.5032 = [0.0900, 0.6652, 0.2447]
    """
    if block < 1:
        raise ValueError(f"online_softmax: block must be >= 1, got {block}")
    # EXERCISE 4.1 BEGIN: one pass over x in blocks keeping a running max m and running sum l
    N = x.shape[-1]
    m = xp.full(x.shape[:-1], -xp.inf, dtype=x.dtype)  # (...,) running max
    l = xp.zeros(x.shape[:-1], dtype=x.dtype)  # (...,) running sum of exp(x - m)
    for start in range(0, N, block):
        blk = x[..., start : start + block]  # (..., <=block)
        m_new = xp.maximum(m, blk.max(axis=-1))
        m_ref = xp.where(xp.isfinite(m_new), m_new, 0)  # all -inf so far: keep exp() at 0, not NaN
        l = l * xp.exp(m - m_ref) + xp.exp(blk - m_ref[..., None]).sum(axis=-1)
        m = m_new
    m_ref = xp.where(xp.isfinite(m), m, 0)
    return xp.exp(x - m_ref[..., None]) / xp.where(l == 0, 1, l)[..., None]
    # EXERCISE 4.1 END


# ------------------------------------------------------------------------------------------------
# 2. tiled attention in array code
# ------------------------------------------------------------------------------------------------


def flash_tile_update(m, l, o, s, v):
    """Fold one tile of scores into the running (m, l, O) of each query row: the heart of FlashAttention.

    m, l (..., Br); o (..., Br, hs); s (..., Br, Bc) scores with masked entries -inf; v (..., Bc, hs).
        m_new = max(m, rowmax(s))
        P     = exp(s - m_new)
        l_new = exp(m - m_new) * l + rowsum(P)
        O_new = exp(m - m_new) * O + P v          (O stays unnormalized; divide by l at the end)
    FlashAttention-2 (Dao 2023), Algorithm 1, lines 8-10. A row whose scores are all -inf so far
    keeps m = -inf, l = 0, O = 0 (no NaN). Returns (m_new, l_new, O_new).
    """
    # EXERCISE 4.2 BEGIN: new running max, rescale l and O by exp(m - m_new), add this tile's P and P v
    m_new = xp.maximum(m, s.max(axis=-1))  # (..., Br)
    m_ref = xp.where(xp.isfinite(m_new), m_new, 0)  # rows with no visible key yet: exp() stays finite
    p = xp.exp(s - m_ref[..., None])  # (..., Br, Bc); masked scores -> 0
    alpha = xp.exp(m - m_ref)  # (..., Br) rescale factor, <= 1
    l_new = alpha * l + p.sum(axis=-1)
    o_new = alpha[..., None] * o + p @ v  # (..., Br, Bc) @ (..., Bc, hs) -> (..., Br, hs)
    return m_new, l_new, o_new
    # EXERCISE 4.2 END


def flash_attention(q, k, v, causal=True, block_q: int = 64, block_k: int = 64):
    """softmax(q k^T / sqrt(hs) + mask) v, tile by tile: the FlashAttention forward in array code.

    (B, nh, Tq, hs), (B, nh, Tk, hs), (B, nh, Tk, hs) -> O (B, nh, Tq, hs), L (B, nh, Tq)
    where L is each row's log-sum-exp of scores (what a backward pass keeps instead of P).
    Laid out like kernels/flash_attention.cu (FlashAttention-2 loop order): the outer loop walks
    query tiles Q_i (the kernel's thread blocks), the inner loop walks key tiles K_j, V_j and folds
    each into the running (m, l, O) with ``flash_tile_update``. Causal: query i sits at absolute
    position Tk - Tq + i (as in ``naive_attention``), and key tiles entirely in a query tile's future
    are skipped. Memory: one (Br, Bc) score tile at a time instead of the (Tq, Tk) matrix.
    """
    B, nh, Tq, hs = q.shape
    Tk = k.shape[-2]
    if Tq > Tk:
        raise ValueError(f"flash_attention: {Tq} queries but only {Tk} keys (need Tq <= Tk)")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"flash_attention: tile sizes must be >= 1, got {block_q} x {block_k}")
    scale = 1.0 / math.sqrt(hs)
    offset = Tk - Tq  # query row r sits at absolute position offset + r
    out = xp.empty(q.shape, dtype=q.dtype)  # (B, nh, Tq, hs)
    lse = xp.empty((B, nh, Tq), dtype=q.dtype)  # (B, nh, Tq)
    for i0 in range(0, Tq, block_q):  # query tile Q_i: rows i0..i1-1
        i1 = min(i0 + block_q, Tq)
        qi = q[:, :, i0:i1] * q.dtype.type(scale)  # (B, nh, Br, hs), pre-scaled
        m = xp.full((B, nh, i1 - i0), -xp.inf, dtype=q.dtype)  # (B, nh, Br) running max
        l = xp.zeros((B, nh, i1 - i0), dtype=q.dtype)  # (B, nh, Br) running sum
        o = xp.zeros((B, nh, i1 - i0, hs), dtype=q.dtype)  # (B, nh, Br, hs) unnormalized output
        k_end = min(Tk, offset + i1) if causal else Tk  # causal tile skipping: no key past the last row
        for j0 in range(0, k_end, block_k):  # key tile K_j, V_j: keys j0..j1-1
            j1 = min(j0 + block_k, Tk)
            s = qi @ k[:, :, j0:j1].swapaxes(-1, -2)  # (B, nh, Br, hs) @ (B, nh, hs, Bc) -> (B, nh, Br, Bc)
            if causal and j1 - 1 > offset + i0:  # the tile crosses the diagonal: mask the future
                visible = (xp.arange(j0, j1)[None, :] <= xp.arange(offset + i0, offset + i1)[:, None])
                s = xp.where(visible, s, -xp.inf)  # (Br, Bc) mask broadcast over (B, nh)
            m, l, o = flash_tile_update(m, l, o, s, v[:, :, j0:j1])
        out[:, :, i0:i1] = o / l[..., None]
        lse[:, :, i0:i1] = m + xp.log(l)
    return out, lse


# ------------------------------------------------------------------------------------------------
# 3. the IO model: bytes moved between HBM and the chip
# ------------------------------------------------------------------------------------------------


def io_model_tiles(M: int, d: int, dtype_bytes: int = FLOAT_BYTES) -> tuple[int, int]:
    """(Br, Bc) tile sizes for an SRAM of M bytes, the FlashAttention paper's rule with the loops swapped.

    Paper (Algorithm 1, outer loop over K/V): Bc = ceil(M / 4d), Br = min(Bc, d). Here the outer loop
    walks query tiles (FlashAttention-2 order, like our kernel), so the big tile is Q_i:
    Br = M' // 4d and Bc = min(Br, d), with M' = M / dtype_bytes elements.
    Example: M = 48 KiB, d = 64, float32 -> (48, 48); M = 192 KiB -> (192, 64).
    """
    Br = max(1, (M // dtype_bytes) // (4 * d))
    return Br, max(1, min(Br, d))


def attention_io_bytes(N: int, d: int, M: int, causal: bool = False, dtype_bytes: int = FLOAT_BYTES) -> dict:
    """HBM bytes moved by standard vs tiled attention for one head: Theta(Nd + N^2) vs Theta(N^2 d^2 / M).

    FlashAttention paper, Theorem 2, counted for the algorithms in this chapter (N queries and keys,
    head size d, SRAM of M bytes, elements of dtype_bytes):
      standard (naive_attention): read Q, K (2Nd), write S (N^2), read S and write P for the softmax
        (2 N^2), read P and V (N^2 + Nd), write O (Nd)           -> 4 N d + 4 N^2 elements.
      tiled (flash_attention, FlashAttention-2 loop order, tiles from io_model_tiles(M, d)): read Q and
        write O once (2 N d), write L (N), and for each of the ceil(N / Br) query tiles read the K and V
        rows it visits (2 d per key; causal visits only keys up to the tile's last row). With
        Br = M / 4d that is about 2 N d * N / Br = 8 N^2 d^2 / M elements: Theta(N^2 d^2 / M).
    Returns {"standard": bytes, "flash": bytes, "Br": Br, "Bc": Bc}.
    Example: N=8, d=2, M=64 bytes (Br = Bc = 2) -> standard 1280 bytes, flash 672 (causal: 480).
    """
    # EXERCISE 4.3 BEGIN: count the elements each algorithm reads and writes, times dtype_bytes
    standard = 4 * N * d + 4 * N * N  # Q, K in; S out, in; P out, in; V in; O out
    Br, Bc = io_model_tiles(M, d, dtype_bytes)
    keys_read = 0  # sum over query tiles of the number of key rows that tile reads
    for i0 in range(0, N, Br):
        keys_read += min(N, i0 + Br) if causal else N
    flash = 2 * N * d + N + 2 * d * keys_read  # Q in, O out, L out, K and V rows in
    return {"standard": standard * dtype_bytes, "flash": flash * dtype_bytes, "Br": Br, "Bc": Bc}
    # EXERCISE 4.3 END


# ------------------------------------------------------------------------------------------------
# 4. the CUDA kernel: tiles, shared memory, and two ways to launch it
# ------------------------------------------------------------------------------------------------


def kernel_smem_bytes(Br: int, Bc: int, hs: int) -> int:
    """Dynamic shared memory of one block, in BYTES (the kernel's flash_smem_floats times 4).

    Q_i, O_i: Br x (hs + 1) each (padded rows); K_j, V_j: Bc x hs each; S_i: Br x (Bc + 1).
    Example: Br = Bc = 32, hs = 64 -> 37,248 bytes.
    """
    return FLOAT_BYTES * (2 * Br * (hs + 1) + 2 * Bc * hs + Br * (Bc + 1))


def kernel_tiles(
    hs: int, smem_limit: int = DEFAULT_SMEM_BYTES, block_k: int | None = None
) -> tuple[int, int]:
    """(Br, Bc) for the kernel: Br = 32 (one warp), Bc the largest of 32, 16, 8 that fits in smem_limit.

    With block_k given, use it and raise SharedMemoryError when it does not fit.
    Examples (48 KiB): hs 16 -> (32, 32), hs 64 -> (32, 32), hs 128 -> (32, 8).
    """
    if not 1 <= hs <= HS_MAX:
        raise ValueError(f"the flash attention kernel takes head sizes 1..{HS_MAX}, got {hs}")
    Br = KERNEL_BLOCK_Q
    candidates = [block_k] if block_k is not None else [32, 16, 8, 4, 2, 1]
    for Bc in candidates:
        need = kernel_smem_bytes(Br, Bc, hs)
        if need <= smem_limit:
            return Br, Bc
    raise SharedMemoryError(
        f"the flash attention tile Br={Br} x Bc={candidates[-1]} at head size {hs} needs "
        f"{kernel_smem_bytes(Br, candidates[-1], hs)} bytes of shared memory, but the device offers "
        f"{smem_limit} bytes per block; use a smaller block_k"
    )


def _check_inputs(q, k, v):
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


def _raise_status(code: int):
    if code != 0:
        raise KernelError(f"flash_attention_forward refused the launch: {KERNEL_STATUS.get(code, code)}")


# --- on a GPU: NVRTC through cupy.RawKernel ---------------------------------------------------

_cuda_kernels: dict = {}


def _cuda_kernel(source: Path = KERNEL_SOURCE):
    """The compiled RawKernel (NVRTC), one per source file and device."""
    import cupy

    key = (str(source), cupy.cuda.Device().id)
    if key not in _cuda_kernels:
        _cuda_kernels[key] = cupy.RawKernel(source.read_text(), KERNEL_NAME, options=("--std=c++17",))
    return _cuda_kernels[key]


def device_smem_limit() -> int:
    """Most dynamic shared memory a block may use on this GPU after opting in (e.g. 232,448 on H100/H200)."""
    import cupy

    dev = cupy.cuda.Device()
    return int(dev.attributes["MaxSharedMemoryPerBlockOptin"])


def flash_attention_cuda(q, k, v, causal=True, block_k: int | None = None, return_lse: bool = False,
                         source: Path = KERNEL_SOURCE):
    """kernels/flash_attention.cu on the GPU (cupy.RawKernel); same result as ``naive_attention``.

    (B, nh, Tq, hs) x 3 -> (B, nh, Tq, hs) float32 (and L (B, nh, Tq) with return_lse).
    Grid (Tr, nh, B), block (Br,), dynamic shared memory kernel_smem_bytes(Br, Bc, hs). Raises
    SharedMemoryError when the tile needs more shared memory than the device has, KernelError when
    the kernel reports a violated limit.
    """
    if not is_gpu():
        raise RuntimeError("flash_attention_cuda needs a CUDA GPU (CuPy); use flash_attention_emulated")
    import cupy

    B, nh, Tq, Tk, hs = _check_inputs(q, k, v)
    limit = device_smem_limit()
    Br, Bc = kernel_tiles(hs, DEFAULT_SMEM_BYTES if block_k is None else limit, block_k)
    smem = kernel_smem_bytes(Br, Bc, hs)
    kernel = _cuda_kernel(source)
    if smem > DEFAULT_SMEM_BYTES:  # above 48 KiB a kernel must opt in
        kernel.max_dynamic_shared_size_bytes = smem
    q, k, v = (cupy.ascontiguousarray(t, dtype=cupy.float32) for t in (q, k, v))
    out = cupy.empty((B, nh, Tq, hs), dtype=cupy.float32)
    lse = cupy.empty((B, nh, Tq), dtype=cupy.float32)
    status = cupy.zeros(1, dtype=cupy.int32)
    Tr = (Tq + Br - 1) // Br
    args = (q, k, v, out, lse, status, np.int32(Tq), np.int32(Tk), np.int32(hs), np.int32(Bc),
            np.int32(bool(causal)), np.float32(1.0 / math.sqrt(hs)))  # fmt: skip
    kernel((Tr, nh, B), (Br,), args, shared_mem=smem)
    cupy.cuda.get_current_stream().synchronize()
    _raise_status(int(status.get()[0]))
    return (out, lse) if return_lse else out


# --- on a CPU: the same .cu, compiled by g++ against cuda_emu.h --------------------------------

# The launcher translation unit: the .cu unchanged, the storage for `extern __shared__ float sram[]`,
# and one extern "C" entry point for ctypes that does what <<<grid, block, smem>>> does.
_EMU_LAUNCHER = """\
#include "{source}"
CUDA_EMU_DYNAMIC_SHARED(float, sram);
extern "C" int launch_flash_attention_forward(
    const float* Q, const float* K, const float* V, float* O, float* L, int* status,
    int Tq, int Tk, int d, int Bc, int causal, float scale,
    unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned smem, char* err, int errlen) {{
    return cuda_emu::launch(dim3(gx, gy, gz), dim3(bx), smem, sram, err, errlen, flash_attention_forward,
                            Q, K, V, O, L, status, Tq, Tk, d, Bc, causal, scale);
}}
"""
EMU_FLAGS = ["-std=c++20", "-O2", "-shared", "-fPIC", "-pthread"]
SANITIZE_FLAGS = {None: [], "thread": ["-fsanitize=thread", "-g"], "address": ["-fsanitize=address", "-g"]}
RED_ZONE = 8192  # NaN floats after each input buffer: a read past the end turns the output into NaN

_emu_lock = threading.Lock()  # launches are serialized (ctypes releases the GIL)
_emu_libs: dict = {}


def kernel_cache_dir() -> Path:
    """Where built kernels are cached: $MINILLM_KERNEL_CACHE, else minillm/kernels/_build if writable."""
    env = os.environ.get("MINILLM_KERNEL_CACHE")
    d = Path(env) if env else KERNEL_DIR / "_build"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = Path(tempfile.gettempdir()) / "minillm_kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def build_emulator(source: Path = KERNEL_SOURCE, sanitize: str | None = None, compiler: str = "g++") -> Path:
    """Compile a .cu + cuda_emu.h into a shared library once; later calls return the cached path.

    The cache key hashes the kernel source, the header, the flags and the compiler, so editing the .cu
    rebuilds it. Raises KernelError with g++'s message when the compile fails.
    """
    source = Path(source).resolve()
    cxx = shutil.which(compiler)
    if cxx is None:
        raise KernelError(f"{compiler} not found: emulating the CUDA kernel on a CPU needs a C++20 compiler")
    flags = EMU_FLAGS + SANITIZE_FLAGS[sanitize] + ["-include", str(EMU_HEADER)]
    h = hashlib.sha256()
    for part in (source.read_bytes(), EMU_HEADER.read_bytes(), " ".join(flags).encode(), cxx.encode()):
        h.update(part)
    tag = f"{source.stem}-{sanitize or 'plain'}-{h.hexdigest()[:16]}"
    out_dir = kernel_cache_dir()
    lib = out_dir / f"{tag}.so"
    if lib.exists():
        return lib
    launcher = out_dir / f"{tag}.cpp"
    launcher.write_text(_EMU_LAUNCHER.format(source=source.as_posix()))
    tmp = out_dir / f"{tag}.{os.getpid()}.tmp.so"
    proc = subprocess.run([cxx, *flags, str(launcher), "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelError(f"g++ could not build {source.name} against cuda_emu.h:\n{proc.stderr}")
    os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    return lib


def _load_emulator(lib: Path):
    if lib not in _emu_libs:
        fn = ctypes.CDLL(str(lib)).launch_flash_attention_forward
        fp, ip = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int)
        c_int, c_uint = ctypes.c_int, ctypes.c_uint
        fn.argtypes = [fp, fp, fp, fp, fp, ip, c_int, c_int, c_int, c_int, c_int, ctypes.c_float,
                       c_uint, c_uint, c_uint, c_uint, c_uint, ctypes.c_char_p, c_int]  # fmt: skip
        fn.restype = c_int
        _emu_libs[lib] = fn
    return _emu_libs[lib]


def _with_red_zone(a: np.ndarray) -> np.ndarray:
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
    B, nh, Tq, Tk, hs = _check_inputs(q, k, v)
    q, k, v = (_with_red_zone(np.ascontiguousarray(to_numpy(t), dtype=np.float32)) for t in (q, k, v))
    out = np.full(B * nh * Tq * hs + RED_ZONE, np.nan, dtype=np.float32)
    lse = np.full(B * nh * Tq + RED_ZONE, np.nan, dtype=np.float32)
    status = np.zeros(1, dtype=np.int32)
    smem = kernel_smem_bytes(Br, Bc, hs) if smem_bytes is None else smem_bytes
    Tr = (Tq + Br - 1) // Br
    fn = _load_emulator(build_emulator(source, sanitize))
    err = ctypes.create_string_buffer(1024)
    fp = ctypes.POINTER(ctypes.c_float)
    pointers = [a.ctypes.data_as(fp) for a in (q, k, v, out, lse)]
    pointers.append(status.ctypes.data_as(ctypes.POINTER(ctypes.c_int)))
    scalars = [Tq, Tk, hs, Bc, int(bool(causal)), 1.0 / math.sqrt(hs)]  # the kernel's int/float arguments
    launch = [Tr, nh, B, Br, smem]  # grid (Tr, nh, B), block (Br,), dynamic shared memory in bytes
    with _emu_lock:
        rc = fn(*pointers, *scalars, *launch, err, len(err))
    if rc != 0:
        raise KernelError(f"emulated launch of {Path(source).name} failed: {err.value.decode()}")
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
    hs = q.shape[-1]
    Br, Bc = kernel_tiles(hs, EMU_SMEM_BYTES, block_k)
    out, lse, status = launch_emulated(q, k, v, causal, Br, Bc, source=source, sanitize=sanitize)
    _raise_status(status)
    return (out, lse) if return_lse else out


# --- what the compiler made of it: nvcc's resource report -----------------------------------------

_PTXAS_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "stack_frame": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
}


def parse_ptxas_report(text: str) -> dict:
    """The numbers in `nvcc -Xptxas -v` output -> {registers, stack_frame, spill_stores, spill_loads}.

    Example: "0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads ... Used 255 registers"
    -> {"registers": 255, "stack_frame": 0, "spill_stores": 8, "spill_loads": 8}. Raises ValueError
    when a number is missing (an unexpected report must not pass as "no spills").
    """
    import re

    out = {}
    for key, pattern in _PTXAS_PATTERNS.items():
        found = re.search(pattern, text)
        if found is None:
            raise ValueError(f"no '{key}' in the ptxas report:\n{text}")
        out[key] = int(found.group(1))
    return out


def nvcc_resource_report(arch: str = "sm_90", source: Path = KERNEL_SOURCE, nvcc: str = "nvcc",
                         extra_flags: tuple[str, ...] = ()) -> dict:
    """Compile the kernel for one GPU architecture with nvcc (device code only) and read ptxas's report.

    nvcc -arch=<arch> -cubin -Xptxas -v [extra_flags] <source>. Returns parse_ptxas_report(...) plus
    "arch" and the raw "report". Spills (registers that did not fit, moved to slow local memory) should be 0.
    Raises KernelError when nvcc is missing or the compile fails.
    """
    exe = shutil.which(nvcc)
    if exe is None:
        raise KernelError(f"{nvcc} not found: install the CUDA toolkit to see the resource report")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = str(Path(tmp) / "k.cubin")
        cmd = [exe, f"-arch={arch}", "-cubin", "-Xptxas", "-v", *extra_flags, str(source), "-o", cubin]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelError(f"nvcc could not compile {Path(source).name} for {arch}:\n{proc.stderr}")
    report = proc.stdout + proc.stderr
    return {"arch": arch, **parse_ptxas_report(report), "report": report.strip()}


# ------------------------------------------------------------------------------------------------
# 5. dispatch
# ------------------------------------------------------------------------------------------------


def _flash_output(q, k, v, causal=True):
    return flash_attention(q, k, v, causal)[0]


def _cuda_or_emulated(q, k, v, causal=True):
    if is_gpu():
        return flash_attention_cuda(q, k, v, causal)
    return xp.asarray(flash_attention_emulated(q, k, v, causal))


def attention_function(name: str):
    """'flash' -> tiled array code; 'cuda' -> the CUDA kernel (on a CPU: the same kernel, emulated).

    Both have the signature f(q, k, v, causal=True) -> (B, nh, Tq, hs), like naive_attention.
    """
    if name == "flash":
        return _flash_output
    if name == "cuda":
        return _cuda_or_emulated
    raise ValueError(f"unknown flash attention implementation {name!r}: use 'flash' or 'cuda'")
