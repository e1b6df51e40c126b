"""Log events reach the host's logging: the standard library logger `guardrails` unless the host
configured structlog, never standard output.

vLLM and SGLang configure the standard library's logging, and under `guardrails run` a
client may read the served command's standard output: an event printed there would corrupt
it. `structlog.testing.capture_logs` leaves structlog configured, so the tests of the
standard-library path reset structlog first.
"""

from __future__ import annotations

import logging
import math
import subprocess
from collections.abc import Iterator

import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.names import LOGGER_NAME, NONFINITE_EVENT, STARTED_EVENT
from guardrails.testing import fresh_guardrails
from tests.processes import run_python

LOGITS = "sampler.logits"


def nan_logits() -> torch.Tensor:
    x = torch.randn(2, 8)
    x[0, :3] = math.nan
    return x


@pytest.fixture
def unconfigured_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


class Recorder(logging.Handler):
    """A real handler, as a host attaches one."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    handler = Recorder()
    logger = logging.getLogger(LOGGER_NAME)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.usefixtures("unconfigured_structlog")
def test_events_reach_the_standard_library_logger_with_their_fields(
    recorder: Recorder,
) -> None:
    with fresh_guardrails(registry=CollectorRegistry(), reporting={"every_calls": 1}) as guards:
        guards.site(LOGITS)(nan_logits())
    [record] = [r for r in recorder.records if getattr(r, "event", None) == NONFINITE_EVENT]
    assert (record.name, record.levelno) == (LOGGER_NAME, logging.WARNING)
    # The fields are attributes of the record (for structured handlers) and in the message.
    assert (record.site, record.nan, record.rows, record.dtype) == (  # type: ignore[attr-defined]
        LOGITS,
        3,
        1,
        "float32",
    )
    message = record.getMessage()
    assert message.startswith(f"{NONFINITE_EVENT} site={LOGITS} rank=0 nan=3 ")
    assert " shape=[2,8] " in message


@pytest.mark.usefixtures("unconfigured_structlog")
def test_the_host_logger_level_decides_what_is_logged(recorder: Recorder) -> None:
    logging.getLogger(LOGGER_NAME).setLevel(logging.ERROR)
    with fresh_guardrails(registry=CollectorRegistry(), reporting={"every_calls": 1}) as guards:
        guards.site(LOGITS)(nan_logits())  # a warning: below the host's level
        bad = torch.randn(2, 8)
        bad[1] = math.nan  # no valid token left: an error
        guards.site(LOGITS)(bad)
    assert [r.levelno for r in recorder.records] == [logging.ERROR]


@pytest.mark.usefixtures("unconfigured_structlog")
def test_pytest_caplog_sees_the_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    with fresh_guardrails(registry=CollectorRegistry(), reporting={"every_calls": 1}) as guards:
        guards.site(LOGITS)(nan_logits())
    events = [getattr(r, "event", None) for r in caplog.records if r.name == LOGGER_NAME]
    assert events == [STARTED_EVENT, NONFINITE_EVENT]


@pytest.mark.usefixtures("unconfigured_structlog")
def test_nothing_is_printed_to_stdout_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with fresh_guardrails(registry=CollectorRegistry(), reporting={"every_calls": 1}) as guards:
        guards.site(LOGITS)(nan_logits())
    assert capsys.readouterr().out == ""


def test_a_host_that_configured_structlog_gets_structlog_events() -> None:
    with (
        capture_logs() as logs,
        fresh_guardrails(registry=CollectorRegistry(), reporting={"every_calls": 1}) as guards,
    ):
        guards.site(LOGITS)(nan_logits())
    assert [e["event"] for e in logs] == [STARTED_EVENT, NONFINITE_EVENT]
    assert (logs[1]["site"], logs[1]["nan"], logs[1]["log_level"]) == (LOGITS, 3, "warning")


CHILD = r"""
import logging, math, sys
import torch
import guardrails as gr

if sys.argv[1] == "basicConfig":
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="HOST %(name)s %(message)s")
guards = gr.Guardrails(gr.GuardSettings(reporting={"every_calls": 1}))
x = torch.randn(2, 8)
x[0, :3] = math.nan
guards.site("sampler.logits")(x)
guards.close()
"""


def run_child(mode: str) -> subprocess.CompletedProcess[str]:
    return run_python("-c", CHILD, mode)


def test_an_unconfigured_process_prints_nothing_to_stdout() -> None:
    done = run_child("nothing")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    # The standard library's last resort: warnings and errors on stderr, nothing else.
    assert f"{NONFINITE_EVENT} site=sampler.logits rank=0 nan=3" in done.stderr


def test_logging_basic_config_formats_the_events() -> None:
    done = run_child("basicConfig")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.startswith("HOST guardrails ")]
    assert [line.split()[2] for line in lines] == [STARTED_EVENT, NONFINITE_EVENT]
