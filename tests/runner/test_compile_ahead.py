"""runner/compile_ahead.py on CPU, through a stand-in for Triton's two compile hooks: compiles overlap, device
work never does, each step keeps its order, hooks set before are chained and put back, a failing step neither
hangs the pool nor stops the others; the graph runner gives it one step call per size, as its capture records
them. Deferred launches (kernels/deferred_launch.py) are built once per specialisation, side by side, on prepared
threads, each with its launcher; a failed warm-up is reported apart; and a pass started before the memory profiling
leaves its warm-ups compiling until `finish`."""

import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from ostinato.kernels.deferred_launch import launch
from ostinato.runner.compile_ahead import (MAX_COMPILE_THREADS, DeferredCompiles, default_compile_threads,
                                           start_compile_ahead)
from ostinato.runner.graphs import CudaGraphRunner, RecordingGraphBackend, StaticInput

COMPILE_S = 0.15


def compile_ahead(steps, prepare_thread=lambda: None, **kwargs):
    """A whole pass: start_compile_ahead, then finish (start-up calls the two apart, with memory profiling
    between them)."""
    running = start_compile_ahead(steps, prepare_thread, **kwargs)
    return None if running is None else running.finish()


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
    assert f"compiled {report.compiles} kernels ahead for 6 graph steps in " in report.summary()


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


def test_the_graph_runner_gives_one_step_call_per_size_largest_first_as_its_capture_records_them():
    runner = CudaGraphRunner(lambda token_ids: token_ids[:, None].float(),
                             [StaticInput("token_ids", (8,), torch.int64, pad_value=0)], (1, 2, 8), "cpu",
                             backend=RecordingGraphBackend())
    assert [call().shape[0] for call in runner.step_calls()] == [8, 2, 1]
    assert runner.capture().sizes == (1, 2, 8)


def test_a_started_pass_returns_before_its_warm_ups_end_and_counts_only_its_own_compiles():
    """start_compile_ahead returns once the steps ran, the deferred launches still compiling, so that start-up
    profiles memory meanwhile: what that thread compiles is not the pass's; finish waits for the rest, once, and
    only then gives Triton's hooks back."""
    triton, gate = FakeTriton(), threading.Event()

    class HeldKernel(FakeKernel):  # its warm-ups wait until the test lets them go
        def warmup(self, *args, grid, **kwargs):
            assert gate.wait(10)
            return super().warmup(*args, grid=grid, **kwargs)

    def step(i):
        def run():
            for j in range(3):
                out = torch.ones(2)
                launch(HeldKernel(triton, f"linear[{i}.{j}]", i), (1,), (out, j + 2), {}, (out,))
        return run

    watched = lambda **kw: None  # noqa: E731  (the hook set before: the CompileWatch)
    triton.knobs.jit_cache_hook = watched
    running = start_compile_ahead([step(0), step(1)], workers=2, knobs=triton.knobs,
                                  deferred=DeferredCompiles(6, lambda: None, 0))
    assert triton.compiles == 0 and triton.knobs.jit_cache_hook is not watched  # the warm-ups keep the hooks
    triton.launch(-1, "profiling")  # this thread compiles meanwhile, as the memory profiling does
    gate.set()
    report = running.finish()
    assert report.warmups == 6 and report.compiles == 6 and triton.compiles == 7
    assert report.seconds >= COMPILE_S and 0 < report.waited <= report.seconds
    assert triton.knobs.jit_cache_hook is watched and triton.knobs.jit_post_compile_hook is None
    assert running.finish() is report and f"waited {report.waited:.2f} s for them at the end" in report.summary()


