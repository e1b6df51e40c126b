"""The reporter: sites' device counts -> Prometheus series and throttled log events.

A site ticks it every `reporting.every_calls` calls; the background poller
(`guardrails.reporting.poller`), `poll()`, `flush()` and `close()` report too. It reads only
host copies that have completed, so it never waits for a device, except in `flush()` (also
run by `close()` and at interpreter exit), which reports exact totals. Counts are never
throttled; log events are, per site (`log_interval_s`), and are delivered after the lock is
released, so a host handler may call back into guardrails. A fault while reporting never
reaches the guarded call: it is counted in `guardrails_reporting_errors_total{stage}` and
logged once. How often it reports, and what that costs: docs/metrics.md ("How counts reach
the counters").
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from guardrails import _process
from guardrails._cuda import side_streams
from guardrails.flags import CountKind
from guardrails.logs import HostLogger, configure_json_logs
from guardrails.names import REPORTING_ERROR_EVENT
from guardrails.reporting import events, exposition, host_time, metrics
from guardrails.reporting.events import Event as _Event
from guardrails.reporting.poller import Poller
from guardrails.reporting.recorder import ReportingErrors
from guardrails.reporting.series import SiteSeries
from guardrails.reporting.throttle import LogThrottle

if TYPE_CHECKING:
    import torch

    from guardrails.reporting.metrics import GuardMetrics, Series
    from guardrails.reporting.mirror import DeviceCounts
    from guardrails.reporting.watched import Observation
    from guardrails.settings import GuardSettings
    from guardrails.tracing.tracer import Trace, TraceReport

__all__ = ["ReportedSite", "Reporter"]

_NO_POLLER: Any = object()  # starting one failed: not tried again


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


class _SiteReport:
    """One site as the reporter knows it: what was counted (`series`) and what was logged
    (`throttle`), kept apart: counts are never throttled."""

    __slots__ = ("series", "site", "throttle")

    def __init__(self, site: ReportedSite) -> None:
        self.site = site
        self.series = SiteSeries(site.slots)
        self.throttle = LogThrottle(len(site.slots))


class Reporter:
    """Turns the sites' device counts into metrics and log events, without a host sync.

    `registry` is the prometheus-client registry (default: the global one); `clock` drives
    the log throttle; `logger` replaces the host's logging (`guardrails.logs.HostLogger`).
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
        self._logger = HostLogger() if logger is None else logger
        # Re-entrant, and never held while host code runs (log delivery happens after it is
        # released). `_reporting` tells a re-entry on the holder's own thread (a signal
        # handler, a finalizer run by the garbage collector) to return instead of working on
        # half-updated state: the report in progress picks its counts up.
        self._lock = _process.rlock(self, "_lock")
        self._reporting = False
        self._sites: dict[int, _SiteReport] = {}
        # Traced models (`guardrails.tracing`): told of hits, read for origins and peaks.
        # Weakly, by key: a trace ends with its model, which a server may drop.
        self._traces: weakref.WeakValueDictionary[str, Trace] = weakref.WeakValueDictionary()
        # Each trace's peak gauges, by module, made at the rank of the pass that chose them.
        self._peaks: weakref.WeakKeyDictionary[Trace, dict[str, Series]] = (
            weakref.WeakKeyDictionary()
        )
        # Imports nothing of prometheus_client: the families open later (see
        # `guardrails.reporting.metrics`), and counts made before wait in their series.
        self._metrics: GuardMetrics = metrics.guard_metrics(
            registry, settings.metrics.labels, directory=settings.metrics.dir
        )
        self._rank = metrics.Rank()
        self._faults = ReportingErrors(self._metrics, self._logger)
        self._closed = False
        # What guardrails' own code costs on this host (guardrails_host_seconds_total).
        self.host_time = host_time.HostTime()
        # Started by the first guarded call (`sampling`), see guardrails.reporting.poller.
        self._poller: Poller | None = None
        if settings.reporting.log_format == "json":
            configure_json_logs()
        if settings.metrics.port:
            try:
                exposition.open_port(
                    self,
                    settings,
                    self._metrics.binding,
                    fault=self._metrics_fault,
                    notice=self._deliver,
                )
            except BaseException:
                exposition.release_server(self)
                raise
        _live.add(self)

    # -- called by the service and the sites ----------------------------------------------

    def started(self, warnings: Sequence[str] = (), installed_by: str = "library") -> None:
        """Log the start-up event: how guardrails came in, what guards, what is off, what
        to look at (`warnings`)."""
        level, event, fields = events.started_event(self._settings, warnings, installed_by)
        # Best effort, not counted: a logger that fails here fails on the first real event
        # too, which is counted and logged with its own error.
        with contextlib.suppress(Exception):
            getattr(self._logger, level)(event, **fields)

    def register(self, site: ReportedSite) -> None:
        """A site was created: its series exist at 0 from now on (in the registry once the
        metrics open: at the first guarded call, see `sampling`)."""
        outbox: list[_Event] = []
        if self._settings.metrics.port:
            # Asked to serve them: the port serves from the start.
            self._open_metrics(outbox)
        with self._lock:
            report = self._report_for(site)
            self._make_series(report, self._resolve_rank(outbox), outbox)
        self._deliver(outbox)

    def sampling(self) -> None:
        """A site was called (its first call, then with each tick): the engine samples, so
        its start-up, and with it the host's own prometheus-client choice, is over; the
        metrics may open now even where the host never imports prometheus_client.

        Not when a site is made: engines make sites in processes that never sample, at
        import (SGLang's HTTP server imports its sampler module before `launch_server`
        sets PROMETHEUS_MULTIPROC_DIR; importing prometheus-client there first kept that
        process's own series out of SGLang's /metrics)."""
        if self._poller is None:
            self._start_poller()
        if self._metrics.binding.is_open or self._closed:
            return
        outbox: list[_Event] = []
        with self._lock:
            self._open_metrics(outbox)
        self._deliver(outbox)

    def _start_poller(self) -> None:
        with self._lock:
            if self._poller is not None or self._closed:
                return
            try:
                self._poller = Poller(self, self._settings.reporting.report_interval_s / 2)
            except Exception as exc:
                # No thread to be had (a process at its limit): counts still reach the
                # counters at ticks and at exit; the fault is counted and logged once.
                self._poller = _NO_POLLER
                self._fault("poll", exc)

    def background_poll(self) -> None:
        """The poller's call: `poll()` with the poller's copies on its own CUDA streams."""
        if self._closed:
            return
        started = host_time.CLOCK()
        try:
            with self._lock:
                devices = [
                    counts.device
                    for report in self._sites.values()
                    for counts, _ in report.series.devices
                ]
                devices += [trace.device for trace in self._traces.values() if trace.active]
            with side_streams(devices):
                self._report_locked(exact=False)
        except Exception as exc:
            self._fault("poll", exc)
        # Counted at the next report (this one's increments are part of what it timed).
        self.host_time.add("poller", host_time.CLOCK() - started)

    def _open_metrics(self, outbox: list[_Event]) -> None:
        binding = self._metrics.binding
        try:
            binding.open()
        except Exception as exc:
            self._fault("metrics", exc, outbox)
            return
        error, binding.error = binding.error, None
        if error is not None:
            self._fault("metrics", error, outbox)

    def track(self, site: ReportedSite, counts: DeviceCounts) -> None:
        """A site got buffers on a new device."""
        with self._lock:
            self._report_for(site).series.track(counts)

    def tick(self) -> None:
        """Called from the hot path every `reporting.every_calls` calls of some site.

        Never waits: if another thread is reporting, that thread picks these counts up.
        """
        self._report_locked(exact=False, wait=False)

    def liveness(self, observations: Sequence[Observation], heartbeat: str) -> None:
        """A liveness window ended (`guardrails.attach.liveness`): set each watched site's
        `guardrails_site_not_called` gauge, and warn once for each that went silent."""
        outbox: list[_Event] = []
        with self._lock:
            rank = self._resolve_rank(outbox)
            for seen in observations:
                watched = seen.watched
                try:
                    child = self._metrics.site_not_called.labels(site=watched.name, rank=rank)
                    child.set(1 if seen.silent else 0)
                except Exception as exc:
                    self._fault("metrics", exc, outbox)
                if not seen.first:
                    continue
                if watched.kind == "installed":
                    outbox.append(
                        events.trace_not_installed_event(
                            rank=rank,
                            heartbeat=heartbeat,
                            steps=seen.steps,
                            loaders=watched.targets,
                            states=watched.states,
                        )
                    )
                    continue
                outbox.append(
                    events.site_not_called_event(
                        site=watched.name,
                        rank=rank,
                        heartbeat=heartbeat,
                        steps=seen.steps,
                        targets=watched.targets,
                        states=watched.states,
                        calls_total=watched.calls,
                        off=watched.kind == "off",
                    )
                )
        self._deliver(outbox)

    def add_trace(self, trace: Trace) -> None:
        """A traced model: its origins and peaks are reported from the next poll on; logged
        (`guardrails.trace_installed`) now."""
        outbox: list[_Event] = []
        with self._lock:
            self._traces[trace.key] = trace
            rank = self._resolve_rank(outbox)
        outbox.append(
            events.trace_installed_event(
                model=trace.model_name,
                modules=len(trace.names),
                patterns=trace.patterns,
                mode=str(trace.mode),
                device=str(trace.device),
                rank=rank,
            )
        )
        self._deliver(outbox)

    def drop_trace(self, trace: Trace) -> None:
        with self._lock:
            self._traces.pop(trace.key, None)

    # -- public ---------------------------------------------------------------------------

    def poll(self) -> None:
        """Report what the host mirrors hold now; never waits for a device."""
        self._report_locked(exact=False)

    def flush(self) -> None:
        """Report exact totals (waits for the devices), and log what the throttle held back."""
        self._report_locked(exact=True)

    def close(self) -> None:
        """Flush, stop reporting and release the metrics server. Idempotent."""
        self._stop_poller()
        self.flush()
        self._closed = True
        _live.discard(self)
        if self._settings.metrics.port:
            exposition.release_server(self)

    # -- internals ------------------------------------------------------------------------

    def _stop_poller(self) -> None:
        poller = self._poller
        if poller is not None and poller is not _NO_POLLER:
            poller.stop()

    def _report_locked(self, *, exact: bool, wait: bool = True) -> None:
        if self._closed or not self._lock.acquire(blocking=wait):
            return
        outbox: list[_Event] = []
        try:
            if self._reporting:
                return  # re-entered on this thread mid-report: that report covers it
            self._reporting = True
            try:
                if self._sites:
                    self._resolve_rank(outbox)  # a process group started since: its rank
                self._report(exact=exact, outbox=outbox)
            except Exception as exc:
                self._fault("poll", exc, outbox)
            finally:
                self._reporting = False
        finally:
            self._lock.release()
        self._deliver(outbox)

    def _deliver(self, outbox: list[_Event]) -> None:
        """Hand events to the logger; called with no guardrails lock held."""
        for method, event, fields in outbox:
            try:
                getattr(self._logger, method)(event, **fields)
            except Exception as exc:
                if event == REPORTING_ERROR_EVENT:
                    continue  # the logger is what failed; the fault is counted already
                self._fault("logs", exc)

    def _report_for(self, site: ReportedSite) -> _SiteReport:
        report = self._sites.get(id(site))
        if report is None:
            report = self._sites[id(site)] = _SiteReport(site)
        return report

    def _resolve_rank(self, outbox: list[_Event]) -> str:
        """The `rank` label (`metrics.Rank`); called with the lock held. When it is new
        here, the error series are made at it, and when it moved, the sites' series too."""
        first = self._rank.value is None
        rank, new = self._rank.resolve()
        if not new:
            return rank
        if not first:
            for report in self._sites.values():
                self._make_series(report, rank, outbox)
        errors = {
            stage: self._series(self._metrics.reporting_errors, outbox, stage=stage, rank=rank)
            for stage in metrics.ERROR_STAGES
        }
        self._faults.open(rank, errors)
        return rank

    def _make_series(self, report: _SiteReport, rank: str, outbox: list[_Event]) -> None:
        site, series, family = report.site, report.series, self._metrics
        for i, kind in enumerate(site.slots):
            series.children[i] = self._child_for(kind, site, rank, family, outbox)
        series.calls_child = self._series(family.guard_calls, outbox, site=site.name, rank=rank)

    def _child_for(
        self,
        kind: CountKind,
        site: ReportedSite,
        rank: str,
        family: GuardMetrics,
        outbox: list[_Event],
    ) -> Any:
        series = metrics.SLOT_SERIES.get(kind)
        if series is None:
            return None
        attr, label = series
        if kind is CountKind.NEGINF and not site.counts_neginf:
            # Never counted there: made by an increment only, not exported as a permanent 0.
            return family.nonfinite_values.labels(site=site.name, kind=label, rank=rank)
        if attr == "nonfinite_values":
            return self._series(
                family.nonfinite_values, outbox, site=site.name, kind=label, rank=rank
            )
        return self._series(family.flagged_rows, outbox, site=site.name, reason=label, rank=rank)

    def _series(self, family: Any, outbox: list[_Event], **labels: str) -> Series:
        # Made now, so that it exists at 0 from the start. prometheus-client creates a
        # multiprocess file here; if that fails, site creation (maybe inside the first
        # sampling call) must not: the series is made at its first increment instead.
        series: Series = family.labels(**labels)
        try:
            series.create()
        except Exception as exc:
            self._fault("metrics", exc, outbox)
        return series

    def _report(self, *, exact: bool, outbox: list[_Event]) -> None:
        self._report_host_time(outbox)  # first: a site that fails to report never holds it up
        # A copy of the list: a site made by a re-entrant call (see `_lock`) is not iterated.
        hits = []
        clean = False
        for report in list(self._sites.values()):
            seen = report.series.seen_calls
            if self._report_site(report, exact=exact, outbox=outbox):
                hits.append(report.site.name)
            elif report.site.kind == "logits" and report.series.seen_calls != seen:
                clean = True
        if self._traces:
            self._report_traces(hits, clean and not hits, outbox)

    def _report_host_time(self, outbox: list[_Event]) -> None:
        spent = self.host_time.unreported()
        if not spent:
            return
        rank = self._resolve_rank(outbox)
        for part, seconds in spent:
            series = self._metrics.host_seconds.labels(part=part, rank=rank)
            if not self._increment(series, seconds, outbox):
                self.host_time.unreport(part, seconds)  # retried at the next report

    def _report_traces(self, hits: list[str], clean: bool, outbox: list[_Event]) -> None:
        """One report pass of each trace (`Trace.report`): count and log the origin it
        found, set its peak gauges."""
        for trace in list(self._traces.values()):
            if not trace.active:  # its model was collected
                self._traces.pop(trace.key, None)
                continue
            try:
                found = trace.report(hits[0] if hits else None, clean)
                if found is not None:
                    self._trace_found(trace, found, outbox)
            except Exception as exc:
                self._fault("poll", exc, outbox)

    def _trace_found(self, trace: Trace, found: TraceReport, outbox: list[_Event]) -> None:
        origin = found.origin
        if origin is not None:
            rank = self._resolve_rank(outbox)
            series = self._metrics.nonfinite_origin.labels(
                module=origin.module, kind=origin.kind, rank=rank
            )
            self._increment(series, 1, outbox)
            outbox.append(
                events.origin_event(
                    module=origin.module,
                    site=found.site,
                    kind=origin.kind,
                    dtype=origin.dtype,
                    rank=rank,
                    step=origin.step,
                    mode=str(trace.mode),
                )
            )
        if not found.peaks:
            return
        rank = self._resolve_rank(outbox)
        gauges = self._peaks.setdefault(trace, {})
        for module, ratio in found.peaks:
            gauge = gauges.get(module)
            if gauge is None:
                gauge = gauges[module] = self._metrics.activation_peak_ratio.labels(
                    module=module, rank=rank
                )
            try:
                gauge.set(ratio)
            except Exception as exc:
                self._fault("metrics", exc, outbox)

    def _report_site(self, report: _SiteReport, *, exact: bool, outbox: list[_Event]) -> bool:
        """Report one site; True when it brought new non-finite logits (a trace's cue)."""
        calls = report.site.calls
        series, throttle = report.series, report.throttle
        # Reading the counts is most of the cost of a poll: a site not called since the last
        # look, with nothing left to log, is done.
        if not exact and series.unchanged(calls) and not throttle.pending:
            return False
        fresh = series.advance(
            calls,
            exact=exact,
            increment=lambda child, delta: self._increment(child, delta, outbox),
            failed_read=lambda exc: self._fault("poll", exc, outbox),
        )
        if fresh or throttle.pending:
            throttle.pending = True
            self._maybe_log(report, fresh=fresh, final=exact, outbox=outbox)
        return fresh and report.site.kind == "logits"

    def _increment(self, child: Any, delta: float, outbox: list[_Event]) -> bool:
        if child is None:
            return True  # a count that only appears in log events
        try:
            child.inc(delta)
        except Exception as exc:
            # Not marked reported: retried on the next poll, so the counter still ends exact
            # once the fault clears.
            self._fault("metrics", exc, outbox)
            return False
        return True

    def _maybe_log(
        self, report: _SiteReport, *, fresh: bool, final: bool, outbox: list[_Event]
    ) -> None:
        # The throttle is checked before anything is built for the event.
        now = self._clock()
        throttle, series = report.throttle, report.series
        if not throttle.due(now, fresh=fresh, final=final):
            return
        site = report.site
        try:
            dtype = site.last_dtype
            outbox.append(
                events.site_event(
                    site=site.name,
                    kind=site.kind,
                    slots=site.slots,
                    totals=series.totals,
                    logged=throttle.logged,
                    calls_total=series.reported_calls,
                    logged_calls=throttle.logged_calls,
                    suppressed=throttle.suppressed,
                    rank=self._rank.value,
                    vocab_size=site.vocab_size if site.kind == "token_ids" else None,
                    dtype=None if dtype is None else str(dtype).removeprefix("torch."),
                    shape=site.last_shape,
                )
            )
        except Exception as exc:
            self._fault("logs", exc, outbox)
        # Advanced now, whether or not delivery works: the throttle state is exact under the
        # lock, and a broken logger must not be retried per call.
        throttle.logged_now(now, self._interval, series.totals, series.reported_calls)

    def _metrics_fault(self, exc: Exception) -> None:
        self._fault("metrics", exc)

    def _fault(self, stage: str, exc: Exception, outbox: list[_Event] | None = None) -> None:
        """Count a contained fault and log it once per stage: into `outbox` when called under
        the lock, else at once."""
        event = self._faults.record(stage, exc, self._rank.value)
        if event is None:
            return
        if outbox is not None:
            outbox.append(event)
        else:
            self._deliver([event])

    def _after_fork_in_child(self) -> None:
        # The parent reports what was counted before the fork; a forked child reports only
        # its own calls (in multiprocess mode both write their own files, which are summed).
        # The parent's poller thread is not in the child: a new one, if the parent had one
        # (the child's calls go on from the parent's count, so no first call would start it).
        self._reporting = False
        polling = self._poller is not None and self._poller is not _NO_POLLER
        self._poller = None
        for report in self._sites.values():
            calls = report.site.calls
            report.series.restart(calls)
            report.throttle.restart(calls)
        self.host_time.restart()
        if polling and not self._closed:
            self._start_poller()  # on the child's own baselines


# -- interpreter exit and fork -------------------------------------------------------------


def _flush_at_exit(reporters: list[Reporter]) -> None:
    for reporter in reporters:
        reporter._stop_poller()  # no poll runs during the exit flush
    for reporter in reporters:
        reporter.flush()


def _after_fork_in_child() -> None:
    for reporter in list(_live):
        reporter._after_fork_in_child()


def _held_at_fork(reporter: Reporter) -> Any:
    # A poll in progress may be inside prometheus-client: the fork waits for it (at most a
    # second), so that the child never inherits that library's lock held.
    return reporter._lock if reporter._poller is not None else None


# Reporters not yet closed (weakly: a `Guardrails` dropped without `close()` is collected).
_live: _process.Live[Reporter] = _process.Live(at_exit=_flush_at_exit)
_process.after_fork("reporters", _after_fork_in_child)
_process.hold_at_fork(_live, _held_at_fork, timeout_s=1.0)
