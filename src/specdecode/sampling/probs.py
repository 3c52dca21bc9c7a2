"""The ONE path from logits to probabilities (temperature, top-k, top-p) and to sampled tokens.

Drafter and verifier both call `probs_from_logits` with the same per-row parameters, so the
drafter's q and the target's p are always computed the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdecode.sampling.argmax import argmax
from specdecode.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters of a batch, as tensors, plus what is known of them on the
    host (so the per-step paths never read a tensor back to decide what to do)."""

    temperature: Tensor  # [B] float32; 0 = greedy
    top_k: Tensor  # [B] int64; <= 0 = disabled
    top_p: Tensor  # [B] float32; 1 = disabled
    greedy: tuple[bool, ...]  # [B] host: temperature 0 (p is one-hot on the argmax)
    filtered: bool  # host: some row uses top-k or top-p

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: str | torch.device
    ) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            greedy=tuple(p.greedy for p in params),
            filtered=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        )

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)

    def rows(self, rows: Sequence[int]) -> SamplingTensors:
        """The parameters of some rows of the batch, in the order given (`filtered` stays the
        batch's: warping a row without top-k or top-p removes nothing, and no tensor is read
        back)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.temperature.device)
        return SamplingTensors(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            greedy=tuple(self.greedy[b] for b in rows),
            filtered=self.filtered,
        )


def warp_logits(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Apply temperature, then top-k, then top-p; removed tokens get -inf.

    logits: [B, V] or [B, K, V] (row b uses parameters b). Returns float32, same shape.
    Greedy rows (temperature 0) are left unscaled: their argmax is what counts.
    """
    x = logits.float()
    view = (-1,) + (1,) * (x.dim() - 1)  # broadcast [B] over the trailing dims
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    x = x / temp.view(view)
    if not st.filtered:
        return x
    use_k = (st.top_k > 0) & (st.top_k < x.shape[-1])
    sorted_x, order = x.sort(dim=-1, descending=True)  # [..., V]
    rank = torch.arange(x.shape[-1], device=x.device)
    k = torch.where(use_k, st.top_k, torch.full_like(st.top_k, x.shape[-1]))
    remove = rank >= k.view(view)  # [..., V]: beyond the k-th best
    sorted_x = sorted_x.masked_fill(remove, float("-inf"))
    sorted_p = sorted_x.softmax(dim=-1)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # probability mass strictly above each token
    # The top token always has before == 0; rows with top_p 1 keep their tail (before may round
    # up to 1.0 there).
    remove = remove | ((before >= st.top_p.view(view)) & (st.top_p < 1.0).view(view))
    sorted_x = sorted_x.masked_fill(remove, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)


def probs_from_logits(logits: Tensor, st: SamplingTensors) -> Tensor:
    """Probabilities after warping; greedy rows become one-hot on their argmax.

    logits: [B, V] or [B, K, V]. Returns float32 probabilities of the same shape. A batch of
    greedy rows only takes the argmax (no softmax: its cost grows with the pass's width x V).
    """
    if st.all_greedy:
        hot = argmax(logits)[..., None]  # warping keeps a greedy row's top token
        return torch.zeros(logits.shape, device=logits.device).scatter_(-1, hot, 1.0)
    warped = warp_logits(logits, st)
    probs = warped.softmax(dim=-1)
    if any(st.greedy):
        one_hot = torch.zeros_like(probs).scatter_(-1, argmax(warped)[..., None], 1.0)
        view = (-1,) + (1,) * (probs.dim() - 1)
        probs = torch.where((st.temperature == 0).view(view), one_hot, probs)
    return probs


def sample(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Draw one token per row of `probs` ([B, V]) with each row's own generator -> [B] int64."""
    out = [
        torch.multinomial(row, 1, generator=gen) for row, gen in zip(probs, generators, strict=True)
    ]
    return torch.cat(out)
