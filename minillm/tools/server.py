"""``python -m minillm serve``: chapter 10's engine behind an OpenAI-compatible HTTP API.

    POST /v1/chat/completions   POST /v1/completions   (streamed as server-sent events, or not)
    GET  /v1/models   GET /health   GET /metrics (Prometheus text)

One thread runs the engine loop (``EngineLoop``): it takes new requests and aborts from an inbox
between steps, runs ``Engine.step()`` and hands each new token to its request's queue. The HTTP
front end (Starlette on uvicorn, asyncio) never touches the engine's state: it checks a request,
turns text into token ids and back, and waits on its queue. A client that goes away has its request
aborted before the next step, and its KV blocks go back to the pool. More requests in flight than
the engine's sequence budget plus ``max_queue`` get 429 with Retry-After at once.

What a request may be (checked before any work is done for it): a body of at most ``MAX_BODY_BYTES``
(413), sent whole within ``request_timeout`` seconds (408), JSON nested at most as deep as Python's
parser goes and with integers of at most ``MAX_INTEGER_DIGITS`` digits, only the fields in ``FIELDS``
(400 naming the others), a prompt that could fit the context by its length in bytes before it is
tokenized (off the event loop). Every error is an OpenAI error object, 404 and 405 included, and
quotes at most ``QUOTE_CHARS`` characters of what the client sent.

Why Starlette + uvicorn: Starlette is the small ASGI toolkit FastAPI is built on; it streams a
response from an async generator and cancels it when the client disconnects, which is what aborting
a request needs, without FastAPI's request models (whose 422 errors are not OpenAI's error objects).
uvicorn is its standard server and stops on SIGINT/SIGTERM, waiting a bounded time for open requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import queue
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field

from ..registry import KNOWN_MODELS, load_model
from ..sampling import SamplingSettings
from ..serving import Engine, Request
from ..tokenizer import TextStream
from .options import add_weights_option, check_kv_pool, int_in, kv_blocks, nonnegative_int, num_seqs, positive_int

ABORT, ADD, STOP = "abort", "add", "stop"
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # the engine's reasons -> OpenAI's
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
MAX_STOPS = 4  # as the OpenAI API
MAX_TEMPERATURE = 2.0  # as the OpenAI API; SamplingSettings checks the rest
MAX_BODY_BYTES = 1 << 20  # 1 MiB: SmolLM2's whole context is about 8 KB of text
MAX_INTEGER_DIGITS = 20  # an int64 has 19; a longer integer in a body is refused before int() reads it
REQUEST_TIMEOUT_S = 10.0  # a request's headers, then its body, must arrive within this (else 408)
QUOTE_CHARS = 80  # what an error quotes of a client's value
MESSAGE_CHARS = 240  # an error message, whatever it quotes
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options",
                 "user")  # user: the client's id for its own records; it changes nothing
FIELDS = {"completions": (*COMMON_FIELDS, "prompt"),  # the request fields this server implements
          "chat": (*COMMON_FIELDS, "messages", "max_completion_tokens")}
log = logging.getLogger("uvicorn.error")  # the server's own log, in uvicorn's format


def clip(text: str, limit: int) -> str:
    """At most ``limit`` characters of ``text``, with "…" where it was cut: clip("abcdef", 3) -> 'abc…'."""
    return text if len(text) <= limit else text[:limit] + "…"


def quote(value) -> str:
    """A client's value as an error message quotes it: its repr, clipped to QUOTE_CHARS."""
    return clip(repr(value), QUOTE_CHARS)


class ApiError(Exception):
    """An error the client caused (or overload): HTTP ``status`` with an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        message = clip(message, MESSAGE_CHARS)  # a library's message may quote a whole value
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> dict:
        kind = "rate_limit_error" if self.status == 429 else "invalid_request_error" if self.status < 500 \
            else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client closed its connection: nobody will read an answer."""


# ---- the engine loop (one thread) ----------------------------------------------------------------


