"""What training fits and how a head is scored: the multi-step loss and the held-out estimate.

A head (`TrainableHead`: EAGLE-3's TTT steps, Medusa's heads, LayerSkip's exit) gives outputs
j = 0, 1, ...; output j of column t predicts token t + j + shift + 1. The loss of one batch:
every output against the target's distribution over the draft vocabulary at that token
(teacher row t + j + shift), soft cross-entropy (= forward KL up to a constant) on answer
positions only, output j weighted STEP_DECAY ** j. The held-out estimate: per output j, how
often the head's top token is the target's top token given a correct prefix (a_j), and the
chain length that implies, tau ~ 1 + a_0 + a_0 a_1 + ... over `steps` drafted tokens (a head
with fewer outputs, LayerSkip's exit, drafts on with its last one: its rate repeats).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.train.target_pass import TargetPass

STEP_DECAY = 0.8  # weight of TTT step j's loss: STEP_DECAY ** j
# Padded sizes: every distinct matmul shape leaves cached oneDNN state and heap behind
# (measured on smollm2: +50 MB per step with free lengths, flat with bucketed ones).
SHAPE_BUCKET = 64  # sequence lengths
ROW_BUCKET = 256  # answer positions through the output head


class TrainableHead(Protocol):
    """What the objective needs of a trainable head (`TrainableEagle3`, `TrainableExitHead`)."""

    shift: int  # output j of column t predicts token t + j + shift + 1

    def __call__(self, features: Tensor, tokens: Tensor, steps: int) -> list[Tensor]:
        """Outputs ([B, T, h] each) over target states [B, T, F] and tokens [B, T]."""
        ...

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., h] outputs -> [..., Vd] draft logits."""
        ...


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The head on held-out exchanges: per output the top-1 agreement with the target given a
    correct prefix, the tau it implies, and the loss."""

    agreement: tuple[float, ...]
    tau: float
    loss: float


def padded_batch(passes: Sequence[TargetPass]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """tokens [B, T], features [B, T, F], teacher [B, T, Vd], argmax [B, T], and the
    positions whose next token is an answer token ([B, T] bool)."""
    length = -(-max(len(p.tokens) for p in passes) // SHAPE_BUCKET) * SHAPE_BUCKET
    batch = len(passes)
    tokens = torch.zeros(batch, length, dtype=torch.long)
    features = torch.zeros(batch, length, passes[0].features.shape[-1], dtype=torch.bfloat16)
    teacher = torch.zeros(batch, length, passes[0].teacher.shape[-1], dtype=torch.bfloat16)
    argmax = torch.zeros(batch, length, dtype=torch.long)
    answer = torch.zeros(batch, length, dtype=torch.bool)
    for b, p in enumerate(passes):
        n = len(p.tokens)
        tokens[b, :n], features[b, :n], teacher[b, :n], argmax[b, :n] = (
            p.tokens,
            p.features,
            p.teacher,
            p.argmax,
        )
        answer[b, p.prompt_length - 1 : n - 1] = True  # the last position has no next token
    return tokens, features, teacher, argmax, answer


def batch_loss(
    head: TrainableHead,
    passes: Sequence[TargetPass],
    steps: int,
    target_ids: Tensor,
    compute: torch.dtype,
) -> tuple[Tensor, tuple[list[int], list[int]]]:
    """The loss over a batch (`steps`: EAGLE-3's TTT steps), and per output (agreeing,
    counted) answer positions. Logits are computed for answer positions only. `compute`: the
    head's matmul dtype (bfloat16: autocast; float32: none; `compute.head_compute_dtype`)."""
    tokens, features, teacher, argmax, answer = padded_batch(passes)
    total = torch.zeros(())
    agree, counted = [], []
    autocast = compute != torch.float32
    with torch.autocast("cpu", dtype=compute, enabled=autocast):
        outputs = head(features, tokens, steps)
    for j, hidden in enumerate(outputs):
        ahead = j + head.shift  # column t predicts token t + ahead + 1: teacher row t + ahead
        rows, cols_at = answer[:, ahead:].nonzero(as_tuple=True)  # [n] each
        n = len(rows)
        if n == 0:
            break
        # n rounded up (repeating row 0) so that the matmuls see few distinct shapes
        padded = -(-n // ROW_BUCKET) * ROW_BUCKET
        rows = torch.cat([rows, rows[:1].expand(padded - n)])
        cols_at = torch.cat([cols_at, cols_at[:1].expand(padded - n)])
        with torch.autocast("cpu", dtype=compute, enabled=autocast):
            logits = head.logits(hidden[rows, cols_at])  # [padded, Vd]
        logp = F.log_softmax(logits.float(), dim=-1)[:n]  # [n, Vd]
        target_p = F.softmax(teacher[rows[:n], cols_at[:n] + ahead].float(), dim=-1)  # [n, Vd]
        ce = -(target_p * logp).sum(-1)  # [n]
        total = total + STEP_DECAY**j * ce.mean()
        top = target_ids[logp.argmax(-1)]
        agree.append(int((top == argmax[rows[:n], cols_at[:n] + ahead]).sum()))
        counted.append(n)
    return total, (agree, counted)


@torch.no_grad()
def evaluate(
    head: TrainableHead,
    held: Sequence[TargetPass],
    steps: int,
    target_ids: Tensor,
    compute: torch.dtype,
) -> Evaluation:
    """Score the head on held-out sequences (module docstring), its matmuls in `compute`."""
    agree: list[int] = []
    counted: list[int] = []
    losses = []
    for p in held:
        loss, (a, c) = batch_loss(head, [p], steps, target_ids, compute)
        losses.append(float(loss))
        for j in range(len(a)):
            if j == len(agree):
                agree.append(0)
                counted.append(0)
            agree[j] += a[j]
            counted[j] += c[j]
    rates = tuple(a / c if c else 0.0 for a, c in zip(agree, counted, strict=True))
    chain = rates + rates[-1:] * max(steps - len(rates), 0)
    tau = 1.0 + sum(math.prod(chain[: j + 1]) for j in range(len(chain)))
    return Evaluation(rates, tau, sum(losses) / len(losses))
