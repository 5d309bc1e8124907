"""y = x @ W.T by a raw CUDA kernel that reads a GGUF Q8_0 or Q4_1 weight's blocks as they lie in the file.

    y[i, j] = sum_t x[i, t] w[j, t]       x (n, k) float32, n = 1..16;  W (m, k) Q8_0 | Q4_1  ->  y (n, m) float32

The reference is ``reference(x, w) = x @ w.dequantize().T``: minillm.quantize's NumPy dequantizers are the
specification, the kernel is checked against them (tests/test_qcuda.py). kernels/quant.cu holds the kernel,
one per format (``q8_0_product``, ``q4_1_product``): a warp owns 2 rows of W, lane j dequantizes weight j of
each block once and multiplies it into all n token rows, x is staged in shared memory a tile at a time, and the
lanes' partial sums meet by warp shuffles. ``quant_product(x, w)`` runs it

    on a GPU (CuPy)                   the kernel, compiled by NVRTC
    under MINILLM_BACKEND=strict      the same kernel through the strict stand-in's RawKernel (the g++ emulation)
    on NumPy                          the reference; ``emulated=True`` runs the CUDA source on the CPU instead

(as minillm.fused runs kernels/fused.cu). On a device the weight's bytes live in a ``DeviceBlocks``
(``to_device(w)``, uploaded once); a Q8_0 or Q4_1 passed as it is is uploaded on every call.

    w = Q4_1.quantize(W)                  # (m, k) float32 -> 20-byte blocks
    y = quant_product(x, to_device(w))    # (n, k) -> (n, m), within float32 rounding of x @ w.dequantize().T
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backend import is_gpu, to_numpy, xp
from .kernels.build import QUANT, QUANT_DEFINES, QUANT_SOURCE, build_emulator, raise_status, run_emulated
from .kernels.launch import RED_ZONE, check_kernel_status, compile_raw_kernel, status_word, with_red_zone
from .quantize import Q4_1, Q8_0

QROWS_MAX, QROWS_PER_BLOCK, QTHREADS, QTILE_K = (QUANT_DEFINES[n][0] for n in ("QROWS_MAX", "QROWS_PER_BLOCK",
                                                                                 "QTHREADS", "QTILE_K"))
KERNEL_OF = {Q8_0: "q8_0_product", Q4_1: "q4_1_product"}  # format -> its kernel in kernels/quant.cu
FLOAT_BYTES = 4
WORD_BYTES = 4  # the kernel takes W's bytes as int32 words


def reference(x, w) -> np.ndarray:
    """y = x @ W.T with W dequantized by minillm.quantize.  x (n, k), w (m, k) -> (n, m) float32"""
    return x @ w.dequantize().T


def kernel_name(w) -> str:
    """The kernel of w's format; a TypeError for a format the kernel does not read."""
    if type(w) not in KERNEL_OF:
        raise TypeError(f"the quantized kernel reads Q8_0 or Q4_1 weights (minillm.quantize), got {type(w).__name__}")
    return KERNEL_OF[type(w)]


def check_product(x, shape) -> tuple[int, int, int]:
    """x (n, k) for a weight of ``shape`` (m, k) -> (n, k, m); a ValueError naming the problem, before anything
    is allocated or launched. Example: x (3, 576), W (49152, 576) -> (3, 576, 49152)."""
    m, k = shape
    if getattr(x, "ndim", None) != 2 or x.dtype.kind != "f":
        raise ValueError(f"x must be a 2-D float array (n, k), got {type(x).__name__} {getattr(x, 'shape', '')}")
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} inputs per row but the weight {shape} takes {k} "
                         f"(a whole number of 32-weight blocks)")
    n = x.shape[0]
    if not 1 <= n <= QROWS_MAX:
        raise ValueError(f"the quantized kernel takes 1..{QROWS_MAX} token rows (QROWS_MAX in kernels/quant.cu), "
                         f"got {n}: run longer inputs in chunks")
    return n, k, m


