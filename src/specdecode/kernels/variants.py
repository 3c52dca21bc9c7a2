"""The builds of the CPU kernels, one per instruction-set level, and which one this CPU runs.

`setup.py` compiles the kernels' sources once per variant of this machine's architecture, at
install, into `specdecode.kernels._cpu_<name>`; at run time `choose` picks the best variant
that was built and that this CPU can execute (as PyTorch's CPU capability dispatch and
llama.cpp's GGML_CPU_ALL_VARIANTS do). SPECDECODE_CPU=auto|<name> forces one. This module
imports nothing but the standard library: setup.py loads it by path, before torch is there.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ENV = "SPECDECODE_CPU"  # auto (default) or a variant's name
BUILD_ENV = "SPECDECODE_CPU_VARIANTS"  # at install: the variants to build (default: all)


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name (SPECDECODE_CPU's value, the module's suffix), the
    architecture it is built on, its compiler flags, the CPU features (as Linux's
    /proc/cpuinfo names them) a CPU needs to run it, and the folder of arch/ that holds its
    instruction sets' micro-kernels (on the include path of its build only)."""

    name: str
    arch: str  # platform.machine() of the machines it is built for ("" = every machine)
    flags: tuple[str, ...]
    needs: frozenset[str]
    folder: str  # arch/<folder>

    def include(self, kernels: Path) -> str:
        """The compiler flag that puts its arch folder (under the kernels' folder) on the
        include path."""
        return f"-I{kernels / 'arch' / self.folder}"

    @property
    def module(self) -> str:
        """The extension module's name inside specdecode.kernels."""
        return f"_cpu_{self.name}"


# x86-64-v3 (Haswell and later, Zen 1 and later) and x86-64-v4 as /proc/cpuinfo names them
_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_AVX512 = _V4 | {"avx512_vnni", "avx512_bf16", "avx512vbmi"}
_AVX512_FLAGS = ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi")

# best first: `choose` takes the first one built that the CPU runs
VARIANTS: tuple[Variant, ...] = (
    Variant(
        "amx",
        "x86_64",
        (*_AVX512_FLAGS, "-mamx-tile", "-mamx-int8", "-mamx-bf16"),
        _AVX512 | {"amx_tile", "amx_int8", "amx_bf16"},
        "avx512",  # its tile code is matmul.cpp's; the vector micro-kernels are AVX-512's
    ),
    Variant("avx512", "x86_64", _AVX512_FLAGS, _AVX512, "avx512"),
    Variant("avxvnni", "x86_64", ("-march=x86-64-v3", "-mavxvnni"), _V3 | {"avx_vnni"}, "avxvnni"),
    Variant("avx2", "x86_64", ("-march=x86-64-v3",), _V3, "avx2"),
    # ARM64 with the dot-product instructions (Graviton 2+, Ampere, Apple M1+, Cortex-A76+)
    Variant(
        "neon", "aarch64", ("-march=armv8.2-a+dotprod",), frozenset({"asimd", "asimddp"}), "neon"
    ),
    Variant("portable", "", (), frozenset(), "portable"),
)
NAMES = tuple(v.name for v in VARIANTS)


def for_machine(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built on this architecture (platform.machine(), or `machine`)."""
    machine = machine or platform.machine()
    return tuple(v for v in VARIANTS if v.arch in ("", machine))


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux's names); empty where /proc/cpuinfo is not there."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, ARM64
            return frozenset(value.split())
    return frozenset()


def runs_here(variant: Variant, features: frozenset[str]) -> bool:
    """Whether a CPU with these features can execute the variant."""
    return variant.arch in ("", platform.machine()) and variant.needs <= features


def missing(variant: Variant, features: frozenset[str]) -> list[str]:
    """The features the variant needs that the CPU lacks (sorted)."""
    return sorted(variant.needs - features)


def sources(folder: Path) -> list[Path]:
    """The kernels' sources in `folder` and its arch folders (*.cpp and *.h), in a fixed order."""
    return sorted(folder.rglob("*.cpp")) + sorted(folder.rglob("*.h"))


def source_hash(folder: Path) -> str:
    """A digest of the kernels' sources in `folder` (see `sources`): a build records the
    digest of its sources, and a build of other sources is refused at load."""
    digest = hashlib.sha256()
    for path in sources(folder):
        name = path.relative_to(folder).as_posix()
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def to_build(environ: dict[str, str] | None = None) -> tuple[Variant, ...]:
    """The variants `setup.py` builds: this architecture's, or those SPECDECODE_CPU_VARIANTS
    names (comma-separated); ValueError for a name that is not one of them."""
    environ = os.environ if environ is None else environ
    here = for_machine()
    wanted = environ.get(BUILD_ENV, "").strip()
    if not wanted:
        return here
    names = [name.strip() for name in wanted.split(",") if name.strip()]
    known = {v.name: v for v in here}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"{BUILD_ENV}={wanted}: {', '.join(unknown)} is not a variant of this machine "
            f"({platform.machine()}); allowed: {', '.join(known)}"
        )
    return tuple(v for v in here if v.name in names)
