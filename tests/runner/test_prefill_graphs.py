"""Prefill steps as graph replays at fixed token counts (runner/prefill_graphs.py), on CPU through
RecordingGraphBackend (the very static-buffer and padding code the GPU runs, without capture) and, marked gpu,
with real CUDA graphs and the Triton backend.

What they prove: a padded replay gives the eager prefill's hidden states and K/V, after a cached prefix and with
block tables that change between replays, and its padded tokens write only the scratch block; chunked prefill
(chunks 1, 7, 16, 100) with prefix caching gives HF's greedy tokens with prefill replays; steps that do not fit
a captured size run eager and are counted; graph memory is reported; a replay that disagrees with eager stops
start-up (or, opted in, turns prefill graphs off and is counted)."""

import pytest
import torch
from test_prefix_chunked_e2e import _hf_cached, _shared_prefix_prompts

from support.graph_engine import engine_with_recorded_graphs, kv_pool
from ostinato.config import EngineArgs, plan_prefill_graph_tokens, read_prefill_graph_tokens
from ostinato.contract import ScheduledSeq, SchedulerOutput
from ostinato.engine.engine import LLMEngine
from ostinato.errors import ConfigError, CudaGraphCaptureError
from ostinato.runner.graph_backends import MemoryReading, RecordingGraphBackend
from ostinato.runner.inputs import build_prefill_inputs
from ostinato.sampling_params import SamplingParams
from ostinato.server.metrics import ServerMetrics
from ostinato.tools.checkpoint import make_checkpoint

BLOCK = 16
NUM_BLOCKS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefill-graphs")
    make_checkpoint(path, shape="tiny", family="llama", seed=11)
    return path


def _args(path, device="cpu", **kw) -> EngineArgs:
    kw.setdefault("num_kv_blocks", NUM_BLOCKS)
    return EngineArgs(str(path), device=device, dtype="float32", max_model_len=128, block_size=BLOCK, **kw)


def _engine(path, prefill_sizes=(8, 16, 32), prefill_max_seqs=3, backend=RecordingGraphBackend, **kw):
    return engine_with_recorded_graphs(_args(path, **kw), (1, 4), prefill_sizes=prefill_sizes,
                                       prefill_max_seqs=prefill_max_seqs, backend=backend)


# ---- replay vs eager, step by step --------------------------------------------------------------------------

