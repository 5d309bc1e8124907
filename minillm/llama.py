"""A Llama forward pass in plain array code (NumPy or CuPy): the architecture of today's open models.

    x = embed_tokens[idx]
    for each block:  x = x + attn(rms_norm(x));  x = x + swiglu(rms_norm(x))
    logits = rms_norm(x) @ embed_tokens^T                        (SmolLM2 ties the LM head)

Four changes from GPT-2 (``model.py``), each a function here:

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

import numpy as np

from .backend import to_numpy, weight_product, xp
from .config import LlamaConfig
from .model import (
    DEFAULT_ATTENTION,
    INIT_STD,
    check_layers,
    check_params,
    get_attention,
    merge_heads,
    split_heads,
    token_positions,
)


def rms_norm(x, w, eps: float):
    """x / sqrt(mean(x^2) + eps) * w over the last axis.  [..., C] -> [..., C]"""
    # EXERCISE 8.2 BEGIN: divide x by its root mean square over the last axis (eps inside the root), scale by w
    mean_square = (x * x).sum(axis=-1, keepdims=True) / x.shape[-1]  # (..., 1)
    return x / xp.sqrt(mean_square + eps) * w
    # EXERCISE 8.2 END


def rope_cos_sin(pos, head_size: int, theta: float):
    """cos and sin of each position's angles pos * theta^(-2j/hs), j = 0..hs/2-1, for the rotate-half layout.

    Dimension j and j + hs/2 share angle j, so each table is [angles | angles] along the last axis.
    pos (T,) -> two (T, hs) float32 tables; pos (B, T) (a ragged batch) -> (B, 1, T, hs), one per row.
    Computed in float64: at position 8000 a float32 angle would be off by ~5e-4 rad.
    """
    inv_freq = theta ** (-xp.arange(0, head_size, 2, dtype=xp.float64) / head_size)  # (hs/2,)
    angles = xp.asarray(pos, dtype=xp.float64)[..., None] * inv_freq  # (..., T, hs/2)
    angles = xp.concatenate([angles, angles], axis=-1)  # (..., T, hs)
    if angles.ndim == 3:
        angles = angles[:, None]  # (B, 1, T, hs): broadcast over heads
    return xp.cos(angles).astype(xp.float32), xp.sin(angles).astype(xp.float32)


def apply_rope(x, cos, sin):
    """Rotate each pair (x_j, x_{j+hs/2}) by its angle: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1).

    (B, nh, T, hs) with cos, sin from ``rope_cos_sin`` -> (B, nh, T, hs). Rotating q at position m and
    k at position n leaves their score depending on n - m only: R(m)q . R(n)k = q . R(n - m)k.
    Weights read from a GGUF file are in this layout once ``gguf.unpermute_rope_rows`` has run.
    """
    # EXERCISE 8.1 BEGIN: rotate dims j and j + hs/2 of each head by the angle in cos, sin (rotate half)
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # rotate_half: (x1, x2) -> (-x2, x1)
    return x * cos + rotated * sin
    # EXERCISE 8.1 END


def repeat_kv(x, n_rep: int):
    """Grouped-query attention's head mapping: query head h reads key/value head h // n_rep.

    (B, n_kv_head, T, hs) -> (B, n_kv_head * n_rep, T, hs); KV heads [a, b] with n_rep = 2 -> [a, a, b, b].
    """
    # EXERCISE 8.3 BEGIN: repeat each key/value head n_rep times in a row along the head axis
    if n_rep == 1:
        return x
    B, n_kv, T, hs = x.shape
    x = xp.broadcast_to(x[:, :, None], (B, n_kv, n_rep, T, hs))  # (B, n_kv, n_rep, T, hs), no copy yet
    return x.reshape(B, n_kv * n_rep, T, hs)
    # EXERCISE 8.3 END


def grouped_attention(attention, n_rep: int):
    """attention(q, k, v) with k, v of n_kv_head heads: each group of n_rep query heads shares one.

    Returns f(q, k, v, causal=True, mask=None): (B, nh, Tq, hs), (B, nh / n_rep, Tk, hs) x 2 -> (B, nh, Tq, hs).
    """

    def grouped(q, k, v, causal=True, mask=None):
        return attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), causal=causal, mask=mask)

    return grouped


def silu(x):
    """x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2 (no exp overflow for large |x|)."""
    return x * (0.5 + 0.5 * xp.tanh(0.5 * x))


def swiglu(x, w_gate_up, w_down):
    """down(silu(gate(x)) * up(x)), gate and up in one product: w_gate_up = [w_gate; w_up] (2H, C).

    (B, T, C) -> (B, T, 2H) -> (B, T, H) -> (B, T, C)"""
    gate, up = xp.split(weight_product(x, w_gate_up), 2, axis=-1)  # (B, T, H) each
    return weight_product(silu(gate) * up, w_down)


def stack_rows(params: dict, names: list[str]):
    """Stack weights [out_i, in] into one (sum out_i, in) matrix and make each params[name] a view of
    its rows: one product then streams them all (a read of q, k and v is one pass, not three), and
    the parameters keep their names, shapes and values (an in-place change reaches the stack)."""
    stacked = xp.concatenate([params[name] for name in names], axis=0)  # (sum out_i, in)
    start = 0
    for name in names:
        rows = params[name].shape[0]
        params[name] = stacked[start : start + rows]  # (out_i, in), a view
        start += rows
    return stacked


class Llama:
    """Llama with grouped-query attention and a selectable attention implementation (``model.ATTENTION``)."""

    def __init__(self, config: LlamaConfig, params: dict, attention: str = DEFAULT_ATTENTION):
        self.config = config
        self.params = check_params(config, params, "Llama")
        self.stacked = {}  # "layers.{i}.qkv" (q_dim + 2 kv_dim, C), "layers.{i}.gate_up" (2H, C): one read each
        for layer in range(config.n_layer):
            h = f"layers.{layer}."
            self.stacked[h + "qkv"] = stack_rows(self.params, [h + f"self_attn.{p}_proj.weight" for p in "qkv"])
            self.stacked[h + "gate_up"] = stack_rows(self.params, [h + f"mlp.{p}_proj.weight" for p in ("gate", "up")])
        self.lm_head = self.params["embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"]  # (V, C)
        self.set_attention(attention)

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
        self.attention = grouped_attention(get_attention(name), self.config.n_head // self.config.n_kv_head)

    def num_params(self) -> int:
        return self.config.num_params()

    def forward(self, idx, cache=None):
        """Token ids (B, T) -> logits (B, T, V) float32; with a cache, at positions cache.positions(T)."""
        return self.logits(self.hidden(idx, cache))

    def hidden(self, idx, cache=None, layers=None):
        """Token ids (B, T) -> the final RMSNorm of the residual stream (B, T, C) after ``layers`` blocks (all)."""
        idx, pos = token_positions(idx, cache, self.config)
        return self.blocks(self.params["embed_tokens.weight"][idx], pos, cache, layers)

    def blocks(self, x, pos, cache=None, layers=None):
        """The blocks on a residual stream x (B, T, C) at positions pos -> its final RMSNorm (B, T, C).

        ``hidden`` starts x from the token embeddings; an EAGLE draft (``minillm.eagle``) starts it
        from its own input projection and runs a one-block Llama through here.
        """
        cfg, p = self.config, self.params
        layers = check_layers(cfg, layers)
        T = x.shape[1]
        cos, sin = rope_cos_sin(pos, cfg.head_size, cfg.rope_theta)  # (T, hs) or (B, 1, T, hs)
        for layer in range(layers):
            h = f"layers.{layer}."
            normed = rms_norm(x, p[h + "input_layernorm.weight"], cfg.norm_eps)
            x = x + self._attention_block(layer, normed, cos, sin, cache)  # (B, T, C)
            normed = rms_norm(x, p[h + "post_attention_layernorm.weight"], cfg.norm_eps)
            x = x + swiglu(normed, self.stacked[h + "gate_up"], p[h + "mlp.down_proj.weight"])
        if cache is not None:
            cache.advance(T)
        return rms_norm(x, p["norm.weight"], cfg.norm_eps)

    def logits(self, h):
        """(B, T, C) -> (B, T, V): h @ lm_head^T."""
        return weight_product(h, self.lm_head)

    def _attention_block(self, layer, x, cos, sin, cache):
        """Causal grouped-query self-attention with RoPE on q and k.  (B, T, C) -> (B, T, C)"""
        cfg, p, h = self.config, self.params, f"layers.{layer}.self_attn."
        q_dim, kv_dim = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size
        qkv = weight_product(x, self.stacked[f"layers.{layer}.qkv"])  # (B, T, q_dim + 2 kv_dim): q, k, v in one read
        q = split_heads(qkv[..., :q_dim], cfg.n_head)  # (B, nh, T, hs)
        k = split_heads(qkv[..., q_dim : q_dim + kv_dim], cfg.n_kv_head)  # (B, n_kv_head, T, hs)
        v = split_heads(qkv[..., q_dim + kv_dim :], cfg.n_kv_head)  # (B, n_kv_head, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            y = self.attention(q, k, v, causal=True)  # (B, nh, T, hs)
        else:
            y = cache.attend(layer, q, k, v, self.attention)  # stores n_kv_head heads -> (B, nh, T, hs)
        return weight_product(merge_heads(y), p[h + "o_proj.weight"])  # (B, T, C)

    def numpy_params(self) -> dict:
        """The parameters as NumPy arrays (for saving)."""
        return {name: to_numpy(a) for name, a in self.params.items()}
