"""Prometheus counters of the guarded sites.

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
    guardrails_site_not_called{site, rank}                 gauge: 1 while an attached site
                                                           (or hook) sees no call as the
                                                           heartbeat runs (liveness)

Constant labels (`[metrics.labels]`, GUARDRAILS_METRICS_LABELS: the engine's `model_name`,
`engine`, `tp_rank`) are added to every family after these, so guardrails' series carry the
same identifying labels as the engine's own on its /metrics endpoint.

Plain `Counter`s incremented only by deltas (and one plain `Gauge`, set, in "livemax" mode),
never a custom collector, so they work unchanged in prometheus-client's multiprocess mode
(`PROMETHEUS_MULTIPROC_DIR`), where each process writes its own file and the host's
`MultiProcessCollector` sums them. `prometheus_client` is imported here only inside
functions: its multiprocess mode is fixed when it is first imported, which must be the host's
choice, not a side effect of `import guardrails`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from guardrails.flags import CountKind

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = [
    "ERROR_STAGES",
    "GUARD_ERROR_REASONS",
    "METRIC_LABELS",
    "METRIC_NAMES",
    "SLOT_SERIES",
    "Family",
    "GuardMetrics",
    "guard_metrics",
    "resolve_rank",
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

# (attribute, name without `_total`, help, labels)
_FAMILIES: Final = (
    (
        "nonfinite_values",
        "guardrails_nonfinite_values",
        "Non-finite logits values found at a guarded site (nan, posinf; neginf where counted).",
        ("site", "kind", "rank"),
    ),
    (
        "flagged_rows",
        "guardrails_flagged_rows",
        "Rows flagged at a guarded site: nonfinite values, no valid token, out-of-vocab ids.",
        ("site", "reason", "rank"),
    ),
    (
        "guard_calls",
        "guardrails_guard_calls",
        "Calls of a guarded site.",
        ("site", "rank"),
    ),
    (
        "reporting_errors",
        "guardrails_reporting_errors",
        "Exceptions contained while reading counts, writing metrics or logging.",
        ("stage", "rank"),
    ),
    (
        "guard_errors",
        "guardrails_guard_errors",
        "Calls of a patched target left unguarded because the site refused the tensor.",
        ("site", "reason", "rank"),
    ),
    (
        "attach_errors",
        "guardrails_attach_errors",
        "Attach points or engine hooks whose target did not resolve (that site is unguarded).",
        ("site", "target", "rank"),
    ),
)
# (attribute, name, help, labels): gauges, exported under their own name.
_GAUGES: Final = (
    (
        "site_not_called",
        "guardrails_site_not_called",
        "1 while an attached site (or engine hook) sees no call as the heartbeat runs "
        "liveness_steps times: it is on no path this engine runs.",
        ("site", "rank"),
    ),
)
METRIC_NAMES: Final = (
    *(f"{name}_total" for _attr, name, _help, _labels in _FAMILIES),
    *(name for _attr, name, _help, _labels in _GAUGES),
)
# Exported name -> label names: what dashboards and alert rules may select on.
METRIC_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    **{f"{name}_total": labels for _attr, name, _help, labels in _FAMILIES},
    **{name: labels for _attr, name, _help, labels in _GAUGES},
}


class Family:
    """One metric family with the instance's constant labels filled in at `.labels()`."""

    __slots__ = ("_constant", "_counter")

    def __init__(self, counter: Counter | Gauge, constant: Mapping[str, str]) -> None:
        self._counter = counter
        self._constant = dict(constant)

    def labels(self, **labels: str) -> Any:
        return self._counter.labels(**labels, **self._constant)


@dataclass(frozen=True)
class GuardMetrics:
    """The counter families of one registry (shared by every `Guardrails` using it), with one
    instance's constant labels."""

    nonfinite_values: Family
    flagged_rows: Family
    guard_calls: Family
    reporting_errors: Family
    guard_errors: Family
    attach_errors: Family
    site_not_called: Family


# The families made for a registry are kept on the registry object itself (an attribute of
# ours, not prometheus-client's), so that a reloaded or second copy of this module finds them
# instead of registering the same names again.
_FAMILIES_ATTR: Final = "_guardrails_metric_families"
_LOCK = threading.Lock()


def guard_metrics(
    registry: CollectorRegistry | None = None, constant: Mapping[str, str] | None = None
) -> GuardMetrics:
    """The counters registered in `registry` (default: the global one), made on first use,
    with `constant` labels (their names become part of every family).

    Asking again for the same registry returns the same counters, so any number of
    `Guardrails` instances share them without a duplicate-metric error; instances sharing a
    registry must use the same constant label names (their values may differ).
    """
    from prometheus_client import REGISTRY

    target = REGISTRY if registry is None else registry
    constant = dict(constant or {})
    names = tuple(sorted(constant))
    with _LOCK:
        # (constant label names, counters by attribute): the names they were made with.
        found: tuple[tuple[str, ...], dict[str, Counter | Gauge]] | None = getattr(
            target, _FAMILIES_ATTR, None
        )
        if found is None:
            counters: dict[str, Counter | Gauge] = {
                attr: _counter(target, name, text, (*labels, *names))
                for attr, name, text, labels in _FAMILIES
            }
            counters.update(
                (attr, _gauge(target, name, text, (*labels, *names)))
                for attr, name, text, labels in _GAUGES
            )
            found = (names, counters)
            setattr(target, _FAMILIES_ATTR, found)
        made, counters = found
        if made != names:
            raise ValueError(
                f"guardrails' metrics in this registry carry the constant labels "
                f"{list(made)}; this instance asks for {list(names)}: every instance "
                "sharing a registry needs the same [metrics.labels] names"
            )
        return GuardMetrics(**{attr: Family(counters[attr], constant) for attr in counters})


def _counter(registry: CollectorRegistry, name: str, text: str, labels: tuple[str, ...]) -> Counter:
    from prometheus_client import Counter

    try:
        return Counter(name, text, labels, registry=registry)
    except ValueError:
        raise ValueError(
            f"the registry already holds a metric named {name}_total that guardrails did not "
            f"register; guardrails needs that name for a Counter with labels {list(labels)}"
        ) from None


def _gauge(registry: CollectorRegistry, name: str, text: str, labels: tuple[str, ...]) -> Gauge:
    from prometheus_client import Gauge

    try:
        # livemax: in multiprocess mode the value of the live processes (one per rank label),
        # and a dead process's 1 goes when the host marks it dead.
        return Gauge(name, text, labels, registry=registry, multiprocess_mode="livemax")
    except ValueError:
        raise ValueError(
            f"the registry already holds a metric named {name} that guardrails did not "
            f"register; guardrails needs that name for a Gauge with labels {list(labels)}"
        ) from None


def resolve_rank(environ: Mapping[str, str] | None = None) -> str:
    """The `rank` label: torch.distributed's rank when initialised, else RANK, else
    LOCAL_RANK, else 0. Malformed variables are skipped: they belong to the launcher."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass  # a half-initialised process group: fall back to the launcher's variables
    env = os.environ if environ is None else environ
    for key in ("RANK", "LOCAL_RANK"):
        raw = env.get(key, "").strip()
        # ASCII only: str.isdigit() also accepts digits int() refuses, such as "²".
        if raw.isascii() and raw.isdigit():
            return str(int(raw))
    return "0"
