"""What training fits and how a head is scored: the multi-step loss and the held-out estimate.

A head (`TrainableHead`: EAGLE-3's TTT steps, Medusa's heads, LayerSkip's exit) gives outputs
j = 0, 1, ...; output j of column t predicts token t + j + shift + 1. The loss of one batch:
every output against the target's distribution over the draft vocabulary at that token
(`Teacher`: the target's output rows of the draft vocabulary over its final-normed state at
row t + j + shift, which the passes keep), soft cross-entropy (= forward KL up to a constant)
on answer positions only, output j weighted STEP_DECAY ** j. The held-out estimate: per output
j, how often the head's top token is the target's top token given a correct prefix (a_j), and the
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
    gathers: bool  # outputs j > 0 are at `columns` only ([B, A, h]), else at every column
    gathers_first: bool  # output 0 too is at `columns` only (a block drafter's)

    def __call__(
        self,
        features: Tensor,
        tokens: Tensor,
        steps: int,
        starts: Tensor | None = None,
        columns: Tensor | None = None,
    ) -> list[Tensor]:
        """Outputs over target states [B, T, F] and tokens [B, T] (packed sequences: `starts`
        [B, T], `Batch.starts`; None: one sequence a row): [B, T, h] each, or for j > 0 of a
        head that `gathers` (every j where it `gathers_first`), [B, A, h] at `columns`
        ([B, A])."""
        ...

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., h] outputs -> [..., Vd] draft logits."""
        ...

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose inputs (concatenated) are `features`."""
        ...


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The head on held-out exchanges: per output the top-1 agreement with the target given a
    correct prefix, the tau it implies, and the loss."""

    agreement: tuple[float, ...]
    tau: float
    loss: float


@dataclass(frozen=True, slots=True)
class Teacher:
    """The target's output head over the draft vocabulary: what the head's outputs are fitted to.

    rows: [Vd, h] the target's output rows of the draft vocabulary (fp32, on the training
        device); its logits at a final-normed state x are x @ rows^T.
    draft_ids: [Vd] int64 the draft vocabulary's target ids, ascending (same device).
    final: the layer index of the final-normed state in the passes (the target's block count).
    """

    rows: Tensor
    draft_ids: Tensor
    final: int


@dataclass(frozen=True, slots=True)
class Batch:
    """Passes packed into rows of one length on the training device (`packed_batch`).

    tokens [B, T] int64, features [B, T, F] (the head's layers), final [B, T, h] (the target's
    final-normed states), argmax [B, T] int64, answer [B, T] bool: the positions whose next
    token is an answer token (the loss's positions), starts [B, T] int64: the column where
    each column's sequence begins (a row's padding belongs to its last sequence).
    """

    tokens: Tensor
    features: Tensor
    final: Tensor
    argmax: Tensor
    answer: Tensor
    starts: Tensor


