"""vLLM's server with ngram speculative decoding, started the launcher's way (`guardrails run
--config config/profiles/vllm.toml`): vLLM's plugin entry point is called in each process too,
and finds guardrails installed already (the start-up events, JSON lines here, say "launcher",
once per process).

With a speculative config nearly every step of vLLM's V1 runner goes through
`RejectionSampler.forward`: the guard there (`eagle.verify`, the target model's logits) heals
a poisoned request's rows before `Sampler.forward` samples the bonus rows from them, so the
`sampler.logits` site sees nothing to end. The hook reads `eagle.verify`'s rows too, per
request: the poisoned request still ends with an error (before: HTTP 200, empty text,
finish_reason "length").
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
    SAMPLED,
    assert_installed_once_per_process,
    chat,
    complete,
    in_thread,
    join,
    not_called,
    sample,
    stream,
    wait_for_sample,
)
from tests.e2e.server import Server
from tests.e2e.vllm.conftest import Reference
from tests.e2e.vllm.launch import NGRAM, server_error, vllm_server

VERIFY = {"site": "eagle.verify"}


@pytest.fixture(scope="module")
def speculative(
    model_dir: Path, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("vllm-ngram") / "server.log"
    with vllm_server(
        model_dir,
        log,
        "--speculative-config",
        NGRAM,
        way="launcher",
        settings={"GUARDRAILS_LOG_FORMAT": "json"},
    ) as server:
        yield server


@pytest.mark.parametrize("temperature", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_poisoned_request_ends_with_an_error_under_speculative_decoding(
    speculative: Server, temperature: float
) -> None:
    for outcome in (
        chat(speculative, POISONED[0], temperature, max_tokens=24),
        complete(speculative, POISONED[1], temperature, max_tokens=24),
        stream(speculative, POISONED[1], temperature, max_tokens=24),
    ):
        assert server_error(outcome), f"answered {outcome.text!r} ({outcome.finish_reason})"
        assert outcome.text == ""


def test_clean_requests_beside_a_poisoned_one_answer_as_without_speculation(
    speculative: Server, reference: Reference
) -> None:
    clean = [in_thread(chat, speculative, text, GREEDY) for text in CLEAN]
    poisoned = in_thread(chat, speculative, POISONED[0], GREEDY)
    join(*(thread for thread, _ in [*clean, poisoned]))
    assert [(o.error, o.text, o.finish_reason) for _, o in clean] == [
        (None, reference.chat[text], "length") for text in CLEAN
    ]
    assert server_error(poisoned[1])


def test_the_verify_rows_are_counted_and_every_site_is_called(speculative: Server) -> None:
    assert speculative.health()[0] == 200
    sent = speculative.poisoned_sent
    # The target model's rows of each poisoned request's first step: at least one each.
    rows = wait_for_sample(
        speculative, "guardrails_flagged_rows_total", sent, reason="no_valid_token", **VERIFY
    )
    assert rows >= sent
    nan = sample(speculative, "guardrails_nonfinite_values_total", kind="nan", **VERIFY)
    assert nan == rows * tiny_llama.VOCAB
    assert sample(speculative, "guardrails_guard_calls_total", **VERIFY) > 0
    silent = not_called(speculative)
    assert set(silent.values()) == {0.0}, silent
    assert "guardrails.site_not_called" not in speculative.log.read_text(errors="replace")


def test_under_the_launcher_the_plugin_installs_nothing_twice(speculative: Server) -> None:
    assert_installed_once_per_process(speculative, "launcher", 2)
