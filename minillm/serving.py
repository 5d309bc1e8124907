"""Continuous batching: a serving engine that admits, runs, preempts and retires requests every step.

Static batching (chapter 7's ``generate_batch``) starts B requests together and holds the batch until
its slowest member is done: a short request waits for a long one, and a request that arrives one
step late waits for the whole batch. Iteration-level scheduling (Orca, Yu et al., OSDI 2022) decides
the batch again at every step; on a paged KV cache (chapter 6) a request holds only the blocks its
tokens fill, so many more fit at once (vLLM, Kwon et al., SOSP 2023).

One ``Engine.step()``, the vLLM / nano-vllm scheduler in four passes:

    (a) schedule  running requests first, oldest first: each gets its next tokens (1 when decoding, a
                  chunk when prefilling) within the token budget; when the pool has no block for
                  them, the NEWEST running request is preempted. Then waiting requests are admitted
                  first-come first-served while the token budget (``max_num_batched_tokens``: prefill
                  AND decode tokens), the sequence budget (``max_num_seqs``) and free blocks allow.
    (b) forward   ONE ragged forward (``forward_ragged``) holds every scheduled request's tokens.
    (c) sample    a request whose cache now holds all its tokens samples its next token from its own
                  generator (``numpy.random.default_rng(request.seed)``, exactly as ``generate`` does).
    (d) retire    a request that reached max_new_tokens, its eos id or a stop sequence is finished and
                  its blocks are freed.

A request is a token list (prompt + output so far) and ``num_computed``, how many of them its cache
holds. Prefill, chunked prefill, decode and resuming after preemption are all one rule: feed the
next tokens up to the end of the list; when the cache holds them all, the last logits give a token.

    fresh request    [p0 p1 p2 p3 p4]          num_computed 0  -> feed p0..p4 (in chunks of at most C)
    decoding         [p0 .. p4 o0 o1]          num_computed 6  -> feed o1, sample o2
    preempted        blocks freed, num_computed 0, back to the FRONT of the waiting queue; on resume it
                     feeds p0..o1 again (recompute) and samples o2 with the same generator: the tokens
                     already emitted are never sampled again, so it produces exactly what it would have.

Speculation for a lone request (``speculate=True``): when one greedy request is running and none is
waiting, a step feeds its last token and up to ``LOOKUP_DRAFT`` (5) tokens prompt lookup copies from earlier
in its text where its last 2 or more tokens occurred before (chapter 9's search, ``long_ngram_lookup``, as a
chat's lookup drafts), takes the target's greedy walk over them (``verify_tree_greedy``) and truncates the
cache past the last accepted one: several tokens from one forward, and exactly the tokens plain steps give.
A verify of 6 tokens costs nearly two decode steps on a CPU, so the engine times its lone steps both ways on
its clock (``LoneTimer``) and speculates only while that measures faster. With a second request the batch
is back to one token each (a batch's forward already shares the weights' pass; chapter 7).

Chunked prefill (Sarathi-Serve, Agrawal et al., OSDI 2024): a long prompt fed in one step makes every
running request wait for that whole prefill (a long gap between two of their tokens); fed C tokens
at a time, each chunk rides along with the decodes.

The pool is made, and the prefix-block cache and the sampler are reached, through the functions of
the section "touch points" below. The engine changes the pool (chapter 6) itself with five calls:
``add_sequence`` and ``reserve`` in ``_admit``, ``reserve`` in ``_reserve``, ``free`` in ``release``,
``truncate`` in ``_speculative_step``;
it also reads the pool's sizes and hands it to ``forward_ragged``. Every block a request holds goes
back through ``release``: when it finishes, is preempted or is aborted.
"""

from __future__ import annotations

import csv
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .backend import synchronize, to_numpy
from .batch_speculative import forward_ragged, last_logits
from .config import check_count, is_int
from .draft_free import LOOKUP_DRAFT, LOOKUP_MIN_NGRAM, MAX_NGRAM, long_ngram_lookup
from .paged_kv import OutOfBlocksError, PagedKVCache, num_blocks_for
from .prefix_blocks import PrefixBlockCache
from .sampling import SamplingSettings, next_tokens
from .token_tree import TokenTree, verify_tree_greedy
from .tokenizer import check_ids

