"""FP8 is visible to operators: /v1/models names the weights' scheme, /metrics gives the weights' bytes with it and the
KV cache's element type."""

from contextlib import contextmanager

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.kernels.fp8_linear import Fp8Linear
from test_server import TestServer


@contextmanager
def _served(tmp_path, **engine_args):
    from ostinato.tools.checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "ckpt", shape="tiny", seed=2)
    engine = LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16,
                                  max_model_len=64, **engine_args))
    server = TestServer(engine)
    try:
        yield engine, server
    finally:
        server.stop()


def _metric(server, name: str) -> tuple[dict, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    sample = next(s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)
    return sample.labels, sample.value


@pytest.mark.parametrize("quantization,label", [(None, "none"), ("fp8", "fp8-at-load")])
def test_models_and_metrics_name_the_weights(quantization, label, tmp_path):
    with _served(tmp_path, quantization=quantization) as (engine, server):
        models = httpx.get(server.base_url + "/v1/models", headers=server.headers, timeout=30).json()
        assert models["data"][0]["quantization"] == label
        labels, value = _metric(server, "ostinato:model_weights_bytes")
        assert labels["quantization"] == label and value == engine.runner.weights_bytes > 0
        fp8 = [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]
        assert bool(fp8) == (quantization == "fp8")


@pytest.mark.parametrize("kv_cache_dtype,label", [("auto", "float32"), ("fp8", "float8_e4m3fn")])
def test_metrics_name_the_kv_cache_dtype(kv_cache_dtype, label, tmp_path):
    with _served(tmp_path, kv_cache_dtype=kv_cache_dtype) as (engine, server):
        labels, value = _metric(server, "ostinato:cache_config_info")
        assert labels["cache_dtype"] == label and value == 1
        assert labels["block_size"] == str(engine.runner.block_size)
