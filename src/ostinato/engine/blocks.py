"""Paged KV-cache bookkeeping: which cache blocks are free and which blocks each sequence owns.

Pure Python (no torch import): the runner owns the KV pool tensors; this module only hands out block
indices in [0, num_blocks). The runner's extra scratch block (index num_blocks) is never handed out.

Arithmetic used throughout: a block holds `block_size` consecutive token positions, so a sequence whose
cache must cover positions [0, n) needs ceil(n / block_size) blocks, and token position p lives in block
`block_table[p // block_size]` at offset `p % block_size`.
"""

from __future__ import annotations

from collections import deque

from .request import Sequence


class BlockAllocator:
    """A free list of block indices with a reference count per block.

    Refcounts exist so that prefix caching can later share one block between sequences: a block returns
    to the free list only when its last holder frees it. Freed blocks go to the back of the free list and
    are reused last (FIFO), so a future prefix cache keeps recently freed contents as long as possible.
    Misuse (double free, incref of a free block, an index out of range) is an engine bug and raises
    RuntimeError, even under `python -O`: a silently corrupted free list would mix two requests' KV.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._num_total

    def allocate(self) -> int | None:
        """Take a free block (refcount 1), or None when every block is in use."""
        if not self._free:
            return None
        block = self._free.popleft()
        self._refcounts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a holder to an allocated block (prefix sharing)."""
        self._check_held(block, "incref")
        self._refcounts[block] += 1

    def free(self, block: int) -> None:
        """Drop one holder; the block returns to the free list when none is left."""
        self._check_held(block, "free")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        """Number of holders of `block` (0 when free)."""
        self._check_index(block)
        return self._refcounts[block]

    def _check_index(self, block: int) -> None:
        # Explicit check: a negative index would silently wrap around in a Python list.
        if not 0 <= block < self._num_total:
            raise RuntimeError(f"KV block {block} is out of range [0, {self._num_total})")

    def _check_held(self, block: int, op: str) -> None:
        self._check_index(block)
        if self._refcounts[block] <= 0:
            raise RuntimeError(f"{op} of KV block {block}, which is free (double free?)")


class BlockManager:
    """Maps sequences to KV blocks: allocation at admission, growth during decode, release at the end.

    A sequence's `block_table` lists its blocks in position order; it always covers the positions the
    runner will read or write for it (see the module docstring for the arithmetic). Sequences hold blocks
    exclusively today (refcount 1); the allocator's refcounts are the hook for prefix caching.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (0 for an empty pool)."""
        total = self.allocator.num_total
        return (total - self.allocator.num_free) / total if total else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that cover positions [0, num_tokens): ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the free blocks cover all seq.num_tokens (prompt + outputs, for a recompute)."""
        return self.blocks_needed(seq.num_tokens) <= self.allocator.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence that holds no blocks enough of them for all its tokens.

        Callers check can_allocate() first; running out here is an engine bug (RuntimeError), and
        nothing is allocated in that case.
        """
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks {seq.block_table}"
        if not self.ensure_slots(seq, seq.num_tokens):
            raise RuntimeError(
                f"allocate(seq {seq.seq_id}) needs {self.blocks_needed(seq.num_tokens)} blocks but only "
                f"{self.allocator.num_free} are free; check can_allocate() first"
            )

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq.block_table to cover positions [0, num_tokens).

        Needs blocks_needed(num_tokens) - len(block_table) new blocks (none when it already covers them:
        a decode step needs a new block only when position num_tokens - 1 starts one, i.e. once every
        block_size tokens). All-or-nothing: returns False and changes nothing when too few are free.
        """
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing <= 0:
            return True
        if missing > self.allocator.num_free:
            return False
        for _ in range(missing):
            block = self.allocator.allocate()
            assert block is not None  # checked num_free above
            seq.block_table.append(block)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` and clear its block_table.

        Tail blocks are freed first so that, with FIFO reuse, a sequence's first blocks (the part a
        future prefix cache is most likely to share) are the last to be overwritten.
        """
        for block in reversed(seq.block_table):
            self.allocator.free(block)
        seq.block_table.clear()
