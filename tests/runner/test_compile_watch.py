"""Start-up warm-up of the eager prefill path and the watch that reports a Triton compile inside a live step."""

import logging
import random
from types import SimpleNamespace

import pytest
import torch

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.runner import compile_watch as cw
from ostinato.kernels import sampling as sampling_kernel
from ostinato.runner.warmup import (WARMUP_STEPS, bitmask_row_counts, warm_up_grammar_masks, warm_up_prefill,
                                   warm_up_sampling)
from ostinato.sampling_params import SamplingParams
from ostinato.tools.checkpoint import make_checkpoint


@pytest.fixture
def knobs(monkeypatch):
    fake = SimpleNamespace(jit_cache_hook=None)
    monkeypatch.setattr(cw, "_runtime_knobs", lambda: fake)
    return fake


def test_compiles_count_as_startup_until_sealed_then_warn(knobs, caplog):
    watch = cw.CompileWatch()
    assert watch.install() and knobs.jit_cache_hook == watch.on_compile
    knobs.jit_cache_hook(key="k1", repr="_prefill_kernel[...]", fn=None)
    assert (watch.compiles_at_startup, watch.compiles_in_service) == (1, 0)
    watch.seal()
    with caplog.at_level(logging.WARNING, logger=cw.__name__):
        assert knobs.jit_cache_hook(key="k2", repr="_gemv_kernel[M=1]", fn=None) is None  # never skips a compile
    assert (watch.compiles_at_startup, watch.compiles_in_service) == (1, 1)
    assert watch.kernels_in_service == ["_gemv_kernel[M=1]"]
    assert "_gemv_kernel[M=1]" in caplog.text and "inside a live step" in caplog.text
    watch.uninstall()
    assert knobs.jit_cache_hook is None


def test_a_foreign_hook_is_chained_and_an_older_watch_is_taken_over(knobs):
    calls = []

    def foreign(**kw):
        calls.append(kw["key"])
        return True  # e.g. a tool that skips compiles: its answer passes through

    knobs.jit_cache_hook = foreign
    old = cw.CompileWatch()
    old.install()
    new = cw.CompileWatch()
    new.install()
    new.seal()
    assert knobs.jit_cache_hook(key="k", repr="r", fn=None) is True
    assert calls == ["k"] and new.compiles_in_service == 1
    assert old.compiles_at_startup == old.compiles_in_service == 0  # not chained twice through the old watch
    new.uninstall()
    assert knobs.jit_cache_hook is foreign


def test_without_a_hook_in_triton_nothing_is_installed(monkeypatch):
    monkeypatch.setattr(cw, "_runtime_knobs", lambda: SimpleNamespace())
    watch = cw.CompileWatch()
    assert not watch.install() and not watch.installed


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmup")
    make_checkpoint(path, shape="tiny", family="qwen3", seed=3)
    return LLMEngine(EngineArgs(model=str(path), device="cpu", max_model_len=128, num_kv_blocks=32))


def test_warm_up_writes_only_the_scratch_block_and_leaves_the_engine_as_it_was(engine):
    runner = engine.runner
    caches = [torch.stack(kv) for kv in runner.kv_caches]  # [2, blocks + 1, block_size, Hkv, D] per layer
    scratch = runner.scratch_block
    ran, _ = warm_up_prefill(runner.model, runner.sampler, runner.block_size, scratch, runner.device, 128)
    assert ran == sum(all(new + cached <= 128 for new, cached in shape) for shape in WARMUP_STEPS) > 0
    changed_scratch = False
    for before, (k, v) in zip(caches, runner.kv_caches):
        after = torch.stack((k, v))
        assert torch.equal(before[:, :scratch], after[:, :scratch]), "warm-up wrote into a real KV block"
        changed_scratch |= not torch.equal(before[:, scratch], after[:, scratch])
    assert changed_scratch  # it did run the forwards (their K/V went to the scratch block)
    assert len(runner.decode_batch) == 0 and engine.scheduler.block_manager.num_free_blocks == 32
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_warm_up_skips_steps_longer_than_the_model(engine):
    runner = engine.runner
    longest = max(new + cached for shape in WARMUP_STEPS for new, cached in shape)
    ran, _ = warm_up_prefill(runner.model, runner.sampler, runner.block_size, runner.scratch_block, runner.device,
                             longest - 1)
    assert 0 < ran < len(WARMUP_STEPS)


