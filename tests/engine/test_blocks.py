"""BlockAllocator and BlockManager: free list, refcounts, block arithmetic, all-or-nothing growth."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ostinato.engine.blocks import BlockAllocator, BlockManager
from ostinato.engine.request import Sequence
from ostinato.sampling_params import SamplingParams


def make_seq(seq_id: int, num_prompt: int, num_output: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(range(num_prompt)), SamplingParams(),
                    output_token_ids=list(range(num_output)))


def test_blocks_module_does_not_import_torch():
    code = "import sys, ostinato.engine.blocks; assert 'torch' not in sys.modules, 'blocks imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- BlockAllocator ---------------------------------------------------------------------------------

def test_allocator_hands_out_each_block_once_then_none():
    alloc = BlockAllocator(3)
    got = [alloc.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    assert alloc.num_free == 0 and alloc.num_total == 3
    assert alloc.allocate() is None
    assert all(alloc.refcount(b) == 1 for b in got)


def test_allocator_empty_pool():
    alloc = BlockAllocator(0)
    assert alloc.allocate() is None and alloc.num_free == 0


def test_allocator_refcount_keeps_shared_block_until_last_free():
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.incref(b)
    assert alloc.refcount(b) == 2
    alloc.free(b)
    assert alloc.num_free == 1 and alloc.refcount(b) == 1
    alloc.free(b)
    assert alloc.num_free == 2 and alloc.refcount(b) == 0


def test_allocator_reuses_freed_blocks_last():
    alloc = BlockAllocator(3)
    first = alloc.allocate()
    alloc.free(first)
    # FIFO: the two never-used blocks come before the one just freed.
    assert [alloc.allocate() for _ in range(3)] == [1, 2, first]


@pytest.mark.parametrize("op", ["free", "incref"])
def test_allocator_rejects_ops_on_free_block(op):
    alloc = BlockAllocator(2)
    b = alloc.allocate()
    alloc.free(b)
    with pytest.raises(RuntimeError, match="double free|free"):
        getattr(alloc, op)(b)
    assert alloc.num_free == 2  # the free list was not corrupted


@pytest.mark.parametrize("block", [-1, 2, 99])
def test_allocator_rejects_out_of_range(block):
    alloc = BlockAllocator(2)
    alloc.allocate(), alloc.allocate()
    with pytest.raises(RuntimeError, match="out of range"):
        alloc.free(block)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "free"]), st.integers(0, 7)), max_size=60))
def test_allocator_matches_a_refcount_model(ops):
    """Random op sequences: the free count always equals the blocks with refcount 0 in a plain model."""
    alloc = BlockAllocator(5)
    model: dict[int, int] = {}
    for op, pick in ops:
        held = sorted(model)
        if op == "alloc":
            b = alloc.allocate()
            if len(model) == 5:
                assert b is None
            else:
                assert b is not None and b not in model
                model[b] = 1
        elif held:
            b = held[pick % len(held)]
            if op == "incref":
                alloc.incref(b)
                model[b] += 1
            else:
                alloc.free(b)
                model[b] -= 1
                if model[b] == 0:
                    del model[b]
        assert alloc.num_free == 5 - len(model)
        assert all(alloc.refcount(b) == model.get(b, 0) for b in range(5))


# ---- BlockManager -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,expected", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_is_ceil_division(num_tokens, expected):
    assert BlockManager(10, 4).blocks_needed(num_tokens) == expected


def test_allocate_covers_prompt_and_outputs():
    bm = BlockManager(10, 4)
    seq = make_seq(0, num_prompt=6, num_output=3)  # 9 tokens -> 3 blocks
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(0.3)


def test_can_allocate_counts_free_blocks_exactly():
    bm = BlockManager(3, 4)
    assert bm.can_allocate(make_seq(0, 12))  # exactly 3 blocks
    assert not bm.can_allocate(make_seq(1, 13))  # 4 blocks


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    seq = make_seq(0, 9)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_ensure_slots_grows_only_at_block_boundaries():
    bm = BlockManager(4, 4)
    seq = make_seq(0, 4)
    bm.allocate(seq)
    assert bm.ensure_slots(seq, 4) and len(seq.block_table) == 1  # already covered
    assert bm.ensure_slots(seq, 5) and len(seq.block_table) == 2  # position 4 starts block 2
    assert bm.ensure_slots(seq, 8) and len(seq.block_table) == 2
    assert bm.ensure_slots(seq, 16) and len(seq.block_table) == 4  # several at once
    assert bm.num_free_blocks == 0


def test_ensure_slots_is_all_or_nothing():
    bm = BlockManager(3, 2)
    seq = make_seq(0, 2)
    bm.allocate(seq)
    before = list(seq.block_table)
    assert not bm.ensure_slots(seq, 7)  # needs 4 blocks in total, only 3 exist
    assert seq.block_table == before and bm.num_free_blocks == 2


def test_free_returns_blocks_and_clears_table():
    bm = BlockManager(4, 2)
    a, b = make_seq(0, 3), make_seq(1, 4)
    bm.allocate(a), bm.allocate(b)
    assert bm.usage == 1.0
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 2
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    assert all(bm.allocator.refcount(blk) == 0 for blk in range(4))


def test_usage_of_empty_pool_is_zero():
    assert BlockManager(0, 16).usage == 0.0


def test_errors_name_the_operation_the_block_and_the_bad_value():
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 0, got -1$"):
        BlockAllocator(-1)
    with pytest.raises(ValueError, match=r"^block_size must be >= 1, got 0$"):
        BlockManager(4, 0)
    alloc = BlockAllocator(4)
    with pytest.raises(RuntimeError, match=r"^free of KV block 2, which is free \(double free\?\)$"):
        alloc.free(2)
    with pytest.raises(RuntimeError, match=r"^incref of KV block 3, which is free \(double free\?\)$"):
        alloc.incref(3)
    with pytest.raises(RuntimeError, match=r"^KV block 4 is out of range \[0, 4\)$"):
        alloc.free(4)
