"""Where a `Guardrails` counts its engine hooks' own failures (`guardrails.integrations._hooks`).

    guardrails_hook_errors_total{hook, rank}   one per failed call of a hook's own code

The series of a hook exists at 0 once the hook applies (when the process's metrics open, see
`guardrails.reporting.metrics`); each failure is counted, and the first of each part is logged
as `guardrails.hook_error` through the owner's logger. Nothing here raises: the engine's call
goes on unhooked.
"""

from __future__ import annotations

from guardrails.names import HOOK_ERROR_EVENT
from guardrails.reporting.recorder import ErrorRecorder

__all__ = ["HookErrors"]


class HookErrors(ErrorRecorder):
    """Where one `Guardrails` counts its engine hooks' own failures.

    `registry`, `logger` and `labels` are the owner's (see `ErrorRecorder`). A failing
    registry or logger is swallowed: the engine's call must go on."""

    FAMILY = "hook_errors"
    EVENT = HOOK_ERROR_EVENT
    LABELS = ("hook",)

    def record(self, hook: str, part: str, error: BaseException, *, log: bool) -> None:
        """Count one failed call of `hook`'s `part`; log it when `log` (the first of the part,
        as its `PartFailures` decides)."""
        self.count(hook)
        if log:
            self.log(
                hook=hook,
                part=part,
                error=f"{type(error).__name__}: {error}",
                action="the engine's call went on unhooked; later failures of this part are "
                "counted, not logged",
            )
