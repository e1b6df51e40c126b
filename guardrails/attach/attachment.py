"""`Attachment`: what one `Guardrails` attaches to engine code it does not own.

- points and patches: `patch()` and the `[[attach]]` entries (`configure()`), one
  `PatchHandle` per point, kept by point until removed (`guardrails.attach.patching`);
- the heartbeat and the liveness self-check that says when an attached site is never called
  (`guardrails.attach.liveness`), installed with the `[[attach]]` entries;
- engine hooks: the `hooks` setting's installers (`guardrails.names.KNOWN_HOOKS`), each given
  the owner, never importing the engine itself.

What fails to apply goes to `Recorders.failed` (`guardrails.attach.errors`). The owner is the
`Guardrails` the patches and hooks guard through (its sites, settings and recorders), held
weakly here (what is patched holds it), so that an instance with nothing attached is freed
as soon as it is dropped, and its reporter flushes then.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import Any

from guardrails import _process
from guardrails.attach.errors import Recorders
from guardrails.attach.liveness import (
    HeartbeatHandle,
    Liveness,
    Observation,
    Watched,
    heartbeat_points,
    watched_now,
)
from guardrails.attach.patching import PatchHandle, PatchOwner
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.attach.traces import Traces
from guardrails.exceptions import Problem
from guardrails.names import KNOWN_HOOKS
from guardrails.reporting._reporter import Reporter

__all__ = ["Attachment"]


class Attachment:
    """The patches, heartbeat and engine hooks of one `Guardrails` (`owner`)."""

    def __init__(
        self, owner: PatchOwner, recorders: Recorders, reporter: Reporter, traces: Traces
    ) -> None:
        self._owner = weakref.ref(owner)
        self._settings = owner.settings
        self._recorders = recorders
        self._reporter = reporter
        self._traces = traces
        # By point: applied, pending or disabled (removed ones leave). Re-entrant: removing
        # a handle forgets it under it.
        self._patches: dict[tuple[str, ...], PatchHandle] = {}
        self._lock = _process.rlock(self, "_lock")
        self._hooks: list[Any] = []
        self._liveness: Liveness | None = None
        self._heartbeats: list[HeartbeatHandle] = []

    def _guards(self) -> PatchOwner:
        owner = self._owner()
        if owner is None:  # the owner calls in: never while it is being collected
            raise RuntimeError("this Guardrails instance is gone")
        return owner

    # -- points and patches ---------------------------------------------------------------

    def patch(
        self, point: AttachPoint, *, on_error: Callable[[AttachError], None] | None = None
    ) -> PatchHandle:
        """The patch of `point`, installed now or when its module is imported; the same
        handle for a point already patched and not removed."""
        with self._lock:
            existing = self._patches.get(point.key)
            if existing is not None and existing.state != "removed":
                return existing
            handle = PatchHandle(point, self._guards(), on_error, on_remove=self._forget)
            self._patches[point.key] = handle
        # Fires at once when the module is already imported, else right after it is.
        handle.install()
        return handle

    def _forget(self, handle: PatchHandle) -> None:
        with self._lock:
            if self._patches.get(handle.point.key) is handle:
                del self._patches[handle.point.key]

    def patches(self) -> list[PatchHandle]:
        """The patches made here: applied, pending or disabled."""
        with self._lock:
            return list(self._patches.values())

    def configure(
        self, *, on_error: Callable[[AttachError], None] | None = None
    ) -> list[PatchHandle]:
        """Patch the `[[attach]]` entries of the settings, then install the heartbeat."""
        handles = []
        settings = self._settings
        for index, entry in enumerate(settings.attach):
            point = AttachPoint.from_settings(entry, settings.origin("attach", index, "target"))
            on_point_error = self._recorders.on_point_error(point, on_error)
            handles.append(self.patch(point, on_error=on_point_error))
        self._install_heartbeat(on_error)
        return handles

    # -- heartbeat and liveness -----------------------------------------------------------

    def _install_heartbeat(self, on_error: Callable[[AttachError], None] | None) -> None:
        settings = self._settings
        if not settings.heartbeat or self._liveness is not None:
            return
        self._liveness = Liveness(
            steps=settings.liveness_steps,
            heartbeat=settings.heartbeat,
            watched=self._watched,
            report=self._reporter.liveness,
        )
        owner = self._guards()
        for point in heartbeat_points(settings):
            on_point_error = self._recorders.on_point_error(point, on_error)
            handle = HeartbeatHandle(
                point,
                self._liveness,
                on_point_error,
                lambda: owner.closed,
                self._reporter.host_time,
            )
            self._heartbeats.append(handle)
            handle.install()

    def _watched(self) -> list[Watched]:
        owner = self._owner()
        sites = {} if owner is None else owner.sites

        def calls(name: str) -> int:
            site = sites.get(name)
            return 0 if site is None else int(site.calls)

        return watched_now(
            self._settings,
            self.patches(),
            calls,
            self._traces.loaders(),
            lambda: len(self._traces.active()),
            self._hooks,
        )

    @property
    def liveness(self) -> Liveness | None:
        """The liveness self-check, once `configure()` found a heartbeat."""
        return self._liveness

    def heartbeats(self) -> list[HeartbeatHandle]:
        """The heartbeat patches (`.state`: pending, applied, failed, ...)."""
        return list(self._heartbeats)

    # -- engine hooks ---------------------------------------------------------------------

    def install_hooks(self, *, on_error: Callable[[Exception], None] | None = None) -> list[Any]:
        """Install the hooks the `hooks` setting names, each given the owner; then report
        each `abort_on` site no installed hook acts on as an attach failure."""
        handles: list[Any] = []
        settings = self._settings
        for name in settings.hooks:
            path = KNOWN_HOOKS[name]
            module_name, _, function = path.partition(":")
            try:
                installer = getattr(importlib.import_module(module_name), function)
                made = list(installer(self._guards()))
                for handle in made:
                    install = getattr(handle, "install", None)
                    if install is not None:
                        install()
                handles.extend(made)
            except Exception as exc:
                self._recorders.failed(name, path, exc, on_error)
        self._hooks.extend(handles)
        for site in settings.unacted_abort_sites():
            # Nothing under `guardrails run` ends these rows: as loud as a missing target.
            problem = Problem(
                settings.origin("sites", site, "abort_on"),
                "no configured hook acts on it, so nothing ends these rows; add the engine's "
                "hook to `hooks` (guardrails.names.HOOK_ACTS_ON) or remove abort_on",
            )
            self._recorders.failed(site, "abort_on", AttachError([problem]), on_error)
        return handles

    def hooks(self) -> list[Any]:
        """The engine-hook handles `install_hooks()` made."""
        return list(self._hooks)

    def hook_off(self, name: str, target: str, state: str) -> None:
        """An engine-hook part that will not run in this process (`state`: why): reported
        now as the liveness self-check reports a silent one, gauge at 1 and the event, in
        every process (the engine core has no heartbeat to wait for)."""
        watched = Watched(name, 0, (target,), (state,), kind="off")
        observation = Observation(watched, silent=True, first=True, steps=0)
        self._reporter.liveness([observation], "(none: not applied)")

    def close(self) -> None:
        """Remove the heartbeat patches: the engine's method goes back (or, wrapped since by
        someone else, stops beating). Patches and hooks stay: they are the caller's."""
        for heartbeat in self._heartbeats:
            heartbeat.remove()
