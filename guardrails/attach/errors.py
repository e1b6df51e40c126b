"""`Recorders`: where one `Guardrails` counts and logs what goes wrong in attaching, never
fatally, and the one rule for an attach failure.

    guard_errors     guardrails_guard_errors_total     a call a patch left unguarded
    attach_errors    guardrails_attach_errors_total    a point, hook or trace not applied
    hook_errors      guardrails_hook_errors_total      an engine hook's own failure
    request_aborts   guardrails_requests_aborted_total the requests engine hooks end

All four use the owner's registry, logger and constant labels (`ErrorRecorder`). An attach
failure (`failed`) goes to the caller's `on_error` when there is one; otherwise it is raised
under `strict_attach` and counted and logged in `attach_errors` without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from guardrails.attach.patching import AttachFailures, GuardErrors
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.logs import HostLogger
from guardrails.reporting.hook_errors import HookErrors
from guardrails.reporting.request_aborts import RequestAborts
from guardrails.settings import GuardSettings

__all__ = ["Recorders"]


class Recorders:
    """The error recorders of one `Guardrails` (see the module docstring)."""

    def __init__(self, settings: GuardSettings, registry: Any = None, logger: Any = None) -> None:
        host_logger = HostLogger() if logger is None else logger
        labels = settings.metrics.labels
        self._strict = settings.strict_attach
        self.guard_errors = GuardErrors(registry, host_logger, labels)
        self.attach_errors = AttachFailures(registry, host_logger, labels)
        self.hook_errors = HookErrors(registry, host_logger, labels)
        self.request_aborts = RequestAborts(registry, host_logger, labels)

    def failed(
        self,
        name: str,
        target: str,
        exc: Exception,
        on_error: Callable[[Exception], None] | None,
    ) -> None:
        """`name` (a site, hook or "trace") could not be applied on `target`: to `on_error`,
        else raised under `strict_attach`, else counted and logged."""
        if on_error is not None:
            on_error(exc)
        elif self._strict:
            raise exc
        else:
            self.attach_errors.record(site=name, target=target, error=exc)

    def on_point_error(
        self, point: AttachPoint, on_error: Callable[[AttachError], None] | None
    ) -> Callable[[AttachError], None] | None:
        """What a patch of `point` calls when it does not fit: `on_error`, else (unless
        `strict_attach`, when None lets it raise) a record in `attach_errors`."""
        if on_error is None and not self._strict:
            return functools.partial(self._point_failed, point)
        return on_error

    def _point_failed(self, point: AttachPoint, error: AttachError) -> None:
        self.attach_errors.record(site=point.site, target=str(point.target), error=error)
