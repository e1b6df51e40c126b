"""Named sampling sites: the objects a guarded call goes through.

A site is built once from settings and bakes them in: an enabled logits site holds one
`HealSpec` per accepted dtype and the kernel for each device; a disabled site is a different
class whose call returns None without looking at its argument. Per device, a site owns
persistent buffers (int64 counts, host mirror; per calling thread, and on CUDA per thread and
stream, row flags and the kernel workspace that goes with them) made when the site first sees
that device, thread or stream or when `reserve()` is called, never inside a CUDA-graph capture.

The flags a call returns belong to the calling thread (on CUDA: to the thread and its current
stream): a view of that buffer, valid until the same thread's next call of that site on the
same device (and stream), like a CUDA graph's static output, whatever other threads and
streams do meanwhile; clone them to keep them longer. Per stream on CUDA because two streams
running the guard at once must not share the Triton kernel's per-row words. A capture on a
stream the thread has not called on yet (`torch.cuda.graph` captures on a side stream) takes a
spare made by `reserve()`, else shares the thread's buffers of the stream it called on last:
nothing is allocated inside a capture.

Refused before anything is touched or any state is made: a dtype the site does not accept
(TypeError), a tensor that is sparse or nested (TypeError), on the meta device or not on the
site's pinned device (ValueError), without a vocab dimension (ValueError), and, when healing,
one whose memory overlaps itself, such as an expanded view (ValueError: writing it in place
could not be consistent). A forked child re-makes every site's lock (`guardrails._process`);
what another thread was writing at the fork was its own buffers.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import torch

from guardrails import _process, ops
from guardrails.exceptions import TensorTypeError, TensorValueError
from guardrails.flags import LOGITS_SLOTS, TOKEN_SLOTS, CountKind, RowFlag
from guardrails.kernels.base import HealSpec, LogitsKernel
from guardrails.kernels.select import select_logits_kernel
from guardrails.kernels.token_ids import guard_token_ids_
from guardrails.kernels.values import posinf_replacement
from guardrails.names import validate_site_name
from guardrails.reporting.mirror import DeviceCounts, capturing_on

if TYPE_CHECKING:
    from guardrails.reporting.reporter import Reporter
    from guardrails.settings import SiteSettings

__all__ = ["DisabledSite", "LogitsSite", "Site", "TokenSite"]

# torch.compile constant-folds this function to True while tracing (the way sites switch to
# guardrails.ops); bound once, as the eager hot path calls it on every call.
_compiling: Final = torch.compiler.is_compiling
_get_ident: Final = threading.get_ident
# Who owns a set of buffers: a thread id, or on CUDA (thread id, stream id).
_Key = int | tuple[int, int]
_STRIDED: Final = torch.strided
_TENSOR: Final = torch.Tensor
_DEFAULT_CAPACITY: Final = 256
_MAX_CACHED_VIEWS: Final = 64
# Threads with buffers on one device before those of threads that have ended are reclaimed.
_RECLAIM_AT: Final = 64
_ASSERTED: Final = int(RowFlag.NAN | RowFlag.POSINF | RowFlag.NO_VALID_TOKEN)
_NO_VALID_TOKEN: Final = int(RowFlag.NO_VALID_TOKEN)
# Not uint16/32/64: torch has no comparison kernels for them ("lt_cpu" not implemented), so
# they get a TypeError naming these instead of an error from inside the guard.
_INTEGER_DTYPES: Final = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class _Buffers:
    """One thread's row flags on one device, and the kernel workspace that describes them
    (the CPU kernel's `extent`: how far these flags may hold non-zero bytes)."""

    __slots__ = ("capacity", "eos_seen", "flags", "recent", "recent_call", "views", "workspace")
    flags: torch.Tensor
    workspace: Any

    def __init__(self, device: torch.device, capacity: int, kernel: LogitsKernel | None) -> None:
        self.capacity = 0
        # The flags this thread's latest call returned, and that call's number (see
        # `_SiteBase.recent`).
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
        self.flags = flags
        self.workspace = ws
        self.views: dict[int, torch.Tensor] = {}
        self.capacity = capacity


class _DeviceState:
    """A site's state on one device: the counts all threads add to, and each thread's buffers.

    Every mutation happens under the site's lock. `owner`/`last` are the thread served last
    and its buffers: with one calling thread (the common case) a call finds its buffers with
    one comparison.
    """

    __slots__ = (
        "buffers",
        "capacity",
        "check",
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
        self.check: Callable[[torch.Tensor, torch.Tensor, Any], bool] | None = getattr(
            kernel, "check", None
        )
        self.counts = DeviceCounts(device, slots)
        self.capacity = capacity  # rows every thread's buffers hold at least
        # Buffers replaced by a growth, kept on CUDA: a graph captured before the growth
        # still writes into them on every replay (their rows were reserved for it).
        self.retired: list[tuple[torch.Tensor, Any]] | None = [] if device.type == "cuda" else None
        self.buffers: dict[_Key, _Buffers] = {}  # by `key()`
        # On CUDA, buffers are per (thread, stream): see the module docstring.
        self.streams = device.type == "cuda"
        # Made ahead (by `reserve`) for the next thread that calls: a thread whose first call
        # is a CUDA-graph capture must not allocate. Also where the buffers of threads that
        # have ended go (`_reclaim`): kept, since a graph such a thread captured still writes
        # them on every replay, and reused by later threads rather than grown without bound
        # (such a graph's flags are then shared with the thread that reuses them).
        self.spare = [_Buffers(device, capacity, kernel)]
        self.owner: _Key | None = None  # none yet: `last` is not used before it is set
        self.last = self.spare[0]

    def key(self) -> _Key:
        """Whose buffers a call from here uses: the thread's, on CUDA the thread's on its
        current stream of this device."""
        ident = _get_ident()
        if self.streams:
            return ident, _cuda_stream_id(self.device.index)
        return ident

    def buffers_for(self, key: _Key, site: str) -> _Buffers:
        """The caller's buffers (made or taken from the spares on its first call)."""
        buffers = self.buffers.get(key)
        if buffers is None:
            buffers = self.buffers[key] = self._new_buffers(key, site)
        if self.streams and not self.spare and not self.capturing():
            # Keep one spare ready on CUDA, made here outside any capture: the next capture
            # on a new stream takes it instead of being refused.
            self.spare.append(_Buffers(self.device, self.capacity, self.kernel))
        self.last = buffers
        self.owner = key
        return buffers

    def _new_buffers(self, key: _Key, site: str) -> _Buffers:
        if not self.spare and len(self.buffers) >= _RECLAIM_AT:
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
        return _Buffers(self.device, self.capacity, self.kernel)

    def _reclaim(self) -> None:
        # Thread ids of ended threads: ids of live threads that run Python (all that can
        # call a site) are the keys of sys._current_frames().
        alive = sys._current_frames().keys()
        for key in [key for key in self.buffers if _thread_of(key) not in alive]:
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

    def flags_view(self, buffers: _Buffers, rows: int, site: str) -> torch.Tensor:
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
        if len(buffers.views) >= _MAX_CACHED_VIEWS:
            buffers.views.clear()
        view = buffers.flags[:rows]
        buffers.views[rows] = view
        return view

    def reserve(self, rows: int, key: _Key) -> None:
        """Every thread's buffers hold `rows` rows from now on; a caller that has none yet
        (`key`'s, or the next to call; on CUDA also a first call on another stream, such as
        a capture's side stream) finds a spare made for it."""
        for buffers in {id(b): b for b in [*self.buffers.values(), *self.spare]}.values():
            if buffers.capacity < rows:
                buffers._allocate(self.device, rows, self.kernel, self.retired)
        self.capacity = max(self.capacity, rows)
        if (self.streams or key not in self.buffers) and not self.spare:
            self.spare.append(_Buffers(self.device, self.capacity, self.kernel))


class _SiteBase:
    """What logits and token-id sites share: name, per-device buffers, call counting."""

    kind: str
    slots: tuple[CountKind, ...]
    enabled = True
    counts_neginf = False  # whether -inf is counted (logits sites that are told to)
    vocab_size: int | None = None  # token-id sites

    def __init__(
        self,
        name: str,
        reporter: Reporter | None,
        *,
        every_calls: int,
        device: torch.device | str | None,
        capacity: int | None,
    ) -> None:
        self.name = validate_site_name(name)
        self._reporter = reporter
        self._every = every_calls
        # Held while a call updates the site: the counts (a read-modify-write on the CPU),
        # the call counter and the per-device state. Re-entrant, because a call may size
        # buffers (reserve) under it. Never held across reporting (host logging, metrics).
        self._lock = _process.rlock(self, "_lock")
        self._states: dict[torch.device, _DeviceState] = {}
        self._state: _DeviceState | None = None  # the last device used: the common case
        self._pinned_device = None if device is None else torch.device(device)
        self._calls = 0
        self.last_dtype: torch.dtype | None = None
        self.last_shape: tuple[int, ...] = ()
        if self._pinned_device is not None:
            self.reserve(capacity or _DEFAULT_CAPACITY, self._pinned_device)

    def _kernel(self, device: torch.device) -> LogitsKernel | None:
        return None

    def reserve(self, rows: int, device: torch.device | str) -> None:
        """Allocate buffers for up to `rows` rows on `device` now (before a graph capture).

        Every thread that has called the site on `device` gets room for `rows` rows, and the
        calling thread, if it has not called yet, a buffer of its own for its first call; on
        CUDA there is also one ready for a first call on another stream (the side stream
        `torch.cuda.graph` captures on)."""
        device = _normalise(torch.device(device))
        if device.type == "meta":
            raise TensorValueError(
                f"guardrails site {self.name!r}: the meta device holds no values to guard "
                "and no counts; use a real device",
                "device",
            )
        with self._lock:
            state = self._states.get(device)
            kernel = self._kernel(device)
            if state is None:
                if capturing_on(device):
                    # Its allocations and zero-fills would be recorded into the graph: the
                    # counts would be re-zeroed on every replay.
                    raise RuntimeError(
                        f"guardrails site {self.name!r} is first used on {device} inside a "
                        f"CUDA-graph capture; call site.reserve(rows, {str(device)!r}) (or "
                        "make one call) before capturing"
                    )
                state = _DeviceState(device, max(rows, 1), len(self.slots), kernel)
                self._states[device] = state
                if self._reporter is not None:
                    self._reporter.track(self, state.counts)
            else:
                state.reserve(rows, state.key())
            self._state = state

    def recent(self, device: torch.device | str | None = None) -> tuple[int, torch.Tensor] | None:
        """`(call number, row flags)` of this site's latest call on the calling thread (on
        `device`, default: on any device; on any of its streams), or None before one.

        The flags are a view of the thread's buffer, valid until the site's next call on
        this thread (and that stream); call numbers grow, so a reader can tell a new call
        from one it has seen. Reading them never synchronises: the values are whatever the
        device has written by the time the reader's own device work runs (stream order)."""
        if device is None:
            # This thread's latest call on any device: the device any thread used last may
            # not be this thread's (two engine workers in one process, one GPU each).
            states = list(self._states.values())
        else:
            found = self._states.get(_normalise(torch.device(device)))
            states = [] if found is None else [found]
        thread = _get_ident()
        latest: _Buffers | None = None
        for state in states:
            if not state.streams:
                mine = [] if (b := state.buffers.get(thread)) is None else [b]
            else:
                # Not only the current stream's: an engine hook may read outside the stream
                # context its sampler ran in.
                with self._lock:
                    mine = [b for k, b in state.buffers.items() if _thread_of(k) == thread]
            for buffers in mine:
                if buffers.recent is not None and (
                    latest is None or buffers.recent_call > latest.recent_call
                ):
                    latest = buffers
        if latest is None or latest.recent is None:
            return None
        return latest.recent_call, latest.recent

    def recent_flags(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """The row flags of this site's latest call on the calling thread, or None."""
        found = self.recent(device)
        return None if found is None else found[1]

    def _state_for(self, tensor: torch.Tensor) -> _DeviceState:
        device = tensor.device
        if self._pinned_device is not None and _normalise(device) != _normalise(
            self._pinned_device
        ):
            raise TensorValueError(
                f"guardrails site {self.name!r} was created for device {self._pinned_device}; "
                f"got a tensor on {device}",
                "device",
            )
        if device.type == "meta":
            # Before any state exists for it: meta counts cannot be read, ever.
            raise TensorValueError(
                f"guardrails site {self.name!r}: a meta tensor holds no values to guard; "
                "the tensor was not modified",
                "device",
            )
        state = self._states.get(_normalise(device))
        if state is None:
            self.reserve(_DEFAULT_CAPACITY, device)
            state = self._states[_normalise(device)]
        self._state = state
        return state

    def _refuse_layout(self, tensor: torch.Tensor, sanitize: bool, what: str) -> None:
        """The slow half of the layout check, for tensors that are not plain contiguous ones:
        sparse and nested tensors are refused, and (when healing) memory that overlaps
        itself; any other strided view, and tensor subclasses, are fine."""
        if tensor.is_nested or tensor.layout is not _STRIDED:
            kind = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
            raise TensorTypeError(
                f"guardrails site {self.name!r}: {what} must be a dense strided tensor, got a "
                f"{kind} tensor; the tensor was not modified",
                "layout",
            )
        if sanitize and not tensor.is_contiguous() and _overlaps(tensor):
            raise TensorValueError(
                f"guardrails site {self.name!r}: the {what}' memory overlaps itself (shape "
                f"{tuple(tensor.shape)}, strides {tensor.stride()}, e.g. an expanded view), "
                "so they cannot be healed in place consistently; pass a tensor that owns its "
                "memory (.contiguous()) or set sanitize = false for this site; the tensor was "
                "not modified",
                "layout",
            )

    def _report(self, tensor: torch.Tensor, state: _DeviceState, *, due: bool) -> None:
        # dtype and shape for log events, also those flushed before the first tick.
        self.last_dtype = tensor.dtype
        self.last_shape = tuple(tensor.shape)
        if not due or self._reporter is None:
            return
        if state.capturing():
            # Inside a CUDA-graph capture a copy would be recorded into the graph and an event
            # query may invalidate the capture: the next tick outside it reports instead.
            return
        state.counts.request()
        self._reporter.tick()

    # -- inspection -------------------------------------------------------------------

    @property
    def calls(self) -> int:
        return self._calls

    def device_counts(self) -> list[DeviceCounts]:
        with self._lock:
            return [state.counts for state in self._states.values()]

    def totals(self) -> dict[CountKind, int]:
        """Exact cumulative counts over all devices (waits for the devices)."""
        totals = dict.fromkeys(self.slots, 0)
        for counts in self.device_counts():
            for kind, value in zip(self.slots, counts.exact(), strict=True):
                totals[kind] += value
        totals[CountKind.CALLS] = self._calls
        return totals

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} calls={self._calls}>"


def _cuda_stream_id(index: int | None) -> int:
    """The id of the calling thread's current stream on CUDA device `index`."""
    # torch.cuda.current_stream() without building a Stream object (the same getter).
    getter = getattr(torch._C, "_cuda_getCurrentStream", None)
    if getter is None:  # pragma: no cover - every CUDA build has it
        return int(torch.cuda.current_stream(index).stream_id)
    return int(getter(index)[0])


def _thread_of(key: _Key) -> int:
    return key[0] if isinstance(key, tuple) else key


def _normalise(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _overlaps(x: torch.Tensor) -> bool:
    """Whether two elements of `x` share memory (writing them in place cannot be done
    consistently)."""
    if x.numel() <= 1:
        return False
    verdict = torch._debug_has_internal_overlap(x)  # 0: no, 1: yes (stride 0), 2: too hard
    if verdict != 2:
        return verdict == 1
    # Strides sorted ascending, each past everything the smaller ones reach: no overlap.
    # That covers every slice, transpose and padded view.
    dims = sorted((st, sz) for sz, st in zip(x.shape, x.stride(), strict=True) if sz > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    # An unusual `as_strided` view: count the distinct offsets its elements use.
    span = sum(st * (sz - 1) for sz, st in zip(x.shape, x.stride(), strict=True)) + 1
    offsets = torch.arange(span, dtype=torch.int64).as_strided(x.shape, x.stride())
    ordered = offsets.flatten().sort().values
    return bool((ordered[1:] == ordered[:-1]).any())


class LogitsSite(_SiteBase):
    """Guards `[..., vocab]` logits in place; `site(logits)` returns uint8 flags [rows]."""

    kind = "logits"
    slots = LOGITS_SLOTS

    def __init__(
        self,
        name: str,
        config: SiteSettings,
        *,
        min_temperature: float,
        reporter: Reporter | None = None,
        every_calls: int = 32,
        device: torch.device | str | None = None,
        capacity: int | None = None,
    ) -> None:
        self.config = config
        self.counts_neginf = config.count_neginf
        self._specs: dict[torch.dtype, HealSpec] = {}
        for dtype_name in config.dtypes:
            dtype = getattr(torch, dtype_name)
            posinf = config.posinf_value
            self._specs[dtype] = HealSpec(
                nan_value=config.nan_value,
                posinf_value=posinf_replacement(dtype, min_temperature)
                if posinf is None
                else posinf,
                sanitize=bool(config.sanitize),
                count_neginf=config.count_neginf,
            )
        self._sanitize = bool(config.sanitize)
        self._kernels: dict[torch.device, LogitsKernel] = {}
        self._op_key = ops.register(self)  # how compiled code reaches this site
        self._assert_msg = (
            f"guardrails: non-finite logits at site {name!r} (NaN, +Inf or a row with no "
            "valid token); GUARDRAILS_ASYNC_ASSERT is on"
            if config.async_assert
            else None
        )
        super().__init__(name, reporter, every_calls=every_calls, device=device, capacity=capacity)

    def _kernel(self, device: torch.device) -> LogitsKernel:
        kernel = self._kernels.get(device)
        if kernel is None:
            kernel = self._kernels[device] = select_logits_kernel(device)
        return kernel

    def spec(self, dtype: torch.dtype) -> HealSpec:
        """The resolved replacement values and switches used for `dtype`."""
        return self._specs[dtype]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        # The hot path: a few attribute reads around one kernel call (B=1 decode pays every
        # one of them).
        try:
            spec = self._specs.get(logits.dtype)
        except AttributeError:
            spec = None
        if spec is None:
            raise self._type_error(logits)
        if _compiling():
            # Traced code keeps the call as one opaque op (see guardrails.ops); the rest of
            # this method would be specialised on the tensors seen while tracing. The dtype
            # check above stays in the traced code (a TypeError as in eager code); the op's
            # fake implementation raises the shape's ValueError while tracing.
            return torch.ops.guardrails.guard_logits_(logits, self._op_key)  # type: ignore[no-any-return]
        # A plain contiguous tensor is dense and strided and cannot overlap itself: the slow
        # check only for others (sparse compressed layouts raise from is_contiguous).
        try:
            plain = type(logits) is _TENSOR and logits.is_contiguous()
        except RuntimeError:
            plain = False
        if not plain:
            self._refuse_layout(logits, self._sanitize, "logits")
        # `_rows` written out: one Python call less on every guarded call.
        try:
            vocab = logits.shape[-1]
        except (IndexError, RuntimeError):
            self._rows(logits)  # raises the 0-d error, or refuses a nested tensor
            raise
        rows = logits.numel() // vocab if vocab else _leading(logits)
        state = self._state
        if state is None or logits.device != state.device:
            state = self._state_for(logits)
        with self._lock:
            key = _get_ident() if not state.streams else state.key()
            buffers = state.last if state.owner == key else state.buffers_for(key, self.name)
            flags = buffers.views.get(rows)
            check = state.check
            # A clean CPU batch is done here: one sum, nothing written.
            if flags is None or check is None or not check(logits, flags, buffers.workspace):
                if logits.requires_grad or logits.is_inference():
                    with _writable(logits):
                        flags = self._guard(logits, rows, spec, state, buffers)
                else:
                    flags = self._guard(logits, rows, spec, state, buffers)
            calls = self._calls = self._calls + 1
            buffers.recent, buffers.recent_call = flags, calls  # what `recent()` reads
        if calls % self._every == 0 or calls == 1:
            # Outside the site lock: a tick may log and write metrics (host code).
            self._report(logits, state, due=calls % self._every == 0)
        return flags

    def rows_of(self, logits: torch.Tensor) -> int:
        """The number of row flags a call on `logits` returns (what compiled code is traced
        with); raises the call's TypeError or ValueError for a tensor it would refuse (but
        for memory overlapping itself, which the call itself refuses)."""
        if self._specs.get(getattr(logits, "dtype", None)) is None:  # type: ignore[arg-type]
            raise self._type_error(logits)
        if logits.layout is not _STRIDED or logits.is_nested:
            self._refuse_layout(logits, False, "logits")
        return self._rows(logits)

    def _rows(self, logits: torch.Tensor) -> int:
        try:
            vocab = logits.shape[-1]
        except IndexError:
            raise self._zero_dim_error() from None
        except RuntimeError:
            # A nested tensor with the strided layout has no sizes.
            if logits.is_nested:
                self._refuse_layout(logits, False, "logits")
            raise
        return logits.numel() // vocab if vocab else _leading(logits)

    def _zero_dim_error(self) -> TensorValueError:
        return TensorValueError(
            f"guardrails site {self.name!r}: logits must have a vocab dimension, got a 0-d tensor"
        )

    def _guard(
        self,
        logits: torch.Tensor,
        rows: int,
        spec: HealSpec,
        state: _DeviceState,
        buffers: _Buffers,
    ) -> torch.Tensor:
        kernel = state.kernel
        assert kernel is not None  # a logits site always has one (for mypy)
        flags = buffers.views.get(rows)
        if flags is None:
            flags = state.flags_view(buffers, rows, self.name)
        if rows:
            # An empty vocabulary too: every kernel flags and counts such rows (no entry to
            # sample from) and writes nothing.
            kernel(logits, flags, state.counts.counts, spec, buffers.workspace)
        if self._assert_msg is not None:
            torch._assert_async(flags.bitwise_and(_ASSERTED).eq(0).all(), self._assert_msg)
        return flags

    def _type_error(self, logits: object) -> TensorTypeError:
        accepted = ", ".join(str(d).removeprefix("torch.") for d in self._specs)
        if not isinstance(logits, torch.Tensor):
            return TensorTypeError(
                f"guardrails site {self.name!r} expects a torch.Tensor of logits, got "
                f"{type(logits).__name__}"
            )
        return TensorTypeError(
            f"guardrails site {self.name!r}: logits dtype {logits.dtype} is not accepted "
            f"(accepted: {accepted}); the tensor was not modified"
        )


class TokenSite(_SiteBase):
    """Guards sampled token ids in place; out-of-vocab ids are flagged, counted, replaced."""

    kind = "token_ids"
    slots = TOKEN_SLOTS
    vocab_size: int

    def __init__(
        self,
        name: str,
        config: SiteSettings,
        *,
        vocab_size: int,
        reporter: Reporter | None = None,
        every_calls: int = 32,
        device: torch.device | str | None = None,
        capacity: int | None = None,
        rows_from: Callable[[], tuple[int, torch.Tensor] | None] | None = None,
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"guardrails token site {name!r}: vocab_size must be an int > 0")
        # on_no_valid_token = "eos": the logits site's `recent()`, whose NO_VALID_TOKEN rows
        # get eos_token_id; the number of the call last used (per thread, in its buffers),
        # so a step whose logits site did not run never reuses an older step's flags.
        self._eos: int | None = None
        if config.on_no_valid_token == "eos":
            if rows_from is None:
                raise ValueError(
                    f"guardrails token site {name!r}: on_no_valid_token = 'eos' needs the "
                    "logits site to read row flags from"
                )
            self._eos = config.eos_token_id
        self._rows_from = rows_from
        for key, value in (("replacement_id", config.replacement_id), ("eos_token_id", self._eos)):
            # guardrails writes these ids itself: outside the vocabulary, the engine's
            # embedding lookup would fail on them (a device-side assert on CUDA).
            if value is not None and value >= vocab_size:
                raise ValueError(
                    f"guardrails token site {name!r}: {key}={value} is outside the "
                    f"vocabulary [0, {vocab_size})"
                )
        self.config = config
        self.vocab_size = vocab_size
        self._op_key = ops.register(self)  # how compiled code reaches this site
        self._sanitize = bool(config.sanitize)
        self._assert_msg = (
            f"guardrails: out-of-vocab token id at site {name!r} (vocab_size={vocab_size}); "
            "GUARDRAILS_ASYNC_ASSERT is on"
            if config.async_assert
            else None
        )
        super().__init__(name, reporter, every_calls=every_calls, device=device, capacity=capacity)

    def __call__(self, token_ids: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
        """Guard `token_ids` against `[0, vocab_size)`; `vocab_size` defaults to the site's
        (an engine whose vocabulary is read at every call passes it; see attach)."""
        if getattr(token_ids, "dtype", None) not in _INTEGER_DTYPES:
            raise self._type_error(token_ids)
        if _compiling():
            # The vocabulary goes into the op (a symbol under dynamic shapes); the op's eager
            # run checks it, as the line below does here.
            vocab_arg = self.vocab_size if vocab_size is None else vocab_size
            return torch.ops.guardrails.guard_token_ids_(token_ids, self._op_key, vocab_arg)  # type: ignore[no-any-return]
        vocab = self.vocab_size if vocab_size is None else self._checked_vocab(vocab_size)
        try:
            plain = type(token_ids) is _TENSOR and token_ids.is_contiguous()
        except RuntimeError:
            plain = False
        if not plain:
            self._refuse_layout(token_ids, self._sanitize, "token ids")
        try:
            rows = self._rows(token_ids)
        except RuntimeError:
            self._rows_checked(token_ids)  # refuses a nested tensor
            raise
        state = self._state
        if state is None or token_ids.device != state.device:
            state = self._state_for(token_ids)
        with self._lock:
            key = _get_ident() if not state.streams else state.key()
            buffers = state.last if state.owner == key else state.buffers_for(key, self.name)
            if token_ids.is_inference():
                with _writable(token_ids):
                    flags = self._guard(token_ids, rows, state, buffers, vocab)
            else:
                flags = self._guard(token_ids, rows, state, buffers, vocab)
            calls = self._calls = self._calls + 1
            buffers.recent, buffers.recent_call = flags, calls  # what `recent()` reads
        if calls % self._every == 0 or calls == 1:
            # Outside the site lock: a tick may log and write metrics (host code).
            self._report(token_ids, state, due=calls % self._every == 0)
        return flags

    def rows_of(self, token_ids: torch.Tensor) -> int:
        """The number of row flags a call on `token_ids` returns (see LogitsSite.rows_of)."""
        if getattr(token_ids, "dtype", None) not in _INTEGER_DTYPES:
            raise self._type_error(token_ids)
        if token_ids.layout is not _STRIDED or token_ids.is_nested:
            self._refuse_layout(token_ids, False, "token ids")
        return self._rows_checked(token_ids)

    def _rows_checked(self, ids: torch.Tensor) -> int:
        try:
            return self._rows(ids)
        except RuntimeError:
            if ids.is_nested:  # a strided nested tensor has no sizes
                self._refuse_layout(ids, False, "token ids")
            raise

    @staticmethod
    def _rows(ids: torch.Tensor) -> int:
        # One per id for 0-d and 1-d ids, one per [..., k] slice otherwise.
        dim = ids.dim()
        return _leading(ids) if dim >= 2 else ids.numel() if dim == 1 else 1

    def _checked_vocab(self, vocab_size: object) -> int:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise TensorValueError(
                f"guardrails token site {self.name!r}: vocab_size must be an int > 0, got "
                f"{vocab_size!r}",
                "reference",
            )
        for key, value in (
            ("replacement_id", self.config.replacement_id),
            ("eos_token_id", self._eos),
        ):
            if value is not None and value >= vocab_size:
                raise TensorValueError(
                    f"guardrails token site {self.name!r}: {key}={value} is outside the "
                    f"vocabulary [0, {vocab_size}) of this call",
                    "reference",
                )
        return vocab_size

    def _guard(
        self,
        ids: torch.Tensor,
        rows: int,
        state: _DeviceState,
        buffers: _Buffers,
        vocab_size: int | None = None,
    ) -> torch.Tensor:
        flags = buffers.views.get(rows)
        if flags is None:
            flags = state.flags_view(buffers, rows, self.name)
        if ids.numel():
            guard_token_ids_(
                ids,
                flags,
                state.counts.counts,
                self.vocab_size if vocab_size is None else vocab_size,
                self.config.replacement_id,
                self._sanitize,
            )
            if self._eos is not None:
                self._end_rows_with_eos(ids, rows, flags, buffers)
        else:
            flags.zero_()
        if self._assert_msg is not None:
            torch._assert_async(flags.eq(0).all(), self._assert_msg)
        return flags

    def _end_rows_with_eos(
        self, ids: torch.Tensor, rows: int, flags: torch.Tensor, buffers: _Buffers
    ) -> None:
        """Rows the logits site flagged NO_VALID_TOKEN in this thread's step get
        `eos_token_id` in their last id (the one sampled in this step), and that flag here
        too; branch-free, no synchronisation. Skipped when the logits site has not run on
        this thread since its last step, or its rows are not these rows."""
        assert self._rows_from is not None  # set with _eos
        assert self._eos is not None
        found = self._rows_from()
        if found is None:
            return
        call, logits_flags = found
        if call <= buffers.eos_seen or logits_flags.numel() != rows:
            return
        if logits_flags.device != ids.device:
            return
        buffers.eos_seen = call
        ended = logits_flags.bitwise_and(_NO_VALID_TOKEN)
        flags.bitwise_or_(ended)
        if ids.dim() >= 2:
            # One flag per [..., k] slice, whose id sampled in this step is the last: the ones
            # before it are history (transformers' input_ids: the prompt and the tokens
            # generated so far), never rewritten.
            last = ids.narrow(-1, ids.shape[-1] - 1, 1)
            last.masked_fill_(ended.bool().reshape(last.shape), self._eos)
        else:
            ids.masked_fill_(ended.bool().reshape(ids.shape), self._eos)

    def _type_error(self, ids: object) -> TensorTypeError:
        if not isinstance(ids, torch.Tensor):
            return TensorTypeError(
                f"guardrails token site {self.name!r} expects a torch.Tensor of token ids, got "
                f"{type(ids).__name__}"
            )
        accepted = ", ".join(str(d).removeprefix("torch.") for d in _INTEGER_DTYPES)
        return TensorTypeError(
            f"guardrails token site {self.name!r}: token ids must be an integer tensor, got "
            f"{ids.dtype} (accepted: {accepted}); the tensor was not modified"
        )


class DisabledSite:
    """A site switched off by configuration: calls return None and touch nothing."""

    __slots__ = ("kind", "name")
    enabled = False
    calls = 0

    def __init__(self, name: str, kind: str) -> None:
        self.name = validate_site_name(name)
        self.kind = kind

    def __call__(self, tensor: torch.Tensor, vocab_size: int | None = None) -> None:
        return None

    def reserve(self, rows: int, device: torch.device | str) -> None:
        return None

    def recent(self, device: torch.device | str | None = None) -> None:
        return None

    def recent_flags(self, device: torch.device | str | None = None) -> None:
        return None

    def totals(self) -> dict[CountKind, int]:
        return {}

    def __repr__(self) -> str:
        return f"<DisabledSite {self.name!r}>"


Site = LogitsSite | TokenSite | DisabledSite


def _leading(tensor: torch.Tensor) -> int:
    rows = 1
    for size in tensor.shape[:-1]:
        rows *= size
    return rows


class _writable:
    """Make an in-place update legal: no autograd record, and inference tensors stay usable."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._contexts: list[Any] = []
        if tensor.is_inference() and not torch.is_inference_mode_enabled():
            self._contexts.append(torch.inference_mode())
        elif tensor.requires_grad:
            self._contexts.append(torch.no_grad())

    def __enter__(self) -> None:
        for context in self._contexts:
            context.__enter__()

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)
