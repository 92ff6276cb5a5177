"""The prefix cache tells no client what another sent: a prompt cached for one API key, or under one
cache_salt, is neither reported as cached (usage.prompt_tokens_details.cached_tokens) nor found in the block
manager (the engine's prefix-cache hit counter) for another key or salt; the same key and salt still hit.

A real uvicorn server in front of the real engine on a tiny random checkpoint, with prefix caching on."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import uvicorn  # noqa: E402
from test_server import MODEL, TestServer, engine_args  # noqa: E402

from ostinato.engine.async_engine import AsyncEngine  # noqa: E402
from ostinato.engine.engine import LLMEngine  # noqa: E402
from ostinato.server.app import build_app  # noqa: E402
from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402

KEYS = ("key-a", "key-b")
BLOCK = 16  # EngineArgs' default block size
PROMPT = list(range(5, 5 + 3 * BLOCK + 2))  # three full blocks before the block of the last token


class KeyedServer(TestServer):
    __test__ = False

    def __init__(self, engine, **app_options):
        self.async_engine = AsyncEngine(engine)
        self.async_engine.start()
        self.app = build_app(self.async_engine, api_key=list(KEYS), served_model_name=MODEL, **app_options)
        self._start(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))

    def complete(self, key: str, salt: str | None = None, path: str = "/v1/completions",
                 prompt: list[int] = PROMPT) -> tuple[dict, int]:
        """The response's usage and the engine's prefix-cache hits (in tokens) that this request added."""
        before = self.stats().prefix_cache_hits
        body = {"model": MODEL, "max_tokens": 2, "temperature": 0.0}
        if path == "/v1/completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": " ".join(f"w{t}" for t in prompt)}]
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(self.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"], self.stats().prefix_cache_hits - before


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("isolation") / "ckpt", shape="tiny", family="llama")


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = KeyedServer(LLMEngine(engine_args(checkpoint)))
    yield srv
    srv.stop()


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("first, second", [
    (("key-a", None), ("key-b", None)),  # another key
    (("key-a", "s1"), ("key-a", "s2")),  # the same key, another salt
    (("key-a", None), ("key-a", "s1")),  # a salt where the first had none
    (("key-a", "s1"), ("key-b", "s1")),  # the same salt under another key
])
def test_another_key_or_salt_gets_no_cached_block(server, path, first, second):
    prompt = [t + 7 * len(server.__dict__.setdefault("seen", [])) for t in PROMPT]  # fresh per case
    server.seen.append(path)
    usage, hits = server.complete(*first, path=path, prompt=prompt)
    assert cached(usage) == 0 and hits == 0  # a new prompt
    usage, hits = server.complete(*second, path=path, prompt=prompt)
    assert cached(usage) == 0, "the prefix cache told another client that this prompt was sent"
    assert hits == 0, "the block manager handed another key's or salt's blocks to this request"
    usage, hits = server.complete(*first, path=path, prompt=prompt)
    assert cached(usage) >= 3 * BLOCK and hits == cached(usage), "the same key and salt must still share"


def test_a_wrong_key_is_refused(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2]},
                   headers={"Authorization": "Bearer key-c"}, timeout=30)
    assert r.status_code == 401
    for key in KEYS:
        r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200


def test_a_bad_cache_salt_is_400(server):
    for bad in ("", 7, "x" * 1025):
        r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2], "cache_salt": bad},
                       headers={"Authorization": "Bearer key-a"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_shared_prefix_cache_lets_keys_share(checkpoint):
    srv = KeyedServer(LLMEngine(engine_args(checkpoint)), isolate_keys=False, report_cached_tokens=False)
    try:
        usage, _ = srv.complete("key-a")
        assert "prompt_tokens_details" not in usage or usage["prompt_tokens_details"] is None
        usage, hits = srv.complete("key-b")
        assert hits >= 3 * BLOCK  # shared on purpose
        assert usage.get("prompt_tokens_details") is None, "--no-report-cached-tokens must leave it out"
        r = httpx.post(srv.base_url + "/v1/completions", headers={"Authorization": "Bearer key-a"}, timeout=30,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True,
                             "stream_options": {"include_usage": True}})
        usage_chunks = [line for line in r.text.splitlines() if '"usage":{' in line]
        assert usage_chunks and "cached_tokens" not in usage_chunks[-1]
    finally:
        srv.stop()


def test_keys_come_from_every_flag_and_the_file(tmp_path, monkeypatch):
    import argparse

    from ostinato import serve_command
    from ostinato.errors import ConfigError

    monkeypatch.setenv("OSTINATO_API_KEY", "from-env")
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team keys\nkey-c\n\n  key-d  \n")
    parser = argparse.ArgumentParser()
    serve_command.register(parser.add_subparsers())
    ns = parser.parse_args(["serve", "m", "--api-key", "key-a", "--api-key", "key-b", "--api-keys-file",
                            str(keys_file), "--shared-prefix-cache", "--no-report-cached-tokens"])
    assert serve_command.api_keys_from(ns) == ["key-a", "key-b", "key-c", "key-d"]
    assert ns.shared_prefix_cache and not ns.report_cached_tokens
    assert serve_command.api_keys_from(parser.parse_args(["serve", "m"])) == ["from-env"]
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        serve_command.api_keys_from(parser.parse_args(["serve", "m", "--api-keys-file", str(tmp_path / "empty")]))
