"""The soak and multiprocess-kill workloads, shared by `tests/system/test_soak.py` (at make-test
sizes) and the long run `make reliability` (`benchmarks/reliability.py`, at full size), so
the long version checks exactly what the short one checks.

    python -m tests.system.workloads CALLS EVERY SEED PAUSE_AT RANK   # one worker process

Contract of the workloads:
- `soak()`: threads call sites of a `Guardrails` while the main thread closes it and builds
  the next one (a config reload). Every count is checked against the oracle
  (`tests/contract/oracle.py`): per instance (`counts()`) and summed over instances
  (Prometheus samples of the shared registry).
- `multiprocess_kill()`: workers with PROMETHEUS_MULTIPROC_DIR guard a deterministic
  schedule; one is SIGKILLed mid-run. Survivors must aggregate exactly; the killed worker's
  series must equal what it had reported: its counts as of its last report, i.e. its first
  `every_calls * floor(n / every_calls)` calls of n. The workers are this module run as a
  script (above), from the repository root.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from tests.contract.oracle import expected_flags_and_counts

ROOT = Path(__file__).resolve().parents[2]
ROWS, VOCAB = 4, 64
KINDS = ("nan", "posinf", "neginf", "rows_nonfinite", "rows_no_valid_token", "calls")
# Prometheus series for each count of a logits site: (metric, label name, label value).
SERIES = {
    "nan": ("guardrails_nonfinite_values_total", "kind", "nan"),
    "posinf": ("guardrails_nonfinite_values_total", "kind", "posinf"),
    "neginf": ("guardrails_nonfinite_values_total", "kind", "neginf"),
    "rows_nonfinite": ("guardrails_flagged_rows_total", "reason", "nonfinite"),
    "rows_no_valid_token": ("guardrails_flagged_rows_total", "reason", "no_valid_token"),
    "calls": ("guardrails_guard_calls_total", "", ""),
}
SHARED_SITE = "soak.shared"
# Memory allowed to grow between the first reload and the end of a soak. Python heap: far
# below one object per call or per report, so a leak of either shows. Resident memory: torch's
# allocator and glibc arenas move by a few hundred KiB; a per-call leak of even 64 bytes of
# tensor memory would add 3 MiB over 50,000 calls.
MAX_HEAP_GROWTH = 256 * 1024
MAX_RSS_GROWTH = 16 * 1024 * 1024
# guardrails' one thread per sampling instance (`guardrails.reporting.poller`); the soak has
# at most two instances open at once (the new one, and the old until no thread calls it).
POLLER_THREAD = "guardrails-report-poller"
MAX_OPEN_INSTANCES = 2


# -- soak: threads, injections, instances closed and re-created mid-run ---------------------


@dataclass(frozen=True)
class SoakConfig:
    calls: int = 50_000
    threads: int = 4
    generations: int = 4  # Guardrails instances, each closed and replaced mid-run
    dirty: float = 0.1  # share of calls with injected bad values
    seed: int = 0
    every_calls: int = 8
    log_interval_s: float = 10.0
    # The throttle's clock advances with the calls made (1 ms each), so the log bound below
    # does not depend on how fast this machine is.
    clock_s_per_call: float = 1e-3


class CountingLogger:
    """Counts events per (site, event) without keeping them (a list would grow per event)."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def _record(self, event: str, **fields: Any) -> None:
        key = (str(fields.get("site", "")), event)
        with self._lock:
            self.events[key] = self.events.get(key, 0) + 1

    info = warning = error = _record

    def for_site(self, site: str) -> int:
        return sum(n for (name, _event), n in self.events.items() if name == site)


class _Generation:
    def __init__(self, number: int, config: SoakConfig, registry: Any, clock: Any) -> None:
        from guardrails import Guardrails, GuardSettings

        self.number = number
        self.logger = CountingLogger()
        settings = GuardSettings(
            environ={},
            reporting={
                "every_calls": config.every_calls,
                "log_interval_s": config.log_interval_s,
            },
            sites={SHARED_SITE: {"count_neginf": True}},
        )
        self.guards = Guardrails(settings, registry=registry, logger=self.logger, clock=clock)
        self.own = [self.guards.site(f"soak.t{i}") for i in range(config.threads)]
        self.shared = self.guards.site(SHARED_SITE)
        self.opened_at = clock()


