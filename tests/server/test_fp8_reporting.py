"""FP8 weights are visible to operators: /v1/models names the scheme, /metrics gives the weights' bytes with it."""

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
