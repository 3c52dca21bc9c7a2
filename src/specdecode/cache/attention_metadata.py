"""What one forward pass attends to, said by its caller, never guessed by the model.

The engine (or a drafter running its own model) builds one `AttentionMetadata` per pass: each
row's cached length before the pass, its new tokens, their positions, the attention mode, and
for trees the mask among the new tokens. The model reads it; the `KVCache` only stores keys and
values (vLLM v1's per-backend `*Metadata` objects are the model for this).

Slots: row b's new token t is written at cache slot `starts[b] + t` and may attend every cached
slot `s < starts[b]` plus the new tokens its mode allows. Rows are padded to one width T; tokens
`t >= num_new[b]` of a row are padding: they are computed and written but never become part of
the row (its cached length after the pass is `starts[b] + num_new[b]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor


class AttentionMode(Enum):
    """How the new tokens of a pass attend.

    PREFILL: causal among the new tokens, computed as one batched attention (fast for long
        passes; its rounding may depend on how many tokens the pass holds).
    DECODE: causal, and each new token attends by itself, exactly as a one-token step would
        (row-exact where the model's kernels allow it): decode steps, chain verification, a
        drafter's catch-up, prefills under prefix caching (a cached block and a fresh prefill
        then agree bit for bit). Valid for any starts, so a batch may mix fresh and running
        rows.
    TREE: each new token attends by itself (like DECODE) to the slots before `tree_starts[b]`
        and to the slots `tree_starts[b] + r` where `tree_mask[b, t, r]`: token trees, whose
        nodes see their ancestors and themselves, and a block drafter's block, whose entries
        see each other (later slots of the pass: no sliding window then, which the native
        kernel checks). `tree_starts` defaults to `starts` (a tree
        fed in one pass); a drafter that grows a tree over several passes sets it to where the
        tree began, so its mask also covers the nodes earlier passes cached.
    """

    PREFILL = "prefill"
    DECODE = "decode"
    TREE = "tree"


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One pass's attention layout (host-side lists and small tensors, built once per pass).

    mode: see `AttentionMode`.
    starts: per row, cached slots before this pass (= the slot of its first new token).
    num_new: per row, its real new tokens (0..T); the rest of the row is padding.
    positions: [B, T] int64 RoPE positions of the new tokens.
    tree_mask: [B, T, M] bool, TREE only: new token t may attend slot tree_starts[b] + r;
        M >= starts[b] - tree_starts[b] + T for every row (columns past a row's slots: False).
    tree_starts: TREE only, per row the first slot the mask covers (default: starts).
    """

    mode: AttentionMode
    starts: tuple[int, ...]
    num_new: tuple[int, ...]
    positions: Tensor  # [B, T] int64
    tree_mask: Tensor | None = None  # [B, T, M] bool
    tree_starts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        batch, width = self.positions.shape
        if len(self.starts) != batch or len(self.num_new) != batch:
            raise ValueError(
                f"starts ({len(self.starts)}) and num_new ({len(self.num_new)}) need one entry "
                f"per row of positions ({batch} rows)"
            )
        if any(s < 0 for s in self.starts) or any(not 0 <= n <= width for n in self.num_new):
            raise ValueError(
                f"starts must be >= 0 and num_new in 0..{width}, got {self.starts}, {self.num_new}"
            )
        if (self.mode is AttentionMode.TREE) != (self.tree_mask is not None):
            raise ValueError("a tree_mask is given exactly when the mode is TREE")
        if self.tree_mask is None:
            if self.tree_starts is not None:
                raise ValueError("tree_starts belong to a TREE pass")
            return
        if self.tree_starts is None:
            object.__setattr__(self, "tree_starts", self.starts)
        offsets = [s - t for s, t in zip(self.starts, self.tree_starts, strict=True)]
        need = max(offsets) + width
        shape = tuple(self.tree_mask.shape)
        if min(offsets) < 0 or shape[:2] != (batch, width) or shape[2] < need:
            raise ValueError(
                f"tree_mask must be [B, T, M] = [{batch}, {width}, >= {need}] with tree_starts "
                f"<= starts, got {shape}, tree_starts {self.tree_starts}, starts {self.starts}"
            )

    @classmethod
    def contiguous(
        cls,
        mode: AttentionMode,
        starts: Sequence[int],
        num_new: Sequence[int],
        device: torch.device | str,
        width: int | None = None,
        max_positions: int | None = None,
    ) -> AttentionMetadata:
        """A causal pass whose new tokens sit at positions `starts[b] + t` (slot == position).

        width: T, the padded row width (default: max(num_new)).
        max_positions: clamp positions below this (padding may run past the context's end;
            it is never kept).
        Example: starts (4, 2), num_new (2, 1) -> positions [[4, 5], [2, 3]] (3 is padding).
        """
        width = max(num_new) if width is None else width
        offsets = torch.arange(width, device=device)
        positions = torch.tensor(list(starts), device=device)[:, None] + offsets  # [B, T]
        if max_positions is not None:
            positions = positions.clamp(max=max_positions - 1)
        return cls(mode, tuple(starts), tuple(num_new), positions)

    @classmethod
    def prefill(cls, lengths: Sequence[int], device: torch.device | str) -> AttentionMetadata:
        """Prompts of `lengths` tokens into empty rows (right-padded to the longest)."""
        return cls.contiguous(AttentionMode.PREFILL, [0] * len(lengths), lengths, device)

    @property
    def batch_size(self) -> int:
        return len(self.starts)

    @property
    def width(self) -> int:
        """T: new tokens per row, padding included."""
        return self.positions.shape[1]

    @property
    def starts_empty(self) -> bool:
        """Whether every row starts empty: no cached slot before this pass (a prompt's
        prefill), so a row's slots are its new tokens."""
        return max(self.starts) == 0

    @property
    def span(self) -> int:
        """S: the cache slots a pass reads, max(starts) + T."""
        return max(self.starts) + self.width

    @property
    def ends(self) -> tuple[int, ...]:
        """Each row's cached length after the pass: starts + num_new."""
        return tuple(s + n for s, n in zip(self.starts, self.num_new, strict=True))

    def attention_mask(self) -> Tensor | None:
        """[B, 1, T, S] bool: query t of row b may read slot s, for batched attention.

        Slot s is visible iff `s < starts[b]` (the cached prefix) or the new token
        `r = s - starts[b]` is causal (`r <= t`); in TREE mode iff `s < tree_starts[b]` or
        `tree_mask[b, t, s - tree_starts[b]]`.
        None when every query may read every slot it is given (one new token per row and
        every row at the same start).
        Example: starts (2,), T = 2 -> query 0 sees slots 0, 1, 2 and query 1 sees 0..3.
        """
        if self.mode is not AttentionMode.TREE and self.width == 1 and len(set(self.starts)) == 1:
            return None
        device = self.positions.device
        slots = torch.arange(self.span, device=device)[None, None, :]  # [1, 1, S]
        if self.tree_mask is None:
            start = torch.tensor(self.starts, device=device)[:, None, None]  # [B, 1, 1]
            query = torch.arange(self.width, device=device)[None, :, None]  # [1, T, 1]
            return (slots - start <= query)[:, None]  # [B, 1, T, S]
        assert self.tree_starts is not None  # set in __post_init__
        rel = slots - torch.tensor(self.tree_starts, device=device)[:, None, None]  # [B, 1, S]
        covered = self.tree_mask.shape[2]
        idx = rel.clamp(0, covered - 1).expand(-1, self.width, -1)  # [B, T, S]
        allowed = (rel < 0) | ((rel < covered) & self.tree_mask.to(device).gather(2, idx))
        return allowed[:, None]
