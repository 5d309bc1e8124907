"""Quantized weight formats: each one a data type with ONE NumPy reference quantizer and dequantizer.

A weight W is (m, k) = (out, in), used as y = x @ W.T. A format stores W in fewer bits and says how to
get it back; the reference pair below is the specification that every fast kernel (``minillm.qkernels``)
and the GGUF reader are checked against. Bits per weight count everything stored (scales included):

    format          block / group            stored per block                        w =              bits/w
    F32             -                        float32                                 w                32
    BF16            -                        the top 16 bits of the float32          bits << 16       16
    Q8_0 (GGUF)     32 weights               fp16 d, 32 int8 q          (34 bytes)   d * q            8.5
    Q4_1 (GGUF)     32 weights               fp16 d, fp16 m, 16 bytes of nibbles     d * q + m        5
    Int8PerChannel  one output row (k)       float32 s per row, int8 q               s * q            8 + 32/k
    Int4PerGroup    g weights of a row       float32 s (and float32 m), nibbles      s * (q - 8) or   4 + 32/g
                                                                                     s * q + m        (4 + 64/g)

The two GGUF formats are llama.cpp's ``block_q8_0`` and ``block_q4_1`` (``ggml-common.h``), held as the
file's raw bytes, one row of blocks per output channel, exactly as they lie in the file:

    block_q8_0 { half d; int8_t qs[32]; }               byte 0-1: d, byte 2 + j: q[j]
    block_q4_1 { half d; half m; uint8_t qs[16]; }       byte 0-1: d, 2-3: m, byte 4 + j: q[j] | q[j + 16] << 4

(low nibbles are weights 0..15 of the block, high nibbles 16..31). The quantizers follow llama.cpp's
``quantize_row_q8_0_ref`` and ``quantize_row_q4_1_ref`` step for step, so they write the same bytes as
llama.cpp's converter (``gguf.quants.quantize`` is the oracle in the tests).

Every constructor checks before it allocates: a 2-D float matrix, finite, sizes that the format can
split into blocks, values whose scales fit the fp16 of a GGUF block; anything else is a ``QuantError``
naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backend import on_device, xp

QK = 32  # weights per GGUF Q8_0 / Q4_1 block
Q8_0_BYTES = 2 + QK  # fp16 d, 32 int8
Q4_1_BYTES = 2 + 2 + QK // 2  # fp16 d, fp16 m, 32 nibbles
FP16_MAX = 65504.0  # the largest finite half: a block scale past it would be stored as inf
INT8_MAX = 127  # int8 levels used: -127..127 (symmetric, so -w quantizes to -q)
NIBBLE_MAX = 15  # 4-bit levels 0..15 (with a minimum)


class QuantError(ValueError):
    """A weight cannot be stored in a format (shape, non-finite value, range), or stored bytes are corrupt."""


# ---- checks shared by every format -------------------------------------------------------------


def check_matrix(w, multiple: int = 1, what: str = "weight") -> np.ndarray:
    """w as a float32 (m, k) array, checked: 2-D, non-empty, k % multiple == 0, every value finite.

    The finiteness check is one float64 sum over w (a NaN or an inf anywhere makes the sum non-finite,
    and float32 values cannot overflow a float64 sum), so it allocates nothing the size of w."""
    if not isinstance(w, np.ndarray) or w.dtype.kind != "f":
        raise QuantError(f"{what} must be a float NumPy array, got {type(w).__name__} {getattr(w, 'dtype', '')}")
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise QuantError(f"{what} must be a non-empty (out, in) matrix, got shape {w.shape}")
    if w.shape[1] % multiple:
        raise QuantError(f"{what} has {w.shape[1]} inputs per row, not a multiple of the format's block of {multiple}")
    if not np.isfinite(np.sum(w, dtype=np.float64)):
        raise QuantError(f"{what} holds NaN or inf values: only finite weights can be quantized")
    if w.dtype != np.float32 and np.max(np.abs(w)) > np.finfo(np.float32).max:
        raise QuantError(f"{what} holds values outside float32's range")
    return np.asarray(w, dtype=np.float32)


def check_fp16_range(w, limit: float, what: str) -> None:
    """Refuse a weight whose block scale would overflow fp16 (|w| past limit)."""
    peak = float(np.max(np.abs(w)))
    if peak > limit:
        raise QuantError(f"{what}: |w| up to {peak:.4g} needs a block scale past fp16's {FP16_MAX:g} "
                         f"(limit {limit:.4g})")


def check_raw(raw, shape, block_bytes: int, what: str) -> np.ndarray:
    """Stored blocks as a uint8 (m, k/32 * block_bytes) array for a weight of ``shape`` (m, k)."""
    m, k = (int(s) for s in shape)
    if m <= 0 or k <= 0 or k % QK:
        raise QuantError(f"{what}: shape {shape} is not (out, in) with in a positive multiple of {QK}")
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.shape != (m, k // QK * block_bytes):
        raise QuantError(f"{what}: a {shape} weight is stored as uint8 {(m, k // QK * block_bytes)}, "
                         f"got {raw.dtype} {raw.shape}")
    return raw


def array_module(a):
    """The array module of a: ``backend.xp`` for a device array (blocks kept on a GPU), else NumPy."""
    return xp if on_device(a) else np


def fp16_bits_to_f32(raw, offset: int, block_bytes: int) -> np.ndarray:
    """The fp16 field at byte ``offset`` of every block -> float32 (m, k/32).  raw (m, nb * block_bytes)"""
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)  # (m, nb, block_bytes)
    field = array_module(raw).ascontiguousarray(blocks[:, :, offset:offset + 2])  # (m, nb, 2) bytes
    return field.view(np.float16)[..., 0].astype(np.float32)


def check_scales(scales, what: str) -> None:
    if not np.isfinite(scales).all():
        raise QuantError(f"{what}: a block scale is NaN or inf (corrupt data)")


def symmetric_top(bits: int) -> int:
    """The highest symmetric level of a b-bit format: levels -top..top (so -w quantizes to -q), stored as
    q + top + 1. 4 bits: -7..7 stored as 1..15."""
    return 2 ** (bits - 1) - 1


def reciprocal_or_zero(s):
    """1 / s, and 0 where s == 0: an all-zero or constant block (or group, or row) stores level 0 (or its
    offset), never NaN."""
    return np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)


def round_half_away(v):
    """C's roundf: halves round away from zero (np.round rounds them to even).  2.5 -> 3, -2.5 -> -3."""
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


