"""A Llama block's row-wise work as numba kernels (``minillm.block_kernels``) against the array code it replaces.

Each kernel equals its reference in ``minillm.nn`` within float32 rounding on the shapes a model hands it (one
decode row, a verify's few rows, a batch; inputs as transposed views), on values where a careless sigmoid
overflows, and where the reference gives inf or NaN. ``Llama`` runs them by default on NumPy
(``LlamaCpuOps``) and gives the array code's logits; ``set_block_ops("array")`` is the reference, and the
fast table is checked to be the one that runs. A block's attention in one kernel (``block_kernels.attend``: RoPE, the
cache's write, every head's attention) gives the array code's path through a ``KVCache`` and its buffers, and runs
only where the cache lends them and the model's attention is the default.
"""

import numba
import numpy as np
import pytest

from minillm import block_kernels as bk
from minillm import kv_cache, llama
from minillm.config import LlamaConfig
from minillm.kv_cache import KVCache, KVRecorder
from minillm.llama import Llama, LlamaCpuOps
from minillm.nn import apply_rope, rms_norm, rope_cos_sin, silu
from minillm.qkernels import host_vector, vector_fma_count
from minillm.row_attention import MIN_KEYS

pytestmark = pytest.mark.host_only  # numba on the host CPU only

SHAPES = [(1, 1, 576), (1, 5, 64), (2, 3, 96)]  # a decode row, a verify's rows, a batch
CFG = LlamaConfig(vocab_size=64, block_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_hidden=48)
GQA = LlamaConfig(vocab_size=64, block_size=96, n_layer=2, n_head=6, n_kv_head=2, n_embd=48, n_hidden=48)  # SmolLM2's 3


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
@pytest.mark.parametrize("config", [CFG, GQA], ids=["2 heads a group", "3 heads a group"])
@pytest.mark.parametrize("B, T, prompt", [(1, 1, 9), (1, 6, 9), (2, 3, 9), (1, 1, 70), (1, 6, 70), (2, 3, 70)])
def test_a_llama_gives_the_array_codes_logits_on_the_kernels(config, B, T, prompt):
    """Prefill, then a decode step or a verify of T tokens through the cache: the same logits either way (past
    MIN_KEYS cached tokens the block's attention is one kernel), and the same keys and values cached."""
    model = Llama.init(config, seed=3)
    assert model.block_ops == "numba" and isinstance(model.ops, LlamaCpuOps)
    ids = np.random.default_rng(4).integers(0, config.vocab_size, (B, prompt + T))
    out, cached = {}, {}
    for name in ("array", "numba"):
        model.set_block_ops(name)
        cache = KVCache(config, batch_size=B, max_len=80)
        model.forward(ids[:, :prompt], cache)
        out[name] = model.forward(ids[:, prompt:], cache)
        cached[name] = np.stack(cache.k + cache.v)
    np.testing.assert_allclose(out["numba"], out["array"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cached["numba"], cached["array"], rtol=1e-5, atol=1e-6)


def filled_cache(config, B, start, rng):
    """A KVCache of ``config`` holding ``start`` random keys and values (zeros past them)."""
    cache = KVCache(config, batch_size=B, max_len=config.block_size)
    for buffers in (cache.k, cache.v):
        for a in buffers:
            a[:, :, :start] = rng.standard_normal((B, config.n_kv_head, start, config.head_size), dtype=np.float32)
    cache.length = start
    return cache


@pytest.mark.uses_exercise("3.1", "8.1")
@pytest.mark.parametrize("B, T, start", [(1, 1, 70), (1, 2, 64), (1, 5, 80), (2, 3, 70), (1, 16, 70), (1, 8, 0)])
def test_attend_writes_the_cache_and_attends_as_the_array_code_does(B, T, start):
    """``block_kernels.attend`` on a cache's buffers against ``LlamaOps.attend`` through a copy of the cache:
    the same output (B, T, n_head hs), the new keys turned by RoPE and the values at positions start.., nothing
    past them touched; 16 new tokens are 48 rows of a group, a prefill of 8 into an empty cache has more rows
    than keys."""
    rng = np.random.default_rng(T + start)
    model = Llama.init(GQA, seed=1)
    model.set_block_ops("array")
    reference, lent = filled_cache(GQA, B, start, rng), filled_cache(GQA, B, start, np.random.default_rng(T + start))
    qkv = rng.standard_normal((B, T, (GQA.n_head + 2 * GQA.n_kv_head) * GQA.head_size), dtype=np.float32)
    rope = model.rope(np.arange(start, start + T))
    want = llama.LlamaOps.attend(model, 1, qkv, reference, rope)
    got = bk.attend(qkv, *rope, lent.k[1], lent.v[1], start, GQA.n_head)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for mine, theirs in ((lent.k[1], reference.k[1]), (lent.v[1], reference.v[1])):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)
        assert not mine[:, :, start + T :].any()


