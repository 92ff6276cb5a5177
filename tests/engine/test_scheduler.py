"""Scheduler: one unit test per rule, then a hypothesis simulation that checks every invariant per step."""

import os
import random
import subprocess
import sys
from collections import deque

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from ostinato.config import CacheConfig, SchedulerConfig
from ostinato.contract import DecodeRows
from ostinato.engine.request import Sequence, SequenceStatus
from ostinato.engine.scheduler import Scheduler
from ostinato.errors import ConfigError, InvalidRequestError, OutOfKVCacheError, QueueFullError
from ostinato.sampling_params import SamplingParams


# The simulation's example count. Mutation testing (docs/TESTING.md) lowers it: each mutant runs this test.
SIMULATION_EXAMPLES = int(os.environ.get("OSTINATO_SIMULATION_EXAMPLES", "200"))


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=None, max_model_len=32,
                   max_queued_requests=None) -> Scheduler:
    sched_cfg = SchedulerConfig(max_num_seqs, max_num_batched_tokens or max(max_model_len, max_num_seqs), max_model_len,
                                max_queued_requests)
    return Scheduler(sched_cfg, CacheConfig(block_size=block_size, num_blocks=num_blocks))


def make_seq(seq_id: int, prompt_len: int, **params) -> Sequence:
    return Sequence(seq_id, f"req-{seq_id}", [100 + seq_id] * prompt_len, SamplingParams(**params))


class RunnerRows:
    """The runner's side of the contract in pure Python: its decode rows and their block tables, fed
    only by SchedulerOutputs (left, joined, new_blocks), as runner/decode_batch.py keeps them."""

    def __init__(self):
        self.rows = DecodeRows()
        self.tables: dict[int, list[int]] = {}

    def apply(self, out) -> list[int]:
        """Apply one step's changes; returns the seq ids that get a token: the decode rows in row order,
        then the chunks that end their prompt (which join the rows)."""
        for seq_id in out.left:
            self.rows.remove(seq_id)
            self.tables.pop(seq_id, None)
        for seq_id, block in out.new_blocks:
            self.tables[seq_id].append(block)
        assert out.num_decode == len(self.rows), "every row decodes"
        assert out.kind == {(True, True): "mixed", (True, False): "decode", (False, True): "prefill",
                            (False, False): "idle"}[(bool(out.num_decode), bool(out.seqs))]
        computed = list(self.rows.seq_ids)
        for s in out.seqs:
            if s.samples:
                self.rows.add(s.seq_id)
                self.tables[s.seq_id] = list(s.block_table)
                computed.append(s.seq_id)
        return computed


_COMPUTED: dict[int, tuple] = {}  # id(out) -> (out, the seq ids it computed)


def rows_of(sched: Scheduler) -> RunnerRows:
    return sched.__dict__.setdefault("_test_rows", RunnerRows())


def step(sched: Scheduler, token: int = 7):
    """Schedule one step and feed back one sampled token per computed sequence."""
    out = sched.schedule()
    computed = rows_of(sched).apply(out)
    sched.update(computed, [token] * len(computed))
    _COMPUTED[id(out)] = (out, computed)
    return out


def ids(out) -> list[int]:
    return _COMPUTED[id(out)][1]


