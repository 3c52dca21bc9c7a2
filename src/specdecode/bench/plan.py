"""`specdecode plan`: measure step costs here and predict which draft shape pays (chain K or a
token tree), per drafter and weight format.

Without --acceptance, the plan generates the target's greedy text on a few prompts (by default
ShareGPT's, held out from the benchmark: shapes are never chosen on the bench's own prompts) and
replays every candidate shape of the configured drafter over it (`replay.py`: the exact steps a
greedy run would take, and the drafter's own time), then prices each step with the measured
pass table:

    predicted speedup = tokens * t(1) / (drafting time + sum over steps of t(draft size + 1))

Sequoia's objective (expected tokens per step over the step's cost), with the expectation
replaced by the replayed steps. Candidates: chains K = 1..max_k and, for drafters with tree
keys, trees of width 2..4 and depth 2..8 with up to PASS_TABLE_WIDTH - 1 nodes. The best wins;
where no tree beats the best chain, the chain is chosen. With --acceptance the chains are
priced with the independent-acceptance formula of `costs.py` instead.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from specdecode.bench.costs import (
    PASS_TABLE_WIDTH,
    bench_costs,
    pass_table_text,
    predicted_from_costs,
)
from specdecode.bench.harness import chat_ids
from specdecode.bench.replay import ReplayStats, replay
from specdecode.bench.roofline import roofline, roofline_text
from specdecode.bench.runners import measured_target
from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.corpus.prompts import load_prompts
from specdecode.drafters.base import MAX_SPECULATIVE_TOKENS
from specdecode.drafters.registry import (
    DrafterConfig,
    as_speculative_config,
    parse_speculative_config,
)
from specdecode.engine.costs import expected_tokens
from specdecode.errors import UserError
from specdecode.llm import LLM
from specdecode.model.transformer import Transformer
from specdecode.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """What to plan for.

    model: the target (alias, folder or .gguf).
    speculative_config: the method, in `LLM`'s form (its shape keys are what the plan varies).
    acceptance: price chains K = 1..max_k with this acceptance rate; None = replay every
        candidate shape over the target's greedy text on `per_set` prompts of each of
        `prompt_sets` (`max_tokens` each).
    context: cached tokens before each timed pass (step costs grow with the context).
    max_k: plan for K = 1..max_k.
    quantization: the target's weight format (`LLM`'s quantization).
    progress: say on stderr what is being measured, with a bar over the replayed shapes.
    """

    model: str
    speculative_config: Mapping[str, Any]
    acceptance: float | None = None
    context: int = 256
    max_k: int = 8
    dtype: str = "bfloat16"
    device: str = "cpu"
    quantization: str = "none"
    prompt_sets: tuple[str, ...] = ("sharegpt",)
    per_set: int = 8
    max_tokens: int = 64
    repeats: int = 5
    progress: bool = False


def candidates(config: DrafterConfig, max_k: int) -> list[DrafterConfig]:
    """The shapes a plan compares: chains K = 1..max_k, then (for a method with tree keys)
    trees of width w in 2..4 and depth d in 2, 3, 4, 6, 8 with min(w * d, 15) nodes."""
    fields = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    trees = "tree_width" in fields
    chain = {"tree_width": 1, "tree_depth": None} if trees else {}
    shapes = [
        dataclasses.replace(config, num_speculative_tokens=k, **chain)  # type: ignore[type-var]
        for k in range(1, max_k + 1)
    ]
    if not trees:
        return shapes
    for width in (2, 3, 4):
        for depth in (2, 3, 4, 6, 8):
            nodes = min(width * depth, PASS_TABLE_WIDTH - 1)
            shapes.append(
                dataclasses.replace(  # type: ignore[type-var]
                    config, num_speculative_tokens=nodes, tree_width=width, tree_depth=depth
                )
            )
    return shapes


def greedy_texts(target: LLM, config: PlanConfig) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation ids) on the configured prompts."""
    prompts = load_prompts(list(config.prompt_sets), config.per_set)
    params = SamplingParams(temperature=0.0, max_tokens=config.max_tokens)
    chats = [{"prompt_token_ids": chat_ids(target, p)} for p in prompts]
    outs = target.generate(chats, params)
    return [(c["prompt_token_ids"], list(o.token_ids)) for c, o in zip(chats, outs, strict=True)]


