"""The tree keeper: one small process per `guardrails run` that lives as long as the command,
and does for the process tree what no process of the tree can be trusted to do at its own exit.

- It serves `GUARDRAILS_METRICS_PORT` (when > 0) for the tree's whole life: prometheus-client's
  server over the tree's files (`guardrails.reporting.exposition.serve`, with the marker every
  process of the tree finds, so each of them logs `guardrails.metrics_served_elsewhere`). A
  short-lived Python child that served first took the port away when it exited.
- When the command ends, it stops serving and removes the tree's metrics directory if the
  launcher made it, whatever the command was (a shell, an entrypoint script) and however it
  ended (SIGKILL included). The removal follows the command's end by moments, never precedes it.

The launcher starts it (`start`) before it becomes the command, and waits (bounded) for its
answer: a port it cannot bind comes back as the error binding raised, before anything runs;
any other failure is the keeper's own (`Keeper.problem`), and the command runs regardless.
It is started by a double fork, so it is no child of the command (a shell's bare `wait` never
waits for it), in a session of its own (the command's process-group signals, a terminal's
Ctrl-C and an engine's `killpg` of its group never reach it), in `/`, with stdin, stdout and
stderr on /dev/null and no other descriptor of the launcher's (it never holds the caller's
pipes open). It watches the command's pid through a pidfd opened by the launcher (exec keeps
the pid), else by polling it. It ignores SIGTERM, SIGINT and SIGHUP: a supervisor that signals
every process it started (systemd's control group) stops the command, and the keeper ends after
it, its work done; removing the directory while the command still writes its last counts would
be worse. It is a fresh interpreter that runs none of `guardrails`'
package `__init__` (which imports torch) and imports prometheus-client only to serve.
Whatever fails in it stays in it: the command never sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from guardrails.reporting import exposition

__all__ = ["NAME", "Keeper", "main", "start"]

NAME: Final = "guardrails-tree"  # what `ps` shows (the process's comm), where it can be set

_PACKAGE: Final = Path(__file__).resolve().parents[1]
# The keeper's interpreter binds `guardrails` to this checkout's package without running its
# `__init__` (torch and the whole service: hundreds of MB and a second per launch, for a
# process that only watches a pid and serves files); the submodules it needs import torch-free.
_BOOT: Final = (
    "import importlib.util, sys\n"
    "package = sys.argv[1]\n"
    "spec = importlib.util.spec_from_file_location(\n"
    "    'guardrails', package + '/__init__.py', submodule_search_locations=[package])\n"
    "sys.modules['guardrails'] = importlib.util.module_from_spec(spec)\n"
    "from guardrails.integrations.tree_keeper import main\n"
    "main(sys.argv[2])\n"
)
_POLL_S: Final = 0.2  # without a pidfd: how often the command's pid is looked at
_STOP: Final = b"s"


@dataclass(frozen=True)
class _Plan:
    """What one keeper does (sent to it as JSON on its command line)."""

    pid: int  # the command's
    pidfd: int  # -1: none, poll `pid`
    ready: int  # the keeper's answer goes here; closed when it ends
    stop: int  # a byte here: the command never ran, end now
    remove: str | None  # the directory the launcher made
    tree: str | None  # the tree's directory: the marker, announced directories
    addr: str
    port: int  # 0: serve nothing
    show: tuple[str, ...]  # directories read besides the tree's


class Keeper:
    """The launcher's end of a keeper. As a context manager, leaving the block (the command
    did not start: exec raised) stops it.

    `problem`: why the keeper is not doing all it was asked (it did not start, failed, or had
    not answered in time: a late one still does its work), or None."""

    def __init__(self, ready: int = -1, stop: int = -1, problem: str | None = None) -> None:
        self._ready = ready
        self._stop = stop
        self.problem = problem

    def __enter__(self) -> Keeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the keeper now (it removes what it would have at the command's end) and wait,
        bounded, until it is gone: its end of the answer pipe closes when it exits."""
        if self._ready < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop, _STOP)
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(OSError):
            while _read(self._ready, deadline - time.monotonic()) not in (b"", None):
                pass
        for fd in (self._ready, self._stop):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ready = self._stop = -1


