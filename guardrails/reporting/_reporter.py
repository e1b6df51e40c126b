"""Reporting: device counts -> host mirror -> Prometheus counters and throttled log events.

Every `reporting.every_calls` calls, a site starts a non-blocking copy of its cumulative
device counts into a host mirror and ticks the reporter. The reporter reads only copies that
have completed (`DeviceCounts.latest()`), so nothing here waits for a device; `flush()` (on
`close()` and at interpreter exit) is the one place that does, to report exact totals.

- Metrics: the difference between the counts read now and those already reported becomes a
  counter increment; counts are never throttled, so the counters end exact.
- Logs: one event per site when new bad values arrive: the first at once, then at most one
  per `reporting.log_interval_s`, carrying how many events it folds in (`suppressed`). Fields
  are counts, names, dtype and shape: never tensor values. Events go to the host's logging
  (`guardrails.logs.HostLogger`), and only after the reporter's lock is released: they are
  decided (and the throttle advanced) under the lock, then delivered outside it, so a host
  handler may call `poll()`, `flush()`, `close()` or make a site from inside an event.
- Faults: an exception while reading counts, creating or writing a metric, serving /metrics
  (other than a bind error, which is a `ConfigError` at start-up) or logging never reaches
  the guarded call (nor site creation); it is counted in
  `guardrails_reporting_errors_total{stage}` (a fault before the first site, once that series
  exists) and logged once. A series that cannot be created (an unwritable multiprocess
  directory) is retried at each increment, so it catches up.

Why `every_calls` defaults to 32: a tick costs about 2-2.5 us of host time on the CPU
(measured) and, on CUDA, a 40-byte pinned copy, an event record and an event query, about
10-20 us of launch overhead (estimated). Every 32 calls that is under 0.1 us per call on the
CPU (a few per cent of a ~3 us site call) and under 1 us on CUDA, while the counters lag the
device by at most 32 calls of the site (one copy more on CUDA): a fraction of a second at
decode rates. The counts of an idle site's last calls are reported by the background poller
(`guardrails.reporting.poller`, twice per `reporting.report_interval_s`), or by `poll()` or
`close()`.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from guardrails import _process
from guardrails._cuda import side_streams
from guardrails.exceptions import ConfigError, Problem
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
    from guardrails.tracing.tracer import Trace

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
        # Imports nothing of prometheus_client: the families open later (see
        # `guardrails.reporting.metrics`), and counts made before wait in their series.
        self._metrics: GuardMetrics = metrics.guard_metrics(
            registry, settings.metrics.labels, directory=settings.metrics.dir
        )
        self._rank: str | None = None
        self._rank_settled = False  # see _resolve_rank
        self._faults = ReportingErrors(self._metrics, self._logger)
        self._closed = False
        # What guardrails' own code costs on this host (guardrails_host_seconds_total).
        self.host_time = host_time.HostTime()
        # Started by the first guarded call (`sampling`), see guardrails.reporting.poller.
        self._poller: Poller | None = None
        if settings.reporting.log_format == "json":
            configure_json_logs()
        port = settings.metrics.port
        if port:
            try:
                self._prepare_serving(settings.metrics.addr, port)
            except BaseException:
                exposition.release_server(self)
                raise
        _live_reporters().add(self)

    def _prepare_serving(self, addr: str, port: int) -> None:
        binding = self._metrics.binding
        if not exposition.claim(addr, port, binding, owner=self):
            raise ConfigError(
                [
                    Problem(
                        self._settings.origin("metrics", "port"),
                        f"cannot serve metrics on {addr}:{port}: another Guardrails in this "
                        "process serves a different registry there",
                        port,
                        accepted="the same registry (or none) for every Guardrails on one "
                        "port, or another port",
                    )
                ]
            )
        if binding.is_open:
            self._serve(addr, port, at_start=True)
            return
        # The server waits for the metrics to open (it imports prometheus_client), but a port
        # that something else holds is still an error at start-up, found without binding it.
        try:
            exposition.probe(addr, port)
        except (OSError, UnicodeError) as exc:
            self._bind_failed(addr, port, exc, at_start=True)
            return  # another process of the tree serves it (else that raised)
        me = weakref.ref(self)

        def serve_when_open() -> None:
            reporter = me()
            if reporter is not None and not reporter._closed:
                reporter._serve(addr, port, at_start=False)

        binding.when_open(serve_when_open)

    def _serve(self, addr: str, port: int, *, at_start: bool) -> None:
        sink = self._metrics.binding.sink
        tree = self._settings.metrics.dir
        directories = list(
            dict.fromkeys(
                str(path)
                for path in (getattr(sink, "directory", None), exposition.multiprocess_dir(), tree)
                if path
            )
        )
        marker_dir = str(tree) if tree else exposition.multiprocess_dir()
        try:
            serving = exposition.serve(
                addr,
                port,
                getattr(sink, "registry", None),
                owner=self,
                directories=directories,
                marker_dir=marker_dir,
            )
        except (OSError, UnicodeError) as exc:
            self._bind_failed(addr, port, exc, at_start=at_start, marker_dir=marker_dir)
            return
        except Exception as exc:
            # prometheus-client refusing a multiprocess directory (not a directory): the
            # series fail the same way and are contained; so is the server, which has
            # nothing to aggregate.
            self._fault("metrics", exc)
            return
        if serving.marker_error is not None:
            # The server runs; only sibling processes cannot learn that it serves them.
            self._fault("metrics", serving.marker_error)

    def _bind_failed(
        self,
        addr: str,
        port: int,
        exc: OSError | UnicodeError,
        *,
        at_start: bool,
        marker_dir: str | None = None,
    ) -> None:
        # In a process tree every process inherits the same port, and one server shows every
        # process's files: a process whose sibling already serves that port is served by it.
        # Anything else holding the port is still an error.
        if marker_dir is None:
            tree = self._settings.metrics.dir
            marker_dir = str(tree) if tree else exposition.multiprocess_dir()
        if exposition.address_in_use(exc) and exposition.sibling_serves(port, marker_dir):
            self._deliver([events.served_elsewhere_event(addr, port)])
            return
        # At start-up, as a ConfigError naming the variable (or file key) that is at fault:
        # the fix is a configuration change, and hosts already handle this error. Later (the
        # metrics opened in a sampling call or an import), a contained fault.
        problem = exposition.bind_problem(
            exc,
            addr,
            port,
            addr_origin=self._settings.origin("metrics", "addr"),
            port_origin=self._settings.origin("metrics", "port"),
        )
        error = ConfigError([problem])
        if at_start:
            raise error from exc
        self._fault("metrics", error)

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
        _live_reporters().discard(self)
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
        """The `rank` label; called with the lock held.

        Read when the first site is made, not at construction. Where nothing says the rank
        then (no process group yet, no RANK variable) it is 0 until a process group is
        initialised: engines' workers (vLLM's, SGLang's tensor-parallel ranks) make their
        sites before they start torch.distributed. At the first report after it starts, the
        sites' series move to the real rank (what the old ones counted stays there: every
        sum stays exact)."""
        if self._rank is None:
            self._rank, self._rank_settled = metrics.resolve_rank_source()
        elif self._rank_settled:
            return self._rank
        else:
            started = metrics.distributed_rank()
            if started is None:
                return self._rank
            self._rank, self._rank_settled = started, True
            for report in self._sites.values():
                self._make_series(report, started, outbox)
        errors = {
            stage: self._series(
                self._metrics.reporting_errors, outbox, stage=stage, rank=self._rank
            )
            for stage in metrics.ERROR_STAGES
        }
        self._faults.open(self._rank, errors)
        return self._rank

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
        """Tell each trace of this pass's hits, report the origin of an episode it holds,
        and set the peak gauge (`guardrails.tracing.tracer`)."""
        for trace in list(self._traces.values()):
            if not trace.active:  # its model was collected
                self._traces.pop(trace.key, None)
                continue
            try:
                if hits:
                    trace.hit(hits[0])
                elif clean and trace.wanted is not None:
                    trace.misses += 1
                if trace.mode.armed and not trace.armed:
                    continue
                rows = trace.read()
                if rows is None:
                    continue
                if trace.wanted is not None:
                    origin = trace.resolve(rows)
                    if origin is not None:
                        self._origin_found(trace, origin, outbox)
                    elif trace.misses > 1:
                        # Two passes without a hit and no latch: the value was born outside
                        # the traced modules (or in an unprobed step); nothing to name.
                        trace.wanted = None
                self._set_peaks(trace, rows, outbox)
            except Exception as exc:
                self._fault("poll", exc, outbox)

    def _origin_found(self, trace: Trace, origin: Any, outbox: list[_Event]) -> None:
        site, trace.wanted = trace.wanted, None
        trace.origin = origin
        rank = self._resolve_rank(outbox)
        series = self._metrics.nonfinite_origin.labels(
            module=origin.module, kind=origin.kind, rank=rank
        )
        self._increment(series, 1, outbox)
        outbox.append(
            events.origin_event(
                module=origin.module,
                site=site,
                kind=origin.kind,
                dtype=origin.dtype,
                rank=rank,
                step=origin.step,
                mode=str(trace.mode),
            )
        )

    def _set_peaks(self, trace: Trace, rows: list[list[float]], outbox: list[_Event]) -> None:
        from guardrails.tracing.tracer import PEAK_SERIES

        ranked = trace.peaks(rows)
        if not ranked:
            return
        rank = self._resolve_rank(outbox)
        family = self._metrics.activation_peak_ratio
        for module, _ratio in ranked[:PEAK_SERIES]:
            if module not in trace.peak_series and len(trace.peak_series) < PEAK_SERIES:
                trace.peak_series[module] = family.labels(module=module, rank=rank)
        values = dict(ranked)
        for module, series in trace.peak_series.items():
            try:
                series.set(values.get(module, 0.0))
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
                    rank=self._rank,
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

    def _fault(self, stage: str, exc: Exception, outbox: list[_Event] | None = None) -> None:
        """Count a contained fault and log it once per stage: into `outbox` when called under
        the lock, else at once."""
        event = self._faults.record(stage, exc, self._rank)
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

_live: _process.Live[Reporter] | None = None
_live_lock = _process.module_lock(__name__, "_live_lock")


def _live_reporters() -> _process.Live[Reporter]:
    """Reporters not yet closed; installs the exit hook with the first one.

    Weak, so that a `Guardrails` dropped without `close()` is still collected.
    """
    global _live
    with _live_lock:
        if _live is None:
            _live = _process.Live()
            atexit.register(_flush_at_exit)
        return _live


def _flush_at_exit() -> None:
    reporters = list(_live or ())
    for reporter in reporters:
        reporter._stop_poller()  # no poll runs during the exit flush
    for reporter in reporters:
        reporter.flush()


def _after_fork_in_child() -> None:
    _held_at_fork.clear()  # the child's locks are new ones (guardrails._process)
    for reporter in list(_live or ()):
        reporter._after_fork_in_child()


# A fork while a background poll is inside prometheus-client would leave that library's own
# lock held in the child for good (its next increment of the series would block): the
# forking thread waits for a poll in progress, at most a second, and the parent goes on.
_held_at_fork: list[Reporter] = []
_FORK_WAIT_S = 1.0


def _before_fork() -> None:
    # Never an unbounded wait: another thread may hold the set's lock (or a reporter's) at
    # the fork; the child re-makes every lock either way (guardrails._process).
    live = _live
    for reporter in [] if live is None else live.snapshot(timeout=_FORK_WAIT_S):
        if reporter._poller is not None and reporter._lock.acquire(timeout=_FORK_WAIT_S):
            _held_at_fork.append(reporter)


def _after_fork_in_parent() -> None:
    while _held_at_fork:
        _held_at_fork.pop()._lock.release()


_process.after_fork("reporters", _after_fork_in_child)
_process.around_fork(_before_fork, _after_fork_in_parent)
