"""The continuous-batching engine (chapter 10): scheduling, chunked prefill, preemption, streaming.

What the tests prove, group by group:
    test_prefill_chunk_*     10.2 the chunk a request feeds in one step
    test_preempt_*           10.3 preemption by recompute: blocks freed, requeued first, tokens kept
    test_serve_*             the engine as a whole (needs 10.1-10.3): for random traces, every request's
                             tokens equal a solo ``generate`` of its prompt with its seed (greedy and
                             sampled; with and without chunking; with preemptions forced by a tiny
                             pool; with prefix caching); the pool is consistent after every step and
                             empty at the end; the budgets hold; FCFS; the newest request is the victim
    test_speculate_*         a lone greedy request decodes by prompt lookup: the same tokens as solo
                             ``generate``, fewer forwards, one token each again beside a second request
    test_request_*, test_engine_*  bad input: clear errors, nothing disturbed
    test_trace_*             the arrival trace, its CSV file format and its bad rows
    test_bench_*             the benchmark's static baseline and its metrics

Each classic mistake of the chapter (tests/fixtures/bug_zoo.py, chapter 10) is caught by one of these.
"""

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import GPT, GPTConfig, generate, serving, to_numpy
from minillm.draft_free import LOOKUP_DRAFT
from minillm.serving import (
    Engine,
    Request,
    SimulatedClock,
    check_stop,
    load_trace,
    poisson_trace,
    prefill_chunk,
    replay,
    save_trace,
)
from minillm.tools.benchmarks import serving as bench

CFG = GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=2, n_embd=16)
MODEL = GPT.init(CFG, seed=0)
BS = 4  # tokens per KV block in these tests


def solo(request: Request) -> list:
    """The reference: ``generate`` alone with the request's settings and seed, cut after a stop."""
    r = request
    tokens = generate(MODEL, list(r.prompt), r.max_new_tokens, r.temperature, r.top_k, r.top_p, seed=r.seed).tokens
    for i in range(len(tokens)):
        if serving.finish_reason(r, tokens[: i + 1]) is not None:
            return tokens[: i + 1]
    return tokens


def run_checked(engine: Engine, requests, arrive_at=None) -> tuple[list, dict]:
    """Add requests at their arrival steps, step until done, checking the pool and the budgets after
    every step -> (handles, streamed tokens per request id)."""
    arrive_at = arrive_at or [0] * len(requests)
    handles, streamed, step = [None] * len(requests), {}, 0
    while step <= max(arrive_at) or engine.has_unfinished:
        for i, r in enumerate(requests):
            if arrive_at[i] == step:
                handles[i] = engine.add_request(r)
                streamed[handles[i].id] = []
        for rid, tokens in engine.step().items():
            assert len(tokens) == 1 or engine.speculate and list(engine.history[-1].scheduled) == [rid]  # alone
            streamed[rid] += tokens
        engine.pool.check()
        step += 1
        assert step < 2000, "the engine does not finish"
    for record in engine.history:
        assert record.num_batched_tokens <= engine.max_num_batched_tokens, record
        assert record.num_running <= engine.max_num_seqs, record
        assert engine.chunk_size is None or max(record.scheduled.values()) <= engine.chunk_size, record
        assert record.blocks_used <= engine.pool.num_blocks
    pool = engine.pool
    assert not pool.block_tables, "a finished request still holds a sequence"
    cached = 0 if engine.prefix is None else len(engine.prefix.held_blocks())
    assert pool.allocator.num_free + cached == pool.num_blocks, "blocks leaked"
    if engine.prefix is not None:
        engine.prefix.clear()
    assert pool.allocator.num_free == pool.num_blocks
    return handles, streamed


# --- 10.2 the chunk ------------------------------------------------------------------------------


@pytest.mark.exercise("10.2")
@pytest.mark.parametrize(
    "pending,budget,chunk,expected",
    [
        (1, 5, None, 1),
        (1, 5, 16, 1),
        (1, 0, None, 0),
        (1, 0, 4, 0),  # a decode
        (40, 64, None, 40),
        (40, 40, None, 40),
        (40, 39, None, 0),  # one shot: all or nothing
        (40, 64, 16, 16),
        (40, 10, 16, 10),
        (7, 64, 16, 7),
        (16, 16, 16, 16),
        (17, 100, 1, 1),
    ],
)
def test_prefill_chunk_examples(pending, budget, chunk, expected):
    """Capped by the chunk size and by the token budget left; without chunking, all or nothing."""
    assert prefill_chunk(pending, budget, chunk) == expected


# --- 10.3 preemption -----------------------------------------------------------------------------


