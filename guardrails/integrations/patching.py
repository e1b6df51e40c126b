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
- Nothing is evaluated: targets and references are parsed by `guardrails.integrations.targets`
  and resolved with `getattr` only.
- `arg:` values are guarded before the call (the callee sees healed logits), `return` values
  after it. Argument positions are found once, at patch time; a call costs a tuple index or
  a dict lookup, attribute reads, and the site call. A disabled site is not wrapped at all.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from pydantic import ValidationError

from guardrails.attach import Handle
from guardrails.exceptions import ConfigError, Problem
from guardrails.integrations.targets import Ref, Target, parse_ref, parse_target
from guardrails.settings import AttachSettings

if TYPE_CHECKING:
    from guardrails.registry import Guardrails

__all__ = [
    "AttachError",
    "AttachPoint",
    "PatchHandle",
    "TargetReport",
    "apply_configured",
    "inspect_point",
    "patch",
    "patches",
]

State = Literal["pending", "applied", "disabled", "failed", "removed"]
Guard = Callable[[Any], Any]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_MARKER = "__guardrails_patch__"


class AttachError(ConfigError):
    """An attach point that cannot be applied: the message names the target."""


@dataclass(frozen=True)
class AttachPoint:
    """One parsed attach point; `origin` names where it was declared (for messages)."""

    site: str
    target: Target
    tensor: Ref
    kind: Literal["logits", "token_ids"] = "logits"
    vocab_size: int | None = None
    vocab_size_from: Ref | None = None
    origin: str = "attach target"

    @classmethod
    def from_settings(cls, entry: AttachSettings, origin: str = "attach target") -> AttachPoint:
        return cls(
            site=entry.site,
            target=parse_target(entry.target),
            tensor=parse_ref(entry.tensor),
            kind=entry.kind,
            vocab_size=entry.vocab_size,
            vocab_size_from=None
            if entry.vocab_size_from is None
            else parse_ref(entry.vocab_size_from),
            origin=origin,
        )

    @classmethod
    def from_arguments(cls, **values: Any) -> AttachPoint:
        """Validate keyword arguments the way a `[[attach]]` entry is validated."""
        try:
            entry = AttachSettings(**values)
        except ValidationError as exc:
            raise ConfigError(
                Problem(
                    "argument " + ".".join(str(p) for p in err["loc"])
                    if err["loc"]
                    else "argument",
                    err["msg"],
                    err.get("input") if isinstance(err.get("input"), str | int) else None,
                )
                for err in exc.errors(include_url=False)
            ) from None
        return cls.from_settings(entry)

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (str(self.target), self.site, str(self.tensor), self.kind)

    def error(self, message: str) -> AttachError:
        return AttachError([Problem(self.origin, message, str(self.target))])

    def __str__(self) -> str:
        return f"{self.site} <- {self.target} [{self.tensor}]"


@dataclass(frozen=True)
class _Resolved:
    """Where a target lives and how calls to it arrive."""

    owner: Any  # the module, class or object holding the attribute
    name: str
    raw: Any  # the attribute as stored: function, staticmethod, classmethod
    func: Callable[..., Any]  # the function underneath
    receiver: int  # 1 when calls arrive with self/cls first
    own: bool  # defined on `owner` itself (restore it) or inherited (delete ours)


def _resolve(point: AttachPoint, module: Any) -> _Resolved:
    owner: Any = module
    value: Any = module
    walked = point.target.module
    for part in point.target.path:
        owner = value
        try:
            value = getattr(value, part)
        except AttributeError:
            raise point.error(f"{walked} has no attribute {part!r}") from None
        walked = f"{walked}{':' if walked == point.target.module else '.'}{part}"
    name = point.target.path[-1]
    if not callable(value):
        raise point.error(f"is not callable (it is a {type(value).__name__})")
    own = name in _namespace(owner)
    if not isinstance(owner, type):
        return _Resolved(owner, name, value, value, 0, own)
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, staticmethod):
        return _Resolved(owner, name, raw, raw.__func__, 0, own)
    if isinstance(raw, classmethod):
        return _Resolved(owner, name, raw, raw.__func__, 1, own)
    if inspect.isfunction(raw):
        return _Resolved(owner, name, raw, raw, 1, own)
    raise point.error(
        f"is a {type(raw).__name__}, not a function written in Python; patch the Python "
        "function that calls it"
    )


