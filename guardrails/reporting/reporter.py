"""Reporting: device counts -> host mirror -> Prometheus counters and throttled log events.

Every `reporting.every_calls` calls, a site starts a non-blocking copy of its cumulative
device counts into a host mirror and ticks the reporter. The reporter reads only copies that
have completed (`DeviceCounts.latest()`), so nothing here waits for a device; `flush()` (on
`close()` and at interpreter exit) is the one place that does, to report exact totals.

- Metrics: the difference between the counts read now and those already reported becomes a
  counter increment; counts are never throttled, so the counters end exact.
- Logs: one structlog event per site when new bad values arrive: the first at once, then at
  most one per `reporting.log_interval_s`, carrying how many events it folds in
  (`suppressed`). Fields are counts, names, dtype and shape: never tensor values.
- Faults: an exception while reading counts, creating or writing a metric or logging never
  reaches the guarded call (nor site creation); it is counted in
  `guardrails_reporting_errors_total{stage}` and logged once. A series that cannot be created
  (an unwritable multiprocess directory) is retried at each increment, so it catches up.

Why `every_calls` defaults to 32: a tick costs about 2-2.5 us of host time on the CPU
(measured) and, on CUDA, a 40-byte pinned copy, an event record and an event query, about
10-20 us of launch overhead (estimated). Every 32 calls that is under 0.1 us per call on the
CPU (a few per cent of a ~3 us site call) and under 1 us on CUDA, while the counters lag the
device by at most 32 calls of the site (one copy more on CUDA): a fraction of a second at
decode rates. The counts of an idle site's last calls are reported by `poll()` or `close()`.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

import structlog

from guardrails.exceptions import ConfigError, Problem
from guardrails.flags import CountKind
from guardrails.logs import configure_json_logs
from guardrails.names import (
    LOGGER_NAME,
    NO_VALID_TOKEN_EVENT,
    NONFINITE_EVENT,
    OOB_EVENT,
    REPORTING_ERROR_EVENT,
)
from guardrails.reporting import exposition, metrics

if TYPE_CHECKING:
    import torch

    from guardrails.reporting.metrics import GuardMetrics
    from guardrails.reporting.mirror import DeviceCounts
    from guardrails.settings import GuardSettings

__all__ = ["ReportedSite", "Reporter"]


class ReportedSite(Protocol):
    """What the reporter reads of a site: its identity, its count layout and call count,
    and what the last call looked like (for log events)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def slots(self) -> tuple[CountKind, ...]: ...
    @property
    def calls(self) -> int: ...
    @property
    def counts_neginf(self) -> bool: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def last_dtype(self) -> torch.dtype | None: ...
    @property
    def last_shape(self) -> tuple[int, ...]: ...


# The counts whose increase is news worth a log event (row counts follow from them).
_NEWS: Final = frozenset(
    {
        CountKind.NAN,
        CountKind.POSINF,
        CountKind.NEGINF,
        CountKind.ROWS_NO_VALID_TOKEN,
        CountKind.OOB_TOKEN,
    }
)


class _SiteReport:
    """What has been reported for one site: per-device baselines, totals, throttle state."""

    __slots__ = (
        "calls_child",
        "children",
        "devices",
        "host_only",
        "logged",
        "logged_calls",
        "news",
        "next_log_at",
        "reported_calls",
        "seen_calls",
        "site",
        "suppressed",
        "totals",
        "unlogged",
    )

    def __init__(self, site: ReportedSite) -> None:
        n = len(site.slots)
        self.site = site
        self.children: list[Any] = [None] * n
        self.calls_child: Any = None
        self.devices: list[tuple[DeviceCounts, list[int]]] = []
        self.totals = [0] * n
        self.logged = [0] * n
        self.news = tuple(i for i, kind in enumerate(site.slots) if kind in _NEWS)
        self.reported_calls = 0
        self.logged_calls = 0
        self.seen_calls = -1
        self.suppressed = 0
        self.next_log_at = -math.inf
        self.host_only = True
        self.unlogged = False


