"""Load and soak, short version: the workloads of `tests/system/workloads.py` at make-test size.

- 50,000 guarded calls from 4 threads, 10% with injected damage, while the main thread closes
  the `Guardrails` instance 3 times mid-run and builds the next one on the same registry.
- 4 worker processes in prometheus multiprocess mode; one is SIGKILLed mid-run.

`make reliability` (`benchmarks/reliability.py`) runs the same workloads with one million calls
and 20,000 calls per worker; `docs/reliability.md` has the figures. Marked `slow`.
"""

from __future__ import annotations

import math
import signal
import threading

import pytest
import torch

from guardrails.testing import fresh_guardrails
from tests.system.workloads import (
    MAX_HEAP_GROWTH,
    MAX_OPEN_INSTANCES,
    MAX_RSS_GROWTH,
    SHARED_SITE,
    KillResult,
    SoakConfig,
    SoakResult,
    expected_series,
    multiprocess_kill,
    soak,
)

pytestmark = pytest.mark.slow

SOAK = SoakConfig(calls=50_000, threads=4, generations=4)


@pytest.fixture(scope="module")
def soaked() -> SoakResult:
    return soak(SOAK)


def test_soak_makes_every_call_across_every_instance(soaked: SoakResult) -> None:
    assert soaked.worker_errors == []
    assert soaked.calls == SOAK.calls
    assert {generation for generation, _site in soaked.expected} == {1, 2, 3, 4}
    assert soaked.dirty_calls > SOAK.calls * SOAK.dirty * 0.8


def test_soak_heals_every_dirty_call(soaked: SoakResult) -> None:
    assert soaked.unhealed_calls == 0


def test_soak_every_call_gets_its_own_flags_under_threads(soaked: SoakResult) -> None:
    # Four threads share one site a quarter of the time: each call's returned flags must be
    # the oracle's for that call's own tensor (a shared buffer would hand out another's).
    assert soaked.dirty_calls > 0
    assert soaked.wrong_flag_calls == 0


def test_soak_counts_of_every_instance_are_exact(soaked: SoakResult) -> None:
    assert soaked.counted == soaked.expected


def test_soak_prometheus_samples_sum_every_instance_exactly(soaked: SoakResult) -> None:
    expected = soaked.exported_expected()
    for site, kinds in expected.items():
        for kind, value in kinds.items():
            if kind == "neginf" and site != SHARED_SITE:
                assert soaked.exported[site][kind] is None  # not counted there, not exported
            else:
                assert soaked.exported[site][kind] == value, (site, kind)
    assert soaked.reporting_errors == 0


def test_soak_python_heap_stays_flat(soaked: SoakResult) -> None:
    assert soaked.heap_growth_bytes < MAX_HEAP_GROWTH


def test_soak_resident_memory_stays_flat(soaked: SoakResult) -> None:
    if soaked.rss_growth_bytes is None:
        pytest.skip("RSS is read from /proc/self/statm (Linux)")
    assert soaked.rss_growth_bytes < MAX_RSS_GROWTH


def test_soak_starts_only_its_pollers_and_leaves_no_thread(soaked: SoakResult) -> None:
    # Besides the soak's own threads: one report poller per open instance, none after close.
    assert soaked.threads_max == soaked.threads_before + SOAK.threads
    assert soaked.pollers_max <= MAX_OPEN_INSTANCES
    assert soaked.threads_after == soaked.threads_before
    assert soaked.pollers_after <= soaked.pollers_before


def test_soak_log_events_stay_within_the_throttle(soaked: SoakResult) -> None:
    for key, (events, bound) in soaked.log_events.items():
        assert events <= bound, key
        if bound:
            assert events >= 1, key  # the first hit of each instance is logged at once


def test_calls_racing_close_keep_healing_and_counting() -> None:
    guards = fresh_guardrails(reporting={"every_calls": 1})
    site = guards.site("sampler.logits")
    started = threading.Barrier(3)
    calls = [0, 0]
    failures: list[str] = []

    def hammer(index: int) -> None:
        x = torch.zeros(2, 16)
        started.wait()
        for _ in range(3000):
            x.zero_()
            x[1, 3] = math.nan
            try:
                site(x)
            except Exception as exc:
                failures.append(repr(exc))
                return
            if not bool(x[1, 3] == -math.inf):
                failures.append("not healed")
            calls[index] += 1

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    started.wait()
    guards.close()  # while both threads call the site
    for thread in threads:
        thread.join()
    assert failures == []
    assert guards.count("sampler.logits", "calls") == sum(calls) == 6000
    assert guards.count("sampler.logits", "nan") == 6000


# -- multiprocess: one of four workers SIGKILLed mid-run ------------------------------------

WORKERS, CALLS, EVERY, SEED = 4, 200, 8, 7


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> KillResult:
    directory = tmp_path_factory.mktemp("kill") / "multiproc"
    directory.mkdir()
    return multiprocess_kill(directory, workers=WORKERS, calls=CALLS, every=EVERY, seed=SEED)


def test_victim_is_sigkilled_while_every_worker_is_mid_run(killed: KillResult) -> None:
    assert killed.returncodes[killed.victim] == -signal.SIGKILL
    assert killed.survivors_mid_run
    assert killed.kill_at % EVERY != 0  # some of its counts were still unreported


def test_survivors_count_exactly_after_a_sibling_is_killed(killed: KillResult) -> None:
    for rank in range(WORKERS):
        if rank == killed.victim:
            continue
        assert killed.returncodes[rank] == 0, killed.stderr[rank]
        assert killed.aggregate[rank] == expected_series(SEED + rank, CALLS)


def test_killed_worker_keeps_exactly_what_it_reported(killed: KillResult) -> None:
    # Reported = its counts at its last report: the first EVERY * floor(n / EVERY) calls.
    reported_calls = EVERY * (killed.kill_at // EVERY)
    expected = expected_series(SEED + killed.victim, reported_calls)
    assert killed.aggregate[killed.victim] == expected
    assert killed.victim_printed == expected


def test_killed_worker_loses_only_calls_after_its_last_report(killed: KillResult) -> None:
    lost = killed.victim_full["calls"] - killed.aggregate[killed.victim]["calls"]
    assert lost == killed.kill_at % EVERY
    assert 0 < lost < EVERY
