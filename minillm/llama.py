"""A Llama forward pass in plain array code (NumPy or CuPy): the architecture of today's open models.

    x = embed_tokens[idx]
    for each block:  x = x + attn(rms_norm(x));  x = x + swiglu(rms_norm(x))
    logits = rms_norm(x) @ embed_tokens^T                        (SmolLM2 ties the LM head)

Four changes from GPT-2 (``model.py``), each one function: ``swiglu`` here, the other three in ``minillm.nn``
(chapter 8's exercises; the fused kernels' references use them too, and ``nn`` sits below both):

- ``rms_norm``: scale by the root mean square, no mean subtraction and no bias (Zhang & Sennrich 2019).
- ``apply_rope``: no position table; q and k of every head are rotated by angles proportional to
  the position (RoPE, Su et al. 2021), so a score q.k depends only on the distance between tokens.
- ``swiglu``: the MLP gates one projection by silu of another (Shazeer 2020).
- ``repeat_kv``: grouped-query attention (Ainslie et al. 2023): n_kv_head key/value heads, each
  shared by n_head / n_kv_head query heads, so a cache stores n_kv_head heads (SmolLM2-135M: 3, not 9).

Parameters are named and laid out like Hugging Face's ``LlamaForCausalLM`` state dict without the
``model.`` prefix (see ``LlamaConfig.param_shapes``); linear weights are [out, in], so y = x @ w.T.
``forward(idx, cache=None)`` follows the same contract as ``GPT.forward`` (see ``model.py``): the
cache stores k and v with n_kv_head heads, and the attention function it is handed maps each
query head to its key/value head before calling the selected implementation (a name in
``model.ATTENTION``; the default "auto" tiles a long prefill).
"""

from __future__ import annotations

import functools

import numpy as np

from .attention import causal_mask
from .backend import is_gpu, on_device, to_numpy, weight_product, xp
from .config import LlamaConfig
from .model import (
    CAUSAL_ONLY,
    DEFAULT_ATTENTION,
    INIT_STD,
    check_layers,
    check_params,
    get_attention,
    host_float32,
    token_positions,
)
from .nn import apply_rope, merge_heads, repeat_kv, rms_norm, rope_cos_sin, silu, split_heads
from .quantize import Blocks, as_blocks, concat_rows, kept_in_blocks

ACTIVATIONS = ("float32", "int8")  # what the CPU kernels multiply a weight kept in blocks by (``set_activations``)


def model_weight(weight):
    """A Q8_0 / Q4_1 weight as a model keeps it: packed once for ``minillm.qkernels``'s kernels on NumPy; on
    a device (CuPy, the strict stand-in) its raw blocks, uploaded once, whose products dequantize there
    (``quantize.Blocks.product``). A weight already kept so is returned as it is."""
    if not isinstance(weight, Blocks):
        return weight  # packed already
    if is_gpu():
        return weight if on_device(weight.raw) else type(weight)(xp.asarray(weight.raw), weight.k)
    from .qkernels import pack  # numba, imported when a model first keeps blocks

    return pack(weight)


