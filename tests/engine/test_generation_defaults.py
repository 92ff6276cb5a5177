"""--generation-config: the model's generation_config.json gives the defaults of what a request leaves unset
(auto), or is ignored (vllm), or comes from another folder; they are logged at start-up, and LLM.generate
without sampling_params runs on them."""

import json
import logging
import shutil

import pytest

from ostinato import LLM, SamplingParams
from ostinato.config import EngineArgs
from ostinato.errors import ConfigError
from ostinato.tools.checkpoint import make_checkpoint

GENERATION = {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 5,
              "eos_token_id": 2, "do_sample": True}
EXPECTED = {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.3, "max_tokens": 5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("gen-defaults") / "ckpt", shape="tiny", family="llama", seed=2)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


def resolved(checkpoint, **kw):
    return EngineArgs(model=str(checkpoint), device="cpu", **kw).resolve()


def test_auto_reads_the_model_s_file_and_vllm_ignores_it(checkpoint):
    assert resolved(checkpoint).generation_defaults == EXPECTED
    assert resolved(checkpoint, generation_config="vllm").generation_defaults == {}


def test_a_folder_gives_its_own_file(checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20, "min_p": 0.05}))
    assert resolved(checkpoint, generation_config=str(tmp_path)).generation_defaults == {"top_k": 20, "min_p": 0.05}


def test_a_missing_folder_or_a_bad_value_is_a_clear_error(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--generation-config .*does not exist"):
        resolved(checkpoint, generation_config=str(tmp_path / "nowhere"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(ConfigError, match="top_p must be"):
        resolved(checkpoint, generation_config=str(tmp_path))


def test_a_model_without_the_file_has_no_defaults(checkpoint, tmp_path):
    copy = shutil.copytree(checkpoint, tmp_path / "copy")
    (copy / "generation_config.json").unlink()
    assert resolved(copy).generation_defaults == {}


def test_offline_generate_runs_on_the_defaults_and_logs_them(checkpoint, caplog):
    with caplog.at_level(logging.INFO):
        llm = LLM(str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert any("sampling defaults from" in r.message and "repetition_penalty=1.3" in r.message
               for r in caplog.records)
    assert llm.get_default_sampling_params() == SamplingParams(**EXPECTED)
    out = llm.generate(["Hello world"])[0].outputs[0]
    explicit = llm.generate(["Hello world"], SamplingParams(**EXPECTED))[0].outputs[0]
    assert len(out.token_ids) <= 5 and out.token_ids == explicit.token_ids
