"""The graph runner's policy on CPU: size planning, padding, guards, counters, fallback, self-check.

RecordingGraphBackend stands in for CUDA graphs; everything else is the code that runs on the GPU.
"""

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ostinato.config import GraphConfig
from ostinato.errors import ConfigError, CudaGraphCaptureError
from ostinato.runner.graphs import (
    CudaGraphRunner,
    GraphInputError,
    MemoryReading,
    RecordingGraphBackend,
    StaticInput,
    default_compare,
    pick_graph_size,
    plan_capture_sizes,
)
from ostinato.runner.memory import MiB

SCRATCH = 99  # the block padded rows point at
VOCAB = 16
SIZES = (1, 2, 4, 8)
HOST_SYNC = "CUDA error: operation not permitted when stream is capturing"


def static_inputs(max_batch=8, width=4):
    return [StaticInput("token_ids", (max_batch,), torch.int64, pad_value=0),
            StaticInput("block_tables", (max_batch, width), torch.int32, pad_value=SCRATCH)]


class Step:
    """A row-wise decode-like step that records what it was called with.

    logits[i] = one-hot of (token + sum of the row's non-scratch blocks) % VOCAB, plus token / 100.
    """

    def __init__(self, fail_at_size=None, error=None):
        self.seen = []  # (token_ids, block_tables) cloned at every call
        self.fail_at_size, self.error = fail_at_size, error

    def __call__(self, token_ids, block_tables):  # [n] int64, [n, W] int32 -> [n, VOCAB]
        if token_ids.shape[0] == self.fail_at_size:
            raise self.error
        self.seen.append((token_ids.clone(), block_tables.clone()))
        real = torch.where(block_tables == SCRATCH, 0, block_tables).sum(-1)
        return torch.nn.functional.one_hot((token_ids + real) % VOCAB, VOCAB).float() + token_ids[:, None] / 100

    @property
    def sizes(self):
        return [t.shape[0] for t, _ in self.seen]


def make_runner(step=None, sizes=SIZES, **kwargs):
    kwargs.setdefault("backend", RecordingGraphBackend())
    return CudaGraphRunner(step or Step(), static_inputs(), sizes, "cpu", **kwargs)


def batch(n, width=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"token_ids": torch.randint(0, 50, (n,), generator=g),
            "block_tables": torch.randint(0, 20, (n, width), generator=g, dtype=torch.int32)}


# ------------------------------------------------------------------------------------------- planning


@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, (1,)),
    (3, (1, 2, 3)),
    (8, (1, 2, 4, 8)),
    (100, (1, 2, 4, *range(8, 97, 8), 100)),
    (256, (1, 2, 4, *range(8, 257, 8))),
    (512, (1, 2, 4, *range(8, 257, 8))),
])
def test_default_capture_sizes(max_num_seqs, expected):
    assert plan_capture_sizes(max_num_seqs) == expected


def test_max_cuda_graph_size_caps_and_raises_the_default():
    assert plan_capture_sizes(512, max_cuda_graph_size=20) == (1, 2, 4, 8, 16, 20)
    assert plan_capture_sizes(512, max_cuda_graph_size=512)[-1] == 512
    assert plan_capture_sizes(8, max_cuda_graph_size=512) == (1, 2, 4, 8)


def test_explicit_sizes_sorted_deduplicated_and_filtered_with_a_reason(caplog):
    assert plan_capture_sizes(256, [8, 1, 4, 4]) == (1, 4, 8)
    with caplog.at_level(logging.WARNING, logger="ostinato.runner.graphs"):
        assert plan_capture_sizes(64, [1, 16, 600, 48], max_cuda_graph_size=32) == (1, 16)
    text = caplog.text
    assert "600 (above --max-num-seqs 64" in text and "48 (above --max-cuda-graph-size 32)" in text


def test_speculation_plans_graphs_for_every_verify_position_of_every_sequence(caplog):
    assert plan_capture_sizes(8, rows_per_sequence=5)[-1] == 40  # 8 sequences x (k = 4) + 1 rows
    with caplog.at_level(logging.WARNING, logger="ostinato.runner.graphs"):
        assert plan_capture_sizes(8, [1, 40, 48], rows_per_sequence=5) == (1, 40)
    assert "48 (above --max-num-seqs 8 x 5 verify positions a sequence" in caplog.text


@pytest.mark.parametrize("sizes, match", [([512], "none of --cuda-graph-sizes"), ([0, 4], "positive"),
                                          ([], "positive"), ([True], "positive")])
def test_unusable_explicit_sizes(sizes, match):
    with pytest.raises(ConfigError, match=match):
        plan_capture_sizes(256, sizes)


