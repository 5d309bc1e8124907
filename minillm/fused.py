"""Fused kernels and the static decode step: one block of either model, a few launches, one CUDA graph per step.

On a GPU every array operation is a kernel launch, and a launch costs the CPU a few microseconds however little it
computes. Written as array code, one LayerNorm is eleven launches (``nn.layer_norm``: a sum, a divide, a subtract,
...), and a decode step of the character model 317-443 (cuda, naive, flash attention): its few million multiply-adds
take less time than the launches. A fused kernel does one whole group of operations in one launch, reading its
inputs once (``kernels/fused.cu``). The launches each group costs as array code, counted on the strict stand-in (one
decode token, naive attention over a 6-token cache):

    kernel                  replaces (the reference, here)                          array code -> fused
    add_layer_norm_rows     x = x + y + b;  nn.layer_norm(x, w, b)                     13 -> 1
    add_rms_norm_rows       x = x + y;      nn.rms_norm(x, w, eps)                      8 -> 1
    bias_gelu               nn.gelu(h + b)                                             10 -> 1
    silu_mul                nn.silu(gate) * up                                          6 -> 1
    qkv_to_cache            + bias, split q | k | v, write k, v into the cache          3 -> 1
    qkv_rope_to_cache       split, nn.apply_rope on q and k, write the cache           12 -> 1
    decode_attention        softmax(q k^T / sqrt(hs) + mask) v over the cache      12 (GQA 14) -> 1
    embed_(pos_)rows        positions from the lengths; wte[ids] (+ wpe[pos])            4 -> 1

``launch(name, grid, **args)`` runs kernel ``name`` with its arguments by name: the names and types are read
once, from each kernel's ``extern "C"`` line in fused.cu (``kernels.build.FUSED_PARAMS``). It runs by CuPy on a
GPU, through the chapter-4 emulation (g++ and cuda_emu.h) under the strict stand-in, and as its reference
``REFERENCES[name]`` on NumPy, where there is no launch to save, unless ``emulated=True`` asks for the CUDA
source on the CPU. A reference is the array code the kernel replaces, on the kernel's own buffers, and takes the
arguments it uses, by the same names: tests run both on the same inputs and compare (tests/test_fused.py), on
awkward shapes and against broken kernels (``kernels/mutants.py``).

The static step runs the model's own block over a table of these kernels:

    StaticStep.run:  embed -> model.blocks(x, pos, cache, ops=FusedOps) -> LM head -> argmax
                                  |  gpt_block / llama_block (model.py, llama.py), once per layer
                                  v
    FusedOps:  product = one cuBLAS matmul into a fixed buffer (its bias left to the next kernel); a weight kept in
                          quantized blocks (weights="q") runs its own product (backend.weight_product) into it
               add_norm = (add_)layer_norm_rows | (add_)rms_norm_rows;  act = bias_gelu | silu_mul
               attend = qkv_to_cache | qkv_rope_to_cache, then decode_attention over the StaticCache

9 launches per layer and 6 around the layers (the embedding, the final norm, the LM head, the argmax and its copy,
the lengths' advance): ``decode_step.static_per_token`` counts them (60 for the 6-layer character model), for
float32 weights; weights kept in blocks on a device dequantize in each product (``quantize.Blocks.product``), more.
A graph replays exactly the kernels it recorded, with the same arguments and the same memory addresses, so a step
can be recorded only if nothing in it changes from one token to the next except the *contents* of device memory:

- shapes are fixed: the cache is a (B, n_kv_head, max_len, hs) buffer per layer that attention reads up to
  each row's position, never sliced to a length the host knows (``StaticCache``);
- positions and lengths live on the device: the step reads ``lengths`` (B,) and adds T to it (the cache
  contract's ``advance``); a Python int would be baked into the recording and replayed unchanged;
- every input, output and intermediate is allocated once, by the first (eager) run, before any recording;
- nothing waits for the device (no ``int(array)``, no ``.get()``, no ``if`` on a device value) and nothing
  is copied from the host: a recording runs nothing, so there is nothing to wait for or copy into yet.

The strict stand-in (``MINILLM_BACKEND=strict``) checks all of this on a CPU: its stream capture refuses each of
those operations with an error naming the line, and its replay reruns exactly what was recorded, on the recorded
buffers. The decoding loops on these steps are ``generate.greedy_generate`` and
``speculative.greedy_speculative_generate``; their reference is ``generate`` at temperature 0.
"""

