"""Builds specdecode's C++ CPU kernels at install, once per instruction-set level of this
machine's architecture (src/specdecode/kernels/variants.py): `pip install .` compiles them
into specdecode.kernels._cpu_<variant>, and at run time the package loads the best one this
CPU runs. Nothing is compiled at run time. SPECDECODE_CPU_VARIANTS=avx2,portable builds only
those (a faster install); every other setting lives in pyproject.toml."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.errors import CCompilerError, CompileError
from torch.utils.cpp_extension import BuildExtension, CppExtension

KERNELS = Path("src/specdecode/kernels")
# compiled per variant: the cores (with the variant's instruction sets) and the module itself
SOURCES = ["ops", "matmul", "gguf", "attention", "pointwise", "peak"]
# compiled once, with no instruction-set flags, and linked into every variant: the torch
# bindings (no vector code; two thirds of a variant's compile time when compiled in each)
BINDINGS = ["bindings", "tensors", "layer"]
# -ffp-contract=off: the fp32 epilogues round exactly as the Python reference does;
# -mtune=native: instruction scheduling for the machine that installs (the one that usually
# runs them), never an instruction the variant's -march does not allow; -g0: no debug
# information (Python's flags ask for it), which took ~40% of the compile time and most of
# each module's bytes, and never changes the code
COMMON = ["-O3", "-ffp-contract=off", "-fopenmp", "-mtune=native", "-g0"]


def _variants_module():
    """kernels/variants.py, loaded by path (the package itself needs the kernels)."""
    spec = importlib.util.spec_from_file_location("_specdecode_variants", KERNELS / "variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH (the venv's bin is not on it unless activated)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # torch builds the slower way, one file after another
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


class BuildVariants(BuildExtension):
    """torch's BuildExtension with each variant's objects in a folder of their own (every
    variant compiles the same sources) and the bindings' objects compiled once, in a folder of
    theirs, for every variant to link. A variant that does not compile (a compiler too old for
    its flags, no compiler at all) is left out with a warning: the package loads the best
    variant that was built, and says so where none was."""

    _bindings: list[str] | None = None

    def build_extension(self, ext) -> None:
        base = self.build_temp
        try:
            objects = self._binding_objects(ext, os.path.join(base, "bindings"))
            ext.extra_objects = [*objects, *(o for o in ext.extra_objects if o not in objects)]
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
            super().build_extension(ext)
        except (RuntimeError, OSError, CompileError, CCompilerError) as err:  # ninja: RuntimeError
            self.warn(f"specdecode: {ext.name} was not built ({err}); it is left out")
        finally:
            self.build_temp = base

    def _binding_objects(self, ext, folder: str) -> list[str]:
        """The bindings' objects, compiled at the first variant with its include folders and
        torch's flags but none of the variant's own."""
        if self._bindings is None:
            own = {*_variant_flags(ext.extra_compile_args)}
            flags = [flag for flag in ext.extra_compile_args if flag not in own]
            self._bindings = self.compiler.compile(
                [str(KERNELS / f"{name}.cpp") for name in BINDINGS],
                output_dir=folder,
                include_dirs=ext.include_dirs,
                extra_postargs=flags,
            )
        return self._bindings


def _variant_flags(flags: list[str]) -> list[str]:
    """The flags of `flags` that belong to one variant: its instruction sets, its arch folder,
    its name, the digest of its sources, its module's name."""
    variants = _variants_module()
    isa = {flag for v in variants.VARIANTS for flag in v.flags}
    own = ("-DSPECDECODE_VARIANT=", "-DSPECDECODE_SOURCE_HASH=", "-DTORCH_EXTENSION_NAME=", "-I")
    return [flag for flag in flags if flag in isa or flag.startswith(own)]


def extensions() -> list[CppExtension]:
    """One extension module per variant of this machine's architecture."""
    variants = _variants_module()
    digest = variants.source_hash(KERNELS)
    return [
        CppExtension(
            name=f"specdecode.kernels.{variant.module}",
            sources=[str(KERNELS / f"{name}.cpp") for name in SOURCES],
            extra_compile_args=[
                *COMMON,
                *variant.flags,
                # its arch folder's micro-kernels, by absolute path (ninja runs in build/)
                variant.include(KERNELS.resolve()),
                # bare words (ops.cpp makes them strings): no quotes to survive a shell
                f"-DSPECDECODE_VARIANT={variant.name}",
                f"-DSPECDECODE_SOURCE_HASH={digest}",
            ],
            extra_link_args=["-fopenmp"],
        )
        for variant in variants.to_build()
    ]


_ninja_on_path()
setup(ext_modules=extensions(), cmdclass={"build_ext": BuildVariants})
