"""The engine core in its own process (ProcessAsyncEngine): streams match the offline engine, an abort frees
the KV blocks, a core that dies or fails a step turns the server's /health 503 and fails pending requests with
EngineDeadError, and shutdown stops the process.

Each test but the last needs a real core process (spawn: a fresh interpreter importing torch), so they are few,
share one where they can, and the two alike start together; the last plays the core's side of the pipe itself, to
order two of its messages as a race once did.
"""

import asyncio
import os
import re
import signal
import time

import pytest

pytest.importorskip("fastapi")  # the server's dependencies (the GPU machine has none)
httpx = pytest.importorskip("httpx")

from ostinato import RequestOutputKind, SamplingParams  # noqa: E402
from ostinato.config import EngineArgs  # noqa: E402
from ostinato.engine.core_process import ProcessAsyncEngine, build_engine  # noqa: E402
from ostinato.engine.engine import LLMEngine  # noqa: E402
from ostinato.engine.outputs import merge_deltas  # noqa: E402
from ostinato.errors import EngineDeadError  # noqa: E402
from ostinato.server.app import build_app  # noqa: E402
from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402


def _slow_engine(args: EngineArgs) -> LLMEngine:
    """A real engine whose steps take 20 ms at least, so a request is still running when a test acts on it."""
    engine = build_engine(args)
    step = engine.step_records  # what the core process runs each step

    def slow_step():
        time.sleep(0.02)
        return step()

    engine.step_records = slow_step
    return engine


def _failing_engine(args: EngineArgs) -> LLMEngine:
    """A real engine whose fifth step raises."""
    engine = build_engine(args)
    step, count = engine.step_records, [0]

    def failing_step():
        count[0] += 1
        if count[0] == 5:
            raise RuntimeError("injected step failure")
        return step()

    engine.step_records = failing_step
    return engine


@pytest.fixture(scope="module")
def args(tmp_path_factory):
    path = tmp_path_factory.mktemp("core-ckpt")
    make_checkpoint(path, shape="tiny", family="llama", seed=2)
    return EngineArgs(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=256,
                      max_num_seqs=8)


@pytest.fixture(scope="module")
def slow_cores(args):
    """Two cores of _slow_engine, started together: each spends seconds importing torch and building its engine,
    which two CPU cores do side by side. One is shut down in order, the other killed."""
    cores = {name: ProcessAsyncEngine(args, factory=_slow_engine) for name in ("stopped", "killed")}
    for core in cores.values():
        core.start()
    yield cores
    for core in cores.values():
        core.shutdown(timeout=10)


async def _ready(core: ProcessAsyncEngine) -> ProcessAsyncEngine:
    await asyncio.wait_for(core.wait_ready(), 120)
    return core


async def _started(args, factory) -> ProcessAsyncEngine:
    core = ProcessAsyncEngine(args, factory=factory)
    core.start()
    return await _ready(core)


async def _wait_idle(core: ProcessAsyncEngine, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await core.get_stats()
        if stats.num_running == stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
            return stats
        assert time.monotonic() < deadline, f"requests still hold KV blocks: {stats}"
        await asyncio.sleep(0.02)


def assert_logprobs_close(got, want):
    """The same tokens and top ids; logprobs to 1e-4. Offline ran the requests one at a time, the core batches
    them together, and an fp32 CPU matmul over other rows may sum in another order: on some CPUs (seen on
    this project's machine) the logprobs then differ in the 6th decimal, never the tokens."""
    if want is None:  # no logprobs asked for
        assert got is None
        return
    assert [(t.token_id, [i for i, _ in t.top]) for t in got] == [(t.token_id, [i for i, _ in t.top]) for t in want]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=1e-4)