@pytest.mark.exercise("10.3")
def test_preempt_frees_blocks_requeues_first_and_keeps_tokens():
    """A preempted request gives back every block, forgets what its cache held, waits at the FRONT of
    the queue, and keeps its tokens (prompt + output) and its generator (the same object, same state)."""
    engine = Engine(MODEL, num_blocks=8, page_size=BS)
    first, other = engine.add_request(Request((1, 2, 3, 4, 5), 4)), engine.add_request(Request((6,), 2))
    engine.waiting.popleft()
    first.seq_id = engine.pool.add_sequence()
    engine.pool.reserve([first.seq_id], 6)  # as if its prompt and one output token were computed
    first.tokens.append(7)
    first.num_computed = 6
    engine.running.append(first)
    rng, state_before = first.rng, first.rng.bit_generator.state
    engine.preempt(first)
    engine.pool.check()
    assert engine.pool.allocator.num_free == 8 and not engine.pool.block_tables
    assert list(engine.waiting) == [first, other] and engine.running == []
    assert (first.seq_id, first.num_computed, first.num_pending) == (None, 0, 6)
    assert first.tokens == [1, 2, 3, 4, 5, 7] and first.output == [7]
    assert first.rng is rng and first.rng.bit_generator.state == state_before
    assert first.preemptions == 1 and engine.num_preemptions == 1


# --- the engine ----------------------------------------------------------------------------------

TRACE = st.lists(
    st.tuples(st.integers(1, 12), st.integers(1, 10), st.integers(0, 6)), min_size=1, max_size=6
)  # (prompt length, max_new_tokens, arrival step)


def make_requests(shape, seed, temperature=0.0, shared_prefix=False, **kw):
    """Requests of the given (prompt length, max_new_tokens, arrival step) with random prompts; with
    ``shared_prefix`` each prompt starts with a random number of tokens of one common 12-token prompt."""
    rng = np.random.default_rng(seed)
    common = rng.integers(0, CFG.vocab_size, 12)
    requests = []
    for i, (p, n, _) in enumerate(shape):
        prompt = rng.integers(0, CFG.vocab_size, p)
        if shared_prefix:
            k = int(rng.integers(0, p + 1))
            prompt[:k] = common[:k]
        requests.append(Request(tuple(int(t) for t in prompt), n, temperature=temperature, seed=seed + i, **kw))
    return requests, [a for _, _, a in shape]


@pytest.mark.exercise("10.1", "10.2", "10.3")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=TRACE,
    chunk=st.sampled_from([None, 1, 3, 8]),
    num_blocks=st.sampled_from([6, 8, 64]),
    max_num_seqs=st.sampled_from([1, 3, 8]),
    seed=st.integers(0, 100),
)
def test_serve_greedy_equals_solo_generate(shape, chunk, num_blocks, max_num_seqs, seed):
    """Greedy: every request's tokens equal ``generate`` alone, whatever else runs beside it, however
    its prompt is chunked, however often it is preempted; the stream is exactly its output."""
    requests, arrive_at = make_requests(shape, seed)
    budget = 24 if chunk is None else 8
    engine = Engine(
        MODEL,
        num_blocks=num_blocks,
        page_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        chunk_size=chunk,
        clock=SimulatedClock(),
    )
    handles, streamed = run_checked(engine, requests, arrive_at)
    for h, r in zip(handles, requests):
        assert h.output == solo(r) == streamed[h.id]
        assert h.finish_reason == "length"


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.4", "7.1")
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(shape=TRACE, chunk=st.sampled_from([None, 3]), num_blocks=st.sampled_from([6, 10]), seed=st.integers(0, 100))
def test_serve_prefix_caching_random_traces_equal_solo(shape, chunk, num_blocks, seed):
    """Prompts sharing prefixes, with prefix caching, chunking and preemptions together: the same tokens
    as ``generate`` alone; the pool is consistent after every step (cached blocks counted once)."""
    requests, arrive_at = make_requests(shape, seed, shared_prefix=True)
    engine = Engine(
        MODEL,
        num_blocks=num_blocks,
        page_size=BS,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        chunk_size=chunk,
        prefix_caching=True,
        clock=SimulatedClock(),
    )
    handles, streamed = run_checked(engine, requests, arrive_at)
    for h, r in zip(handles, requests):
        assert h.output == solo(r) == streamed[h.id]


@pytest.mark.exercise("10.1", "10.3")
@pytest.mark.uses_exercise("1.1", "3.1", "3.3", "6.1", "7.1")
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(shape=TRACE, chunk=st.sampled_from([None, 2]), seed=st.integers(0, 100))
def test_serve_sampled_equals_solo_with_the_same_seed(shape, chunk, seed):
    """Sampled (temperature 1, top-k 8): request i draws from its own generator, default_rng(seed_i),
    so its tokens equal ``generate(..., seed=seed_i)`` alone, also across preemptions (a resumed
    request never samples an emitted token again, so its generator makes the same draws)."""
    requests, arrive_at = make_requests(shape, seed, temperature=1.0, top_k=8)
    engine = Engine(
        MODEL,
        num_blocks=6,
        page_size=BS,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        chunk_size=chunk,
        clock=SimulatedClock(),
    )
    handles, streamed = run_checked(engine, requests, arrive_at)
    for h, r in zip(handles, requests):
        assert h.output == solo(r) == streamed[h.id]


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.3", "7.1", "9.2", "9.3", "10.1", "10.2", "10.3")
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(shape=TRACE, chunk=st.sampled_from([None, 3]), num_blocks=st.sampled_from([8, 64]),
       prefix=st.booleans(), seed=st.integers(0, 100))