def target_states(model: Transformer, layers: tuple[int, ...], ids: list[int]) -> Tensor:
    """The target's states of `layers` after each of `ids` ([n, F]), from one pass over them
    (what a replayed head reads: `bench.replay`)."""
    meta = AttentionMetadata.prefill([len(ids)], model.device)
    last = torch.tensor([[len(ids) - 1]], device=model.device)  # logits: one position only
    tokens = torch.tensor([ids], device=model.device)
    _, hidden = model(tokens, meta, model.new_cache(1, len(ids)), None, last, layers)
    return hidden[0]


def replayed_speedup(stats: ReplayStats, target_ms: Sequence[float]) -> float:
    """tokens * t(1) / (drafting + sum of t(size + 1)) for replayed steps; target_ms[T - 1] is
    a pass over T tokens. Example: 2 steps of 3-node drafts emitting 5 tokens, t(1) = 10 ms,
    t(4) = 12 ms, 6 ms of drafting: 5 * 10 / (6 + 24) = 1.67."""
    spent = stats.draft_s * 1e3 + sum(target_ms[size] for size in stats.draft_sizes)
    return stats.num_tokens * target_ms[0] / spent if spent > 0 else 0.0


def _shape_rows(llm: LLM, config: PlanConfig, target_ms: Sequence[float]) -> list[dict[str, Any]]:
    """Replay every candidate shape of `config`'s drafter; one row per shape it drafts (a
    shape it refuses, such as a chain longer than a block drafts, has none; UserError where
    it refuses them all)."""
    _stage(config, "generating the target's greedy text to replay the shapes on")
    texts = greedy_texts(llm, config)
    base = parse_speculative_config(config.speculative_config)
    rows = []
    known: dict[tuple[tuple[int, ...], tuple[int, ...]], Tensor] = {}  # one pass per text

    def states(layers: tuple[int, ...], ids: list[int]) -> Tensor:
        key = (layers, tuple(ids))
        if key not in known:
            known[key] = target_states(llm.model, layers, ids)
        return known[key]

    shapes = candidates(base.drafter, config.max_k)
    refused: list[UserError] = []  # shapes the drafter cannot draft (a block's longest, ...)
    for shape in tqdm(shapes, desc="plan: replays", unit="shape", disable=not config.progress):
        spec = dataclasses.replace(base, drafter=shape)
        try:
            drafter = llm.with_speculative_config(spec).engine.drafter
        except UserError as err:
            refused.append(err)
            continue
        stats = replay(
            drafter, texts, config.max_tokens, partial(states, drafter.needs.hidden_layers)
        )
        rows.append(
            {
                "speculative_config": as_speculative_config(spec),
                "k": shape.num_speculative_tokens,
                "tree_width": getattr(shape, "tree_width", 1),
                "tree_depth": getattr(shape, "tree_depth", None),
                "expected_tokens_per_step": stats.tokens_per_step,
                "mean_draft_size": sum(stats.draft_sizes) / max(stats.num_steps, 1),
                "draft_ms_per_step": stats.draft_s * 1e3 / max(stats.num_steps, 1),
                "predicted_speedup": replayed_speedup(stats, target_ms),
            }
        )
    if not rows:
        raise refused[0]
    return rows


