"""A Llama block's row-wise work as numba kernels (``minillm.block_kernels``) against the array code it replaces.

Each kernel equals its reference in ``minillm.nn`` within float32 rounding on the shapes a model hands it (one
decode row, a verify's few rows, a batch; inputs as transposed views), on values where a careless sigmoid
overflows, and where the reference gives inf or NaN. ``Llama`` runs them by default on NumPy
(``LlamaCpuOps``) and gives the array code's logits; ``set_block_ops("array")`` is the reference, and the
fast table is checked to be the one that runs.
"""

import numba
import numpy as np
import pytest

from minillm import block_kernels as bk
from minillm import llama
from minillm.config import LlamaConfig
from minillm.kv_cache import KVCache
from minillm.llama import Llama, LlamaCpuOps
from minillm.nn import apply_rope, rms_norm, rope_cos_sin, silu
from minillm.qkernels import host_vector, vector_fma_count

pytestmark = pytest.mark.host_only  # numba on the host CPU only

SHAPES = [(1, 1, 576), (1, 5, 64), (2, 3, 96)]  # a decode row, a verify's rows, a batch
CFG = LlamaConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_hidden=48)


def transposed(rng, shape):
    """Random float32 of ``shape`` as a non-contiguous view, as a model's heads are."""
    return rng.standard_normal(shape[::-1], dtype=np.float32).T


@pytest.mark.uses_exercise("8.2")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("add", [True, False], ids=["x+h", "x"])
def test_add_rms_norm_equals_the_residual_add_and_rms_norm(shape, add):
    rng = np.random.default_rng(0)
    x, h = 3 * transposed(rng, shape), rng.standard_normal(shape, dtype=np.float32)
    w = rng.standard_normal(shape[-1], dtype=np.float32)
    s = x + h if add else x
    got_s, got_n = bk.add_rms_norm(x, h if add else None, w, 1e-5)
    np.testing.assert_allclose(got_s, s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_n, rms_norm(s, w, 1e-5), rtol=2e-5, atol=2e-6)
    small = bk.add_rms_norm(1e-4 * s, None, w, 1e-2)[1]  # eps matters: inside the root, beside mean(s^2)
    np.testing.assert_allclose(small, rms_norm(1e-4 * s, w, 1e-2), rtol=2e-5, atol=1e-9)
    assert got_n.dtype == got_s.dtype == np.float32 and got_n.flags.c_contiguous


def exact_silu(g):
    """silu in float64, g / (1 + e^-g): the truth both float32 versions round."""
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g.astype(np.float64)))


@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (1, 5, 2 * 48), (2, 3, 2 * 7)])
def test_silu_mul_equals_silu_of_gate_times_up(shape):
    """Within float32 rounding of the float64 truth, and so of the reference's values (whose tanh form rounds
    sigmoid(g) to 0 for g below about -17: there the two differ by less than 1e-5 of |g up|)."""
    rng = np.random.default_rng(1)
    gate_up = 8 * transposed(rng, shape)  # |gate| up to ~30: both signs, e^-|g| small
    H = shape[-1] // 2
    gate, up = gate_up[..., :H], gate_up[..., H:]
    got = bk.silu_mul(gate_up)
    np.testing.assert_allclose(got, exact_silu(gate) * up, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(got, silu(gate) * up, rtol=2e-6, atol=1e-5)


def test_silu_mul_at_the_edges_of_the_exponential():
    """Gates far below -87 (e^-|g| is 0 there), at 0, huge, and inf / NaN: what the reference gives."""
    gate = np.array([-1e4, -100, -88.5, -87.0, -20, -1e-3, 0, 1e-3, 20, 87.0, 88.5, 100, 1e4, np.inf, -np.inf,
                     np.nan], dtype=np.float32)
    up = np.linspace(-2, 3, len(gate)).astype(np.float32)
    gate_up = np.concatenate([gate, up])[None]
    with np.errstate(invalid="ignore", over="ignore"):
        want, truth = silu(gate) * up, exact_silu(gate) * up
    got = bk.silu_mul(gate_up)[0]
    np.testing.assert_allclose(got, truth, rtol=2e-6, atol=1e-30, equal_nan=True)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5, equal_nan=True)


def test_silu_mul_compiles_to_vector_fmas():
    """Its exponential's polynomial and the sigmoid's division run in vector lanes: numba's default error model
    (a ZeroDivisionError check on every float division) would leave the loop scalar."""
    kernel = numba.njit(**{k: v for k, v in bk.JIT.items() if k != "cache"})(bk.silu_mul_kernel.py_func)
    kernel.compile((bk.ROWS, bk.ROWS))
    counts = vector_fma_count(kernel.inspect_asm(kernel.signatures[0]))
    assert counts["zmm" if host_vector()[0] == 16 else "ymm"] >= 6, counts  # the polynomial's FMAs


@pytest.mark.uses_exercise("8.1")
@pytest.mark.parametrize("T, start", [(1, 0), (1, 8000), (7, 100)])
def test_rope_equals_apply_rope(T, start):
    rng = np.random.default_rng(2)
    cos, sin = rope_cos_sin(np.arange(start, start + T), 64, 10000.0)
    x = rng.standard_normal((2, T, 9, 64), dtype=np.float32).transpose(0, 2, 1, 3)  # (B, heads, T, hs), a view
    got = bk.rope(x, cos, sin)
    np.testing.assert_allclose(got, apply_rope(x, cos, sin), rtol=1e-5, atol=2e-6)
    assert got.flags.c_contiguous


