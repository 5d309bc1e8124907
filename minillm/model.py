"""A GPT-2 forward pass in plain array code (NumPy or CuPy).

    x = wte[idx] + wpe[pos]
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte^T                                   (the LM head is tied to wte)

Parameters are a flat dict named and laid out like Hugging Face GPT-2's state dict without the
``transformer.`` prefix (see ``GPTConfig.param_shapes``), so GPT-2 weights map on without renaming.

Weights (``weights``, chapter 13's kernels for the character models): "fp32" keeps the float32 arrays, the
reference, every product through ``linear``; "q" packs each block's four matrices and the LM head once for
``minillm.qkernels``'s kernels (F32 panels, ``keep_weights``), the same numbers within float32 rounding. A
packed model is for inference; training and saving read float32 arrays (``numpy_params``).

``forward(idx, cache=None)`` is the only entry point. Without a cache it runs the whole sequence
(training, and the naive "recompute everything" generation). With a cache it runs only the new
positions and attends over everything cached: prefill (T tokens), decode (1 token) and speculative
verification (K tokens) are the same call. The cache is anything that keeps the forward-cache
contract (positions, attend, advance), stated once in ``minillm.cache_contract``.
"""

from __future__ import annotations

import math

import numpy as np

from .attention import naive_attention
from .backend import is_gpu, on_device, to_numpy, weight_product, xp
from .config import GPTConfig
from .flash_attention import auto_attention, tiled_attention
from .kernels.launch import kernel_attention, kernel_attention_v2
from .nn import gelu, layer_norm, linear, merge_heads, split_heads
from .quantize import as_blocks, kept_in_blocks

INIT_STD = 0.02  # GPT-2 initialization
WEIGHTS = ("q", "fp32")  # how a model keeps its weight matrices: for the kernels (chapter 13), or float32 arrays
BLOCK_MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # a GPT-2 block's products, [in, out]

# name -> f(q, k, v, causal=True) -> (B, nh, Tq, hs); every choice gives the same logits, paged or not.
# The one list of the choices: docstrings, errors and the command line name them from here.
ATTENTION = {
    "auto": auto_attention,  # chapter 4: naive for small score matrices, flash past NAIVE_MAX_SCORES
    "naive": naive_attention,  # chapter 2: the (Tq, Tk) score matrix, the reference
    "flash": tiled_attention,  # chapter 4: tiles and the online softmax in array code
    "cuda": kernel_attention,  # chapter 4: kernels/flash_attention.cu (on a CPU: the same kernel, emulated)
    "cuda_v2": kernel_attention_v2,  # chapter 4: kernels/flash_attention_v2.cu, the fast one (emulated likewise)
}
DEFAULT_ATTENTION = "auto"  # a long prefill never builds its (T, T) score matrix
CAUSAL_ONLY = ("cuda", "cuda_v2")  # the kernels know the causal rule only: they take no explicit mask


def get_attention(name: str):
    """The attention implementation called ``name`` in ``ATTENTION``; ValueError naming the choices."""
    if name not in ATTENTION:
        raise ValueError(f"unknown attention implementation {name!r}: use one of {', '.join(map(repr, ATTENTION))}")
    return ATTENTION[name]


def gpt_block(ops, layer: int, x, h, cache):
    """One GPT-2 block over the table ``ops``, the previous block's MLP output h added first (none before
    the first block): the add that ends a sublayer and the norm that starts the next are one op.

        x = x + h;   x = x + attn(ln_1(x));   h = mlp(ln_2(x))       -> (x, h), each (B, T, C)
    """
    b = f"h.{layer}."
    x, n = ops.add_norm(x, h, b + "ln_1")  # x = x + h;  n = ln_1(x)
    y = ops.attend(layer, ops.product(n, b + "attn.c_attn"), cache)  # q|k|v (B, T, 3C) -> heads merged (B, T, C)
    x, n = ops.add_norm(x, ops.product(y, b + "attn.c_proj"), b + "ln_2")  # x = x + attn;  n = ln_2(x)
    return x, ops.product(ops.act(ops.product(n, b + "mlp.c_fc")), b + "mlp.c_proj")  # (B, T, 4C) -> (B, T, C)


