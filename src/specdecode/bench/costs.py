"""Step costs and the speculative cost model: what a method should gain on this machine.

With acceptance rate a (each draft token accepted independently with probability a) and K draft
tokens, a step emits E = (1 - a^(K+1)) / (1 - a) tokens on average (Leviathan et al. 2023;
E = K + 1 when a = 1). A step costs K draft passes of one token plus one target pass over K + 1
tokens, so

    speedup = E * target(1) / (K * draft(1) + target(K + 1))

where target(T) and draft(T) are the measured seconds of a forward pass over T new tokens.
Worked example: a = 0.8, K = 4, target(1) = 170 ms, target(5) = 200 ms, draft(1) = 60 ms:
E = (1 - 0.8^5) / 0.2 = 3.36; speedup = 3.36 * 170 / (4 * 60 + 200) = 1.30.

That formula is for planning (`specdecode plan`, a given acceptance). A finished run is checked
with `predicted_from_counters`, which replaces the independence assumption by what the counters
saw: how many decode steps carried a draft, how long the drafts were, and how many tokens the
steps emitted. Prompt lookup needs this: its drafts come in bursts (a copied span is accepted
whole, then lookups miss and steps decode one token), which a single rate a does not describe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from specdecode import kernels
from specdecode.bench.roofline import BANDWIDTH_BYTES, bandwidth_read, madds_per_token
from specdecode.engine.costs import (
    expected_tokens,
    interleaved_seconds,
    verification_passes,
)
from specdecode.metrics import SpecCounters
from specdecode.model.gguf_linear import REQUANTIZED
from specdecode.model.transformer import Transformer

# The weight formats whose projections multiply int8 activations by integer weights on our
# kernels: their int8 peak is the compute roof (int4 runs torch's kernel, bf16 and fp32 no
# integer products).
INT8_PRODUCTS = frozenset({"int8", "gguf", *REQUANTIZED})

# Pass costs are measured for T = 1 .. at least this many new tokens: the pass table that shows
# how a verification pass grows with its width (t(T) / t(1)), whatever K is planned.
PASS_TABLE_WIDTH = 16
BANDWIDTH = "bandwidth"  # the read's key among the passes


def predicted_speedup(
    acceptance: float, k: int, target_s: dict[int, float], draft_s: float = 0.0
) -> float:
    """The module docstring's speedup; `target_s[T]` = seconds of a target pass over T tokens
    (needs T = 1 and T = K + 1), `draft_s` = seconds of one draft token (0 for lookup drafters)."""
    step = k * draft_s + target_s[k + 1]
    return expected_tokens(acceptance, k) * target_s[1] / step


def bench_costs(
    target: Transformer,
    drafts: Mapping[str, Transformer],
    max_k: int,
    context: int,
    repeats: int = 5,
) -> dict[str, Any]:
    """Pass costs for the cost model, in ms: the target over T = 1..max(max_k + 1,
    PASS_TABLE_WIDTH) new tokens ("target_ms"[T - 1]), each named draft model over one token
    ("draft_ms"[name]), and what the matmuls ran on ("kernels": the kernel variant and
    `kernels.isa`); for the roofline, the target's projection multiply-adds per token
    ("madds_per_token") and, for formats of INT8_PRODUCTS on the CPU kernels, their int8 peak
    measured in this run ("int8_peak_gmacs", G a second: `kernels.int8_peak`; None
    elsewhere); the read bandwidth in GB/s ("bandwidth_gb_s": a streaming read of
    `BANDWIDTH_BYTES`, `bandwidth_read`), for the roofline's floor. Every pass and the read are
    timed `repeats` times in interleaved rounds (`interleaved_seconds`; the medians): their
    ratios are same-run ratios."""
    widths = range(1, max(max_k + 1, PASS_TABLE_WIDTH) + 1)
    passes: dict[tuple[str | None, int], Callable[[], None]] = {
        (None, w): run
        for (_, w), run in verification_passes(target, context, [(1, w) for w in widths]).items()
    }
    for name, model in drafts.items():
        passes[(name, 1)] = verification_passes(model, context, [(1, 1)])[(1, 1)]
    passes[(BANDWIDTH, 0)] = bandwidth_read()
    seconds = interleaved_seconds(passes, repeats)  # the drafts' passes among the target's
    target_s = {w: seconds[(None, w)] for w in widths}
    on_cpu = target.device.type == "cpu" and kernels.available()
    return {
        "madds_per_token": madds_per_token(target),
        "int8_peak_gmacs": (
            kernels.int8_peak() if on_cpu and target.quantization in INT8_PRODUCTS else None
        ),
        "context": context,
        "target_ms": [target_s[t] * 1e3 for t in sorted(target_s)],
        "draft_ms": {name: seconds[(name, 1)] * 1e3 for name in drafts},
        "bandwidth_gb_s": BANDWIDTH_BYTES / seconds[(BANDWIDTH, 0)] / 1e9,
        "kernels": (
            f"{kernels.variant()} kernels, {kernels.isa()}" if on_cpu else target.device.type
        ),
    }


def pass_ratios(costs: Mapping[str, Any]) -> list[float]:
    """t(T) / t(1) for T = 1, 2, ... from `bench_costs`' target_ms."""
    one = costs["target_ms"][0]
    return [ms / one for ms in costs["target_ms"]]


