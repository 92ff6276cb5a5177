"""`make-checkpoint --format gguf`: a GGUF file the gguf library reads back, its types following --gguf-type (the _M
recipe's extra bits; llama.cpp's fallbacks where a row is too short for a k-quant), the same bytes for a seed."""

import argparse
from collections import Counter

import pytest

gguf = pytest.importorskip("gguf")

from ostinato.tools import checkpoint as ck  # noqa: E402


def _run(argv):
    parser = argparse.ArgumentParser(prog="ostinato")
    ck.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def _types(path):
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_q4_k_m_mix_and_its_report(tmp_path, capsys):
    assert _run(["make-checkpoint", str(tmp_path / "a"), "--shape", "tiny-256", "--format", "gguf",
                 "--gguf-type", "Q4_K_M", "--quiet"]) == 0
    assert "Q4_K_M -> " in capsys.readouterr().out
    types = _types(tmp_path / "a" / "model.gguf")
    assert types["output.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert (types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]) == ("Q4_K", "Q6_K")  # last eighth: more bits
    assert types["blk.1.ffn_down.weight"] == "Q6_K" and types["output_norm.weight"] == "F32"
    assert Counter(types.values()) == {"Q4_K": 13, "Q6_K": 3, "F32": 5}


def test_short_rows_fall_back_and_a_seed_gives_the_same_file(tmp_path):
    for name in ("a", "b"):
        ck.make_gguf_checkpoint(tmp_path / name, "tiny", gguf_type="Q4_K_M", seed=5)
    types = _types(tmp_path / "a" / "model.gguf")  # hidden 64: no k-quant row fits
    assert set(types.values()) == {"Q5_0", "Q8_0", "F32"}
    assert (tmp_path / "a" / "model.gguf").read_bytes() == (tmp_path / "b" / "model.gguf").read_bytes()


def test_an_unknown_type_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _run(["make-checkpoint", str(tmp_path), "--format", "gguf", "--gguf-type", "Q3_K_S"])
    assert "--gguf-type: invalid choice" in capsys.readouterr().err
