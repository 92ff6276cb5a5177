"""Size limits that keep the code readable: no module in src/ over MAX_MODULE_LINES lines, no function over
MAX_FUNCTION_LINES lines except Triton kernel bodies (a kernel is one launch: splitting it costs registers or a
launch, and its helpers are @triton.jit functions inlined anyway), and no line of the repository's Python over
MAX_LINE characters."""

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MAX_LINE = 120


def is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated @triton.jit, @jit or @_jit (kernels/triton_optional.py's jit), called or not."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("jit", "_jit"):
            return True
    return False


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`name (lines)` for each function or method (nested ones too) longer than `limit` lines, from its `def`
    to its last line, Triton kernels left out."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{node.name} ({length} lines, line {node.lineno})")
    return found


def python_files() -> list[Path]:
    """The repository's Python files, tracked or new (git's view: ignored folders, such as a local virtual
    environment, left out)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in out.split() if (ROOT / name).is_file()]


def sources() -> list[Path]:
    """The package's modules."""
    return sorted(p for p in python_files() if p.is_relative_to(SRC))


def test_no_module_is_over_the_line_limit():
    too_long = [f"{p.relative_to(SRC)} ({n} lines)" for p in sources()
                if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(too_long)


def test_no_function_is_over_the_line_limit():
    too_long = [f"{p.relative_to(SRC)}: {f}" for p in sources() for f in long_functions(p.read_text())]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)


def test_the_function_check_counts_lines_and_spares_only_kernels():
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    source = (f"def short():\n{body}\n"
              f"class A:\n    def method(self):\n    {body.replace(chr(10) + '    ', chr(10) + '        ')}\n"
              f"@triton.jit\ndef kernel():\n{body}\n@_jit\ndef helper():\n{body}\n"
              f"@functools.cache\ndef cached():\n{body}")
    assert long_functions(source, limit=6) == []
    assert sorted(f.split(", line")[0] for f in long_functions(source, limit=5)) == [
        "cached (6 lines", "method (6 lines", "short (6 lines"]


def test_no_line_is_over_the_character_limit():
    files = python_files()
    assert ROOT / "src" / "ostinato" / "engine" / "scheduler.py" in files and Path(__file__).resolve() in files
    too_long = [f"{p.relative_to(ROOT)}:{i} ({len(line)} characters)" for p in files
                for i, line in enumerate(p.read_text(encoding="utf-8").split("\n"), 1) if len(line) > MAX_LINE]
    assert not too_long, f"lines over {MAX_LINE} characters:\n" + "\n".join(too_long)
