"""Bad input gets a clear error naming the problem and what is allowed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specdecode.cli import main
from specdecode.llm import LLM
from specdecode.model.convert import config_from_gguf, open_gguf
from specdecode.model.loading import load_model


def test_unknown_alias_or_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no such model alias or path.*smollm2-135m"):
        LLM(model="no-such-model")
    with pytest.raises(FileNotFoundError, match="no such model alias or path"):
        LLM(model=str(tmp_path / "missing"))


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"unsupported architecture 'mamba'.*llama, mistral, qwen2, mimo, qwen3"
    ):
        load_model(folder)


def test_unknown_dtype(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float8'; allowed: float32"):
        LLM(model=str(tiny_model_dir), dtype="float8")


def test_malformed_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read weights"):
        load_model(folder)


def test_missing_tensor(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"lacks (9|12) tensor\(s\).*model\.layers\.3\."):
        load_model(folder)


def test_truncated_gguf(smollm2_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "truncated.gguf"
    with smollm2_gguf.open("rb") as f:
        broken.write_bytes(f.read(2_000_000))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(broken)


def test_corrupted_gguf_header(smollm2_gguf: Path, tmp_path: Path) -> None:
    broken = tmp_path / "corrupt.gguf"
    with smollm2_gguf.open("rb") as f:
        data = bytearray(f.read(4_000_000))
    data[:4] = b"XXXX"  # bad magic
    broken.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(broken)


def test_gguf_config_is_read(smollm2_gguf: Path) -> None:
    cfg = config_from_gguf(open_gguf(smollm2_gguf))
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and not cfg.qkv_bias


def test_cli_reports_errors_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "no-such-model", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdecode: error: 'no-such-model' is no such model alias or path")
    with pytest.raises(SystemExit):
        main(["generate", "--model", "x", "--prompt", "hi", "--dtype", "float8"])


def test_cli_rejects_bad_sampling_values(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hi"]
    assert main([*args, "--top-p", "1.5"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert main([*args, "--max-tokens", "0"]) == 2
    assert "max_tokens must be a positive int" in capsys.readouterr().err
    assert main([*args, "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_cli_keeps_the_traceback_of_a_bug(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only UserError is a one-line error; anything else is a bug and propagates."""

    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("a bug deep inside")

    monkeypatch.setattr("specdecode.cli_args.LLM", broken)
    with pytest.raises(TypeError, match="a bug deep inside"):
        main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi"])
