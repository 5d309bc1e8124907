"""A GPT-2 forward pass in plain array code (NumPy or CuPy).

    x = wte[idx] + wpe[pos]
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte^T                                   (the LM head is tied to wte)

Parameters are a flat dict named and laid out like Hugging Face GPT-2's state dict without the
``transformer.`` prefix (see ``GPTConfig.param_shapes``), so GPT-2 weights map on without renaming.

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
from .backend import on_device, to_numpy, weight_product, xp
from .config import GPTConfig
from .flash_attention import auto_attention, tiled_attention
from .kernels.launch import kernel_attention, kernel_attention_v2

LN_EPS = 1e-5  # GPT-2's LayerNorm epsilon
GELU_C = math.sqrt(2.0 / math.pi)  # a Python float: a NumPy float64 scalar would upcast float32
GELU_A = 0.044715  # the cubic coefficient of the tanh approximation
INIT_STD = 0.02  # GPT-2 initialization

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


def get_attention(name: str):
    """The attention implementation called ``name`` in ``ATTENTION``; ValueError naming the choices."""
    if name not in ATTENTION:
        raise ValueError(f"unknown attention implementation {name!r}: use one of {', '.join(map(repr, ATTENTION))}")
    return ATTENTION[name]


def layer_norm(x, w, b):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis.  [..., C] -> [..., C]"""
    n = x.shape[-1]  # sum / n, not .mean(): NumPy's mean wrapper costs more than a decode step's math
    xc = x - x.sum(axis=-1, keepdims=True) / n
    var = (xc * xc).sum(axis=-1, keepdims=True) / n  # what x.var computes, without centering x twice
    return xc / xp.sqrt(var + LN_EPS) * w + b


def gelu(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's tanh approximation."""
    return 0.5 * x * (1.0 + xp.tanh(GELU_C * (x + GELU_A * x * x * x)))  # x*x*x: pow is slow


def linear(x, w, b):
    """x @ w + b with w stored [in, out].  [..., in] -> [..., out]

    ``weight_product(x, w.T)`` is x @ w through BLAS or, for a few token rows on a CPU, a kernel that
    streams w once (``minillm.backend``): the same numbers up to float32 rounding."""
    return weight_product(x, w.T) + b


def split_heads(x, n_head):
    """(B, T, C) -> (B, nh, T, hs)"""
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


def merge_heads(y):
    """(B, nh, T, hs) -> (B, T, C)"""
    B, nh, T, hs = y.shape
    return y.transpose(0, 2, 1, 3).reshape(B, T, nh * hs)


class GPT:
    """GPT-2 with a selectable attention implementation: a name in ``ATTENTION`` (default "auto").

    The forward pass calls its three elementwise building blocks through the model (``self.linear``,
    ``self.layer_norm``, ``self.gelu``), so an experiment can swap one on an instance (chapter 3
    times a decode step with each part replaced by a stand-in) without touching this module.
    """

    layer_norm = staticmethod(layer_norm)
    gelu = staticmethod(gelu)
    linear = staticmethod(linear)

    def __init__(self, config: GPTConfig, params: dict, attention: str = DEFAULT_ATTENTION):
        self.config = config
        self.params = check_params(config, params, "GPT")
        self.set_attention(attention)

    @classmethod
    def init(cls, config: GPTConfig, seed: int = 0, attention: str = DEFAULT_ATTENTION) -> GPT:
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
        return cls(config, {k: v.astype(np.float32) for k, v in params.items()}, attention)

    def set_attention(self, name: str) -> None:
        """Switch the attention implementation; every choice gives the same logits."""
        self.attention_name = name
        self.attention = get_attention(name)

    def num_params(self) -> int:
        return self.config.num_params()

    @property
    def lm_head(self):
        """(V, C): the LM head, tied to the token embedding."""
        return self.params["wte.weight"]

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
        cfg, p = self.config, self.params
        layers = check_layers(cfg, layers)
        idx, pos = token_positions(idx, cache, cfg)  # (B, T), (T,) or (B, T)
        T = idx.shape[1]
        x = p["wte.weight"][idx] + p["wpe.weight"][pos]  # (B, T, C)
        for layer in range(layers):
            h = f"h.{layer}."
            ln_1 = self.layer_norm(x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
            x = x + self._attention_block(layer, ln_1, cache)  # (B, T, C)
            ln_2 = self.layer_norm(x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
            x = x + self._mlp_block(layer, ln_2)  # (B, T, C)
        if cache is not None:
            cache.advance(T)
        return self.layer_norm(x, p["ln_f.weight"], p["ln_f.bias"])

    def logits(self, h):
        """(B, T, C) -> (B, T, V): the LM head, h @ wte^T."""
        return weight_product(h, self.lm_head)

    def _attention_block(self, layer, x, cache):
        """Causal multi-head self-attention.  (B, T, C) -> (B, T, C)"""
        p, h = self.params, f"h.{layer}.attn."
        qkv = self.linear(x, p[h + "c_attn.weight"], p[h + "c_attn.bias"])  # (B, T, 3C)
        C = self.config.n_embd
        q, k, v = (split_heads(qkv[..., i * C : (i + 1) * C], self.config.n_head) for i in range(3))
        if cache is None:
            y = self.attention(q, k, v, causal=True)  # (B, nh, T, hs)
        else:
            y = cache.attend(layer, q, k, v, self.attention)  # (B, nh, T, hs)
        return self.linear(merge_heads(y), p[h + "c_proj.weight"], p[h + "c_proj.bias"])

    def _mlp_block(self, layer, x):
        """Position-wise MLP with a 4x hidden layer.  (B, T, C) -> (B, T, 4C) -> (B, T, C)"""
        p, h = self.params, f"h.{layer}.mlp."
        x = self.gelu(self.linear(x, p[h + "c_fc.weight"], p[h + "c_fc.bias"]))
        return self.linear(x, p[h + "c_proj.weight"], p[h + "c_proj.bias"])

    def numpy_params(self) -> dict:
        """The parameters as NumPy arrays (for saving)."""
        return {name: to_numpy(a) for name, a in self.params.items()}


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
