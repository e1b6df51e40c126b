"""SGLang's real server with tracing on (`GUARDRAILS_TRACE`): the origin of a poisoned
request's non-finite values is named in the log and on /metrics, on the model SGLang's
`ModelRunner.load_model` builds in the scheduler process, for both planted faults:

- the NaN embedding row (bfloat16): `model.embed_tokens`;
- layer 0's MLP arithmetic overflowing float16: the module inside `model.layers.0.mlp` that
  did it, `act_fn` (SGLang's SiluAndMul multiplies the gate by the up projection), never the
  `down_proj` after it.

SGLang's layers take `positions` (int64) before `hidden_states` and return `(output, bias)`
or `(x, residual)`: the probes judge the first floating input and output
(`guardrails.tracing.tracer`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from guardrails.names import TRACE_NOT_INSTALLED_EVENT
from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    ORIGIN_EVENT,
    POISONED,
    chat,
    log_lines,
    not_called,
    origins,
    wait_for_origin,
)
from tests.e2e.server import Server
from tests.e2e.sglang.serve import assert_aborted, serving

PATTERNS = "model.embed_tokens,model.layers.*,model.norm"


@pytest.fixture(scope="module", params=[tiny_llama.FAULT_NAN_ROW, tiny_llama.FAULT_OVERFLOW])
def traced(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    fault = request.param
    model = tiny_llama.save(tmp_path_factory.mktemp(f"tiny-llama-{fault}"), fault)
    log = tmp_path_factory.mktemp(f"sglang-traced-{fault}") / "server.log"
    with serving(model, log, env={"GUARDRAILS_TRACE": PATTERNS}) as server:
        yield fault, server


def test_a_clean_request_names_no_origin_and_the_trace_is_seen_installed(
    traced: tuple[str, Server],
) -> None:
    _, server = traced
    outcome = chat(server, CLEAN[0], GREEDY)  # 12 steps: past a liveness window (8)
    assert (outcome.error, outcome.finish_reason) == (None, "length")
    assert not_called(server).get("trace") == 0.0  # the scheduler's model is traced
    assert log_lines(server, TRACE_NOT_INSTALLED_EVENT) == []
    assert log_lines(server, ORIGIN_EVENT) == []
    assert origins(server) == {}


def test_the_poisoned_requests_origin_is_named(traced: tuple[str, Server]) -> None:
    fault, server = traced
    assert_aborted(chat(server, POISONED[0], GREEDY))  # still ended, as untraced
    found = wait_for_origin(server)
    (line,) = log_lines(server, ORIGIN_EVENT)
    assert list(found.values()) == [1.0], found
    ((module, kind),) = found
    if fault == tiny_llama.FAULT_NAN_ROW:
        assert (module, kind) == ("model.embed_tokens", "nan")
        assert "dtype=bfloat16" in line
    else:
        # SGLang's SiluAndMul: silu(gate) * up, about 1e5 from gate = up = 320.
        assert (module, kind) == ("model.layers.0.mlp.act_fn", "posinf")
        assert "dtype=float16" in line
    assert f"module={module} " in line
    assert "site=sampler.logits" in line