@dataclass(frozen=True)
class _Closed:
    """What is kept of a closed instance: the instance itself is dropped, so that the
    memory check sees the library's growth, not the harness's."""

    number: int
    counts: dict[tuple[str, str], int]
    events: dict[str, int]
    span_s: float


@dataclass
class SoakResult:
    config: SoakConfig
    calls: int = 0
    dirty_calls: int = 0
    wall_s: float = 0.0
    # (generation, site) -> kind -> count, from the oracle
    expected: dict[tuple[int, str], dict[str, int]] = field(default_factory=dict)
    # (generation, site) -> kind -> count, from that instance's counts() after close()
    counted: dict[tuple[int, str], dict[str, int]] = field(default_factory=dict)
    # site -> kind -> Prometheus sample (summed over instances by the shared registry)
    exported: dict[str, dict[str, float | None]] = field(default_factory=dict)
    reporting_errors: float = 0.0
    # (generation, site) -> (log events, bound from the throttle)
    log_events: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    unhealed_calls: int = 0
    # Calls whose returned row flags were not the oracle's for that call's own tensor.
    wrong_flag_calls: int = 0
    worker_errors: list[str] = field(default_factory=list)
    # Threads besides guardrails' report pollers, which are counted apart: the soak's
    # instances start at most one each (at most 2 open at once), and earlier instances of the
    # process (other tests') may have theirs running, or ending, meanwhile.
    threads_before: int = 0
    threads_max: int = 0
    threads_after: int = 0
    pollers_before: int = 0
    pollers_max: int = 0  # the most alive at once during the run, beyond pollers_before
    pollers_after: int = 0
    heap_growth_bytes: int = 0
    rss_growth_bytes: int | None = None

    def exported_expected(self) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for (_generation, site), kinds in self.expected.items():
            into = totals.setdefault(site, dict.fromkeys(KINDS, 0))
            for kind, value in kinds.items():
                into[kind] += value
        return totals

    def problems(self) -> list[str]:
        """Every check of the run that failed, as readable lines (empty: all passed)."""
        out = [f"worker error: {e}" for e in self.worker_errors]
        if self.calls != self.config.calls:
            out.append(f"made {self.calls} calls, meant {self.config.calls}")
        if self.unhealed_calls:
            out.append(f"{self.unhealed_calls} calls left NaN or +Inf in the logits")
        if self.wrong_flag_calls:
            out.append(f"{self.wrong_flag_calls} calls returned flags not their own call's")
        if self.counted != self.expected:
            out.append(f"counts() differ from the oracle: {self.counted} != {self.expected}")
        exported = self.exported_expected()
        for site, kinds in exported.items():
            for kind, value in kinds.items():
                if kind == "neginf" and site != SHARED_SITE:
                    continue  # not counted there, so not exported
                if self.exported.get(site, {}).get(kind) != value:
                    seen = self.exported.get(site, {}).get(kind)
                    out.append(f"Prometheus {site} {kind} = {seen}, oracle {value}")
        if self.reporting_errors:
            out.append(f"{self.reporting_errors} reporting errors")
        for key, (events, bound) in self.log_events.items():
            if events > bound:
                out.append(f"{key}: {events} log events, throttle bound {bound}")
        if self.heap_growth_bytes >= MAX_HEAP_GROWTH:
            out.append(f"Python heap grew {self.heap_growth_bytes} bytes")
        if self.rss_growth_bytes is not None and self.rss_growth_bytes >= MAX_RSS_GROWTH:
            out.append(f"resident memory grew {self.rss_growth_bytes} bytes")
        if self.threads_after != self.threads_before:
            out.append(f"threads: {self.threads_before} before, {self.threads_after} after")
        if self.threads_max > self.threads_before + self.config.threads:
            out.append(f"threads: up to {self.threads_max} alive during the run")
        if self.pollers_max > MAX_OPEN_INSTANCES:
            out.append(f"report pollers: up to {self.pollers_max} more alive during the run")
        if self.pollers_after > self.pollers_before:
            out.append(f"report pollers: {self.pollers_before} before, {self.pollers_after} after")
        return out