@dataclass
class Outbox:
    """One request's tokens, from the engine thread to the front end's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None  # the engine's id, set by the engine thread

    def put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # its event loop has closed (the server is gone): nobody reads it
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Owns the ``Engine``: every call on it happens in this thread, between steps."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outboxes: dict[int, Outbox] = {}
        self.in_flight = 0  # accepted by the front end and not yet finished (front end's thread only)
        self.steps = 0
        self.failed: str | None = None  # why the engine stopped serving (an exception in a step)
        self.snapshot = self.read_snapshot()
        self.thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is left (each client gets "cancelled") and end the thread."""
        self.inbox.put((STOP, None, None))
        self.thread.join(timeout)

    def read_snapshot(self) -> dict:
        pool, prefix = self.engine.pool, self.engine.prefix
        return {"running": len(self.engine.running), "waiting": len(self.engine.waiting),
                "blocks_free": pool.num_free_blocks, "blocks_used": pool.num_blocks - pool.num_free_blocks,
                "prefix_reused_tokens": 0 if prefix is None else prefix.reused_tokens, "steps": self.steps}

    def fail(self, message: str) -> None:
        """The engine raised: its state cannot be trusted, so every open request gets a 500 (each
        client learns at once) and every new one a 503; /health says so."""
        self.failed = message
        for box in self.outboxes.values():
            box.put(("failed", message))
        self.outboxes.clear()
        self.engine.waiting.clear()
        self.engine.running.clear()

    def handle(self, command) -> bool:
        """Apply one inbox command -> False when the loop must stop."""
        kind, request, outbox = command
        if kind == STOP:
            for rid, box in list(self.outboxes.items()):
                self.engine.abort(rid)
                box.put(("cancelled", None))
            self.outboxes.clear()
            return False
        if kind == ADD and self.failed is not None:
            outbox.put(("failed", self.failed))
        elif kind == ADD:
            try:
                state = self.engine.add_request(request)
            except ValueError as exc:  # checked by the front end already; a race cannot crash the loop
                outbox.put(("error", str(exc)))
                return True
            outbox.request_id = state.id
            self.outboxes[state.id] = outbox
        elif kind == ABORT and outbox.request_id in self.outboxes:
            self.engine.abort(outbox.request_id)
            del self.outboxes[outbox.request_id]
        return True

    def run(self) -> None:
        while True:
            try:  # wait for work when idle; between steps only drain what has arrived
                command = self.inbox.get(timeout=None if not self.engine.has_unfinished else 0)
                if not self.handle(command):
                    return
                self.snapshot = self.read_snapshot()
                continue
            except queue.Empty:
                pass
            try:
                new = self.engine.step()
            except Exception as exc:  # a bug in a step: fail every open request, refuse new ones
                self.fail(f"{type(exc).__name__}: {exc}")
                continue
            self.steps += 1
            for rid, tokens in new.items():
                box = self.outboxes.get(rid)
                if box is None:
                    continue
                box.put(("tokens", tokens))
                state = self.engine.finished.pop(rid, None)  # the server keeps no finished requests
                if state is not None:
                    del self.outboxes[rid]
                    box.put(("done", state.finish_reason))
            self.engine.history.clear()  # the server keeps no per-step records either
            self.snapshot = self.read_snapshot()


# ---- text out: stop strings, incomplete characters -----------------------------------------------


