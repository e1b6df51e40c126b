"""A process that forks while another thread holds every lock guardrails made; run by
`tests/system/test_process_state.py` in a fresh interpreter, from the repository root:

    python -m tests.system.fork_workload fresh   # no Guardrails before the fork
    python -m tests.system.fork_workload live    # one with sites and a patch before it
    python -m tests.system.fork_workload census  # print every lock found, as JSON
    python -m tests.system.fork_workload live look  # hold the locks found by looking instead

Every module of the package is imported first, so that every module-level lock exists. A
thread then acquires each lock `guardrails._process.locks()` lists (with "live": the instance's
too) and keeps them while the main thread forks. The child builds its first `Guardrails` on the
process's default registry, guards a NaN and an out-of-vocab id, and exits 0 when both were
healed and counted. The parent waits for it with a deadline (CHILD_WAIT_S) and kills it past
that: exit status 0 means the child worked, 1 a wrong result, 2 a deadlocked child.
"""

from __future__ import annotations

import gc
import importlib
import json
import math
import os
import pkgutil
import signal
import sys
import threading
import time
from typing import Any

CHILD_WAIT_S = 60.0  # a hang guard, not a speed check: a working child exits in well under it
LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def import_everything() -> list[str]:
    """Import every module of the package (not the ones run as scripts: `__main__`, and
    sitecustomize, which `site` runs)."""
    import guardrails

    names = []
    for info in pkgutil.walk_packages(guardrails.__path__, "guardrails."):
        if info.name.rpartition(".")[2] in ("sitecustomize", "__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
    return names


def reachable_locks() -> list[tuple[str, Any]]:
    """Every lock held in a guardrails module's globals or a guardrails object's attributes
    (guardrails._process's own excepted), found by looking, not by asking the registry."""
    found: list[tuple[str, Any]] = []
    for name, module in list(sys.modules.items()):
        if name == "guardrails._process" or not name.startswith("guardrails"):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, LOCK_TYPES):
                found.append((f"{name}:{attr}", value))
    for obj in gc.get_objects():
        kind = type(obj)
        module = getattr(kind, "__module__", None)
        if not isinstance(module, str) or not module.startswith("guardrails"):
            continue
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        for attr, value in list(attrs.items()):
            if isinstance(value, LOCK_TYPES):
                found.append((f"{module}.{kind.__qualname__}.{attr}", value))
    return found


def census() -> dict[str, Any]:
    """Every reachable lock, whether `guardrails._process` registered that very object, and
    what the registry lists."""
    from guardrails import _process

    registered = {id(entry.lock) for entry in _process.locks()}
    found = [(where, id(value) in registered) for where, value in reachable_locks()]
    return {"found": found, "registered": sorted({e.where for e in _process.locks()})}


def locks_to_hold(source: str) -> tuple[list[str], list[Any]]:
    """The registry's locks ("registry"), or every lock found by looking ("look": also runs
    on a tree without `guardrails._process`, the check that the test fails on the code
    before it)."""
    if source == "look":
        found = reachable_locks()
        return sorted({where for where, _ in found}), [value for _, value in found]
    from guardrails import _process

    entries = _process.locks()
    return sorted({e.where for e in entries}), [e.lock for e in entries]


def build_live() -> Any:
    """A `Guardrails` with a logits site, a token-id site and an import-path patch, used once."""
    import torch

    from guardrails import Guardrails, GuardSettings
    from guardrails.logs import SilentLogger

    guards = Guardrails(GuardSettings(environ={}), logger=SilentLogger())
    guards.site("sampler.logits")(torch.randn(2, 8))
    guards.token_site("sampler.token_ids", vocab_size=16)(torch.tensor([1, 2]))
    guards.patch("tests.system.fork_workload:make_logits", site="sampler.logits")
    make_logits(guards)
    return guards


def make_logits(_guards: Any) -> Any:
    """What the live instance's patch guards (called once in the parent)."""
    import torch

    return torch.zeros(1, 4)


def child() -> int:
    """The forked child's work: 0 if a first `Guardrails` heals and counts."""
    import torch

    from guardrails import Guardrails, GuardSettings, RowFlag
    from guardrails.logs import SilentLogger

    guards = Guardrails(GuardSettings(environ={}), logger=SilentLogger())
    logits = guards.site("sampler.logits")
    ids = guards.token_site("sampler.token_ids", vocab_size=16)
    x = torch.randn(2, 8)
    x[0, 3] = math.nan
    tokens = torch.tensor([3, 40])
    flags = logits(x)
    id_flags = ids(tokens)
    ok = (
        flags is not None
        and flags.tolist() == [int(RowFlag.NAN), 0]
        and x[0, 3].item() == -math.inf
        and id_flags is not None
        and id_flags.tolist() == [0, int(RowFlag.OOB_TOKEN)]
        and tokens.tolist() == [3, 0]
        and guards.counts().get(("sampler.logits", "nan")) == 1
        and guards.counts().get(("sampler.token_ids", "oob_token")) == 1
    )
    guards.close()
    return 0 if ok else 1


def child_status(pid: int, wait_s: float) -> int | str:
    """A forked child's exit status, or "deadlocked" (killed) if it outlives `wait_s`."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "deadlocked"


def fork_while_held(locks: list[Any]) -> int:
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        for each in locks:
            each.acquire()
        held.set()
        release.wait(CHILD_WAIT_S * 2)
        for each in reversed(locks):
            each.release()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    if not held.wait(CHILD_WAIT_S):
        print("the holder thread could not take every lock", file=sys.stderr)
        return 3
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller
        code = 4
        try:
            code = child()
        finally:
            os._exit(code)
    try:
        status = child_status(pid, CHILD_WAIT_S)
        if status == "deadlocked":
            print("the forked child deadlocked: killed", file=sys.stderr)
            return 2
        return status
    finally:
        release.set()
        holder.join(CHILD_WAIT_S)


def main(mode: str, source: str = "registry") -> int:
    import_everything()
    keep = build_live() if mode in ("live", "census") else None
    if mode == "census":
        print(json.dumps(census()))
        return 0
    names, locks = locks_to_hold(source)
    print(json.dumps({"held": names}))
    code = fork_while_held(locks)
    del keep
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
