"""`ostinato bench --penalty-rows N`: the timed steps with N rows using repetition_penalty replay the decode
graphs with the logits processors, those without replay the others (RecordingGraphBackend, CPU)."""

import torch

from support.graph_engine import recorded_graphs
from ostinato import LLM
from ostinato.tools.bench.decode import replay_ms_seeded, rows_loaded
from ostinato.tools.checkpoint import make_checkpoint


def test_penalty_rows_time_the_graphs_with_the_logits_processors(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama", seed=0)
    with recorded_graphs((1, 2, 4)):
        runner = LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64,
                     max_num_seqs=4).engine.runner
    with torch.inference_mode():
        with rows_loaded(runner, 3, 8, torch.Generator().manual_seed(0), penalty_rows=1):
            assert runner.step_graphs() is runner.processor_graphs
        assert runner.step_graphs() is runner.graphs  # the rows left: no processor in use
        replay_ms_seeded(runner, 3, 8, seed=1, iters=2, warmup=1, penalty_rows=1)
        assert runner.processor_graphs.stats.replays_by_size == {4: 3}
        assert runner.graphs.stats.graph_steps == 0
        replay_ms_seeded(runner, 3, 8, seed=1, iters=2, warmup=1)
        assert runner.graphs.stats.replays_by_size == {4: 3}
