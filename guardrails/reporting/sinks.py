"""Where one process's guardrails series are written: a registry, or files of a process tree.

Chosen once per registry when its metrics open (`guardrails.reporting.metrics`), never at
import, and only after the host had its chance to choose prometheus-client's mode:

- `RegistrySink`: plain `Counter`s and `Gauge`s in a prometheus-client registry, made the way
  the host makes its own. With an explicit `registry=`, or when prometheus-client runs in
  multiprocess mode (the host set `PROMETHEUS_MULTIPROC_DIR` before importing it, as SGLang
  and vLLM's several API servers do): each process then writes its own file in the host's
  directory, and the host's `/metrics` sums them.
- `FileSink`: the same series written into a directory in prometheus-client's multiprocess file
  format (`counter_<pid>.db`, `gauge_livemax_<pid>.db`), while the process's prometheus-client
  stays in the mode the host chose (single-process). For a process tree: the host's own
  `PROMETHEUS_MULTIPROC_DIR` when it is set, otherwise guardrails' tree directory
  (`GUARDRAILS_METRICS_DIR`, which `guardrails run` owns). In the tree directory's case a
  prometheus-client `MultiProcessCollector` over it is added to the process's global registry,
  so a host that serves that registry (vLLM with one API server) shows the whole tree's
  guardrails series next to its own, which stay as the host made them.

A process of a tree whose series go to a multiprocess directory other than the tree
directory (the host's) announces that directory in the tree directory (`announce`, a small
`guardrails_multiproc_*.dir` file, which the collectors ignore): whoever serves the tree's
`GUARDRAILS_METRICS_PORT` (`guardrails.reporting.exposition`) shows it too (`announced`).

Files use prometheus-client's own `MmapedDict` and key format, so its own
`MultiProcessCollector` reads them. A forked child writes its own file (its counts start at 0
there: the parent's stay in the parent's); the `live*` gauge file of a process is removed
when it exits, as prometheus-client's `mark_process_dead` would.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from guardrails import _process

__all__ = [
    "TREE_COLLECTOR_ATTR",
    "FamilySpec",
    "FileSink",
    "RegistrySink",
    "announce",
    "announced",
    "choose_sink",
    "multiprocess_dir",
    "read_json",
    "write_json",
]

# Set on the global registry once a collector over the tree directory is registered in it.
TREE_COLLECTOR_ATTR: Final = "_guardrails_tree_collector"
# The families made in a registry, kept on the registry object itself (an attribute of ours):
# a reloaded or second copy of guardrails finds them instead of registering the names again.
_FAMILIES_ATTR: Final = "_guardrails_metric_families"
_LOCK = _process.module_lock(__name__, "_LOCK")
# An announced directory, in the tree directory. Not *.db: prometheus-client's collectors read
# only those.
_ANNOUNCED: Final = "guardrails_multiproc_{}.dir"


def multiprocess_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The prometheus-client multiprocess directory, as prometheus-client itself reads it."""
    env = os.environ if environ is None else environ
    return env.get("PROMETHEUS_MULTIPROC_DIR") or env.get("prometheus_multiproc_dir") or None


def choose_sink(registry: Any, tree_dir: str | None) -> RegistrySink | FileSink:
    """Where the series of `registry` go (None: the process's default; see the module
    docstring). Imports prometheus-client: call it only once the metrics may open."""
    if registry is not None:
        return RegistrySink(registry)
    from prometheus_client import values

    host_dir = multiprocess_dir()
    if getattr(values.ValueClass, "_multiprocess", False):
        # The host's multiprocess mode: its own directory and files.
        _announce_quietly(tree_dir, host_dir)
        return RegistrySink(None)
    if host_dir is not None:
        # The host set its directory after prometheus-client was imported here (a forked
        # child, or an engine that serves its directory from other processes): its /metrics
        # reads that directory, so guardrails' files go there.
        return FileSink(host_dir, serve_tree=False, announce_in=tree_dir)
    if tree_dir is not None:
        return FileSink(tree_dir, serve_tree=True, announce_in=tree_dir)
    return RegistrySink(None)


def announce(tree_dir: str, directory: str) -> None:
    """Say in `tree_dir` that series of this tree are written in `directory` too; nothing
    when it is the tree directory itself, or announced already. Raises `OSError`."""
    directory = os.path.abspath(directory)
    if os.path.realpath(directory) == os.path.realpath(tree_dir):
        return
    digest = hashlib.sha256(os.fsencode(directory)).hexdigest()[:16]
    target = os.path.join(tree_dir, _ANNOUNCED.format(digest))
    if os.path.lexists(target):
        return
    write_json(target, {"path": directory}, tmp_prefix=".guardrails_multiproc_")


def announced(tree_dir: str | None) -> list[str]:
    """The directories announced in `tree_dir` that exist now."""
    if tree_dir is None:
        return []
    found = []
    for path in glob.glob(os.path.join(glob.escape(tree_dir), _ANNOUNCED.format("*"))):
        data = read_json(path, limit=8192)
        directory = data.get("path") if isinstance(data, dict) else None
        if isinstance(directory, str) and os.path.isabs(directory) and os.path.isdir(directory):
            found.append(directory)
    return found


