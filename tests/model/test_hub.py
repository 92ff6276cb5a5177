"""Hub ids resolve from a huggingface_hub cache this test fills itself (models--ORG--NAME/snapshots/REV,
refs/BRANCH), offline: HF_HUB_OFFLINE is set for every test, so nothing here touches the network."""

import shutil

import pytest

from ostinato import LLM, SamplingParams, cli
from ostinato.config import default_served_model_name, looks_like_hub_id
from ostinato.errors import CheckpointError, ConfigError
from ostinato.model.gguf_sources import resolve_model_dir
from ostinato.model.hub import check_tokenizer_folder
from ostinato.tools.checkpoint import make_checkpoint

MAIN = "a" * 40
OLDER = "b" * 40
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "16", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hub") / "ckpt", shape="tiny", family="llama", seed=1)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # a relative ORG/NAME folder must not exist where the test runs
    return tmp_path / "hub"


def _cache_model(cache, repo_id, ckpt, commit, ref=None):
    """Copy a checkpoint into huggingface_hub's cache layout as snapshot `commit`, named by refs/`ref`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(ckpt, snapshot)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_hub_ids_are_told_apart_from_paths():
    assert looks_like_hub_id("Qwen/Qwen3-0.6B") and looks_like_hub_id("meta-llama/Llama-3.2-1B-Instruct")
    for not_an_id in ("/abs/path", "./rel/x", "~/x/y", "a/b/c", "org/model.gguf", "smollm2-135m", "../x"):
        assert not looks_like_hub_id(not_an_id), not_an_id
    assert default_served_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert default_served_model_name("/models/qwen3") == "qwen3"


def test_hub_id_resolves_from_the_cache_at_main_and_at_a_revision(hub_cache, ckpt):
    main = _cache_model(hub_cache, "Qwen/Qwen3-0.6B", ckpt, MAIN, ref="main")
    older = _cache_model(hub_cache, "Qwen/Qwen3-0.6B", ckpt, OLDER, ref="v1")
    assert resolve_model_dir("Qwen/Qwen3-0.6B") == main
    assert resolve_model_dir("Qwen/Qwen3-0.6B", revision="v1") == older
    assert resolve_model_dir("Qwen/Qwen3-0.6B", revision=OLDER) == older


def test_hub_id_runs_through_llm_and_the_cli(hub_cache, ckpt, capsys):
    _cache_model(hub_cache, "Org/Tiny", ckpt, OLDER, ref="v1")
    llm = LLM("Org/Tiny", revision="v1", device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert llm.engine.model_dir == hub_cache / "models--Org--Tiny" / "snapshots" / OLDER
    assert llm.engine.served_model_name == "Org/Tiny"  # the id clients send as `model`, as vLLM names it
    ref = llm.generate(["Hello world"], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert cli.main(["generate", "Org/Tiny", "--revision", "v1", *ENGINE_FLAGS, "--raw", "--prompt", "Hello world",
                     "--max-tokens", "5"]) == 0
    assert f"--- prompt: 'Hello world'\n{ref.text}\n" in capsys.readouterr().out


def test_offline_without_the_model_says_what_is_missing_and_how_to_provide_it(hub_cache, capsys):
    with pytest.raises(CheckpointError) as e:
        resolve_model_dir("Qwen/Qwen3-0.6B")
    msg = str(e.value)
    assert "Qwen/Qwen3-0.6B is not in the HF cache" in msg and str(hub_cache) in msg
    assert "HF_HUB_OFFLINE is set" in msg and "hf download Qwen/Qwen3-0.6B" in msg and "local folder" in msg
    assert cli.main(["generate", "Qwen/Qwen3-0.6B", *ENGINE_FLAGS, "--prompt", "x"]) == 2
    assert "is not in the HF cache" in capsys.readouterr().err


def test_a_cached_snapshot_without_weights_names_them(hub_cache, ckpt):
    snapshot = _cache_model(hub_cache, "Org/Tiny", ckpt, MAIN, ref="main")
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lacks \*\.safetensors weights: download it"):
        resolve_model_dir("Org/Tiny")


def test_revision_of_a_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="applies to hub ids"):
        resolve_model_dir(str(tmp_path), revision="main")


def test_missing_path_and_bad_name_get_different_messages(hub_cache, tmp_path):
    with pytest.raises(CheckpointError, match="^no such file or folder: "):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="^no such file or folder: "):
        resolve_model_dir("./models/llama")
    with pytest.raises(CheckpointError, match="^unknown model name 'smollm3'"):
        resolve_model_dir("smollm3")


def test_a_folder_without_tokenizer_files_names_them(tmp_path, ckpt, capsys):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(ckpt, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="has no tokenizer files: it needs tokenizer.json or tokenizer.model"):
        check_tokenizer_folder(folder)
    check_tokenizer_folder(ckpt)  # a complete folder passes
    assert cli.main(["generate", str(folder), *ENGINE_FLAGS, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer files" in err and "Traceback" not in err and "sentencepiece" not in err


def test_without_network_the_cache_serves_and_a_missing_model_is_named(hub_cache, ckpt, monkeypatch):
    """HF_HUB_OFFLINE unset but no hub to reach (a closed local port stands for it): the cached snapshot is
    used; an uncached id says the hub cannot be reached."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    main = _cache_model(hub_cache, "Org/Tiny", ckpt, MAIN, ref="main")
    assert resolve_model_dir("Org/Tiny") == main
    with pytest.raises(CheckpointError, match="not in the HF cache .* and the hub cannot be reached"):
        resolve_model_dir("Org/Other")
