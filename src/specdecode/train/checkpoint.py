"""A training run's state on disk: where it stands (`TrainState`), the checkpoint a stopped run
resumes from (`CHECKPOINT` in the output folder, written atomically), and what a finished run
leaves (the head folder and `LOG`, its evaluations)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from specdecode.errors import UserError
from specdecode.model.loading import parse_dtype
from specdecode.train.compute import head_compute_dtype, training_device
from specdecode.train.config import TrainConfig
from specdecode.train.dflash_model import TrainableDFlash
from specdecode.train.eagle3_model import TrainableStateHead
from specdecode.train.exit_model import TrainableExitHead
from specdecode.train.objective import Evaluation

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.json"
# What shapes the head and the data it reads (batch_size: a later epoch's batches): a resumed
# run keeps them (its budget, its evaluations, the rate, the head's compute dtype and the
# feature store's folder may change).
RUN_FIELDS = (
    "model",
    "method",
    "responses",
    "quantization",
    "dtype",
    "draft_vocab_size",
    "vocab_examples",
    "max_length",
    "max_answer_tokens",
    "batch_size",
    "unroll",
    "medusa_heads",
    "draft_layers",
    "exit_layer",
    "init",
    "seed",
)


@dataclass
class TrainState:
    """Where a run stands (saved in checkpoints)."""

    step: int = 0
    epoch: int = 0  # 0: reading the stream; e > 0: the e-th pass over the stored examples
    examples: int = 0  # examples consumed from the stream (skipped ones included)
    position: int = 0  # batches of this epoch trained on (epochs > 0)
    tokens: int = 0  # sequence tokens the head trained on
    answer_tokens: int = 0  # of which answer tokens (the loss covers these)
    seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)  # evaluations


def load_checkpoint(config: TrainConfig) -> dict | None:
    """The checkpoint to resume from (None for a fresh run); refused where it was made with
    other `RUN_FIELDS` than `config`'s, or says nothing of them."""
    if not config.resume:
        return None
    path = config.out / CHECKPOINT
    if not path.is_file():
        raise UserError(f"nothing to resume: {path} does not exist")
    saved = torch.load(path, weights_only=False, map_location="cpu")
    run = saved.get("run")
    if run is None:
        raise UserError(
            f"{path} does not say which settings made it (an older specdecode wrote it): "
            "start a fresh run with another --out"
        )
    differ = [
        f"{name} {run.get(name)!r} there, {value!r} now"
        for name, value in run_fields(config).items()
        if run.get(name) != value
    ]
    if differ:
        raise UserError(
            f"{path} was made with other settings ({'; '.join(differ)}): resume with its "
            "settings, or start a fresh run with another --out"
        )
    return saved


def run_fields(config: TrainConfig) -> dict[str, object]:
    """`config`'s values of `RUN_FIELDS` (what a resumed run must keep)."""
    return {name: getattr(config, name) for name in RUN_FIELDS}


def save_checkpoint(
    config: TrainConfig,
    head: TrainableStateHead | TrainableExitHead | TrainableDFlash,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    draft_ids: Tensor,
) -> None:
    """Write the run's state to `config.out`'s checkpoint atomically (a stop mid-write
    leaves the old checkpoint), with the settings a resume must keep."""
    path = config.out / CHECKPOINT
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "state": asdict(state),
            "draft_ids": draft_ids,
            "run": run_fields(config),
        },
        tmp,
    )
    tmp.replace(path)


def save_head(
    config: TrainConfig,
    head: TrainableStateHead | TrainableExitHead | TrainableDFlash,
    state: TrainState,
    ev: Evaluation,
    computed: int,
) -> None:
    """Write the head folder (weights in save_dtype, a summary in config.json) and the log;
    `computed`: the target passes this run ran (the rest were read from the store)."""
    dtype = parse_dtype(config.save_dtype)
    weights = {
        n: (t.to(dtype) if t.is_floating_point() else t).cpu()
        for n, t in head.head_weights().items()
    }
    summary = {
        "method": config.method,
        "steps": state.step,
        "examples": state.examples,
        "epoch": state.epoch,
        "passes_run": computed,
        "tokens": state.tokens,
        "answer_tokens": state.answer_tokens,
        "minutes": round(state.seconds / 60, 2),
        "held_out_agreement": list(ev.agreement),
        "held_out_tau": ev.tau,
        "responses": config.responses,
        "head_dtype": str(
            head_compute_dtype(config.head_dtype, device=training_device(config.device))
        ).removeprefix("torch."),
        "device": config.device,
        "parameters": sum(p.numel() for p in head.parameters()),
    }
    head.save(config.out, weights, summary)
    log = {"config": _jsonable(asdict(config)), "summary": summary, "history": state.history}
    (config.out / LOG).write_text(json.dumps(log, indent=2) + "\n")


def _jsonable(d: dict) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def record(state: TrainState, ev: Evaluation, seconds: float) -> None:
    """Add an evaluation, made `seconds` into the run, to `state.history` (the log's rows)."""
    state.history.append(
        {
            "step": state.step,
            "tokens": state.tokens,
            "answer_tokens": state.answer_tokens,
            "minutes": round(seconds / 60, 3),
            "loss": round(ev.loss, 4),
            "tau": round(ev.tau, 4),
            **{f"agree_{j}": round(a, 4) for j, a in enumerate(ev.agreement)},
        }
    )
