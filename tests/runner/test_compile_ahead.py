"""runner/compile_ahead.py and runner/compile_pool.py on CPU.

A real Triton kernel of ours (kernels/paged_kv_write.py) is compiled for sm_90 (the triton wheel ships ptxas)
behind a stand-in for the CUDA driver that answers only what a launch asks before it compiles (device,
stream, target): the recording pass sees its launch and skips it, a worker process compiles it into a
temporary TRITON_CACHE_DIR, and the same launch in this process then loads it from there (a cache hit, no
compile). ValuesOff is checked on CPU tensors: ops that would read garbage indices or write existing tensors
do neither."""

import logging
import time

import pytest
import torch

from ostinato.runner.compile_ahead import (CompileCounter, ValuesOff, compile_ahead, record_kernels)
from ostinato.runner.compile_pool import CompilePool, KernelJob
from ostinato.runner.graphs import CudaGraphRunner, RecordingGraphBackend, StaticInput

triton = pytest.importorskip("triton")


class SM90Driver:
    """What JITFunction.run asks the driver before it compiles (a warm-up launch asks nothing more)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


@pytest.fixture
def kv_write_kernel(tmp_path, monkeypatch):
    """kernels/paged_kv_write.py's kernel as a compiling JITFunction (the CPU tests run Triton's interpreter,
    whose functions never compile), launched as warm-ups against SM90Driver, with an empty Triton cache."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from ostinato.kernels.paged_kv_write import _write_kv_kernel

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    kernel = JITFunction(getattr(_write_kv_kernel, "fn", _write_kv_kernel))
    previous = driver._active
    driver.set_active(SM90Driver())
    args = (torch.bfloat16,) * 4 + (torch.int64,) + (64, 128, 64, 128, 4096, 512, 128)
    constexprs = dict(NUM_KV_HEADS=4, HEADS_PAD=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16)
    try:
        yield kernel, lambda: kernel.warmup(*args, grid=(1,), **constexprs)
    finally:
        driver._active = previous


def test_a_kernel_compiled_ahead_in_a_worker_is_a_cache_hit_here(kv_write_kernel, caplog):
    kernel, launch = kv_write_kernel
    pool = CompilePool.start(1)
    try:
        with caplog.at_level(logging.INFO, logger="ostinato.runner.compile_ahead"):
            report = compile_ahead([launch, launch], pool, "a test", knobs=triton.knobs.runtime)
        assert report is not None and report.problems == (), report
        assert (report.distinct, report.compiled, report.cached) == (1, 1, 0)
        assert "compiled 1 Triton kernels ahead for a test" in caplog.text
        assert not kernel.device_caches[0][0]  # recorded, not compiled here
        with CompileCounter() as counter:
            assert launch() is not None
        assert (counter.compiled, counter.loaded) == (0, 1)
        # Again (a warm start): the pass finds it cached and sends nothing.
        kernel.device_caches.clear()
        again = compile_ahead([launch], pool, "a test", knobs=triton.knobs.runtime)
        assert (again.distinct, again.cached, again.compiled) == (1, 1, 0)
        # A job the worker cannot compile comes back with its error, and the worker serves on.
        bogus = KernelJob("ostinato.kernels.paged_kv_write", "no_such_kernel", {}, {}, {}, {}, ("cuda", 90, 32),
                          "0", "no_such_kernel")
        [result] = pool.compile([bogus])
        assert not result.matched and "AttributeError" in result.error
    finally:
        pool.close()


def test_the_recording_pass_launches_nothing_and_puts_everything_back(kv_write_kernel):
    kernel, _ = kv_write_kernel
    k, cache, slots = torch.zeros(2, 4, 128, dtype=torch.bfloat16), torch.zeros(9, 16, 4, 128, dtype=torch.bfloat16), \
        torch.zeros(2, dtype=torch.int64)

    def launch():  # a real launch, as a step makes it (the same specialisation as the fixture's warm-up)
        return kernel[(2,)](k, k, cache, cache, slots, *k.stride()[:2], *k.stride()[:2], *cache.stride()[:3],
                            NUM_KV_HEADS=4, HEADS_PAD=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16)

    sentinel = object()
    kernel.device_caches[0][0]["an earlier compile"] = sentinel
    knobs = triton.knobs.runtime
    previous_hook = knobs.jit_cache_hook
    seen_during, launched = [], []

    def step():
        seen_during.append(set(kernel.device_caches[0][0]) - {None})
        launched.append(launch())

    def failing_step():
        raise RuntimeError("a step that fails")

    with CompileCounter() as counter:
        recording = record_kernels([step, failing_step, step], knobs)
    assert seen_during[0] == set()  # kernels already loaded miss during the pass: none of them can run
    # The first launch was skipped by the hook; the second found the stand-in left for the rest of the pass,
    # which launches nothing, and never reached the hook.
    assert launched[0] is None and type(launched[1]).__name__ == "_SkippedLaunch" and recording.met == 1
    assert kernel.device_caches[0][0] == {"an earlier compile": sentinel}  # stand-ins gone, the rest back
    assert knobs.jit_cache_hook is previous_hook
    assert counter.compiled == counter.loaded == 0
    assert len(recording.jobs) == 1
    assert recording.step_errors == ["step 2: RuntimeError: a step that fails"]


