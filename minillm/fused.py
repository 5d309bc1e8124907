"""Fused kernels: the elementwise and row-wise work of a decode step, one launch per group of operations.

On a GPU every array operation is a kernel launch, and a launch costs the CPU a few microseconds however little
it computes. Written as array code, one LayerNorm is eleven launches (``model.layer_norm``: a sum, a divide, a
subtract, a square, ...), one GELU eight, one attention over the cache about ten: a decode step of the
character model launches 300-430 kernels, and its few million multiply-adds take less time than the launches.
A fused kernel does one whole group in one launch, reading its inputs once (``kernels/fused.cu``):

    kernel                  replaces (the reference, here)                        launches it saves
    add_layer_norm_rows     x = x + y + b;  model.layer_norm(x, w, b)              ~12 -> 1
    add_rms_norm_rows       x = x + y;      llama.rms_norm(x, w, eps)               ~8 -> 1
    bias_gelu               model.gelu(h + b)                                       ~9 -> 1
    silu_mul                llama.silu(gate) * up                                   ~6 -> 1
    qkv_to_cache            split q | k | v, + bias, write k, v into the cache       ~6 -> 1
    qkv_rope_to_cache       split, llama.apply_rope on q and k, write the cache    ~15 -> 1
    decode_attention        softmax(q k^T / sqrt(hs) + mask) v over the cache      ~10 -> 1
    embed_(pos_)rows        positions from the lengths; wte[ids] (+ wpe[pos])       ~4 -> 1

Every kernel takes the same buffers as its reference here (``REFERENCES[name]``, array code on the arrays'
own backend) and writes the same ones: tests run both on the same inputs and compare (tests/test_fused.py),
on awkward shapes and against broken kernels (``kernels/mutants.py``). ``launch(name, grid, args)`` runs
kernel ``name``: by CuPy on a GPU, through the chapter-4 emulation (g++ and cuda_emu.h) under the strict
stand-in, and as its reference on NumPy, where there is no launch to save, unless ``emulated=True`` asks for
the CUDA source on the CPU. ``minillm.decode_step`` builds a whole decode step from these kernels.
"""

from __future__ import annotations

import math

import numpy as np

from .attention import softmax
from .backend import is_gpu, xp
from .kernels.build import (
    FUSED,
    FUSED_HS_MAX,
    FUSED_SOURCE,
    FUSED_THREADS,
    NORM_SMEM_FLOATS,
    KernelError,
    build_emulator,
    run_emulated,
)
from .kernels.launch import compile_raw_kernel
from .nn import LN_EPS, apply_rope, gelu, layer_norm, merge_heads, repeat_kv, rms_norm, rope_cos_sin, silu, split_heads

FLOAT_BYTES = 4
HS_MAX = FUSED_HS_MAX  # the largest head size decode_attention takes (its #define in fused.cu)


NORM_SMEM_BYTES = FLOAT_BYTES * NORM_SMEM_FLOATS  # the norm kernels' shared memory: two sums' slots


def attention_smem_bytes(hs: int) -> int:
    """decode_attention's dynamic shared memory: each of the warp's 32 lanes parks hs + 2 floats (its
    unnormalized output, running max and running sum) for the merge.  hs 64 -> 8,448 bytes."""
    return FLOAT_BYTES * FUSED_THREADS * (hs + 2)


def launch(name: str, grid: tuple, args: tuple, shared_mem: int = 0, emulated: bool = False, source=FUSED_SOURCE):
    """Run kernel ``name`` of kernels/fused.cu on ``args`` (its parameters in order: arrays, then numpy.int32 /
    numpy.float32 scalars), grid ``grid``, one warp per block.

    With ``emulated`` (or a ``source`` other than fused.cu: a mutant), on host arrays: the CUDA source through
    the g++ emulation. Else on a device (CuPy, the strict stand-in): the kernel, asynchronously (no wait for
    the device); on NumPy: the reference ``REFERENCES[name]``. A refused launch writes its FUSED_* code to the
    status argument.
    """
    if emulated or source != FUSED_SOURCE:
        lib = build_emulator(source, kernel=FUSED)
        run_emulated(lib, args, (tuple(grid) + (1, 1))[:3], FUSED_THREADS, shared_mem, name)
    elif is_gpu():
        kernel = compile_raw_kernel(source, shared_mem, name)
        kernel(tuple(grid), (FUSED_THREADS,), tuple(args), shared_mem=shared_mem)
    else:
        REFERENCES[name](*args)


# ---- the references: the array code each kernel replaces, on the kernel's own buffers ------------------------
# Each writes what its kernel writes (in place) and checks none of the limits the kernel checks: the decode step
# checks token ids and positions on the host before it launches anything.


def embed_rows(ids, lengths, wte, x, pos, status, T, C, V, max_len, wpe=None):
    """pos[r] = lengths[b] + t for row r = b * T + t;  x[r] = wte[ids[r]] (+ wpe[pos[r]]).
    ids (B, T) int32, lengths (B,) int32, wte (V, C) -> x (B * T, C), pos (B * T,) int32."""
    B = lengths.shape[0]
    pos[...] = (lengths[:, None] + xp.arange(int(T), dtype=xp.int32)).reshape(B * int(T))  # (B, T) -> (B * T,)
    x[...] = wte[ids.reshape(-1)] if wpe is None else wte[ids.reshape(-1)] + wpe[pos]


def embed_pos_rows(ids, lengths, wte, wpe, x, pos, status, T, C, V, max_len):
    """GPT-2's embedding: ``embed_rows`` plus the position table wpe (block_size, C)."""
    embed_rows(ids, lengths, wte, x, pos, status, T, C, V, max_len, wpe=wpe)