from __future__ import annotations

import ctypes
import inspect
import math
from typing import NamedTuple

import numpy as np

from .attention import softmax
from .backend import is_gpu, to_numpy, weight_product, xp
from .cache_contract import CacheFullError
from .config import GPTConfig, LlamaConfig
from .kernels.build import (
    FUSED,
    FUSED_HS_MAX,
    FUSED_PARAMS,
    FUSED_SOURCE,
    FUSED_THREADS,
    NORM_SMEM_FLOATS,
    KernelError,
    build_emulator,
    run_emulated,
)
from .kernels.launch import compile_raw_kernel
from .kv_cache import cache_capacity
from .nn import LN_EPS, apply_rope, gelu, layer_norm, merge_heads, repeat_kv, rms_norm, rope_cos_sin, silu, split_heads
from .quantize import kept_in_blocks

FLOAT_BYTES = 4
HS_MAX = FUSED_HS_MAX  # the largest head size decode_attention takes (its #define in fused.cu)
NORM_SMEM_BYTES = FLOAT_BYTES * NORM_SMEM_FLOATS  # the norm kernels' shared memory: two sums' slots
SCALARS = {ctypes.c_int: np.int32, ctypes.c_float: np.float32}  # a kernel's scalar parameter -> what it takes


def attention_smem_bytes(hs: int) -> int:
    """decode_attention's dynamic shared memory: each of the warp's 32 lanes parks hs + 2 floats (its
    unnormalized output, running max and running sum) for the merge.  hs 64 -> 8,448 bytes."""
    return FLOAT_BYTES * FUSED_THREADS * (hs + 2)


def attention_scale(hs: int) -> float:
    """1 / sqrt(hs), the score scale."""
    return 1.0 / math.sqrt(hs)


def kernel_args(name: str, args: dict) -> dict:
    """Kernel ``name``'s arguments by name -> the same in its parameters' order, each scalar as the numpy.int32 /
    numpy.float32 the kernel takes; TypeError naming what is missing or unknown.

    Example: kernel_args("bias_gelu", {"H": 7, "h": h, "bias": b}) -> {"h": h, "bias": b, "H": numpy.int32(7)}."""
    params = FUSED_PARAMS[name]
    if args.keys() != params.keys():
        missing, unknown = [p for p in params if p not in args], [a for a in args if a not in params]
        raise TypeError(f"kernel {name}({', '.join(params)}): missing {missing}, unknown {unknown}")
    return {p: SCALARS[t](args[p]) if t in SCALARS else args[p] for p, t in params.items()}


def launch(name: str, grid: tuple, shared_mem: int = 0, emulated: bool = False, source=FUSED_SOURCE, **args):
    """Run kernel ``name`` of kernels/fused.cu on its arguments ``args``, by name (arrays; Python or NumPy
    numbers for the scalars), grid ``grid``, one warp per block.

    With ``emulated`` (or a ``source`` other than fused.cu: a mutant), on host arrays: the CUDA source through
    the g++ emulation. Else on a device (CuPy, the strict stand-in): the kernel, asynchronously (no wait for
    the device); on NumPy: the reference ``REFERENCES[name]`` on the arguments it takes. A refused launch
    writes its FUSED_* code to the status argument.
    """
    args = kernel_args(name, args)
    if emulated or source != FUSED_SOURCE:
        lib = build_emulator(source, kernel=FUSED)
        run_emulated(lib, tuple(args.values()), (tuple(grid) + (1, 1))[:3], FUSED_THREADS, shared_mem, name)
    elif is_gpu():
        kernel = compile_raw_kernel(source, shared_mem, name)
        kernel(tuple(grid), (FUSED_THREADS,), tuple(args.values()), shared_mem=shared_mem)
    else:
        REFERENCES[name](**{p: args[p] for p in REFERENCE_PARAMS[name]})


