"""Prompts, greedy settings and a fake sequence shared by the speculative-decoding tests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdecode.sampling_params import SamplingParams
from specdecode.types import DraftBudget, RequestOutput

# Token-id prompts of different lengths, some repetitive (so prompt lookup finds matches).
PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 3, 250, 17, 42, 99]},
    {"prompt_token_ids": list(range(10, 40)) + list(range(10, 20))},
    {"prompt_token_ids": [7]},
    {"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@dataclass
class FakeSeq:
    """A minimal SeqView for calling a drafter directly."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None


class PassCounter:
    """Counts a model's forward passes (everything else is the model's)."""

    def __init__(self, model) -> None:
        self.model, self.passes = model, 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.passes += 1
        return self.model(*args, **kwargs)


def assert_fully_accepted(outs: list[RequestOutput], k: int) -> None:
    """Draft = target: acceptance >= 0.98 and tau close to K + 1, per request.

    Every full step emits K + 1 tokens; only the first token (from prefill) and the tail of the
    40-token limit are shorter.
    """
    for out in outs:
        spec = out.metrics.spec
        assert spec.acceptance_rate >= 0.98
        assert 0.98 * (k + 1) * (1 - (k + 2) / 40) <= spec.mean_acceptance_length <= k + 1


def chi2_pvalue(observed: Tensor, expected_probs: Tensor) -> float:
    """Chi-square goodness-of-fit p-value; cells with expected count < 5 are pooled.

    observed: [V, V] counts; expected_probs: [V, V] summing to 1. Cells of probability 0 must
    be empty (asserted) and are left out. sf(x; df) = Q(df / 2, x / 2), the regularized upper
    incomplete gamma function (no scipy needed).
    """
    obs, exp = observed.flatten().double(), expected_probs.flatten().double() * observed.sum()
    assert obs[exp == 0].sum() == 0, "a (t0, t1) pair of target probability 0 was emitted"
    big, small = exp >= 5, (exp > 0) & (exp < 5)
    obs_cells, exp_cells = obs[big], exp[big]
    if small.any():
        pooled_obs, pooled_exp = obs[small].sum(), exp[small].sum()
        if pooled_exp >= 5:
            obs_cells = torch.cat([obs_cells, pooled_obs[None]])
            exp_cells = torch.cat([exp_cells, pooled_exp[None]])
        else:  # too small on its own: merge into the smallest big cell
            i = exp_cells.argmin()
            obs_cells[i] += pooled_obs
            exp_cells[i] += pooled_exp
    stat = ((obs_cells - exp_cells) ** 2 / exp_cells).sum()
    df = torch.tensor((len(exp_cells) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def budgets(limits: Iterable[int]) -> list[DraftBudget]:
    """A `propose` budget of each of `limits` tokens, without a stopping rule."""
    return [DraftBudget(k) for k in limits]