def test_speculate_random_traces_equal_solo(shape, chunk, num_blocks, prefix, seed):
    """With speculation on, greedy: every request's tokens still equal ``generate`` alone (lone requests
    speculate, crowded ones do not, preemptions and prefix caching as they come); the pool is consistent
    after every step and empty at the end."""
    requests, arrive_at = make_requests(shape, seed, shared_prefix=prefix)
    engine = Engine(MODEL, num_blocks=num_blocks, page_size=BS, max_num_batched_tokens=24, max_num_seqs=3,
                    chunk_size=chunk, prefix_caching=prefix, clock=SimulatedClock(), speculate=True)
    handles, streamed = run_checked(engine, requests, arrive_at)
    for h, r in zip(handles, requests):
        assert h.output == solo(r) == streamed[h.id]


REPEATING = Request((2, 11, 2, 2, 11, 2, 2, 11, 2), 10, temperature=0)  # lookup drafts, some rejected


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.3", "7.1", "9.2", "9.3", "10.1", "10.2", "10.3")
def test_speculate_a_lone_request_takes_fewer_forwards_and_stops_where_solo_does():
    """A prompt that repeats itself: the lone request emits several tokens a step, exactly solo's, and
    never more than max_new_tokens; an eos id inside the accepted drafts ends it there."""
    reference = solo(REPEATING)
    engine = Engine(MODEL, num_blocks=32, page_size=BS, clock=SimulatedClock(), speculate=True)
    (h,), streamed = run_checked(engine, [REPEATING])
    assert h.output == reference == streamed[h.id] and h.finish_reason == "length"
    decode_steps = [r for r in engine.history if r.prefill_tokens == 0]
    assert len(decode_steps) < len(reference) - 1, "no step emitted more than one token"
    assert 1 < max(max(r.scheduled.values()) for r in decode_steps) <= LOOKUP_DRAFT + 1  # a chat's chain at most
    eos = Request(REPEATING.prompt, 10, temperature=0, eos_id=reference[3])
    (h,), _ = run_checked(Engine(MODEL, num_blocks=32, page_size=BS, clock=SimulatedClock(), speculate=True), [eos])
    assert h.output == solo(eos) and h.finish_reason == "eos"


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.3", "7.1", "9.2", "9.3", "10.1", "10.2", "10.3")
def test_speculate_drafts_as_a_chat_does():
    """A lone request's lookups draft LOOKUP_DRAFT (5) tokens at most, where ten followed the suffix's earlier
    occurrence; and they start from a suffix of LOOKUP_MIN_NGRAM (2) tokens: where the text's last token occurred
    before but not its last two, its first decode step feeds its one token."""
    rng = np.random.default_rng(1)
    for _ in range(2000):  # a prompt b_0 .. b_10 b_0 whose first greedy token is b_1: ten tokens followed "b_0 b_1"
        b = [int(t) for t in rng.permutation(CFG.vocab_size)[:11]]
        if solo(Request((*b, b[0]), 1, temperature=0)) == [b[1]]:
            break
    else:
        pytest.fail("no prompt of the kind found")
    engine = Engine(MODEL, num_blocks=32, page_size=BS, clock=SimulatedClock(), speculate=True)
    run_checked(engine, [Request((*b, b[0]), 12, temperature=0)])
    assert engine.history[1].prefill_tokens == 0 and max(engine.history[1].scheduled.values()) == LOOKUP_DRAFT + 1
    tested, rng = 0, np.random.default_rng(0)
    for _ in range(2000):
        if tested == 3:
            break
        prompt = tuple(int(t) for t in rng.integers(0, CFG.vocab_size, 5))
        first = solo(Request(prompt, 1, temperature=0))[0]
        if first not in prompt[:-1] or any(prompt[i : i + 2] == (prompt[-1], first) for i in range(4)):
            continue  # the last token after the first output must repeat a lone token of the prompt
        engine = Engine(MODEL, num_blocks=32, page_size=BS, clock=SimulatedClock(), speculate=True)
        run_checked(engine, [Request(prompt, 3, temperature=0)])
        assert engine.history[1].prefill_tokens == 0 and max(engine.history[1].scheduled.values()) == 1
        tested += 1
    assert tested == 3


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.3", "7.1", "9.2", "9.3", "10.1", "10.2", "10.3")
def test_speculate_only_alone_and_only_greedy():
    """Beside a second running request, or sampled, every step feeds one token per request (a batch shares
    the weights' pass already; a sampled request keeps ``generate``'s draws for its seed)."""
    second = Request((7, 8, 9), 12, temperature=0)
    sampled = Request(REPEATING.prompt, 12, temperature=1.0, seed=3)
    engine = Engine(MODEL, num_blocks=64, page_size=BS, max_num_seqs=4, clock=SimulatedClock(), speculate=True)
    handles, _ = run_checked(engine, [REPEATING, second, sampled])
    assert [h.output for h in handles] == [solo(REPEATING), solo(second), solo(sampled)]
    together = [r for r in engine.history if len(r.scheduled) > 1]
    assert together and all(max(r.scheduled.values()) == 1 for r in together if r.prefill_tokens == 0)
    engine = Engine(MODEL, num_blocks=64, page_size=BS, clock=SimulatedClock(), speculate=True)
    (h,), _ = run_checked(engine, [sampled])
    assert h.output == solo(sampled) and all(max(r.scheduled.values()) == 1 for r in engine.history[1:])


