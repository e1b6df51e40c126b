"""Named sampling sites: the objects a guarded call goes through.

A site is built once from settings and bakes them in: an enabled logits site holds one
`HealSpec` per accepted dtype and the kernel for each device; a disabled site is a different
class whose call returns None without looking at its argument. Per device, a site owns
persistent buffers (row flags, int64 counts, kernel workspace, host mirror) made when the site
first sees that device or when `reserve()` is called, never inside a CUDA-graph capture.

The flags a call returns are a view of the site's buffer, valid until that site's next call on
the same device (like a CUDA graph's static output): clone them to keep them longer.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final

import torch

from guardrails import ops
from guardrails.flags import LOGITS_SLOTS, TOKEN_SLOTS, CountKind, RowFlag
from guardrails.kernels.base import HealSpec, LogitsKernel
from guardrails.kernels.select import select_logits_kernel
from guardrails.kernels.token_ids import guard_token_ids_
from guardrails.kernels.values import posinf_replacement
from guardrails.names import validate_site_name
from guardrails.reporting.mirror import DeviceCounts

if TYPE_CHECKING:
    from guardrails.reporting.reporter import Reporter
    from guardrails.settings import SiteSettings

__all__ = ["DisabledSite", "LogitsSite", "Site", "TokenSite"]

# torch.compile constant-folds this function to True while tracing (the way sites switch to
# guardrails.ops); bound once, as the eager hot path calls it on every call.
_compiling: Final = torch.compiler.is_compiling
_DEFAULT_CAPACITY: Final = 256
_MAX_CACHED_VIEWS: Final = 64
_ASSERTED: Final = int(RowFlag.NAN | RowFlag.POSINF | RowFlag.NO_VALID_TOKEN)
# Not uint16/32/64: torch has no comparison kernels for them ("lt_cpu" not implemented), so
# they get a TypeError naming these instead of an error from inside the guard.
_INTEGER_DTYPES: Final = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class _DeviceState:
    __slots__ = ("capacity", "counts", "device", "flags", "kernel", "retired", "views", "workspace")
    flags: torch.Tensor
    workspace: Any

    def __init__(
        self, device: torch.device, capacity: int, slots: int, kernel: LogitsKernel | None
    ) -> None:
        self.device = device
        self.kernel = kernel  # None at token-id sites
        self.counts = DeviceCounts(device, slots)
        # Buffers replaced by a growth, kept on CUDA: a graph captured before the growth
        # still writes into them on every replay (their rows were reserved for it).
        self.retired: list[tuple[torch.Tensor, Any]] = []
        self.capacity = 0
        self._allocate(capacity, kernel)

    def _allocate(self, capacity: int, kernel: LogitsKernel | None) -> None:
        # Ordinary tensors even when first sized inside inference mode, so that calls made
        # outside it can still update them.
        with torch.inference_mode(False):
            flags = torch.zeros(capacity, dtype=torch.uint8, device=self.device)
            ws = kernel.workspace(capacity, self.device) if kernel is not None else None
        # Only now that both exist: an allocation that fails leaves the state as it was.
        if self.capacity and self.device.type == "cuda":
            self.retired.append((self.flags, self.workspace))
        self.flags = flags
        self.workspace = ws
        self.views: dict[int, torch.Tensor] = {}
        self.capacity = capacity

    def flags_view(self, rows: int, kernel: LogitsKernel | None, site: str) -> torch.Tensor:
        if rows > self.capacity:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"guardrails site {site!r}: {rows} rows exceed the {self.capacity} reserved "
                    f"on {self.device} during CUDA-graph capture; call "
                    f"site.reserve({rows}, device) before capturing"
                )
            self._allocate(max(rows, 2 * self.capacity), kernel)
        if len(self.views) >= _MAX_CACHED_VIEWS:
            self.views.clear()
        view = self.flags[:rows]
        self.views[rows] = view
        return view


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
        # Held for a whole call: the flags buffer and (on the CPU) the read-modify-write of
        # the counts belong to one caller at a time. Re-entrant, because a call may size
        # buffers (reserve) and count itself under it.
        self._lock = threading.RLock()
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
        """Allocate buffers for up to `rows` rows on `device` now (before a graph capture)."""
        device = _normalise(torch.device(device))
        with self._lock:
            state = self._states.get(device)
            kernel = self._kernel(device)
            if state is None:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
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
            elif rows > state.capacity:
                state._allocate(rows, kernel)
            self._state = state

    def _state_for(self, tensor: torch.Tensor) -> _DeviceState:
        device = tensor.device
        if self._pinned_device is not None and _normalise(device) != _normalise(
            self._pinned_device
        ):
            raise ValueError(
                f"guardrails site {self.name!r} was created for device {self._pinned_device}; "
                f"got a tensor on {device}"
            )
        state = self._states.get(_normalise(device))
        if state is None:
            self.reserve(_DEFAULT_CAPACITY, device)
            state = self._states[_normalise(device)]
        self._state = state
        return state

    def _count_call(self, tensor: torch.Tensor, state: _DeviceState) -> None:
        # Called with the site lock held, at the end of every call.
        calls = self._calls = self._calls + 1
        due = calls % self._every == 0
        if due or calls == 1:
            self._report(tensor, state, due=due)

    def _report(self, tensor: torch.Tensor, state: _DeviceState, *, due: bool) -> None:
        # dtype and shape for log events, also those flushed before the first tick.
        self.last_dtype = tensor.dtype
        self.last_shape = tuple(tensor.shape)
        if not due or self._reporter is None:
            return
        if state.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
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


def _normalise(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
        state = self._state
        if state is None or logits.device != state.device:
            state = self._state_for(logits)
        with self._lock:
            if logits.requires_grad or logits.is_inference():
                with _writable(logits):
                    flags = self._guard(logits, spec, state)
            else:
                flags = self._guard(logits, spec, state)
            self._count_call(logits, state)
            return flags

    def rows_of(self, logits: torch.Tensor) -> int:
        """The number of row flags a call on `logits` returns (what compiled code is traced
        with); raises the call's TypeError or ValueError for a tensor it would refuse."""
        if self._specs.get(getattr(logits, "dtype", None)) is None:  # type: ignore[arg-type]
            raise self._type_error(logits)
        return self._rows(logits)

    def _rows(self, logits: torch.Tensor) -> int:
        try:
            vocab = logits.shape[-1]
        except IndexError:
            raise self._zero_dim_error() from None
        return logits.numel() // vocab if vocab else _leading(logits)

    def _zero_dim_error(self) -> ValueError:
        return ValueError(
            f"guardrails site {self.name!r}: logits must have a vocab dimension, got a 0-d tensor"
        )

    def _guard(self, logits: torch.Tensor, spec: HealSpec, state: _DeviceState) -> torch.Tensor:
        # `_rows` written out: one Python call less on every guarded call.
        try:
            vocab = logits.shape[-1]
        except IndexError:
            raise self._zero_dim_error() from None
        rows = logits.numel() // vocab if vocab else _leading(logits)
        kernel = state.kernel
        assert kernel is not None  # a logits site always has one (for mypy)
        flags = state.views.get(rows)
        if flags is None:
            flags = state.flags_view(rows, kernel, self.name)
        if rows:
            # An empty vocabulary too: every kernel flags and counts such rows (no entry to
            # sample from) and writes nothing.
            kernel(logits, flags, state.counts.counts, spec, state.workspace)
        if self._assert_msg is not None:
            torch._assert_async(flags.bitwise_and(_ASSERTED).eq(0).all(), self._assert_msg)
        return flags

    def _type_error(self, logits: object) -> TypeError:
        accepted = ", ".join(str(d).removeprefix("torch.") for d in self._specs)
        if not isinstance(logits, torch.Tensor):
            return TypeError(
                f"guardrails site {self.name!r} expects a torch.Tensor of logits, got "
                f"{type(logits).__name__}"
            )
        return TypeError(
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
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"guardrails token site {name!r}: vocab_size must be an int > 0")
        if config.replacement_id >= vocab_size:
            raise ValueError(
                f"guardrails token site {name!r}: replacement_id={config.replacement_id} is "
                f"outside the vocabulary [0, {vocab_size})"
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

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if getattr(token_ids, "dtype", None) not in _INTEGER_DTYPES:
            raise self._type_error(token_ids)
        if _compiling():
            return torch.ops.guardrails.guard_token_ids_(token_ids, self._op_key)  # type: ignore[no-any-return]
        state = self._state
        if state is None or token_ids.device != state.device:
            state = self._state_for(token_ids)
        with self._lock:
            if token_ids.is_inference():
                with _writable(token_ids):
                    return self._guard(token_ids, state)
            return self._guard(token_ids, state)

    def rows_of(self, token_ids: torch.Tensor) -> int:
        """The number of row flags a call on `token_ids` returns (see LogitsSite.rows_of)."""
        if getattr(token_ids, "dtype", None) not in _INTEGER_DTYPES:
            raise self._type_error(token_ids)
        return self._rows(token_ids)

    @staticmethod
    def _rows(ids: torch.Tensor) -> int:
        # One per id for 0-d and 1-d ids, one per [..., k] slice otherwise.
        dim = ids.dim()
        return _leading(ids) if dim >= 2 else ids.numel() if dim == 1 else 1

    def _guard(self, ids: torch.Tensor, state: _DeviceState) -> torch.Tensor:
        rows = self._rows(ids)
        flags = state.views.get(rows)
        if flags is None:
            flags = state.flags_view(rows, None, self.name)
        if ids.numel():
            guard_token_ids_(
                ids,
                flags,
                state.counts.counts,
                self.vocab_size,
                self.config.replacement_id,
                self._sanitize,
            )
        else:
            flags.zero_()
        if self._assert_msg is not None:
            torch._assert_async(flags.eq(0).all(), self._assert_msg)
        self._count_call(ids, state)
        return flags

    def _type_error(self, ids: object) -> TypeError:
        if not isinstance(ids, torch.Tensor):
            return TypeError(
                f"guardrails token site {self.name!r} expects a torch.Tensor of token ids, got "
                f"{type(ids).__name__}"
            )
        accepted = ", ".join(str(d).removeprefix("torch.") for d in _INTEGER_DTYPES)
        return TypeError(
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

    def __call__(self, tensor: torch.Tensor) -> None:
        return None

    def reserve(self, rows: int, device: torch.device | str) -> None:
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
