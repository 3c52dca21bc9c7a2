"""What a new user meets on the command line (issue 40): one line and exit code 2 for every bad
input, progress bars on a terminal only, help that states its defaults, and the kernels'
build message only when something is compiled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_model

from specdecode.bench import plan as plan_module
from specdecode.bench import run as run_module
from specdecode.bench.plan import PlanConfig, run_plan
from specdecode.certify import CertifyConfig
from specdecode.cli import main
from specdecode.errors import UserError, context_overflow, prompt_too_long
from specdecode.llm import LLM

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ux_target"), "llama")


def _terminal(monkeypatch: pytest.MonkeyPatch, tty: bool = True) -> None:
    """Make stderr say whether it is a terminal; call it in the test itself, where capsys's
    capture is sys.stderr (during fixture setup it is not)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    row = {"id": "echo-0", "category": "echo", "messages": [{"role": "user", "content": "abcabc"}]}
    path.write_text(json.dumps(row) + "\n")
    return path


def _one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `main(argv)`, which must end with exit code 2 and one line on stderr; that line."""
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's own refusals exit from parse_args
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    return err


# --- one line, exit code 2 ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "m", "--prompt", "hi"],
        ["certify", "--model", "m"],
        ["plan", "--model", "m"],
        ["serve", "m"],
    ],
    ids=["generate", "certify", "plan", "serve"],
)
def test_malformed_json_flag_is_one_line_with_its_position(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _one_line_exit_2([*argv, "--speculative-config", '{"method": "ngram",}'], capsys)
    assert "--speculative-config: not valid JSON" in err and "column 20 (char 19)" in err


def test_argparse_refusals_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_exit_2(["generate", "--model", "m", "--prompt", "x", "--top-k", "two"], capsys)
    assert "argument --top-k: invalid int value: 'two'" in err
    assert "specdecode generate --help" in _one_line_exit_2(["generate", "--model", "m"], capsys)
    _one_line_exit_2(["pull", "no-such-alias"], capsys)


def test_missing_files_say_no_such_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    err = _one_line_exit_2(["bench", "--model", "m", "--prompts", f"chat,{missing}"], capsys)
    assert f"no such file: {missing}" in err
    plan = ["plan", "--model", "m", "--speculative-config", NGRAM, "--prompts", str(missing)]
    assert f"no such file: {missing}" in _one_line_exit_2(plan, capsys)
    report = tmp_path / "bench.json"
    assert f"no such file: {report}" in _one_line_exit_2(["bench", "--report", str(report)], capsys)


def test_generate_refuses_max_tokens_beyond_the_context(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--model", str(model_dir), "--prompt", "hello", "--dtype", "float32"]
    err = _one_line_exit_2([*argv, "--max-tokens", "100000000"], capsys)
    llm = LLM(str(model_dir), dtype="float32")
    context = llm.model.config.max_position_embeddings
    num_prompt = len(llm.tokenizer.encode("hello"))
    assert str(context_overflow(context, num_prompt, 100_000_000)) in err
    room = context - num_prompt  # exactly what fits is accepted
    assert main([*argv, "--max-tokens", str(room), "--json"]) == 0
    chat = _one_line_exit_2([*argv, "--chat", "--max-tokens", str(room)], capsys)
    assert f"maximum context length is {context} tokens" in chat  # the template's tokens count


def test_the_server_says_the_same_about_max_tokens(model_dir: Path) -> None:
    """max_tokens past the context, and a prompt that fills it: the server's 400, the command
    line and `LLM.generate` give one text each (`Engine.check_context`)."""
    from server_cases import running_server

    from specdecode.server.app import ServeConfig

    llm = LLM(str(model_dir), dtype="float32")
    context = llm.model.config.max_position_embeddings
    num_prompt = len(llm.tokenizer.encode("hello"))
    long = [1] * context
    with running_server(llm, ServeConfig("tiny")) as base:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 100_000_000}
        response = httpx.post(f"{base}/v1/completions", json=body)
        too_long = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": long})
    assert response.status_code == 400
    want = str(context_overflow(context, num_prompt, 100_000_000))
    assert response.json()["error"]["message"] == want
    assert too_long.status_code == 400
    with pytest.raises(UserError) as alone:
        llm.generate({"prompt_token_ids": long})
    assert (
        too_long.json()["error"]["message"]
        == str(alone.value)
        == str(prompt_too_long(context, context))
    )


# --- help -----------------------------------------------------------------------------------


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_certify_help_shows_its_defaults_and_a_run_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _help("certify", capsys)
    default = CertifyConfig()
    assert f"tokens per run (default {default.num_tokens})" in text
    assert f"speculative runs (default {default.num_samples:,})" in text
    assert f"(default {default.alpha:g})" in text and f"(default {default.batch_size:,})" in text
    assert "about 15 minutes on SmolLM2-135M" in text  # docs/certify.md's measurement


def test_serve_help_names_every_route(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help("serve", capsys)
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/viz"):
        assert route in text


# --- progress -------------------------------------------------------------------------------


def _certify_args(model_dir: Path) -> list[str]:
    draft = json.dumps({"model": str(model_dir), "num_speculative_tokens": 2})  # q = p
    return [
        *["certify", "--model", str(model_dir), "--dtype", "float32", "--top-k", "4"],
        *["--speculative-config", draft, "--samples", "40", "--batch-size", "16"],
    ]


def test_certify_shows_progress_on_a_terminal(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _terminal(monkeypatch)
    assert main(_certify_args(model_dir)) == 0
    err = capsys.readouterr().err
    assert "certify: speculative runs" in err and "40/40" in err and "acceptance=" in err
    assert main([*_certify_args(model_dir), "--json"]) == 0  # --json: no bar
    assert "certify:" not in capsys.readouterr().err


def test_certify_shows_no_bar_when_stderr_is_not_a_terminal(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_certify_args(model_dir)) == 0
    assert "certify:" not in capsys.readouterr().err


def test_bench_bar_only_on_a_terminal_and_run_lines_above_it(
    model_dir: Path, prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--model", str(model_dir), "--methods", "plain", "--prompts"]
    argv += [str(prompts_file), "--max-tokens", "2", "--repeats", "1", "--dtype", "float32"]
    argv += ["--quiet-wait", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "  r0 echo-0" in err  # the run's line
    assert "bench:" not in err  # stderr is not a terminal: no bar


@pytest.mark.parametrize(
    ("flags", "tty", "bar", "lines"),
    [([], True, True, True), ([], False, False, True), (["--no-progress"], True, False, False)],
)
def test_bench_decides_on_its_bar_and_run_lines(
    flags: list[str],
    tty: bool,
    bar: bool,
    lines: bool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen = {}

    def fake_run_bench(config: run_module.BenchConfig, log: bool = True) -> None:
        seen.update(bar=config.loop.progress, lines=log)
        raise UserError("stop here")

    _terminal(monkeypatch, tty)
    monkeypatch.setattr(run_module, "run_bench", fake_run_bench)
    assert main(["bench", "--model", "m", *flags]) == 2
    assert seen == {"bar": bar, "lines": lines}


@pytest.mark.parametrize(("flags", "tty", "bar"), [([], True, True), (["--json"], True, False)])
def test_plan_shows_progress_on_a_terminal_unless_json(
    flags: list[str], tty: bool, bar: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = {}

    def fake_run_plan(config: PlanConfig) -> None:
        seen["bar"] = config.progress
        raise UserError("stop here")

    _terminal(monkeypatch, tty)
    monkeypatch.setattr(plan_module, "run_plan", fake_run_plan)
    argv = ["plan", "--model", "m", "--speculative-config", NGRAM, *flags]
    assert main(argv) == 2 and seen == {"bar": bar}


def test_plan_progress_names_its_stages_and_counts_the_replays(
    model_dir: Path, prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = PlanConfig(
        str(model_dir),
        json.loads(NGRAM),
        context=8,
        max_k=2,
        dtype="float32",
        prompt_sets=(str(prompts_file),),
        per_set=1,
        max_tokens=6,
        repeats=1,
        progress=True,
    )
    run_plan(config)
    err = capsys.readouterr().err
    assert "plan: measuring the pass table" in err and "plan: generating" in err
    assert "plan: replays" in err and "shape" in err


def test_the_command_line_runs_without_the_servers_packages(tmp_path: Path) -> None:
    """`pip install specdecode` has no fastapi or uvicorn (the 'serve' extra): every other
    subcommand still loads, and `serve` says which extra to install."""
    blocked = "import sys\nfor m in ('fastapi', 'uvicorn', 'starlette'): sys.modules[m] = None\n"
    run = "from specdecode.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    script = tmp_path / "no_server.py"
    script.write_text(blocked + run)
    for argv in (["train", "--help"], ["generate", "--help"]):
        done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    done = subprocess.run(
        [sys.executable, str(script), "serve", "some-model"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "is missing" in done.stderr and "pip install 'specdecode[serve]'" in done.stderr