def raise_status(code: int) -> None:
    """A FUSED_* status code (0: nothing to do) -> KernelError naming what a kernel of fused.cu refused."""
    if code:
        raise KernelError(f"a kernel of fused.cu refused its input: {FUSED.status.get(code, f'status {code}')}")


# ---- the references: the array code each kernel replaces, on the kernel's own buffers ------------------------
# Each writes what its kernel writes (in place), takes only the arguments it uses (shapes come from the buffers),
# and checks none of the limits the kernel checks: the static step checks token ids and lengths on the host.
# A token row r = b * T + t; a buffer of rows is (B * T, width) or (B, T, width).


def embed_rows(ids, lengths, wte, x, pos):
    """pos[r] = lengths[b] + t;  x[r] = wte[ids[r]].  ids (B, T) int32, lengths (B,), wte (V, C) -> x, pos (B * T,)"""
    B, T = ids.shape
    pos[...] = (lengths[:, None] + xp.arange(T, dtype=xp.int32)).reshape(B * T)  # (B, T) -> (B * T,)
    x[...] = wte[ids].reshape(x.shape)  # (B, T, C)


def embed_pos_rows(ids, lengths, wte, wpe, x, pos):
    """GPT-2's embedding: ``embed_rows`` plus the position table wpe (block_size, C) at pos."""
    embed_rows(ids, lengths, wte, x, pos)
    x += wpe[pos].reshape(x.shape)


def layer_norm_rows(x, w, b, out, eps):
    """out = nn.layer_norm(x, w, b, eps) over each row."""
    out[...] = layer_norm(x, w, b, float(eps))


def rms_norm_rows(x, w, out, eps):
    """out = nn.rms_norm(x, w, eps) over each row."""
    out[...] = rms_norm(x, w, float(eps))


def add_layer_norm_rows(x, y, bias, w, b, out, eps):
    """x += y + bias (the residual stream); out = nn.layer_norm(x, w, b, eps)."""
    x += y + bias
    layer_norm_rows(x, w, b, out, eps)


def add_rms_norm_rows(x, y, w, out, eps):
    """x += y (the residual stream); out = nn.rms_norm(x, w, eps)."""
    x += y
    rms_norm_rows(x, w, out, eps)


def bias_gelu(h, bias):
    """h = nn.gelu(h + bias), in place."""
    h[...] = gelu(h + bias)


def silu_mul(gu, a):
    """a = nn.silu(gate) * up, gate and up the two halves of each row of gu.  (rows, 2H) -> (rows, H)"""
    H = a.shape[-1]
    a[...] = silu(gu[..., :H]) * gu[..., H:]


def split_qkv(rows, nh: int, nkv: int, hs: int) -> tuple:
    """(B, T, (nh + 2 nkv) hs) -> q (B, nh, T, hs), k and v (B, nkv, T, hs)."""
    q_dim, kv_dim = nh * hs, nkv * hs
    return (split_heads(rows[..., :q_dim], nh), split_heads(rows[..., q_dim : q_dim + kv_dim], nkv),
            split_heads(rows[..., q_dim + kv_dim :], nkv))


