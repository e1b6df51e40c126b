"""Process state has one home (`guardrails._process`): every lock is made and re-made there.

Statically, no module but `_process` calls `threading.Lock()` / `RLock()` (or any other lock
constructor), and every `_process` lock is assigned to the very attribute it names (else the
child would re-make another one). At run time, in a fresh interpreter with every module
imported and a live `Guardrails`, every lock found by looking through module globals and
guardrails objects is one the registry made. And a real fork while another thread holds every
lock (the registry's, and separately every one found by looking) gives a child whose first
`Guardrails` heals and counts: on the code before `_process`, that child deadlocked (killed
past the workload's deadline, exit status 2).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from guardrails import Guardrails, GuardSettings, _process

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "guardrails"
LOCK_MAKERS = {"Lock", "RLock", "allocate_lock", "Condition", "Semaphore", "BoundedSemaphore"}
REGISTERING = {"lock", "rlock", "module_lock"}
WORKLOAD_WAIT_S = 300  # hang guard for the whole workload (its child has its own deadline)


def _called_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _sources() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path.name != "_process.py"]


def test_no_module_but_the_process_one_makes_a_lock() -> None:
    escaped = []
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            owner = func.value if isinstance(func, ast.Attribute) else None
            from_threading = isinstance(owner, ast.Name) and owner.id in ("threading", "_thread")
            bare = isinstance(func, ast.Name)
            if _called_name(node) in LOCK_MAKERS and (from_threading or bare):
                escaped.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert escaped == [], (
        f"locks made outside guardrails._process (not re-made after fork): {escaped}"
    )


def test_no_module_but_the_process_one_registers_a_fork_hook() -> None:
    # One hook, one order: a second `os.register_at_fork` elsewhere runs in an order of its
    # own relative to the locks this module re-makes (`around_fork` / `after_fork` instead).
    hooks = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _sources()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        if isinstance(node, ast.Call) and _called_name(node) == "register_at_fork"
    ]
    assert hooks == [], f"fork hooks outside guardrails._process: {hooks}"


def test_around_fork_runs_before_in_order_and_gives_back_in_reverse() -> None:
    seen: list[str] = []
    pairs = [
        (lambda: seen.append("take a"), lambda: seen.append("give a")),
        (lambda: seen.append("take b"), lambda: seen.append("give b")),
    ]
    saved = list(_process._around)
    try:
        for before, after in pairs:
            _process.around_fork(before, after)
            _process.around_fork(before, after)  # twice: once
        pid = os.fork()
        if pid == 0:
            os._exit(0 if seen == ["take a", "take b"] else 3)
        _, status = os.waitpid(pid, 0)
    finally:
        _process._around[:] = saved
    assert os.waitstatus_to_exitcode(status) == 0
    assert seen == ["take a", "take b", "give b", "give a"]


def test_every_registered_lock_is_assigned_to_the_attribute_it_names() -> None:
    wrong = []
    seen = 0
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            value = node.value
            if not isinstance(value, ast.Call) or _called_name(value) not in REGISTERING:
                continue
            func = value.func
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
                continue
            if func.value.id != "_process":
                continue
            seen += 1
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = value.args[1] if len(value.args) > 1 else None
            attr = named.value if isinstance(named, ast.Constant) else None
            (target,) = targets
            if isinstance(target, ast.Name):
                ok = func.attr == "module_lock" and target.id == attr
                ok = ok and isinstance(value.args[0], ast.Name) and value.args[0].id == "__name__"
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                first = value.args[0]
                ok = func.attr in ("lock", "rlock") and target.attr == attr
                ok = ok and isinstance(first, ast.Name) and first.id == target.value.id
            else:
                ok = False
            if not ok:
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert seen >= 15  # the walk found the package's locks at all
    assert wrong == [], f"a lock registered under another name than where it is kept: {wrong}"


def _workload(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARDRAILS_")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "tests.system.fork_workload", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=WORKLOAD_WAIT_S,
        check=False,
    )


def test_every_lock_guardrails_holds_is_one_the_registry_made() -> None:
    done = _workload("census")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    found = {where for where, _ in report["found"]}
    unregistered = sorted(where for where, registered in report["found"] if not registered)
    assert unregistered == []
    # Module globals and the instance locks of a live Guardrails with sites and a patch.
    for expected in (
        "guardrails.sites.ops:_LOCK",
        "guardrails.reporting.metrics:_bindings_lock",
        "guardrails._cuda:_exchange_lock",
        "guardrails.service:_default_lock",
        "guardrails.sites.registry.SiteRegistry._lock",
        "guardrails.sites._site.LogitsSite._lock",
        "guardrails.attach.patching.AttachFailures._lock",
        "guardrails.attach.patching.PatchHandle._lock",
    ):
        assert expected in found
    assert found <= set(report["registered"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("source", ["registry", "look"])
@pytest.mark.parametrize("mode", ["fresh", "live"])
def test_a_fork_while_another_thread_holds_every_lock_gives_a_working_child(
    mode: str, source: str
) -> None:
    done = _workload(mode, source)
    held = json.loads(done.stdout.strip().splitlines()[0])["held"]
    assert "guardrails.reporting.metrics:_bindings_lock" in held
    if mode == "live":
        assert "guardrails.attach.patching.PatchHandle._lock" in held
    # 0: the child healed and counted; 1: a wrong result; 2: it deadlocked and was killed.
    assert done.returncode == 0, done.stderr


# -- the registry itself, in this process ------------------------------------------------


class _Owner:
    pass


def test_a_registered_lock_is_listed_with_where_it_lives_and_leaves_with_its_owner() -> None:
    owner = _Owner()
    owner.guard = _process.rlock(owner, "guard")  # type: ignore[attr-defined]
    mine = [entry for entry in _process.locks() if entry.owner is owner]
    assert [(e.attr, e.reentrant, e.lock is owner.guard) for e in mine] == [("guard", True, True)]  # type: ignore[attr-defined]
    assert mine[0].where == f"{__name__}._Owner.guard"
    del owner, mine
    import gc

    gc.collect()
    assert not [e for e in _process.locks() if type(e.owner) is _Owner]


def test_bad_registrations_are_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="unknown after-fork stage 'sitez'"):
        _process.after_fork("sitez", lambda: None)
    with pytest.raises(ValueError, match=r"no module 'not\.a\.module' is being imported"):
        _process.module_lock("not.a.module", "_LOCK")
    with pytest.raises(ValueError, match="Python identifier, got 'a b'"):
        _process.lock(_Owner(), "a b")


# What this module's after-fork callbacks saw in a child (they stay registered for the
# session: in another test's child they only append here).
_SEEN: list[str] = []
_WATCHED: list[_Owner] = []


def _free(lock: Any) -> bool:
    if not lock.acquire(blocking=False):
        return False
    lock.release()
    return True


def _seeing(stage: str) -> Callable[[], None]:
    def seen() -> None:
        # Every lock is re-made before any callback runs.
        unlocked = all(_free(owner.guard) for owner in _WATCHED)  # type: ignore[attr-defined]
        _SEEN.append(stage if unlocked else f"{stage} (a stale lock)")

    return seen


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_new_unlocked_locks_and_runs_the_stages_in_order() -> None:
    owner = _Owner()
    owner.guard = _process.lock(owner, "guard")  # type: ignore[attr-defined]
    before = owner.guard  # type: ignore[attr-defined]
    _WATCHED[:] = [owner]
    callbacks = {stage: _seeing(stage) for stage in reversed(_process.STAGES)}
    for stage, callback in callbacks.items():  # registered last stage first
        _process.after_fork(stage, callback)
        _process.after_fork(stage, callback)  # twice: still run once
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with before:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave, never return into pytest
        code = 3
        try:
            now = owner.guard  # type: ignore[attr-defined]
            os.write(write, json.dumps([now is not before, _free(now), _SEEN]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        answer = json.loads(os.read(read, 4096))
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(read)
        release.set()
        holder.join(10)
    assert answer == [True, True, list(_process.STAGES)]
    assert os.waitstatus_to_exitcode(status) == 0
    assert owner.guard is before  # type: ignore[attr-defined]  # the parent keeps its own


def test_the_reporters_fork_hook_never_waits_on_a_thread_that_holds_the_live_set() -> None:
    # A thread that holds the set of live reporters at a fork (for good, as a thread stuck
    # there would) must not keep the fork from happening: the hook gives up after its wait.
    # The join timeout is a hang guard, far above that wait.
    from guardrails.reporting import _reporter

    guards = Guardrails(GuardSettings())
    live = _reporter._live
    release = threading.Event()
    holding = threading.Event()

    def hold() -> None:
        with live._lock:
            holding.set()
            release.wait(120)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(30)
        hook = threading.Thread(target=_process._before_fork, daemon=True)
        hook.start()
        hook.join(60)
        assert not hook.is_alive(), "the fork hook waited on the holder"
        _process._after_fork_in_parent()
    finally:
        release.set()
        holder.join(30)
        guards.close()
