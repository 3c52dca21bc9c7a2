"""`specdecode plan`: measure step costs here and predict each K's speedup (see `costs.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specdecode.bench.costs import (
    PASS_TABLE_WIDTH,
    bench_costs,
    expected_tokens_per_step,
    pass_table_text,
    predicted_from_costs,
)
from specdecode.bench.prompts import load_prompts
from specdecode.bench.roofline import measure_bandwidth, roofline, roofline_text
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.types import SamplingParams


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """What to plan for.

    model: the target (alias, folder or .gguf).
    speculative_config: the method, in `LLM`'s form; its K is where acceptance is measured.
    acceptance: the acceptance rate to plan with; None = measure it by generating greedily on
        `per_set` prompts of each of `prompt_sets` (`max_tokens` each).
    context: cached tokens before each timed pass (step costs grow with the context).
    max_k: plan for K = 1..max_k.
    quantization: the target's weight format (`LLM`'s quantization).
    """

    model: str
    speculative_config: Mapping[str, Any]
    acceptance: float | None = None
    context: int = 256
    max_k: int = 8
    dtype: str = "bfloat16"
    device: str = "cpu"
    quantization: str = "none"
    prompt_sets: tuple[str, ...] = ("code", "chat")
    per_set: int = 1
    max_tokens: int = 64
    repeats: int = 5


def measured_acceptance(llm: LLM, config: PlanConfig) -> float:
    """Acceptance rate of `llm`'s drafter over greedy generations on the configured prompts."""
    prompts = load_prompts(list(config.prompt_sets), config.per_set)
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens)
    llm.generate([llm.chat_prompt(list(p.messages)) for p in prompts], params)
    return llm.spec_metrics.acceptance_rate


def run_plan(config: PlanConfig) -> dict[str, Any]:
    """Step costs, the acceptance used, and per K the expected tokens/step and speedup."""
    if config.acceptance is not None and not 0.0 <= config.acceptance <= 1.0:
        raise UserError(f"--acceptance must be in [0, 1], got {config.acceptance}")
    if not 1 <= config.max_k <= MAX_SPECULATIVE_TOKENS:
        raise UserError(f"--max-k must be in 1..{MAX_SPECULATIVE_TOKENS}, got {config.max_k}")
    if config.context < 1:
        raise UserError(f"--context must be >= 1 cached token, got {config.context}")
    target = LLM(config.model, config.dtype, device=config.device, quantization=config.quantization)
    room = target.model.config.max_position_embeddings
    widest = max(config.max_k + 1, PASS_TABLE_WIDTH)
    if config.context + widest > room:
        raise UserError(
            f"--context {config.context} + a pass of {widest} tokens (the pass table's widest, "
            f"or --max-k + 1) exceeds the model's context of {room} tokens"
        )
    llm = target.with_speculative_config(config.speculative_config)
    draft = llm.draft_model
    drafts = {} if draft is None else {"draft": draft}
    costs = bench_costs(target.model, drafts, config.max_k, config.context, config.repeats)
    draft_ms = costs["draft_ms"].get("draft", 0.0)
    acceptance = config.acceptance
    source = "given"
    if acceptance is None:
        acceptance, source = measured_acceptance(llm, config), "measured"
    name = None if draft is None else "draft"
    rows = [
        {
            "k": k,
            "expected_tokens_per_step": expected_tokens_per_step(acceptance, k),
            "step_ms": k * draft_ms + costs["target_ms"][k],
            "predicted_speedup": predicted_from_costs(acceptance, k, costs, name),
        }
        for k in range(1, config.max_k + 1)
    ]
    return {
        "costs": costs,
        "target_ms": {t + 1: ms for t, ms in enumerate(costs["target_ms"])},
        "draft_ms": draft_ms,
        "acceptance": acceptance,
        "acceptance_source": source,
        "rows": rows,
        "best_k": max(rows, key=lambda r: r["predicted_speedup"])["k"],
        "roofline": roofline(
            target.model, config.context, measure_bandwidth(), costs["target_ms"][0]
        ),
    }


def plan_text(plan: dict[str, Any]) -> str:
    """The plan as a short markdown report."""
    lines = [
        roofline_text(plan["roofline"]),
        "",
        pass_table_text(plan["costs"]),
        "",
        f"draft token ms: {plan['draft_ms']:.1f}",
        f"acceptance {plan['acceptance']:.3f} ({plan['acceptance_source']})",
        "",
        "| K | E[tokens/step] | step ms | predicted speedup |",
        "|---|---|---|---|",
    ]
    for row in plan["rows"]:
        best = " (best)" if row["k"] == plan["best_k"] else ""
        lines.append(
            f"| {row['k']}{best} | {row['expected_tokens_per_step']:.2f} | {row['step_ms']:.1f} "
            f"| {row['predicted_speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"