@pytest.mark.parametrize("spec_s,expect_speculating", [(0.03, False), (0.015, True)])
def test_speculate_lone_timer_tries_both_ways_then_keeps_the_faster(spec_s, expect_speculating):
    """Speculating steps emit 2 tokens, plain steps 1 in 0.01 s: at 0.03 s a speculating step is slower per
    token, at 0.015 s faster. Both ways run their trial tokens first; then the faster way runs and the
    other one only every LONE_RETRY-th step."""
    timer, ways = serving.LoneTimer(), []
    for _ in range(400):
        ways.append(timer.speculates())
        timer.add(ways[-1], spec_s if ways[-1] else 0.01, 2 if ways[-1] else 1)
    trial = serving.LONE_TRIAL_TOKENS
    assert ways[: trial // 2] == [True] * (trial // 2) and ways[trial // 2 : trial // 2 + trial] == [False] * trial
    later = ways[trial // 2 + trial :]
    other = sum(w != expect_speculating for w in later)
    assert 0 < other <= len(later) // serving.LONE_RETRY + 1


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.3", "7.1", "9.2", "9.3", "10.1", "10.2", "10.3")
def test_speculate_an_engine_that_measured_plain_faster_takes_plain_steps():
    engine = Engine(MODEL, num_blocks=32, page_size=BS, clock=SimulatedClock(), speculate=True)
    for _ in range(200):  # what its clock measured: speculating steps slower per token
        way = engine.lone_timer.speculates()
        engine.lone_timer.add(way, 0.03 if way else 0.01, 2 if way else 1)
    (h,), _ = run_checked(engine, [REPEATING])
    assert h.output == solo(REPEATING)
    assert sum(max(r.scheduled.values()) > 1 for r in engine.history if r.prefill_tokens == 0) <= 1  # a retry


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.3", "7.1", "9.2", "9.3", "10.1", "10.2", "10.3")
def test_speculate_the_check_catches_a_cache_not_truncated(monkeypatch):
    """The classic mistake: the rejected drafts' keys and values stay in the cache; the tokens after
    the first rejection are then not solo's."""
    monkeypatch.setattr(serving.PagedKVCache, "truncate", lambda self, seq_id, n: None)
    engine = Engine(MODEL, num_blocks=32, page_size=BS, clock=SimulatedClock(), speculate=True)
    engine.add_request(REPEATING)
    steps = 0
    while engine.has_unfinished and steps < 100:
        engine.step()
        steps += 1
    assert engine.finished[0].output != solo(REPEATING)


def crowded(temperature):
    """Six requests of 8 prompt + 12 new tokens (5 blocks each at the end) in a pool of 12 blocks:
    they all start, then run out of blocks."""
    requests = [
        Request(tuple((3 * i + j) % CFG.vocab_size for j in range(8)), 12, temperature=temperature, seed=i)
        for i in range(6)
    ]
    return requests, Engine(
        MODEL, num_blocks=12, page_size=BS, max_num_batched_tokens=64, max_num_seqs=6, clock=SimulatedClock()
    )


@pytest.mark.exercise("10.1", "10.3")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_serve_preempts_the_newest_and_resumes_exactly(temperature):
    """When decodes need blocks the pool does not have, the newest running request is preempted (all
    six fit at first, then three or more must go); every preempted request later produces exactly
    the tokens it would have produced alone, and streams no token twice."""
    requests, engine = crowded(temperature)
    handles, streamed = [], {}
    for r in requests:
        handles.append(engine.add_request(r))
    while engine.has_unfinished:
        running_before = [s.id for s in engine.running]
        for rid, tokens in engine.step().items():
            streamed.setdefault(rid, []).extend(tokens)
        engine.pool.check()
        preempted = engine.history[-1].preempted
        if preempted:  # the victims are the newest running requests, newest first
            assert preempted == running_before[::-1][: len(preempted)]
    assert engine.num_preemptions >= 3
    for h, r in zip(handles, requests):
        assert h.output == solo(r) == streamed[h.id]


@pytest.mark.exercise("10.1", "10.2")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_budgets_count_prefill_and_decode_tokens():
    """The token budget holds decode tokens AND prefill tokens: with 3 requests decoding, a 20-token
    prompt gets chunks of at most budget - 3 tokens, and no forward ever holds more than the budget."""
    engine = Engine(
        MODEL,
        num_blocks=64,
        page_size=BS,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        chunk_size=16,
        clock=SimulatedClock(),
    )
    short = [Request((i + 1,), 10) for i in range(3)]
    requests = short + [Request(tuple(range(1, 13)) + tuple(range(1, 9)), 3)]
    handles, _ = run_checked(engine, requests, arrive_at=[0, 0, 0, 2])
    chunks = [r.scheduled[handles[3].id] for r in engine.history if handles[3].id in r.scheduled]
    assert chunks[:3] == [5, 5, 5] and sum(chunks[:4]) == 20  # 8 - 3 decodes, then the rest
    assert max(r.num_batched_tokens for r in engine.history) == 8


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_fcfs_nobody_overtakes_the_head_of_the_queue():
    """Requests start in arrival order: a 16-token prompt that does not fit beside a running decode
    (budget 16) waits, and the one-token request behind it, which would fit, waits too."""
    engine = Engine(
        MODEL, num_blocks=64, page_size=BS, max_num_batched_tokens=16, max_num_seqs=3, clock=SimulatedClock()
    )
    requests = [Request((1, 2), 6), Request(tuple(range(1, 13)) + (1, 2, 3, 4), 1), Request((3,), 2)]
    handles, _ = run_checked(engine, requests)
    starts = [next(i for i, r in enumerate(engine.history) if h.id in r.scheduled) for h in handles]
    assert starts == [0, 6, 7]


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_admits_only_when_the_free_blocks_hold_the_whole_prefill():
    """With chunks of 4, a 16-token prompt (4 blocks) arriving when only 2 blocks are free is not
    admitted, though its first chunk would fit: admitted on one chunk, it would be preempted as soon
    as the running request grows. It starts when the running request has finished; no preemption."""
    engine = Engine(MODEL, num_blocks=6, page_size=BS, max_num_batched_tokens=16, chunk_size=4, clock=SimulatedClock())
    first, second = Request(tuple(range(1, 13)), 8, temperature=0), Request(tuple(range(1, 13)) + (1, 2, 3, 4), 2)
    handles, _ = run_checked(engine, [first, second], arrive_at=[0, 4])
    steps = [[i for i, r in enumerate(engine.history) if h.id in r.scheduled] for h in handles]
    assert steps[1][0] > steps[0][-1] and engine.num_preemptions == 0


@pytest.mark.exercise("10.1", "10.2")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_chunked_and_one_shot_prefill_give_the_same_cache_and_logits(monkeypatch):
    """A 21-token prompt prefilled in one step, or in chunks of 1, 4 and 8 beside another request's
    decodes: the same K/V in the cache (to float32 rounding) and the same first-token logits, equal
    to a forward of the prompt without any cache."""
    seen, sample_next = {}, serving.sample_next

    def recording(states, logits):
        for state, row in zip(states, to_numpy(logits)):
            seen.setdefault(state.request.seed, []).append(row)
        return sample_next(states, logits)

    monkeypatch.setattr(serving, "sample_next", recording)
    prompt = tuple(int(t) for t in np.random.default_rng(3).integers(0, CFG.vocab_size, 21))
    reference = to_numpy(MODEL.forward(np.array([prompt]))[0, -1])
    caches = {}
    for chunk in (None, 1, 4, 8):
        engine = Engine(
            MODEL, num_blocks=32, page_size=BS, max_num_batched_tokens=32, chunk_size=chunk, clock=SimulatedClock()
        )
        engine.add_request(Request((5, 6), 30, temperature=0, seed=100))
        engine.step()
        h = engine.add_request(Request(prompt, 2, temperature=0, seed=chunk or 0))
        while not h.output:
            engine.step()
        caches[chunk] = [np.stack([to_numpy(a) for a in engine.pool.read(h.seq_id, layer)])
                         for layer in range(CFG.n_layer)]
        if chunk is not None:
            assert max(r.scheduled.get(h.id, 0) for r in engine.history) == chunk
        np.testing.assert_allclose(seen[chunk or 0][0], reference, rtol=1e-5, atol=1e-5)
    for chunk in (1, 4, 8):
        for layer in range(CFG.n_layer):
            np.testing.assert_allclose(caches[chunk][layer], caches[None][layer], rtol=1e-5, atol=1e-6)


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.4", "7.1")
def test_serve_prefix_caching_reuses_a_shared_prompt_prefix():
    """Requests sharing a 12-token prefix reuse its cached blocks (fewer tokens computed) and still
    produce exactly the solo tokens; cached blocks nobody holds are counted free at the end."""
    prefix = tuple(range(1, 13))
    requests = [Request(prefix + (i + 1, i + 2), 5, temperature=0) for i in range(4)]
    runs = {}
    for caching in (False, True):
        engine = Engine(
            MODEL,
            num_blocks=24,
            page_size=BS,
            max_num_batched_tokens=32,
            max_num_seqs=2,
            prefix_caching=caching,
            clock=SimulatedClock(),
        )
        handles, _ = run_checked(engine, requests)
        runs[caching] = sum(r.num_batched_tokens for r in engine.history)
        for h, r in zip(handles, requests):
            assert h.output == solo(r)
    assert runs[True] <= runs[False] - 2 * 12  # requests 3 and 4 found the whole prefix cached


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_stops_at_eos_and_stop_sequences():
    """A request finishes after its eos id or after a stop sequence (both kept in the output), freeing
    its blocks at once."""
    base = Request((1, 2, 3), 20, temperature=0)
    free_run = solo(base)
    eos = Request((1, 2, 3), 20, temperature=0, eos_id=free_run[4])
    stop = Request((1, 2, 3), 20, temperature=0, stop=[free_run[5:7], [99 % CFG.vocab_size, 12, 12, 12]])
    engine = Engine(MODEL, num_blocks=32, page_size=BS, clock=SimulatedClock())
    (h_base, h_eos, h_stop), _ = run_checked(engine, [base, eos, stop])
    assert h_base.output == free_run and h_base.finish_reason == "length"
    cut = free_run.index(free_run[4]) + 1
    assert h_eos.output == free_run[:cut] and h_eos.finish_reason == "eos"
    assert h_stop.output == solo(stop) and len(h_stop.output) <= 7 and h_stop.finish_reason == "stop"


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_metrics_on_a_simulated_clock():
    """With a simulated clock of 1 s per step (slot cost 0), one request alone: TTFT 1 s (its prefill
    step), every inter-token latency 1 s, end-to-end n s; arrival times are respected."""
    engine = Engine(MODEL, num_blocks=16, page_size=BS, clock=SimulatedClock(step_s=1.0, slot_s=0.0))
    h = engine.add_request(Request((1, 2, 3), 5, temperature=0))
    assert [t for _, t in engine.stream()] == h.output
    assert h.metrics.ttft_s == 1.0 and h.metrics.itl_s == [1.0] * 4 and h.metrics.e2e_s == 5.0
    clock = SimulatedClock(step_s=0.5, slot_s=0.01)
    handles = replay(
        Engine(MODEL, num_blocks=16, page_size=BS, clock=clock),
        [Request((1, 2), 3), Request((4, 5, 6), 2)],
        arrivals=[0.0, 7.0],
    )
    assert handles[1].metrics.arrival_s == 7.0 and handles[1].metrics.token_times_s[0] > 7.0
    assert handles[0].metrics.token_times_s[-1] < 7.0  # the first was done before the second arrived


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_rejects_a_request_that_can_never_fit_without_disturbing_others():
    """Longer than the context, than the pool, or (without chunking) than the token budget: refused at
    add_request with a clear error; the queued and running requests finish as if it never came."""
    engine = Engine(MODEL, num_blocks=5, page_size=BS, max_num_batched_tokens=16, clock=SimulatedClock())
    ok = [Request((1, 2, 3), 4, temperature=0), Request((4, 5), 6, temperature=0)]
    handles = [engine.add_request(ok[0])]
    engine.step()
    too_long = [
        (Request(tuple([1] * 30), 4), "context of 32"),
        (Request(tuple([1] * 18), 4), "the pool's 5"),
        (Request(tuple([1] * 14), 4), "max_num_batched_tokens=16"),
    ]
    for request, message in too_long:
        with pytest.raises(ValueError, match=message):
            engine.add_request(request)
    handles.append(engine.add_request(ok[1]))
    for _ in engine.stream():
        engine.pool.check()
    assert [h.output for h in handles] == [solo(r) for r in ok] and [h.id for h in handles] == [0, 1]


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(prompt=(1,), max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
        (dict(prompt=(1,), max_new_tokens=-2), ValueError, "max_new_tokens must be >= 1"),
        (dict(prompt=(1,), max_new_tokens=2.5), ValueError, "max_new_tokens must be >= 1 \\(an int"),
        (dict(prompt=(1,), max_new_tokens=True), ValueError, "max_new_tokens must be >= 1 \\(an int"),
        (dict(prompt=(1, -1), max_new_tokens=3), ValueError, "-1 is outside the vocabulary"),
        (dict(prompt=(1, 2.5), max_new_tokens=3), ValueError, "2.5 is not an int"),
        (dict(prompt=(True,), max_new_tokens=3), ValueError, "True is not an int"),
        (dict(prompt=(1,), max_new_tokens=3, eos_id=-1), ValueError, "-1 is outside the vocabulary"),
        (dict(prompt=(), max_new_tokens=3), ValueError, "at least one token"),
        (dict(prompt="ROMEO", max_new_tokens=3), TypeError, "token ids"),
        (dict(prompt=(1,), max_new_tokens=3, stop="END"), TypeError, "list of token-id sequences"),
        (dict(prompt=(1,), max_new_tokens=3, stop=["END"]), TypeError, "unknown stop condition 'END'"),
        (dict(prompt=(1,), max_new_tokens=3, stop=[[]]), TypeError, "unknown stop condition"),
        (dict(prompt=(1,), max_new_tokens=3, stop=[[1, -1]]), TypeError, "unknown stop condition"),
        (dict(prompt=(1,), max_new_tokens=3, stop=[[1, True]]), TypeError, "unknown stop condition"),
        (dict(prompt=(1,), max_new_tokens=3, temperature=-1), ValueError, "temperature"),
        (dict(prompt=(1,), max_new_tokens=3, top_p=0), ValueError, "top_p"),
    ],
)
def test_request_bad_input_is_a_clear_error(kwargs, error, message):
    """Each bad argument is refused when the request is made, with a message naming it. Catches a
    check of the largest id only (a -1 slipped through), ``int()`` rounding a float id or count
    (2.5 -> 2), and a bool taken for a count or an id (True -> 1)."""
    with pytest.raises(error, match=message):
        Request(**kwargs)


def test_request_stop_sequences_are_normalized():
    assert check_stop([[3, 4], (7,)]) == ((3, 4), (7,))
    assert Request((1,), 2, stop=[[np.int64(3)]]).stop == ((3,),)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_blocks=0), "num_blocks must be >= 1"),
        (dict(page_size=-1), "page_size must be >= 1"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
        (dict(chunk_size=0), "chunk_size must be >= 1"),
    ],
)
def test_engine_bad_budgets_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, **{"num_blocks": 8, **kwargs})


