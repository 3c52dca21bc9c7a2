"""The OpenVINO GenAI peer of `specdecode bench`: its specs, its export cache, its skip
messages, and (where OpenVINO GenAI and an exporter are installed) a real run on SmolLM2."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from peer_cases import peer_config, peer_run

from specdecode.bench import openvino
from specdecode.bench.methods import MethodSpec, parse_methods
from specdecode.bench.openvino import export_command, exported, optimum_cli
from specdecode.bench.report import best_table, markdown
from specdecode.bench.run import run_bench
from specdecode.bench.stats import summarize
from specdecode.errors import MissingDependencyError, UserError


def test_openvino_specs_parse_pair_with_ours_and_check_bits() -> None:
    ours = parse_methods("plain,ngram:k=8,draft:m05:k=4")
    plain = MethodSpec.parse("openvino")
    assert plain.is_peer and plain.engine == "openvino" and plain.option("bits") == 4
    assert plain.peer_of(ours).name == "plain"
    lookup = MethodSpec.parse("openvino-lookup:k=8:max=3:bits=8")
    assert (lookup.option("k"), lookup.option("max"), lookup.option("bits")) == (8, 3, 8)
    assert lookup.peer_of(ours).name == "ngram:k=8"
    draft = MethodSpec.parse("openvino-draft:m05:k=4")
    assert draft.model == "m05" and draft.peer_of(ours).name == "draft:m05:k=4"
    with pytest.raises(UserError, match=r"bad 'bits=5'.*bits is one of 4, 8"):
        MethodSpec.parse("openvino:bits=5")
    with pytest.raises(UserError, match="needs a model"):
        MethodSpec.parse("openvino-draft:k=4")
    with pytest.raises(UserError, match="needs k=N"):
        MethodSpec.parse("openvino-lookup")
    with pytest.raises(UserError, match="takes bits"):
        MethodSpec.parse("openvino:q=int8")


def test_a_peers_speculative_method_is_checked_against_its_own_plain_run() -> None:
    specs = parse_methods("plain,openvino,openvino:bits=8,openvino-lookup:k=2:bits=8,hf-lookup:k=2")
    assert specs[3].plain_of_engine(specs).name == "openvino:bits=8"  # same bits
    assert specs[4].plain_of_engine(specs) is None  # no hf in the run
    assert specs[1].plain_of_engine(specs) is None  # a plain method has none
    runs = [
        peer_run("plain", [1, 2, 3, 4], 4.0),
        peer_run("openvino", [1, 2, 5, 5], 2.0),
        peer_run("openvino:bits=8", [1, 2, 3, 6], 2.0),
        peer_run("openvino-lookup:k=2:bits=8", [1, 2, 3, 6], 1.0),
        peer_run("hf-lookup:k=2", [1, 2, 3, 4], 8.0),
    ]
    methods = summarize(runs, specs, greedy=True)["methods"]
    assert methods["openvino-lookup:k=2:bits=8"]["exactness"]["versus"] == "openvino:bits=8"
    assert methods["openvino-lookup:k=2:bits=8"]["exactness"]["share_identical"] == 1.0
    assert methods["openvino"]["exactness"]["versus"] == "plain"  # how far the engine moves it
    assert methods["openvino"]["exactness"]["per_prompt"][0]["first_divergence"] == 2
    assert methods["hf-lookup:k=2"]["exactness"]["versus"] == "plain"
    lines = best_table(summarize(runs, specs, greedy=True))
    best = "4.00 (openvino-lookup:k=2:bits=8)"
    assert lines[4] == f"| OpenVINO GenAI | {best} | {best} |"


def _fake_cli(path: Path, body: str) -> Path:
    """An executable standing in for optimum-cli: a Python script with `body` (argv in
    `sys.argv`; the output folder is the last argument)."""
    path.write_text(
        f"#!{sys.executable}\nimport pathlib, sys\nout = pathlib.Path(sys.argv[-1])\n{body}\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_export_runs_once_offline_and_is_reused(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    calls = tmp_path / "calls.txt"
    cli = _fake_cli(
        tmp_path / "cli",
        "import os\n"
        f"line = ' '.join(sys.argv[1:]) + ' ' + os.environ['HF_HUB_OFFLINE']\n"
        f"open({str(calls)!r}, 'a').write(line + '\\n')\n"
        "out.mkdir(exist_ok=True)\n(out / 'openvino_model.xml').write_text('<net/>')",
    )
    out = exported(folder, 4, str(cli))
    assert out == folder / "openvino-int4" and (out / "openvino_model.xml").is_file()
    assert exported(folder, 4, "/no/such/cli") == out  # cached: the exporter is not asked again
    (call,) = calls.read_text().splitlines()
    assert call.startswith(f"export openvino --model {folder} --task text-generation-with-past")
    assert "--weight-format int4 --group-size-fallback adjust" in call
    assert call.endswith(".openvino-int4.partial 1")  # into a hidden sibling, offline
    assert "--group-size-fallback" not in export_command("cli", folder, 8, out)
    assert not list(folder.glob(".openvino*"))


def test_a_failed_export_says_why_and_leaves_nothing_behind(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    cli = _fake_cli(
        tmp_path / "cli",
        "out.mkdir(exist_ok=True)\n"
        "print('nncf: group size 128 does not divide 576', file=sys.stderr)\n"
        "sys.exit(3)",
    )
    with pytest.raises(UserError, match=r"could not export .* \(exit 3\): nncf: group size 128"):
        exported(folder, 4, str(cli))
    assert sorted(p.name for p in folder.iterdir()) == []


def test_the_exporter_is_found_or_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv(openvino.CLI_VARIABLE, raising=False)
    with pytest.raises(MissingDependencyError, match="make openvino-exporter"):
        optimum_cli()
    local = tmp_path / ".venv-optimum" / "bin"
    local.mkdir(parents=True)
    _fake_cli(local / "optimum-cli", "")
    assert optimum_cli() == os.path.join(".venv-optimum", "bin", "optimum-cli")
    (tmp_path / "bin").mkdir()
    on_path = _fake_cli(tmp_path / "bin" / "optimum-cli", "")
    assert optimum_cli() == str(on_path)
    monkeypatch.setenv(openvino.CLI_VARIABLE, str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"SPECDECODE_OPTIMUM_CLI is .*not a file"):
        optimum_cli()


def test_without_openvino_genai_the_peer_is_skipped_with_what_to_install(
    tiny_model_dir: Path, tiny_prompts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "openvino_genai", None)
    config = peer_config(str(tiny_model_dir), "plain,openvino", (str(tiny_prompts),), 4, "float32")
    report = run_bench(config, log=False)
    assert {r.method for r in report["runs"]} == {"plain"}
    (skip,) = report["skipped"]
    assert "pip install openvino-genai==" in skip["reason"]
    assert "- skipped openvino: " in markdown(report)


def test_without_an_exporter_the_peer_is_skipped_with_how_to_build_one(
    tiny_model_dir: Path, tiny_prompts: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is an optional peer")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(openvino.CLI_VARIABLE, raising=False)
    methods = "plain,openvino-lookup:k=2"
    report = run_bench(
        peer_config(str(tiny_model_dir), methods, (str(tiny_prompts),), 4, "float32"), log=False
    )
    (skip,) = report["skipped"]
    assert skip["method"] == "openvino-lookup:k=2"
    assert "make openvino-exporter" in skip["reason"]


@pytest.mark.real_model
def test_openvino_peers_run_on_the_real_model(smollm2_dir: Path) -> None:
    pytest.importorskip("openvino_genai", reason="OpenVINO GenAI is an optional peer")
    try:
        optimum_cli()
    except MissingDependencyError:
        if not (smollm2_dir / "openvino-int4" / "openvino_model.xml").is_file():
            pytest.skip("no optimum-cli to export the model with (make openvino-exporter)")
    methods = "plain,openvino,openvino-lookup:k=4,openvino-draft:smollm2-135m:k=2"
    report = run_bench(peer_config("smollm2-135m", methods, ("qa",), 16, "auto"), log=False)
    assert report["skipped"] == []
    runs = {r.method: r for r in report["runs"]}
    assert {r.num_tokens for r in runs.values()} == {16}
    assert all(0 <= t < 49152 for r in runs.values() for t in r.token_ids)
    assert len(runs["openvino-draft:smollm2-135m:k=2"].arrivals) < 16  # several tokens a step
    exact = {n: m["exactness"] for n, m in report["summary"]["methods"].items()}
    assert exact["openvino-lookup:k=4"]["versus"] == "openvino"
    assert exact["openvino-draft:smollm2-135m:k=2"]["share_identical"] == 1.0
