"""The decode step's two graph sets (runner/decode_step.py): a step in which no row uses a logits processor
replays the graphs without them and launches none of their work; a step with such a row replays the graphs with
them (captured at fewer sizes, so it pads further), and the tokens are the eager engine's either way, through
rows joining and leaving (RecordingGraphBackend through the real runner, CPU)."""

from unittest import mock

import pytest

from support.graph_engine import recorded_graphs
from ostinato import LLM, SamplingParams
from ostinato.runner.decode_step import processor_sizes
from ostinato.runner.logits_processors import LogitsProcessors
from ostinato.tools.checkpoint import make_checkpoint

SIZES = (1, 2, 3, 4)
PROMPTS = [[7, 8, 9], [20, 21, 22, 23], [40, 41], [55, 3, 4]]
PLAIN = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 9, 7)]
PENALIZED = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=0.5,
                           logit_bias={5: 2.0})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("processor-graphs") / "ckpt", shape="tiny", family="llama", seed=2)

    def make():
        return LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64, max_num_seqs=4)

    eager = make()
    with recorded_graphs(SIZES):
        graph = make()
    return eager, graph


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def counted(runner):
    """(graph steps without the processors, with them) so far."""
    return runner.graphs.stats.graph_steps, runner.processor_graphs.stats.graph_steps


def test_the_variant_with_processors_is_captured_at_the_powers_of_two_and_the_largest():
    assert processor_sizes(SIZES) == (1, 2, 4)
    assert processor_sizes((1, 2, 4, 8, 16, 24, 32, 40)) == (1, 2, 4, 8, 16, 32, 40)
    assert processor_sizes((3, 5)) == (5,)


def test_a_batch_without_processors_launches_none_of_their_work(engines):
    eager, graph = engines
    runner = graph.engine.runner
    before = counted(runner)
    with mock.patch.object(LogitsProcessors, "process_logits", autospec=True) as process:
        out = tokens(graph, PROMPTS[:3], PLAIN)
    assert process.call_count == 0  # neither in the decode steps nor in the prefill draw
    plain, with_processors = counted(runner)
    assert plain - before[0] == max(p.max_tokens for p in PLAIN) - 1 and with_processors == before[1]
    assert out == tokens(eager, PROMPTS[:3], PLAIN)


def test_a_row_with_processors_switches_the_graphs_while_it_runs_and_keeps_every_token(engines):
    eager, graph = engines
    runner = graph.engine.runner
    before, sizes_before = counted(runner), dict(runner.processor_graphs.stats.replays_by_size)
    params = PLAIN + [PENALIZED]
    with mock.patch.object(LogitsProcessors, "process_logits", autospec=True,
                           side_effect=LogitsProcessors.process_logits) as process:
        out = tokens(graph, PROMPTS, params)
    plain, with_processors = counted(runner)
    # The penalized row decodes max_tokens - 1 steps (its first token is the prefill's); all four rows are in
    # the batch then (4 rows: the size-4 graph). Once it left, the plain graphs run alone again.
    assert with_processors - before[1] == PENALIZED.max_tokens - 1
    assert plain - before[0] == (max(p.max_tokens for p in params) - 1) - (PENALIZED.max_tokens - 1)
    assert process.call_count == PENALIZED.max_tokens  # its prefill draw, then each of its decode steps
    replays = runner.processor_graphs.stats.replays_by_size
    assert replays.get(4, 0) - sizes_before.get(4, 0) == PENALIZED.max_tokens - 1
    assert out == tokens(eager, PROMPTS, params)
    assert out[:3] == tokens(eager, PROMPTS[:3], PLAIN)  # the plain rows as without the penalized one
    assert out[3] != tokens(eager, PROMPTS[3:], [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)])[0]


def test_a_three_row_batch_with_processors_pads_to_the_next_captured_size(engines):
    _, graph = engines
    stats = graph.engine.runner.processor_graphs.stats
    padded = stats.padded_rows
    out = tokens(graph, PROMPTS[:2] + [PROMPTS[3]], PLAIN[:2] + [PENALIZED])
    after = graph.engine.runner.processor_graphs.stats
    assert after.padded_rows - padded == PENALIZED.max_tokens - 1  # 3 rows replayed at size 4, every step
    assert len(out[2]) == PENALIZED.max_tokens
    assert graph.engine.stats().decode_steps_graph == sum(counted(graph.engine.runner))


@pytest.mark.gpu
def test_real_cuda_graphs_with_and_without_processors_give_the_eager_tokens(tmp_path):
    """The same workload on real CUDA graphs (both sets, the penalties kernel inside the second) against
    --enforce-eager on the GPU, fp32: rows with and without processors joining and leaving."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama", seed=2)
    penalized = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=0.5,
                               frequency_penalty=0.3, logit_bias={5: 2.0}, bad_words=["a"], min_p=0.1)
    params = PLAIN + [penalized]

    def make(**kw):
        return LLM(str(ckpt), device="cuda", dtype="float32", num_kv_blocks=32, max_model_len=64, max_num_seqs=4,
                   **kw)

    graph, eager = make(cuda_graph_sizes=SIZES), make(enforce_eager=True)
    assert tokens(graph, PROMPTS, params) == tokens(eager, PROMPTS, params)
    assert tokens(graph, PROMPTS[:3], PLAIN) == tokens(eager, PROMPTS[:3], PLAIN)
    runner = graph.engine.runner
    assert runner.processor_graphs.captured_sizes == (1, 2, 4)
    assert runner.processor_graphs.stats.graph_steps == penalized.max_tokens - 1
    assert runner.graphs.stats.graph_steps > 0
