"""The static decode step (minillm.decode_step) gives generate's greedy tokens, eager and replayed from a graph,
for GPT-2 and Llama; it costs at most 12 launches per layer and 8 around them, and one graph launch per token;
and the strict stand-in's stream capture refuses what a CUDA graph cannot hold, naming the line, and replays
exactly what it recorded (so a position passed as a Python int is replayed stale, as on a GPU)."""

import numpy as np
import pytest

from minillm import GPT, CacheFullError, GPTConfig, KVCache, Llama, LlamaConfig, generate, strict, to_numpy
from minillm.backend import is_gpu, xp
from minillm.decode_step import launch_budget, static_per_token
from minillm.fused import CaptureUnavailable, FusedGPTOps, StaticCache, StaticStep
from minillm.generate import greedy_generate
from minillm.speculative import greedy_speculative_generate

on_the_stand_in = pytest.mark.skipif(xp is not strict, reason="the capture, the counts: MINILLM_BACKEND=strict")
PROMPT = [1, 2, 3, 4, 5]


def tiny_gpt():
    return GPT.init(GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=2, n_embd=16), seed=0)


def tiny_llama():
    return Llama.init(LlamaConfig(vocab_size=17, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                  n_hidden=40), seed=3)


MODELS = {"gpt": tiny_gpt, "llama": tiny_llama}
# On NumPy the static step runs minillm.fused's array references (exercises 12.1, 12.2); Llama's run chapter 8's
# functions, and the reference decoding (generate) chapter 3's cache.
REFERENCES = pytest.mark.uses_exercise("12.1", "12.2", "3.1", "3.3", "8.1", "8.2", "8.3")
ON_A_DEVICE = pytest.mark.skipif(not is_gpu(), reason="a graph needs a device (CuPy, or the strict stand-in)")