def _namespace(owner: Any) -> Any:
    try:
        return vars(owner)
    except TypeError:
        return {}


@dataclass(frozen=True)
class _Slot:
    """Where an argument arrives: a position in `args`, a keyword, or both."""

    position: int | None
    keyword: str | None


def _locate(point: AttachPoint, ref: Ref, resolved: _Resolved) -> _Slot:
    try:
        signature = inspect.signature(resolved.func)
    except (TypeError, ValueError) as exc:
        raise point.error(f"cannot read its signature for {ref} ({exc})") from None
    params = list(signature.parameters.values())
    visible = [p.name for p in params[resolved.receiver :]]
    if ref.name is not None:
        param = signature.parameters.get(ref.name)
        if param is None or params.index(param) < resolved.receiver:
            raise point.error(
                f"has no argument {ref.name!r} (its arguments: {', '.join(visible) or 'none'})"
            )
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise point.error(f"{ref}: name a regular parameter, not *{param.name}")
        position = params.index(param) if param.kind in _POSITIONAL else None
        keyword = None if param.kind is inspect.Parameter.POSITIONAL_ONLY else param.name
        return _Slot(position, keyword)
    position = resolved.receiver + (ref.index or 0)  # the grammar gives arg:N an index
    positional = [p for p in params if p.kind in _POSITIONAL]
    if position < len(positional):
        param = positional[position]
        keyword = None if param.kind is inspect.Parameter.POSITIONAL_ONLY else param.name
        return _Slot(position, keyword)
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return _Slot(position, None)
    raise point.error(
        f"{ref} is out of range: it takes {len(positional) - resolved.receiver} positional "
        f"argument(s) ({', '.join(visible) or 'none'})"
    )


