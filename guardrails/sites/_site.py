"""Named sampling sites: the objects a guarded call goes through.

A site is built once from settings and bakes them in: an enabled logits site holds one
`HealSpec` per accepted dtype and the kernel for each device; a disabled site is a different
class whose call returns None without looking at its argument. Per device, a site owns
persistent buffers (int64 counts, host mirror; per calling thread, and on CUDA per thread and
stream, row flags and the kernel workspace that goes with them; `guardrails.sites._buffers`)
made when the site first sees that device, thread or stream or when `reserve()` is called,
never inside a CUDA-graph capture.

The flags a call returns belong to the calling thread (on CUDA: to the thread and its current
stream): a view of that buffer, valid until the same thread's next call of that site on the
same device (and stream), like a CUDA graph's static output, whatever other threads and
streams do meanwhile; clone them to keep them longer. Per stream on CUDA because two streams
running the guard at once must not share the Triton kernel's per-row words. A capture on a
stream the thread has not called on yet (`torch.cuda.graph` captures on a side stream) takes a
spare made by `reserve()`, else it is refused with a RuntimeError naming `reserve()`: nothing
is allocated inside a capture.

Refused before anything is touched or any state is made (`guardrails.sites._inputs` says what
and raises it): a dtype the site does not accept, a sparse or nested tensor, the meta device or
one other than the site's pinned device, logits without a vocab dimension, and, when healing,
memory that overlaps itself. A forked child re-makes every site's lock (`guardrails._process`);
what another thread was writing at the fork was its own buffers.

The two hot paths, `LogitsSite.__call__` and `TokenSite.__call__`, mirror each other step for
step and are written out in full on purpose (each Python call saved counts at batch 1): dtype
check; the compiled branch (one opaque op); the plain-tensor test and the slow layout check;
the row count (the plain count, then `checked_*_rows` for its error); the device state; under
the site lock the caller's buffers, the guard and the call counter; then reporting outside the
lock. A change to one is a change to the other. `LogitsSite.__call__` also opens with a short
path for a clean CPU batch (the CPU kernel's one-sum check, about half the Python steps of the
full path): the same tests in fewer steps, taken only where the full path would have found the
same buffers and the same flags view; anything else goes on to the full path.
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
from guardrails.reporting.mirror import DeviceCounts
from guardrails.sites import ops
from guardrails.sites._buffers import (
    Buffers,
    DeviceState,
    RowsCheck,
    get_ident,
    normalise,
    thread_of,
)
from guardrails.sites._inputs import (
    INTEGER_DTYPES,
    checked_logits_rows,
    checked_token_rows,
    checked_vocab,
    leading_rows,
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
        # The CPU state when its kernel has a host-side clean check: `LogitsSite.__call__`'s
        # short path (a clean CPU batch from a thread that has called with this row count).
        self._cpu: tuple[DeviceState, RowsCheck] | None = None
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
                if device.type == "cpu" and state.check_rows is not None:
                    self._cpu = state, state.check_rows
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
        # The short path: a clean CPU batch, one sum and nothing written, from a thread that
        # has called before with this row count. Everything the full path checks first is
        # checked here too (or a call with it never reaches here: a refused layout has no
        # view), in as few Python steps as possible: right after an engine's forward pass
        # has evicted the caches each step costs about 1 us, not 0.1 (benchmarks/README.md).
        checked = False
        # Compiled code never reads `_cpu` (Dynamo would guard on it and trace again once set).
        if not _compiling() and (cpu := self._cpu) is not None:
            rows = -1
            # Not two dimensions: a ValueError from unpacking; a sparse or nested tensor: a
            # RuntimeError. The full path says what is wrong, if anything.
            try:
                if (
                    type(logits) is _TENSOR
                    and logits.is_cpu
                    and (dtype := logits.dtype) in self._specs
                ):
                    count, vocab = logits.shape
                    row_stride, step = logits.stride()
                    # Rows of adjacent values that do not overlap, contiguous or not (vLLM's
                    # `[:, :vocab]` of a padded LM head): what the full path accepts too.
                    if step == 1 and (row_stride >= vocab or count <= 1):
                        rows = count
            except (ValueError, RuntimeError):
                rows = -1
            home, clean = cpu
            buffers = home.buffers.get(get_ident()) if rows >= 0 else None
            # Unlocked: the workspace before the flags, which `Buffers._allocate` (a reserve
            # from another thread) replaces in the other order, so that the two always agree.
            ws = buffers.workspace if buffers is not None else None
            if buffers is not None and (flags := buffers.views.get(rows)) is not None:
                if clean(logits, rows, vocab, dtype, flags, ws):
                    with self._lock:
                        calls = self._calls = self._calls + 1
                        buffers.recent, buffers.recent_call = flags, calls
                    # The first counted call can be a short one (the call before it raised,
                    # under async_assert): it starts the poller, as on the full path.
                    if calls % self._every == 0 or calls == 1:
                        self._report(logits, home, due=calls % self._every == 0)
                    return flags
                # Not proved clean (not finite, or float16 or a large batch, which the check
                # leaves to the kernel): the full path guards without asking it again.
                checked = True
        # The full path: a few attribute reads around one kernel call (B=1 decode on a GPU
        # pays every one of them).
        try:
            spec = self._specs.get(logits.dtype)
        except AttributeError:
            spec = None
        if spec is None:
            raise logits_type_error(self.name, logits, self._specs)
        if _compiling():
            # Traced code keeps the call as one opaque op (see guardrails.sites.ops); the rest of
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
            refuse_layout(self.name, logits, self._sanitize, "logits")
        # `logits_rows` written out: one Python call less on every guarded call.
        try:
            vocab = logits.shape[-1]
        except (IndexError, RuntimeError):
            checked_logits_rows(self.name, logits)  # the 0-d error, or a nested refusal
            raise
        rows = logits.numel() // vocab if vocab else leading_rows(logits)
        state = self._state
        if state is None or logits.device != state.device:
            state = self._state_for(logits)
        with self._lock:
            key = get_ident() if not state.streams else state.key()
            buffers = state.last if state.owner == key else state.buffers_for(key, self.name)
            flags = buffers.views.get(rows)
            check = state.check
            # A clean CPU batch is done here: one sum, nothing written.
            if (
                checked
                or flags is None
                or check is None
                or not check(logits, flags, buffers.workspace)
            ):
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
        buffers: Buffers,
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