def test_scheduler_module_does_not_import_torch():
    code = ("import sys, ostinato.engine.scheduler, ostinato.engine.blocks; "
            "assert 'torch' not in sys.modules, 'the scheduler imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- start-up and add() -----------------------------------------------------------------------------

def test_init_refuses_cache_smaller_than_max_model_len():
    with pytest.raises(OutOfKVCacheError, match="lower --max-model-len to 28 or less"):
        make_scheduler(num_blocks=7, block_size=4, max_model_len=32)
    make_scheduler(num_blocks=8, block_size=4, max_model_len=32)  # exactly one full sequence fits


def test_init_refuses_empty_cache_with_a_useful_message():
    with pytest.raises(OutOfKVCacheError, match="give the KV cache more memory") as e:
        make_scheduler(num_blocks=0)
    assert "to 0 or less" not in str(e.value)


def test_init_refuses_token_budget_below_max_num_seqs():
    # Every decode row counts one token; a budget below the seats could not hold a full decode step.
    with pytest.raises(ConfigError, match="raise --max-num-batched-tokens or lower --max-num-seqs"):
        make_scheduler(max_num_seqs=8, max_num_batched_tokens=7)
    make_scheduler(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=32)  # chunks of what is left


@pytest.mark.parametrize("prompt_len,match", [(0, "empty"), (32, "shorten the prompt below 32"),
                                              (40, "--max-model-len")])
def test_add_rejects_prompts_that_can_never_run(prompt_len, match):
    sched = make_scheduler(max_model_len=32)
    with pytest.raises(InvalidRequestError, match=match) as e:
        sched.add(make_seq(0, prompt_len))
    assert e.value.param == "prompt"
    assert sched.num_waiting == 0 and not sched.has_unfinished()


@pytest.mark.parametrize("blocks, computed", [([3], 0), ([], 2)])
def test_add_refuses_a_sequence_that_claims_cached_tokens(blocks, computed):
    seq = make_seq(0, 4)
    seq.block_table, seq.num_computed_tokens = blocks, computed
    with pytest.raises(AssertionError, match="a new sequence holds no KV"):
        make_scheduler().add(seq)


def test_add_raises_queue_full_at_the_limit_and_accepts_again_once_drained():
    sched = make_scheduler(max_queued_requests=2)
    sched.add(make_seq(0, 3))
    sched.add(make_seq(1, 3))
    with pytest.raises(QueueFullError, match="--max-queued-requests 2"):
        sched.add(make_seq(2, 3))
    assert sched.num_waiting == 2 and sched.get(2) is None
    step(sched)  # both admitted: the waiting queue is empty again
    sched.add(make_seq(2, 3))
    assert sched.num_waiting == 1


# ---- prefill ------------------------------------------------------------------------------------------

def test_prefill_step_feeds_whole_prompt_from_position_zero():
    sched = make_scheduler(block_size=4)
    seq = make_seq(0, 6, temperature=0.5)
    sched.add(seq)
    out = sched.schedule()
    assert out.kind == "prefill" and out.preempted_seq_ids == ()
    (s,) = out.seqs
    assert s.token_ids == tuple(seq.prompt_token_ids) and s.start_pos == 0 and s.context_len == 6
    assert s.block_table == tuple(seq.block_table) and len(s.block_table) == 2
    assert s.sampling_params is seq.sampling_params and s.num_generated == 0
    assert seq.status is SequenceStatus.RUNNING and sched.num_running == 1 and sched.num_waiting == 0
    sched.update([0], [42])
    assert seq.output_token_ids == [42] and seq.num_computed_tokens == 6
    seq.block_table.append(-1)
    assert s.block_table != tuple(seq.block_table)  # the output holds a copy


def test_admission_limited_by_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(i, 2))
    assert ids(step(sched)) == [0, 1]
    out = step(sched)  # running is full: decode, the third keeps waiting
    assert out.kind == "decode" and ids(out) == [0, 1] and sched.num_waiting == 1
    sched.finish(0, SequenceStatus.FINISHED_STOPPED)
    out = step(sched)  # 1 keeps decoding while 2 is admitted beside it
    assert out.kind == "mixed" and ids(out) == [1, 2] and [s.seq_id for s in out.seqs] == [2]


def test_admission_limited_by_batched_tokens_chunks_the_prompt_that_overflows():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=8)
    for i, n in enumerate([5, 2, 3]):
        sched.add(make_seq(i, n))
    out = step(sched)
    assert [(s.seq_id, len(s.token_ids), s.samples) for s in out.seqs] == [(0, 5, True), (1, 2, True), (2, 1, False)]
    assert ids(out) == [0, 1] and out.num_batched_tokens == 8  # 2 got the last token of the budget, no sample
    out = step(sched)  # 0 and 1 decode; 2's last 2 tokens are prefilled beside them
    assert out.kind == "mixed" and out.num_decode == 2 and ids(out) == [0, 1, 2]
    (s,) = out.seqs
    assert s.seq_id == 2 and s.start_pos == 1 and s.token_ids == (102, 102) and s.samples


def test_admission_limited_by_free_blocks():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    sched.add(make_seq(0, 9))  # 3 blocks
    sched.add(make_seq(1, 5))  # 2 blocks: only 1 left
    assert ids(step(sched)) == [0]
    assert step(sched).kind == "decode" and sched.num_waiting == 1
    sched.finish(0, SequenceStatus.FINISHED_LENGTH)
    assert sched.block_manager.num_free_blocks == 4
    assert ids(step(sched)) == [1]


