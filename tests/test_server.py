"""The OpenAI-compatible server (``minillm.tools.server``), through the official ``openai`` client.

A server on 127.0.0.1 with a free port, in this process (uvicorn in a thread), over chapter 10's
engine:
- greedy answers equal offline ``generate`` token for token; streamed deltas concatenate to the
  same text; a seed reproduces a sampled answer; stop strings cut the text as the API says;
- 16 concurrent clients with different prompts each get their own answer;
- a client that disconnects mid-stream has its request aborted within a step, and after 100 such
  clients the KV pool checks clean with every block free;
- a plain (not streamed) request whose client closes its socket is aborted within a few steps;
- overload gets 429 with Retry-After at once; bad input gets 400 with an OpenAI error object (deep
  JSON, huge integers, fields the server does not implement, sampling values the library refuses),
  a body over the limit 413, one too slow 408, an unknown path 404 and a wrong method 405, each
  error quoting at most a few dozen characters of what was sent, and the server keeps serving;
- a prompt too long for the context is refused by its size before it is tokenized, and tokenizing
  runs off the event loop; without max_tokens a request gets as many tokens as fit;
- SIGTERM on ``python -m minillm serve`` ends in-flight streams and the process within a bound.
"""

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from minillm import GPT, GPTConfig, generate, load_model
from minillm.serving import Engine
from minillm.tools.server import MAX_BODY_BYTES, MESSAGE_CHARS, Server, TextOut, uvicorn_config

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

pytestmark = pytest.mark.host_only  # an HTTP front end over the NumPy engine; no array code of its own
# the engine runs the paged KV cache and the scheduler (chapters 3, 6, 10) and samples (chapter 1)
USES = pytest.mark.uses_exercise("1.1", "1.2", "3.1", "3.3", "6.1", "6.4", "7.1", "10.1", "10.2", "10.3")
PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:\nWe", "KING HENRY:", "To be, or", "HAMLET:\nAy"]


@pytest.fixture(scope="module")
def target():
    return load_model("target")


@contextlib.contextmanager
def running(server: Server):
    """Serve ``server`` on 127.0.0.1 at a free port -> its base URL; stop it afterwards."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn_config(server, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert uv.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


def make_server(model, tok, name="target", max_num_seqs=8, max_queue=64, num_blocks=256, request_timeout=10.0):
    engine = Engine(model, num_blocks=num_blocks, page_size=16, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=256, chunk_size=64, prefix_caching=True)
    return Server(name, model, tok, engine, max_queue=max_queue, request_timeout=request_timeout)


@pytest.fixture(scope="module")
def served(target):
    server = make_server(*target)
    with running(server) as url:
        yield server, url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def offline(model, tok, prompt: str, n: int, **sampling) -> str:
    return tok.decode(generate(model, tok.encode(prompt), n, **sampling).tokens)


def raw(url: str, data: bytes) -> socket.socket:
    """A socket to the server that has sent ``data`` (an HTTP request, whole or not)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(data)
    return sock


def post_head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


