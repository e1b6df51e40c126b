"""The optional /metrics server, shared by owners in one process and by sibling workers.

`serve()` starts prometheus-client's HTTP server for the first owner of an address and port;
later owners share it and `release_server()` stops it when no live owner needs it. Owners in
one process share a port only when they show the same series (`claim()`, checked when a
`Guardrails` is built): a second registry on a taken port would silently not be served.

In a process tree (guardrails' tree directory, `GUARDRAILS_METRICS_DIR`, or the host's
`PROMETHEUS_MULTIPROC_DIR`) the server shows guardrails' series of every process of the tree,
summed from their files by prometheus-client's own `MultiProcessCollector.merge`, and a marker
file in the shared directory tells the other processes (same port, same directory) that this
process serves them. A sibling believes a marker only when the process it names is listening
on that port (read from the kernel's socket table): a stale marker whose pid was reused, or a
port held by something else, is not a sibling. The server also shows the multiprocess
directories that processes of the tree announced in the shared directory (their series went to
a host's directory, `guardrails.reporting.sinks.announce`), those that exist at each scrape.
Under `guardrails run` the serving process is the tree keeper
(`guardrails.integrations.tree_keeper`), for the tree's whole life; every process of the tree
finds it there. `prometheus_client` is imported only inside functions, for the reason given in
`guardrails.reporting.metrics`.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from guardrails import _process
from guardrails.exceptions import ConfigError, Problem
from guardrails.reporting import events
from guardrails.reporting.sinks import announced, multiprocess_dir, read_json, write_json

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from guardrails.reporting.events import Event
    from guardrails.reporting.metrics import _Binding
    from guardrails.settings import GuardSettings

__all__ = [
    "Serving",
    "address_in_use",
    "bind_problem",
    "claim",
    "multiprocess_dir",
    "open_port",
    "probe",
    "release_server",
    "serve",
    "sibling_serves",
]


@dataclass
class _Served:
    server: Any
    thread: threading.Thread
    owners: weakref.WeakSet[Any]
    marker_dir: str | None


class _TreeFiles:
    """guardrails' series in the files of `directories`, and of the directories announced in
    `announced_in` that exist at the scrape, summed over processes by prometheus-client's own
    merge (the host's series in a shared directory are the host's /metrics' to show, not this
    port's)."""

    def __init__(self, directories: Sequence[str], announced_in: str | None = None) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        for path in directories:
            # prometheus-client's own check, before anything is bound: not a directory raises.
            MultiProcessCollector(None, path=path)  # type: ignore[no-untyped-call]  # untyped upstream
        self._directories = tuple(directories)
        self._announced_in = announced_in

    def collect(self) -> Iterator[Any]:
        from prometheus_client.multiprocess import MultiProcessCollector

        found = [*self._directories, *announced(self._announced_in)]
        # One directory reached by two paths (a link, an announced copy of a listed one) is
        # read once: its files would be summed twice.
        paths = {os.path.realpath(path): path for path in found}.values()
        files = [f for path in paths for f in glob.glob(os.path.join(path, "*.db"))]
        for metric in MultiProcessCollector.merge(files, accumulate=True):  # type: ignore[no-untyped-call]
            if metric.name.startswith("guardrails_"):
                yield metric


@dataclass(frozen=True)
class Serving:
    """What `serve()` did: whether it started the server, and a contained marker failure
    (the server serves regardless; only siblings cannot learn about it)."""

    started: bool
    marker_error: OSError | None = None


_SERVERS: dict[tuple[str, int], _Served] = {}
_SERVERS_LOCK = _process.module_lock(__name__, "_SERVERS_LOCK")


# Owners whose server waits for their metrics to open (`open_port`); kept in a forked child,
# whose owners still serve once theirs open.
_WAITING: weakref.WeakSet[Any] = weakref.WeakSet()

# (addr, port) -> (what is shown there, the owners that claimed it), for this process.
_CLAIMS: dict[tuple[str, int], tuple[object, weakref.WeakSet[Any]]] = {}


def claim(addr: str, port: int, shown: object, owner: object) -> bool:
    """`owner` will serve `shown` (a registry, or the process's default series) on
    `addr:port`; False when a live owner in this process shows something else there."""
    key = (addr, port)
    with _SERVERS_LOCK:
        found = _CLAIMS.get(key)
        if found is not None and found[1] and found[0] is not shown:
            return False
        if found is None or not found[1]:
            found = _CLAIMS[key] = (shown, weakref.WeakSet())
        found[1].add(owner)
        return True


def probe(addr: str, port: int) -> None:
    """Raise the `OSError` binding `addr:port` would raise now, binding nothing for long.

    SO_REUSEADDR, as prometheus-client's own server sets it: on Linux the probe then fails
    only on a socket that listens there, and never makes a real server (or another
    process's probe) fail."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)


def serve(
    addr: str,
    port: int,
    registry: CollectorRegistry | None,
    owner: object,
    *,
    directories: Sequence[str] = (),
    marker_dir: str | None = None,
) -> Serving:
    """Serve /metrics on `addr:port` for `owner`.

    A second owner asking for the same address and port shares the running server. With
    `directories` (the files of a process tree) the server shows guardrails' series of every
    process there, as the host engine's own /metrics does; else `registry` (None: the global
    one). `marker_dir` is where the other processes of the tree look for the marker, and where
    they announce the other directories their series went to (shown too). A port
    that cannot be bound raises `OSError` (a bad address may also raise `UnicodeError`, from
    the idna codec); a directory that is not one raises prometheus-client's `ValueError`
    before anything is bound.
    """
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    key = (addr, port)
    with _SERVERS_LOCK:
        served = _SERVERS.get(key)
        if served is not None:
            served.owners.add(owner)
            return Serving(started=False)
        if directories:
            exposed = CollectorRegistry(auto_describe=False)
            exposed.register(_TreeFiles(directories, announced_in=marker_dir))
        else:
            exposed = REGISTRY if registry is None else registry
        server, thread = start_http_server(port, addr=addr, registry=exposed)
        owners: weakref.WeakSet[Any] = weakref.WeakSet()
        owners.add(owner)
        # Registered before the marker is written: whatever happens to the marker, this
        # server has an owner that releases it (no thread serving on behind a raised error).
        _SERVERS[key] = _Served(server, thread, owners, marker_dir)
        marker_error = None
        if marker_dir is not None:
            try:
                _write_marker(marker_dir, port)
            except OSError as exc:
                marker_error = exc
        return Serving(started=True, marker_error=marker_error)


def open_port(
    owner: object,
    settings: GuardSettings,
    binding: _Binding,
    *,
    fault: Callable[[Exception], None],
    notice: Callable[[list[Event]], None],
) -> None:
    """Serve `owner`'s metrics (`binding`) on `[metrics] addr:port`: now if they are open,
    else once they open (the server imports prometheus-client), for as long as `owner` has
    not released its claim (`release_server`).

    At start-up a port that something else holds, an address this host does not have, or
    another registry of this process on the port is a `ConfigError` naming the setting at
    fault; later, a contained fault (`fault`). A port a sibling process of the tree serves is
    left to it (`notice` gets the event that says so). `fault` and `notice` are held weakly
    until the metrics open: pass bound methods of `owner`."""
    addr, port = settings.metrics.addr, settings.metrics.port
    if not claim(addr, port, binding, owner=owner):
        raise ConfigError(
            [
                Problem(
                    settings.origin("metrics", "port"),
                    f"cannot serve metrics on {addr}:{port}: another Guardrails in this "
                    "process serves a different registry there",
                    port,
                    accepted="the same registry (or none) for every Guardrails on one "
                    "port, or another port",
                )
            ]
        )
    if binding.is_open:
        _serve_owner(owner, settings, binding, fault, notice, at_start=True)
        return
    # The server waits for the metrics to open, but a port that something else holds is
    # still an error at start-up, found without binding it.
    try:
        probe(addr, port)
    except (OSError, UnicodeError) as exc:
        _bind_failed(settings, exc, fault, notice, at_start=True)
        return  # another process of the tree serves it (else that raised)
    with _SERVERS_LOCK:
        _WAITING.add(owner)
    me = weakref.ref(owner)
    weak_fault, weak_notice = weakref.WeakMethod(fault), weakref.WeakMethod(notice)

    def serve_when_open() -> None:
        found, on_fault, on_notice = me(), weak_fault(), weak_notice()
        if found is None or on_fault is None or on_notice is None:
            return  # collected
        with _SERVERS_LOCK:
            if found not in _WAITING:
                return  # released (closed) meanwhile
            _WAITING.discard(found)
        _serve_owner(found, settings, binding, on_fault, on_notice, at_start=False)

    binding.when_open(serve_when_open)


def _serve_owner(
    owner: object,
    settings: GuardSettings,
    binding: _Binding,
    fault: Callable[[Exception], None],
    notice: Callable[[list[Event]], None],
    *,
    at_start: bool,
) -> None:
    sink = binding.sink
    tree = settings.metrics.dir
    directories = list(
        dict.fromkeys(
            str(path)
            for path in (getattr(sink, "directory", None), multiprocess_dir(), tree)
            if path
        )
    )
    marker_dir = _marker_dir(settings)
    try:
        serving = serve(
            settings.metrics.addr,
            settings.metrics.port,
            getattr(sink, "registry", None),
            owner=owner,
            directories=directories,
            marker_dir=marker_dir,
        )
    except (OSError, UnicodeError) as exc:
        _bind_failed(settings, exc, fault, notice, at_start=at_start)
        return
    except Exception as exc:
        # prometheus-client refusing a multiprocess directory (not a directory): the series
        # fail the same way and are contained; so is the server, which has nothing to
        # aggregate.
        fault(exc)
        return
    if serving.marker_error is not None:
        # The server runs; only sibling processes cannot learn that it serves them.
        fault(serving.marker_error)


def _marker_dir(settings: GuardSettings) -> str | None:
    tree = settings.metrics.dir
    return str(tree) if tree else multiprocess_dir()


def _bind_failed(
    settings: GuardSettings,
    exc: OSError | UnicodeError,
    fault: Callable[[Exception], None],
    notice: Callable[[list[Event]], None],
    *,
    at_start: bool,
) -> None:
    # In a process tree every process inherits the same port, and one server shows every
    # process's files: a process whose sibling already serves that port is served by it.
    # Anything else holding the port is still an error.
    addr, port = settings.metrics.addr, settings.metrics.port
    if address_in_use(exc) and sibling_serves(port, _marker_dir(settings)):
        notice([events.served_elsewhere_event(addr, port)])
        return
    # At start-up, as a ConfigError naming the variable (or file key) that is at fault: the
    # fix is a configuration change, and hosts already handle this error. Later (the metrics
    # opened in a sampling call or an import), a contained fault.
    problem = bind_problem(
        exc,
        addr,
        port,
        addr_origin=settings.origin("metrics", "addr"),
        port_origin=settings.origin("metrics", "port"),
    )
    error = ConfigError([problem])
    if at_start:
        raise error from exc
    fault(error)


# Bind errors that are the address's fault, not the port's.
_ADDRESS_ERRNOS: Final = frozenset(
    {errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, getattr(errno, "EPFNOSUPPORT", errno.EAFNOSUPPORT)}
)


def address_in_use(exc: BaseException) -> bool:
    """Whether `serve()` or `probe()` failed because something listens on the port."""
    return isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE


def bind_problem(
    exc: OSError | UnicodeError, addr: str, port: int, *, addr_origin: str, port_origin: str
) -> Problem:
    """What a failed `serve()` or `probe()` says to fix: the address (a name that does not
    resolve, one this host does not have, a family it lacks) or else the port. `addr_origin`
    and `port_origin` name where each value came from (`GuardSettings.origin`)."""
    reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
    text = f"cannot serve metrics on {addr}:{port}: {reason}"
    if isinstance(exc, socket.gaierror | UnicodeError) or (
        isinstance(exc, OSError) and exc.errno in _ADDRESS_ERRNOS
    ):
        return Problem(
            addr_origin,
            text,
            addr,
            accepted="an address of this host (127.0.0.1, ::1, 0.0.0.0) or its name",
        )
    return Problem(
        port_origin, text, port, accepted="a free port, or 0 to leave /metrics to the host"
    )


def _marker(path: str, port: int) -> str:
    return os.path.join(path, f"guardrails_metrics_{port}.server")


def _write_marker(path: str, port: int) -> None:
    # Not *.db: the collector reads only those.
    write_json(
        _marker(path, port), {"pid": os.getpid(), "port": port}, tmp_prefix=".guardrails_metrics_"
    )


def _marker_pid(path: str, port: int) -> int:
    data = read_json(_marker(path, port), limit=4096)
    if not isinstance(data, dict) or data.get("port") != port:
        return 0
    pid = data.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else 0


def sibling_serves(port: int, path: str | None, *, wait_s: float = 2.0) -> bool:
    """Whether another process of this process tree serves `port`.

    The process that binds the port leaves a marker (its pid and the port) in the shared
    directory `path`, which the collectors ignore (they read only *.db files). The marker is
    believed only if that pid is another process listening on `port`. A process that cannot
    bind waits briefly for the marker, since the processes of a tree start together.
    """
    if path is None:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        pid = _marker_pid(path, port)
        if pid and pid != os.getpid() and listens_on(pid, port):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def listens_on(pid: int, port: int, proc: str | os.PathLike[str] = "/proc") -> bool:
    """Whether process `pid` holds a socket listening on TCP `port` (Linux `/proc`).

    False where that cannot be read (another OS, a process of another user): an unproven
    sibling is no sibling, and the port conflict stays an error.
    """
    root = Path(proc)
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (root / "net" / table).read_text(encoding="ascii").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; st 0A is LISTEN; the inode is the 10th field.
            if len(fields) > 9 and fields[3] == "0A" and fields[1].rpartition(":")[2]:
                with contextlib.suppress(ValueError):
                    if int(fields[1].rpartition(":")[2], 16) == port:
                        inodes.add(fields[9])
    if not inodes:
        return False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.scandir(root / str(pid) / "fd")
    except OSError:
        return False
    with fds:
        for entry in fds:
            with contextlib.suppress(OSError):
                if os.readlink(entry.path) in wanted:
                    return True
    return False


def release_server(owner: object) -> None:
    """`owner` no longer needs its server; stop each server no live owner needs."""
    stopped: list[_Served] = []
    with _SERVERS_LOCK:
        _WAITING.discard(owner)
        for _shown, claimants in _CLAIMS.values():
            claimants.discard(owner)
        for key, served in list(_SERVERS.items()):
            served.owners.discard(owner)
            if not served.owners:
                stopped.append(_SERVERS.pop(key))
    for served in stopped:
        path = served.marker_dir
        port = served.server.server_port
        # Only a marker this process wrote: never another process's, nor what is planted there.
        if path is not None and _marker_pid(path, port) == os.getpid():
            with contextlib.suppress(OSError):
                os.remove(_marker(path, port))
        served.server.shutdown()
        served.server.server_close()
        served.thread.join(timeout=5)


def _forget_servers_in_child() -> None:
    # A forked child inherits the listening socket but not the thread serving it: shutting
    # that server down would wait forever for a loop that does not run here. Close the
    # child's copy of the socket (the parent's keeps serving) and forget it.
    for served in _SERVERS.values():
        # Already closed (OSError): nothing left to release in this process.
        with contextlib.suppress(OSError):
            served.server.socket.close()
    _SERVERS.clear()
    _CLAIMS.clear()


_process.after_fork("servers", _forget_servers_in_child)