def grouped_attention(attention, n_rep: int, masks: bool = False):
    """attention(q, k, v) with k, v of n_kv_head heads: each group of n_rep query heads shares one.

    Returns f(q, k, v, causal=True, mask=None): (B, nh, Tq, hs), (B, nh / n_rep, Tk, hs) x 2 -> (B, nh, Tq, hs).

    The n_rep query heads of a group become n_rep x Tq query rows of their one key/value head, (B, nh, Tq, hs)
    -> (B, nh / n_rep, n_rep Tq, hs), and attend without copying k and v, the way llama.cpp broadcasts. A
    decode step's query (Tq = 1) sees every key; with more query rows the (Tq, Tk) mask (the causal one, or the
    one given) is stacked n_rep times, so ``masks`` says whether ``attention`` takes an explicit mask (the CUDA
    kernels know the causal rule only). Otherwise, and where n_rep Tq > Tk (a prefill into an empty cache), k
    and v are repeated (``repeat_kv``). SmolLM2 at 128 cached tokens: the copies took 0.8-1.8 ms of a verify of 2
    or 5 tokens, 18-25 ms (docs/eagle.md).
    """

    def grouped(q, k, v, causal=True, mask=None):
        B, nh, Tq, hs = q.shape
        Tk, rows = k.shape[2], n_rep * Tq
        if 1 < n_rep and rows <= Tk and (masks or (Tq == 1 and mask is None)):
            if mask is None and causal and Tq > 1:
                mask = causal_mask(Tq, Tk)
            stacked = None if mask is None else xp.tile(xp.asarray(mask, dtype=bool), (n_rep, 1))  # row (r, t): t's
            out = attention(q.reshape(B, nh // n_rep, rows, hs), k, v, causal=False, mask=stacked)
            return out.reshape(B, nh, Tq, hs)
        return attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), causal=causal, mask=mask)

    return grouped


def swiglu(x, w_gate_up, w_down):
    """down(silu(gate(x)) * up(x)), gate and up in one product: w_gate_up = [w_gate; w_up] (2H, C).

    (B, T, C) -> (B, T, 2H) -> (B, T, H) -> (B, T, C)"""
    gate, up = xp.split(weight_product(x, w_gate_up), 2, axis=-1)  # (B, T, H) each
    return weight_product(silu(gate) * up, w_down)


def stack_rows(params: dict, names: list[str]):
    """Stack weights [out_i, in] into one (sum out_i, in) matrix and make each params[name] a view of
    its rows: one product then streams them all (a read of q, k and v is one pass, not three), and
    the parameters keep their names, shapes and values (an in-place change reaches the stack).

    Weights kept in their file's blocks (one format, ``minillm.quantize``) stack their raw rows, which are
    then kept as the model keeps blocks (``quantize.model_weight``: packed once on a CPU)."""
    parts = [params[name] for name in names]
    blocks = any(kept_in_blocks(w) for w in parts)
    stacked = model_weight(concat_rows([as_blocks(w) for w in parts])) if blocks else xp.concatenate(parts, axis=0)
    start = 0
    for name, w in zip(names, parts):
        stop = start + w.shape[0]
        params[name] = stacked.row_slice(start, stop) if blocks else stacked[start:stop]  # (out_i, in), a view
        start = stop
    return stacked


def check_llama_params(config: LlamaConfig, params: dict) -> dict:
    """``check_params`` (names, shapes; arrays -> float32 on the backend), except that a matrix kept in its
    file's blocks (a ``minillm.quantize`` Q8_0 / Q4_1) is checked by its shape and kept as it is."""
    blocks = {name: w for name, w in params.items() if kept_in_blocks(w)}
    shapes = {name: np.broadcast_to(np.float32(0), w.shape) for name, w in blocks.items()}  # no memory on a CPU
    return check_params(config, params | shapes, "Llama") | blocks


def llama_block(ops, layer: int, x, h, cache, rope, taps: dict | None = None):
    """One Llama block over the table ``ops``, the previous block's MLP output h added first (none before the
    first block), RoPE's tables ``rope`` (from ``ops.rope(pos)``) turning q and k:

        x = x + h;   x = x + attn(rms_norm(x));   h = swiglu(rms_norm(x))       -> (x, h), each (B, T, C)

    ``taps`` ({layer: None, ...}, optional) gets the block's input as it reads it, rms_norm(x + h), when it names
    this block (EAGLE-3's low and middle features).
    """
    b = f"layers.{layer}."
    x, n = ops.add_norm(x, h, b + "input_layernorm")  # x = x + h;  n = rms_norm(x)
    if taps is not None and layer in taps:
        taps[layer] = n
    y = ops.attend(layer, ops.product(n, b + "qkv"), cache, rope)  # q|k|v in one product -> heads merged (B, T, C)
    x, n = ops.add_norm(x, ops.product(y, b + "self_attn.o_proj"), b + "post_attention_layernorm")
    return x, ops.product(ops.act(ops.product(n, b + "gate_up")), b + "mlp.down_proj")  # (B, T, 2H) -> (B, T, C)


