"""EngineArgs.resolve(): the flags checked against the checkpoint once and split per component; the Runner
protocol both runners satisfy; DecodeTuning reaching the attention backend through the config."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from ostinato.config import EngineArgs, EngineConfig, RunnerConfig
from ostinato.engine.engine import LLMEngine
from ostinato.errors import CheckpointError, ConfigError
from ostinato.kernels.decode_plan import DecodeTuning
from ostinato.runner.protocol import Runner
from ostinato.runner.runner import ModelRunner, make_backend
from ostinato.runner.tp_executor import TensorParallelRunner
from ostinato.tools.checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), shape="tiny", family="llama", seed=1))


def test_resolve_reads_the_checkpoint_and_splits_the_flags(checkpoint):
    tuning = DecodeTuning(block_n=32)
    config = EngineArgs(checkpoint, max_num_seqs=4, num_kv_blocks=24, block_size=8, seed=7, pdl="off",
                        decode_tuning=tuning, tensor_parallel_size=2, served_model_name="tiny").resolve(device="cpu")
    assert isinstance(config, EngineConfig) and isinstance(config.runner, RunnerConfig)
    runner = config.runner
    assert runner.model_dir == checkpoint and config.model is runner.model and config.model.family == "llama"
    assert (runner.device, runner.attention_backend, runner.pdl, runner.seed) == ("cpu", "torch", "off", 7)
    assert runner.decode_tuning is tuning
    assert (runner.kv_pool.block_size, runner.kv_pool.num_blocks) == (8, 24)
    assert config.scheduler.max_num_seqs == 4 and config.graph.enforce_eager  # CPU: eager
    assert config.parallel.tensor_parallel_size == 2 and config.served_model_name == "tiny"
    assert config.tokenizer == checkpoint and config.model_source == checkpoint
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.runner = runner  # type: ignore[misc]


def test_resolve_on_cuda_captures_and_drops_prefill_graphs_for_the_torch_backend(checkpoint):
    triton = EngineArgs(checkpoint, max_num_seqs=8).resolve(device="cuda")
    assert triton.runner.attention_backend == "triton"
    assert triton.graph.capture_sizes == (1, 2, 4, 8) and triton.graph.prefill_sizes
    torch_backend = EngineArgs(checkpoint, max_num_seqs=8, attention_backend="torch").resolve(device="cuda")
    assert torch_backend.graph.capture_sizes == (1, 2, 4, 8) and torch_backend.graph.prefill_sizes == ()


def test_resolve_says_what_is_wrong(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        EngineArgs(str(tmp_path / "missing")).resolve(device="cpu")
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        EngineArgs(checkpoint, max_model_len=10**7).resolve(device="cpu")
    with pytest.raises(ConfigError, match="decode_tuning must be an ostinato.kernels.decode_plan.DecodeTuning"):
        EngineArgs(checkpoint, decode_tuning={"block_n": 32})
    with pytest.raises(ConfigError, match="cuda or cpu"):
        EngineArgs(checkpoint).resolve()  # --device auto: only the caller, who sees torch, can pick


def test_the_engine_runs_from_a_resolved_config(checkpoint):
    config = EngineArgs(checkpoint, device="cpu", num_kv_blocks=16, max_model_len=64).resolve(device="cpu")
    engine = LLMEngine(config)
    assert engine.config is config and engine.runner.config is config.runner
    assert isinstance(engine.runner, ModelRunner) and isinstance(engine.runner, Runner)
    assert engine.runner.rank_health() == [] and engine.stats().ranks == ()
    engine.shutdown()  # a single rank has nothing to stop, and says so by not failing


def _protocol_members() -> set[str]:
    return {name for name in vars(Runner) if not name.startswith("_")} | set(Runner.__annotations__)


@pytest.mark.parametrize("cls", [ModelRunner, TensorParallelRunner])
def test_both_runners_define_every_member_of_the_protocol(cls):
    """Defined on the class itself (or set in its constructor), not reached through __getattr__ by chance."""
    source = inspect.getsource(cls)
    missing = [name for name in _protocol_members()
               if not hasattr(cls, name) and f"self.{name} =" not in source and f"self.{name}:" not in source]
    assert missing == []


def test_decode_tuning_reaches_the_triton_backend_with_pdl_from_the_flag():
    tuning = DecodeTuning(block_n=32, pdl=True)
    backend = make_backend("triton", torch.device("cuda"), "off", tuning)
    assert backend.tuning.decode == dataclasses.replace(tuning, pdl=False)  # --pdl off wins over the field
    assert make_backend("triton", torch.device("cuda"), "off").tuning.decode == DecodeTuning(pdl=False)
