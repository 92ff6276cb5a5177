"""scripts/setup.sh: what it installs where (its --plan line), and its torch resolution on this CPU machine (a
pip dry run, as on an empty environment): torch's CPU build, no nvidia-* package, no triton."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="setup.sh is a bash script")


def run_setup(*args: str, gpu: str, ci: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(OSTINATO_SETUP_GPU=gpu, PYTHON=sys.executable)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(["bash", str(SETUP), *args], env=env, capture_output=True, text=True, timeout=timeout)


PLANS = [
    ("0", None, [], "[test]"),  # a CPU machine: no triton (about 1 GB it would not use)
    ("0", "true", [], "[test,triton]"),  # CI on CPU runs the Triton kernels in the interpreter
    ("0", None, ["--triton"], "[test,triton]"),
    ("1", None, [], "[test,triton]"),  # a GPU machine runs the Triton kernels
    ("1", None, ["--no-triton"], "[test]"),
]


@pytest.fixture(scope="module")
def plans():
    """Each case's --plan run, all started together: each spends its seconds in the script's `import torch`,
    which two cores do side by side."""
    with ThreadPoolExecutor(len(PLANS)) as pool:
        return list(pool.map(lambda case: run_setup(*case[2], "--plan", gpu=case[0], ci=case[1]), PLANS))


@pytest.mark.parametrize("case", range(len(PLANS)), ids=["-".join([f"gpu{g}", f"ci{c}", *f]) for g, c, f, _ in PLANS])
def test_triton_is_installed_where_it_is_used(plans, case):
    gpu, _, _, extras = PLANS[case]
    r = plans[case]
    assert r.returncode == 0, r.stderr
    assert f"setup: GPU={gpu}, " in r.stdout and f"then ostinato -e .{extras}\n" in r.stdout


def test_an_unknown_option_is_refused_by_name():
    r = run_setup("--cuda", gpu="0")
    assert r.returncode == 2 and "unknown option --cuda" in r.stderr


@pytest.mark.slow
def test_the_cpu_resolution_pulls_no_cuda_package(tmp_path):
    report = tmp_path / "report.json"
    r = run_setup("--dry-run", str(report), gpu="0", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    installs = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    assert "torch" in installs and "+cu" not in installs["torch"], installs
    assert not [name for name in installs if name.startswith("nvidia-")], installs
    assert "triton" not in installs
