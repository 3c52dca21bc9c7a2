"""Records of timed requests: what a runner measures (`Timing`) and a run of the loop (`Run`).

`bench.json` stores every `Run` as a plain JSON object (`dataclasses.asdict`); `Run.from_dict`
reads one back, also from reports of older versions (fields added since take their defaults).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class Timing:
    """One request as a runner measured it; times in seconds from the call.

    arrivals: one (time, new tokens so far) per event in which tokens arrived (ours: each
        `LLM.stream` event; HF: each streamer push after the prompt; llama.cpp: each token);
        several tokens may arrive in one event (a speculative step). () = not seen.
    """

    wall_s: float  # from the call to the last token (prefill included)
    ttft_s: float  # from the call to the first new token
    token_ids: tuple[int, ...]  # [num_tokens] the new tokens
    arrivals: tuple[tuple[float, int], ...] = ()  # [events] (s since the call, tokens so far)
    spec: dict[str, Any] | None = None  # our `SpecCounters.as_dict()`; None for a peer

    @property
    def num_tokens(self) -> int:
        """New tokens generated."""
        return len(self.token_ids)

    @classmethod
    def measured(
        cls,
        t0: float,
        end: float,
        stamps: Sequence[tuple[float, int]],
        token_ids: Sequence[int],
        spec: dict[str, Any] | None = None,
    ) -> Timing:
        """From `time.perf_counter()` readings: the call at `t0`, the last token at `end`, and
        (reading, new tokens so far) per arrival. Without any arrival, TTFT is the wall time.

        Example: t0 10.0, end 10.3, stamps [(10.1, 1), (10.3, 3)] -> wall 0.3 s, TTFT 0.1 s,
        arrivals ((0.1, 1), (0.3, 3)).
        """
        arrivals = tuple((t - t0, n) for t, n in stamps)
        ttft = arrivals[0][0] if arrivals else end - t0
        return cls(end - t0, ttft, tuple(token_ids), arrivals, spec)


@dataclass(frozen=True, slots=True, kw_only=True)
class Run(Timing):
    """One timed run of the benchmark loop: a runner's `Timing` and where and how it ran.

    repeat: the repeat it belongs to (0-based); attempt: 0, or the redo of a disturbed group.
    foreign_cores: the other processes' mean CPU load while it ran, in cores.
    cpu_s: CPU seconds (all threads) of this process and its worker processes (a peer's, as
        vLLM's) during the run, for the energy estimate.
    disturbed: foreign_cores >= `machine.QUIET_CORES` (its group was kept at the last attempt).
    """

    method: str  # the method spec as written, e.g. "ngram:k=8"
    prompt_id: str
    category: str
    repeat: int
    attempt: int
    num_prompt_tokens: int
    foreign_cores: float
    disturbed: bool
    cpu_s: float | None = None  # CPU seconds during the run (None: older reports)

    @classmethod
    def of(cls, timing: Timing, **where: Any) -> Run:
        """`timing` with where it ran: `where` gives the fields `Run` adds to `Timing`."""
        return cls(**{f.name: getattr(timing, f.name) for f in fields(Timing)}, **where)

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Run:
        """A run read back from `bench.json`: keys this version does not know (e.g. an older
        "num_tokens") are ignored, and fields added since ("arrivals") take their defaults."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in row.items() if key in known}
        values["token_ids"] = tuple(values["token_ids"])
        values["arrivals"] = tuple((t, n) for t, n in values.get("arrivals", ()))
        return cls(**values)
