"""The block manager's prefix cache, against an independent model: which blocks hold which prefix, who holds
them, which are evictable and in what order. A hypothesis state machine drives admissions (with the cached
prefix), chunked growth, commits and frees on a small pool, where eviction is constant."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ostinato.engine.blocks import BlockManager, hash_block
from ostinato.engine.request import Sequence
from ostinato.sampling_params import SamplingParams

BS = 2


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), SamplingParams())


class PrefixCacheMachine(RuleBasedStateMachine):
    """The model keys a cached block by the whole token prefix it ends (a tuple), not by a hash: the manager's
    chained hashes must behave exactly like that."""

    @initialize(num_blocks=st.integers(1, 8))
    def setup(self, num_blocks):
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=True, salt="m")
        self.total = num_blocks
        self.live: list[Sequence] = []
        self.next_id = 0
        self.holders: dict[int, int] = {}  # block -> sequences holding it
        self.cache: dict[tuple, int] = {}  # token prefix of a full computed block -> its block
        self.lru: list[int] = []  # cached blocks nobody holds, least recently released first
        self.queries = self.hits = 0
        self.committed: dict[int, int] = {}  # seq id -> leading blocks committed

    def _key_block(self, block):
        return next((k for k, b in self.cache.items() if b == block), None)

    def _take(self, block):
        """The model's view of allocate() having returned `block`."""
        assert self.holders.get(block, 0) == 0, f"allocate() handed out block {block}, which is held"
        if block in self.lru:  # an eviction: only of the least recently used, and only with no plain free block
            uncached_free = self.total - len(self.holders) - len(self.lru)
            assert uncached_free == 0, "evicted a cached block while a never-cached free block was left"
            assert block == self.lru[0], "evicted a cached block that is not the least recently used"
            self.lru.remove(block)
            del self.cache[self._key_block(block)]
        self.holders[block] = 1

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9), chunk=st.integers(1, 9))
    def admit(self, tokens, chunk):
        seq = seq_of(self.next_id, tokens)
        self.next_id += 1
        hits = self.bm.cached_prefix(seq)
        expect = []
        for i in range((len(tokens) - 1) // BS):  # never the block of the last token
            b = self.cache.get(tuple(tokens[:(i + 1) * BS]))
            if b is None:
                break
            expect.append(b)
        assert hits == expect
        end = len(hits) * BS + min(chunk, len(tokens) - len(hits) * BS)
        needed = -(-end // BS) - len(hits) + sum(1 for b in hits if b in self.lru)
        assert self.bm.can_admit(hits, end) == (needed <= self.total - len(self.holders))
        if not self.bm.can_admit(hits, end):
            return
        self.bm.admit(seq, hits, end)
        for b in hits:
            if b in self.lru:
                self.lru.remove(b)
            self.holders[b] = self.holders.get(b, 0) + 1
        for b in seq.block_table[len(hits):]:
            self._take(b)
        self.queries += len(tokens)
        self.hits += len(hits) * BS
        seq.num_computed_tokens = end
        self.committed[seq.seq_id] = len(hits)
        self._commit(seq, end)
        self.live.append(seq)

    def _commit(self, seq, end, since=None):
        """Blocks computed since the last commit take their prefix unless another block holds it (at a free:
        every computed block of the sequence)."""
        self.bm.commit(seq, end)
        done = self.committed.get(seq.seq_id, 0) if since is None else since
        for i in range(done, end // BS):
            if self._key_block(seq.block_table[i]) is None:
                self.cache.setdefault(tuple(seq.prompt_token_ids[:(i + 1) * BS]), seq.block_table[i])
        self.committed[seq.seq_id] = max(done, end // BS)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 4))
    def grow(self, data, k):
        """The next chunk (or a decode) of a live sequence, when blocks allow."""
        seq = data.draw(st.sampled_from(self.live))
        end = min(seq.num_computed_tokens + k, seq.num_tokens)
        held = len(seq.block_table)
        if not self.bm.ensure_slots(seq, end):
            assert -(-end // BS) - held > self.total - len(self.holders)
            return
        for b in seq.block_table[held:]:
            self._take(b)
        seq.num_computed_tokens = end
        self._commit(seq, end)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        table = list(seq.block_table)
        self._commit(seq, seq.num_computed_tokens, since=0)
        self.bm.free(seq)
        assert seq.block_table == []
        for b in reversed(table):  # tail first: the first blocks are the most recently released
            self.holders[b] -= 1
            if not self.holders[b]:
                del self.holders[b]
                if self._key_block(b) is not None:
                    self.lru.append(b)

    @invariant()
    def accounting_is_exact(self):
        if not hasattr(self, "bm"):
            return
        alloc = self.bm.allocator
        for b in range(self.total):  # no block free while held; refcount = holders
            assert alloc.refcount(b) == self.holders.get(b, 0)
        assert self.bm.num_free_blocks == self.total - len(self.holders)
        assert alloc.num_cached == len(self.cache) and alloc.num_evictable == len(self.lru)
        assert {alloc.key_of(b) is not None for b in self.lru} <= {True}
        for prefix, b in self.cache.items():  # each cached prefix is found at its block, by its chained key
            key = None
            for i in range(len(prefix) // BS):
                key = hash_block(key, prefix[i * BS:(i + 1) * BS], b"m")
            assert alloc.lookup(key) == b
        assert (self.bm.prefix_queries, self.bm.prefix_hits) == (self.queries, self.hits)
        held = [b for s in self.live for b in s.block_table]
        assert sorted(set(held)) == sorted(self.holders)


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_salt_and_parent_change_the_key():
    assert hash_block(None, [1, 2], b"a") != hash_block(None, [1, 2], b"b")  # another model or dtype
    first = hash_block(None, [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])  # chained on the prefix
    assert hash_block(first, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = seq_of(0, list(range(8)))  # two full blocks
    bm.admit(a, [], 8)
    a.num_computed_tokens = 8
    bm.commit(a, 8)
    assert bm.allocator.num_cached == 2
    b = seq_of(1, list(range(8)))
    assert bm.cached_prefix(b) == a.block_table[:1]  # the block of token 7 is computed again, not shared
    c = seq_of(2, list(range(9)))
    assert bm.cached_prefix(c) == a.block_table[:2]


def test_cached_blocks_are_evicted_only_when_the_pool_needs_them_lru_first():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    seqs = []
    for i in range(2):
        s = seq_of(i, [i, i, 9])  # one full block each, and a partial one
        bm.admit(s, [], 3)
        s.num_computed_tokens = 3
        seqs.append(s)
    first_blocks = [s.block_table[0] for s in seqs]
    for s in seqs:
        bm.free(s)  # seq 0's first block is released before seq 1's
    assert bm.allocator.num_cached == 2 and bm.num_free_blocks == 4
    t = seq_of(5, [7, 7, 7])
    bm.admit(t, [], 3)  # the two never-cached blocks: nothing evicted
    assert bm.allocator.num_evictions == 0 and bm.allocator.num_cached == 2
    u = seq_of(6, [8, 8, 8])
    bm.admit(u, [], 1)  # one more block: the least recently released cached one goes
    assert bm.allocator.num_evictions == 1 and u.block_table == [first_blocks[0]]
    assert bm.cached_prefix(seq_of(7, [1, 1, 1])) == [first_blocks[1]]  # the other is still there
    assert bm.cached_prefix(seq_of(8, [0, 0, 0])) == []


def test_prefix_caching_off_never_keys_a_block():
    bm = BlockManager(4, 2)
    s = seq_of(0, [1, 1, 1, 1, 1])
    bm.admit(s, [], 5)
    s.num_computed_tokens = 5
    bm.free(s)
    assert bm.allocator.num_cached == 0 and bm.cached_prefix(seq_of(1, [1, 1, 1, 1, 1])) == []
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)


@pytest.mark.parametrize("op", ["free", "cache"])
def test_ops_on_a_free_block_are_refused(op):
    bm = BlockManager(2, 2, enable_prefix_caching=True)
    with pytest.raises(RuntimeError, match="which is free"):
        bm.allocator.free(0) if op == "free" else bm.allocator.cache(0, b"k")


def _computed(bm: BlockManager, seq: Sequence) -> None:
    bm.admit(seq, bm.cached_prefix(seq), seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq, seq.num_tokens)


@pytest.mark.parametrize("first, second", [(None, "b"), ("a", None), ("a", "b")])
def test_a_request_with_another_cache_salt_finds_no_cached_block(first, second):
    bm = BlockManager(16, 4, enable_prefix_caching=True, salt="m")
    prompt = list(range(13))  # three full blocks before the last token's
    _computed(bm, Sequence(0, "r0", prompt, SamplingParams(cache_salt=first)))
    other = Sequence(1, "r1", prompt, SamplingParams(cache_salt=second))
    assert bm.cached_prefix(other) == []
    _computed(bm, other)
    assert bm.prefix_hits == 0
    again = Sequence(2, "r2", prompt, SamplingParams(cache_salt=second))
    assert len(bm.cached_prefix(again)) == 3  # the same salt still shares


def test_cache_salt_must_be_a_non_empty_string():
    from ostinato.errors import InvalidRequestError

    for bad in ("", 3):
        with pytest.raises(InvalidRequestError, match="cache_salt") as e:
            SamplingParams(cache_salt=bad)
        assert e.value.param == "cache_salt"
