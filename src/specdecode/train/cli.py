"""`specdecode train`'s flags (one per `TrainConfig` field) and its command."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from specdecode.model.loading import DTYPES
from specdecode.model.quant import QUANTIZATIONS
from specdecode.train.checkpoint import LOG
from specdecode.train.compute import HEAD_DTYPES
from specdecode.train.config import METHODS, RESPONSES, TrainConfig
from specdecode.train.init import INITS
from specdecode.train.trainer import train

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specdecode train`."""
    d = _DEFAULTS
    p = sub.add_parser(
        "train",
        help="train a draft head (EAGLE-3, Medusa, LayerSkip exit, MTP, DFlash) for a target",
        description="Trains a draft head on the target's own hidden states: ShareGPT "
        "exchanges and Python standard-library code (never the bench's prompts), answered by "
        "the dataset (teacher forcing) or by the target itself. Writes config.json and "
        "model.safetensors (EAGLE-3: speculators' format) into --out, usable as "
        'speculative_config {"method": METHOD, "model": OUT, "num_speculative_tokens": 4}. '
        "See docs/training.md.",
    )
    p.add_argument("--model", required=True, help="target: alias, Hugging Face folder or .gguf")
    p.add_argument("--out", required=True, type=Path, help="the head's folder")
    p.add_argument("--method", default=d["method"], choices=METHODS)
    p.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help=f"stop after this long (default {d['budget_minutes']:g} unless --budget-examples)",
    )
    p.add_argument("--budget-examples", type=int, default=None, help="stop after N examples")
    p.add_argument("--responses", default=d["responses"], choices=RESPONSES)
    p.add_argument("--quantization", default=d["quantization"], choices=["none", *QUANTIZATIONS])
    p.add_argument("--dtype", default=d["dtype"], choices=sorted(DTYPES))
    p.add_argument(
        "--device",
        default=d["device"],
        help="where the head trains: cpu, cuda, cuda:N, mps (the target's passes run on the "
        "CPU; default cpu)",
    )
    p.add_argument(
        "--features",
        type=Path,
        default=None,
        help="the feature store: the target's passes, kept for later epochs, resumes and runs "
        "(default: a folder under the cache named by the target, format and layers)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=d["epochs"],
        help="passes over the first --budget-examples examples (later ones read the store)",
    )
    p.add_argument(
        "--head-dtype",
        default=d["head_dtype"],
        choices=HEAD_DTYPES,
        help="the head's matmuls: auto = bfloat16 on a GPU and where the CPU has native bf16 "
        "dot products (AVX-512 BF16, AMX), else float32 (default auto)",
    )
    p.add_argument("--draft-vocab-size", type=int, default=d["draft_vocab_size"])
    p.add_argument("--max-length", type=int, default=d["max_length"], help="tokens per example")
    p.add_argument("--max-answer-tokens", type=int, default=d["max_answer_tokens"])
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument(
        "--unroll",
        type=int,
        default=d["unroll"],
        help="EAGLE-3's TTT steps; the tokens a parallel head or a dflash block drafts",
    )
    p.add_argument("--medusa-heads", type=int, default=d["medusa_heads"], help="Medusa's K")
    p.add_argument(
        "--draft-layers", type=int, default=d["draft_layers"], help="dflash's decoder layers"
    )
    p.add_argument(
        "--exit-layer", type=int, default=None, help="layer_skip's E (default: layers // 4)"
    )
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--warmup-steps", type=int, default=d["warmup_steps"])
    p.add_argument("--init", default=d["init"], choices=INITS)
    p.add_argument("--eval-examples", type=int, default=d["eval_examples"])
    p.add_argument("--eval-every", type=int, default=d["eval_every"], help="steps")
    p.add_argument("--checkpoint-minutes", type=float, default=d["checkpoint_minutes"])
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--save-dtype", default=d["save_dtype"], choices=sorted(DTYPES))


def run_train(args: argparse.Namespace) -> int:
    """`specdecode train`: train, then say where the head is and how it did."""
    names = set(_DEFAULTS)
    values = {k: v for k, v in vars(args).items() if k in names}
    if args.budget_minutes is None and args.budget_examples is None:
        values["budget_minutes"] = _DEFAULTS["budget_minutes"]
    config = TrainConfig(**values)
    state = train(config)
    last = state.history[-1]
    print(
        f"head saved to {config.out}: {state.step} steps, {state.tokens:,} tokens "
        f"({state.answer_tokens:,} answer tokens), {state.seconds / 60:.1f} min; held-out "
        f"top-1 agreement {last['agree_0']:.3f}, tau ~{last['tau']:.2f} (log: {config.out / LOG})"
    )
    return 0
