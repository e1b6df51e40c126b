"""Prometheus series of guardrails, made without deciding anything for the host.

Contract (metric names and labels are fixed; see the design brief):

    guardrails_nonfinite_values_total{site, kind, rank}    kind: nan, posinf, neginf
    guardrails_flagged_rows_total{site, reason, rank}      reason: nonfinite, no_valid_token,
                                                                   oob_token
    guardrails_guard_calls_total{site, rank}
    guardrails_reporting_errors_total{stage, rank}         stage: poll, metrics, logs
    guardrails_guard_errors_total{site, reason, rank}      reason: dtype, shape, layout,
                                                                   device, reference, error
    guardrails_attach_errors_total{site, target, rank}     an attach point or hook whose
                                                           target does not resolve
    guardrails_hook_errors_total{hook, rank}               an engine hook's own failure at
                                                           run time (the engine's call went on)
    guardrails_requests_aborted_total{hook, reason, rank}  requests an engine hook ended
                                                           (reason: nonfinite_logits,
                                                           nonfinite_kv)
    guardrails_site_not_called{site, rank}                 gauge: 1 while an attached site
                                                           (or hook) sees no call as the
                                                           heartbeat runs (liveness)
    guardrails_nonfinite_origin_total{module, kind, rank}  the traced module where a site's
                                                           non-finite values were born, once
                                                           per episode (guardrails.tracing)
    guardrails_activation_peak_ratio{module, rank}         gauge: largest finite |output| of a
                                                           traced module / its dtype's largest
                                                           finite value (at most 8 modules)
    guardrails_host_seconds_total{part, rank}              host seconds guardrails' own code
                                                           spent, by part (reporting.host_time)

Constant labels (`[metrics.labels]`, GUARDRAILS_METRICS_LABELS: the engine's `model_name`,
`engine`, `tp_rank`) are added to every family after these, so guardrails' series carry the
same identifying labels as the engine's own on its /metrics endpoint.

When the families are made ("the metrics open"): prometheus-client fixes its multiprocess mode
(`values.ValueClass`) when it is first imported, and SGLang and vLLM set
`PROMETHEUS_MULTIPROC_DIR` only after interpreter start, so nothing here imports it early.
`guard_metrics()` returns `Family` objects whose `Series` keep their value until the metrics
of their registry open, and from then on are plain prometheus-client children (or lines of a
multiprocess file, `guardrails.reporting.sinks`). They open at the first of:

- an explicit `registry=` (its owner imported prometheus-client: the choice is made);
- the host's own import of prometheus-client (a post-import hook; at once when it is
  imported already): the host's mode is then whatever the host chose;
- the first site (`Reporter.register`): the engine samples, so its start-up is over; with
  no host metrics at all (a plain script) guardrails imports prometheus-client itself here.

So "every enabled series exists at 0 from the start" means: from the moment its site (or
attach point, or hook) is made, as soon as the process's metrics are open; a series made before
carries its 0 (or its counts) into the open metrics. Counts are never lost while they wait.
Counters are incremented by deltas and the gauge set (in "livemax" mode: in multiprocess mode
the value of the live processes, one per rank label, and a dead process's value goes with
its file), never computed by a custom collector, so they work unchanged in prometheus-client's
multiprocess mode.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from guardrails import _process
from guardrails.flags import CountKind
from guardrails.reporting.sinks import FamilySpec

if TYPE_CHECKING:
    from guardrails.reporting.sinks import FileSink, RegistrySink

__all__ = [
    "ABORT_REASONS",
    "ERROR_STAGES",
    "FAMILIES",
    "GUARD_ERROR_REASONS",
    "METRIC_LABELS",
    "METRIC_NAMES",
    "SLOT_SERIES",
    "Family",
    "FamilySpec",
    "GuardMetrics",
    "Rank",
    "Series",
    "distributed_rank",
    "guard_metrics",
    "resolve_rank",
    "resolve_rank_source",
]

# Where each count of a site's buffer goes: (family, label value). Out-of-vocab ids are
# counted per row in metrics; the number of ids only appears in log events.
SLOT_SERIES: Final[Mapping[CountKind, tuple[str, str]]] = {
    CountKind.NAN: ("nonfinite_values", "nan"),
    CountKind.POSINF: ("nonfinite_values", "posinf"),
    CountKind.NEGINF: ("nonfinite_values", "neginf"),
    CountKind.ROWS_NONFINITE: ("flagged_rows", "nonfinite"),
    CountKind.ROWS_NO_VALID_TOKEN: ("flagged_rows", "no_valid_token"),
    CountKind.ROWS_OOB_TOKEN: ("flagged_rows", "oob_token"),
}
ERROR_STAGES: Final = ("poll", "metrics", "logs")
# Why a patched target's call went unguarded: the site refused the tensor's dtype, its shape
# (no vocab dimension), its layout (sparse, nested, memory overlapping itself), its device
# (meta, or not the site's), the configured reference does not fit the call, or anything else.
GUARD_ERROR_REASONS: Final = ("dtype", "shape", "layout", "device", "reference", "error")
# Why an engine hook ended a request: a logits row matched its site's abort_on, or (transformers'
# continuous batching) its keys or values were non-finite in a prefill chunk with no logits row.
ABORT_REASONS: Final = ("nonfinite_logits", "nonfinite_kv")


FAMILIES: Final = (
    FamilySpec(
        "nonfinite_values",
        "guardrails_nonfinite_values",
        "Non-finite logits values found at a guarded site (nan, posinf; neginf where counted).",
        ("site", "kind", "rank"),
    ),
    FamilySpec(
        "flagged_rows",
        "guardrails_flagged_rows",
        "Rows flagged at a guarded site: nonfinite values, no valid token, out-of-vocab ids.",
        ("site", "reason", "rank"),
    ),
    FamilySpec(
        "guard_calls", "guardrails_guard_calls", "Calls of a guarded site.", ("site", "rank")
    ),
    FamilySpec(
        "reporting_errors",
        "guardrails_reporting_errors",
        "Exceptions contained while reading counts, writing metrics or logging.",
        ("stage", "rank"),
    ),
    FamilySpec(
        "guard_errors",
        "guardrails_guard_errors",
        "Calls of a patched target left unguarded because the site refused the tensor.",
        ("site", "reason", "rank"),
    ),
    FamilySpec(
        "attach_errors",
        "guardrails_attach_errors",
        "Attach points or engine hooks whose target did not resolve (that site is unguarded).",
        ("site", "target", "rank"),
    ),
    FamilySpec(
        "hook_errors",
        "guardrails_hook_errors",
        "Calls of an engine hook that failed in guardrails' own code (the engine's call went on "
        "unhooked).",
        ("hook", "rank"),
    ),
    FamilySpec(
        "requests_aborted",
        "guardrails_requests_aborted",
        "Requests an engine hook ended through the engine's own error path (their request ids "
        "are in the guardrails.request_aborted events).",
        ("hook", "reason", "rank"),
    ),
    FamilySpec(
        "site_not_called",
        "guardrails_site_not_called",
        "1 while an attached site (or engine hook) sees no call as the heartbeat runs "
        "liveness_steps times: it is on no path this engine runs.",
        ("site", "rank"),
        type="gauge",
        multiprocess_mode="livemax",
    ),
    FamilySpec(
        "nonfinite_origin",
        "guardrails_nonfinite_origin",
        "Traced module where non-finite values a site reported were born (input finite, "
        "output not), once per episode.",
        ("module", "kind", "rank"),
    ),
    FamilySpec(
        "activation_peak_ratio",
        "guardrails_activation_peak_ratio",
        "Largest finite |output| of a traced module as a share of its dtype's largest finite "
        "value (1 is overflow); the modules with the largest peaks, at most 8.",
        ("module", "rank"),
        type="gauge",
        multiprocess_mode="livemax",
    ),
    FamilySpec(
        "host_seconds",
        "guardrails_host_seconds",
        "Host seconds guardrails' own code spent in this process, by part (site calls, attach "
        "points, engine hook parts without the engine's call, the report poller).",
        ("part", "rank"),
    ),
)
METRIC_NAMES: Final = tuple(spec.sample for spec in FAMILIES)
# Exported name -> label names: what dashboards and alert rules may select on.
METRIC_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    spec.sample: spec.labels for spec in FAMILIES
}


class Series:
    """One labelled series: made at 0 by `create()`, or at its first `inc()` / `set()`.

    Before its registry's metrics open, the value is kept here and written when they do. A
    series whose creation fails once they are open (an unwritable multiprocess directory)
    raises from that call and is retried at the next one."""

    def __init__(self, binding: _Binding, attr: str, labels: dict[str, str]) -> None:
        self._binding = binding
        self._attr = attr
        self._labels = labels
        self._child: Any = None
        self.pending_inc = 0.0
        self.pending_set: float | None = None
        self.queued = False

    def create(self) -> None:
        if self._child is None:
            self._binding.settle(self, "create", 0.0)

    def inc(self, amount: float = 1) -> None:
        child = self._child
        if child is None:
            self._binding.settle(self, "inc", amount)
        else:
            child.inc(amount)

    def set(self, value: float) -> None:
        child = self._child
        if child is None:
            self._binding.settle(self, "set", value)
        else:
            child.set(value)

    def bind(self, child: Any) -> None:
        # Called by the binding, under its lock: what waited goes in first.
        if self.pending_set is not None:
            child.set(self.pending_set)
            self.pending_set = None
        if self.pending_inc:
            child.inc(self.pending_inc)
            self.pending_inc = 0.0
        self._child = child

    @property
    def attr(self) -> str:
        return self._attr

    @property
    def labels(self) -> dict[str, str]:
        return self._labels


class Family:
    """One family with an instance's constant labels filled in at `.labels()`."""

    __slots__ = ("_attr", "_binding", "_constant")

    def __init__(self, binding: _Binding, attr: str, constant: Mapping[str, str]) -> None:
        self._binding = binding
        self._attr = attr
        self._constant = dict(constant)

    def labels(self, **labels: str) -> Series:
        return self._binding.series(self._attr, {**labels, **self._constant})