@pytest.mark.parametrize("n, size", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None), (1000, None)])
def test_pick_graph_size(n, size):
    assert pick_graph_size(n, SIZES) == size


@given(st.lists(st.integers(1, 300), min_size=1, unique=True), st.integers(1, 400))
def test_pick_graph_size_is_the_smallest_size_that_fits(sizes, n):
    sizes = sorted(sizes)
    fitting = [s for s in sizes if s >= n]
    assert pick_graph_size(n, sizes) == (fitting[0] if fitting else None)


def test_pick_graph_size_rejects_empty_batches():
    with pytest.raises(ValueError):
        pick_graph_size(0, SIZES)


# ------------------------------------------------------------------------------------ capture and run


def test_capture_goes_largest_first_with_warmup():
    step = Step()
    report = make_runner(step, warmup_iters=2).capture()
    # 2 warm-ups + the capture per size; the largest size runs once more to learn the output's shape
    assert step.sizes == [8] * 4 + [4] * 3 + [2] * 3 + [1] * 3
    assert report.sizes == SIZES and report.disabled_cause is None and report.seconds >= 0


def test_every_size_writes_its_output_into_one_shared_buffer():
    # Per-graph outputs would each stay alive (logits: size x vocab floats per graph); one buffer serves all.
    runner = make_runner(Step())
    runner.capture()
    ptrs = {runner.run(**batch(n)).data_ptr() for n in (1, 2, 3, 4, 8)}
    assert len(ptrs) == 1


def test_padding_rows_get_the_pad_value_and_output_is_the_static_view():
    step = Step()
    runner = make_runner(step)
    runner.capture()
    runner.run(**batch(4, seed=5))  # a full batch first: row 3 must not keep its entries
    inputs = batch(3)
    out = runner.run(**inputs)
    tokens, tables = step.seen[-1]  # what the replay computed on: the size-4 buffers
    assert tokens.shape[0] == 4 and tokens[3] == 0
    assert torch.equal(tables[:3], inputs["block_tables"]) and (tables[3] == SCRATCH).all()
    assert torch.equal(out, step(**inputs))  # rows [:n] are the eager result
    again = runner.run(**batch(3, seed=1))
    assert again.data_ptr() == out.data_ptr()  # the same static output, overwritten by the next replay
    assert torch.equal(out, again)


def test_counters_for_graph_eager_and_padded_steps():
    step = Step()
    runner = make_runner(step)
    runner.capture()
    for n in (1, 3, 5, 8, 9):
        runner.run(**batch(n))
    assert step.sizes[-1] == 9  # n=9 ran eagerly on the inputs as given
    s = runner.stats
    assert (s.graph_steps, s.eager_steps, s.oversize_steps) == (4, 1, 1)
    assert s.padded_rows == 1 + 3 and s.real_rows == 1 + 3 + 5 + 8
    assert s.replays_by_size == {1: 1, 4: 1, 8: 2}
    assert s.padding_fraction == pytest.approx(4 / 21)
    assert s.graphs_enabled and s.captured_sizes == SIZES


def test_wider_block_table_raises_before_any_replay():
    step = Step()
    runner = make_runner(step)
    runner.capture()
    calls = len(step.seen)
    for n in (3, 9):  # graph path and eager path follow the same contract
        with pytest.raises(GraphInputError, match=r"'block_tables' is 5 wide in dim 1 but was captured 4 wide"):
            runner.run(**batch(n, width=5))
    assert len(step.seen) == calls and runner.stats.graph_steps == 0 and runner.stats.eager_steps == 0
    assert issubclass(GraphInputError, ConfigError)


def test_narrower_block_table_is_padded_on_the_right_and_stale_entries_cleared():
    step = Step()
    runner = make_runner(step)
    runner.capture()
    runner.run(**batch(4, width=4, seed=3))  # fills all 4 columns of the size-4 graph's rows
    narrow = batch(3, width=2, seed=4)
    out = runner.run(**narrow)
    _, tables = step.seen[-1]
    assert torch.equal(tables[:3, :2], narrow["block_tables"]) and (tables[:, 2:] == SCRATCH).all()
    assert torch.equal(out, step(**narrow))


@pytest.mark.parametrize("change, match", [
    (lambda b: b.update(block_tables=b["block_tables"].long()), "torch.int64, its static buffer torch.int32"),
    (lambda b: b.update(token_ids=b["token_ids"].to("meta")), "is on meta"),
    (lambda b: b.pop("token_ids"), r"missing \['token_ids'\]"),
    (lambda b: b.update(extra=b["token_ids"]), r"unknown \['extra'\]"),
    (lambda b: b.update(token_ids=b["token_ids"][:2]), "disagree on the batch size"),
    (lambda b: b.update(block_tables=b["block_tables"][:, 0]), "has 1 dims"),
])
def test_input_guards(change, match):
    runner = make_runner()
    runner.capture()
    inputs = batch(3)
    change(inputs)
    with pytest.raises(GraphInputError, match=match):
        runner.run(**inputs)


