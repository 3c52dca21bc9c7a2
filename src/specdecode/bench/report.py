"""Markdown tables of a benchmark report (the dict `run_bench` returns and saves as JSON)."""

from __future__ import annotations

from typing import Any

from specdecode.bench.stats import ALL


def fmt(s: dict[str, float] | None, digits: int = 2, unit: str = "") -> str:
    """'median (min-max)' of a spread, '-' for none."""
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


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
    """Every method x category: tokens/s, speedup, acceptance, tau, TTFT, output length."""
    lines = [
        "| method | category | tokens/s | speedup | acceptance | tau | TTFT ms | new tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, method in summary["methods"].items():
        for cat in [*summary["categories"], ALL]:
            c = method["cells"][cat]
            lines.append(
                f"| {name} | {cat} | {fmt(c['tokens_per_s'])} | {fmt(c['speedup'], unit='x')} "
                f"| {_num(c['acceptance_rate'])} | {_num(c['tau'])} | {fmt(c['ttft_ms'], 0)} "
                f"| {fmt(c['num_tokens'], 0)} |"
            )
    return lines


def exactness_table(summary: dict[str, Any]) -> list[str]:
    """Greedy: share of prompts identical to plain decoding, and where the others diverge."""
    lines = ["| method | identical to plain | first divergence (prompt: index) |", "|---|---|---|"]
    for name, method in summary["methods"].items():
        exact = method["exactness"]
        if exact is None or name == "plain":
            continue
        diverged = [p for p in exact["per_prompt"] if not p["identical"]]
        where = ", ".join(f"{p['prompt_id']}: {p['first_divergence']}" for p in diverged) or "-"
        total = len(exact["per_prompt"])
        same = total - len(diverged)
        lines.append(f"| {name} | {same}/{total} ({exact['share_identical']:.0%}) | {where} |")
    return lines


def prediction_table(report: dict[str, Any]) -> list[str]:
    """Cost model vs measurement for each speculative method of ours (all prompts), decode phase
    (the model leaves prefill out), with the end-to-end speedup beside it."""
    costs, methods = report.get("costs"), report["summary"]["methods"]
    rows = [(n, m) for n, m in methods.items() if m.get("predicted_speedup") is not None]
    if costs is None or not rows:
        return []
    target = ", ".join(f"{ms:.0f}" for ms in costs["target_ms"])
    drafts = ", ".join(f"{name} {ms:.0f}" for name, ms in costs["draft_ms"].items()) or "none"
    lines = [
        f"Pass costs at {costs['context']} cached tokens, ms: target over T = 1, 2, ... tokens: "
        f"{target}; draft model, one token: {drafts}.",
        "",
        "| method | acceptance | tau | decode speedup, predicted | decode speedup, measured "
        "| end-to-end speedup |",
        "|---|---|---|---|---|---|",
    ]
    for name, method in rows:
        cell = method["cells"][ALL]
        speedups = [method["predicted_speedup"], cell["decode_speedup"], cell["speedup"]]
        lines.append(
            f"| {name} | {_num(cell['acceptance_rate'])} | {_num(cell['tau'])} | "
            + " | ".join(fmt(s, unit="x") for s in speedups)
            + " |"
        )
    return lines


def peer_table(summary: dict[str, Any]) -> list[str]:
    """Ours / peer tokens/s for each peer method with a corresponding method of ours."""
    if not summary["peers"]:
        return []
    cats = [*summary["categories"], ALL]
    lines = ["| ours / peer | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for pair in summary["peers"]:
        cells = [fmt(pair["ratio"].get(c), unit="x") for c in cats]
        lines.append(f"| {pair['ours']} / {pair['peer']} | " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The whole report as markdown."""
    summary, config = report["summary"], report["config"]
    head = (
        f"model {config['model']}, {config['dtype']}, temperature {config['temperature']}, "
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
    predicted = prediction_table(report)
    if predicted:
        parts += ["", "Cost model (see `specdecode plan`) vs measured, all prompts:", ""]
        parts += predicted
    parts += ["", "Per method and category:", "", *detail_table(summary)]
    exact = exactness_table(summary)
    if len(exact) > 2:
        parts += ["", "Greedy output vs our plain decoding (first repeat):", "", *exact]
    return "\n".join(parts) + "\n"
