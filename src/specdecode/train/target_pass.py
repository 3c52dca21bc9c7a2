"""What training reads from the target: its states at named layers, per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.model.transformer import Transformer

NO_ARGMAX = -1  # `TargetPass.argmax` before the prompt's last token (no teacher row there)


@dataclass(frozen=True, slots=True)
class TargetPass:
    """One training sequence as the target sees it.

    tokens: [T] int64 the sequence (prompt + answer).
    prompt_length: tokens of the prompt; positions >= prompt_length - 1 predict answer tokens.
    states: [T, len(layers) * h] the inputs of `layers` concatenated in that order (target
        dtype; index L, the number of blocks, is the final-normed output: `Transformer.forward`'s
        hidden_layers).
    layers: which block inputs `states` holds.
    argmax: [T] int64 the target's most likely next token over its whole vocabulary, from
        position prompt_length - 1 on (NO_ARGMAX before).
    """

    tokens: Tensor
    prompt_length: int
    states: Tensor
    layers: tuple[int, ...]
    argmax: Tensor

    def at(self, layers: tuple[int, ...]) -> Tensor:
        """[T, len(layers) * h] the states of `layers` (each held here) in that order."""
        missing = [i for i in layers if i not in self.layers]
        if missing:
            raise ValueError(f"layers {missing} are not among the pass's {list(self.layers)}")
        if layers == self.layers:
            return self.states
        width = self.states.shape[-1] // len(self.layers)
        parts = [self.layers.index(i) for i in layers]
        return torch.cat([self.states[:, p * width : (p + 1) * width] for p in parts], dim=-1)


@torch.inference_mode()
def run_target(
    model: Transformer, tokens: list[int], prompt_length: int, layers: tuple[int, ...]
) -> TargetPass:
    """One PREFILL pass of `model` over `tokens`, keeping the inputs of `layers`; the output
    head runs only from the prompt's last position on (the only rows a loss reads)."""
    device = model.device
    ids = torch.tensor([tokens], device=device)  # [1, T]
    cache = model.new_cache(1, len(tokens))
    meta = AttentionMetadata.prefill([len(tokens)], device)
    first = max(prompt_length - 1, 0)
    index = torch.arange(first, len(tokens), device=device)[None]  # [1, N]
    logits, hidden = model(ids, meta, cache, logits_index=index, hidden_layers=layers)
    argmax = torch.full((len(tokens),), NO_ARGMAX, dtype=torch.long)
    argmax[first:] = logits[0].argmax(-1).cpu()  # logits [1, N, V]
    return TargetPass(ids[0].cpu(), prompt_length, hidden[0].cpu(), tuple(layers), argmax)
