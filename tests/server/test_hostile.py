"""Hostile input and overload: every bad value gets a 4xx naming what to change, and no single request
stalls the server. While each heavy hostile request is in flight, /health and a small completion from another
client must still answer within PROBE_SECONDS.

Real uvicorn with the guarded protocol (server/http.py) and the real engine on a tiny random checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")  # the GPU machine has no server stack

from ostinato.engine.async_engine import AsyncEngine
from ostinato.engine.engine import LLMEngine
from ostinato.server.app import build_app
from ostinato.server.http import uvicorn_config
from ostinato.server.limits import CHARS_PER_TOKEN, ServerLimits
from ostinato.tools.checkpoint import make_checkpoint
from test_server import MAX_MODEL_LEN, MODEL, TestServer, ThrottledEngine, engine_args

PROBE_SECONDS = 5.0  # /health and a small completion must answer within this while a hostile request runs
HOSTILE_SECONDS = 30.0  # and the hostile request itself must be answered within this
QUEUE_BOUND = 16
# max_n above the queue bound, so that n-over-queue-bound reaches the engine's check.
LIMITS = ServerLimits(max_n=64, header_timeout=1.0, body_timeout=1.0, stream_send_timeout=0.5,
                      timeout_keep_alive=1.0)
CHAR_CAP = CHARS_PER_TOKEN * (MAX_MODEL_LEN - 1)


class GuardedServer(TestServer):
    """TestServer, but served the way `ostinato serve` serves: the guarded protocol and the limits."""

    def __init__(self, engine, limits: ServerLimits = LIMITS):
        self.async_engine = AsyncEngine(engine)
        self.async_engine.start()
        self.app = build_app(self.async_engine, api_key=None, served_model_name=MODEL, limits=limits)
        self._start(uvicorn_config(self.app, limits, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.headers = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hostile") / "ckpt", shape="tiny", family="llama")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return ThrottledEngine(LLMEngine(engine_args(checkpoint, max_queued_requests=QUEUE_BOUND)))


@pytest.fixture(scope="module")
def server(engine):
    srv = GuardedServer(engine)
    yield srv
    srv.stop()


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def probe(server) -> None:
    """/health and a small completion answer, each within PROBE_SECONDS."""
    t0 = time.monotonic()
    assert httpx.get(server.base_url + "/health", timeout=PROBE_SECONDS).status_code == 200
    r = httpx.post(server.base_url + "/v1/completions", timeout=PROBE_SECONDS,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 2 * PROBE_SECONDS


def while_in_flight(server, send) -> httpx.Response:
    """Run `send()` (a hostile request) on another thread and probe the server until it is answered."""
    result: dict = {}

    def run():
        try:
            result["response"] = send()
        except BaseException as e:  # noqa: BLE001 - re-raised below on the test's thread
            result["error"] = e

    hostile = threading.Thread(target=run, daemon=True)
    hostile.start()
    deadline = time.monotonic() + HOSTILE_SECONDS
    probe(server)  # at least once, even if the hostile request is refused at once
    while hostile.is_alive():
        assert time.monotonic() < deadline, "the hostile request was not answered in time"
        probe(server)
    if "error" in result:
        raise result["error"]
    return result["response"]


def post(server, path: str, body: dict) -> httpx.Response:
    """POST `body` as Python's json module writes it: lone surrogates as \\ud800 escapes, NaN and Infinity as
    JSON's common extension (httpx's own encoder refuses both)."""
    return httpx.post(server.base_url + path, content=json.dumps(body).encode(), timeout=HOSTILE_SECONDS,
                      headers={"Content-Type": "application/json"})


CHAT = [{"role": "user", "content": "hello"}]
# (name, path, body, status, param): heavy requests, each probed while in flight.
HEAVY = [
    ("1MB-prompt", "/v1/completions", {"prompt": "word " * 200_000}, 400, "prompt"),
    ("4MB-prompt", "/v1/completions", {"prompt": "x" * 4_000_000}, 413, None),
    ("1MB-chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200_000}]}, 400,
     "messages"),
    ("30k-messages", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 30_000}, 400,
     "messages"),
    ("300k-token-ids", "/v1/completions", {"prompt": [1] * 300_000}, 400, "prompt"),
    ("n-1e6", "/v1/completions", {"prompt": "hi", "n": 1_000_000, "max_tokens": 1}, 400, "n"),  # over --max-n
    ("100k-stops", "/v1/completions", {"prompt": "hi", "stop": ["ab"] * 100_000}, 400, "stop"),
    ("long-stop", "/v1/completions", {"prompt": "hi", "stop": ["ab" * 50_000]}, 400, "stop"),
    ("100k-stop-ids", "/v1/completions", {"prompt": "hi", "stop_token_ids": [5] * 100_000}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize("name,path,body,status,param", HEAVY, ids=[h[0] for h in HEAVY])
def test_heavy_request_is_refused_without_stalling_others(server, name, path, body, status, param):
    response = while_in_flight(server, lambda: post(server, path, {"model": MODEL, **body}))
    assert_error(response, status, param)


def test_prompt_is_measured_before_it_is_tokenized(server, engine):
    """A prompt one character over the cap is refused without being tokenized; tokenization runs in the
    tokenizer pool, never on the event loop or the engine thread."""
    threads: list[str] = []
    encode = engine.tokenizer.encode

    def spy(*args, **kw):
        threads.append(threading.current_thread().name)
        return encode(*args, **kw)

    engine.tokenizer.encode = spy
    try:
        assert_error(post(server, "/v1/completions", {"prompt": "a" * (CHAR_CAP + 1)}), 400, "prompt")
        assert threads == []
        assert post(server, "/v1/completions", {"prompt": "a fine prompt", "max_tokens": 2}).status_code == 200
        assert post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}).status_code == 200
    finally:
        del engine.tokenizer.encode
    assert len(threads) == 2 and all(t.startswith("ostinato-tokenize") for t in threads), threads


SURROGATE = "abc\ud800def"
BAD_VALUES = [  # (name, path, body, param)
    ("surrogate-prompt", "/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("surrogate-prompt-list", "/v1/completions", {"prompt": [SURROGATE]}, "prompt"),
    ("surrogate-chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages"),
    ("surrogate-chat-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, "messages"),
    ("surrogate-stop", "/v1/completions", {"prompt": "hi", "stop": [SURROGATE]}, "stop"),
    ("temperature-nan", "/v1/completions", {"prompt": "hi", "temperature": float("nan")}, "temperature"),
    ("temperature-inf", "/v1/completions", {"prompt": "hi", "temperature": float("inf")}, "temperature"),
    ("temperature-1e39", "/v1/completions", {"prompt": "hi", "temperature": 1e39}, "temperature"),
    ("top-p-nan", "/v1/chat/completions", {"messages": CHAT, "top_p": float("nan")}, "top_p"),
    ("top-p-float32-zero", "/v1/completions", {"prompt": "hi", "top_p": 1e-46}, "top_p"),
    ("n-over-queue-bound", "/v1/completions", {"prompt": "hi", "n": QUEUE_BOUND + 1, "max_tokens": 1}, "n"),
    ("logprobs-over-cap", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "logprobs"),
    ("temperature-string", "/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("stream-yes", "/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("n-true", "/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("max-tokens-string", "/v1/completions", {"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ("top-k-float", "/v1/completions", {"prompt": "hi", "top_k": 2.0}, "top_k"),
    ("ignore-eos-int", "/v1/completions", {"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
    ("token-id-bool", "/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("chat-logprobs-int", "/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
]


@pytest.mark.parametrize("name,path,body,param", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_is_400_naming_the_parameter(server, name, path, body, param):
    error = assert_error(post(server, path, {"model": MODEL, **body}), 400, param)
    assert error["type"] == "invalid_request_error"
    assert "TypeError" not in error["message"]  # a tokenizer's exception never reaches the client


def test_internal_error_does_not_leak(checkpoint):
    engine = ThrottledEngine(LLMEngine(engine_args(checkpoint)))

    def encode(*_args, **_kw):
        raise RuntimeError("secret: /srv/models/private-weights")

    srv = GuardedServer(engine)
    try:
        engine._engine.tokenizer.encode = encode
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
        error = assert_error(r, 500)
        assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
    finally:
        srv.stop()


# ---- edge contracts ----------------------------------------------------------------------------------------
def test_openapi_documents_400_not_422(server):
    schema = httpx.get(server.base_url + "/openapi.json", timeout=10).json()
    assert "422" not in json.dumps(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"400", "413", "429"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_models_does_not_disclose_the_path(server, checkpoint):
    body = httpx.get(server.base_url + "/v1/models", timeout=10).text
    assert str(checkpoint) not in body and checkpoint.name not in body and "/" not in body.replace("\\/", "")


def test_oversized_headers_get_the_error_body(server):
    r = httpx.get(server.base_url + "/health", headers={"X-Big": "a" * (LIMITS.max_header_bytes + 100)}, timeout=10)
    error = assert_error(r, 431)
    assert "--max-header-bytes" in error["message"]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # the same head, sent in pieces
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(LIMITS.max_header_bytes // 1000 + 2):
            try:
                sock.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
            except OSError:
                break
        reply = _read_until_closed(sock, 5)
    assert reply.startswith(b"HTTP/1.1 431") and b'"error"' in reply
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # not HTTP at all
        sock.sendall(b"HELLO THERE\r\n\r\n")
        reply = _read_until_closed(sock, 5)
    assert reply.startswith(b"HTTP/1.1 400") and json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 400
    probe(server)


def test_each_request_on_a_kept_alive_connection_has_its_own_head_bound_and_timer(server, engine):
    """On one connection: three heads of 10 KB, each sent in two pieces, answer (the bound, 16 KB, is per head,
    not per connection); a stream that outlasts --header-timeout (1 s here) is not cut by the head timer, and the
    connection then serves the next request; a head over the bound still gets 431."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(10)
        for _ in range(3):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5_000)
            time.sleep(0.05)  # the server reads the head in two pieces
            sock.sendall(b"a" * 5_000 + b"\r\n\r\n")
            assert _read_response(sock)[0] == 200
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 60, "min_tokens": 60, "temperature": 0,
                           "stream": True}).encode()
        engine.delay = 0.03  # 60 tokens: about 2 s of streaming
        try:
            t0 = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            status, streamed = _read_response(sock)
        finally:
            engine.delay = 0.0
        assert status == 200 and b"data: [DONE]" in streamed and time.monotonic() - t0 > 1.5
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (LIMITS.max_header_bytes + 100)
                     + b"\r\n\r\n")
        assert _read_response(sock)[0] == 431


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response from a kept-alive connection: its status and body (by Content-Length, or chunked)."""
    def more() -> bytes:
        got = sock.recv(65536)
        assert got, f"the server closed the connection mid-response, after {data + body!r:.300}"
        return got

    data = body = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, body = data.split(b"\r\n\r\n", 1)
    status = int(head.split(b" ", 2)[1])
    length = [int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
              if line.lower().startswith(b"content-length:")]
    while (len(body) < length[0]) if length else not body.endswith(b"\r\n0\r\n\r\n"):
        body += more()
    return status, body


def _read_until_closed(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:  # the server closed while our last bytes were unread: its reply came first
        pass
    return data


def test_slowloris_head_is_cut_off(server):
    """A head trickled one byte at a time, and a connection that sends nothing, are closed with 408 after
    --header-timeout (1 s here), not held for ever."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as trickle, \
            socket.create_connection(("127.0.0.1", server.port)) as silent:
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for _ in range(100):  # keep trickling for up to 10 s; the server must hang up long before
            try:
                trickle.sendall(b"X")
            except OSError:
                closed = True
                break
            trickle.settimeout(0.1)
            try:
                if trickle.recv(65536) == b"":
                    closed = True
                    break
            except socket.timeout:
                continue
            except OSError:
                closed = True
                break
        assert closed, "a trickled request head held its connection"
        assert time.monotonic() - t0 < LIMITS.header_timeout + 3
        reply = _read_until_closed(silent, 5)
        assert reply.startswith(b"HTTP/1.1 408") and b'"error"' in reply
    probe(server)


