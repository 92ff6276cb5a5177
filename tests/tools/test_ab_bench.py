"""benchmarks/step/ab.py, the alternated whole-step comparison: its variants, the environment each runs in, and the
table it prints (the benches themselves are `ostinato bench`, tested on their own; a run by hand on a CPU
checkpoint is in the script's docstring's form)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "benchmarks" / "step" / "ab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_variant_is_flags_a_tree_or_both(ab):
    assert ab.parse_variant("main=") == ab.Variant("main", ())
    assert ab.parse_variant("""qo=--decode-tuning '{"quantize_output": true}'""") == \
        ab.Variant("qo", ("--decode-tuning", '{"quantize_output": true}'))
    src = str(ROOT / "src")
    assert ab.parse_variant(f"tree=@{src} --quantization fp8") == ab.Variant("tree", ("--quantization", "fp8"), src)
    with pytest.raises(argparse.ArgumentTypeError, match="holds no ostinato package"):
        ab.parse_variant(f"tree=@{ROOT}")
    with pytest.raises(argparse.ArgumentTypeError, match="a variant is NAME=FLAGS"):
        ab.parse_variant("--quantization fp8")


def test_a_tree_goes_first_on_the_path_and_flags_after_the_common_ones(ab, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    tree = ab.Variant("t", ("--pdl", "off"), str(ROOT / "src"))
    assert ab.variant_env(tree)["PYTHONPATH"] == os.pathsep.join([str(ROOT / "src"), "elsewhere"])
    assert ab.variant_env(ab.Variant("m", ()))["PYTHONPATH"] == "elsewhere"
    command = ab.bench_command("M", ["--no-hf"], tree, "out.json")
    assert command[1:] == ["-m", "ostinato", "bench", "M", "--no-hf", "--pdl", "off", "--output-json", "out.json"]


def test_rounds_alternate_and_the_table_sets_each_median_over_the_first_variants(ab, monkeypatch, capsys):
    order = []
    steps = {"a": [2.0, 2.2, 2.1], "b": [1.0, 1.2, 1.05]}

    def run_once(model, common, variant, timeout):
        order.append(variant.name)
        ms = steps[variant.name][order.count(variant.name) - 1]
        return {"rows": [{"batch": 1, "graph_ms": ms, "eager_ms": 9.0}, {"batch": 8, "graph_ms": None,
                                                                          "eager_ms": 2 * ms}]}

    monkeypatch.setattr(ab, "run_once", run_once)
    assert ab.main(["M", "--rounds", "3", "--variant", "a=", "--variant", "b=--pdl off"]) == 0
    assert order == ["a", "b"] * 3
    lines = capsys.readouterr().out.splitlines()
    assert "a                            1     2.100   1.000  2.000 / 2.200 / 2.100" in lines
    assert "b                            1     1.050   0.500  1.000 / 1.200 / 1.050" in lines
    assert "b                            8     2.100   0.500  2.000 / 2.400 / 2.100" in lines  # eager where no graph


def test_one_variant_or_a_name_twice_is_refused(ab, capsys):
    for variants in (["--variant", "a="], ["--variant", "a=", "--variant", "a=--pdl off"]):
        with pytest.raises(SystemExit):
            ab.main(["M", *variants])
        assert "at least two variants, each its own name" in capsys.readouterr().err