@dataclass(frozen=True)
class GuardMetrics:
    """The families of one registry (shared by every `Guardrails` using it), with one
    instance's constant labels, and what decides when they open (`binding`)."""

    nonfinite_values: Family
    flagged_rows: Family
    guard_calls: Family
    reporting_errors: Family
    guard_errors: Family
    attach_errors: Family
    hook_errors: Family
    requests_aborted: Family
    site_not_called: Family
    nonfinite_origin: Family
    activation_peak_ratio: Family
    host_seconds: Family
    binding: _Binding


class _Binding:
    """When and where the families of one registry (None: the process's default) are made.

    `directory`: guardrails' tree directory (`GUARDRAILS_METRICS_DIR`), used by the default
    binding when the host has no multiprocess directory of its own."""

    def __init__(self, registry: Any, constant: tuple[str, ...], directory: str | None) -> None:
        self.registry = registry
        self.constant = constant
        self.directory = directory
        self.sink: RegistrySink | FileSink | None = None
        self.error: Exception | None = None
        self._lock = _process.rlock(self, "_lock")
        self._families: dict[str, Any] | None = None
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], Series] = {}
        self._pending: list[Series] = []
        self._on_open: list[Callable[[], None]] = []

    @property
    def is_open(self) -> bool:
        return self._families is not None

    def series(self, attr: str, labels: dict[str, str]) -> Series:
        key = (attr, tuple(sorted(labels.items())))
        found = self._series.get(key)
        if found is None:
            with self._lock:
                found = self._series.setdefault(key, Series(self, attr, labels))
        return found

    def when_open(self, callback: Callable[[], None]) -> None:
        """Call `callback` (which must contain its own errors) once the metrics open: now if
        they are open already."""
        with self._lock:
            if self._families is None:
                self._on_open.append(callback)
                return
        callback()

    def open(self) -> None:
        """Make the families now (importing prometheus-client if the host has not); raises
        what that raised (the series keep waiting and a later call retries)."""
        with self._lock:
            if self._families is not None:
                return
            try:
                from guardrails.reporting.sinks import choose_sink

                sink = choose_sink(self.registry, self.directory)
                self._families = sink.families(FAMILIES, self.constant)
            except Exception as exc:
                self.error = exc
                raise
            self.sink = sink
            self.error = None
            pending, self._pending = self._pending, []
            for series in pending:
                series.queued = False
                try:
                    series.bind(self._families[series.attr].child(series.labels))
                except Exception as exc:
                    # Retried at the series' next call; its waiting value is kept.
                    self.error = exc
                    self._queue(series)
            callbacks, self._on_open = self._on_open, []
        for callback in callbacks:
            callback()

    def open_quietly(self) -> None:
        """`open()`, keeping a failure in `error` for the next reporter that looks."""
        with contextlib.suppress(Exception):  # kept in self.error; a reporter counts it
            self.open()

    def settle(self, series: Series, op: str, value: float) -> None:
        with self._lock:
            child = series._child
            if child is None:
                if self._families is None:
                    if op == "inc":
                        series.pending_inc += value
                    elif op == "set":
                        series.pending_set, series.pending_inc = value, 0.0
                    self._queue(series)
                    return
                child = self._families[series.attr].child(series.labels)
                series.bind(child)
        if op == "inc":
            child.inc(value)
        elif op == "set":
            child.set(value)

    def _queue(self, series: Series) -> None:
        if not series.queued:
            series.queued = True
            self._pending.append(series)


