"""Paged KV-cache bookkeeping: which cache blocks are free, which blocks each sequence owns, and which full
blocks hold a known prefix (prefix caching).

Pure Python (no torch import): the runner owns the KV pool tensors; this module only hands out block
indices in [0, num_blocks). The runner's extra scratch block (index num_blocks) is never handed out.

Arithmetic used throughout: a block holds `block_size` consecutive token positions, so a sequence whose
cache must cover positions [0, n) needs ceil(n / block_size) blocks, and token position p lives in block
`block_table[p // block_size]` at offset `p % block_size`.

Prefix caching. A *full* block whose K/V has been computed is keyed by a chained hash: the hash of the
previous block's key, its own block_size token ids, and (for the first block) a salt naming everything else
that changes K/V (the model and its dtype; the engine passes it in, opaque), and the request's own
`cache_salt` if it has one. Two sequences whose first k
blocks hold the same tokens therefore find the same k keys, and the second reads the first's blocks instead
of recomputing them. A cached block is shared read-only: a sequence writes only positions past its cached
prefix, and the prefix never covers the prompt's last token (its logits are needed, so it is always
computed), so a shared block is never written. A cached block whose last holder frees it keeps its content
and its key; it is evicted (its key dropped, the block reused) only when the pool needs a block and no
never-cached free block is left, least recently used first.

Isolation. Whether a prefix is cached shows in a request's `num_cached_tokens` and in its time to first token,
so a client could learn whether another sent a given prompt. A salt in the first block's key changes every
key after it: requests with different salts never share (or see) each other's blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from ostinato.engine.request import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids, salt: bytes = b"") -> BlockHash:
    """The key of a full block: chained on its parent's key (None for a sequence's first block, which takes
    the salt instead). blake2b over the token ids' int64 bytes: a collision would hand one request another's
    K/V, so a cryptographic hash, not Python's hash(). About a microsecond per block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else b"\x00salt:" + salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockAllocator:
    """The pool: a refcount per block, free blocks, and the prefix cache's key <-> block maps.

    A block is in exactly one of three states:
    - held: refcount >= 1 (one per sequence whose block table lists it);
    - free: refcount 0, no key; in `_free`, reused first-freed-first;
    - evictable: refcount 0 with a key (cached content nobody holds); in `_evictable`, least recently used
      first. allocate() takes one only when `_free` is empty, dropping its key (an eviction).
    num_free counts free + evictable: both can be handed out. Misuse (double free, an index out of range,
    sharing a free block) is an engine bug and raises RuntimeError, even under `python -O`: a silently
    corrupted pool would mix two requests' KV.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._num_total = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._refcounts = [0] * num_blocks
        self._key_of: dict[int, BlockHash] = {}  # cached block -> its key (held or evictable)
        self._block_of: dict[BlockHash, int] = {}  # key -> cached block
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_cached(self) -> int:
        """Blocks that hold a key (held or evictable)."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def allocate(self) -> int | None:
        """Take a block (refcount 1, no key): a free one, else the least recently used evictable one; None
        when every block is held."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.num_evictions += 1
        else:
            return None
        self._refcounts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a holder: to a held block, or to an evictable (cached) one, which leaves the LRU order."""
        self._check_index(block)
        if self._refcounts[block] == 0:
            if block not in self._evictable:
                raise RuntimeError(f"incref of KV block {block}, which is free (double free?)")
            del self._evictable[block]
        self._refcounts[block] += 1

    def free(self, block: int) -> None:
        """Drop one holder. With none left the block becomes evictable if it holds a key (most recently
        used), else free."""
        self._check_held(block, "free")
        self._refcounts[block] -= 1
        if self._refcounts[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        """Number of holders of `block` (0 when free or evictable)."""
        self._check_index(block)
        return self._refcounts[block]

    # ---- the prefix cache ---------------------------------------------------------------------------
    def cache(self, block: int, key: BlockHash) -> None:
        """Record that held `block` now holds the full block `key`. A key already cached in another block is
        left there (this block stays uncached and is freed plainly): one block per key."""
        self._check_held(block, "cache")
        if key in self._block_of:
            return
        old = self._key_of.get(block)
        if old is not None:
            raise RuntimeError(f"KV block {block} is cached already under another key")
        self._key_of[block] = key
        self._block_of[key] = block

    def lookup(self, key: BlockHash) -> int | None:
        """The cached block holding `key`, held or evictable; None if none is."""
        return self._block_of.get(key)

    def key_of(self, block: int) -> BlockHash | None:
        return self._key_of.get(block)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def _check_index(self, block: int) -> None:
        # Explicit check: a negative index would silently wrap around in a Python list.
        if not 0 <= block < self._num_total:
            raise RuntimeError(f"KV block {block} is out of range [0, {self._num_total})")

    def _check_held(self, block: int, op: str) -> None:
        self._check_index(block)
        if self._refcounts[block] <= 0:
            raise RuntimeError(f"{op} of KV block {block}, which is free (double free?)")


class BlockManager:
    """Maps sequences to KV blocks: admission (with the cached prefix), growth chunk by chunk and during
    decode, release at the end.

    A sequence's `block_table` lists its blocks in position order; it always covers the positions the
    runner will read or write for it (see the module docstring for the arithmetic). Its first
    `seq.num_cached_blocks` blocks carry keys (hits found at admission, and full blocks it computed since,
    once committed); they may be shared with other sequences.

    Prefix-cache statistics count tokens, as vLLM's metrics do: `prefix_queries` the tokens of every
    sequence admitted (a recompute after preemption counts again), `prefix_hits` those found cached.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, salt: str = ""):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._salt = salt.encode()
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out: free ones and cached ones nobody holds."""
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, in [0, 1] (0 for an empty pool); cached blocks nobody holds
        count as free."""
        total = self.allocator.num_total
        return (total - self.allocator.num_free) / total if total else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that cover positions [0, num_tokens): ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- admission ---------------------------------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks holding seq's leading full blocks, in order; never one that holds its last token
        (that token is always computed: its logits are needed). Empty with prefix caching off. No side
        effects: admit() takes them."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        n = (seq.num_tokens - 1) // self.block_size
        keys = self._keys(seq, n)
        for i in range(n):
            block = self.allocator.lookup(keys[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Whether a sequence holding no blocks can take `hits` and new blocks up to num_tokens positions.
        Evictable hits leave the free count when taken, so they count against it."""
        new = self.blocks_needed(num_tokens) - len(hits)
        taken = sum(1 for b in hits if self.allocator.is_evictable(b))
        return new + taken <= self.allocator.num_free

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give a sequence that holds no blocks its cached prefix `hits` (from cached_prefix(), unchanged
        since) and new blocks covering positions [0, num_tokens). Callers check can_admit() first."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks {seq.block_table}"
        assert self.can_admit(hits, num_tokens), f"admit(seq {seq.seq_id}) without room: check can_admit()"
        for block in hits:
            self.allocator.incref(block)
        seq.block_table.extend(hits)
        seq.num_cached_blocks = len(hits)
        grown = self.ensure_slots(seq, num_tokens)
        assert grown
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(hits) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the free blocks cover all seq.num_tokens, without the cache (a sequence holding none)."""
        return self.can_admit([], seq.num_tokens)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of a sequence's tokens, no cache lookup. Running out is an engine bug."""
        if not self.can_allocate(seq):
            raise RuntimeError(
                f"allocate(seq {seq.seq_id}) needs {self.blocks_needed(seq.num_tokens)} blocks but only "
                f"{self.allocator.num_free} are free; check can_allocate() first")
        self.admit(seq, [], seq.num_tokens)

    # ---- growth --------------------------------------------------------------------------------------
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

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's blocks past those covering positions [0, num_tokens), last first: the blocks a verify
        step took for proposed tokens that were rejected. They were never keyed (a key needs known tokens)."""
        keep = self.blocks_needed(num_tokens)
        if keep < seq.num_cached_blocks:
            raise RuntimeError(f"trim(seq {seq.seq_id}) to {keep} blocks would drop keyed blocks "
                               f"({seq.num_cached_blocks})")
        while len(seq.block_table) > keep:
            self.allocator.free(seq.block_table.pop())

    def room(self, seq: Sequence) -> int:
        """How many positions seq's cache could cover with every free block added (chunk sizing)."""
        return (len(seq.block_table) + self.allocator.num_free) * self.block_size

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Key seq's full blocks whose K/V is computed (or launched: steps run in order) up to position
        num_computed, and whose tokens are known (a token in flight is not), so later sequences can share
        them. O(new full blocks)."""
        if not self.enable_prefix_caching:
            return
        n = min(num_computed, seq.num_tokens) // self.block_size
        if n <= seq.num_cached_blocks:
            return
        keys = self._keys(seq, n)
        for i in range(seq.num_cached_blocks, n):
            self.allocator.cache(seq.block_table[i], keys[i])
        seq.num_cached_blocks = n

    def free(self, seq: Sequence) -> None:
        """Commit seq's computed full blocks, then release every block and clear its block_table.

        Tail blocks are freed first: they become the least recently used, so a sequence's first blocks (the
        part other requests most likely share) are the last to be evicted.
        """
        self.commit(seq, seq.num_computed_tokens)
        if self.enable_prefix_caching:
            # A block left unkeyed because another block held its key then (two sequences computed the same
            # prefix) takes the key now if that one has been evicted since.
            keys, alloc = seq.block_hashes, self.allocator
            for i in range(seq.num_cached_blocks):
                if alloc.key_of(seq.block_table[i]) is None and alloc.lookup(keys[i]) is None:
                    alloc.cache(seq.block_table[i], keys[i])
        for block in reversed(seq.block_table):
            self.allocator.free(block)
        seq.block_table.clear()
        seq.num_cached_blocks = 0

    def _keys(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """seq's first num_blocks block keys, computed once per block and kept on the sequence (its tokens
        only ever grow, so a key never changes, across preemption too)."""
        keys, bs = seq.block_hashes, self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            tokens = seq.token_ids_range(i * bs, (i + 1) * bs)
            keys.append(hash_block(keys[-1], tokens) if keys else hash_block(None, tokens, self._salt_of(seq)))
        return keys

    def _salt_of(self, seq: Sequence) -> bytes:
        """The first block's salt: the engine's, and the request's cache_salt after it when it has one."""
        request_salt = seq.sampling_params.cache_salt
        return self._salt if request_salt is None else self._salt + b"\x00request:" + request_salt.encode()
