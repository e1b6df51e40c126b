"""Where a `Guardrails` counts and names the requests its engine hooks end.

    guardrails_requests_aborted_total{hook, reason, rank}   one per ended request
    guardrails.request_aborted                              one warning event per ended request

The event carries the engine's own request id (vLLM `request_id`, SGLang `rid`, transformers
serve's request id; None where the engine has none, a bare `generate()`), the site whose
`abort_on` matched, the reason and what the client got (`status`, `finish_reason`). That id is
what an operator joins with the engine's access log or a trace span; it never becomes a label
(unbounded), and no prompt or token value is ever logged.

Counts are never throttled; the events are, per hook: at most `PER_SECOND` in any one-second
window, the rest counted and folded into the next event's `suppressed`. The series of a hook's
reasons exist at 0 once the hook applies. Nothing here raises: the engine's call goes on.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from guardrails import _process
from guardrails.names import REQUEST_ABORTED_EVENT
from guardrails.reporting.metrics import ABORT_REASONS
from guardrails.reporting.recorder import ErrorRecorder

__all__ = ["PER_SECOND", "RequestAborts"]

# Enough for every request of a poisoned batch on a small server; a storm (a bad GPU ends every
# request) stays a few lines per second while the counter keeps the exact number.
PER_SECOND: Final = 20


class _Window:
    """A hook's last `PER_SECOND` logged events' times: one more may go when the oldest of
    them is a second old (a sliding window: no span of a second holds more)."""

    __slots__ = ("logged", "suppressed")

    def __init__(self) -> None:
        self.logged: deque[float] = deque(maxlen=PER_SECOND)
        self.suppressed = 0


class RequestAborts(ErrorRecorder):
    """The requests one `Guardrails`'s engine hooks ended: counted, each named in a throttled
    event. `registry`, `logger` and `labels` are the owner's (see `ErrorRecorder`); `clock`
    (seconds, monotonic) is for tests."""

    FAMILY = "requests_aborted"
    EVENT = REQUEST_ABORTED_EVENT
    LABELS = ("hook", "reason")

    def __init__(
        self,
        registry: Any = None,
        logger: Any = None,
        labels: dict[str, str] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(registry, logger, labels)
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        # Guards the windows; held for no callback (the event is logged after it is released).
        self._lock = _process.lock(self, "_lock")

    def prepare_hook(self, hook: str) -> None:
        """Every reason's series of `hook` exists at 0 from now on."""
        for reason in ABORT_REASONS:
            self.prepare(hook, reason)

    def record(
        self,
        hook: str,
        *,
        site: str,
        reason: str,
        request_id: object,
        status: int | None,
        finish_reason: str | None,
        kv_slots_zeroed: int | None = None,
    ) -> None:
        """`hook` ended the request `request_id` (the engine's own id, or None): count it and
        log it unless this second's events of `hook` are spent. Never raises.
        `kv_slots_zeroed`: the KV slots of its own the hook zeroed (a field of the event only
        for hooks that zero them there: SGLang's)."""
        self.count(hook, reason)
        with self._lock:
            window = self._windows.get(hook)
            if window is None:
                window = self._windows[hook] = _Window()
            now = self._clock()
            logged = window.logged
            if len(logged) == PER_SECOND and now - logged[0] < 1.0:
                window.suppressed += 1
                return
            logged.append(now)
            suppressed, window.suppressed = window.suppressed, 0
        try:
            rank = self.rank
        except Exception:
            rank = "0"
        extra = {} if kv_slots_zeroed is None else {"kv_slots_zeroed": kv_slots_zeroed}
        with contextlib.suppress(Exception):
            self.logger.warning(
                self.EVENT,
                hook=hook,
                site=site,
                reason=reason,
                request_id=None if request_id is None else str(request_id),
                status=status,
                finish_reason=finish_reason,
                **extra,
                suppressed=suppressed,
                rank=rank,
            )
