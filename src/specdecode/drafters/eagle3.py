"""EAGLE-3 drafting: a trained head over the target's own hidden states (method "eagle3").

The head (`specdecode.heads.eagle3`) keeps, per sequence, a one-layer cache of entries: entry t
reads (token t + 1, the target's fused state after token t) at position t. The target's
states arrive after every target pass with `commit` (`target.hidden`: this drafter asks for the
inputs of the head's `aux_layers`), for the tokens the pass kept: every committed token but
the last.

Worked example, K = 3, committed t0..t5, entries 0..3 fed before, the last target pass kept
s4 (its state after t4):

    propose: feed (t5, s4) at position 4 -> d1. Feed (d1, h4) at position 5 -> d2; (d2, h5)
             at 6 -> d3, where h is the head's own pre-norm output of the entry before.
    verdict: accepted d1, recovered r: committed t0..t5 d1 r; the target pass kept s5, s6.
    propose: drop the drafted entries (cache back to entries 0..4), feed (d1, s5) and (r, s6)
             at positions 5, 6 -> d1'; draft on.

Drafted tokens come from the reduced draft vocabulary, mapped to target ids; q is the head's
distribution after the request's sampling parameters, zero outside the draft vocabulary, so
verification (against the target's full distribution) stays exact. Under greedy parameters a
chain is the head's argmax at each entry and carries no q (deterministic: q one-hot). With
`tree_width` > 1 the draft is EAGLE-2's dynamic tree (`drafters.dynamic_tree`): each level is
one TREE pass over the frontier, each node reading its parent's pre-norm output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata, AttentionMode
from specdecode.cache.kv_cache import KVCache
from specdecode.drafters.base import (
    Drafter,
    DrafterBase,
    DrafterContext,
    DrafterNeeds,
    ModelDrafterConfig,
    SeqView,
    cache_with_room,
    check_draft_length,
    check_tree_shape,
    draft_limits,
)
from specdecode.drafters.dynamic_tree import DynamicTree, frontier_pass, reduced_log_confidence
from specdecode.drafters.state_queue import StateQueue
from specdecode.errors import UserError
from specdecode.heads.eagle3 import load_eagle3_head, mask_token
from specdecode.model.rope import Rotary
from specdecode.sampling.argmax import argmax
from specdecode.sampling.probs import SamplingTensors, probs_from_logits, sample
from specdecode.tree.token_tree import ROOT
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


@dataclass(frozen=True, slots=True)
class Eagle3Config(ModelDrafterConfig):
    """speculative_config of an EAGLE-3 head, method "eagle3" (vLLM's keys).

    model: the head's folder (config.json + model.safetensors, speculators' format;
        the `train` command's `--method eagle3` writes one).
    num_speculative_tokens: draft at most this many tokens per step (K, 1..64; a tree's nodes).
    quantization: the head's weight format ("none", "int8", "int4", "gguf"); None = the target's.
    tree_width: children per expanded node of a dynamic tree (1 = a chain).
    tree_depth: levels of the tree, one head pass each (default: K).
    """

    method: ClassVar[str] = "eagle3"
    WHAT: ClassVar[str] = "an eagle3 config"


def build_eagle3_drafter(config: Eagle3Config, context: DrafterContext) -> Drafter:
    """The registry's factory: load the head for the target (refused if trained for another)."""
    head = load_eagle3_head(
        Path(config.model).expanduser(),
        context.target,
        config.weight_format(context.target.quantization),
    )
    if head.config.parallel_tokens:
        raise UserError(
            f"{config.model} is a parallel EAGLE-3 head (parallel_draft_tokens "
            f'{head.config.parallel_tokens}): use method "eagle3_parallel"'
        )
    return Eagle3Drafter(head, config.num_speculative_tokens, config.tree_width, config.tree_depth)


class StateHead(Protocol):
    """What the drafter drives: a one-layer head over the target's states (`Eagle3Head`, or a
    checkpoint's MTP layer, `heads.mtp.MtpHead`).

    kind: its name in messages. feature_layers: the target states it reads
    (`DrafterNeeds.hidden_layers`). vocab_size: the target's. draft_to_target: [Vd] target id
    of each row of its logits. rotary: its RoPE tables (their length bounds the positions).
    fuse: target states -> its input feature. Calling it runs entries (tokens, features, meta,
    cache, logits_index) -> (logits [B, N, Vd], the feature a drafted next entry reads).
    """

    kind: str
    feature_layers: tuple[int, ...]
    vocab_size: int
    draft_to_target: Tensor
    rotary: Rotary

    @property
    def device(self) -> torch.device: ...

    def new_cache(self, batch_size: int, capacity: int) -> KVCache: ...

    def fuse(self, features: Tensor) -> Tensor: ...

    def __call__(
        self,
        tokens: Tensor,
        hidden: Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
        logits_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...


@dataclass
class HeadRow(StateQueue):
    """One sequence's head state: its cache (made at its first draft; its committed part holds
    the entries of the fed target states) and the queued target states."""

    cache: KVCache | None = None


class Eagle3Drafter(DrafterBase):
    """Proposes up to K tokens per sequence with an EAGLE-3 head (module docstring), or any
    `StateHead` fed the same way (a checkpoint's MTP layer: `drafters.mtp`).

    Args:
        head: the loaded head (for the target whose states it reads).
        num_speculative_tokens: draft at most this many tokens per step (K, 1..64).
        tree_width: children per expanded node of a dynamic tree (1 = chains).
        tree_depth: levels of a tree (None = K).
    """

    def __init__(
        self,
        head: StateHead,
        num_speculative_tokens: int,
        tree_width: int = 1,
        tree_depth: int | None = None,
    ) -> None:
        check_draft_length(num_speculative_tokens)
        check_tree_shape(tree_width, tree_depth, num_speculative_tokens)
        self.head = head
        self.needs = DrafterNeeds(hidden_layers=head.feature_layers)
        self.num_speculative_tokens = num_speculative_tokens
        self.tree_width = tree_width
        self.tree_depth = tree_depth or num_speculative_tokens
        self.vocab_size = head.vocab_size
        self._draft_ids = head.draft_to_target.cpu()  # [Vd] draft row -> target id (host)
        self._rows: dict[str, HeadRow] = {}

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One draft per sequence, of at most min(K, `budgets[i].max_tokens`) tokens.

        Args:
            seqs: the sequences to draft for (their target states came with `commit`).
            budgets: per sequence, the most tokens its draft may have (`max_tokens`, 0 = no
                draft).

        Returns:
            drafts: per sequence, a chain `Draft(tokens [k_i] int64, probs [k_i, V] float32)`
            (probs None under greedy parameters: each token is the head's argmax), or with
            tree_width > 1 a tree `Draft(tokens [k_i], None, tree)`.
        """
        max_tokens = draft_limits(seqs, budgets)
        propose = self._propose_chain if self.tree_width == 1 else self._propose_tree
        with torch.inference_mode():
            return [propose(seq, m) for seq, m in zip(seqs, max_tokens, strict=True)]

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Queue the target's states of the tokens the step kept; the next `propose` drops the
        drafted entries and feeds them."""
        if target.hidden is not None:
            row = self._rows.setdefault(seq.request_id, HeadRow())
            row.push(target.hidden, seq.request_id, self.head.kind)

    def release(self, request_id: str) -> None:
        """Drop a finished sequence's head cache (unknown ids are ignored)."""
        self._rows.pop(request_id, None)

    def _propose_chain(self, seq: SeqView, max_tokens: int) -> Draft:
        """Feed the new target states, then draft entry by entry."""
        k, row = self._prepare(seq, max_tokens)
        if k == 0:
            return Draft(torch.zeros(0, dtype=torch.long), torch.zeros(0, self.vocab_size))
        logits, hidden = self._catch_up(seq, row)
        logits = logits[0]
        tokens = torch.empty(k, dtype=torch.long)  # [k]
        # greedy: each token the argmax, deterministic (q one-hot: no probs)
        greedy = seq.params.greedy
        st = None if greedy else SamplingTensors.from_params([seq.params], self.head.device)
        probs = None if greedy else torch.zeros(k, self.vocab_size)  # [k, V]
        for j in range(k):
            if greedy:
                tokens[j] = self._draft_ids[int(argmax(logits))]
            else:
                q = probs_from_logits(logits[None], st)[0].cpu()  # [Vd]
                tokens[j] = self._draft_ids[int(sample(q[None], [seq.generator])[0])]
                probs[j, self._draft_ids] = q
            if j + 1 < k:
                logits, hidden = self._feed(row.cache, tokens[j : j + 1], hidden)
        return Draft(tokens, probs)

    def _propose_tree(self, seq: SeqView, max_tokens: int) -> Draft:
        """Feed the new target states, then grow a dynamic tree, one TREE pass per level."""
        k, row = self._prepare(seq, max_tokens)
        if k == 0:
            return Draft(torch.zeros(0, dtype=torch.long))
        logits, hidden = self._catch_up(seq, row)
        tree = DynamicTree(self.tree_width, k)
        tree.expand([ROOT], reduced_log_confidence(logits, self._draft_ids, self.vocab_size))
        outputs: dict[int, Tensor] = {ROOT: hidden}  # candidate -> its entry's pre-norm output
        slots: dict[int, int] = {}
        cache, device = row.cache, self.head.device
        for _ in range(min(self.tree_depth, k) - 1):
            frontier = tree.frontier
            tokens, meta = frontier_pass(tree, slots, cache.lengths[0], row.fed, device)
            parents = torch.stack([outputs[tree.candidates[n].parent] for n in frontier])
            level_logits, level_hidden = self.head(tokens, parents[None], meta, cache)
            outputs.update(zip(frontier, level_hidden[0], strict=True))
            scores = reduced_log_confidence(level_logits[0], self._draft_ids, self.vocab_size)
            tree.expand(frontier, scores)
        tokens, shape = tree.draft()
        return Draft(torch.tensor(tokens, dtype=torch.long), tree=shape)

    def _prepare(self, seq: SeqView, max_tokens: int) -> tuple[int, HeadRow]:
        """The draft size for `seq` and its row, its cache grown to fit and its drafted
        entries dropped."""
        ids = seq.token_ids
        room = self.head.rotary.cos.shape[0] - len(ids) + 1  # entry d_j sits at len - 2 + j
        k = min(max_tokens, self.num_speculative_tokens, max(room, 0)) if ids else 0
        row = self._row_for(seq, len(ids) + max(k, self.tree_width * self.tree_depth))
        row.cache.truncate(row.fed)
        return k, row

    def _catch_up(self, seq: SeqView, row: HeadRow, masks: int = 0) -> tuple[Tensor, Tensor]:
        """Feed the queued target states (entry t reads token t + 1), then `masks` mask
        entries (a parallel head's: `drafters.eagle3_parallel`), in one pass; return the
        logits of the last state's entry and of the mask entries ([1 + masks, Vd]) and the
        last state's pre-norm output ([h])."""
        ids, fed = seq.token_ids, row.fed
        head, device = self.head, self.head.device
        fused = head.fuse(row.take(seq, head.kind).to(device))  # [n, h]
        n = len(fused)
        levels = [mask_token(j) for j in range(1, masks + 1)]
        tokens = torch.tensor([[*ids[fed + 1 :], *levels]], device=device)  # [1, n + masks]
        if masks:
            fused = torch.cat([fused, head.mask_features(fused[-1], masks)])  # [n + masks, h]
        mode = AttentionMode.PREFILL if fed == 0 else AttentionMode.DECODE
        meta = AttentionMetadata.contiguous(mode, [fed], [n + masks], device)
        index = torch.arange(n - 1, n + masks, device=device)[None]  # [1, 1 + masks]
        logits, hidden = head(tokens, fused[None], meta, row.cache, index)
        return logits[0], hidden[0, n - 1]

    def _feed(self, cache: KVCache, token: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Feed one drafted entry (token [1], the entry before's pre-norm output [h]); return
        its logits ([Vd]) and pre-norm output ([h])."""
        device = self.head.device
        meta = AttentionMetadata.contiguous(AttentionMode.DECODE, [cache.lengths[0]], [1], device)
        logits, out = self.head(token.to(device)[None], hidden[None, None], meta, cache)
        return logits[0, 0], out[0, 0]

    def _row_for(self, seq: SeqView, needed: int) -> HeadRow:
        """The sequence's row, its cache allocated or grown to at least `needed` entries."""
        row = self._rows.setdefault(seq.request_id, HeadRow())
        row.cache = cache_with_room(
            row.cache,
            seq,
            needed,
            self.num_speculative_tokens + self.tree_width * self.tree_depth + 1,
            lambda capacity: self.head.new_cache(1, capacity),
        )
        return row