def test_run_before_capture_and_capture_twice():
    runner = make_runner()
    with pytest.raises(RuntimeError, match="capture"):
        runner.run(**batch(1))
    runner.capture()
    with pytest.raises(RuntimeError, match="already"):
        runner.capture()


def test_configuration_errors():
    with pytest.raises(ConfigError, match="CUDA device"):
        CudaGraphRunner(Step(), static_inputs(), SIZES, "cpu")  # the default backend needs CUDA
    with pytest.raises(ConfigError, match="dim 0 >= 16"):
        make_runner(sizes=(1, 16))
    with pytest.raises(ConfigError, match="fallback"):
        make_runner(fallback="ignore")
    with pytest.raises(ConfigError, match="no CUDA-graph capture sizes"):
        make_runner(sizes=())
    with pytest.raises(ConfigError, match="distinct names"):
        CudaGraphRunner(Step(), static_inputs() * 2, SIZES, "cpu", backend=RecordingGraphBackend())
    with pytest.raises(ConfigError, match="identifier"):
        StaticInput("block-tables", (8, 4), torch.int32)


def test_enforce_eager_counts_every_step():
    step = Step()
    runner = CudaGraphRunner.from_config(step, static_inputs(), GraphConfig(True, (), "error", False), "cpu")
    report = runner.capture()
    assert report.sizes == () and "enforce_eager" in report.disabled_cause and step.seen == []
    runner.run(**batch(2))
    runner.run(**batch(9))
    s = runner.stats
    assert (s.graph_steps, s.eager_steps, s.oversize_steps) == (0, 2, 0) and not s.graphs_enabled
    assert runner.check(batch) == 0.0


def test_capture_report_measures_memory_per_size():
    class GrowingBackend(RecordingGraphBackend):
        """Each capture of size s keeps s MiB; the allocator reserves the same."""
        used = 0

        def capture(self, fn, pool):
            replay, out = super().capture(fn, pool)
            self.used += out.shape[0] * MiB
            return replay, out

        def memory_in_use(self):
            return MemoryReading(self.used, self.used)

    report = make_runner(backend=GrowingBackend(), progress=True).capture()
    assert list(report.bytes_by_size.items()) == [(8, 8 * MiB), (4, 4 * MiB), (2, 2 * MiB), (1, 1 * MiB)]
    assert report.total_bytes == report.pool_bytes == 15 * MiB
    assert "15.0 MiB" in report.summary()


# ------------------------------------------------------------------------------------ fallback policy


def test_capture_failure_raises_with_size_cause_and_hint():
    runner = make_runner(Step(fail_at_size=4, error=RuntimeError(HOST_SYNC + "\nCUDA kernel errors ...")))
    with pytest.raises(CudaGraphCaptureError) as e:
        runner.capture()
    msg = str(e.value)
    assert "batch size 4" in msg and HOST_SYNC in msg and "kernel errors" not in msg
    assert ".item()" in msg and "--cuda-graph-fallback eager" in msg
    assert isinstance(e.value.__cause__, RuntimeError)
    assert runner.captured_sizes == ()  # the size-8 graph captured before is dropped too
    runner.run(**batch(2))  # a caller that carries on anyway gets counted eager steps
    assert runner.stats.eager_steps == 1 and runner.stats.oversize_steps == 0


def test_capture_failure_with_eager_fallback_warns_once_and_counts_eager(caplog):
    step = Step(fail_at_size=4, error=RuntimeError(HOST_SYNC))
    runner = make_runner(step, fallback="eager")
    with caplog.at_level(logging.WARNING, logger="ostinato.runner.graphs"):
        report = runner.capture()
        for n in (1, 3, 8):
            step.fail_at_size = None
            out = runner.run(**batch(n))
            assert out.shape == (n, VOCAB) and step.sizes[-1] == n  # eager, on the inputs as given
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "batch size 4" in warnings[0].getMessage()
    assert report.sizes == () and "batch size 4" in report.disabled_cause
    s = runner.stats
    assert (s.graph_steps, s.eager_steps, s.oversize_steps) == (0, 3, 0)
    assert s.disabled_cause == report.disabled_cause and s.captured_sizes == ()


