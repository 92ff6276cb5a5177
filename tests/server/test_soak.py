"""Soak: concurrent clients, a quarter of them hanging up mid-stream, on a KV pool small enough to
force preemption. Asserts that no request is lost, that greedy text under load equals the same request run
alone, and that every KV block is free at the end. Bounded to SOAK_SECONDS of load on 2 CPU cores.

Prints its figures (requests, aborts, preemptions, seconds); docs/RELIABILITY.md keeps those of the last run.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")  # the GPU machine has no server stack

from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import SamplingParams
from ostinato.tools.checkpoint import make_checkpoint
from test_hostile import GuardedServer
from test_server import MODEL, engine_args, run_offline

NUM_REQUESTS = 48
DISTINCT = 8
CONCURRENCY = 12
ABORT_EVERY = 4  # every 4th request is a stream its client closes after a few chunks
SOAK_SECONDS = 60.0
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls sing of rain".split()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("soak") / "ckpt", shape="tiny", family="llama")


def make_requests(seed: int = 0) -> list[dict]:
    """NUM_REQUESTS requests over DISTINCT (prompt, max_tokens) pairs: each pair runs several times under load,
    in other batches and preemption states, while its solo reference runs once."""
    rng = random.Random(seed)
    pairs = [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))), rng.randint(24, 80))
             for _ in range(DISTINCT)]
    return [{"prompt": pairs[i % DISTINCT][0], "max_tokens": pairs[i % DISTINCT][1], "abort": i % ABORT_EVERY == 1,
             "stream": i % 2 == 0} for i in range(NUM_REQUESTS)]


def send(base_url: str, req: dict) -> dict:
    body = {"model": MODEL, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": req["stream"] or req["abort"]}
    with httpx.Client(base_url=base_url, timeout=SOAK_SECONDS) as client:
        if not body["stream"]:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return {"text": choice["text"], "finish_reason": choice["finish_reason"]}
        text, finish, chunks = "", None, 0
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                text, finish, chunks = text + choice["text"], choice["finish_reason"] or finish, chunks + 1
                if req["abort"] and chunks == 3:
                    return {"aborted": True}  # leaving the block closes the connection mid-stream
        return {"text": text, "finish_reason": finish}


def test_soak_with_aborts_and_preemption(checkpoint):
    # 20 blocks of 16 tokens: 8 running sequences of up to ~9 blocks each cannot all fit, so some are preempted.
    # Steps of 16 tokens: prompts are prefilled in chunks beside the decodes; repeated prompts hit the prefix cache.
    engine = LLMEngine(engine_args(checkpoint, num_kv_blocks=20, max_num_seqs=8, max_num_batched_tokens=16))
    server = GuardedServer(engine)
    requests = make_requests()
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(lambda req: send(server.base_url, req), requests))
        elapsed = time.monotonic() - t0
        stats = server.wait_until_idle(timeout=10)  # every block free, nothing running or waiting
    finally:
        server.stop()
    aborted = sum(1 for r in results if r.get("aborted"))
    print(f"\nsoak: {len(requests)} requests ({aborted} aborted mid-stream) at concurrency {CONCURRENCY} in "
          f"{elapsed:.1f} s; {stats.num_preemptions} preemptions; {stats.kv_blocks_free}/{stats.kv_blocks_total} "
          "KV blocks free at the end")
    assert elapsed < SOAK_SECONDS
    assert stats.num_preemptions > 0, "the pool was meant to force preemption"
    assert stats.prefix_cache_hits > 0, "repeated prompts were meant to hit the prefix cache"
    assert aborted == sum(1 for r in requests if r["abort"])

    # A pool large enough for one request (no preemption), whole prompts in one step, nothing cached.
    solo = LLMEngine(engine_args(checkpoint, enable_prefix_caching=False))
    expected: dict[tuple[str, int], str] = {}
    for req, result in zip(requests, results):
        if req["abort"]:
            continue
        key = (req["prompt"], req["max_tokens"])
        if key not in expected:
            out = run_offline(solo, req["prompt"], SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                                                                  ignore_eos=True))
            expected[key] = out.outputs[0].text
        assert result["finish_reason"] == "length", (req, result)
        assert result["text"] == expected[key], req
