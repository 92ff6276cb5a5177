"""With CI set, a test dependency that does not import stops the run (conftest.py) instead of skipping tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The dependency shadowed as broken: the slowest of conftest.CI_REQUIRED_MODULES to import (it pulls in
# transformers), so the CI run, which imports the rest, spends no seconds on it.
BROKEN = "compressed_tensors"


def start_pytest(tmp_path, ci: str | None) -> subprocess.Popen:
    """pytest on one quick test of this checkout (so conftest.py applies), with BROKEN shadowed by a module that
    raises on import."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / f"{BROKEN}.py").write_text("raise ImportError('simulated broken install')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    quick = "tests/engine/test_sampling_params.py::test_greedy_is_the_one_rule_the_sampler_applies"
    # -n 0: one test needs no worker processes (the configuration would start one per core).
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", quick]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(returncode, output) of the run with CI=true and of the one without CI, started together: each spends
    seconds importing torch, which two cores do side by side."""
    procs = {ci: start_pytest(tmp_path_factory.mktemp(f"ci-{ci}"), ci) for ci in ("true", None)}
    outs = {ci: p.communicate(timeout=120) for ci, p in procs.items()}
    return {ci: (procs[ci].returncode, out + err) for ci, (out, err) in outs.items()}


def test_ci_fails_when_a_test_dependency_is_broken(runs):
    code, output = runs["true"]
    assert code != 0
    assert f"{BROKEN} (ImportError: simulated broken install)" in output


def test_without_ci_the_same_machine_runs(runs):
    code, output = runs[None]
    assert code == 0, output
