"""Decode attention replayed in CUDA graphs: bit-identical from one replay to the next, equal to eager at the
same size, with padded rows, moving block tables and other launches sharing the arrival counters.

Why: the single-launch decode (kernels/decode_attention.py) merges its partials in the last program of a
(sequence, kv head) to arrive, counted on arrival counters that every layer, graph and eager call of a
backend share, and at decode it writes the new token's K/V itself. A hole in that protocol (a merge that
reads a partial before it is visible, a counter not back at 0, a slot written and read in one launch, a pad
row reading what another pad row writes) shows up on a GPU as output that changes from one replay to the
next, or a replay that differs from eager on the same inputs. The interpreter runs programs one after
another, so on CPU these tests check the bookkeeping (counters reset, tables that move, pad rows) and on the
GPU the races too: `PYTHONPATH=src python3 -m pytest -m gpu tests/runner/test_decode_replay.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from test_triton_attention import (  # noqa: E402
    DEVICES, RopeCase, _reshuffle, assert_close_to_reference, backend_with, reference_attention,
)
from ostinato.kernels.decode_plan import choose_num_splits  # noqa: E402
from ostinato.kernels.device import num_sms  # noqa: E402
from ostinato.attention.triton_paged import TritonPagedBackend  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REPLAYS = int(os.environ.get("OSTINATO_DECODE_REPLAYS", "200"))  # a stress run sets 2000


def decode_call(case: RopeCase, backend: TritonPagedBackend, rope: bool):
    """The decode a layer runs on `case`'s fixed tensors: decode_with_rope (q/k norm, RoPE, K/V write and
    attention in one kernel), or the plain decode of the q heads (K/V already in the cache)."""
    if rope:
        return lambda: case.run(backend)
    q = case.heads[:, :case.num_heads]  # a strided view, as the decoder hands it over
    return lambda: backend.decode(q, case.cache.k_cache, case.cache.v_cache, case.meta, case.scale)


def real_blocks(case: RopeCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches without the scratch block (where the pad rows' racing writes land)."""
    return case.cache.k_cache[:case.cache.scratch_block], case.cache.v_cache[:case.cache.scratch_block]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rope", [True, False], ids=["with-rope", "plain"])
@pytest.mark.parametrize("batch,pad_rows,context", [(1, 0, 512), (5, 3, 512), (13, 3, 2048), (2, 2, 8192)])
def test_replays_are_bit_identical_to_eager(rope, batch, pad_rows, context):
    """Qwen3-0.6B's attention shape (16 q heads, 8 kv heads, head_dim 128, bf16) at split counts > 1 (the merge
    runs in the last-arriving program), pad rows as the runner pads a graph: one captured launch replayed
    REPLAYS times on the same inputs gives eager's output to the bit every time, leaves every real slot of
    the cache as eager left it, and ends with every arrival counter at 0."""
    backend = TritonPagedBackend()
    lens = [max(2, context - 37 * i) for i in range(batch)]
    case = RopeCase("cuda", torch.bfloat16, lens, 2, 8, 128, True, seed=60, filler=0.0, pad_rows=pad_rows)
    rows, width = batch + pad_rows, case.cache.block_tables.shape[1] * 16
    splits = choose_num_splits(backend.tuning.decode, rows, 8, width, num_sms(torch.device("cuda")))
    assert splits > 1, splits  # a split launch: its last-arriving slice merges
    call = decode_call(case, backend, rope)
    if rope:
        ref, _ = case.expected((case.cache.k_cache, case.cache.v_cache))
    else:
        ref = reference_attention(case.heads[:, :case.num_heads], case.cache, [1] * rows, case.scale)

    eager = call().clone()  # compiles outside the capture; with rope, writes the new K/V (idempotent)
    assert_close_to_reference(eager[:batch], ref[:batch], torch.bfloat16)
    caches_after_eager = tuple(c.clone() for c in real_blocks(case))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    outs = torch.empty((REPLAYS, *static_out.shape), dtype=static_out.dtype, device="cuda")
    for i in range(REPLAYS):
        graph.replay()
        outs[i].copy_(static_out)
    torch.cuda.synchronize()
    differs = (outs != eager).flatten(2).any(2)  # [replay, row]
    bad = differs.any(1)
    assert not bad.any(), f"{int(bad.sum())} of {REPLAYS} replays differ from eager, first replay " \
                          f"{int(bad.nonzero()[0])} in rows {differs[bad][0].nonzero().flatten().tolist()}"
    for after, want in zip(real_blocks(case), caches_after_eager):
        assert torch.equal(after, want)
    assert not backend.split_counters.get(static_out.device, 0).any()


