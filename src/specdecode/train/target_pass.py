"""What training reads from the target: its fused states and its distribution, per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.model.transformer import Transformer


@dataclass(frozen=True, slots=True)
class TargetPass:
    """One training sequence as the target sees it.

    tokens: [T] int64 the sequence (prompt + answer).
    prompt_length: tokens of the prompt; positions >= prompt_length - 1 predict answer tokens.
    features: [T, F] the inputs of the layers the head reads (target dtype; see
        `Transformer.forward`'s hidden_layers).
    teacher: [T, Vd] the target's logits over the draft vocabulary (bf16): row t predicts
        token t + 1.
    argmax: [T] int64 the target's most likely next token over its whole vocabulary.
    """

    tokens: Tensor
    prompt_length: int
    features: Tensor
    teacher: Tensor
    argmax: Tensor


@torch.inference_mode()
def run_target(
    model: Transformer,
    tokens: list[int],
    prompt_length: int,
    layers: tuple[int, ...],
    draft_ids: Tensor,
) -> TargetPass:
    """One PREFILL pass of `model` over `tokens`, keeping the inputs of `layers` (draft_ids:
    [Vd] the draft vocabulary)."""
    device = model.device
    ids = torch.tensor([tokens], device=device)  # [1, T]
    cache = model.new_cache(1, len(tokens))
    meta = AttentionMetadata.prefill([len(tokens)], device)
    logits, hidden = model(ids, meta, cache, hidden_layers=layers)  # [1, T, V], [1, T, F]
    return TargetPass(
        ids[0].cpu(),
        prompt_length,
        hidden[0].cpu(),
        logits[0, :, draft_ids.to(device)].to(torch.bfloat16).cpu(),
        logits[0].argmax(-1).cpu(),
    )
