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
2. ``flash_attention``       the tiled algorithm in array code (NumPy/CuPy), laid out like the kernel;
   ``tiled_attention``       the same with the signature of ``naive_attention`` (GPT's attention="flash");
   ``auto_attention``        naive for small score matrices, tiled for large ones (attention="auto",
                             the models' default): the one place that decides by size
3. ``attention_io_bytes``    the HBM traffic model of standard vs tiled attention (paper, Theorem 2)

The CUDA kernel that runs the same loop, ``kernels/flash_attention.cu``, is launched by
``minillm.kernels.launch`` (on a GPU, or emulated on a CPU).
"""

from __future__ import annotations

import math

from .attention import check_mask, naive_attention
from .backend import is_gpu, xp

FLOAT_BYTES = 4
NAIVE_MAX_SCORES = 1 << 24  # auto_attention: up to 16M scores (64 MiB of float32) at once run naive
AUTO_BLOCK = 256  # auto_attention's tiles: (B, nh, 256, 256) scores at a time, few enough for Python's loop


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


def flash_attention(q, k, v, causal=True, block_q: int = 64, block_k: int = 64, mask=None):
    """softmax(q k^T / sqrt(hs) + mask) v, tile by tile: the FlashAttention forward in array code.

    (B, nh, Tq, hs), (B, nh, Tk, hs), (B, nh, Tk, hs) -> O (B, nh, Tq, hs), L (B, nh, Tq)
    where L is each row's log-sum-exp of scores (what a backward pass keeps instead of P).
    Laid out like kernels/flash_attention.cu (FlashAttention-2 loop order): the outer loop walks
    query tiles Q_i (the kernel's thread blocks), the inner loop walks key tiles K_j, V_j and folds
    each into the running (m, l, O) with ``flash_tile_update``. Causal: query i sits at absolute
    position Tk - Tq + i (as in ``naive_attention``), and key tiles entirely in a query tile's future
    are skipped. Memory: one (Br, Bc) score tile at a time instead of the (Tq, Tk) matrix.
    ``mask`` (Tq, Tk) bool, if given, replaces the causal rule (each tile reads its slice; none is skipped).
    """
    B, nh, Tq, hs = q.shape
    Tk = k.shape[-2]
    if Tq > Tk:
        raise ValueError(f"flash_attention: {Tq} queries but only {Tk} keys (need Tq <= Tk)")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"flash_attention: tile sizes must be >= 1, got {block_q} x {block_k}")
    if mask is not None:
        mask, causal = check_mask(mask, Tq, Tk), False
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
            elif mask is not None:
                s = xp.where(mask[i0:i1, j0:j1], s, -xp.inf)
            m, l, o = flash_tile_update(m, l, o, s, v[:, :, j0:j1])
        out[:, :, i0:i1] = o / l[..., None]
        lse[:, :, i0:i1] = m + xp.log(l)
    return out, lse


def tiled_attention(q, k, v, causal=True, mask=None):
    """``flash_attention``'s output alone: (B, nh, Tq, hs) x 3 -> (B, nh, Tq, hs), like ``naive_attention``."""
    return flash_attention(q, k, v, causal, mask=mask)[0]


def naive_fits(B: int, nh: int, Tq: int, Tk: int) -> bool:
    """Whether the (B, nh, Tq, Tk) score matrix is small enough for the naive path: at most NAIVE_MAX_SCORES.

    Example: SmolLM2 (9 heads) prefilling 1,024 tokens -> 9.4M scores: True; 7,000 tokens -> 441M
    scores (1.8 GB of float32, several copies during the softmax): False. A decode step (Tq = 1)
    always fits.
    """
    return B * nh * Tq * Tk <= NAIVE_MAX_SCORES


def auto_attention(q, k, v, causal=True, mask=None):
    """``naive_attention`` while ``naive_fits``, else ``flash_attention`` in AUTO_BLOCK tiles: the same
    output (B, nh, Tq, hs), with memory bounded by one tile instead of growing as Tq x Tk.

    On a CPU, a few query rows over many keys (a decode step or a verification over a cache,
    ``row_attention.fits``) go to ``row_attention``'s numba kernel, which reads each key and value once;
    short prompts keep the plain matrix code; a long prefill never builds its (Tq, Tk) matrix. The models'
    default (attention="auto"); "naive" and "flash" stay what they say.
    """
    B, nh, Tq, _ = q.shape
    if not is_gpu():
        from .row_attention import fits, row_attention  # numba, imported on a CPU's first call

        if fits(q, k):
            return row_attention(q, k, v, causal, mask=mask)
    if naive_fits(B, nh, Tq, k.shape[-2]):
        return naive_attention(q, k, v, causal, mask=mask)
    return flash_attention(q, k, v, causal, block_q=AUTO_BLOCK, block_k=AUTO_BLOCK, mask=mask)[0]


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
