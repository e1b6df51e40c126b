"""Time-bounded reporting: a background thread that polls a reporter twice per interval.

A site ticks its reporter every `reporting.every_calls` calls; the counts of the calls since
its last tick would wait for more traffic. On an idle server (one poisoned request, then
nothing) that is forever. The poller calls the reporter's `poll()` every
`reporting.report_interval_s / 2` seconds, so that a guarded step's counts and events reach the
counters and the logs within the interval of the step, whether or not another call comes:

- the first poll after the step asks for a fresh copy of the device counts (on the CPU they are
  read directly), the next one, at most half an interval later, reads it;
- it never waits for a device and never runs on the serving thread. On CUDA its copies are
  enqueued on a side stream of its own (`guardrails._cuda.side_streams`), not on the engine's
  streams, with the thread's capture mode thread-local (`guardrails._cuda.outside_captures`): a
  capture on another thread is neither joined nor invalidated. Such a copy is not ordered after the
  engine's work: it reads the counts as they are when it runs (they only grow), and the next
  one reads what came after;
- the guarded call is unchanged: nothing per call, nothing allocated;
- what a poll costs is counted in `guardrails_host_seconds_total{part="poller"}` (its work,
  not its sleep).

The thread starts with the reporter's first guarded call (processes that never sample get
none), holds the reporter weakly, stops at `close()` and at interpreter exit (before the exit
flush), and is started afresh in a forked child by the reporter's after-fork hook (the child's
calls go on from the parent's count: no first call of its own would start it).
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol

__all__ = ["Poller"]


class _Polled(Protocol):
    def background_poll(self) -> None: ...


class Poller:
    """Polls `owner.background_poll()` every `period_s` seconds until stopped."""

    __slots__ = ("_stop", "_thread")

    def __init__(self, owner: _Polled, period_s: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_run,
            # A wait longer than the platform's lock timeout would raise in the thread.
            args=(weakref.ref(owner), self._stop, min(period_s, threading.TIMEOUT_MAX)),
            name="guardrails-report-poller",
            daemon=True,  # never keeps a server's process alive
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop polling; waits for a poll in progress (not from the poller's own thread)."""
        self._stop.set()
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout_s)


def _run(owner: weakref.ref[_Polled], stop: threading.Event, period_s: float) -> None:
    while not stop.wait(period_s):
        polled = owner()
        if polled is None:
            return  # the reporter was collected
        polled.background_poll()  # contains its own faults (counted, logged once)
        del polled
