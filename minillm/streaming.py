"""Streaming weight products for a few token rows on a CPU: read each weight once, never pack it.

    y[i, j] = sum_t x[i, t] w[j, t]          y = x @ w.T,  x (n, in), w (out, in) -> y (n, out)

The reference is BLAS (``x @ w.T``, ``backend.blas_product``). For n = 1 BLAS runs a matrix-vector
product (gemv), which streams w once; for n > 1 a matrix-matrix product (gemm), which first copies w
into its own blocked layout ("packing"). For a decode step or a short speculative verification the
products are memory-bound, so the copy is the cost: with BLAS alone a forward of SmolLM2-135M over 2
tokens cost 2.3 single-token steps on a 2-core EPYC (``python -m minillm bench verify-cost --model
smollm2-135m`` measures it, docs/verify_cost.md). These kernels read each weight once and multiply it
into all n token rows while it sits in the L1 cache.

Two layouts, one kernel each (the models store both; copying a weight into the other layout would
double the memory and go stale when training updates it in place):

- ``rows_kernel``: w stored [out, in] (Llama, and every LM head): 4 rows of w at a time, dotted
  with the n token rows, 4 at a time (then 2, then 1), while the 4 rows sit in the L1 cache: 16
  sums kept in registers from 8 loads per step of the inner loop (4 x 2: 8 sums from 6 loads).
- ``cols_kernel``: w stored [in, out] (GPT-2's Conv1D weights, y = x @ w): row w[t] is added into
  the n output rows scaled by x[i, t], 4 rows of w at a time so one load and store of y[i, j]
  carries 4 multiply-adds.

Compiled by numba (``fastmath`` lets LLVM reorder the sums into SIMD lanes, so the result differs
from BLAS by float32 rounding only), for float32 2-D C-contiguous arrays only (one signature each),
cached on disk (``cache=True``): the first import in a fresh install compiles for a few seconds, every
later process loads the machine code. Only ``backend.weight_product`` imports this module, on the
first product it might stream, so a GPU or a machine without numba never imports numba.
"""

from __future__ import annotations

import numba
import numpy as np

from . import cpu_target

ROW_BLOCK = 4  # weight rows per pass: 4 sums share each load of x (rows), 4 multiply-adds each load of y (cols)
TOKEN_BLOCK = 2  # token rows per pass of rows_kernel's 2-row loop (its main loop takes twice as many)

cpu_target.full_width()  # 512-bit vectors on AVX-512, before the first numba function of the process
f32 = numba.float32
SIGNATURE = numba.void(f32[:, ::1], f32[:, ::1], f32[:, ::1])  # the one signature each kernel is compiled for
jit = numba.njit(SIGNATURE, cache=True, fastmath=True, nogil=True, boundscheck=False)


