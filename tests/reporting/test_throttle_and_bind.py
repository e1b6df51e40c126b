"""The log throttle and the bind-error mapping, each on its own."""

from __future__ import annotations

import errno
import socket

import pytest

from guardrails.reporting.exposition import address_in_use, bind_problem
from guardrails.reporting.throttle import LogThrottle


def test_the_first_event_goes_at_once_then_one_per_interval() -> None:
    throttle = LogThrottle(2)
    assert throttle.due(100.0, fresh=True, final=False)
    throttle.logged_now(100.0, 5.0, [3, 1], 10)
    assert (throttle.logged, throttle.logged_calls, throttle.next_at) == ([3, 1], 10, 105.0)
    assert not throttle.due(101.0, fresh=True, final=False)
    assert not throttle.due(102.0, fresh=False, final=False)
    assert throttle.suppressed == 1  # only fresh news held back is folded in
    assert throttle.due(102.0, fresh=False, final=True)  # a flush always logs
    assert throttle.due(105.0, fresh=True, final=False)
    throttle.pending = True
    throttle.logged_now(105.0, 5.0, [4, 1], 12)
    assert (throttle.suppressed, throttle.pending) == (0, False)


def test_a_forked_child_starts_with_nothing_logged() -> None:
    throttle = LogThrottle(2)
    throttle.logged_now(1.0, 5.0, [3, 1], 10)
    throttle.suppressed, throttle.pending = 4, True
    throttle.restart(12)
    assert (throttle.logged, throttle.logged_calls) == ([0, 0], 12)
    assert (throttle.suppressed, throttle.pending) == (0, False)


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"),
        OSError(errno.EAFNOSUPPORT, "Address family not supported"),
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        UnicodeError("label empty or too long"),
    ],
)
def test_an_address_fault_names_the_address(exc: OSError | UnicodeError) -> None:
    problem = bind_problem(exc, "nowhere.invalid", 9400, addr_origin="A", port_origin="P")
    assert problem.where == "A"
    assert problem.value == "nowhere.invalid"
    assert "cannot serve metrics on nowhere.invalid:9400" in problem.message
    assert not address_in_use(exc)


def test_a_port_in_use_names_the_port() -> None:
    exc = OSError(errno.EADDRINUSE, "Address already in use")
    problem = bind_problem(exc, "127.0.0.1", 9400, addr_origin="A", port_origin="P")
    assert (problem.where, problem.value) == ("P", 9400)
    assert problem.message == "cannot serve metrics on 127.0.0.1:9400: Address already in use"
    assert address_in_use(exc)