def _rotate(lens: list[int], step: int) -> list[int]:
    """Step `step`'s lengths: the first lengths rotated and shortened, so contexts cross slice and block
    boundaries and every sequence still fits the blocks it was given."""
    k = step % len(lens)
    return [max(1, n - 7 * step) for n in lens[k:] + lens[:k]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rope", [True, False], ids=["with-rope", "plain"])
def test_graph_follows_moving_tables_and_equals_eager(device, rope):
    """Decode steps over one pool whose block tables, lengths, K/V and qkv change in place between steps (as
    the runner's static buffers do), with two pad rows: each replay matches the float64 reference on the
    real rows and eager on the same inputs to the bit, and an eager decode of another batch size on the same
    backend (another split count and counter range) runs between replays. On CPU the 'replay' is a second
    call of the same backend on the same tensors (no graphs there), 2 steps at a small shape."""
    gpu = device == "cuda"
    if gpu:
        dtype, group, kv_heads, head_dim, steps = torch.bfloat16, 2, 8, 128, 10
        lens, other_lens = [700, 513, 64, 1, 300, 129], [900, 17, 2]
        backend = TritonPagedBackend()
    else:
        dtype, group, kv_heads, head_dim, steps = torch.float32, 2, 2, 32, 2
        lens, other_lens = [90, 33, 17], [40, 3]
        backend = backend_with(splits=4, block_n=16)
    case = RopeCase(device, dtype, lens, group, kv_heads, head_dim, True, seed=70, filler=0.0, pad_rows=2)
    other = RopeCase(device, dtype, other_lens, group, kv_heads, head_dim, True, seed=71, filler=0.0, pad_rows=0)
    call, other_call = decode_call(case, backend, rope), decode_call(other, backend, rope)
    n = len(lens)
    call()  # compiles outside the capture
    if gpu:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = call()

        def replay() -> torch.Tensor:
            graph.replay()
            return static_out.clone()
    else:
        replay = call
    gen = torch.Generator().manual_seed(72)
    for step in range(steps):
        _reshuffle(case.cache, _rotate(lens, step + 1) + [1, 1], gen)
        case.pad_tables()
        case.refresh()
        case.heads.copy_(torch.randn(case.heads.shape, generator=gen).to(dtype))
        if rope:
            ref, expected = case.expected(tuple(c.clone() for c in (case.cache.k_cache, case.cache.v_cache)))
        else:
            ref = reference_attention(case.heads[:, :case.num_heads], case.cache, [1] * (n + 2), case.scale)
        out = replay()
        assert_close_to_reference(out[:n], ref[:n], dtype)
        if rope:  # the new tokens' K/V at their slots (the scratch block: pad rows race there, unread)
            tol = 1e-6 if dtype == torch.float32 else 1e-2
            for actual, want in zip(real_blocks(case), expected):
                torch.testing.assert_close(actual.float(), want[:case.cache.scratch_block].float(), atol=tol,
                                           rtol=tol)
        other_out = other_call()  # another shape on the same counters, between two steps
        assert torch.equal(out, call()), f"step {step}: the replay differs from eager on the same inputs"
        assert torch.isfinite(other_out).all()
        assert not backend.split_counters.get(out.device, 0).any(), f"step {step}: a counter was not reset"


@pytest.mark.gpu
@requires_cuda
def test_graph_engine_decodes_the_same_twice(tmp_path):
    """Whole steps are deterministic: two engines (bf16, CUDA graphs, the split decode merging in its last
    program) on the same schedule (25 sequences, a graph of 32 with pad rows, sequences leaving and joining so
    tables move and freed blocks are reused) give the same tokens and the same top-5 logprobs to the bit. A
    race anywhere in the step (the merge, the K/V write, pad rows sharing the scratch slot) drifts them apart;
    test_gpu_e2e's graph-vs-eager check cannot tell that from the eager batch's other GEMM shapes."""
    from test_gpu_e2e import run_schedule

    from ostinato.config import EngineArgs
    from ostinato.engine.engine import LLMEngine
    from ostinato.tools.checkpoint import make_checkpoint

    make_checkpoint(tmp_path, shape="tiny", family="qwen3", seed=3, dtype="bfloat16")
    common = dict(model=str(tmp_path), dtype="bfloat16", max_model_len=256, num_kv_blocks=512, max_num_seqs=64)
    first, second = (run_schedule(LLMEngine(EngineArgs(**common)), 25) for _ in range(2))
    assert first.keys() == second.keys() and len(first) >= 25
    for key, a in first.items():
        b = second[key]
        assert a.token_ids == b.token_ids, f"{key}: tokens differ between two identical runs"
        assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs], f"{key}: logprobs differ"
