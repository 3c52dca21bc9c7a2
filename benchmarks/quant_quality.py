"""How far each weight format moves a model from its bf16 self, on the bench's prompts.

For every prompt (`--prompts` sets, `--per-set` each, rendered with the chat template): the bf16
model's greedy continuation of `--max-tokens` tokens is the reference text. Every format then
reads prompt + reference in one teacher-forced pass, and at each reference position we compare
its next-token distribution q with bf16's p:
- top-1 agreement: share of positions where argmax q == argmax p;
- KL(p || q) in nats, mean over positions;
- greedy match: share of prompts whose own greedy continuation equals bf16's token for token,
  and the median index of the first difference.
bf16 itself is scored against fp32 the same way, for scale (bf16 rounding is not free either).

Usage: python benchmarks/quant_quality.py --model qwen2.5-coder-1.5b --per-set 2 \
    --max-tokens 64 [--out bench_out/quant_quality.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.stats import first_divergence
from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.corpus.prompts import available_sets, load_prompts
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams

FORMATS = [("float32", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")]


@torch.inference_mode()
def next_token_logprobs(llm: LLM, ids: list[int], start: int) -> torch.Tensor:
    """Log-probabilities [len(ids) - start, V] of the token after each position from `start - 1`
    (teacher forcing: one pass over `ids`)."""
    model = llm.model
    tokens = torch.tensor([ids], device=model.device)
    meta = AttentionMetadata.prefill([len(ids)], model.device)
    logits, _ = model(tokens, meta, model.new_cache(1, len(ids)))
    return logits[0, start - 1 : len(ids) - 1].float().log_softmax(-1)


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(ref || other) of two [N, V] log-probability tables."""
    agree = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - other)).sum(-1).mean().item()
    return {"top1_agreement": agree, "kl_nats": kl}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default=",".join(available_sets()))
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    prompts = load_prompts(args.prompts.split(","), args.per_set)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    base = LLM(args.model, dtype="bfloat16")
    rendered = [base.chat_prompt(list(p.messages))["prompt_token_ids"] for p in prompts]
    outs = base.generate([{"prompt_token_ids": ids} for ids in rendered], params)
    refs = [list(o.token_ids) for o in outs]
    base_lp = [
        next_token_logprobs(base, ids + ref, len(ids))
        for ids, ref in zip(rendered, refs, strict=True)
    ]
    results: dict[str, Any] = {"model": args.model, "prompts": len(prompts), "formats": {}}
    for dtype, quantization in FORMATS:
        name = quantization if quantization != "none" else dtype
        llm = LLM(args.model, dtype=dtype, quantization=quantization)
        scores = [
            compare(lp, next_token_logprobs(llm, ids + ref, len(ids)))
            for lp, ids, ref in zip(base_lp, rendered, refs, strict=True)
        ]
        own = llm.generate([{"prompt_token_ids": ids} for ids in rendered], params)
        diverge = [
            first_divergence(list(o.token_ids), ref) for o, ref in zip(own, refs, strict=True)
        ]
        differing = [d for d in diverge if d is not None]
        results["formats"][name] = {
            "top1_agreement": statistics.mean(s["top1_agreement"] for s in scores),
            "kl_nats": statistics.mean(s["kl_nats"] for s in scores),
            "greedy_identical": sum(d is None for d in diverge) / len(diverge),
            "median_first_divergence": statistics.median(differing) if differing else None,
        }
        print(f"{name}: {results['formats'][name]}", file=sys.stderr, flush=True)
        del llm
    print(
        f"| format vs bf16 ({args.model}, {len(prompts)} prompts x {args.max_tokens} tokens) "
        "| top-1 agreement | KL nats | greedy identical | median first divergence |"
    )
    print("|---|---|---|---|---|")
    for name, r in results["formats"].items():
        first = (
            "-" if r["median_first_divergence"] is None else f"{r['median_first_divergence']:.0f}"
        )
        print(
            f"| {name} | {r['top1_agreement']:.3f} | {r['kl_nats']:.4f} "
            f"| {r['greedy_identical']:.0%} | {first} |"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
