"""The kernels' builds (kernels/variants.py): built at install, chosen at run time by the
CPU's features or SPECDECODE_CPU, refused with a clear error where they cannot run."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import runnable_variants, select_variant

from specdecode import kernels
from specdecode.cli import main
from specdecode.kernels import variants

X86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 variants")
ALL_X86 = ("amx", "avx512", "avxvnni", "avx2", "portable")
ZEN3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
LAPTOP = ZEN3 | {"avx_vnni"}  # Alder Lake and later


def test_the_install_built_every_variant_of_this_machine() -> None:
    """`make install` (pip install) builds them all (or those SPECDECODE_CPU_VARIANTS names)."""
    assert kernels.built() == tuple(v.name for v in variants.to_build())
    assert kernels.available()


@X86
def test_auto_takes_the_best_installed_variant_the_cpu_runs() -> None:
    assert kernels.choose("auto", LAPTOP, ALL_X86) == "avxvnni"
    assert kernels.choose("auto", ZEN3, ALL_X86) == "avx2"
    assert kernels.choose("auto", LAPTOP, ("avx512", "portable")) == "portable"
    assert kernels.choose("auto", frozenset(), ALL_X86) == "portable"
    everything = variants.VARIANTS[0].needs
    assert kernels.choose("auto", everything, ALL_X86) == "amx"
    assert kernels.choose("avx2", everything, ALL_X86) == "avx2"


@X86
def test_a_forced_variant_the_cpu_cannot_run_names_what_it_lacks() -> None:
    with pytest.raises(kernels.NativeKernelsUnavailable, match=r"lacks avx512_bf16, .*avx512f"):
        kernels.choose("avx512", LAPTOP, ALL_X86)
    with pytest.raises(kernels.NativeKernelsUnavailable, match="lacks avx_vnni"):
        kernels.choose("avxvnni", ZEN3, ALL_X86)


def test_a_variant_that_is_not_installed_says_how_to_get_it() -> None:
    with pytest.raises(kernels.NativeKernelsUnavailable, match=r"installed: portable\).*pip"):
        kernels.choose("avx2", variants.VARIANTS[0].needs, ("portable",))
    with pytest.raises(kernels.NativeKernelsUnavailable, match="installed: none"):
        kernels.choose("auto", frozenset(), ())


@X86
def test_auto_says_when_no_installed_variant_runs_here() -> None:
    """A build for a bigger CPU (an AMX-only install on a laptop) is not silently skipped."""
    with pytest.raises(kernels.NativeKernelsUnavailable, match=r"none installed runs.*amx"):
        kernels.choose("auto", LAPTOP, ("amx",))


def test_an_unknown_variant_lists_the_allowed_ones() -> None:
    with pytest.raises(kernels.NativeKernelsUnavailable, match="allowed: auto, amx, avx512, avx"):
        kernels.choose("sse9", frozenset(), ALL_X86)


def test_cpu_features_read_x86_and_arm64_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\nbugs\t\t: spectre\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp i8mm\n")
    assert variants.cpu_features(x86) == {"fpu", "avx2", "fma"}
    assert variants.cpu_features(arm) == {"fp", "asimd", "asimddp", "i8mm"}
    assert variants.cpu_features(tmp_path / "missing") == frozenset()


def test_each_architecture_builds_its_own_variants() -> None:
    """x86-64 builds the four x86 levels, ARM64 the NEON one (dot product), both portable;
    an ARM64 CPU without the dot product (Cortex-A72) runs portable."""
    assert tuple(v.name for v in variants.for_machine("x86_64")) == ALL_X86
    assert [v.name for v in variants.for_machine("aarch64")] == ["neon", "portable"]
    neon = variants.for_machine("aarch64")[0]
    assert variants.missing(neon, frozenset({"fp", "asimd"})) == ["asimddp"]
    assert variants.missing(neon, frozenset({"fp", "asimd", "asimddp", "i8mm"})) == []


def test_the_install_builds_the_variants_it_is_told_to() -> None:
    assert variants.to_build({}) == variants.for_machine()
    assert [v.name for v in variants.to_build({variants.BUILD_ENV: "portable"})] == ["portable"]
    with pytest.raises(ValueError, match="sse9 is not a variant of this machine"):
        variants.to_build({variants.BUILD_ENV: "portable,sse9"})


def test_a_build_of_other_sources_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An editable install whose kernel sources changed since the build: a clear error, never
    the old kernels."""
    monkeypatch.setattr(variants, "source_hash", lambda folder: "0" * 16)
    kernels.native.cache_clear()
    with pytest.raises(kernels.NativeKernelsUnavailable, match="built from other sources"):
        kernels.native()
    monkeypatch.undo()
    kernels.native.cache_clear()
    kernels.available.cache_clear()


def test_env_names_the_variant_in_use(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in runnable_variants():
        select_variant(name, monkeypatch)
        assert main(["env"]) == 0
        assert f"kernels in use: {name} ({variants.ENV}={name})" in capsys.readouterr().out
    select_variant("sse9", monkeypatch)
    assert main(["env"]) == 2
    assert "allowed: auto" in capsys.readouterr().err
    select_variant("auto", monkeypatch)


def test_nothing_compiles_at_run_time() -> None:
    """Loading and running the kernels never reaches torch's JIT builder."""
    code = (
        "import sys, torch; from specdecode import kernels; kernels.native();"
        "kernels.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6);"
        "print('torch.utils.cpp_extension' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


KERNELS = Path(variants.__file__).parent
# what every arch folder defines (each *_shared.h says what), included by the op files
MICRO_KERNELS = (
    "argmax_row.h",
    "attention_paths.h",
    "epilogue.h",
    "gguf_tile.h",
    "matmul_dot.h",
    "peak_chains.h",
)


def test_every_variant_has_an_arch_folder_with_every_micro_kernel() -> None:
    """A variant's instruction sets live in its arch folder (on its include path alone): each
    folder answers every header the op files include, and no folder is left without a
    variant."""
    folders = {v.folder for v in variants.VARIANTS}
    assert folders == {p.name for p in (KERNELS / "arch").iterdir() if p.is_dir()}
    for folder in folders:
        present = {p.name for p in (KERNELS / "arch" / folder).glob("*.h")}
        assert set(MICRO_KERNELS) <= present, (folder, set(MICRO_KERNELS) - present)
    for name in MICRO_KERNELS:  # found in the arch folder, never beside the op files
        assert not (KERNELS / name).exists()


def test_the_op_files_hold_no_instruction_set_conditionals() -> None:
    """Vector code lives in the arch folders: the op files' only conditionals are
    matmul.cpp's AMX tiles (the amx variant shares the avx512 folder) and ops.cpp's defaults
    for a build without setup.py's names."""
    allowed = {"matmul.cpp": ("SPECDECODE_AMX", "__AMX_TILE__"), "ops.cpp": ("SPECDECODE_",)}
    for path in sorted(KERNELS.glob("*.cpp")):
        for line in path.read_text().splitlines():
            if line.startswith(("#if", "#elif")):
                words = allowed.get(path.name, ())
                assert any(word in line for word in words), f"{path.name}: {line}"


def test_the_source_digest_covers_the_arch_folders(tmp_path: Path) -> None:
    """A change to a micro-kernel changes the digest, so a build of the old sources is refused."""
    (tmp_path / "arch" / "avx2").mkdir(parents=True)
    (tmp_path / "ops.cpp").write_text("int x;")
    header = tmp_path / "arch" / "avx2" / "gguf_tile.h"
    header.write_text("// one")
    before = variants.source_hash(tmp_path)
    header.write_text("// two")
    assert variants.source_hash(tmp_path) != before
