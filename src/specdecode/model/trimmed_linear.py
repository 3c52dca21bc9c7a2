"""The rows of an output projection, in its own weight format (`trimmed_linear`): a draft
model's head cut to its frequent tokens (FR-Spec, `drafters.trimmed_head`) and a block
drafter's logits over its draft vocabulary (`heads.dflash`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from specdecode import kernels
from specdecode.errors import UserError
from specdecode.model.gguf_linear import GgufLinear
from specdecode.model.linear import Bf16Linear, DenseLinear
from specdecode.model.quant import Int8DynamicLinear


def check_kept(kept: Tensor, vocab_size: int) -> None:
    """Refuse `kept` unless it is 1..vocab_size sorted, distinct int64 ids below vocab_size."""
    ok = kept.dim() == 1 and kept.dtype == torch.long and 0 < len(kept) <= vocab_size
    ok = ok and bool((kept[1:] > kept[:-1]).all()) and int(kept[0]) >= 0
    if not ok or int(kept[-1]) >= vocab_size:
        raise UserError(
            f"the kept tokens must be 1..{vocab_size} sorted, distinct int64 ids in "
            f"0..{vocab_size - 1}, got {kept.dtype} of shape {tuple(kept.shape)}"
        )


def trimmed_linear(head: nn.Module, kept: Tensor) -> nn.Module:
    """The rows `kept` ([Vk] int64) of the output projection `head`, in its own format, so that
    `trimmed(x) == head(x)[..., kept]`: bit for bit for the row-exact formats (bf16 on the CPU
    kernel, int8: the same int8 rows and scales, GGUF: the same blocks). fp32 `DenseLinear`
    rows are copied as they are (BLAS may round a narrower matrix differently)."""
    bias = getattr(head, "bias", None)
    bias = None if bias is None else bias[kept]  # [Vk]
    if isinstance(head, Int8DynamicLinear):
        q = kernels.unpack(head.packed, head.out_features, head.in_features)[kept]  # [Vk, in]
        # q * scale re-quantizes to q exactly; its derived scale may differ by an ulp, so the
        # original scales are copied in.
        trimmed = Int8DynamicLinear(q.float() * head.scale[kept, None], bias)
        trimmed.scale[: len(kept)] = head.scale[kept]
        return trimmed
    if isinstance(head, Bf16Linear):
        weight = kernels.unpack(head.packed, head.out_features, head.in_features)  # [V, in]
        return Bf16Linear(weight[kept], bias)
    if isinstance(head, DenseLinear):
        return DenseLinear(head.weight[kept], bias)
    if isinstance(head, GgufLinear):
        return head.rows(kept)
    raise UserError(
        f"draft_vocab_size cannot trim an output head of type {type(head).__name__}; it trims "
        "int8, GGUF, bf16 (with specdecode's CPU kernels) and fp32 heads (leave draft_vocab_size "
        "unset for this model)"
    )
