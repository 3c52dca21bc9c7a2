"""What an engine reports after a step (`Engine.stats`): the values a server's gauges show."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One snapshot of an engine between steps.

    running: requests in the running batch.
    waiting: requests queued for it.
    kv_cache_usage: the share of the KV cache the running requests' rows hold (0..1).
    num_preemptions: requests preempted so far (their rows taken back, KV cache short).
    draft_limit: the latest step's mean draft limit per request (0 when it drafted nothing).
    running_ids: the running requests' ids.
    """

    running: int
    waiting: int
    kv_cache_usage: float
    num_preemptions: int
    draft_limit: float
    running_ids: frozenset[str]