def test_the_kernels_refuse_shapes_they_would_misread():
    x = np.zeros((1, 2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="add_rms_norm"):
        bk.add_rms_norm(x, None, np.ones(7, dtype=np.float32), 1e-5)
    with pytest.raises(ValueError, match="two halves"):
        bk.silu_mul(np.zeros((1, 7), dtype=np.float32))
    with pytest.raises(ValueError, match="tables"):
        bk.rope(np.zeros((1, 1, 2, 8), dtype=np.float32), *rope_cos_sin(np.arange(3), 8, 10000.0))


@pytest.mark.uses_exercise("3.1", "8.1", "8.2", "8.3")
@pytest.mark.parametrize("B, T", [(1, 1), (1, 6), (2, 3)])
def test_a_llama_gives_the_array_codes_logits_on_the_kernels(B, T):
    """Prefill, then a decode step or a verify of T tokens through the cache: the same logits either way."""
    model = Llama.init(CFG, seed=3)
    assert model.block_ops == "numba" and isinstance(model.ops, LlamaCpuOps)
    ids = np.random.default_rng(4).integers(0, CFG.vocab_size, (B, 9 + T))
    out = {}
    for name in ("array", "numba"):
        model.set_block_ops(name)
        cache = KVCache(CFG, batch_size=B, max_len=32)
        model.forward(ids[:, :9], cache)
        out[name] = model.forward(ids[:, 9:], cache)
    np.testing.assert_allclose(out["numba"], out["array"], rtol=1e-4, atol=1e-5)


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
def test_the_kernels_are_what_runs_and_the_array_code_stays_one_call_away(monkeypatch):
    """On "numba" the array code's norm, RoPE and SiLU are never called; on "array" they are."""
    calls = []

    def counted(fn):
        def wrapper(*args):
            calls.append(fn.__name__)
            return fn(*args)
        return wrapper

    for name in ("rms_norm", "apply_rope", "silu"):
        monkeypatch.setattr(llama, name, counted(getattr(llama, name)))
    model = Llama.init(CFG, seed=5)
    model.forward(np.array([[1, 2, 3]]))
    assert calls == []
    model.set_block_ops("array")
    model.forward(np.array([[1, 2, 3]]))
    assert {"rms_norm", "apply_rope", "silu"} <= set(calls)
    with pytest.raises(ValueError, match="block_ops='fast': choose from numba, array"):
        model.set_block_ops("fast")


@pytest.mark.uses_exercise("8.1")
def test_ragged_positions_turn_by_the_array_code():
    """A ragged batch's RoPE tables are one per row, (B, 1, T, hs): the kernel takes (T, hs), so the array code turns
    them, with the same result as the reference table."""
    model = Llama.init(CFG, seed=6)
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, 4, 3, 8), dtype=np.float32), rng.standard_normal((2, 2, 3, 8), dtype=np.float32)
    tables = model.rope(np.array([[0, 1, 2], [5, 6, 7]]))
    assert tables[0].ndim == 4
    for a, b in zip(model.ops.rotate(q, k, tables), llama.LlamaOps.rotate(model, q, k, tables)):
        np.testing.assert_array_equal(a, b)


def test_rope_tables_are_looked_up_in_one_table_grown_by_doubling(monkeypatch):
    """On "numba" RoPE's (cos, sin) come from one table of positions 0..n-1, computed when a position is past it
    (n at least doubled): the array code's floats at every position asked, below and past each growth."""
    ops = LlamaCpuOps(Llama.init(CFG, seed=8))  # the fast table itself, whatever the model's default
    sizes = []

    def counted(self, pos):
        sizes.append(len(pos))
        return rope_cos_sin(pos, CFG.head_size, CFG.rope_theta)

    monkeypatch.setattr(llama.LlamaOps, "rope", counted)
    for pos in (np.arange(0, 3), np.arange(1022, 1025), np.array([5000]), np.arange(7, 9), np.array([4999, 2])):
        for got, want in zip(ops.rope(pos), rope_cos_sin(pos, CFG.head_size, CFG.rope_theta)):
            np.testing.assert_array_equal(got, want)
    assert sizes == [llama.ROPE_TABLE_START, 2 * llama.ROPE_TABLE_START, 5001]


@pytest.fixture
def fresh_probe():
    """``kernels_match_reference`` asked again, before and after the test (it answers once a process)."""
    llama.kernels_match_reference.cache_clear()
    yield
    llama.kernels_match_reference.cache_clear()


def test_an_exercise_left_to_do_runs_and_raises_in_the_model(monkeypatch, fresh_probe):
    """With the reference RMSNorm still a stub, the kernels do not stand in for it: the model runs the array code,
    so the stub's NotImplementedError is what the model raises."""
    def stub(x, w, eps):
        raise NotImplementedError("exercise 8.2")

    monkeypatch.setattr(llama, "rms_norm", stub)
    model = Llama.init(CFG, seed=8)
    assert model.block_ops == "array" and model.ops is model
    with pytest.raises(NotImplementedError, match="exercise 8.2"):
        model.forward(np.array([[1, 2, 3]]))


def test_an_exercise_done_another_way_is_what_the_model_runs(monkeypatch, fresh_probe):
    """A reference that computes something else (eps outside the root) is not replaced by the kernels either."""
    monkeypatch.setattr(llama, "rms_norm", lambda x, w, eps: x / (np.sqrt((x * x).mean(-1, keepdims=True)) + eps) * w)
    assert Llama.init(CFG, seed=9).block_ops == "array"
