"""GPTConfig: the five numbers that fix a GPT-2-style model's shape."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 84  # distinct characters in the Shakespeare corpus
    block_size: int = 256  # context length: positions 0..block_size-1 have embeddings
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 256  # model width C; head size hs = n_embd // n_head

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:
        """Key/value heads a cache stores per layer: GPT-2 has one per query head (multi-head)."""
        return self.n_head

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape, named like Hugging Face GPT-2 (no ``transformer.`` prefix).

        Linear weights are stored [in, out] (GPT-2's Conv1D layout); the LM head is tied to wte.
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
            }  # fmt: skip
        shapes |= {"ln_f.weight": (C,), "ln_f.bias": (C,)}
        return shapes

    def num_params(self) -> int:
        """Number of parameters (the tied LM head counted once).

        Example: GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
        -> 124,439,808, GPT-2 small's count.
        """
        total = 0
        for shape in self.param_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        return cls(**{k: d[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")})