def test_fcfs_no_head_of_line_skipping():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    sched.add(make_seq(0, 9))
    step(sched)
    sched.add(make_seq(1, 8))  # needs 2 blocks, 1 free
    sched.add(make_seq(2, 1))  # would fit, but arrived later
    out = step(sched)
    assert out.kind == "decode" and ids(out) == [0]
    assert sched.get(2).status is SequenceStatus.WAITING


def test_idle_when_nothing_to_do():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.kind == "idle" and out.is_empty and not sched.has_unfinished()


# ---- decode and preemption -----------------------------------------------------------------------------

def test_decode_reports_only_the_blocks_added_at_boundaries():
    sched = make_scheduler(block_size=4)
    seq = make_seq(0, 3)
    sched.add(seq)
    step(sched, token=11)  # prefill: 3 prompt tokens cached, 4 tokens in all
    out = step(sched, token=12)
    assert out.kind == "decode" and out.num_decode == 1 and out.new_blocks == () and out.left == ()
    assert len(seq.block_table) == 1  # positions 0..3 fit one block
    out = step(sched, token=13)  # position 4 opens block 2: the only change reported
    assert len(seq.block_table) == 2 and out.new_blocks == ((0, seq.block_table[1]),)
    assert seq.output_token_ids == [11, 12, 13] and seq.num_computed_tokens == 5
    assert rows_of(sched).tables[0] == seq.block_table


def test_rows_that_leave_are_reported_once_at_the_next_step():
    sched = make_scheduler(max_num_seqs=4)
    for i in range(3):
        sched.add(make_seq(i, 3))
    step(sched)
    sched.finish(1, SequenceStatus.FINISHED_STOPPED)
    out = step(sched)
    assert out.kind == "decode" and out.left == (1,) and out.num_decode == 2 and ids(out) == [0, 2]
    assert sched.abort(0) and not sched.abort(0)
    out = step(sched)
    assert out.left == (0,) and ids(out) == [2]
    assert step(sched).left == ()


def test_preempts_most_recent_and_requeues_it_at_the_front():
    # 4 blocks of 2 tokens. A and B take 2 blocks each; C waits (max_num_seqs=2).
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2, max_model_len=8)
    a, b, c = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    for seq in (a, b, c):
        sched.add(seq)
    assert ids(step(sched, 1)) == [0, 1]
    assert ids(step(sched, 2)) == [0, 1]  # positions 3: still in block 2
    out = step(sched, 3)  # A's position 4 needs a third block: B (admitted last) is preempted
    assert out.kind == "decode" and ids(out) == [0] and out.preempted_seq_ids == (1,)
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.output_token_ids == [1, 2]  # generated tokens are kept for the recompute
    assert step(sched, 4).kind == "decode"  # B (5 tokens, 3 blocks) does not fit into 1 free block
    sched.finish(0, SequenceStatus.FINISHED_STOPPED)
    out = step(sched, 5)
    # B resumes ahead of C, which arrived before B's preemption; both do not fit (3 + 2 blocks > 4).
    assert out.kind == "prefill" and ids(out) == [1] and sched.get(2).status is SequenceStatus.WAITING
    (s,) = out.seqs
    assert s.token_ids == tuple(b.prompt_token_ids) + (1, 2) and s.start_pos == 0 and s.num_generated == 2
    assert b.output_token_ids == [1, 2, 5] and b.num_computed_tokens == 5


def test_preemption_order_newest_first_and_front_order_kept():
    # 6 blocks of 2: A, B 2 blocks each, C, D 1 each. A and B both need a third block.
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_seqs=4, max_model_len=12)
    for i, n in enumerate([4, 4, 1, 1]):
        sched.add(make_seq(i, n))
    assert ids(step(sched)) == [0, 1, 2, 3]
    out = step(sched)
    assert ids(out) == [0, 1] and out.preempted_seq_ids == (3, 2) and sched.num_preemptions == 2
    sched.finish(0, SequenceStatus.FINISHED_STOPPED)
    sched.finish(1, SequenceStatus.FINISHED_STOPPED)
    assert ids(step(sched)) == [2, 3]  # original admission order restored at the front