def llama_blocks(ops, x, pos, cache, layers: int, taps: dict | None = None):
    """``layers`` blocks on the residual stream x (B, T, C) at positions pos, then the last add and the
    final RMSNorm -> (B, T, C); ``taps`` as in ``llama_block``."""
    rope, h = ops.rope(pos), None
    for layer in range(layers):
        x, h = llama_block(ops, layer, x, h, cache, rope, taps)
    return ops.add_norm(x, h, "norm")[1]


class LlamaOps:
    """The operations of a Llama block in array code: the default table of ``llama_block`` (the same ops as
    ``model.GPTOps``: product, add_norm, act, attend, and rope for the position tables).

    ``stacked`` holds the products that read several weights in one pass: "layers.{i}.qkv" (q_dim + 2 kv_dim, C)
    and "layers.{i}.gate_up" (2H, C); every other product reads its own weight. Weights are [out, in].
    """

    def __init__(self, config: LlamaConfig, params: dict, attention, stacked: dict):
        self.config, self.params, self.attention, self.stacked = config, params, attention, stacked

    def matrix(self, name: str):
        """The [out, in] weight called name: a float32 matrix, or a weight kept in blocks (``minillm.quantize``)."""
        return self.stacked[name] if name in self.stacked else self.params[name + ".weight"]

    def weight(self, name: str) -> tuple:
        """The weight called name as (w [in, out], bias None): a transposed view of the [out, in] matrix."""
        return self.matrix(name).T, None

    def norm_weights(self, name: str) -> tuple:
        return (self.params[name + ".weight"],)

    def product(self, x, name: str):
        """x @ W^T for W [out, in].  (..., in) -> (..., out)"""
        return weight_product(x, self.matrix(name))

    def add_norm(self, x, h, name: str):
        """x + h (the residual stream; x itself when h is None) and its RMSNorm ``name`` -> (x, normed)."""
        x = x if h is None else x + h
        return x, rms_norm(x, *self.norm_weights(name), self.config.norm_eps)

    def act(self, gate_up):
        """silu(gate) * up, gate and up the two halves of the stacked product.  (..., 2H) -> (..., H)"""
        gate, up = xp.split(gate_up, 2, axis=-1)
        return silu(gate) * up

    def rope(self, pos) -> tuple:
        """RoPE's (cos, sin) tables at positions pos: (T, hs) each, or (B, 1, T, hs) for a ragged batch."""
        cfg = self.config
        cos, sin = rope_cos_sin(pos, cfg.head_size, cfg.rope_theta)
        return cos, sin

    def rotate(self, q, k, rope) -> tuple:
        """RoPE on q and k, (B, heads, T, hs) each, with the tables ``rope`` -> (q, k) turned."""
        cos, sin = rope
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, layer: int, qkv, cache, rope):
        """Causal grouped-query self-attention with RoPE on q and k.  (B, T, q_dim + 2 kv_dim) -> (B, T, C)"""
        cfg = self.config
        q_dim, kv_dim = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size
        q = split_heads(qkv[..., :q_dim], cfg.n_head)  # (B, nh, T, hs)
        k = split_heads(qkv[..., q_dim : q_dim + kv_dim], cfg.n_kv_head)  # (B, n_kv_head, T, hs)
        v = split_heads(qkv[..., q_dim + kv_dim :], cfg.n_kv_head)  # (B, n_kv_head, T, hs)
        q, k = self.rotate(q, k, rope)
        if cache is None:
            y = self.attention(q, k, v, causal=True)  # (B, nh, T, hs)
        else:
            y = cache.attend(layer, q, k, v, self.attention)  # stores n_kv_head heads -> (B, nh, T, hs)
        return merge_heads(y)


