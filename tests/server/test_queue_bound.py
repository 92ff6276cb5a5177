"""`ostinato serve` bounds its waiting queue by default (a public server answers 429 rather than letting clients
wait unbounded under a full KV cache); the offline commands do not; --help and the README state the same bound."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ostinato import cli
from ostinato.cli_args import engine_args_from
from ostinato.config import SERVER_MAX_QUEUED_REQUESTS
from ostinato.errors import ConfigError

README = Path(__file__).resolve().parents[2] / "README.md"


def _engine_args(argv: list[str]):
    return engine_args_from(cli.build_parser().parse_args(argv))


def test_serve_bounds_the_waiting_queue_by_default():
    assert SERVER_MAX_QUEUED_REQUESTS is not None and SERVER_MAX_QUEUED_REQUESTS >= 16  # at least the default --max-n
    assert _engine_args(["serve", "/tmp/m"]).max_queued_requests == SERVER_MAX_QUEUED_REQUESTS
    assert _engine_args(["serve", "/tmp/m", "--max-queued-requests", "8"]).max_queued_requests == 8
    assert _engine_args(["serve", "/tmp/m", "--max-queued-requests", "none"]).max_queued_requests is None


def test_offline_commands_queue_without_bound():
    assert _engine_args(["generate", "/tmp/m", "--prompt", "hi"]).max_queued_requests is None


def test_a_queue_bound_below_one_is_refused(capsys):
    with pytest.raises(ConfigError, match="--max-queued-requests must be >= 1"):
        _engine_args(["serve", "/tmp/m", "--max-queued-requests", "0"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "/tmp/m", "--max-queued-requests", "many"])
    assert "expected an integer or 'none'" in capsys.readouterr().err


def test_help_and_readme_state_the_same_bound(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default: {SERVER_MAX_QUEUED_REQUESTS}," in help_text and "429" in help_text
    readme = " ".join(README.read_text().split())
    assert re.search(rf"`--max-queued-requests` \({SERVER_MAX_QUEUED_REQUESTS} waiting sequences", readme)