def test_first_preemption_warns_once_with_the_remedy(caplog):
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_seqs=4, max_model_len=12)
    for i, n in enumerate([4, 4, 1, 1]):
        sched.add(make_seq(i, n))
    step(sched)
    with caplog.at_level("DEBUG", logger="ostinato.engine.scheduler"):
        step(sched)  # preempts 3, then 2
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1  # a full cache is worth one warning, not one per preemption
    assert warnings[0].getMessage().startswith("KV cache full: preempted sequence 3 (it will be recomputed)")
    assert "--num-kv-blocks" in warnings[0].getMessage()
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG"]
    assert debug == ["preempted sequence 2 (2 preemptions in total)"]


def test_a_sequence_left_running_at_max_model_len_is_an_engine_bug_named_as_such():
    sched = make_scheduler(max_model_len=9)  # blocks of 4: the 9th token needs a third block
    sched.add(make_seq(0, 8))
    step(sched)  # 8 + 1 = 9 tokens: the engine had to finish it (FINISHED_LENGTH) and did not
    with pytest.raises(AssertionError, match="seq 0 has 9 tokens, max_model_len is 9: the engine must finish"):
        sched.schedule()


def test_sequence_that_is_the_newest_preempts_itself():
    # 3 blocks of 2: A takes 2, B takes 1. B's position 2 needs a new block and B is the newest.
    sched = make_scheduler(num_blocks=3, block_size=2, max_model_len=6)
    a, b = make_seq(0, 3), make_seq(1, 2)
    sched.add(a), sched.add(b)
    step(sched)
    out = step(sched)
    assert ids(out) == [0] and out.preempted_seq_ids == (1,)
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert sched.block_manager.num_free_blocks == 1


def test_update_skips_sequence_aborted_during_its_step():
    sched = make_scheduler()
    sched.add(make_seq(0, 3)), sched.add(make_seq(1, 3))
    sched.schedule()
    assert sched.abort(0)
    sched.update([0, 1], [5, 6])
    assert sched.get(0) is None and sched.get(1).output_token_ids == [6]


# ---- abort / finish ---------------------------------------------------------------------------------

def test_abort_from_waiting_and_running():
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq(0, 5), make_seq(1, 5)
    sched.add(running), sched.add(waiting)
    step(sched)
    assert sched.abort(1)
    assert waiting.status is SequenceStatus.FINISHED_ABORTED and sched.num_waiting == 0
    assert sched.abort(0)
    assert running.status is SequenceStatus.FINISHED_ABORTED and running.block_table == []
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished()
    assert not sched.abort(0) and not sched.abort(12345)  # already gone / unknown: no-op


def test_finish_frees_blocks_and_forgets_the_sequence():
    sched = make_scheduler()
    seq = make_seq(0, 9)
    sched.add(seq)
    step(sched)
    assert sched.block_manager.usage > 0
    assert sched.finish(0, SequenceStatus.FINISHED_LENGTH)
    assert seq.status is SequenceStatus.FINISHED_LENGTH and sched.get(0) is None
    assert sched.block_manager.usage == 0 and not sched.finish(0, SequenceStatus.FINISHED_LENGTH)


# ---- property test: a simulated engine --------------------------------------------------------------

@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(2, 24))
    min_blocks = -(-max_model_len // block_size)  # the least the scheduler accepts

    def requests(prompt_lens, max_size):
        return st.lists(st.tuples(st.integers(0, 12),  # arrival step (bunched: many run at once)
                                  prompt_lens,
                                  st.integers(1, 2 * max_model_len)),  # max_tokens
                        max_size=max_size)

    valid = draw(requests(st.integers(1, max_model_len - 1), 16))
    invalid = draw(requests(st.sampled_from([0, max_model_len, max_model_len + 1]), 2))
    max_num_seqs = draw(st.integers(1, 6))
    return dict(
        config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            # Budgets from one token per seat (prompts prefilled in chunks of a token or two) to whole prompts.
            max_num_batched_tokens=draw(st.integers(max_num_seqs, max(max_num_seqs, 2 * max_model_len))),
            max_model_len=max_model_len,
            max_queued_requests=draw(st.none() | st.integers(2, 8)),
        ),
        # A cache of about one max-length sequence: preemption is common.
        cache=CacheConfig(block_size=block_size, num_blocks=min_blocks + draw(st.integers(0, 3)),
                          enable_prefix_caching=draw(st.booleans())),
        arrivals=sorted(valid + invalid),
        # Prompts of a few token patterns, so that prompts share prefixes of every length.
        families=draw(st.integers(1, 3)),
    )