class TextOut:
    """Tokens -> text deltas; the text ends before the first stop string, which is not part of it.

    A delta never ends inside a UTF-8 character, and while a stop string may still be forming, its
    possible beginning is held back. Example: stop ["\\n\\n"], text "a\\n" -> "a" now, "\\n" held.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.decoder = TextStream(tokenizer)
        self.stop, self.hold = stop, max((len(s) for s in stop), default=1) - 1
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        self.text += self.decoder.push(token)
        return self.deltas(final=False)

    def finish(self) -> str:
        self.text += self.decoder.flush()
        return self.deltas(final=True)

    def deltas(self, final: bool) -> str:
        found = [i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stop) if i >= 0]
        if found:
            self.text, self.stopped = self.text[: min(found)], True
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out


# ---- requests in: checks ---------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object. Refused with 400: not UTF-8, not JSON, nested deeper than
    Python's parser goes (RecursionError), an integer longer than MAX_INTEGER_DIGITS (before ``int``
    reads it: a 5,000-digit one would take it long and then fail), not an object."""
    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
            raise ApiError(400, f"an integer in the request body has more than {MAX_INTEGER_DIGITS} digits")
        return int(digits)

    try:
        body = json.loads(raw.decode("utf-8"), parse_int=integer)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_fields(body: dict, implemented: tuple) -> None:
    """Refuse every field not ``implemented`` (an endpoint's FIELDS), naming them; null counts as not given."""
    unknown = [name for name, value in body.items() if name not in implemented and value is not None]
    if unknown:
        raise ApiError(400, f"unsupported fields: {clip(', '.join(unknown), QUOTE_CHARS)} (this server implements "
                            f"{', '.join(implemented)})", clip(unknown[0], QUOTE_CHARS))


def sampling(body: dict) -> tuple[float, float]:
    """temperature and top_p -> the values, checked by the library's one check (SamplingSettings),
    each error naming its field; the OpenAI API also caps temperature at MAX_TEMPERATURE."""
    values = {"temperature": 1.0, "top_p": 1.0}  # the defaults, for a field absent or null
    for name in values:
        value = body.get(name)
        if value is None:
            continue
        try:
            SamplingSettings(**{name: value})
        except ValueError as exc:
            raise ApiError(400, str(exc), name) from None
        values[name] = float(value)
    if values["temperature"] > MAX_TEMPERATURE:
        raise ApiError(400, f"temperature must be at most {MAX_TEMPERATURE}, got {values['temperature']}",
                       "temperature")
    return values["temperature"], values["top_p"]


def integer(body: dict, name: str, default, low: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"{name} must be an integer >= {low}, got {quote(value)}", name)
    return value


def stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    return stop