# --- touch points: the paged cache and the sampler -------------------------------------------------


def make_pool(config, num_blocks: int, page_size: int, prefix_caching: bool):
    """The engine's one KV pool -> (pool of num_blocks blocks of page_size tokens, shared by all
    requests; its PrefixBlockCache, or None without prefix caching)."""
    pool = PagedKVCache(config, num_blocks=num_blocks, page_size=page_size)
    return pool, (PrefixBlockCache(pool) if prefix_caching else None)


def reuse_prefix(prefix: PrefixBlockCache | None, seq_id: int, tokens) -> int:
    """Point an empty sequence at the cached blocks of its tokens' prefix -> tokens reused (0 without
    prefix caching). ``remember_prefix`` makes a computed prompt's full blocks findable."""
    return 0 if prefix is None else prefix.share(seq_id, tokens)


def remember_prefix(prefix: PrefixBlockCache | None, seq_id: int, prompt) -> None:
    if prefix is not None:
        prefix.store(seq_id, prompt)


def sample_next(states: list, logits) -> list[int]:
    """Each request's next token from its last logits (B, V), with its own settings and generator, all
    rows with one transfer to the host (``next_tokens``)."""
    return next_tokens(logits, [s.request.settings for s in states], [s.rng for s in states])


# --- requests --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """What a client asks for: a prompt, how many tokens at most, when to stop, how to sample.

    ``stop``: token-id sequences; the request finishes after the token that completes one (the
    sequence is part of the output). ``eos_id``: a token that finishes it (also kept). ``seed``: its
    generator is ``numpy.random.default_rng(seed)``, so greedy or sampled, it produces the tokens of
    ``generate(model, prompt, max_new_tokens, temperature, top_k, top_p, seed)`` (cut at a stop).
    """

    prompt: tuple
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    eos_id: int | None = None
    stop: tuple = ()
    settings: SamplingSettings = field(init=False, repr=False, compare=False)  # checked once, from the three above

    def __post_init__(self):
        if isinstance(self.prompt, (str, bytes)):
            raise TypeError("the prompt must be token ids (encode text with the tokenizer first)")
        object.__setattr__(self, "prompt", tuple(check_ids(self.prompt)))  # ints >= 0; the engine knows V
        if not self.prompt:
            raise ValueError("the prompt must contain at least one token")
        object.__setattr__(self, "max_new_tokens", check_count("max_new_tokens", self.max_new_tokens, 1))
        check_ids([] if self.eos_id is None else [self.eos_id])
        object.__setattr__(self, "settings", SamplingSettings(self.temperature, self.top_k, self.top_p))
        object.__setattr__(self, "stop", check_stop(self.stop))

    @property
    def max_cached_tokens(self) -> int:
        """Tokens its cache holds at the end: the prompt and every output token but the last (never fed)."""
        return len(self.prompt) + self.max_new_tokens - 1


def check_stop(stop) -> tuple:
    """Stop sequences -> a tuple of non-empty tuples of token ids; anything else is a clear error.

    Example: [[3, 4], (7,)] -> ((3, 4), (7,)); "END" -> TypeError (encode strings first).
    """
    if isinstance(stop, (str, bytes)) or not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a list of token-id sequences, got {stop!r}")
    out = []
    for s in stop:
        if isinstance(s, (str, bytes)) or not isinstance(s, (list, tuple)) or not s:
            raise TypeError(f"unknown stop condition {s!r}: a stop sequence is a non-empty list of token ids")
        if not all(is_int(t) and t >= 0 for t in s):
            raise TypeError(f"unknown stop condition {s!r}: a stop sequence holds token ids (ints >= 0)")
        out.append(tuple(int(t) for t in s))
    return tuple(out)


@dataclass
class RequestMetrics:
    """Times of one request on the engine's clock (seconds): arrival, each token, and what follows."""

    arrival_s: float
    token_times_s: list = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        """Time to first token: first token time - arrival (includes the wait in the queue)."""
        return self.token_times_s[0] - self.arrival_s

    @property
    def itl_s(self) -> list:
        """Inter-token latencies: the gaps between consecutive tokens."""
        return list(np.diff(self.token_times_s))

    @property
    def e2e_s(self) -> float:
        """End-to-end latency: last token time - arrival."""
        return self.token_times_s[-1] - self.arrival_s