def _threads() -> tuple[int, int]:
    """(threads alive besides guardrails' report pollers, report pollers alive)."""
    alive = threading.enumerate()
    pollers = sum(thread.name == POLLER_THREAD for thread in alive)
    return len(alive) - pollers, pollers


def _oracle(x: torch.Tensor, *, count_neginf: bool) -> tuple[torch.Tensor, list[int]]:
    """The oracle's row flags and counts for one call on `x`, counts in KINDS order (the call
    included)."""
    flags, counts = expected_flags_and_counts(x, count_neginf=count_neginf)
    return flags, [*(counts[kind] for kind in KINDS[:-1]), 1]


def _inject(x: torch.Tensor, rng: random.Random) -> None:
    """Write 1-3 random kinds of damage into `x` ([ROWS, VOCAB]), whole rows included."""
    for _ in range(rng.randint(1, 3)):
        row = rng.randrange(ROWS)
        what = rng.random()
        if what < 0.05:
            x[row] = math.nan  # no valid token left
        elif what < 0.08:
            x[row] = -math.inf
            x[row, rng.randrange(VOCAB)] = math.nan
        else:
            value = rng.choice((math.nan, math.nan, math.inf, -math.inf))
            start = rng.randrange(VOCAB)
            x[row, start : start + rng.randint(1, 4)] = value


class _State:
    def __init__(self, generation: _Generation) -> None:
        self.current = generation


def _drive(
    index: int,
    quota: int,
    config: SoakConfig,
    state: _State,
    done: list[int],
    acks: list[int],
    tallies: dict[tuple[int, str], list[int]],
    stats: dict[str, int],
    errors: list[str],
) -> None:
    rng = random.Random(config.seed * 7919 + index)
    clean = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(index))
    x = clean.clone()
    try:
        for _ in range(quota):
            generation = state.current
            # Written after reading `current`: once the main thread sees the new number
            # here, this thread will never call an older instance again.
            acks[index] = generation.number
            shared = rng.random() < 0.25
            site = generation.shared if shared else generation.own[index]
            x.copy_(clean)
            dirty = rng.random() < config.dirty
            if dirty:
                _inject(x, rng)
                expect_flags, expect = _oracle(x, count_neginf=shared)
            flags = site(x)
            # Read at once, before this thread's next call: they must be this call's own
            # flags, whatever the other threads do on the same site meanwhile.
            if not (torch.equal(flags, expect_flags) if dirty else not bool(flags.any())):
                stats["wrong_flags"] += 1
            tally = tallies.setdefault((generation.number, site.name), [0] * len(KINDS))
            if dirty:
                for i, value in enumerate(expect):
                    tally[i] += value
                stats["dirty"] += 1
                if bool(x.isnan().any()) or bool(x.isposinf().any()):
                    stats["unhealed"] += 1
            else:
                tally[-1] += 1
            done[index] += 1
    except Exception as exc:  # reported as a failed check, never swallowed
        errors.append(f"thread {index}: {type(exc).__name__}: {exc}")


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None  # not Linux: RSS is not checked


