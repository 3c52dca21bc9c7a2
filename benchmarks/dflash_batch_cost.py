"""What a DFlash drafter's step costs for several sequences: drafted together (one pass feeding
their contexts, one over their blocks, one of the output rows, as `DFlashDrafter.propose`
does for a batch) against one sequence at a time (three passes each).

Builds a 1-layer block drafter with random weights and a 32,000-token draft vocabulary for the
target (`--model`, `--quantization`), gives each of `--seqs` sequences a context of
`--context` random target states, then times, `--rounds` times interleaved, a drafting step
for all of them: one `propose` over the batch, and one `propose` per sequence (two drafters
of the same weights, each with its own sequences; every step first commits one more state per
sequence, as a decode step that kept one token does). Prints per way the median ms a step,
the spread, and their ratio; the drafts of the two ways are compared (they must be equal:
the drafter's passes are row-exact in int8 and GGUF).

Usage: python benchmarks/dflash_batch_cost.py [--model qwen2.5-coder-1.5b]
       [--quantization gguf] [--k 4] [--seqs 4] [--context 256] [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.drafters.dflash import DFlashDrafter
from specdecode.heads.dflash import DFlashHead
from specdecode.heads.dflash_config import DFlashHeadConfig, save_dflash_head
from specdecode.heads.eagle3_config import default_aux_layers
from specdecode.llm import LLM
from specdecode.sampling_params import SamplingParams
from specdecode.train.dflash_model import initial_dflash_weights
from specdecode.types import DraftBudget, TargetFeatures, TargetOutputs, Verdict


@dataclass
class _Seq:
    """A sequence as a drafter sees it (`drafters.base.SeqView`)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int = 0
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    generator: torch.Generator | None = None


def _head(model: str, quantization: str, k: int, folder: Path) -> DFlashHead:
    """A random 1-layer block drafter (blocks of k) for the target, saved in `folder` and
    loaded as the engine loads it."""
    llm = LLM(model, quantization=quantization)
    target = llm.model.config
    draft_ids = torch.arange(min(32000, target.vocab_size))
    aux = default_aux_layers(target.num_layers)
    cfg = DFlashHeadConfig.for_target(target, 1, k + 1, aux, len(draft_ids))
    norm, embed = torch.ones(target.hidden_size), llm.model.embed_tokens.weight
    weights = initial_dflash_weights(
        cfg, target, llm.model_path, draft_ids, "random", 0, norm, embed
    )
    save_dflash_head(folder, cfg, weights)
    spec = {"method": "dflash", "model": str(folder), "num_speculative_tokens": k}
    return LLM(model, quantization=quantization, speculative_config=spec).engine.drafter.head


def _step(
    drafter: DFlashDrafter, seqs: list[_Seq], states: torch.Tensor, together: bool
) -> list[list[int]]:
    """Commit the state of each sequence's last token but one, draft for all (one propose or
    one each), then append a token to each; returns the drafts' tokens."""
    for seq in seqs:
        n = len(seq.token_ids)
        hidden = TargetFeatures(n - 2, states[n - 2 : n - 1])
        drafter.commit(seq, Verdict(0, torch.tensor([seq.token_ids[-1]])), TargetOutputs(hidden))
    k = drafter.num_speculative_tokens
    if together:
        drafts = drafter.propose(seqs, [DraftBudget(k)] * len(seqs))
    else:
        drafts = [drafter.propose([seq], [DraftBudget(k)])[0] for seq in seqs]
    for seq in seqs:
        seq.token_ids.append(int(seq.token_ids[-1] * 7 + 3) % 1000)
    return [d.tokens.tolist() for d in drafts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="drafting steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        head = _head(args.model, args.quantization, args.k, Path(tmp))
    gen = torch.Generator().manual_seed(0)
    total = args.context + args.steps * args.rounds + 2
    width = len(head.feature_layers) * head.config.layers.hidden_size
    states = torch.randn(total, width, generator=gen).to(head.dtype)  # [total, F]
    ways = {"together": True, "one at a time": False}
    drafters = {way: DFlashDrafter(head, args.k) for way in ways}
    seqs = {
        way: [
            _Seq(f"s{i}", [(17 * i + j) % 1000 for j in range(args.context)])
            for i in range(args.seqs)
        ]
        for way in ways
    }
    for way in ways:  # each sequence's first context, not timed
        for seq in seqs[way]:
            prompt = TargetFeatures(0, states[: args.context - 1])
            drafters[way].commit(seq, Verdict(0, torch.tensor([0])), TargetOutputs(prompt))
        drafters[way].propose(seqs[way], [DraftBudget(args.k)] * args.seqs)
        for seq in seqs[way]:
            seq.token_ids.append(1)
    ms: dict[str, list[float]] = {way: [] for way in ways}
    drafted: dict[str, list] = {way: [] for way in ways}
    for way, together in ways.items():  # warm-up steps, not timed
        drafted[way].append(_step(drafters[way], seqs[way], states, together))
    for _ in range(args.rounds):
        for way, together in ways.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                drafted[way].append(_step(drafters[way], seqs[way], states, together))
            ms[way].append((time.perf_counter() - start) / args.steps * 1e3)
    print(
        f"{args.model} ({args.quantization}), 1-layer block drafter, K = {args.k}, "
        f"{args.seqs} sequences of {args.context}+ states, {args.steps} steps x {args.rounds} "
        "interleaved rounds: drafting ms per step"
    )
    for way, values in ms.items():
        print(
            f"  {way:14s} median {statistics.median(values):7.2f}  "
            f"(min {min(values):.2f}, max {max(values):.2f})"
        )
    ratio = statistics.median(ms["together"]) / statistics.median(ms["one at a time"])
    print(f"  together / one at a time: {ratio:.2f}")
    print(f"  same drafts: {drafted['together'] == drafted['one at a time']}")


if __name__ == "__main__":
    main()
