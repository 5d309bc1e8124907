"""Quantized weight formats (chapter 13): each format's NumPy reference against its error bound and
against llama.cpp's own bytes.

The oracle for the GGUF formats is the ``gguf`` package's ``gguf.quants`` (a port of llama.cpp's
``ggml-quants.c``): our quantizers must write the same bytes, our dequantizers read any bytes the same
way, on random blocks and on every block of SmolLM2's file. Bad input (odd shapes, NaN, inf, scales past
fp16, corrupt bytes) must be refused with a QuantError that names it.

Exercise 13.1 (``Q4_1.quantize``) is graded by the tests marked ``exercise("13.1")``: llama.cpp's bytes,
its rounding of halves and the error bound; exercise 13.2 (``Int4PerGroup.quantize``) by its error bound
and its worked example's bytes.
"""

import numpy as np
import pytest

from minillm import quantize
from minillm.quantize import BF16, F32, FORMATS, Q4_1, Q8_0, QK, Int4PerGroup, Int8PerChannel, QuantError

gq = pytest.importorskip("gguf.quants")
GGML = gq.GGMLQuantizationType

pytestmark = pytest.mark.host_only  # NumPy on the host only


def random_weight(rng, shape=(6, 4 * QK), outliers=True):
    """Normal weights with a few large ones (the block scales must follow them) and an all-zero row."""
    w = rng.standard_normal(shape).astype(np.float32)
    if outliers:
        w[0, 3] = 40.0
        w[1, -1] = -25.0
        w[2] = 0.0
    return w