@pytest.mark.gpu
def test_no_kernel_compiles_inside_live_steps_on_the_gpu(tmp_path):
    """Prompts of 1, odd and multiple-of-16 lengths, several at once, chunked over a cached prefix, greedy and
    sampled: after start-up's warm-up none of them makes Triton compile (the first 1-token prompt used to)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make_checkpoint(tmp_path, shape="tiny", family="qwen3", seed=4, dtype="bfloat16")
    eng = LLMEngine(EngineArgs(model=str(tmp_path), dtype="bfloat16", max_model_len=512, num_kv_blocks=128,
                               max_num_seqs=8, max_num_batched_tokens=40))
    watch = eng.runner.compile_watch
    assert watch.installed and watch.compiles_at_startup >= 0
    base = list(range(3, 200))
    lengths = (1, 2, 5, 16, 17, 31, 64, 100, 150)
    for i, n in enumerate(lengths):
        params = (SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=4, ignore_eos=True, logprobs=1))
        eng.add_request(f"r{i}", base[:n], params)
        eng.step()
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().kernel_compiles_in_service == 0, watch.kernels_in_service


@pytest.mark.gpu
def test_no_kernel_compiles_when_many_prompts_finish_in_one_step(tmp_path):
    """nano-vllm's workload in small: prompts of 100-400 tokens arriving together, so that eager prefill steps
    sample 1 to 40 rows at once (temperature and greedy). The sampling kernels pick their vocabulary chunks by
    row count; start-up's warm-up samples each plan (runner/warmup.py), so none compiles in service. A real
    vocabulary size, as the chunk plans depend on it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make_checkpoint(tmp_path, shape="tiny-vocab128k", family="llama", seed=5, dtype="bfloat16")
    eng = LLMEngine(EngineArgs(model=str(tmp_path), dtype="bfloat16", max_model_len=1024, num_kv_blocks=4096,
                               max_num_seqs=64, max_num_batched_tokens=8192))
    rng = random.Random(0)
    for i in range(64):
        params = SamplingParams(temperature=0.6 if i % 3 else 0.0, max_tokens=rng.randint(2, 40), ignore_eos=True)
        eng.add_request(f"r{i}", [rng.randrange(3, 10000) for _ in range(rng.randint(100, 400))], params)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().kernel_compiles_in_service == 0, eng.runner.compile_watch.kernels_in_service


def test_warm_up_samples_one_batch_per_chunk_plan():
    """Every row count up to the maximum shares its chunk plan with one of the row counts sampled at start-up,
    and no two of those share one (one batch per plan, smallest first)."""
    for vocab, sms in ((128256, 132), (151936, 132), (1000, 4)):
        reps = sampling_kernel.plan_representatives(256, vocab, sms)
        plans = [sampling_kernel.plan_chunks(r, vocab, sms) for r in reps]
        assert reps[0] == 1 and reps == sorted(reps) and len(set(plans)) == len(plans)
        assert all(sampling_kernel.plan_chunks(rows, vocab, sms) in plans for rows in range(1, 257))
        assert all(sampling_kernel.plan_chunks(r - 1, vocab, sms) != p for r, p in zip(reps[1:], plans[1:]))
    assert warm_up_sampling(1000, 8, torch.device("cpu")) == []  # CPU samples with torch: nothing to compile


def test_grammar_mask_warm_up_covers_each_row_count_class():
    """Triton specialises the bitmask kernel's row count as 1, a multiple of 16, or neither: one batch of each
    (those that fit max_num_seqs), and nothing on CPU, where xgrammar's kernel is C++."""
    def cls(rows):
        return "one" if rows == 1 else "x16" if rows % 16 == 0 else "other"

    assert {cls(r) for r in bitmask_row_counts(256)} == {"one", "x16", "other"}
    for max_rows in (1, 2, 8, 15, 16, 64):
        covered = {cls(r) for r in bitmask_row_counts(max_rows)}
        assert covered == {cls(r) for r in range(1, max_rows + 1)}
        assert max(bitmask_row_counts(max_rows)) <= max_rows
    assert warm_up_grammar_masks(1000, 8, torch.device("cpu")) == []


@pytest.mark.gpu
def test_no_kernel_compiles_when_constrained_or_penalized_rows_decode(tmp_path):
    """Grammar-constrained batches of 1, 3 and 16 rows (each row-count class of xgrammar's bitmask kernel) and
    rows with logits processors, after start-up: nothing compiles in service."""
    pytest.importorskip("xgrammar")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ostinato.structured_outputs import StructuredOutputs

    make_checkpoint(tmp_path, shape="tiny", family="qwen3", seed=4, dtype="bfloat16")
    eng = LLMEngine(EngineArgs(model=str(tmp_path), dtype="bfloat16", max_model_len=256, num_kv_blocks=128,
                               max_num_seqs=16))
    regex = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputs(regex="[0-9]{5}"))
    penalized = SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True, repetition_penalty=1.2,
                               logit_bias={5: 1.0}, min_p=0.05)
    for n, params in ((1, regex), (3, regex), (16, regex), (2, penalized)):
        eng.constrained.check(regex.structured_outputs)
        for i in range(n):
            eng.add_request(f"r{n}-{i}", [3, 4, 5 + i], params)
        while eng.has_unfinished():
            eng.step()
    assert eng.stats().kernel_compiles_in_service == 0, eng.runner.compile_watch.kernels_in_service


def test_a_capture_failure_names_the_kernels_compiled_inside_it(knobs):
    from ostinato.runner.graphs import describe_capture_failure

    watch = cw.CompileWatch()
    watch.install()
    knobs.jit_cache_hook(key="k1", repr="_warm[...]", fn=SimpleNamespace(__name__="_warm_kernel"))
    mark = watch.compiles
    knobs.jit_cache_hook(key="k2", repr="_late[...]", fn=SimpleNamespace(__name__="_late_kernel"))
    assert watch.kernels_since(mark) == ["_late_kernel"]
    error = RuntimeError("Triton Error [CUDA]: operation failed due to a previous error during capture")
    error.add_note(f"Triton compiled {', '.join(watch.kernels_since(mark))} inside the capture")
    msg = describe_capture_failure(128, error)
    assert "batch size 128" in msg and "_late_kernel inside the capture" in msg and "_warm_kernel" not in msg
    watch.uninstall()
