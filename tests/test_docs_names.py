"""Every name of ours that README.md and docs/*.md put in backticks exists: repository paths
(`kernels/tiles.h`, `tests/native/driver.cpp`, `drafters/`), `path:symbol` and `path:LINE`
references, test names (`test_...`, `file.py::test_...`) and dotted names under `specdecode.`
(a module, or an attribute of one). A doc that names a file, a test or a function that moved
or never was says something false; this test says which span and where.

A path may be abridged to its tail (`model/attention.py` for `src/specdecode/model/attention.py`,
`gguf.cpp` for `src/specdecode/kernels/gguf.cpp`): it resolves when some file or folder of the
repository ends with it. What is not ours is left alone: URLs and server routes (a leading
`/`), placeholders (`<folder>`, `MODEL`, `...`, `{k}`), home-folder paths (`~/...`), and the
files the commands write (`bench.json`, `config.json`: extensions other than source and docs).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\s]+)`")
SOURCE = (".py", ".md", ".cpp", ".h", ".toml", ".cfg", ".sh", ".in")
SKIPPED_FOLDERS = {".git", ".venv", "build", "node_modules", "__pycache__", "bench_out"}
PLACEHOLDER = re.compile(r"[<>{}*~]|\.\.\.|\b[A-Z]{2,}\b")
WRITTEN = {"bench.md", "openvino-int4/", "held-out/"}  # what commands write, named like ours


@cache
def repository_paths() -> frozenset[str]:
    """Every file and folder of the repository, relative to its root ("/"-separated), without
    the virtual environments, build outputs and caches."""
    found: set[str] = set()
    stack = [ROOT]
    while stack:
        folder = stack.pop()
        for entry in folder.iterdir():
            if entry.name in SKIPPED_FOLDERS or entry.name.startswith(".venv"):
                continue
            relative = entry.relative_to(ROOT).as_posix()
            found.add(relative)
            if entry.is_dir() and not entry.is_symlink():
                stack.append(entry)
    return frozenset(found)


def resolve(path: str) -> Path | None:
    """The repository file or folder that `path` (trailing "/" allowed) names: itself, or the
    shortest path ending with it (`model/attention.py`); None if there is none."""
    path, paths = path.rstrip("/"), repository_paths()
    if path in paths:
        return ROOT / path
    tails = sorted((p for p in paths if p.endswith("/" + path)), key=len)
    return ROOT / tails[0] if tails else None


@cache
def test_names() -> frozenset[str]:
    """The names of every test function under tests/."""
    names: set[str] = set()
    for source in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", source.read_text(), re.M))
    return frozenset(names)


def _is_path(span: str) -> bool:
    """Whether a span reads as a repository path: a folder path, or a source or doc file."""
    if span.startswith(("/", "http:", "https:", "-")) or PLACEHOLDER.search(span):
        return False
    if span in WRITTEN:
        return False
    name = span.split("::")[0].split(":")[0]
    if "/" in name:
        return not name.startswith(".") or name.startswith("./")
    return name.endswith(SOURCE) and not name.startswith(".")


def _dotted_exists(name: str) -> bool:
    """Whether `specdecode.a.b` is a module or an attribute of one (no native build needed
    for the pure-Python names)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def span_problem(span: str) -> str:
    """Why a backticked span names something of ours that does not exist ("" if it exists or
    is not a name of ours)."""
    if re.fullmatch(r"test_\w+", span):
        return "" if span in test_names() else "no test of that name under tests/"
    if re.fullmatch(r"specdecode(\.\w+)+", span):
        return "" if _dotted_exists(span) else "no such module or attribute"
    if not _is_path(span):
        return ""
    path, _, rest = span.partition("::")
    if rest and rest.split("[")[0] not in test_names():
        return f"no test {rest.split('[')[0]} under tests/"
    path, _, symbol = path.partition(":")
    target = resolve(path)
    if target is None:
        return "no such file or folder in the repository"
    if symbol and not re.fullmatch(r"\d+(-\d+)?", symbol):
        text = "" if target.is_dir() else target.read_text(errors="replace")
        if not re.search(rf"\b{re.escape(symbol)}\b", text):
            return f"{path} has no {symbol}"
    return ""


def spans(text: str) -> Iterator[tuple[int, str]]:
    """(line, span) of every backticked word of the prose (fenced blocks left out)."""
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for match in SPAN.finditer(prose):
        yield prose.count("\n", 0, match.start()) + 1, match.group(1)


def _relative(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_every_named_path_test_and_module_exists(doc: Path) -> None:
    problems = [
        f"{_relative(doc)}:{line}: `{span}` -> {problem}"
        for line, span in spans(doc.read_text())
        if (problem := span_problem(span))
    ]
    assert not problems, "names the docs give that do not exist:\n" + "\n".join(problems)


def test_the_checker_tells_real_names_from_false_ones() -> None:
    """On names known to exist and not to (so a reader that passes everything cannot pass)."""
    for real in (
        "kernels/tiles.h",
        "src/specdecode/kernels/",
        "model/attention.py",
        "gguf.cpp",
        "tests/native/driver.cpp",
        "sampling/decide.py:decide",
        "engine/engine.py:355",
        "tests/test_model.py::test_causal_route_gives_the_masked_routes_bits",
        "test_causal_route_gives_the_masked_routes_bits",
        "specdecode.errors.UserError",
        "bench.json",  # written by a command: not checked
        "/v1/models",
        "kernels/arch/<folder>/gguf_tile.h",
    ):
        assert span_problem(real) == "", real
    for false in (
        "kernels/tile.h",
        "tests/test_repeats.py",
        "sampling/decide.py:decide_all",
        "test_no_such_test_anywhere",
        "tests/test_model.py::test_no_such_test_anywhere",
        "specdecode.errors.NoSuchError",
        "specdecode.no_such_module",
        "no_such_module.py",
    ):
        assert span_problem(false), false