def test_slow_body_is_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        reply = _read_until_closed(sock, LIMITS.body_timeout + 5)
        assert time.monotonic() - t0 < LIMITS.body_timeout + 3
    assert reply.startswith(b"HTTP/1.1 408") and b'"error"' in reply
    probe(server)


def test_unread_stream_is_aborted_and_its_blocks_freed(server, engine):
    """A client that keeps its connection but reads nothing: the ASGI send blocks (as on a full socket), and
    after --stream-send-timeout the request is aborted and its KV blocks freed."""
    engine.delay = 0.02  # 200 tokens would take >= 4 s; the abort must come long before
    body = json.dumps({"model": MODEL, "prompt": "never read", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json"),
                                                                 (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent_chunks = []

    async def run() -> float:
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        never = asyncio.Event()

        async def receive():
            return messages.pop() if messages else await never.wait()  # connected, silent

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sent_chunks.append(message["body"])
                if len(sent_chunks) >= 2:
                    await never.wait()  # the socket is full: the client reads nothing

        t0 = time.monotonic()
        await asyncio.wait_for(server.app(scope, receive, send), timeout=10)
        return time.monotonic() - t0

    try:
        elapsed = asyncio.run(run())
        stats = server.wait_until_idle(timeout=5)
    finally:
        engine.delay = 0.0
    assert elapsed < 3.0, f"the unread stream held its request for {elapsed:.1f} s"
    assert stats.kv_blocks_free == stats.kv_blocks_total
    probe(server)


def test_unread_stream_over_a_real_socket(server, engine):
    """The same over TCP: a client with a 1 KiB receive buffer asks for 16 streamed completions with 20 logprobs
    each (megabytes of events) and reads nothing. Once the socket buffers fill, the request must be aborted long
    before it would finish, and its blocks freed. Steps take 20 ms (230 of them >= 4.6 s), so that the engine
    cannot outrun the server's event loop: unthrottled, on a loaded 2-core machine, it once generated every
    token before the stalled send timed out (under the full suite; alone, less than half of them)."""
    n, max_tokens = QUEUE_BOUND, 230
    body = json.dumps({"model": MODEL, "messages": CHAT, "n": n, "logprobs": True, "top_logprobs": 20,
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    before = server.stats().generation_tokens_total
    engine.delay = 0.02
    try:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            deadline = time.monotonic() + 30
            while server.stats().generation_tokens_total == before:  # it started
                assert time.monotonic() < deadline
                time.sleep(0.05)
            stats = server.wait_until_idle(timeout=30)
    finally:
        engine.delay = 0.0
    generated = stats.generation_tokens_total - before
    assert generated < n * max_tokens, "the unread stream ran to the end"
    probe(server)


def test_server_is_idle_after_the_hostile_requests(server):
    server.wait_until_idle(timeout=10)