def gpt_blocks(ops, x, cache, layers: int):
    """``layers`` blocks on the residual stream x (B, T, C), then the last add and ln_f -> (B, T, C)."""
    h = None
    for layer in range(layers):
        x, h = gpt_block(ops, layer, x, h, cache)
    return ops.add_norm(x, h, "ln_f")[1]


class GPTOps:
    """The operations of a GPT-2 block in array code: the default table of ``gpt_block``.

        product(x, name)          x @ W + b of the weight called name ([in, out])     one weight product
        add_norm(x, h, name)      (x + h, layer_norm(x + h)), no add when h is None   the residual add + norm
        act(h)                    gelu(h)
        attend(layer, qkv, cache) split q | k | v into heads, attend (over the cache), merge the heads

    The static decode step swaps in a table of fused kernels (``minillm.fused.FusedOps``) and training
    one that keeps the activations (``minillm.train.Recording``); the block is the same. The ops call their
    building blocks through the table (``self.linear``, ``self.layer_norm``, ``self.gelu``,
    ``self.attention``), so an experiment can swap one on a model instance (chapter 3 times a decode step
    with each part replaced by a stand-in) without touching this module.
    """

    layer_norm = staticmethod(layer_norm)
    gelu = staticmethod(gelu)
    linear = staticmethod(linear)

    def __init__(self, config: GPTConfig, params: dict, attention):
        self.config, self.params, self.attention = config, params, attention

    def weight(self, name: str) -> tuple:
        """The weight called name as (w [in, out], bias): float32 arrays (TypeError for a weight packed for the
        kernels: it has no [in, out] array, only its own product)."""
        w = self.params[name + ".weight"]
        if kept_in_blocks(w):
            raise TypeError(f"{name} is packed for minillm.qkernels (weights='q'): it has no [in, out] array, only "
                            "its own product; load the model with weights='fp32' for its float32 arrays")
        return w, self.params[name + ".bias"]

    def norm_weights(self, name: str) -> tuple:
        """The LayerNorm called name as (w, b)."""
        return self.params[name + ".weight"], self.params[name + ".bias"]

    def product(self, x, name: str):
        """x @ W + b.  (..., in) -> (..., out)

        W [in, out] goes through ``linear``; a weight packed for the kernels (weights="q", [out, in] panels) runs
        its own product, ``weight_product(x, W)``."""
        w, b = self.params[name + ".weight"], self.params[name + ".bias"]
        return weight_product(x, w) + b if kept_in_blocks(w) else self.linear(x, w, b)

    def add_norm(self, x, h, name: str):
        """x + h (the residual stream; x itself when h is None) and its LayerNorm ``name`` -> (x, normed)."""
        x = x if h is None else x + h
        return x, self.layer_norm(x, *self.norm_weights(name))

    def act(self, h):
        return self.gelu(h)

    def attend(self, layer: int, qkv, cache):
        """Causal multi-head self-attention from the q|k|v product.  (B, T, 3C) -> (B, T, C)"""
        C, nh = self.config.n_embd, self.config.n_head
        q, k, v = (split_heads(qkv[..., i * C : (i + 1) * C], nh) for i in range(3))  # (B, nh, T, hs) each
        if cache is None:
            y = self.attention(q, k, v, causal=True)  # (B, nh, T, hs)
        else:
            y = cache.attend(layer, q, k, v, self.attention)  # (B, nh, T, hs)
        return merge_heads(y)


