"""The persistent decode batch: rows kept from the scheduler's changes alone stay right; the decode step
through graphs (RecordingGraphBackend on CPU, real graphs on the GPU) equals eager while sequences join and
leave; seeded sampling gives the same tokens alone and among 31 other requests."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ostinato import LLM, SamplingParams
from ostinato.config import CacheConfig, SchedulerConfig
from ostinato.engine.request import Sequence, SequenceStatus
from ostinato.engine.scheduler import Scheduler
from ostinato.runner.decode_batch import BLOCKS, CTR, POS, TOKEN, DecodeBatch, DecodeLayout
from ostinato.runner.decode_step import compare_step
from ostinato.runner.graphs import RecordingGraphBackend
from ostinato.tools.checkpoint import make_checkpoint


# ---- rows follow the scheduler (property test) ---------------------------------------------------------

@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(2, 24))
    blocks = -(-max_model_len // block_size) + draw(st.integers(0, 3))  # about one sequence: preemptions
    arrivals = draw(st.lists(st.tuples(st.integers(0, 10), st.integers(1, max_model_len - 1),
                                       st.integers(1, 2 * max_model_len)), max_size=12))
    max_num_seqs = draw(st.integers(1, 6))
    # Budgets below max_model_len chunk the prompts; prefix caching on or off.
    cfg = SchedulerConfig(max_num_seqs, draw(st.integers(max_num_seqs, max_model_len + 6)), max_model_len, None)
    return cfg, CacheConfig(block_size, blocks, enable_prefix_caching=draw(st.booleans())), sorted(arrivals)


def check_rows(batch: DecodeBatch, sched: Scheduler, layout: DecodeLayout, joining: int = 0) -> None:
    """Every running sequence's row says what the scheduler's sequence says; the other rows are padding."""
    running = [sched.get(i) for i in batch.rows.seq_ids]
    assert all(s is not None and s.status is SequenceStatus.RUNNING for s in running)
    # every running sequence whose prefill is done holds a row (those whose last chunk runs now: after it), no other
    assert sched.num_running - sched.num_prefilling - joining == len(running)
    for seq in running:
        row = batch.row(seq.seq_id)
        assert batch.block_table(seq.seq_id) == seq.block_table
        assert int(row[POS]) == seq.num_tokens - 1 and int(row[TOKEN]) == seq.last_token_id
        assert int(row[CTR]) == len(seq.output_token_ids)
        assert (row[BLOCKS + len(seq.block_table):] == layout.scratch_block).all()  # no stale block ids
    pad = layout.pad_row()
    assert all(torch.equal(batch.host[r], pad) for r in range(len(batch), layout.rows))
    n = len(batch)
    if n:  # the step's unpacking: slots inside each sequence's own blocks
        u = layout.unpack(batch.host[:n])
        for r, seq_id in enumerate(batch.rows.seq_ids):
            seq = sched.get(seq_id)
            p = seq.num_tokens - 1
            assert int(u["slot_mapping"][r]) == seq.block_table[p // layout.block_size] * layout.block_size \
                + p % layout.block_size
            assert int(u["context_lens"][r]) == seq.num_tokens


def scheduler_and_rows(cfg: SchedulerConfig, cache: CacheConfig):
    sched = Scheduler(cfg, cache)
    layout = DecodeLayout(cfg.max_num_seqs, -(-cfg.max_model_len // cache.block_size), cache.block_size,
                          scratch_block=cache.num_blocks)
    return sched, layout, DecodeBatch(layout, torch.device("cpu"), engine_seed=0)


@settings(max_examples=60, deadline=None)
@given(workload=workloads(), seed=st.integers(0, 2**32 - 1))
def test_rows_stay_right_across_boundaries_preemption_and_reused_blocks(workload, seed):
    cfg, cache, arrivals = workload
    rng = random.Random(seed)
    sched, layout, batch = scheduler_and_rows(cfg, cache)
    pending = list(arrivals)
    next_id = 0
    for t in range(2000):
        while pending and pending[0][0] <= t:
            _, prompt_len, max_tokens = pending.pop(0)
            sched.add(Sequence(next_id, f"r{next_id}", [rng.randrange(1, 500) for _ in range(prompt_len)],
                               SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.7]))))
            next_id += 1
        if not pending and not sched.has_unfinished():
            break
        out = sched.schedule()
        batch.apply(out.left, out.new_blocks)
        assert len(batch) == out.num_decode
        computed, tokens = [], []
        if out.num_decode:
            check_rows(batch, sched, layout, sum(s.samples for s in out.seqs))  # what the graph reads this step
            computed = list(batch.rows.seq_ids)
            tokens = [rng.randrange(1, 500) for _ in computed]
            batch.advance(len(computed), torch.tensor(tokens).numpy())
        for s in out.seqs:  # chunks that end their prompt sample and join after the decode rows
            if s.samples:
                computed.append(s.seq_id)
                tokens.append(rng.randrange(1, 500))
                batch.join(s, tokens[-1])
        sched.update(computed, tokens)
        for seq_id in computed:
            seq = sched.get(seq_id)
            if seq is None:
                continue
            if len(seq.output_token_ids) >= seq.sampling_params.max_tokens or seq.num_tokens >= cfg.max_model_len:
                sched.finish(seq_id, SequenceStatus.FINISHED_LENGTH)
            elif rng.random() < 0.03:
                sched.finish(seq_id, SequenceStatus.FINISHED_STOPPED)
            elif rng.random() < 0.03:
                sched.abort(seq_id)
    assert not sched.has_unfinished()
    out = sched.schedule()  # idle: the last finished sequences' rows leave now
    assert out.kind == "idle"
    for seq_id in out.left:
        batch.leave(seq_id)
    assert len(batch) == 0 and all(torch.equal(row, layout.pad_row()) for row in batch.host)


@settings(max_examples=60, deadline=None)
@given(workload=workloads(), seed=st.integers(0, 2**32 - 1))
def test_overlapped_scheduling_keeps_rows_blocks_and_lengths_right(workload, seed):
    """The engine's overlapped loop, simulated: decode step n+1 is scheduled and its rows prepared before
    step n's tokens are read; random stops, aborts and preemptions on a tight cache."""
    cfg, cache, arrivals = workload
    rng = random.Random(seed)
    sched, layout, batch = scheduler_and_rows(cfg, cache)
    pending, added, done, emitted = list(arrivals), {}, {}, {}
    inflight = None
    for t in range(3000):
        while pending and pending[0][0] <= t:
            _, prompt_len, max_tokens = pending.pop(0)
            seq = Sequence(len(added), f"r{len(added)}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))
            sched.add(seq)
            added[seq.seq_id], emitted[seq.seq_id] = seq, 0
        if not pending and not sched.has_unfinished() and inflight is None:
            break
        out = sched.schedule()
        batch.apply(out.left, out.new_blocks)
        assert len(batch) == out.num_decode
        step = None
        if out.num_decode:
            for r, seq_id in enumerate(batch.rows.seq_ids):  # what the graph reads
                seq = sched.get(seq_id)
                assert batch.block_table(seq_id) == seq.block_table
                assert int(batch.host[r, POS]) == seq.num_computed_tokens - 1
                assert len(seq.block_table) == -(-seq.num_computed_tokens // cache.block_size)
            step = (list(batch.rows.seq_ids), [rng.randrange(1, 500) for _ in range(len(batch))])
            batch.advance(len(batch))
        joined = [s for s in out.seqs if s.samples]
        if joined:
            step = step or ([], [])
            for s in joined:
                step[0].append(s.seq_id)
                step[1].append(rng.randrange(1, 500))
                batch.join(s, step[1][-1])
        if out.num_decode:  # overlapped: read the step before, keep this one in flight
            ready, inflight = [inflight], step
        else:
            ready, inflight = [inflight, step], None
        for r in ready:
            if r is None:
                continue
            sched.update(*r)
            for seq_id in r[0]:
                seq = sched.get(seq_id)
                if seq is None:  # finished or aborted at the step before: a wasted row, no token
                    continue
                emitted[seq_id] += 1
                if len(seq.output_token_ids) >= seq.sampling_params.max_tokens or seq.num_tokens >= cfg.max_model_len:
                    assert sched.finish(seq_id, SequenceStatus.FINISHED_LENGTH)
                    done[seq_id] = "length"
                elif rng.random() < 0.03:
                    assert sched.finish(seq_id, SequenceStatus.FINISHED_STOPPED)
                    done[seq_id] = "stop"
                elif rng.random() < 0.02:
                    assert sched.abort(seq_id)
                    done[seq_id] = "abort"
    assert not sched.has_unfinished() and set(done) == set(added)
    assert sched.block_manager.num_free_blocks == cache.num_blocks
    for seq_id, seq in added.items():  # never an extra token; length means exactly max_tokens (or max_len)
        assert emitted[seq_id] == len(seq.output_token_ids) <= seq.sampling_params.max_tokens
        if done[seq_id] == "length":
            assert len(seq.output_token_ids) == seq.sampling_params.max_tokens or seq.num_tokens == cfg.max_model_len


# ---- the self-check's comparison -------------------------------------------------------------------------

def test_compare_step_catches_wrong_sampled_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    right = torch.tensor([1, 0])
    assert compare_step((logits, right), (logits.clone(), right.clone())) is None
    assert "argmax" in compare_step((logits, torch.tensor([1, 2])), (logits, right))
    other = logits.clone()
    other[1, 2] = 9.0
    assert compare_step((logits, right), (other, torch.tensor([1, 2]))) is not None


# ---- the engine: graphs vs eager, seeds --------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt-batch")
    make_checkpoint(path, shape="tiny", seed=3)
    return path


def _workload(n: int = 7):
    """Staggered requests: different prompt and output lengths, so rows join and leave between steps."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    # Distinct lengths: the last requests finish one by one, so batches of 3 (padded to 4) occur.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 9, 14, 20, 5, 11, 17)[:n]]
    return prompts, params


def _use_recording_graphs(llm: LLM, sizes=(1, 2, 4)) -> None:
    """Swap the CPU engine's eager decode for graphs recorded by RecordingGraphBackend, self-check included."""
    from ostinato.runner.decode_graph_check import random_decode_rows

    runner = llm.engine.runner
    step = runner.decode_step
    graphs = step.graph_runner(sizes, enforce_eager=False, fallback="error", progress=False,
                               backend=RecordingGraphBackend())
    graphs.capture()
    spec = type("Spec", (), {"device": runner.device, "block_size": runner.block_size,
                             "model_config": runner.model_config})
    with torch.inference_mode():
        graphs.check(lambda n: random_decode_rows(spec, step.layout, n), compare_step, step.sampled_rows)
    runner.graphs = graphs


def test_graph_path_equals_eager_while_rows_join_and_leave(ckpt):
    prompts, params = _workload()
    # max_num_seqs 4 < 7 requests: later requests join while earlier ones decode and leave.
    eager = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphed = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=4)
    _use_recording_graphs(graphed)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == expected
    st_ = graphed.engine.stats()
    assert st_.decode_steps_graph > 0 and st_.decode_steps_eager == 0 and st_.padded_rows > 0
    assert set(st_.replays_by_size) == {1, 2, 4}  # batches of 3 replayed the graph of 4 with a pad row


def test_seeded_request_same_tokens_alone_and_among_31_others(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=32, seed=1)
    target = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = [5, 17, 99, 3, 250]
    alone = llm.generate([prompt], target)[0].outputs[0].token_ids
    rng = random.Random(2)
    others = [SamplingParams(temperature=rng.choice([0.0, 0.8, 1.3]), seed=rng.choice([None, rng.randrange(99)]),
                             top_k=rng.choice([-1, 5]), max_tokens=rng.randint(1, 16), ignore_eos=True)
              for _ in range(31)]
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 30))] for _ in range(31)]
    crowd = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=32, seed=99)
    outs = crowd.generate(prompts[:13] + [prompt] + prompts[13:], others[:13] + [target] + others[13:])
    assert outs[13].outputs[0].token_ids == alone
    assert len(set(alone)) > 3  # it sampled (a fresh draw per token), it did not repeat one token
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    assert llm.generate([prompt], unseeded)[0].outputs[0].token_ids != alone


