"""The split prefill (kernels/prefill_attention.py) against a float64 reference, its plan, and the
backend's choice between it and the one-pass prefill kernel.

CPU: the kernels under the Triton interpreter at small sizes (one kv head, short contexts, small key tiles so
that contexts of a few hundred tokens span many tiles and slices). GPU (`PYTHONPATH=src python3 -m pytest
-m gpu tests/kernels/test_triton_prefill_split.py`): the llama-3.1-8b attention shape at the chunk sizes and cached
contexts of a chunked 8k prefill, and a shapes-only launch replayed in a CUDA graph with new lengths.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_attention import (  # noqa: E402  (tests/ is on sys.path: pytest's rootdir-relative import)
    DEVICES, PagedCache, assert_close_to_reference, prefill_meta, reference_attention, requires_cuda,
)

from ostinato.attention import triton_paged  # noqa: E402
from ostinato.attention.base import AttentionMetadata  # noqa: E402
from ostinato.attention.torch_ref import TorchRefBackend  # noqa: E402
from ostinato.attention.triton_paged import TritonAttentionTuning, TritonPagedBackend  # noqa: E402
from ostinato.kernels.prefill_plan import PrefillSplitTuning, plan_prefill  # noqa: E402
from ostinato.errors import ConfigError  # noqa: E402


def split_backend(**tuning) -> TritonPagedBackend:
    return TritonPagedBackend(TritonAttentionTuning(prefill_split=PrefillSplitTuning(**tuning)))


def run_prefill(device, dtype, query_lens, prefixes, group, backend, num_kv_heads=1, head_dim=32,
                block_size=16, seed=0, meta_edit=None, padding_tokens=0):
    """Returns the backend's output for the real tokens and the reference. padding_tokens: rows of q past
    the last sequence's tokens (as a prefill captured at a fixed token count has), belonging to none."""
    context_lens = [p + q for p, q in zip(prefixes, query_lens)]
    cache = PagedCache(context_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    q = torch.randn(sum(query_lens) + padding_tokens, num_kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    meta = prefill_meta(cache, query_lens)
    if meta_edit is not None:
        meta = meta_edit(meta)
    scale = head_dim ** -0.5
    out = backend.prefill(q.to(device), cache.k_cache, cache.v_cache, meta, scale)
    assert out.shape == q.shape
    real = sum(query_lens)
    return out[:real], reference_attention(q[:real], cache, query_lens, scale)


def spy_on_split(monkeypatch) -> list:
    """Records each call of the split path from TritonPagedBackend.prefill."""
    calls = []
    real = triton_paged.paged_prefill_split

    def spy(*args, **kwargs):
        calls.append(args[-1])  # the plan
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_paged, "paged_prefill_split", spy)
    return calls


# Four sequences of different lengths in one call: a single new token after 150 cached (a decode-like row),
# 7 after 32 (a block boundary), 20 after 97 (off one; the causal diagonal inside a key tile) and a fresh
# 16-token prompt. Key tiles of 16, so slices cut these contexts into many whole tiles and a ragged last one.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,group,head_dim,splits", [
    (torch.float32, 1, 32, 3), (torch.float32, 4, 64, 5), (torch.bfloat16, 8, 32, 4), (torch.float16, 3, 40, 2)])