@pytest.mark.exercise("12.2")
@REFERENCES
@pytest.mark.parametrize("family", MODELS)
def test_a_step_gives_the_forward_passes_logits(family):
    """Prefill (T = 5) and then a verify-shaped step (T = 3) at positions 5..7 give model.forward's logits for
    the same tokens with a KVCache: the reference."""
    model = MODELS[family]()
    cache, ref_cache = StaticCache(model.config, 1, 10), KVCache(model.config)
    for tokens in (PROMPT, [6, 2, 7]):
        step = StaticStep(model, cache, T=len(tokens))
        step.set_ids([tokens])
        step.step()
        want = to_numpy(model.forward(np.array([tokens]), ref_cache))[0]
        np.testing.assert_allclose(to_numpy(step.logits), want, atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(to_numpy(step.next_ids)[0], want.argmax(-1))
    assert cache.host_lengths.tolist() == [8] and to_numpy(cache.lengths).tolist() == [8]


@pytest.mark.exercise("12.2")
@REFERENCES
@pytest.mark.parametrize("family", MODELS)
def test_a_batch_step_gives_each_rows_own_logits(family):
    """Three rows of different tokens, a prefill (T = 5) and then a T = 3 step: each row's logits are
    model.forward's for that row alone. Fails for keys and values written into another batch row (the
    batch row of token row r is r // T, not r % B)."""
    model = MODELS[family]()
    rows = [[PROMPT, [6, 2, 7]], [[3, 3, 1, 0, 2], [1, 5, 4]], [[7, 1, 6, 2, 4], [0, 0, 3]]]
    cache, ref_caches = StaticCache(model.config, len(rows), 10), [KVCache(model.config) for _ in rows]
    for i in range(2):
        step = StaticStep(model, cache, T=len(rows[0][i]))
        step.set_ids([row[i] for row in rows])
        step.step()
        for b, (row, ref_cache) in enumerate(zip(rows, ref_caches)):
            want = to_numpy(model.forward(np.array([row[i]]), ref_cache))[0]
            got = to_numpy(step.logits).reshape(len(rows), step.T, -1)[b]  # (B * T, V) -> row b's (T, V)
            np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    assert cache.host_lengths.tolist() == [8] * len(rows)


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("graph", [pytest.param(False, marks=REFERENCES), pytest.param(True, marks=ON_A_DEVICE)])
def test_greedy_tokens_equal_generate(family, graph):
    """Greedy decoding on the static steps, eager or replayed from the captured graph, gives exactly
    generate(..., temperature=0)'s tokens."""
    model = MODELS[family]()
    want = generate(model, PROMPT, 12, temperature=0).tokens
    assert greedy_generate(model, PROMPT, 12, graph=graph) == want


def tiny_draft(family):
    """A smaller model of the same vocabulary: a weak draft whose guesses are sometimes right."""
    if family == "gpt":
        return GPT.init(GPTConfig(vocab_size=13, block_size=32, n_layer=1, n_head=2, n_embd=16), seed=5)
    return Llama.init(LlamaConfig(vocab_size=17, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                                  n_hidden=24), seed=4)


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("graph", [pytest.param(False, marks=REFERENCES), pytest.param(True, marks=ON_A_DEVICE)])
def test_speculative_tokens_equal_the_targets_greedy(family, k, graph):
    """A draft's T = 1 step proposes, the target's T = k + 1 step verifies, the lengths roll back: the target's
    own greedy tokens, whatever the draft guesses (a draft that is the target itself accepts every guess)."""
    target = MODELS[family]()
    want = generate(target, PROMPT, 14, temperature=0).tokens
    for draft in (tiny_draft(family), target):
        assert greedy_speculative_generate(target, draft, PROMPT, 14, k=k, graph=graph) == want


@REFERENCES
def test_the_cache_refuses_to_overflow_before_launching():
    model = tiny_gpt()
    cache = StaticCache(model.config, 1, 6)
    step = StaticStep(model, cache, T=5)
    step.set_ids([PROMPT])
    step.step()
    with pytest.raises(CacheFullError, match="max_len=6"):
        step.step()
    assert cache.host_lengths.tolist() == [5]
    with pytest.raises(ValueError, match="token ids"):
        step.set_ids([[0, 1, 2, 3, 13]])
    with pytest.raises(ValueError, match="lengths"):
        cache.set_lengths(7)


def test_the_step_refuses_another_kind_of_model():
    """A model that is neither a GPT nor a Llama: refused with one line before any buffer is made."""
    model = tiny_llama()
    with pytest.raises(TypeError, match="runs a GPT or a Llama, not a Medusa"):
        StaticStep(type("Medusa", (), {"config": object()})(), StaticCache(model.config, 1, 8))


@pytest.mark.uses_exercise("13.1")  # Q4_1.quantize
@pytest.mark.parametrize("graph", [pytest.param(False, marks=REFERENCES), pytest.param(True, marks=ON_A_DEVICE)])
def test_weights_kept_in_blocks_decode_on_the_static_step(graph):
    """A Llama whose matrices stay in Q8_0 / Q4_1 blocks (weights="q", the default load): the step's products,
    embedding and LM head are the blocks' own, and its greedy tokens (and a speculative run's, with a float32 draft
    of the same weights) equal generate's. Fails for a step that multiplies a float32 copy it does not have."""
    from test_quantized_model import TINY, tiny_params

    blocks, dense = tiny_params()
    model = Llama(TINY, blocks)
    want = generate(model, PROMPT, 12, temperature=0).tokens
    assert greedy_generate(model, PROMPT, 12, graph=graph) == want
    assert greedy_speculative_generate(model, Llama(TINY, dense), PROMPT, 12, k=3, graph=graph) == want


@pytest.mark.skipif(is_gpu(), reason="on NumPy")
def test_numpy_has_no_graph():
    step = StaticStep(tiny_gpt(), StaticCache(tiny_gpt().config, 1, 8), T=1)
    with pytest.raises(CaptureUnavailable):
        step.capture()


# ---- what a token costs the device --------------------------------------------------------------------------


@on_the_stand_in
@pytest.mark.parametrize("family", MODELS)
def test_a_decoded_token_fits_the_launch_budget(family):
    """Eager, the fused step launches at most 12 kernels per layer plus 8; captured, a token is one graph launch
    and no kernel launch; either way the host waits once per token (for its id) and copies nothing up."""
    model = MODELS[family]()
    eager = static_per_token(model, 3, graph=False)
    assert eager["kernels"] <= launch_budget(model.config) and eager["graph_launches"] == 0, eager
    assert eager["syncs"] == 1 and eager["copies_to_device"] == 0, eager
    captured = static_per_token(model, 3, graph=True)
    assert captured == {"kernels": 0, "syncs": 1, "copies_to_device": 0, "graph_launches": 1}, captured


# ---- the stand-in's capture: what a graph cannot hold, and what a replay does --------------------------------


def capture(fn):
    """Run fn() inside a capture on a fresh stream -> the graph."""
    stream = strict.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


@on_the_stand_in
@pytest.mark.parametrize("what, fn", [
    ("a synchronization", lambda a: int(a[0])),
    ("a synchronization", lambda a: a.get()),
    ("a Python branch on a device value", lambda a: bool(a[0] > 0)),
    ("a copy from the host", lambda a: a + xp.asarray(np.ones(4, np.float32))),
    ("a host index", lambda a: a[[0, 2]]),
    ("nonzero", lambda a: xp.nonzero(a)),
    ("a boolean mask", lambda a: a[a > 0]),
    ("a stream synchronization", lambda a: xp.cuda.get_current_stream().synchronize()),
])
def test_the_capture_refuses_what_a_graph_cannot_hold(what, fn):
    """Each is refused with a CaptureError that names the operation and the line of this file that did it."""
    a = xp.asarray(np.arange(4, dtype=np.float32))
    with pytest.raises(strict.CaptureError, match=what) as info:
        capture(lambda: fn(a))
    assert "test_decode_step.py" in str(info.value)


@on_the_stand_in
def test_a_kernels_first_launch_cannot_be_recorded():
    """A capture without the warm-up run meets the kernels' compile: refused (StaticStep.capture warms up)."""
    model = tiny_gpt()
    step = StaticStep(model, StaticCache(model.config, 1, 8), T=1)
    from minillm.kernels import launch

    launch._raw_kernels.clear()  # as in a fresh process: nothing compiled yet
    with pytest.raises(strict.CaptureError, match="first launch"):
        capture(step.run)


@on_the_stand_in
def test_a_recording_runs_nothing_until_launched():
    """While recording nothing runs (a new array holds NaN, a written one keeps its old values); each launch
    reruns the recorded kernels on the current contents of the recorded buffers, as one graph launch."""
    a, out = xp.asarray(np.arange(4, dtype=np.float32)), xp.zeros(4, dtype=xp.float32)
    box = {}

    def body():
        box["b"] = a * 2
        out[...] = box["b"] + 1

    graph = capture(body)
    assert np.isnan(box["b"].get()).all() and (out.get() == 0).all()
    graph.launch()
    np.testing.assert_array_equal(out.get(), [1, 3, 5, 7])
    a += 10
    strict.reset_counts()
    graph.launch()
    np.testing.assert_array_equal(out.get(), [21, 23, 25, 27])
    assert strict.COUNTS["graph_launches"] == 1 and strict.COUNTS["kernels"] == 0


@on_the_stand_in
def test_a_position_passed_from_the_host_is_replayed_stale(monkeypatch):
    """Bug zoo: a step that computes its positions from the host's length (a Python int) is right eager, but
    its graph replays the position of the step it recorded at every token: the tokens go wrong. This is why
    StaticStep reads the lengths on the device."""
    model = tiny_gpt()
    model.params["wpe.weight"] *= 30.0  # tokens that depend on their positions
    want = generate(model, PROMPT, 8, temperature=0).tokens
    assert len(set(want)) > 2, want
    real_embed = FusedGPTOps.embed

    def embed_from_host(self, ids, cache):
        real_embed(self, ids, cache)
        self.pos[...] = xp.arange(self.T, dtype=xp.int32) + int(cache.host_lengths[0])  # baked in
        p = self.model.params
        self.x[...] = p["wte.weight"][ids] + p["wpe.weight"][self.pos]  # (1, T, C)
        return self.x

    monkeypatch.setattr(FusedGPTOps, "embed", embed_from_host)
    assert greedy_generate(model, PROMPT, 8, graph=False) == want
    assert greedy_generate(model, PROMPT, 8, graph=True) != want


@REFERENCES
@pytest.mark.slow
def test_the_real_model_decodes_on_the_static_step():
    """SmolLM2-135M (30 layers, GQA 9/3, RoPE at theta 1e5), loaded as by default (its matrices in the file's
    blocks): the static step's greedy tokens equal generate's, through the fused kernels and a captured graph under
    the stand-in (the array references on NumPy)."""
    from minillm import GGUFError
    from minillm.registry import load_model

    try:
        model, _ = load_model("smollm2-135m")
    except GGUFError as exc:
        pytest.skip(str(exc))
    prompt = [1, 504, 3575, 282, 4649, 314]
    assert greedy_generate(model, prompt, 5, graph=is_gpu()) == generate(model, prompt, 5, temperature=0).tokens