def layer_norm_rows(x, w, b, out, C, eps):
    """out = model.layer_norm(x, w, b).  x, out (rows, C)"""
    assert float(eps) == np.float32(LN_EPS), "model.layer_norm's epsilon is LN_EPS"
    out[...] = layer_norm(x, w, b)


def rms_norm_rows(x, w, out, C, eps):
    """out = llama.rms_norm(x, w, eps).  x, out (rows, C)"""
    out[...] = rms_norm(x, w, float(eps))


def add_layer_norm_rows(x, y, bias, w, b, out, C, eps):
    """x += y + bias (the residual stream); out = model.layer_norm(x, w, b).  x, y, out (rows, C)"""
    x += y + bias
    layer_norm_rows(x, w, b, out, C, eps)


def add_rms_norm_rows(x, y, w, out, C, eps):
    """x += y (the residual stream); out = llama.rms_norm(x, w, eps).  x, y, out (rows, C)"""
    x += y
    rms_norm_rows(x, w, out, C, eps)


def bias_gelu(h, bias, H):
    """h = model.gelu(h + bias), in place.  h (rows, H)"""
    h[...] = gelu(h + bias)


def silu_mul(gu, a, H):
    """a = llama.silu(gate) * up, gate and up the two halves of each row of gu.  gu (rows, 2H) -> a (rows, H)"""
    a[...] = silu(gu[:, : int(H)]) * gu[:, int(H) :]


def qkv_to_cache(qkv, bias, pos, q, kc, vc, status, T, nh, nkv, hs, max_len, theta=None):
    """Split each row of the q|k|v product (+ bias; or RoPE on q and k when ``theta`` is given): q to
    q (B, nh, T, hs), k and v to the caches (B, nkv, max_len, hs) at the row's position pos[r].

    qkv (B * T, (nh + 2 nkv) hs), pos (B * T,) int32."""
    T, nh, nkv, hs = int(T), int(nh), int(nkv), int(hs)
    B = qkv.shape[0] // T
    rows = qkv.reshape(B, T, -1) if bias is None else (qkv + bias).reshape(B, T, -1)  # (B, T, width)
    q_dim, kv_dim = nh * hs, nkv * hs
    q_new = split_heads(rows[..., :q_dim], nh)  # (B, nh, T, hs)
    k_new = split_heads(rows[..., q_dim : q_dim + kv_dim], nkv)  # (B, nkv, T, hs)
    v_new = split_heads(rows[..., q_dim + kv_dim :], nkv)
    if theta is not None:
        cos, sin = rope_cos_sin(pos.reshape(B, T), hs, float(theta))  # (B, 1, T, hs)
        q_new, k_new = apply_rope(q_new, cos, sin), apply_rope(k_new, cos, sin)
    q[...] = q_new
    # EXERCISE 12.2 BEGIN: write token row r's k and v into the caches at position pos[r] of batch row r // T
    row_batch = xp.arange(B * T) // T  # (B * T,): the batch row of each token row
    kc[row_batch, :, pos, :] = k_new.transpose(0, 2, 1, 3).reshape(B * T, nkv, hs)  # (B * T, nkv, hs)
    vc[row_batch, :, pos, :] = v_new.transpose(0, 2, 1, 3).reshape(B * T, nkv, hs)
    # EXERCISE 12.2 END


def qkv_rope_to_cache(qkv, pos, q, kc, vc, status, T, nh, nkv, hs, max_len, theta):
    """Llama's q, k, v: ``qkv_to_cache`` with RoPE on q and k at each row's position, no bias."""
    qkv_to_cache(qkv, None, pos, q, kc, vc, status, T, nh, nkv, hs, max_len, theta=theta)


def decode_attention(q, kc, vc, pos, out, status, T, nh, nkv, hs, max_len, scale):
    """out[r] = softmax(q k^T * scale + mask) v, the query of row r = b * T + t seeing keys 0..pos[r] of the
    cache, written in merged-heads layout.

    q (B, nh, T, hs), caches (B, nkv, max_len, hs), pos (B * T,) -> out (B * T, nh * hs). The reference reads
    every one of the max_len slots and masks the unwritten ones (the kernel stops at pos[r])."""
    B, T = q.shape[0], int(T)
    # EXERCISE 12.1 BEGIN: True where cache slot j is visible to token row (b, t): j at or before its position
    visible = xp.arange(int(max_len)) <= pos.reshape(B, T)[:, :, None]  # (B, T, max_len)
    # EXERCISE 12.1 END
    k, v = repeat_kv(kc, int(nh) // int(nkv)), repeat_kv(vc, int(nh) // int(nkv))  # (B, nh, max_len, hs)
    scores = (q @ k.swapaxes(-1, -2)) * float(scale)  # (B, nh, T, max_len)
    weights = softmax(xp.where(visible[:, None], scores, -xp.inf))
    out[...] = merge_heads(weights @ v).reshape(B * T, -1)  # (B, nh, T, hs) -> (B * T, nh * hs)


REFERENCES = {name: globals()[name] for name in FUSED.names}  # kernel name -> its reference, same arguments


def raise_status(code: int) -> None:
    """A FUSED_* status code (0: nothing to do) -> KernelError naming what a kernel of fused.cu refused."""
    if code:
        raise KernelError(f"a kernel of fused.cu refused its input: {FUSED.status.get(code, f'status {code}')}")


def attention_scale(hs: int) -> np.float32:
    """1 / sqrt(hs), the score scale, as the float32 the kernel takes."""
    return np.float32(1.0 / math.sqrt(hs))
