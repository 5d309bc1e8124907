"""The strict CuPy stand-in follows CuPy's rules (no implicit conversion, explicit ways up and down,
RawKernel's argument rules), counts kernels and synchronizations, and with it as the backend (the test
command's strict run) the kernel launcher, a decoded token and a batch's step cost what they should: no
wait for the device inside the forward pass, one transfer of a batch's next tokens per step."""

import shutil

import numpy as np
import pytest

from minillm import GPT, GPTConfig, generate_batch, speculative_generate_batch, strict
from minillm.backend import xp
from minillm.decode_step import per_token
from minillm.kernels import launch
from minillm.serving import Engine, Request, SimulatedClock

on_the_stand_in = pytest.mark.skipif(xp is not strict, reason="counts the stand-in's calls: MINILLM_BACKEND=strict")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the stand-in's RawKernel runs the g++ emulation")


@pytest.fixture
def counts():
    strict.reset_counts()
    return strict.COUNTS


def test_no_implicit_conversion_either_way():
    """np.asarray(device), mixing device and NumPy arrays in any order, and NumPy arrays given to device
    functions or stored into device arrays all raise TypeError, as in CuPy."""
    a = strict.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    host = np.ones(3, dtype=np.float32)
    for wrong in (lambda: np.asarray(a), lambda: np.array(a), lambda: a + host, lambda: host * a,
                  lambda: np.add(host, a), lambda: strict.exp(host), lambda: np.concatenate([a, host[None]]),
                  lambda: a.__setitem__(0, host)):
        with pytest.raises(TypeError):
            wrong()
    np.testing.assert_array_equal((np.exp(a) + 1).get(), np.exp(np.arange(6, dtype=np.float32).reshape(2, 3)) + 1)
    np.testing.assert_array_equal(((a > 1) & (a < 4) | ~(a != 0)).get(), [[True, False, True], [True, False, False]])


def test_the_ways_down_are_counted_synchronizations(counts):
    """.get(), asnumpy, int(), float(), bool() and .item() each wait for the device once; a reduction
    stays on the device as a 0-d array (CuPy's), so summing does not synchronize."""
    a = strict.asarray(np.arange(4, dtype=np.float32))
    total = a.sum()
    assert isinstance(total, strict.ndarray) and total.shape == () and counts["syncs"] == 0
    assert isinstance(a.get(), np.ndarray) and isinstance(strict.asnumpy(a), np.ndarray)
    assert int(total) == 6 and float(total) == 6.0 and bool(total) and total.item() == 6.0
    assert counts["syncs"] == 6


def test_kernels_are_counted_and_views_are_free(counts):
    a = strict.asarray(np.zeros((4, 8), dtype=np.float32))
    counts.clear()
    a.reshape(8, 4), a.T, a[1:3], a.swapaxes(0, 1)
    assert counts["kernels"] == 0
    (a * 2).sum(axis=-1), strict.exp(a)
    assert counts["kernels"] == 3


@needs_gxx
def test_raw_kernel_takes_only_cupys_arguments():
    """The kernel's int parameters need numpy.int32 (CuPy passes a Python int as int64), its pointers
    C-contiguous device arrays of the parameter's type, and more than 48 KiB of shared memory the opt-in."""
    kernel = strict.RawKernel(launch.KERNEL_SOURCE.read_text(), launch.KERNEL_NAME)
    q = strict.asarray(np.ones((1, 1, 4, 16), dtype=np.float32))
    out, lse, status = strict.empty((1, 1, 4, 16), np.float32), strict.empty((1, 1, 4), np.float32), \
        strict.zeros(1, np.int32)
    good = [q, q, q, out, lse, status, np.int32(4), np.int32(4), np.int32(16), np.int32(32), np.int32(1),
            np.float32(0.25)]
    kernel((1, 1, 1), (32,), tuple(good), shared_mem=launch.kernel_smem_bytes(32, 32, 16))
    np.testing.assert_allclose(out.get(), 1.0, atol=1e-6)
    for i, wrong in [(6, 4), (11, 0.25), (6, np.int64(4)), (0, q.get()), (0, q.astype(np.float64)),
                     (0, strict.asarray(np.ones((1, 1, 16, 4), np.float32)).swapaxes(2, 3))]:
        with pytest.raises(TypeError, match=f"kernel argument {i}"):
            kernel((1, 1, 1), (32,), tuple(good[:i] + [wrong] + good[i + 1:]), shared_mem=1024)
    with pytest.raises(RuntimeError, match="opt-in"):
        kernel((1, 1, 1), (32,), tuple(good), shared_mem=64 * 1024)


