"""Reporting: device counts -> host mirror -> Prometheus counters and throttled logs.

Minimal interface used by the sites; the full reporter (metrics, throttled structlog events,
fault containment) is built on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guardrails.settings import GuardSettings
    from guardrails.sites import DeviceCounts, _SiteBase

__all__ = ["Reporter"]


class Reporter:
    """Turns the sites' device counts into metrics and log events, without a host sync."""

    def __init__(
        self,
        settings: GuardSettings,
        *,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._tracked: list[tuple[_SiteBase, DeviceCounts]] = []

    def register(self, site: _SiteBase) -> None:
        """A site was created (its series should exist at 0 from now on)."""

    def track(self, site: _SiteBase, counts: DeviceCounts) -> None:
        """A site got buffers on a new device."""
        with self._lock:
            self._tracked.append((site, counts))

    def tick(self) -> None:
        """Called from the hot path every `reporting.every_calls` calls of some site."""
        self.poll()

    def poll(self) -> None:
        """Report what the host mirrors hold now; never waits for a device."""

    def flush(self) -> None:
        """Report exact totals (waits for the devices); for shutdown."""

    def close(self) -> None:
        self.flush()
