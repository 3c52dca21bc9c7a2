"""Statistics of benchmark runs: per method x category, paired against plain decoding.

Definitions (speedup, acceptance and tau as in docs/design.md's vocabulary):
- tokens/s of a run = new tokens / wall seconds (prefill included: end to end).
- speedup of a run = its tokens/s / tokens/s of plain decoding on the same prompt in the same
  repeat (the runs of one group ran back to back, so machine drift cancels in the ratio).
- decode speedup: the same ratio for the decode phase alone, (new tokens - 1) / (wall - TTFT),
  which is what the cost model predicts (it leaves prefill out).
- decode ms/token of a run = 1000 / its decode tokens/s.
- median ITL (inter-token latency) of a run: the median gap between tokens arriving after the
  first (`inter_token_ms`); robust to another process taking a core for part of the run.
- share of floor of plain decoding (ours in each weight format, and the HF peer "hf", which runs
  the unquantized weights: format "none") = the roofline's floor ms of a 1-token step in that
  format / the median decode ms/token of the method's runs (1.0 = at the floor).
- acceptance rate and tau come from our counters summed over the cell's runs (peers: None).
- exact: for greedy runs, whether the first repeat's tokens equal plain decoding's, token for
  token, with the first index where they differ otherwise.
- deterministic: whether every repeat of a prompt gave the first repeat's tokens.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from specdecode.bench.costs import predicted_from_counters
from specdecode.bench.methods import MethodSpec
from specdecode.bench.records import Run
from specdecode.energy import joules
from specdecode.metrics import SpecCounters

BASELINE = "plain"
ALL = "all"  # the category name of the cell over every prompt


def spread(values: list[float]) -> dict[str, float] | None:
    """{"median", "min", "max", "n"} of `values`; None when there are none."""
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def tokens_per_s(run: Run) -> float:
    """New tokens per wall second of one run."""
    return run.num_tokens / run.wall_s


def decode_tokens_per_s(run: Run) -> float | None:
    """Tokens after the first per second after the first; None for a run of one token."""
    decode_s = run.wall_s - run.ttft_s
    return (run.num_tokens - 1) / decode_s if run.num_tokens > 1 and decode_s > 0 else None


def decode_ms_per_token(run: Run) -> float | None:
    """1000 / `decode_tokens_per_s`: ms per token after the first; None for one token."""
    rate = decode_tokens_per_s(run)
    return None if rate is None else 1e3 / rate


def inter_token_ms(arrivals: Sequence[tuple[float, int]]) -> list[float]:
    """Gaps in ms between tokens arriving after the first arrival, one per token: each token of
    an arrival that brought several counts at its share of the gap.

    Example: arrivals [(0.10, 1), (0.14, 2), (0.22, 4)] (s, tokens so far) -> [40, 40, 40].
    """
    gaps = []
    for (ta, na), (tb, nb) in itertools.pairwise(arrivals):
        gaps += [(tb - ta) / (nb - na) * 1e3] * (nb - na)
    return gaps


def median_itl_ms(run: Run) -> float | None:
    """Median of `inter_token_ms` of a run; None with fewer than two arrivals (one token, or a
    run saved before arrivals were recorded)."""
    gaps = inter_token_ms(run.arrivals)
    return statistics.median(gaps) if gaps else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of `a` and `b` (a length difference counts), else None.

    Example: [5, 6, 7] vs [5, 6, 9, 1] -> 2; [5, 6] vs [5, 6, 7] -> 2; [5] vs [5] -> None.
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _counters(runs: list[Run]) -> SpecCounters | None:
    """Our counters of `runs` added together; None when the runs are a peer's. Counters a
    record lacks (written before they existed) count 0."""
    counted = [r.spec for r in runs if r.spec is not None]
    if not counted:
        return None
    total = SpecCounters()
    for spec in counted:
        total += SpecCounters(
            **{f.name: spec[f.name] for f in fields(SpecCounters) if f.name in spec}
        )
    return total


def per_position(counters: SpecCounters) -> list[float]:
    """[i] = share of drafts whose first i + 1 tokens were all accepted."""
    drafts = max(counters.num_drafts, 1)
    return [count / drafts for count in counters.accepted_per_position]


def _ratios(
    runs: list[Run],
    base: dict[tuple[str, int], Run],
    rate: Callable[[Run], float | None] = tokens_per_s,
) -> list[float]:
    """`rate` of each run over its paired baseline run's (same prompt and repeat)."""
    pairs = [(rate(r), rate(base[_key(r)])) for r in runs if _key(r) in base]
    return [mine / theirs for mine, theirs in pairs if mine is not None and theirs]


