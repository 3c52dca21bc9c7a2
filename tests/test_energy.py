"""The energy estimate: each request's CPU seconds (its prefill and its share of each batch
step) add up to the process's, times the documented per-core figure or the environment's."""

from __future__ import annotations

from pathlib import Path

import pytest
from spec_cases import GREEDY, PROMPTS

from specdecode import energy
from specdecode.errors import UserError
from specdecode.llm import LLM


def test_requests_share_the_cpu_seconds_of_their_steps(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float32")
    before = energy.cpu_seconds()
    outs = llm.generate(PROMPTS, GREEDY)
    spent = energy.cpu_seconds() - before
    shares = [o.metrics.cpu_s for o in outs if o.metrics is not None]
    assert len(shares) == len(PROMPTS) and all(s > 0 for s in shares)
    assert sum(shares) <= spent  # tokenizing, scheduling outside the steps: not charged
    assert sum(shares) >= 0.5 * spent  # but the passes are
    metrics = outs[0].metrics
    assert metrics is not None
    assert metrics.energy_j == pytest.approx(metrics.cpu_s * energy.WATTS_PER_CORE)
    assert metrics.as_dict()["energy_j_estimate"] == metrics.energy_j


def test_the_power_figure_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert energy.joules(2.0) == 2.0 * energy.WATTS_PER_CORE
    monkeypatch.setenv(energy.WATTS_ENV, "10")
    assert energy.joules(2.0) == 20.0 and "10 W" in energy.method()
    for bad in ("0", "-3", "lots"):
        monkeypatch.setenv(energy.WATTS_ENV, bad)
        with pytest.raises(UserError, match="positive number of watts"):
            energy.joules(1.0)