@jit
def rows_kernel(x, w, y):
    """y = x @ w.T with w stored [out, in].  x (n, in), w (out, in), y (n, out) (every y[i, j] is written)."""
    n, k = x.shape
    m = w.shape[0]
    j = 0
    while j + ROW_BLOCK <= m:  # pass 1: 4 weight rows at a time, read from memory once, then from L1
        w0, w1, w2, w3 = w[j], w[j + 1], w[j + 2], w[j + 3]
        i = 0
        while i + 2 * TOKEN_BLOCK <= n:  # 4 token rows x 4 weight rows: 16 sums from 8 loads per t
            xa, xb, xc, xd = x[i], x[i + 1], x[i + 2], x[i + 3]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = f32(0.0)
            c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = f32(0.0)
            for t in range(k):
                p, q, r, s = xa[t], xb[t], xc[t], xd[t]
                u0, u1, u2, u3 = w0[t], w1[t], w2[t], w3[t]
                a0 += u0 * p
                a1 += u1 * p
                a2 += u2 * p
                a3 += u3 * p
                b0 += u0 * q
                b1 += u1 * q
                b2 += u2 * q
                b3 += u3 * q
                c0 += u0 * r
                c1 += u1 * r
                c2 += u2 * r
                c3 += u3 * r
                d0 += u0 * s
                d1 += u1 * s
                d2 += u2 * s
                d3 += u3 * s
            y[i, j], y[i, j + 1], y[i, j + 2], y[i, j + 3] = a0, a1, a2, a3
            y[i + 1, j], y[i + 1, j + 1], y[i + 1, j + 2], y[i + 1, j + 3] = b0, b1, b2, b3
            y[i + 2, j], y[i + 2, j + 1], y[i + 2, j + 2], y[i + 2, j + 3] = c0, c1, c2, c3
            y[i + 3, j], y[i + 3, j + 1], y[i + 3, j + 2], y[i + 3, j + 3] = d0, d1, d2, d3
            i += 2 * TOKEN_BLOCK
        if i + TOKEN_BLOCK <= n:  # 2 token rows x 4 weight rows: 8 sums from 6 loads per t
            xa, xb = x[i], x[i + 1]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = f32(0.0)
            for t in range(k):
                p, q = xa[t], xb[t]
                u0, u1, u2, u3 = w0[t], w1[t], w2[t], w3[t]
                a0 += u0 * p
                a1 += u1 * p
                a2 += u2 * p
                a3 += u3 * p
                b0 += u0 * q
                b1 += u1 * q
                b2 += u2 * q
                b3 += u3 * q
            y[i, j], y[i, j + 1], y[i, j + 2], y[i, j + 3] = a0, a1, a2, a3
            y[i + 1, j], y[i + 1, j + 1], y[i + 1, j + 2], y[i + 1, j + 3] = b0, b1, b2, b3
            i += TOKEN_BLOCK
        if i < n:  # an odd last token row (n = 1: the decode step)
            xi = x[i]
            a0 = a1 = a2 = a3 = f32(0.0)
            for t in range(k):
                p = xi[t]
                a0 += w0[t] * p
                a1 += w1[t] * p
                a2 += w2[t] * p
                a3 += w3[t] * p
            y[i, j], y[i, j + 1], y[i, j + 2], y[i, j + 3] = a0, a1, a2, a3
        j += ROW_BLOCK
    while j < m:  # pass 2: the last out % 4 weight rows, one at a time
        wj = w[j]
        for i in range(n):
            xi = x[i]
            a = f32(0.0)
            for t in range(k):
                a += wj[t] * xi[t]
            y[i, j] = a
        j += 1


@jit
def cols_kernel(x, w, y):
    """y = x @ w with w stored [in, out].  x (n, in), w (in, out), y (n, out) (zeroed first)."""
    n, k = x.shape
    m = w.shape[1]
    for i in range(n):  # pass 1: every sum starts at zero (y comes from np.empty)
        for j in range(m):
            y[i, j] = 0.0
    t = 0
    while t + ROW_BLOCK <= k:  # pass 2: 4 weight rows per pass over y
        w0, w1, w2, w3 = w[t], w[t + 1], w[t + 2], w[t + 3]
        for i in range(n):
            c0, c1, c2, c3 = x[i, t], x[i, t + 1], x[i, t + 2], x[i, t + 3]
            yi = y[i]
            for j in range(m):
                yi[j] += c0 * w0[j] + c1 * w1[j] + c2 * w2[j] + c3 * w3[j]
        t += ROW_BLOCK
    while t < k:  # pass 3: the last in % 4 weight rows
        wt = w[t]
        for i in range(n):
            c = x[i, t]
            yi = y[i]
            for j in range(m):
                yi[j] += c * wt[j]
        t += 1


KERNELS = {"rows": rows_kernel, "cols": cols_kernel}


def layout(w) -> str | None:
    """'rows' for a float32 w whose [out, in] rows are contiguous (w C-contiguous), 'cols' for one stored
    [in, out] and handed over as its transpose (w.T C-contiguous), None for anything else."""
    if not isinstance(w, np.ndarray) or w.dtype != np.float32 or w.ndim != 2:
        return None
    if w.flags.c_contiguous:
        return "rows"
    if w.T.flags.c_contiguous:
        return "cols"
    return None


def stream_product(x, w):
    """x @ w.T for float32 x (n, in) and w (out, in) in either layout (``layout``), streaming w once.

    The reference is ``x @ w.T`` (BLAS). (2, 3) @ (4, 3).T -> (2, 4)."""
    kind = layout(w)
    if kind is None:
        raise ValueError(f"stream_product needs a float32 2-D weight with contiguous rows or columns, got "
                         f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"stream_product: x {x.shape} does not match w {w.shape} (x @ w.T)")
    y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    KERNELS[kind](x, w if kind == "rows" else w.T, y)
    return y
