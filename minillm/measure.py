"""Measuring on a shared machine: wall times taken in alternating pairs, and the cost of a decode step.

A speed-up is a ratio of two wall times. Timed minutes apart, the two drift with whatever else the
machine runs (on a shared 2-core machine the drift reached 20 %); timed in alternation, both of a pair
run under the same conditions, so their ratio holds. Every chapter that reports a speed-up, and every
benchmark, times with these functions (the GPU synchronized before each clock read).

    time_paired(lambda: generate(model, p, 64), lambda: speculative_generate(model, draft, p, 64))
        -> (plain s, speculative s, the speculative result)
    step_ratio(draft, 1, target)    # c: a draft step in target decode steps (chapter 5)
    verify_cost(target, 5)          # v(5): a forward over 5 new tokens in the same path's decode steps
    decode_step_parts(model, 144)   # where a cached decode step's time goes (chapter 3)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from functools import partial

from .backend import synchronize, xp
from .kv_cache import KVCache

STEP_CONTEXT = 128  # cached tokens when timing one decode step (mid-way through a generation)


# ---- wall times, in alternating pairs ------------------------------------------------------------


def timed(fn):
    """Run ``fn()`` once -> (wall seconds, its result), the GPU synchronized before both clock reads."""
    synchronize()
    t0 = time.perf_counter()
    value = fn()
    synchronize()
    return time.perf_counter() - t0, value


def time_fn(fn, warmup: int = 1, repeat: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn)[0] for _ in range(repeat))


def time_pairs(baseline, candidate, repeat: int = 3):
    """Time two ways of doing the same work in alternation -> (baseline times, candidate times,
    candidate's last result), ``repeat`` wall times each in seconds, after one warm-up call each.

    Alternating the runs puts both of a pair under the same machine conditions, so their ratio does
    not drift with background load the way two medians timed minutes apart do (on a shared 2-core
    machine that drift reached 20 %).
    """
    baseline()
    result = candidate()
    base_times, cand_times = [], []
    for _ in range(repeat):
        base_times.append(timed(baseline)[0])
        seconds, result = timed(candidate)
        cand_times.append(seconds)
    return base_times, cand_times, result


def time_paired(baseline, candidate, repeat: int = 3):
    """``time_pairs`` reduced to medians -> (baseline s, candidate s, candidate's last result)."""
    base_times, cand_times, result = time_pairs(baseline, candidate, repeat)
    return statistics.median(base_times), statistics.median(cand_times), result


# ---- one cached forward: its cost in decode steps ------------------------------------------------


def cached_step(model, n_tokens, context=STEP_CONTEXT):
    """A function that runs one cached forward over ``n_tokens`` new tokens after ``context`` cached."""
    cache = KVCache(model.config)
    model.forward(xp.zeros((1, context), dtype=xp.int64), cache)
    new = xp.ones((1, n_tokens), dtype=xp.int64)

    def step():
        cache.truncate(context)
        model.forward(new, cache)

    return step


def step_time(model, n_tokens, context=STEP_CONTEXT, repeat=30):
    """Median seconds of one cached forward over ``n_tokens`` new tokens after ``context`` cached."""
    return time_fn(cached_step(model, n_tokens, context), warmup=3, repeat=repeat)


def paired_ratio(times, ref_times) -> float:
    """The median of t / t_ref over pairs timed together (``time_pairs``, or one round of a benchmark).
    Background load slows both of a pair alike, so this ratio holds on a busy machine where two
    medians timed apart do not.  Example: times [2, 3, 9], ref_times [1, 3, 3] -> median(2, 1, 3) = 2
    (the ratio of the medians would say 3 / 3 = 1)."""
    return statistics.median(t / r for t, r in zip(times, ref_times, strict=True))


def step_ratio(model, n_tokens, ref_model, ref_tokens=1, repeat=30, context=STEP_CONTEXT) -> float:
    """Cost of ``model``'s cached step over n_tokens in units of ``ref_model``'s over ref_tokens: the
    ``paired_ratio`` of ``repeat`` alternating pairs, ``context`` tokens cached (c, v(K))."""
    ref_times, times, _ = time_pairs(cached_step(ref_model, ref_tokens, context),
                                     cached_step(model, n_tokens, context), repeat)
    return paired_ratio(times, ref_times)


def verify_cost(model, n_tokens, context=STEP_CONTEXT, repeat=30) -> float:
    """v(n) = t(n) / t(1): one cached forward over n new tokens in units of the SAME model's
    single-token decode step on the SAME weight-product path (whatever ``set_fast_products`` says
    now), timed in alternating pairs. A speculative round that verifies n tokens costs v(n) of that
    path's own decode steps, so each path is measured against its own step, never another's."""
    return step_ratio(model, n_tokens, model, 1, repeat, context)


# ---- a draft's share of a speculative round ----------------------------------------------------


class TimedProposer:
    """A proposer (chapter 9's ``propose`` / ``observe``) that adds up the seconds its ``propose``
    takes: the draft's cost in a round, apart from the target's verify. The first call that runs a draft (one
    with ``draft_calls``) is also kept apart (``catch_up_s``, ``catch_up_calls``): that round's draft reads the
    whole prompt (the first round verifies nothing: the target reads the prompt).
    ``TimedProposer(p).seconds / result.stats.rounds / k / t_step`` is c, a draft step in decode steps."""

    def __init__(self, inner):
        self.inner, self.max_depth, self.seconds = inner, inner.max_depth, 0.0
        self.catch_up_s, self.catch_up_calls = 0.0, 0  # the first propose that ran the draft, and its forwards

    def propose(self, state):
        calls = getattr(self.inner, "draft_calls", 0)
        t0 = time.perf_counter()
        proposal = self.inner.propose(state)
        took = time.perf_counter() - t0
        self.seconds += took
        ran = getattr(self.inner, "draft_calls", 0) - calls
        if ran and not self.catch_up_calls:  # the draft's first forward reads the whole prompt
            self.catch_up_s, self.catch_up_calls = took, ran
        return proposal

    def observe(self, state, emitted, extra_logits):
        self.inner.observe(state, emitted, extra_logits)


# ---- where a decode step's time goes: each part swapped for a free stand-in ----------------------

STAND_INS = {  # a part of the decode step -> (the model's attribute, a stand-in that costs ~nothing)
    "weight matmuls": ("linear", lambda x, w, b: xp.zeros(x.shape[:-1] + w.shape[-1:], dtype=x.dtype)),
    "LayerNorms": ("layer_norm", lambda x, w, b: x),
    "GELU": ("gelu", lambda x: x),
    "attention math": ("attention", lambda q, k, v, causal=True: q),  # left: writing the new k, v into the cache
}


@contextlib.contextmanager
def swapped(model, name: str, stand_in):
    """Inside the block, ``model.<name>`` is ``stand_in`` (set on this instance only); then as before."""
    had_own = name in vars(model)
    before = vars(model).get(name)
    setattr(model, name, stand_in)
    try:
        yield
    finally:
        if had_own:
            setattr(model, name, before)
        else:
            delattr(model, name)


def llama_stand_ins(model) -> dict:
    """``STAND_INS`` for a Llama: every weight product (``LlamaOps.product``: q|k|v, o, gate|up, down) and the LM
    head (``logits``) by zeros of their output's shape, so the rest of the step is what is left: attention, the
    norms, RoPE, SwiGLU's activation, the cache writes and Python."""
    vocab = model.config.vocab_size
    return {"weight products": ("product", lambda x, name: xp.zeros((*x.shape[:-1], model.matrix(name).shape[0]),
                                                                    dtype=x.dtype)),
            "LM head": ("logits", lambda h: xp.zeros((*h.shape[:-1], vocab), dtype=h.dtype))}


def decode_step_parts(model, context: int, steps: int = 10, rounds: int = 10, tokens: int = 1,
                      stand_ins: dict | None = None) -> list[dict]:
    """Where one decode step's time goes, by ablation: time the step with ``context`` tokens cached,
    then with one part swapped for a stand-in that returns its input (or zeros of the right shape);
    the difference is that part's cost *inside the loop*. Timing a part on its own would miss that
    every step streams all weights through the CPU caches and so evicts everything else. Variants
    are timed in alternation, ``steps`` decode steps per timing, medians over ``rounds``. ``tokens``
    > 1 times a forward over that many new tokens instead (a speculative verification). ``stand_ins``:
    the parts to swap ({part: (attribute, stand-in)}; ``STAND_INS``, GPT's, by default; ``llama_stand_ins``).
    """
    stand_ins = STAND_INS if stand_ins is None else stand_ins
    cache = KVCache(model.config, max_len=context + tokens)
    model.forward(xp.asarray([[t % model.config.vocab_size for t in range(context)]]), cache)
    token = xp.asarray([[(t + 1) % model.config.vocab_size for t in range(tokens)]])

    def step():
        for _ in range(steps):
            cache.truncate(context)
            model.forward(token, cache)

    variants = {"whole step": contextlib.nullcontext}  # part -> a function making its context
    variants |= {part: partial(swapped, model, name, fn) for part, (name, fn) in stand_ins.items()}
    times = {part: [] for part in variants}
    for r in range(rounds):
        for part in list(variants)[:: 1 if r % 2 else -1]:
            with variants[part]():
                times[part].append(1e6 * time_fn(step, warmup=1, repeat=1) / steps)
    whole = statistics.median(times["whole step"])
    rows = [{"part": "whole step", "step us": whole, "part us": whole, "share": 1.0}]
    for part in list(variants)[1:]:
        cost = statistics.median(w - t for w, t in zip(times["whole step"], times[part]))  # paired by round
        rows.append({"part": part, "step us": statistics.median(times[part]), "part us": cost, "share": cost / whole})
    return rows
