"""A sequence's sampling state (runner/sampling_state.py): written once when it joins the decode batch, read by
its prefill draw and its decode draws from the same row; it moves with the row when rows condense. Also the
one slot helper (runner/inputs.py kv_slots) against the slot formula."""

import numpy as np
import pytest
import torch

from ostinato.contract import ScheduledSeq
from ostinato.runner.decode_batch import BLOCKS, TOP_K, TOP_P, DecodeBatch, DecodeLayout
from ostinato.runner.inputs import kv_slots
from ostinato.runner.sampler import Sampler, row_key
from ostinato.sampling_params import SamplingParams

ENGINE_SEED = 7
PARAMS = [
    SamplingParams(temperature=0.0, top_k=50),  # greedy: its top-k is switched off
    SamplingParams(temperature=0.5, top_k=7, logprobs=3),
    SamplingParams(temperature=1.0, top_p=0.9, seed=5),
    SamplingParams(temperature=1e-6, seed=11),  # greedy by the one rule
    SamplingParams(temperature=0.8, seed=-3, logprobs=0),
]


def _seqs(params, first_id=10):
    return [ScheduledSeq(first_id + i, (3, 4), 2 * i, tuple(range(i + 1)), p, num_generated=i)
            for i, p in enumerate(params)]


def _batch(rows=8):
    return DecodeBatch(DecodeLayout(rows, 8, 4, scratch_block=99), torch.device("cpu"), ENGINE_SEED)


def _fields(b):
    return (b.temperature.tolist(), b.top_k.tolist(), b.top_p.tolist(), b.key.tolist(), b.counter.tolist(),
            b.any_filtered, b.num_logprobs, b.max_num_logprobs)


def test_prefill_and_decode_read_the_settings_the_join_wrote():
    batch, seqs = _batch(), _seqs(PARAMS)
    rows = [batch.join(s) for s in seqs]
    prefill = batch.joined_sampling(rows[0], len(rows))
    decode = batch.sampling(batch.dev[: len(rows)])
    # The prefill draw counts the tokens generated before it; the row then holds the next draw's counter.
    assert prefill.counter.tolist() == [s.num_generated for s in seqs]
    assert decode.counter.tolist() == [s.num_generated + 1 for s in seqs]
    p, d = _fields(prefill), _fields(decode)
    assert p[:4] == d[:4] and p[5:] == d[5:]
    assert p[0] == pytest.approx([0.0, 0.5, 1.0, 0.0, 0.8]) and p[1] == [0, 7, 0, 0, 0]
    assert p[2] == pytest.approx([1.0, 1.0, 0.9, 1.0, 1.0])
    assert p[3] == [row_key(s.sampling_params.seed, ENGINE_SEED, s.seq_id) for s in seqs]
    assert p[5] and p[6] == (None, 3, None, None, 0) and p[7] == 3
    # The same settings a batch of sequences without rows gets (warm-up): one writer for both.
    assert _fields(Sampler("cpu", ENGINE_SEED).prepare(seqs)) == p


def test_rows_joined_after_others_are_read_from_their_own_rows():
    batch = _batch()
    for s in _seqs(PARAMS[:2], first_id=0):
        batch.join(s)
    late = _seqs(PARAMS[2:], first_id=50)
    first = batch.join(late[0])
    for s in late[1:]:
        batch.join(s)
    got = batch.joined_sampling(first, len(late))
    assert _fields(got) == _fields(Sampler("cpu", ENGINE_SEED).prepare(late))
    assert not batch.joined_sampling(0, 1).any_filtered  # row 0 is greedy: its top-k is off
    assert batch.joined_sampling(1, 1).num_logprobs == (3,)


