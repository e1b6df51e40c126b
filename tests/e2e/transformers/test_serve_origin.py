"""`transformers serve` under `guardrails run` with tracing on (`GUARDRAILS_TRACE`), in both
modes: the origin of the tiny Llama's planted fault (layer 0's MLP arithmetic overflows
float16) is named in the server's log and on /metrics; a clean request names nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.client import (
    CLEAN,
    GREEDY,
    ORIGIN_EVENT,
    POISONED,
    chat,
    log_lines,
    origins,
    samples,
    wait_for_origin,
)
from tests.e2e.server import Server
from tests.e2e.transformers.serve import CB_ARGS, serving


@pytest.fixture(scope="module", params=["plain", "batching"])
def traced(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp(f"traced-{request.param}") / "server.log"
    settings = {"GUARDRAILS_TRACE": "model.layers.*,model.norm"}
    extra = ("--continuous-batching", *CB_ARGS) if request.param == "batching" else ()
    with serving(model_dir, log, *extra, settings=settings) as server:
        yield server


def test_a_clean_request_names_no_origin(traced: Server) -> None:
    outcome = chat(traced, CLEAN[0], GREEDY)
    assert outcome.error is None
    assert log_lines(traced, ORIGIN_EVENT) == []
    assert origins(traced) == {}
    peaks = [v for (name, _), v in samples(traced).items() if "activation_peak_ratio" in name]
    assert 0 < len(peaks) <= 8
    assert all(0 < value < 1 for value in peaks)


def test_the_planted_faults_origin_is_in_the_log_and_on_metrics(traced: Server) -> None:
    outcome = chat(traced, POISONED[0], GREEDY)
    assert outcome.error is not None  # the request still ends with its error, as untraced
    found = wait_for_origin(traced)
    assert set(found) in ({("model.layers.0.mlp", "nan")}, {("model.layers.0.mlp", "posinf")})
    assert list(found.values()) == [1.0]
    (line,) = log_lines(traced, ORIGIN_EVENT)
    assert "module=model.layers.0.mlp " in line
    assert "site=sampler.logits" in line
    assert "dtype=float16" in line
