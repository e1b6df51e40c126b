"""Named sampling sites: the objects a guarded call goes through.

A site is built once from settings and bakes them in: an enabled logits site holds a
`HealSpec` per accepted dtype and a kernel per device; a `DisabledSite`'s call returns None.
Per device a site owns the counts and, per calling thread (on CUDA per thread and stream), row
flags and a kernel workspace (`guardrails.sites._buffers`), made at first use or by
`reserve()`, never inside a CUDA-graph capture. A call returns a view of the caller's flags,
valid until that thread's (and stream's) next call of the site; clone them to keep them.
Refused before anything is touched (`guardrails.sites._inputs`): a dtype the site does not
accept, a sparse or nested tensor, the meta device or one other than the pinned device, logits
without a vocab dimension, and when healing memory that overlaps itself. An enabled site's
call adds its host time to guardrails_host_seconds_total{part="site:<name>"}. Each call's
steps, in order: docs/performance.md, "A site's call path".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import torch

from guardrails import _process
from guardrails._cuda import capturing_on
from guardrails.flags import LOGITS_SLOTS, TOKEN_SLOTS, CountKind, RowFlag
from guardrails.kernels.base import HealSpec, LogitsKernel
from guardrails.kernels.select import select_logits_kernel
from guardrails.kernels.token_ids import guard_token_ids_
from guardrails.kernels.values import posinf_replacement
from guardrails.names import validate_site_name
from guardrails.reporting.host_time import CLOCK, HostTime
from guardrails.reporting.mirror import DeviceCounts
from guardrails.sites import ops
from guardrails.sites._buffers import (
    Buffers,
    DeviceState,
    get_ident,
    normalise,
    thread_of,
)
from guardrails.sites._inputs import (
    INTEGER_DTYPES,
    checked_logits_rows,
    checked_token_rows,
    checked_vocab,
    logits_type_error,
    refuse_device,
    refuse_layout,
    token_rows,
    token_type_error,
    written_id_outside,
)

if TYPE_CHECKING:
    from guardrails.reporting._reporter import Reporter
    from guardrails.settings import SiteSettings

__all__ = ["DisabledSite", "LogitsSite", "Site", "TokenSite"]

# torch.compile constant-folds this function to True while tracing (the way sites switch to
# guardrails.sites.ops); bound once, as the eager hot path calls it on every call.
_compiling: Final = torch.compiler.is_compiling
_STRIDED: Final = torch.strided
_TENSOR: Final = torch.Tensor
_DEFAULT_CAPACITY: Final = 256
_ASSERTED: Final = int(RowFlag.NAN | RowFlag.POSINF | RowFlag.NO_VALID_TOKEN)
_NO_VALID_TOKEN: Final = int(RowFlag.NO_VALID_TOKEN)


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
        self._states: dict[torch.device, DeviceState] = {}
        self._state: DeviceState | None = None  # the last device used: the common case
        # Each call adds its own host time, the reporter's tick included, to
        # guardrails_host_seconds_total{part="site:<name>"} (`Reporter.host_time`; the dict
        # is that object's for its lifetime, so it is looked up once, here).
        host_time = reporter.host_time if reporter is not None else HostTime()
        self._spent = host_time.spent
        self._time_part = f"site:{self.name}"
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
        device = normalise(torch.device(device))
        refuse_device(self.name, device, None, tensor=False)
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
                state = DeviceState(device, max(rows, 1), len(self.slots), kernel)
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
            found = self._states.get(normalise(torch.device(device)))
            states = [] if found is None else [found]
        thread = get_ident()
        latest: Buffers | None = None
        for state in states:
            if not state.streams:
                mine = [] if (b := state.buffers.get(thread)) is None else [b]
            else:
                # Not only the current stream's: an engine hook may read outside the stream
                # context its sampler ran in.
                with self._lock:
                    mine = [b for k, b in state.buffers.items() if thread_of(k) == thread]
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

    def _state_for(self, tensor: torch.Tensor) -> DeviceState:
        device = tensor.device
        # Before any state exists for it: meta counts cannot be read, ever.
        refuse_device(self.name, device, self._pinned_device, tensor=True)
        state = self._states.get(normalise(device))
        if state is None:
            self.reserve(_DEFAULT_CAPACITY, device)
            state = self._states[normalise(device)]
        self._state = state
        return state

    def _report(self, tensor: torch.Tensor, state: DeviceState, *, due: bool) -> None:
        # dtype and shape for log events, also those flushed before the first tick.
        self.last_dtype = tensor.dtype
        self.last_shape = tuple(tensor.shape)
        if self._reporter is None:
            return
        if state.capturing():
            # Inside a CUDA-graph capture a copy would be recorded into the graph and an event
            # query may invalidate the capture: the next tick outside it reports instead.
            return
        self._reporter.sampling()  # a no-op once the metrics are open
        if not due:
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


class LogitsSite(_SiteBase):
    """Guards `[..., vocab]` logits in place; `site(logits)` returns uint8 flags [rows].

    site = guards.site("sampler.logits")   # made by `Guardrails`, never directly
    flags = site(logits)                   # NaN -> -inf, +Inf -> a large finite value
    poisoned = flags & RowFlag.NO_VALID_TOKEN  # rows that cannot be sampled at all
    """

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
        try:
            spec = self._specs.get(dtype := logits.dtype)
        except AttributeError:
            spec = None
        if spec is None:
            raise logits_type_error(self.name, logits, self._specs)
        if _compiling():
            # Traced code keeps the call as one opaque op (see guardrails.sites.ops), whose
            # eager run is this method; the rest of it would be specialised on the tensors
            # seen while tracing. The dtype check above stays in the traced code (a TypeError
            # as in eager code); the op's fake implementation raises the shape's ValueError.
            return torch.ops.guardrails.guard_logits_(logits, self._op_key)  # type: ignore[no-any-return]
        t0 = CLOCK()
        # Rows of adjacent values that do not overlap (a 2-d batch, contiguous or vLLM's
        # `[:, :vocab]` of a padded LM head) need no other look at the layout. Not two
        # dimensions: a ValueError from unpacking; sparse or nested: a RuntimeError.
        try:
            rows, vocab = logits.shape
            row_stride, step = logits.stride()
        except (ValueError, RuntimeError):
            step = 0
        if step != 1 or type(logits) is not _TENSOR or (row_stride < vocab and rows > 1):
            rows, vocab = self._rows(logits)
        state = self._state
        if state is None or logits.device != state.device:
            state = self._state_for(logits)
        with self._lock:
            key = get_ident() if not state.streams else state.key()
            buffers = state.last if state.owner == key else state.buffers_for(key, self.name)
            flags = buffers.views.get(rows)
            if flags is None:
                flags = state.flags_view(buffers, rows, self.name)
            ws = buffers.workspace
            check = state.check_rows
            # A clean small CPU batch is done here: one sum, nothing written. Otherwise
            # the kernel, which reuses what the check learnt.
            if check is None or vocab < 0 or not check(logits, rows, vocab, dtype, flags, ws):
                if logits.requires_grad or logits.is_inference():
                    with _writable(logits):
                        self._guard(logits, rows, spec, state, flags, ws)
                else:
                    self._guard(logits, rows, spec, state, flags, ws)
            calls = self._calls = self._calls + 1
            buffers.recent, buffers.recent_call = flags, calls  # what `recent()` reads
        if calls % self._every == 0 or calls == 1:
            # Outside the site lock: a tick may log and write metrics (host code). The
            # first counted call starts the poller, also after calls that raised.
            self._report(logits, state, due=calls % self._every == 0)
        # HostTime.add written out: one dict update, no frame.
        spent = self._spent
        spent[self._time_part] = spent.get(self._time_part, 0.0) + (CLOCK() - t0)
        return flags

    def _rows(self, logits: torch.Tensor) -> tuple[int, int]:
        """`(rows, vocab)` of logits that are not a plain 2-d batch, after the slow layout
        check; `vocab` is -1 unless they have two dimensions (the kernel then runs its own
        clean check). Raises the call's error for what it refuses."""
        # A plain contiguous tensor is dense and strided and cannot overlap itself: the slow
        # check only for others (sparse compressed layouts raise from is_contiguous).
        try:
            plain = type(logits) is _TENSOR and logits.is_contiguous()
        except RuntimeError:
            plain = False
        if not plain:
            refuse_layout(self.name, logits, self._sanitize, "logits")
        rows = checked_logits_rows(self.name, logits)  # the 0-d error, or a nested refusal
        return rows, logits.shape[-1] if logits.dim() == 2 else -1

    def rows_of(self, logits: torch.Tensor) -> int:
        """The number of row flags a call on `logits` returns (what compiled code is traced
        with); raises the call's TypeError or ValueError for a tensor it would refuse (but
        for memory overlapping itself, which the call itself refuses)."""
        if self._specs.get(getattr(logits, "dtype", None)) is None:  # type: ignore[arg-type]
            raise logits_type_error(self.name, logits, self._specs)
        if logits.layout is not _STRIDED or logits.is_nested:
            refuse_layout(self.name, logits, False, "logits")
        return checked_logits_rows(self.name, logits)

    def _guard(
        self,
        logits: torch.Tensor,
        rows: int,
        spec: HealSpec,
        state: DeviceState,
        flags: torch.Tensor,
        ws: Any,
    ) -> None:
        kernel = state.kernel
        assert kernel is not None  # a logits site always has one (for mypy)
        if rows:
            # An empty vocabulary too: every kernel flags and counts such rows (no entry to
            # sample from) and writes nothing.
            kernel(logits, flags, state.counts.counts, spec, ws)
        if self._assert_msg is not None:
            torch._assert_async(flags.bitwise_and(_ASSERTED).eq(0).all(), self._assert_msg)


