"""The logits -> probs path on hand-built logits tables."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.sampling.probs import SamplingTensors, probs_from_logits, sample
from specdecode.sampling_params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))  # probs 0.1 0.4 0.2 0.3


def _st(**kwargs) -> SamplingTensors:
    return SamplingTensors.from_params([SamplingParams(**kwargs)], "cpu")


def test_plain_softmax_recovers_table() -> None:
    probs = probs_from_logits(LOGITS, _st(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([[0.1, 0.4, 0.2, 0.3]]))


def test_temperature_sharpens_and_flattens() -> None:
    cold = probs_from_logits(LOGITS, _st(temperature=0.5))[0]
    expected = torch.tensor([0.01, 0.16, 0.04, 0.09]) / 0.30  # p^2 renormalized
    torch.testing.assert_close(cold, expected)
    hot = probs_from_logits(LOGITS, _st(temperature=100.0))[0]
    assert hot.max() - hot.min() < 0.01


def test_greedy_is_one_hot_argmax() -> None:
    probs = probs_from_logits(LOGITS, _st(temperature=0.0))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_top_k_keeps_k_best_renormalized() -> None:
    probs = probs_from_logits(LOGITS, _st(top_k=2))[0]
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.4 / 0.7, 0.0, 0.3 / 0.7]))
    assert torch.equal(probs_from_logits(LOGITS, _st(top_k=-1)), probs_from_logits(LOGITS, _st()))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, [1]), (0.5, [1, 3]), (0.69, [1, 3]), (0.71, [1, 3, 2]), (0.95, [1, 3, 2, 0])],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, kept: list[int]) -> None:
    probs = probs_from_logits(LOGITS, _st(top_p=top_p))[0]
    base = torch.tensor([0.1, 0.4, 0.2, 0.3])
    expected = torch.zeros(4)
    expected[kept] = base[kept] / base[kept].sum()
    torch.testing.assert_close(probs, expected)


def test_top_k_then_top_p_and_per_row_parameters() -> None:
    logits = LOGITS.expand(3, -1)
    params = [SamplingParams(top_k=3, top_p=0.6), SamplingParams(temperature=0.0), SamplingParams()]
    probs = probs_from_logits(logits, SamplingTensors.from_params(params, "cpu"))
    # row 0: top-3 = {1: .4, 3: .3, 2: .2} renormalized to .444 .333 .222; top-p .6 keeps {1, 3}
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[2], torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_three_dimensional_logits_use_each_rows_parameters() -> None:
    logits = LOGITS[:, None].expand(2, 3, -1)  # [B=2, K=3, V=4]
    params = [SamplingParams(top_k=1), SamplingParams()]
    probs = probs_from_logits(logits, SamplingTensors.from_params(params, "cpu"))
    assert probs.shape == (2, 3, 4)
    assert torch.equal(probs[0], torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 3))
    torch.testing.assert_close(probs[1], torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 3))


def test_sampling_frequencies_follow_probs_and_respect_top_k() -> None:
    probs = probs_from_logits(LOGITS, _st(top_k=3))
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(probs, [gen]) for _ in range(20000)]).flatten()
    counts = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert counts[0] == 0  # outside top-k: never drawn
    expected = torch.tensor([0.0, 4 / 9, 2 / 9, 3 / 9])
    # 5 standard deviations of a binomial proportion with n = 20000
    assert torch.all((counts - expected).abs() <= 5 * torch.sqrt(expected * (1 - expected) / 20000))


def test_same_seed_same_draws() -> None:
    probs = probs_from_logits(LOGITS, _st())
    runs = []
    for _ in range(2):
        gen = torch.Generator().manual_seed(1234)
        runs.append([sample(probs, [gen]).item() for _ in range(50)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": math.nan}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be -1 or 0"),
        ({"max_tokens": 0}, "max_tokens must be a positive int"),
        ({"max_tokens": -3}, "max_tokens must be a positive int"),
        ({"stop": [""]}, "stop must be non-empty strings"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_k_beyond_the_vocabulary_leaves_the_distribution_alone() -> None:
    logits = (torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 30).expand(2, -1)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_k=50)]
    probs = probs_from_logits(logits, SamplingTensors.from_params(params, "cpu"))
    assert torch.equal(probs[0], probs[1])  # the sorted path keeps every token too