def packed_batch(
    passes: Sequence[TargetPass],
    layers: tuple[int, ...],
    final: int,
    device: torch.device,
    pack: bool = True,
) -> Batch:
    """The passes as one `Batch` on `device`; features are the states of `layers`. Rows are
    as long as the longest pass rounded up to SHAPE_BUCKET, and each pass goes, longest
    first, into the first row with room for it (one pass a row when no two fit). pack=False:
    one pass a row, in order (the layout before packing, which tests and benchmarks compare).

    Example: passes of 100, 60 and 20 tokens give T 128 and rows [100, 20] and [60].
    """
    length = -(-max(len(p.tokens) for p in passes) // SHAPE_BUCKET) * SHAPE_BUCKET
    rows: list[list[TargetPass]] = []
    filled: list[int] = []  # tokens per row
    # longest first (a stable sort: equal lengths keep their order), or as given
    order = sorted(passes, key=lambda p: -len(p.tokens)) if pack else passes
    for p in order:
        n = len(p.tokens)
        room = (b for b, used in enumerate(filled) if pack and used + n <= length)
        b = next(room, len(rows))
        if b == len(rows):
            rows.append([])
            filled.append(0)
        rows[b].append(p)
        filled[b] += n
    first = passes[0]
    width = first.states.shape[-1] // len(first.layers)
    dtype = first.states.dtype
    shape = (len(rows), length)
    tokens = torch.zeros(shape, dtype=torch.long)
    features = torch.zeros(*shape, width * len(layers), dtype=dtype)
    finals = torch.zeros(*shape, width, dtype=dtype)
    argmax = torch.zeros(shape, dtype=torch.long)
    answer = torch.zeros(shape, dtype=torch.bool)
    starts = torch.zeros(shape, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for p in row:
            end = at + len(p.tokens)
            tokens[b, at:end], argmax[b, at:end] = p.tokens, p.argmax
            features[b, at:end], finals[b, at:end] = p.at(layers), p.at((final,))
            answer[b, at + p.prompt_length - 1 : end - 1] = True  # the last has no next token
            starts[b, at:] = at
            at = end
    parts = (tokens, features, finals, argmax, answer, starts)
    return Batch(*(t.to(device, non_blocking=True) for t in parts))


def read_columns(batch: Batch, ahead: int) -> Tensor:
    """[B, T] bool: the columns t whose output predicting token t + ahead + 1 a loss reads:
    position t + ahead is an answer position of t's own sequence."""
    length = batch.answer.shape[1]
    read = torch.zeros_like(batch.answer)
    if ahead < length:
        same = batch.starts[:, ahead:] == batch.starts[:, : length - ahead]
        read[:, : length - ahead] = batch.answer[:, ahead:] & same
    return read


def later_columns(needed: Tensor) -> tuple[Tensor, Tensor]:
    """The columns to run outputs after the first for: per row the `needed` ([B, T] bool)
    columns in order, then the row's last one repeated (column 0 for a row with none), A of
    them: the most any row needs rounded up to SHAPE_BUCKET (at most T, at least 1). Returns
    columns [B, A] int64 and slot [B, T] int64: where each needed column is in its row of
    `columns` (-1 elsewhere).

    Example: needed [[0, 1, 1, 0, 1, 0]] gives columns [[1, 2, 4, 4, 4, 4]] (A 6 = T) and
    slot [[-1, 0, 1, -1, 2, -1]].
    """
    batch, length = needed.shape
    counts = needed.sum(1)  # [B]
    width = max(min(-(-int(counts.max()) // SHAPE_BUCKET) * SHAPE_BUCKET, length), 1)
    order = torch.argsort((~needed).int(), dim=1, stable=True)[:, :width]  # needed ones first
    last = order.gather(1, (counts - 1).clamp(min=0)[:, None])  # [B, 1]
    last = torch.where(counts[:, None] > 0, last, 0)
    steps = torch.arange(width, device=needed.device)[None]  # [1, A]
    columns = torch.where(steps < counts[:, None], order, last)
    slot = torch.full((batch, length), -1, dtype=torch.long, device=needed.device)
    rows, at = needed.nonzero(as_tuple=True)
    slot[rows, at] = (needed.cumsum(1) - 1)[rows, at]
    return columns, slot


def batch_loss(
    head: TrainableHead,
    batch: Batch,
    steps: int,
    teacher: Teacher,
    compute: torch.dtype,
) -> tuple[Tensor, tuple[list[int], list[int]]]:
    """The loss over a batch (`steps`: EAGLE-3's TTT steps), and per output (agreeing,
    counted) answer positions. Logits are computed for answer positions only. `compute`: the
    head's matmul dtype (float32: none; else autocast on the batch's device;
    `compute.head_compute_dtype`)."""
    device = batch.tokens.device
    total = torch.zeros((), device=device)
    agree, counted = [], []
    autocast = torch.autocast(device.type, dtype=compute, enabled=compute != torch.float32)
    gathered = 0 if head.gathers_first else 1  # the first output at `columns` only
    later = torch.zeros_like(batch.answer)  # the columns the gathered outputs are read at
    for j in range(gathered, steps):
        later |= read_columns(batch, j + head.shift)
    columns, slot = later_columns(later)
    with autocast:
        outputs = head(batch.features, batch.tokens, steps, batch.starts, columns)
    target_p, teacher_row = _teacher_probs(batch, teacher, autocast)
    for j, hidden in enumerate(outputs):
        ahead = j + head.shift  # column t predicts token t + ahead + 1: teacher row t + ahead
        rows, cols_at = read_columns(batch, ahead).nonzero(as_tuple=True)  # [n] each
        n = len(rows)
        if n == 0:
            break
        # n rounded up (repeating row 0) so that the matmuls see few distinct shapes
        padded = -(-n // ROW_BUCKET) * ROW_BUCKET
        rows = torch.cat([rows, rows[:1].expand(padded - n)])
        cols_at = torch.cat([cols_at, cols_at[:1].expand(padded - n)])
        at = slot[rows, cols_at] if j >= gathered and head.gathers else cols_at  # output columns
        with autocast:
            logits = head.logits(hidden[rows, at])  # [padded, Vd]
        logp = F.log_softmax(logits.float(), dim=-1)[:n]  # [n, Vd]
        ce = -(target_p[teacher_row[rows[:n], cols_at[:n] + ahead]] * logp).sum(-1)  # [n]
        total = total + STEP_DECAY**j * ce.mean()
        top = teacher.draft_ids[logp.argmax(-1)]
        agree.append(int((top == batch.argmax[rows[:n], cols_at[:n] + ahead]).sum()))
        counted.append(n)
    return total, (agree, counted)


@torch.no_grad()
def _teacher_probs(
    batch: Batch, teacher: Teacher, autocast: torch.autocast
) -> tuple[Tensor, Tensor]:
    """The target's distribution over the draft vocabulary at every answer position, computed
    once for all outputs: probabilities [N, Vd] (fp32) and each position's row in them
    ([B, T] int64, -1 off the answer positions)."""
    slot = torch.full(batch.answer.shape, -1, dtype=torch.long, device=batch.answer.device)
    slot[batch.answer] = torch.arange(int(batch.answer.sum()), device=slot.device)
    with autocast:
        logits = batch.final[batch.answer].to(teacher.rows.dtype) @ teacher.rows.T  # [N, Vd]
    return F.softmax(logits.float(), dim=-1), slot


@torch.no_grad()
def evaluate(
    head: TrainableHead,
    held: Sequence[TargetPass],
    steps: int,
    teacher: Teacher,
    compute: torch.dtype,
) -> Evaluation:
    """Score the head on held-out sequences (module docstring), its matmuls in `compute`, on
    the teacher's device."""
    agree: list[int] = []
    counted: list[int] = []
    losses = []
    for p in held:
        batch = packed_batch([p], head.feature_layers, teacher.final, teacher.rows.device)
        loss, (a, c) = batch_loss(head, batch, steps, teacher, compute)
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
