"""The docs name only what exists, and the code's comments explain rather than log.

1. Every repository path that README.md, docs/*.md or benchmarks/README.md cites is checked: backticked spans and
   fenced code blocks, tokens that start with src/, docs/, benchmarks/, tests/ or scripts/, paths relative to
   src/ostinato/ (runner/runner.py), and relative Markdown links. Each must exist in the tree.
2. No file under src/, tests/ or benchmarks/ mentions DESIGN.md (it is not in the repository), an issue number,
   a measuring round, or a working session. Only the prose forms are matched, so `requests.Session`, a pytest
   "test session", a "session leader" and `round(x, 3)` are fine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "ostinato"
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

REPO_PREFIXES = ("src/", "docs/", "benchmarks/", "tests/", "scripts/")
PACKAGE_DIRS = ("server", "engine", "runner", "model", "attention", "kernels", "tools")
PACKAGE_RELATIVE = re.compile(r"^(?:%s)/[\w/]+\.(?:py|md)$" % "|".join(PACKAGE_DIRS))
BACKTICKED = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
TRAILING = ".,;:)]'\""


def _tokens(text: str) -> list[str]:
    """Whitespace-separated words of every backticked span and fenced block of a Markdown text."""
    spans = BACKTICKED.findall(FENCE.sub("", text)) + FENCE.findall(text)
    return [word for span in spans for word in span.split()]


def _cited_path(word: str) -> str | None:
    """The repository path a word names, or None: placeholders (<layer>, *, {a,b}, $VAR) name no one file."""
    word = word.split("::")[0].rstrip(TRAILING).lstrip("(['\"")
    if any(c in word for c in "<>*{}$"):
        return None
    if word.startswith(REPO_PREFIXES):
        return word
    if PACKAGE_RELATIVE.match(word):
        return f"src/ostinato/{word}"
    return None


def cited_paths(doc: Path, text: str | None = None) -> set[str]:
    """Repository paths (relative to the root) that doc cites; text stands in for its contents when given."""
    text = doc.read_text() if text is None else text
    paths = {p for p in map(_cited_path, _tokens(text)) if p}
    for target in LINK.findall(text):
        if "://" not in target and not target.startswith("mailto:"):
            paths.add((doc.parent / target).resolve().relative_to(ROOT).as_posix())
    return paths


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_doc_cites_exists(doc):
    missing = sorted(p for p in cited_paths(doc) if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} cites paths that do not exist: {missing}"


def test_the_path_check_sees_paths_in_every_form():
    text = ("Run `python3 benchmarks/step/pdl.py CK`, read `runner/runner.py` and `tests/engine/test_eos.py::test_x`;"
            " not `tests/<layer>/test_*.py`.\n\n```bash\nbash scripts/setup.sh\n```\n[arch](ARCHITECTURE.md)\n")
    assert cited_paths(ROOT / "docs" / "ANY.md", text) == {
        "benchmarks/step/pdl.py", "src/ostinato/runner/runner.py", "tests/engine/test_eos.py", "scripts/setup.sh",
        "docs/ARCHITECTURE.md"}


ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
            "fourteenth fifteenth").split()
LOG_PATTERNS = {
    "DESIGN.md": re.compile(r"DESIGN\.md"),
    # A letter may not come before (tissue, around), an underscore may: gpu_issue11_round8b.sh is a log too.
    "an issue number": re.compile(r"(?<![a-z])issues? ?#?\d+", re.I),
    "a measuring round": re.compile(r"(?<![a-z])round ?\d+[a-z]?\b", re.I),
    "a working session": re.compile(
        r"\b(?:%s|this|that|last|next|previous|earlier|same|another) sessions?\b|\bsessions? (?:files?|logs?)\b"
        % "|".join(ORDINALS), re.I),
}


def _source_files() -> list[Path]:
    here = Path(__file__).resolve()
    files = [p for top in ("src", "tests", "benchmarks") for p in (ROOT / top).rglob("*")
             if p.suffix in (".py", ".sh", ".md") and "__pycache__" not in p.parts]
    return sorted(p for p in files if p.resolve() != here)  # this file spells the patterns out


def log_mentions(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pattern in LOG_PATTERNS.items() for m in pattern.finditer(text)]


def test_no_source_file_logs_history_in_its_comments():
    found = []
    for path in _source_files():
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{lineno}: {hit}" for hit in log_mentions(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", [
    "measured in the ninth session", "(docs/PERFORMANCE.md, issue 11)", "Issue 12's goal", "round 9c showed",
    "scripts/gpu_issue11_round8b.sh", "see DESIGN.md", "this session's commits", "a session file",
])
def test_the_history_patterns_catch_log_lines(line):
    assert log_mentions(line)


@pytest.mark.parametrize("line", [
    "async with aiohttp.ClientSession() as s:", "requests.Session()", "for the rest of the test session",
    "the child: a session leader", "round(x, 3)", "--rounds 5", "rounded down", "tissue 3", "around 3 us",
])
def test_the_history_patterns_leave_code_and_plain_words_alone(line):
    assert not log_mentions(line)
