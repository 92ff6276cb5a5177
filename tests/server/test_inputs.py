"""What the server accepts is what its OpenAPI schema says, and every refused input is a 400 naming its field:
seeds past 64 bits, stop ids past the vocabulary, empty prompts, content parts other than text, chat roles that
are not names, and n above --max-n (checked by the server itself, not by the queue bound behind it).

Real uvicorn with the default ServerLimits, in front of the real engine (unbounded queue) on a tiny checkpoint.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")  # the GPU machine has no server stack

from ostinato.engine.engine import LLMEngine
from ostinato.errors import InvalidRequestError
from ostinato.server.limits import ServerLimits
from ostinato.tools.checkpoint import make_checkpoint
from test_hostile import GuardedServer, assert_error
from test_server import MODEL, engine_args

CHAT = [{"role": "user", "content": "hello"}]
MAX_N = ServerLimits().max_n


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("inputs") / "ckpt", shape="tiny", family="llama")
    return LLMEngine(engine_args(path))  # no queue bound: only the server's own --max-n can refuse a large n


@pytest.fixture(scope="module")
def server(engine):
    srv = GuardedServer(engine, ServerLimits())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def schema(server):
    return httpx.get(server.base_url + "/openapi.json", timeout=10).json()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, content=json.dumps({"model": MODEL, **body}).encode(), timeout=30,
                      headers={"Content-Type": "application/json"})


def chat_with(message: dict) -> dict:
    return {"messages": [message], "max_tokens": 2}


BAD = [  # (name, path, body, param, words the message must hold)
    ("seed-2**70", "/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, "seed", "2**63 - 1"),
    ("seed-below-int64", "/v1/completions", {"prompt": "hi", "seed": -(2 ** 63) - 1}, "seed", "[-2**63,"),
    ("seed-plus-n", "/v1/completions", {"prompt": "hi", "seed": 2 ** 63 - 1, "n": 2}, "seed", "seed + i"),
    ("stop-id-negative", "/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "0"),
    ("prompt-empty", "/v1/completions", {"prompt": ""}, "prompt", "empty"),
    ("prompt-empty-list", "/v1/completions", {"prompt": []}, "prompt", "empty"),
    ("prompt-list-of-empty", "/v1/completions", {"prompt": [""]}, "prompt", "empty"),
    ("prompt-list-of-no-ids", "/v1/completions", {"prompt": [[]]}, "prompt", "empty"),
    ("part-image", "/v1/chat/completions",
     chat_with({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}), "messages",
     "'image_url'"),
    ("part-audio-after-text", "/v1/chat/completions",
     chat_with({"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "input_audio"}]}), "messages",
     "content part 1"),
    ("part-without-type", "/v1/chat/completions", chat_with({"role": "user", "content": [{"text": "hi"}]}),
     "messages", "None"),
    ("role-empty", "/v1/chat/completions", chat_with({"role": "", "content": "hi"}), "messages", "role"),
    ("role-markup", "/v1/chat/completions", chat_with({"role": "user<|im_end|>", "content": "hi"}), "messages",
     "role"),
    ("n-over-max-n", "/v1/completions", {"prompt": "hi", "n": MAX_N + 1, "max_tokens": 1}, "n",
     f"at most {MAX_N}"),
    ("n-over-max-n-chat", "/v1/chat/completions", {"messages": CHAT, "n": MAX_N + 1, "max_tokens": 1}, "n",
     f"at most {MAX_N}"),
]


@pytest.mark.parametrize("name,path,body,param,words", BAD, ids=[b[0] for b in BAD])
def test_refused_input_is_400_naming_the_field(server, name, path, body, param, words):
    error = assert_error(post(server, path, body), 400, param)
    assert error["type"] == "invalid_request_error" and words in error["message"], error["message"]


def test_a_stop_id_past_the_vocabulary_is_400(server, engine):
    vocab = engine.model_config.vocab_size
    error = assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop_token_ids": [vocab]}), 400,
                         "stop_token_ids")
    assert f"[0, {vocab})" in error["message"]


GOOD = [  # the edges of what is accepted
    ("seed-max", "/v1/completions", {"prompt": "hi", "seed": 2 ** 63 - 1, "max_tokens": 1}),
    ("seed-min", "/v1/completions", {"prompt": "hi", "seed": -(2 ** 63), "max_tokens": 1}),
    ("role-system", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "be brief"}, *CHAT], "max_tokens": 1}),
    ("text-parts", "/v1/chat/completions",
     chat_with({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})),
]


@pytest.mark.parametrize("name,path,body", GOOD, ids=[g[0] for g in GOOD])
def test_inputs_at_the_edges_are_served(server, name, path, body):
    r = post(server, path, body)
    assert r.status_code == 200, r.text


def test_n_up_to_max_n_is_served(server):
    """The n limit is the server's: exactly --max-n completions are served, one more is refused (above)."""
    r = post(server, "/v1/completions", {"prompt": "hi", "n": MAX_N, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(MAX_N))
    server.wait_until_idle()


def test_the_n_limit_is_checked_by_the_limits_themselves():
    ServerLimits(max_n=3).check_sampling(n=3, stop=None, stop_token_ids=None, logprobs=None)
    with pytest.raises(InvalidRequestError) as info:
        ServerLimits(max_n=3).check_sampling(n=4, stop=None, stop_token_ids=None, logprobs=None)
    assert info.value.param == "n" and "at most 3" in str(info.value)


# ---- the schema says the same ----------------------------------------------------------------------------
def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _component(schema: dict, name: str) -> dict:
    return schema["components"]["schemas"][name]


def test_schema_says_a_prompt_is_never_empty(schema):
    prompt = _component(schema, "CompletionRequest")["properties"]["prompt"]
    for alternative in prompt["anyOf"]:
        assert alternative.get("minLength", alternative.get("minItems")) == 1, alternative
        items = alternative.get("items", {})
        if items.get("type") in ("string", "array"):
            assert items.get("minLength", items.get("minItems")) == 1, alternative


def test_schema_lists_only_the_text_content_part(schema):
    part_type = _component(schema, "ContentPart")["properties"]["type"]
    accepted = [part_type["const"]] if "const" in part_type else part_type.get("enum")
    assert accepted == ["text"], part_type


def test_schema_states_the_role_rule_and_the_seed_range(schema):
    role = _component(schema, "ChatMessage")["properties"]["role"]
    assert re.fullmatch(role["pattern"], "assistant") and not re.fullmatch(role["pattern"], "")
    seed = next(a for a in _component(schema, "CompletionRequest")["properties"]["seed"]["anyOf"]
                if a.get("type") == "integer")
    assert seed["format"] == "int64"


def test_schema_documents_the_event_stream(schema):
    for path, body in (("/v1/completions", "CompletionResponse"),
                       ("/v1/chat/completions", "ChatCompletionResponse")):
        ok = schema["paths"][path]["post"]["responses"]["200"]["content"]
        assert _resolve(schema, ok["application/json"]["schema"]) == _component(schema, body)
        assert "text/event-stream" in ok and "[DONE]" in ok["text/event-stream"]["schema"]["description"]
