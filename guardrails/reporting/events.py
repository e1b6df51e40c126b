"""The reporter's log events, built by pure functions: fields in, `(level, event, fields)` out.

Nothing here reads a clock, a lock or a site object, so each builder is tested on its own
(`tests/reporting/test_events.py`), as a structlog processor would be. The reporter decides
*when* an event is due (`guardrails.reporting.throttle`) and *delivers* it outside its lock;
these only say *what* it holds: counts, names, dtype and shape, never tensor values.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from guardrails.flags import CountKind
from guardrails.names import (
    METRICS_SERVED_ELSEWHERE_EVENT,
    NO_VALID_TOKEN_EVENT,
    NONFINITE_EVENT,
    NONFINITE_ORIGIN_EVENT,
    OOB_EVENT,
    REPORTING_ERROR_EVENT,
    SITE_NOT_CALLED_EVENT,
    STARTED_EVENT,
    TRACE_INSTALLED_EVENT,
    TRACE_NOT_INSTALLED_EVENT,
)

if TYPE_CHECKING:
    from guardrails.settings import GuardSettings

__all__ = [
    "Event",
    "fault_event",
    "origin_event",
    "served_elsewhere_event",
    "site_event",
    "site_not_called_event",
    "started_event",
    "trace_installed_event",
    "trace_not_installed_event",
]

# (logger method, event name, fields): decided under the reporter's lock, delivered after it.
Event = tuple[str, str, dict[str, Any]]


def site_event(
    *,
    site: str,
    kind: str,
    slots: Sequence[CountKind],
    totals: Sequence[int],
    logged: Sequence[int],
    calls_total: int,
    logged_calls: int,
    suppressed: int,
    rank: str | None,
    vocab_size: int | None,
    dtype: str | None,
    shape: Sequence[int],
) -> Event:
    """The event for one site's news since its last event.

    `totals` are the counts reported so far, one per slot of `slots`; `logged` those the
    last event carried (its deltas are the difference); `calls_total` and `logged_calls` the
    same for calls. A token-id site logs `guardrails.oob_token_ids`; a logits site
    `guardrails.no_valid_token` when rows were left with no valid token, else
    `guardrails.nonfinite_logits`."""
    if len(totals) != len(slots) or len(logged) != len(slots):
        raise ValueError(
            f"site {site!r}: {len(slots)} count slots but {len(totals)} totals and "
            f"{len(logged)} logged counts"
        )
    fields: dict[str, Any] = {"site": site, "rank": rank}
    deltas: dict[CountKind, int] = {}
    for slot, total, before in zip(slots, totals, logged, strict=True):
        deltas[slot] = total - before
        fields[str(slot)] = deltas[slot]
        fields[f"{slot}_total"] = total
    if kind == "token_ids":
        event, rows, level = OOB_EVENT, deltas.get(CountKind.ROWS_OOB_TOKEN, 0), "error"
        fields["vocab_size"] = vocab_size
    elif deltas.get(CountKind.ROWS_NO_VALID_TOKEN, 0) > 0:
        event, rows, level = NO_VALID_TOKEN_EVENT, deltas[CountKind.ROWS_NO_VALID_TOKEN], "error"
    else:
        event, rows, level = NONFINITE_EVENT, deltas.get(CountKind.ROWS_NONFINITE, 0), "warning"
    fields.update(
        rows=rows,
        calls=calls_total - logged_calls,
        calls_total=calls_total,
        dtype=dtype,
        shape=list(shape),
        suppressed=suppressed,
    )
    return level, event, fields


def fault_event(stage: str, error: BaseException, rank: str | None) -> Event:
    """`guardrails.reporting_error`: a contained fault of the reporter's `stage`."""
    return (
        "error",
        REPORTING_ERROR_EVENT,
        {"stage": stage, "error": f"{type(error).__name__}: {error}", "rank": rank},
    )


def served_elsewhere_event(addr: str, port: int) -> Event:
    """`guardrails.metrics_served_elsewhere`: a sibling process of the tree serves the port."""
    return (
        "info",
        METRICS_SERVED_ELSEWHERE_EVENT,
        {"addr": addr, "port": port, "reason": "a process tree: another process serves its series"},
    )


