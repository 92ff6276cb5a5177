"""`serve`'s watchdog and shutdown flags: their defaults (as the README states them), 'none', and values that are
refused before anything starts."""

import argparse

import pytest

pytest.importorskip("uvicorn")

from ostinato import serve_command  # noqa: E402
from ostinato.errors import ConfigError  # noqa: E402


def parse(*flags):
    parser = argparse.ArgumentParser()
    serve_command.register(parser.add_subparsers())
    return parser.parse_args(["serve", "m", *flags])


def test_defaults_and_none():
    ns = parse()
    assert (ns.engine_stall_timeout, ns.engine_kill_timeout, ns.shutdown_timeout) == (60.0, 120.0, 20.0)
    ns = parse("--engine-stall-timeout", "none", "--engine-kill-timeout", "None", "--shutdown-timeout", "0")
    assert (ns.engine_stall_timeout, ns.engine_kill_timeout, ns.shutdown_timeout) == (None, None, 0.0)


@pytest.mark.parametrize("flags", [("--engine-stall-timeout", "0"), ("--engine-kill-timeout", "-1"),
                                   ("--shutdown-timeout", "-1"), ("--engine-stall-timeout", "soon")])
def test_bad_values_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*flags)
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err


def test_a_kill_bound_below_the_stall_bound_is_refused_before_the_engine_starts():
    ns = parse("--engine-stall-timeout", "10", "--engine-kill-timeout", "5")
    with pytest.raises(ConfigError, match="--engine-kill-timeout"):
        serve_command.run(ns, engine_factory=None)


def test_the_readme_states_the_defaults():
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert "`--engine-stall-timeout` seconds (60)" in readme
    assert "`--engine-kill-timeout` (120)" in readme and "`--shutdown-timeout` seconds (20" in readme


def test_the_event_loop_is_uvloop_where_installed_and_asyncio_on_request():
    import uvloop

    assert parse().loop == "auto"
    assert serve_command.event_loop_factory("auto") is uvloop.new_event_loop
    assert serve_command.event_loop_factory("uvloop") is uvloop.new_event_loop
    assert serve_command.event_loop_factory("asyncio") is None


def test_without_uvloop_auto_falls_back_and_asking_for_it_says_what_to_do(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert serve_command.event_loop_factory("auto") is None
    with pytest.raises(ConfigError, match="pip install uvloop.*--loop asyncio"):
        serve_command.event_loop_factory("uvloop")
