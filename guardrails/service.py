"""`Guardrails`: the service object, a thin front over parts that each do one job.

    sites        `SiteRegistry` (guardrails.sites.registry): named sites, made on first
                 request and cached, so engine code may ask in its hot loop or keep a site
    reporting    `Reporter` (guardrails.reporting): device counts -> metrics and log events
    errors       `Recorders` (guardrails.attach.errors): attach and hook failures, counted
    attachment   `Attachment` (guardrails.attach.attachment): patches, heartbeat, hooks
    tracing      `Traces` (guardrails.attach.traces): traces and the loaders that make them

One instance per engine (or test); `default()` builds a process-wide one lazily from the
environment. Each logs `guardrails.started` once, at construction (what guards, what is off,
warnings worth a look). One dropped without `close()` still reports: when it is collected
(or at exit) its reporter flushes exact totals; only the reporter is kept for that
(`weakref.finalize`), and only until then.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from guardrails import _process
from guardrails.attach.attachment import Attachment
from guardrails.attach.errors import Recorders
from guardrails.attach.handles import GuardedFunction, Handle, attach_module
from guardrails.attach.liveness import HeartbeatHandle, Liveness
from guardrails.attach.patching import AttachFailures, GuardErrors, PatchHandle
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.attach.traces import Traces
from guardrails.distribution import clash_advice, other_owners
from guardrails.flags import CountKind
from guardrails.reporting._reporter import Reporter
from guardrails.reporting.hook_errors import HookErrors
from guardrails.reporting.host_time import HostTime
from guardrails.reporting.request_aborts import RequestAborts
from guardrails.settings import GuardSettings
from guardrails.settings.targets import newer_than_verified
from guardrails.sites import DisabledSite, LogitsSite, Site, SiteRegistry, TokenSite
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
    the global one); `clock` and `logger` exist for tests of the throttled log events;
    `installed_by` is what the start-up event says brought guardrails in ("library", or
    "launcher" / "plugin:<engine>" from `guardrails.integrations`).
    """

    def __init__(
        self,
        settings: GuardSettings | None = None,
        *,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
        installed_by: str = "library",
    ) -> None:
        self.settings = GuardSettings() if settings is None else settings
        self._reporter = Reporter(self.settings, registry=registry, clock=clock, logger=logger)
        self._sites = SiteRegistry(self.settings, self._reporter)
        self._recorders = Recorders(self.settings, registry, logger)
        sites = self._sites  # not `self`: no part keeps this instance alive
        self._traces = Traces(self.settings, self._reporter, self._recorders, lambda: sites.closed)
        self._attachment = Attachment(self, self._recorders, self._reporter, self._traces)
        # Dropped without close(): flush when collected, or at exit. A bound method of the
        # reporter, never of self, so that it does not keep this instance alive.
        self._finalizer = weakref.finalize(self, self._reporter.flush)
        self._reporter.started(startup_warnings(self.settings), installed_by)

    @classmethod
    def from_env(cls, **overrides: Any) -> Guardrails:
        """Read `GUARDRAILS_*` and the config file now; keyword arguments override both."""
        return cls(GuardSettings(**overrides))

    # -- sites (SiteRegistry) -------------------------------------------------------------

    def site(
        self, name: str, *, device: torch.device | str | None = None, capacity: int | None = None
    ) -> LogitsSite | DisabledSite:
        """The logits site `name` (created on first use); `device`/`capacity` pre-allocate
        its buffers, as needed before a CUDA-graph capture."""
        return self._sites.site(name, device=device, capacity=capacity)

    def token_site(
        self,
        name: str,
        *,
        vocab_size: int,
        device: torch.device | str | None = None,
        capacity: int | None = None,
    ) -> TokenSite | DisabledSite:
        """The token-id site `name`; ids outside `[0, vocab_size)` are flagged and replaced."""
        return self._sites.token_site(name, vocab_size=vocab_size, device=device, capacity=capacity)

    @property
    def sites(self) -> dict[str, Site]:
        """The sites created so far, by name."""
        return self._sites.sites

    def is_enabled(self, name: str) -> bool:
        """Whether a site of this name guards (without creating it)."""
        return self._sites.is_enabled(name)

    # -- attach points, patches, heartbeat, hooks (Attachment) ----------------------------

    def guard_output(
        self, site: str, *, select: Callable[[Any], torch.Tensor] | None = None
    ) -> Callable[[F], GuardedFunction]:
        """Decorator: guard the logits a function returns, in place, at `site` (`select`
        finds them in the result; default: a tensor, `.logits`, `["logits"]` or the first
        element). An `async def` stays one; its awaited result is guarded."""
        target, host_time = self.site(site), self.host_time

        def decorate(func: F) -> GuardedFunction:
            return GuardedFunction(func, target, select=select, host_time=host_time)

        return decorate

    def guard_input(self, site: str, *, arg: str = "logits") -> Callable[[F], GuardedFunction]:
        """Decorator: guard the argument `arg` in place at `site` before each call, so the
        function sees healed logits (an `async def` or generator function: when it starts).
        `ValueError` at decoration when the function has no argument of that name."""
        target, host_time = self.site(site), self.host_time

        def decorate(func: F) -> GuardedFunction:
            return GuardedFunction(func, target, arg=arg, host_time=host_time)

        return decorate

    def attach_module(
        self, module: nn.Module, site: str, *, select: Callable[[Any], torch.Tensor] | None = None
    ) -> Handle:
        """Forward hook: guard `module`'s output logits in place at `site`."""
        return attach_module(module, self.site(site), select=select)

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
        its module is imported; idempotent (`guardrails.attach.patching`). `AttachError`
        when the target does not fit, raised by the import that loads a pending one."""
        point = AttachPoint.from_arguments(
            site=site,
            target=target,
            tensor=tensor,
            kind=kind,
            vocab_size=vocab_size,
            vocab_size_from=vocab_size_from,
            when=when,
        )
        return self._attachment.patch(point)

    def patches(self) -> list[PatchHandle]:
        """Import-path patches made through this instance: applied, pending or disabled."""
        return self._attachment.patches()

    def attach_configured(
        self, *, on_error: Callable[[AttachError], None] | None = None
    ) -> list[PatchHandle]:
        """Apply the `[[attach]]` entries and the heartbeat that checks they are called (what
        `guardrails run` does). A point that does not fit goes to `on_error`; default:
        raised with `strict_attach`, else counted in `guardrails_attach_errors_total`."""
        return self._attachment.configure(on_error=on_error)

    @property
    def liveness(self) -> Liveness | None:
        """The liveness self-check, once `attach_configured()` found a heartbeat."""
        return self._attachment.liveness

    def heartbeats(self) -> list[HeartbeatHandle]:
        """The heartbeat patches (`.state`: pending, applied, failed, ...)."""
        return self._attachment.heartbeats()

    def install_hooks(self, *, on_error: Callable[[Exception], None] | None = None) -> list[Any]:
        """Install the engine hooks the `hooks` setting names (`guardrails.names.KNOWN_HOOKS`;
        what `guardrails run` does next); returns their handles. A failure goes to `on_error`;
        default: raised with `strict_attach`, else counted in `guardrails_attach_errors_total`."""
        return self._attachment.install_hooks(on_error=on_error)

    def hooks(self) -> list[Any]:
        """The engine-hook handles `install_hooks()` made (`.state`, `.calls`, `.remove()`)."""
        return self._attachment.hooks()

    def hook_off(self, name: str, target: str, state: str) -> None:
        """Report an engine-hook part that will not run (`state`: why) as off at once:
        `guardrails_site_not_called{site=name}` at 1 and `guardrails.site_not_called`."""
        self._attachment.hook_off(name, target, state)

    # -- tracing (Traces) -----------------------------------------------------------------

    def trace(
        self,
        model: nn.Module,
        modules: list[str] | tuple[str, ...] | None = None,
        *,
        mode: str | None = None,
    ) -> Trace:
        """Detect-only probes on the modules of `model` matching a glob of `modules` (default:
        `[trace]`), naming where the non-finite logits a site reports were born
        (`guardrails.tracing`); `mode`: "always", "armed", "every:N". Returns the removable
        handle. ValueError for a pattern that matches no module or a bad mode."""
        return self._traces.trace(model, modules, mode=mode)

    def traces(self) -> list[Trace]:
        """The traces made through this instance, neither removed nor ended with their
        model."""
        return self._traces.active()

    def trace_configured(self, *, on_error: Callable[[Exception], None] | None = None) -> list[Any]:
        """Trace each model the engine builds with the `[trace]` settings (what `guardrails
        run` does); returns the loader patches. A model the patterns do not fit goes to
        `on_error`, as in `install_hooks`, and runs untraced."""
        return self._traces.configure(on_error=on_error)

    # -- errors (Recorders) ---------------------------------------------------------------

    @property
    def guard_errors(self) -> GuardErrors:
        """Where this instance's patches count the calls they leave unguarded."""
        return self._recorders.guard_errors

    @property
    def attach_errors(self) -> AttachFailures:
        """Where this instance counts attach points and hooks that could not be applied."""
        return self._recorders.attach_errors

    @property
    def hook_errors(self) -> HookErrors:
        """Where this instance's engine hooks count their own failures."""
        return self._recorders.hook_errors

    @property
    def host_time(self) -> HostTime:
        """Host seconds guardrails' own code spent, by part (guardrails_host_seconds_total)."""
        return self._reporter.host_time

    @property
    def request_aborts(self) -> RequestAborts:
        """Where this instance's engine hooks count and name the requests they end."""
        return self._recorders.request_aborts

    # -- reporting (Reporter) and lifecycle -----------------------------------------------

    def poll(self) -> None:
        """Push the device counts that have reached the host to metrics and logs."""
        self._reporter.poll()

    def flush(self) -> None:
        """Push exact totals to metrics and logs now, waiting for the devices (shutdown,
        tests); unlike `close()`, reporting goes on."""
        self._reporter.flush()

    def counts(self) -> dict[tuple[str, str], int]:
        """Exact cumulative counts `{(site, kind): n}` of enabled sites (waits for devices)."""
        return self._sites.counts()

    def count(self, site: str, kind: CountKind | str) -> int:
        """One exact count, 0 for a site never created."""
        return self.counts().get((site, str(kind)), 0)

    def close(self) -> None:
        """Report everything still pending (exactly), stop reporting and remove the heartbeat
        patches, the loader patches and the traces. Idempotent."""
        if not self._sites.close():
            return
        self._attachment.close()
        self._reporter.close()
        self._traces.close()  # nothing reports for them any more
        self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._sites.closed

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
        state = "closed" if self.closed else "open"
        return f"<Guardrails {state} sites={sorted(self._sites.sites)}>"


def startup_warnings(settings: GuardSettings) -> list[str]:
    """What the start-up event (and `guardrails check`) warns about, one line each."""
    warnings = [str(notice) for notice in settings.notices]
    warnings += newer_than_verified(settings.verified_with)
    owners = other_owners()
    if owners:
        warnings.append(clash_advice(owners))
    return warnings


_default: Guardrails | None = None
# Re-made in a forked child, like every lock of guardrails (see guardrails._process).
_default_lock = _process.module_lock(__name__, "_default_lock")


def default(*, installed_by: str = "library") -> Guardrails:
    """The process-wide instance, built from the environment on first use (`installed_by`:
    what its start-up event says brought guardrails in; see `Guardrails`)."""
    global _default
    instance = _default
    if instance is None:
        with _default_lock:
            if _default is None:
                _default = Guardrails(installed_by=installed_by)
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
