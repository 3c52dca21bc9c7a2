"""How fast a device trains a head of a target's shape: one `specdecode train` step, timed.

Builds the EAGLE-3 head (or Medusa heads) that `specdecode train` would build for the target
whose config.json is given (random weights: the step's cost does not depend on them), feeds
it random passes of the target's width (states of the head's layers and the final-normed
state, `--examples` sequences of `--length` tokens, the last `--answer` of them answer
tokens), and times the trainer's own step (`packed_batch`, `batch_loss`, backward, gradient
clipping, AdamW) on `--device`, after `--warmup` untimed steps. Prints the median and the
spread of the step and the target tokens per second it reaches. Synthetic inputs: this times
the head's step only, not the target's passes nor the data.

Usage: python benchmarks/head_step.py --config MODEL_FOLDER/config.json [--device cuda]
       [--method eagle3] [--examples 16] [--length 512] [--answer 384]
       [--steps 10] [--head-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdecode.heads.eagle3_config import Eagle3HeadConfig
from specdecode.heads.exit_head import ExitHeadConfig
from specdecode.model.config import ModelConfig
from specdecode.train.compute import HEAD_DTYPES, head_compute_dtype, training_device
from specdecode.train.eagle3_model import TrainableEagle3
from specdecode.train.exit_model import TrainableExitHead
from specdecode.train.init import initial_exit_weights, initial_weights
from specdecode.train.objective import Teacher, batch_loss, packed_batch
from specdecode.train.target_pass import TargetPass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the target's config.json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--method", default="eagle3", choices=["eagle3", "medusa"])
    parser.add_argument("--examples", type=int, default=16, help="sequences per step")
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--answer", type=int, default=384, help="answer tokens per sequence")
    parser.add_argument("--draft-vocab-size", type=int, default=32000)
    parser.add_argument("--unroll", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--head-dtype", default="auto", choices=HEAD_DTYPES)
    args = parser.parse_args()
    device = training_device(args.device)
    target = ModelConfig.from_hf_dict(json.loads(args.config.read_text()))
    vd, h = args.draft_vocab_size, target.hidden_size
    draft_ids = torch.arange(vd)
    gen = torch.Generator().manual_seed(0)
    if args.method == "eagle3":
        cfg = Eagle3HeadConfig.for_target(target, vd)
        weights = initial_weights(cfg, args.config.parent, draft_ids, "random", 0)
        embed = torch.randn(target.vocab_size, h, generator=gen, dtype=torch.bfloat16) * 0.02
        head = TrainableEagle3(cfg, weights, embed)
    else:
        cfg = ExitHeadConfig.for_target("medusa", target, vd, 4, None)
        head = TrainableExitHead(
            cfg, initial_exit_weights(cfg, args.config.parent, draft_ids, "random", 0)
        )
    head = head.to(device)
    final = target.num_layers
    layers = tuple(dict.fromkeys((*head.feature_layers, final)))  # Medusa reads the final
    width = len(layers) * h
    passes = [
        TargetPass(
            torch.randint(0, vd, (args.length,), generator=gen),
            args.length - args.answer,
            torch.randn(args.length, width, generator=gen).to(torch.bfloat16),
            layers,
            torch.randint(0, vd, (args.length,), generator=gen),
        )
        for _ in range(args.examples)
    ]
    rows = torch.randn(vd, h, generator=gen) * 0.02
    teacher = Teacher(rows.to(device), draft_ids.to(device), final)
    compute = head_compute_dtype(args.head_dtype, device=device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-4, betas=(0.9, 0.95))
    times = []
    for step in range(args.warmup + args.steps):
        _sync(device)
        start = time.perf_counter()
        batch = packed_batch(passes, head.feature_layers, final, device)
        loss, _ = batch_loss(head, batch, args.unroll, teacher, compute)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    tokens = args.examples * args.length
    median = statistics.median(times)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{args.method} head of {args.config.parent.name} on {device} ({name}), {compute}, "
        f"{args.examples} x {args.length} tokens a step ({args.answer} answer tokens each), "
        f"unroll {args.unroll}: step median {median * 1e3:.1f} ms "
        f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f}, {len(times)} steps) = "
        f"{tokens / median:,.0f} target tokens/s"
    )


if __name__ == "__main__":
    main()
