"""`ostinato serve`'s start-up log, as a user reads it on the terminal: the engine core's INFO lines (KV cache,
CUDA graphs, the step policy) appear, and uvicorn's "running" line comes only once the model is ready.

The server runs as a real `ostinato serve` process on a tiny checkpoint on CPU, stopped with SIGINT."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ostinato.tools.checkpoint import make_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("serve-log") / "ckpt", shape="tiny", family="llama", seed=1)


def _serve_log(ckpt: Path, timeout_s: float = 240.0) -> list[str]:
    """stderr lines of `ostinato serve` from start until its ready line, then until it stopped on SIGINT."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "ostinato", "serve", str(ckpt), "--host", "127.0.0.1", "--port", "0",
           "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16", "--max-model-len", "64"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines, deadline = [], time.monotonic() + timeout_s
    try:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if "ostinato.server.app: serving " in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
        lines += rest.splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return lines


def test_serve_shows_the_core_start_up_and_announces_running_once_ready(ckpt):
    lines = _serve_log(ckpt)
    text = "\n".join(lines)

    def first(fragment: str) -> int:
        found = [i for i, line in enumerate(lines) if fragment in line]
        assert found, f"no line with {fragment!r} in:\n{text}"
        return found[0]

    kv_cache = first("ostinato.runner.kv_setup: KV cache: 16 blocks")  # logged by the engine core process
    first("no CUDA device: decode runs eager")
    # The server's step policy, resolved: 256 sequences (the default) leave half the 512-token prefill graph.
    first("steps: up to 256 sequences, 8192 tokens a step; a step that also decodes carries at most 256 prompt tokens")
    loading = first("until it is ready /health answers 503 (event loop: uvloop)")  # a dependency on Linux
    ready = first("ostinato.server.app: serving ")
    running = first("Uvicorn running on http://127.0.0.1:")
    assert loading < kv_cache < running and ready - 1 <= running <= ready + 1, text
    assert sum("Uvicorn running on" in line for line in lines) == 1