def test_engine_refuses_ids_outside_the_vocabulary_changing_nothing():
    """An id past the vocabulary in the prompt, the eos id or a stop sequence is refused by add_request
    (a stop sequence of such ids could never match), and the engine is as it was."""
    engine = Engine(MODEL, num_blocks=8, page_size=BS)
    for request in (Request((1, 13), 2), Request((1,), 2, eos_id=13), Request((1,), 2, stop=[[2, 13]])):
        with pytest.raises(ValueError, match="token ids must lie in 0..12"):
            engine.add_request(request)
    assert not engine.has_unfinished and not engine.pool.block_tables


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_refuses_a_negative_id_and_the_request_beside_it_finishes():
    """A prompt with a negative id (or one past the vocabulary, as numpy ints) never reaches the
    queue: with only the largest id checked, it was admitted and every later step failed in the
    forward, so the valid request beside it never finished and kept its blocks."""
    engine = Engine(MODEL, num_blocks=8, page_size=BS, clock=SimulatedClock())
    ok = Request((1, 2, 3), 4, temperature=0)
    handle = engine.add_request(ok)
    for bad in ((5, -1, 2), np.array([4, -3]), np.array([2, 13])):
        with pytest.raises(ValueError, match="token ids must"):
            engine.add_request(Request(bad, 3))
    for _ in engine.stream():
        engine.pool.check()
    assert handle.output == solo(ok) and handle.finish_reason == "length"
    assert not engine.pool.block_tables and engine.pool.allocator.num_free == engine.pool.num_blocks


