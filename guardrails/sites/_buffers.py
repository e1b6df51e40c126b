"""A site's state per device: the counts every thread adds to, and per-thread buffers.

Per calling thread (on CUDA per thread and stream) a site keeps row flags and the kernel
workspace that goes with them (`Buffers`); per device, the counts all threads add to and those
buffers (`DeviceState`). Buffers are made when a site first sees a device, thread or stream, or
when `reserve()` is called, never inside a CUDA-graph capture (see `guardrails.sites._site` for what
the flags a call returns are valid for). Every mutation happens under the owning site's lock.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, Final

import torch

from guardrails._cuda import capturing_on
from guardrails.kernels.base import LogitsKernel
from guardrails.reporting.mirror import DeviceCounts

__all__ = [
    "MAX_CACHED_VIEWS",
    "RECLAIM_AT",
    "Buffers",
    "DeviceState",
    "Key",
    "RowsCheck",
    "cuda_stream_id",
    "get_ident",
    "normalise",
    "thread_of",
]

get_ident: Final = threading.get_ident
# Who owns a set of buffers: a thread id, or on CUDA (thread id, stream id).
Key = int | tuple[int, int]
# A kernel's host-side clean check of 2-d logits whose shape and dtype the caller has read
# (see LogitsKernel): (x, rows, vocab, dtype, flags, workspace) -> clean.
RowsCheck = Callable[[torch.Tensor, int, int, torch.dtype, torch.Tensor, Any], bool]
MAX_CACHED_VIEWS: Final = 64
# Threads with buffers on one device before those of threads that have ended are reclaimed.
RECLAIM_AT: Final = 64


class Buffers:
    """One thread's row flags on one device, and the kernel workspace that describes them
    (the CPU kernel's `extent`: how far these flags may hold non-zero bytes)."""

    __slots__ = ("capacity", "eos_seen", "flags", "recent", "recent_call", "views", "workspace")
    flags: torch.Tensor
    workspace: Any

    def __init__(self, device: torch.device, capacity: int, kernel: LogitsKernel | None) -> None:
        self.capacity = 0
        # The flags this thread's latest call returned, and that call's number (see
        # `Site.recent` in guardrails.sites._site).
        self.recent: torch.Tensor | None = None
        self.recent_call = 0
        # At a token site with on_no_valid_token = "eos": the number of the logits site's
        # call whose rows this thread last ended, per thread like the logits site's `recent`.
        self.eos_seen = 0
        self._allocate(device, capacity, kernel, None)

    def _allocate(
        self,
        device: torch.device,
        capacity: int,
        kernel: LogitsKernel | None,
        retired: list[tuple[torch.Tensor, Any]] | None,
    ) -> None:
        # Ordinary tensors even when first sized inside inference mode, so that calls made
        # outside it can still update them.
        with torch.inference_mode(False):
            flags = torch.zeros(capacity, dtype=torch.uint8, device=device)
            ws = kernel.workspace(capacity, device) if kernel is not None else None
        # Only now that both exist: an allocation that fails leaves the buffers as they were.
        if self.capacity and retired is not None:
            retired.append((self.flags, self.workspace))
        # Replaced together under the site's lock, which a call holds while it reads them: the
        # flags a call gets always go with the workspace it gets.
        self.views: dict[int, torch.Tensor] = {}
        self.flags = flags
        self.workspace = ws
        self.capacity = capacity


class DeviceState:
    """A site's state on one device: the counts all threads add to, and each thread's buffers.

    Every mutation happens under the site's lock. `owner`/`last` are the thread served last
    and its buffers: with one calling thread (the common case) a call finds its buffers with
    one comparison.
    """

    __slots__ = (
        "buffers",
        "capacity",
        "check_rows",
        "counts",
        "device",
        "kernel",
        "last",
        "owner",
        "retired",
        "spare",
        "streams",
    )

    def __init__(
        self, device: torch.device, capacity: int, slots: int, kernel: LogitsKernel | None
    ) -> None:
        self.device = device
        self.kernel = kernel  # None at token-id sites
        # The kernel's host-side clean check, where it has one (see LogitsKernel).
        self.check_rows: RowsCheck | None = getattr(kernel, "check_rows", None)
        self.counts = DeviceCounts(device, slots)
        self.capacity = capacity  # rows every thread's buffers hold at least
        # Buffers replaced by a growth, kept on CUDA: a graph captured before the growth
        # still writes into them on every replay (their rows were reserved for it).
        self.retired: list[tuple[torch.Tensor, Any]] | None = [] if device.type == "cuda" else None
        self.buffers: dict[Key, Buffers] = {}  # by `key()`
        # On CUDA, buffers are per (thread, stream): see the module docstring.
        self.streams = device.type == "cuda"
        # Made ahead (by `reserve`) for the next thread that calls: a thread whose first call
        # is a CUDA-graph capture must not allocate. Also where the buffers of threads that
        # have ended go (`_reclaim`): kept, since a graph such a thread captured still writes
        # them on every replay, and reused by later threads rather than grown without bound
        # (such a graph's flags are then shared with the thread that reuses them).
        self.spare = [Buffers(device, capacity, kernel)]
        self.owner: Key | None = None  # none yet: `last` is not used before it is set
        self.last = self.spare[0]

    def key(self) -> Key:
        """Whose buffers a call from here uses: the thread's, on CUDA the thread's on its
        current stream of this device."""
        ident = get_ident()
        if self.streams:
            return ident, cuda_stream_id(self.device.index)
        return ident

    def buffers_for(self, key: Key, site: str) -> Buffers:
        """The caller's buffers (made or taken from the spares on its first call)."""
        buffers = self.buffers.get(key)
        if buffers is None:
            buffers = self.buffers[key] = self._new_buffers(key, site)
        if self.streams and not self.spare and not self.capturing():
            # Keep one spare ready on CUDA, made here outside any capture: the next capture
            # on a new stream takes it instead of being refused.
            self.spare.append(Buffers(self.device, self.capacity, self.kernel))
        self.last = buffers
        self.owner = key
        return buffers

    def _new_buffers(self, key: Key, site: str) -> Buffers:
        if not self.spare and len(self.buffers) >= RECLAIM_AT:
            self._reclaim()
        capturing = self.capturing()
        if self.spare and (not capturing or self.spare[-1].capacity >= self.capacity):
            buffers = self.spare.pop()
            if buffers.capacity < self.capacity:
                buffers._allocate(self.device, self.capacity, self.kernel, self.retired)
            return buffers
        if capturing:
            # A capture on a stream this thread has not called on (torch.cuda.graph's side
            # stream) and no spare left: sharing another stream's buffers would let the
            # graph's replays race that stream's eager calls on the Triton kernel's per-row
            # words, and allocating would be recorded into the graph.
            raise RuntimeError(
                f"guardrails site {site!r}: a CUDA-graph capture on a stream this thread has "
                f"not called on, on {self.device}, and no spare buffers are left for it; call "
                "site.reserve(rows, device) (or make one eager call) in the capturing thread "
                "before each capture on a new stream"
            )
        return Buffers(self.device, self.capacity, self.kernel)

    def _reclaim(self) -> None:
        # Thread ids of ended threads: ids of live threads that run Python (all that can
        # call a site) are the keys of sys._current_frames().
        alive = sys._current_frames().keys()
        for key in [key for key in self.buffers if thread_of(key) not in alive]:
            buffers = self.buffers.pop(key)
            if all(b is not buffers for b in self.spare):  # shared by a capture: once
                self.spare.append(buffers)
        if self.owner not in self.buffers:
            self.owner = None

    def capturing(self) -> bool:
        """Whether the caller's current stream of this state's device is capturing."""
        return self.streams and capturing_on(self.device)

    def _capture_check(self, site: str, rows: int) -> None:
        if self.capturing():
            # Its allocations and zero-fills would be recorded into the graph.
            raise RuntimeError(
                f"guardrails site {site!r} needs buffers for {rows} rows on {self.device} "
                "inside a CUDA-graph capture; call site.reserve(rows, device) (or make one "
                "call) in the capturing thread before capturing"
            )

    def flags_view(self, buffers: Buffers, rows: int, site: str) -> torch.Tensor:
        if rows > buffers.capacity:
            if self.capturing():
                raise RuntimeError(
                    f"guardrails site {site!r}: {rows} rows exceed the {buffers.capacity} "
                    f"reserved on {self.device} during CUDA-graph capture; call "
                    f"site.reserve({rows}, device) before capturing"
                )
            buffers._allocate(
                self.device, max(rows, 2 * buffers.capacity), self.kernel, self.retired
            )
        if len(buffers.views) >= MAX_CACHED_VIEWS:
            buffers.views.clear()
        view = buffers.flags[:rows]
        buffers.views[rows] = view
        return view

    def reserve(self, rows: int, key: Key) -> None:
        """Every thread's buffers hold `rows` rows from now on; a caller that has none yet
        (`key`'s, or the next to call; on CUDA also a first call on another stream, such as
        a capture's side stream) finds a spare made for it."""
        for buffers in {id(b): b for b in [*self.buffers.values(), *self.spare]}.values():
            if buffers.capacity < rows:
                buffers._allocate(self.device, rows, self.kernel, self.retired)
        self.capacity = max(self.capacity, rows)
        if (self.streams or key not in self.buffers) and not self.spare:
            self.spare.append(Buffers(self.device, self.capacity, self.kernel))


def cuda_stream_id(index: int | None) -> int:
    """The id of the calling thread's current stream on CUDA device `index`."""
    # torch.cuda.current_stream() without building a Stream object (the same getter).
    getter = getattr(torch._C, "_cuda_getCurrentStream", None)
    if getter is None:  # pragma: no cover - every CUDA build has it
        return int(torch.cuda.current_stream(index).stream_id)
    return int(getter(index)[0])


def thread_of(key: Key) -> int:
    return key[0] if isinstance(key, tuple) else key


def normalise(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
