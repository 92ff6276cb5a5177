"""A server you can leave running: a real `ostinato serve` process (tiny checkpoint, CPU, loopback) under the
failures a supervisor meets, each with a stream in flight.

- the core killed (SIGKILL): the stream gets an error event, the server exits 1;
- the core stopped (SIGSTOP) past --engine-stall-timeout: every /health answers within 1 s, 200 and then
  503 "stalled"; past --engine-kill-timeout the core is killed, the stream gets an error event, exit 1;
- SIGTERM mid-stream, core healthy: /health says 503 "draining" at once, also on the kept-alive connection,
  a new completion gets 503, the stream runs to its end, exit 0 (uvicorn alone exits 143);
- SIGTERM with a stream that cannot finish (the core stopped): after --shutdown-timeout the stream gets an
  error event, exit 0;
- SIGTERM, then the core killed during the drain: the stream gets an error event, and the server exits 1,
  not 0, logging why (a failure, not a clean stop).

The five servers run at once (each scenario in its own thread), so the whole file takes about as long as the
slowest one. OSTINATO_SOAK=long runs the longer profile recorded in docs/RELIABILITY.md (more streams, longer
bounds and a longer stop); `-s` prints each scenario's outcome.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from support.served import Served  # noqa: E402

from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the core process through /proc")]
STREAM = {"prompt": [5, 6, 7], "max_tokens": 240, "temperature": 0.0, "ignore_eos": True, "stream": True}
PROFILES = {  # streams in flight per scenario; the bounds (s); how long the drain scenario holds the core
    "short": dict(streams=1, stall=1.0, kill=3.0, drain=20.0, drain_cut=1.0, hold=0.0),
    "long": dict(streams=8, stall=5.0, kill=15.0, drain=60.0, drain_cut=5.0, hold=3.0),
}
P = PROFILES[os.environ.get("OSTINATO_SOAK", "short")]


class Stream:
    """A streamed completion read by a thread: its events, and whether its first chunk has come."""

    def __init__(self, url: str, max_tokens: int = 240):
        self.body = {**STREAM, "max_tokens": max_tokens}
        self.events: list[dict | str] = []
        self.first = threading.Event()
        self.done = threading.Event()
        threading.Thread(target=self._read, args=(url,), daemon=True).start()
        assert self.first.wait(60), "no first chunk"

    def _read(self, url: str) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=self.body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.first.set()
        except httpx.HTTPError as e:
            self.events.append(f"transport error: {type(e).__name__}")
        finally:
            self.first.set()
            self.done.set()

    def outcome(self, timeout: float) -> str:
        """'finished' (every token, then [DONE]), 'error event', or what else happened."""
        assert self.done.wait(timeout), "the stream did not end"
        chunks = [e for e in self.events if isinstance(e, dict)]
        if any("error" in e for e in chunks):
            return "error event"
        if chunks and chunks[-1]["choices"][0]["finish_reason"] == "length" and self.events[-1] == "[DONE]":
            return "finished"
        return f"cut: {self.events[-2:]}"


def _timed_health(client) -> tuple[int | None, str, float]:
    start = time.monotonic()
    try:
        r = client.get("/health", timeout=5)
        status, body = r.status_code, r.json().get("status", "")
    except httpx.HTTPError as e:
        status, body = None, type(e).__name__
    return status, body, time.monotonic() - start


def outcomes_of(streams: list[Stream], timeout: float) -> str:
    """The streams' outcome if they all had the same one, else each one's."""
    found = [s.outcome(timeout) for s in streams]
    return found[0] if len(set(found)) == 1 else "; ".join(found)


def scenario_kill(ckpt: Path) -> dict:
    srv = Served(ckpt)
    try:
        streams = [Stream(srv.url) for _ in range(P["streams"])]
        os.kill(srv.core, signal.SIGKILL)
        t0 = time.monotonic()
        outcome = outcomes_of(streams, 30)
        return {"stream": outcome, "stream_s": time.monotonic() - t0, "code": srv.exit_code(30),
                "exit_s": time.monotonic() - t0, "log": "".join(srv.log)}
    finally:
        srv.kill()


def scenario_stall(ckpt: Path) -> dict:
    srv = Served(ckpt, "--engine-stall-timeout", str(P["stall"]), "--engine-kill-timeout", str(P["kill"]))
    try:
        streams = [Stream(srv.url) for _ in range(P["streams"])]
        os.kill(srv.core, signal.SIGSTOP)
        t0, probes = time.monotonic(), []
        with httpx.Client(base_url=srv.url) as client:
            while srv.proc.poll() is None and time.monotonic() - t0 < P["kill"] + 20:
                status, body, took = _timed_health(client)
                probes.append((time.monotonic() - t0, status, body, took))
                time.sleep(0.1)
        stalled = [p[0] for p in probes if p[2] == "stalled"]
        return {"stream": outcomes_of(streams, 30), "code": srv.exit_code(30), "exit_s": time.monotonic() - t0,
                "slowest_probe_s": max(p[3] for p in probes if p[1] is not None),
                "first_stalled_s": stalled[0] if stalled else None, "statuses": [p[1:3] for p in probes],
                "log": "".join(srv.log)}
    finally:
        srv.kill()


def scenario_drain(ckpt: Path) -> dict:
    """SIGTERM mid-stream; the core is held (SIGSTOP) across the signal so the stream is surely in flight, and
    let go (SIGCONT) once /health has said draining."""
    srv = Served(ckpt, "--shutdown-timeout", str(P["drain"]))
    try:
        with httpx.Client(base_url=srv.url) as client:
            assert client.get("/health", timeout=10).status_code == 200  # opens the kept-alive connection
            # Short streams: they must finish within the drain.
            streams = [Stream(srv.url, max_tokens=8) for _ in range(P["streams"])]
            os.kill(srv.core, signal.SIGSTOP)
            os.kill(srv.proc.pid, signal.SIGTERM)
            t0 = time.monotonic()
            status, body, took = _timed_health(client)  # on the connection kept alive from before the signal
            refused = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
            time.sleep(P["hold"])
            late = _timed_health(client)[:2]
        os.kill(srv.core, signal.SIGCONT)
        outcome = outcomes_of(streams, P["drain"] + 30)
        return {"health": (status, body), "health_s": took, "late_health": late, "new_request": refused.status_code,
                "stream": outcome, "stream_s": time.monotonic() - t0, "code": srv.exit_code(30),
                "exit_s": time.monotonic() - t0}
    finally:
        srv.kill()


def scenario_drain_timeout(ckpt: Path) -> dict:
    srv = Served(ckpt, "--shutdown-timeout", str(P["drain_cut"]))
    try:
        streams = [Stream(srv.url) for _ in range(P["streams"])]
        os.kill(srv.core, signal.SIGSTOP)  # the streams cannot finish
        os.kill(srv.proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        outcome = outcomes_of(streams, P["drain_cut"] + 30)
        stream_s = time.monotonic() - t0
        return {"stream": outcome, "stream_s": stream_s, "code": srv.exit_code(30), "exit_s": time.monotonic() - t0}
    finally:
        srv.kill()


def scenario_drain_dead_core(ckpt: Path) -> dict:
    """SIGTERM with a stream in flight (the core held by SIGSTOP so it cannot finish), then the core is killed
    while the server drains."""
    srv = Served(ckpt, "--shutdown-timeout", str(P["drain"]))
    try:
        streams = [Stream(srv.url) for _ in range(P["streams"])]
        os.kill(srv.core, signal.SIGSTOP)
        os.kill(srv.proc.pid, signal.SIGTERM)
        srv.wait_for_log("shutting down", 30)  # the drain has begun, with the streams in flight
        os.kill(srv.core, signal.SIGKILL)
        t0 = time.monotonic()
        outcome = outcomes_of(streams, 30)
        return {"stream": outcome, "code": srv.exit_code(30), "exit_s": time.monotonic() - t0,
                "log": "".join(srv.log)}
    finally:
        srv.kill()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("soak") / "ckpt", shape="tiny", family="llama", seed=3)
    scenarios = {"kill": scenario_kill, "stall": scenario_stall, "drain": scenario_drain,
                 "drain_timeout": scenario_drain_timeout, "drain_dead_core": scenario_drain_dead_core}
    with ThreadPoolExecutor(len(scenarios)) as pool:
        futures = {name: pool.submit(fn, ckpt) for name, fn in scenarios.items()}
        results = {}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except Exception as e:  # recorded, so each scenario's test fails on its own
                results[name] = {"failed": f"{type(e).__name__}: {e}"}
    for name, result in results.items():
        print(name, {k: v for k, v in result.items() if k not in ("log", "statuses")})
    return results


def test_a_killed_core_fails_the_stream_and_exits_1(outcomes):
    r = outcomes["kill"]
    assert r["stream"] == "error event" and r["code"] == 1 and r["exit_s"] < 30, r
    assert "the engine is dead" in r["log"] and "exited (exit code -9)" in r["log"], r["log"]  # and says why


def test_a_stopped_core_is_reported_stalled_then_killed(outcomes):
    r = outcomes["stall"]
    assert r["slowest_probe_s"] < 1.0, r["statuses"]  # /health answers whatever the core does
    # Counted from the core's last message, which came at most a step before the stop.
    assert r["first_stalled_s"] is not None and P["stall"] - 0.3 <= r["first_stalled_s"] < P["kill"], r["statuses"]
    assert (200, "ok") in r["statuses"][:3], r["statuses"]  # before the stall bound: the front's last view
    assert r["stream"] == "error event", r
    assert r["code"] == 1 and P["kill"] <= r["exit_s"] < P["kill"] + 10, r
    assert "no progress" in r["log"] and "was killed" in r["log"], r["log"]


def test_sigterm_drains_the_stream_and_exits_0(outcomes):
    r = outcomes["drain"]
    assert r["health"] == (503, "draining") and r["health_s"] < 1.0, r
    assert r["late_health"] == (503, "draining"), r  # a new connection during the drain: the port is open
    assert r["new_request"] == 503, r
    assert r["stream"] == "finished", r
    assert r["code"] == 0, r


def test_sigterm_past_the_shutdown_timeout_ends_the_stream_with_an_error(outcomes):
    r = outcomes["drain_timeout"]
    assert r["stream"] == "error event", r
    assert P["drain_cut"] <= r["stream_s"] < P["drain_cut"] + 7.0, r
    assert r["code"] == 0, r


def test_a_core_that_dies_during_the_drain_makes_the_server_exit_1(outcomes):
    """Not a clean stop: a supervisor must see the failure, not exit code 0."""
    r = outcomes["drain_dead_core"]
    assert r["stream"] == "error event", r
    assert r["code"] == 1 and r["exit_s"] < P["drain"], r  # the drain does not wait out --shutdown-timeout
    assert f"{P['streams']} request(s) in flight" in r["log"], r["log"]  # the drain began with the streams
    assert "the engine died during the drain" in r["log"] and "exit code -9" in r["log"], r["log"]
