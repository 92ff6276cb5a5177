"""The OpenAI-compatible server end to end: a real uvicorn server on a loopback port in a background thread,
in front of the real engine on a tiny random checkpoint, driven by the official `openai` client and httpx.

Error statuses and bodies live in test_server_errors.py; the helpers here (TestServer, run_offline) are shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import httpx
import pytest

# The GPU machine has no server stack (fastapi, uvicorn, openai): skip there rather than fail collection.
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from ostinato.cli_args import engine_args_from
from ostinato.config import EngineArgs
from ostinato.engine.async_engine import AsyncEngine
from ostinato.engine.engine import LLMEngine
from ostinato.engine.outputs import RequestOutput
from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import SamplingParams
from ostinato import serve_command
from ostinato.server.app import build_app
from ostinato.tools.bench import serve as bench_serve
from ostinato.tools.checkpoint import make_checkpoint

API_KEY = "test-key"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
METRIC_NAMES = (
    "ostinato:num_requests_running", "ostinato:num_requests_waiting", "ostinato:kv_cache_usage_perc",
    "ostinato:prompt_tokens_total", "ostinato:generation_tokens_total", "ostinato:time_to_first_token_seconds",
    "ostinato:inter_token_latency_seconds", "ostinato:e2e_request_latency_seconds", "ostinato:num_preemptions_total",
    "ostinato:decode_steps_total", "ostinato:padded_rows_total", "ostinato:cuda_graph_captured_sizes",
    "ostinato:cuda_graph_memory_bytes", "ostinato:cuda_graphs_enabled", "ostinato:request_success_total",
)


def engine_args(path, **overrides) -> EngineArgs:
    kw = dict(model=str(path), device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN,
              max_num_seqs=32, served_model_name=MODEL)
    kw.update(overrides)
    return EngineArgs(**kw)


class ThrottledEngine:
    """Wraps a real LLMEngine: `delay` seconds of sleep before each step (so a request is still running when a
    test disconnects), and `fail` makes the next step raise (a dead engine)."""

    def __init__(self, engine: LLMEngine):
        self._engine = engine
        self.delay = 0.0
        self.fail = False
        self.polls = 0  # has_unfinished() calls: the engine thread's loop iterations
        self.polls_at_stats = 0  # `polls` when stats() last ran (on the engine thread, between loop turns)

    def has_unfinished(self) -> bool:
        self.polls += 1
        return self._engine.has_unfinished()

    def step(self):
        if self.fail:
            raise RuntimeError("injected step failure")
        if self.delay:
            time.sleep(self.delay)
        return self._engine.step()

    def stats(self):
        self.polls_at_stats = self.polls
        return self._engine.stats()

    def __getattr__(self, name):
        return getattr(self._engine, name)


class TestServer:
    """uvicorn serving build_app(AsyncEngine(engine)) on 127.0.0.1:<free port> in a daemon thread."""

    __test__ = False  # not a test class, despite the name

    def __init__(self, engine, *, api_key: str | None = API_KEY, max_body_bytes: int = 64 * 1024):
        self.async_engine = AsyncEngine(engine)
        self.async_engine.start()
        self.app = build_app(self.async_engine, api_key=api_key, served_model_name=MODEL,
                             max_body_bytes=max_body_bytes)
        self._start(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _start(self, config: uvicorn.Config) -> None:
        """Run uvicorn with `config` in a daemon thread; sets base_url and port once it listens."""
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)

    def post(self, path: str, body, **kw) -> httpx.Response:
        return httpx.post(self.base_url + path, json=body, headers=self.headers, timeout=30, **kw)

    def stats(self):
        return asyncio.run(self.async_engine.get_stats())

    def wait_until_idle(self, timeout: float = 10.0):
        """Poll until no request runs or waits and every KV block is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
                return stats
            assert time.monotonic() < deadline, f"requests still hold KV blocks: {stats}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.async_engine.shutdown(timeout=10)


