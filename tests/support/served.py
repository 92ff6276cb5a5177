"""`ostinato serve` as a real process (a tiny checkpoint on CPU, on loopback), and its engine core's pid, for the
tests that kill, stop or signal them (tests/server/test_reliability_soak.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
READY = re.compile(r"ostinato\.server\.app: serving .* on http://127\.0\.0\.1:(\d+)")


def children(pid: int) -> list[int]:
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


def core_pid(server_pid: int) -> int:
    """The spawned engine core among the server's children (not multiprocessing's resource tracker)."""
    for pid in children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine core among the children of {server_pid}")


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


class Served:
    """`ostinato serve` in a subprocess; its stderr is read by a thread (a full pipe would block the server)."""

    def __init__(self, ckpt: Path, *flags: str):
        env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = [sys.executable, "-m", "ostinato", "serve", str(ckpt), "--host", "127.0.0.1", "--port", "0",
               "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32", "--max-model-len", "256", *flags]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log: list[str] = []
        self._port = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        assert self._port.wait(240), "the server did not become ready:\n" + "".join(self.log)
        assert self.port, "the server exited before it was ready:\n" + "".join(self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        self.core = core_pid(self.proc.pid)

    port = 0

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            found = READY.search(line)
            if found:
                self.port = int(found.group(1))
                self._port.set()
        self._port.set()

    def wait_for_log(self, text: str, timeout: float) -> None:
        """Until a line of the server's log holds `text`."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.log):
            assert time.monotonic() < deadline, f"{text!r} not logged within {timeout} s:\n" + "".join(self.log)
            time.sleep(0.02)

    def exit_code(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs after {timeout} s:\n" + "".join(self.log))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.core, signal.SIGCONT) if alive(self.core) else None
            self.proc.kill()
            self.proc.wait()
