"""`specdecode plan`: its flags and its command."""

from __future__ import annotations

import argparse
import json

from specdecode.cli_args import (
    add_weight_flags,
    csv,
    json_object,
    require_prompt_files,
    show_progress,
)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode plan`."""
    p = sub.add_parser(
        "plan",
        help="measure step costs and predict which draft shape (chain K or tree) pays",
        description="Replays chains K = 1..--max-k and token trees (width 2-4, depth 2-8, up "
        "to 15 nodes) of the drafter over the target's greedy text on --prompts, and predicts "
        "each one's speedup = tokens * target(1) / (drafting + sum of target(draft + 1)) with "
        "the pass costs measured here; prints the best shape's speculative_config. With "
        "--acceptance a: chains only, E = (1 - a^(K+1)) / (1 - a) tokens per step.",
    )
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf")
    p.add_argument("--speculative-config", type=json_object, required=True)
    p.add_argument("--acceptance", type=float, default=None, help="default: replay shapes")
    p.add_argument("--context", type=int, default=256, help="cached tokens before each pass")
    p.add_argument("--max-k", type=int, default=8, help="longest chain compared")
    p.add_argument(
        "--prompts",
        type=csv,
        default=("sharegpt",),
        help="prompt sets replayed on (default: sharegpt, held out from the bench)",
    )
    p.add_argument("--per-set", type=int, default=8, help="prompts taken from each set")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    add_weight_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (no progress)")


def run_plan_command(args: argparse.Namespace) -> int:
    """`specdecode plan`: measure, replay, print the plan (markdown, or one JSON object)."""
    from specdecode.bench.plan import PlanConfig, plan_text, run_plan

    require_prompt_files(args.prompts)
    plan = run_plan(
        PlanConfig(
            model=args.model,
            speculative_config=args.speculative_config,
            acceptance=args.acceptance,
            context=args.context,
            max_k=args.max_k,
            dtype=args.dtype,
            device=args.device,
            quantization=args.quantization,
            prompt_sets=args.prompts,
            per_set=args.per_set,
            max_tokens=args.max_tokens,
            progress=show_progress(args.json),
        )
    )
    print(json.dumps(plan) if args.json else plan_text(plan), end="\n" if args.json else "")
    return 0
