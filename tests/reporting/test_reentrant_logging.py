"""A host log handler may call back into guardrails from inside a guardrails event.

A structlog processor (the host configured structlog) or a standard-library `logging.Handler`
(it did not) calls `poll()`, `flush()`, `close()`, a new site or a site's first device from
inside the first NaN event. Each scenario runs in its own thread, joined with a timeout: a
thread still alive is a deadlock. Everything runs in one child process per logging style, so a
regression that deadlocks cannot hang the test run itself (the child is killed).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.processes import run_python

ACTIONS = ("poll", "flush", "close", "new_site", "new_device")

CHILD = r"""
import json, logging, math, os, sys, threading
import structlog, torch
from prometheus_client import CollectorRegistry
from guardrails.testing import fresh_guardrails

style, actions = sys.argv[1], sys.argv[2].split(",")
callbacks = []

if style == "structlog":
    def processor(logger, method, event_dict):
        for callback in callbacks:
            callback(event_dict["event"])
        return event_dict
    structlog.configure(
        processors=[processor, structlog.processors.KeyValueRenderer()],
        logger_factory=structlog.ReturnLoggerFactory(),
    )
else:
    class Handler(logging.Handler):
        def emit(self, record):
            for callback in callbacks:
                callback(record.getMessage().split()[0])
    logging.getLogger("guardrails").addHandler(Handler())

results = {}
for action in actions:
    registry = CollectorRegistry()
    guards = fresh_guardrails(registry=registry, reporting={"every_calls": 1})
    later = guards.site("later.logits")  # registered; no device until its first call
    handled = []

    def callback(event, action=action, guards=guards, later=later, handled=handled):
        if event != "guardrails.nonfinite_logits" or handled:
            return
        handled.append(event)
        if action == "poll":
            guards.poll()
        elif action == "flush":
            guards.flush()
        elif action == "close":
            guards.close()
        elif action == "new_site":
            guards.site("brand.new.logits")(torch.randn(2, 8))
        elif action == "new_device":
            later(torch.randn(2, 8))

    def work(guards=guards):
        x = torch.randn(2, 8)
        x[0, :3] = math.nan
        guards.site("sampler.logits")(x)
        guards.close()

    callbacks[:] = [callback]
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout=20)
    callbacks[:] = []
    labels = {"site": "sampler.logits", "kind": "nan", "rank": "0"}
    results[action] = {
        "finished": not thread.is_alive(),
        "handled": bool(handled),
        "nan": registry.get_sample_value("guardrails_nonfinite_values_total", labels),
    }
print(json.dumps(results), flush=True)
os._exit(0)  # a deadlocked thread holds a reporter's lock: no exit hooks
"""


@pytest.fixture(scope="module", params=["structlog", "logging"])
def outcome(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    try:
        done = run_python("-c", CHILD, request.param, ",".join(ACTIONS), timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {request.param} child did not finish: a scenario blocked for good")
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("action", ACTIONS)
def test_a_log_handler_calling_back_into_guardrails_never_blocks(
    outcome: tuple[str, dict[str, Any]], action: str
) -> None:
    style, results = outcome
    result = results[action]
    assert result["handled"], f"the {style} handler never saw the event"
    assert result["finished"], f"{action}() from inside a {style} handler blocked for good"
    # And the counts are exact: the handler's call did its work or left it to the caller.
    assert result["nan"] == 3
