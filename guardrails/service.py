"""`Guardrails`: the service object that owns sites, their counts and the reporter.

One instance per engine (or test); `default()` builds a process-wide one lazily from the
environment. Sites are created on first request and cached by name: asking again for the same
name returns the same object, so engine code may call `guards.site("sampler.logits")` in its
hot loop or keep the returned site.

Each instance logs `guardrails.started` once, at construction: what guards, what is switched
off, and warnings worth a look (a `[sites]` section no site uses, a metrics server reachable
from other hosts, every site off, another distribution owning the import name). An instance
dropped without `close()` still reports: when it is collected (or at interpreter exit,
whichever comes first) its reporter flushes exact totals. Only the reporter is kept for that
(by `weakref.finalize`), and only until then: a dropped instance's sites are not kept alive.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from guardrails import _process
from guardrails._sites import DisabledSite, LogitsSite, Site, TokenSite
from guardrails.attach.handles import GuardedFunction, Handle, attach_module
from guardrails.attach.liveness import HeartbeatHandle, Liveness, Watched, heartbeat_points
from guardrails.attach.loaders import trace_built_models
from guardrails.attach.patching import AttachFailures, GuardErrors, PatchHandle
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.distribution import clash_advice, other_owners
from guardrails.exceptions import Problem
from guardrails.flags import CountKind
from guardrails.logs import HostLogger
from guardrails.names import validate_site_name
from guardrails.reporting._reporter import Reporter
from guardrails.reporting.hook_errors import HookErrors
from guardrails.reporting.request_aborts import RequestAborts
from guardrails.settings import GuardSettings

if TYPE_CHECKING:
    from torch import nn

    from guardrails.tracing.tracer import Trace

__all__ = ["Guardrails", "default", "sanitize_logits_", "startup_warnings"]

F = TypeVar("F", bound=Callable[..., Any])


class Guardrails:
    """Named guarded sites built from one `GuardSettings` snapshot.

        guards = Guardrails(GuardSettings())          # or guardrails.default(): env + file
        flags = guards.site("sampler.logits")(logits)  # heals in place; uint8 RowFlag per row
        guards.token_site("sampler.token_ids", vocab_size=V)(next_ids)  # out-of-vocab -> 0
        guards.close()                                 # or `with Guardrails(...) as guards:`

    Nothing waits for the device: counts reach the metrics and log events as the reporter
    polls (every `reporting.every_calls` calls, within `reporting.report_interval_s` of a
    step by a background poll, and at `flush()` / `close()`).

    `registry` is the prometheus-client `CollectorRegistry` to register counters in (default:
    the global one); `clock` and `logger` exist for tests of the throttled log events.
    """

    def __init__(
        self,
        settings: GuardSettings | None = None,
        *,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self.settings = GuardSettings() if settings is None else settings
        self._sites: dict[str, Site] = {}
        self._lock = _process.lock(self, "_lock")
        self._closed = False
        # Import-path patches made through this instance, by point: applied, pending or
        # disabled (removed ones leave). Re-entrant: removing a handle forgets it under it.
        self._patches: dict[tuple[str, ...], PatchHandle] = {}
        self._patches_lock = _process.rlock(self, "_patches_lock")
        # Engine hooks installed through this instance, and the liveness self-check with
        # its heartbeat patches (made by attach_configured when settings name a heartbeat).
        self._hooks: list[Any] = []
        self._liveness: Liveness | None = None
        self._heartbeats: list[HeartbeatHandle] = []
        self._trace_loaders: list[Any] = []  # loader patches that trace built models
        # guards.trace() handles, by key, removed at close(); weakly: a trace ends with its
        # model, which a server may drop (guardrails.tracing.tracer).
        self._traces: weakref.WeakValueDictionary[str, Trace] = weakref.WeakValueDictionary()
        self._reporter = Reporter(self.settings, registry=registry, clock=clock, logger=logger)
        # Calls that patches leave unguarded (a tensor the site refused), counted and logged
        # once, through the same registry and the host's logging.
        host_logger = HostLogger() if logger is None else logger
        labels = self.settings.metrics.labels
        self._guard_errors = GuardErrors(registry, host_logger, labels)
        # Attach points and hooks that could not be applied: counted and logged, not fatal
        # (unless strict_attach).
        self._attach_errors = AttachFailures(registry, host_logger, labels)
        # Engine hooks' own failures at run time: counted, logged once per part, not fatal.
        self._hook_errors = HookErrors(registry, host_logger, labels)
        # The requests engine hooks end: counted, each named (its engine id) in an event.
        self._request_aborts = RequestAborts(registry, host_logger, labels)
        # Dropped without close(): flush when collected, or at exit. A bound method of the
        # reporter, never of self, so that it does not keep this instance alive.
        self._finalizer = weakref.finalize(self, self._reporter.flush)
        self._reporter.started(startup_warnings(self.settings))

    @classmethod
    def from_env(cls, **overrides: Any) -> Guardrails:
        """Read `GUARDRAILS_*` and the config file now; keyword arguments override both."""
        return cls(GuardSettings(**overrides))

    # -- sites ----------------------------------------------------------------------------

    def site(
        self,
        name: str,
        *,
        device: torch.device | str | None = None,
        capacity: int | None = None,
    ) -> LogitsSite | DisabledSite:
        """The logits site `name` (created on first use).

        `device`/`capacity` pre-allocate its buffers, as needed before a CUDA-graph capture.
        """
        site = self._sites.get(name)
        if site is None:
            site = self._create(name, "logits", device=device, capacity=capacity)
        elif device is not None:
            site.reserve(capacity or 1, device)
        if isinstance(site, TokenSite) or site.kind != "logits":
            raise ValueError(f"guardrails site {name!r} is a token-id site, not a logits site")
        return site

    def token_site(
        self,
        name: str,
        *,
        vocab_size: int,
        device: torch.device | str | None = None,
        capacity: int | None = None,
    ) -> TokenSite | DisabledSite:
        """The token-id site `name`; ids outside `[0, vocab_size)` are flagged and replaced."""
        site = self._sites.get(name)
        if site is None:
            site = self._create(
                name, "token_ids", vocab_size=vocab_size, device=device, capacity=capacity
            )
        elif device is not None:
            site.reserve(capacity or 1, device)
        if isinstance(site, LogitsSite) or site.kind != "token_ids":
            raise ValueError(f"guardrails site {name!r} is a logits site, not a token-id site")
        if isinstance(site, TokenSite) and site.vocab_size != vocab_size:
            raise ValueError(
                f"guardrails token site {name!r} exists with vocab_size={site.vocab_size}, "
                f"asked for {vocab_size}"
            )
        return site

    def _create(self, name: str, kind: str, **options: Any) -> Site:
        validate_site_name(name)
        with self._lock:
            existing = self._sites.get(name)
            if existing is not None:
                return existing
            if self._closed:
                raise RuntimeError("this Guardrails instance is closed")
            settings = self.settings
            site: Site
            if not settings.is_site_enabled(name):
                site = DisabledSite(name, kind)
            else:
                config = settings.site_settings(name)
                common: dict[str, Any] = {
                    "reporter": self._reporter,
                    "every_calls": settings.reporting.every_calls,
                    "device": options.get("device"),
                    "capacity": options.get("capacity"),
                }
                if kind == "logits":
                    site = LogitsSite(
                        name, config, min_temperature=settings.min_temperature, **common
                    )
                else:
                    rows_from = None
                    if config.on_no_valid_token == "eos":
                        logits_name = config.logits_site

                        def rows_from() -> tuple[int, torch.Tensor] | None:
                            # Looked up at each call: the logits site may be made later.
                            logits_site = self._sites.get(logits_name)
                            return None if logits_site is None else logits_site.recent()

                    site = TokenSite(
                        name,
                        config,
                        vocab_size=options["vocab_size"],
                        rows_from=rows_from,
                        **common,
                    )
                self._reporter.register(site)
            self._sites[name] = site
            return site

    @property
    def sites(self) -> dict[str, Site]:
        """The sites created so far, by name."""
        return dict(self._sites)

    def is_enabled(self, name: str) -> bool:
        """Whether a site of this name guards (without creating it)."""
        return self.settings.is_site_enabled(name)

    # -- attach helpers -------------------------------------------------------------------

    def guard_output(
        self, site: str, *, select: Callable[[Any], torch.Tensor] | None = None
    ) -> Callable[[F], GuardedFunction]:
        """Decorator: guard the logits a function returns, in place, at `site`."""
        target = self.site(site)

        def decorate(func: F) -> GuardedFunction:
            return GuardedFunction(func, target, select=select)

        return decorate

    def attach_module(
        self,
        module: nn.Module,
        site: str,
        *,
        select: Callable[[Any], torch.Tensor] | None = None,
    ) -> Handle:
        """Forward hook: guard `module`'s output logits in place at `site`."""
        return attach_module(module, self.site(site), select=select)

    def trace(
        self,
        model: nn.Module,
        modules: list[str] | tuple[str, ...] | None = None,
        *,
        mode: str | None = None,
    ) -> Trace:
        """Detect-only probes on the modules of `model` whose `named_modules()` names match
        a glob of `modules` (default: the `[trace]` settings); when a site of this instance
        reports non-finite logits, the traced module where they were born is reported
        (`guardrails.tracing`). `mode`: "always", "armed" or "every:N" (default: settings).

        Returns the removable handle (also a context manager). ValueError for a pattern that
        matches no module or a bad mode."""
        from guardrails.tracing.tracer import Trace

        config = self.settings.trace
        patterns = list(config.modules if modules is None else modules)
        if self._closed:
            raise RuntimeError("this Guardrails instance is closed")
        trace = Trace(
            model,
            patterns,
            config.mode if mode is None else mode,
            on_remove=self._forget,
            errors=self._hook_errors,
        )
        self._reporter.add_trace(trace)
        with self._lock:
            self._traces[trace.key] = trace
        return trace

    def _forget(self, trace: Trace) -> None:
        self._reporter.drop_trace(trace)
        with self._lock:
            self._traces.pop(trace.key, None)

    def traces(self) -> list[Trace]:
        """The traces made through this instance, neither removed nor ended with their
        model."""
        with self._lock:
            return [trace for trace in self._traces.values() if trace.active]

    def trace_configured(self, *, on_error: Callable[[Exception], None] | None = None) -> list[Any]:
        """Trace each model the engine builds with the `[trace]` settings (what `guardrails
        run` does; `guardrails.attach.loaders`); returns the loader patches (none when
        no module is traced). A model the patterns do not fit goes to `on_error`; default:
        raised with `strict_attach`, else counted in `guardrails_attach_errors_total
        {site="trace"}` and logged, and the model runs untraced."""

        def failed(error: AttachError) -> None:
            self._hook_failed("trace", "trace.modules", error, on_error)

        handles = trace_built_models(self, failed)
        self._trace_loaders.extend(handles)
        return list(handles)

    def patch(
        self,
        target: str,
        site: str,
        *,
        tensor: str = "return",
        kind: str = "logits",
        vocab_size: int | None = None,
        vocab_size_from: str | None = None,
        when: str | None = None,
    ) -> PatchHandle:
        """Guard a value of `target` ("package.module:Class.method") at `site`, now or when
        its module is imported; idempotent. See `guardrails.attach.patching`.

        Raises `AttachError` when the module is already imported and the target does not
        fit; a pending point raises from the import statement that loads its module."""
        point = AttachPoint.from_arguments(
            site=site,
            target=target,
            tensor=tensor,
            kind=kind,
            vocab_size=vocab_size,
            vocab_size_from=vocab_size_from,
            when=when,
        )
        return self._patch(point)

    def attach_configured(
        self, *, on_error: Callable[[AttachError], None] | None = None
    ) -> list[PatchHandle]:
        """Apply the `[[attach]]` entries of the settings, and the heartbeat that checks they
        are called (what `guardrails run` does; `guardrails.attach.liveness`).

        A point that does not fit its target (now, or when its module is imported) goes to
        `on_error`. Default: with `strict_attach` it is raised (from the import that loads
        the module, for a pending point); otherwise it is counted in
        `guardrails_attach_errors_total` and logged, and every other point still applies."""
        handles = []
        for index, entry in enumerate(self.settings.attach):
            origin = self.settings.origin("attach", index, "target")
            point = AttachPoint.from_settings(entry, origin)
            handles.append(self._patch(point, on_error=self._on_attach_error(point, on_error)))
        self._install_heartbeat(on_error)
        return handles

    def _on_attach_error(
        self, point: AttachPoint, on_error: Callable[[AttachError], None] | None
    ) -> Callable[[AttachError], None] | None:
        if on_error is None and not self.settings.strict_attach:
            return functools.partial(self._attach_failed, point)
        return on_error

    def _install_heartbeat(self, on_error: Callable[[AttachError], None] | None) -> None:
        settings = self.settings
        if not settings.heartbeat or self._liveness is not None:
            return
        self._liveness = Liveness(
            steps=settings.liveness_steps,
            heartbeat=settings.heartbeat,
            watched=self._watched,
            report=self._reporter.liveness,
        )
        for point in heartbeat_points(settings):
            handle = HeartbeatHandle(
                point, self._liveness, self._on_attach_error(point, on_error), lambda: self.closed
            )
            self._heartbeats.append(handle)
            handle.install()

    @property
    def liveness(self) -> Liveness | None:
        """The liveness self-check, once `attach_configured()` found a heartbeat."""
        return self._liveness

    def heartbeats(self) -> list[HeartbeatHandle]:
        """The heartbeat patches (`.state`: pending, applied, failed, ...)."""
        return list(self._heartbeats)

    def _watched(self) -> list[Watched]:
        """What the liveness self-check watches now (see `guardrails.attach.liveness`)."""
        settings = self.settings
        found: dict[str, tuple[list[str], list[str]]] = {}
        excused: set[str] = set()  # sites with an applied point that only some steps call
        for handle in self.patches():
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
            site = self._sites.get(name)
            out.append(
                Watched(name, 0 if site is None else site.calls, tuple(targets), tuple(states))
            )
        loaders = [h for h in self._trace_loaders if h.state != "removed"]
        if loaders:
            out.append(
                Watched(
                    "trace",
                    len(self.traces()),
                    tuple(str(h.point.target) for h in loaders),
                    tuple(h.state for h in loaders),
                    kind="installed",
                )
            )
        halves: dict[str, list[Any]] = {}
        for hook in self._hooks:
            watch = getattr(hook, "watch_name", None)
            if watch is not None and hook.state in ("pending", "applied", "error"):
                halves.setdefault(watch, []).append(hook)
        for name, hooks in halves.items():
            out.append(
                Watched(
                    name,
                    sum(hook.calls for hook in hooks),
                    tuple(hook.path for hook in hooks),
                    tuple(hook.state for hook in hooks),
                )
            )
        return out

    def _attach_failed(self, point: AttachPoint, error: AttachError) -> None:
        self._attach_errors.record(site=point.site, target=str(point.target), error=error)

    def install_hooks(self, *, on_error: Callable[[Exception], None] | None = None) -> list[Any]:
        """Install the engine hooks named by the `hooks` setting (what `guardrails run` does
        after the `[[attach]]` entries); returns their handles (`.remove()`, `.state`).

        Each name maps to guardrails' own integration code (`guardrails.names.KNOWN_HOOKS`);
        a hook registers import hooks for its engine's modules and never imports the engine
        itself. A hook that fails to install goes to `on_error`; default: raised with
        `strict_attach`, else counted in `guardrails_attach_errors_total{site=<hook>}` and
        logged."""
        import importlib

        from guardrails.names import KNOWN_HOOKS

        handles: list[Any] = []
        for name in self.settings.hooks:
            path = KNOWN_HOOKS[name]
            module_name, _, function = path.partition(":")
            try:
                installer = getattr(importlib.import_module(module_name), function)
                made = list(installer(self))
                for handle in made:
                    install = getattr(handle, "install", None)
                    if install is not None:
                        install()
                handles.extend(made)
            except Exception as exc:
                self._hook_failed(name, path, exc, on_error)
        self._hooks.extend(handles)
        for site in self.settings.unacted_abort_sites():
            # Nothing under `guardrails run` ends these rows: as loud as a missing target.
            problem = Problem(
                self.settings.origin("sites", site, "abort_on"),
                "no configured hook acts on it, so nothing ends these rows; add the engine's "
                "hook to `hooks` (guardrails.names.HOOK_ACTS_ON) or remove abort_on",
            )
            self._hook_failed(site, "abort_on", AttachError([problem]), on_error)
        return handles

    def _hook_failed(
        self,
        name: str,
        target: str,
        exc: Exception,
        on_error: Callable[[Exception], None] | None,
    ) -> None:
        if on_error is not None:
            on_error(exc)
        elif self.settings.strict_attach:
            raise exc
        else:
            self._attach_errors.record(site=name, target=target, error=exc)

    def hooks(self) -> list[Any]:
        """The engine-hook handles `install_hooks()` made (`.state`, `.calls`, `.remove()`)."""
        return list(self._hooks)

    @property
    def guard_errors(self) -> GuardErrors:
        """Where this instance's patches count the calls they leave unguarded."""
        return self._guard_errors

    @property
    def attach_errors(self) -> AttachFailures:
        """Where this instance counts attach points and hooks that could not be applied."""
        return self._attach_errors

    @property
    def hook_errors(self) -> HookErrors:
        """Where this instance's engine hooks count their own failures."""
        return self._hook_errors

    @property
    def request_aborts(self) -> RequestAborts:
        """Where this instance's engine hooks count and name the requests they end."""
        return self._request_aborts

    def patches(self) -> list[PatchHandle]:
        """Import-path patches made through this instance: applied, pending or disabled."""
        with self._patches_lock:
            return list(self._patches.values())

    def _patch(
        self, point: AttachPoint, *, on_error: Callable[[AttachError], None] | None = None
    ) -> PatchHandle:
        with self._patches_lock:
            existing = self._patches.get(point.key)
            if existing is not None and existing.state != "removed":
                return existing
            handle = PatchHandle(point, self, on_error, on_remove=self._forget_patch)
            self._patches[point.key] = handle
        # Fires at once when the module is already imported, else right after it is.
        handle.install()
        return handle

    def _forget_patch(self, handle: PatchHandle) -> None:
        with self._patches_lock:
            if self._patches.get(handle.point.key) is handle:
                del self._patches[handle.point.key]

    # -- reporting ------------------------------------------------------------------------

    def poll(self) -> None:
        """Push the device counts that have reached the host to metrics and logs."""
        self._reporter.poll()

    def flush(self) -> None:
        """Push exact totals to metrics and logs now, waiting for the devices (shutdown,
        tests); unlike `close()`, reporting goes on."""
        self._reporter.flush()

    def counts(self) -> dict[tuple[str, str], int]:
        """Exact cumulative counts `{(site, kind): n}` of enabled sites (waits for devices)."""
        out: dict[tuple[str, str], int] = {}
        for name, site in self.sites.items():
            for kind, value in site.totals().items():
                out[(name, str(kind))] = value
        return out

    def count(self, site: str, kind: CountKind | str) -> int:
        """One exact count, 0 for a site never created."""
        return self.counts().get((site, str(kind)), 0)

    def close(self) -> None:
        """Report everything still pending (exactly), stop reporting and remove the heartbeat
        patches, the loader patches and the traces. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # The heartbeat belongs to this instance's self-check: the engine's method goes back
        # (or, wrapped since by someone else, stops beating).
        for heartbeat in self._heartbeats:
            heartbeat.remove()
        self._reporter.close()
        # Nothing reports for them any more: their hooks come off the models.
        for loader in self._trace_loaders:
            loader.remove()
        with self._lock:
            traces = list(self._traces.values())
        for trace in traces:
            trace.remove()
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Guardrails:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Guardrails {state} sites={sorted(self._sites)}>"


def startup_warnings(settings: GuardSettings) -> list[str]:
    """What the start-up event (and `guardrails check`) warns about, one line each."""
    warnings = [str(notice) for notice in settings.notices]
    owners = other_owners()
    if owners:
        warnings.append(clash_advice(owners))
    return warnings


_default: Guardrails | None = None
# Re-made in a forked child, like every lock of guardrails (see guardrails._process).
_default_lock = _process.module_lock(__name__, "_default_lock")


def default() -> Guardrails:
    """The process-wide instance, built from the environment on first use."""
    global _default
    instance = _default
    if instance is None:
        with _default_lock:
            if _default is None:
                _default = Guardrails()
            instance = _default
    return instance


def _reset_default() -> Guardrails | None:
    """Forget the process-wide instance (tests, config reload); returns the old one."""
    global _default
    with _default_lock:
        old, _default = _default, None
    return old


def sanitize_logits_(
    logits: torch.Tensor, msg: str = "", *, site: str = "sampler.logits"
) -> torch.Tensor | None:
    """Guard `logits` in place at `site` of the default instance. Returns the row flags, or
    None where the site is disabled.

    A drop-in for SGLang's `sanitize_nan_logits(logits, msg="")`, which its sampler calls as
    `sanitize_nan_logits(logits, "sampler: next_token_logits")`: `msg` is that description
    of the call, accepted and not used (guardrails' events and metrics name the site, which
    is keyword-only so that a message is never taken for a site name)."""
    if not isinstance(msg, str):
        raise TypeError(f"guardrails: msg must be a str (SGLang's description), got {msg!r}")
    return default().site(site)(logits)
