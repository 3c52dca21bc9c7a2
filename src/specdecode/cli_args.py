"""Argument types and flags shared by the `specdecode` subcommands."""

from __future__ import annotations

import argparse
import json

from specdecode.model.loading import DTYPES
from specdecode.model.quant import AUTO, QUANTIZATIONS


def json_object(text: str) -> dict[str, object]:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_quantization(p: argparse.ArgumentParser) -> None:
    """--quantization: the target's weight format."""
    p.add_argument(
        "--quantization",
        default=AUTO,
        choices=[AUTO, "none", *QUANTIZATIONS],
        help="weight format of the target (and of a draft model, unless speculative_config "
        "sets its own): auto (default) = gguf where the model has a GGUF file and runs on the "
        "CPU, else none; none = --dtype, int8 = dynamic int8, int4 = weight-only int4, "
        "gguf = the GGUF file's own blocks (pulled aliases and .gguf files)",
    )


def add_weight_flags(p: argparse.ArgumentParser) -> None:
    """--dtype, --device and --quantization: how the target's weights are loaded."""
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    add_quantization(p)
