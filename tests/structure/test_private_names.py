"""No module reaches into another module's private names (import-linter sees modules, not names): neither
`from ostinato.x import _y` nor `x._y` on a module imported from ostinato, nor a private module's import."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = SRC.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_aliases(tree: ast.Module) -> dict[str, str]:
    """Local names bound to ostinato modules: `import ostinato.x as m`, `from ostinato import x`."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ostinato"):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or "ostinato"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ostinato"):
            for alias in node.names:
                if is_module(f"{node.module}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def private_uses(source: str, own: str) -> list[str]:
    """`line: what` for each use in `source` (module `own`) of another ostinato module's private name."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ostinato"):
            if node.module != own:
                found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if is_private(a.name)]
                if any(is_private(part) for part in node.module.split(".")):
                    found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.startswith("ostinato") and any(is_private(p) for p in a.name.split("."))]
    aliases = module_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            base = dotted(node.value)
            if base is None:
                continue
            head, _, rest = base.partition(".")
            if head in aliases:
                target = ".".join(filter(None, [aliases[head], rest]))
                if target != own and is_module(target):
                    found.append(f"{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        own = module_name(path)
        offenders += [f"{path.relative_to(SRC)}:{use}" for use in private_uses(path.read_text(), own)]
    assert not offenders, "private names used across modules:\n" + "\n".join(offenders)


def test_the_check_sees_each_form():
    source = ("from ostinato.engine.async_engine import _ENDED, deliver\n"
              "from ostinato.kernels import decode_plan as plan\n"
              "import ostinato.runner.sampler\n"
              "from ostinato.kernels._hidden import thing\n"
              "x = plan._cdiv(1, 2) + ostinato.runner.sampler._limit\n"
              "from ostinato.kernels.triton_optional import jit as _jit\n")
    found = sorted(use.split(": ", 1)[1] for use in private_uses(source, "ostinato.tools.example"))
    assert found == ["from ostinato.engine.async_engine import _ENDED", "from ostinato.kernels._hidden import ...",
                     "ostinato.kernels.decode_plan._cdiv", "ostinato.runner.sampler._limit"]
    # A module's own private names are its own business.
    own = sorted(use.split(": ", 1)[1] for use in private_uses(source, "ostinato.engine.async_engine"))
    assert own == found[1:]