def _acceptance_rows(
    acceptance: float, config: PlanConfig, costs: Mapping[str, Any], name: str | None
) -> list[dict[str, Any]]:
    """Chains K = 1..max_k priced with the independent-acceptance formula."""
    draft_ms = costs["draft_ms"].get("draft", 0.0)
    return [
        {
            "k": k,
            "tree_width": 1,
            "tree_depth": None,
            "expected_tokens_per_step": expected_tokens(acceptance, k),
            "mean_draft_size": float(k),
            "draft_ms_per_step": k * draft_ms,
            "predicted_speedup": predicted_from_costs(acceptance, k, costs, name),
        }
        for k in range(1, config.max_k + 1)
    ]


def run_plan(config: PlanConfig) -> dict[str, Any]:
    """Step costs, and per candidate shape its tokens per step and predicted speedup; "best"
    is the row of the shape to use."""
    if config.acceptance is not None and not 0.0 <= config.acceptance <= 1.0:
        raise UserError(f"--acceptance must be in [0, 1], got {config.acceptance}")
    if not 1 <= config.max_k <= MAX_SPECULATIVE_TOKENS:
        raise UserError(f"--max-k must be in 1..{MAX_SPECULATIVE_TOKENS}, got {config.max_k}")
    if config.context < 1:
        raise UserError(f"--context must be >= 1 cached token, got {config.context}")
    target = measured_target(config.model, config.dtype, config.device, config.quantization)
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
    _stage(config, f"measuring the pass table at {config.context} cached tokens")
    costs = bench_costs(target.model, drafts, config.max_k, config.context, config.repeats)
    if config.acceptance is None:
        rows = _shape_rows(llm, config, costs["target_ms"])
    else:
        rows = _acceptance_rows(
            config.acceptance, config, costs, None if draft is None else "draft"
        )
    return {
        "costs": costs,
        "target_ms": {t + 1: ms for t, ms in enumerate(costs["target_ms"])},
        "draft_ms": costs["draft_ms"].get("draft", 0.0),
        "acceptance": config.acceptance,
        "rows": rows,
        "best": max(rows, key=lambda r: r["predicted_speedup"]),
        "roofline": roofline(
            target.model, config.context, costs["bandwidth_gb_s"], costs["target_ms"][0]
        ),
    }


def _stage(config: PlanConfig, what: str) -> None:
    """With `config.progress`, say on stderr what the plan does now."""
    if config.progress:
        tqdm.write(f"plan: {what}", file=sys.stderr)


def _shape(row: Mapping[str, Any]) -> str:
    """ "chain K=3" or "tree K=12 w=3 d=4"."""
    if row["tree_width"] == 1:
        return f"chain K={row['k']}"
    return f"tree K={row['k']} w={row['tree_width']} d={row['tree_depth']}"


def plan_text(plan: dict[str, Any]) -> str:
    """The plan as a short markdown report."""
    source = (
        "replayed over the target's greedy text"
        if plan["acceptance"] is None
        else f"acceptance {plan['acceptance']:.3f} (given), independent per position"
    )
    lines = [
        roofline_text(plan["roofline"]),
        "",
        pass_table_text(plan["costs"]),
        "",
        f"draft token ms: {plan['draft_ms']:.1f}; tokens per step {source}",
        "",
        "| shape | E[tokens/step] | draft size | draft ms/step | predicted speedup |",
        "|---|---|---|---|---|",
    ]
    for row in plan["rows"]:
        best = " (best)" if row == plan["best"] else ""
        lines.append(
            f"| {_shape(row)}{best} | {row['expected_tokens_per_step']:.2f} "
            f"| {row['mean_draft_size']:.1f} | {row['draft_ms_per_step']:.1f} "
            f"| {row['predicted_speedup']:.2f}x |"
        )
    best = plan["best"]
    lines += ["", f"chosen: {_shape(best)}, predicted {best['predicted_speedup']:.2f}x"]
    if "speculative_config" in best:
        lines.append(f"speculative_config: {json.dumps(best['speculative_config'])}")
    return "\n".join(lines) + "\n"
