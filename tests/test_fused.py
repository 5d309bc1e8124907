"""The fused kernels of kernels/fused.cu equal the array code they replace (minillm.fused's references) on every
buffer they write, on awkward shapes: one token row or several, widths that are not a multiple of the warp,
grouped-query heads, positions on both sides of a lane boundary, scores large enough to overflow exp() without
the running max, RoPE at position 5,000. Each classic mistake (kernels.mutants.FUSED_MUTANTS) fails the same
check, and a kernel refuses what it cannot take through its status word.

The kernels run through the chapter-4 emulation (g++ and cuda_emu.h) on host arrays: no device code, so these
run in the NumPy run only (host_only); the strict run drives the same kernels through the stand-in's RawKernel
in tests/test_decode_step.py."""

import ast
import ctypes
import inspect
import shutil
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from minillm import fused
from minillm.kernels import build
from minillm.kernels.build import KernelError
from minillm.kernels.mutants import FUSED_MUTANTS, mutate_kernel, write_kernel_mutant

pytestmark = [pytest.mark.host_only,
              pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation compiles fused.cu with g++")]
ATOL = 2e-5  # float32 arithmetic in another order (the kernel's sums run lane by lane)


def copies(args: dict) -> dict:
    return {k: a.copy() if isinstance(a, np.ndarray) else a for k, a in args.items()}


def run_both(name, grid, args, shared_mem=0, source=build.FUSED_SOURCE):
    """Kernel ``name`` (emulated, from ``source``) and its reference (``fused.launch`` on NumPy) on copies of the
    same arguments -> the two argument dicts after the run, so a test compares every buffer either one wrote."""
    kernel_args, reference_args = copies(args), copies(args)
    fused.launch(name, grid, shared_mem, emulated=True, source=source, **kernel_args)
    fused.REFERENCES[name](**{p: reference_args[p] for p in fused.REFERENCE_PARAMS[name]})
    return kernel_args, reference_args


def assert_same(kernel_args, reference_args, atol=ATOL):
    for key, got in kernel_args.items():
        if isinstance(got, np.ndarray):
            np.testing.assert_allclose(got, reference_args[key], atol=atol, rtol=1e-5, err_msg=f"argument {key}")


def rand(rng, *shape, scale=1.0, shift=0.0):
    return (rng.standard_normal(shape) * scale + shift).astype(np.float32)


# ---- one case per kernel: (grid, args, shared memory) ----------------------------------------------------


def norm_case(name, rows, C, rng, scale=1.0, shift=0.0):
    x, y, bias = rand(rng, rows, C, scale=scale, shift=shift), rand(rng, rows, C), rand(rng, C)
    w, b, out = rand(rng, C, shift=1.0), rand(rng, C), np.full((rows, C), np.nan, np.float32)
    args = {"x": x, "y": y, "bias": bias, "w": w, "b": b, "out": out, "C": C, "eps": 1e-5}
    return (rows,), {p: args[p] for p in build.FUSED_PARAMS[name]}, fused.NORM_SMEM_BYTES


def qkv_case(name, B, T, nh, nkv, hs, rng, start=0, max_len=None):
    lengths = start + np.arange(B, dtype=np.int32) * 2  # rows at different lengths
    max_len = int(lengths.max()) + T + 1 if max_len is None else max_len
    pos = (lengths[:, None] + np.arange(T)).reshape(-1).astype(np.int32)
    width = (nh + 2 * nkv) * hs
    qkv, bias = rand(rng, B * T, width), rand(rng, width)
    q = np.full((B, nh, T, hs), np.nan, np.float32)
    kc, vc = rand(rng, B, nkv, max_len, hs), rand(rng, B, nkv, max_len, hs)  # old entries must survive
    args = {"qkv": qkv, "bias": bias, "pos": pos, "q": q, "kc": kc, "vc": vc, "status": np.zeros(1, np.int32),
            "T": T, "nh": nh, "nkv": nkv, "hs": hs, "max_len": max_len, "theta": 10000.0}
    return (B * T,), {p: args[p] for p in build.FUSED_PARAMS[name]}, 0


def attention_case(B, T, nh, nkv, hs, last_pos, rng, score_scale=1.0):
    """Queries at positions last_pos - T + 1 .. last_pos (row b: last_pos + b) over a cache of last_pos + B + 1
    slots, the slots past each query's position filled with huge values that must never be read."""
    max_len = last_pos + B + 2
    pos = np.concatenate([np.arange(last_pos + b - T + 1, last_pos + b + 1) for b in range(B)]).astype(np.int32)
    q = rand(rng, B, nh, T, hs, scale=score_scale)
    kc, vc = rand(rng, B, nkv, max_len, hs), rand(rng, B, nkv, max_len, hs)
    kc[..., -1, :] = vc[..., -1, :] = 1e30  # the last slot lies past every query's position
    kc[..., :, 0] += np.linspace(0, 8, max_len, dtype=np.float32)  # scores that grow along the sequence
    args = {"q": q, "kc": kc, "vc": vc, "pos": pos, "out": np.full((B * T, nh * hs), np.nan, np.float32),
            "status": np.zeros(1, np.int32), "T": T, "nh": nh, "nkv": nkv, "hs": hs, "max_len": max_len,
            "scale": fused.attention_scale(hs)}
    return (T, nh, B), args, fused.attention_smem_bytes(hs)


def embed_case(name, B, T, rng, V=11, C=40, max_len=12):
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    lengths = np.array([0, 3, 5][:B], np.int32)
    wte, wpe = rand(rng, V, C), rand(rng, max_len, C)
    args = {"ids": ids, "lengths": lengths, "wte": wte, "wpe": wpe, "x": np.full((B * T, C), np.nan, np.float32),
            "pos": np.full(B * T, -1, np.int32), "status": np.zeros(1, np.int32), "T": T, "C": C, "V": V,
            "max_len": max_len}
    return (B * T,), {p: args[p] for p in build.FUSED_PARAMS[name]}, 0


# ---- every kernel equals its reference ----------------------------------------------------------------------


RMS = pytest.mark.uses_exercise("8.2")  # the references of the RMSNorm kernels call nn.rms_norm
ROPE = pytest.mark.uses_exercise("8.1")  # ... of the RoPE kernel nn.apply_rope
GQA = pytest.mark.uses_exercise("8.3")  # ... of decode_attention nn.repeat_kv


@pytest.mark.parametrize("name", ["layer_norm_rows", pytest.param("rms_norm_rows", marks=RMS), "add_layer_norm_rows",
                                  pytest.param("add_rms_norm_rows", marks=RMS)])
@pytest.mark.parametrize("rows, C", [(1, 32), (3, 45), (2, 576)])
def test_norms_equal_the_array_code(name, rows, C):
    """out = norm(x) (and x += y + bias, written back, for the residual ones): C below, at and above the warp."""
    assert_same(*run_both(name, *norm_case(name, rows, C, np.random.default_rng(C))))


@pytest.mark.parametrize("H", [7, 100])
def test_activations_equal_the_array_code(H):
    """GPT-2's bias + GELU in place; Llama's silu(gate) * up from the stacked product's row."""
    rng = np.random.default_rng(H)
    assert_same(*run_both("bias_gelu", (2,), {"h": rand(rng, 2, H, scale=3.0), "bias": rand(rng, H), "H": H}))
    gu, a = rand(rng, 2, 2 * H, scale=3.0), np.full((2, H), np.nan, np.float32)
    assert_same(*run_both("silu_mul", (2,), {"gu": gu, "a": a, "H": H}))


@pytest.mark.uses_exercise("12.2")
@pytest.mark.parametrize("name", ["qkv_to_cache", pytest.param("qkv_rope_to_cache", marks=ROPE)])
@pytest.mark.parametrize("B, T, nh, nkv, hs", [(1, 1, 4, 4, 8), (2, 3, 4, 2, 16), (2, 1, 9, 3, 64)])
def test_qkv_split_and_cache_write_equal_the_array_code(name, B, T, nh, nkv, hs):
    """q lands in (B, nh, T, hs); k and v in the caches at each row's own position, nothing else changes."""
    assert_same(*run_both(name, *qkv_case(name, B, T, nh, nkv, hs, np.random.default_rng(hs))))


@pytest.mark.uses_exercise("12.2")
@ROPE
def test_rope_at_position_5000_keeps_the_double_angle():
    """The angle pos * theta^(-2j/hs) in double, as nn.rope_cos_sin computes it: in float it would be off by
    about 3e-4 rad at this position."""
    assert_same(*run_both("qkv_rope_to_cache", *qkv_case("qkv_rope_to_cache", 1, 2, 2, 1, 32,
                                                           np.random.default_rng(0), start=5000)))


ATTENTION_SHAPES = [(1, 1, 4, 4, 8), (2, 3, 4, 2, 16), (1, 2, 9, 3, 64), (1, 1, 2, 1, 128)]  # B, T, nh, nkv, hs


@pytest.mark.exercise("12.1")
@GQA
@pytest.mark.parametrize("B, T, nh, nkv, hs, last_pos", [(*shape, p) for shape in ATTENTION_SHAPES
                                                         for p in (0, 31, 32, 70) if p + 1 >= shape[1]])
def test_decode_attention_equals_the_masked_array_code(B, T, nh, nkv, hs, last_pos):
    """Each query attends keys 0..pos of its KV head: one key (position 0), a lane's last key (31), one more
    than the warp (32), several per lane (70); grouped heads; the slots past pos (1e30) are never read."""
    rng = np.random.default_rng(last_pos)
    assert_same(*run_both("decode_attention", *attention_case(B, T, nh, nkv, hs, last_pos, rng)))


@pytest.mark.exercise("12.1")
@GQA
def test_decode_attention_takes_scores_that_overflow_exp():
    """Scores in the hundreds: without the running max exp() overflows to inf and the output is NaN."""
    kernel, reference = run_both("decode_attention", *attention_case(1, 1, 2, 2, 16, 40, np.random.default_rng(1),
                                                                     score_scale=60.0))
    assert np.isfinite(kernel["out"]).all()
    assert_same(kernel, reference, atol=1e-4)


@pytest.mark.parametrize("name", ["embed_rows", "embed_pos_rows"])
def test_embedding_writes_positions_from_the_lengths(name):
    """pos = lengths[b] + t on the device; x = wte[ids] (+ wpe[pos])."""
    kernel, reference = run_both(name, *embed_case(name, 3, 2, np.random.default_rng(5)))
    assert_same(kernel, reference)
    np.testing.assert_array_equal(kernel["pos"], [0, 1, 3, 4, 5, 6])


# ---- limits: refused through the status word ---------------------------------------------------------------


def test_kernels_refuse_what_they_cannot_take():
    """A token id outside the vocabulary, a position past the cache, a head above HS_MAX: each writes its
    FUSED_* code and nothing else; fused.raise_status names it."""
    rng = np.random.default_rng(0)
    grid, args, _ = embed_case("embed_rows", 1, 1, rng)
    args["ids"][...] = 11  # V = 11: one past the last id
    x_before = args["x"].copy()
    fused.launch("embed_rows", grid, emulated=True, **args)
    assert args["status"][0] == build.FUSED_DEFINES["FUSED_BAD_TOKEN"][0]
    np.testing.assert_array_equal(args["x"], x_before)  # nothing written
    with pytest.raises(KernelError, match="token id outside"):
        fused.raise_status(int(args["status"][0]))
    grid, args, _ = qkv_case("qkv_to_cache", 1, 1, 2, 2, 8, rng, max_len=4)
    args["pos"][...] = 4  # position 4 of a 4-slot cache
    fused.launch("qkv_to_cache", grid, emulated=True, **args)
    assert args["status"][0] == build.FUSED_DEFINES["FUSED_PAST_CACHE"][0]
    grid, args, smem = attention_case(1, 1, 1, 1, 8, 3, rng)
    fused.launch("decode_attention", grid, smem, emulated=True, **args | {"hs": fused.HS_MAX + 1})
    assert args["status"][0] == build.FUSED_DEFINES["FUSED_HEAD_TOO_LARGE"][0]


# ---- the bug zoo: every classic mistake fails the same checks ------------------------------------------------

MUTANT_CASES = {
    "attention_off_by_one": lambda rng: ("decode_attention", attention_case(1, 2, 2, 2, 16, 33, rng)),
    "attention_no_rescale": lambda rng: ("decode_attention", attention_case(1, 1, 2, 2, 16, 70, rng, 3.0)),
    "gqa_round_robin": lambda rng: ("decode_attention", attention_case(1, 1, 4, 2, 16, 20, rng)),
    "norm_uncentered_variance": lambda rng: ("layer_norm_rows", norm_case("layer_norm_rows", 2, 45, rng,
                                                                          shift=5.0)),
    "norm_eps_outside_sqrt": lambda rng: ("rms_norm_rows", norm_case("rms_norm_rows", 2, 45, rng, scale=1e-3)),
    "rope_interleaved_pairs": lambda rng: ("qkv_rope_to_cache", qkv_case("qkv_rope_to_cache", 1, 2, 2, 1, 16, rng)),
    "rope_float_angle": lambda rng: ("qkv_rope_to_cache", qkv_case("qkv_rope_to_cache", 1, 2, 2, 1, 32, rng,
                                                                   start=5000)),
}


def mutant(name) -> Path:
    out = Path(tempfile.gettempdir()) / "minillm-kernel-mutants"
    out.mkdir(exist_ok=True)
    return write_kernel_mutant(name, build.FUSED_SOURCE, out, FUSED_MUTANTS)


def test_every_mutant_has_a_case_and_edits_the_current_kernel_once():
    assert set(MUTANT_CASES) == set(FUSED_MUTANTS) == set(MUTANT_USES)
    for name in FUSED_MUTANTS:
        mutate_kernel(name, build.FUSED_SOURCE.read_text(), FUSED_MUTANTS)


ATTENTION_REFERENCE = pytest.mark.uses_exercise("12.1", "8.3")
ROPE_REFERENCE = pytest.mark.uses_exercise("12.2", "8.1")
MUTANT_USES = {  # the exercises each mutant's case runs through its kernel's reference
    "attention_off_by_one": ATTENTION_REFERENCE, "attention_no_rescale": ATTENTION_REFERENCE,
    "gqa_round_robin": ATTENTION_REFERENCE, "norm_uncentered_variance": [], "norm_eps_outside_sqrt": RMS,
    "rope_interleaved_pairs": ROPE_REFERENCE, "rope_float_angle": ROPE_REFERENCE,
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=MUTANT_USES[n]) for n in sorted(FUSED_MUTANTS)])
def test_the_checks_catch_each_mutant(name):
    """The mutant passes its own case on the real kernel, and fails it on the mutant."""
    kernel_name, (grid, args, smem) = MUTANT_CASES[name](np.random.default_rng(7))
    assert_same(*run_both(kernel_name, grid, args, smem))
    with pytest.raises(AssertionError):
        assert_same(*run_both(kernel_name, grid, args, smem, source=mutant(name)))


