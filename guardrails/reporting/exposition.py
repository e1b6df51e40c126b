"""The optional /metrics server, shared by owners in one process and by sibling workers.

`serve()` starts prometheus-client's HTTP server for the first owner of an address and port;
later owners share it and `release_server()` stops it when no live owner needs it. In
prometheus-client's multiprocess mode the server exposes the aggregate of every process's
files, and a marker file in the shared directory tells sibling workers (same port, same
directory) that this process serves them. `prometheus_client` is imported only inside
functions, for the reason given in `guardrails.reporting.metrics`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["multiprocess_dir", "release_server", "serve", "sibling_serves"]


def multiprocess_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The prometheus-client multiprocess directory, as prometheus-client itself reads it."""
    env = os.environ if environ is None else environ
    return env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("prometheus_multiproc_dir") or None


@dataclass
class _Served:
    server: Any
    thread: threading.Thread
    owners: weakref.WeakSet[Any]


_SERVERS: dict[tuple[str, int], _Served] = {}
_SERVERS_LOCK = threading.Lock()


def serve(addr: str, port: int, registry: CollectorRegistry | None, owner: object) -> bool:
    """Serve /metrics on `addr:port` for `owner`; True if this call started the server.

    A second owner asking for the same address and port shares the running server. In
    multiprocess mode the server exposes the aggregate of every process's files, as the host
    engine's own /metrics does. A port that cannot be bound raises `OSError`.
    """
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    key = (addr, port)
    with _SERVERS_LOCK:
        served = _SERVERS.get(key)
        if served is not None:
            served.owners.add(owner)
            return False
        path = multiprocess_dir()
        if path is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            exposed = CollectorRegistry()
            MultiProcessCollector(exposed, path=path)  # type: ignore[no-untyped-call]  # untyped upstream
        else:
            exposed = REGISTRY if registry is None else registry
        server, thread = start_http_server(port, addr=addr, registry=exposed)
        if path is not None:
            # Tells sibling workers (same port, same directory) that this process serves them.
            with open(_marker(path, port), "w", encoding="ascii") as handle:
                handle.write(str(os.getpid()))
        _watch_forks()
        owners: weakref.WeakSet[Any] = weakref.WeakSet()
        owners.add(owner)
        _SERVERS[key] = _Served(server, thread, owners)
        return True


def _marker(path: str, port: int) -> str:
    return os.path.join(path, f"guardrails_metrics_{port}.server")


def sibling_serves(port: int, *, wait_s: float = 2.0) -> bool:
    """Whether another live process of this multiprocess deployment serves `port`.

    The process that binds the port leaves a marker (its pid) in the shared
    PROMETHEUS_MULTIPROC_DIR, which the collector ignores (it reads only *.db files). A worker
    that cannot bind waits briefly for the marker, since workers start together.
    """
    path = multiprocess_dir()
    if path is None:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(_marker(path, port), encoding="ascii") as handle:
                pid = int(handle.read().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and _alive(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def release_server(owner: object) -> None:
    """`owner` no longer needs its server; stop each server no live owner needs."""
    stopped: list[_Served] = []
    with _SERVERS_LOCK:
        for key, served in list(_SERVERS.items()):
            served.owners.discard(owner)
            if not served.owners:
                stopped.append(_SERVERS.pop(key))
    for served in stopped:
        path = multiprocess_dir()
        if path is not None:
            with contextlib.suppress(OSError):
                os.remove(_marker(path, served.server.server_port))
        served.server.shutdown()
        served.server.server_close()
        served.thread.join(timeout=5)


def _forget_servers_in_child() -> None:
    # A forked child inherits the listening socket but not the thread serving it: shutting
    # that server down would wait forever for a loop that does not run here. Close the
    # child's copy of the socket (the parent's keeps serving) and forget it.
    global _SERVERS_LOCK
    _SERVERS_LOCK = threading.Lock()
    for served in _SERVERS.values():
        # Already closed (OSError): nothing left to release in this process.
        with contextlib.suppress(OSError):
            served.server.socket.close()
    _SERVERS.clear()


_fork_hook_installed = False


def _watch_forks() -> None:
    # Installed with the first server, not at import: importing guardrails has no effects.
    global _fork_hook_installed
    if not _fork_hook_installed and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_forget_servers_in_child)
        _fork_hook_installed = True
