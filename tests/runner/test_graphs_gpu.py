"""CUDA-graph capture and replay on a real GPU (run: PYTHONPATH=src python3 -m pytest -m gpu tests/...)."""

import logging

import pytest
import torch

from ostinato.errors import CudaGraphCaptureError
from ostinato.runner.graphs import CudaGraphRunner, GraphInputError, StaticInput

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HIDDEN, VOCAB = 64, 128
BLOCK_SIZE, WIDTH, NUM_BLOCKS = 4, 4, 32  # a block table holds WIDTH blocks of BLOCK_SIZE tokens
SCRATCH = NUM_BLOCKS  # the extra cache block padded rows read
SIZES = (1, 2, 4, 8)
TOL = dict(rtol=1e-4, atol=1e-4)


class PagedMLP:
    """A small decode-like step: the token's embedding plus the mean of its sequence's cached vectors
    (pages picked by the block table, masked by the context length), then an MLP to logits."""

    def __init__(self, device):
        torch.manual_seed(0)
        self.emb = torch.randn(VOCAB, HIDDEN).to(device)
        self.cache = torch.randn(NUM_BLOCKS + 1, BLOCK_SIZE, HIDDEN).to(device)  # [blocks + scratch, B, H]
        self.w1 = (torch.randn(HIDDEN, 4 * HIDDEN) / HIDDEN**0.5).to(device)
        self.w2 = (torch.randn(4 * HIDDEN, VOCAB) / (4 * HIDDEN) ** 0.5).to(device)

    def __call__(self, token_ids, block_tables, context_lens):
        # token_ids [n] int64, block_tables [n, W] int32, context_lens [n] int32 -> logits [n, VOCAB]
        n, width = block_tables.shape
        pages = self.cache[block_tables.long()].reshape(n, width * BLOCK_SIZE, HIDDEN)  # [n, W*B, H]
        positions = torch.arange(width * BLOCK_SIZE, device=pages.device)
        mask = (positions[None, :] < context_lens[:, None]).to(pages.dtype)  # [n, W*B]
        ctx = (pages * mask[..., None]).sum(1) / context_lens.clamp(min=1)[:, None].to(pages.dtype)  # [n, H]
        hidden = torch.relu((self.emb[token_ids] + ctx) @ self.w1)  # [n, 4H]
        return hidden @ self.w2


def static_inputs():
    return [StaticInput("token_ids", (8,), torch.int64, pad_value=0),
            StaticInput("block_tables", (8, WIDTH), torch.int32, pad_value=SCRATCH),
            StaticInput("context_lens", (8,), torch.int32, pad_value=0)]


def make_inputs(n, width=WIDTH, seed=0):
    """n sequences over shuffled, distinct blocks; context fits in `width` blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=g)[: n * width].reshape(n, width).to(torch.int32)
    inputs = {"token_ids": torch.randint(0, VOCAB, (n,), generator=g),
              "block_tables": blocks,
              "context_lens": torch.randint(1, width * BLOCK_SIZE + 1, (n,), generator=g, dtype=torch.int32)}
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.fixture
def step():
    return PagedMLP("cuda")


@pytest.fixture
def runner(step):
    r = CudaGraphRunner(step, static_inputs(), SIZES, "cuda")
    report = r.capture()
    assert report.sizes == SIZES and list(report.bytes_by_size) == [8, 4, 2, 1]
    assert report.total_bytes > 0 and report.pool_bytes > 0  # the graph pool is measured
    return r


def test_replay_matches_eager_with_padding(runner, step):
    full_batch_outputs = []
    for i, n in enumerate((1, 3, 5, 8, 8)):
        inputs = make_inputs(n, seed=i)  # new values in the static buffers before every replay
        out = runner.run(**inputs)
        assert out.shape == (n, VOCAB)
        torch.testing.assert_close(out, step(**inputs), **TOL)
        if n == 8:
            full_batch_outputs.append(out.data_ptr())
    assert full_batch_outputs[0] == full_batch_outputs[1]  # one static output tensor: the graph path ran
    s = runner.stats
    assert s.replays_by_size == {1: 1, 4: 1, 8: 3} and s.padded_rows == 1 + 3 and s.eager_steps == 0


def test_replay_reads_tensors_changed_in_place(runner, step):
    inputs = make_inputs(3)
    before = runner.run(**inputs).clone()
    step.cache.mul_(-2.0)  # the KV pool changes in place between replays: no value is baked into the graph
    after = runner.run(**inputs)
    torch.testing.assert_close(after, step(**inputs), **TOL)
    assert not torch.allclose(before, after)


def test_block_table_width_guards(runner, step):
    with pytest.raises(GraphInputError, match="captured 4 wide"):
        runner.run(**make_inputs(2, width=WIDTH + 1))
    narrow = make_inputs(3, width=2)
    torch.testing.assert_close(runner.run(**narrow), step(**narrow), **TOL)
    assert runner.stats.graph_steps == 1


def test_self_check_and_eager_above_the_largest_size(runner, step):
    assert runner.check(lambda n: make_inputs(n, seed=100 + n)) >= 0
    assert runner.graphs_enabled
    big = {k: torch.cat([v, v[:1]]) for k, v in make_inputs(8).items()}  # 9 rows: above the largest size
    torch.testing.assert_close(runner.run(**big), step(**big), **TOL)
    assert runner.stats.oversize_steps == 1 and runner.stats.eager_steps == 1


def syncing_step(step):
    def fn(token_ids, block_tables, context_lens):
        if context_lens.max().item() > 0:  # a host sync: not capturable
            return step(token_ids, block_tables, context_lens)
        return step(token_ids, block_tables, context_lens) * 0
    return fn


def test_host_sync_fails_capture_with_the_size(step):
    r = CudaGraphRunner(syncing_step(step), static_inputs(), SIZES, "cuda")
    with pytest.raises(CudaGraphCaptureError, match="batch size 8") as e:
        r.capture()
    assert "synchronizes with the host" in str(e.value)
    # CUDA is usable afterwards: a good step captures and replays.
    good = CudaGraphRunner(step, static_inputs(), SIZES, "cuda")
    good.capture()
    inputs = make_inputs(3)
    torch.testing.assert_close(good.run(**inputs), step(**inputs), **TOL)


def test_host_sync_with_eager_fallback_runs_eager(step, caplog):
    r = CudaGraphRunner(syncing_step(step), static_inputs(), SIZES, "cuda", fallback="eager")
    with caplog.at_level(logging.WARNING, logger="ostinato.runner.graphs"):
        report = r.capture()
    assert report.sizes == () and "batch size 8" in report.disabled_cause
    assert sum(rec.levelno == logging.WARNING for rec in caplog.records) == 1
    for n in (1, 3, 8):
        inputs = make_inputs(n, seed=n)
        torch.testing.assert_close(r.run(**inputs), step(**inputs), **TOL)
    torch.cuda.synchronize()
    s = r.stats
    assert (s.graph_steps, s.eager_steps) == (0, 3) and not s.graphs_enabled
