"""CUDA stream capture, as guardrails' own device work must treat it: a floor every layer
may import (it imports nothing of guardrails but process state).

- `outside_captures()`: the calling thread's capture mode is thread-local inside, so an event
  query or a copy from a reporting thread never invalidates another thread's graph capture;
- `side_streams(devices)`: guardrails' own stream per CUDA device, never an engine's;
- `capturing_on(device)`: whether the calling thread's current stream of that device captures.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterable, Iterator

import torch

from guardrails import _process

__all__ = ["capturing_on", "outside_captures", "side_streams"]

_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
_exchange: Callable[[ctypes.c_int], int] | None = None
_exchange_loaded = False
_exchange_lock = _process.module_lock(__name__, "_exchange_lock")


def _capture_mode_exchange() -> Callable[[ctypes.c_int], int] | None:
    """`cuThreadExchangeStreamCaptureMode` from the CUDA driver, or None without one."""
    global _exchange, _exchange_loaded
    if _exchange_loaded:
        return _exchange
    with _exchange_lock:
        if not _exchange_loaded:
            try:
                # The driver torch has loaded already (a CUDA tensor exists when this runs).
                function = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
            except (OSError, AttributeError):
                _exchange = None
            else:
                function.argtypes = [ctypes.POINTER(ctypes.c_int)]
                function.restype = ctypes.c_int

                def exchange(mode: ctypes.c_int) -> int:
                    return int(function(ctypes.byref(mode)))

                _exchange = exchange
            _exchange_loaded = True
    return _exchange


@contextlib.contextmanager
def outside_captures() -> Iterator[None]:
    """Run CUDA calls that must not disturb other threads' graph captures: the calling
    thread's capture mode is thread-local inside, and restored after. A no-op without the
    CUDA driver."""
    exchange = _capture_mode_exchange()
    mode = ctypes.c_int(_THREAD_LOCAL)
    if exchange is None or exchange(mode) != 0:
        yield
        return
    try:
        yield
    finally:
        exchange(mode)  # `mode` now holds the previous one


_side: dict[torch.device, torch.cuda.Stream] = {}
_side_lock = _process.module_lock(__name__, "_side_lock")


@contextlib.contextmanager
def side_streams(devices: Iterable[torch.device]) -> Iterator[None]:
    """Make a side stream of guardrails' own the calling thread's current stream on each CUDA
    device in `devices` (the background poller's copies and event records go there, never
    onto an engine's stream). A no-op for other devices."""
    with contextlib.ExitStack() as stack:
        for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
            with _side_lock:
                stream = _side.get(device)
                if stream is None:
                    with outside_captures():
                        stream = _side[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            stack.enter_context(torch.cuda.stream(stream))
        yield


def capturing_on(device: torch.device) -> bool:
    """Whether the calling thread's current stream *of `device`* is capturing a CUDA graph.

    `torch.cuda.is_current_stream_capturing()` asks about the current device only: a site on
    cuda:1 called while cuda:0 is current would otherwise be judged by cuda:0's stream."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()