def test_a_leaving_sequence_hands_its_row_to_the_last_one_with_its_state():
    batch, seqs = _batch(), _seqs(PARAMS)
    for s in seqs:
        batch.join(s)
    before = _fields(batch.sampling(batch.dev[:5]))
    batch.leave(seqs[1].seq_id)  # the only top-k row, and one of the two logprobs rows
    after = batch.sampling(batch.dev[:4])
    order = [0, 4, 2, 3]  # the last row moved into the hole
    assert after.temperature.tolist() == [before[0][i] for i in order]
    assert after.key.tolist() == [before[3][i] for i in order]
    assert after.num_logprobs == (None, 0, None, None) and after.max_num_logprobs == 0
    assert after.any_filtered  # the top-p row stays
    assert (batch.np[4] == batch.layout.pad_row().numpy()).all()
    batch.leave(seqs[2].seq_id)
    assert not batch.sampling(batch.dev[:3]).any_filtered  # no row filters any more
    assert batch.needs_finish  # a row still asks for logprobs
    batch.leave(seqs[4].seq_id)
    assert not batch.needs_finish  # no row filters or asks for logprobs
    # The state is the row's setting columns only: its block table is untouched by the settings.
    assert batch.np[0, BLOCKS] == 0 and batch.np[0, TOP_K] == 0
    assert batch.np[0, TOP_P].view(np.float32) == 1.0


def test_the_prefill_draw_equals_the_draw_from_settings_built_without_rows():
    logits = torch.randn(len(PARAMS), 300, generator=torch.Generator().manual_seed(1)) * 3
    batch, seqs = _batch(), _seqs(PARAMS)
    rows = [batch.join(s) for s in seqs]
    sampler = Sampler("cpu", ENGINE_SEED)
    joined = sampler(logits, batch.joined_sampling(rows[0], len(rows)))
    unjoined = sampler(logits, sampler.prepare(seqs))
    assert joined.token_ids.tolist() == unjoined.token_ids.tolist()
    assert torch.equal(joined.top_ids, unjoined.top_ids) and torch.equal(joined.logprobs, unjoined.logprobs)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_kv_slots_is_the_slot_formula_for_numpy_and_torch(block_size):
    gen = np.random.default_rng(block_size)
    tables = gen.integers(0, 1000, (5, 6))
    positions = gen.integers(0, 6 * block_size, 5)
    want = [int(tables[r, p // block_size]) * block_size + int(p) % block_size for r, p in enumerate(positions)]
    assert kv_slots(tables.astype(np.int32), positions, block_size).tolist() == want  # one table per row
    assert kv_slots(torch.from_numpy(tables).int(), torch.from_numpy(positions), block_size).tolist() == want
    one = np.arange(2 * block_size)  # one sequence's positions over its own table
    assert kv_slots(tables[0], one, block_size).tolist() == [
        int(tables[0, p // block_size]) * block_size + p % block_size for p in one]
    assert kv_slots(tables.astype(np.int32), positions, block_size).dtype == np.int64


def test_both_prefill_paths_lay_out_the_same_tokens():
    from ostinato.contract import SchedulerOutput
    from ostinato.runner.inputs import build_prefill_inputs
    from ostinato.runner.prefill_graphs import PrefillGraphs

    seqs = (ScheduledSeq(0, (5, 6, 7), 13, (4, 2, 9, 1), SamplingParams(), 0),
            ScheduledSeq(1, (8,), 0, (3,), SamplingParams(), 0, samples=False),
            ScheduledSeq(2, tuple(range(9)), 4, (6, 5, 0, 7), SamplingParams(), 0))
    eager = build_prefill_inputs(SchedulerOutput("prefill", seqs), 4, 99, torch.device("cpu"))
    graphs = PrefillGraphs(torch.nn.Identity(), (32,), 4, 8, 4, 99, 64, torch.device("cpu"), enforce_eager=True)
    n, last_rows = graphs.fill(seqs, 32)
    assert n == 13 and last_rows == eager.last_token_indices.tolist() == [2, 12]
    assert graphs.tokens[0, :n].tolist() == eager.input_ids.tolist()
    assert graphs.tokens[1, :n].tolist() == eager.positions.tolist() == [13, 14, 15, 0, *range(4, 13)]
    assert graphs.tokens[2, :n].tolist() == eager.meta.slot_mapping.tolist()
    assert eager.meta.slot_mapping.tolist()[:4] == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 3 * 4]  # block 1 holds 12..15
    assert graphs.lengths[:3].tolist() == eager.meta.query_start_loc[:3].tolist() == [0, 3, 4]
    assert graphs.lengths[5:8].tolist() == eager.meta.context_lens.tolist() == [16, 1, 13]