class GPT(GPTOps):
    """GPT-2 with a selectable attention implementation: a name in ``ATTENTION`` (default "auto"), and its
    weight matrices kept as ``weights`` says ("fp32", the float32 arrays; "q", packed for the kernels:
    ``keep_weights``).

    The model is its own table of array-code ops (``GPTOps``): ``forward`` runs ``gpt_blocks(self, ...)``.
    """

    def __init__(self, config: GPTConfig, params: dict, attention: str = DEFAULT_ATTENTION, weights: str = "fp32"):
        params, self.packed_head = keep_weights(config, check_params(config, params, "GPT"), weights)
        super().__init__(config, params, None)
        self.weights = weights
        self.set_attention(attention)

    @classmethod
    def init(cls, config: GPTConfig, seed: int = 0, attention: str = DEFAULT_ATTENTION, weights: str = "fp32") -> GPT:
        """GPT-2 initialization: weights ~ N(0, 0.02), biases 0, LayerNorm gains 1, and the two
        residual projections (attn.c_proj, mlp.c_proj) scaled by 1/sqrt(2 n_layer)."""
        rng = np.random.default_rng(seed)
        residual_std = INIT_STD / math.sqrt(2 * config.n_layer)
        params = {}
        for name, shape in config.param_shapes().items():
            if name.endswith("c_proj.weight"):
                params[name] = rng.normal(0.0, residual_std, shape)
            elif name.endswith(".weight") and len(shape) == 2:
                params[name] = rng.normal(0.0, INIT_STD, shape)
            elif "ln_" in name and name.endswith(".weight"):
                params[name] = np.ones(shape)
            else:
                params[name] = np.zeros(shape)
        return cls(config, {k: v.astype(np.float32) for k, v in params.items()}, attention, weights)

    def set_attention(self, name: str) -> None:
        """Switch the attention implementation; every choice gives the same logits."""
        self.attention_name = name
        self.attention = get_attention(name)

    def with_weights(self, weights: str) -> GPT:
        """A model of the same float32 values, its matrices kept as ``weights`` says: "q" packs them anew, "fp32"
        holds the float32 arrays (this model's own, when it holds arrays)."""
        return GPT(self.config, self.numpy_params(), self.attention_name, weights)

    def num_params(self) -> int:
        return self.config.num_params()

    @property
    def lm_head(self):
        """(V, C): the LM head, tied to the token embedding (with weights "q" on NumPy, the table packed once for
        the kernels; the lookups read the float32 table)."""
        return self.params["wte.weight"] if self.packed_head is None else self.packed_head

    def forward(self, idx, cache=None):
        """Token ids (B, T) -> logits (B, T, V) float32.

        Without a cache the T tokens sit at positions 0..T-1 (T <= block_size). With a cache they
        sit at positions cache.positions(T), usually cache.length + t, and attend over the cache.
        """
        return self.logits(self.hidden(idx, cache))

    def hidden(self, idx, cache=None, layers=None):
        """Token ids (B, T) -> the final LayerNorm of the residual stream (B, T, C) after ``layers`` blocks.

        ``forward`` is ``logits(hidden(idx, cache))``. ``layers`` < n_layer exits early: the first
        blocks only, then ln_f (self-speculation's draft). Medusa heads read this hidden state.
        """
        p = self.params
        idx, pos = token_positions(idx, cache, self.config)  # (B, T), (T,) or (B, T)
        x = p["wte.weight"][idx] + p["wpe.weight"][pos]  # (B, T, C)
        return self.blocks(x, pos, cache, layers)

    def blocks(self, x, pos, cache=None, layers=None, ops=None):
        """The blocks of table ``ops`` (this model's array code by default) on the embedded stream x (B, T, C)
        -> its final LayerNorm (B, T, C); the cache advances past the T tokens. (GPT-2's positions are in x.)"""
        out = gpt_blocks(self if ops is None else ops, x, cache, check_layers(self.config, layers))
        if cache is not None:
            cache.advance(x.shape[1])
        return out

    def logits(self, h):
        """(B, T, C) -> (B, T, V): the LM head, h @ wte^T."""
        return weight_product(h, self.lm_head)

    def numpy_params(self) -> dict:
        """The parameters as NumPy arrays laid out as ``config.param_shapes()`` says (for saving, training, a
        copy of the model): an array as it is, brought to the host; a matrix packed for the kernels read back from
        its panels, [out, in] -> its float32 [in, out] array."""
        return {name: np.ascontiguousarray(host_float32(a).T) if kept_in_blocks(a) else to_numpy(a)  # (in, out)
                for name, a in self.params.items()}


