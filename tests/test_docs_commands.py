"""Every `specdecode ...` example in README.md and docs/*.md parses with the CLI as it is, and the
defaults the docs quote are the ones `--help` states (parse only: no model is loaded).

Examples are read from fenced bash blocks (whole commands, `\\` continuations joined, comments
dropped; each must parse, and a bench command's --methods must parse as method specs) and from
inline code spans (often abridged, e.g. `specdecode generate ... --compare`: their subcommand
and every --flag must exist). Quoted defaults: "`--flag` (..., default X)", "`--flag` (X)" with
a number X, "`--flag X` (default)", "By default (`--flag X`)", and a preset spelled out as
"`--preset NAME` = `FLAGS`".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from specdecode.bench.methods import parse_methods
from specdecode.bench.presets import BENCH_DEFAULTS, bench_options
from specdecode.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELLS = {"bash", "sh", "shell", "console", "zsh"}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBPARSERS = _subparsers()


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _specdecode_argv(tokens: list[str]) -> list[str] | None:
    """The arguments after `specdecode` (or `python -m specdecode.cli`) in a shell command's
    tokens, or None if it runs no specdecode command."""
    for i, token in enumerate(tokens):
        if token == "specdecode" or token.endswith("/specdecode"):
            return tokens[i + 1 :]
        if token == "specdecode.cli" and i > 0 and tokens[i - 1] == "-m":
            return tokens[i + 1 :]
    return None


def fenced_commands(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, command as written, argv after `specdecode`) of each command in shell blocks."""
    for block in FENCE.finditer(text):
        if block.group(1) not in SHELLS:
            continue
        first = _line_of(text, block.start(2))
        lines = block.group(2).split("\n")
        i = 0
        while i < len(lines):
            start, command = i, lines[i]
            while command.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command.rstrip()[:-1] + " " + lines[i].strip()
            i += 1
            command = command.strip().removeprefix("$ ")
            try:
                tokens = shlex.split(command, comments=True)
            except ValueError:
                continue  # not a command line (a here-doc's body, ...)
            argv = _specdecode_argv(tokens)
            if argv:
                yield first + start, command, argv


def _without_fences(text: str) -> str:
    """`text` with its fenced blocks blanked (their line count kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def inline_commands(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(line, span, its words after `specdecode`) of each inline `specdecode ...` span."""
    prose = _without_fences(text)
    for span in re.finditer(r"`(specdecode [^`]+)`", prose):
        words = span.group(1).split()
        yield _line_of(prose, span.start()), " ".join(words), words[1:]