def response(sock: socket.socket) -> tuple[int, dict]:
    """Read a whole response (the server closes the connection after it) -> (status, its JSON body)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def serves(url: str) -> None:
    """The server still answers a good request."""
    ok = httpx.post(url + "/v1/completions", json={"model": "target", "prompt": "ROMEO:", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text


def pool_is_clean(server: Server) -> None:
    """Once idle: nothing in flight, the pool's books balance, every block is free (a cached prefix
    block no sequence holds counts as free: the pool evicts it when it needs the room)."""
    deadline = time.monotonic() + 10
    engine = server.loop.engine
    while (server.loop.in_flight or engine.running or engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (server.loop.in_flight or engine.running or engine.waiting)
    engine.pool.check()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


# ---- answers ---------------------------------------------------------------------------------------


@USES
def test_greedy_completions_equal_offline_generate_streamed_or_not(target, served):
    model, tok = target
    server, url = served
    c = client(url)
    for prompt in PROMPTS[:3]:
        want = offline(model, tok, prompt, 24, temperature=0.0)
        r = c.completions.create(model="target", prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(tok.encode(prompt))
        parts = [ch.choices[0].text for ch in c.completions.create(model="target", prompt=prompt, max_tokens=24,
                                                                  temperature=0, stream=True)]
        assert "".join(parts) == want and len(parts) > 1
    pool_is_clean(server)


@USES
@pytest.mark.uses_exercise("6.3", "9.2", "9.3")
def test_a_server_that_speculates_answers_as_offline_generate(target, monkeypatch):
    """``serve --speculate``: a lone greedy request's answer, streamed or not, is offline generate's, and
    its steps did speculate."""
    model, tok = target
    rounds = []
    real = Engine._speculative_step
    monkeypatch.setattr(Engine, "_speculative_step", lambda self, *a: rounds.append(a[1]) or real(self, *a))
    engine = Engine(model, num_blocks=64, page_size=16, max_num_seqs=4, max_num_batched_tokens=256, chunk_size=64,
                    prefix_caching=True, speculate=True)
    server = Server("target", model, tok, engine)
    with running(server) as url:
        c = client(url)
        for prompt in ["ROMEO:\nO Romeo, Romeo, Romeo, Romeo", PROMPTS[1]]:
            want = offline(model, tok, prompt, 32, temperature=0.0)
            r = c.completions.create(model="target", prompt=prompt, max_tokens=32, temperature=0)
            assert r.choices[0].text == want and r.usage.completion_tokens == 32
            parts = [ch.choices[0].text for ch in c.completions.create(model="target", prompt=prompt, max_tokens=32,
                                                                      temperature=0, stream=True)]
            assert "".join(parts) == want
        pool_is_clean(server)
    assert rounds, "no step speculated"


@USES
def test_a_seed_reproduces_a_sampled_answer_and_top_p_is_the_engines(target, served):
    model, tok = target
    c = client(served[1])
    want = offline(model, tok, "ROMEO:", 30, temperature=0.9, top_p=0.8, seed=7)
    got = [c.completions.create(model="target", prompt="ROMEO:", max_tokens=30, temperature=0.9, top_p=0.8,
                                seed=7).choices[0].text for _ in range(2)]
    assert got == [want, want]


@USES
def test_stop_strings_cut_the_text_before_them(target, served):
    model, tok = target
    c = client(served[1])
    full = offline(model, tok, "ROMEO:", 60, temperature=0.0)
    stop = full[20:22]  # a string the greedy answer writes
    want = full[: full.index(stop)]
    r = c.completions.create(model="target", prompt="ROMEO:", max_tokens=60, temperature=0, stop=[stop, "@@"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    parts = [ch.choices[0].text for ch in c.completions.create(model="target", prompt="ROMEO:", max_tokens=60,
                                                              temperature=0, stop=stop, stream=True)]
    assert "".join(parts) == want
    pool_is_clean(served[0])


def test_text_out_holds_back_a_forming_stop_string_and_whole_characters():
    class Bytes:  # a byte-level tokenizer: token i is the byte i
        token_bytes = [bytes([i]) for i in range(256)]

    out = TextOut(Bytes(), ["\n\n"])
    deltas = [out.push(b) for b in b"ab\n"]
    assert "".join(deltas) == "ab" and not out.stopped  # "\n" may start the stop string: held
    assert out.push(ord("\n")) == "" and out.stopped and out.finish() == ""
    out = TextOut(Bytes(), [])
    assert [out.push(b) for b in "é!".encode()] == ["", "é", "!"]  # never half a character
    out = TextOut(Bytes(), ["xy"])
    assert "".join(out.push(b) for b in b"axb") + out.finish() == "axb" and not out.stopped


@USES
@pytest.mark.uses_exercise("8.4")
def test_chat_completions_use_the_models_chat_template(served):
    """SmolLM2's tokenizer on a tiny random model: the prompt is the ChatML of the messages, the
    answer offline generate's tokens up to the end of turn."""
    from test_bpe import smollm2_gguf

    from minillm.registry import load_tokenizer

    tok = load_tokenizer(smollm2_gguf())
    model = GPT.init(GPTConfig(vocab_size=tok.vocab_size, block_size=128, n_layer=1, n_head=2, n_embd=16), seed=3)
    server = make_server(model, tok, name="tiny")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"}]
    ids = tok.encode_pieces(tok.chat_pieces(messages))
    tokens = generate(model, ids, 12, temperature=0.0).tokens
    if tok.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tok.eos_token_id)]
    with running(server) as url:
        c = client(url)
        r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == tok.decode(tokens) and r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == len(ids)
        parts = [ch.choices[0].delta.content or "" for ch in
                 c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)]
        assert "".join(parts) == tok.decode(tokens)
        as_parts = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, messages[1]]
        chunks = list(c.chat.completions.create(model="tiny", messages=as_parts, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == tok.decode(tokens)
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}}]}]
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": image}, timeout=30)
        assert r.status_code == 400 and "text parts" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot"}]})
        assert r.status_code == 400 and "role" in r.json()["error"]["message"]


