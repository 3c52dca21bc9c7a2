"""Block drafting with a DFlash drafter (method "dflash"): a whole draft from one pass.

The drafter (`specdecode.heads.dflash`) keeps per sequence a context of the committed tokens'
target states, fed as they arrive (`drafters.state_queue`: every committed token but the
last), and drafts a block: the last committed token at its position followed by mask
entries that see each other and the context, one pass through its few layers. The block is
always the whole one the drafter was trained on (block_size - 1 mask entries, fewer only
where the positions run out), however few tokens the step drafts: a mask entry's state
depends on the others, and a shorter block than trained drafts worse (docs/training.md).
Mask entry j gives level j - 1's logits over the drafter's vocabulary (d_j; the target's
whole vocabulary or the draft vocabulary a trained drafter saved); only the levels the
draft reads are scored. No level sees the tokens drafted before it as tokens (they see
each other's states within the block), so chains and trees come from the levels as a
parallel head's do (`drafters.level_drafts`), with q per level.

Worked example, K = 3, block_size 5, committed t0..t5, context entries 0..3 fed before, the
last target pass kept s4:

    propose: extend the context with s4 (entry 4), one pass over (t5 at 5, M at 6, 7, 8, 9)
             -> d1, d2, d3 from the entries at 6, 7, 8.
    verdict: accepted d1, recovered r (committed t0..t5 d1 r); the pass kept s5, s6.
    propose: extend with s5, s6 (entries 5, 6); one pass over (r at 7, M at 8, 9, 10, 11).

A step's drafting is one block pass however long the draft (a sequential head makes K), and
the sequences a step drafts for share their passes: their contexts live in rows of one cache
(`drafters.draft_rows`), fed in one pass; their blocks run as one TREE pass (the shorter ones
padded); their mask entries go through the output rows (the drafter's costliest weights: its
vocabulary's rows of the target's head) in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from specdecode.drafters.base import (
    Drafter,
    DrafterBase,
    DrafterContext,
    DrafterNeeds,
    ModelDrafterConfig,
    SeqView,
    check_draft_length,
    check_tree_shape,
    draft_limits,
    is_positive_int,
)
from specdecode.drafters.draft_rows import DraftRows
from specdecode.drafters.level_drafts import (
    chain_from_levels,
    check_levels,
    empty_draft,
    tree_from_levels,
)
from specdecode.drafters.state_queue import StateQueue
from specdecode.drafters.trimmed_head import frequent_tokens
from specdecode.errors import UserError
from specdecode.heads.dflash import BlockInput, DFlashHead, load_dflash_head
from specdecode.heads.files import check_draft_vocab_size
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


@dataclass(frozen=True, slots=True)
class DFlashConfig(ModelDrafterConfig):
    """speculative_config of a DFlash block drafter, method "dflash".

    model: the drafter's folder (z-lab's format; `specdecode train --method dflash` writes
        one).
    num_speculative_tokens: draft at most this many tokens per step (K; a tree's nodes; a
        chain is at most block_size - 1 long).
    quantization: the drafter's weight format ("none", "int8", "int4", a GGUF block type;
        "gguf" runs its dense weights as int8); None = the target's.
    tree_width: children per expanded node of a dynamic tree (1 = a chain).
    tree_depth: levels of the tree (default: min(K, block_size - 1)), all from one pass.
    draft_vocab_size: score only the target's this many most frequent tokens (FR-Spec's table,
        `drafters.trimmed_head.frequent_tokens`), for a drafter without a draft vocabulary
        of its own (z-lab's score all 151,936 of Qwen3's); None = the folder's.
    """

    method: ClassVar[str] = "dflash"
    WHAT: ClassVar[str] = "a dflash config"

    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        ModelDrafterConfig.__post_init__(self)  # (slots dataclasses break a bare super())
        size = self.draft_vocab_size
        if size is not None and (not is_positive_int(size) or size < self.tree_width):
            raise UserError(
                f"draft_vocab_size must be None (the folder's vocabulary) or an int from "
                f"tree_width ({self.tree_width}) to the target's vocabulary size, got {size!r}"
            )


def build_dflash_drafter(config: DFlashConfig, context: DrafterContext) -> Drafter:
    """The registry's factory: load the drafter for the target (refused if made for another)."""
    size, vocab = config.draft_vocab_size, context.target.config.vocab_size
    if size is not None:
        check_draft_vocab_size(size, vocab)
    head = load_dflash_head(
        Path(config.model).expanduser(),
        context.target,
        config.weight_format(context.target.quantization),
        None if size is None else frequent_tokens(context.tokenizer, size, vocab),
    )
    return DFlashDrafter(head, config.num_speculative_tokens, config.tree_width, config.tree_depth)