class SimulatedEngine:
    """Plays the engine and keeps an independent model of the waiting queue and of every request."""

    def __init__(self, sched: Scheduler, rng: random.Random, families: int = 0):
        self.sched, self.rng, self.families = sched, rng, families
        self.cfg = sched.config
        self.added: dict[int, Sequence] = {}
        self.finished: dict[int, SequenceStatus] = {}
        self.outputs: dict[int, list[int]] = {}  # what the "runner" sampled for each sequence
        self.waiting: deque[int] = deque()  # the FCFS order the scheduler must follow
        self.next_id = self.next_token = 0
        self.rows = RunnerRows()  # the runner's rows, kept from the outputs alone
        # What each KV slot holds, as the steps wrote it: block -> {offset: token}. A sequence reading a cached
        # prefix must find its own tokens there, and no step may write into a block shared or cached before it.
        self.kv: dict[int, dict[int, int]] = {}

    def arrive(self, prompt_len: int, max_tokens: int) -> None:
        seq = make_seq(self.next_id, prompt_len, max_tokens=max_tokens)
        if self.families:  # a prompt of family f: f, f+1, f+2, ... so prompts of one family share a prefix
            f = self.rng.randrange(self.families)
            seq.prompt_token_ids = [(f * 7 + j) % 5 for j in range(prompt_len)]
        self.next_id += 1
        limit = self.cfg.max_queued_requests
        if prompt_len == 0 or prompt_len >= self.cfg.max_model_len:
            with pytest.raises(InvalidRequestError):
                self.sched.add(seq)
        elif limit is not None and len(self.waiting) >= limit:
            with pytest.raises(QueueFullError):
                self.sched.add(seq)
        else:
            self.sched.add(seq)
            self.added[seq.seq_id] = seq
            self.outputs[seq.seq_id] = []
            self.waiting.append(seq.seq_id)

    def abort(self, seq_id: int) -> None:
        assert self.sched.abort(seq_id)
        self.finished[seq_id] = SequenceStatus.FINISHED_ABORTED
        if seq_id in self.waiting:
            self.waiting.remove(seq_id)

    def step(self) -> None:
        sched, rng = self.sched, self.rng
        if self.added and rng.random() < 0.02:
            live = sorted(set(self.added) - set(self.finished))
            if live:
                self.abort(rng.choice(live))
        out = sched.schedule()
        computed = self.rows.apply(out)
        self.check_output(out, computed)
        self.check_kv(out)
        sampled = []
        for _ in computed:
            self.next_token += 1
            sampled.append(self.next_token)
        in_flight_abort = None
        if computed and rng.random() < 0.01:  # a client goes away while the step runs
            in_flight_abort = rng.choice(computed)
            self.abort(in_flight_abort)
        sched.update(computed, sampled)
        for seq_id, tok in zip(computed, sampled):
            if seq_id == in_flight_abort:
                continue
            self.outputs[seq_id].append(tok)
            seq = sched.get(seq_id)
            if len(seq.output_token_ids) >= seq.sampling_params.max_tokens or \
                    seq.num_tokens >= self.cfg.max_model_len:
                status = SequenceStatus.FINISHED_LENGTH
            elif rng.random() < 0.02:
                status = SequenceStatus.FINISHED_STOPPED  # e.g. EOS or a stop string
            else:
                continue
            assert sched.finish(seq_id, status)
            self.finished[seq_id] = status
        self.check_state()

    def check_output(self, out, scheduled: list[int]) -> None:
        sched, bm, cfg = self.sched, self.sched.block_manager, self.cfg
        assert len(set(scheduled)) == len(scheduled) <= cfg.max_num_seqs
        assert sched.num_running <= cfg.max_num_seqs
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        for pid in out.preempted_seq_ids:
            assert pid not in scheduled and pid in out.left
        # The runner's rows, kept only from what the outputs reported, are exactly the decoding sequences (those
        # whose last chunk ran in this step included), and each row's block table is the sequence's.
        running = {i: s for i in self.added if i not in self.finished and
                   (s := sched.get(i)).status is SequenceStatus.RUNNING}
        decoding = {i for i, s in running.items() if s.decoding}
        assert set(self.rows.rows.seq_ids) == decoding
        for seq_id in decoding:
            assert self.rows.tables[seq_id] == running[seq_id].block_table
        # Decodes are never starved: every sequence that held a row before this step (all decoding but those whose
        # last chunk runs now) gets its token.
        joined = {s.seq_id for s in out.seqs if s.samples}
        assert set(scheduled[:out.num_decode]) == decoding - joined and not joined & set(scheduled[:out.num_decode])
        for s in out.seqs:
            seq = sched.get(s.seq_id)
            assert seq.status is SequenceStatus.RUNNING and s.block_table == tuple(seq.block_table)
            assert len(s.block_table) == bm.blocks_needed(s.context_len)  # covers the chunk, no more
            assert s.num_generated == len(self.outputs[s.seq_id]) and s.sampling_params is seq.sampling_params
            tokens = seq.prompt_token_ids + self.outputs[s.seq_id]
            assert s.token_ids == tuple(tokens[s.start_pos:s.context_len]) and s.token_ids
            assert s.samples == (s.context_len == len(tokens))  # only the last chunk samples
        # FCFS admission: the admitted are the head of the waiting queue; a step that preempts admits none.
        admitted = [s.seq_id for s in out.seqs if s.seq_id in self.waiting]
        assert admitted == list(self.waiting)[:len(admitted)]
        assert not (admitted and out.preempted_seq_ids)
        for _ in admitted:
            self.waiting.popleft()
        if not bm.enable_prefix_caching:
            assert all(s.start_pos == 0 for s in out.seqs if s.seq_id in admitted)
        # Each victim goes to the front in turn (newest first), so the oldest victim ends up first.
        self.waiting.extendleft(out.preempted_seq_ids)
        if out.kind == "idle":
            assert not out.seqs and not out.num_decode
            return
        if self.waiting and not out.preempted_seq_ids:  # admission stopped for a reason
            head = self.added[self.waiting[0]]
            left = cfg.max_num_batched_tokens - out.num_batched_tokens
            hits = bm.cached_prefix(head)
            cached = len(hits) * bm.block_size
            assert (sched.num_running >= cfg.max_num_seqs or left == 0 or head.num_inflight
                    or not bm.can_admit(hits, cached + min(head.num_tokens - cached, left)))

    def check_kv(self, out) -> None:
        """Play the step's K/V writes into the content model, then check that every sequence the step computes
        reads its own tokens at every position of its context: a cached prefix that holds other tokens, or a
        write into a block another sequence still reads, shows up here."""
        sched, bs = self.sched, self.sched.block_manager.block_size
        joined = {s.seq_id for s in out.seqs if s.samples}
        decoded = [sched.get(i) for i in self.rows.rows.seq_ids if i not in joined]
        writes = [(seq, seq.num_computed_tokens - 1) for seq in decoded]  # each row feeds its last token
        chunked = [(sched.get(s.seq_id), s) for s in out.seqs]
        writes += [(seq, s.start_pos + i) for seq, s in chunked for i in range(len(s.token_ids))]
        writers: dict[int, int] = {}
        for seq, pos in writes:
            block = seq.block_table[pos // bs]
            assert writers.setdefault(block, seq.seq_id) == seq.seq_id, f"two sequences write block {block}"
            self.kv.setdefault(block, {})[pos % bs] = seq.token_ids_range(pos, pos + 1)[0]
        # Reads come after the step's writes (each layer writes the step's K/V, then attends), so a prefix
        # another chunk of this very step computes is read right.
        reads = [(seq, seq.num_computed_tokens) for seq in decoded] + [(seq, s.context_len) for seq, s in chunked]
        for seq, context in reads:
            tokens = seq.token_ids_range(0, context)
            held = [self.kv.get(seq.block_table[p // bs], {}).get(p % bs) for p in range(context)]
            assert held == tokens, f"seq {seq.seq_id} reads {held}, its tokens are {tokens}"

    def check_state(self) -> None:
        sched, bm = self.sched, self.sched.block_manager
        holders: dict[int, int] = {}
        num_live = 0
        for seq_id, seq in self.added.items():
            live = sched.get(seq_id)
            if seq_id in self.finished:  # finished exactly once, and forgotten
                assert live is None and seq.status is self.finished[seq_id] and seq.block_table == []
                continue
            num_live += 1
            assert live is seq and seq.output_token_ids == self.outputs[seq_id]
            if seq.status is SequenceStatus.WAITING:
                assert seq.block_table == [] and seq.num_computed_tokens == 0 and not seq.decoding
            else:
                assert seq.status is SequenceStatus.RUNNING
                if seq.decoding:
                    assert seq.num_computed_tokens == seq.num_tokens - 1 < self.cfg.max_model_len
                else:  # prefilled up to num_computed_tokens, chunk by chunk
                    assert 0 < seq.num_computed_tokens < seq.num_tokens and not seq.num_inflight
                assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
                assert len(set(seq.block_table)) == len(seq.block_table)
                for b in seq.block_table:
                    holders[b] = holders.get(b, 0) + 1
        assert sched.num_waiting == len(self.waiting) and sched.num_waiting + sched.num_running == num_live
        assert sched.num_prefilling <= 1  # admission waits for the budget and blocks the one before leaves
        assert all(sched.get(i).status is SequenceStatus.WAITING for i in self.waiting)
        # The pool's accounting is exact: each block's refcount is its number of holders; every other block is
        # free or evictable (cached, held by nobody); only full cached blocks are shared.
        alloc = bm.allocator
        assert all(alloc.refcount(b) == holders.get(b, 0) for b in range(bm.num_total_blocks))
        assert len(holders) + bm.num_free_blocks == bm.num_total_blocks
        assert all(alloc.key_of(b) is not None for b, n in holders.items() if n > 1)
        if not bm.enable_prefix_caching:
            assert alloc.num_cached == 0 and all(n == 1 for n in holders.values())
        assert sched.num_preemptions == sum(s.num_preemptions for s in self.added.values())


@settings(max_examples=SIMULATION_EXAMPLES, deadline=None)
@given(workload=workloads(), seed=st.integers(0, 2**32 - 1))
def test_simulated_engine_keeps_every_invariant(workload, seed):
    # A seeded Random rather than st.randoms(): hypothesis' own randoms lean towards 0.0, which would
    # abort or stop nearly every sequence at once and hide preemption.
    sched = Scheduler(workload["config"], workload["cache"])
    engine = SimulatedEngine(sched, random.Random(seed), workload["families"])
    arrivals = deque(workload["arrivals"])
    last_arrival = arrivals[-1][0] if arrivals else 0
    cfg = workload["config"]
    # Every step makes progress (the oldest running sequence always gets a token; a prefill admits at
    # least one), so this bound is generous.
    max_steps = last_arrival + 1 + len(arrivals) * cfg.max_model_len * (cfg.max_num_seqs + 2)
    for t in range(max_steps):
        while arrivals and arrivals[0][0] == t:
            _, prompt_len, max_tokens = arrivals.popleft()
            engine.arrive(prompt_len, max_tokens)
        engine.step()
        if not arrivals and not sched.has_unfinished():
            break
    assert not arrivals and not sched.has_unfinished(), f"requests left after {max_steps} steps"
    target(sched.num_preemptions, label="preemptions")  # steer generation towards tight caches
    assert set(engine.finished) == set(engine.added)
    assert sched.block_manager.num_free_blocks == workload["cache"].num_blocks


@settings(max_examples=30, deadline=None)
@given(workload=workloads())
def test_tight_cache_without_finishes_still_drains(workload):
    """No random stops or aborts: every sequence runs to max_tokens / max_model_len through preemptions."""
    sched = Scheduler(workload["config"], workload["cache"])
    engine = SimulatedEngine(sched, _NeverRandom(0))
    for _, prompt_len, max_tokens in workload["arrivals"]:
        engine.arrive(prompt_len, max_tokens)
    cfg = workload["config"]
    for _ in range(1 + len(engine.added) * cfg.max_model_len * (cfg.max_num_seqs + 2)):
        if not sched.has_unfinished():
            break
        engine.step()
    assert not sched.has_unfinished()
    assert all(s is SequenceStatus.FINISHED_LENGTH for s in engine.finished.values())


class _NeverRandom(random.Random):
    """random() never falls under a probability threshold: no random stops or aborts."""

    def random(self) -> float:
        return 1.0


def test_decode_rows_condense_and_ignore_unknown_sequences():
    rows = DecodeRows()
    assert [rows.add(s) for s in (10, 11, 12)] == [0, 1, 2]
    assert rows.remove(99) is None  # never joined (aborted before its prefill)
    assert rows.remove(12) == (2, 2) and rows.seq_ids == [10, 11]  # the last row: nothing moves
    assert rows.remove(10) == (0, 1) and rows.seq_ids == [11] and rows.row_of == {11: 0}  # 11 fills the hole
    assert rows.add(13) == 1 and rows.row_of == {11: 0, 13: 1} and len(rows) == 2


# ---- overlapped scheduling: the next step is scheduled before the previous one's tokens land ----------------

def test_overlap_a_token_in_flight_that_ends_a_sequence_frees_its_row():
    s = make_scheduler()
    s.add(make_seq(0, 4, max_tokens=2))
    s.add(make_seq(1, 4, max_tokens=10))
    step(s)  # prefill: one token each
    first = s.schedule()  # decode 1, not yet updated
    assert first.kind == "decode" and first.num_decode == 2 and first.left == ()
    second = s.schedule()  # seq 0's token in flight is its 2nd (max_tokens): it leaves before computing a 3rd
    assert second.kind == "decode" and second.num_decode == 1 and second.left == (0,)
    assert s.get(1).num_inflight == 2 and s.get(0).num_inflight == 1
    s.update([0, 1], [7, 7])
    s.update([1], [8])
    assert s.get(0).output_token_ids == [7, 7] and s.get(1).output_token_ids == [7, 7, 8]
    assert s.finish(0, SequenceStatus.FINISHED_LENGTH) and s.get(0) is None and s.has_unfinished()


def test_overlap_only_ending_sequences_left_is_an_idle_step_that_drops_their_rows():
    s = make_scheduler(max_model_len=32)
    s.add(make_seq(0, 30, max_tokens=100))
    step(s)  # prefill 30 tokens + 1 sampled: 31
    assert s.schedule().kind == "decode"  # feeds token 31 (position 30); its sample would be the 32nd
    out = s.schedule()  # the 32nd token reaches max_model_len: nothing more to compute
    assert out.kind == "idle" and out.left == (0,) and out.num_decode == 0
    assert s.get(0).num_inflight == 1


def test_overlap_a_step_that_crosses_a_block_boundary_with_a_token_in_flight():
    s = make_scheduler(block_size=4)
    s.add(make_seq(0, 3, max_tokens=10))
    step(s)  # prefill 3 tokens (one block of 4) + 1 sampled
    assert s.schedule().new_blocks == ()  # feeds token 4: still in the first block
    out = s.schedule()  # token 5 needs a second block while token 4's sample is still in flight
    seq = s.get(0)
    assert out.kind == "decode" and out.new_blocks == ((0, seq.block_table[1]),) and len(seq.block_table) == 2
    assert seq.num_inflight == 2 and seq.num_computed_tokens == 5


def test_a_step_that_decodes_carries_at_most_the_prefill_cap_and_one_that_does_not_fills_the_budget():
    sched = Scheduler(SchedulerConfig(4, 16, 32, max_prefill_tokens_while_decoding=3),
                      CacheConfig(block_size=4, num_blocks=64))
    sched.add(make_seq(0, 10))
    sched.add(make_seq(1, 9))
    out = step(sched)  # nothing decodes yet: the whole budget, 10 + the first 6 of the next prompt
    assert out.kind == "prefill" and [(s.seq_id, len(s.token_ids)) for s in out.seqs] == [(0, 10), (1, 6)]
    out = step(sched)  # 0 decodes: the chunk beside it is capped at 3 tokens (the budget left 15)
    assert out.kind == "mixed" and out.num_decode == 1 and [(s.seq_id, len(s.token_ids)) for s in out.seqs] == [(1, 3)]
    assert out.seqs[0].samples  # 6 + 3 = 9: that prompt is done
    sched.add(make_seq(2, 8))
    out = step(sched)
    assert out.num_decode == 2 and [(s.seq_id, len(s.token_ids)) for s in out.seqs] == [(2, 3)]
    with pytest.raises(ConfigError, match="--max-prefill-tokens-while-decoding must be >= 1"):
        SchedulerConfig(4, 16, 32, max_prefill_tokens_while_decoding=0)