@dataclass
class RequestState:
    """The handle ``add_request`` returns: a request's progress inside the engine.

    ``tokens`` = prompt + output; the cache holds the first ``num_computed`` of them.
    """

    id: int
    request: Request
    rng: np.random.Generator
    metrics: RequestMetrics
    tokens: list
    num_computed: int = 0
    seq_id: int | None = None  # its sequence in the pool while it holds blocks
    finish_reason: str | None = None
    preemptions: int = 0

    @property
    def output(self) -> list:
        return self.tokens[len(self.request.prompt) :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_pending(self) -> int:
        """Tokens to feed before the next token can be sampled (1 when decoding)."""
        return len(self.tokens) - self.num_computed


def finish_reason(request: Request, output) -> str | None:
    """Why a request with this output is done, or None: "length", "eos" or "stop"."""
    if request.eos_id is not None and output[-1] == request.eos_id:
        return "eos"
    if any(tuple(output[-len(s) :]) == s for s in request.stop if len(output) >= len(s)):
        return "stop"
    return "length" if len(output) >= request.max_new_tokens else None


# --- clocks ----------------------------------------------------------------------------------------


class RealClock:
    """Wall time (``time.perf_counter``); a step takes as long as it takes."""

    def now(self) -> float:
        return time.perf_counter()

    def advance(self, padded_slots: int) -> None:
        synchronize()  # the step's time has passed on its own; wait for the device to finish it

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


@dataclass
class SimulatedClock:
    """A clock that a step advances by a cost model: step_s + slot_s x (rows x columns of its forward).

    The forward of a ragged batch computes every padded slot, so its cost follows B x max n_b, not
    the number of real tokens. Deterministic: tests and the notebook get the same times every run.
    """

    step_s: float = 0.01  # fixed cost of one forward (weights read, Python overhead)
    slot_s: float = 0.001  # cost per (row, column) slot of the padded batch
    t: float = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, padded_slots: int) -> None:
        """One forward of padded_slots (rows x columns) has run."""
        self.t += self.step_s + self.slot_s * padded_slots

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


# --- the engine ------------------------------------------------------------------------------------

LONE_TRIAL_TOKENS = 32  # tokens of a lone request's steps each way before the faster way is picked
LONE_RETRY = 16  # then every 16th lone step goes the other way, so a change of workload is seen
LONE_DECAY = 0.98  # the seconds and tokens behind each rate fade by this at every step of their way


class LoneTimer:
    """Seconds per token of a lone greedy request's decode steps, plain and speculating, on the engine's clock:
    each way first runs ``LONE_TRIAL_TOKENS`` tokens, then the faster one runs, the other every ``LONE_RETRY``-th
    step (the rates are decayed sums, so they follow the workload)."""

    def __init__(self):
        self.seconds, self.tokens, self.trial, self.steps = [0.0, 0.0], [0.0, 0.0], [0, 0], 0

    def speculates(self) -> bool:
        self.steps += 1
        if min(self.trial) < LONE_TRIAL_TOKENS:
            return self.trial[1] < LONE_TRIAL_TOKENS
        faster = self.seconds[1] / self.tokens[1] < self.seconds[0] / self.tokens[0]
        return faster != (self.steps % LONE_RETRY == 0)

    def add(self, speculated: bool, seconds: float, tokens: int) -> None:
        way = int(speculated)
        self.seconds[way] = self.seconds[way] * LONE_DECAY + seconds
        self.tokens[way] = self.tokens[way] * LONE_DECAY + tokens
        self.trial[way] += tokens



