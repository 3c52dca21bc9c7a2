"""Prompts, greedy settings and a fake sequence shared by the speculative-decoding tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.types import RequestOutput, SamplingParams, TargetFeatures

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
    features: TargetFeatures | None = None
    target_argmax: list[int] | None = None


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