# ---- the formats -------------------------------------------------------------------------------


@dataclass(frozen=True)
class F32:
    """float32, the reference every other format approximates.  data (m, k) float32."""

    data: np.ndarray
    bits_per_weight = 32.0

    @classmethod
    def quantize(cls, w) -> F32:
        return cls(check_matrix(w).copy())

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape

    def dequantize(self) -> np.ndarray:
        return self.data.copy()


@dataclass(frozen=True)
class BF16:
    """bfloat16: the float32's sign, 8-bit exponent and top 7 mantissa bits.  bits (m, k) uint16.

    Same range as float32, relative error up to 2**-8 (half of 7 mantissa bits) (rounded to nearest, ties to even).
    Example: 1.0 = 0x3F800000 -> 0x3F80; 1 + 2**-8 lies halfway between 0x3F80 and 0x3F81 -> 0x3F80 (even).
    """

    bits: np.ndarray
    bits_per_weight = 16.0

    @classmethod
    def quantize(cls, w) -> BF16:
        u = check_matrix(w).view(np.uint32)
        rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # round to nearest even
        return cls((rounded >> np.uint32(16)).astype(np.uint16))

    @property
    def shape(self) -> tuple[int, int]:
        return self.bits.shape

    def dequantize(self) -> np.ndarray:
        return (self.bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


class Blocks:
    """What a GGUF block weight (Q8_0, Q4_1) does as a model's weight, without a float32 copy of itself.

    ``raw`` (m, k/32 * block bytes) may live on the host or on a device (``backend.xp``); rows of blocks
    are whole output channels, so stacking weights or picking rows never touches a block's bytes."""

    def rows(self, ids):
        """Dequantize only the rows ``ids`` (an embedding lookup).  ids (...) ints -> (..., k) float32

        Example: a Q8_0 (49152, 576) token table and ids (1, 3) -> (1, 3, 576), three rows read."""
        return self.unpack(ids).dequantize().reshape(*np.shape(ids), self.k)

    def unpack(self, ids):
        """The rows ``ids`` as blocks of this format (their bytes copied, nothing dequantized), as
        ``qkernels.Packed.unpack`` gives them.  ids (...) ints -> (n, k) in this format"""
        flat = ids.reshape(-1) if hasattr(ids, "reshape") else np.asarray(ids).reshape(-1)
        return type(self)(self.raw[flat], self.k)

    def __getitem__(self, ids):
        """``table[ids]`` as for a float32 table: ``rows(ids)``."""
        return self.rows(ids)

    def row_slice(self, start: int, stop: int):
        """Rows start..stop-1, a view of the same blocks."""
        return type(self)(self.raw[start:stop], self.k)

    def product(self, x):
        """x @ W.T by the reference: W dequantized, then one matmul.  (..., k) -> (..., m) float32"""
        return x @ self.dequantize().T


def concat_rows(weights: list):
    """Weights of one block format and one input size -> one weight of all their rows, in order (the raw
    block rows concatenated; nothing is dequantized).  Q4_1 (576, 576), (192, 576) -> Q4_1 (768, 576)"""
    kind, k = type(weights[0]), weights[0].k
    if any(type(w) is not kind or w.k != k for w in weights):
        raise QuantError(f"concat_rows: the weights must share one format and input size, got "
                         f"{[(type(w).__name__, w.shape) for w in weights]}")
    return kind(array_module(weights[0].raw).concatenate([w.raw for w in weights]), k)


def kept_in_blocks(w) -> bool:
    """True for a weight kept in quantized blocks (a ``Blocks``, or ``qkernels.Packed``): not an array, a
    weight that knows its own product (``w.product(x)``, which ``backend.weight_product`` calls)."""
    return hasattr(w, "product")


def block_format(w) -> type:
    """The format class (``Q8_0``, ``Q4_1``) of a weight kept in blocks, read from one row."""
    return type(w.unpack(np.arange(1)))


def as_blocks(w) -> Blocks:
    """A weight kept in blocks as the file's blocks: a ``Blocks`` as it is, a packed one unpacked (a copy)."""
    return w if isinstance(w, Blocks) else w.unpack(np.arange(w.shape[0]))


@dataclass(frozen=True)
class Q8_0(Blocks):
    """GGUF Q8_0: blocks of 32 weights, w = d * q.  raw (m, k/32 * 34) uint8, the file's bytes.

    Per block: amax = max |w|, d = amax / 127, q = roundf(w / d) in -127..127, d stored as fp16.
    Example: a block whose largest |w| is 2.54 -> d = 0.02, w = 1.0 -> q = 50."""

    raw: np.ndarray
    k: int
    bits_per_weight = 8.0 * Q8_0_BYTES / QK

    @classmethod
    def from_raw(cls, raw, shape) -> Q8_0:
        raw = check_raw(raw, shape, Q8_0_BYTES, "Q8_0")
        check_scales(fp16_bits_to_f32(raw, 0, Q8_0_BYTES), "Q8_0")
        return cls(raw, int(shape[1]))

    @classmethod
    def quantize(cls, w) -> Q8_0:
        w = check_matrix(w, QK, "Q8_0 weight")
        check_fp16_range(w, FP16_MAX * INT8_MAX, "Q8_0 weight")
        m, k = w.shape
        blocks = w.reshape(m, k // QK, QK)  # (m, nb, 32)
        d = np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(INT8_MAX)  # (m, nb, 1)
        q = round_half_away(blocks * reciprocal_or_zero(d)).astype(np.int8)  # an all-zero block: q = 0  # (m, nb, 32)
        raw = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=-1)  # (m, nb, 34)
        return cls(raw.reshape(m, -1), k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.k

    def scales(self) -> np.ndarray:
        """d per block, float32 (m, k/32)."""
        return fp16_bits_to_f32(self.raw, 0, Q8_0_BYTES)

    def quants(self) -> np.ndarray:
        """q per weight, int8 (m, k/32, 32)."""
        return self.raw.reshape(self.raw.shape[0], -1, Q8_0_BYTES)[:, :, 2:].view(np.int8)

    def dequantize(self) -> np.ndarray:
        """w = d * q.  -> float32 (m, k)"""
        w = self.scales()[:, :, None] * self.quants().astype(np.float32)  # (m, nb, 1) * (m, nb, 32)
        return w.reshape(self.shape)


@dataclass(frozen=True)
class Q4_1(Blocks):
    """GGUF Q4_1: blocks of 32 weights, w = d * q + m, q in 0..15.  raw (m, k/32 * 20) uint8, the file's bytes.

    Per block: m = min w, d = (max w - min w) / 15, q = min(15, trunc((w - m) / d + 0.5)); d, m stored
    as fp16; byte 4 + j holds q[j] in its low nibble and q[j + 16] in its high nibble.
    Example: d = 0.25, m = -1, byte 4 = 0x3A -> weight 0 = 0.25 * 0xA - 1 = 1.5, weight 16 = 0.25 * 3 - 1 = -0.25."""

    raw: np.ndarray
    k: int
    bits_per_weight = 8.0 * Q4_1_BYTES / QK

    @classmethod
    def from_raw(cls, raw, shape) -> Q4_1:
        raw = check_raw(raw, shape, Q4_1_BYTES, "Q4_1")
        check_scales(fp16_bits_to_f32(raw, 0, Q4_1_BYTES), "Q4_1")
        check_scales(fp16_bits_to_f32(raw, 2, Q4_1_BYTES), "Q4_1")
        return cls(raw, int(shape[1]))

    @classmethod
    def quantize(cls, w) -> Q4_1:
        w = check_matrix(w, QK, "Q4_1 weight")
        check_fp16_range(w, FP16_MAX, "Q4_1 weight")  # m = min w is stored as fp16; then d = range/15 fits too
        m, k = w.shape
        blocks = w.reshape(m, k // QK, QK)  # (m, nb, 32)
        # EXERCISE 13.1 BEGIN: per block lo, d, q = trunc((w - lo) / d + 0.5) <= 15; nibbles = q[j] | q[j + 16] << 4
        lo, hi = blocks.min(axis=-1, keepdims=True), blocks.max(axis=-1, keepdims=True)  # (m, nb, 1)
        d = (hi - lo) / np.float32(NIBBLE_MAX)
        inv = reciprocal_or_zero(d)  # a constant block: q = 0
        q = np.minimum(np.trunc((blocks - lo) * inv + np.float32(0.5)), NIBBLE_MAX).astype(np.uint8)  # (m, nb, 32)
        nibbles = q[:, :, :QK // 2] | (q[:, :, QK // 2:] << np.uint8(4))  # (m, nb, 16): weights j and j + 16
        # EXERCISE 13.1 END
        head = np.concatenate([d.astype(np.float16), lo.astype(np.float16)], axis=-1).view(np.uint8)  # (m, nb, 4)
        return cls(np.concatenate([head, nibbles], axis=-1).reshape(m, -1), k)

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.k

    def scales(self) -> tuple[np.ndarray, np.ndarray]:
        """(d, m) per block, float32 (m, k/32) each."""
        return fp16_bits_to_f32(self.raw, 0, Q4_1_BYTES), fp16_bits_to_f32(self.raw, 2, Q4_1_BYTES)

    def quants(self) -> np.ndarray:
        """q per weight, uint8 0..15 (m, k/32, 32)."""
        nibbles = self.raw.reshape(self.raw.shape[0], -1, Q4_1_BYTES)[:, :, 4:]  # (m, nb, 16)
        return array_module(self.raw).concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=-1)

    def dequantize(self) -> np.ndarray:
        """w = d * q + m.  -> float32 (m, k)"""
        d, lo = self.scales()
        w = d[:, :, None] * self.quants().astype(np.float32) + lo[:, :, None]  # (m, nb, 32)
        return w.reshape(self.shape)


@dataclass(frozen=True)
class Int8PerChannel:
    """int8 with one float32 scale per output channel: w = s[j] * q[j, t], q in -127..127.

    q (m, k) int8, scale (m,) float32; s = max_t |w[j, t]| / 127. One outlier in a row coarsens the
    whole row, which is why the block formats keep a scale per 32 weights."""

    q: np.ndarray
    scale: np.ndarray

    @classmethod
    def quantize(cls, w) -> Int8PerChannel:
        w = check_matrix(w)
        s = np.max(np.abs(w), axis=1) / np.float32(INT8_MAX)  # (m,)
        return cls(np.clip(np.rint(w * reciprocal_or_zero(s)[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8), s)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def bits_per_weight(self) -> float:
        return 8.0 + 32.0 / self.q.shape[1]

    def dequantize(self) -> np.ndarray:
        return self.scale[:, None] * self.q.astype(np.float32)  # (m, 1) * (m, k)


@dataclass(frozen=True)
class Int4PerGroup:
    """int4 (or 3-bit) with a float32 scale per group of g weights of a row, symmetric or with a minimum.

    With b bits (4, or 3) and top = 2^b - 1 with a minimum, 2^(b-1) - 1 symmetric (15 and 7 for 4 bits):
    symmetric (minimum is None):  s = max |w| / top,          q = rint(w / s) in -top..top,  n = q + top + 1
    with a minimum:                s = (max w - min w) / top,  n = rint((w - min) / s) in 0..top
    dequantized as w = s * (n - top - 1) or w = s * n + min (rint: NumPy's round half to even; a group of
    zeros, or a constant group, has s = 0 and stores n = top + 1, or n = 0, not NaN). 3-bit levels are
    kept in nibbles here (what they cost in quality is the point); ``bits_per_weight`` counts b bits.
    Example, symmetric, g = 4: w = [-7, 0, 3.5, 7] -> s = 1, n = [1, 8, 12, 15] -> packed [0xC1, 0xF8].
    packed (m, k/2) uint8: within each group, byte j holds weight j (low nibble) and weight j + g/2
    (high nibble), the order of a Q4_1 block; scale and minimum (m, k/g) float32. With g = 32 and a
    minimum this is Q4_1 with float32 instead of fp16 scales."""

    packed: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    group: int
    bits: int = 4

    @classmethod
    def quantize(cls, w, group: int = QK, minimum: bool = True, bits: int = 4) -> Int4PerGroup:
        if not isinstance(group, int) or group < 2 or group % 2:
            raise QuantError(f"Int4PerGroup: the group size must be an even integer >= 2, got {group!r}")
        if bits not in (3, 4):
            raise QuantError(f"Int4PerGroup: bits must be 3 or 4, got {bits!r}")
        top = symmetric_top(bits) if not minimum else 2**bits - 1  # the highest level: 7 or 15 for 4 bits
        w = check_matrix(w, group, f"Int4PerGroup(group={group}) weight")
        m, k = w.shape
        groups = w.reshape(m, k // group, group)  # (m, ng, g)
        # EXERCISE 13.2 BEGIN: per group: scale s, minimum lo (None if symmetric), levels n: 0..top, or q + top + 1
        if minimum:
            lo = groups.min(axis=-1, keepdims=True)  # (m, ng, 1)
            s = (groups.max(axis=-1, keepdims=True) - lo) / np.float32(top)
            inv = reciprocal_or_zero(s)
            n = np.clip(np.rint((groups - lo) * inv), 0, top)
        else:
            lo = None
            s = np.max(np.abs(groups), axis=-1, keepdims=True) / np.float32(top)
            inv = reciprocal_or_zero(s)
            n = np.clip(np.rint(groups * inv), -top, top) + (top + 1)
        # EXERCISE 13.2 END
        n = n.astype(np.uint8)  # (m, ng, g)
        packed = n[:, :, :group // 2] | (n[:, :, group // 2:] << np.uint8(4))  # (m, ng, g/2)
        return cls(packed.reshape(m, k // 2), s[:, :, 0], None if lo is None else lo[:, :, 0], group, bits)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def bits_per_weight(self) -> float:
        return self.bits + 32.0 * (1 if self.minimum is None else 2) / self.group

    def dequantize(self) -> np.ndarray:
        m, k = self.shape
        packed = self.packed.reshape(m, k // self.group, self.group // 2)  # (m, ng, g/2)
        n = np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=-1).astype(np.float32)
        if self.minimum is None:
            w = self.scale[:, :, None] * (n - np.float32(symmetric_top(self.bits) + 1))
        else:
            w = self.scale[:, :, None] * n + self.minimum[:, :, None]
        return w.reshape(m, k)


FORMATS = {cls.__name__: cls for cls in (F32, BF16, Q8_0, Q4_1, Int8PerChannel, Int4PerGroup)}
