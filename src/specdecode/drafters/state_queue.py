"""The target's states a state-reading drafter waits for, per sequence (`StateQueue`).

EAGLE-3 heads, MTP layers and block drafters read the target's states of the committed
tokens. They arrive with `commit` after each target pass, for the tokens the pass kept (every
committed token but the last), wait in the queue, and the next draft feeds them in one go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdecode.drafters.base import SeqView
from specdecode.types import TargetFeatures


@dataclass
class StateQueue:
    """One sequence's target states: how many were fed to the drafter, and those not yet."""

    fed: int = 0  # tokens whose states the drafter has consumed (0..fed - 1)
    pending: list[Tensor] = field(default_factory=list)  # [n, F] states for tokens fed..

    @property
    def known(self) -> int:
        """Tokens whose target state has arrived (fed or pending)."""
        return self.fed + sum(len(p) for p in self.pending)

    def push(self, features: TargetFeatures, request_id: str, kind: str) -> None:
        """Queue the states of `features` ([n, F] from token `features.start`) not known yet.

        Raises:
            ValueError: states of earlier tokens never arrived (`kind` names the drafter).
        """
        if features.start + len(features.hidden) <= self.known:
            return
        if features.start > self.known:
            raise ValueError(
                f"{kind}: target states for tokens {self.known}..{features.start - 1} of "
                f"request {request_id} never arrived"
            )
        self.pending.append(features.hidden[self.known - features.start :])

    def take(self, seq: SeqView, kind: str) -> Tensor:
        """The queued states ([n, F], n >= 1, tokens fed..len - 2), now counted as fed.

        Raises:
            ValueError: the queue does not reach the sequence's last token but one.
        """
        ids = seq.token_ids
        if self.known != len(ids) - 1 or not self.pending:
            raise ValueError(
                f"{kind}: request {seq.request_id} has {len(ids)} tokens but target states for "
                f"{self.known} and {sum(len(p) for p in self.pending)} new ones; the engine "
                "gives the states of every committed token but the last"
            )
        states = torch.cat(self.pending)
        self.fed, self.pending = self.known, []
        return states