def prefill_chunk(num_pending: int, budget_left: int, chunk_size: int | None) -> int:
    """Tokens a request feeds this step: at most chunk_size, within the token budget; 0 = not now.

    Without chunking (chunk_size None) a prefill is all or nothing. Examples: (1, 5, None) -> 1
    (a decode); (40, 64, 16) -> 16; (40, 10, 16) -> 10; (40, 10, None) -> 0; (7, 64, 16) -> 7.
    """
    # EXERCISE 10.2 BEGIN: the chunk a request feeds: capped by chunk_size and by the budget left
    if chunk_size is None:
        return num_pending if num_pending <= budget_left else 0
    return min(num_pending, chunk_size, budget_left)
    # EXERCISE 10.2 END


@dataclass
class StepRecord:
    """What one step did: for the budgets' tests, the timelines and the plots."""

    time_s: float  # clock after the step
    scheduled: dict  # request id -> tokens fed this step
    prefill_tokens: int  # fed tokens that produced no output token (prompt chunks, recompute)
    num_running: int
    num_waiting: int
    blocks_used: int  # blocks held by sequences (cached prefix blocks nobody holds are not counted)
    preempted: list  # ids preempted this step
    padded_slots: int  # rows x columns of the ragged forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.scheduled.values())


class Engine:
    """Continuous batching over one PagedKVCache: add_request, then step() until idle.

    ``max_num_batched_tokens``: tokens (prefill + decode) in one forward; ``max_num_seqs``: requests
    running at once; ``chunk_size``: the most prompt tokens a request feeds in one step (None: a
    prompt is prefilled in one step, so it must fit the token budget); ``speculate``: a lone greedy
    request decodes by prompt lookup (``_speculative_step``).
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        page_size: int = 16,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 16,
        chunk_size: int | None = None,
        prefix_caching: bool = False,
        clock=None,
        speculate: bool = False,
    ):
        for name, value in [
            ("num_blocks", num_blocks),
            ("page_size", page_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ]:
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if chunk_size is not None and int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None: no chunking), got {chunk_size}")
        self.model = model
        self.pool, self.prefix = make_pool(model.config, num_blocks, page_size, prefix_caching)
        self.max_num_batched_tokens, self.max_num_seqs = int(max_num_batched_tokens), int(max_num_seqs)
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        self.clock = RealClock() if clock is None else clock
        self.speculate = bool(speculate)
        self.lone_timer = LoneTimer()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # in admission order: the newest last
        self.finished: dict[int, RequestState] = {}
        self.history: list[StepRecord] = []
        self.num_preemptions = 0
        self._next_id = 0

    # -- requests in --
    def add_request(self, request: Request, arrival_s: float | None = None) -> RequestState:
        """Queue a request -> its handle. One that could never run is refused here, changing nothing."""
        self.check_fits(request)
        state = RequestState(
            id=self._next_id,
            request=request,
            rng=np.random.default_rng(request.seed),
            metrics=RequestMetrics(self.clock.now() if arrival_s is None else arrival_s),
            tokens=list(request.prompt),
        )
        self._next_id += 1
        self.waiting.append(state)
        return state

    def check_fits(self, request: Request) -> None:
        """Raise ValueError if the request could never run, even alone: ids outside the vocabulary,
        more tokens than the context or the pool holds, or (no chunking) a prefill over the budget."""
        V, n = self.model.config.vocab_size, request.max_cached_tokens
        eos = [] if request.eos_id is None else [request.eos_id]
        check_ids([*request.prompt, *eos, *(t for s in request.stop for t in s)], V)  # every id the request holds
        if n > self.pool.max_len:
            raise ValueError(
                f"request too long: {len(request.prompt)} prompt + {request.max_new_tokens} new "
                f"tokens need {n} cached tokens > the context of {self.pool.max_len}"
            )
        blocks = num_blocks_for(n, self.pool.page_size)
        if blocks > self.pool.num_blocks:
            raise ValueError(
                f"request too long: {n} cached tokens need {blocks} blocks > the pool's {self.pool.num_blocks}"
            )
        if self.chunk_size is None and n > self.max_num_batched_tokens:
            raise ValueError(
                f"request too long: without chunking its prefill (up to {n} tokens after a "
                f"preemption) must fit max_num_batched_tokens={self.max_num_batched_tokens}"
            )

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: int) -> RequestState:
        """Remove a waiting or running request (a client that went away) -> its handle, finish_reason
        "abort". A running request's blocks go back to the pool (``release``); a waiting one holds none."""
        for state in [*self.running, *self.waiting]:
            if state.id == request_id:
                break
        else:
            raise KeyError(f"request {request_id} is neither waiting nor running (finished, aborted or never added)")
        if state in self.running:
            self.running.remove(state)
            self.release(state)
        else:
            self.waiting.remove(state)
        state.finish_reason = "abort"
        return state

    # -- (a) scheduling --
    def _reserve(self, state: RequestState, n: int, preempted: list) -> bool:
        """Blocks for n more tokens of a running request, preempting the newest running requests as
        needed (their ids go to ``preempted``) -> False if the request itself had to be preempted."""
        while True:
            try:
                self.pool.reserve([state.seq_id], n)
                return True
            except OutOfBlocksError:
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim.id)
                if victim is state:
                    return False

    def release(self, state: RequestState) -> None:
        """Give a request's blocks back to the pool and forget what its cache held (its tokens stay)."""
        self.pool.free(state.seq_id)
        state.seq_id, state.num_computed = None, 0

    def preempt(self, state: RequestState) -> None:
        """Preemption by recompute: free the request's blocks; it waits at the front of the queue."""
        # EXERCISE 10.3 BEGIN: release its blocks (``release``), requeue it first; keep its tokens and rng
        self.running.remove(state)
        self.release(state)
        self.waiting.appendleft(state)
        # EXERCISE 10.3 END
        state.preemptions += 1
        self.num_preemptions += 1

    def _admit(self, state: RequestState, budget_left: int) -> int:
        """Start a waiting request: a sequence, its cached prefix, blocks for its first chunk -> tokens
        scheduled, or 0 (then nothing changed). Admitted only if the free blocks hold its whole
        prefill, not just the first chunk (vLLM's rule): a request admitted on its first chunk alone
        would soon be preempted again, its chunks recomputed for nothing."""
        state.seq_id = self.pool.add_sequence()
        state.num_computed = reuse_prefix(self.prefix, state.seq_id, state.tokens)
        n = prefill_chunk(state.num_pending, budget_left, self.chunk_size)
        held = len(self.pool.block_tables[state.seq_id])  # blocks of its cached prefix
        if n and num_blocks_for(len(state.tokens), self.pool.page_size) - held <= self.pool.num_free_blocks:
            try:
                self.pool.reserve([state.seq_id], n)
                return n
            except OutOfBlocksError:
                pass
        self.release(state)
        return 0

    def schedule(self) -> tuple[dict, list]:
        """Pass (a): -> ({request id: tokens to feed}, ids preempted). Blocks are reserved here."""
        scheduled, preempted, budget = {}, [], self.max_num_batched_tokens
        i = 0
        while i < len(self.running):  # running requests first, oldest first (a victim is always behind i)
            state = self.running[i]
            n = prefill_chunk(state.num_pending, budget, self.chunk_size)
            if n and self._reserve(state, n, preempted):
                scheduled[state.id] = n
                budget -= n
            i += 1
        # EXERCISE 10.1 BEGIN: admit waiting requests first come, first served, while the budgets allow
        while self.waiting and not preempted and len(self.running) < self.max_num_seqs:
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                break  # FCFS: nobody overtakes the request at the head of the queue
            state = self.waiting.popleft()
            self.running.append(state)
            scheduled[state.id] = n
            budget -= n
        # EXERCISE 10.1 END
        return scheduled, preempted

    # -- one step: (a) schedule, (b) forward, (c) sample, (d) retire --
    def step(self) -> dict:
        """Run one iteration -> {request id: [new tokens]} (one each; several for a lone request that
        speculates; {} when nothing ran)."""
        lone = self.running[0] if self.speculate and len(self.running) == 1 and not self.waiting else None
        if lone is None or lone.num_pending != 1 or not lone.request.settings.greedy:
            return self._step()
        t0 = self.clock.now()  # a lone decode step: timed, plain or speculating (``LoneTimer``)
        room = lone.request.max_new_tokens - len(lone.output) - 1  # its last token is the target's own
        drafts = (long_ngram_lookup(lone.tokens, LOOKUP_MIN_NGRAM, MAX_NGRAM, LOOKUP_DRAFT)[:room]
                  if self.lone_timer.speculates() else [])
        new = self._speculative_step(lone, drafts) if drafts else self._step()
        self.lone_timer.add(bool(drafts), self.clock.now() - t0, len(new.get(lone.id, [])))
        return new

    def _step(self) -> dict:
        """Passes (a) to (d) for every running request, one token each."""
        scheduled, preempted = self.schedule()
        if not scheduled:
            if self.has_unfinished:
                raise RuntimeError("the scheduler made no progress with requests queued")
            return {}
        batch = [s for s in self.running if s.id in scheduled]
        feeds = [s.tokens[s.num_computed : s.num_computed + scheduled[s.id]] for s in batch]
        rows = forward_ragged(self.model, self.pool, [s.seq_id for s in batch], feeds)  # (b): ONE forward
        sampling, prefill = [], 0
        for state, logits in zip(batch, rows):
            computed_before = state.num_computed
            state.num_computed += len(logits)
            if computed_before < len(state.request.prompt):
                remember_prefix(self.prefix, state.seq_id, state.request.prompt)
            if state.num_pending == 0:  # (c) its cache holds every token: it samples the next one
                sampling.append((state, logits))
                prefill += len(logits) - 1
            else:
                prefill += len(logits)
        new = {}
        if sampling:  # every sampling request's token at once: one transfer to the host
            states = [state for state, _ in sampling]
            for state, token in zip(states, sample_next(states, last_logits([logits for _, logits in sampling]))):
                state.tokens.append(token)
                new[state.id] = [token]
        return self._record(batch, scheduled, preempted, prefill, len(batch) * max(len(f) for f in feeds), new)

    def _speculative_step(self, state: RequestState, drafts: list) -> dict:
        """One forward over the request's last token and ``drafts``; the target's greedy walk keeps the drafts
        it agrees with and adds its own next token; the cache is truncated past the last kept one."""
        feed = [state.tokens[-1], *drafts]
        preempted = []
        if not self._reserve(state, len(feed), preempted):  # (it fits alone: check_fits)
            return self._record([], {}, preempted, 0, 0, {})
        (logits,) = forward_ragged(self.model, self.pool, [state.seq_id], [feed])
        emitted, path = verify_tree_greedy(TokenTree.chain(feed[0], drafts), to_numpy(logits))
        state.num_computed += len(path)  # the fed token and the accepted drafts; the rest is dropped
        self.pool.truncate(state.seq_id, state.num_computed)
        new = []
        for token in emitted:  # one at a time: a stop, the eos id or max_new_tokens may end it early
            state.tokens.append(token)
            new.append(token)
            if finish_reason(state.request, state.output) is not None:
                break
        return self._record([state], {state.id: len(feed)}, preempted, 0, len(feed), {state.id: new})

    def _record(self, batch, scheduled, preempted, prefill, padded_slots, new) -> dict:
        """(d): time the step, retire the requests it finished, keep its ``StepRecord`` -> new."""
        record = StepRecord(
            time_s=0.0,
            scheduled=scheduled,
            prefill_tokens=prefill,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            blocks_used=0,
            preempted=preempted,
            padded_slots=padded_slots,
        )
        self.clock.advance(record.padded_slots)
        record.time_s = self.clock.now()
        for state in batch:
            if state.id in new:
                state.metrics.token_times_s += [record.time_s] * len(new[state.id])
                state.finish_reason = finish_reason(state.request, state.output)
                if state.finished:  # (d) retire: its blocks go back to the pool
                    self.release(state)
                    self.running.remove(state)
                    self.finished[state.id] = state
        record.blocks_used = self.pool.num_blocks - self.pool.num_free_blocks
        self.history.append(record)
        return new

    def stream(self):
        """Step until every queued request is done, yielding (request id, token) as tokens appear."""
        while self.has_unfinished:
            for rid, tokens in self.step().items():
                for token in tokens:
                    yield rid, token


