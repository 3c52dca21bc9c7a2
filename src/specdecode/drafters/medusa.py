"""Medusa drafting: K trained heads over the target's final state draft a whole step at once.

Cai et al. 2024, "Medusa". The heads (`specdecode.heads.exit_head`, kind "medusa") read the
target's final-normed state after token t; head k (1-based) predicts token t + k + 1. After
every target pass the engine hands over the states of the committed tokens but the last
(`commit`'s `target.hidden`; this drafter asks for block L's input = the final-normed
output), so the newest state s is the one after token n - 2 of n committed tokens: the
target's own head read it to commit token n - 1, and head k drafts token n - 2 + k + 1, i.e.
d_k follows the last committed token at distance k. One head pass drafts all K tokens; no
cache, nothing to roll back.

Chains: d_k is head k's argmax (greedy) or a sample from q_k, head k's distribution after the
request's sampling parameters, zero outside the reduced draft vocabulary (verification uses
the target's full distribution, so it stays exact). Trees (`tree_width` > 1): every node of
level d proposes head d + 1's top tokens (`drafters.level_drafts`).
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
)
from specdecode.drafters.level_drafts import (
    chain_from_levels,
    check_levels,
    empty_draft,
    tree_from_levels,
)
from specdecode.heads.exit_head import ExitHead, load_exit_head
from specdecode.types import Draft, DraftBudget, TargetOutputs, Verdict


@dataclass(frozen=True, slots=True)
class MedusaConfig(ModelDrafterConfig):
    """speculative_config of Medusa heads, method "medusa" (vLLM's method name).

    model: the heads' folder (the `train` command's `--method medusa` writes one).
    num_speculative_tokens: draft at most this many tokens per step (K; a tree's nodes; a
        chain is at most as long as the heads are many).
    quantization: the heads' weight format ("none", "int8", "int4", "gguf"); None = the target's.
    tree_width: children per expanded node of a dynamic tree (1 = a chain).
    tree_depth: levels of the tree (default: min(K, heads)); at most the number of heads.
    """

    method: ClassVar[str] = "medusa"
    WHAT: ClassVar[str] = "a medusa config"


def build_medusa_drafter(config: MedusaConfig, context: DrafterContext) -> Drafter:
    """The registry's factory: load the heads for the target (refused if trained for another)."""
    head = load_exit_head(
        Path(config.model).expanduser(),
        context.target,
        config.weight_format(context.target.quantization),
        "medusa",
    )
    return MedusaDrafter(head, config.num_speculative_tokens, config.tree_width, config.tree_depth)


class MedusaDrafter(DrafterBase):
    """Proposes up to K tokens per sequence from one pass of Medusa heads (module docstring).

    Args:
        head: the loaded heads (for the target whose final states they read).
        num_speculative_tokens: draft at most this many tokens per step (K, 1..64).
        tree_width: children per expanded node of a dynamic tree (1 = chains).
        tree_depth: levels of a tree (None = min(K, heads)).

    Raises:
        UserError: a chain longer, or a tree deeper, than the heads are many.
    """

    def __init__(
        self,
        head: ExitHead,
        num_speculative_tokens: int,
        tree_width: int = 1,
        tree_depth: int | None = None,
    ) -> None:
        check_draft_length(num_speculative_tokens)
        check_tree_shape(tree_width, tree_depth, num_speculative_tokens)
        heads = head.config.num_heads
        what = f"these Medusa heads draft at most {heads} levels (one per head)"
        check_levels(heads, num_speculative_tokens, tree_width, tree_depth, what)
        self.head = head
        self.needs = DrafterNeeds(hidden_layers=(head.config.feature_layer,))
        self.num_speculative_tokens = num_speculative_tokens
        self.tree_width = tree_width
        self.tree_depth = min(tree_depth or num_speculative_tokens, heads)
        self.vocab_size = head.config.vocab_size
        self._draft_ids = head.draft_to_target.cpu()  # [Vd] draft row -> target id (host)
        self._states: dict[str, tuple[int, Tensor]] = {}  # id -> (token index, its state [h])

    def propose(self, seqs: Sequence[SeqView], budgets: Sequence[DraftBudget]) -> list[Draft]:
        """One draft per sequence, of at most min(K, `budgets[i].max_tokens`) tokens.

        Args:
            seqs: the sequences to draft for (their newest target states came with `commit`).
            budgets: per sequence, the most tokens its draft may have (`max_tokens`, 0 = no
                draft).

        Returns:
            drafts: per sequence, a chain `Draft(tokens [k_i] int64, probs [k_i, V] float32)`,
            or with tree_width > 1 a tree `Draft(tokens [k_i], None, tree)`.
        """
        max_tokens = draft_limits(seqs, budgets)
        drafts = []
        with torch.inference_mode():
            for seq, limit in zip(seqs, max_tokens, strict=True):
                k = min(limit, self.num_speculative_tokens) if seq.token_ids else 0
                if k == 0:
                    drafts.append(empty_draft(self.tree_width > 1, self.vocab_size))
                    continue
                levels = k if self.tree_width == 1 else min(self.tree_depth, k)
                logits = self.head(self._newest_state(seq)[None], levels)[0]  # [levels, Vd]
                if self.tree_width == 1:
                    drafts.append(chain_from_levels(seq, logits, self._draft_ids, self.vocab_size))
                else:
                    drafts.append(
                        tree_from_levels(
                            logits, k, self.tree_width, self._draft_ids, self.vocab_size
                        )
                    )
        return drafts

    def commit(self, seq: SeqView, verdict: Verdict, target: TargetOutputs) -> None:
        """Keep the target's state of the newest token the step kept (the next `propose`
        drafts from it)."""
        features = target.hidden
        if features is not None and len(features.hidden):
            index = features.start + len(features.hidden) - 1
            self._states[seq.request_id] = (index, features.hidden[-1].to(self.head.device))

    def release(self, request_id: str) -> None:
        """Forget a finished sequence's newest state (unknown ids are ignored)."""
        self._states.pop(request_id, None)

    def _newest_state(self, seq: SeqView) -> Tensor:
        """The target's state after token n - 2 ([h]) of the n committed tokens (kept by
        `commit` until a later pass replaces it)."""
        wanted = len(seq.token_ids) - 2
        index, state = self._states.get(seq.request_id, (None, None))
        if index != wanted or state is None:
            raise ValueError(
                f"medusa: request {seq.request_id} has {len(seq.token_ids)} tokens but no target "
                f"state for token {wanted}; the engine gives the states of every committed "
                "token but the last"
            )
        return state