def stacked_weights(params: dict, n_layer: int, stack) -> dict:
    """{"layers.{i}.qkv": q, k, v rows; "layers.{i}.gate_up": gate, up rows} made by ``stack(params, names)``."""
    out = {}
    for layer in range(n_layer):
        h = f"layers.{layer}."
        out[h + "qkv"] = stack(params, [h + f"self_attn.{p}_proj.weight" for p in "qkv"])
        out[h + "gate_up"] = stack(params, [h + f"mlp.{p}_proj.weight" for p in ("gate", "up")])
    return out


ROPE_TABLE_START = 1024  # positions in LlamaCpuOps's first RoPE table (0.5 MB at SmolLM2's head size)


class LlamaCpuOps(LlamaOps):
    """``LlamaOps`` with a block's row-wise work as numba kernels on a CPU (``minillm.block_kernels``): the residual
    add with its RMSNorm, RoPE on q and k, SiLU(gate) * up, one call each where the array code makes 4 to 8. The
    products, the attention and the weights are the model's own (read through it, so its switches reach here).
    ``Llama``'s default on NumPy; ``Llama.set_block_ops("array")`` runs the model's own table, the reference."""

    def __init__(self, model):
        from . import block_kernels  # numba, imported once a CPU builds this table
        from .row_attention import fits_shape

        self.model, self.kernels, self.fits = model, block_kernels, fits_shape
        self.rope_table = None  # (cos, sin) of positions 0..n-1, grown as positions come (``rope``)

    @property
    def config(self):
        return self.model.config

    @property
    def params(self):
        return self.model.params

    @property
    def stacked(self):
        return self.model.stacked

    @property
    def attention(self):
        return self.model.attention

    def product(self, x, name: str):
        return self.model.product(x, name)  # the model's (a measurement may swap it on the instance)

    def add_norm(self, x, h, name: str):
        return self.kernels.add_rms_norm(x, h, *self.norm_weights(name), self.config.norm_eps)

    def act(self, gate_up):
        return self.kernels.silu_mul(gate_up)

    def attend(self, layer: int, qkv, cache, rope):
        """``LlamaOps.attend`` in one kernel (``block_kernels.attend``) where the cache lends its buffers
        (``in_place``), the model's attention is "auto" and ``row_attention`` takes the shape (``fits_shape``): RoPE,
        the cache's write and the attention of every head. Anywhere else, ``LlamaOps.attend``."""
        cfg, cos = self.config, rope[0]
        lend = getattr(cache, "in_place", None)
        if (lend is not None and self.model.attention_name == "auto" and cos.ndim == 2
                and self.fits(cfg.n_head // cfg.n_kv_head * qkv.shape[1], cache.length + qkv.shape[1])):
            buffers = lend(layer)
            if buffers is not None:
                return self.kernels.attend(qkv, *rope, *buffers, cache.length, cfg.n_head)
        return super().attend(layer, qkv, cache, rope)

    def rope(self, pos) -> tuple:
        """``LlamaOps.rope``'s tables, looked up in one computed for positions 0..n-1 (n doubled when a position
        is past it) instead of computed at every call: the same floats, position by position."""
        pos = np.asarray(pos)
        if pos.ndim != 1:  # a ragged batch's (B, T) positions: the array code
            return super().rope(pos)
        top = int(pos.max(initial=0)) + 1
        have = 0 if self.rope_table is None else len(self.rope_table[0])
        if have < top:
            self.rope_table = super().rope(np.arange(max(top, 2 * have, ROPE_TABLE_START)))
        cos, sin = self.rope_table
        return cos[pos], sin[pos]

    def rotate(self, q, k, rope) -> tuple:
        cos, sin = rope
        if cos.ndim != 2:  # a ragged batch's tables, one per row: the array code
            return super().rotate(q, k, rope)
        return self.kernels.rope(q, cos, sin), self.kernels.rope(k, cos, sin)


BLOCK_OPS = ("numba", "array")  # what a Llama's blocks run on besides products and attention (``set_block_ops``)


@functools.cache
def kernels_match_reference() -> bool:
    """Whether ``block_kernels`` compute what this library's array code computes, on a small probe (once a process):
    the residual add and RMSNorm, RoPE, SiLU(gate) * up. False where the array code raises (an exercise of chapter 8
    left to do) or gives something else (done another way): a Llama then runs the array code, so that what a
    student writes in ``minillm.nn`` is what the model runs, and its errors show."""
    from . import block_kernels as bk

    rng = np.random.default_rng(0)
    x, h, w = (rng.standard_normal(shape, dtype=np.float32) for shape in ((1, 2, 16), (1, 2, 16), (16,)))
    small = np.float32(3e-3) * x  # a mean square near eps: where eps sits matters
    q = rng.standard_normal((1, 2, 3, 8), dtype=np.float32)
    cos, sin = rope_cos_sin(np.arange(5, 8), 8, 10000.0)
    try:
        pairs = [(bk.add_rms_norm(x, h, w, 1e-5)[1], rms_norm(x + h, w, 1e-5)),
                 (bk.add_rms_norm(small, None, w, 1e-5)[1], rms_norm(small, w, 1e-5)),
                 (bk.rope(q, cos, sin), apply_rope(q, cos, sin)),
                 (bk.silu_mul(np.concatenate([x, h], -1)), silu(x) * h)]
    except Exception:  # any failure of the reference: run it, where it fails in plain sight
        return False
    return all(np.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in pairs)


class Llama(LlamaOps):
    """Llama with grouped-query attention and a selectable attention implementation (``model.ATTENTION``).

    The model is its own table of array-code ops (``LlamaOps``); ``forward`` runs ``llama_blocks(self.ops, ...)``, on
    a CPU the table whose norms, RoPE and SiLU are numba kernels (``LlamaCpuOps``, ``set_block_ops``).
    """

    def __init__(self, config: LlamaConfig, params: dict, attention: str = DEFAULT_ATTENTION):
        params = check_llama_params(config, params)
        stacked = stacked_weights(params, config.n_layer, stack_rows)  # one read each
        params |= {name: model_weight(w) for name, w in params.items() if kept_in_blocks(w)}  # the rest
        super().__init__(config, params, None, stacked)
        self.lm_head = self.params["embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"]  # (V, C)
        self.set_attention(attention)
        self.activations = "float32"
        self.set_block_ops("numba" if not is_gpu() and kernels_match_reference() else "array")

    @classmethod
    def init(cls, config: LlamaConfig, seed: int = 0, attention: str = DEFAULT_ATTENTION) -> Llama:
        """Random weights ~ N(0, 0.02) and RMSNorm gains 1 (for tests and experiments; no training here)."""
        rng = np.random.default_rng(seed)
        params = {name: np.ones(shape) if len(shape) == 1 else rng.normal(0.0, INIT_STD, shape)
                  for name, shape in config.param_shapes().items()}
        return cls(config, {k: v.astype(np.float32) for k, v in params.items()}, attention)

    def set_attention(self, name: str) -> None:
        """Switch the attention implementation; every choice gives the same logits."""
        self.attention_name = name
        self.attention = grouped_attention(get_attention(name), self.config.n_head // self.config.n_kv_head,
                                           masks=name not in CAUSAL_ONLY)

    def set_block_ops(self, name: str) -> None:
        """What the blocks run their norms, RoPE and SiLU on: "numba" (``LlamaCpuOps``, a CPU's default where the
        kernels match the array code, ``kernels_match_reference``) or "array" (this model's own table, ``LlamaOps``:
        the reference, and what a GPU runs). Both give the same logits within float32 rounding."""
        if name not in BLOCK_OPS:
            raise ValueError(f"block_ops={name!r}: choose from {', '.join(BLOCK_OPS)}")
        if name == "numba" and is_gpu():
            raise ValueError("block_ops='numba' runs numba kernels on NumPy arrays: on a GPU the blocks run 'array'")
        self.block_ops = name
        self.ops = LlamaCpuOps(self) if name == "numba" else self

    def set_activations(self, name: str) -> None:
        """What a product by a Q8_0 / Q4_1 weight multiplies: "float32" (exact, the default) or "int8", its input
        rounded to int8 per block of 32 and integer dot products, as llama.cpp does (``qkernels.with_int8_x``).
        "int8" is NOT the same model: ``bench quant-quality`` measures what it costs. It needs the weights
        packed for the CPU kernels (``weights="q"`` on NumPy)."""
        if name not in ACTIVATIONS:
            raise ValueError(f"activations={name!r}: choose from {', '.join(ACTIVATIONS)}")
        if is_gpu() or not any(kept_in_blocks(w) for w in self.params.values()):
            raise ValueError(f"activations={name!r} switches the CPU kernels' products: load the model with "
                             "weights='q' (--weights q) on NumPy")
        from .qkernels import with_int8_x

        def switched(w):
            return with_int8_x(w, name == "int8") if kept_in_blocks(w) else w

        self.params = {n: switched(w) for n, w in self.params.items()}
        self.stacked = {n: switched(w) for n, w in self.stacked.items()}
        self.lm_head = switched(self.lm_head)
        self.activations = name

    def num_params(self) -> int:
        return self.config.num_params()

    def forward(self, idx, cache=None):
        """Token ids (B, T) -> logits (B, T, V) float32; with a cache, at positions cache.positions(T)."""
        return self.logits(self.hidden(idx, cache))

    def hidden(self, idx, cache=None, layers=None, taps: dict | None = None):
        """Token ids (B, T) -> the final RMSNorm of the residual stream (B, T, C) after ``layers`` blocks (all);
        ``taps`` as in ``llama_blocks``."""
        idx, pos = token_positions(idx, cache, self.config)
        return self.blocks(self.params["embed_tokens.weight"][idx], pos, cache, layers, taps=taps)

    def hidden_taps(self, idx, cache=None, tap_layers=(), layers=None) -> tuple:
        """``hidden``, and the input of each block in ``tap_layers`` as that block reads it (after its
        input_layernorm): EAGLE-3's lower features -> (h (B, T, C), [(B, T, C) per tap layer])."""
        taps = dict.fromkeys(tap_layers)
        h = self.hidden(idx, cache, layers, taps)
        return h, [taps[layer] for layer in tap_layers]

    def blocks(self, x, pos, cache=None, layers=None, ops=None, taps: dict | None = None):
        """The blocks of table ``ops`` (this model's array code by default) on a residual stream x (B, T, C) at
        positions pos -> its final RMSNorm (B, T, C); the cache advances past the T tokens.

        ``hidden`` starts x from the token embeddings; an EAGLE draft (``minillm.eagle``) starts it
        from its own input projection and runs a one-block Llama through here.
        """
        out = llama_blocks(self.ops if ops is None else ops, x, pos, cache, check_layers(self.config, layers), taps)
        if cache is not None:
            cache.advance(x.shape[1])
        return out

    def logits(self, h):
        """(B, T, C) -> (B, T, V): h @ lm_head^T."""
        return weight_product(h, self.lm_head)

    def numpy_params(self) -> dict:
        """The parameters as float32 NumPy arrays, laid out as ``config.param_shapes()`` says (for saving, a copy):
        a matrix kept in blocks (``weights="q"``) is dequantized to the [out, in] rows the fp32 load holds."""
        return {name: host_float32(a) if kept_in_blocks(a) else to_numpy(a) for name, a in self.params.items()}