def check_abort_returns_every_block(prefix_caching: bool) -> None:
    """abort(id) removes a waiting, running (mid-prefill or decoding) or preempted request and gives
    its blocks back: after aborting 24 requests at every stage the pool checks clean and holds no
    block (a leak, or a double free, fails ``pool.check``); the request left alone still produces
    exactly its solo tokens; an unknown or already aborted id is a KeyError."""
    rng = np.random.default_rng(5)
    engine = Engine(MODEL, num_blocks=12, page_size=BS, max_num_batched_tokens=12, max_num_seqs=6,
                    chunk_size=5, prefix_caching=prefix_caching, clock=SimulatedClock())
    keep = Request((7, 1, 2, 3, 4, 5), 6, temperature=0)
    kept = engine.add_request(keep)
    handles = [engine.add_request(Request(tuple(int(t) for t in rng.integers(0, 13, rng.integers(1, 12))),
                                          int(rng.integers(1, 10)), seed=i)) for i in range(24)]
    stages = set()
    for i, state in enumerate(rng.permutation(handles)):
        for _ in range(i % 3):
            engine.step()
            engine.pool.check()
        if not state.finished:
            stages.add("running" if state in engine.running else "preempted" if state.preemptions else "waiting")
            assert engine.abort(state.id) is state and state.finish_reason == "abort"
            engine.pool.check()
            assert state not in engine.running and state not in engine.waiting and state.seq_id is None
            with pytest.raises(KeyError, match=f"request {state.id} is neither waiting nor running"):
                engine.abort(state.id)
    assert {"running", "waiting"} <= stages
    for _ in engine.stream():
        engine.pool.check()
    assert kept.output == solo(keep)
    with pytest.raises(KeyError, match="request 999"):
        engine.abort(999)
    assert not engine.pool.block_tables
    if engine.prefix is not None:
        engine.prefix.clear()
    assert engine.pool.allocator.num_free == engine.pool.num_blocks, "blocks leaked"


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_abort_returns_every_block():
    """``check_abort_returns_every_block``: 24 requests aborted at every stage, none leaks a block."""
    check_abort_returns_every_block(prefix_caching=False)


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.4", "7.1")
def test_serve_prefix_caching_abort_returns_every_block():
    """The same with prefix caching: an aborted request's shared prefix blocks stay the cache's, once."""
    check_abort_returns_every_block(prefix_caching=True)


