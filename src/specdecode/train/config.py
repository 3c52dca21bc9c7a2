"""What `specdecode train` does: `TrainConfig`, its flags one to one, checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import UserError
from specdecode.model.loading import parse_dtype
from specdecode.model.quant import parse_quantization
from specdecode.train.compute import HEAD_DTYPES
from specdecode.train.init import INITS

METHODS = ("eagle3", "eagle3_parallel", "medusa", "layer_skip", "mtp", "dflash")
EAGLE3 = ("eagle3", "eagle3_parallel")
RESPONSES = ("dataset", "target")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """What `specdecode train` does (its flags, one to one).

    model: the target (alias, folder or .gguf). out: the head's folder.
    method: "eagle3", "eagle3_parallel" (drafts `unroll` tokens in one pass), "medusa",
        "layer_skip", "mtp" (an MTP layer in DeepSeek-V3's form, `train.mtp_model`) or
        "dflash" (a block drafter of `draft_layers` layers whose block drafts `unroll`
        tokens, `train.dflash_model`).
    budget_minutes / budget_examples: stop at whichever comes first (at least one given).
    responses: "dataset" (teacher forcing on the dataset's answers) or "target" (the target
        answers each prompt greedily, up to max_answer_tokens: self-distillation, slower).
    quantization / dtype: the target's format for its passes (int8: fast prefill).
    device: where the target's passes run and the head trains ("cpu", "cuda", "cuda:1", ...);
        a GPU runs the target unquantized (quantization None: the int8 and gguf kernels are
        the CPU's).
    head_dtype: the head's matmuls: "auto" (bfloat16 on a GPU and where the CPU has native
        bf16 dot products, else float32), "bfloat16" or "float32".
    features: the feature store's folder (None: one under the cache, named by what it holds).
    epochs: passes over the first budget_examples examples (> 1 needs budget_examples).
    draft_vocab_size: the head's vocabulary (the most frequent answer tokens of the first
        vocab_examples examples). max_length: tokens per sequence (prompt + answer).
    batch_size: sequences per optimizer step. unroll: EAGLE-3's TTT steps (and the chain
        length the held-out tau counts). lr / warmup_steps: AdamW's rate, reached linearly
        over the first steps, then constant.
    medusa_heads: Medusa's heads (the longest chain it drafts). exit_layer: layer_skip's E
        (None: a quarter of the target's layers). draft_layers: a dflash drafter's layers.
    init: "target" (start from the target's last layer and output rows) or "random".
    eval_examples / eval_every: held-out exchanges scored every eval_every steps.
    checkpoint_minutes: how often checkpoint.pt is written. resume: continue from it.
    seed: initial weights (the data order is fixed). save_dtype: the saved head's dtype.
    """

    model: str
    out: Path
    method: str = "eagle3"
    budget_minutes: float | None = 60.0
    budget_examples: int | None = None
    responses: str = "dataset"
    quantization: str | None = "int8"
    dtype: str = "bfloat16"
    device: str = "cpu"
    head_dtype: str = "auto"
    features: Path | None = None
    epochs: int = 1
    draft_vocab_size: int = 32000
    vocab_examples: int = 2000
    max_length: int = 512
    max_answer_tokens: int = 256
    batch_size: int = 4
    unroll: int = 3
    medusa_heads: int = 4
    draft_layers: int = 1
    exit_layer: int | None = None
    lr: float = 5e-4
    warmup_steps: int = 20
    init: str = "target"
    eval_examples: int = 8
    eval_every: int = 25
    checkpoint_minutes: float = 10.0
    resume: bool = False
    seed: int = 0
    save_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UserError(f"cannot train method {self.method!r}; trainable: {', '.join(METHODS)}")
        if self.budget_minutes is None and self.budget_examples is None:
            raise UserError("give a budget: --budget-minutes and/or --budget-examples")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise UserError(f"--budget-minutes must be > 0, got {self.budget_minutes}")
        if self.responses not in RESPONSES:
            raise UserError(
                f"unknown responses {self.responses!r}; allowed: {', '.join(RESPONSES)}"
            )
        if self.head_dtype not in HEAD_DTYPES:
            raise UserError(
                f"unknown head dtype {self.head_dtype!r}; allowed: {', '.join(HEAD_DTYPES)}"
            )
        if self.init not in INITS:
            raise UserError(f"unknown init {self.init!r}; allowed: {', '.join(INITS)}")
        for name in (
            "budget_examples",
            "draft_vocab_size",
            "vocab_examples",
            "max_length",
            "max_answer_tokens",
            "batch_size",
            "unroll",
            "medusa_heads",
            "draft_layers",
            "exit_layer",
            "eval_examples",
            "eval_every",
            "epochs",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if not self.lr > 0 or self.warmup_steps < 0 or not self.checkpoint_minutes > 0:
            raise UserError("lr and checkpoint_minutes must be > 0, warmup_steps >= 0")
        if self.device != "cpu" and self.quantization not in (None, "none"):
            raise UserError(
                f"--device {self.device} runs the target unquantized: give --quantization none "
                f"(the {self.quantization} kernels run on the CPU)"
            )
        if self.epochs > 1 and self.budget_examples is None:
            raise UserError("--epochs > 1 trains again on --budget-examples examples: give it")
        parse_quantization(self.quantization)
        parse_dtype(self.dtype)
        parse_dtype(self.save_dtype)
