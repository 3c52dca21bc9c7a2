"""The `specdecode` command line on a tiny model (human and --json modes) and `models`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.cli import main


def test_generate_json_prints_one_object(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--json"]
    assert main([*args, "--max-tokens", "7", "--dtype", "float32"]) == 0
    out = json.loads(capsys.readouterr().out)
    required = {"text", "token_ids", "num_generated_tokens", "elapsed_s", "tokens_per_s"}
    assert required <= out.keys()
    assert out["num_generated_tokens"] == len(out["token_ids"]) <= 7


def test_generate_streams_text_then_a_summary(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--chat"]
    assert main([*args, "--max-tokens", "5", "--temperature", "0.8", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.err and "tokens in" in captured.err


def test_generate_with_a_constraint(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--structured-outputs constrains the output; a bad one is a one-line error, exit 2."""
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--json"]
    choice = '{"choice": ["left", "right"]}'
    assert main([*args, "--max-tokens", "8", "--structured-outputs", choice]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("left", "right")
    assert main([*args, "--structured-outputs", '{"regex": "(("}']) == 2
    assert "invalid regex constraint" in capsys.readouterr().err


def test_models_lists_every_alias(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for alias in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        assert alias in out
    assert "LicenseRef-Gemma-Terms-of-Use" in out


def test_generate_with_speculative_config_reports_spec_metrics(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabcabc", "--json"]
    assert main([*args, "--max-tokens", "12", "--speculative-config", config]) == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert spec["num_steps"] >= 1 and spec["mean_acceptance_length"] >= 1.0
    assert {"num_drafts", "num_draft_tokens", "acceptance_rate", "accepted_per_position"} <= set(
        spec
    )


def test_bad_speculative_config_json(tiny_model_dir: Path) -> None:
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi"]
    with pytest.raises(SystemExit):
        main([*args, "--speculative-config", "{not json"])


def test_plain_summary_has_no_speculative_counters(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4"]
    assert main([*args, "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "tokens/s" in err and "acceptance" not in err and "tau" not in err


def test_compare_runs_plain_decoding_beside_speculation(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabcabc", "--compare"]
    args += ["--max-tokens", "12", "--dtype", "float32", "--speculative-config", config]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[speculative: " in err and "acceptance" in err and "tau" in err
    assert "[plain decoding: " in err and "same text: yes" in err and "speedup" in err
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plain"]["identical"] is True and out["plain"]["speedup"] > 0
    assert out["plain"]["num_generated_tokens"] == out["num_generated_tokens"]


def test_compare_needs_a_speculative_config(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--compare"]
    assert main(args) == 2
    assert "--compare needs --speculative-config" in capsys.readouterr().err


def test_compare_under_sampling_does_not_compare_tokens(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "abcabc", "--compare"]
    args += ["--max-tokens", "8", "--temperature", "0.8", "--seed", "1"]
    assert main([*args, "--speculative-config", config]) == 0
    assert "same text: not compared (sampling" in capsys.readouterr().err


def test_bench_report_that_cannot_be_read_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the saved report" in capsys.readouterr().err
    broken = tmp_path / "bench.json"
    broken.write_text("{not json")
    assert main(["bench", "--report", str(broken)]) == 2
    assert "cannot read the saved report" in capsys.readouterr().err