# --- traces --------------------------------------------------------------------------------------


def test_trace_is_seeded_poisson_and_round_trips_through_csv(tmp_path):
    """Same seed, same trace; arrivals increase with mean gap 1 / rate; lengths within bounds; the
    CSV file reads back to the same rows."""
    a, b = (
        poisson_trace(400, rate=4.0, mean_prompt=20, mean_output=10, max_tokens=64, seed=1),
        poisson_trace(400, rate=4.0, mean_prompt=20, mean_output=10, max_tokens=64, seed=1),
    )
    assert a == b and a != poisson_trace(400, 4.0, 20, 10, 64, seed=2)
    arrivals = np.array([r.arrival_s for r in a])
    assert (np.diff(arrivals) >= 0).all() and 0.2 < np.diff(arrivals).mean() < 0.3
    assert all(1 <= r.prompt_tokens and 1 <= r.output_tokens and r.prompt_tokens + r.output_tokens <= 65 for r in a)
    save_trace(a, tmp_path / "t.csv")
    assert load_trace(tmp_path / "t.csv") == a


@pytest.mark.parametrize(
    "body,message",
    [
        ("0.5,3,4\n0.25,3,4\n", "line 3: arrival 0.25"),
        ("0.5,3\n", "line 2: 2 fields"),
        ("0.5,three,4\n", "line 2: invalid literal"),
        ("0.5,3,0\n", "line 2: prompt_tokens and output_tokens"),
        ("nan,3,4\n", "line 2: arrival nan"),
    ],
)
def test_trace_bad_rows_name_their_line(tmp_path, body, message):
    path = tmp_path / "bad.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + body)
    with pytest.raises(ValueError, match=message):
        load_trace(path)
    path.write_text("when,prompt,output\n0,1,1\n")
    with pytest.raises(ValueError, match="line 1 must be the header"):
        load_trace(path)


