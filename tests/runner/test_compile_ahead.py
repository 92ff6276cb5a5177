"""runner/compile_ahead.py on CPU, through a stand-in for Triton's two compile hooks: compiles overlap, device
work never does, each step keeps its order, hooks set before are chained and put back, a failing step neither
hangs the pool nor stops the others; and the graph runner hands it one step per size before it captures."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ostinato.runner.compile_ahead import compile_ahead
from ostinato.runner.graphs import CudaGraphRunner, RecordingGraphBackend, StaticInput

COMPILE_S = 0.15


class FakeTriton:
    """Kernels compile once (a sleep between the two hooks, as Triton's JIT calls them); a launch is device work,
    during which the number of threads on the device is tracked."""

    def __init__(self):
        self.knobs = SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
        self.cache, self.compiles, self.on_device, self.most_on_device = set(), 0, 0, 0
        self.lock = threading.Lock()
        self.launches: list[tuple[int, str]] = []

    def launch(self, step_id: int, kernel: str) -> None:
        if kernel not in self.cache:
            skip = self.knobs.jit_cache_hook(key=kernel, repr=kernel, fn=None)
            if not skip:
                time.sleep(COMPILE_S)
                with self.lock:
                    self.compiles += 1
                    self.cache.add(kernel)
                self.knobs.jit_post_compile_hook(key=kernel, repr=kernel, fn=None)
        with self.lock:
            self.on_device += 1
            self.most_on_device = max(self.most_on_device, self.on_device)
        time.sleep(0.002)
        with self.lock:
            self.on_device -= 1
            self.launches.append((step_id, kernel))


def steps_for(triton: FakeTriton, n: int, fail: int | None = None):
    def step(i):
        def run():
            for kernel in (f"gemv[{i}]", "shared", f"sample[{i}]"):
                if i == fail and kernel == "shared":
                    raise RuntimeError("a kernel failed")
                triton.launch(i, kernel)
        return run
    return [step(i) for i in range(n)]


def test_compiles_overlap_while_device_work_stays_one_thread_at_a_time():
    triton = FakeTriton()
    watched = []
    previous_before = lambda **kw: watched.append(kw["key"])  # noqa: E731  (what the CompileWatch would count)
    triton.knobs.jit_cache_hook = previous_before
    t0 = time.perf_counter()
    report = compile_ahead(steps_for(triton, 6), workers=6, knobs=triton.knobs)
    seconds = time.perf_counter() - t0
    assert report is not None and report.error is None and report.steps == 6
    assert report.compiles == triton.compiles >= 13  # 12 own kernels, and "shared" at least once
    assert seconds < 0.5 * triton.compiles * COMPILE_S  # serially it would take every compile's time
    assert triton.most_on_device == 1
    for i in range(6):  # each step's launches in its own program order
        assert [k for s, k in triton.launches if s == i] == [f"gemv[{i}]", "shared", f"sample[{i}]"]
    assert len(watched) == triton.compiles  # the hook set before still saw every compile
    assert triton.knobs.jit_cache_hook is previous_before and triton.knobs.jit_post_compile_hook is None
    assert f"compiled {report.compiles} kernels ahead for 6 graph sizes in " in report.summary()


def test_a_failing_step_is_reported_and_the_others_still_run():
    triton = FakeTriton()
    report = compile_ahead(steps_for(triton, 4, fail=1), workers=2, knobs=triton.knobs)
    assert report.error == "RuntimeError: a kernel failed"
    assert {s for s, k in triton.launches if k.startswith("sample")} == {0, 2, 3}
    assert triton.knobs.jit_cache_hook is None and triton.knobs.jit_post_compile_hook is None


def test_a_hook_that_skips_the_compile_keeps_the_turn():
    """Triton skips a compile (and the post-compile hook) when its cache hook returns True: the worker must not
    wait for a turn it never gave up."""
    triton = FakeTriton()
    triton.knobs.jit_cache_hook = lambda **kw: True
    report = compile_ahead(steps_for(triton, 3), workers=3, knobs=triton.knobs)
    assert report.compiles == 0 and report.error is None and triton.most_on_device == 1


@pytest.mark.parametrize("knobs, n", [(None, 4), (SimpleNamespace(jit_cache_hook=None), 4),
                                      (SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None), 1)])
def test_it_stands_aside_where_it_cannot_help(knobs, n, monkeypatch):
    import ostinato.runner.compile_ahead as module

    monkeypatch.setattr(module, "_triton_runtime_knobs", lambda: None)  # no Triton (or no hooks)
    ran = []
    assert compile_ahead([lambda: ran.append(1)] * n, knobs=knobs) is None and ran == []


def test_the_graph_runner_hands_every_size_s_step_over_before_capturing():
    seen = []
    runner = CudaGraphRunner(lambda token_ids: token_ids[:, None].float(),
                             [StaticInput("token_ids", (8,), torch.int64, pad_value=0)], (1, 2, 8), "cpu",
                             backend=RecordingGraphBackend())
    runner.compile_ahead = lambda steps: seen.extend(step().shape[0] for step in steps)
    runner.capture()
    assert seen == [8, 2, 1] and runner.captured_sizes == (1, 2, 8)


def test_the_threads_run_on_the_capturing_thread_s_device_and_autograd_mode(monkeypatch, caplog):
    """The engine's device is torch.device("cuda"), with no index, which torch.cuda.set_device refuses: each
    thread must get the capturing thread's device index, and its autograd mode (a new thread starts with grad
    on, and inference mode would make the buffers a step creates lazily unusable to the capture)."""
    import ostinato.runner.compile_ahead as module
    from ostinato.runner.kv_setup import compile_graph_kernels_ahead

    knobs = SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)
    monkeypatch.setattr(module, "_triton_runtime_knobs", lambda: knobs)

    def set_device(device):  # as torch's: an int, or a torch.device that names its index
        index = device if isinstance(device, int) else device.index
        if index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        threads[threading.get_ident()] = index

    threads, ran = {}, []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def step():
        ran.append((threads.get(threading.get_ident()), torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return torch.zeros(1)

    with torch.no_grad():
        report = compile_graph_kernels_ahead([step] * 5, torch.device("cuda"), None, [])
    assert report is not None and report.error is None, report
    assert ran == [(3, False, False)] * 5
    assert "failed" not in caplog.text


def test_every_failing_step_is_logged_as_a_warning(caplog):
    triton = FakeTriton()
    with caplog.at_level("WARNING", logger="ostinato.runner.compile_ahead"):
        report = compile_ahead(steps_for(triton, 3, fail=2), workers=2, knobs=triton.knobs)
    failed = [r for r in caplog.records if "step 3 of 3 failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelname == "WARNING" and failed[0].exc_info is not None
    assert any("a step failed, left to the capture" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records), report


@pytest.mark.gpu
def test_a_cold_start_compiles_the_graph_kernels_ahead_and_the_capture_none(tmp_path):
    """With an empty Triton cache, start-up logs the kernels it compiled ahead, and the capture loop that follows
    compiles none itself (what was not covered shows up as 'the capture compiled N more kernels')."""
    import os
    import re
    import subprocess
    import sys

    from ostinato.tools.checkpoint import make_checkpoint

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make_checkpoint(tmp_path / "ckpt", shape="tiny", family="qwen3", seed=4, dtype="bfloat16")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    r = subprocess.run([sys.executable, "-m", "ostinato", "generate", str(tmp_path / "ckpt"), "--prompt", "hi",
                        "--raw", "--max-tokens", "2", "--max-num-seqs", "64"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # What the pass did, whatever the start-up logged after it: its lines, its warnings and their tracebacks.
    said = "\n".join(line for line in r.stderr.splitlines() if "compil" in line or "WARNING" in line
                     or line.startswith(("Traceback", "  ", "ValueError", "RuntimeError")))[-4000:]
    ahead = re.search(r"compiled (\d+) kernels ahead for (\d+) graph sizes", r.stderr)
    # One line per decode graph set: without the logits processors, and with them.
    more = re.findall(r"the capture compiled (\d+) more kernels", r.stderr)
    assert "a step failed" not in r.stderr, said
    assert ahead and int(ahead[1]) > 0 and int(ahead[2]) > 1, said
    assert more == ["0", "0"], said