def _key(run: Run) -> tuple[str, int]:
    return run.prompt_id, run.repeat


def joules_per_token(run: Run) -> float | None:
    """The run's estimated energy per new token (`specdecode.energy`); None without its CPU
    seconds (older reports) or tokens."""
    if run.cpu_s is None or not run.num_tokens:
        return None
    return joules(run.cpu_s) / run.num_tokens


def _values(runs: list[Run], value: Callable[[Run], float | None]) -> list[float]:
    """`value` of each run, the runs without one left out."""
    return [v for r in runs if (v := value(r)) is not None]


def _cell(runs: list[Run], base: dict[tuple[str, int], Run]) -> dict[str, Any]:
    """Statistics of one method's runs in one category."""
    counters = _counters(runs)
    drafted = counters is not None and counters.num_draft_tokens > 0
    return {
        "num_runs": len(runs),
        "tokens_per_s": spread([tokens_per_s(r) for r in runs]),
        "decode_tokens_per_s": spread(_values(runs, decode_tokens_per_s)),
        "decode_ms_per_token": spread(_values(runs, decode_ms_per_token)),
        "median_itl_ms": spread(_values(runs, median_itl_ms)),
        "speedup": spread(_ratios(runs, base)),
        "decode_speedup": spread(_ratios(runs, base, decode_tokens_per_s)),
        "ttft_ms": spread([r.ttft_s * 1e3 for r in runs]),
        "num_tokens": spread([float(r.num_tokens) for r in runs]),
        "joules_per_token": spread(_values(runs, joules_per_token)),
        "acceptance_rate": counters.acceptance_rate if drafted else None,
        "tau": None if counters is None else counters.mean_acceptance_length,
        "accepted_per_position": per_position(counters) if drafted else None,
    }


def _predicted(run: Run, costs: dict[str, Any], spec: MethodSpec) -> float | None:
    """The cost model's decode speedup for the steps of one run of ours."""
    counters = _counters([run])
    return None if counters is None else predicted_from_counters(counters, 1, costs, spec.model)


def _by(runs: list[Run], method: str) -> dict[tuple[str, int], Run]:
    return {_key(r): r for r in runs if r.method == method}


def exactness(runs: list[Run], method: str, base_method: str) -> dict[str, Any] | None:
    """Greedy exactness of `method` vs `base_method` (plain decoding) on the first repeat (None
    without a run of `base_method`)."""
    base, mine = _by(runs, base_method), _by(runs, method)
    per_prompt = []
    for (prompt_id, repeat), run in mine.items():
        if repeat == 0 and (prompt_id, 0) in base:
            at = first_divergence(run.token_ids, base[(prompt_id, 0)].token_ids)
            per_prompt.append(
                {"prompt_id": prompt_id, "identical": at is None, "first_divergence": at}
            )
    if not per_prompt:
        return None
    share = sum(p["identical"] for p in per_prompt) / len(per_prompt)
    return {"versus": base_method, "share_identical": share, "per_prompt": per_prompt}


def _plain_of(spec: MethodSpec, specs: list[MethodSpec], default_format: str) -> str:
    """Our plain decoding in `spec`'s weight format and constraint (what its greedy output must
    equal); for a peer's speculative method, its own engine's plain method (`plain_of_engine`);
    else BASELINE (for a peer's plain decoding and ours: how far the engine or the format moves
    it, and where the run has no such plain method)."""
    if spec.is_peer:
        own = spec.plain_of_engine(specs)
        return BASELINE if own is None else own.name
    if spec.kind == "plain":
        return BASELINE
    fmt = spec.weight_format(default_format)
    same = [
        s.name
        for s in specs
        if s.kind == "plain"
        and s.weight_format(default_format) == fmt
        and s.constrained == spec.constrained
    ]
    return same[0] if same else BASELINE


def floor_format(spec: MethodSpec, default_format: str) -> str | None:
    """The weight format whose roofline floor bounds `spec`'s decoding: our plain decoding's
    own, "none" for the HF peer "hf" (the unquantized weights); None for any other method."""
    if spec.kind == "plain":
        return spec.weight_format(default_format)
    return "none" if spec.kind == "hf" else None


