"""A dead engine ends `ostinato serve` with a non-zero exit code, so a supervisor restarts it, instead of
leaving a server that answers 503 forever.

Here the --engine-thread layout, through the serve command's own code path in this process. The engine core
process killed with SIGKILL (exit 1, and the log says why) is a scenario of test_reliability_soak.py, which
starts its servers at once."""

import os
import signal
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402


def test_an_engine_thread_whose_step_raises_makes_serve_exit_non_zero(tmp_path, gc_settings_restored):
    """--engine-thread: a step that raises also ends `serve` with exit code 1 (through the serve command's own
    code path, in this process)."""
    from ostinato import SamplingParams, cli, serve_command
    from ostinato.engine.engine import LLMEngine

    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama", seed=1)

    def engine_that_fails_its_first_step(args):
        engine = LLMEngine(args)
        engine.add_request("pending", [4, 5], SamplingParams(max_tokens=4))  # the engine steps it when woken

        def failing_step():
            raise RuntimeError("injected step failure")

        engine.step = failing_step
        return engine

    with socket.socket() as probe:  # a free port, known in advance so a thread can wake the engine over HTTP
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def wake_the_engine():
        """Once the engine serves, a /metrics read posts a command, which wakes the idle engine thread; it then
        steps the pending request."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if not stopped.wait(30):  # a server that outlives its engine: stop it the way Ctrl-C does (exit 0)
            os.kill(os.getpid(), signal.SIGINT)

    stopped = threading.Event()
    threading.Thread(target=wake_the_engine, daemon=True).start()
    ns = cli.build_parser().parse_args(["serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
                                        "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16",
                                        "--max-model-len", "64", "--engine-thread"])
    started = time.monotonic()
    try:
        code = serve_command.run(ns, engine_factory=engine_that_fails_its_first_step)
    except KeyboardInterrupt:
        pytest.fail("serve kept running after its engine died, until stopped with SIGINT")
    finally:
        stopped.set()
    assert code == 1
    assert time.monotonic() - started < 60