def achieved_gmacs(costs: Mapping[str, Any]) -> list[float]:
    """Per pass width T = 1, 2, ...: the projections' multiply-adds of a pass over T tokens
    divided by the whole pass's time, in G a second (a lower bound on the matmuls' own rate:
    the pass also spends time in attention, norms and glue). Empty for costs that did not
    record the count (reports written before it)."""
    madds = costs.get("madds_per_token")
    if not madds:
        return []
    return [t * madds / (ms / 1e3) / 1e9 for t, ms in enumerate(costs["target_ms"], 1)]


def pass_table_text(costs: Mapping[str, Any]) -> str:
    """The target's pass costs as a markdown table: T, ms, t(T) / t(1), and where recorded
    the projections' G multiply-adds a second (`achieved_gmacs`) and their share of the int8
    peak measured in the same run."""
    rates, peak = achieved_gmacs(costs), costs.get("int8_peak_gmacs")
    head = (
        f"target pass over T new tokens at {costs['context']} cached tokens "
        f"(matmuls: {costs['kernels']})"
    )
    if peak:
        head += f"; int8 peak {peak:.0f} G multiply-adds/s (measured now)"
    lines = [head, "", "| T | ms | t(T) / t(1) |", "|---|---|---|"]
    if rates:
        lines[2] += " G multiply-adds/s |" + (" of int8 peak |" if peak else "")
        lines[3] += "---|" + ("---|" if peak else "")
    for width, (ms, ratio) in enumerate(
        zip(costs["target_ms"], pass_ratios(costs), strict=True), 1
    ):
        line = f"| {width} | {ms:.1f} | {ratio:.2f} |"
        if rates:
            line += f" {rates[width - 1]:.0f} |" + (
                f" {rates[width - 1] / peak:.0%} |" if peak else ""
            )
        lines.append(line)
    return "\n".join(lines)


def predicted_from_costs(
    acceptance: float, k: int, costs: Mapping[str, Any], draft: str | None
) -> float:
    """`predicted_speedup` with the pass costs of `bench_costs` (draft None: a free drafter)."""
    target = {t + 1: ms for t, ms in enumerate(costs["target_ms"])}
    draft_ms = 0.0 if draft is None else costs["draft_ms"].get(draft, 0.0)
    return predicted_speedup(acceptance, k, target, draft_ms)


def _target_ms(costs: Mapping[str, Any], width: float) -> float:
    """A target pass over `width` new tokens (fractional: linear between measured widths)."""
    table = costs["target_ms"]  # [T - 1] = ms of a pass over T tokens
    low = min(max(int(width), 1), len(table))
    high = min(low + 1, len(table))
    return table[low - 1] + (table[high - 1] - table[low - 1]) * (width - low)


def predicted_from_counters(
    counters: SpecCounters, num_requests: int, costs: Mapping[str, Any], draft: str | None
) -> float | None:
    """Decode-phase speedup the pass costs predict for the steps a run actually took.

    `counters` are summed over `num_requests` requests; each request's first step (prefill's
    token) is left out. The remaining S steps emitted N tokens; D of them carried drafts of
    L tokens (chain tokens or tree nodes) on average. Plain decoding spends N * target(1); the
    run spent its drafting time plus D * target(L + 1) + (S - D) * target(1). The drafting
    time is the counters' `draft_s` where they measured it, else L * draft(1) per draft (a
    chain drawn one token per pass). None when no decode step ran.

    Example: S = 10, N = 25, D = 5, L = 4, free drafts, target(1) = 100 ms, target(5) = 120 ms:
    25 * 100 / (5 * 120 + 5 * 100) = 2.27.
    """
    steps = counters.num_steps - num_requests
    emitted = counters.num_output_tokens - num_requests
    if steps <= 0 or emitted <= 0:
        return None
    one = _target_ms(costs, 1)
    # a drafter that is no draft model (a head) has no table entry: its draft_s counts
    draft_ms = 0.0 if draft is None else costs["draft_ms"].get(draft, 0.0)
    drafting = counters.num_drafts
    spent = (steps - drafting) * one
    if drafting:
        length = counters.num_draft_tokens / drafting
        spent += drafting * _target_ms(costs, length + 1)
        measured = counters.draft_s * 1e3
        spent += measured if measured > 0 else drafting * length * draft_ms
    return emitted * one / spent
