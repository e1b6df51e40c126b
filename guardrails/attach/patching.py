"""Import-path patching: guard a value of `package.module:Class.method` at a named site.

    handle = guards.patch("pkg.sampler:Sampler.forward", "sampler.token_ids",
                          tensor="return.sampled_token_ids", kind="token_ids",
                          vocab_size_from="arg:logits")
    handle.state        # "applied", "pending" (module not imported yet), "disabled", "removed"
    handle.remove()     # puts the original attribute back

Contract:
- A point is applied at once when its module is imported, otherwise by a post-import hook
  (wrapt) the moment it is. Applying the same point twice on one `Guardrails` wraps once and
  returns the same handle; a module that is never imported leaves the handle pending.
- A target that does not resolve, is not callable, or has no such argument raises
  `AttachError` (a `ConfigError`) naming the target and, for `[[attach]]` entries, the config
  key, when the point is applied. Launched processes turn that into a loud exit instead.
- Nothing is evaluated: targets and references are parsed by `guardrails.settings.targets`
  and resolved with `getattr` only (`guardrails.attach.resolve`).
- The handles belong to the `Guardrails` that made them (`guards.patches()`).
- `arg:` values are guarded before the call (the callee sees healed logits), `return` values
  after it. Argument positions are found once, at patch time; a call costs a tuple index or
  a dict lookup, attribute reads, and the site call. A disabled site is not wrapped at all.
- A call never fails because of guardrails: a tensor the site refuses (its `TensorTypeError`
  or `TensorValueError`), a reference that does not fit that call, or any other error of the
  guard is counted in `guardrails_guard_errors_total{site, reason, rank}`, logged once per
  (site, reason) as `guardrails.guard_error` (`GuardErrors`), and the call goes on unguarded.
  Only the device-side assert of a site in async-assert (CI) mode is let through.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from guardrails import _process
from guardrails.attach.expects import ref_problems
from guardrails.attach.handles import Handle, SiteCall
from guardrails.attach.points import AttachError, AttachPoint
from guardrails.attach.resolve import Resolved, namespace, reader, resolve, vocab_of
from guardrails.attach.wrapping import around
from guardrails.exceptions import TensorTypeError, TensorValueError
from guardrails.names import ATTACH_ERROR_EVENT, GUARD_ERROR_EVENT
from guardrails.reporting.host_time import CLOCK
from guardrails.reporting.recorder import ErrorRecorder
from guardrails.settings.targets import (
    imported_version,
    installed_version,
    parse_requirement,
    requirement_holds,
)

if TYPE_CHECKING:
    from guardrails.reporting.host_time import HostTime
    from guardrails.settings import GuardSettings

__all__ = [
    "AttachFailures",
    "GuardErrors",
    "ImportPatch",
    "NotApplied",
    "PatchHandle",
    "PatchOwner",
    "TargetReport",
    "inspect_point",
]

State = Literal["pending", "applied", "disabled", "inapplicable", "mismatch", "failed", "removed"]
Guard = Callable[..., Any]

_MARKER = "__guardrails_patch__"


class GuardErrors(ErrorRecorder):
    """Where the patches of one `Guardrails` count the calls they leave unguarded.

    `registry`, `logger` and `labels` are the owner's (see `ErrorRecorder`). Holds no lock:
    the once-per-(site, reason) log is decided by `ErrorRecorder.first`, so nothing is held
    while host code (metrics, logging) runs, and a forked child inherits nothing locked. A
    failing registry or logger is swallowed: the engine's call must go on.
    """

    FAMILY = "guard_errors"
    EVENT = GUARD_ERROR_EVENT
    LABELS = ("site", "reason")

    def prepare(self, *key: str) -> None:
        """Make the series of the site `key` names at 0 for every reason (a point was
        applied): a first error then shows as an increase, not as a new series."""
        from guardrails.reporting.metrics import GUARD_ERROR_REASONS

        (site,) = key
        for reason in GUARD_ERROR_REASONS:
            super().prepare(site, reason)

    def record(self, point: AttachPoint, reason: str, error: BaseException) -> None:
        """Count one unguarded call of `point`; log the first of each (site, reason)."""
        self.count(point.site, reason)
        if self.first(point.site, reason):
            self.log(
                site=point.site,
                reason=reason,
                target=str(point.target),
                tensor=str(point.tensor),
                error=f"{type(error).__name__}: {error}",
                action="the call went on unguarded; later ones are counted, not logged",
            )


class AttachFailures(ErrorRecorder):
    """Where one `Guardrails` counts the attach points and hooks that could not be applied.

    A target that does not resolve (an engine version without that method, a hook whose
    code no longer fits) leaves its site unguarded: `guardrails_attach_errors_total{site,
    target, rank}` counts it and `guardrails.attach_error` logs it (each time: it happens
    once per point), and the process goes on with every other site guarded. Like
    `GuardErrors`, a failing registry or logger is swallowed.
    """

    FAMILY = "attach_errors"
    EVENT = ATTACH_ERROR_EVENT
    LABELS = ("site", "target")
    # Points fail at install and at imports, some before torch.distributed starts and some
    # after: each failure reads the rank it happens on.
    REREAD_RANK = True

    def __init__(
        self, registry: Any = None, logger: Any = None, labels: dict[str, str] | None = None
    ) -> None:
        super().__init__(registry, logger, labels)
        self._lock = _process.lock(self, "_lock")
        self.failures: list[tuple[str, str, str]] = []  # (site, target, error), in order

    def record(self, *, site: str, target: str, error: BaseException) -> None:
        """One attach point (or hook) of `site` on `target` failed with `error`."""
        text = str(error) if isinstance(error, AttachError) else f"{type(error).__name__}: {error}"
        with self._lock:
            self.failures.append((site, target, text))
        self.count(site, target)
        self.log(
            site=site,
            target=target,
            error=text,
            action="this site is not guarded there; every other site still is "
            "(GUARDRAILS_STRICT_ATTACH=true makes this fatal)",
        )


class PatchOwner(Protocol):
    """What a patch needs of the `Guardrails` that owns it."""

    @property
    def closed(self) -> bool: ...

    @property
    def settings(self) -> GuardSettings: ...

    @property
    def guard_errors(self) -> GuardErrors: ...

    @property
    def host_time(self) -> HostTime: ...

    def is_enabled(self, name: str) -> bool: ...

    def site(self, name: str) -> SiteCall: ...

    def token_site(self, name: str, *, vocab_size: int) -> SiteCall: ...

    @property
    def sites(self) -> dict[str, Any]: ...


def _off(value: Any) -> None:
    return None


class NotApplied(Exception):
    """Raised by `ImportPatch._wrap`: the target resolved, but is left as it is (`state`:
    why, e.g. "mismatch" when the engine lacks what the wrapper reads)."""

    def __init__(self, state: State) -> None:
        super().__init__(state)
        self.state: State = state


class ImportPatch(Handle):
    """The one way guardrails wraps `module:Owner.attr` of code it does not own (attach
    points, the heartbeat, model loaders, engine hook parts): waiting for the module's
    import, the `when` check, resolving the target (`guardrails.attach.resolve`), wrapping it
    in place with `around()`, marking the wrapper with its handle, and putting it back.

    Subclasses say what the wrapper does (`_wrap`) and how it stops acting when it cannot be
    taken out of a chain (`_stop`). States: pending (module not imported yet), applied,
    disabled, inapplicable (`when` names other versions), mismatch (the engine lacks what the
    wrapper reads), failed, removed.
    """

    def __init__(
        self,
        point: AttachPoint,
        on_error: Callable[[AttachError], None] | None,
        on_remove: Callable[[Any], None] | None,
        closed: Callable[[], bool],
    ) -> None:
        super().__init__(self._undo, str(point))
        self.point = point
        self.error: AttachError | None = None
        self._on_error = on_error
        self._on_remove = on_remove
        self._closed = closed
        self._state: State = "pending"
        self._lock = _process.lock(self, "_lock")
        self._installed: tuple[Resolved, Any] | None = None
        # `when` names a distribution with no metadata (a source checkout on PYTHONPATH):
        # decided from the module's own __version__ once it is imported.
        self._version_unknown = False

    @property
    def state(self) -> State:
        return self._state

    def install(self) -> None:
        """Apply now if the target's module is imported, else right after it is; a point
        whose `when` requirement the installed distribution does not meet is inapplicable
        and never applied."""
        if self._state != "pending":
            return  # disabled at construction, or installed already
        when = self.point.when
        if when is not None:
            holds = requirement_holds(when)
            if holds is False:
                self._state = "inapplicable"
                return
            self._version_unknown = holds is None
        import wrapt  # late: only processes that patch pay for the import hook machinery

        wrapt.register_post_import_hook(self._on_import, self.point.target.module)

    def _on_import(self, module: Any) -> None:
        """wrapt post-import hook; also called at once for an imported module.

        A point that does not fit goes to `on_error` (which may end the process, or count
        and log it and return: then the import goes on); without one it raises."""
        try:
            self._apply(module)
        except Exception as exc:
            error = exc if isinstance(exc, AttachError) else self.point.error(repr(exc))
            self._state = "failed"
            self.error = error
            if self._on_error is None:
                if error is exc:
                    raise
                raise error from exc
            self._on_error(error)

    def _apply(self, module: Any) -> None:
        with self._lock:
            if self._state != "pending":
                return
            if self._closed():
                self._state = "removed"  # its module came after its owner was closed
                return
            point = self.point
            unknown = self._version_unknown and point.when is not None
            if unknown and not self._version_holds(point.when or ""):
                self._state = "inapplicable"
                return
            resolved = resolve(point, module)
            if inspect.isasyncgenfunction(resolved.func):
                raise point.error(
                    "is an async generator function; patch the function that consumes it"
                )
            try:
                wrapper = self._wrap(resolved)
            except NotApplied as why:
                self._state = why.state
                return
            if wrapper is None:
                self._state = "disabled"  # nothing wrapped: a disabled site costs nothing
                return
            setattr(wrapper, _MARKER, self)
            installed: Any = wrapper
            if isinstance(resolved.raw, staticmethod):
                installed = staticmethod(wrapper)
            elif isinstance(resolved.raw, classmethod):
                installed = classmethod(wrapper)
            setattr(resolved.owner, resolved.name, installed)
            self._installed = (resolved, installed)
            self._state = "applied"

    def _version_holds(self, when: str) -> bool:
        version = imported_version(when)
        holds = requirement_holds(when, version)
        if holds is None:
            name = parse_requirement(when).name
            found = "no version" if version is None else f"the version {version!r}"
            raise self.point.error(
                f"when = {when!r} cannot be checked: {name} has no distribution metadata "
                f"(imported from a source checkout or installed under another name?) and "
                f"{found} in its __version__; install it as a distribution (pip install -e "
                "<checkout>) or drop `when` from this point"
            )
        return holds

    def _wrap(self, resolved: Resolved) -> Callable[..., Any] | None:
        raise NotImplementedError

    def _stop(self) -> None:
        """The wrapper stays in the chain (someone wrapped it): make it pass calls through."""
        raise NotImplementedError

    def _undo(self) -> None:
        with self._lock:
            if self._installed is not None:
                resolved, installed = self._installed
                current = namespace(resolved.owner).get(resolved.name)
                if current is installed:
                    if resolved.own:
                        setattr(resolved.owner, resolved.name, resolved.raw)
                    else:
                        delattr(resolved.owner, resolved.name)
                else:
                    # Someone wrapped our wrapper: putting the original back would drop
                    # theirs, so ours stays in the chain and stops acting.
                    self._stop()
                self._installed = None
            self._state = "removed"
        if self._on_remove is not None:
            self._on_remove(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.point} {self._state}>"


class PatchHandle(ImportPatch):
    """One attach point on one `Guardrails`: pending until its module is imported, then
    applied (or disabled by settings). `.remove()` restores the original attribute."""

    def __init__(
        self,
        point: AttachPoint,
        guards: PatchOwner,
        on_error: Callable[[AttachError], None] | None,
        on_remove: Callable[[PatchHandle], None] | None = None,
    ) -> None:
        super().__init__(point, on_error, on_remove, lambda: guards.closed)
        self._guards = guards
        # [guard]: swapped for `_off` when the original cannot be put back (see _undo).
        self._guard: list[Guard | None] = [None]

    @property
    def guards(self) -> PatchOwner:
        return self._guards

    def _wrap(self, resolved: Resolved) -> Callable[..., Any] | None:
        point = self.point
        read = reader(point, point.tensor, resolved)
        read_vocab = None
        if point.vocab_size_from is not None:
            if point.vocab_size_from.source == "return" and point.tensor.source == "arg":
                raise point.error(
                    f"vocab_size_from = {str(point.vocab_size_from)!r} is read after the "
                    f"call but tensor = {str(point.tensor)!r} is guarded before it"
                )
            read_vocab = reader(point, point.vocab_size_from, resolved)
        if point.tensor.source == "return" and inspect.isgeneratorfunction(resolved.func):
            raise point.error(
                'is a generator function: tensor = "return" would be the generator, not the '
                "logits; guard an argument, or patch the function that consumes it"
            )
        if not self._guards.is_enabled(point.site):
            return None
        _refuse_twice(point, resolved, self._guards)
        if point.kind == "logits":
            self._guard[0] = self._guards.site(point.site)
        elif point.vocab_size is not None:
            self._guard[0] = self._token_guard(point.vocab_size)
            fixed = point.vocab_size

            def read_vocab(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> int:
                return fixed  # passed at every call: the site may be shared with other points

        self._guards.guard_errors.prepare(point.site)
        # In CI mode a site's assert must fail the process where the bad value is (on
        # the CPU it raises at once); every other error of the guard is contained.
        fatal: tuple[type[Exception], ...] = (
            (RuntimeError,) if self._guards.settings.site_settings(point.site).async_assert else ()
        )
        return _wrapper(self, resolved.func, read, read_vocab, point.tensor.source, fatal)

    def _stop(self) -> None:
        self._guard[0] = _off

    def _token_guard(self, vocab: int) -> Guard:
        """The token-id site: the one of this name if another point (or code) made it, else
        made now, sized from `vocab`. Every call passes its own vocabulary, so points whose
        vocabularies differ share the site and each is checked against its own."""
        site = self._guards.sites.get(self.point.site)
        if site is None or getattr(site, "kind", None) != "token_ids":
            site = self._guards.token_site(self.point.site, vocab_size=vocab)
        current = self._guard[0]
        if current is None:
            self._guard[0] = site
            return site
        return current  # another thread got there first, or the handle was removed

    def _unguarded(self, reason: str, error: BaseException) -> None:
        """This call goes on unguarded: counted and (once per site and reason) logged."""
        self._guards.guard_errors.record(self.point, reason, error)


def _wrapper(
    handle: PatchHandle,
    func: Callable[..., Any],
    read: Callable[[tuple[Any, ...], dict[str, Any], Any], Any],
    read_vocab: Callable[[tuple[Any, ...], dict[str, Any], Any], Any] | None,
    when: Literal["arg", "return"],
    fatal: tuple[type[Exception], ...],
) -> Callable[..., Any]:
    slot = handle._guard
    add, part = handle.guards.host_time.add, f"attach:{handle.point.site}"

    def guard(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        start = CLOCK()
        try:
            value = read(args, kwargs, result)
            if value is None:
                return
            site = slot[0]
            vocab = None
            if read_vocab is not None:
                # Read at every call: an engine may serve several vocabularies, or grow one.
                vocab = vocab_of(read_vocab(args, kwargs, result))
                if site is None:
                    site = handle._token_guard(vocab)
            if site is None:
                raise RuntimeError(f"guardrails: {handle.point} has no site")  # unreachable
        except Exception as exc:
            # The configured reference does not fit what this call passes or returns.
            handle._unguarded("reference", exc)
            return
        finally:
            add(part, CLOCK() - start)  # the site's own call is its own part
        try:
            if vocab is None:
                site(value)
            else:
                site(value, vocab)
        except fatal:
            raise
        except (TensorTypeError, TensorValueError) as exc:
            # Not a tensor at all: the reference picked the wrong value.
            reason = exc.reason if isinstance(value, torch.Tensor) else "reference"
            handle._unguarded(reason, exc)
        except Exception as exc:
            handle._unguarded("error", exc)

    if when == "arg":

        def guard_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            guard(args, kwargs, None)

        return around(func, before=guard_args)
    return around(func, after=guard)


def _refuse_twice(point: AttachPoint, resolved: Resolved, guards: PatchOwner) -> None:
    """The same value guarded twice at one site would count every call twice: by another
    live `Guardrails`, or by another point of this one (two `[[attach]]` entries for one
    target, site and tensor whose `when` ranges overlap)."""
    func: Any = resolved.func
    while func is not None:
        other = getattr(func, _MARKER, None)
        if (
            isinstance(other, PatchHandle)
            and other.point.slot == point.slot
            and other.state == "applied"
        ):
            if other.guards is not guards:
                raise point.error(
                    f"is already guarded at {point.site!r} by another Guardrails instance; "
                    "remove that handle first"
                )
            raise point.error(
                f"{point.tensor} is already guarded at {point.site!r} by {other.point.origin} "
                f"(when = {other.point.when!r}); two points for one value must not both apply: "
                "make their `when` ranges disjoint"
            )
        func = getattr(func, "__wrapped__", None)


# -- checking without patching (guardrails check) -------------------------------------------


@dataclass(frozen=True)
class TargetReport:
    """What `inspect_point` found: ok, not importable in this environment, or an error."""

    point: AttachPoint
    status: Literal["ok", "not_importable", "inapplicable", "error"]
    message: str = ""


def inspect_point(point: AttachPoint) -> TargetReport:
    """Import the target's module and check the target the way applying it would, without
    patching anything. A point whose `when` the installed version does not meet is
    inapplicable (not imported, not an error)."""
    unknown = False
    if point.when is not None:
        holds = requirement_holds(point.when)
        if holds is False:
            version = installed_version(point.when)
            return TargetReport(
                point, "inapplicable", f"for {point.when}; {version} is installed: skipped"
            )
        unknown = holds is None
    try:
        if unknown:
            # No distribution metadata: the engine may still be importable (a source
            # checkout on PYTHONPATH), and then its __version__ decides, as at run time.
            name = parse_requirement(point.when or "").name
            top = point.target.module.partition(".")[0]
            if not _importable(top):
                return TargetReport(point, "not_importable", f"{name} is not installed here")
            importlib.import_module(top)
            version = imported_version(point.when or "")
            holds = requirement_holds(point.when or "", version)
            if holds is None:
                found = "no __version__" if version is None else f"__version__ {version!r}"
                return TargetReport(
                    point,
                    "error",
                    f"when = {point.when!r} cannot be checked: {name} has no distribution "
                    f"metadata and {found}",
                )
            if not holds:
                return TargetReport(
                    point, "inapplicable", f"for {point.when}; {name} {version} is imported"
                )
        module = importlib.import_module(point.target.module)
    except ModuleNotFoundError as exc:
        top = point.target.module.partition(".")[0]
        missing = exc.name or ""
        parts = point.target.module.split(".")
        if missing and missing not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
            # The target module exists but something it imports does not: not "module not
            # found", which would send the user looking for a typo in the target.
            return TargetReport(
                point, "not_importable", f"importing {point.target.module} failed: {exc!r}"
            )
        if missing == top or not _importable(top):
            return TargetReport(point, "not_importable", f"{top} is not installed here")
        return TargetReport(
            point, "error", f"module {point.target.module} not found ({exc}); wrong version?"
        )
    except Exception as exc:  # importing someone else's package can fail in any way
        return TargetReport(
            point, "not_importable", f"importing {point.target.module} failed: {exc!r}"
        )
    try:
        resolved = resolve(point, module)
        reader(point, point.tensor, resolved)
        if point.vocab_size_from is not None:
            reader(point, point.vocab_size_from, resolved)
    except AttachError as exc:
        return TargetReport(point, "error", "; ".join(p.message for p in exc.problems))
    # What the reference reads past the call's value, against the engine's annotations.
    problems = ref_problems(resolved.func, resolved.receiver, point.tensor)
    if point.vocab_size_from is not None:
        problems += ref_problems(resolved.func, resolved.receiver, point.vocab_size_from)
    if problems:
        return TargetReport(point, "error", "; ".join(problems))
    return TargetReport(point, "ok")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
