"""A dead engine core ends `ostinato serve` with a non-zero exit code, so a supervisor restarts it, instead of
leaving a server that answers 503 forever.

The server runs as a real `ostinato serve` process on a tiny checkpoint on CPU, on loopback; its core is killed
with SIGKILL."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the "(comm)" that may hold spaces
                found.append(int(entry.name))
    return found


def _core_pid(server_pid: int) -> int:
    """The spawned engine core among the server's children (not multiprocessing's resource tracker)."""
    for pid in _children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine core among the children of {server_pid}")


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
        os.kill(_core_pid(proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        _, rest = proc.communicate(timeout=30)
        assert proc.returncode not in (0, None), rest
        assert time.monotonic() - killed < 30
        assert "the engine is dead" in rest and "exited (exit code -9)" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