def qkv_to_cache(qkv, bias, pos, q, kc, vc):
    """Split each row of the q|k|v product (+ bias; None: no bias): q to q (B, nh, T, hs), k and v to the caches
    (B, nkv, max_len, hs) at the row's position pos[r].  qkv (B * T, (nh + 2 nkv) hs), pos (B * T,) int32."""
    B, nh, T, hs = q.shape
    nkv = kc.shape[1]
    rows = qkv.reshape(B, T, -1) if bias is None else (qkv + bias).reshape(B, T, -1)  # (B, T, width)
    q_new, k_new, v_new = split_qkv(rows, nh, nkv, hs)
    q[...] = q_new
    # EXERCISE 12.2 BEGIN: write token row r's k and v into the caches at position pos[r] of batch row r // T
    row_batch = xp.arange(B * T) // T  # (B * T,): the batch row of each token row
    kc[row_batch, :, pos, :] = k_new.transpose(0, 2, 1, 3).reshape(B * T, nkv, hs)  # (B * T, nkv, hs)
    vc[row_batch, :, pos, :] = v_new.transpose(0, 2, 1, 3).reshape(B * T, nkv, hs)
    # EXERCISE 12.2 END


def qkv_rope_to_cache(qkv, pos, q, kc, vc, theta):
    """Llama's q, k, v: nn.apply_rope on q and k at each row's position (no bias), then ``qkv_to_cache``."""
    B, nh, T, hs = q.shape
    nkv = kc.shape[1]
    rows = qkv.reshape(B, T, -1)  # (B, T, width)
    q_new, k_new, _ = split_qkv(rows, nh, nkv, hs)
    cos, sin = rope_cos_sin(pos.reshape(B, T), hs, float(theta))  # (B, 1, T, hs)
    turned = [merge_heads(apply_rope(q_new, cos, sin)), merge_heads(apply_rope(k_new, cos, sin)),
              rows[..., (nh + nkv) * hs :]]  # q | k turned, v as it is
    qkv_to_cache(xp.concatenate(turned, axis=-1), None, pos, q, kc, vc)


