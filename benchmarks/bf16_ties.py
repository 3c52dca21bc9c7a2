"""Why did a bf16 greedy run diverge from plain decoding? Print the target's top-2 logits there.

For every divergence that `specdecode bench` reported (first repeat, vs plain decoding), this
re-runs the target over the prompt plus plain decoding's tokens up to the divergence, in bf16 and
in fp32, and prints the two best logits at that position. A bf16 tie (or a gap below bf16's
resolution) with a clear fp32 winner means rounding, not a verification error: a pass over
K + 1 tokens rounds differently from a one-token pass.

Usage:
    python benchmarks/bf16_ties.py bench_out/issue3/bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.corpus.prompts import load_prompts
from specdecode.llm import LLM


def divergences(report: dict) -> dict[tuple[str, int], list[str]]:
    """(prompt id, first divergent index) -> the methods that diverged there."""
    out: dict[tuple[str, int], list[str]] = {}
    for name, method in report["summary"]["methods"].items():
        for p in (method["exactness"] or {}).get("per_prompt", []):
            if not p["identical"]:
                out.setdefault((p["prompt_id"], p["first_divergence"]), []).append(name)
    return out


def top2(llm: LLM, ids: list[int]) -> list[tuple[int, float]]:
    """The target's two best (token, logit) after `ids`."""
    cache = llm.model.new_cache(1, len(ids))
    logits, _ = llm.model(torch.tensor([ids]), AttentionMetadata.prefill([len(ids)], "cpu"), cache)
    best = logits[0, -1].float().topk(2)
    return list(zip(best.indices.tolist(), best.values.tolist(), strict=True))


def main(path: str) -> None:
    report = json.loads(Path(path).read_text())
    config = report["config"]
    cats = list(dict.fromkeys(p["category"] for p in report["prompts"]))
    prompts = {p.id: p for p in load_prompts(cats, config["per_set"])}
    plain = {r["prompt_id"]: r["token_ids"] for r in report["runs"]
             if r["method"] == "plain" and r["repeat"] == 0}  # fmt: skip
    found = divergences(report)
    print("| prompt | index | methods | bf16 top-2 | fp32 top-2 |\n|---|---|---|---|---|")
    rows = {key: [] for key in found}
    for dtype in ("bfloat16", "float32"):
        llm = LLM(config["model"], dtype=dtype)
        for pid, at in found:
            ids = llm.chat_prompt(list(prompts[pid].messages))["prompt_token_ids"]
            (a, va), (b, vb) = top2(llm, ids + plain[pid][:at])
            rows[(pid, at)].append(f"{a}: {va:.4f} / {b}: {vb:.4f}")
    for (pid, at), cells in sorted(rows.items()):
        print(f"| {pid} | {at} | {', '.join(found[(pid, at)])} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main(sys.argv[1])
