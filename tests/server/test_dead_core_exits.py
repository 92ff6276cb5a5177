"""A dead engine core ends `ostinato serve` with a non-zero exit code, so a supervisor restarts it, instead of
leaving a server that answers 503 forever.

The server runs as a real `ostinato serve` process on a tiny checkpoint on CPU, on loopback; its core is killed
with SIGKILL."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from support.served import SRC, core_pid  # noqa: E402

from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the core process through /proc")
def test_a_killed_core_makes_the_server_exit_non_zero(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama", seed=1)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "ostinato", "serve", str(ckpt), "--host", "127.0.0.1", "--port", "0",
           "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16", "--max-model-len", "64"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        deadline, port = time.monotonic() + 240, None
        for line in proc.stderr:
            found = re.search(r"ostinato\.server\.app: serving .* on http://127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
            assert time.monotonic() < deadline, "the server did not become ready"
        assert port is not None, "the server exited before it was ready"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        os.kill(core_pid(proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        _, rest = proc.communicate(timeout=30)
        assert proc.returncode not in (0, None), rest
        assert time.monotonic() - killed < 30
        assert "the engine is dead" in rest and "exited (exit code -9)" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_thread_whose_step_raises_makes_serve_exit_non_zero(tmp_path):
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
