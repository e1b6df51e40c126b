"""Host seconds guardrails spends in the serving process, by part:

    guardrails_host_seconds_total{part, rank}

`part` names what spent it:

    site:<site>      a site call: detect, heal, flag, count, and the reporter's tick
    attach:<site>    an attach point's or decorator's own work around its site call
                     (finding the tensor in the call)
    hook:<hook>      an engine hook's parts, without the engine's call they wrap
    poller           the background report poll (reading counts, writing series, logging)
    heartbeat        the liveness heartbeat's wrapper and self-check

Each timed unit reads `time.perf_counter` twice around its own work and adds the difference
here; never the engine's call inside it, nor another timed unit's work (a site called from an
attach point is counted under `site:`, not under `attach:`), so the parts add up to
guardrails' host time. Totals are plain floats of this process, added without a lock (two
threads adding to one part at the same instant may lose one addition; an engine steps on one
thread); the reporter turns them into counter increments each time it reports, so the counter
lags by at most one report interval and a forked child counts only its own time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

__all__ = ["CLOCK", "HostTime"]

CLOCK: Final[Callable[[], float]] = time.perf_counter


class HostTime:
    """Seconds of host time by part, and what of them the reporter has already counted."""

    __slots__ = ("_reported", "spent")

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._reported: dict[str, float] = {}

    def add(self, part: str, seconds: float) -> None:
        """`part` spent `seconds` more (called on the hot path: one dict update)."""
        spent = self.spent
        spent[part] = spent.get(part, 0.0) + seconds

    def unreported(self) -> list[tuple[str, float]]:
        """(part, seconds) spent since the last call, for the reporter's counter increments;
        marks them reported."""
        out = []
        for part, total in list(self.spent.items()):
            delta = total - self._reported.get(part, 0.0)
            if delta > 0:
                self._reported[part] = total
                out.append((part, delta))
        return out

    def unreport(self, part: str, seconds: float) -> None:
        """`unreported()` gave `seconds` of `part` that did not reach the counter: give them
        again next time."""
        self._reported[part] = self._reported.get(part, 0.0) - seconds

    def restart(self) -> None:
        """In a forked child: what the parent spent is the parent's to report."""
        self._reported = dict(self.spent)
