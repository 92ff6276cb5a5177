"""FP8 is visible to operators: /v1/models names the weights' scheme, /metrics gives the weights' bytes with it and the
KV cache's element type."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.kernels.fp8_linear import Fp8Linear
from test_server import TestServer


def _weights_metric(server) -> tuple[dict, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    sample = next(s for fam in text_string_to_metric_families(text) for s in fam.samples
                  if s.name == "ostinato:model_weights_bytes")
    return sample.labels, sample.value


@pytest.mark.parametrize("quantization,label", [(None, "none"), ("fp8", "fp8-at-load")])
def test_models_and_metrics_name_the_weights(quantization, label, tmp_path):
    from ostinato.tools.checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "ckpt", shape="tiny", seed=2)
    engine = LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16,
                                  max_model_len=64, quantization=quantization))
    server = TestServer(engine)
    try:
        models = httpx.get(server.base_url + "/v1/models", headers=server.headers, timeout=30).json()
        assert models["data"][0]["quantization"] == label
        labels, value = _weights_metric(server)
        assert labels["quantization"] == label and value == engine.runner.weights_bytes > 0
        fp8 = [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]
        assert bool(fp8) == (quantization == "fp8")
    finally:
        server.stop()


@pytest.mark.parametrize("kv_cache_dtype,label", [("auto", "float32"), ("fp8", "float8_e4m3fn")])
def test_metrics_name_the_kv_cache_dtype(kv_cache_dtype, label, tmp_path):
    from ostinato.tools.checkpoint import make_checkpoint

    path = make_checkpoint(tmp_path / "ckpt", shape="tiny", seed=2)
    engine = LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16,
                                  max_model_len=64, kv_cache_dtype=kv_cache_dtype))
    server = TestServer(engine)
    try:
        text = httpx.get(server.base_url + "/metrics", timeout=30).text
        sample = next(s for fam in text_string_to_metric_families(text) for s in fam.samples
                      if s.name == "ostinato:cache_config_info")
        assert sample.labels["cache_dtype"] == label and sample.value == 1
        assert sample.labels["block_size"] == str(engine.runner.block_size)
    finally:
        server.stop()