def _steps(vocab: int) -> list[tuple[ScheduledSeq, ...]]:
    """Prefill steps over the same blocks, in order: later steps read what earlier ones wrote (cached prefixes
    ending inside a block), block tables change between steps, and every step is padded."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, vocab, (120,), generator=gen).tolist()
    a, b, c = (0, 1, 2, 3), (7, 5, 9), (11, 4)  # non-contiguous tables
    return [
        (ScheduledSeq(1, tuple(ids[:21]), 0, a[:2], PARAMS, 0, samples=False),),  # 21 -> 32
        (ScheduledSeq(1, tuple(ids[21:27]), 21, a[:2], PARAMS, 0),),  # after a prefix of 21: 6 -> 8
        (ScheduledSeq(2, tuple(ids[30:43]), 0, b[:1], PARAMS, 0, samples=False),  # three sequences: 13+1+9 -> 32
         ScheduledSeq(1, tuple(ids[27:28]), 27, a[:2], PARAMS, 0),
         ScheduledSeq(3, tuple(ids[60:69]), 0, c[:1], PARAMS, 0)),
        (ScheduledSeq(2, tuple(ids[43:55]), 13, b[:2], PARAMS, 0),  # 12 + 4 -> 16, a table grown by a block
         ScheduledSeq(3, tuple(ids[69:73]), 9, c[:1], PARAMS, 0)),
    ]


def _zero(engine):
    for k, v in kv_pool(engine):
        k.zero_(), v.zero_()


def _replay_vs_eager(engine, before_each=None):
    runner = engine.runner
    pg, model = runner.prefill_graphs, runner.model
    steps = _steps(engine.model_config.vocab_size)
    _zero(engine)
    eager = []
    for seqs in steps:
        inp = build_prefill_inputs(SchedulerOutput("prefill", seqs), BLOCK, runner.scratch_block, runner.device)
        eager.append(model(inp.input_ids, inp.positions, inp.meta).clone())
    eager_kv = [(k.clone(), v.clone()) for k, v in kv_pool(engine)]
    _zero(engine)
    before = pg.stats()
    for seqs, want in zip(steps, eager):
        if before_each is not None:
            before_each(pg)
        hidden, last_rows = pg.run(SchedulerOutput("prefill", seqs))
        torch.testing.assert_close(hidden, want, rtol=1e-4, atol=1e-4)
        assert last_rows == [i for i, row in enumerate(_rows(seqs)) if row]
    after = pg.stats()
    assert after.graph_steps - before.graph_steps == len(steps) and after.eager_steps == before.eager_steps
    assert after.padded_tokens - before.padded_tokens == (32 - 21) + (8 - 6) + (32 - 23) + 0
    return eager_kv


def _rows(seqs):
    """Per token row: whether it is the last token of a chunk that samples."""
    return [s.samples and i == len(s.token_ids) - 1 for s in seqs for i in range(len(s.token_ids))]


def test_padded_replays_give_the_eager_prefill_and_write_only_the_scratch_block(checkpoint):
    engine = _engine(checkpoint)
    eager_kv = _replay_vs_eager(engine)
    for (ke, ve), (kg, vg) in zip(eager_kv, kv_pool(engine)):
        torch.testing.assert_close(kg[:NUM_BLOCKS], ke[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vg[:NUM_BLOCKS], ve[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)
    assert all(k[-1].abs().sum() > 0 for k, _ in kv_pool(engine))  # padded tokens wrote the scratch block
    assert all(k[-1].abs().sum() == 0 for k, _ in eager_kv)


def test_steps_that_do_not_fit_run_eager_and_are_counted(checkpoint):
    pg = _engine(checkpoint, prefill_sizes=(8, 16), prefill_max_seqs=2).runner.prefill_graphs
    seq = lambda i, n: ScheduledSeq(i, (5,) * n, 0, (i,), PARAMS, 0)  # noqa: E731
    assert pg.size_for(SchedulerOutput("prefill", (seq(0, 9),))) == 16
    assert pg.size_for(SchedulerOutput("prefill", (seq(0, 8), seq(1, 8)))) == 16
    assert pg.size_for(SchedulerOutput("prefill", (seq(0, 17),))) is None  # more tokens than the largest
    assert pg.size_for(SchedulerOutput("prefill", (seq(0, 1), seq(1, 1), seq(2, 1)))) is None  # > max seqs
    before = pg.stats().eager_steps
    assert pg.run(SchedulerOutput("prefill", (seq(0, 17),))) is None
    assert pg.stats().eager_steps == before + 1


# ---- end to end ---------------------------------------------------------------------------------------------

def _generate(engine, prompts):
    """Greedy tokens of the prompts, each added one step after the other (so chunks run beside decodes), and
    the number of steps that prefilled something."""
    prefill_steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: prefill_steps.append(bool((out := schedule()).seqs)) or out
    done = {}

    def step():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
        step()
    while engine.has_unfinished():
        step()
    return [done[str(i)] for i in range(len(prompts))], sum(prefill_steps)


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
def test_chunked_prefill_with_prefix_caching_on_prefill_graphs_gives_hf_tokens(checkpoint, chunk):
    engine = _engine(checkpoint, prefill_sizes=(2, 8, 32), prefill_max_seqs=4, num_kv_blocks=64,
                     max_num_batched_tokens=chunk, max_num_seqs=min(chunk, 4))
    prompts = _shared_prefix_prompts(engine.model_config.vocab_size)[:3]  # cached prefixes of 0 and 32 tokens
    tokens, prefill_steps = _generate(engine, prompts)
    assert tokens == _hf_cached(checkpoint, prompts)
    s = engine.stats()
    assert s.prefill_steps_graph > 0 and s.prefill_steps_graph + s.prefill_steps_eager == prefill_steps
    assert (s.prefill_steps_eager > 0) == (chunk == 100)  # only a budget of 100 makes steps above 32 tokens
    assert s.prefix_cache_hits > 0 and s.kv_blocks_free == s.kv_blocks_total


# ---- mixed steps in one replay (--mixed-step one-replay) -------------------------------------------------------

def _mixed_run(checkpoint, mode: str, params: list[SamplingParams]):
    """Staggered prompts under a small step budget, so chunks run beside decode rows; the outputs (tokens,
    logprobs) in order, and the engine's stats."""
    engine = _engine(checkpoint, prefill_sizes=(8, 16, 32), prefill_max_seqs=3, mixed_step=mode,
                     num_kv_blocks=64, max_num_batched_tokens=12, max_num_seqs=6)
    prompts = _shared_prefix_prompts(engine.model_config.vocab_size)[:6]
    done = {}

    def step():
        done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)

    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
        step()
    while engine.has_unfinished():
        step()
    outs = [done[str(i)] for i in range(len(prompts))]
    return prompts, [o.token_ids for o in outs], [o.logprobs for o in outs], engine.stats()


