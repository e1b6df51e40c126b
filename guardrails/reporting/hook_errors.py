"""Where a `Guardrails` counts its engine hooks' own failures (`guardrails.integrations._hooks`).

    guardrails_hook_errors_total{hook, rank}   one per failed call of a hook's own code

The series of a hook exists at 0 once the hook applies (when the process's metrics open, see
`guardrails.reporting.metrics`); each failure is counted, and the first of each part is logged
as `guardrails.hook_error` through the owner's logger. Nothing here raises: the engine's call
goes on unhooked.
"""

from __future__ import annotations

import contextlib
from typing import Any

from guardrails.names import HOOK_ERROR_EVENT

__all__ = ["HookErrors"]


class HookErrors:
    """Where one `Guardrails` counts its engine hooks' own failures.

    `registry`, `logger` and `labels` are the owner's (None: the process's default series;
    `guardrails.logs.HostLogger`). A failing registry or logger is swallowed: the engine's
    call must go on."""

    def __init__(
        self, registry: Any = None, logger: Any = None, labels: dict[str, str] | None = None
    ) -> None:
        if logger is None:
            from guardrails.logs import HostLogger

            logger = HostLogger()
        self._registry = registry
        self._labels = labels or {}
        self._logger = logger
        self._rank: str | None = None
        self._series: dict[str, Any] = {}

    @property
    def logger(self) -> Any:
        """The owner's logger: what the hooks' other events go through."""
        return self._logger

    @property
    def rank(self) -> str:
        if self._rank is None:
            from guardrails.reporting.metrics import resolve_rank

            self._rank = resolve_rank()
        return self._rank

    def prepare(self, hook: str) -> None:
        """The hook applied: its series exists at 0 from now on."""
        with contextlib.suppress(Exception):  # retried at the first increment
            self._child(hook).create()

    def record(self, hook: str, part: str, error: BaseException, *, log: bool) -> None:
        """Count one failed call of `hook`'s `part`; log it when `log` (the first of the part)."""
        with contextlib.suppress(Exception):
            self._child(hook).inc()
        if not log:
            return
        with contextlib.suppress(Exception):
            self._logger.error(
                HOOK_ERROR_EVENT,
                hook=hook,
                part=part,
                error=f"{type(error).__name__}: {error}",
                rank=self.rank,
                action="the engine's call went on unhooked; later failures of this part are "
                "counted, not logged",
            )

    def _child(self, hook: str) -> Any:
        child = self._series.get(hook)
        if child is None:
            from guardrails.reporting.metrics import guard_metrics

            family = guard_metrics(self._registry, self._labels).hook_errors
            child = self._series[hook] = family.labels(hook=hook, rank=self.rank)
        return child
