"""The bench's method-spec grammar has one source (the drafter registry and `bench/methods.py`):
`bench --help` names every registered key, what it advertises parses, the docs' table is the
generated one; and the CLI's modules keep their layers and have no import circle."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.bench.method_help import CHOICES, TABLE_START, option_value, with_table
from specdecode.bench.methods import EXAMPLES, KINDS, OUR_OPTIONS, OURS, MethodSpec, parse_methods
from specdecode.cli import main

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "specdecode"


@pytest.fixture(scope="module")
def bench_help() -> str:
    """`specdecode bench --help` as printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    return out.getvalue()


def _entries(text: str) -> dict[str, str]:
    """The help's grammar entries by method name: a line "  SPEC ..." and the lines indented
    deeper that continue it, joined."""
    entries: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if re.match(r"^  \S", line) and not line.startswith("  -"):
            name = re.split(r"[:\[]", line.split()[0])[0]
            entries[name] = line.strip()
        elif name is not None and line.startswith("      "):
            entries[name] += " " + line.strip()
        else:
            name = None
    return entries


def test_help_names_every_registered_key_and_peer(bench_help: str) -> None:
    entries = _entries(bench_help)
    flat = " ".join(bench_help.split())
    for bench_name, method in OURS.items():
        entry = entries.get(bench_name)
        assert entry is not None, f"bench --help has no entry for {bench_name!r}"
        assert f"({method.name})" in entry
        model = ":MODEL" if method.model_required else "[:MODEL]" if method.model_field else ""
        assert entry.startswith(f"{bench_name}{model}:k=")
        for key, field in method.bench_options.items():
            assert f":{key}=" in entry, f"{bench_name}'s key {key!r} is missing from the help"
            assert f"{key}={field}" in flat, f"the help does not say {key!r} sets {field}"
    for name, kind in KINDS.items():
        entry = entries.get(name)
        assert entry is not None, f"bench --help has no entry for {name!r}"
        for key, default in kind.options.items():
            assert f":{key}=" in entry and (default is None or f"{key}={default}" in entry)
        assert kind.peer_of is None or kind.about in " ".join(entry.split())
    for key, (values, _) in OUR_OPTIONS.items():
        assert f"{key}={'|'.join(values)}" in flat
    for example in EXAMPLES:
        assert example in flat


def test_examples_parse() -> None:
    assert [s.name for s in parse_methods(",".join(EXAMPLES))] == list(EXAMPLES)


def test_every_value_the_help_shows_parses() -> None:
    """Each option's advertised values (a fixed set, or its default) are accepted."""
    for bench_name, method in OURS.items():
        head = f"{bench_name}:m" if method.model_field else bench_name
        for key, field in method.bench_options.items():
            shown = option_value(method, key)
            values = CHOICES.get(field, (shown,))
            for value in values:
                if key == "k" or value in ("N", "X"):
                    continue
                MethodSpec.parse(f"{head}:k=16:{key}={value}")


def test_peer_defaults_come_from_one_table() -> None:
    assert MethodSpec.parse("hf-lookup:k=8").option("max") == KINDS["hf-lookup"].options["max"]
    assert MethodSpec.parse("llamacpp-lookup:k=8:max=3").option("max") == 3
    with pytest.raises(ValueError, match="needs k=N"):
        MethodSpec.parse("llamacpp-lookup")


def test_docs_table_is_the_generated_one() -> None:
    doc = (ROOT / "docs" / "drafters.md").read_text()
    assert TABLE_START in doc, "docs/drafters.md lost its generated method-spec table"
    assert with_table(doc) == doc, (
        "docs/drafters.md's method-spec table is stale: run "
        "`python -m specdecode.bench.method_help --write docs/drafters.md`"
    )


def _imports(path: Path) -> set[str]:
    """The modules `path` imports (at any level, TYPE_CHECKING blocks included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_server_modules_import_no_circle_and_no_bench() -> None:
    assert "specdecode.server.cli" not in _imports(SRC / "server" / "ray_serve.py")
    assert "specdecode.server.ray_serve" not in _imports(SRC / "server" / "spec.py")
    for name in ("cli.py", "spec.py", "ray_serve.py"):
        found = {m for m in _imports(SRC / "server" / name) if m.startswith("specdecode.")}
        assert not {m for m in found if m.startswith(("specdecode.bench", "specdecode.train"))}


def test_serve_parser_loads_no_bench_or_train_code() -> None:
    code = (
        "import argparse, sys; from specdecode.server.cli import add_serve_parser; "
        "add_serve_parser(argparse.ArgumentParser().add_subparsers()); "
        "bad = [m for m in sys.modules if m.startswith(('specdecode.bench', 'specdecode.train'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
