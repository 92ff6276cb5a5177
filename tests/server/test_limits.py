"""Limits below the server: SamplingParams refuses garbage values (so the offline API does too), the server's
limits, the KV self-check's cost, and the CLI and README keeping their word. No model is loaded here."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ostinato import cli
from ostinato.errors import ConfigError, InvalidRequestError
from ostinato.runner import decode_graph_check
from ostinato.runner.decode_batch import BLOCKS, POS, DecodeLayout
from ostinato.sampling_params import SamplingParams

README = Path(__file__).resolve().parents[2] / "README.md"


# ---- SamplingParams -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=1e39), "temperature"),  # inf in float32
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=math.inf), "top_p"),
    (dict(top_p=1e-46), "top_p"),  # 0 in float32
    (dict(temperature=True), "temperature"),
    (dict(n=True), "n"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=2.0), "top_k"),
    (dict(stop_token_ids=(True,)), "stop_token_ids"),
])
def test_sampling_params_refuse_garbage(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in str(info.value)


def test_sampling_params_keep_valid_edges():
    SamplingParams(temperature=0.0, top_p=1e-30)  # tiny but positive in float32
    SamplingParams(temperature=1e-30, top_p=1.0)  # below the sampler's greedy threshold: greedy, not garbage
    SamplingParams(temperature=1e30)


# ---- server limits ------------------------------------------------------------------------------------------
def test_limits_follow_max_model_len():
    limits_mod = pytest.importorskip("ostinato.server.limits")
    limits = limits_mod.ServerLimits()
    assert limits.prompt_tokens(4096) == 4095
    assert limits.prompt_chars(4096) == limits_mod.CHARS_PER_TOKEN * 4095
    assert limits.body_bytes(4096) > limits_mod.JSON_BYTES_PER_CHAR * limits.prompt_chars(4096)
    explicit = limits_mod.ServerLimits(max_prompt_tokens=100, max_prompt_chars=50, max_body_bytes=1000)
    assert (explicit.prompt_tokens(4096), explicit.prompt_chars(4096), explicit.body_bytes(4096)) == (100, 50, 1000)
    assert explicit.prompt_tokens(64) == 63  # never above the model's own limit
    with pytest.raises(InvalidRequestError, match="at most 50"):
        explicit.check_prompt_chars(51, 4096)
    with pytest.raises(ConfigError, match="--max-n"):
        limits_mod.ServerLimits(max_n=0)


# ---- the KV self-check --------------------------------------------------------------------------------------
class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_self_check_inputs_cost_nothing_per_block():
    """A pool of millions of tiny blocks: the random block tables must not cost O(num_blocks) per row (one
    randperm(num_blocks) per row ran an H200 out of memory)."""
    spec = SimpleNamespace(block_size=16, device=torch.device("cpu"), model_config=SimpleNamespace(vocab_size=1000))
    num_blocks = 5_000_000
    layout = DecodeLayout(rows=8, blocks_per_seq=32, block_size=16, scratch_block=num_blocks)
    with _LargestTensor() as mode:
        rows = decode_graph_check.random_decode_rows(spec, layout, 8)["batch"]
    tables = rows[:, BLOCKS:]
    assert tables.shape == (8, 32) and tables.dtype == torch.int32
    assert 0 <= int(tables.min()) and int(tables.max()) < num_blocks  # real blocks (see the test below)
    assert mode.largest <= 8 * layout.width, f"an op built a tensor of {mode.largest} elements"
    small_layout = DecodeLayout(rows=4, blocks_per_seq=32, block_size=16, scratch_block=3)
    small = decode_graph_check.random_decode_rows(spec, small_layout, 4)["batch"][:, BLOCKS:]  # fewer blocks than a row
    assert small.shape == (4, 32) and int(small.max()) <= 3


@pytest.mark.parametrize("num_blocks,size", [(1000, 64), (40, 32), (8, 8), (3, 8), (1, 4)])
def test_self_check_rows_never_read_what_another_row_writes(num_blocks, size):
    """Rows run concurrently on a GPU: a row that read a slot another row writes in the same step would see
    either value, and eager and replay would disagree for no fault of the graph (seen on the H200 at batch 8).
    Each row's written slot must be outside every other row's read set, unless the two rows are identical."""
    spec = SimpleNamespace(block_size=4, device=torch.device("cpu"), model_config=SimpleNamespace(vocab_size=50))
    layout = DecodeLayout(rows=size, blocks_per_seq=6, block_size=4, scratch_block=num_blocks)
    for seed in range(20):
        torch.manual_seed(seed)
        rows = decode_graph_check.random_decode_rows(spec, layout, size)["batch"]
        pos = rows[:, POS].tolist()
        tables = rows[:, BLOCKS:].tolist()
        assert max(max(t) for t in tables) < num_blocks  # real blocks only: the scratch block is for pad rows
        written = [tables[r][p // 4] * 4 + p % 4 for r, p in enumerate(pos)]
        for r, p in enumerate(pos):
            reads = {tables[r][q // 4] * 4 + q % 4 for q in range(p + 1)}
            for other, slot in enumerate(written):
                if other != r and slot in reads:
                    assert rows[other].tolist() == rows[r].tolist(), (seed, r, other)


# ---- the CLI keeps its word ---------------------------------------------------------------------------------
def test_log_level_before_or_after_the_command():
    parser = cli.build_parser()
    assert parser.parse_args(["make-checkpoint", "/tmp/x", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "error", "make-checkpoint", "/tmp/x"]).log_level == "ERROR"
    assert parser.parse_args(["make-checkpoint", "/tmp/x"]).log_level == "INFO"


def test_invalid_log_level_is_a_clear_error(capsys):
    for argv in (["--log-level", "loud", "make-checkpoint", "/tmp/x"], ["make-checkpoint", "/tmp/x", "--log-level",
                                                                          "loud"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "invalid log level 'loud'" in err and "DEBUG" in err and "Traceback" not in err


def test_help_spells_bench_serve_as_the_readme_does(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert re.search(r"^\s+bench serve\s", out, re.M), out
    assert "ostinato bench serve" in README.read_text()
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--help"])
    assert capsys.readouterr().out.startswith("usage: ostinato bench serve")


def test_serve_without_fastapi_says_what_to_install(monkeypatch, capsys):
    for name in [m for m in sys.modules if m.startswith(("ostinato.server", "ostinato.serve_command"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    assert cli.main(["serve", "/tmp/some-model", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "`ostinato serve` needs the Python package 'fastapi'" in err and "pip install" in err


def _all_options() -> set[str]:
    parser = cli.build_parser()
    options = set(parser._option_string_actions)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in sub.choices.values():
        options |= set(command._option_string_actions)
    return options


def test_every_flag_the_readme_names_exists():
    flag = r"(?<![\w-])--[a-z][a-z0-9-]+"
    named = set(re.findall(flag, README.read_text()))
    # The set-up section names scripts/setup.sh's own flags and the pip flags it passes on.
    setup = set(re.findall(flag, (README.parent / "scripts" / "setup.sh").read_text()))
    assert named - _all_options() - setup == set()


def test_readme_states_the_default_capture_sizes():
    from ostinato.config import default_capture_sizes

    assert default_capture_sizes(256)[:6] == (1, 2, 4, 8, 16, 24)
    assert "1, 2, 4, then every multiple of 8" in README.read_text()
