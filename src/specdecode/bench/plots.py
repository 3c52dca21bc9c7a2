"""PNG plots of a benchmark report (matplotlib, no display needed).

- speedup.png: speedup vs plain decoding per category, one bar group per category, a bar per
  method (median, with the min-max range as an error bar);
- acceptance.png: per draft position i, the share of drafts whose first i + 1 tokens were
  accepted, one line per speculative method of ours;
- speedup_vs_k.png: per drafter family (a draft model, or n-gram lookup, in one weight format),
  the measured speedup of the decode phase (vs plain decoding in that format) against K, next
  to the cost model's prediction for the same steps (`costs.predicted_from_counters`) and
  E[tokens/step] = (1 - a^(K+1)) / (1 - a) at the measured acceptance a (what the speedup would
  be if drafting and verifying K tokens cost no more than one token and acceptances were
  independent).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from specdecode.bench.methods import MethodSpec
from specdecode.bench.report import weight_format
from specdecode.bench.stats import ALL
from specdecode.engine.costs import expected_tokens
from specdecode.errors import MissingDependencyError

MATPLOTLIB_REQUIREMENT = "matplotlib>=3.8"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise MissingDependencyError(
            f"plots need matplotlib: pip install {MATPLOTLIB_REQUIREMENT}"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def speedup_plot(report: dict[str, Any], path: Path) -> Path:
    """Grouped bars: categories on x, one bar per method (plain, always 1.0, left out)."""
    plt = _pyplot()
    summary = report["summary"]
    cats = [*summary["categories"], ALL]
    names = [n for n in summary["methods"] if n != "plain"]
    width_in = min(14.0, max(6.0, 0.22 * len(cats) * max(1, len(names))))
    fig, ax = plt.subplots(figsize=(width_in, 5.0))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        cells = [summary["methods"][name]["cells"][c]["speedup"] for c in cats]
        med = [c["median"] if c else 0.0 for c in cells]
        low = [c["median"] - c["min"] if c else 0.0 for c in cells]
        high = [c["max"] - c["median"] if c else 0.0 for c in cells]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, med, width, yerr=[low, high], capsize=2, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("speedup vs plain decoding (tokens/s ratio)")
    ax.set_title(f"{report['config']['model']}, {weight_format(report['config'])}")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def acceptance_plot(report: dict[str, Any], path: Path) -> Path:
    """Per-position acceptance, one line per speculative method of ours (over all prompts)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    drawn = 0
    for name, method in report["summary"]["methods"].items():
        shares = method["cells"][ALL]["accepted_per_position"]
        if shares:
            ax.plot(range(1, len(shares) + 1), shares, marker="o", label=name)
            drawn += 1
    ax.set_xlabel("draft position i")
    ax.set_ylabel("share of drafts with tokens 1..i accepted")
    ax.set_ylim(0.0, 1.05)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.set_title("no draft token was accepted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


Family = tuple[str, str | None, str | None]  # (kind, draft model, q= format)


def _families(report: dict[str, Any]) -> dict[Family, list[tuple[int, str]]]:
    """Speculative methods of ours grouped by drafter and format: family -> [(K, name)] sorted."""
    families: dict[Family, list[tuple[int, str]]] = defaultdict(list)
    for name in report["summary"]["methods"]:
        spec = MethodSpec.parse(name)
        if spec.is_speculative:
            family = (spec.kind, spec.model, spec.quantization)
            families[family].append((spec.num_speculative_tokens, name))
    return {key: sorted(members) for key, members in families.items()}


def speedup_vs_k_plot(report: dict[str, Any], path: Path) -> Path:
    """Measured decode speedup vs K per drafter family, with the cost model and E[tokens/step]."""
    plt = _pyplot()
    methods = report["summary"]["methods"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (kind, model, quantization), members in _families(report).items():
        label = (model or kind) + (f" q={quantization}" if quantization else "")
        ks = [k for k, _ in members]
        cells = [methods[name]["cells"][ALL] for _, name in members]
        measured = [methods[name]["measured_decode_speedup"] for _, name in members]
        if None in measured:  # no plain decoding in its format to compare with
            continue
        med = [m["median"] for m in measured]
        err = [
            [m["median"] - m["min"] for m in measured],
            [m["max"] - m["median"] for m in measured],
        ]
        line = ax.errorbar(ks, med, yerr=err, marker="o", capsize=3, label=f"{label}: measured")
        color = line[0].get_color()
        accept = [c["acceptance_rate"] or 0.0 for c in cells]
        ax.plot(
            ks,
            [expected_tokens(a, k) for a, k in zip(accept, ks, strict=True)],
            linestyle=":",
            color=color,
            label=f"{label}: E[tokens/step]",
        )
        predicted = [methods[name]["predicted_speedup"] for _, name in members]
        if None not in predicted:
            ax.plot(
                ks,
                [p["median"] for p in predicted],
                linestyle="--",
                color=color,
                label=f"{label}: cost model",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("decode-phase speedup vs plain decoding")
    if ax.get_legend_handles_labels()[0]:  # nothing to label without plain decoding to pair
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(report: dict[str, Any], out: Path) -> list[Path]:
    """Every plot of `report` into `out`; ImportError naming matplotlib when it is missing."""
    _pyplot()  # fail before touching `out`
    out.mkdir(parents=True, exist_ok=True)
    paths = [speedup_plot(report, out / "speedup.png")]
    if _families(report):
        paths.append(acceptance_plot(report, out / "acceptance.png"))
        paths.append(speedup_vs_k_plot(report, out / "speedup_vs_k.png"))
    return paths