def run_offline(engine: LLMEngine, prompt, params: SamplingParams) -> RequestOutput:
    """The request run alone on an engine nobody else drives: the reference the server must match."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    for _ in range(10_000):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError("the offline request did not finish")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("server") / "ckpt", shape="tiny", family="llama")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return ThrottledEngine(LLMEngine(engine_args(checkpoint)))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return LLMEngine(engine_args(checkpoint))


@pytest.fixture(scope="module")
def server(engine):
    srv = TestServer(engine)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _reset_throttle(request):
    yield
    if "engine" in request.fixturenames:
        request.getfixturevalue("engine").delay = 0.0


GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


# ---- the happy paths ------------------------------------------------------------------------------------
def test_models_lists_the_served_model(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_equals_offline_greedy(server, reference):
    result = server.client().completions.create(model=MODEL, prompt="The quick brown fox", **GREEDY)
    expected = run_offline(reference, "The quick brown fox", SamplingParams(temperature=0, max_tokens=12,
                                                                          ignore_eos=True))
    assert result.choices[0].text == expected.outputs[0].text
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12
    assert result.id.startswith("cmpl-") and result.model == MODEL


def test_token_id_prompt_and_list_of_one_prompt(server, reference):
    ids = reference.tokenizer.encode("hello there")
    by_ids = server.client().completions.create(model=MODEL, prompt=ids, **GREEDY)
    by_list = server.client().completions.create(model=MODEL, prompt=["hello there"], **GREEDY)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_list.choices[0].text


def test_chat_applies_the_template_and_equals_offline(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    result = server.client().chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt was added
    prompt_ids = reference.tokenizer.encode(text, add_special_tokens=False)
    expected = run_offline(reference, prompt_ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.outputs[0].text
    assert result.choices[0].finish_reason == "length"


def test_streaming_completion_with_usage(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_sends_sse_frames_and_done(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(f[6:]) or json.loads(f[6:])["usage"] is None for f in frames[:-1])


def test_streaming_chat(server):
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streaming_chat_with_usage(server):
    client = server.client()
    messages = [{"role": "user", "content": "Count to ten"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert all(c.usage is None for c in chunks[:-1])  # usage only in the last chunk, as OpenAI sends it
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == whole.choices[0].message.content


def test_n_choices(server):
    result = server.client().completions.create(model=MODEL, prompt="Colors:", n=3, temperature=1.0, seed=7,
                                                max_tokens=6, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    streamed = list(server.client().completions.create(model=MODEL, prompt="Colors:", n=3, temperature=1.0, seed=7,
                                                       max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
    for c in result.choices:
        parts = [ch.choices[0].text for ch in streamed if ch.choices[0].index == c.index]
        assert "".join(parts) == c.text  # same seed, same draws: streaming changes nothing


def test_logprobs(server, reference):
    result = server.client().completions.create(model=MODEL, prompt="Numbers:", logprobs=2, **GREEDY)
    lp = result.choices[0].logprobs
    offline = run_offline(reference, "Numbers:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                logprobs=2)).outputs[0]
    # The server's numbers are the offline engine's: the sampled token's logprob and its top-2 alternatives.
    assert lp.token_logprobs == pytest.approx([t.logprob for t in offline.logprobs], abs=1e-5)
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in offline.token_ids]
    for top, entry in zip(lp.top_logprobs, offline.logprobs):
        strings = [reference.tokenizer.decode([tid]) for tid, _ in entry.top]
        assert set(top) == set(strings)
        for text, (_, value) in zip(strings, entry.top):
            if strings.count(text) == 1:  # two ids that decode alike share one key: which value wins is moot
                assert top[text] == pytest.approx(value, abs=1e-5)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)  # two ids may decode to the same string
    chat = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                   logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(t.top_logprobs) == 3 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5 for t in content)


def test_32_concurrent_requests_equal_offline_greedy(server, reference):
    prompts = [f"Request {i}: a story about the number {i * 7}" for i in range(32)]

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=60) as client:
            return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, **GREEDY)
                                          for p in prompts))

    before = server.stats()
    results = asyncio.run(asyncio.wait_for(run_all(), timeout=60))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.choices[0].text == run_offline(reference, prompt, params).outputs[0].text, prompt
    after = server.wait_until_idle()
    steps = (after.decode_steps_eager + after.decode_steps_graph) - (before.decode_steps_eager +
                                                                     before.decode_steps_graph)
    assert steps <= 32 * 11 // 4  # decode steps were shared: continuous batching, not one request at a time


def test_idle_engine_thread_sleeps(server, engine):
    server.client().completions.create(model=MODEL, prompt="wake up", max_tokens=2)
    server.wait_until_idle()
    # stats() runs as a command on the engine thread, so each call reads the loop count between two turns.
    # An idle thread turns exactly once per command (it runs it, polls once, and waits again); a busy loop
    # would turn many times while we sleep. The count does not depend on how long anything takes.
    server.stats()
    before = engine.polls_at_stats
    time.sleep(0.3)
    server.stats()
    assert engine.polls_at_stats - before == 1


def test_eos_ends_plain_and_streamed_completions(tmp_path_factory, checkpoint, reference):
    from test_eos import with_extra_eos

    free = run_offline(reference, "The end is near", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    ids = free.outputs[0].token_ids
    eos = ids[8]
    first = ids.index(eos)
    assert 0 < first < 15 and reference.eos_ids.isdisjoint(ids), ids  # an earlier stop is the new EOS's doing
    path = with_extra_eos(checkpoint, tmp_path_factory.mktemp("server-eos") / "ckpt", eos)
    srv = TestServer(LLMEngine(engine_args(path)))
    try:
        client = srv.client()
        plain = client.completions.create(model=MODEL, prompt="The end is near", max_tokens=16, temperature=0)
        assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == first + 1
        chunks = list(client.completions.create(model=MODEL, prompt="The end is near", max_tokens=16,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == first + 1
        assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
        ignored = client.completions.create(model=MODEL, prompt="The end is near", max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 16
        srv.wait_until_idle()
    finally:
        srv.stop()


# ---- disconnects free KV blocks --------------------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, engine):
    engine.delay = 0.02  # 200 tokens would take >= 4 s: the disconnect must end it long before
    before = server.stats().generation_tokens_total
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                      timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert server.stats().kv_blocks_free < server.stats().kv_blocks_total  # it holds blocks now
    # leaving the block closed the connection mid-stream
    stats = server.wait_until_idle(timeout=5)
    assert stats.generation_tokens_total - before < 150
    assert 'finished_reason="abort"' in httpx.get(server.base_url + "/metrics").text


def test_client_disconnect_while_waiting_for_a_plain_response(server, engine):
    engine.delay = 0.02
    before = server.stats().generation_tokens_total
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, headers=server.headers, timeout=0.5)
    stats = server.wait_until_idle(timeout=5)
    assert stats.generation_tokens_total - before < 150


def test_breaking_out_of_generate_aborts(server, engine):
    engine.delay = 0.01  # 200 tokens would take >= 2 s
    before = server.stats()

    async def consume_two():
        agen = server.async_engine.generate("gen-break", "Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        seen = 0
        async for out in agen:
            assert out.request_id == "gen-break"
            seen += 1
            if seen == 2:
                break
        await agen.aclose()

    asyncio.run(asyncio.wait_for(consume_two(), timeout=20))
    # aclose() posted the abort before this stats command, and the engine thread runs commands in order: the
    # request is gone and its blocks are free now, long before it could have finished on its own.
    stats = server.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.generation_tokens_total - before.generation_tokens_total < 200


def test_generate_raises_add_errors_before_any_output(server):
    async def first(prompt):
        return await anext(server.async_engine.generate(uuid.uuid4().hex, prompt, SamplingParams(max_tokens=4)))

    with pytest.raises(InvalidRequestError, match="empty"):
        asyncio.run(first([]))
    with pytest.raises(InvalidRequestError) as info:
        asyncio.run(first(list(range(5)) * 60))  # 300 tokens >= max_model_len
    assert info.value.param == "prompt"


# ---- health, metrics, version ---------------------------------------------------------------------------
def test_health_reports_graph_status(server):
    r = httpx.get(server.base_url + "/health")  # no API key needed
    assert r.status_code == 200
    body = r.json()
    # engine_args() asks for device="cpu": no graphs can exist, whatever the engine reports about itself.
    assert body["status"] == "ok" and body["model"] == MODEL
    assert body["cuda_graphs_enabled"] is False and body["captured_sizes"] == []
    assert body["cuda_graphs"].startswith("disabled (") and "CPU" in body["cuda_graphs"]
    assert body["batch_invariant"] is False


def test_health_and_metrics_show_batch_invariant_mode(checkpoint):
    srv = TestServer(LLMEngine(engine_args(checkpoint, num_kv_blocks=32, batch_invariant=True)))
    try:
        assert httpx.get(srv.base_url + "/health").json()["batch_invariant"] is True
        text = httpx.get(srv.base_url + "/metrics", headers=srv.headers).text
        assert _metric(text, "ostinato:batch_invariant") == 1.0
    finally:
        srv.stop()


def test_health_reports_active_graphs(checkpoint):
    from support.graph_engine import engine_with_recorded_graphs

    srv = TestServer(engine_with_recorded_graphs(engine_args(checkpoint, num_kv_blocks=32), (1, 2, 4)))
    try:
        body = httpx.get(srv.base_url + "/health").json()
        assert body["cuda_graphs_enabled"] is True and body["captured_sizes"] == [1, 2, 4]
        assert body["cuda_graphs"] == "active (3 sizes, 1..4)"
    finally:
        srv.stop()


def _metric(text: str, name: str) -> float:
    """The value of the first sample of `name` (a bare name, or a name with the start of its labels)."""
    prefix = name if "{" in name else name + "{"
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(prefix)))


def test_metrics_expose_vllm_style_names(server):
    before = httpx.get(server.base_url + "/metrics").text
    result = server.client().completions.create(model=MODEL, prompt="metrics", **GREEDY)
    server.wait_until_idle()
    text = httpx.get(server.base_url + "/metrics").text
    for name in METRIC_NAMES:
        assert name in text, name
    assert 'ostinato:decode_steps_total{model_name="tiny-llama",path="eager"}' in text
    # The counters moved by what the response itself reports (usage), not by what the engine says of itself.
    for counter, expected in (("ostinato:generation_tokens_total", result.usage.completion_tokens),
                              ("ostinato:prompt_tokens_total", result.usage.prompt_tokens)):
        assert _metric(text, counter) - _metric(before, counter) == expected, counter
    eager_steps = 'ostinato:decode_steps_total{model_name="tiny-llama",path="eager"'
    assert _metric(text, eager_steps) - _metric(before, eager_steps) == 11  # 12 tokens: a prefill, 11 decodes
    assert _metric(text, "ostinato:num_requests_running") == 0 and _metric(text, "ostinato:kv_cache_usage_perc") == 0
    ttft_count = _metric(text, "ostinato:time_to_first_token_seconds_count")
    assert ttft_count >= 1


def test_cached_prompt_tokens_in_usage_and_metrics(server, reference):
    """A prompt sent again finds its full blocks in the prefix cache: usage.prompt_tokens_details.cached_tokens
    (completions, chat, streamed usage too) and the prefix-cache counters say so."""
    vocab = reference.model_config.vocab_size
    ids = [(7 * i + 3) % vocab for i in range(40)]  # 2 full blocks of 16 and 8 tokens
    before = httpx.get(server.base_url + "/metrics").text
    client = server.client()
    first = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=ids, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32
    messages = [{"role": "system", "content": "You answer in one line. " * 8}, {"role": "user", "content": "Hi"}]
    chat = [client.chat.completions.create(model=MODEL, messages=messages, **GREEDY) for _ in range(2)]
    assert chat[1].usage.prompt_tokens_details.cached_tokens >= 16
    assert chat[1].usage.prompt_tokens_details.cached_tokens % 16 == 0
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                   stream_options={"include_usage": True}, **GREEDY))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == chat[1].usage.prompt_tokens_details.cached_tokens
    server.wait_until_idle()
    text = httpx.get(server.base_url + "/metrics").text
    hits = 32 * 2 + 2 * chat[1].usage.prompt_tokens_details.cached_tokens + \
        chat[0].usage.prompt_tokens_details.cached_tokens
    hits_metric = "ostinato:prefix_cache_hits_total"
    assert _metric(text, hits_metric) - _metric(before, hits_metric) == hits
    queries = 3 * 40 + 3 * chat[0].usage.prompt_tokens
    assert _metric(text, "ostinato:prefix_cache_queries_total") - \
        _metric(before, "ostinato:prefix_cache_queries_total") == queries


def test_version(server):
    assert httpx.get(server.base_url + "/version").json()["version"]


# ---- the commands -----------------------------------------------------------------------------------------
def test_bench_serve_against_the_server(server, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_serve.register(parser.add_subparsers())
    out = tmp_path / "bench.json"
    ns = parser.parse_args(["bench-serve", "--base-url", server.base_url, "--num-prompts", "6", "--max-concurrency",
                            "3", "--input-len", "8", "--output-len", "5", "--api-key", API_KEY,
                            "--output-json", str(out)])
    assert ns.func(ns) == 0
    summary = json.loads(out.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0 and summary["model"] == MODEL
    assert summary["total_output_tokens"] == 30 and summary["total_input_tokens"] == 48
    assert 0 < summary["ttft_ms"]["median"] <= summary["e2el_ms"]["median"]
    assert summary["output_throughput"] > 0 and summary["tpot_ms"]["mean"] > 0
    assert "Output token throughput" in bench_serve.format_table(summary)
    err = capsys.readouterr().err  # progress on stderr: the warm-up announced, then every request counted
    assert "1 warm-up request(s), then 6 to" in err and "bench serve: 100%" in err and "6/6" in err


def test_serve_flags_build_engine_args(monkeypatch):
    monkeypatch.setenv("OSTINATO_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    serve_command.register(parser.add_subparsers())
    ns = parser.parse_args(["serve", "/models/x", "--port", "9001", "--max-num-seqs", "8", "--cuda-graph-sizes",
                            "1,2,4", "--enforce-eager", "--cuda-graph-fallback", "eager", "--dtype", "float32"])
    args = engine_args_from(ns)
    assert (args.model, args.max_num_seqs, args.cuda_graph_sizes) == ("/models/x", 8, (1, 2, 4))
    assert args.enforce_eager and args.cuda_graph_fallback == "eager" and args.dtype == "float32"
    assert args.block_size == EngineArgs(model="m").block_size  # flags not given keep EngineArgs' defaults
    assert serve_command.api_keys_from(ns) == ["from-env"] and ns.port == 9001 and ns.func is serve_command.run