def test_async_scheduling_gives_the_same_outputs_and_never_an_extra_token(ckpt):
    prompts, params = _workload()
    sync = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=4, async_scheduling=False, num_kv_blocks=6,
               max_model_len=96)
    first = sync.generate(prompts, params)
    # Stop on a token greedy decoding produces mid-way, so a sequence stops at a step the scheduler could not
    # foresee (not max_tokens): its next row is wasted and its token must not appear.
    stop = first[3].outputs[0].token_ids[6]
    params[3] = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop], ignore_eos=True)
    # Logprobs send decode steps through the eager finish after the replay, whose tokens must be read from
    # a copy: the next replay overwrites the graph's sampled-token buffer before an overlapped read.
    params.append(SamplingParams(temperature=0.9, seed=11, max_tokens=15, n=2, ignore_eos=True, logprobs=2))
    prompts.append([7, 8, 9])
    runs, overlapped, logprobs = {}, {}, {}
    for flag in (False, True):
        llm = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=4, async_scheduling=flag,
                  num_kv_blocks=6, max_model_len=96)  # 6 blocks of 16: preemptions happen
        # Record, for each step whose tokens are read, whether a later step had been launched already.
        runner, launches, reads = llm.engine.runner, [0], []
        launch = runner.launch

        def counting_launch(out, launch=launch, launches=launches, reads=reads):
            pending = launch(out)
            launches[0] += 1
            mine, result = launches[0], pending.result
            pending.result = lambda: (reads.append(launches[0] > mine), result())[1]
            return pending

        runner.launch = counting_launch
        outs = llm.generate(prompts, params)
        runs[flag] = ([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], llm.engine.stats())
        logprobs[flag] = [lp for o in outs for c in o.outputs if c.logprobs for lp in c.logprobs]
        overlapped[flag] = sum(reads)
    assert runs[True][0] == runs[False][0]
    # Logprobs: the same tokens; values equal up to fp32 rounding (preemption, hence recompute, falls on other
    # steps with overlap, and a recomputed prefill sums in another order than the decode steps it replaces).
    assert len(logprobs[True]) == len(logprobs[False]) == 30
    for a, b in zip(logprobs[True], logprobs[False]):
        assert a.token_id == b.token_id and [i for i, _ in a.top] == [i for i, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    (tokens, reason), = runs[True][0][3]
    assert reason == "stop" and tokens[-1] == stop and stop not in tokens[:-1]
    assert runs[False][1].num_preemptions > 0 and runs[True][1].num_preemptions > 0
    # Overlap ran: most steps' tokens were read after the next step was launched; never without it.
    assert overlapped[False] == 0 and overlapped[True] > 20
    assert runs[True][1].kv_blocks_free == 6 and runs[True][1].num_running == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_graphs_equal_eager_at_padded_sizes_while_rows_join_and_leave(ckpt, async_scheduling):
    """Real CUDA graphs (sampling inside) vs --enforce-eager, fp32, as requests join and leave between steps."""
    prompts, params = _workload()
    params[1] = SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True)  # seeded, in the graph
    params[2] = SamplingParams(temperature=0.8, top_k=20, seed=4, max_tokens=14, ignore_eos=True)  # after it
    kw = dict(device="cuda", dtype="float32", max_num_seqs=4, num_kv_blocks=64, max_model_len=512,
              async_scheduling=async_scheduling)
    eager = LLM(str(ckpt), enforce_eager=True, **kw)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphed = LLM(str(ckpt), cuda_graph_sizes=(1, 2, 4), **kw)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == expected
    st_ = graphed.engine.stats()
    assert st_.decode_steps_graph > 0 and st_.decode_steps_eager == 0 and st_.padded_rows > 0
    assert set(st_.replays_by_size) == {1, 2, 4}


