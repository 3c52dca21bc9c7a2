"""Energy per token, estimated: CPU seconds x a per-core power figure.

This machine exposes no power counters (no RAPL under /sys/class/powercap in this VM), so the
estimate charges each busy core-second a fixed share of a server CPU's rated power:
`WATTS_PER_CORE` = 3.75 W, an AMD EPYC 9654's (Zen 4, like this machine's cores) 360 W TDP over
its 96 cores. It counts neither idle cores, memory nor the rest of the machine, and a core
that waits on memory is charged as much as one that computes. Set `SPECDECODE_WATTS_PER_CORE`
for another machine. Use it to compare methods on one machine, not as a measurement.
"""

from __future__ import annotations

import os
import time

from specdecode.errors import UserError

WATTS_PER_CORE = 3.75  # EPYC 9654: 360 W TDP / 96 cores
WATTS_ENV = "SPECDECODE_WATTS_PER_CORE"


def watts_per_core() -> float:
    """The per-core power figure: `SPECDECODE_WATTS_PER_CORE` when set, else WATTS_PER_CORE."""
    text = os.environ.get(WATTS_ENV)
    if text is None:
        return WATTS_PER_CORE
    try:
        watts = float(text)
    except ValueError:
        watts = -1.0
    if not watts > 0:
        raise UserError(f"{WATTS_ENV} must be a positive number of watts, got {text!r}")
    return watts


def method() -> str:
    """How the estimate is made, for reports."""
    return f"estimate: CPU seconds x {watts_per_core():g} W per busy core (specdecode.energy)"


def cpu_seconds() -> float:
    """CPU seconds this process has used so far, all its threads together."""
    return time.process_time()


def joules(cpu_s: float) -> float:
    """The energy estimate for `cpu_s` CPU seconds."""
    return cpu_s * watts_per_core()