@needs_gxx
def test_launcher_reads_limits_once_and_never_waits_in_the_forward_pass(monkeypatch, counts):
    """flash_attention_cuda on the device: the opt-in limit is one attribute read per device (not one
    per call, nor every attribute); kernel_attention, the model's path, launches without synchronizing;
    a direct call reads the kernel's status back once. A launcher that synchronized after every launch,
    or queried the device per call, fails here."""
    monkeypatch.setattr(launch, "xp", strict)
    monkeypatch.setattr(launch, "is_gpu", lambda: True)
    monkeypatch.setattr(launch, "_smem_limits", {})
    q, k, v = (strict.asarray(np.ones((1, 2, 8, 16), dtype=np.float32)) for _ in range(3))
    for _ in range(3):
        launch.flash_attention_cuda(q, k, v, True, block_k=8)
    assert counts["attribute_queries"] == 1 and counts["syncs"] == 3  # one status read per direct call
    counts.clear()
    for _ in range(3):
        launch.kernel_attention(q, k, v, True)
    assert counts["syncs"] == 0 and counts["attribute_queries"] == 0


@on_the_stand_in
@needs_gxx
def test_a_decoded_token_costs_few_synchronizations():
    """bench device-calls' count (the kernel's attention): per decoded token, the sampled id is one
    synchronization and the forward pass's token-id range check one more; a loop that copied logits or
    the cache to the host per token, or a launcher that waited per launch, adds more."""
    model = GPT.init(GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=2, n_embd=16), seed=0,
                     attention="cuda")
    cost = per_token(model, 8)
    assert 1 <= cost["syncs"] <= 2, cost
    assert cost["kernels"] < 200, cost  # 115 for this 2-layer model when written


BATCH = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]  # four rows: a per-row pick would wait four times a step


@on_the_stand_in
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_batch_brings_its_next_tokens_down_in_one_transfer(tiny_model, counts, temperature):
    """generate_batch, speculative_generate_batch and the serving engine pick every row's next token
    (greedy: one argmax over the rows on the device; sampled: one copy of the rows' logits) with ONE
    transfer per forward: at most two synchronizations per forward (that transfer and the token-id range
    check) plus the loop's one timing wait per step. Picking row by row (an int() or a logits copy per
    row, as next_token on each device row does) costs B per forward and fails here."""
    draft = GPT.init(GPTConfig(vocab_size=13, block_size=32, n_layer=1, n_head=2, n_embd=16), seed=1)
    batch = generate_batch(tiny_model, BATCH, 6, temperature=temperature)
    assert counts["syncs"] <= 2 * batch.stats.target_calls + 6, dict(counts)
    counts.clear()
    spec = speculative_generate_batch(tiny_model, draft, BATCH, 6, k=3, temperature=temperature)
    forwards = spec.stats.target_calls + spec.stats.draft_calls
    assert counts["syncs"] <= 2 * forwards + len(spec.stats.rounds), dict(counts)
    engine = Engine(tiny_model, num_blocks=40, page_size=4, max_num_batched_tokens=64, clock=SimulatedClock())
    for prompt in BATCH:
        engine.add_request(Request(tuple(prompt), 6, temperature=temperature))
    counts.clear()
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    assert counts["syncs"] <= 2 * steps, dict(counts)
