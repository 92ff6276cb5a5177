"""`ostinato serve` exempts the front's start-up heap from Python's cyclic collector once the engine is ready
(engine/startup_heap.py says why), through the serve command's own code path in this process (--engine-thread:
the engine, built in this process, is frozen with it). The engine core process freezes its own heap:
tests/engine/test_startup_heap.py."""

import gc
import os
import signal
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402


def _tracked_by_collections(obj) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_the_served_engine_and_the_front_are_frozen_once_ready(tmp_path, gc_settings_restored):
    from ostinato import cli, serve_command
    from ostinato.engine.engine import LLMEngine

    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama", seed=1)
    built = []

    def engine_factory(args):
        built.append(LLMEngine(args))
        return built[0]

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen = {}

    def watch_then_stop():
        """Once the server answers /health 200, wait for the freeze (it follows the 'serving' line), then stop
        the server the way Ctrl-C does."""
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and not seen:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        frozen_by = time.monotonic() + 10
                        while time.monotonic() < frozen_by and gc.get_freeze_count() == 0:
                            time.sleep(0.05)
                        seen["engine_frozen"] = not _tracked_by_collections(built[0])
                except httpx.HTTPError:
                    time.sleep(0.1)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch_then_stop, daemon=True).start()
    ns = cli.build_parser().parse_args(["serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
                                        "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16",
                                        "--max-model-len", "64", "--engine-thread"])
    try:
        serve_command.run(ns, engine_factory=engine_factory)
    except KeyboardInterrupt:
        pass
    assert seen.get("engine_frozen") is True