def test_decode_rows_in_the_prefill_replay_give_hf_tokens_and_the_two_replay_tokens(checkpoint):
    # Greedy rows, seeded sampled rows (their tokens must not depend on how a step ran), and rows with top-k
    # and logprobs (the sampling finished after the replay).
    params = [GREEDY, SamplingParams(temperature=0.9, seed=3, max_tokens=9, ignore_eos=True), GREEDY,
              SamplingParams(temperature=0.7, top_k=5, seed=4, max_tokens=7, ignore_eos=True, logprobs=2),
              GREEDY, SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)]
    prompts, one, one_lp, s1 = _mixed_run(checkpoint, "one-replay", params)
    _, two, two_lp, s2 = _mixed_run(checkpoint, "two-replays", params)
    assert one == two
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert [one[i] for i in greedy] == _hf_cached(checkpoint, [prompts[i] for i in greedy])
    assert one_lp[3] and len(one_lp[3]) == len(two_lp[3])
    for a, b in zip(one_lp[3], two_lp[3]):  # the logprobs row: same tokens, same values (fp32)
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))
    assert s1.decode_steps_mixed > 0 and s2.decode_steps_mixed == 0
    assert s1.decode_steps_graph < s2.decode_steps_graph  # the mixed steps' decode replays are gone
    assert s1.kv_blocks_free == s1.kv_blocks_total


def test_a_prefill_replay_after_a_mixed_one_attends_no_stale_decode_row(checkpoint):
    # The decode rows' contexts stay in the graph's buffers: a later replay with fewer (or no) decode rows
    # must zero them, or the decode kernel would replace the chunk's first rows with a stale row's attention.
    engine = _engine(checkpoint, mixed_step="one-replay")
    pad_rows = engine.runner.decode_batch.np[:3].copy()  # pad rows: position 0 in the scratch block
    pad_rows[:, 0] = 5  # a real token id

    def leave_three_decode_rows(pg):
        pg.fill((), 8, pad_rows)
        assert pg.decode_cap >= 3 and int(pg.decode_contexts[:3].min()) == 1

    _replay_vs_eager(engine, before_each=leave_three_decode_rows)  # each replay equals the eager prefill
    assert int(engine.runner.prefill_graphs.decode_contexts.max()) == 0


# ---- memory, the self-check, flags --------------------------------------------------------------------------

class GrowingBackend(RecordingGraphBackend):
    """Each capture keeps 1 MiB per row of its output (a decode graph's batch, a prefill graph's tokens)."""

    def __init__(self):
        self.used = 0

    def capture(self, fn, pool):
        replay, out = super().capture(fn, pool)
        self.used += out.shape[0] << 20
        return replay, out

    def memory_in_use(self):
        return MemoryReading(self.used, self.used)


def test_prefill_graph_memory_is_measured_and_reported(checkpoint):
    engine = _engine(checkpoint, prefill_sizes=(8, 16), backend=GrowingBackend)
    s, runner = engine.stats(), engine.runner
    assert s.prefill_graph_memory_bytes == (16 + 8) << 20 and s.prefill_graph_sizes == (8, 16)
    # Decode sizes 1 and 4, twice: without and with the logits processors (runner/decode_step.py).
    assert s.graph_memory_bytes == 2 * ((1 + 4) << 20) + s.prefill_graph_memory_bytes
    assert "prefill graphs use 0.023 GiB" in runner.memory_report


class WrongPrefillReplay(RecordingGraphBackend):
    """Replays of prefill graphs (outputs [T, hidden]) come back perturbed; decode graphs replay right."""

    def capture(self, fn, pool):
        replay, out = super().capture(fn, pool)
        if out.shape[-1] == 64:  # the tiny checkpoint's hidden size (its vocabulary is larger)
            return (lambda: (replay(), out.add_(0.5))), out
        return replay, out


