"""Quantized weight products on one CPU core: y = x @ W.T, each weight read and dequantized ONCE per pass.

    y[i, j] = sum_t x[i, t] w[j, t]          x (n, k) float32, W (m, k) in a format -> y (n, m) float32

The reference is ``x @ W.dequantize().T`` (``minillm.quantize`` holds the formats and their NumPy
dequantizers). A decode step (n = 1) or a short verification (n <= 16) is memory-bound: the time is
the bytes of W over the memory bandwidth, so a 4-bit weight should cost a sixth of a float32 one --
but only if it is never expanded to float32 in memory. These kernels expand each weight in registers,
multiply it into all n token rows there, and move on.

The layout, packed once (``pack``). W's m rows are cut into panels of P = 16 output channels, and a
panel is stored input position by input position, so that the P weights of one position are adjacent:

    F32    w    [m/P, k, P]  float32          BF16   bits [m/P, k, P]  uint16
    Q8_0   d    [m/P, k/32, P]  fp16 bits     q    [m/P, k/32, 32, P]  int8
    Q4_1   dm   [m/P, k/32, 2, P] fp16 bits   qs   [m/P, k/32, 16, P]  uint8 (q[j] | q[j + 16] << 4)

The block formats keep their file's bytes per weight (the fp16 scales stay fp16). One position of a
panel is one 16-lane vector on AVX-512 (two 8-lane ones on AVX2): load it, dequantize it (``d * q + m``
for Q4_1: 8 instructions for the two positions a byte row holds), and add it times x[i, t] into R
accumulators, one per token row. (Q4_1's kernel instead multiplies q itself into a block's sums and applies d
and m once per block of 32 positions, ``q4_1_kernel`` and ``block_shape``, where those sums fit the
registers.)

    for each panel (16 outputs), L of them at a time:  acc (U, R, L) lives in registers
        for t in 0..k-1:                               (U copies of the R rows, see below)
            w = dequantize(panel[t])                   # [L]   once per pass
            for r in 0..R-1:  acc[t % U, r] += x[r, t] * w        # vfmadd231ps, broadcast x
        y[:, outputs] = sum over U of acc

Each step also asks the CPU for the panel's bytes PREFETCH_BYTES (16 KB) ahead (``prefetch``, one
``prefetcht0`` per 64-byte line): the hardware prefetcher alone left the loads waiting, most at n = 8
(a pass 5 to 25 % faster with it, docs/quantization.md).

R is the number of token rows (n rounded up to 1 to 6, 8 or 16; the missing rows are zeros), a
compile-time constant so that the sums stay in registers. An FMA takes 4 cycles and a core starts 2
per cycle, so 8 independent sums keep it busy: with R < 8 rows, positions t % U go to U separate sums.
How many fit is the CPU's register file (``kernel_shape``, one rule for every caller): with AVX-512's
32 zmm, U = 8 / R and L = 16, the whole panel. With AVX2's 16 ymm a panel row is two vectors, and 8
sums of two vectors would be every register: U is 2 at R = 1 and 1 from R = 2, the kernels for 8 rows
(and Q4_1's for 4) take the panel L = 8 outputs at a time (the second half reads the panel again from
the cache), and 16 rows do not fit at all. Past the largest row tile (16, or 8 on AVX2) the product
runs in chunks, dequantizing each weight once per chunk. ``stack_spills`` counts the stack loads and
stores in a kernel's inner loop; the tests require 0 for the kernels of one row.

What numba needed (each setting is applied only while these kernels compile, ``vector_compile``):

- the accumulators in registers: a stack array (``stack_tile``, an LLVM ``alloca`` of constant size)
  that LLVM's SROA pass turns into registers once the loops over r and p are unrolled; a NumPy array
  would live on the heap and be loaded and stored on every step;
- the SLP vectorizer on (``NUMBA_SLP_VECTORIZE``, off by default): it packs the 16 unrolled lanes into
  one vector instruction; the loop vectorizer off (``NUMBA_LOOP_VECTORIZE=0``): it would vectorize
  the wrong loop first (across rows, with gathers) before the unrolling that SLP needs;
- ``fastmath`` with ``contract``, which fuses each multiply and add into one FMA (without it there is
  no FMA at all). ``reassoc`` is left out: no sum here needs reordering (the 16 lanes are 16 different
  outputs), so each sum keeps the order the code gives it;
- fp16 and bf16 conversions as single LLVM instructions (``half_to_f32``, ``bits_to_f32``): numba
  has no float16 type on a CPU.

With numba's default settings the same kernels compile to scalar FMAs (vfmadd231ss), 16 per position;
``tests/test_qkernels.py`` reads the machine code (``vector_fma_count``) and fails if that happens.

Compiled with ``cache=True``: the first use of a (format, R) compiles (0.3-0.8 s of CPU each on a 2-core
EPYC, 32 kernels in all, 28 on AVX2; docs/quantization.md), later processes load the machine code. Everything
runs on the calling thread (no ``prange``).

An option that is not exact, ``product(x, W, int8_x=True)`` for Q8_0 and Q4_1 on a CPU with AVX512-VNNI or
AVX2 (``int8_isa``): x is quantized to int8 per block of 32, as llama.cpp does, and the kernels
(``INT8_KERNELS``) multiply integers on the same panels, with vpdpbusd or with vpmaddubsw and vpmaddwd
(section "int8 activations" below). The default stays exact.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass, replace

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cpu_target
from .cpu_target import host_features, host_vector
from .quantize import BF16, F32, Q4_1, Q4_1_BYTES, Q8_0, Q8_0_BYTES, QK, QuantError

P = 16  # output channels per panel: one 512-bit vector of float32 (two 256-bit ones with AVX2)
ROW_TILES = (1, 2, 3, 4, 5, 6, 8, 16)  # token rows a kernel is compiled for (n is rounded up to one of these):
# every n up to 6, since a verify of 4 or 5 drafted tokens is 5 or 6 rows (a pass 14-25 % faster than padded to 8)
MAX_ROWS = ROW_TILES[-1]  # the most rows a kernel is compiled for; row_tiles() says which tiles fit this CPU
FMA_CHAINS = 8  # independent sums that keep the FMA units busy (latency 4 x 2 per cycle); see kernel_shape
BLOCK_CHAINS = 2  # independent sums of a Q4_1 block (q4_1_kernel); see block_shape
WEIGHT_REGISTERS = {"F32": 1, "BF16": 1, "Q8_0": 2, "Q4_1": 4}  # vectors a format's dequantization holds per
# vector of outputs: the weight (F32, BF16), d and the weight (Q8_0), d, m and the two weights of a byte (Q4_1)
PREFETCH_BYTES = 16384  # how far ahead of the loads the kernels ask for the weight's next bytes (docs/quantization.md)
FASTMATH = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}  # fastmath without "reassoc" (docstring)
cpu_target.full_width()  # 512-bit vectors on AVX-512, before the first numba function of the process
jit = numba.njit(cache=True, fastmath=FASTMATH, nogil=True, boundscheck=False)
inline = numba.njit(inline="always", fastmath=FASTMATH)


# ---- what numba needs: registers for the tile, two conversions, the vectorizer settings ------------


@intrinsic(prefer_literal=True)
def stack_tile(typingctx, d0, d1, d2):
    """A (d0, d1, d2) float32 array in the function's stack frame (d0, d1, d2 compile-time constants)."""
    if not all(isinstance(d, types.IntegerLiteral) for d in (d0, d1, d2)):
        return None
    shape = [d.literal_value for d in (d0, d1, d2)]
    array = types.Array(types.float32, 3, "C")

    def codegen(context, builder, sig, args):
        with builder.goto_entry_block():  # an alloca in the entry block: SROA can promote it to registers
            memory = builder.alloca(ir.ArrayType(ir.FloatType(), shape[0] * shape[1] * shape[2]))
        intp = context.get_value_type(types.intp)
        strides = [shape[1] * shape[2] * 4, shape[2] * 4, 4]
        tile = context.make_array(array)(context, builder)
        context.populate_array(tile, data=builder.bitcast(memory, ir.FloatType().as_pointer()),
                               shape=[ir.Constant(intp, s) for s in shape],
                               strides=[ir.Constant(intp, s) for s in strides],
                               itemsize=ir.Constant(intp, 4), meminfo=None)
        return tile._getvalue()

    return array(d0, d1, d2), codegen


