"""What training fits and how the head is scored: EAGLE-3's TTT loss and the held-out estimate.

The loss of one batch: the head's `steps` unrolled steps (`TrainableEagle3`) against the
target's distribution over the draft vocabulary, soft cross-entropy (= forward KL up to a
constant) on answer positions only, step j weighted STEP_DECAY ** j. The held-out estimate:
per step j, how often the head's top token is the target's top token given a correct prefix
(a_j), and the chain length that implies, tau ~ 1 + a_0 + a_0 a_1 + ...
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from specdecode.train.eagle3_model import TrainableEagle3
from specdecode.train.target_pass import TargetPass

STEP_DECAY = 0.8  # weight of TTT step j's loss: STEP_DECAY ** j
# Padded sizes: every distinct matmul shape leaves cached oneDNN state and heap behind
# (measured on smollm2: +50 MB per step with free lengths, flat with bucketed ones).
SHAPE_BUCKET = 64  # sequence lengths
ROW_BUCKET = 256  # answer positions through the output head


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The head on held-out exchanges: per TTT step the top-1 agreement with the target
    given a correct prefix, the tau it implies, and the loss."""

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
    head: TrainableEagle3, passes: Sequence[TargetPass], steps: int, target_ids: Tensor
) -> tuple[Tensor, tuple[list[int], list[int]]]:
    """The TTT loss over a batch, and per step (agreeing, counted) answer positions. Logits
    are computed for answer positions only."""
    tokens, features, teacher, argmax, answer = padded_batch(passes)
    total = torch.zeros(())
    agree, counted = [], []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = head(features, tokens, steps)
    for j, hidden in enumerate(outputs):
        # column t predicts token t + j + 2: teacher row t + j + 1 (an answer position)
        rows, cols_at = answer[:, j + 1 :].nonzero(as_tuple=True)  # [n] each
        n = len(rows)
        if n == 0:
            break
        # n rounded up (repeating row 0) so that the matmuls see few distinct shapes
        padded = -(-n // ROW_BUCKET) * ROW_BUCKET
        rows = torch.cat([rows, rows[:1].expand(padded - n)])
        cols_at = torch.cat([cols_at, cols_at[:1].expand(padded - n)])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = head.logits(hidden[rows, cols_at])  # [padded, Vd]
        logp = F.log_softmax(logits.float(), dim=-1)[:n]  # [n, Vd]
        target_p = F.softmax(teacher[rows[:n], cols_at[:n] + j + 1].float(), dim=-1)  # [n, Vd]
        ce = -(target_p * logp).sum(-1)  # [n]
        total = total + STEP_DECAY**j * ce.mean()
        top = target_ids[logp.argmax(-1)]
        agree.append(int((top == argmax[rows[:n], cols_at[:n] + j + 1]).sum()))
        counted.append(n)
    return total, (agree, counted)


@torch.no_grad()
def evaluate(
    head: TrainableEagle3, held: Sequence[TargetPass], steps: int, target_ids: Tensor
) -> Evaluation:
    """Score the head on held-out sequences (module docstring)."""
    agree, counted, losses = [0] * steps, [0] * steps, []
    for p in held:
        loss, (a, c) = batch_loss(head, [p], steps, target_ids)
        losses.append(float(loss))
        for j in range(len(a)):
            agree[j] += a[j]
            counted[j] += c[j]
    rates = tuple(a / c if c else 0.0 for a, c in zip(agree, counted, strict=True))
    tau = 1.0 + sum(math.prod(rates[: j + 1]) for j in range(len(rates)))
    return Evaluation(rates, tau, sum(losses) / len(losses))
