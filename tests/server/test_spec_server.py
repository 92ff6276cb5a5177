"""A speculative engine behind the server: completions are served (with the speculation counters in /metrics),
and what a verify step cannot apply is a 400 naming the field, never a 5xx; no block is left held."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")  # the GPU machine has no server stack

from ostinato.engine.engine import LLMEngine
from ostinato.server.limits import ServerLimits
from ostinato.tools.checkpoint import make_checkpoint
from test_hostile import GuardedServer, assert_error
from test_server import MODEL, engine_args


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("spec-server") / "ckpt", shape="tiny", family="llama")
    return LLMEngine(engine_args(path, speculative_method="ngram", num_speculative_tokens=3))


@pytest.fixture(scope="module")
def server(engine):
    srv = GuardedServer(engine, ServerLimits())
    yield srv
    srv.stop()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", content=json.dumps({"model": MODEL, **body}).encode(),
                      timeout=60, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1.3), ("frequency_penalty", 0.5),
                                          ("min_tokens", 2), ("response_format", {"type": "json_object"})])
def test_what_a_verify_step_cannot_apply_is_a_400_naming_it(server, engine, field, value):
    param = "structured_outputs" if field == "response_format" else field
    error = assert_error(post(server, {"prompt": "a b a b a", "max_tokens": 4, field: value}), 400, param)
    assert "--speculative-method" in error["message"]
    st = engine.stats()
    assert st.kv_blocks_free == st.kv_blocks_total


def test_completions_are_served_and_counted(server, engine):
    r = post(server, {"prompt": "a b c a b c a b", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert "ostinato:spec_decode_num_draft_tokens_total" in metrics
    assert engine.stats().spec_decode_drafts > 0