class TokenSite(_SiteBase):
    """Guards sampled token ids in place; out-of-vocab ids are flagged, counted, replaced.

    site = guards.token_site("sampler.token_ids", vocab_size=V)
    flags = site(next_ids)        # ids outside [0, V) -> replacement_id (default 0)
    flags = site(next_ids, V2)    # a call's own vocabulary, when it differs
    """

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
        # The ids guardrails writes itself, checked against every vocabulary it guards with.
        self._written = (("replacement_id", config.replacement_id), ("eos_token_id", self._eos))
        outside = written_id_outside(vocab_size, self._written)
        if outside is not None:
            raise ValueError(
                f"guardrails token site {name!r}: {outside[0]}={outside[1]} is outside the "
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
        if getattr(token_ids, "dtype", None) not in INTEGER_DTYPES:
            raise token_type_error(self.name, token_ids)
        if _compiling():
            # The vocabulary goes into the op (a symbol under dynamic shapes); the op's eager
            # run checks it, as the line below does here.
            vocab_arg = self.vocab_size if vocab_size is None else vocab_size
            return torch.ops.guardrails.guard_token_ids_(token_ids, self._op_key, vocab_arg)  # type: ignore[no-any-return]
        t0 = CLOCK()
        vocab = (
            self.vocab_size
            if vocab_size is None
            else checked_vocab(self.name, vocab_size, self._written)
        )
        try:
            plain = type(token_ids) is _TENSOR and token_ids.is_contiguous()
        except RuntimeError:
            plain = False
        if not plain:
            refuse_layout(self.name, token_ids, self._sanitize, "token ids")
        try:
            rows = token_rows(token_ids)
        except RuntimeError:
            checked_token_rows(self.name, token_ids)  # refuses a nested tensor
            raise
        state = self._state
        if state is None or token_ids.device != state.device:
            state = self._state_for(token_ids)
        with self._lock:
            key = get_ident() if not state.streams else state.key()
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
        # HostTime.add written out: one dict update, no frame.
        spent = self._spent
        spent[self._time_part] = spent.get(self._time_part, 0.0) + (CLOCK() - t0)
        return flags

    def rows_of(self, token_ids: torch.Tensor) -> int:
        """The number of row flags a call on `token_ids` returns (see LogitsSite.rows_of)."""
        if getattr(token_ids, "dtype", None) not in INTEGER_DTYPES:
            raise token_type_error(self.name, token_ids)
        if token_ids.layout is not _STRIDED or token_ids.is_nested:
            refuse_layout(self.name, token_ids, False, "token ids")
        return checked_token_rows(self.name, token_ids)

    def _guard(
        self,
        ids: torch.Tensor,
        rows: int,
        state: DeviceState,
        buffers: Buffers,
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
        self, ids: torch.Tensor, rows: int, flags: torch.Tensor, buffers: Buffers
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