def test_streams_match_offline_and_an_abort_frees_the_blocks(args, slow_cores):
    offline = LLMEngine(args)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["zz"],
                            output_kind=RequestOutputKind.DELTA)
    n_params = SamplingParams(temperature=1.0, n=2, seed=4, max_tokens=10, ignore_eos=True, logprobs=2,
                              output_kind=RequestOutputKind.DELTA)
    expected = {}
    for rid, prompt, p in (("a", [5, 6, 7], params), ("b", "Hello there", n_params)):
        offline.add_request(rid, prompt, p)
        deltas = []
        while offline.has_unfinished():
            deltas += [o for o in offline.step() if o.request_id == rid]
        expected[rid] = merge_deltas(deltas)

    async def main():
        core = await _ready(slow_cores["stopped"])
        try:
            async def collect(rid, prompt, p):
                return merge_deltas([out async for out in core.generate(rid, prompt, p)])

            got = await asyncio.gather(collect("a", [5, 6, 7], params), collect("b", "Hello there", n_params))
            for out in got:
                want = expected[out.request_id]
                assert out.finished and out.prompt_token_ids == want.prompt_token_ids
                assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in out.outputs] == \
                       [(c.index, c.text, c.token_ids, c.finish_reason) for c in want.outputs]
                for c, w in zip(out.outputs, want.outputs):
                    assert_logprobs_close(c.logprobs, w.logprobs)
            # Abort mid-stream (the consumer stops early): the stream closes, the core frees the blocks.
            stream = await core.add_request("long", [1, 2, 3], SamplingParams(
                max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
            async with stream:
                first = await stream.__anext__()
                assert first.outputs and not first.finished
                busy = await core.get_stats()
                assert busy.num_running == 1 and busy.kv_blocks_free < busy.kv_blocks_total
            stats = await _wait_idle(core)
            assert stats.generation_tokens_total < 24 + 20 + 200  # "long" was cut short
        finally:
            core.shutdown(timeout=30)
        assert core._process.exitcode == 0  # stopped in order, not killed
        assert core.dead_cause == "the engine was shut down"

    asyncio.run(main())


def test_a_killed_core_fails_pending_requests_and_health_says_503(slow_cores):
    async def main():
        core = await _ready(slow_cores["killed"])
        app = build_app(core, served_model_name="m")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            stream = await core.add_request("x", [4, 5], SamplingParams(max_tokens=200, ignore_eos=True,
                                                                        output_kind=RequestOutputKind.DELTA))
            await stream.__anext__()
            os.kill(core.core_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited"):
                async for _ in stream:
                    pass
            health = await client.get("/health")
            assert health.status_code == 503 and "exited" in health.json()["cause"]
            with pytest.raises(EngineDeadError):
                await core.add_request("y", [4], SamplingParams(max_tokens=2))
            body = {"model": "m", "prompt": [1, 2], "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 503
        core.shutdown(timeout=10)

    asyncio.run(main())


def test_a_failed_step_kills_the_engine_and_leaks_nothing(args, capfd):
    """The stream's error event and /health carry a generic cause and an incident id, not the exception's text;
    the core's stderr has the traceback on the line with the same id."""
    async def main():
        core = await _started(args, factory=_failing_engine)
        try:
            app = build_app(core, served_model_name="m")
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"model": "m", "prompt": [4, 5], "max_tokens": 50, "ignore_eos": True, "stream": True}
                events = (await client.post("/v1/completions", json=body)).text
                health = await client.get("/health")
            assert not core.is_ready and '"error"' in events
            return events, health
        finally:
            core.shutdown(timeout=10)

    events, health = asyncio.run(main())
    assert "injected step failure" not in events and "RuntimeError" not in events
    incident = re.search(r"incident ([0-9a-f]{16})", events).group(1)
    assert health.status_code == 503 and incident in health.json()["cause"]
    assert "injected step failure" not in health.text and "RuntimeError" not in health.text
    stderr = capfd.readouterr().err
    logged = [line for line in stderr.splitlines() if incident in line]
    assert logged, stderr
    after = stderr[stderr.index(logged[0]):]
    assert "Traceback" in after and "RuntimeError: injected step failure" in after


def test_each_step_is_one_message_carrying_every_request_it_advanced(args, gc_settings_restored):
    """The core's protocol, in this process (no spawn): per engine step that gave outputs, exactly one "step"
    message goes to the front, holding every request that got a token in it, with that step's new token ids."""
    import threading

    from support.core_in_process import run_core_main

    n_requests, max_tokens = 4, 6
    stop, steps_with_outputs, messages = threading.Event(), [], []

    def counting_engine(engine_args):
        engine = build_engine(engine_args)
        step = engine.step_records

        def counted():
            records = step()
            if records:
                steps_with_outputs.append(sorted(r[0] for r in records))
            return records

        engine.step_records = counted
        return engine

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    commands = [("add", f"r{i}", [i + 1, i + 2, i + 3], params) for i in range(n_requests)]

    class Commands:
        stopped = False

        def recv(self):
            if commands:
                return commands.pop(0)
            if self.stopped:  # a real pipe closes after the stop; without this the pump thread would spin
                raise EOFError  # on ("stop",) for the rest of the test session, holding the GIL and memory
            stop.wait(60)
            self.stopped = True
            return ("stop",)

    class Events:
        finished = set()

        def send(self, message):  # a batch is the messages that queued while a send was in progress, in order
            for message in message[1] if message[0] == "batch" else (message,):
                messages.append(message)
                if message[0] == "step":
                    self.finished.update(item[0] for item in message[1] if item[2])
                    if len(self.finished) == n_requests:
                        stop.set()

    run_core_main(counting_engine, args, Commands(), Events())
    steps = [m for m in messages if m[0] == "step"]
    # One message per step that gave outputs, holding exactly the requests that step advanced (the requests
    # may join over the first steps, as the commands arrive).
    assert [sorted(item[0] for item in m[1]) for m in steps] == steps_with_outputs
    assert max(len(m[1]) for m in steps) == n_requests
    tokens = {}
    for m in steps:
        for request_id, comps, *_ in m[1]:
            ((_, _, token_ids, _, _),) = comps
            assert len(token_ids) == 1
            tokens.setdefault(request_id, []).extend(token_ids)
    assert all(len(t) == max_tokens for t in tokens.values())


class _Sent:
    """The core's command pipe, as ProcessAsyncEngine's sender: records what the front sends."""

    broken = False

    def __init__(self):
        self.messages = []

    def send(self, message) -> None:
        self.messages.append(message)


def test_a_death_read_right_after_an_acceptance_ends_the_accepted_requests_stream():
    """The reader thread reads the core's "added" and then its "dead" before the event loop runs again: the
    request is accepted (its add_request returns a stream) and the stream then raises EngineDeadError, where the
    death, judged on the reader thread, once saw the acceptance not yet run and left the stream waiting forever."""
    import threading

    async def main():
        core = ProcessAsyncEngine(EngineArgs("unused"))
        core._sender = _Sent()  # no process: the test plays the core's side
        adding = asyncio.create_task(core.add_request("r", [1, 2], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0)
        assert core._sender.messages[0][:2] == ("add", "r")
        reader = threading.Thread(target=lambda: [core._on_message(m) for m in (("added", "r", [1, 2], None),
                                                                               ("dead", "injected"))])
        reader.start()
        reader.join()  # blocks the loop: both messages are read before it runs a callback
        stream = await asyncio.wait_for(adding, 5)
        with pytest.raises(EngineDeadError, match="injected"):
            await asyncio.wait_for(stream.__anext__(), 5)

    asyncio.run(main())
