"""The engine's graph decode path on CPU (RecordingGraphBackend through the real runner): a batch padded up to
a captured size gives the same tokens as eager, and its padded rows write K/V only into the scratch block,
never into a real sequence's slots."""

import pytest
import torch

from support.graph_engine import kv_pool, recorded_graphs
from ostinato import LLM, SamplingParams
from ostinato.tools.checkpoint import make_checkpoint

SIZES = (1, 2, 4, 8)
NUM_BLOCKS = 8  # every block is in use at some point: a padded write into any real slot is seen
# Five sequences (padded to 8), finishing one after another: batches 5, 4, 3 (padded to 4), 2 and 1.
PROMPTS = [[7, 8, 9], [20, 21, 22, 23, 24], [40] * 17, [55, 3], [99, 98, 97, 96]]
MAX_TOKENS = [6, 9, 12, 15, 20]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("graph-path") / "ckpt", shape="tiny", family="llama", seed=3)


def make_llm(checkpoint, **kw):
    return LLM(str(checkpoint), dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=64, max_num_seqs=8, **kw)


def run(llm):
    """Greedy token ids of PROMPTS, submitted together (so decode batches shrink as they finish)."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def eager_and_graph(checkpoint):
    eager = make_llm(checkpoint, device="cpu")
    with recorded_graphs(SIZES):
        graph = make_llm(checkpoint, device="cpu")
    # The start-up self-check wrote K/V into real blocks and the scratch block (before any sequence held KV);
    # clear the pool so that both engines start from the same zeroed cache and the scratch block shows only
    # what decode steps write there.
    for k, v in kv_pool(graph.engine):
        k.zero_(), v.zero_()
    return eager.engine, run(eager), graph.engine, run(graph)


def test_graph_path_is_active_and_pads(eager_and_graph):
    eager, _, graph, _ = eager_and_graph
    st = graph.stats()
    assert st.graphs_enabled and st.captured_sizes == SIZES and graph.graph_status == "active (4 sizes, 1..8)"
    assert st.decode_steps_eager == 0 and st.decode_steps_graph > 0
    assert st.replays_by_size.keys() == {1, 2, 4, 8}
    assert st.padded_rows > 0  # 5 -> 8 and 3 -> 4 at least
    assert eager.stats().decode_steps_graph == 0


def test_padded_graph_steps_give_the_eager_tokens(eager_and_graph):
    _, eager_out, _, graph_out = eager_and_graph
    assert graph_out == eager_out
    assert [len(ids) for ids in graph_out] == MAX_TOKENS


def test_padded_rows_write_only_the_scratch_block(eager_and_graph):
    eager, _, graph, _ = eager_and_graph
    # Same requests, same deterministic block allocation: every real block holds the same K/V both ways.
    for (ke, ve), (kg, vg) in zip(kv_pool(eager), kv_pool(graph)):
        torch.testing.assert_close(kg[:NUM_BLOCKS], ke[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vg[:NUM_BLOCKS], ve[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)
    # ... and the padded rows did write somewhere: the scratch block, which eager never touches.
    assert any(k[-1].abs().sum() > 0 for k, _ in kv_pool(graph))
    assert all(k[-1].abs().sum() == 0 for k, _ in kv_pool(eager))


@pytest.mark.gpu
def test_real_cuda_graphs_pad_into_the_scratch_block_only(checkpoint):
    """The same check with real CUDA graphs (the Triton backend) against --enforce-eager on the GPU, fp32."""
    graph_llm = make_llm(checkpoint, device="cuda", cuda_graph_sizes=SIZES)
    eager_llm = make_llm(checkpoint, device="cuda", enforce_eager=True)
    graph, eager = graph_llm.engine, eager_llm.engine
    for k, v in kv_pool(graph):
        k.zero_(), v.zero_()
    assert run(graph_llm) == run(eager_llm)
    st = graph.stats()
    assert st.decode_steps_eager == 0 and st.padded_rows > 0 and st.captured_sizes == SIZES
    for (ke, ve), (kg, vg) in zip(kv_pool(eager), kv_pool(graph)):
        torch.testing.assert_close(kg[:NUM_BLOCKS], ke[:NUM_BLOCKS], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vg[:NUM_BLOCKS], ve[:NUM_BLOCKS], rtol=1e-4, atol=1e-4)
    assert any(k[-1].abs().sum() > 0 for k, _ in kv_pool(graph))