def _parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """(namespace, "") if argparse accepts `argv`, else (None, its error)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(argv), ""
    except SystemExit as exit_info:
        return None, err.getvalue().strip() or f"exit {exit_info.code}"


def _fenced_problem(argv: list[str]) -> str:
    """Why a whole command from a shell block does not parse ("" if it does)."""
    if argv[-1] in ("-h", "--help"):
        return "" if argv[0] in SUBPARSERS or argv == ["--help"] else f"no command {argv[0]}"
    args, error = _parse(argv)
    if args is None:
        return error
    if args.command == "bench" and args.methods is not None:
        try:
            parse_methods(args.methods)
        except ValueError as err:
            return str(err)
    return ""


def _inline_problem(words: list[str]) -> str:
    """Why an abridged inline command is wrong: an unknown subcommand or --flag ("" if fine)."""
    if not words or words[0].startswith("-") or words[0].isupper():
        return ""  # `specdecode --help`, `specdecode COMMAND --help`
    if words[0] not in SUBPARSERS:
        return f"no subcommand {words[0]!r}"
    known = SUBPARSERS[words[0]]._option_string_actions
    unknown = [
        w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in known
    ]
    return f"{words[0]} has no {', '.join(unknown)}" if unknown else ""


def _relative(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_every_example_command_parses(doc: Path) -> None:
    text = doc.read_text()
    problems = [
        f"{_relative(doc)}:{line}: {command}\n    -> {problem}"
        for line, command, argv in fenced_commands(text)
        if (problem := _fenced_problem(argv))
    ]
    problems += [
        f"{_relative(doc)}:{line}: `{span}`\n    -> {problem}"
        for line, span, words in inline_commands(text)
        if (problem := _inline_problem(words))
    ]
    assert not problems, "doc examples the CLI refuses:\n" + "\n".join(problems)


# --- quoted defaults ------------------------------------------------------------------------

FLAG_SPAN = r"`(--[a-z][a-z0-9-]*)((?: [^`]*)?)`"
VALUE = r"(`[^`]*`|\"[^\"]*\"|[\w.~/-]+(?: \d{3})*)(?=\s*[,;)])"
PATTERNS = [
    re.compile(FLAG_SPAN + r"\s*\((?:[^()]*?[,;]\s*)?default:?\s+" + VALUE),  # (..., default X)
    re.compile(FLAG_SPAN + r"\s*\(((?:\d[\d ,.]*)?\d)\)"),  # `--flag` (16)
    re.compile(FLAG_SPAN + r"\s*\(default\)"),  # `--flag X` (default)
    re.compile(r"[Bb]y default \(" + FLAG_SPAN + r"\)"),  # By default (`--flag X`)
]


def _command_before(text: str, index: int) -> str | None:
    """The subcommand that the text before `index` last names (`specdecode NAME`)."""
    names = [n for n in re.findall(r"specdecode (\w+)", text[:index]) if n in SUBPARSERS]
    return names[-1] if names else None


def quoted_defaults(text: str) -> list[tuple[str | None, str, str]]:
    """(the subcommand in context, flag, value) of each default the prose quotes, in order."""
    flat = " ".join(_without_fences(text).split())  # a quote may wrap over lines
    found = []
    for pattern in PATTERNS:
        for m in pattern.finditer(flat):
            value = m.group(3) if pattern.groups >= 3 else m.group(2)
            if value.strip() and not value.isupper():  # not a placeholder like MODEL
                found.append((m.start(), _command_before(flat, m.start()), m.group(1), value))
    return [entry[1:] for entry in sorted(found)]


def _normal(value: str) -> str:
    """A quoted value as the CLI would read it: no backticks or quotes, digits joined."""
    value = value.strip().strip("`").strip('"').strip("'")
    return re.sub(r"(?<=\d)[ ,](?=\d{3}\b)", "", value)


def _matches(parser: argparse.ArgumentParser, flag: str, quoted: str) -> bool | None:
    """Whether `quoted` is `flag`'s default in `parser` (None: the parser has no such flag)."""
    action = parser._option_string_actions.get(flag)
    if action is None:
        return None
    default = action.default
    if default is None and action.dest in BENCH_DEFAULTS:  # bench: filled in after parsing
        default = getattr(bench_options(parser.parse_args([])), action.dest)
    if isinstance(default, tuple):
        default = ",".join(default)
    value = _normal(quoted)
    with contextlib.suppress(TypeError, ValueError, argparse.ArgumentTypeError):
        value = action.type(value) if callable(action.type) else value
    return value == default or str(value) == str(default)


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_quoted_defaults_match_the_help(doc: Path) -> None:
    problems = []
    for command, flag, value in quoted_defaults(doc.read_text()):
        verdicts = {name: _matches(p, flag, value) for name, p in SUBPARSERS.items()}
        having = {name: ok for name, ok in verdicts.items() if ok is not None}
        if not having:
            problems.append(f"{flag} (quoted default {value!r}) is no option of any command")
        elif not (having[command] if command in having else any(having.values())):
            where = command if command in having else " / ".join(having)
            problems.append(
                f"{flag}: the doc quotes {value!r}; `specdecode {where} --help` differs"
            )
    assert not problems, f"{_relative(doc)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=_relative)
def test_presets_spelled_out_match_the_code(doc: Path) -> None:
    text = " ".join(doc.read_text().split())
    parse = SUBPARSERS["bench"].parse_args
    for name, flags in re.findall(r"`--preset ([\w-]+)` = `([^`]+)`", text):
        preset = bench_options(parse(["--preset", name]))
        spelled = bench_options(parse(shlex.split(flags)))
        for dest in BENCH_DEFAULTS:
            assert getattr(spelled, dest) == getattr(preset, dest), (
                f"{_relative(doc)}: `--preset {name}` = `{flags}`, but the preset's {dest} is "
                f"{getattr(preset, dest)!r} (`specdecode bench --help`)"
            )


def test_the_extractors_find_what_they_should() -> None:
    """The readers on a hand-made page (so a silent regex cannot pass everything)."""
    page = (
        "Run `specdecode generate ... --compare` or `specdecode bench\n--report FILE`.\n"
        "```bash\nspecdecode plan --model m \\\n    --speculative-config '{}'  # plan it\n"
        "make serve   # = specdecode serve x\n```\n"
        "`specdecode certify` takes `--tokens` (tokens per run, default 3), `--samples`\n"
        '(default 20 000), `--prompt` (default `"hi"`), `--port` (8000) and `--chat` (no).\n'
        "By default (`--quantization auto`), and `--responses dataset` (default).\n"
    )
    assert [(line, argv) for line, _, argv in fenced_commands(page)] == [
        (4, ["plan", "--model", "m", "--speculative-config", "{}"])
    ]
    assert [words for _, _, words in inline_commands(page)] == [
        ["generate", "...", "--compare"],
        ["bench", "--report", "FILE"],
        ["certify"],
    ]
    found = [(command, flag, _normal(value)) for command, flag, value in quoted_defaults(page)]
    assert found == [
        ("certify", "--tokens", "3"),
        ("certify", "--samples", "20000"),
        ("certify", "--prompt", "hi"),
        ("certify", "--port", "8000"),
        ("certify", "--quantization", "auto"),
        ("certify", "--responses", "dataset"),
    ]
    assert _fenced_problem(["plan", "--model", "m"]).startswith("specdecode: error:")
    assert _fenced_problem(["bench", "--methods", "plain,beam"]).startswith("unknown method")
    assert _inline_problem(["generate", "--nope"]) == "generate has no --nope"
