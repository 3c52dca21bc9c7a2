"""`specdecode certify`: its flags (with their defaults and a rough run time) and its command."""

from __future__ import annotations

import argparse
import json

from specdecode.certify import CertifyConfig, certify, certify_text
from specdecode.cli_args import add_weight_flags, json_object, llm_from_args, show_progress
from specdecode.errors import UserError

# How long a run takes, as docs/certify.md measured it (the only figure there).
RUN_TIME = (
    "A run with the defaults took about 15 minutes on SmolLM2-135M (2 busy CPU cores, bf16; "
    "docs/certify.md), nearly all of it the sampled runs: the time grows with the model's "
    "per-token cost, --samples and --tokens."
)


def add_certify_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode certify`."""
    default = CertifyConfig()
    p = sub.add_parser(
        "certify",
        help="check that a speculative config samples exactly the target's distribution",
        description="Runs the prompt --samples times for --tokens tokens with the speculative "
        "config (run i with seed --seed + i) and compares the sequences with the target's own "
        "sampling distribution in a chi-square test: its exact probabilities, enumerated from "
        "the target, or (when too many sequences matter) as many runs of plain decoding. "
        "Exit code 0: PASS (p-value >= --alpha), 1: FAIL, 2: bad input. "
        f"{RUN_TIME} See docs/certify.md.",
    )
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf")
    p.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        help="JSON, required: the drafter to certify (plain decoding is the reference itself)",
    )
    p.add_argument("--prompt", default=default.prompt, help=f"default: {default.prompt!r}")
    p.add_argument(
        "--tokens",
        type=int,
        default=default.num_tokens,
        help=f"tokens per run (default {default.num_tokens})",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=default.num_samples,
        help=f"speculative runs (default {default.num_samples:,})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=default.temperature,
        help=f"> 0 (default {default.temperature:g})",
    )
    p.add_argument(
        "--top-k", type=int, default=default.top_k, help=f"-1 = disabled (default {default.top_k})"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=default.top_p,
        help=f"1 = disabled (default {default.top_p:g})",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=default.alpha,
        help=f"significance level (default {default.alpha:g})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=default.seed,
        help=f"run i uses seed + i (default {default.seed})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=default.batch_size,
        help=f"runs per batch (default {default.batch_size:,})",
    )
    add_weight_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (no progress bar)")


def run_certify(args: argparse.Namespace) -> int:
    """`specdecode certify`: 0 on PASS, 1 on FAIL (UserError, exit code 2, on bad input)."""
    if args.speculative_config is None:
        raise UserError(
            "certify needs --speculative-config: it checks a drafter against the target's own "
            "sampling, and plain decoding is that reference"
        )
    config = CertifyConfig(  # checked before the model loads
        prompt=args.prompt,
        num_tokens=args.tokens,
        num_samples=args.samples,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        alpha=args.alpha,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    llm = llm_from_args(args)
    result = certify(llm, config, progress=show_progress(args.json))
    print(json.dumps(result.as_dict()) if args.json else certify_text(result, config))
    return 0 if result.passed else 1