# ---- each kernel's arguments declared once: its extern "C" line --------------------------------------------------


def test_each_kernels_parameters_are_read_from_its_declaration(tmp_path):
    """fused.cu's extern "C" lines give every kernel's parameters, names and types, in order: what the emulated
    launcher, CuPy's call and the references follow. A parameter of another type is refused."""
    assert set(build.FUSED_PARAMS) == set(fused.REFERENCES) == set(build.FUSED.names)
    assert build.FUSED_PARAMS["bias_gelu"] == {"h": build.FLOAT_P, "bias": build.FLOAT_P, "H": ctypes.c_int}
    assert list(build.FUSED_PARAMS["qkv_rope_to_cache"])[-2:] == ["max_len", "theta"]
    source = tmp_path / "k.cu"
    source.write_text('extern "C" __global__ void f(const int* ids,\n    float* out, float eps) {}\n'
                      'extern "C" __global__ void g(double d) {}\n')
    with pytest.raises(KernelError, match="'double d'"):
        build.read_entry_points(source)
    source.write_text('extern "C" __global__ void f(const int* ids,\n    float* out, float eps) {}\n')
    assert build.read_entry_points(source) == {"f": {"ids": build.INT_P, "out": build.FLOAT_P, "eps": ctypes.c_float}}


def test_a_launch_takes_its_arguments_by_name():
    """Every parameter named once, none other: a missing or unknown name is refused before anything runs;
    scalars become the numpy.int32 / numpy.float32 the kernel takes."""
    grid, args, _ = embed_case("embed_rows", 1, 2, np.random.default_rng(0))
    assert fused.kernel_args("embed_rows", args)["T"].dtype == np.int32
    with pytest.raises(TypeError, match=r"missing \['max_len'\], unknown \['maxlen'\]"):
        fused.launch("embed_rows", grid, emulated=True, **{k: v for k, v in args.items() if k != "max_len"},
                     maxlen=12)


REFERENCE_EXERCISES = {"decode_attention": pytest.mark.uses_exercise("12.1"),  # references an exercise writes
                       "qkv_to_cache": pytest.mark.uses_exercise("12.2")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=REFERENCE_EXERCISES[n]) if n in REFERENCE_EXERCISES else n
                                  for n in sorted(build.FUSED.names)])
def test_each_reference_takes_only_what_it_uses(name):
    """A reference's parameters are some of its kernel's, in the kernel's order, and its body reads each one."""
    params = fused.REFERENCE_PARAMS[name]
    assert [p for p in build.FUSED_PARAMS[name] if p in params] == list(params)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fused.REFERENCES[name])))
    read = {node.id for node in ast.walk(tree.body[0]) if isinstance(node, ast.Name)}
    assert set(params) <= read, set(params) - read