def soak(config: SoakConfig) -> SoakResult:
    """Run the soak described in the module docstring and collect every figure."""
    from prometheus_client import CollectorRegistry

    result = SoakResult(config)
    registry = CollectorRegistry()
    done = [0] * config.threads
    acks = [0] * config.threads
    errors: list[str] = []

    def clock() -> float:
        return sum(done) * config.clock_s_per_call

    gc.collect()
    result.threads_before, result.pollers_before = _threads()
    generation = _Generation(1, config, registry, clock)
    closed: list[_Closed] = []
    opened = 1
    state = _State(generation)
    tallies: list[dict[tuple[int, str], list[int]]] = [{} for _ in range(config.threads)]
    stats = [{"dirty": 0, "unhealed": 0, "wrong_flags": 0} for _ in range(config.threads)]
    quotas = [config.calls // config.threads] * config.threads
    quotas[0] += config.calls - sum(quotas)
    workers = [
        threading.Thread(
            target=_drive,
            args=(i, quotas[i], config, state, done, acks, tallies[i], stats[i], errors),
            name=f"soak-{i}",
        )
        for i in range(config.threads)
    ]
    started = time.perf_counter()
    tracemalloc.start()
    heap_start = rss_start = None
    try:
        for worker in workers:
            worker.start()
        step = config.calls // config.generations
        next_switch = step
        while any(worker.is_alive() for worker in workers):
            time.sleep(0.002)
            threads, pollers = _threads()
            result.pollers_max = max(result.pollers_max, pollers - result.pollers_before)
            result.threads_max = max(result.threads_max, threads)
            if sum(done) < next_switch or opened >= config.generations:
                continue
            opened += 1
            old, generation = generation, _Generation(opened, config, registry, clock)
            state.current = generation
            while not all(
                acks[i] == generation.number or not workers[i].is_alive()
                for i in range(config.threads)
            ):
                time.sleep(0.0005)
            closed.append(_close(old, clock))
            del old
            next_switch += step
            if heap_start is None:
                # After one reload, with one instance open, as at the end.
                gc.collect()
                heap_start = tracemalloc.get_traced_memory()[0]
                rss_start = _rss_bytes()
        for worker in workers:
            worker.join()
        gc.collect()
        heap_end = tracemalloc.get_traced_memory()[0]
        rss_end = _rss_bytes()
    finally:
        tracemalloc.stop()
    closed.append(_close(generation, clock))
    result.wall_s = time.perf_counter() - started
    result.threads_after, result.pollers_after = _threads()
    if heap_start is not None:
        result.heap_growth_bytes = heap_end - heap_start
    if rss_start is not None and rss_end is not None:
        result.rss_growth_bytes = rss_end - rss_start
    result.worker_errors = errors
    result.unhealed_calls = sum(s["unhealed"] for s in stats)
    result.wrong_flag_calls = sum(s["wrong_flags"] for s in stats)
    result.dirty_calls = sum(s["dirty"] for s in stats)
    result.calls = sum(done)

    for per_thread in tallies:
        for key, values in per_thread.items():
            into = result.expected.setdefault(key, dict.fromkeys(KINDS, 0))
            for kind, value in zip(KINDS, values, strict=True):
                into[kind] += value
    for gen in closed:
        for (site, kind), value in gen.counts.items():
            if (gen.number, site) in result.expected or value:
                result.counted.setdefault((gen.number, site), dict.fromkeys(KINDS, 0))[kind] = value
        for site, events in gen.events.items():
            key = (gen.number, site)
            news = key in result.expected and any(
                result.expected[key][k] for k in ("nan", "posinf", "neginf", "rows_no_valid_token")
            )
            # First hit at once, at most one per interval after it, one more at close().
            bound = (2 + int(gen.span_s // config.log_interval_s)) if news else 0
            result.log_events[key] = (events, bound)
    for site in {site for _gen, site in result.expected}:
        result.exported[site] = {
            kind: registry.get_sample_value(
                metric, {"site": site, "rank": "0", **({label: value} if label else {})}
            )
            for kind, (metric, label, value) in SERIES.items()
        }
    result.reporting_errors = sum(
        registry.get_sample_value("guardrails_reporting_errors_total", {"stage": s, "rank": "0"})
        or 0.0
        for s in ("poll", "metrics", "logs")
    )
    return result


def _close(generation: _Generation, clock: Any) -> _Closed:
    generation.guards.close()
    sites = [site.name for site in (*generation.own, generation.shared)]
    return _Closed(
        generation.number,
        generation.guards.counts(),
        {site: generation.logger.for_site(site) for site in sites},
        clock() - generation.opened_at,
    )


# -- multi-process: four workers, one SIGKILLed mid-run ------------------------------------

LOGITS_SITE, TOKEN_SITE = "mp.logits", "mp.token_ids"
WORKER_ARGS = ("CALLS", "EVERY", "SEED", "PAUSE_AT", "RANK")


def schedule(seed: int, step: int) -> tuple[int, int, int]:
    """(NaN values, +Inf values, out-of-vocab ids) injected at call `step` of a worker."""
    rng = random.Random(seed * 1_000_003 + step)
    if rng.random() < 0.7:
        return 0, 0, 0
    return rng.randint(0, 3), rng.randint(0, 2), rng.randint(0, 2)


def expected_series(seed: int, calls: int) -> dict[str, int]:
    """What a worker's first `calls` calls add to each series it exports."""
    out = dict.fromkeys(("nan", "posinf", "rows_nonfinite", "oob_rows", "calls"), 0)
    for step in range(1, calls + 1):
        nan, posinf, oob = schedule(seed, step)
        out["nan"] += nan
        out["posinf"] += posinf
        out["rows_nonfinite"] += 1 if nan + posinf else 0
        out["oob_rows"] += oob
    out["calls"] = calls
    return out


def _series_labels(rank: int) -> dict[str, tuple[str, dict[str, str]]]:
    r = str(rank)
    return {
        "nan": (
            "guardrails_nonfinite_values_total",
            {"site": LOGITS_SITE, "kind": "nan", "rank": r},
        ),
        "posinf": (
            "guardrails_nonfinite_values_total",
            {"site": LOGITS_SITE, "kind": "posinf", "rank": r},
        ),
        "rows_nonfinite": (
            "guardrails_flagged_rows_total",
            {"site": LOGITS_SITE, "reason": "nonfinite", "rank": r},
        ),
        "oob_rows": (
            "guardrails_flagged_rows_total",
            {"site": TOKEN_SITE, "reason": "oob_token", "rank": r},
        ),
        "calls": ("guardrails_guard_calls_total", {"site": LOGITS_SITE, "rank": r}),
    }


def read_series(registry: Any, rank: int) -> dict[str, float | None]:
    return {
        name: registry.get_sample_value(metric, labels)
        for name, (metric, labels) in _series_labels(rank).items()
    }


def worker(calls: int, every: int, seed: int, pause_at: int, rank: int) -> None:
    """One engine worker (run in its own process): guard `calls` scheduled calls.

    At call `pause_at` it prints what it has reported so far and waits for a line on stdin
    (the parent kills it there, or says go). Stdout carries only these JSON lines; the
    worker, being the host, sends guardrails' log events to stderr.
    """
    from prometheus_client import REGISTRY

    import guardrails as gr

    gr.configure_json_logs(sys.stderr)
    guards = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": every}))
    logits_site = guards.site(LOGITS_SITE)
    ids_site = guards.token_site(TOKEN_SITE, vocab_size=VOCAB)
    x = torch.zeros(ROWS, VOCAB)
    for step in range(1, calls + 1):
        nan, posinf, oob = schedule(seed, step)
        x.zero_()
        row = step % ROWS
        x[row, :nan] = math.nan
        if posinf:
            x[row, VOCAB - posinf :] = math.inf
        logits_site(x)
        ids = torch.tensor([1, 2, 3])
        ids[:oob] = VOCAB + step
        ids_site(ids)
        if step == pause_at:
            # Read from this process's own series (its multiprocess file): what it reported.
            reported = read_series(REGISTRY, rank)
            print(json.dumps({"paused_at": step, "reported": reported}), flush=True)
            if not sys.stdin.readline():
                return
    guards.close()
    print(json.dumps({"done": calls, "reported": read_series(REGISTRY, rank)}), flush=True)


@dataclass
class KillResult:
    workers: int
    calls: int
    every: int
    victim: int
    kill_at: int
    returncodes: dict[int, int | None] = field(default_factory=dict)
    aggregate: dict[int, dict[str, float | None]] = field(default_factory=dict)
    expected: dict[int, dict[str, int]] = field(default_factory=dict)
    victim_printed: dict[str, float | None] = field(default_factory=dict)
    victim_full: dict[str, int] = field(default_factory=dict)  # counted, unreported included
    survivors_mid_run: bool = False
    stderr: dict[int, str] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = []
        for rank, expected in self.expected.items():
            got = self.aggregate.get(rank, {})
            if any(got.get(k) != v for k, v in expected.items()):
                out.append(f"rank {rank}: aggregate {got} != expected {expected}")
        if self.returncodes.get(self.victim) != -signal.SIGKILL:
            out.append(f"victim exit {self.returncodes.get(self.victim)}, not SIGKILL")
        for rank, code in self.returncodes.items():
            if rank != self.victim and code != 0:
                out.append(f"rank {rank} exited {code}: {self.stderr.get(rank, '')[-2000:]}")
        if self.victim_printed != self.aggregate.get(self.victim):
            out.append(f"victim printed {self.victim_printed}, aggregate differs")
        if not self.survivors_mid_run:
            out.append("the survivors were not mid-run when the victim was killed")
        return out


def multiprocess_kill(
    directory: Path,
    *,
    workers: int = 4,
    calls: int = 200,
    every: int = 8,
    seed: int = 0,
    victim: int = 1,
    kill_at: int | None = None,
    timeout_s: float = 300.0,
) -> KillResult:
    """Start `workers` processes on one multiprocess directory, SIGKILL `victim` mid-run.

    The victim pauses at call `kill_at` (default: a random call in the middle, not a multiple
    of `every`, so that some counts are still unreported), the survivors half-way; with all of
    them paused the victim is killed, then the survivors finish and close.
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    rng = random.Random(seed)
    if kill_at is None:
        kill_at = rng.randrange(calls // 4, 3 * calls // 4)
        if kill_at % every == 0:
            kill_at += 1
    result = KillResult(workers, calls, every, victim, kill_at)
    base_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GUARDRAILS_") and k not in ("RANK", "LOCAL_RANK")
    }
    procs: dict[int, subprocess.Popen[str]] = {}
    stderr_files: dict[int, IO[str]] = {}
    try:
        for rank in range(workers):
            env = {**base_env, "PROMETHEUS_MULTIPROC_DIR": str(directory), "RANK": str(rank)}
            pause = kill_at if rank == victim else calls // 2
            stderr_files[rank] = open(  # noqa: SIM115  # closed in the finally below
                directory.parent / f"worker-{rank}.stderr", "w+", encoding="utf-8"
            )
            procs[rank] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.system.workloads",
                    *(str(v) for v in (calls, every, seed + rank, pause, rank)),
                ],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr_files[rank],
                text=True,
            )
        deadline = time.monotonic() + timeout_s
        paused: dict[int, dict[str, Any]] = {}
        for rank, proc in procs.items():
            assert proc.stdout is not None
            line = _readline(proc, deadline)
            if line is None:
                raise RuntimeError(f"worker {rank} never paused: {_tail(stderr_files[rank])}")
            paused[rank] = json.loads(line)
        result.victim_printed = paused[victim]["reported"]
        result.survivors_mid_run = all(
            procs[r].poll() is None and paused[r]["paused_at"] < calls for r in procs if r != victim
        )
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=60)
        for rank, proc in procs.items():
            if rank != victim:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
        for rank, proc in procs.items():
            if rank != victim:
                proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for rank, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            result.returncodes[rank] = proc.returncode
            result.stderr[rank] = _tail(stderr_files[rank]) if rank in stderr_files else ""
        for handle in stderr_files.values():
            handle.close()

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]  # untyped upstream
    for rank in range(workers):
        result.aggregate[rank] = read_series(registry, rank)
        reported_calls = calls if rank != victim else every * (kill_at // every)
        result.expected[rank] = expected_series(seed + rank, reported_calls)
    result.victim_full = expected_series(seed + victim, kill_at)
    return result


def _readline(proc: subprocess.Popen[str], deadline: float) -> str | None:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None  # exited
        if line.startswith("{"):
            return line
    return None


def _tail(handle: IO[str]) -> str:
    with contextlib.suppress(OSError, ValueError):
        handle.flush()
        handle.seek(0)
        return handle.read()[-4000:]
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """The worker process of `multiprocess_kill()`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 5:
        print(f"usage: python -m tests.system.workloads {' '.join(WORKER_ARGS)}", file=sys.stderr)
        return 2
    worker(*(int(arg) for arg in args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
