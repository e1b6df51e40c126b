"""Series and delta tracking for one site: device counts read now -> counter increments.

`SiteSeries` holds a site's Prometheus series (one per count slot that has one, and its
calls), the per-device baselines already reported and the totals they sum to. `advance()`
turns the difference between the counts read now and the baselines into increments; a
baseline moves only when its increment worked, so a failed write is retried at the next
read and the counters still end exact. Log throttling is elsewhere
(`guardrails.reporting.throttle`). Used under the reporter's lock only; no lock of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from guardrails.flags import CountKind

if TYPE_CHECKING:
    from guardrails.reporting.mirror import DeviceCounts

__all__ = ["NEWS", "SiteSeries"]

# The counts whose increase is news worth a log event (row counts follow from them).
NEWS: Final = frozenset(
    {
        CountKind.NAN,
        CountKind.POSINF,
        CountKind.NEGINF,
        CountKind.ROWS_NO_VALID_TOKEN,
        CountKind.OOB_TOKEN,
    }
)

# Add `delta` to a series (None: a count only log events carry); False when the write failed.
Increment = Callable[[Any, int], bool]


class SiteSeries:
    """What has been counted for one site with `slots`: its series, per-device baselines,
    totals and calls."""

    __slots__ = (
        "calls_child",
        "children",
        "devices",
        "host_only",
        "news",
        "reported_calls",
        "seen_calls",
        "totals",
    )

    def __init__(self, slots: Sequence[CountKind]) -> None:
        n = len(slots)
        self.children: list[Any] = [None] * n
        self.calls_child: Any = None
        self.devices: list[tuple[DeviceCounts, list[int]]] = []
        self.totals = [0] * n
        self.news = frozenset(i for i, kind in enumerate(slots) if kind in NEWS)
        self.reported_calls = 0
        self.seen_calls = -1
        self.host_only = True

    def track(self, counts: DeviceCounts) -> None:
        """The site got buffers on a new device; nothing of it is reported yet."""
        self.devices.append((counts, [0] * len(self.totals)))
        self.host_only = self.host_only and counts.device.type == "cpu"

    def unchanged(self, calls: int) -> bool:
        """On the CPU the counts only change with calls: none since the last look, none new."""
        return calls == self.seen_calls and self.host_only

    def advance(
        self,
        calls: int,
        *,
        exact: bool,
        increment: Increment,
        failed_read: Callable[[Exception], None],
    ) -> bool:
        """Read every device's counts (exact: waiting for the device; else the latest
        completed copy, asking for the next) and count what is new; `calls` is the site's
        call count now. True when a count of `NEWS` rose."""
        fresh = False
        for counts, base in self.devices:
            if not exact and calls == self.seen_calls and counts.device.type == "cpu":
                continue
            try:
                if exact:
                    values = counts.exact()
                else:
                    values = counts.latest()
                    # The next copy, for the next look: a site whose work only replays in a
                    # CUDA graph makes no Python call that would ask for one (no-op on CPU).
                    counts.request()
            except Exception as exc:
                failed_read(exc)
                continue
            for i, value in enumerate(values):
                delta = value - base[i]
                # A copy older than what was reported (an exact read overtook it) is <= 0.
                if delta > 0 and increment(self.children[i], delta):
                    base[i] = value
                    self.totals[i] += delta
                    if i in self.news:
                        fresh = True
        self.seen_calls = calls
        delta_calls = calls - self.reported_calls
        if delta_calls > 0 and increment(self.calls_child, delta_calls):
            self.reported_calls = calls
        return fresh

    def restart(self, calls: int) -> None:
        """In a forked child: the parent reports what was counted before the fork; this one
        counts from the CPU counts it inherited and its `calls` on."""
        self.reported_calls = calls
        for counts, base in self.devices:
            if counts.device.type == "cpu":
                base[:] = counts.latest()
        self.totals = [0] * len(self.totals)
