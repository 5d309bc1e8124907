"""Model configs: the numbers that fix a model's shape, one dataclass per architecture.

- ``GPTConfig``: GPT-2 (learned positions, LayerNorm, GELU MLP, one K/V head per query head).
- ``LlamaConfig``: Llama (RoPE, RMSNorm, SwiGLU MLP, grouped-query attention); its defaults are
  SmolLM2-135M's.

Both share ``ModelConfig``: the fields every cache and loop reads (``vocab_size``, ``block_size``,
``n_layer``, ``n_head``, ``n_kv_head``, ``head_size``), checked once, and ``num_params``,
``to_dict``, ``from_dict``.

``is_int`` and ``check_count``: the one test of "a whole number" that every argument check uses (a
count, a length, a token id): an int or a NumPy integer, never a bool or a float.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields


def is_int(value) -> bool:
    """True for an int or a NumPy integer; False for a bool (True is not 1 token), a float (2.0 too), None.

    Example: 3, np.int64(3) -> True; True, 2.5, 2.0, "3" -> False.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_count(name: str, value, low: int) -> int:
    """An int >= low -> that int; anything else is a ValueError naming the argument.

    Example: check_count("max_new_tokens", 3, 1) -> 3; 0, -2, 2.5 or True -> ValueError.
    """
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be >= {low} (an int, not a bool or a float), got {value!r}")
    return int(value)


class ModelConfig:
    """What the two configs share; subclasses are frozen dataclasses that list their own fields."""

    INT_FIELDS: tuple = ()  # fields that must be positive ints

    def __post_init__(self):
        name = type(self).__name__
        for field_name in self.INT_FIELDS:
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}.{field_name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"{name}: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self) -> int:
        """Number of parameters (a tied LM head counted once), from the subclass's ``param_shapes()``."""
        return sum(math.prod(shape) for shape in self.param_shapes().values())

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class GPTConfig(ModelConfig):
    vocab_size: int = 84  # distinct characters in the Shakespeare corpus
    block_size: int = 256  # context length: positions 0..block_size-1 have embeddings
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 256  # model width C; head size hs = n_embd // n_head

    INT_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")

    @property
    def n_kv_head(self) -> int:
        """Key/value heads a cache stores per layer: GPT-2 has one per query head (multi-head)."""
        return self.n_head

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, named like Hugging Face GPT-2 (no ``transformer.`` prefix).

        Linear weights are stored [in, out] (GPT-2's Conv1D layout); the LM head is tied to wte.
        Example: GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
        has 124,439,808 parameters, GPT-2 small's count.
        """
        C, V = self.n_embd, self.vocab_size
        shapes = {"wte.weight": (V, C), "wpe.weight": (self.block_size, C)}
        for i in range(self.n_layer):
            h = f"h.{i}."
            shapes |= {
                h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
                h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
                h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
                h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
                h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
                h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,),
            }
        shapes |= {"ln_f.weight": (C,), "ln_f.bias": (C,)}
        return shapes


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    vocab_size: int = 49152  # byte-level BPE tokens
    block_size: int = 8192  # context length: RoPE has no table, but the model was trained this far
    n_layer: int = 30  # transformer blocks
    n_head: int = 9  # query heads per block
    n_kv_head: int = 3  # key/value heads: each serves n_head // n_kv_head query heads (GQA)
    n_embd: int = 576  # model width C; head size hs = n_embd // n_head
    n_hidden: int = 1536  # SwiGLU hidden width
    rope_theta: float = 100000.0  # RoPE base: pair j turns by position * rope_theta^(-2j/hs)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # the LM head is embed_tokens (else a separate lm_head.weight)

    INT_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "n_hidden")

    def __post_init__(self):
        super().__post_init__()
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig: n_kv_head={self.n_kv_head} does not divide n_head={self.n_head}")
        if self.head_size % 2:
            raise ValueError(f"LlamaConfig: head size {self.head_size} is odd; RoPE rotates pairs of dims")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))  # a Python float: never a NumPy float64 scalar
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, named like Hugging Face's LlamaForCausalLM (no ``model.`` prefix).

        Linear weights are stored [out, in] (torch.nn.Linear's layout), so y = x @ w.T.
        Example: LlamaConfig() (SmolLM2-135M) has 134,515,008 parameters.
        """
        C, V, H = self.n_embd, self.vocab_size, self.n_hidden
        q_dim, kv_dim = self.n_head * self.head_size, self.n_kv_head * self.head_size
        shapes = {"embed_tokens.weight": (V, C)}
        for i in range(self.n_layer):
            h = f"layers.{i}."
            shapes |= {
                h + "input_layernorm.weight": (C,),
                h + "self_attn.q_proj.weight": (q_dim, C), h + "self_attn.k_proj.weight": (kv_dim, C),
                h + "self_attn.v_proj.weight": (kv_dim, C), h + "self_attn.o_proj.weight": (C, q_dim),
                h + "post_attention_layernorm.weight": (C,),
                h + "mlp.gate_proj.weight": (H, C), h + "mlp.up_proj.weight": (H, C),
                h + "mlp.down_proj.weight": (C, H),
            }
        shapes["norm.weight"] = (C,)
        if not self.tie_embeddings:
            shapes["lm_head.weight"] = (V, C)
        return shapes