class DFlashDrafter(DrafterBase):
    """Proposes up to K tokens per sequence from one block pass (module docstring).

    Args:
        head: the loaded drafter.
        num_speculative_tokens: draft at most this many tokens per step (K).
        tree_width: children per expanded node of a dynamic tree (1 = chains).
        tree_depth: levels of a tree (None = min(K, block_size - 1)).

    Raises:
        UserError: a chain longer, or a tree deeper, than one block drafts.
    """

    def __init__(
        self,
        head: DFlashHead,
        num_speculative_tokens: int,
        tree_width: int = 1,
        tree_depth: int | None = None,
    ) -> None:
        check_draft_length(num_speculative_tokens)
        check_tree_shape(tree_width, tree_depth, num_speculative_tokens)
        levels = head.config.max_draft
        what = (
            f"this DFlash drafter's block drafts at most {levels} tokens (block_size "
            f"{head.config.block_size})"
        )
        check_levels(levels, num_speculative_tokens, tree_width, tree_depth, what)
        self.head = head
        self.needs = DrafterNeeds(hidden_layers=head.feature_layers)
        self.num_speculative_tokens = num_speculative_tokens
        self.tree_width = tree_width
        self.tree_depth = min(tree_depth or num_speculative_tokens, levels)
        self.vocab_size = head.vocab_size
        self._ids = head.draft_to_target.cpu()  # [Vd] level logits' row -> target id
        self._rows: dict[str, StateQueue] = {}  # per sequence: target states not yet fed
        self._contexts = DraftRows(head.new_cache)  # per sequence: a row of context entries

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One draft per sequence, of at most min(K, `budgets[i].max_tokens`) tokens.

        Args:
            seqs: the sequences to draft for (their target states came with `commit`).
            budgets: per sequence, the most tokens its draft may have (0 = no draft).

        Returns:
            drafts: per sequence, a chain `Draft(tokens [k_i] int64, probs [k_i, V] float32)`
            (probs None under greedy parameters: each token is its level's argmax), or with
            tree_width > 1 a tree `Draft(tokens [k_i], None, tree)`.
        """
        max_tokens = draft_limits(seqs, budgets)
        with torch.inference_mode():
            limits = [self._limit(seq, m) for seq, m in zip(seqs, max_tokens, strict=True)]
            drafting = [(seq, k) for seq, k in zip(seqs, limits, strict=True) if k]
            logits = iter(())
            if drafting:  # every block in one pass, their logits in one pass of the output rows
                states = self._blocks(drafting)
                levels = [len(s) for s in states]
                logits = iter(self.head.logits(torch.cat(states)).split(levels))  # [levels, Vd]
            return [
                self._draft(seq, k, next(logits) if k else None)
                for seq, k in zip(seqs, limits, strict=True)
            ]

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Queue the target's states of the tokens the step kept; the next `propose` feeds
        them to the context."""
        if target.hidden is not None:
            queue = self._rows.setdefault(seq.request_id, StateQueue())
            queue.push(target.hidden, seq.request_id, self.head.kind)

    def release(self, request_id: str) -> None:
        """Drop a finished sequence's context (unknown ids are ignored)."""
        self._rows.pop(request_id, None)
        self._contexts.release(request_id)

    def _limit(self, seq: SeqView, max_tokens: int) -> int:
        """The most tokens `seq`'s draft may have (its budget, K, the positions left)."""
        room = self._room(seq)
        return min(max_tokens, self.num_speculative_tokens, room) if seq.token_ids else 0

    def _room(self, seq: SeqView) -> int:
        """The mask entries `seq`'s block has positions for (entry j sits at len - 1 + j)."""
        return max(self.head.positions - len(seq.token_ids), 0)

    def _levels(self, k: int) -> int:
        """The levels (mask entries) a draft of at most k tokens (k >= 1) reads."""
        return min(self.tree_depth, k) if self.tree_width > 1 else k

    def _blocks(self, drafting: Sequence[tuple[SeqView, int]]) -> list[Tensor]:
        """Feed the drafting sequences' queued states to their rows of context entries (one
        pass), then run their blocks (one pass), for drafts of at most k tokens each: per
        sequence the first levels' final states ([levels, h]) of a whole block (block_size -
        1 mask entries, fewer only where the positions run out: what the drafter was trained
        on)."""
        queued = [  # (first: a queue out of step raises before any row changes)
            self._rows.setdefault(seq.request_id, StateQueue()).take(seq, self.head.kind)
            for seq, _ in drafting
        ]
        room = max(len(seq.token_ids) for seq, _ in drafting) + self.head.config.block_size
        rows = self._contexts.place([seq.request_id for seq, _ in drafting], room)
        cache = self._contexts.select(rows)
        try:
            newest = self.head.extend(cache, queued)  # [R, h]
            masks = [min(self.head.config.max_draft, self._room(seq)) for seq, _ in drafting]
            inputs = [
                BlockInput(seq.token_ids[-1], n, h)
                for (seq, _), n, h in zip(drafting, masks, newest, strict=True)
            ]
            states = self.head.blocks(cache, inputs)
        finally:  # the rows hold what the passes left (the contexts fed, no block)
            self._contexts.store_rows(rows, cache)
        return [s[: self._levels(k)] for s, (_, k) in zip(states, drafting, strict=True)]

    def _draft(self, seq: SeqView, k: int, logits: Tensor | None) -> Draft:
        """A chain or a tree of at most k tokens from its levels' logits ([levels, Vd]; None
        where k is 0: an empty draft)."""
        tree = self.tree_width > 1
        if logits is None:
            return empty_draft(tree, self.vocab_size)
        if tree:
            return tree_from_levels(logits, k, self.tree_width, self._ids, self.vocab_size)
        return chain_from_levels(seq, logits, self._ids, self.vocab_size)
