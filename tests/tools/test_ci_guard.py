"""With CI set, a test dependency that does not import stops the run (conftest.py) instead of skipping tests."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_pytest(tmp_path, ci: str | None, broken: str | None):
    """pytest on one quick test of this checkout (so conftest.py applies), with `broken` shadowed by a module
    that raises on import."""
    shim = tmp_path / "shim"
    shim.mkdir()
    if broken:
        (shim / f"{broken}.py").write_text("raise ImportError('simulated broken install')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    quick = "tests/engine/test_sampling_params.py::test_greedy_is_the_one_rule_the_sampler_applies"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", quick], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_ci_fails_when_a_test_dependency_is_broken(tmp_path):
    r = run_pytest(tmp_path, "true", "openai")
    assert r.returncode != 0
    assert "openai (ImportError: simulated broken install)" in r.stdout + r.stderr


def test_without_ci_the_same_machine_runs(tmp_path):
    r = run_pytest(tmp_path, None, "openai")
    assert r.returncode == 0, r.stdout + r.stderr