def check_weights(weights: str) -> None:
    """``weights`` is one of ``WEIGHTS``; ValueError naming the choices otherwise."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: choose from {', '.join(WEIGHTS)}")


def keep_weights(config: GPTConfig, params: dict, weights: str) -> tuple[dict, object]:
    """How a GPT keeps its float32 weight matrices -> (params, the packed LM head or None).

    "fp32": the arrays as they are, the reference (``linear``: BLAS, or ``minillm.streaming``'s kernel).
    "q": on NumPy each block's four matrices (``BLOCK_MATRICES``, stored [in, out]) packed once, transposed, as
    F32 panels [out, in] for ``minillm.qkernels`` (``pack``; the product is then ``w.product(x)``, prefill in
    chunks of 16 rows), and the LM head (wte (V, C), already [out, in]) likewise; the embedding tables stay
    arrays for their lookups. On a device (CuPy, the strict stand-in) the arrays stay, as every weight there
    stays in what the device multiplies (``llama.model_weight``): "q" is then "fp32".

    The F32 panels hold the same float32 values, so "q" differs from "fp32" by the rounding of sums taken in
    another order (tests/test_gpt_qkernels.py)."""
    check_weights(weights)
    if weights == "fp32" or is_gpu():
        return params, None
    from .qkernels import pack  # numba, imported when a model first packs

    packed = {f"h.{i}.{m}.weight": pack(to_numpy(params[f"h.{i}.{m}.weight"]).T)  # [in, out] -> [out, in] panels
              for i in range(config.n_layer) for m in BLOCK_MATRICES}
    return params | packed, pack(to_numpy(params["wte.weight"]))


def host_float32(w) -> np.ndarray:
    """A model's weight as a float32 NumPy array of its own (a copy): an array brought to the host as it is laid
    out; a weight kept for the kernels (``weights="q"``) as its [out, in] rows, the very values the float32 load
    (``weights="fp32"``) holds: quantized blocks dequantized by the reference, F32 panels (a GPT's) read back.

    The read-back is ``qkernels.pack``'s F32 line inverted, panels (m/P, k, P) -> rows (m, k) (``Packed.unpack``
    gives back only the block formats)."""
    if kept_in_blocks(w) and getattr(w, "format", None) == "F32":
        (panels,) = w.arrays  # (m/P, k, P), m padded to whole panels
        m, k = w.shape
        return np.ascontiguousarray(panels.transpose(0, 2, 1).reshape(-1, k)[:m])  # (m/P, P, k) -> (m, k)
    return np.array(to_numpy(as_blocks(w).dequantize() if kept_in_blocks(w) else w), dtype=np.float32)


def check_params(config, params: dict, model_name: str) -> dict:
    """Check params against ``config.param_shapes()`` (names and shapes) -> float32 device arrays."""
    expected = config.param_shapes()
    missing = sorted(expected.keys() - params.keys())
    extra = sorted(params.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"{model_name} params do not match the config: missing {missing}, extra {extra}")
    for name, shape in expected.items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{model_name} param {name}: shape {tuple(params[name].shape)} != {shape}")
    return {name: xp.asarray(p, dtype=xp.float32) for name, p in params.items()}


def check_layers(config, layers) -> int:
    """How many blocks a forward runs: all (None) or an int in 1..n_layer."""
    if layers is None:
        return config.n_layer
    if not isinstance(layers, (int, np.integer)) or not 1 <= layers <= config.n_layer:
        raise ValueError(f"layers must be an int in 1..n_layer={config.n_layer}, got {layers!r}")
    return int(layers)


def token_positions(idx, cache, config):
    """Check token ids (B, T) -> (ids, absolute positions): 0..T-1 without a cache, cache.positions(T) with one.

    Positions are (T,), or (B, T) for a ragged batch. Without a cache T may not pass block_size.
    The id range check costs one wait for the device when the ids are already there (one bool of
    the whole check, not a min and a max), none when they come from the host.
    """
    on_host = not on_device(idx)  # a list or a NumPy array: check it before the copy to the device
    idx = np.asarray(idx) if on_host else idx
    if idx.ndim != 2:
        raise ValueError(f"forward expects token ids of shape (B, T), got {idx.shape}")
    T = idx.shape[1]
    if T == 0:
        raise ValueError("forward needs at least one token")
    out_of_range = (idx < 0) | (idx >= config.vocab_size)
    if bool(out_of_range.any()):  # on the device: the one wait
        raise ValueError(f"token ids must lie in 0..{config.vocab_size - 1}")
    return xp.asarray(idx), new_positions(T, cache, config)


def new_positions(T: int, cache, config):
    """Absolute positions of T new tokens: cache.positions(T) with a cache, else 0..T-1 (T <= block_size)."""
    if cache is not None:
        return xp.asarray(cache.positions(T))
    if T > config.block_size:
        raise ValueError(f"{T} tokens exceed the context length block_size={config.block_size}")
    return xp.arange(T)