def block_error_bound(w, fmt):
    """The largest |w - dequantize(quantize(w))| a format allows, per weight (broadcast to w's shape).

    Rounding to the nearest of levels d apart errs by d / 2; the GGUF formats store d (and m) in fp16,
    relative error 2**-11, which moves a level q * d by up to q * d * 2**-11 (Q8_0: |q| <= 127, Q4_1:
    q <= 15, plus m * 2**-11 for Q4_1's minimum)."""
    m, k = w.shape
    blocks = w.reshape(m, k // QK, QK).astype(np.float64)
    fp16 = 2.0 ** -11
    if fmt == "Q8_0":
        d = np.abs(blocks).max(-1, keepdims=True) / 127
        bound = d / 2 + 127 * d * fp16
    else:
        lo, hi = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
        d = (hi - lo) / 15
        bound = d / 2 + 15 * d * fp16 + np.abs(lo) * fp16
    return np.broadcast_to(bound, blocks.shape).reshape(m, k) * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("fmt", ["Q8_0", pytest.param("Q4_1", marks=pytest.mark.exercise("13.1"))])
def test_block_round_trip_within_half_a_level(fmt):
    """Every weight comes back within half a quantization level (plus the fp16 scale's rounding)."""
    w = random_weight(np.random.default_rng(0))
    back = FORMATS[fmt].quantize(w).dequantize()
    assert back.dtype == np.float32 and back.shape == w.shape
    assert np.all(np.abs(back - w) <= block_error_bound(w, fmt))
    assert np.all(back[2] == 0.0)  # an all-zero row stays zero (d = 0, not NaN)


def test_other_round_trips_within_their_bounds():
    """F32: exact; BF16: relative 2**-8; int8 per channel: s / 2 per row."""
    w = random_weight(np.random.default_rng(1), (5, 96))
    assert np.array_equal(F32.quantize(w).dequantize(), w)
    bf = BF16.quantize(w).dequantize()
    assert np.all(np.abs(bf - w) <= np.abs(w) * 2.0 ** -8)
    i8 = Int8PerChannel.quantize(w)
    s = np.abs(w).max(1, keepdims=True) / 127
    assert np.all(np.abs(i8.dequantize() - w) <= s / 2 * (1 + 1e-5) + 1e-30)


@pytest.mark.exercise("13.2")
def test_int4_per_group_round_trips_within_half_a_level():
    """int4 per group, symmetric or with a minimum, groups of 8 to a whole row: every weight within s / 2
    of its group's scale (a minimum dropped, the symmetric levels not shifted by 8, a scale from the
    wrong range all break it), an all-zero row stays zero, and the bits per weight count the scales."""
    w = random_weight(np.random.default_rng(1), (5, 96))
    cases = ((32, True, 4), (32, False, 4), (8, True, 4), (96, False, 4), (32, True, 3), (8, False, 3))
    for group, minimum, bits in cases:
        q4 = Int4PerGroup.quantize(w, group=group, minimum=minimum, bits=bits)
        g = w.reshape(5, -1, group).astype(np.float64)
        if minimum:
            s = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / (2**bits - 1)
        else:
            s = np.abs(g).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
        bound = np.broadcast_to(s / 2, g.shape).reshape(w.shape) * (1 + 1e-5) + 1e-30
        case = (group, minimum, bits)
        assert np.all(np.abs(q4.dequantize() - w) <= bound), case
        assert np.all(q4.dequantize()[2] == 0.0), case
        assert len(np.unique(q4.dequantize()[0, :group])) <= 2**bits, case  # at most 2^b levels per group
        assert q4.bits_per_weight == bits + 32 * (2 if minimum else 1) / group


@pytest.mark.exercise("13.2")
def test_int4_per_group_docstring_example_and_its_bytes():
    """Int4PerGroup's worked example, byte for byte: symmetric, g = 4, w = [-7, 0, 3.5, 7] -> s = 1,
    n = [1, 8, 12, 15] (3.5 rounds half to even: q = 4), packed [0xC1, 0xF8] (byte j holds weight j low,
    j + 2 high); with a minimum the same group gives lo = -7, s = 14/15 and n = rint((w + 7) / s)."""
    w = np.array([[-7.0, 0.0, 3.5, 7.0]], dtype=np.float32)
    sym = Int4PerGroup.quantize(w, group=4, minimum=False)
    assert sym.minimum is None and sym.scale.shape == (1, 1) and sym.scale[0, 0] == 1.0
    assert sym.packed.tolist() == [[0xC1, 0xF8]]
    with_min = Int4PerGroup.quantize(w, group=4, minimum=True)
    s = np.float32(14) / np.float32(15)
    n = np.rint((w[0] + np.float32(7)) * (np.float32(1) / s)).astype(int)  # [0, 8, 11, 15]
    assert with_min.minimum.tolist() == [[-7.0]] and with_min.scale[0, 0] == s
    assert with_min.packed.tolist() == [[n[0] | n[2] << 4, n[1] | n[3] << 4]]
    two = Int4PerGroup.quantize(np.concatenate([w, 2 * w], axis=1), group=4, minimum=False)  # two groups of a row
    assert two.scale.tolist() == [[1.0, 2.0]] and two.packed.tolist() == [[0xC1, 0xF8, 0xC1, 0xF8]]


@pytest.mark.uses_exercise("13.1", "13.2")
def test_int4_with_minimum_at_group_32_is_q4_1_up_to_fp16_scales():
    """Int4PerGroup(group=32, minimum) is Q4_1's arithmetic with float32 scales: same weights to fp16 error."""
    w = random_weight(np.random.default_rng(2))
    a = Int4PerGroup.quantize(w, group=QK).dequantize()
    b = Q4_1.quantize(w).dequantize()
    assert np.allclose(a, b, atol=2e-3 * np.abs(w).max())


@pytest.mark.parametrize("fmt", ["Q8_0", pytest.param("Q4_1", marks=pytest.mark.exercise("13.1")), "BF16"])
def test_quantizers_write_llama_cpp_bytes(fmt):
    """Our quantize writes exactly the bytes of gguf.quants.quantize (llama.cpp's reference)."""
    w = random_weight(np.random.default_rng(3), (7, 8 * QK))
    ours = FORMATS[fmt].quantize(w)
    theirs = gq.quantize(w, GGML[fmt])
    assert np.array_equal(ours.bits.view(np.uint8) if fmt == "BF16" else ours.raw, theirs.view(np.uint8))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_dequantize_random_bytes_like_gguf(fmt):
    """Any bytes with finite scales dequantize as gguf.quants.dequantize does (bit for bit)."""
    rng = np.random.default_rng(4)
    cls = FORMATS[fmt]
    block = quantize.Q8_0_BYTES if fmt == "Q8_0" else quantize.Q4_1_BYTES
    m, nb = 9, 5
    raw = rng.integers(0, 256, (m, nb, block), dtype=np.uint8)
    heads = 1 if fmt == "Q8_0" else 2
    raw[:, :, :2 * heads] = rng.uniform(-100, 100, (m, nb, heads)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(m, nb * block)
    ours = cls.from_raw(raw, (m, nb * QK)).dequantize()
    assert np.array_equal(ours, gq.dequantize(raw, GGML[fmt]))


@pytest.mark.exercise("13.1")
def test_q4_1_rounds_halves_up_and_clamps_like_llama_cpp():
    """A block from 0 to 15 has d = 1 and m = 0, so w = q + 0.5 lies exactly halfway between two levels:
    llama.cpp rounds it up (trunc(x + 0.5)), not to the even level (np.rint) nor down (trunc). Each byte
    holds weight j in its low nibble and j + 16 in its high one; a constant block stores q = 0."""
    ramp = np.concatenate([[0.0, 15.0], np.arange(14) + 0.5, np.arange(16)]).astype(np.float32)  # (32,)
    w = np.stack([ramp, ramp[::-1], np.full(QK, 3.25, np.float32)])  # (3, 32)
    ours = Q4_1.quantize(w)
    np.testing.assert_array_equal(ours.raw, gq.quantize(w, GGML["Q4_1"]).view(np.uint8))
    d, lo = ours.scales()
    assert d[:2].tolist() == [[1.0], [1.0]] and lo.tolist() == [[0.0], [0.0], [3.25]] and d[2, 0] == 0.0
    q = ours.quants()[:, 0]  # (3, 32)
    assert q[0].tolist() == [0, 15, *range(1, 15), *range(16)]
    assert not q[2].any()
    nibbles = ours.raw[0, 4:]  # byte j: q[j] | q[j + 16] << 4
    assert nibbles[1] == 15 | 1 << 4 and nibbles[15] == 14 | 15 << 4


def test_q4_1_docstring_example():
    """d = 0.25, m = -1, first nibble byte 0x3A -> weight 0 = 1.5, weight 16 = -0.25."""
    raw = np.zeros((1, quantize.Q4_1_BYTES), dtype=np.uint8)
    raw[0, :4] = np.array([0.25, -1.0], dtype=np.float16).view(np.uint8)
    raw[0, 4] = 0x3A
    w = Q4_1.from_raw(raw, (1, QK)).dequantize()
    assert w[0, 0] == 1.5 and w[0, 16] == -0.25 and w[0, 1] == -1.0


def smollm2_reader():
    from minillm.gguf import GGUFError, open_gguf
    from minillm.registry import smollm2_path

    try:
        return open_gguf(smollm2_path())
    except GGUFError as exc:
        pytest.skip(str(exc))


def test_smollm2_tensors_dequantize_like_gguf():
    """Block 0's seven Q4_1 matrices and the Q8_0 embedding (first 2048 rows) of SmolLM2's file, read
    from the file's bytes as they are, dequantize exactly as gguf.quants does."""
    reader = smollm2_reader()
    checked = set()
    for tensor in reader.tensors:
        fmt = tensor.tensor_type.name
        if fmt not in ("Q8_0", "Q4_1") or not (tensor.name.startswith("blk.0.") or tensor.name == "token_embd.weight"):
            continue
        raw = np.asarray(tensor.data)[:2048]  # (rows, bytes per row), the file's memory map
        shape = (raw.shape[0], int(tensor.shape[0]))  # GGUF lists the contiguous axis first
        weight = FORMATS[fmt].from_raw(raw, shape)
        assert np.array_equal(weight.dequantize(), gq.dequantize(raw, GGML[fmt])), tensor.name
        checked.add(fmt)
    assert checked == {"Q8_0", "Q4_1"}


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("bad, message", [
    (np.ones((4, 33), np.float32), "not a multiple of the format's block of 32"),
    (np.ones((4, 0), np.float32), "non-empty"),
    (np.ones(64, np.float32), "non-empty \\(out, in\\) matrix"),
    (np.ones((2, 64), np.int32), "float NumPy array"),
    (np.full((2, 64), np.nan, np.float32), "NaN or inf"),
    (np.array([[1.0] * 63 + [np.inf]] * 2, np.float32), "NaN or inf"),
    (np.full((2, 64), 1e7, np.float32), "past fp16"),
    (np.full((2, 64), 1e39), "outside float32's range"),
])
def test_bad_weights_are_refused(fmt, bad, message):
    with pytest.raises(QuantError, match=message):
        FORMATS[fmt].quantize(bad)


def test_bad_bytes_and_settings_are_refused():
    w = random_weight(np.random.default_rng(5))
    raw = gq.quantize(w, GGML["Q4_1"]).view(np.uint8)  # llama.cpp's bytes (exercise 13.1 writes the same)
    with pytest.raises(QuantError, match="is stored as uint8"):
        Q4_1.from_raw(raw[:, :-1], w.shape)  # a truncated row
    with pytest.raises(QuantError, match="multiple of 32"):
        Q8_0.from_raw(raw, (6, 100))
    corrupt = raw.copy()
    corrupt[1, :2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(QuantError, match="NaN or inf"):
        Q4_1.from_raw(corrupt, w.shape)
    with pytest.raises(QuantError, match="even integer"):
        Int4PerGroup.quantize(w, group=3)
    with pytest.raises(QuantError, match="bits must be 3 or 4, got 2"):
        Int4PerGroup.quantize(w, bits=2)
    with pytest.raises(QuantError, match="block of 48"):
        Int4PerGroup.quantize(w, group=48)
    with pytest.raises(QuantError, match="NaN or inf"):
        BF16.quantize(np.full((2, 3), np.nan, np.float32))


@pytest.mark.uses_exercise("13.1")  # both: a Q8_0 weight is concatenated with a Q4_1 one
@pytest.mark.parametrize("fmt", [Q8_0, Q4_1])
def test_blocks_as_a_model_weight(fmt):
    """rows(ids) is dequantize()[ids] in the ids' shape; row_slice and concat_rows move whole rows of blocks
    (their bytes unchanged); product is x @ dequantize().T; two formats cannot be concatenated."""
    from minillm.quantize import concat_rows

    rng = np.random.default_rng(7)
    w = fmt.quantize(rng.standard_normal((40, 64)).astype(np.float32))
    ids = np.array([[39, 0], [5, 5]])
    np.testing.assert_array_equal(w.rows(ids), w.dequantize()[ids])
    assert w.rows(ids).shape == (2, 2, 64) and w[ids].dtype == np.float32
    np.testing.assert_array_equal(w.row_slice(3, 9).raw, w.raw[3:9])
    both = concat_rows([w.row_slice(0, 7), w.row_slice(7, 40)])
    np.testing.assert_array_equal(both.raw, w.raw)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(w.product(x), x @ w.dequantize().T)
    other = (Q4_1 if fmt is Q8_0 else Q8_0).quantize(rng.standard_normal((4, 64)).astype(np.float32))
    with pytest.raises(QuantError, match="share one format"):
        concat_rows([w, other])