# --- workloads: arrival traces, a trace file, a driver -------------------------------------------


@dataclass(frozen=True)
class TraceRow:
    """One request of a workload: when it arrives and how long its prompt and output are."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


def poisson_trace(
    n: int, rate: float, mean_prompt: float, mean_output: float, max_tokens: int, seed: int
) -> list[TraceRow]:
    """n requests arriving as a Poisson process of ``rate`` per second (exponential gaps), with
    exponential (long-tailed) prompt and output lengths, clipped so prompt + output <= max_tokens + 1."""
    if n < 1 or rate <= 0 or mean_prompt <= 0 or mean_output <= 0:
        raise ValueError(f"need n >= 1 and positive rate and means, got {n}, {rate}, {mean_prompt}, {mean_output}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    prompt = np.clip(np.ceil(rng.exponential(mean_prompt, n)), 1, max_tokens).astype(int)
    output = np.clip(np.ceil(rng.exponential(mean_output, n)), 1, max_tokens + 1 - prompt).astype(int)
    return [TraceRow(round(float(a), 6), int(p), int(o)) for a, p, o in zip(arrivals, prompt, output)]


def save_trace(rows, path) -> None:
    """Write a trace as CSV: a header line ``arrival_s,prompt_tokens,output_tokens``, one request a line."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(TRACE_COLUMNS)
        writer.writerows([r.arrival_s, r.prompt_tokens, r.output_tokens] for r in rows)