def start(
    env: Mapping[str, str],
    *,
    remove: str | None,
    tree: str | None,
    addr: str,
    port: int,
    timeout_s: float = 10.0,
) -> Keeper:
    """Start the keeper of the command this process is about to become (exec) with `env`.

    `remove`: the directory to remove when the command ends; `tree`: the tree's directory;
    `port` > 0: serve it on `addr` until then (the tree's files, and `env`'s
    PROMETHEUS_MULTIPROC_DIR). Returns once the keeper answered, or after `timeout_s`. Raises
    the `OSError` (or `UnicodeError`) binding the port raised, once the keeper is gone and
    `remove` removed; any other failure is the returned keeper's `problem`. A port the keeper
    of an enclosing launch serves for `tree` is no error (and a keeper left with nothing to
    do ends at once)."""
    host_dir = exposition.multiprocess_dir(env)
    try:
        pidfd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):  # not Linux, a kernel before 5.3, a seccomp filter
        pidfd = -1
    fds: list[int] = []
    try:
        fds += os.pipe()
        fds += os.pipe()
    except OSError as exc:  # out of descriptors
        _close(pidfd, *fds)
        return Keeper(problem=f"cannot start it: {exc}")
    ready_r, ready_w, stop_r, stop_w = fds
    plan = _Plan(
        pid=os.getpid(),
        pidfd=pidfd,
        ready=ready_w,
        stop=stop_r,
        remove=remove,
        tree=tree,
        addr=addr,
        port=port,
        show=(host_dir,) if host_dir is not None and os.path.isdir(host_dir) else (),
    )
    keeper = Keeper(ready_r, stop_w)
    refused: OSError | None = None
    try:
        _spawn(plan, _keeper_env(env))
    except OSError as exc:  # fork refused: no memory, a process limit
        refused = exc
    finally:
        # The keeper holds its own copies; the answer pipe ends when the keeper does.
        _close(ready_w, stop_r, pidfd)
    if refused is not None:
        keeper.stop()
        keeper.problem = f"cannot start it: {refused}"
        return keeper
    answer = _answer(ready_r, time.monotonic() + timeout_s)
    if "errno" in answer or "unicode" in answer:
        keeper.stop()
        raise _bind_error(answer)
    if answer.get("elsewhere") and remove is None:
        keeper.stop()  # nothing left for it to do
        return Keeper()
    if answer.get("late"):
        # Still starting, perhaps on a loaded machine: it does its work all the same, and its
        # answer goes to a closed pipe. Never stopped here: that removes the directory.
        keeper.problem = f"no answer in {timeout_s:g}s"
    elif not answer.get("ok"):
        # A keeper that failed to serve still removes the directory: left running. One that
        # ended without answering is gone already.
        keeper.problem = str(answer.get("fault", "it ended without answering"))
    return keeper


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _keeper_env(env: Mapping[str, str]) -> dict[str, str]:
    # Not the bootstrap (the keeper is no guarded process), and prometheus-client left in its
    # default mode: the keeper writes no series.
    out = {
        k: v
        for k, v in env.items()
        if k not in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
    }
    bootstrap = str(_PACKAGE / "integrations" / "_bootstrap")
    entries = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != bootstrap]
    if entries:
        out["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        out.pop("PYTHONPATH", None)
    return out


def _spawn(plan: _Plan, env: dict[str, str]) -> None:
    argv = [sys.executable, "-P", "-c", _BOOT, str(_PACKAGE), json.dumps(dataclasses.asdict(plan))]
    keep = tuple(fd for fd in (plan.ready, plan.stop, plan.pidfd) if fd >= 0)
    middle = os.fork()
    if middle == 0:
        # The middle process: it starts the keeper and exits at once, so that the keeper's
        # parent becomes init (or the nearest subreaper), never the command this process turns
        # into. os._exit: none of the launcher's exit handlers or buffers run twice.
        code = 1
        try:
            subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=keep,
                close_fds=True,
                start_new_session=True,
                cwd="/",
                env=env,
            )
            code = 0
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                _say(plan.ready, {"fault": f"cannot start it: {type(exc).__name__}: {exc}"})
        finally:
            os._exit(code)
    # A caller that ignores SIGCHLD (inherited by this process) has it reaped already.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(middle, 0)


def _read(fd: int, timeout_s: float) -> bytes | None:
    """One read from `fd`, or None when nothing came in `timeout_s`."""
    ready, _, _ = select.select([fd], [], [], max(timeout_s, 0.0))
    return os.read(fd, 4096) if ready else None