_BINDING_ATTR: Final = "_guardrails_binding"
_default_binding: _Binding | None = None
_bindings_lock = _process.module_lock(__name__, "_bindings_lock")


def guard_metrics(
    registry: Any = None,
    constant: Mapping[str, str] | None = None,
    *,
    directory: str | os.PathLike[str] | None = None,
) -> GuardMetrics:
    """The families of `registry` (default: the process's own, see the module docstring),
    with `constant` labels (their names become part of every family).

    Imports nothing of prometheus-client itself. Asking again for the same registry returns
    the same families, so any number of `Guardrails` instances share them without a
    duplicate-metric error; instances sharing a registry must use the same constant label
    names (their values may differ), else `ValueError`.
    """
    global _default_binding
    constant = dict(constant or {})
    names = tuple(sorted(constant))
    path = None if directory is None else os.fspath(directory)
    fresh = False
    with _bindings_lock:
        if registry is None:
            binding = _default_binding
            if binding is None:
                binding = _default_binding = _Binding(None, names, path)
                fresh = True
        else:
            binding = getattr(registry, _BINDING_ATTR, None)
            if binding is None:
                binding = _Binding(registry, names, None)
                setattr(registry, _BINDING_ATTR, binding)
                fresh = True
    if binding.constant != names:
        raise ValueError(
            f"guardrails' metrics in this registry carry the constant labels "
            f"{list(binding.constant)}; this instance asks for {list(names)}: every instance "
            "sharing a registry needs the same [metrics.labels] names"
        )
    if path is not None and binding.directory is None and not binding.is_open:
        binding.directory = path
    if registry is not None:
        if not binding.is_open:
            binding.open()  # its owner imported prometheus-client: the choice is made
    elif fresh:
        # The host's own import of prometheus-client is its choice made: open then (at once
        # if it happened already). wrapt's hook never imports the module itself.
        import wrapt

        wrapt.register_post_import_hook(lambda _module: binding.open_quietly(), "prometheus_client")
    return GuardMetrics(
        **{spec.attr: Family(binding, spec.attr, constant) for spec in FAMILIES},
        binding=binding,
    )


