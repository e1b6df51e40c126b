"""Sites shared by real threads, and processes forked while another thread is inside a call.

A call's flags belong to the thread that made it: a thread that passes only clean logits never
sees a flag set by another thread's call, however the calls interleave. A process forked while
another thread holds a site (its lock, its buffers) gets a child whose first guarded call works
and counts. The switch interval is cut to the minimum so that threads change hands between a
call's return and the caller's read of its flags as often as the interpreter allows.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from guardrails import Guardrails, RowFlag
from guardrails.logs import SilentLogger
from guardrails.testing import fresh_guardrails
from tests.system.fork_workload import child_status

CLEAN_CALLS = 20_000  # the shared flags buffer showed another thread's flags within ~10k-40k
FORKS = 5
CHILD_WAIT_S = 20.0  # a child that has not exited by then is deadlocked: killed, test fails
NO_VALID = int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)


@pytest.fixture
def quick_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def quiet() -> Iterator[Guardrails]:
    with fresh_guardrails(logger=SilentLogger()) as guards:
        yield guards


def _run_beside(
    background: Callable[[threading.Event], None], foreground: Callable[[], None]
) -> None:
    """`foreground()` in this thread while `background(stop)` loops in another one."""
    stop = threading.Event()
    failures: list[BaseException] = []

    def wrapped() -> None:
        try:
            background(stop)
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    thread = threading.Thread(target=wrapped, daemon=True)
    thread.start()
    try:
        foreground()
    finally:
        stop.set()
        thread.join()
    assert failures == []


def test_a_thread_passing_clean_logits_never_gets_another_threads_flags(
    quiet: Guardrails, quick_switches: None
) -> None:
    site = quiet.site("sampler.logits")
    dirty_calls = [0]
    flagged: list[list[int]] = []

    def dirty(stop: threading.Event) -> None:
        x = torch.empty(4, 64)
        while not stop.is_set():
            x.fill_(math.nan)  # every row: NaN and no valid token
            assert site(x).tolist() == [NO_VALID] * 4
            dirty_calls[0] += 1

    def clean() -> None:
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
        for _ in range(CLEAN_CALLS):
            flags = site(x)
            if bool(flags.any()):
                flagged.append(flags.tolist())

    _run_beside(dirty, clean)
    assert len(flagged) == 0, flagged[:3]
    assert dirty_calls[0] > 0  # the threads did overlap
    assert quiet.count("sampler.logits", "calls") == CLEAN_CALLS + dirty_calls[0]
    assert quiet.count("sampler.logits", "rows_no_valid_token") == 4 * dirty_calls[0]


def test_a_token_site_shared_by_threads_returns_each_callers_own_flags(
    quiet: Guardrails, quick_switches: None
) -> None:
    site = quiet.token_site("sampler.token_ids", vocab_size=16)
    dirty_calls = [0]
    flagged: list[list[int]] = []

    def dirty(stop: threading.Event) -> None:
        ids = torch.empty(4, dtype=torch.int64)
        while not stop.is_set():
            ids.fill_(99)
            site(ids)
            dirty_calls[0] += 1

    def clean() -> None:
        ids = torch.tensor([1, 2, 3, 4])
        for _ in range(CLEAN_CALLS):
            flags = site(ids)
            if bool(flags.any()):
                flagged.append(flags.tolist())

    _run_beside(dirty, clean)
    assert len(flagged) == 0, flagged[:3]
    assert quiet.count("sampler.token_ids", "rows_oob_token") == 4 * dirty_calls[0]


def test_an_abort_policy_shared_by_threads_never_ends_a_clean_request(
    quiet: Guardrails, quick_switches: None
) -> None:
    pytest.importorskip("transformers")
    from guardrails.integrations.transformers import GuardLogitsProcessor

    eos = 1
    processor = GuardLogitsProcessor(quiet, abort_on=["no_valid_token"], eos_token_id=eos)
    input_ids = torch.zeros(2, 3, dtype=torch.int64)
    dirty_steps = [0]
    ended: list[int] = []

    def dirty(stop: threading.Event) -> None:
        scores = torch.empty(2, 64)
        while not stop.is_set():
            scores.fill_(math.nan)
            out = processor(input_ids, scores)  # type: ignore[arg-type]
            assert out.argmax(-1).tolist() == [eos, eos]
            dirty_steps[0] += 1

    def clean() -> None:
        scores = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
        scores[:, eos] = -1e4  # a clean request never picks EOS
        for step in range(CLEAN_CALLS // 2):
            out = processor(input_ids, scores)  # type: ignore[arg-type]
            if not torch.equal(out, scores):
                ended.append(step)

    _run_beside(dirty, clean)
    assert len(ended) == 0, ended[:3]
    assert processor.aborted_rows() == 2 * dirty_steps[0]


# -- fork ------------------------------------------------------------------------------------


def _child_status(pid: int) -> int | str:
    """The child's exit status, or "deadlocked" (killed) if it outlives CHILD_WAIT_S."""
    return child_status(pid, CHILD_WAIT_S)


def _in_child(guards: Guardrails) -> int:
    """One dirty logits call and one dirty token-id call; 0 if both worked and counted."""
    logits = guards.site("sampler.logits")
    ids = guards.token_site("sampler.token_ids", vocab_size=16)
    nan_before = guards.count("sampler.logits", "nan")
    oob_before = guards.count("sampler.token_ids", "oob_token")
    x = torch.randn(2, 8)
    x[0, 3] = math.nan
    tokens = torch.tensor([3, 40])
    ok = (
        logits(x).tolist() == [int(RowFlag.NAN), 0]
        and x[0, 3].item() == -math.inf
        and ids(tokens).tolist() == [0, int(RowFlag.OOB_TOKEN)]
        and tokens.tolist() == [3, 0]
        and guards.count("sampler.logits", "nan") == nan_before + 1
        and guards.count("sampler.token_ids", "oob_token") == oob_before + 1
    )
    return 0 if ok else 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_is_inside_a_guarded_call_gives_a_working_child(
    quiet: Guardrails,
) -> None:
    logits = quiet.site("sampler.logits")
    ids = quiet.token_site("sampler.token_ids", vocab_size=16)
    statuses: list[int | str] = []

    def busy(stop: threading.Event) -> None:
        x = torch.randn(8, 256)
        tokens = torch.arange(8)
        while not stop.is_set():
            logits(x)
            ids(tokens)

    def fork_children() -> None:
        while logits.calls < 100:  # the other thread is in its loop
            time.sleep(0.001)
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                code = 3
                try:
                    code = _in_child(quiet)
                finally:
                    os._exit(code)
            statuses.append(_child_status(pid))

    _run_beside(busy, fork_children)
    assert statuses == [0] * FORKS


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_holds_the_service_locks_gives_a_working_child(
    quiet: Guardrails,
) -> None:
    # Another thread is inside site creation or patching (the service's locks) at the fork.
    import guardrails.service as service

    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with quiet._sites._lock, quiet._attachment._lock, service._default_lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: a new site, a new default instance, then a guarded call
            code = 3
            try:
                service.default()
                quiet.patches()
                code = _in_child(quiet)
            finally:
                os._exit(code)
        status = _child_status(pid)
    finally:
        release.set()
        holder.join(10)
    assert status == 0