def _answer(fd: int, deadline: float) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = _read(fd, deadline - time.monotonic())
        if chunk is None:
            return {"late": True}
        if not chunk:
            break
        data += chunk
    try:
        found = json.loads(data) if data else {}
    except ValueError:
        found = {"fault": f"an unreadable answer: {data[:200]!r}"}
    return found if isinstance(found, dict) else {"fault": f"an unreadable answer: {found!r}"}


def _bind_error(answer: Mapping[str, Any]) -> OSError | UnicodeError:
    # The keeper's error as the launcher's own bind would have raised it, for `bind_problem`.
    if "unicode" in answer:
        return UnicodeError(str(answer["unicode"]))
    kind = socket.gaierror if answer.get("gai") else OSError
    return kind(int(answer["errno"]), str(answer.get("strerror") or ""))


def _say(fd: int, answer: Mapping[str, Any]) -> None:
    # One write, under PIPE_BUF: the launcher reads all of it or nothing.
    os.write(fd, (json.dumps(answer)[:3000] + "\n").encode())


# -- the keeper process -------------------------------------------------------------------


class _Owner:
    """What holds the keeper's server (`exposition.serve` keeps its owners weakly)."""


def main(spec: str) -> None:
    """The keeper process (run by `start`'s interpreter): never returns."""
    try:
        fields = json.loads(spec)
        _keep(_Plan(**{**fields, "show": tuple(fields["show"])}))
    finally:
        os._exit(0)


def _keep(plan: _Plan) -> None:
    _name_process()
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)  # see the module docstring
    owner = _Owner()
    try:
        _say_quietly(plan.ready, _serve(plan, owner))
        _wait_for_end(plan)
    finally:
        with contextlib.suppress(Exception):
            exposition.release_server(owner)  # the port closes, the marker goes
        if plan.remove is not None:
            shutil.rmtree(plan.remove, ignore_errors=True)


def _serve(plan: _Plan, owner: object) -> dict[str, Any]:
    if plan.port <= 0:
        return {"ok": True}
    directories = [path for path in (plan.tree, *plan.show) if path]
    try:
        serving = exposition.serve(
            plan.addr,
            plan.port,
            None,
            owner,
            directories=directories,
            marker_dir=plan.tree,
        )
    except UnicodeError as exc:
        return {"unicode": str(exc)}
    except OSError as exc:
        if exposition.address_in_use(exc) and exposition.sibling_serves(
            plan.port, plan.tree, wait_s=0.0
        ):
            # The keeper of an enclosing `guardrails run` serves this tree already (a launch
            # inside a launched command shares its directory and port).
            return {"ok": True, "elsewhere": True}
        return {
            "errno": exc.errno or 0,
            "strerror": exc.strerror or str(exc),
            "gai": isinstance(exc, socket.gaierror),
        }
    except Exception as exc:
        return {"fault": f"cannot serve: {type(exc).__name__}: {exc}"}
    if serving.marker_error is not None:
        # No process of the tree could tell this port is served for it: each would take the
        # bound port for someone else's. Leave the port to the tree's own processes.
        exposition.release_server(owner)
        return {"fault": f"cannot write the server marker: {serving.marker_error}"}
    return {"ok": True}


def _say_quietly(fd: int, answer: Mapping[str, Any]) -> None:
    # A launcher that stopped waiting became the command already (its end is closed): the
    # keeper carries on with its work all the same.
    with contextlib.suppress(OSError):
        _say(fd, answer)


def _wait_for_end(plan: _Plan) -> None:
    """Return when the command ended, or when the launcher says it never will run."""
    poller = select.poll()
    if plan.pidfd >= 0:
        poller.register(plan.pidfd, select.POLLIN)
    poller.register(plan.stop, select.POLLIN)
    timeout_ms = None if plan.pidfd >= 0 else int(_POLL_S * 1000)
    while True:
        for fd, _events in poller.poll(timeout_ms):
            if fd == plan.pidfd:
                return
            if os.read(plan.stop, 64):
                return
            # End of file: the launcher became the command (exec closed its end), or ended.
            poller.unregister(plan.stop)
        if plan.pidfd < 0 and not _alive(plan.pid):
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # A zombie has ended; its parent has not collected it yet.
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return True
    fields = stat.rpartition(")")[2].split()
    return not fields or fields[0] != "Z"


def _name_process() -> None:
    # Best effort, Linux only: `ps` and `top` show the keeper by name, not as another python.
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, NAME.encode(), 0, 0, 0)
