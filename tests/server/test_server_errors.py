"""Every error the server answers: status code, OpenAI error body, and that nothing leaks afterwards.

Real uvicorn + the real engine on a tiny random checkpoint (helpers from test_server.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")  # the GPU machine has no server stack

from ostinato import cli
from ostinato.engine.async_engine import EngineDeadError
from ostinato.engine.engine import LLMEngine
from ostinato.errors import CheckpointError
from ostinato.tools.checkpoint import make_checkpoint
from test_server import API_KEY, MODEL, TestServer, ThrottledEngine, engine_args

MAX_BODY = 4096


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("server-errors") / "ckpt", shape="tiny", family="llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = TestServer(LLMEngine(engine_args(checkpoint)), max_body_bytes=MAX_BODY)
    yield srv
    srv.stop()


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


CHAT = [{"role": "user", "content": "hello"}]
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": list(range(10)) * 30}, "prompt"),  # 300 tokens >= max_model_len 256
    ("/v1/completions", {"prompt": [5] * 200, "max_tokens": 100}, "max_tokens"),  # 200 + 100 > 256
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -3}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", ""]}, "stop"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),  # a token id outside the vocabulary
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),  # pydantic: 400, not 422
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": -3.0}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0.0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"seven": 1.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"7": 101.0}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1000000": 1.0}}, "logit_bias"),  # outside the vocabulary
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "bad_words": [" "]}, "bad_words"),
    ("/v1/chat/completions", {"messages": CHAT, "frequency_penalty": 9.0}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 300}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS, ids=[f"{p.split('/')[-1]}-{m}-{i}"
                                                               for i, (p, _, m) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_400(server, path, body, param):
    error = assert_error(server.post(path, {"model": MODEL, **body}), 400, param)
    assert error["type"] == "invalid_request_error"


def test_bad_requests_leak_nothing(server):
    server.wait_until_idle(timeout=5)
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "still fine", "max_tokens": 3}).status_code == 200


def test_malformed_json_is_400(server):
    for raw in (b'{"prompt": ', b"not json at all"):
        r = httpx.post(server.base_url + "/v1/completions", content=raw, timeout=10,
                       headers={**server.headers, "Content-Type": "application/json"})
        assert "JSON" in assert_error(r, 400)["message"]
    assert_error(server.post("/v1/completions", [1, 2, 3]), 400)  # valid JSON, not an object
    r = httpx.post(server.base_url + "/v1/completions", content=b'{"prompt": "hi"}', headers=server.headers)
    assert "Content-Type: application/json" in assert_error(r, 400)["message"]  # curl -d without -H


def test_unknown_model_is_404(server):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        error = assert_error(server.post(path, {"model": "gpt-17", **body}), 404, "model")
        assert MODEL in error["message"]  # says which model is served


def test_api_key(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    url = server.base_url + "/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY}x"}):
        assert_error(httpx.post(url, json=body, headers=headers), 401)
    assert_error(httpx.get(server.base_url + "/v1/models"), 401)
    # a bad key is refused before the body is even parsed
    assert_error(httpx.post(url, content=b"{", headers={"Content-Type": "application/json"}), 401)
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.base_url + open_path).status_code == 200, open_path
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_body_over_the_limit_is_413(server):
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}
    assert_error(server.post("/v1/completions", big), 413)

    def chunked():  # no Content-Length: the server must count the streamed body
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(server.base_url + "/v1/completions", content=chunked(), timeout=10,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert_error(r, 413)


def test_unknown_route_has_the_error_body(server):
    assert_error(httpx.get(server.base_url + "/v1/nothing", headers=server.headers), 404)


# ---- a full queue: 429 ----------------------------------------------------------------------------------
def test_full_waiting_queue_is_429_with_retry_after(checkpoint):
    engine = ThrottledEngine(LLMEngine(engine_args(checkpoint, max_num_seqs=1, max_queued_requests=1)))
    engine.delay = 0.02
    srv = TestServer(engine)
    long = {"model": MODEL, "prompt": "long", "max_tokens": 150, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=long, headers=srv.headers) as running:
            assert running.status_code == 200
            deadline = time.monotonic() + 10
            while srv.stats().num_running != 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=long, headers=srv.headers) as waiting:
                assert waiting.status_code == 200 and srv.stats().num_waiting == 1
                r = srv.post("/v1/completions", {"model": MODEL, "prompt": "one more", "max_tokens": 2})
                assert_error(r, 429)
                assert int(r.headers["Retry-After"]) >= 1
        srv.wait_until_idle(timeout=5)  # both streams were dropped: aborted, blocks freed
        assert srv.post("/v1/completions", {"model": MODEL, "prompt": "now", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


# ---- a dead engine: 503 -----------------------------------------------------------------------------------
def test_engine_failure_fails_requests_and_health(checkpoint, caplog):
    """A step that raises fails the stream and /health with a generic cause and an incident id; the exception's
    text (which could hold anything) stays in the log, on the line that carries the same id."""
    caplog.set_level(logging.ERROR)
    engine = ThrottledEngine(LLMEngine(engine_args(checkpoint)))
    engine.delay = 0.02
    srv = TestServer(engine)
    try:
        body = {"model": MODEL, "prompt": "doomed", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, headers=srv.headers) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            engine.fail = True  # the next step raises
            rest = [line for line in lines if line]
        assert '"error"' in rest[-2] and rest[-1] == "data: [DONE]"
        assert "injected step failure" not in rest[-2] and "RuntimeError" not in rest[-2]
        incident = re.search(r"incident ([0-9a-f]{16})", rest[-2]).group(1)
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and incident in health.json()["cause"]
        assert "injected step failure" not in health.text and "RuntimeError" not in health.text
        logged = [r for r in caplog.records if incident in r.getMessage()]
        assert logged and "injected step failure" in caplog.text
        assert logged[0].exc_info is not None and "injected step failure" in str(logged[0].exc_info[1])
        assert_error(srv.post("/v1/completions", {"model": MODEL, "prompt": "hi"}), 503)
        assert httpx.get(srv.base_url + "/metrics").status_code == 200  # still scrapable
    finally:
        srv.stop()


# ---- start-up: 503 while loading, and a load that fails ----------------------------------------------------
def test_health_is_503_while_loading(checkpoint):
    release = threading.Event()

    def slow_load():
        assert release.wait(timeout=30)
        return LLMEngine(engine_args(checkpoint))

    srv = TestServer(slow_load)
    try:
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert_error(r, 503)
        assert "Retry-After" in r.headers
        assert httpx.get(srv.base_url + "/metrics").status_code == 200  # the server's own metrics, no engine's
        release.set()
        deadline = time.monotonic() + 30
        while httpx.get(srv.base_url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.05)
        assert srv.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        release.set()
        srv.stop()


def test_failed_load_reports_its_cause(tmp_path):
    def broken_load():
        raise CheckpointError(f"{tmp_path}/config.json is missing")

    srv = TestServer(broken_load)
    try:
        with pytest.raises(EngineDeadError) as info:
            asyncio.run(asyncio.wait_for(srv.async_engine.wait_ready(), timeout=10))
        assert isinstance(info.value.__cause__, CheckpointError)
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 503 and "config.json is missing" in health.json()["cause"]
        assert_error(srv.post("/v1/completions", {"model": MODEL, "prompt": "hi"}), 503)
    finally:
        srv.stop()


def test_serve_command_exits_on_bad_flags_and_missing_model(tmp_path):
    assert cli.main(["serve", str(tmp_path), "--block-size", "3"]) == 2  # ConfigError, printed by the CLI
    missing = ["serve", str(tmp_path / "nope"), "--host", "127.0.0.1", "--port", "0", "--device", "cpu"]
    assert cli.main(["--log-level", "ERROR"] + missing) == 1  # uvicorn came up, the load failed: exit 1
