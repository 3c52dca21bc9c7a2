"""What the `specdecode` subcommands share: the parser that reports bad input in one line,
argument types, the weight flags, the LLM they describe, and whether to show progress."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.loading import DTYPES
from specdecode.model.quant import AUTO, QUANTIZATIONS
from specdecode.sampling_params import SamplingParams

BAD_INPUT = 2  # the exit code of every bad input


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr and exit code 2, like every other
    bad input (`specdecode: error: argument --max-tokens: invalid int value: 'x' (see
    `specdecode generate --help`)`), instead of the usage text first. Its subcommands' parsers
    are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"specdecode: error: {message} (see `{self.prog} --help`)\n")


def json_object(text: str) -> dict[str, object]:
    """argparse type: a JSON object; a bad one names the position of the JSON error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"not valid JSON: {err.msg} at line {err.lineno} column {err.colno} (char "
            f"{err.pos}) of {text!r}"
        ) from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def csv(text: str) -> tuple[str, ...]:
    """argparse type: a comma-separated list of names."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def require_file(path: str | Path) -> Path:
    """`path` as a Path; UserError "no such file: PATH" where nothing is there."""
    found = Path(path).expanduser()
    if not found.exists():
        raise UserError(f"no such file: {path}")
    return found


def require_prompt_files(sets: tuple[str, ...]) -> None:
    """Refuse a prompt set given as a path (a .jsonl name or one with a folder) that does not
    exist: "no such file: PATH" (a set's name, e.g. "chat", is checked where it is loaded)."""
    for name in sets:
        if name.endswith(".jsonl") or "/" in name:
            require_file(name)


def add_quantization(p: argparse.ArgumentParser) -> None:
    """--quantization: the target's weight format."""
    p.add_argument(
        "--quantization",
        default=AUTO,
        choices=[AUTO, "none", *QUANTIZATIONS],
        help="weight format of the target (and of a draft model, unless speculative_config "
        "sets its own): auto (default) = gguf where the model has a GGUF file and runs on the "
        "CPU, else none; none = --dtype, int8 = dynamic int8, int4 = weight-only int4, "
        "gguf = the GGUF file's own blocks (pulled aliases and .gguf files), q4_0 .. q8_0 = "
        "the dense weights requantized into those GGUF blocks as the model loads",
    )


def add_weight_flags(p: argparse.ArgumentParser) -> None:
    """--dtype, --device and --quantization: how the target's weights are loaded."""
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    add_quantization(p)


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p and --seed (`sampling_from_args` reads them)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = disabled")
    p.add_argument("--seed", type=int, default=None)


def sampling_from_args(args: argparse.Namespace, **fields: object) -> SamplingParams:
    """The SamplingParams of `add_sampling_flags`'s flags and --max-tokens, plus `fields`."""
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        **fields,  # type: ignore[arg-type]
    )


def add_speculative_flag(p: argparse.ArgumentParser) -> None:
    """--speculative-config: one drafter's JSON config (`llm_from_args` reads it)."""
    p.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'',
    )


def llm_from_args(args: argparse.Namespace) -> LLM:
    """The LLM that --model, --dtype, --device, --speculative-config and --quantization say."""
    return LLM(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        speculative_config=args.speculative_config,
        quantization=args.quantization,
    )


def show_progress(quiet: bool = False) -> bool:
    """Whether a command shows progress bars: not when told to be `quiet` (--json,
    --no-progress), nor when stderr is not a terminal (a log file, a pipe)."""
    return not quiet and sys.stderr.isatty()