def load_trace(path) -> list[TraceRow]:
    """Read a trace CSV -> rows; a bad row is a ValueError naming its line number."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    if not lines or tuple(c.strip() for c in lines[0]) != TRACE_COLUMNS:
        raise ValueError(f"{path}: line 1 must be the header {','.join(TRACE_COLUMNS)}")
    rows, last = [], 0.0
    for number, cells in enumerate(lines[1:], start=2):
        try:
            if len(cells) != 3:
                raise ValueError(f"{len(cells)} fields, expected 3")
            row = TraceRow(float(cells[0]), int(cells[1]), int(cells[2]))
            if not np.isfinite(row.arrival_s) or row.arrival_s < last:
                raise ValueError(f"arrival {cells[0]} is not a time >= the previous arrival {last}")
            if row.prompt_tokens < 1 or row.output_tokens < 1:
                raise ValueError("prompt_tokens and output_tokens must be >= 1")
        except ValueError as e:
            raise ValueError(f"{path}, line {number}: {e}") from None
        rows.append(row)
        last = row.arrival_s
    return rows


def replay(engine: Engine, requests, arrivals, on_step=None) -> dict:
    """Feed requests to the engine at their arrival times (on its clock) and run it until all are
    done -> {index in requests: handle}. When nothing runs, the clock waits for the next arrival.
    ``on_step(new)``, if given, sees each step's new tokens ({request id: [token]}) as they come."""
    pending = deque(sorted(zip(arrivals, range(len(requests))), key=lambda p: p[0]))
    start, handles = engine.clock.now(), {}
    while pending or engine.has_unfinished:
        if not engine.has_unfinished and pending:
            engine.clock.wait_until(start + pending[0][0])
        while pending and start + pending[0][0] <= engine.clock.now():
            arrival, i = pending.popleft()
            handles[i] = engine.add_request(requests[i], arrival_s=start + arrival)
        new = engine.step()
        if on_step is not None:
            on_step(new)
    return handles
