"""The import contracts in pyproject.toml (`lint-imports`, run by .ci/run) hold on this tree, and they are able
to fail: a back-import planted in a copy of src/ breaks them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over root/src with root/pyproject.toml's contracts, as .ci/run runs it."""
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run([sys.executable, "-c", command, "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def copy_of_the_tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_import_contract():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module,planted,broken", [
    ("kernels/pdl.py", "import ostinato.runner.sampler", "ostinato.kernels.pdl -> ostinato.runner.sampler"),
    ("engine/scheduler.py", "import torch", "ostinato.engine.scheduler -> torch"),
    ("errors.py", "import ostinato.engine.outputs", "ostinato.errors -> ostinato.engine.outputs"),
    ("engine/outputs.py", "import ostinato.cli_args", "ostinato.engine.outputs -> ostinato.cli_args"),
])
def test_a_planted_back_import_breaks_a_contract(tmp_path, module, planted, broken):
    tree = copy_of_the_tree(tmp_path)
    path = tree / "src" / "ostinato" / module
    path.write_text(path.read_text() + f"\n{planted}  # planted by the test\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert broken in result.stdout, result.stdout + result.stderr
