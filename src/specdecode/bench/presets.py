"""Presets of `specdecode bench`: named sets of its options, so a standing comparison is one
command (`specdecode bench --model smollm2-135m --preset plain-vs-hf`). A flag given on the
command line still wins over the preset, and the preset over the defaults."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType

from specdecode.bench.harness import LoopConfig
from specdecode.bench.run import BenchConfig

# bench's options that a preset may set (argparse dest -> value without a preset or flag):
# the defaults of the configs they fill
_BENCH = {f.name: f.default for f in fields(BenchConfig)}
BENCH_DEFAULTS: Mapping[str, object] = MappingProxyType(
    {
        "methods": _BENCH["methods"],
        "prompts": _BENCH["prompt_sets"],
        "max_tokens": _BENCH["max_tokens"],
        "repeats": next(f.default for f in fields(LoopConfig) if f.name == "repeats"),
        "ignore_eos": _BENCH["ignore_eos"],
    }
)
# `bench --preset NAME`: values for some of BENCH_DEFAULTS' options; a flag given still wins.
BENCH_PRESETS: Mapping[str, Mapping[str, object]] = MappingProxyType(
    {
        # our plain decoding vs HF transformers' generate(), fixed-length outputs: on the same
        # weights (q=none: in --dtype, as HF runs them) and in the run's format (the default,
        # "auto": a GGUF model's own blocks)
        "plain-vs-hf": MappingProxyType(
            {
                "methods": "plain:q=none,plain,hf",
                "prompts": ("chat",),
                "ignore_eos": True,
                "max_tokens": 64,
                "repeats": 3,
            }
        ),
    }
)


def as_flags(options: Mapping[str, object]) -> str:
    """Options as the flags that set them: {"max_tokens": 64, "ignore_eos": True} ->
    "--max-tokens 64 --ignore-eos"."""
    flags = []
    for dest, value in options.items():
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags.append(f"{flag} {','.join(value) if isinstance(value, tuple) else value}")
    return " ".join(flags)


def bench_options(args: argparse.Namespace) -> argparse.Namespace:
    """`args` of `bench` with each option of BENCH_DEFAULTS not given on the command line taken
    from `--preset`, else from BENCH_DEFAULTS."""
    preset = BENCH_PRESETS[args.preset] if args.preset else {}
    given = {dest: getattr(args, dest) for dest in BENCH_DEFAULTS}
    chosen = {
        dest: value if value is not None else preset.get(dest, BENCH_DEFAULTS[dest])
        for dest, value in given.items()
    }
    return argparse.Namespace(**{**vars(args), **chosen})
