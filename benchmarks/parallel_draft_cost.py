"""What drafting costs a step: a sequential EAGLE-3 head (K passes) vs a parallel one and a
DFlash block drafter (1 pass each).

Builds the three for the target (`--model`) with random weights (a draft's cost does not
depend on them; with random weights almost nothing is accepted, so every step drafts K tokens
and catches up one or two entries; the block drafter has `--dflash-layers` layers), saves them
in a temporary folder, and runs the engine with each on the same prompts, greedy, `--rounds`
times interleaved (sequential, parallel, dflash, sequential, ...). Per run it reads the
engine's own drafting time (`SpecMetrics.draft_s` over the steps that drafted) and prints per
drafter the median ms of drafting per step, the spread over the runs, and its ratio to the
sequential head's.

Usage: python benchmarks/parallel_draft_cost.py [--model qwen2.5-coder-1.5b] [--quantization gguf]
       [--k 4] [--dflash-layers 1] [--prompts 2] [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from specdecode.corpus.prompts import load_prompts
from specdecode.heads.dflash_config import DFlashHeadConfig, save_dflash_head
from specdecode.heads.eagle3 import save_eagle3_head
from specdecode.heads.eagle3_config import Eagle3HeadConfig, default_aux_layers
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.train.dflash_model import initial_dflash_weights
from specdecode.train.init import initial_weights

KINDS = ("eagle3", "eagle3_parallel", "dflash")


def _heads(llm: LLM, k: int, layers: int, folder: Path) -> dict[str, Path]:
    """A random sequential head, parallel (k levels) head and block drafter (k per block,
    `layers` layers) for `llm`'s target."""
    target = llm.model.config
    draft_ids = torch.arange(min(32000, target.vocab_size))
    out = {}
    aux = default_aux_layers(target.num_layers)
    cfg = DFlashHeadConfig.for_target(target, layers, k + 1, aux, len(draft_ids))
    norm = torch.ones(target.hidden_size)
    embed = llm.model.embed_tokens.weight
    weights = initial_dflash_weights(
        cfg, target, llm.model_path, draft_ids, "random", 0, norm, embed
    )
    save_dflash_head(folder / "dflash", cfg, weights)
    out["dflash"] = folder / "dflash"
    for kind in KINDS[:2]:
        cfg = Eagle3HeadConfig.for_target(
            target, len(draft_ids), "random", k if kind == "eagle3_parallel" else 0
        )
        path = folder / kind
        save_eagle3_head(path, cfg, initial_weights(cfg, llm.model_path, draft_ids, "random", 0))
        out[kind] = path
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dflash-layers", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=2, help="chat prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompts = [list(p.messages) for p in load_prompts(["chat"], args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        base = LLM(args.model, quantization=args.quantization)
        heads = _heads(base, args.k, args.dflash_layers, Path(tmp))
        llms = {
            kind: LLM(
                args.model,
                quantization=args.quantization,
                speculative_config={
                    "method": kind,
                    "model": str(path),
                    "num_speculative_tokens": args.k,
                },
            )
            for kind, path in heads.items()
        }
        ms: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for kind, llm in llms.items():
                outs = llm.chat(prompts, params)
                spec = [o.metrics.spec for o in outs]
                drafts = sum(s.num_drafts for s in spec)
                ms[kind].append(sum(s.draft_s for s in spec) / drafts * 1e3)
    print(
        f"{args.model} ({args.quantization}), K = {args.k}, {args.prompts} chat prompts x "
        f"{args.max_tokens} tokens, {args.rounds} interleaved rounds: drafting ms per step"
    )
    for kind, values in ms.items():
        print(
            f"  {kind:16s} median {statistics.median(values):7.2f}  "
            f"(min {min(values):.2f}, max {max(values):.2f})"
        )
    for kind in KINDS[1:]:
        ratio = statistics.median(ms[kind]) / statistics.median(ms["eagle3"])
        print(f"  {kind} / sequential: {ratio:.2f}")


if __name__ == "__main__":
    main()
