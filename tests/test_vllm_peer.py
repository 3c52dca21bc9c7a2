"""The vLLM peer of `specdecode bench`: its specs, the speculative_config it hands vLLM, the
worker's environment, what happens without vLLM's venv or when its worker cannot start, and
(where `make vllm-peer` has built `.venv-vllm`) a real run on SmolLM2."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from peer_cases import peer_config, peer_run

from specdecode.bench import vllm_peer
from specdecode.bench.methods import KINDS, MethodSpec, parse_methods
from specdecode.bench.report import ENGINES, best_table
from specdecode.bench.run import run_bench
from specdecode.bench.stats import summarize
from specdecode.bench.vllm_peer import VllmRunner, speculative_config, vllm_python, worker_env
from specdecode.errors import MissingDependencyError, UserError


def test_vllm_specs_parse_and_pair_with_ours() -> None:
    ours = parse_methods("plain,ngram:k=8,draft:m05:k=3")
    plain = MethodSpec.parse("vllm")
    assert plain.is_peer and plain.engine == "vllm" and plain.peer_of(ours).name == "plain"
    ngram = MethodSpec.parse("vllm-ngram:k=8")
    assert ngram.peer_of(ours).name == "ngram:k=8" and ngram.option("max") == 4
    draft = MethodSpec.parse("vllm-draft:m05:k=3")
    assert draft.peer_of(ours).name == "draft:m05:k=3"
    specs = parse_methods("vllm,vllm-draft:m05:k=3")
    assert specs[1].plain_of_engine(specs).name == "vllm"  # checked against vLLM's own plain
    with pytest.raises(UserError, match="needs a model"):
        MethodSpec.parse("vllm-draft:k=3")
    with pytest.raises(UserError, match="needs k=N"):
        MethodSpec.parse("vllm-ngram")


def test_vllms_best_method_is_reported_beside_ours() -> None:
    """Every peer library has its row in the best-method table (vLLM's was left out once)."""
    assert {kind.engine for kind in KINDS.values()} <= set(ENGINES)
    specs = parse_methods("plain,vllm,vllm-draft:m05:k=3")
    runs = [
        peer_run("plain", [1, 2, 3, 4], 1.0),
        peer_run("vllm", [1, 2, 3, 4], 4.0),
        peer_run("vllm-draft:m05:k=3", [1, 2, 3, 4], 2.0),
    ]
    lines = best_table(summarize(runs, specs, greedy=True))
    best = "2.00 (vllm-draft:m05:k=3)"
    assert f"| vLLM (CPU) | {best} | {best} |" in lines


def test_the_speculative_config_vllm_gets(tmp_path: Path) -> None:
    assert speculative_config(MethodSpec.parse("vllm"), None) is None
    ngram = speculative_config(MethodSpec.parse("vllm-ngram:k=6:max=3"), None)
    assert ngram == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 2,
    }
    suffix = speculative_config(MethodSpec.parse("vllm-suffix:k=8"), None)
    assert suffix == {  # no answers of earlier requests, as our suffix:...:cached=0
        "method": "suffix",
        "num_speculative_tokens": 8,
        "suffix_decoding_max_cached_requests": 0,
    }
    ours = parse_methods("plain,suffix:k=8:cached=0")
    assert MethodSpec.parse("vllm-suffix:k=8").peer_of(ours).name == "suffix:k=8:cached=0"
    draft = speculative_config(MethodSpec.parse("vllm-draft:m05:k=3"), tmp_path)
    assert draft == {"model": str(tmp_path), "num_speculative_tokens": 3}


