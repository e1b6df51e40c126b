"""One recorder for the errors guardrails swallows: counted every time, logged once, never raised.

Each kind of contained error has its own metric family and event (names in
`guardrails.reporting.metrics` and `guardrails.names`, unchanged) and one `ErrorRecorder`
subclass, owned by the `Guardrails` (or `Reporter`) whose registry, constant labels and
logger it uses:

    ReportingErrors  guardrails_reporting_errors_total{stage, rank}      reporting_error
    GuardErrors      guardrails_guard_errors_total{site, reason, rank}   guard_error
    AttachFailures   guardrails_attach_errors_total{site, target, rank}  attach_error
    HookErrors       guardrails_hook_errors_total{hook, rank}            hook_error

(`GuardErrors` and `AttachFailures` live in `guardrails.attach.patching`, `HookErrors` in
`guardrails.reporting.hook_errors`.) The base holds what they share: the series, made lazily
(nothing here imports prometheus-client; they wait for the process's metrics to open), made
at 0 by `prepare()`; `count()`, which swallows a failing registry; `first()`, an atomic
once-per-key decision (one `dict.setdefault`, so no lock is held while host code runs and a
forked child inherits nothing locked); and `log()`, which swallows a failing logger.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

from guardrails import _process
from guardrails.names import REPORTING_ERROR_EVENT
from guardrails.reporting.events import Event, fault_event

if TYPE_CHECKING:
    from guardrails.reporting.metrics import GuardMetrics

__all__ = ["ErrorRecorder", "ReportingErrors"]


class ErrorRecorder:
    """Count + log-once + metric family, for one kind of error guardrails contains.

    Subclasses name their family (`FAMILY`, an attribute of `GuardMetrics`), their event
    (`EVENT`) and the family's labels besides `rank` (`LABELS`, in key order). `registry`,
    `logger` and `labels` are the owner's (None: the process's default series;
    `guardrails.logs.HostLogger`, the host's structlog or the standard library's
    "guardrails" logger)."""

    FAMILY: ClassVar[str]
    EVENT: ClassVar[str]
    LABELS: ClassVar[tuple[str, ...]]
    # Read the rank at each use instead of once (for errors that may come before and after
    # torch.distributed starts).
    REREAD_RANK: ClassVar[bool] = False

    def __init__(
        self, registry: Any = None, logger: Any = None, labels: dict[str, str] | None = None
    ) -> None:
        if logger is None:
            from guardrails.logs import HostLogger  # late: structlog only when it logs

            logger = HostLogger()
        self._registry = registry
        self._labels = labels or {}
        self._logger = logger
        self._rank: str | None = None
        self._rank_settled = False
        self._series: dict[tuple[str, ...], Any] = {}
        self._logged: dict[tuple[str, ...], object] = {}

    @property
    def logger(self) -> Any:
        """The owner's logger: what the owner's other events go through."""
        return self._logger

    @property
    def rank(self) -> str:
        """The `rank` label (`guardrails.reporting.metrics.resolve_rank`), read once it is
        settled (a process group or a launcher variable says it), or at each use with
        `REREAD_RANK`."""
        if self._rank is None or self.REREAD_RANK or not self._rank_settled:
            from guardrails.reporting.metrics import resolve_rank_source

            self._rank, self._rank_settled = resolve_rank_source()
        return self._rank

    def prepare(self, *key: str) -> None:
        """The series of `key` exists at 0 from now on (retried at its first increment)."""
        with contextlib.suppress(Exception):
            self._child(key).create()

    def count(self, *key: str) -> None:
        """One more error of `key`; a failing registry is swallowed."""
        with contextlib.suppress(Exception):
            self._child(key).inc()

    def first(self, *key: str) -> bool:
        """True for the first call with `key` only (atomic, lock-free)."""
        mine = object()
        return self._logged.setdefault(key, mine) is mine

    def log(self, **fields: Any) -> None:
        """Log `EVENT` with `fields` and the rank at error level; a failing logger is
        swallowed."""
        try:
            rank = self.rank
        except Exception:
            rank = "0"  # the rank's reader failed; the error itself is still worth a log
        with contextlib.suppress(Exception):
            self._logger.error(self.EVENT, **fields, rank=rank)

    def _metrics(self) -> GuardMetrics:
        from guardrails.reporting.metrics import guard_metrics

        return guard_metrics(self._registry, self._labels)

    def _child(self, key: tuple[str, ...]) -> Any:
        rank = self.rank
        child = self._series.get((*key, rank))
        if child is None:
            if len(key) != len(self.LABELS):
                raise ValueError(
                    f"{type(self).__name__}: {len(self.LABELS)} labels "
                    f"({', '.join(self.LABELS)}) but the key {key!r}"
                )
            family = getattr(self._metrics(), self.FAMILY)
            labels = dict(zip(self.LABELS, key, strict=True))
            child = self._series[(*key, rank)] = family.labels(**labels, rank=rank)
        return child


class ReportingErrors(ErrorRecorder):
    """The reporter's own contained faults, by stage (`metrics.ERROR_STAGES`).

    Unlike the others, its series are made only once the reporter knows its rank (at the
    first site, `open()`): a fault before that is held in a count and added then. Its event
    is returned by `record()` instead of logged, for the reporter to deliver after its lock
    is released; it carries the reporter's rank so far (None before the first site)."""

    FAMILY = "reporting_errors"
    EVENT = REPORTING_ERROR_EVENT
    LABELS = ("stage",)

    def __init__(self, metrics: GuardMetrics, logger: Any) -> None:
        super().__init__(logger=logger)
        self._family_of = metrics
        self._open = False
        self._uncounted: Counter[str] = Counter()  # faults before the series existed
        # Guards the two above; held for no callback.
        self._lock = _process.lock(self, "_lock")

    def open(self, rank: str, made: dict[str, Any]) -> None:
        """The reporter resolved `rank` and made the series `made` (by stage): count what
        waited for them."""
        with self._lock:
            self._rank = rank
            self._series.update(((stage, rank), child) for stage, child in made.items())
            self._open = True
            uncounted, self._uncounted = self._uncounted, Counter()
        for stage, n in uncounted.items():
            with contextlib.suppress(Exception):
                made[stage].inc(n)

    def record(self, stage: str, error: BaseException, rank: str | None) -> Event | None:
        """Count a fault of `stage`; its event (carrying `rank`) when it is the first of the
        stage, else None."""
        with self._lock:
            child = self._series.get((stage, self._rank or "")) if self._open else None
            if child is None:
                self._uncounted[stage] += 1
        if child is not None:
            # The metrics themselves may be what failed; the event still says so.
            with contextlib.suppress(Exception):
                child.inc()
        if not self.first(stage):
            return None
        return fault_event(stage, error, rank)

    def _metrics(self) -> GuardMetrics:
        return self._family_of