def grid(m: int) -> tuple[int, int, int]:
    """One block per QROWS_PER_BLOCK (8) rows of W.  m = 576 -> (72, 1, 1); m = 13 -> (2, 1, 1)."""
    return -(-m // QROWS_PER_BLOCK), 1, 1


def smem_bytes(n: int, k: int) -> int:
    """The kernel's dynamic shared memory: a tile of x, n rows of min(QTILE_K, k) floats.
    n = 16, k = 576 -> 32,768 bytes (the most any launch asks for); n = 1, k = 64 -> 256."""
    return FLOAT_BYTES * n * min(QTILE_K, k)


def block_words(raw, red_zone: int = 0) -> np.ndarray:
    """A weight's raw bytes (m, row bytes) uint8 -> int32 words holding them in order, zero bytes up to a whole
    word, then ``red_zone`` words of 0xFFFFFFFF (every fp16 there is NaN: a block read past the end shows).
    Example: one Q8_0 block (34 bytes) -> 9 words, the last two bytes 0."""
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    words = -(-data.size // WORD_BYTES)
    out = np.full(words + red_zone, -1, dtype=np.int32)
    out[:words] = 0
    out.view(np.uint8)[: data.size] = data
    return out


@dataclass(frozen=True)
class DeviceBlocks:
    """A Q8_0 or Q4_1 weight with its bytes on the device (the backend's int32 words), uploaded once."""

    weight: Q8_0 | Q4_1
    words: object  # (ceil(bytes / 4),) int32, a backend array

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape


def to_device(w) -> DeviceBlocks:
    """Upload a Q8_0 / Q4_1 weight's blocks, as they are, for ``quant_product``."""
    kernel_name(w)
    return DeviceBlocks(w, xp.asarray(block_words(w.raw)))


def launch_emulated(name: str, words: np.ndarray, x, n: int, m: int, k: int,
                    source: Path = QUANT_SOURCE) -> tuple[np.ndarray, int]:
    """One launch of kernel ``name`` of ``source`` (quant.cu or a mutant) through the g++ emulation, with no
    Python-side checks -> (y (n, m), status): the kernel's own status code is returned, not raised, so tests can
    see the kernel refuse a launch. x gets a red zone of NaN (a read past its end shows in y)."""
    xs = with_red_zone(np.ascontiguousarray(to_numpy(x), dtype=np.float32))
    y = np.full(n * m + RED_ZONE, np.nan, dtype=np.float32)
    status = np.zeros(1, dtype=np.int32)
    lib = build_emulator(source, kernel=QUANT)
    args = (words, xs, y, status, np.int32(n), np.int32(m), np.int32(k))
    run_emulated(lib, args, grid(m), QTHREADS, smem_bytes(n, k), name)
    return y[: n * m].reshape(n, m), int(status[0])


def quant_product(x, w, emulated: bool = False, source: Path = QUANT_SOURCE, check_status: bool = True):
    """y = x @ W.T by kernels/quant.cu, W a Q8_0 / Q4_1 (or its ``DeviceBlocks``); same result as ``reference``
    within float32 rounding (the kernel sums lane by lane).

    x (n, k) with n = 1..16 -> y (n, m) float32, on the backend's arrays (NumPy with ``emulated``). On a device
    the launch is asynchronous: only ``check_status`` reads the kernel's status back, which waits for the device
    (``check_product`` has already refused everything the kernel would). ``source``: a mutant of quant.cu, run
    emulated."""
    blocks = w if isinstance(w, DeviceBlocks) else None
    weight = w if blocks is None else blocks.weight
    name = kernel_name(weight)
    n, k, m = check_product(x, weight.shape)
    if emulated or source != QUANT_SOURCE:
        y, status = launch_emulated(name, block_words(weight.raw, RED_ZONE), x, n, m, k, source)
        raise_status(status, name)
        return y
    if not is_gpu():
        return reference(x, weight)
    blocks = blocks or to_device(weight)
    y = xp.empty((n, m), dtype=xp.float32)
    smem = smem_bytes(n, k)
    args = (blocks.words, xp.ascontiguousarray(x, dtype=xp.float32), y, status_word(), np.int32(n), np.int32(m),
            np.int32(k))
    compile_raw_kernel(source, smem, name)(grid(m), (QTHREADS,), args, shared_mem=smem)
    if check_status:
        check_kernel_status(name)
    return y