def test_the_worker_binds_our_threads_and_keeps_stdout_for_answers(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    python = tmp_path / "bin" / "python"
    python.touch()
    (tmp_path / "lib" / "libiomp5.so").touch()
    env = worker_env(str(python), 2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(vllm_peer.KV_CACHE_GIB)
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr" and env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_PRELOAD"].endswith(str(tmp_path / "lib" / "libiomp5.so"))


def test_vllms_python_is_found_or_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(vllm_peer.PYTHON_VARIABLE, raising=False)
    with pytest.raises(MissingDependencyError, match="make vllm-peer"):
        vllm_python()
    monkeypatch.setenv(vllm_peer.PYTHON_VARIABLE, str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="which is not a file"):
        vllm_python()
    monkeypatch.delenv(vllm_peer.PYTHON_VARIABLE)
    local = tmp_path / ".venv-vllm" / "bin" / "python"
    local.parent.mkdir(parents=True)
    local.touch()
    assert vllm_python() == ".venv-vllm/bin/python"


def test_a_worker_that_cannot_load_vllm_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real worker, run by a Python without vLLM: it exits at `import vllm`, and the
    runner says so with the worker's own last lines (never a hang)."""
    monkeypatch.setenv(vllm_peer.PYTHON_VARIABLE, sys.executable)  # ours has no vllm
    with pytest.raises(UserError, match=r"(?s)did not start: .*No module named 'vllm'"):
        VllmRunner(MethodSpec.parse("vllm"), tmp_path, 64, [0], None)


def test_a_worker_that_does_not_load_in_time_is_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho loading >&2\nexec sleep 60\n")
    python.chmod(0o755)
    monkeypatch.setenv(vllm_peer.PYTHON_VARIABLE, str(python))
    started = time.monotonic()
    with pytest.raises(UserError, match=r"did not start within 0.5 s: loading"):
        VllmRunner(MethodSpec.parse("vllm"), tmp_path, 64, [0], None, load_timeout_s=0.5)
    assert time.monotonic() - started < 30


def test_bits_4_runs_vllm_on_gptq_checkpoints_of_both_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-draft:...:bits=4 hands the worker the GPTQ folders of the target and the draft."""
    written: list[Path] = []

    def exported(folder: Path) -> Path:
        written.append(folder)
        return folder / "gptq-int4"

    monkeypatch.setattr(vllm_peer.gptq, "exported", exported)
    monkeypatch.setenv(vllm_peer.PYTHON_VARIABLE, sys.executable)  # exits: no vllm
    spec = MethodSpec.parse("vllm-draft:m05:k=3:bits=4")
    with pytest.raises(UserError, match="did not start"):
        VllmRunner(spec, tmp_path / "target", 64, [0], tmp_path / "draft")
    assert written == [tmp_path / "target", tmp_path / "draft"]
    assert MethodSpec.parse("vllm").option("bits") == 16
    with pytest.raises(UserError, match="bits"):
        MethodSpec.parse("vllm:bits=8")
    specs = parse_methods("vllm,vllm:bits=4,vllm-ngram:k=4:bits=4")
    assert specs[2].plain_of_engine(specs).name == "vllm:bits=4"  # its own format's plain


def test_without_vllms_venv_the_peer_is_skipped_with_how_to_build_it(
    tiny_model_dir: Path, tiny_prompts: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(vllm_peer.PYTHON_VARIABLE, raising=False)
    report = run_bench(
        peer_config(str(tiny_model_dir), "plain,vllm", (str(tiny_prompts),), 4, "float32"),
        log=False,
    )
    assert {r.method for r in report["runs"]} == {"plain"}
    (skip,) = report["skipped"]
    assert skip["method"] == "vllm" and "make vllm-peer" in skip["reason"]


@pytest.mark.real_model
@pytest.mark.slow
def test_vllm_peers_run_on_the_real_model(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(__file__).resolve().parent.parent
    python = root / vllm_peer.VLLM_VENV / "bin" / "python"
    if not python.is_file():
        pytest.skip("no vLLM venv (make vllm-peer)")
    monkeypatch.setenv(vllm_peer.PYTHON_VARIABLE, str(python))
    methods = "plain,vllm,vllm-ngram:k=4,vllm-suffix:k=4,vllm-draft:smollm2-135m:k=2,vllm:bits=4"
    report = run_bench(peer_config("smollm2-135m", methods, ("qa",), 16, "auto"), log=False)
    assert report["skipped"] == []
    runs = {r.method: r for r in report["runs"]}
    assert {r.num_tokens for r in runs.values()} == {16}
    assert len(runs["vllm-draft:smollm2-135m:k=2"].arrivals) < 16  # several tokens a step
    exact = {n: m["exactness"] for n, m in report["summary"]["methods"].items()}
    assert exact["vllm-draft:smollm2-135m:k=2"]["versus"] == "vllm"
    assert exact["vllm-draft:smollm2-135m:k=2"]["share_identical"] == 1.0
    assert exact["vllm-suffix:k=4"]["share_identical"] == 1.0
    assert exact["vllm:bits=4"]["versus"] == "plain"  # its 4-bit GPTQ checkpoint ran
