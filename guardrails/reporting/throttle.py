"""Log throttling for one site: the first event at once, then at most one per interval.

`LogThrottle` holds only the throttle's state: when the next event may go, how many events
it has folded in since the last (`suppressed`), what the last event carried (`logged`,
`logged_calls`, so the next one gives the deltas) and whether news waits for an event
(`pending`). The metric baselines are elsewhere (`guardrails.reporting.series`): counts are
never throttled. Used under the reporter's lock only; it holds no lock of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["LogThrottle"]


class LogThrottle:
    """The throttle state of one site's log events; `slots` counts per event."""

    __slots__ = ("logged", "logged_calls", "next_at", "pending", "suppressed")

    def __init__(self, slots: int) -> None:
        self.logged = [0] * slots
        self.logged_calls = 0
        self.next_at = -math.inf
        self.suppressed = 0
        self.pending = False

    def due(self, now: float, *, fresh: bool, final: bool) -> bool:
        """Whether an event goes now (always when `final`); a `fresh` one held back is
        counted in `suppressed`."""
        if final or now >= self.next_at:
            return True
        if fresh:
            self.suppressed += 1
        return False

    def logged_now(self, now: float, interval: float, totals: Sequence[int], calls: int) -> None:
        """An event was decided at `now` carrying `totals` and `calls`: the next is due no
        sooner than `now + interval`."""
        self.next_at = now + interval
        self.logged = list(totals)
        self.logged_calls = calls
        self.suppressed = 0
        self.pending = False

    def restart(self, calls: int) -> None:
        """In a forked child: nothing logged yet, the parent's `calls` are not this one's."""
        self.logged = [0] * len(self.logged)
        self.logged_calls = calls
        self.suppressed = 0
        self.pending = False