@USES
@pytest.mark.uses_exercise("8.1", "8.2", "8.3", "8.4")
def test_smollm2_chat_answers_equal_offline_generate():
    """The real model through the server: greedy chat answers are ``generate``'s tokens up to the end of
    turn, plain and streamed."""
    model, tok = load_model("smollm2-135m")
    server = make_server(model, tok, name="smollm2-135m", max_num_seqs=2, num_blocks=64)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokens = generate(model, tok.encode_pieces(tok.chat_pieces(messages)), 16, temperature=0.0).tokens
    want = tok.decode(tokens[: tokens.index(tok.eos_token_id)] if tok.eos_token_id in tokens else tokens)
    with running(server) as url:
        c = client(url)
        r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == want and "Paris" in want
        stream = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0,
                                           stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream) == want
        pool_is_clean(server)


@USES
def test_sixteen_concurrent_clients_each_get_their_own_answer(target, served):
    model, tok = target
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 3)][:16]
    want = [offline(model, tok, p, 20, temperature=0.0) for p in prompts]
    c = client(served[1])

    def ask(i):
        if i % 2:
            return c.completions.create(model="target", prompt=prompts[i], max_tokens=20, temperature=0).choices[0].text
        stream = c.completions.create(model="target", prompt=prompts[i], max_tokens=20, temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in stream)

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, range(16))) == want
    pool_is_clean(served[0])


# ---- faults -----------------------------------------------------------------------------------------