def test_attend_refuses_what_it_would_misread():
    """Buffers too short for the new tokens, tables of another length, a q|k|v of another width, a copy of the
    buffers instead of them: each a ValueError, before anything is written."""
    rng = np.random.default_rng(0)
    cache = filled_cache(GQA, 1, 90, rng)
    qkv = rng.standard_normal((1, 2, 10 * GQA.head_size), dtype=np.float32)
    rope = rope_cos_sin(np.arange(90, 92), GQA.head_size, GQA.rope_theta)
    k, v = cache.k[0], cache.v[0]
    with pytest.raises(ValueError, match="KV buffers"):
        bk.attend(qkv, *rope, k, v, 95, GQA.n_head)
    with pytest.raises(ValueError, match="tables"):
        bk.attend(qkv, rope[0][:1], rope[1][:1], k, v, 90, GQA.n_head)
    with pytest.raises(ValueError, match="q|k|v"):
        bk.attend(qkv[..., :-2], *rope, k, v, 90, GQA.n_head)
    with pytest.raises(ValueError, match="in place"):
        bk.attend(qkv, *rope, k.transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2), v, 90, GQA.n_head)
    assert not k[:, :, 90:].any() and not v[:, :, 90:].any()


ATTEND = bk.attend  # the kernel itself, for a test that counts its calls


class OwnAttend(KVCache):
    """A cache with an attend of its own (a student's, say): what it does is what must run."""

    def attend(self, layer, q, k, v, attention):
        return super().attend(layer, q, k, v, attention)


@pytest.mark.uses_exercise("3.1", "8.1", "8.2", "8.3")
def test_the_one_kernel_attention_runs_only_where_the_cache_lends_its_buffers(monkeypatch):
    """One ``block_kernels.attend`` per block for a decode step past MIN_KEYS cached tokens on a KVCache with the
    default attention; none below MIN_KEYS, with attention="naive" (the reference), through a cache that passes
    calls on (``KVRecorder``), or on a KVCache subclass with its own attend."""
    calls = []
    monkeypatch.setattr(bk, "attend", lambda *args: calls.append(1) or ATTEND(*args))
    model = Llama.init(GQA, seed=2)
    ids = np.random.default_rng(3).integers(0, GQA.vocab_size, (1, MIN_KEYS + 1))

    def decode_calls(prompt, make=KVCache, attention="auto"):
        model.set_attention(attention)
        cache = make(GQA, max_len=80)
        model.forward(ids[:, :prompt], cache)
        calls.clear()
        model.forward(ids[:, prompt : prompt + 1], cache)
        return len(calls)

    assert decode_calls(MIN_KEYS) == GQA.n_layer
    assert decode_calls(MIN_KEYS - 2) == 0
    assert decode_calls(MIN_KEYS, attention="naive") == 0
    assert decode_calls(MIN_KEYS, make=OwnAttend) == 0
    assert decode_calls(MIN_KEYS, make=lambda config, max_len: KVRecorder(KVCache(config, max_len=max_len))) == 0


@pytest.mark.uses_exercise("8.1", "8.2", "8.3")
def test_a_cache_exercise_left_to_do_runs_and_raises_in_the_model(monkeypatch, fresh_probe):
    """With KVCache.attend still a stub, or writing where the kernel would not, the cache lends nothing: the model
    goes through the attend that is written, and a stub's NotImplementedError is what it raises."""
    def stub(self, layer, q, k, v, attention):
        raise NotImplementedError("exercise 3.1")

    def at_zero(self, layer, q, k, v, attention):  # every write at position 0
        T = k.shape[2]
        self.k[layer][:, :, :T], self.v[layer][:, :, :T] = k, v
        return attention(q, self.k[layer][:, :, : self.length + T], self.v[layer][:, :, : self.length + T])

    model = Llama.init(GQA, seed=4)
    monkeypatch.setattr(KVCache, "attend", at_zero)
    assert KVCache(GQA).in_place(0) is None
    kv_cache.attends_in_place.cache_clear()
    monkeypatch.setattr(KVCache, "attend", stub)
    cache = KVCache(GQA, max_len=80)
    assert cache.in_place(0) is None
    cache.length = MIN_KEYS
    with pytest.raises(NotImplementedError, match="exercise 3.1"):
        model.forward(np.array([[1]]), cache)


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
    calls.clear()  # the probe of kernels_match_reference, where a test before this one asked for it again
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
    """``kernels_match_reference`` and ``kv_cache.attends_in_place`` asked again, before and after the test (each
    answers once a process)."""
    probes = (llama.kernels_match_reference, kv_cache.attends_in_place)
    for probe in probes:
        probe.cache_clear()
    yield
    for probe in probes:
        probe.cache_clear()


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
