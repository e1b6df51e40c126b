"""Device counts and their host mirror: how counts leave the device without a sync.

A site accumulates its counts into an int64 buffer on the tensor's device. `request()` starts
a non-blocking copy of that buffer into host memory (pinned on CUDA, so the copy is truly
asynchronous) and records an event; `latest()` returns the newest completed copy and never
waits. On the CPU the buffer is host memory already and is read directly.

The CUDA calls here (copy, event record, event query) run with the calling thread's stream
capture mode set to thread-local (`outside_captures`): while another thread captures a CUDA
graph in the default global mode, an event query from this thread would otherwise be refused
and invalidate that capture (a host's metrics thread polling while the engine captures).
"""

from __future__ import annotations

import torch

from guardrails import _process
from guardrails._cuda import outside_captures

__all__ = ["DeviceCounts"]


class DeviceCounts:
    """One site's counters on one device, and their host mirror.

    The device buffer is only ever added to. `request()` starts a non-blocking copy into a
    host buffer (pinned on CUDA, so the copy is truly asynchronous) and records an event;
    `latest()` returns the newest completed copy without waiting. On the CPU the buffer *is*
    host memory, so `latest()` reads it directly.
    """

    __slots__ = (
        "__weakref__",
        "_event",
        "_last",
        "_lock",
        "_mirror",
        "_pending",
        "counts",
        "device",
    )

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        # CUDA: one copy in flight, asked for by a site's tick (serving thread) or by a poll
        # (any thread, the background poller's included). A request never waits for it.
        self._lock = _process.lock(self, "_lock")
        self._last = [0] * slots
        self._pending = False
        with torch.inference_mode(False):
            self.counts = torch.zeros(slots, dtype=torch.int64, device=device)
            if device.type == "cuda":
                # Pinned: a non-blocking copy into pageable memory would be synchronous.
                # (torch.cuda.Event is untyped in torch's stubs, hence the ignores below.)
                self._mirror = torch.zeros(slots, dtype=torch.int64, pin_memory=True)
                self._event: torch.cuda.Event | None = torch.cuda.Event()  # type: ignore[no-untyped-call]
            else:
                self._mirror = self.counts
                self._event = None

    def request(self) -> None:
        """Start a copy of the device counts to the host unless one is in flight."""
        if self._event is None or self._pending:
            return
        if not self._lock.acquire(blocking=False):
            return  # another thread is asking for one now
        try:
            if self._pending:
                return
            # On the counts' device, whichever device is current in the calling thread, on
            # that thread's current stream there.
            with outside_captures(), torch.cuda.device(self.device):
                if torch.cuda.is_current_stream_capturing():
                    # A copy recorded into a graph would replay forever; count on replay only.
                    return
                self._mirror.copy_(self.counts, non_blocking=True)
                self._event.record()
            self._pending = True
        finally:
            self._lock.release()

    def latest(self) -> list[int]:
        """The newest host copy; never waits for the device."""
        if self._event is None:
            return [int(v) for v in self.counts.tolist()]
        if self._pending:
            with self._lock:
                if self._pending:
                    with outside_captures():
                        done = self._event.query()  # type: ignore[no-untyped-call]
                    if done:
                        self._last = [int(v) for v in self._mirror.tolist()]
                        self._pending = False
        return self._last

    def exact(self) -> list[int]:
        """The current totals, waiting for the device (tests, `counts()`, shutdown)."""
        if self._event is not None:
            # Every stream of the device: calls on a side stream count too. Thread-local
            # capture mode: from flush/close/counts, the finalizer or atexit, a synchronize
            # while another thread captures in global mode would invalidate that capture.
            with outside_captures():
                torch.cuda.synchronize(self.device)
                values = [int(v) for v in self.counts.tolist()]
            self._last = values
            return values
        values = [int(v) for v in self.counts.tolist()]
        self._last = values
        return values