def test_trace_rows_fit_a_context():
    rows = poisson_trace(200, rate=1.0, mean_prompt=30, mean_output=30, max_tokens=32, seed=0)
    assert all(r.prompt_tokens + r.output_tokens - 1 <= 32 for r in rows)


# --- the benchmark's pieces ----------------------------------------------------------------------


@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "6.3", "7.1", "9.2", "9.3", "10.1", "10.2", "10.3")
def test_bench_serve_speculation_runs_a_request_alone_both_ways():
    from minillm.tools.benchmarks.serve_speculation import new_engine, run_alone

    plain, spec = new_engine(MODEL, 32, False), new_engine(MODEL, 32, True, always=True)
    for _ in range(3):  # the engines are kept from request to request; --always speculates past the trial too
        out, plain_steps = run_alone(plain, list(REPEATING.prompt), 10)
        assert out == solo(REPEATING) and plain_steps == 9
        out, spec_steps = run_alone(spec, list(REPEATING.prompt), 10)
        assert out == solo(REPEATING) and spec_steps < plain_steps
    assert not plain.running and not spec.finished


@pytest.mark.uses_exercise("3.1", "3.3")
def test_bench_static_baseline_waits_for_full_batches_and_the_slowest_member():
    """Static batching on a simulated clock: a batch starts when its last member has arrived, every
    member gets its tokens (those of ``generate`` alone) when the batch's slowest member is done, and
    the batch pays for its padded prefill and its longest member's decodes."""
    requests = [Request(prompt, n, temperature=0) for prompt, n in [((1, 2, 3), 2), ((4,), 5), ((5, 6), 3)]]
    clock = SimulatedClock(step_s=1.0, slot_s=0.0)
    outputs, metrics = bench.run_static(MODEL, requests, [0.0, 2.0, 3.0], batch_size=2, clock=clock)
    assert outputs == [solo(r) for r in requests]
    assert bench.static_slots([3, 1], 5) == [6, 2, 2, 2, 2]
    assert [m.token_times_s for m in metrics] == [[7.0], [7.0], [10.0]]  # 2 + 5 steps; then 7 + 3 steps
    assert [m.ttft_s for m in metrics] == [m.e2e_s for m in metrics] == [7.0, 5.0, 7.0]


def test_bench_stall_itls_are_the_gaps_ending_during_a_long_prefill():
    """A long request (prompt >= 5 tokens) waits from t=2 to its first token at t=4: the other
    request's gaps that end in [2, 4] are the stall gaps."""
    long_request, short = Request((1,) * 5, 2), Request((1,), 4)
    metrics = [serving.RequestMetrics(2.0, [4.0, 4.5]), serving.RequestMetrics(0.0, [1.0, 1.5, 3.5, 4.0])]
    assert bench.stall_itls(metrics, [long_request, short], long_prompt=5) == [2.0, 0.5]
    row = bench.summarize("x", [[1, 2], [1, 2, 3, 4]], metrics, [long_request, short], long_prompt=5)
    assert row["max ITL in long prefill ms"] == 2000.0 and row["tok/s"] == 6 / 4.5


@pytest.mark.exercise("10.1")
@pytest.mark.uses_exercise("3.1", "3.3", "6.1", "7.1")
def test_serve_demo_prints_progress_and_every_requests_metrics():
    """The live demo on the shipped model: a status line, then one row per request."""
    out = io.StringIO()
    assert bench.demo(["--requests", "3", "--rate", "50", "--chunk", "8"], out=out) == 0
    text = out.getvalue()
    assert "running" in text and "TTFT ms" in text and "preempted" in text
    assert len([line for line in text.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]) == 3