def resolve_rank(environ: Mapping[str, str] | None = None) -> str:
    """The `rank` label: torch.distributed's rank when initialised, else RANK, else
    LOCAL_RANK, else 0. Malformed variables are skipped: they belong to the launcher."""
    return resolve_rank_source(environ)[0]


def resolve_rank_source(environ: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """`resolve_rank`'s answer, and whether it is settled: False for the fallback 0, which a
    process group initialised later replaces (`distributed_rank`)."""
    rank = distributed_rank()
    if rank is not None:
        return rank, True
    env = os.environ if environ is None else environ
    for key in ("RANK", "LOCAL_RANK"):
        raw = env.get(key, "").strip()
        # ASCII only: str.isdigit() also accepts digits int() refuses, such as "²".
        if raw.isascii() and raw.isdigit():
            return str(int(raw)), True
    return "0", False


class Rank:
    """One reporter's `rank` label (`resolve_rank`), read when first asked, not at
    construction. Where nothing says the rank then (no process group yet, no RANK variable)
    it is 0 until a process group is initialised: engines' workers (vLLM's, SGLang's
    tensor-parallel ranks) make their sites before they start torch.distributed. Asked after
    that, it moves to the real rank once; the owner moves its series there (what the old ones
    counted stays: every sum stays exact)."""

    __slots__ = ("_settled", "value")

    def __init__(self) -> None:
        self.value: str | None = None  # None: not read yet
        self._settled = False

    def resolve(self) -> tuple[str, bool]:
        """The rank, and whether it is new here: read for the first time, or just moved to
        the process group's."""
        if self.value is None:
            self.value, self._settled = resolve_rank_source()
            return self.value, True
        if self._settled:
            return self.value, False
        started = distributed_rank()
        if started is None:
            return self.value, False
        self.value, self._settled = started, True
        return started, True


def distributed_rank() -> str | None:
    """torch.distributed's global rank once its default process group is initialised, else
    None. Engines start it after guardrails has made its sites (vLLM's and SGLang's workers
    import their samplers first), and set no RANK variable: their workers' ranks are known
    only from here. Cheap: no environment read, one flag test while uninitialised."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass  # a half-initialised process group: not yet
    return None
