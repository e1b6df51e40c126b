"""Prometheus counters of the guarded sites, and the optional /metrics server.

Contract (metric names and labels are fixed; see the design brief):

    guardrails_nonfinite_values_total{site, kind, rank}    kind: nan, posinf, neginf
    guardrails_flagged_rows_total{site, reason, rank}      reason: nonfinite, no_valid_token,
                                                                   oob_token
    guardrails_guard_calls_total{site, rank}
    guardrails_reporting_errors_total{stage, rank}         stage: poll, metrics, logs

Plain `Counter`s incremented only by deltas, never a custom collector, so they work unchanged
in prometheus-client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`), where each process
writes its own file and the host's `MultiProcessCollector` sums them. `prometheus_client` is
imported here only inside functions: its multiprocess mode is fixed when it is first imported,
which must be the host's choice, not a side effect of `import guardrails`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from guardrails.flags import CountKind

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter

__all__ = [
    "ERROR_STAGES",
    "METRIC_LABELS",
    "METRIC_NAMES",
    "SLOT_SERIES",
    "GuardMetrics",
    "guard_metrics",
    "multiprocess_dir",
    "release_server",
    "resolve_rank",
    "serve",
]

# Where each count of a site's buffer goes: (family, label value). Out-of-vocab ids are
# counted per row in metrics; the number of ids only appears in log events.
SLOT_SERIES: Final[Mapping[CountKind, tuple[str, str]]] = {
    CountKind.NAN: ("nonfinite_values", "nan"),
    CountKind.POSINF: ("nonfinite_values", "posinf"),
    CountKind.NEGINF: ("nonfinite_values", "neginf"),
    CountKind.ROWS_NONFINITE: ("flagged_rows", "nonfinite"),
    CountKind.ROWS_NO_VALID_TOKEN: ("flagged_rows", "no_valid_token"),
    CountKind.ROWS_OOB_TOKEN: ("flagged_rows", "oob_token"),
}
ERROR_STAGES: Final = ("poll", "metrics", "logs")

# (attribute, name without `_total`, help, labels)
_FAMILIES: Final = (
    (
        "nonfinite_values",
        "guardrails_nonfinite_values",
        "Non-finite logits values found at a guarded site (nan, posinf; neginf where counted).",
        ("site", "kind", "rank"),
    ),
    (
        "flagged_rows",
        "guardrails_flagged_rows",
        "Rows flagged at a guarded site: nonfinite values, no valid token, out-of-vocab ids.",
        ("site", "reason", "rank"),
    ),
    (
        "guard_calls",
        "guardrails_guard_calls",
        "Calls of a guarded site.",
        ("site", "rank"),
    ),
    (
        "reporting_errors",
        "guardrails_reporting_errors",
        "Exceptions contained while reading counts, writing metrics or logging.",
        ("stage", "rank"),
    ),
)
METRIC_NAMES: Final = tuple(f"{name}_total" for _attr, name, _help, _labels in _FAMILIES)
# Exported name -> label names: what dashboards and alert rules may select on.
METRIC_LABELS: Final[Mapping[str, tuple[str, ...]]] = {
    f"{name}_total": labels for _attr, name, _help, labels in _FAMILIES
}


@dataclass(frozen=True)
class GuardMetrics:
    """The four counter families of one registry, shared by every `Guardrails` using it."""

    nonfinite_values: Counter
    flagged_rows: Counter
    guard_calls: Counter
    reporting_errors: Counter


_BY_REGISTRY: weakref.WeakKeyDictionary[Any, GuardMetrics] = weakref.WeakKeyDictionary()
_BY_REGISTRY_LOCK = threading.Lock()


def guard_metrics(registry: CollectorRegistry | None = None) -> GuardMetrics:
    """The counters registered in `registry` (default: the global one), made on first use.

    Asking again for the same registry returns the same counters, so any number of
    `Guardrails` instances share them without a duplicate-metric error.
    """
    from prometheus_client import REGISTRY

    target = REGISTRY if registry is None else registry
    with _BY_REGISTRY_LOCK:
        found = _BY_REGISTRY.get(target)
        if found is None:
            found = GuardMetrics(
                **{
                    attr: _counter(target, name, text, labels)
                    for attr, name, text, labels in _FAMILIES
                }
            )
            _BY_REGISTRY[target] = found
        return found


def _counter(registry: CollectorRegistry, name: str, text: str, labels: tuple[str, ...]) -> Counter:
    from prometheus_client import Counter

    try:
        return Counter(name, text, labels, registry=registry)
    except ValueError:
        # Registered earlier by another copy of this module (a reload, a vendored copy): reuse
        # it if it is the same metric. The lookup table is private, hence the getattr.
        existing = getattr(registry, "_names_to_collectors", {}).get(name + "_total")
        if isinstance(existing, Counter) and tuple(existing._labelnames) == labels:
            return existing
        raise ValueError(
            f"the registry already holds a different metric named {name}_total; guardrails "
            f"needs a Counter with labels {list(labels)}"
        ) from None


def resolve_rank(environ: Mapping[str, str] | None = None) -> str:
    """The `rank` label: torch.distributed's rank when initialised, else RANK, else
    LOCAL_RANK, else 0. Malformed variables are skipped: they belong to the launcher."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass  # a half-initialised process group: fall back to the launcher's variables
    env = os.environ if environ is None else environ
    for key in ("RANK", "LOCAL_RANK"):
        raw = env.get(key, "").strip()
        # ASCII only: str.isdigit() also accepts digits int() refuses, such as "²".
        if raw.isascii() and raw.isdigit():
            return str(int(raw))
    return "0"


def multiprocess_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The prometheus-client multiprocess directory, as prometheus-client itself reads it."""
    env = os.environ if environ is None else environ
    return env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("prometheus_multiproc_dir") or None


# -- the optional /metrics server ----------------------------------------------------------


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