def share_of_floor(floor_ms: float | None, cell: dict[str, Any]) -> float | None:
    """`floor_ms` / the median decode ms/token of `cell`; None without either."""
    decode = cell["decode_ms_per_token"]
    return None if floor_ms is None or decode is None else floor_ms / decode["median"]


def deterministic(runs: list[Run], method: str) -> bool | None:
    """Whether every repeat of each prompt gave the first repeat's tokens; None without a
    second repeat of any prompt."""
    first = {r.prompt_id: r.token_ids for r in runs if r.method == method and r.repeat == 0}
    later = [r for r in runs if r.method == method and r.repeat > 0 and r.prompt_id in first]
    return all(r.token_ids == first[r.prompt_id] for r in later) if later else None


def summarize(
    runs: list[Run],
    specs: list[MethodSpec],
    greedy: bool,
    costs: dict[str, dict[str, Any]] | None = None,
    default_format: str = "none",
    floors: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Every method's cells (per category and ALL), exactness, determinism, share of the floor,
    and ours/peer ratios.

    Speedups are against BASELINE (our plain decoding in the run's format, `default_format`);
    greedy exactness is against our plain decoding in the method's own format when the run has
    it (`_plain_of`): speculation is exact relative to the target it runs.
    Each speculative method of ours gets "measured_decode_speedup": the decode-phase ratio against
    our plain decoding in the same format. With `costs` (weight format -> `costs.bench_costs`),
    it also gets the cost model's "predicted_speedup" of that ratio (the spread over its runs of
    each run's prediction from its own counters).
    With `floors` (weight format -> the roofline's floor ms of a 1-token step), plain decoding
    (ours and "hf") gets "share_of_floor" (`floor_format`); every other method gets None.
    """
    categories = list(dict.fromkeys(r.category for r in runs))
    base = _by(runs, BASELINE)
    methods: dict[str, Any] = {}
    for spec in specs:
        mine = [r for r in runs if r.method == spec.name]
        cells = {c: _cell([r for r in mine if r.category == c], base) for c in categories}
        cells[ALL] = _cell(mine, base)
        fmt, plain = spec.weight_format(default_format), _plain_of(spec, specs, default_format)
        predicted = measured = None
        if spec.is_speculative:
            measured = spread(_ratios(mine, _by(runs, plain), decode_tokens_per_s))
            if costs is not None and fmt in costs:
                own = costs[fmt]
                predicted = spread([p for r in mine if (p := _predicted(r, own, spec)) is not None])
        floor_fmt = floor_format(spec, default_format)
        floor = None if floors is None or floor_fmt is None else floors.get(floor_fmt)
        methods[spec.name] = {
            "kind": spec.kind,
            "weight_format": None if spec.is_peer else fmt,
            "cells": cells,
            "exactness": exactness(runs, spec.name, plain) if greedy else None,
            "predicted_speedup": predicted,
            "measured_decode_speedup": measured,
            "floor_format": floor_fmt,
            "share_of_floor": share_of_floor(floor, cells[ALL]),
            "deterministic": deterministic(runs, spec.name),
        }
    return {"categories": categories, "methods": methods, "peers": peer_ratios(runs, specs)}


def _itl_rate(run: Run) -> float | None:
    """1000 / `median_itl_ms`: tokens per second at the run's median inter-token latency."""
    itl = median_itl_ms(run)
    return None if not itl else 1e3 / itl


def peer_ratios(runs: list[Run], specs: list[MethodSpec]) -> list[dict[str, Any]]:
    """For each peer method with a corresponding method of ours: ours/peer tokens/s per
    category (and ALL) in "ratio"; over all prompts, ours/peer decode tokens/s in
    "decode_ratio" and peer/ours median ITL in "itl_ratio" (> 1: ours is faster), paired per
    prompt and repeat."""
    ours = [s for s in specs if not s.is_peer]
    out = []
    for peer in (s for s in specs if s.is_peer):
        match = peer.peer_of(ours)
        if match is None:
            continue
        theirs = _by(runs, peer.name)
        mine = [r for r in runs if r.method == match.name]
        cats = [*dict.fromkeys(r.category for r in mine), ALL]
        ratio = {
            cat: spread(_ratios([r for r in mine if cat in (ALL, r.category)], theirs))
            for cat in cats
        }
        out.append(
            {
                "ours": match.name,
                "peer": peer.name,
                "ratio": ratio,
                "decode_ratio": spread(_ratios(mine, theirs, decode_tokens_per_s)),
                "itl_ratio": spread(_ratios(mine, theirs, _itl_rate)),
            }
        )
    return out