def test_out_of_memory_during_capture_names_the_memory_flags():
    runner = make_runner(Step(fail_at_size=8, error=torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB")))
    with pytest.raises(CudaGraphCaptureError, match="out of GPU memory .* batch size 8") as e:
        runner.capture()
    assert "--gpu-memory-utilization" in str(e.value) and "--max-cuda-graph-size" in str(e.value)


def test_a_step_that_does_not_return_a_batch_tensor_fails_capture():
    runner = make_runner(lambda token_ids, block_tables: (token_ids,))
    with pytest.raises(CudaGraphCaptureError, match="returned tuple for batch size 8"):
        runner.capture()
    runner = make_runner(lambda token_ids, block_tables: token_ids.sum(0, keepdim=True))
    with pytest.raises(CudaGraphCaptureError, match=r"returned \(1,\) for batch size 8"):
        runner.capture()


def test_no_eager_fallback_when_the_device_is_unusable():
    class PoisonedBackend(RecordingGraphBackend):
        def recover(self):
            return "CUDA is unusable after the failed capture (illegal memory access); restart the process"

    runner = make_runner(Step(fail_at_size=8, error=RuntimeError("boom")), fallback="eager",
                         backend=PoisonedBackend())
    with pytest.raises(CudaGraphCaptureError, match="batch size 8.*restart the process"):
        runner.capture()


# ----------------------------------------------------------------------------------------- self-check


def test_check_passes_and_leaves_counters_alone():
    runner = make_runner()
    runner.capture()
    seconds = runner.check(lambda n: batch(n, width=3, seed=n))
    assert seconds >= 0 and runner.graphs_enabled
    s = runner.stats
    assert (s.graph_steps, s.eager_steps, s.padded_rows, s.replays_by_size) == (0, 0, 0, {})


class Drifting(Step):
    """A step whose result changes with every call: replay and eager can never agree."""

    def __call__(self, token_ids, block_tables):
        return super().__call__(token_ids, block_tables) * len(self.seen)


def test_check_mismatch_raises_by_default():
    runner = make_runner(Drifting())
    runner.capture()
    with pytest.raises(CudaGraphCaptureError, match="self-check failed for batch size 1: max abs diff"):
        runner.check(batch)
    assert runner.captured_sizes == () and not runner.graphs_enabled


def test_check_mismatch_with_eager_fallback(caplog):
    runner = make_runner(fallback="eager")
    runner.capture()
    with caplog.at_level(logging.WARNING, logger="ostinato.runner.graphs"):
        runner.check(batch, compare=lambda g, e: "rows differ" if g.shape[0] == 4 else None)
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1
    assert "batch size 4" in runner.disabled_cause and "rows differ" in runner.disabled_cause
    runner.run(**batch(2))
    assert runner.stats.eager_steps == 1 and runner.stats.graph_steps == 0


def test_check_rejects_inputs_of_the_wrong_size():
    runner = make_runner()
    runner.capture()
    with pytest.raises(GraphInputError, match=r"make_inputs\(1\) must return inputs with 1 rows"):
        runner.check(lambda n: batch(n + 1))


def test_default_compare():
    x = torch.randn(4, 32)
    assert default_compare(x, x.clone()) is None
    assert default_compare(x, x + 5e-4) is None  # within fp32 tolerance
    assert "max abs diff" in default_compare(x + 0.1, x)
    assert "max abs diff" in default_compare(x.clone().fill_(float("nan")), x)
    assert "shape" in default_compare(x[:2], x)
    b = x.bfloat16()
    assert default_compare(b, (x * 1.01).bfloat16()) is None  # a few bf16 ulps
    # allclose holds (each value moved by <= 1.5e-3), but the winner flipped by more than a tie.
    eager, graph = torch.tensor([[1.0, 0.9975]]), torch.tensor([[0.9985, 0.9990]])
    assert "argmax" in default_compare(graph, eager)
    # A near-tie in eager may flip.
    assert default_compare(torch.tensor([[1.0, 1.0002]]), torch.tensor([[1.0, 0.9999]])) is None
    ids = torch.tensor([3, 1, 2])
    assert default_compare(ids, ids.clone()) is None
    assert "rows [1]" in default_compare(torch.tensor([3, 0, 2]), ids)


def test_capture_keeps_the_garbage_collector_off_and_restores_it():
    # A collection inside a capture can finalize an earlier engine's objects, whose CUDA calls (an event query, a
    # pinned free) would invalidate the capture: the CUDA backend captures inside _gc_paused.
    import gc

    from ostinato.runner.graph_backends import _gc_paused

    assert gc.isenabled()
    with _gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with _gc_paused():
            raise RuntimeError("a failed capture")
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_paused():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