@USES
def test_a_client_that_disconnects_is_aborted_at_once_and_leaks_nothing(target, served):
    server, url = served
    body = {"model": "target", "prompt": "ROMEO:", "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            steps = server.loop.snapshot["steps"]
        deadline = time.monotonic() + 10
        while server.loop.engine.running and time.monotonic() < deadline:
            time.sleep(0.005)
        assert not server.loop.engine.running
        assert server.loop.snapshot["steps"] - steps <= 3  # aborted within a step or two of the close
        for i in range(100):  # a hundred clients that go away after their first token
            with http.stream("POST", "/v1/completions", json=body | {"prompt": PROMPTS[i % 6]}) as r:
                next(r.iter_lines())
        pool_is_clean(server)
        metrics = http.get("/metrics").text
    assert "minillm_requests_running 0" in metrics and "minillm_requests_in_flight 0" in metrics
    aborted = next(line for line in metrics.splitlines() if line.startswith("minillm_requests_aborted_total "))
    assert int(aborted.split()[1]) >= 101


@USES
def test_a_plain_request_whose_client_leaves_is_aborted_within_a_few_steps(served, monkeypatch):
    """A non-streamed request whose client closes its socket mid-answer: the engine runs at most a few
    more steps for it, the aborted counter counts it, and its blocks go back (each step is slowed
    by 2 ms, so that the 240-token answer cannot finish first)."""
    server, url = served
    step = server.loop.engine.step
    monkeypatch.setattr(server.loop.engine, "step", lambda: (time.sleep(0.002), step())[1])
    aborted = server.counts["requests_aborted_total"]
    body = json.dumps({"model": "target", "prompt": "ROMEO:", "max_tokens": 240, "temperature": 0}).encode()
    sock = raw(url, post_head(len(body)) + body)
    deadline = time.monotonic() + 10
    while not server.loop.engine.running and time.monotonic() < deadline:
        time.sleep(0.002)
    steps = server.loop.steps
    sock.close()
    while server.loop.engine.running and time.monotonic() < deadline:
        time.sleep(0.002)
    assert server.loop.steps - steps <= 5, f"{server.loop.steps - steps} steps after the client left"
    assert server.counts["requests_aborted_total"] == aborted + 1
    pool_is_clean(server)
    serves(url)


@USES
def test_slow_headers_or_body_get_408_and_the_server_keeps_serving(target):
    """With a 0.5 s request timeout: 20 connections that send half their headers, one that sends
    nothing and one that sends a tenth of its body each get a 408 and are closed, while a good
    request is answered."""
    server = make_server(*target, request_timeout=0.5)
    with running(server) as url:
        slow = [raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n") for _ in range(20)]
        slow += [raw(url, b""), raw(url, post_head(100) + b'{"model": ')]
        t0 = time.monotonic()
        serves(url)
        for sock in slow:
            with sock:
                status, body = response(sock)
            assert status == 408 and "did not arrive within 0.5 s" in body["error"]["message"]
        assert time.monotonic() - t0 < 5
        serves(url)


@USES
def test_a_client_that_leaves_during_its_upload_is_logged_in_one_line(served):
    """Five clients send a tenth of their body and close: five log lines, no traceback."""
    url, records = served[1], []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        for _ in range(5):
            raw(url, post_head(1000) + b'{"model": "target", ').close()
        deadline = time.monotonic() + 10
        while len(records) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        serves(url)
    finally:
        logger.removeHandler(handler)
    assert len(records) == 5 and all("closed its connection" in r.getMessage() for r in records)
    assert not any(r.exc_info for r in records)


@USES
def test_overload_gets_429_with_retry_after_at_once(target):
    """The engine is held before its next step (so no request can finish): 2 running + 1 queued
    fill the budget, and the next request is refused at once."""
    server = make_server(*target, max_num_seqs=2, max_queue=1)
    gate, step = threading.Event(), server.loop.engine.step
    server.loop.engine.step = lambda: (gate.wait(), step())[1]
    body = {"model": "target", "prompt": "ROMEO:", "max_tokens": 240, "temperature": 0, "stream": True}
    with running(server) as url, httpx.Client(base_url=url, timeout=30) as http:
        with contextlib.ExitStack() as streams:
            for _ in range(3):
                streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while server.loop.in_flight < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.monotonic()
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1" and time.monotonic() - t0 < 2
            assert r.json()["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                client(url).completions.create(model="target", prompt="x", max_tokens=2)
            gate.set()
        pool_is_clean(server)
        assert http.post("/v1/completions", json=body | {"stream": False, "max_tokens": 3}).status_code == 200


REFUSED_FIELDS = {"logprobs": 2, "echo": True, "best_of": 2, "suffix": "x", "tools": [{"type": "function"}],
                  "response_format": {"type": "json_object"}, "logit_bias": {"5": 10}, "presence_penalty": 0.5,
                  "frequency_penalty": 0.5, "top_k": 5}


@USES
@pytest.mark.parametrize("content, message, param", [
    (b'{"model": "target", "prompt": ', "not JSON", None),
    (b'{"model": "target", "prompt": "\xff\xfe"}', "not UTF-8", None),
    (b'[1, 2]', "JSON object", None),
    (b'{"model": "target", "prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", "nested too deeply", None),
    (b'{"model": "target", "prompt": "ROMEO:", "seed": ' + b"7" * 5000 + b"}", "more than 20 digits", None),
    (b'{"model": "target", "prompt": "ROMEO:", "temperature": 1' + b"0" * 400 + b"}", "more than 20 digits", None),
    (b'{"model": "target", "prompt": "ROMEO:", "top_p": 1' + b"0" * 400 + b"}", "more than 20 digits", None),
    (b'{"model": "gpt-4", "prompt": "ROMEO:"}', "unknown model", "model"),
    (b'{"model": "target", "prompt": "ROMEO:", "temperature": NaN}', "temperature", "temperature"),
    (b'{"model": "target", "prompt": "ROMEO:", "temperature": -1}', "temperature", "temperature"),
    (b'{"model": "target", "prompt": "ROMEO:", "temperature": 1e-300}', "temperature must be 0", "temperature"),
    (b'{"model": "target", "prompt": "ROMEO:", "temperature": 2.5}', "at most 2", "temperature"),
    (b'{"model": "target", "prompt": "ROMEO:", "temperature": "hot"}', "temperature", "temperature"),
    (b'{"model": "target", "prompt": "ROMEO:", "top_p": 2}', "top_p", "top_p"),
    (b'{"model": "target", "prompt": "ROMEO:", "top_p": 0}', "top_p", "top_p"),
    (b'{"model": "target", "prompt": "ROMEO:", "max_tokens": 0}', "max_tokens", "max_tokens"),
    (b'{"model": "target", "prompt": "ROMEO:", "n": 2}', "n must be 1", "n"),
    (b'{"model": "target", "prompt": ""}', "prompt", "prompt"),
    (b'{"model": "target", "prompt": "ROMEO:", "stop": [1]}', "stop", "stop"),
    (b'{"model": "target", "prompt": "ROMEO:", "max_tokens": 100000}', "too long", "prompt"),
    (b'{"model": "target", "prompt": "ROMEO:", "seed": -3}', "seed", "seed"),
    (b'{"model": "target", "messages": [{"role": "user", "content": "hi"}]}', "no chat template", "model"),
    (b'{"model": "target", "prompt": "ROMEO:", "stream": true, "stream_options": 3}', "stream_options",
     "stream_options"),
    (b'{"model": "target", "messages": [], "tools": []}', "unsupported fields: tools", "tools"),
    (b'{"model": "target", "prompt": "ROMEO:", "max_completion_tokens": 3}', "unsupported fields: max_comp",
     "max_completion_tokens"),  # a chat field
    *[(json.dumps({"model": "target", "prompt": "ROMEO:", name: value}).encode(), f"unsupported fields: {name}", name)
      for name, value in REFUSED_FIELDS.items()],
], ids=lambda v: repr(v[:60]) if isinstance(v, bytes) else None)
def test_bad_input_gets_400_with_an_error_object_and_the_server_keeps_serving(served, content, message, param):
    url = served[1]
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
    r = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and "\n" not in error["message"]
    assert error["param"] == param, error
    serves(url)


@pytest.mark.uses_exercise("3.3", "10.1")
def test_errors_quote_only_the_beginning_of_what_was_sent(served):
    """A 500,000-character model name, temperature or field name, a prompt of 80 characters the model
    does not know: the error quotes the start of it."""
    url, huge, unknown = served[1], "ROMEO" * 100_000, "".join(map(chr, range(0x4E00, 0x4E50)))
    for body in [{"model": huge, "prompt": "ROMEO:"}, {"model": "target", "prompt": "ROMEO:", "temperature": huge},
                 {"model": "target", "prompt": "ROMEO:", huge: 1}, {"model": "target", "prompt": unknown}]:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and len(error["message"]) <= MESSAGE_CHARS + 1, error["message"][:200]
        assert len(str(error["param"])) <= MESSAGE_CHARS + 1
    serves(url)


@USES
def test_unknown_paths_methods_and_broken_http_get_openai_error_objects(served):
    url = served[1]
    r = httpx.post(url + "/v1/embeddings", json={"model": "target", "input": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert "/v1/embeddings" in r.json()["error"]["message"]
    r = httpx.get(url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.headers["Allow"] == "POST" and "GET" in r.json()["error"]["message"]
    with raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: many\r\n\r\n") as sock:
        status, body = response(sock)  # not HTTP: uvicorn's 400, as an error object too
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    serves(url)


@USES
def test_a_body_over_the_limit_gets_413_by_its_length_or_as_it_arrives(served):
    url = served[1]
    sock = raw(url, post_head(MAX_BODY_BYTES + 1))  # the declared length alone: nothing of it is sent
    with sock:
        status, body = response(sock)
    assert status == 413 and str(MAX_BODY_BYTES) in body["error"]["message"]
    chunks = (b"x" * 65536 for _ in range(MAX_BODY_BYTES // 65536 + 2))  # chunked: no length to go by
    r = httpx.post(url + "/v1/completions", content=chunks, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/completions", json={"model": "target", "prompt": "ROMEO " * 700_000}, timeout=30)
    assert r.status_code == 413
    serves(url)


@USES
def test_a_long_prompt_is_refused_by_its_size_and_tokenizing_leaves_the_event_loop_free(served, monkeypatch):
    """300,000 characters cannot fit a context of 256 tokens: refused without tokenizing. A slow
    tokenizer (1 s per prompt) runs in a worker thread: /health answers meanwhile."""
    server, url = served
    tok, calls = server.tokenizer, []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: calls.append(len(text)) or (time.sleep(1.0), encode(text))[1])
    r = httpx.post(url + "/v1/completions", json={"model": "target", "prompt": "ROMEO " * 50_000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" and calls == []
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, url + "/v1/completions", json={"model": "target", "prompt": "ROMEO:",
                                                                         "max_tokens": 2}, timeout=30)
        while not calls:
            time.sleep(0.01)
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert time.monotonic() - t0 < 0.5, "the event loop waited for the tokenizer"
        assert answer.result().status_code == 200


@USES
def test_without_max_tokens_a_request_gets_as_many_tokens_as_fit(served):
    """The character model's context is 256 tokens: a 245-character prompt with no max_tokens gets
    the 12 tokens that fit (the last one is never cached), through the openai client."""
    server, url = served
    prompt = "ROMEO:\n" * 35
    r = client(url).completions.create(model="target", prompt=prompt, temperature=0)
    assert server.context == 256 and r.usage.completion_tokens == 256 - len(prompt) + 1 == 12
    assert r.choices[0].finish_reason == "length"
    serves(url)


def test_the_long_prompt_error_reaches_the_openai_client(served):
    with pytest.raises(openai.BadRequestError, match="context"):
        client(served[1]).completions.create(model="target", prompt="ROMEO: " * 200, max_tokens=5)


@USES
def test_models_health_and_metrics(served):
    url = served[1]
    assert [m.id for m in client(url).models.list()] == ["target"]
    assert client(url).completions.create(model="target", prompt="ROMEO:", max_tokens=3).usage.completion_tokens == 3
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(url + "/metrics").text
    for name in ("minillm_requests_running", "minillm_requests_waiting", "minillm_kv_blocks_used",
                 "minillm_kv_blocks_free", "minillm_prefix_cache_reused_tokens_total",
                 'minillm_time_to_first_token_seconds_bucket{le="+Inf"}', "minillm_inter_token_latency_seconds_count"):
        assert f"\n{name} " in metrics, name


@USES
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_streams_and_the_server_within_a_bound(sig):
    """``python -m minillm serve`` in a child process: SIGTERM or SIGINT (Ctrl-C) during a long stream
    -> the stream ends (the client is not left hanging) and the process exits within the shutdown
    timeout + 5 s, with no traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--model", "target", "--port", str(port),
                              "--shutdown-timeout", "2", "--exit-with-parent"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        body = {"model": "target", "prompt": "ROMEO:", "max_tokens": 240, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = json.loads(next(lines).removeprefix("data: "))
            assert first["object"] == "text_completion"
            t0 = time.monotonic()
            child.send_signal(sig)
            with contextlib.suppress(httpx.TransportError):
                for _ in lines:  # ends: the server cancels or finishes it, or closes the connection
                    pass
            assert time.monotonic() - t0 < 10
        child.wait(timeout=10)  # uvicorn shuts down, then ends with the signal it caught, as a server should
        assert child.returncode in (0, -sig, 128 + sig) and time.monotonic() - t0 < 2 + 5
        assert b"Traceback" not in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@USES
def test_serve_load_fault_run_leaves_no_block_and_every_surviving_answer_right(served, capsys, tmp_path):
    """``bench serve-load --kill 0.5``: half the clients hang up mid-stream; the rest get the answer
    their prompt gets alone, and the server holds no KV block afterwards. The JSON is a new file."""
    from minillm.tools.benchmarks import serve_load

    out = tmp_path / "row.json"
    args = ["--url", served[1], "--rate", "20", "--duration", "1.5", "--max-tokens", "24", "--kill", "0.5",
            "--shared-prefix", "40", "--seed", "3", "--json", str(out)]
    assert serve_load.main(args) == 0
    row = json.loads(out.read_text())
    assert row["fault_hung_up"] > 0 and row["fault_survivors"] > 0 and row["completed"] == row["fault_survivors"]
    assert row["fault_survivors_wrong"] == 0 and row["fault_blocks_held_after"] == 0 and row["errors"] == "-"
    assert "KV blocks held afterwards: 0" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's usage error, before any request
        serve_load.main(args)
    assert "row.json exists: name a new file" in capsys.readouterr().err and json.loads(out.read_text()) == row
    pool_is_clean(served[0])


def test_an_engine_that_raises_fails_its_requests_and_refuses_new_ones(target):
    """A bug in a step must not leave clients hanging: the open request gets a 500 at once, /health
    turns 503 with the reason, and a new request gets 503."""
    server = make_server(*target)

    def broken():
        raise RuntimeError("a bug in the step")

    server.loop.engine.step = broken
    with running(server) as url:
        with pytest.raises(openai.InternalServerError, match="a bug in the step"):
            client(url).completions.create(model="target", prompt="ROMEO:", max_tokens=5)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "a bug in the step" in health.json()["error"]
        r = httpx.post(url + "/v1/completions", json={"model": "target", "prompt": "ROMEO:", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"


def alive(pid: int) -> bool:
    """Running (not gone, and not a zombie waiting for whoever adopted it to reap it); Linux's /proc."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from Linux's /proc")
def test_a_server_started_with_exit_with_parent_does_not_outlive_its_parent():
    """A parent starts ``serve --exit-with-parent`` and is killed (SIGKILL: no cleanup of its own):
    the server notices and exits within seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-m', 'minillm', 'serve', "
            f"'--port', '{port}', '--exit-with-parent']); print(p.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and alive(server_pid):
            time.sleep(0.1)
        assert not alive(server_pid), "the server outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