class Reporter:
    """Turns the sites' device counts into metrics and log events, without a host sync.

    `registry` is the prometheus-client registry (default: the global one); `clock` drives
    the log throttle; `logger` replaces `structlog.get_logger("guardrails")`.
    """

    def __init__(
        self,
        settings: GuardSettings,
        *,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self._settings = settings
        self._interval = settings.reporting.log_interval_s
        self._clock = clock
        self._logger = structlog.get_logger(LOGGER_NAME) if logger is None else logger
        self._lock = threading.Lock()
        self._sites: dict[int, _SiteReport] = {}
        # Imports prometheus_client, first here: never at `import guardrails`, because it fixes
        # its multiprocess mode when first imported.
        self._metrics: GuardMetrics = metrics.guard_metrics(registry)
        self._rank: str | None = None
        self._errors: dict[str, Any] = {}
        self._logged_faults: set[str] = set()
        self._closed = False
        if settings.reporting.log_format == "json":
            configure_json_logs()
        port = settings.metrics.port
        if port:
            self._serve(registry, settings.metrics.addr, port)
        _live_reporters().add(self)

    def _serve(self, registry: Any, addr: str, port: int) -> None:
        try:
            exposition.serve(addr, port, registry, owner=self)
        except OSError as exc:
            # In multiprocess mode every worker inherits the same port, and one server shows
            # every process's files: a worker whose sibling already serves that port is
            # served by it. Anything else holding the port is still an error.
            if exposition.sibling_serves(port):
                self._logger.info(
                    "guardrails.metrics_served_elsewhere",
                    addr=addr,
                    port=port,
                    reason="multiprocess mode: another process serves the aggregate",
                )
                return
            # At start-up, as a ConfigError naming the variable (or file key) that chose the
            # port: the fix is a configuration change, and hosts already handle this error.
            reason = exc.strerror or str(exc)
            raise ConfigError(
                [
                    Problem(
                        self._settings.origin("metrics", "port"),
                        f"cannot serve metrics on {addr}:{port}: {reason}",
                        port,
                        accepted="a free port, or 0 to leave /metrics to the host",
                    )
                ]
            ) from exc

    # -- called by the sites --------------------------------------------------------------

    def register(self, site: ReportedSite) -> None:
        """A site was created: its series exist at 0 from now on."""
        with self._lock:
            report = self._report_for(site)
            rank = self._resolve_rank()
            family = self._metrics
            for i, kind in enumerate(site.slots):
                report.children[i] = self._child_for(kind, site, rank, family)
            report.calls_child = self._series(family.guard_calls, site=site.name, rank=rank)

    def track(self, site: ReportedSite, counts: DeviceCounts) -> None:
        """A site got buffers on a new device."""
        with self._lock:
            report = self._report_for(site)
            report.devices.append((counts, [0] * len(site.slots)))
            report.host_only = report.host_only and counts.device.type == "cpu"

    def tick(self) -> None:
        """Called from the hot path every `reporting.every_calls` calls of some site.

        Never waits: if another thread is reporting, that thread picks these counts up.
        """
        self._report_locked(exact=False, wait=False)

    # -- public ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Report what the host mirrors hold now; never waits for a device."""
        self._report_locked(exact=False)

    def flush(self) -> None:
        """Report exact totals (waits for the devices), and log what the throttle held back."""
        self._report_locked(exact=True)

    def close(self) -> None:
        """Flush, stop reporting and release the metrics server. Idempotent."""
        self.flush()
        self._closed = True
        _live_reporters().discard(self)
        if self._settings.metrics.port:
            exposition.release_server(self)

    # -- internals (hold self._lock) ------------------------------------------------------

    def _report_locked(self, *, exact: bool, wait: bool = True) -> None:
        if self._closed or not self._lock.acquire(blocking=wait):
            return
        try:
            self._report(exact=exact)
        except Exception as exc:
            self._fault("poll", exc)
        finally:
            self._lock.release()

    def _report_for(self, site: ReportedSite) -> _SiteReport:
        report = self._sites.get(id(site))
        if report is None:
            report = self._sites[id(site)] = _SiteReport(site)
        return report

    def _resolve_rank(self) -> str:
        # Read when the first site is made, not at construction: engines usually build their
        # sites after torch.distributed is initialised, but may build guardrails before.
        if self._rank is None:
            self._rank = metrics.resolve_rank()
            for stage in metrics.ERROR_STAGES:
                self._errors[stage] = self._series(
                    self._metrics.reporting_errors, stage=stage, rank=self._rank
                )
        return self._rank

    def _child_for(
        self, kind: CountKind, site: ReportedSite, rank: str, family: GuardMetrics
    ) -> Any:
        series = metrics.SLOT_SERIES.get(kind)
        if series is None:
            return None
        attr, label = series
        if kind is CountKind.NEGINF and not site.counts_neginf:
            return _Lazy(family.nonfinite_values, site=site.name, kind=label, rank=rank)
        if attr == "nonfinite_values":
            return self._series(family.nonfinite_values, site=site.name, kind=label, rank=rank)
        return self._series(family.flagged_rows, site=site.name, reason=label, rank=rank)

    def _series(self, family: Any, **labels: str) -> _Lazy:
        # Made now, so that it exists at 0 from the start. prometheus-client creates a
        # multiprocess file here; if that fails, site creation (maybe inside the first
        # sampling call) must not: the series is made at its first increment instead.
        series = _Lazy(family, **labels)
        try:
            series.create()
        except Exception as exc:
            self._fault("metrics", exc)
        return series

    def _report(self, *, exact: bool) -> None:
        for report in self._sites.values():
            self._report_site(report, exact=exact)

    def _report_site(self, report: _SiteReport, *, exact: bool) -> None:
        calls = report.site.calls
        # On the CPU the counts only change with calls, and reading them is most of the cost
        # of a poll: a site not called since the last look, with nothing left to log, is done.
        if not exact and calls == report.seen_calls and report.host_only and not report.unlogged:
            return
        fresh = False
        for counts, base in report.devices:
            if not exact and calls == report.seen_calls and counts.device.type == "cpu":
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
                self._fault("poll", exc)
                continue
            for i, value in enumerate(values):
                delta = value - base[i]
                # A copy older than what was reported (an exact read overtook it) is <= 0.
                if delta > 0 and self._increment(report.children[i], delta):
                    base[i] = value
                    report.totals[i] += delta
                    if i in report.news:
                        fresh = True
        report.seen_calls = calls
        delta_calls = calls - report.reported_calls
        if delta_calls > 0 and self._increment(report.calls_child, delta_calls):
            report.reported_calls = calls
        if fresh or report.unlogged:
            report.unlogged = True
            self._maybe_log(report, fresh=fresh, final=exact)

    def _increment(self, child: Any, delta: int) -> bool:
        if child is None:
            return True  # a count that only appears in log events
        try:
            child.inc(delta)
        except Exception as exc:
            # Not marked reported: retried on the next poll, so the counter still ends exact
            # once the fault clears.
            self._fault("metrics", exc)
            return False
        return True

    def _maybe_log(self, report: _SiteReport, *, fresh: bool, final: bool) -> None:
        # The throttle is checked before anything is built for the event.
        now = self._clock()
        if not final and now < report.next_log_at:
            if fresh:
                report.suppressed += 1
            return
        try:
            self._emit(report)
        except Exception as exc:
            self._fault("logs", exc)
        # Advanced even when logging failed: a broken logger must not be retried per call.
        report.next_log_at = now + self._interval
        report.logged = list(report.totals)
        report.logged_calls = report.reported_calls
        report.suppressed = 0
        report.unlogged = False

    def _emit(self, report: _SiteReport) -> None:
        site = report.site
        fields: dict[str, Any] = {"site": site.name, "rank": self._rank}
        deltas: dict[CountKind, int] = {}
        for i, kind in enumerate(site.slots):
            deltas[kind] = report.totals[i] - report.logged[i]
            fields[str(kind)] = deltas[kind]
            fields[f"{kind}_total"] = report.totals[i]
        if site.kind == "token_ids":
            event, rows, level = OOB_EVENT, deltas[CountKind.ROWS_OOB_TOKEN], "error"
            fields["vocab_size"] = site.vocab_size
        elif deltas.get(CountKind.ROWS_NO_VALID_TOKEN, 0) > 0:
            event, rows, level = (
                NO_VALID_TOKEN_EVENT,
                deltas[CountKind.ROWS_NO_VALID_TOKEN],
                "error",
            )
        else:
            event, rows, level = NONFINITE_EVENT, deltas[CountKind.ROWS_NONFINITE], "warning"
        dtype = site.last_dtype
        fields.update(
            rows=rows,
            calls=report.reported_calls - report.logged_calls,
            calls_total=report.reported_calls,
            dtype=None if dtype is None else str(dtype).removeprefix("torch."),
            shape=list(site.last_shape),
            suppressed=report.suppressed,
        )
        getattr(self._logger, level)(event, **fields)

    def _fault(self, stage: str, exc: Exception) -> None:
        child = self._errors.get(stage)
        if child is not None:
            # The metrics themselves may be what failed; the log below still says so.
            with contextlib.suppress(Exception):
                child.inc()
        if stage in self._logged_faults:
            return
        self._logged_faults.add(stage)
        # The logger may be what failed; the counter above already records it.
        with contextlib.suppress(Exception):
            self._logger.error(
                REPORTING_ERROR_EVENT,
                stage=stage,
                error=f"{type(exc).__name__}: {exc}",
                rank=self._rank,
            )

    def _after_fork_in_child(self) -> None:
        # The parent reports what was counted before the fork; a forked child reports only
        # its own calls (in multiprocess mode both write their own files, which are summed).
        self._lock = threading.Lock()
        for report in self._sites.values():
            report.reported_calls = report.logged_calls = report.site.calls
            for counts, base in report.devices:
                if counts.device.type == "cpu":
                    base[:] = counts.latest()
            report.totals = [0] * len(report.totals)
            report.logged = [0] * len(report.logged)
            report.suppressed = 0
            report.unlogged = False


class _Lazy:
    """A series that is created by `create()` or, failing that, on its first increment.

    -inf at sites that do not count it is only ever created by an increment: it is never
    counted there, so it should not be exported as a permanent 0."""

    __slots__ = ("_child", "_family", "_labels")

    def __init__(self, family: Any, **labels: str) -> None:
        self._family = family
        self._labels = labels
        self._child: Any = None

    def create(self) -> None:
        if self._child is None:
            self._child = self._family.labels(**self._labels)

    def inc(self, amount: float = 1) -> None:
        if self._child is None:
            self.create()
        self._child.inc(amount)


# -- interpreter exit and fork -------------------------------------------------------------

_live: weakref.WeakSet[Reporter] | None = None
_live_lock = threading.Lock()


def _live_reporters() -> weakref.WeakSet[Reporter]:
    """Reporters not yet closed; installs the exit and fork hooks with the first one.

    A WeakSet, so that a `Guardrails` dropped without `close()` is still collected.
    """
    global _live
    with _live_lock:
        if _live is None:
            _live = weakref.WeakSet()
            atexit.register(_flush_at_exit)
            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
        return _live


def _flush_at_exit() -> None:
    for reporter in list(_live or ()):
        reporter.flush()


def _after_fork_in_child() -> None:
    for reporter in list(_live or ()):
        reporter._after_fork_in_child()