def write_json(path: str, data: object, *, tmp_prefix: str) -> None:
    """Write `data` as JSON to `path` through a new file renamed over it: a link planted at
    `path` is replaced, never followed (its target is never written), and a reader sees the
    old file or the new one, never half of one. Raises `OSError`."""
    fd, tmp = tempfile.mkstemp(prefix=tmp_prefix, suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def read_json(path: str, *, limit: int) -> object:
    """The JSON in `path` (its first `limit` bytes), or None where it cannot be read or parsed,
    or `path` is a link (O_NOFOLLOW: a planted link is not a file guardrails wrote)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, encoding="utf-8") as handle:
            return json.loads(handle.read(limit))
    except (OSError, ValueError):
        return None


def _announce_quietly(tree_dir: str | None, directory: str | None) -> None:
    # Best effort: the series are written either way and the host's /metrics shows them;
    # only the tree's own port would miss them, and failing the sink would lose them all.
    if tree_dir is not None and directory is not None:
        with contextlib.suppress(OSError, ValueError):  # ValueError: a NUL in a path
            announce(tree_dir, directory)


@dataclass(frozen=True)
class FamilySpec:
    """One metric family (the table is `guardrails.reporting.metrics.FAMILIES`): `name`
    without `_total` for counters; a gauge needs the `multiprocess_mode` prometheus-client
    combines processes with (e.g. "livemax")."""

    attr: str
    name: str
    help: str
    labels: tuple[str, ...]
    type: str = "counter"
    multiprocess_mode: str = ""

    @property
    def sample(self) -> str:
        """The exported sample name."""
        return f"{self.name}_total" if self.type == "counter" else self.name


class RegistrySink:
    """Plain prometheus-client metrics in `registry` (None: the global one)."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import REGISTRY

        self.registry = REGISTRY if registry is None else registry
        self.directory: str | None = None

    def families(self, specs: Sequence[FamilySpec], constant: tuple[str, ...]) -> dict[str, Any]:
        """The metrics of `specs` (made on first use), by attribute."""
        with _LOCK:
            found: tuple[tuple[str, ...], dict[str, Any]] | None = getattr(
                self.registry, _FAMILIES_ATTR, None
            )
            if found is None:
                made = {spec.attr: _metric(self.registry, spec, constant) for spec in specs}
                found = (constant, made)
                setattr(self.registry, _FAMILIES_ATTR, found)
            names, made = found
            if names != constant:
                raise ValueError(
                    f"guardrails' metrics in this registry carry the constant labels "
                    f"{list(names)}; this instance asks for {list(constant)}: every instance "
                    "sharing a registry needs the same [metrics.labels] names"
                )
            # A newer copy of guardrails may know families an older one did not make.
            for spec in specs:
                if spec.attr not in made:
                    made[spec.attr] = _metric(self.registry, spec, constant)
            return {spec.attr: _RegistryFamily(made[spec.attr]) for spec in specs}


class _RegistryFamily:
    __slots__ = ("_metric",)

    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def child(self, labels: dict[str, str]) -> Any:
        return self._metric.labels(**labels)


def _metric(registry: Any, spec: FamilySpec, constant: tuple[str, ...]) -> Any:
    from prometheus_client import Counter, Gauge

    labels = (*spec.labels, *constant)
    try:
        if spec.type == "gauge":
            return Gauge(
                spec.name,
                spec.help,
                labels,
                registry=registry,
                multiprocess_mode=spec.multiprocess_mode,  # type: ignore[arg-type]  # a Literal upstream
            )
        return Counter(spec.name, spec.help, labels, registry=registry)
    except ValueError:
        raise ValueError(
            f"the registry already holds a metric named {spec.sample} that guardrails did not "
            f"register; guardrails needs that name for a {spec.type} with labels {list(labels)}"
        ) from None


class FileSink:
    """This process's guardrails series as prometheus-client multiprocess files in `directory`.

    `serve_tree`: also register a `MultiProcessCollector` over `directory` in the global
    registry (once per process), for a host that serves that registry. `announce_in`: the
    tree directory, where a `directory` other than it is announced (`announce`).
    """

    def __init__(self, directory: str, *, serve_tree: bool, announce_in: str | None = None) -> None:
        from prometheus_client import REGISTRY
        from prometheus_client.multiprocess import MultiProcessCollector

        # prometheus-client's own check: a path that is not a directory is refused here,
        # before any series is written (a contained metrics fault for the caller).
        MultiProcessCollector(None, path=directory)  # type: ignore[no-untyped-call]  # untyped upstream
        self.directory = directory
        self.registry: Any = REGISTRY
        self._announce_in = announce_in
        _announce_quietly(announce_in, directory)
        self._lock = _process.lock(self, "_lock")
        self._files: dict[str, Any] = {}
        self._children: list[_FileChild] = []
        _live_sinks().add(self)
        if serve_tree:
            with _LOCK:
                if getattr(REGISTRY, TREE_COLLECTOR_ATTR, None) != directory:
                    MultiProcessCollector(REGISTRY, path=directory)  # type: ignore[no-untyped-call]
                    setattr(REGISTRY, TREE_COLLECTOR_ATTR, directory)

    def families(self, specs: Sequence[FamilySpec], constant: tuple[str, ...]) -> dict[str, Any]:
        return {spec.attr: _FileFamily(self, spec, constant) for spec in specs}

    def _file(self, prefix: str) -> Any:
        # Called with self._lock held.
        mmaped = self._files.get(prefix)
        if mmaped is None:
            from prometheus_client.mmap_dict import MmapedDict

            path = os.path.join(self.directory, f"{prefix}_{os.getpid()}.db")
            mmaped = self._files[prefix] = MmapedDict(path)  # type: ignore[no-untyped-call]
        return mmaped

    def write(self, child: _FileChild) -> None:
        # Called with self._lock held.
        self._file(child.prefix).write_value(child.key, child.value, 0.0)

    def read(self, child: _FileChild) -> None:
        # Called with self._lock held. Makes the key (at 0) if the file lacks it; a file left
        # by a dead process with this pid continues, as prometheus-client's own values do:
        # its counts are still part of the sum.
        child.value = float(self._file(child.prefix).read_value(child.key)[0])

    def open_child(self, child: _FileChild) -> None:
        with self._lock:
            self.read(child)
            self._children.append(child)

    def after_fork_in_child(self) -> None:
        # The parent's files stay the parent's: this process writes its own from 0, into the
        # host's directory if the parent set one before forking (vLLM sets its own before it
        # forks engine cores for several API servers, whose /metrics reads only that one).
        self.directory = multiprocess_dir() or self.directory
        _announce_quietly(self._announce_in, self.directory)
        for mmaped in self._files.values():
            with contextlib.suppress(Exception):
                mmaped.close()
        self._files = {}
        for child in self._children:
            child.value = 0.0
            child.opened = False

    def close_live_files(self) -> None:
        """At exit: remove this process's `live*` gauge files (a dead process's gauge is no
        longer live), as `prometheus_client.multiprocess.mark_process_dead` does."""
        with self._lock:
            for prefix, mmaped in list(self._files.items()):
                if not prefix.startswith("gauge_live"):
                    continue
                with contextlib.suppress(Exception):
                    mmaped.close()
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.directory, f"{prefix}_{os.getpid()}.db"))
                del self._files[prefix]