def decode_attention(q, kc, vc, pos, out, scale):
    """out[r] = softmax(q k^T * scale + mask) v, the query of row r = b * T + t seeing keys 0..pos[r] of the
    cache, written in merged-heads layout.

    q (B, nh, T, hs), caches (B, nkv, max_len, hs), pos (B * T,) -> out (B * T, nh * hs). The reference reads
    every one of the max_len slots and masks the unwritten ones (the kernel stops at pos[r])."""
    B, nh, T, _ = q.shape
    nkv, max_len = kc.shape[1], kc.shape[2]
    # EXERCISE 12.1 BEGIN: True where cache slot j is visible to token row (b, t): j at or before its position
    visible = xp.arange(int(max_len)) <= pos.reshape(B, T)[:, :, None]  # (B, T, max_len)
    # EXERCISE 12.1 END
    k, v = repeat_kv(kc, nh // nkv), repeat_kv(vc, nh // nkv)  # (B, nh, max_len, hs)
    scores = (q @ k.swapaxes(-1, -2)) * float(scale)  # (B, nh, T, max_len)
    weights = softmax(xp.where(visible[:, None], scores, -xp.inf))
    out[...] = merge_heads(weights @ v).reshape(out.shape)  # (B, nh, T, hs) -> (B, T, nh * hs)


REFERENCES = {name: globals()[name] for name in FUSED.names}  # kernel name -> its reference
REFERENCE_PARAMS = {name: tuple(inspect.signature(f).parameters) for name, f in REFERENCES.items()}


# ---- the block's ops as fused kernels ---------------------------------------------------------------------------


class Product(NamedTuple):
    """A weight product in its fixed buffer, its bias not yet added: the fused kernel that reads it adds it."""

    y: object  # (B, T, out)
    bias: object  # (out,), or None


class FusedOps:
    """The operations of a block as fused kernels on fixed buffers: the table the static step runs
    ``model.gpt_block`` / ``llama.llama_block`` over (the forward pass runs the same blocks over the model's own
    table of array code, ``model.GPTOps`` / ``llama.LlamaOps``).

        product(x, name)          x @ W into that product's buffer (cuBLAS, out=) -> Product(y, bias)   1 launch
        add_norm(x, h, name)      x += h.y + h.bias; normed = norm(x) (no add when h is None)            1 launch
        act(h)                    bias + GELU in place (GPT-2) | silu(gate) * up (Llama)                 1 launch
        attend(layer, qkv, cache) q|k|v (+ bias | RoPE) -> q and the cache at pos; attention over it    2 launches

    The weights come from the model's own table (``weight``, ``norm_weights``); each family's subclass names its
    kernels. Buffers are (B, T, width): the residual stream ``x``, ``normed``, ``q``, the merged heads ``attn``,
    and one per product of the block (by its name without the layer, shared by every layer), made at the first
    run, the eager one before any capture.
    """

    def __init__(self, model, B: int, T: int):
        cfg = model.config
        self.model, self.config, self.B, self.T, self.rows = model, cfg, B, T, (B * T,)
        self.x = xp.zeros((B, T, cfg.n_embd), dtype=xp.float32)
        self.normed = xp.zeros_like(self.x)
        self.pos = xp.zeros(B * T, dtype=xp.int32)  # each token row's absolute position, written by embed
        self.q = xp.zeros((B, cfg.n_head, T, cfg.head_size), dtype=xp.float32)
        self.attn = xp.zeros((B, T, cfg.n_head * cfg.head_size), dtype=xp.float32)
        self.buffers = {}

    def buffer(self, key: str, width: int):
        """The fixed (B, T, width) buffer called key, made at its first use."""
        if key not in self.buffers:
            self.buffers[key] = xp.zeros((self.B, self.T, width), dtype=xp.float32)
        return self.buffers[key]

    def product(self, x, name: str) -> Product:
        """x @ W (W [in, out] from the model's table) into the buffer of this product.  (B, T, in) -> (B, T, out)"""
        w, bias = self.model.weight(name)
        y = self.buffer(name.split(".", 2)[-1], w.shape[1])  # "h.3.mlp.c_fc" -> "mlp.c_fc"
        xp.matmul(x.reshape(-1, x.shape[-1]), w, out=y.reshape(-1, w.shape[1]))  # (rows, in) @ (in, out)
        return Product(y, bias)

    def norm(self, kernel: str, x, added: dict, **weights) -> None:
        """normed = the norm ``kernel`` of x, its weights ``weights``; with ``added`` (the product to add: y, and
        its bias where the family has one) first x += y (+ bias), by the add_ variant of the kernel: one launch."""
        launch("add_" + kernel if added else kernel, self.rows, shared_mem=NORM_SMEM_BYTES, x=x, **added, **weights,
               out=self.normed, C=self.config.n_embd, eps=self.eps)

    def cache_dims(self, cache) -> dict:
        """The sizes the q|k|v and attention kernels take."""
        return {"T": self.T, "nh": self.config.n_head, "nkv": self.config.n_kv_head, "hs": self.config.head_size,
                "max_len": cache.max_len}

    def attention(self, layer: int, cache):
        """decode_attention: each query over keys 0..pos of its layer's cache -> the merged heads (B, T, nh * hs)."""
        hs = self.config.head_size
        launch("decode_attention", (self.T, self.config.n_head, self.B), shared_mem=attention_smem_bytes(hs),
               q=self.q, kc=cache.k[layer], vc=cache.v[layer], pos=self.pos, out=self.attn, status=cache.status,
               **self.cache_dims(cache), scale=attention_scale(hs))
        return self.attn

    def embed_args(self, ids, cache) -> dict:
        """What both embedding kernels take besides the tables: the ids, the lengths, the outputs, the sizes."""
        cfg = self.config
        return {"ids": ids, "lengths": cache.lengths, "x": self.x, "pos": self.pos, "status": cache.status,
                "T": self.T, "C": cfg.n_embd, "V": cfg.vocab_size, "max_len": cache.max_len}


class FusedGPTOps(FusedOps):
    """GPT-2's kernels: LayerNorm with its bias, bias + GELU, q|k|v + bias into the cache, wte + wpe."""

    eps = LN_EPS

    def embed(self, ids, cache):
        """pos = lengths + t; x = wte[ids] + wpe[pos]: one launch -> x (B, T, C)."""
        p = self.model.params
        launch("embed_pos_rows", self.rows, wte=p["wte.weight"], wpe=p["wpe.weight"], **self.embed_args(ids, cache))
        return self.x

    def add_norm(self, x, h, name: str):
        w, b = self.model.norm_weights(name)
        self.norm("layer_norm_rows", x, {} if h is None else {"y": h.y, "bias": h.bias}, w=w, b=b)
        return x, self.normed

    def act(self, h: Product):
        launch("bias_gelu", self.rows, h=h.y, bias=h.bias, H=h.y.shape[-1])
        return h.y

    def attend(self, layer: int, qkv: Product, cache):
        c = cache
        launch("qkv_to_cache", self.rows, qkv=qkv.y, bias=qkv.bias, pos=self.pos, q=self.q, kc=c.k[layer],
               vc=c.v[layer], status=c.status, **self.cache_dims(c))
        return self.attention(layer, c)


class FusedLlamaOps(FusedOps):
    """Llama's kernels: RMSNorm, silu(gate) * up, q|k|v with RoPE into the cache, the token embedding alone."""

    @property
    def eps(self):
        return self.config.norm_eps

    def embed(self, ids, cache):
        """pos = lengths + t; x = embed_tokens[ids]: one launch -> x (B, T, C). The kernel reads a float32 table; a
        table kept in blocks is looked up by the kernel's reference, which dequantizes only the rows it picks."""
        wte = self.model.params["embed_tokens.weight"]
        if kept_in_blocks(wte):
            embed_rows(ids, cache.lengths, wte, self.x, self.pos)  # (the host checked the ids: StaticStep.set_ids)
        else:
            launch("embed_rows", self.rows, wte=wte, **self.embed_args(ids, cache))
        return self.x

    def product(self, x, name: str) -> Product:
        """x @ W^T into the product's buffer; W [out, in] kept in quantized blocks runs its own product (the model's
        ``weight_product``: minillm.qkernels on NumPy, the blocks dequantized on a device), copied into the buffer.
        (B, T, in) -> (B, T, out)"""
        w = self.model.matrix(name)
        if not kept_in_blocks(w):
            return super().product(x, name)
        y = self.buffer(name.split(".", 2)[-1], w.shape[0])  # "layers.3.gate_up" -> "gate_up"
        y[...] = weight_product(x, w)
        return Product(y, None)

    def add_norm(self, x, h, name: str):
        (w,) = self.model.norm_weights(name)
        self.norm("rms_norm_rows", x, {} if h is None else {"y": h.y}, w=w)  # Llama's products have no bias
        return x, self.normed

    def act(self, h: Product):
        H = h.y.shape[-1] // 2
        a = self.buffer("act", H)
        launch("silu_mul", self.rows, gu=h.y, a=a, H=H)
        return a

    def rope(self, pos):
        """RoPE's tables are the kernel's to compute, from each row's position and theta: the table is theta."""
        return self.config.rope_theta

    def attend(self, layer: int, qkv: Product, cache, theta):
        c = cache
        launch("qkv_rope_to_cache", self.rows, qkv=qkv.y, pos=self.pos, q=self.q, kc=c.k[layer], vc=c.v[layer],
               status=c.status, **self.cache_dims(c), theta=theta)
        return self.attention(layer, c)


FUSED_OPS = {GPTConfig: FusedGPTOps, LlamaConfig: FusedLlamaOps}  # a model's config -> its fused table


# ---- the static step ----------------------------------------------------------------------------------------


class CaptureUnavailable(RuntimeError):
    """A CUDA graph needs a device: NumPy has no stream to record."""


class StaticCache:
    """K and V (B, n_kv_head, max_len, hs) per layer, and each row's length, all on the device.

    ``lengths`` (B,) int32 is what the steps read and advance (``advance``, the cache contract's: the model's
    ``blocks`` calls it after the last layer); ``host_lengths`` is the host's copy, which ``StaticStep.step``
    keeps, so the host can refuse an overflow without waiting for the device.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None):
        self.config, self.batch_size = config, batch_size
        self.max_len = cache_capacity(config, max_len)
        shape = (batch_size, config.n_kv_head, self.max_len, config.head_size)  # (B, n_kv_head, max_len, hs)
        self.k = [xp.zeros(shape, dtype=xp.float32) for _ in range(config.n_layer)]
        self.v = [xp.zeros(shape, dtype=xp.float32) for _ in range(config.n_layer)]
        self.lengths = xp.zeros(batch_size, dtype=xp.int32)
        self.host_lengths = np.zeros(batch_size, dtype=np.int64)
        self.status = xp.zeros(1, dtype=xp.int32)  # a kernel that refuses its input writes its FUSED_* code here

    def advance(self, T: int) -> None:
        """Every row's T new tokens are cached: one launch, on the device (the next step reads the new length)."""
        self.lengths += T

    def set_lengths(self, lengths) -> None:
        """Keep the first lengths[b] tokens of each row (a rollback): one copy to the device."""
        lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), (self.batch_size,))
        if lengths.min() < 0 or lengths.max() > self.max_len:
            raise ValueError(f"lengths must lie in 0..max_len={self.max_len}, got {lengths.tolist()}")
        self.host_lengths = lengths.copy()
        self.lengths[...] = xp.asarray(lengths.astype(np.int32))

    def check_status(self) -> None:
        """Read the kernels' status word (a wait) and raise KernelError if one refused its input."""
        code = int(to_numpy(self.status)[0])
        if code:
            self.status[...] = 0
            raise_status(code)