def test_a_replay_that_disagrees_with_eager_stops_start_up_or_turns_prefill_graphs_off(checkpoint):
    with pytest.raises(CudaGraphCaptureError, match="prefill graph self-check failed for 8 tokens"):
        _engine(checkpoint, prefill_sizes=(8,), backend=WrongPrefillReplay)
    engine = _engine(checkpoint, prefill_sizes=(8,), backend=WrongPrefillReplay, cuda_graph_fallback="eager")
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    tokens, prefill_steps = _generate(engine, prompts)
    s = engine.stats()
    assert (s.prefill_steps_graph, s.prefill_steps_eager) == (0, prefill_steps) and s.decode_steps_graph > 0
    assert tokens == _hf_cached(checkpoint, prompts)
    text = ServerMetrics("m").render(s)[0].decode()
    assert f'ostinato:prefill_steps_total{{model_name="m",path="eager"}} {float(prefill_steps)}' in text


def test_prefill_graph_token_plan():
    assert plan_prefill_graph_tokens(2048) == (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert plan_prefill_graph_tokens(256) == (16, 32, 48, 64, 96, 128, 192, 256)
    assert plan_prefill_graph_tokens(160) == (16, 32, 48, 64, 96, 128, 160)  # the budget itself, unpadded
    assert plan_prefill_graph_tokens(100, (8, 64, 128)) == (8, 64)
    assert read_prefill_graph_tokens("none") == () and read_prefill_graph_tokens("16,32 64") == (16, 32, 64)
    with pytest.raises(ConfigError, match="--prefill-graph-tokens"):
        read_prefill_graph_tokens("16,x")
    args = EngineArgs("m", max_num_batched_tokens=192, max_num_seqs=8, prefill_graph_max_seqs=32)
    gc = args.graph_config(device_is_cuda=True)
    assert gc.prefill_sizes == (16, 32, 48, 64, 96, 128, 192) and gc.prefill_max_seqs == 8


def test_given_prefill_graph_sizes_above_the_budget_are_dropped_with_one_warning(caplog):
    """The capture's plan warns; the step policy, which plans the same sizes for its cap, does not again."""
    args = EngineArgs("m", max_num_batched_tokens=100, max_num_seqs=8, prefill_graph_tokens=(8, 64, 128, 256))
    with caplog.at_level("WARNING", logger="ostinato.config"):
        assert args.prefill_tokens_while_decoding() == 64 - 8
        assert not caplog.records
        assert args.graph_config(device_is_cuda=True).prefill_sizes == (8, 64)
    assert [r.getMessage() for r in caplog.records] == [
        "not capturing prefill graphs for --prefill-graph-tokens [128, 256]: above --max-num-batched-tokens 100, "
        "no step holds that many tokens"]
    assert EngineArgs("m", prefill_graph_tokens="none").graph_config(True).prefill_sizes == ()
    assert EngineArgs("m", enforce_eager=True).graph_config(True).prefill_sizes == ()


# ---- real CUDA graphs -----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_real_prefill_graphs_replay_the_eager_prefill_with_cached_prefixes(checkpoint):
    """fp32, Triton attention: the same steps as on CPU through captured graphs (the grid fixed by T and the
    sequence slots, block tables changed between replays), and the engine's tokens with and without them."""
    engine = LLMEngine(_args(checkpoint, device="cuda", prefill_graph_tokens=(8, 16, 32), prefill_graph_max_seqs=3))
    assert engine.runner.prefill_graphs.captured_sizes == (8, 16, 32)
    eager_kv = _replay_vs_eager(engine)
    for (ke, ve), (kg, vg) in zip(eager_kv, kv_pool(engine)):
        torch.testing.assert_close(kg[:NUM_BLOCKS], ke[:NUM_BLOCKS], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vg[:NUM_BLOCKS], ve[:NUM_BLOCKS], rtol=1e-4, atol=1e-4)
    prompts = _shared_prefix_prompts(engine.model_config.vocab_size)
    on = LLMEngine(_args(checkpoint, device="cuda", num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=4))
    off = LLMEngine(_args(checkpoint, device="cuda", num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=4,
                          prefill_graph_tokens="none"))
    two = LLMEngine(_args(checkpoint, device="cuda", num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=4,
                          mixed_step="two-replays"))
    want = _generate(off, prompts)[0]
    assert _generate(on, prompts)[0] == want and _generate(two, prompts)[0] == want
    s = on.stats()
    assert s.prefill_steps_graph > 0 and s.prefill_steps_eager == 0 and s.prefill_graph_memory_bytes > 0
    assert s.decode_steps_mixed > 0  # decode rows rode in prefill replays (the real decode kernel in the graph)
    assert off.stats().prefill_steps_graph == 0 and two.stats().decode_steps_mixed == 0