def test_async_scheduling_wastes_no_step_on_a_sequence_known_to_end(ckpt):
    # max_tokens=4: one prefill and 3 decode steps. The 4th token is in flight when the step after is
    # scheduled; the scheduler knows it ends the sequence, so no 4th decode step is launched for it.
    llm = LLM(str(ckpt), device="cpu", dtype="float32", async_scheduling=True)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert llm.engine.stats().decode_steps_eager == 3


def test_tokens_sampled_by_prefill_chunks_are_read_with_the_step_not_inside_its_launch(ckpt, monkeypatch):
    # A chunk that ends its prompt samples a token. Waiting for it inside launch() made the step that ends a
    # long prompt wait for two steps of GPU work (overlapped scheduling runs one step ahead): every running
    # stream saw one long gap. The token is read in result(), with the decode rows', and the new row feeds
    # a placeholder for it meanwhile (the outputs equal the synchronous engine's in the test above).
    from ostinato.runner import sampler as sampler_mod

    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=4, async_scheduling=True, num_kv_blocks=6,
              max_model_len=96)
    runner, inside, reads = llm.engine.runner, [False], []
    get, launch = sampler_mod.HostCopy.get, runner.launch
    monkeypatch.setattr(sampler_mod.HostCopy, "get", lambda self: (reads.append(inside[0]), get(self))[1])

    def watched_launch(out):
        inside[0] = True
        try:
            return launch(out)
        finally:
            inside[0] = False

    runner.launch = watched_launch
    prompts, params = _workload()
    outs = llm.generate(prompts, params)
    assert all(o.outputs[0].token_ids for o in outs)
    assert reads and not any(reads), f"{sum(reads)} of {len(reads)} prefill samples were read inside launch()"