def message_text(content) -> str:
    """A message's content: a string, or a list of parts of which only {"type": "text"} ones are read."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, "a message's content must be a string or a list of text parts (this model reads text only)",
                   "messages")


@dataclass
class Job:
    """A checked request: token ids for the engine, how to sample, how to turn tokens into text."""

    prompt: list
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list
    stream: bool
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the token counts


class Server:
    """The front end: the checks, the OpenAI formats, the metrics; ``EngineLoop`` runs the engine."""

    def __init__(self, model_name: str, model, tokenizer, engine: Engine, max_queue: int = 64,
                 default_max_tokens: int = 256, request_timeout: float = REQUEST_TIMEOUT_S):
        self.model_name, self.model, self.tokenizer = model_name, model, tokenizer
        self.eos = getattr(tokenizer, "eos_token_id", None)  # ends an answer; not part of its text
        self.longest_token = max(len(b) for b in tokenizer.token_bytes)  # bytes; n bytes of text >= n / this tokens
        self.loop = EngineLoop(engine)
        self.max_in_flight = engine.max_num_seqs + max_queue
        self.default_max_tokens = default_max_tokens
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.counts = {"requests_total": 0, "requests_rejected_total": 0, "requests_aborted_total": 0}

    @property
    def context(self) -> int:
        """Tokens one request can hold: the model's context, or the whole pool if that is smaller."""
        pool = self.loop.engine.pool
        return min(pool.max_len, pool.num_blocks * pool.page_size)

    # -- checks
    def check_model(self, body: dict) -> None:
        if body.get("model") != self.model_name:
            raise ApiError(400, f"unknown model {quote(body.get('model'))}: this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def max_tokens(self, body: dict, prompt: list) -> int:
        """max_tokens (or max_completion_tokens) if given; else default_max_tokens or as many as fit
        beside the prompt, whichever is fewer (the last token is never cached: context - prompt + 1)."""
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        given = integer(body, name, None, 1)
        return given if given is not None else max(1, min(self.default_max_tokens, self.context - len(prompt) + 1))

    def job(self, body: dict, prompt: list) -> Job:
        if integer(body, "n", 1, 1) != 1:
            raise ApiError(400, "n must be 1: this server returns one choice per request", "n")
        stream, options = body.get("stream", False), body.get("stream_options") or {}
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream must be true or false, got {quote(stream)}", "stream")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise ApiError(400, "stream_options must be an object like {\"include_usage\": true}", "stream_options")
        seed = integer(body, "seed", None, 0)
        job = Job(prompt, self.max_tokens(body, prompt), *sampling(body),
                  secrets.randbits(63) if seed is None else seed, stop_strings(body), stream,
                  options.get("include_usage", False))
        try:
            self.loop.engine.check_fits(self.request(job))
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages" if "messages" in body else "prompt",
                           "context_length_exceeded") from None
        return job

    def request(self, job: Job) -> Request:
        return Request(tuple(job.prompt), job.max_tokens, job.temperature, None,
                       None if job.top_p >= 1.0 else job.top_p, job.seed, self.eos)

    def check_prompt_bytes(self, n_bytes: int, param: str) -> None:
        """Refuse a prompt too long for the context by its size alone, before it is tokenized: n bytes
        of text are at least n / (the longest token's bytes) tokens."""
        fewest = -(-n_bytes // self.longest_token)
        if fewest > self.context:
            raise ApiError(400, f"request too long: a prompt of {n_bytes} bytes is at least {fewest} tokens > the "
                                f"context of {self.context}", param, "context_length_exceeded")

    async def encode(self, encode, text, param: str) -> list:
        """``encode(text)`` in a worker thread, so that a long prompt does not hold the event loop."""
        try:
            return await asyncio.to_thread(encode, text)
        except (KeyError, ValueError) as exc:  # the character model knows only its alphabet
            raise ApiError(400, f"the prompt cannot be encoded by {self.model_name}'s tokenizer: {exc}",
                           param) from None

    async def chat_prompt(self, body: dict) -> list:
        if not hasattr(self.tokenizer, "chat_pieces"):
            raise ApiError(400, f"{self.model_name} has no chat template: use /v1/completions", "model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
        turns = []
        for m in messages:
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(400, "each message needs a role: system, developer, user or assistant", "messages")
            turns.append({"role": "system" if role == "developer" else role, "content": message_text(m.get("content"))})
        self.check_prompt_bytes(sum(len(t["content"].encode()) for t in turns), "messages")
        pieces = self.tokenizer.chat_pieces(turns)
        return await self.encode(self.tokenizer.encode_pieces, pieces, "messages")

    async def text_prompt(self, body: dict) -> list:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", "prompt")
        self.check_prompt_bytes(len(prompt.encode()), "prompt")
        return await self.encode(self.tokenizer.encode, prompt, "prompt")

    def admit(self) -> None:
        if self.loop.failed is not None:
            raise ApiError(503, f"the engine failed and serves no more requests: {self.loop.failed}",
                           code="engine_failed")
        if self.loop.in_flight >= self.max_in_flight:
            self.counts["requests_rejected_total"] += 1
            raise ApiError(429, f"server busy: {self.loop.in_flight} requests in flight (at most "
                           f"{self.max_in_flight}); retry later", code="overloaded", retry_after=1)

    # -- running a job: an async generator of (text delta, finish reason or None, tokens so far)
    async def run(self, job: Job, receive=None):
        """Yield text deltas; the last item carries the finish reason. The request is aborted in the
        engine when the generator is left early: a client that went away (the task cancelled, as
        Starlette does to a stream, or the ASGI ``receive`` of a plain request, watched here, says
        http.disconnect), or a stop string the engine does not know about."""
        self.loop.in_flight += 1
        self.counts["requests_total"] += 1
        box = Outbox(asyncio.get_running_loop())
        self.loop.inbox.put((ADD, self.request(job), box))
        watch = None if receive is None else asyncio.create_task(until_disconnect(receive, box))
        out, eos = TextOut(self.tokenizer, job.stop), self.eos
        engine_done, n_tokens = False, 0
        start = last = time.perf_counter()
        try:
            while True:
                kind, payload = await box.queue.get()
                if kind == "gone":  # the client of a plain request went away
                    return
                if kind != "tokens":
                    engine_done = True
                    if kind == "error":
                        raise ApiError(400, payload)
                    if kind == "failed":
                        raise ApiError(500, f"the engine failed: {payload}", code="engine_failed")
                    if kind == "cancelled":
                        raise ApiError(503, "the server is shutting down", code="shutting_down", retry_after=1)
                    yield out.finish(), FINISH.get(payload, payload), n_tokens  # "done"
                    return
                now = time.perf_counter()
                for token in payload:
                    n_tokens += 1
                    (self.ttft if n_tokens == 1 else self.itl).observe(now - (start if n_tokens == 1 else last))
                    last = now
                    delta = "" if token == eos else out.push(token)
                    if out.stopped:
                        yield out.finish(), "stop", n_tokens
                        return
                    if delta:
                        yield delta, None, n_tokens
        finally:
            if watch is not None:
                watch.cancel()
            self.loop.in_flight -= 1
            if not engine_done:  # left early: the engine still runs it; free its blocks before the next step
                self.counts["requests_aborted_total"] += not out.stopped  # a stop string is not an abort
                self.loop.inbox.put((ABORT, None, box))

    # -- metrics
    def metrics(self) -> str:
        s = self.loop.snapshot
        lines = []
        for name, kind, value, about in [
            ("minillm_requests_running", "gauge", s["running"], "requests in the running batch"),
            ("minillm_requests_waiting", "gauge", s["waiting"], "requests queued in the engine"),
            ("minillm_requests_in_flight", "gauge", self.loop.in_flight, "requests accepted and not finished"),
            ("minillm_kv_blocks_used", "gauge", s["blocks_used"], "KV cache blocks held by sequences"),
            ("minillm_kv_blocks_free", "gauge", s["blocks_free"], "KV cache blocks free"),
            ("minillm_prefix_cache_reused_tokens_total", "counter", s["prefix_reused_tokens"],
             "prompt tokens read from the prefix cache instead of computed"),
            ("minillm_engine_steps_total", "counter", s["steps"], "engine steps run"),
            ("minillm_requests_total", "counter", self.counts["requests_total"], "requests accepted"),
            ("minillm_requests_rejected_total", "counter", self.counts["requests_rejected_total"],
             "requests refused with 429 (overload)"),
            ("minillm_requests_aborted_total", "counter", self.counts["requests_aborted_total"],
             "requests whose client went away before the end"),
        ]:
            lines += [f"# HELP {name} {about}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += self.ttft.lines("minillm_time_to_first_token_seconds", "time from request to its first token")
        lines += self.itl.lines("minillm_inter_token_latency_seconds", "time between two tokens of a request")
        return "\n".join(lines) + "\n"


async def until_disconnect(receive, box: Outbox) -> None:
    """Wait for the ASGI http.disconnect of a request whose body has been read, then tell its ``run``."""
    while (await receive())["type"] != "http.disconnect":
        pass
    box.queue.put_nowait(("gone", None))


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum, self.count = self.sum + value, self.count + 1
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += 1

    def lines(self, name: str, about: str) -> list[str]:
        out = [f"# HELP {name} {about}", f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{le}"}} {c}' for le, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


# ---- HTTP --------------------------------------------------------------------------------------------


def build_app(server: Server):
    """The Starlette application over ``server``; its lifespan starts and stops the engine thread."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error_response(exc: ApiError) -> JSONResponse:
        headers = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request, exc: HTTPException) -> JSONResponse:  # Starlette's own 404 and 405
        about = {404: "no such endpoint", 405: "method not allowed"}.get(exc.status_code, exc.detail)
        error = ApiError(exc.status_code, f"{about}: {request.method} {clip(request.url.path, QUOTE_CHARS)}")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def read_body(request) -> dict:
        """The body, at most MAX_BODY_BYTES (by Content-Length, then as it arrives: 413), whole within
        ``server.request_timeout`` (408) -> its JSON object. A client that leaves meanwhile: one log line."""
        def too_large() -> ApiError:
            return ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")

        declared = request.headers.get("content-length", "0")  # h11 has checked that it is digits
        if len(declared) > len(str(MAX_BODY_BYTES)) or int(declared) > MAX_BODY_BYTES:
            raise too_large()
        raw = bytearray()
        try:
            async with asyncio.timeout(server.request_timeout):
                async for chunk in request.stream():
                    raw += chunk
                    if len(raw) > MAX_BODY_BYTES:
                        raise too_large()
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {server.request_timeout:g} s") from None
        except ClientDisconnect:
            log.warning("a client closed its connection while sending its request (%d bytes of it read)", len(raw))
            raise ClientGone() from None
        return parse_json(bytes(raw))

    def completion_endpoint(chat: bool):
        kind = "chat.completion" if chat else "text_completion"
        fields = FIELDS["chat" if chat else "completions"]

        def choice(text: str, reason, streaming: bool) -> dict:
            if chat:
                key = "delta" if streaming else "message"
                content = {"content": text} if streaming else {"role": "assistant", "content": text}
                return {"index": 0, key: content, "finish_reason": reason, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

        async def endpoint(request):
            try:
                body = await read_body(request)
                check_fields(body, fields)
                server.check_model(body)
                job = server.job(body, await (server.chat_prompt(body) if chat else server.text_prompt(body)))
                server.admit()
            except ApiError as exc:
                return error_response(exc)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
            head = {"id": rid, "created": int(time.time()), "model": server.model_name}
            # a stream is cancelled by Starlette when its client goes; a plain request watches receive
            gen = server.run(job, None if job.stream else request.receive)

            def usage(n: int) -> dict:
                return {"prompt_tokens": len(job.prompt), "completion_tokens": n,
                        "total_tokens": len(job.prompt) + n}

            if not job.stream:
                text, reason, n = [], None, 0
                try:
                    async for item in gen:
                        text.append(item[0])
                        reason, n = item[1], item[2]
                except ApiError as exc:
                    return error_response(exc)
                if reason is None:  # the client went away: nobody reads an answer
                    return Response(status_code=499)
                return JSONResponse({**head, "object": kind, "choices": [choice("".join(text), reason, False)],
                                     "usage": usage(n)})

            async def events():
                chunk = {**head, "object": kind + ".chunk" if chat else kind}
                if chat:
                    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    yield f"data: {json.dumps({**chunk, 'choices': [first]})}\n\n"
                try:
                    async for delta, reason, n in gen:
                        yield f"data: {json.dumps({**chunk, 'choices': [choice(delta, reason, True)]})}\n\n"
                        if reason is not None and job.include_usage:
                            yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage(n)})}\n\n"
                except ApiError as exc:
                    yield f"data: {json.dumps(exc.body())}\n\n"
                finally:
                    await gen.aclose()
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        return endpoint

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "minillm"}]})

    async def health(request):
        problem = server.loop.failed or (None if server.loop.thread.is_alive() else "the engine thread stopped")
        return JSONResponse({"status": "ok"} if problem is None else {"status": "failed", "error": problem},
                            status_code=200 if problem is None else 503)

    async def metrics(request):
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        yield
        server.loop.stop()

    return Starlette(routes=[
        Route("/v1/chat/completions", completion_endpoint(True), methods=["POST"]),
        Route("/v1/completions", completion_endpoint(False), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error})


def uvicorn_config(server: Server, **options):
    """uvicorn's settings for ``server`` (``options``: host, port, sockets, ...): its app, quiet logs, and
    ``server.request_timeout`` as the deadline for an idle kept-alive connection (uvicorn's
    timeout_keep_alive) and for each request's headers (``HeadersDeadline``; the app times the body)."""
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadersDeadline(H11Protocol):
        """uvicorn's HTTP/1.1 protocol with a deadline on a request's line and headers: a connection still
        sending them ``timeout_keep_alive`` seconds after it opened or began its next request gets a 408
        and is closed. (uvicorn alone waits for them forever, so trickling clients could hold it.) Its
        400 for bytes that are not HTTP is an error object too."""

        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self.deadline = self.loop.call_later(self.timeout_keep_alive, self.headers_too_slow)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self.cancel_deadline()
            elif self.deadline is None:  # the next request on a kept-alive connection has begun
                self.deadline = self.loop.call_later(self.timeout_keep_alive, self.headers_too_slow)

        def connection_lost(self, exc) -> None:
            self.cancel_deadline()
            super().connection_lost(exc)

        def cancel_deadline(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def headers_too_slow(self) -> None:
            self.deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.close_with(408, b"Request Timeout",
                                f"the request headers did not arrive within {self.timeout_keep_alive:g} s")

        def send_400_response(self, msg: str) -> None:  # uvicorn's answer to bytes that are not HTTP
            self.close_with(400, b"Bad Request", msg)

        def close_with(self, status: int, reason: bytes, message: str) -> None:
            """Answer with an error object and close; written as bytes, as no request may have been parsed."""
            body = json.dumps(ApiError(status, message).body()).encode()
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body))
            self.transport.close()

    return uvicorn.Config(build_app(server), http=HeadersDeadline, timeout_keep_alive=server.request_timeout,
                          log_level="warning", **options)


def make_server(args, loader=load_model) -> Server:
    model, tokenizer = loader(args.model, weights=args.weights)
    context = model.config.block_size if args.context is None else min(args.context, model.config.block_size)
    num_blocks = args.num_blocks or -(-context * args.max_num_seqs // args.page_size)
    check_kv_pool(model.config, num_blocks, args.page_size)  # before the engine builds and zeroes the pool
    engine = Engine(model, num_blocks=num_blocks, page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, chunk_size=args.chunk_size,
                    prefix_caching=not args.no_prefix_caching, speculate=args.speculate)
    return Server(args.model, model, tokenizer, engine, max_queue=args.max_queue,
                  default_max_tokens=args.default_max_tokens)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="target", choices=KNOWN_MODELS, help="the model to serve (default target)")
    add_weights_option(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000, help="TCP port (default 8000; 0: any free one)")
    p.add_argument("--context", type=positive_int, help="tokens a request may hold (default: the model's context)")
    p.add_argument("--max-num-seqs", type=num_seqs, default=8, help="requests in the running batch (default 8)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=256,
                   help="tokens in one engine step (default 256)")
    p.add_argument("--chunk-size", type=positive_int, default=64, help="prompt tokens per step (default 64)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=kv_blocks, help="KV blocks (default: the context for every running request)")
    p.add_argument("--max-queue", type=nonnegative_int, default=64,
                   help="requests waiting beyond --max-num-seqs before 429 (default 64)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of a request that gives none (default 256)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--speculate", action="store_true",
                   help="a greedy request running alone decodes by prompt lookup: several tokens a step where its "
                   "text repeats itself, the same tokens as without")
    p.add_argument("--shutdown-timeout", type=positive_int, default=5,
                   help="seconds to wait for open requests on SIGINT/SIGTERM (default 5)")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="shut down when the process that started this one ends (a notebook, a test)")


def exit_with_parent(poll_s: float = 0.5) -> None:
    """Watch the parent process; when it is gone (this process is re-parented), SIGTERM ourselves,
    so a server started by a notebook or a test never outlives it."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="minillm-parent-watch", daemon=True).start()


def serve(args) -> int:
    import uvicorn

    server = make_server(args)
    if args.exit_with_parent:
        exit_with_parent()
    print(f"serving {args.model} on http://{args.host}:{args.port}/v1 (OpenAI API); Ctrl-C stops", flush=True)
    class EndStreamsOnExit(uvicorn.Server):
        """On SIGINT or SIGTERM, first cancel every open request in the engine (each stream ends at once with its
        "cancelled" event), then shut down: uvicorn waits for open streams only up to its graceful timeout, and
        a slow machine would reach it with streams still running and have them cancelled mid-write."""

        def handle_exit(self, sig, frame):
            server.loop.inbox.put((STOP, None, None))
            super().handle_exit(sig, frame)

    EndStreamsOnExit(uvicorn_config(server, host=args.host, port=args.port,
                                    timeout_graceful_shutdown=args.shutdown_timeout)).run()
    return 0

