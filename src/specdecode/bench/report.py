"""Markdown tables of a benchmark report (the dict `run_bench` returns and saves as JSON)."""

from __future__ import annotations

from typing import Any

from specdecode import energy
from specdecode.bench.costs import achieved_gmacs, pass_ratios
from specdecode.bench.methods import KINDS
from specdecode.bench.roofline import roofline_text
from specdecode.bench.stats import ALL


def fmt(s: dict[str, float] | None, digits: int = 2, unit: str = "") -> str:
    """'median (min-max)' of a spread, '-' for none."""
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def weight_format(config: dict[str, Any]) -> str:
    """Our weights as run: the dtype, or "int8 (bfloat16 activations)"."""
    quantization = config.get("quantization", "none")  # absent in reports of older versions
    dtype = config["dtype"]
    return dtype if quantization == "none" else f"{quantization} ({dtype} activations)"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def speedup_table(summary: dict[str, Any]) -> list[str]:
    """Methods x categories: speedup vs plain decoding, median (min-max) over runs."""
    cats = [*summary["categories"], ALL]
    lines = ["| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for name, method in summary["methods"].items():
        cells = [fmt(method["cells"][c]["speedup"], unit="x") for c in cats]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def detail_table(summary: dict[str, Any]) -> list[str]:
    """Every method x category: tokens/s, speedup, acceptance, tau, TTFT, output length, and
    estimated joules per token (`specdecode.energy`)."""
    lines = [
        "| method | category | tokens/s | speedup | acceptance | tau | TTFT ms | new tokens "
        "| J/token (est.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, method in summary["methods"].items():
        for cat in [*summary["categories"], ALL]:
            c = method["cells"][cat]
            lines.append(
                f"| {name} | {cat} | {fmt(c['tokens_per_s'])} | {fmt(c['speedup'], unit='x')} "
                f"| {_num(c['acceptance_rate'])} | {_num(c['tau'])} | {fmt(c['ttft_ms'], 0)} "
                f"| {fmt(c['num_tokens'], 0)} | {fmt(c.get('joules_per_token'), 3)} |"
            )
    return lines


def exactness_table(summary: dict[str, Any]) -> list[str]:
    """Greedy: share of prompts identical to plain decoding (ours in the same weight format; a
    peer's speculative method: its own engine's), and where the others diverge."""
    lines = [
        "| method | identical to | share | first divergence (prompt: index) |",
        "|---|---|---|---|",
    ]
    for name, method in summary["methods"].items():
        exact = method["exactness"]
        if exact is None or name == exact["versus"]:
            continue
        diverged = [p for p in exact["per_prompt"] if not p["identical"]]
        where = ", ".join(f"{p['prompt_id']}: {p['first_divergence']}" for p in diverged) or "-"
        total = len(exact["per_prompt"])
        same = total - len(diverged)
        lines.append(
            f"| {name} | {exact['versus']} | {same}/{total} ({exact['share_identical']:.0%}) "
            f"| {where} |"
        )
    return lines


def prediction_table(report: dict[str, Any]) -> list[str]:
    """Cost model vs measurement for each speculative method of ours (all prompts), decode phase
    (the model leaves prefill out) against plain decoding in the same weight format, with the
    end-to-end speedup (against the run's plain decoding) beside it."""
    methods = report["summary"]["methods"]
    rows = [(n, m) for n, m in methods.items() if m.get("predicted_speedup") is not None]
    if not rows:
        return []
    lines = [
        "| method | acceptance | tau | decode speedup, predicted | decode speedup, measured "
        "| end-to-end speedup |",
        "|---|---|---|---|---|---|",
    ]
    for name, method in rows:
        cell = method["cells"][ALL]
        speedups = [method["predicted_speedup"], method["measured_decode_speedup"], cell["speedup"]]
        lines.append(
            f"| {name} | {_num(cell['acceptance_rate'])} | {_num(cell['tau'])} | "
            + " | ".join(fmt(s, unit="x") for s in speedups)
            + " |"
        )
    return lines


def pass_cost_lines(report: dict[str, Any]) -> list[str]:
    """Per weight format of ours: the target's pass over T = 1, 2, ... new tokens (ms, and
    t(T) / t(1)), what the matmuls ran on, and each draft model's 1-token pass."""
    lines = []
    for name, costs in report.get("costs", {}).items():
        target = ", ".join(
            f"{ms:.0f} ({ratio:.2f})"
            for ms, ratio in zip(costs["target_ms"], pass_ratios(costs), strict=True)
        )
        drafts = ", ".join(f"{d} {ms:.0f}" for d, ms in costs["draft_ms"].items()) or "none"
        lines.append(
            f"- {name} (matmuls: {costs.get('kernels', 'not recorded')}), at "
            f"{costs['context']} cached tokens: target over T = 1, 2, ... tokens, ms "
            f"(t(T) / t(1)): {target}; draft model, one token, ms: {drafts}." + _peak_text(costs)
        )
    return lines


def _peak_text(costs: dict[str, Any]) -> str:
    """The report's sentence on the projections' multiply-adds a second per pass width and
    their share of the int8 peak, where the costs record them ("" where they do not)."""
    rates, peak = achieved_gmacs(costs), costs.get("int8_peak_gmacs")
    if not rates:
        return ""
    shares = ", ".join(f"{rate:.0f}" + (f" ({rate / peak:.0%})" if peak else "") for rate in rates)
    of_peak = f" (share of the int8 peak, {peak:.0f} G/s, measured in the same run)" if peak else ""
    return f" Projections' G multiply-adds a second at T = 1, 2, ...{of_peak}: {shares}."


def roofline_lines(report: dict[str, Any]) -> list[str]:
    """Per weight format: the 1-token floor (`bench.roofline`) and how close the plain decoding
    it bounds (ours in that format; "hf" for "none") came in the runs."""
    methods = report["summary"]["methods"]
    lines = []
    for name, roof in report["roofline"].items():
        line = f"- {roofline_text(roof)}"
        measured = [
            f"{method} {m['cells'][ALL]['decode_ms_per_token']['median']:.1f} ms/token "
            f"({m['share_of_floor']:.0%})"
            for method, m in methods.items()
            if m["floor_format"] == name and m["share_of_floor"] is not None
        ]
        if measured:
            line += (
                "; decode in the runs, median ms/token after the first (share of the floor "
                f"speed): {', '.join(measured)}"
            )
        lines.append(line + ".")
    return lines


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def token_table(summary: dict[str, Any]) -> list[str]:
    """Every method over all prompts: decode ms/token, median inter-token latency, share of the
    roofline floor (plain decoding only), and whether every repeat gave the same tokens."""
    lines = [
        "| method | decode ms/token | median ITL ms | share of floor | same tokens every repeat |",
        "|---|---|---|---|---|",
    ]
    for name, method in summary["methods"].items():
        cell = method["cells"][ALL]
        share = method["share_of_floor"]
        lines.append(
            f"| {name} | {fmt(cell['decode_ms_per_token'], 1)} | {fmt(cell['median_itl_ms'], 1)} "
            f"| {'-' if share is None else f'{share:.0%}'} | {_yes_no(method['deterministic'])} |"
        )
    return lines


ENGINES = {
    "ours": "ours",
    "hf": "HF transformers",
    "llamacpp": "llama.cpp",
    "openvino": "OpenVINO GenAI",
    "vllm": "vLLM (CPU)",
}


def _engine(kind: str) -> str:
    """The library behind a method kind (`Kind.engine`; "ours" for our speculative methods)."""
    return KINDS[kind].engine if kind in KINDS else "ours"


def best_table(summary: dict[str, Any]) -> list[str]:
    """Per category, each engine's best method by median tokens/s, and ours / theirs.

    These are ratios of medians over different methods (not paired per prompt): the question
    is what a user gets from each engine's best choice on that kind of prompt.
    """
    cats = [*summary["categories"], ALL]
    best: dict[str, dict[str, tuple[float, str]]] = {}
    for name, method in summary["methods"].items():
        engine = _engine(method["kind"])
        mine = best.setdefault(engine, {})
        for cat in cats:
            rate = method["cells"][cat]["tokens_per_s"]
            if rate is not None and (cat not in mine or rate["median"] > mine[cat][0]):
                mine[cat] = (rate["median"], name)
    if "ours" not in best or len(best) < 2:
        return []
    lines = ["| best, tokens/s | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for engine, label in ENGINES.items():
        if engine in best:
            cells = [f"{best[engine][c][0]:.2f} ({best[engine][c][1]})" for c in cats]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for engine, label in ENGINES.items():
        if engine != "ours" and engine in best:
            ratios = [f"{best['ours'][c][0] / best[engine][c][0]:.2f}x" for c in cats]
            lines.append(f"| ours / {label} | " + " | ".join(ratios) + " |")
    return lines


def peer_table(summary: dict[str, Any]) -> list[str]:
    """Ours / peer tokens/s for each peer method with a corresponding method of ours, per
    category, then over all prompts the decode phase's ratio and the median ITL's (peer / ours:
    > 1 where ours is faster too)."""
    if not summary["peers"]:
        return []
    cats = [*summary["categories"], ALL]
    head = ["ours / peer", *cats, f"{ALL}, decode", f"{ALL}, ITL"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for pair in summary["peers"]:
        cells = [fmt(pair["ratio"].get(c), unit="x") for c in cats]
        cells += [fmt(pair["decode_ratio"], unit="x"), fmt(pair["itl_ratio"], unit="x")]
        lines.append(f"| {pair['ours']} / {pair['peer']} | " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The whole report as markdown."""
    summary, config = report["summary"], report["config"]
    head = (
        f"model {config['model']}, {weight_format(config)}, temperature {config['temperature']}, "
        f"{config['max_tokens']} new tokens max, {config['loop']['repeats']} repeats, "
        f"{len(report['prompts'])} prompts; {report['machine']['cpu']}, "
        f"{report['machine']['torch_threads']} threads; "
        f"disturbed runs kept / redone: {report['disturbed_kept']} / {len(report['discarded'])}"
    )
    parts = [head]
    parts += [f"- skipped {s['method']}: {s['reason']}" for s in report.get("skipped", [])]
    parts += ["", "Speedup vs plain decoding (tokens/s ratio per prompt and repeat):", ""]
    parts += speedup_table(summary)
    if summary["peers"]:
        parts += ["", "Ours / peer library, tokens/s, same prompts and run:", ""]
        parts += peer_table(summary)
    best = best_table(summary)
    if best:
        parts += ["", "Each engine's best method per category (median tokens/s):", "", *best]
    predicted = prediction_table(report)
    if predicted:
        parts += ["", "Cost model (see `specdecode plan`) vs measured, all prompts:", ""]
        parts += predicted
    costs = pass_cost_lines(report)
    if costs:
        parts += ["", "Pass costs, per weight format of ours:", "", *costs]
    if report.get("roofline"):
        parts += ["", "Roofline of a 1-token step, per weight format of ours:", ""]
        parts += roofline_lines(report)
    parts += [
        "",
        "Per token, all prompts (decode: after the first token; ITL: inter-token latency):",
        "",
        *token_table(summary),
    ]
    parts += ["", "Per method and category:", "", *detail_table(summary)]
    cpu = "the CPU seconds of the process and its workers (a peer's) over each run"
    parts += ["", f"J/token: {energy.method()}; {cpu}."]
    exact = exactness_table(summary)
    if len(exact) > 2:
        parts += ["", "Greedy output vs plain decoding (first repeat):", "", *exact]
    return "\n".join(parts) + "\n"