def test_the_threads_run_on_the_capturing_thread_s_device_and_autograd_mode(monkeypatch, caplog):
    """The engine's device is torch.device("cuda"), with no index, which torch.cuda.set_device refuses: each
    thread must get the capturing thread's device index, and its autograd mode (a new thread starts with grad
    on, and inference mode would make the buffers a step creates lazily unusable to the capture)."""
    import ostinato.runner.compile_ahead as module
    from ostinato.runner.compile_ahead import start_graph_kernel_compiles

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

    kernel = FakeKernel(FakeTriton(), "gemv")
    kernel.warmup = lambda *args, grid, **kwargs: ran.append(("warm-up on", threads.get(threading.get_ident())))

    def step():
        ran.append((threads.get(threading.get_ident()), torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        out = torch.ones(1)
        launch(kernel, (1,), (out,), {}, (out,))  # a deferred launch: built on a pool thread, on cuda:3 too
        return out

    with torch.no_grad():
        report = start_graph_kernel_compiles([step] * 5, torch.device("cuda")).finish()
    assert report is not None and report.error is None, report
    assert sorted(ran, key=str) == [("warm-up on", 3)] + [(3, False, False)] * 5
    assert list(kernel.device_caches) == [3] and report.warmups == 1
    assert "failed" not in caplog.text


def test_every_failing_step_is_logged_as_a_warning(caplog):
    triton = FakeTriton()
    with caplog.at_level("WARNING", logger="ostinato.runner.compile_ahead"):
        report = compile_ahead(steps_for(triton, 3, fail=2), workers=2, knobs=triton.knobs)
    failed = [r for r in caplog.records if "step 3 of 3 failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelname == "WARNING" and failed[0].exc_info is not None
    assert any("a step failed, left to the capture" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records), report


class FakeKernel:
    """A Triton kernel of FakeTriton: launched through kernels/deferred_launch.py, or built by its warm-up."""

    def __init__(self, triton: FakeTriton, name: str, step_id: int = -1, fail: bool = False):
        self.triton, self.name, self.step_id, self.fail = triton, name, step_id, fail
        self.__name__ = name  # as a JITFunction's: the log names the kernels built
        self.warmups: list[tuple[str, tuple, dict]] = []
        self.binders: list[str] = []  # the threads that built a device's binder (Triton: on first use)
        self.compiled: list[SimpleNamespace] = []  # what each warm-up built; its launcher built (loaded_on) or not
        self.device_caches = defaultdict(lambda: self.binders.append(threading.current_thread().name))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.triton.launch(self.step_id, self.name)

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((threading.current_thread().name, args, kwargs))
        if self.fail:
            raise RuntimeError("no such specialisation")
        compiled = SimpleNamespace(loaded_on=[])
        compiled._init_handles = lambda: compiled.loaded_on.append(threading.current_thread().name)
        self.compiled.append(compiled)
        knobs = self.triton.knobs
        if knobs.jit_cache_hook is not None and knobs.jit_cache_hook(key=self.name, repr=self.name, fn=None):
            return None
        time.sleep(COMPILE_S)
        with self.triton.lock:
            self.triton.compiles += 1
            self.triton.cache.add(self.name)
        if knobs.jit_post_compile_hook is not None:
            knobs.jit_post_compile_hook(key=self.name, repr=self.name, fn=None)
        return compiled


def test_a_deferred_launch_is_built_once_per_specialisation_on_a_prepared_thread():
    triton = FakeTriton()
    prepared = []
    kernel = FakeKernel(triton, "gemv")
    sink = DeferredCompiles(4, lambda: prepared.append(threading.current_thread().name), 0)
    rows = torch.zeros(64, dtype=torch.bfloat16)
    for m, x, block in [(2, rows, 4), (3, rows, 4),  # 2 and 3: the same class (neither 1 nor a multiple of 16)
                        (16, rows, 4), (1, rows, 4), (3, rows[1:], 4),  # another class; a misaligned address
                        (3, rows, 8), (3, rows.float(), 4)]:  # another constexpr; another dtype
        sink(kernel, (1,), (x, m), {"BLOCK": block})
    assert sink.finish() == ((("gemv", 6),), None)
    assert kernel.binders == [threading.current_thread().name] and list(kernel.device_caches) == [0]
    # Each built kernel's launcher built and loaded right after it, on the same pool thread.
    assert [compiled.loaded_on for compiled in kernel.compiled] == [[thread] for thread, _, _ in kernel.warmups]
    aligned_bf16_block4 = [args[1] for _, args, kwargs in kernel.warmups if args[0] is rows and kwargs["BLOCK"] == 4]
    assert sorted(aligned_bf16_block4) == [1, 2, 16]
    assert {thread for thread, _, _ in kernel.warmups} <= set(prepared) and prepared
    assert all(thread.startswith("compile_warmup") for thread in prepared)


@pytest.mark.parametrize("cpus, threads", [(1, 1), (16, 16), (128, MAX_COMPILE_THREADS)])
def test_one_compile_thread_per_cpu_the_process_may_use(monkeypatch, cpus, threads):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert default_compile_threads() == threads


def deferred_steps(triton: FakeTriton, n: int, per_step: int):
    def step(i):
        def run():
            for j in range(per_step):  # one step's kernels, each its own specialisation
                out = torch.ones(2)
                launch(FakeKernel(triton, f"linear[{i}.{j}]", i), (1,), (out, j + 2), {}, (out,))
                assert not out.any()  # zeroed, as the launch was handed over
            triton.launch(i, "sample")  # launched as ever, compiled in the step
        return run
    return [step(i) for i in range(n)]


def test_one_step_s_deferred_launches_compile_side_by_side():
    """What a step launches through deferred_launch is not run but built on the compile threads, all at once:
    the step does not wait for each in turn."""
    triton = FakeTriton()
    t0 = time.perf_counter()
    report = compile_ahead(deferred_steps(triton, 2, per_step=6), workers=2, knobs=triton.knobs,
                           deferred=DeferredCompiles(12, lambda: None, 0))
    seconds = time.perf_counter() - t0
    assert report.error is None and report.warmups == 12 and report.compile_threads == 12
    assert report.compiles == triton.compiles >= 13  # 12 warm-ups and "sample" at least once
    assert seconds < 5 * COMPILE_S  # in turn, each step's six compiles alone would take 6 x COMPILE_S
    assert sorted(triton.launches) == [(0, "sample"), (1, "sample")]  # the deferred ones never ran
    assert "12 launches built as warm-ups on 12 threads: linear[0.0] 1, " in report.summary()


def test_a_failing_warm_up_is_reported_and_left_to_the_capture(caplog):
    triton = FakeTriton()
    bad = FakeKernel(triton, "bad", fail=True)

    def step():
        out = torch.ones(1)
        launch(bad, (1,), (out,), {}, (out,))

    with caplog.at_level("WARNING", logger="ostinato.runner.compile_ahead"):
        report = compile_ahead([step, step], workers=2, knobs=triton.knobs,
                               deferred=DeferredCompiles(2, lambda: None, 0))
    assert report.error is None and report.warmup_error == "RuntimeError: no such specialisation"
    assert report.warmups == 1
    assert "a kernel's warm-up failed, left to the capture" in caplog.text
    assert any("a warm-up failed, left to the capture: RuntimeError" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)


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
    ahead = re.search(r"compiled (\d+) kernels ahead for (\d+) graph steps", r.stderr)
    # One line per decode graph set: without the logits processors, and with them.
    more = re.findall(r"the capture compiled (\d+) more kernels", r.stderr)
    assert "a step failed" not in r.stderr and "a warm-up failed" not in r.stderr, said
    assert ahead and int(ahead[1]) > 0 and int(ahead[2]) > 1, said
    assert more == ["0", "0"], said
