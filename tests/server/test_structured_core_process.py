"""Structured outputs with the engine core in its own process (the default `ostinato serve` layout): the front
compiles with its own compiler (a 400 naming the field before queueing), the core with its own, and the
constrained answer holds. A tiny random checkpoint: random weights follow no format unless masked."""

import re
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")

from ostinato.engine.core_process import ProcessAsyncEngine  # noqa: E402
from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402
from test_server import TestServer, engine_args  # noqa: E402

SERVED = "tiny-llama"


class CoreProcessServer(TestServer):
    __test__ = False

    def __init__(self, args):
        import uvicorn

        from ostinato.server.app import build_app

        self.async_engine = ProcessAsyncEngine(args)
        self.async_engine.start()
        self.app = build_app(self.async_engine, served_model_name=SERVED)
        self._start(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.headers = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("core-structured") / "ckpt", shape="tiny", family="qwen3", seed=2)
    srv = CoreProcessServer(engine_args(path))
    deadline = time.monotonic() + 120
    while not srv.async_engine.is_ready:  # the core loads the model in its own process
        assert time.monotonic() < deadline and srv.async_engine.dead_cause is None, srv.async_engine.dead_cause
        time.sleep(0.1)
    yield srv
    srv.stop()


def test_core_process_constrains_and_refuses(server):
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 30, "temperature": 1.0, "seed": 1}
    r = server.post("/v1/completions", {**body, "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["text"])
    r = server.post("/v1/completions", {**body, "structured_outputs": {"regex": "(bad"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", r.text