def test_values_off_neither_reads_indices_nor_writes_existing_tensors():
    weight = torch.arange(12.0).reshape(4, 3)
    garbage = torch.tensor([7, -9, 10**9])
    kept, out = torch.ones(3), torch.zeros(3)  # state that existed before the pass
    with ValuesOff():
        looked_up = torch.nn.functional.embedding(garbage, weight)  # would raise: indices out of range
        selected = weight.index_select(0, garbage)
        gathered = weight.gather(1, garbage[:2, None].expand(2, 3))
        added = kept.add_(5)
        summed = torch.add(kept, kept, out=out)
        fresh = torch.zeros(3)
        fresh.add_(kept)  # a tensor the pass made is written for real
        values, indices = torch.empty(2), torch.empty(2, dtype=torch.int64)
        topk = torch.topk(weight[0], 2, out=(values, indices))
        computed = kept * 2
        resized = torch.empty(0).resize_(5)
        row = weight.select(0, 2)  # an integer index is no tensor's values
        lazy = torch.empty(3).fill_(4.0)  # state a step creates: initialised for real
        lazy.index_put_((garbage,), torch.ones(3))  # but never written at garbage indices
    assert looked_up.shape == (3, 3) and selected.shape == (3, 3) and gathered.shape == (2, 3)
    assert added is kept and torch.equal(kept, torch.ones(3))
    assert summed is out and torch.equal(out, torch.zeros(3))
    assert topk[0] is values and topk[1] is indices
    assert torch.equal(computed, torch.full((3,), 2.0))  # ops that neither index nor write still run
    assert resized.shape == (5,)  # shape-changing writes run: later shapes depend on them
    assert row.data_ptr() == weight.data_ptr() + 6 * weight.element_size()  # views stay views (and offsets)
    assert torch.equal(lazy, torch.full((3,), 4.0)) and torch.equal(fresh, torch.ones(3))


def test_a_failure_inside_never_fails_the_start(kv_write_kernel, caplog):
    _, launch = kv_write_kernel

    class BrokenPool:
        workers = 1

        def compile(self, jobs):
            raise OSError("no such process")

    with caplog.at_level(logging.WARNING, logger="ostinato.runner.compile_ahead"):
        assert compile_ahead([launch], BrokenPool(), "a test", knobs=triton.knobs.runtime) is None
    assert "compiling the Triton kernels of a test ahead failed, the capture compiles them: OSError" in caplog.text
    assert triton.knobs.runtime.jit_cache_hook is None


def test_a_worker_that_died_gives_its_jobs_back_as_errors():
    pool = CompilePool.start(1)
    try:
        pool._procs[0].kill()
        pool._procs[0].wait()
        job = KernelJob("m", "k", {}, {}, {}, {}, ("cuda", 90, 32), "0", "k")
        t0 = time.perf_counter()
        [result] = pool.compile([job])
        assert result.error is not None and "died" in result.error and time.perf_counter() - t0 < 5
    finally:
        pool.close()


def test_the_graph_runner_hands_every_size_s_step_over_before_capturing():
    seen = []
    runner = CudaGraphRunner(lambda token_ids: token_ids[:, None].float(),
                             [StaticInput("token_ids", (8,), torch.int64, pad_value=0)], (1, 2, 8), "cpu",
                             backend=RecordingGraphBackend())
    runner.compile_ahead = lambda steps: seen.extend(step().shape[0] for step in steps)
    runner.capture()
    assert seen == [8, 2, 1] and runner.captured_sizes == (1, 2, 8)


@pytest.mark.gpu
def test_a_cold_start_compiles_the_graph_kernels_ahead_and_the_capture_none(tmp_path):
    """With an empty Triton cache, start-up logs the kernels it compiled ahead, and the captures that follow
    compile none themselves: they load every kernel from the cache."""
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
    said = "\n".join(line for line in r.stderr.splitlines() if "compil" in line or "WARNING" in line)[-4000:]
    ahead = re.findall(r"compiled (\d+) Triton kernels ahead for the decode graphs", r.stderr)
    itself = re.findall(r"the capture of the decode graphs.* compiled (\d+) Triton kernels itself", r.stderr)
    assert ahead and int(ahead[0]) > 0, said
    assert itself == ["0", "0"], said
    assert "left to be compiled where launched" not in r.stderr, said
