"""`run_bench`: load the model once, build every method, run them interleaved, summarize."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specdecode.bench.costs import bench_costs
from specdecode.bench.harness import WARMUP_TOKENS, LoopConfig, chat_ids, run_interleaved
from specdecode.bench.machine import machine_facts, wait_until_quiet
from specdecode.bench.methods import parse_methods
from specdecode.bench.records import Run
from specdecode.bench.report import markdown
from specdecode.bench.roofline import roofline
from specdecode.bench.runners import OursRunner, Runner, build_runners, measured_target
from specdecode.bench.stats import summarize
from specdecode.corpus.prompts import load_prompts
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One benchmark run.

    model: the target (alias, folder or .gguf).
    methods: comma-separated method specs (`specdecode.bench.methods`), e.g. "plain,ngram:k=8".
    prompt_sets: the prompt sets to run, e.g. ("code", "chat").
    per_set: prompts taken from the start of each set.
    max_tokens: new tokens per request at most (EOS ends a request sooner unless ignore_eos).
    temperature: 0 = greedy (exactness is reported only then); > 0 samples with `seed`.
    quantization: our target's weight format (`LLM`'s quantization; draft models follow it).
    """

    model: str
    methods: str = "plain,ngram:k=8"
    prompt_sets: tuple[str, ...] = ("code", "chat", "summarize", "edit")
    per_set: int = 3
    max_tokens: int = 128
    dtype: str = "bfloat16"
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False
    device: str = "cpu"
    quantization: str = "none"
    loop: LoopConfig = field(default_factory=LoopConfig)


def _log(run: Run) -> None:
    """One line per run on stderr (acceptance and tau only for a run that drafted)."""
    spec = run.spec
    accept = (
        f" accept {spec['acceptance_rate']:.2f} tau {spec['mean_acceptance_length']:.2f}"
        if spec is not None and spec["num_drafts"] > 0
        else ""
    )
    tqdm.write(  # above the progress bar, if one is shown
        f"  r{run.repeat} {run.prompt_id:<13} {run.method:<28} {run.num_tokens:4d} tok "
        f"{run.num_tokens / run.wall_s:6.2f} tok/s{accept} load {run.foreign_cores:.2f}",
        file=sys.stderr,
    )


def run_bench(config: BenchConfig, log: bool = True) -> dict[str, Any]:
    """Run the benchmark; return the report (config, machine, prompts, runs and discarded runs
    as `Run`s, pass costs, roofline per weight format of ours, summary)."""
    specs = parse_methods(config.methods)
    prompts = load_prompts(list(config.prompt_sets), config.per_set)
    params = SamplingParams(
        temperature=config.temperature,
        max_tokens=config.max_tokens,
        seed=config.seed if config.temperature > 0 else None,
        ignore_eos=config.ignore_eos,
    )
    llm = measured_target(config.model, config.dtype, config.device, config.quantization)
    config = replace(config, quantization=_format(llm))  # "auto" as it resolved
    rendered = [(p, chat_ids(llm, p)) for p in prompts]
    n_ctx = max(len(ids) for _, ids in rendered) + config.max_tokens + WARMUP_TOKENS
    runners, skipped = build_runners(specs, llm, n_ctx)
    for skip in skipped:
        print(f"skipped {skip['method']}: {skip['reason']}", file=sys.stderr)
    specs = [r.spec for r in runners]
    runs, discarded = run_interleaved(runners, rendered, params, config.loop, _log if log else None)
    context = int(statistics.median(len(ids) for _, ids in rendered)) + config.max_tokens // 2
    costs = measure_costs(runners, context, config.loop.quiet_wait_s)
    targets = {_format(r.llm): r.llm.model for r in runners if isinstance(r, OursRunner)}
    roof = {  # each format's floor from the bandwidth read in its own passes' rounds
        name: roofline(model, context, costs[name]["bandwidth_gb_s"], costs[name]["target_ms"][0])
        for name, model in targets.items()
    }
    return {
        "config": asdict(config),
        "machine": machine_facts(),
        "prompts": [
            {"id": p.id, "category": p.category, "num_tokens": len(ids)} for p, ids in rendered
        ],
        "skipped": skipped,
        "runs": runs,
        "discarded": discarded,
        "disturbed_kept": sum(r.disturbed for r in runs),
        "costs": costs,
        "roofline": roof,
        "summary": summarize(
            runs,
            specs,
            config.temperature == 0,
            costs=costs,
            default_format=config.quantization,
            floors=_floors(roof),
        ),
    }


def _floors(roof: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Weight format -> floor ms of a 1-token step, from `run_bench`'s roofline entries."""
    return {name: entry["floor_ms"] for name, entry in roof.items()}


def _format(llm: LLM) -> str:
    """The weight format name of `llm`'s target: "none", "int8", "int4" or "gguf"."""
    return llm.model.quantization or "none"


def measure_costs(runners: list[Runner], context: int, quiet_wait_s: float) -> dict[str, Any]:
    """Pass costs (`bench_costs`) at `context` cached tokens per target format of our methods:
    the target over 1..K + 1 tokens for the longest K of that format's speculative methods (1
    token without any), and every draft model they use."""
    if quiet_wait_s > 0:
        wait_until_quiet(quiet_wait_s)
    ours = [r for r in runners if isinstance(r, OursRunner)]
    costs = {}
    for name in dict.fromkeys(_format(r.llm) for r in ours):
        group = [r for r in ours if _format(r.llm) == name]
        spec = [r for r in group if r.spec.is_speculative]
        drafts = {r.spec.model: r.llm.draft_model for r in spec if r.llm.draft_model is not None}
        max_k = max((r.spec.num_speculative_tokens for r in spec), default=0)
        costs[name] = bench_costs(group[0].llm.model, drafts, max_k, context)
    return costs


def resummarize(report: dict[str, Any]) -> dict[str, Any]:
    """A report read back from `bench.json` (`as_json`'s form): its runs as `Run`s and its
    summary recomputed from them, the pass costs and the roofline, with this version's
    statistics. Reports of older versions lack some entries; what needs them is left out."""
    runs = [Run.from_dict(r) for r in report["runs"]]
    discarded = [Run.from_dict(r) for r in report["discarded"]]
    ran = {r.method for r in runs}
    specs = [s for s in parse_methods(report["config"]["methods"]) if s.name in ran]
    greedy = report["config"]["temperature"] == 0
    default = report["config"].get("quantization", "none")  # absent before formats existed
    floors = _floors(report.get("roofline", {}))
    summary = summarize(runs, specs, greedy, report.get("costs"), default, floors)
    return {**report, "runs": runs, "discarded": discarded, "summary": summary}


def as_json(report: dict[str, Any]) -> dict[str, Any]:
    """`report` as plain JSON values: its runs and discarded runs as dicts."""
    runs = {key: [asdict(r) for r in report[key]] for key in ("runs", "discarded")}
    return {**report, **runs}


def save(report: dict[str, Any], out: Path) -> None:
    """Write `bench.json` (every raw measurement, `as_json`) and `bench.md` (the tables) into
    `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(as_json(report), indent=1))
    (out / "bench.md").write_text(markdown(report))
