"""Process state department: guardrails' locks, its live objects, and what a forked child redoes.

Every lock guardrails holds, at module level or in an object, is made here: `module_lock()` for
a module's global, `lock()` / `rlock()` for an object's attribute. Each is recorded as (owner,
attribute), the owner held weakly, so that a forked child can put a fresh lock in its place: the
forking thread is the child's only thread, and a lock another thread of the parent held at the
fork would never be released there (the child's first `Guardrails` would wait on it forever).

Objects a child must also bring up to date (a reporter's baselines, a file sink's files, a
served socket) are kept in `Live` sets and their after-fork work is registered with
`after_fork(stage, callback)`. ONE `os.register_at_fork` hook, installed when this module is
imported, is guardrails' only one. In a child it does it all in a fixed order: first every
registered lock is re-made (so that no callback can wait on a stale one), then the callbacks
run stage by stage, in the order of `STAGES`, each stage's in the order they were registered.
A callback that raises does not stop the others; the first error is raised at the end (Python
reports it as unraisable). Around the fork, in the forking process, it runs what
`around_fork(before, after_in_parent)` registered: `before` in registration order, then the
`after_in_parent` callbacks in the reverse order (what was taken first is given back last);
`hold_at_fork(live, lock_of, timeout_s)` is the common case, each live object's lock held
across the fork, never waited for without a bound. A `Live` set made with `at_exit` runs it
on the objects still alive at interpreter exit (installed with the first object added).

Nothing here imports torch or any other part of guardrails.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

__all__ = [
    "STAGES",
    "Live",
    "RegisteredLock",
    "after_fork",
    "around_fork",
    "hold_at_fork",
    "lock",
    "locks",
    "module_lock",
    "rlock",
]

_T = TypeVar("_T")

# The after-fork order. Sinks forget their parent's files before reporters take new baselines
# (a baseline may write a series); served sockets are closed last, after the series are safe.
STAGES: Final = ("sinks", "reporters", "servers")


@dataclass(frozen=True)
class RegisteredLock:
    """One lock made here, as it is now: `owner.attr` is `lock` unless the owner rebound it."""

    owner: object
    attr: str
    lock: Any
    reentrant: bool

    @property
    def where(self) -> str:
        """`module:attr` for a module's lock, `module.Class.attr` for an object's."""
        owner = self.owner
        if isinstance(owner, type(sys)):
            return f"{owner.__name__}:{self.attr}"
        kind = type(owner)
        return f"{kind.__module__}.{kind.__qualname__}.{self.attr}"


# id(owner) -> (weak reference to the owner, {attribute: re-entrant}). Entries leave when
# their owner is collected (a lock-free pop in the weakref callback: a collection may run
# while this thread holds `_registry_lock`).
_owners: dict[int, tuple[weakref.ref[Any], dict[str, bool]]] = {}
_registry_lock = threading.RLock()
_callbacks: dict[str, list[Callable[[], None]]] = {stage: [] for stage in STAGES}
# (before, after_in_parent) pairs for the forking process (`around_fork`).
_around: list[tuple[Callable[[], None], Callable[[], None]]] = []
# What `hold_at_fork` holds across a fork: the parent's to release, nothing in the child.
_held: list[list[Any]] = []


def _make(reentrant: bool) -> Any:
    return threading.RLock() if reentrant else threading.Lock()


def _register(owner: object, attr: str, reentrant: bool) -> Any:
    if not isinstance(attr, str) or not attr.isidentifier():
        raise ValueError(f"a lock's attribute must be a Python identifier, got {attr!r}")
    made = _make(reentrant)
    key = id(owner)
    with _registry_lock:
        entry = _owners.get(key)
        if entry is None or entry[0]() is not owner:
            ref: weakref.ref[Any] = weakref.ref(owner, _forgetting(key))
            entry = _owners[key] = (ref, {})
        entry[1][attr] = reentrant
    return made


def _forgetting(key: int) -> Callable[[weakref.ref[Any]], None]:
    def forget(ref: weakref.ref[Any]) -> None:
        entry = _owners.get(key)
        if entry is not None and entry[0] is ref:
            _owners.pop(key, None)

    return forget


def lock(owner: object, attr: str) -> threading.Lock:
    """A new lock for `owner.attr` (assign it there), re-made there in a forked child."""
    made: threading.Lock = _register(owner, attr, reentrant=False)
    return made


def rlock(owner: object, attr: str) -> threading.RLock:
    """A new re-entrant lock for `owner.attr` (assign it there), re-made in a forked child."""
    made: threading.RLock = _register(owner, attr, reentrant=True)
    return made


def module_lock(module: str, attr: str) -> threading.Lock:
    """A new lock for the global `attr` of the module named `module` (pass `__name__`; the
    module is in `sys.modules` while its body runs), re-made there in a forked child."""
    try:
        owner = sys.modules[module]
    except KeyError:
        raise ValueError(
            f"no module {module!r} is being imported; pass the module's __name__"
        ) from None
    made: threading.Lock = _register(owner, attr, reentrant=False)
    return made


def locks() -> list[RegisteredLock]:
    """Every lock made here whose owner is alive, as bound now (tests, diagnostics)."""
    with _registry_lock:
        entries = [(ref(), dict(attrs)) for ref, attrs in _owners.values()]
    found: list[RegisteredLock] = []
    for owner, attrs in entries:
        if owner is None:
            continue
        for attr, reentrant in attrs.items():
            found.append(RegisteredLock(owner, attr, getattr(owner, attr, None), reentrant))
    return found


def after_fork(stage: str, callback: Callable[[], None]) -> None:
    """Run `callback` in a forked child, in `stage` (one of `STAGES`), after every lock is
    re-made. Registering the same callback twice runs it once."""
    if stage not in _callbacks:
        raise ValueError(f"unknown after-fork stage {stage!r}; expected one of {list(STAGES)}")
    with _registry_lock:
        if callback not in _callbacks[stage]:
            _callbacks[stage].append(callback)


def around_fork(before: Callable[[], None], after_in_parent: Callable[[], None]) -> None:
    """Run `before` in the forking process just before a fork and `after_in_parent` there
    just after it (what `before` took, `after_in_parent` gives back; the child gets its fresh
    locks and `after_fork` callbacks instead). Registering the same pair twice runs it once."""
    with _registry_lock:
        if (before, after_in_parent) not in _around:
            _around.append((before, after_in_parent))


def hold_at_fork(live: Live[_T], lock_of: Callable[[_T], Any], timeout_s: float) -> None:
    """Around each fork, hold `lock_of(obj)` (None: nothing to hold) of each object in
    `live`, so that no other thread of the forking process is inside what it guards (a poll
    inside prometheus-client would leave that library's own lock held in the child for good),
    and release them in the parent after the fork. Never an unbounded wait: another thread
    may hold the set's lock or an object's for good; each is waited for at most `timeout_s`
    and the fork goes on without it (the child re-makes every lock either way)."""
    held: list[Any] = []

    def before() -> None:
        for obj in live.snapshot(timeout=timeout_s):
            found = lock_of(obj)
            if found is not None and found.acquire(timeout=timeout_s):
                held.append(found)

    def after_in_parent() -> None:
        while held:
            held.pop().release()

    with _registry_lock:
        _held.append(held)
    around_fork(before, after_in_parent)


def _before_fork() -> None:
    for before, _ in list(_around):
        before()


def _after_fork_in_parent() -> None:
    for _, after in reversed(list(_around)):
        after()


class Live(Generic[_T]):
    """The objects of one kind alive in this process, held weakly (a dropped `Guardrails` is
    still collected). Iterating gives a snapshot, safe while others add or leave.

    `at_exit(objects)` runs at interpreter exit on the objects alive then; it is installed
    with the first object added, not before (an exit hook runs before those installed
    earlier: the host's own)."""

    def __init__(self, at_exit: Callable[[list[_T]], None] | None = None) -> None:
        self._items: weakref.WeakSet[_T] = weakref.WeakSet()
        self._lock = lock(self, "_lock")
        self._at_exit = at_exit

    def add(self, item: _T) -> None:
        with self._lock:
            self._items.add(item)
            at_exit, self._at_exit = self._at_exit, None
        if at_exit is not None:
            atexit.register(lambda: at_exit(list(self)))

    def discard(self, item: _T) -> None:
        with self._lock:
            self._items.discard(item)

    def __iter__(self) -> Iterator[_T]:
        with self._lock:
            snapshot = list(self._items)
        return iter(snapshot)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def snapshot(self, timeout: float) -> list[_T]:
        """The objects alive now, waiting at most `timeout` seconds for another thread that
        holds the set's lock; [] if it still does (a fork hook must not wait on a thread
        that may hold it for good)."""
        if not self._lock.acquire(timeout=timeout):
            return []
        try:
            return list(self._items)
        finally:
            self._lock.release()


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.RLock()
    for held in _held:
        held.clear()  # the parent's to release
    for ref, attrs in list(_owners.values()):
        owner = ref()
        if owner is None:
            continue
        for attr, reentrant in attrs.items():
            setattr(owner, attr, _make(reentrant))
    first: BaseException | None = None
    for stage in STAGES:
        for callback in list(_callbacks[stage]):
            try:
                callback()
            except Exception as exc:  # the others still run; the first is raised below
                first = first or exc
    if first is not None:
        raise first


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
