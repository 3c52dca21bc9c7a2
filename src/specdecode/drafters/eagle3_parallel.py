"""Parallel EAGLE-3 drafting: a whole draft from one head pass (method "eagle3_parallel").

P-EAGLE / PARD style. A parallel head (`Eagle3HeadConfig.parallel_tokens` = P, trained by
`specdecode train --method eagle3_parallel`) is an EAGLE-3 head whose drafted entries read a
learned mask token and mask feature of its level instead of the token drafted before and the
head's own output. So one pass holds everything a draft needs: the entries of the new target
states (the catch-up, as in `drafters.eagle3`), then K - 1 mask entries at the next
positions. The last state's entry gives level 0 (d_1), mask entry j gives level j (d_(j+1));
no level sees the tokens drafted before it, like Medusa's heads, so chains and trees come from
the levels alike (`drafters.level_drafts`). The mask entries are dropped from the head's cache
before the next draft, which feeds the target's states of the tokens the step kept.

Worked example, K = 3, committed t0..t5, entries 0..3 fed before, the last target pass kept s4:

    propose: one pass over (t5, s4) at position 4, (M1, s4 + m1) at 5, (M2, s4 + m2) at 6
             -> d1, d2, d3 (Mj, mj: level j's mask embedding and feature offset; s4 stands
             for its fused feature).
    verdict: accepted d1, recovered r; the target pass kept s5, s6.
    propose: drop entries 5, 6 (cache back to entries 0..4); one pass over (d1, s5), (r, s6),
             (M1, s6 + m1), (M2, s6 + m2) at 5..8 -> d1', d2', d3'.

A step's drafting is one head pass however long the draft (the sequential head makes K).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from torch import Tensor

from specdecode.drafters.base import Drafter, DrafterContext, ModelDrafterConfig, SeqView
from specdecode.drafters.eagle3 import Eagle3Drafter, HeadRow
from specdecode.drafters.level_drafts import (
    chain_from_levels,
    check_levels,
    empty_draft,
    tree_from_levels,
)
from specdecode.errors import UserError
from specdecode.heads.eagle3 import Eagle3Head, load_eagle3_head
from specdecode.types import Draft


@dataclass(frozen=True, slots=True)
class Eagle3ParallelConfig(ModelDrafterConfig):
    """speculative_config of a parallel EAGLE-3 head, method "eagle3_parallel".

    model: the head's folder (`specdecode train --method eagle3_parallel` writes one).
    num_speculative_tokens: draft at most this many tokens per step (K; a tree's nodes; a
        chain is at most as long as the head's parallel_draft_tokens).
    quantization: the head's weight format ("none", "int8", "int4", "gguf"); None = the target's.
    tree_width: children per expanded node of a dynamic tree (1 = a chain).
    tree_depth: levels of the tree (default: min(K, parallel_draft_tokens)); at most the head's
        parallel_draft_tokens.
    """

    method: ClassVar[str] = "eagle3_parallel"
    WHAT: ClassVar[str] = "an eagle3_parallel config"


def build_eagle3_parallel_drafter(config: Eagle3ParallelConfig, context: DrafterContext) -> Drafter:
    """The registry's factory: load the parallel head for the target (refused if trained for
    another target, or if it drafts token by token)."""
    head = load_eagle3_head(
        Path(config.model).expanduser(),
        context.target,
        config.weight_format(context.target.quantization),
    )
    return Eagle3ParallelDrafter(
        head, config.num_speculative_tokens, config.tree_width, config.tree_depth
    )


class Eagle3ParallelDrafter(Eagle3Drafter):
    """Proposes up to K tokens per sequence from one pass of a parallel EAGLE-3 head (module
    docstring).

    Args:
        head: the loaded parallel head (parallel_tokens P > 0).
        num_speculative_tokens: draft at most this many tokens per step (K).
        tree_width: children per expanded node of a dynamic tree (1 = chains).
        tree_depth: levels of a tree (None = min(K, P)).

    Raises:
        UserError: a head that drafts token by token, or a chain longer / a tree deeper than P.
    """

    def __init__(
        self,
        head: Eagle3Head,
        num_speculative_tokens: int,
        tree_width: int = 1,
        tree_depth: int | None = None,
    ) -> None:
        levels = head.config.parallel_tokens
        if not levels or head.mask_embed is None or head.mask_hidden is None:
            raise UserError(
                "this EAGLE-3 head drafts token by token (its config.json has no "
                'parallel_draft_tokens): use method "eagle3"'
            )
        what = f"this parallel head drafts at most {levels} levels a pass"
        check_levels(levels, num_speculative_tokens, tree_width, tree_depth, what)
        if tree_width > 1:
            tree_depth = min(tree_depth or num_speculative_tokens, levels)
        super().__init__(head, num_speculative_tokens, tree_width, tree_depth)

    def _propose_chain(self, seq: SeqView, max_tokens: int) -> Draft:
        k, row = self._prepare(seq, max_tokens)
        if k == 0:
            return empty_draft(False, self.vocab_size)
        return chain_from_levels(seq, self._levels(seq, row, k), self._draft_ids, self.vocab_size)

    def _propose_tree(self, seq: SeqView, max_tokens: int) -> Draft:
        k, row = self._prepare(seq, max_tokens)
        if k == 0:
            return empty_draft(True, self.vocab_size)
        logits = self._levels(seq, row, min(self.tree_depth, k))
        return tree_from_levels(logits, k, self.tree_width, self._draft_ids, self.vocab_size)

    def _levels(self, seq: SeqView, row: HeadRow, levels: int) -> Tensor:
        """One pass over the queued target states' entries and `levels` - 1 mask entries;
        returns the logits of the last state's entry and of the mask entries ([levels, Vd])."""
        return self._catch_up(seq, row, levels - 1)[0]
