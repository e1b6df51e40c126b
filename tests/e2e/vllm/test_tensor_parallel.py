"""vLLM's server with `--tensor-parallel-size 2` (two CPU workers, one core each), started
plainly: guardrails comes into each of its processes through vLLM's plugin entry point, with
the shipped profile (its start-up events are JSON lines here, `GUARDRAILS_LOG_FORMAT=json`).

Both workers run the sampler on the same gathered logits, so both guard them: each worker's
series carry its own rank (torch.distributed's, which vLLM starts after the samplers' modules
are imported: before, every worker reported rank 0), and one poisoned request is one flagged
row on each rank. Sums over `rank` count each tensor-parallel copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    POISONED,
    assert_installed_once_per_process,
    chat,
    not_called,
    sample,
    stream,
    wait_for_sample,
)
from tests.e2e.server import Server
from tests.e2e.vllm.conftest import Reference
from tests.e2e.vllm.launch import server_error, vllm_server

SITE = {"site": "sampler.logits"}


@pytest.fixture(scope="module")
def tp2(
    model_dir: Path, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("vllm-tp2") / "server.log"
    with vllm_server(
        model_dir,
        log,
        "--tensor-parallel-size",
        "2",
        settings={"GUARDRAILS_LOG_FORMAT": "json"},
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    ) as server:
        yield server


def test_clean_requests_answer_as_with_one_worker(tp2: Server, reference: Reference) -> None:
    for text in CLEAN:
        got = chat(tp2, text, GREEDY)
        assert (got.error, got.text, got.finish_reason) == (None, reference.chat[text], "length")


def test_a_poisoned_request_ends_with_an_error_under_tensor_parallelism(tp2: Server) -> None:
    for outcome in (chat(tp2, POISONED[0], GREEDY), stream(tp2, POISONED[1], GREEDY)):
        assert server_error(outcome), f"answered {outcome.text!r} ({outcome.finish_reason})"
        assert outcome.text == ""
    assert tp2.health()[0] == 200


def test_each_worker_counts_under_its_own_rank(tp2: Server) -> None:
    sent = tp2.poisoned_sent
    assert sent == 2
    for rank in ("0", "1"):
        rows = wait_for_sample(
            tp2, "guardrails_flagged_rows_total", sent, reason="no_valid_token", rank=rank, **SITE
        )
        assert rows == sent, rank
        nan = sample(tp2, "guardrails_nonfinite_values_total", kind="nan", rank=rank, **SITE)
        assert nan == sent * tiny_llama.VOCAB, rank
        assert sample(tp2, "guardrails_guard_calls_total", rank=rank, **SITE) > sent, rank
    silent = not_called(tp2)
    assert silent.get("sampler.logits") == 0.0, silent
    assert set(silent.values()) == {0.0}, silent


def test_the_plugin_installed_guardrails_in_every_process(tp2: Server) -> None:
    # The API server, the engine core and both workers: each says how guardrails came in,
    # and none twice. No launcher, no configuration: the shipped profile.
    assert_installed_once_per_process(
        tp2, "plugin:vllm", 3, "vllm.toml", "vllm.end_poisoned_requests"
    )