class StaticStep:
    """One forward of T new tokens per row at fixed addresses: T = 1 decodes, T = K + 1 verifies K drafts.

    ``ids`` (B, T) int32 in; ``logits`` (B * T, V) and ``next_ids`` (B, T) int32, their argmax, out. For T = 1
    ``next_ids`` is ``ids`` itself, so a decode step feeds itself the token it chose. ``run()`` launches the
    step's kernels; ``capture()`` records them into a CUDA graph, after which ``step()`` replays it.
    """

    def __init__(self, model, cache: StaticCache, T: int = 1):
        cfg = model.config
        if type(cfg) not in FUSED_OPS:
            raise TypeError(f"the static decode step runs a GPT or a Llama, not a {type(model).__name__}")
        if cache.config != cfg:
            raise ValueError("the cache was made for another model config")
        if cfg.head_size > HS_MAX:
            raise ValueError(f"the fused attention kernel takes head sizes up to {HS_MAX}, got {cfg.head_size}")
        self.model, self.cache, self.T, self.B = model, cache, int(T), cache.batch_size
        self.ops = FUSED_OPS[type(cfg)](model, self.B, self.T)
        self.ids = xp.zeros((self.B, self.T), dtype=xp.int32)
        self.next_ids = self.ids if self.T == 1 else xp.zeros((self.B, self.T), dtype=xp.int32)
        self.logits = xp.zeros((self.B * self.T, cfg.vocab_size), dtype=xp.float32)
        self.lm_head_t = None if kept_in_blocks(model.lm_head) else model.lm_head.T  # (C, V), a view
        self.graph = self.pool = self.stream = None

    def run(self) -> None:
        """Launch the step's kernels, the model's own blocks over ``FusedOps``: 9 per layer, 6 around them; none
        waits for the device."""
        x = self.ops.embed(self.ids, self.cache)  # pos = lengths + t; x = wte[ids] (+ wpe[pos])
        h = self.model.blocks(x, self.ops.pos, self.cache, ops=self.ops)  # the blocks, the final norm; advance(T)
        h = h.reshape(self.B * self.T, -1)  # (rows, C)
        if self.lm_head_t is None:  # an LM head kept in blocks: its own product
            self.logits[...] = weight_product(h, self.model.lm_head)
        else:
            xp.matmul(h, self.lm_head_t, out=self.logits)  # (rows, C) @ (C, V)
        self.next_ids[...] = self.logits.reshape(self.B, self.T, -1).argmax(axis=-1)  # two launches: argmax, copy

    def set_ids(self, ids) -> None:
        """Token ids (B, T) from the host -> ``ids`` (one copy to the device), checked against the vocabulary."""
        ids = np.asarray(ids, dtype=np.int64).reshape(self.B, self.T)
        if ids.min() < 0 or ids.max() >= self.model.config.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.model.config.vocab_size - 1}")
        self.ids[...] = xp.asarray(ids.astype(np.int32))

    def step(self) -> None:
        """One step: the recorded graph when ``capture`` made one, else ``run``. Refuses to pass max_len."""
        c = self.cache
        if c.host_lengths.max() + self.T > c.max_len:
            raise CacheFullError(f"static cache full: {int(c.host_lengths.max())} cached + {self.T} new tokens > "
                                 f"max_len={c.max_len}")
        if self.graph is None:
            self.run()
        else:
            self.graph.launch()  # on the current stream: ordered after the copies that fed ids
        c.host_lengths += self.T

    def capture(self) -> None:
        """Record ``run`` into a CUDA graph, once; ``step`` replays it from then on.

        First one eager run: it compiles every kernel (a compile or module load cannot be recorded), makes the
        step's buffers and cuBLAS's workspace. Its effects on the state (the lengths, and ids for T = 1) are
        undone; the keys and values it wrote past the lengths are never read. The recording runs on a stream of
        its own (the legacy default stream cannot record) with a memory pool of its own, so no array made after
        it can be given the memory the graph's temporaries use at every replay.
        """
        if not is_gpu():
            raise CaptureUnavailable("a CUDA graph needs a device (CuPy, or MINILLM_BACKEND=strict)")
        if self.graph is not None:
            return
        lengths, ids = self.cache.lengths.copy(), self.ids.copy()
        self.run()
        self.cache.lengths[...] = lengths
        self.ids[...] = ids
        self.stream, self.pool = xp.cuda.Stream(non_blocking=True), xp.cuda.MemoryPool()
        with self.stream, xp.cuda.using_allocator(self.pool.malloc):
            self.stream.begin_capture()
            try:
                self.run()
            finally:
                graph = self.stream.end_capture()
        self.graph = graph


def static_prefill(model, tokens: list, max_len: int) -> StaticCache:
    """A static cache of ``max_len`` slots holding ``tokens`` (one eager step of T = len(tokens); none for [])."""
    cache = StaticCache(model.config, 1, max_len)
    if tokens:
        step = StaticStep(model, cache, T=len(tokens))
        step.set_ids([tokens])
        step.step()
    return cache


def start_decoding(model, prompt: list, max_len: int, graph: bool = False) -> StaticStep:
    """The T = 1 decode step of a static cache that holds prompt[:-1], its ids holding prompt[-1]: each
    ``step()`` feeds the last token and leaves the next one, its argmax, in ``ids``. With ``graph`` the step is
    captured, so each ``step()`` is one graph launch."""
    decode = StaticStep(model, static_prefill(model, prompt[:-1], max_len), T=1)
    decode.set_ids([[prompt[-1]]])
    if graph:
        decode.capture()
    return decode


def next_id(step: StaticStep) -> int:
    """The token a T = 1 step chose, brought to the host: the one wait per token."""
    return int(to_numpy(step.ids)[0, 0])