def _reader(
    point: AttachPoint, ref: Ref, resolved: _Resolved
) -> Callable[[tuple[Any, ...], dict[str, Any], Any], Any]:
    """A function (args, kwargs, result) -> the referenced value, or None when absent."""
    attrs = ref.attrs
    if ref.source == "arg":
        slot = _locate(point, ref, resolved)
        position, keyword = slot.position, slot.keyword

        def read_arg(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
            if position is not None and position < len(args):
                value = args[position]
            elif keyword is not None:
                value = kwargs.get(keyword)  # left to its default: nothing to guard
            else:
                return None
            for attr in attrs:
                if value is None:
                    return None
                value = getattr(value, attr)
            return value

        return read_arg
    index = ref.index

    def read_return(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> Any:
        value = result
        if index is not None and value is not None:
            value = value[index]
        for attr in attrs:
            if value is None:
                return None
            value = getattr(value, attr)
        return value

    return read_return


def _vocab_of(value: Any) -> int:
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 1:
        return int(shape[-1])
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"expected an int or a [..., vocab] tensor, got {type(value).__name__}")


def _off(value: Any) -> None:
    return None


class PatchHandle(Handle):
    """One attach point on one `Guardrails`: pending until its module is imported, then
    applied (or disabled by settings). `.remove()` restores the original attribute."""

    def __init__(
        self,
        point: AttachPoint,
        guards: Guardrails,
        on_error: Callable[[AttachError], NoReturn] | None,
    ) -> None:
        super().__init__(self._undo, str(point))
        self.point = point
        self.error: AttachError | None = None
        self._guards = guards
        self._on_error = on_error
        self._state: State = "pending"
        self._lock = threading.Lock()
        # [guard]: swapped for `_off` when the original cannot be put back (see _undo).
        self._guard: list[Guard | None] = [None]
        self._installed: tuple[_Resolved, Any] | None = None

    @property
    def state(self) -> State:
        return self._state

    @property
    def guards(self) -> Guardrails:
        return self._guards

    def _on_import(self, module: Any) -> None:
        """wrapt post-import hook; also called at once for an imported module."""
        try:
            self._apply(module)
        except AttachError as exc:
            self._state = "failed"
            self.error = exc
            if self._on_error is not None:
                self._on_error(exc)
            raise

    def _apply(self, module: Any) -> None:
        with self._lock:
            if self._state != "pending":
                return
            if self._guards.closed:
                self._state = "removed"  # its module came after its Guardrails was closed
                return
            point = self.point
            resolved = _resolve(point, module)
            read = _reader(point, point.tensor, resolved)
            read_vocab = None
            if point.vocab_size_from is not None:
                if point.vocab_size_from.source == "return" and point.tensor.source == "arg":
                    raise point.error(
                        f"vocab_size_from = {str(point.vocab_size_from)!r} is read after the "
                        f"call but tensor = {str(point.tensor)!r} is guarded before it"
                    )
                read_vocab = _reader(point, point.vocab_size_from, resolved)
            if not self._guards.is_enabled(point.site):
                self._state = "disabled"  # nothing wrapped: a disabled site costs nothing
                return
            _refuse_foreign(point, resolved, self._guards)
            if point.kind == "logits":
                self._guard[0] = self._guards.site(point.site)
            elif point.vocab_size is not None:
                self._guard[0] = self._guards.token_site(point.site, vocab_size=point.vocab_size)
            wrapper = _wrapper(self, resolved.func, read, read_vocab, point.tensor.source)
            setattr(wrapper, _MARKER, self)
            installed: Any = wrapper
            if isinstance(resolved.raw, staticmethod):
                installed = staticmethod(wrapper)
            elif isinstance(resolved.raw, classmethod):
                installed = classmethod(wrapper)
            setattr(resolved.owner, resolved.name, installed)
            self._installed = (resolved, installed)
            self._state = "applied"

    def _token_guard(self, value: Any) -> Guard:
        """The token-id site, sized from the first call's `vocab_size_from` value."""
        try:
            vocab = _vocab_of(value)
        except TypeError as exc:
            raise self.point.error(
                f"vocab_size_from = {self.point.vocab_size_from}: {exc}"
            ) from None
        site = self._guards.token_site(self.point.site, vocab_size=vocab)
        current = self._guard[0]
        if current is None:
            self._guard[0] = site
            return site
        return current  # another thread got there first, or the handle was removed

    def _fail(self, exc: Exception) -> NoReturn:
        error = (
            exc
            if isinstance(exc, AttachError)
            else self.point.error(f"{self.point.tensor}: {type(exc).__name__}: {exc}")
        )
        self.error = error
        if self._on_error is not None:
            self._on_error(error)
        raise error from (None if exc is error else exc)

    def _undo(self) -> None:
        with self._lock:
            if self._installed is not None:
                resolved, installed = self._installed
                current = _namespace(resolved.owner).get(resolved.name)
                if current is installed:
                    if resolved.own:
                        setattr(resolved.owner, resolved.name, resolved.raw)
                    else:
                        delattr(resolved.owner, resolved.name)
                else:
                    # Someone wrapped our wrapper: putting the original back would drop
                    # theirs, so ours stays in the chain and stops guarding.
                    self._guard[0] = _off
                self._installed = None
            self._state = "removed"
        _forget(self)

    def __repr__(self) -> str:
        return f"<PatchHandle {self.point} {self._state}>"


def _wrapper(
    handle: PatchHandle,
    func: Callable[..., Any],
    read: Callable[[tuple[Any, ...], dict[str, Any], Any], Any],
    read_vocab: Callable[[tuple[Any, ...], dict[str, Any], Any], Any] | None,
    when: Literal["arg", "return"],
) -> Callable[..., Any]:
    slot = handle._guard

    def guard(args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        try:
            value = read(args, kwargs, result)
            if value is None:
                return
            site = slot[0]
            if site is None and read_vocab is not None:
                site = handle._token_guard(read_vocab(args, kwargs, result))
            if site is None:
                raise RuntimeError(f"guardrails: {handle.point} has no site")  # unreachable
            site(value)
        except AttachError as exc:
            handle._fail(exc)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            # The configured reference does not fit what the target passes or returns.
            handle._fail(exc)

    if when == "arg":

        @functools.wraps(func)
        def guard_before(*args: Any, **kwargs: Any) -> Any:
            guard(args, kwargs, None)
            return func(*args, **kwargs)

        return guard_before

    @functools.wraps(func)
    def guard_after(*args: Any, **kwargs: Any) -> Any:
        result = func(*args, **kwargs)
        guard(args, kwargs, result)
        return result

    return guard_after


def _refuse_foreign(point: AttachPoint, resolved: _Resolved, guards: Guardrails) -> None:
    """The same point applied by another live `Guardrails` would count every call twice."""
    func: Any = resolved.func
    while func is not None:
        other = getattr(func, _MARKER, None)
        if (
            isinstance(other, PatchHandle)
            and other.point.key == point.key
            and other.state == "applied"
            and other.guards is not guards
        ):
            raise point.error(
                f"is already guarded at {point.site!r} by another Guardrails instance; remove "
                "that handle first"
            )
        func = getattr(func, "__wrapped__", None)


# Handles per Guardrails instance, for idempotence and `patches()`; weak so that a dropped
# instance takes its table with it.
_TABLES: weakref.WeakKeyDictionary[Guardrails, dict[tuple[str, str, str, str], PatchHandle]] = (
    weakref.WeakKeyDictionary()
)
_TABLES_LOCK = threading.RLock()


def _forget(handle: PatchHandle) -> None:
    with _TABLES_LOCK:
        table = _TABLES.get(handle.guards)
        if table is not None and table.get(handle.point.key) is handle:
            del table[handle.point.key]


def patch(
    guards: Guardrails,
    point: AttachPoint,
    *,
    on_error: Callable[[AttachError], NoReturn] | None = None,
) -> PatchHandle:
    """Apply `point` now if its module is imported, else when it is; idempotent per `guards`.

    Raises `AttachError` when the module is already imported and the target does not fit;
    a pending point raises from the import statement that loads its module, or calls
    `on_error` first (the launcher exits there)."""
    import wrapt  # late: only processes that patch pay for the import hook machinery

    with _TABLES_LOCK:
        table = _TABLES.setdefault(guards, {})
        existing = table.get(point.key)
        if existing is not None and existing.state != "removed":
            return existing
        handle = PatchHandle(point, guards, on_error)
        table[point.key] = handle
    # Fires at once when the module is already imported, else right after it is.
    wrapt.register_post_import_hook(handle._on_import, point.target.module)
    return handle


def patches(guards: Guardrails) -> list[PatchHandle]:
    """The live handles of `guards`, in the order they were made."""
    with _TABLES_LOCK:
        return list(_TABLES.get(guards, {}).values())


def apply_configured(
    guards: Guardrails, *, on_error: Callable[[AttachError], NoReturn] | None = None
) -> list[PatchHandle]:
    """Apply every `[[attach]]` entry of `guards.settings`."""
    handles = []
    for index, entry in enumerate(guards.settings.attach):
        origin = guards.settings.origin("attach", index, "target")
        handles.append(patch(guards, AttachPoint.from_settings(entry, origin), on_error=on_error))
    return handles


# -- checking without patching (guardrails check) -------------------------------------------


@dataclass(frozen=True)
class TargetReport:
    """What `inspect_point` found: ok, not importable in this environment, or an error."""

    point: AttachPoint
    status: Literal["ok", "not_importable", "error"]
    message: str = ""


def inspect_point(point: AttachPoint) -> TargetReport:
    """Import the target's module and check the target the way applying it would, without
    patching anything."""
    try:
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
        resolved = _resolve(point, module)
        _reader(point, point.tensor, resolved)
        if point.vocab_size_from is not None:
            _reader(point, point.vocab_size_from, resolved)
    except AttachError as exc:
        return TargetReport(point, "error", "; ".join(p.message for p in exc.problems))
    return TargetReport(point, "ok")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