def test_split_prefill_matches_reference(device, dtype, group, head_dim, splits, monkeypatch):
    calls = spy_on_split(monkeypatch)
    out, ref = run_prefill(device, dtype, [1, 7, 20, 16], [150, 32, 97, 0], group,
                           split_backend(block_n=16, splits=splits), head_dim=head_dim, seed=splits)
    assert [plan.splits for plan in calls] == [splits]
    assert_close_to_reference(out, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_more_slices_than_key_tiles(device):
    # 16 slices of contexts holding 1, 2 and 3 key tiles: most slices are empty, and the last token's
    # slice holds only the diagonal tile, where some rows of its block see no key at all.
    out, ref = run_prefill(device, torch.float32, [3, 20, 9], [2, 0, 30], 2,
                           split_backend(block_n=16, splits=16), seed=7)
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_long_query_blocks_over_long_context(device):
    # Several query blocks of one sequence (block_m 16 at group 2: 8 queries a block) after a long prefix,
    # each block its own key range and split, with the sequence starting off a block boundary of the grid.
    out, ref = run_prefill(device, torch.float32, [5, 30], [3, 260], 2,
                           split_backend(block_m=16, block_n=32, splits=4), block_size=32, seed=9)
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_only_plan_needs_no_host_figures(device, monkeypatch):
    # A captured prefill gives no host figures and a stale max_query_len, and pads its tokens to the captured
    # count: the plan comes from num_tokens and the block-table width, and the real tokens' output is exact.
    def without_host_figures(meta: AttentionMetadata) -> AttentionMetadata:
        meta.query_lens = meta.context_lens_host = None
        meta.max_query_len = 1
        return meta

    calls = spy_on_split(monkeypatch)
    out, ref = run_prefill(device, torch.float32, [6, 19], [120, 44], 4,
                           split_backend(block_n=16, min_split_keys=16), seed=11, meta_edit=without_host_figures,
                           padding_tokens=7)
    assert len(calls) == 1 and calls[0].from_shapes_only and calls[0].splits > 1
    assert_close_to_reference(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_keeps_the_one_pass_kernel_when_programs_fill_the_gpu(device, monkeypatch):
    # A GPU of 4 SMs (16 programs wanted; the CPU's pretend figure, set here for the H200 too): 64 queries at
    # group 1 (BLOCK_Q 64) over one kv head are one program, so a long context splits; 4 kv heads x 4 blocks of
    # 16 are 16 programs: no split.
    from ostinato.kernels import prefill_attention as triton_prefill_split
    monkeypatch.setattr(triton_prefill_split, "num_sms", lambda device: 4)
    calls = spy_on_split(monkeypatch)
    out, ref = run_prefill(device, torch.float32, [64], [200], 1, split_backend(min_split_keys=64), seed=13)
    assert_close_to_reference(out, ref, torch.float32)
    assert len(calls) == 1 and calls[0].splits > 1
    out, ref = run_prefill(device, torch.float32, [64], [200], 1, split_backend(min_split_keys=64, block_m=16),
                           num_kv_heads=4, seed=14)
    assert_close_to_reference(out, ref, torch.float32)
    assert len(calls) == 1


def _meta(query_lens, context_lens, table_width=528, host_figures=True) -> AttentionMetadata:
    tables = torch.zeros(len(query_lens), table_width, dtype=torch.int32)  # only its shape is read
    return AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(0), block_tables=tables, context_lens=torch.zeros(0),
        query_lens=list(query_lens) if host_figures else None,
        context_lens_host=list(context_lens) if host_figures else None, max_query_len=max(query_lens))


@pytest.mark.parametrize("query_len,context_len,block_q,splits", [
    (96, 8096, 16, 12), (224, 8224, 16, 5), (480, 8447, 16, 3), (2016, 8447, 16, 1),  # a chunked 8k prompt
    (96, 96, 16, 1),  # a short context: nothing to split
    (1, 8001, 16, 31),  # one new token: slices of 256 keys (min_split_keys)
])
def test_plan_at_the_8b_shape_on_an_h200(query_len, context_len, block_q, splits):
    # 132 SMs x 4 programs wanted; 8 kv heads, group 4, block_m 64; the one-pass kernel when splits == 1.
    plan = plan_prefill(PrefillSplitTuning(), _meta([query_len], [context_len]), query_len, 4, 8, 16, 132)
    assert (plan.block_q, plan.splits, plan.from_shapes_only) == (block_q, splits, False)


def test_plan_splits_for_the_longest_scan_not_the_number_of_sequences():
    # The 96-token chunk beside 32 one-token rows at context 256 in one launch: 38 query blocks would
    # ask for 2 slices, but the rows add little work, so the chunk's scans are still cut 10 ways.
    meta = _meta([96] + [1] * 32, [8096] + [256] * 32)
    assert plan_prefill(PrefillSplitTuning(), meta, 128, 4, 8, 16, 132).splits == 10


def test_shapes_only_plan_depends_on_shapes_alone():
    # The same token count and table: the same plan whatever the lengths; bounds from num_tokens and the width.
    plans = {plan_prefill(PrefillSplitTuning(), _meta(q, c, host_figures=False), 96, 4, 8, 16, 132)
             for q, c in [([96], [8096]), ([96], [96]), ([1], [1])]}
    assert plans == {plan_prefill(PrefillSplitTuning(), _meta([96], [0], host_figures=False), 96, 4, 8, 16, 132)}
    (plan,) = plans
    # 6 query blocks x 8 kv heads scanning the table's 8448 keys: 768 keys a slice for 528 programs.
    assert plan.from_shapes_only and plan.max_query_len == 96 and plan.splits == 11


def test_bad_split_tuning_raises_a_config_error():
    with pytest.raises(ConfigError, match="block_n must be a power of two"):
        PrefillSplitTuning(block_n=48)
    with pytest.raises(ConfigError, match="min_split_keys"):
        PrefillSplitTuning(min_split_keys=0)
    with pytest.raises(ConfigError, match="splits"):
        PrefillSplitTuning(splits=0)


# ---- GPU: the llama-3.1-8b attention shape -------------------------------------------------------------------

LLAMA_8B = {"num_kv_heads": 8, "group": 4, "head_dim": 128}


def _gpu_case(query_len, cached, seed):
    cache = PagedCache([cached + query_len], LLAMA_8B["num_kv_heads"], LLAMA_8B["head_dim"], 16, torch.bfloat16,
                       "cuda", seed=seed, spare_blocks=1, extra_width=8)
    heads = LLAMA_8B["num_kv_heads"] * LLAMA_8B["group"]
    q = torch.randn(query_len, heads, LLAMA_8B["head_dim"], generator=torch.Generator().manual_seed(seed))
    return cache, q.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("query_len", [1, 96, 224, 2016])
@pytest.mark.parametrize("cached", [0, 4096, 8000])
@pytest.mark.parametrize("host_figures", [True, False], ids=["host-figures", "shapes-only"])
def test_gpu_8b_shape_matches_torch_reference(query_len, cached, host_figures):
    cache, q = _gpu_case(query_len, cached, seed=query_len + cached)
    meta = prefill_meta(cache, [query_len])
    if not host_figures:
        meta.query_lens = meta.context_lens_host = None
    scale = LLAMA_8B["head_dim"] ** -0.5
    out = TritonPagedBackend().prefill(q, cache.k_cache, cache.v_cache, meta, scale)
    ref_meta = prefill_meta(cache, [query_len])
    ref = TorchRefBackend().prefill(q, cache.k_cache, cache.v_cache, ref_meta, scale)
    assert_close_to_reference(out, ref.double().cpu(), torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_gpu_shapes_only_split_replays_in_a_cuda_graph_with_new_lengths():
    # Captured once at 96 tokens and 2 sequences; replayed with other lengths, prefixes and tables.
    backend, scale = TritonPagedBackend(), LLAMA_8B["head_dim"] ** -0.5
    cache = PagedCache([4000, 2000], LLAMA_8B["num_kv_heads"], LLAMA_8B["head_dim"], 16, torch.bfloat16, "cuda",
                       seed=21, spare_blocks=300, extra_width=300)
    static_q = torch.randn(96, 32, 128, device="cuda", dtype=torch.bfloat16)
    meta = prefill_meta(cache, [40, 56])
    meta.query_lens = meta.context_lens_host = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.prefill(static_q, cache.k_cache, cache.v_cache, meta, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.prefill(static_q, cache.k_cache, cache.v_cache, meta, scale)

    new = PagedCache([90 + 7000, 6], 8, 128, 16, torch.bfloat16, "cuda", seed=22,
                     spare_blocks=cache.k_cache.shape[0] - 1 - 445, extra_width=0)  # the same pool shape
    assert new.k_cache.shape == cache.k_cache.shape and new.block_tables.shape[1] <= meta.block_tables.shape[1]
    cache.k_cache.copy_(new.k_cache)
    cache.v_cache.copy_(new.v_cache)
    meta.block_tables.fill_(new.scratch_block)
    meta.block_tables[:, :new.block_tables.shape[1]].copy_(new.block_tables)
    meta.context_lens.copy_(new.context_lens)
    meta.query_start_loc.copy_(torch.tensor([0, 90, 96], dtype=torch.int32))
    static_q.copy_(torch.randn(96, 32, 128, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_attention(static_q, new, [90, 6], scale)
    assert_close_to_reference(static_out, ref, torch.bfloat16)


@pytest.mark.gpu
@requires_cuda
def test_gpu_split_prefill_compiles_once_whatever_the_counts_lengths_and_table_widths(monkeypatch):
    # After the warm-up's shape (16 new tokens after 496: runner/warmup.py), steps with other sequence counts
    # (1, 2, 3, 17), split counts, lengths and block-table widths (a multiple of 16 among them) compile nothing.
    from ostinato.runner.compile_watch import CompileWatch

    watch = CompileWatch()
    if not watch.install():
        pytest.skip("this Triton has no compile hook")
    calls = spy_on_split(monkeypatch)
    backend, shape = TritonPagedBackend(), dict(num_kv_heads=8, head_dim=128)
    try:
        run_prefill("cuda", torch.bfloat16, [16], [496], 4, backend, **shape)
        watch.seal()
        for seed, (query_lens, prefixes) in enumerate([
                ([1], [3000]), ([96, 5], [8000, 20]), ([7, 7, 7], [600, 1000, 2000]), ([16], [720]),
                ([40] * 17, [1000] * 17)]):
            out, ref = run_prefill("cuda", torch.bfloat16, query_lens, prefixes, 4, backend, seed=seed, **shape)
            assert_close_to_reference(out, ref, torch.bfloat16)
    finally:
        watch.uninstall()
    assert len(calls) == 6 and all(plan.splits > 1 for plan in calls), calls
    assert len({plan.splits for plan in calls}) > 2  # several split counts, one compiled kernel
    assert watch.compiles_in_service == 0, watch.kernels_in_service
