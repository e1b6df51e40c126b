"""The liveness self-check: a site attached where the engine never calls it guards nothing,
and says so.

    heartbeat = "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward"
    liveness_steps = 256                         # GUARDRAILS_LIVENESS_STEPS

Engines pick runners and modes at start-up, so an attach point that resolves proves nothing:
it may sit on a method the chosen runner never calls. A heartbeat is a call every engine step
passes whatever the engine picked (the shipped profiles name one per engine). Each of its
calls is one beat: an integer increment, nothing else, and nothing is added to a guarded
call. Every `liveness_steps` beats the monitor reads the call counts of what it watches (the
sites keep them anyway) and reports each that had no call in that window:

- watched: every enabled site named by an attach point that is not for another version and
  not disabled, when its `expect_calls` is true (unset: true except at `eagle.*` sites), and
  every engine-hook half made to be called at every step (pooled under the hook's name);
- reported: warning event `guardrails.site_not_called` (site, heartbeat, steps, targets and
  their states), once until it is called again, and the gauge
  `guardrails_site_not_called{site, rank}` at 1; at the first window with a call it is 0;
- with tracing set (`[trace] modules`), whether this process traced a model at all (kind
  "installed", under the name "trace"): none at the end of a window is the warning
  `guardrails.trace_not_installed` (once until one is) and `guardrails_site_not_called
  {site="trace"}` at 1, since a model built through a loader guardrails does not patch
  would otherwise run unprobed while every origin stays silently unnamed.

A process where the heartbeat never beats (an API server, a tokenizer process) reports
nothing, so a multi-process engine is judged where it samples. Anything that fails in the
check is contained: a heartbeat is the engine's own call and must go on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from guardrails import _process
from guardrails.attach.patching import ImportPatch
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.attach.resolve import Resolved
from guardrails.attach.wrapping import around
from guardrails.reporting.host_time import CLOCK, HostTime
from guardrails.reporting.watched import Observation, Watched
from guardrails.settings.targets import Ref, parse_target

if TYPE_CHECKING:
    from guardrails.settings import GuardSettings

__all__ = ["HeartbeatHandle", "Liveness", "Observation", "Watched", "heartbeat_points"]


class Liveness:
    """Counts heartbeat calls and, every `steps` of them, hands what it watched to `report`.

    `watched()` lists the watched things afresh at each check (points apply, fail and are
    removed while the engine runs); `report(observations, heartbeat)` turns them into the
    gauge and the event, and contains its own faults.
    """

    def __init__(
        self,
        *,
        steps: int,
        heartbeat: Sequence[str],
        watched: Callable[[], Iterable[Watched]],
        report: Callable[[Sequence[Observation], str], None],
    ) -> None:
        self.steps = steps
        self.heartbeat = ", ".join(heartbeat)
        self._watched = watched
        self._report = report
        self._beats = 0
        self._due = steps
        self._last: dict[str, tuple[int, int]] = {}  # name -> (calls, beat when last called)
        self._silent: set[str] = set()
        self._lock = _process.lock(self, "_lock")

    @property
    def beats(self) -> int:
        return self._beats

    def beat(self) -> None:
        """One heartbeat call. Not locked: a lost increment under a thread race delays a
        check by one beat and costs nothing else."""
        self._beats += 1
        if self._beats >= self._due:
            self._check()

    def check(self) -> list[Observation]:
        """Look now, whatever the count (tests, `close()`); returns what it reported."""
        with self._lock:
            observations = self._observe()
        self._report(observations, self.heartbeat)
        return observations

    def _check(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # another thread is checking this window
        try:
            if self._beats < self._due:
                return
            self._due = self._beats + self.steps
            observations = self._observe()
        except Exception:
            observations = []  # a watched() that failed: the next window tries again
        finally:
            self._lock.release()
        if observations:
            # The report contains its own faults; this is the engine's call.
            with contextlib.suppress(Exception):
                self._report(observations, self.heartbeat)

    def _observe(self) -> list[Observation]:
        now = self._beats
        out = []
        for item in self._watched():
            calls, since = self._last.get(item.name, (0, 0))
            silent = item.calls == 0 if item.kind == "installed" else item.calls <= calls
            if not silent:
                since = now
            self._last[item.name] = (item.calls, since)
            first = silent and item.name not in self._silent
            if silent:
                self._silent.add(item.name)
            else:
                self._silent.discard(item.name)
            out.append(Observation(item, silent, first, now - since))
        return out


def heartbeat_points(settings: GuardSettings) -> list[AttachPoint]:
    """The settings' heartbeat targets as attach points (site "heartbeat", nothing guarded):
    what `Guardrails.attach_configured()` wraps and `guardrails check` resolves."""
    return [
        AttachPoint(
            site="heartbeat",
            target=parse_target(text),
            tensor=Ref("return"),
            origin=settings.origin("heartbeat"),
        )
        for text in settings.heartbeat
    ]


class HeartbeatHandle(ImportPatch):
    """The heartbeat target, wrapped when its module is imported: each call is one beat,
    then the engine's own call (an `async def` stays one). A beat's time goes to `host_time`
    (`guardrails_host_seconds_total{part="heartbeat"}` when it is the owner's)."""

    def __init__(
        self,
        point: AttachPoint,
        liveness: Liveness,
        on_error: Callable[[AttachError], None] | None,
        closed: Callable[[], bool],
        host_time: HostTime | None = None,
    ) -> None:
        super().__init__(point, on_error, None, closed)
        self._beat: list[Callable[[], None]] = [liveness.beat]
        self._host_time = HostTime() if host_time is None else host_time  # None: untold

    def _wrap(self, resolved: Resolved) -> Callable[..., Any]:
        slot, add = self._beat, self._host_time.add

        def beat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            start = CLOCK()
            slot[0]()
            add("heartbeat", CLOCK() - start)

        return around(resolved.func, before=beat)

    def _stop(self) -> None:
        self._beat[0] = _nothing


def _nothing() -> None:
    return None


def watched_now(
    settings: GuardSettings,
    patches: Iterable[ImportPatch],
    calls: Callable[[str], int],
    loaders: Sequence[ImportPatch],
    traced: Callable[[], int],
    hooks: Iterable[Any],
) -> list[Watched]:
    """What the self-check watches now, read afresh at each check: the sites of `patches`
    (`calls(site)`: its call count, 0 for one never made), "trace" when `loaders` are
    installed (`traced()`: the traces alive), and the halves of `hooks` that name a
    `watch_name`, pooled under it."""
    found: dict[str, tuple[list[str], list[str]]] = {}
    excused: set[str] = set()  # sites with an applied point that only some steps call
    for handle in patches:
        name = handle.point.site
        if handle.state in ("inapplicable", "disabled", "removed"):
            continue
        if not settings.is_site_enabled(name) or not settings.site_settings(name).expect_calls:
            continue
        if not handle.point.expect_calls:
            if handle.state == "applied":
                excused.add(name)
            continue
        targets, states = found.setdefault(name, ([], []))
        targets.append(str(handle.point.target))
        states.append(handle.state)
    out = []
    for name, (targets, states) in found.items():
        if name in excused and "applied" not in states:
            # What guards it here runs on some steps only; the points that should run at
            # every step are another runner's, never imported in this process.
            continue
        out.append(Watched(name, calls(name), tuple(targets), tuple(states)))
    installed = [h for h in loaders if h.state != "removed"]
    if installed:
        out.append(
            Watched(
                "trace",
                traced(),
                tuple(str(h.point.target) for h in installed),
                tuple(h.state for h in installed),
                kind="installed",
            )
        )
    halves: dict[str, list[Any]] = {}
    for hook in hooks:
        watch = getattr(hook, "watch_name", None)
        if watch is not None and hook.state in ("pending", "applied", "failed"):
            halves.setdefault(watch, []).append(hook)
    for name, pooled in halves.items():
        out.append(
            Watched(
                name,
                sum(hook.calls for hook in pooled),
                tuple(hook.path for hook in pooled),
                tuple(hook.state for hook in pooled),
            )
        )
    return out