def started_event(
    settings: GuardSettings, warnings: Sequence[str] = (), installed_by: str = "library"
) -> Event:
    """`guardrails.started`: how guardrails came into the process (`installed_by`: "library",
    "launcher" or "plugin:<engine>"), what guards, what is off, what to look at (`warnings`,
    which make it a warning)."""
    config = settings.config_file
    fields: dict[str, Any] = {
        "installed_by": installed_by,
        "pid": os.getpid(),
        "enabled": settings.enabled,
        "sanitize": settings.sanitize,
        "async_assert": settings.async_assert,
        "sites": list(settings.enabled_sites),
        "disabled_sites": list(settings.disabled_sites),
        "metrics_port": settings.metrics.port,
        "metrics_addr": settings.metrics.addr if settings.metrics.port else None,
        "config_file": None if config is None else str(config),
        "hooks": list(settings.hooks),
        "strict_attach": settings.strict_attach,
        # What `guardrails run` traces (None: nothing); code may call trace() regardless.
        "trace": {"modules": list(settings.trace.modules), "mode": settings.trace.mode}
        if settings.trace.modules
        else None,
        "warnings": list(warnings),
    }
    return ("warning" if warnings else "info"), STARTED_EVENT, fields


def site_not_called_event(
    *,
    site: str,
    rank: str,
    heartbeat: str,
    steps: int,
    targets: Sequence[str],
    states: Sequence[str],
    calls_total: int,
    off: bool = False,
) -> Event:
    """`guardrails.site_not_called`: a watched site saw no call in a liveness window; `off`:
    an engine-hook part that was not applied (its engine lacks what it reads)."""
    return (
        "warning",
        SITE_NOT_CALLED_EVENT,
        {
            "site": site,
            "rank": rank,
            "heartbeat": heartbeat,
            "steps": steps,
            "targets": list(targets),
            "state": list(states),
            "calls_total": calls_total,
            "action": "this hook part is off: the installed engine lacks what it reads "
            "(see guardrails.attach_error; guardrails check names each field)"
            if off
            else "the engine runs a path this site is not on: it guards "
            "nothing there. Check the profile against the runner this engine "
            "picked (guardrails check; docs/runbook.md)",
        },
    )


def origin_event(
    *,
    module: str,
    site: str | None,
    kind: str,
    dtype: str | None,
    rank: str,
    step: int,
    mode: str,
) -> Event:
    """`guardrails.nonfinite_origin`: the traced module where a non-finite value was born."""
    return (
        "warning",
        NONFINITE_ORIGIN_EVENT,
        {
            "module": module,
            "site": site,
            "kind": kind,
            "dtype": dtype,
            "rank": rank,
            "step": step,
            "mode": mode,
        },
    )


def trace_installed_event(
    *, model: str, modules: int, patterns: Sequence[str], mode: str, device: str, rank: str
) -> Event:
    """`guardrails.trace_installed`: probes were put on `modules` modules of a `model`."""
    return (
        "info",
        TRACE_INSTALLED_EVENT,
        {
            "model": model,
            "modules": modules,
            "patterns": list(patterns),
            "mode": mode,
            "device": device,
            "rank": rank,
        },
    )


def trace_not_installed_event(
    *,
    rank: str,
    heartbeat: str,
    steps: int,
    loaders: Sequence[str],
    states: Sequence[str],
) -> Event:
    """`guardrails.trace_not_installed`: tracing is set, and the heartbeat ran a liveness
    window in a process that traced no model."""
    return (
        "warning",
        TRACE_NOT_INSTALLED_EVENT,
        {
            "rank": rank,
            "heartbeat": heartbeat,
            "steps": steps,
            "loaders": list(loaders),
            "state": list(states),
            "action": "this engine built its model through no loader guardrails patches: "
            "no origin will be named. Run guardrails check to see the loaders this engine "
            "version has, or trace the model in code with guards.trace(model) "
            "(docs/runbook.md)",
        },
    )
