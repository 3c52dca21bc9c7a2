"""What training reads from the target: its states at named layers, per sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.cache.attention_metadata import AttentionMetadata
from specdecode.model.transformer import Transformer

NO_ARGMAX = -1  # `TargetPass.argmax` before the prompt's last token (no teacher row there)
PADDING = 0.15  # `row_groups`: padded positions a pass may add, as a share of its real tokens
HEAD_ROWS = 256  # output-head rows computed at once ([256, V] logits at a time)


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


def run_target(
    model: Transformer, tokens: list[int], prompt_length: int, layers: tuple[int, ...]
) -> TargetPass:
    """One PREFILL pass of `model` over `tokens`, keeping the inputs of `layers`: the pass of
    `run_targets` for one sequence."""
    return run_targets(model, [(tokens, prompt_length)], layers)[0]


@torch.inference_mode()
def run_targets(
    model: Transformer,
    sequences: Sequence[tuple[list[int], int]],
    layers: tuple[int, ...],
    rows: int = 1,
) -> list[TargetPass]:
    """The passes of `sequences` ((tokens, prompt length) each), in their order, from PREFILL
    passes of up to `rows` sequences each (right-padded rows of similar lengths:
    `row_groups`); the output head runs only from each prompt's last position on (the only
    rows a loss reads), HEAD_ROWS rows at a time. A sequence's pass is the same, bit for bit,
    in whatever group it runs where the target's kernels are row-exact (int8, gguf)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    out: dict[int, TargetPass] = {}
    for group in row_groups([len(tokens) for tokens, _ in sequences], rows):
        passes = _group_passes(model, [sequences[i] for i in group], tuple(layers))
        out.update(zip(group, passes, strict=True))
    return [out[i] for i in range(len(sequences))]


def row_groups(lengths: Sequence[int], rows: int) -> list[list[int]]:
    """The sequences of `lengths` (their indices) grouped into passes of at most `rows`
    sequences, longest first, a group growing while its padding stays within PADDING of its
    tokens. Example: row_groups([5, 100, 96], 4) is [[1, 2], [0]]."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and len(group) < rows:
            width = lengths[group[0]]  # the longest: the group's width
            real = sum(lengths[j] for j in group) + lengths[i]
            if width * (len(group) + 1) <= (1 + PADDING) * real:
                group.append(i)
                continue
        groups.append([i])
    return groups


def _group_passes(
    model: Transformer, sequences: Sequence[tuple[list[int], int]], layers: tuple[int, ...]
) -> list[TargetPass]:
    """One PREFILL pass over `sequences` as right-padded rows; their passes, in order."""
    device, final = model.device, model.config.num_layers
    lengths = [len(tokens) for tokens, _ in sequences]
    ids = torch.zeros((len(sequences), max(lengths)), dtype=torch.long)  # [B, T]
    for r, (tokens, _) in enumerate(sequences):
        ids[r, : len(tokens)] = torch.tensor(tokens)
    kept = layers if final in layers else (*layers, final)  # the head reads the final state
    cache = model.new_cache(len(sequences), ids.shape[1])
    meta = AttentionMetadata.prefill(lengths, device)
    first_only = torch.zeros((len(sequences), 1), dtype=torch.long, device=device)  # [B, 1]
    _, hidden = model(ids.to(device), meta, cache, logits_index=first_only, hidden_layers=kept)
    width = hidden.shape[-1] // len(kept)  # hidden [B, T, len(kept) * width]
    at = kept.index(final) * width
    firsts = [max(n - 1, 0) for _, n in sequences]
    tops = torch.cat([hidden[r, f : lengths[r], at : at + width] for r, f in enumerate(firsts)])
    argmax = torch.cat(
        [model.head(chunk[None])[0].argmax(-1) for chunk in tops.split(HEAD_ROWS)]
    ).cpu()  # [R] over every row's answer positions, row after row
    out, done = [], 0
    for r, ((_, n), first) in enumerate(zip(sequences, firsts, strict=True)):
        top = torch.full((lengths[r],), NO_ARGMAX, dtype=torch.long)
        top[first:] = argmax[done : done + lengths[r] - first]
        done += lengths[r] - first
        states = hidden[r, : lengths[r], : len(layers) * width].to("cpu", copy=True)
        out.append(TargetPass(ids[r, : lengths[r]].clone(), n, states, layers, top))
    return out