class _FileFamily:
    __slots__ = ("_help", "_labels", "_name", "_prefix", "_sample", "_sink")

    def __init__(self, sink: FileSink, spec: FamilySpec, constant: tuple[str, ...]) -> None:
        self._sink = sink
        self._name = spec.name
        self._sample = spec.sample
        self._help = spec.help
        self._labels = (*spec.labels, *constant)
        self._prefix = f"gauge_{spec.multiprocess_mode}" if spec.type == "gauge" else spec.type

    def child(self, labels: dict[str, str]) -> _FileChild:
        from prometheus_client.mmap_dict import mmap_key

        values = [labels[name] for name in self._labels]  # KeyError: a label is missing
        if len(labels) != len(self._labels):
            raise ValueError(f"labels {sorted(labels)} do not match {list(self._labels)}")
        key = mmap_key(self._name, self._sample, list(self._labels), values, self._help)
        child = _FileChild(self._sink, self._prefix, key)
        self._sink.open_child(child)
        return child


class _FileChild:
    """One series in this process's file: `inc()` and `set()` write the new value through."""

    __slots__ = ("key", "opened", "prefix", "sink", "value")

    def __init__(self, sink: FileSink, prefix: str, key: str) -> None:
        self.sink = sink
        self.prefix = prefix
        self.key = key
        self.value = 0.0
        self.opened = True

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("counters can only be incremented by non-negative amounts")
        with self.sink._lock:
            self._reopen()
            self.value += amount
            self.sink.write(self)

    def set(self, value: float) -> None:
        with self.sink._lock:
            self._reopen()
            self.value = float(value)
            self.sink.write(self)

    def get(self) -> float:
        return self.value

    def _reopen(self) -> None:
        if not self.opened:  # first write after a fork: this process's own file
            self.opened = True
            self.sink.read(self)


_sinks: _process.Live[FileSink] | None = None


def _live_sinks() -> _process.Live[FileSink]:
    # The exit hook is installed with the first file sink, not at import.
    global _sinks
    if _sinks is None:
        _sinks = _process.Live()
        atexit.register(_close_at_exit)
    return _sinks


def _close_at_exit() -> None:
    for sink in list(_sinks or ()):
        sink.close_live_files()


def _after_fork_in_child() -> None:
    for sink in list(_sinks or ()):
        sink.after_fork_in_child()


_process.after_fork("sinks", _after_fork_in_child)