@intrinsic
def half_to_f32(typingctx, bits):
    """fp16 bits (uint16) -> float32, exactly: one ``fpext half`` (vcvtph2ps)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def bits_to_f32(typingctx, bits):
    """uint32 bits -> the float32 they encode (a bf16 is its top 16 bits)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def prefetch(typingctx, array, offset):
    """Ask the CPU to start loading the cache line at byte ``offset`` of array's data into L1 (``llvm.prefetch``,
    ``prefetcht0``). A hint only: it never faults, so an offset past the end is harmless."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        byte = builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [args[1]])
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte.type, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [byte, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data
        return context.get_dummy_value()

    return types.none(array, types.intp), codegen


@contextlib.contextmanager
def vector_compile():
    """While numba compiles: SLP vectorizer on, loop vectorizer off (module docstring); restored after."""
    saved = numba.config.SLP_VECTORIZE, numba.config.LOOP_VECTORIZE
    numba.config.SLP_VECTORIZE, numba.config.LOOP_VECTORIZE = 1, 0
    try:
        yield
    finally:
        numba.config.SLP_VECTORIZE, numba.config.LOOP_VECTORIZE = saved


# ---- the tile: zero it, add one weight vector into every row, write it out ---------------------------


@inline
def zero(acc):
    for u in range(acc.shape[0]):
        for r in range(acc.shape[1]):
            for p in range(acc.shape[2]):
                acc[u, r, p] = 0.0


@inline
def add_rows(acc, u, x, t, w):
    """acc[u, r, :] += x[r, t] * w[:] for every row r.  acc (U, R, L), x (R, k), w (L,)"""
    for r in range(acc.shape[1]):
        xr = x[r, t]
        for p in range(acc.shape[2]):
            acc[u, r, p] += xr * w[p]


@inline
def store(acc, y, col):
    """y[r, col + p] = sum_u acc[u, r, p].  acc (U, R, L), y (R, m)"""
    for r in range(acc.shape[1]):
        for p in range(acc.shape[2]):
            s = acc[0, r, p]
            for u in range(1, acc.shape[0]):
                s += acc[u, r, p]
            y[r, col + p] = s


# ---- one kernel per format (rows R, chains U, lanes L: the literals that kernel_shape chooses) --------
#
# A panel's P outputs are computed L at a time: L = P, the whole panel, where its sums fit the registers;
# L = 8 on AVX2 for 8 rows (and Q4_1's 4): two sub-panels of one ymm each, the second reading the panel's
# bytes again from the L1/L2 cache, so that the U x R accumulators are U x R vector registers.


@jit
def f32_kernel(x, w, y, rows, chains, lanes):
    """y = x @ W.T for W packed F32.  x (R, k), w (m/P, k, P) float32, y (R, m)"""
    numba.literally(rows)
    numba.literally(chains)
    numba.literally(lanes)
    acc = stack_tile(chains, rows, lanes)
    k = w.shape[1]
    for panel in range(w.shape[0]):
        for lane in range(0, P, lanes):  # L outputs at a time; only the first pass prefetches
            zero(acc)
            t = 0
            while t + chains <= k:
                if rows >= 4 and lane == 0:  # with 1 or 2 rows the hints cost more than they save
                    ahead = (panel * k + t) * P * 4 + PREFETCH_BYTES  # one 64-byte line per position
                    for u in range(chains):
                        prefetch(w, ahead + 64 * u)
                for u in range(chains):
                    add_rows(acc, u, x, t + u, w[panel, t + u, lane:lane + lanes])
                t += chains
            while t < k:
                add_rows(acc, 0, x, t, w[panel, t, lane:lane + lanes])
                t += 1
            store(acc, y, panel * P + lane)


@jit
def bf16_kernel(x, bits, y, rows, chains, lanes):
    """y = x @ W.T for W packed BF16.  x (R, k), bits (m/P, k, P) uint16, y (R, m)"""
    numba.literally(rows)
    numba.literally(chains)
    numba.literally(lanes)
    acc = stack_tile(chains, rows, lanes)
    w = stack_tile(chains, 1, lanes)
    k = bits.shape[1]
    for panel in range(bits.shape[0]):
        for lane in range(0, P, lanes):
            zero(acc)
            t = 0
            while t + chains <= k:
                if lane == 0:
                    ahead = (panel * k + t) * P * 2 + PREFETCH_BYTES  # one line per two positions
                    for u in range(0, chains, 2):
                        prefetch(bits, ahead + 64 * (u // 2))
                for u in range(chains):
                    for p in range(lanes):
                        w[u, 0, p] = bits_to_f32(np.uint32(bits[panel, t + u, lane + p]) << np.uint32(16))
                    add_rows(acc, u, x, t + u, w[u, 0])
                t += chains
            while t < k:
                for p in range(lanes):
                    w[0, 0, p] = bits_to_f32(np.uint32(bits[panel, t, lane + p]) << np.uint32(16))
                add_rows(acc, 0, x, t, w[0, 0])
                t += 1
            store(acc, y, panel * P + lane)


@jit
def q8_0_kernel(x, d, q, y, rows, chains, lanes):
    """y = x @ W.T for W packed Q8_0 (w = d * q).  x (R, k), d (m/P, k/32, P) fp16 bits,
    q (m/P, k/32, 32, P) int8, y (R, m)"""
    numba.literally(rows)
    numba.literally(chains)
    numba.literally(lanes)
    acc = stack_tile(chains, rows, lanes)
    scale = stack_tile(1, 1, lanes)
    w = stack_tile(chains, 1, lanes)
    for panel in range(q.shape[0]):
        for lane in range(0, P, lanes):
            zero(acc)
            for b in range(q.shape[1]):
                if lane == 0:
                    ahead = (panel * q.shape[1] + b) * QK * P + PREFETCH_BYTES  # a block of 16 outputs: 8 lines of q
                    for line in range(QK * P // 64):
                        prefetch(q, ahead + 64 * line)
                    prefetch(d, ahead // 16)  # and 32 bytes of d
                for p in range(lanes):
                    scale[0, 0, p] = half_to_f32(d[panel, b, lane + p])
                for j in range(0, QK, chains):
                    for u in range(chains):
                        for p in range(lanes):
                            w[u, 0, p] = scale[0, 0, p] * np.float32(q[panel, b, j + u, lane + p])
                        add_rows(acc, u, x, b * QK + j + u, w[u, 0])
            store(acc, y, panel * P + lane)


@inline
def q4_1_block_start(dm, qs, scale, panel, b, lane):
    """Block b of a Q4_1 panel: its d and m into scale (2, 1, L); on the first lanes, the panel's bytes
    PREFETCH_BYTES ahead asked for (16 outputs: 4 lines of qs, and 64 bytes of dm)."""
    if lane == 0:
        ahead = (panel * qs.shape[1] + b) * (QK // 2) * P + PREFETCH_BYTES
        for line in range(QK // 2 * P // 64):
            prefetch(qs, ahead + 64 * line)
        prefetch(dm, ahead // 4)
    for p in range(scale.shape[2]):
        scale[0, 0, p] = half_to_f32(dm[panel, b, 0, lane + p])
        scale[1, 0, p] = half_to_f32(dm[panel, b, 1, lane + p])


@jit
def q4_1_kernel(x, dm, qs, y, rows, chains, lanes):
    """y = x @ W.T for W packed Q4_1, the block's d and m applied once per block:
    sum_t x[t] (d q[t] + m) = d * sum_t x[t] q[t] + m * sum_t x[t] over the block's 32 positions.
    x (R, k), dm (m/P, k/32, 2, P) fp16 bits, qs (m/P, k/32, 16, P) uint8 (low nibble: position j, high: j + 16),
    y (R, m)"""
    numba.literally(rows)
    numba.literally(chains)
    numba.literally(lanes)
    acc = stack_tile(1, rows, lanes)  # the outputs' sums
    block = stack_tile(chains, rows, lanes)  # one block's sums of x * q
    scale = stack_tile(2, 1, lanes)  # d, m of the block
    w = stack_tile(2, 1, lanes)  # q at positions j and j + 16, as floats
    half = QK // 2
    pairs = max(1, chains // 2)
    blocks = qs.shape[1]
    x_sums = np.empty((rows, blocks), dtype=np.float32)  # each block's sum of x, shared by every output
    for r in range(rows):
        for b in range(blocks):
            s = np.float32(0.0)
            for t in range(QK):
                s += x[r, b * QK + t]
            x_sums[r, b] = s
    for panel in range(qs.shape[0]):
        for lane in range(0, P, lanes):
            zero(acc)
            for b in range(blocks):
                q4_1_block_start(dm, qs, scale, panel, b, lane)
                zero(block)
                for j0 in range(0, half, pairs):
                    for v in range(pairs):
                        j = j0 + v
                        for p in range(lanes):
                            byte = qs[panel, b, j, lane + p]
                            w[0, 0, p] = np.float32(byte & np.uint8(0x0F))
                            w[1, 0, p] = np.float32(byte >> np.uint8(4))
                        add_rows(block, (2 * v) % chains, x, b * QK + j, w[0, 0])
                        add_rows(block, (2 * v + 1) % chains, x, b * QK + j + half, w[1, 0])
                for r in range(rows):
                    for p in range(lanes):
                        s = block[0, r, p]
                        for u in range(1, chains):
                            s += block[u, r, p]
                        acc[0, r, p] += scale[0, 0, p] * s + scale[1, 0, p] * x_sums[r, b]
            store(acc, y, panel * P + lane)


@jit
def q4_1_wide_kernel(x, dm, qs, y, rows, chains, lanes):
    """y = x @ W.T for W packed Q4_1, each weight dequantized whole (w = d * q + m) before its products: the kernel
    for row tiles whose block sums do not fit the registers (``block_shape``). Shapes as ``q4_1_kernel``'s."""
    numba.literally(rows)
    numba.literally(chains)
    numba.literally(lanes)
    acc = stack_tile(chains, rows, lanes)
    scale = stack_tile(2, 1, lanes)  # d, m of the block
    w = stack_tile(2, 1, lanes)  # positions j and j + 16
    half = QK // 2
    pairs = max(1, chains // 2)  # byte rows per step: 2 positions each, 2 * pairs sums in flight
    for panel in range(qs.shape[0]):
        for lane in range(0, P, lanes):
            zero(acc)
            for b in range(qs.shape[1]):
                q4_1_block_start(dm, qs, scale, panel, b, lane)
                for j0 in range(0, half, pairs):
                    for v in range(pairs):
                        j = j0 + v
                        for p in range(lanes):
                            byte = qs[panel, b, j, lane + p]
                            w[0, 0, p] = scale[0, 0, p] * np.float32(byte & np.uint8(0x0F)) + scale[1, 0, p]
                            w[1, 0, p] = scale[0, 0, p] * np.float32(byte >> np.uint8(4)) + scale[1, 0, p]
                        add_rows(acc, (2 * v) % chains, x, b * QK + j, w[0, 0])
                        add_rows(acc, (2 * v + 1) % chains, x, b * QK + j + half, w[1, 0])
            store(acc, y, panel * P + lane)


KERNELS = {"F32": f32_kernel, "BF16": bf16_kernel, "Q8_0": q8_0_kernel, "Q4_1": q4_1_kernel}


# ---- a table's rows (an embedding lookup): dequantized from the panels, nothing unpacked ------------------
# Without fastmath, so d * q + m rounds twice as the array code's (``Q4_1.dequantize``) does: the same floats.


@numba.njit(cache=True, nogil=True)
def q8_0_rows(d, q, ids, out):
    """out[r] = row ids[r] of W packed Q8_0 (d (m/P, k/32, P) fp16 bits, q (m/P, k/32, 32, P) int8): d * q."""
    for r in range(ids.shape[0]):
        panel, lane = ids[r] // P, ids[r] % P
        for b in range(q.shape[1]):
            scale = half_to_f32(d[panel, b, lane])
            for j in range(QK):
                out[r, b * QK + j] = scale * np.float32(q[panel, b, j, lane])


@numba.njit(cache=True, nogil=True)
def q4_1_rows(dm, qs, ids, out):
    """out[r] = row ids[r] of W packed Q4_1 (dm (m/P, k/32, 2, P) fp16 bits, qs (m/P, k/32, 16, P) uint8, low
    nibble position j, high j + 16): d * q + m."""
    half = QK // 2
    for r in range(ids.shape[0]):
        panel, lane = ids[r] // P, ids[r] % P
        for b in range(qs.shape[1]):
            scale, low = half_to_f32(dm[panel, b, 0, lane]), half_to_f32(dm[panel, b, 1, lane])
            for j in range(half):
                byte = qs[panel, b, j, lane]
                out[r, b * QK + j] = scale * np.float32(byte & np.uint8(0x0F)) + low
                out[r, b * QK + j + half] = scale * np.float32(byte >> np.uint8(4)) + low


ROW_KERNELS = {"Q8_0": q8_0_rows, "Q4_1": q4_1_rows}


# ---- an option, not exact: x quantized to int8 per block of 32 and integer products (llama.cpp's route) --
#
#     y[i, j] ~ sum_b  d_w[j, b] dx[i, b] sum_t q_w[j, t] q_x[i, t]  (+ m_w[j, b] dx[i, b] sum_t q_x[i, t] for Q4_1)
#
# x's block b of row i becomes dx q_x with dx = max |x| / 127 and q_x = round(x / dx) in -127..127 (llama.cpp's
# q8_1 / q8_0 for activations), so the product is x_hat @ W.T, within sum_b (dx / 2) sum_t |w| of x @ W.T.
# vpdpbusd (AVX512-VNNI) multiplies 64 unsigned weight bytes by 64 signed x bytes and adds each 4 products into
# an int32 lane: one instruction per 64 weights, where the float kernels spend 5 to 6 per 16. With AVX2 the same
# sums take vpmaddubsw (32 byte products, added in pairs into int16) and vpmaddwd by ones (pairs into int32),
# llama.cpp's AVX2 route, plus the shuffles that bring each output's 4 bytes together (``avx2_block_dot``).

INT8_TRANSPOSE = [16 * (lane % 4) + lane // 4 for lane in range(64)]  # 4 byte rows x 16 outputs -> 16 dwords of 4
AVX2_PAIRS = [16 * (i // 16) + i % 16 // 2 + 8 * (i % 2) for i in range(32)]  # in each 128-bit lane: bytes p, 8 + p
AVX2_WORDS = [8 * (i // 8) + i % 8 // 2 + 16 * (i % 2) for i in range(16)]  # vpunpcklwd (+ 4: vpunpckhwd)
AVX2_OUTPUTS = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]  # (0-3 | 8-11), (4-7 | 12-15) -> 0..15


def load_vector(builder, base, offset: int, vector):
    """The ``vector``-typed value at byte ``offset`` of the i8 pointer ``base`` (unaligned)."""
    at = builder.gep(base, [ir.Constant(ir.IntType(64), offset)])
    return builder.load(builder.bitcast(at, vector.as_pointer()), align=1)


def splat_dword(builder, xbase, t: int, lanes: int):
    """x bytes t..t+3 in every one of ``lanes`` dword lanes."""
    i32 = ir.IntType(32)
    dwords = ir.VectorType(i32, lanes)
    one = builder.insert_element(ir.Constant(dwords, None), load_vector(builder, xbase, t, i32), ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(dwords, None), ir.Constant(dwords, [0] * lanes))


def vnni_block_dot(builder, wbase, xbase, is_q8_0: bool):
    """int8_block_dot's sums with AVX512-VNNI: one vpermb per 4 byte rows puts each output's 4 bytes in a dword
    lane, one vpdpbusd multiplies them by 4 bytes of x and adds.  -> <16 x i32>"""
    i8, i32 = ir.IntType(8), ir.IntType(32)
    bytes64, dwords16 = ir.VectorType(i8, 64), ir.VectorType(i32, 16)
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(dwords16, [dwords16] * 3),
                                         "llvm.x86.avx512.vpdpbusd.512")

    def weight_rows(g):  # rows 4g..4g+3 -> dword p holds output p's 4 bytes
        v = load_vector(builder, wbase, 64 * g, bytes64)
        transpose = ir.Constant(ir.VectorType(i32, 64), INT8_TRANSPOSE)
        return builder.shuffle_vector(v, ir.Constant(bytes64, None), transpose)  # vpermb

    sums = [ir.Constant(dwords16, 0), ir.Constant(dwords16, 0)]  # two chains of vpdpbusd
    if is_q8_0:  # 8 groups of 4 positions
        for g in range(QK // 4):
            w = builder.xor(weight_rows(g), ir.Constant(bytes64, [0x80] * 64))  # q + 128 as an unsigned byte
            x4 = splat_dword(builder, xbase, 4 * g, 16)
            sums[g % 2] = builder.call(dot, [sums[g % 2], builder.bitcast(w, dwords16), x4])
    else:  # 4 groups of 4 byte rows: low nibbles are positions 4g.., high nibbles 16 + 4g..
        for g in range(QK // 8):
            v = weight_rows(g)
            low = builder.and_(v, ir.Constant(bytes64, [0x0F] * 64))
            high = builder.lshr(v, ir.Constant(bytes64, [4] * 64))
            sums[0] = builder.call(dot, [sums[0], builder.bitcast(low, dwords16),
                                         splat_dword(builder, xbase, 4 * g, 16)])
            sums[1] = builder.call(dot, [sums[1], builder.bitcast(high, dwords16),
                                         splat_dword(builder, xbase, QK // 2 + 4 * g, 16)])
    return builder.add(sums[0], sums[1])


def avx2_block_dot(builder, wbase, xbase, is_q8_0: bool):
    """int8_block_dot's sums with AVX2, as llama.cpp's AVX2 dot products do them: vpmaddubsw multiplies unsigned
    weight bytes by signed x bytes and adds pairs into int16, vpmaddwd by ones adds pairs of those into int32.

    The panel's rows are positions, so each output's 4 bytes are first brought into one dword lane: per two rows
    (one 32-byte load) a vpermq and a vpshufb pair up the rows' bytes of one output, and a vpunpcklwd /
    vpunpckhwd of two such pairs gives outputs (0-3 | 8-11) and (4-7 | 12-15), put back in order at the end.
    Q8_0's signed weights go in as |q| with x's sign flipped where q < 0 (vpsignb): each int16 pair sum is then
    at most 2 x 128 x 127, no saturation; the result is sum (q + 128) x_q, as vpdpbusd's, by adding 128 sum x_q.
    -> <16 x i32>"""
    i1, i8, i16, i32, i64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
    bytes32, words16, dwords8 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
    qwords4 = ir.VectorType(i64, 4)
    module = builder.module
    maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(words16, [bytes32, bytes32]),
                                             "llvm.x86.avx2.pmadd.ub.sw")
    madd = cgutils.get_or_insert_function(module, ir.FunctionType(dwords8, [words16, words16]),
                                          "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(words16, [1] * 16)

    def row_pairs(offset):  # rows j, j + 1 (32 bytes) -> per 128-bit lane the two bytes of each of 8 outputs
        v = builder.bitcast(load_vector(builder, wbase, offset, bytes32), qwords4)
        v = builder.shuffle_vector(v, ir.Constant(qwords4, None), ir.Constant(ir.VectorType(i32, 4), [0, 2, 1, 3]))
        v = builder.shuffle_vector(builder.bitcast(v, bytes32), ir.Constant(bytes32, None),
                                   ir.Constant(ir.VectorType(i32, 32), AVX2_PAIRS))  # vpermq, vpshufb
        return builder.bitcast(v, words16)

    def weight_rows(g):  # rows 4g..4g+3 -> outputs (0-3 | 8-11), (4-7 | 12-15), a dword of 4 bytes each
        a, b = row_pairs(64 * g), row_pairs(64 * g + 32)
        return [builder.bitcast(builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 16), [w + shift for w in
                                                                                                    AVX2_WORDS])),
                                bytes32) for shift in (0, 4)]

    def x_splat(t):
        return builder.bitcast(splat_dword(builder, xbase, t, 8), bytes32)

    if is_q8_0:  # 8 groups of 4 positions
        absolute = cgutils.get_or_insert_function(module, ir.FunctionType(bytes32, [bytes32, i1]), "llvm.abs.v32i8")
        sign = cgutils.get_or_insert_function(module, ir.FunctionType(bytes32, [bytes32, bytes32]),
                                              "llvm.x86.avx2.psign.b")
        sums = [ir.Constant(dwords8, 0), ir.Constant(dwords8, 0)]
        for g in range(QK // 4):
            xs = x_splat(4 * g)
            for h, v in enumerate(weight_rows(g)):
                pairs = builder.call(maddubs, [builder.call(absolute, [v, ir.Constant(i1, 0)]),
                                               builder.call(sign, [xs, v])])
                sums[h] = builder.add(sums[h], builder.call(madd, [pairs, ones]))
        psadbw = cgutils.get_or_insert_function(module, ir.FunctionType(qwords4, [bytes32, bytes32]),
                                                "llvm.x86.avx2.psad.bw")
        biased = builder.xor(load_vector(builder, xbase, 0, bytes32), ir.Constant(bytes32, [0x80] * 32))
        eights = builder.call(psadbw, [biased, ir.Constant(bytes32, [0] * 32)])  # sums of x + 128 over 8 bytes
        total = builder.extract_element(eights, ir.Constant(i32, 0))
        for e in range(1, 4):
            total = builder.add(total, builder.extract_element(eights, ir.Constant(i32, e)))
        offset = builder.shl(builder.trunc(builder.sub(total, ir.Constant(i64, 128 * QK)), i32), ir.Constant(i32, 7))
        offset = builder.shuffle_vector(builder.insert_element(ir.Constant(dwords8, None), offset, ir.Constant(i32, 0)),
                                        ir.Constant(dwords8, None), ir.Constant(dwords8, [0] * 8))
        sums = [builder.add(s, offset) for s in sums]  # + 128 sum x_q
    else:  # 4 groups of 4 byte rows: low nibbles are positions 4g.., high nibbles 16 + 4g..
        acc = [ir.Constant(words16, 0), ir.Constant(words16, 0)]  # int16: 8 pair sums of 2 x 15 x 127 at most
        for g in range(QK // 8):
            xl, xh = x_splat(4 * g), x_splat(QK // 2 + 4 * g)
            for h, v in enumerate(weight_rows(g)):
                low = builder.and_(v, ir.Constant(bytes32, [0x0F] * 32))
                high = builder.lshr(v, ir.Constant(bytes32, [4] * 32))
                acc[h] = builder.add(acc[h], builder.add(builder.call(maddubs, [low, xl]),
                                                         builder.call(maddubs, [high, xh])))
        sums = [builder.call(madd, [a, ones]) for a in acc]
    return builder.shuffle_vector(sums[0], sums[1], ir.Constant(ir.VectorType(i32, 16), AVX2_OUTPUTS))


@intrinsic
def int8_block_dot(typingctx, tile, row, weights, w_byte, signed, xq, x_byte):
    """tile[0, row, :] = float32(sum over a block's 32 positions of weight byte x xq byte) for the 16 outputs
    of a panel.  weights: the panel's block as packed (Q4_1: 16 byte rows of two nibbles, Q8_0 (signed=True):
    32 rows of int8) from byte w_byte; xq: the row's 32 int8 values of x from byte x_byte.

    Q8_0's weights count as q + 128 (unsigned); the kernel takes 128 sum(q_x) off again. The integer sums are
    this CPU's (``int8_isa``): ``vnni_block_dot`` or ``avx2_block_dot``, both exact."""
    if not isinstance(signed, types.BooleanLiteral):
        return None
    is_q8_0 = signed.literal_value

    def codegen(context, builder, sig, args):
        tile_a, row_v, w_a, w_off, _, x_a, x_off = args
        i8 = ir.IntType(8)

        def base(k, value, offset):
            data = context.make_array(sig.args[k])(context, builder, value).data
            return builder.gep(builder.bitcast(data, i8.as_pointer()), [offset])

        block_dot = vnni_block_dot if int8_isa() == "avx512vnni" else avx2_block_dot
        sums = block_dot(builder, base(2, w_a, w_off), base(5, x_a, x_off), is_q8_0)
        total = builder.sitofp(sums, ir.VectorType(ir.FloatType(), P))
        out = builder.gep(context.make_array(sig.args[0])(context, builder, tile_a).data,
                          [builder.mul(row_v, ir.Constant(row_v.type, P))])
        builder.store(total, builder.bitcast(out, total.type.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.none(tile, types.intp, weights, types.intp, signed, xq, types.intp), codegen


@jit
def quantize_x(x, rows):
    """x (R, k) -> int8 per block of 32: xq (R, k) int8, dx (nb, R) = max |x| / 127, sq (nb, R) = sum of
    the block's xq.  x ~ dx * xq, each within dx / 2."""
    k = x.shape[1]
    xq = np.empty((rows, k), dtype=np.int8)
    dx = np.empty((k // QK, rows), dtype=np.float32)
    sq = np.empty((k // QK, rows), dtype=np.float32)
    block = stack_tile(1, 1, QK)
    for r in range(rows):
        for b in range(k // QK):
            for t in range(QK):
                block[0, 0, t] = x[r, b * QK + t]
            amax = np.float32(0.0)
            for t in range(QK):
                amax = max(amax, abs(block[0, 0, t]))
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            total = 0
            for t in range(QK):
                q = np.int32(math.floor(block[0, 0, t] * inv + np.float32(0.5)))  # |q| <= 127
                xq[r, b * QK + t] = q
                total += q
            dx[b, r] = amax / np.float32(127.0)
            sq[b, r] = total
    return xq, dx, sq


@jit
def q8_0_int8_kernel(x, d, q, y, rows, chains, lanes):
    """y ~ x @ W.T for W packed Q8_0, x quantized per block (above).  Shapes as q8_0_kernel's; chains, lanes unused."""
    numba.literally(rows)
    acc = stack_tile(1, rows, P)
    isum = stack_tile(1, rows, P)  # sum_t (q_w + 128) q_x of one block, per row
    scale = stack_tile(1, 1, P)
    k, nb = x.shape[1], q.shape[1]
    xq, dx, sq = quantize_x(x, rows)
    for panel in range(q.shape[0]):
        zero(acc)
        for b in range(nb):
            at = (panel * nb + b) * QK * P  # the block's first byte in q
            for line in range(QK * P // 64):
                prefetch(q, at + PREFETCH_BYTES + 64 * line)
            prefetch(d, (at + PREFETCH_BYTES) // 16)
            for p in range(P):
                scale[0, 0, p] = half_to_f32(d[panel, b, p])
            for r in range(rows):
                int8_block_dot(isum, r, q, at, True, xq, r * k + b * QK)
            for r in range(rows):
                d_x, offset = dx[b, r], np.float32(128.0) * sq[b, r]
                for p in range(P):
                    acc[0, r, p] += (scale[0, 0, p] * d_x) * (isum[0, r, p] - offset)
        store(acc, y, panel * P)


@jit
def q4_1_int8_kernel(x, dm, qs, y, rows, chains, lanes):
    """y ~ x @ W.T for W packed Q4_1, x quantized per block (above).  Shapes as q4_1_kernel's; chains, lanes unused."""
    numba.literally(rows)
    acc = stack_tile(2, rows, P)  # 0: d dx sum(q_w q_x), 1: m dx sum(q_x) (two chains)
    isum = stack_tile(1, rows, P)
    scale = stack_tile(2, 1, P)
    k, nb = x.shape[1], qs.shape[1]
    xq, dx, sq = quantize_x(x, rows)
    for panel in range(qs.shape[0]):
        zero(acc)
        for b in range(nb):
            at = (panel * nb + b) * QK // 2 * P
            for line in range(QK // 2 * P // 64):
                prefetch(qs, at + PREFETCH_BYTES + 64 * line)
            prefetch(dm, (at + PREFETCH_BYTES) // 4)
            for p in range(P):
                scale[0, 0, p] = half_to_f32(dm[panel, b, 0, p])
                scale[1, 0, p] = half_to_f32(dm[panel, b, 1, p])
            for r in range(rows):
                int8_block_dot(isum, r, qs, at, False, xq, r * k + b * QK)
            for r in range(rows):
                d_x, s_x = dx[b, r], dx[b, r] * sq[b, r]
                for p in range(P):
                    acc[0, r, p] += (scale[0, 0, p] * d_x) * isum[0, r, p]
                    acc[1, r, p] += scale[1, 0, p] * s_x
        store(acc, y, panel * P)


INT8_KERNELS = {"Q8_0": q8_0_int8_kernel, "Q4_1": q4_1_int8_kernel}


def int8_isa() -> str | None:
    """The integer dot product the int8 kernels are built on here: "avx512vnni" (vpdpbusd), "avx2" (vpmaddubsw and
    vpmaddwd), or None (no int8 kernel for this CPU)."""
    features = host_features()
    return "avx512vnni" if "avx512vnni" in features else "avx2" if "avx2" in features else None


# ---- packing: a format's weight -> the kernel's panels, once ------------------------------------------


@dataclass(frozen=True)
class Packed:
    """A weight in its kernel's layout (module docstring): ``arrays`` are the kernel's weight arguments.

    As a model's weight it does what a float32 matrix does, from its blocks: ``product(x)`` = x @ W.T,
    ``rows(ids)`` (and ``table[ids]``) dequantizes the looked-up rows only, ``row_slice`` is a view."""

    format: str
    shape: tuple[int, int]  # (m, k) of the weight; m is padded to a multiple of P in the panels
    arrays: tuple
    int8_x: bool = False  # products quantize x to int8 per block of 32 (``with_int8_x``): not exact

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def product(self, x):
        """x @ W.T by the kernels (``product``), a prefill in chunks of 16 rows.  (..., k) float32 -> (..., m)

        Dequantizing W panel by panel into BLAS instead measured 3 to 8 times slower for prompts of 17 to
        256 tokens (docs/quantization.md), so the kernels take every product."""
        x2 = x.reshape(-1, x.shape[-1])  # (B, T, k) -> (B*T, k): every token row is one row of the product
        return product(x2, self, self.int8_x).reshape(*x.shape[:-1], self.shape[0])

    def unpack(self, ids):
        """The rows ``ids`` as the file's blocks (the inverse of ``pack``): (n,) ints -> Q8_0 / Q4_1 (n, k)."""
        ids = np.asarray(ids).reshape(-1)
        panel, lane = ids // P, ids % P
        m, k = self.shape
        if self.format == "Q8_0":
            d, q = self.arrays  # (m/P, nb, P), (m/P, nb, 32, P)
            raw = np.concatenate([d[panel, :, lane].view(np.uint8).reshape(len(ids), -1, 2),  # (n, nb, 2)
                                  q[panel, :, :, lane].view(np.uint8)], axis=-1)  # (n, nb, 32)
            return Q8_0(raw.reshape(len(ids), -1), k)
        if self.format == "Q4_1":
            dm, qs = self.arrays  # (m/P, nb, 2, P), (m/P, nb, 16, P)
            raw = np.concatenate([dm[panel, :, :, lane].view(np.uint8).reshape(len(ids), -1, 4),  # (n, nb, 4)
                                  qs[panel, :, :, lane]], axis=-1)  # (n, nb, 16)
            return Q4_1(raw.reshape(len(ids), -1), k)
        raise QuantError(f"unpack: {self.format} keeps no blocks (Q8_0 and Q4_1 do)")

    def rows(self, ids):
        """Dequantize only the rows ``ids``, straight from the panels (``ROW_KERNELS``; the reference is
        ``unpack(ids).dequantize()``, ``Blocks.rows``).  ids (...) ints in 0..m-1 -> (..., k) float32"""
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        m, k = self.shape
        if flat.size and not 0 <= flat.min() <= flat.max() < m:
            raise IndexError(f"row ids must lie in 0..{m - 1}, got {flat.min()}..{flat.max()}")
        if self.format not in ROW_KERNELS:
            raise QuantError(f"rows: {self.format} keeps no blocks (Q8_0 and Q4_1 do)")
        out = np.empty((flat.size, k), dtype=np.float32)
        ROW_KERNELS[self.format](*self.arrays, flat, out)
        return out.reshape(*np.shape(ids), k)

    def __getitem__(self, ids):
        """``table[ids]`` as for a float32 table: ``rows(ids)``."""
        return self.rows(ids)

    def row_slice(self, start: int, stop: int) -> Packed:
        """Rows start..stop-1: a view of whole panels when start is a multiple of P and stop is too (or the
        end), else those rows packed anew."""
        m, k = self.shape
        if start % P or (stop % P and stop != m):
            return pack(self.unpack(np.arange(start, stop)))
        return Packed(self.format, (stop - start, k), tuple(a[start // P:-(-stop // P)] for a in self.arrays),
                      self.int8_x)


def with_int8_x(packed: Packed, on: bool = True) -> Packed:
    """The same panels, their products taking x quantized to int8 per block of 32 (``on``) or exact: llama.cpp's
    route (``product(..., int8_x=True)``), for Q8_0 and Q4_1 on a CPU with an int8 kernel (``int8_isa``); other
    formats (F32, BF16) keep their exact products.  Nothing is copied."""
    if on and packed.format in INT8_KERNELS and int8_isa() is None:
        raise QuantError("int8 activations need a CPU with AVX512-VNNI or AVX2 (this one has neither)")
    return replace(packed, int8_x=on and packed.format in INT8_KERNELS)


def panels(a, m: int):
    """(m, ...) rows -> (m_pad / P, P, ...) with zero rows appended up to a multiple of P."""
    pad = -m % P
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)])
    return a.reshape(-1, P, *a.shape[1:])


def pack(weight) -> Packed:
    """A weight (a float32 (m, k) array, or minillm.quantize's F32, BF16, Q8_0, Q4_1) -> Packed.

    Example: a Q4_1 weight (1536, 576) -> dm (96, 18, 2, 16) uint16 and qs (96, 18, 16, 16) uint8."""
    if isinstance(weight, np.ndarray):
        weight = F32.quantize(weight)
    m, k = weight.shape
    if isinstance(weight, F32):
        arrays = (np.ascontiguousarray(panels(weight.data, m).transpose(0, 2, 1)),)  # (m/P, P, k) -> (m/P, k, P)
    elif isinstance(weight, BF16):
        arrays = (np.ascontiguousarray(panels(weight.bits, m).transpose(0, 2, 1)),)
    elif isinstance(weight, Q8_0):
        blocks = panels(weight.raw.reshape(m, k // QK, Q8_0_BYTES), m)  # (m/P, P, nb, 34)
        d = blocks[..., :2].copy().view(np.uint16)[..., 0]  # (m/P, P, nb)
        arrays = (np.ascontiguousarray(d.transpose(0, 2, 1)),  # (m/P, nb, P)
                  np.ascontiguousarray(blocks[..., 2:].view(np.int8).transpose(0, 2, 3, 1)))  # (m/P, nb, 32, P)
    elif isinstance(weight, Q4_1):
        blocks = panels(weight.raw.reshape(m, k // QK, Q4_1_BYTES), m)  # (m/P, P, nb, 20)
        dm = blocks[..., :4].copy().view(np.uint16)  # (m/P, P, nb, 2)
        arrays = (np.ascontiguousarray(dm.transpose(0, 2, 3, 1)),  # (m/P, nb, 2, P)
                  np.ascontiguousarray(blocks[..., 4:].transpose(0, 2, 3, 1)))  # (m/P, nb, 16, P)
    else:
        raise QuantError(f"pack: no kernel for {type(weight).__name__}; kernels exist for {', '.join(KERNELS)}")
    return Packed(type(weight).__name__, (m, k), arrays)


# ---- compiling and calling --------------------------------------------------------------------------


def row_tile(n: int) -> int:
    """The compiled row count a product over n <= row_tiles()[-1] token rows runs with.  1 -> 1, 5 -> 5, 7 -> 8,
    9 -> 16 (AVX-512; on AVX2 the largest tile is 8)."""
    return next(r for r in row_tiles() if r >= n)


_COMPILED = {}  # (format, R, int8_x) -> the compiled function's entry point


def compiled(fmt: str, rows: int, int8_x: bool = False):
    """The kernel of ``fmt`` for ``rows`` token rows (the int8 one with ``int8_x``), compiled (or loaded from
    the cache) on first use.

    Calls go to the compiled entry point: the dispatcher would re-resolve the literal arguments on
    every call (milliseconds each)."""
    kernel = _COMPILED.get((fmt, rows, int8_x))
    if kernel is None:
        with vector_compile():
            kernel = source_kernel(fmt, rows, int8_x).compile(kernel_signature(fmt, rows))
        _COMPILED[fmt, rows, int8_x] = kernel
    return kernel


def source_kernel(fmt: str, rows: int, int8_x: bool = False):
    """The numba function that multiplies ``fmt`` over ``rows`` token rows: ``INT8_KERNELS[fmt]`` with int8_x, else
    ``KERNELS[fmt]``, except Q4_1 where its block sums do not fit the registers (``block_shape``)."""
    if int8_x:
        return INT8_KERNELS[fmt]
    if fmt == "Q4_1" and block_shape(rows) is None:
        return q4_1_wide_kernel
    return KERNELS[fmt]


@functools.cache
def block_shape(rows: int) -> tuple[int, int] | None:
    """(U, L) of ``q4_1_kernel`` for ``rows`` token rows, or None where it does not fit and ``q4_1_wide_kernel``
    runs. That kernel holds two sets of sums, a block's (U x R x V vectors) and the outputs' (R x V): the block's
    in less than half the register file, both with the weights (``WEIGHT_REGISTERS``) in all of it. U =
    BLOCK_CHAINS, else 1; the whole panel first, else one vector's lanes.

        AVX-512 (32 zmm):  R = 1 .. 6: U = 2, L = 16;  R = 8: U = 1, L = 16;  R = 16: None
        AVX2 (16 ymm):     R = 1: U = 2, L = 16;  R = 2: U = 1, L = 16;  R = 3: U = 2, L = 8;
                           R = 4 .. 6: U = 1, L = 8;  R = 8: None

    Two chains, not FMA_CHAINS: the conversions between the multiply-adds hide their latency, and every chain
    costs an addition per output and block. The rule is the one that measured no slower than the wide kernel at
    any tile on a Zen 4, with AVX-512 and with it turned off (docs/quantization.md, "The scale once per block")."""
    lanes, registers = host_vector()
    for width in (P, lanes):
        vectors = width // lanes  # V
        for u in (BLOCK_CHAINS, 1):
            sums = u * rows * vectors
            if 2 * sums < registers and sums + (rows + WEIGHT_REGISTERS["Q4_1"]) * vectors <= registers:
                return u, width
    return None


@functools.cache
def kernel_shape(fmt: str, rows: int) -> tuple[int, int] | None:
    """(U, L): the independent sums per output and the outputs computed at once (the whole panel, P, or one
    vector's lanes) of ``fmt``'s kernel for ``rows`` token rows on this CPU; None when even one vector of
    outputs does not fit the register file (16 rows on AVX2: the product then runs in chunks of 8).

    The budget, in vector registers: a sub-panel row of L outputs is V = L / lanes vectors. The U x R x V
    accumulators take at most a quarter of the register file and FMA_CHAINS sums (8 zmm on AVX-512), and
    with the format's dequantized weights (``WEIGHT_REGISTERS`` x V) at most three quarters; the last
    quarter holds x's broadcasts and the constants. The whole panel first (x is broadcast once per
    position), one vector's lanes when the whole panel does not fit.

        AVX-512 (16 lanes, 32 zmm):  U = max(1, 8 // R), L = 16 for R = 1 .. 16
        AVX2 (8 lanes, 16 ymm):      R = 1: U = 2, L = 16;  R = 2 .. 4: U = 1, L = 16 (Q4_1 from R = 3: L = 8);
                                     R = 5 .. 8: U = 1, L = 8;  R = 16: None

    docs/quantization.md ("On an AVX2 CPU") has the measurements that chose these fractions."""
    if fmt == "Q4_1" and block_shape(rows) is not None:
        return block_shape(rows)
    lanes, registers = host_vector()
    for width in (P, lanes):
        vectors = width // lanes  # V
        u = max(1, min(FMA_CHAINS, registers // 4) // (rows * vectors))
        if u * rows * vectors + WEIGHT_REGISTERS[fmt] * vectors <= registers * 3 // 4:
            return u, width
    return None


@functools.cache
def row_tiles() -> tuple:
    """The ROW_TILES whose kernels fit this CPU's register file for every format (``kernel_shape``):
    (1, 2, 3, 4, 5, 6, 8, 16) with AVX-512, (1, 2, 3, 4, 5, 6, 8) with AVX2."""
    return tuple(r for r in ROW_TILES if all(kernel_shape(fmt, r) for fmt in KERNELS))


def literals(fmt: str, rows: int) -> tuple[int, int, int]:
    """The compile-time arguments of ``fmt``'s kernel for ``rows`` token rows on this CPU: (R, U, L)."""
    return (rows, *kernel_shape(fmt, rows))


def kernel_signature(fmt: str, rows: int, chains: int | None = None, lanes: int | None = None) -> tuple:
    """The argument types of ``fmt``'s kernel for ``rows`` token rows: the arrays, then ``literals(fmt, rows)``
    as literal types (or these chains and lanes instead, to compare other choices)."""
    weights = {"F32": (types.float32[:, :, ::1],), "BF16": (types.uint16[:, :, ::1],),
               "Q8_0": (types.uint16[:, :, ::1], types.int8[:, :, :, ::1]),
               "Q4_1": (types.uint16[:, :, :, ::1], types.uint8[:, :, :, ::1])}[fmt]
    return (types.float32[:, ::1], *weights, types.float32[:, ::1],
            *(types.literal(v) for v in (rows, chains or literals(fmt, rows)[1], lanes or literals(fmt, rows)[2])))


def machine_code(fmt: str, rows: int, fastmath=FASTMATH, int8_x: bool = False, chains: int | None = None,
                 lanes: int | None = None) -> str:
    """The assembly of ``fmt``'s kernel (the int8 one with ``int8_x``) for ``rows`` rows, freshly compiled (a
    cached kernel keeps no assembly) under ``vector_compile`` with these fastmath flags (and these chains and
    lanes, by default ``kernel_shape``'s)."""
    source = source_kernel(fmt, rows, int8_x).py_func
    kernel = numba.njit(fastmath=fastmath, nogil=True, boundscheck=False)(source)
    sig = kernel_signature(fmt, rows, chains, lanes)
    with vector_compile():
        kernel.compile(sig)
    return kernel.inspect_asm(kernel.signatures[0])


def vector_fma_count(asm: str) -> dict:
    """{'zmm': n, 'ymm': n, 'scalar': n} FMA instructions in an assembly listing, and the int8 kernels' integer
    dot products: 'vnni': n zmm vpdpbusd, 'maddubs': n ymm vpmaddubsw (AVX2)."""
    fmas = re.findall(r"vfmadd\d+(p|s)s\s+[^\n]*?%([xyz]mm)", asm)
    return {"zmm": sum(1 for kind, reg in fmas if kind == "p" and reg == "zmm"),
            "ymm": sum(1 for kind, reg in fmas if kind == "p" and reg == "ymm"),
            "scalar": sum(1 for kind, _ in fmas if kind == "s"),
            "vnni": len(re.findall(r"vpdpbusd\s+[^\n]*?%zmm", asm)),
            "maddubs": len(re.findall(r"vpmaddubsw\s+[^\n]*?%ymm", asm))}


def inner_loop(asm: str) -> list[str]:
    """The lines of a kernel's inner loop in its listing: of the innermost loops (a label and a later jump back to
    it, with no loop inside) of the first function (the kernel; numba's Python wrapper follows it), the one with
    the most vector FMAs."""
    kernel = asm.split(".Lfunc_end0")[0].splitlines()
    labels = {line[:-1]: i for i, line in enumerate(kernel) if re.fullmatch(r"\.LBB\w+:", line)}
    loops = [(labels[m[1]], j) for j, line in enumerate(kernel)
             if (m := re.fullmatch(r"\s+j\w+\s+(\.LBB\w+)", line)) and labels.get(m[1], j) < j]
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    if not innermost:
        return kernel
    a, b = max(innermost, key=lambda ab: sum(1 for line in kernel[ab[0]:ab[1]] if re.search(r"vfmadd\d+ps", line)))
    return kernel[a:b + 1]


def stack_spills(asm: str) -> int:
    """Vector instructions in a kernel's inner loop that keep its sums in memory: those with a stack address
    ((%rsp) or (%rsp, index)), registers spilled and reloaded on every step, and every vector store (the loop
    writes nothing: y is stored after it), a tile that SROA left in memory and LLVM walks with a pointer of its
    own. 0 when the accumulators and the dequantized weights fit in the register file. (Outside the loop, LLVM
    may still park a few registers.)"""
    return sum(1 for line in inner_loop(asm) if re.search(r"%[xyz]mm\d", line)
               and ("(%rsp" in line or re.match(r"\s+vmov\w*\s+%[xyz]mm\d+,\s*[-\w]*\(", line)))


def product(x, packed: Packed, int8_x: bool = False) -> np.ndarray:
    """y = x @ W.T for x (n, k) float32 and a packed W (m, k) -> (n, m) float32.

    The reference is ``x @ weight.dequantize().T``. (3, 64) @ Q8_0 (5, 64) -> (3, 5): one pass with
    R = 4 (a zero fourth row), m padded to 16 outputs inside the panels.

    ``int8_x=True`` (Q8_0 and Q4_1, a CPU with an int8 kernel: ``int8_isa``) quantizes x to int8 per block of 32
    and multiplies integers, as llama.cpp does: NOT exact, within sum_b (max_b |x| / 254) sum_{t in b} |w| of
    x @ W.T."""
    m, k = packed.shape
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != k or x.shape[0] == 0:
        raise QuantError(f"product: x {x.shape} does not match the weight {packed.shape} (x (n, {k}) @ W.T)")
    if x.dtype != np.float32:
        raise QuantError(f"product: x must be float32, got {x.dtype}")
    if int8_x and (packed.format not in INT8_KERNELS or int8_isa() is None):
        raise QuantError(f"product: int8_x needs a {' or '.join(INT8_KERNELS)} weight (got {packed.format}) and a CPU "
                         f"with AVX512-VNNI or AVX2 (here: {int8_isa() or 'neither'})")
    n = x.shape[0]
    x = np.ascontiguousarray(x)
    y = np.empty((n, m), dtype=np.float32)
    m_pad = packed.arrays[-1].shape[0] * P
    if n == 1 and m == m_pad:  # a decode step, the common case: one call on x itself
        compiled(packed.format, 1, int8_x)(x, *packed.arrays, y, *literals(packed.format, 1))
        return y
    chunk = row_tiles()[-1]
    for start in range(0, n, chunk):  # chunks of 16 rows (8 on AVX2); each reads every weight once
        rows = min(chunk, n - start)
        tile = row_tile(rows)
        if tile == rows:  # x's own rows, a view: nothing is copied
            xs = x[start:start + rows]
        else:  # 7 rows on the 8-row kernel: zero rows below them
            xs = np.zeros((tile, k), dtype=np.float32)
            xs[:rows] = x[start:start + rows]
        direct = tile == rows and m == m_pad  # the kernel can write y's rows itself
        out = y[start:start + rows] if direct else np.empty((tile, m_pad), dtype=np.float32)
        compiled(packed.format, tile, int8_x)(xs, *packed.arrays, out, *literals(packed.format, tile))
        if not direct:
            y[start:start + rows] = out[:rows, :m]
    return y
