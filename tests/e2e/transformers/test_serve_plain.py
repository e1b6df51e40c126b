"""`transformers serve` in its default mode (one `generate()` per request) under `guardrails run`
with config/profiles/transformers-serve.toml, driven by the openai client over 127.0.0.1.

The model (tests/e2e/tiny_llama.py) overflows float16 by itself on one word: a prompt holding
it has all-NaN logits from its first step. Unguarded, transformers serve answers it with a
plain-text HTTP 500 when sampling and with HTTP 200 and empty text when greedy.
"""

from __future__ import annotations

import pytest

from guardrails.integrations.transformers_hooks import HOOK, MESSAGE
from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    POISONED,
    SAMPLED,
    aborted_events,
    assert_host_time_grows,
    assert_reported_while_idle,
    chat,
    complete,
    in_thread,
    join,
    not_called,
    stream,
    wait_for_sample,
)
from tests.e2e.server import Server


def test_clean_requests_answer_as_usual(plain: Server) -> None:
    greedy = chat(plain, CLEAN[0], GREEDY)
    assert greedy.error is None
    assert greedy.finish_reason == "length"
    assert len(greedy.text.split()) == 12
    streamed = stream(plain, CLEAN[0], GREEDY)
    assert (streamed.error, streamed.text, streamed.finish_reason) == (None, greedy.text, "length")
    sampled = chat(plain, CLEAN[1], SAMPLED)
    assert sampled.error is None
    assert sampled.finish_reason == "length"


@pytest.mark.parametrize("temperature", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_poisoned_request_is_an_http_500_with_a_json_body(
    plain: Server, temperature: float
) -> None:
    outcome = chat(plain, POISONED[0], temperature)
    error = outcome.error
    assert error is not None, f"answered {outcome.text!r} ({outcome.finish_reason})"
    assert getattr(error, "status_code", None) == 500
    assert error.body == {"detail": MESSAGE}


@pytest.mark.parametrize("temperature", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_poisoned_stream_ends_with_an_error_event_and_no_content(
    plain: Server, temperature: float
) -> None:
    outcome = stream(plain, POISONED[1], temperature)
    assert outcome.error is not None, f"streamed {outcome.text!r} ({outcome.finish_reason})"
    assert outcome.error.body == MESSAGE  # the openai client's APIError for an error event
    assert (outcome.text, outcome.content_chunks, outcome.finish_reason) == ("", 0, None)
    assert outcome.chunks_after_error == 0


def test_clean_requests_sent_with_a_poisoned_one_are_unaffected(plain: Server) -> None:
    alone = [chat(plain, text, GREEDY) for text in CLEAN]
    threads = [in_thread(chat, plain, text, GREEDY) for text in CLEAN]
    threads += [in_thread(chat, plain, POISONED[0], GREEDY)]
    threads += [in_thread(stream, plain, POISONED[1], GREEDY)]
    join(*(thread for thread, _ in threads))
    outcomes = [outcome for _, outcome in threads]
    assert [(o.text, o.finish_reason, o.error) for o in outcomes[:3]] == [
        (a.text, "length", None) for a in alone
    ]
    assert getattr(outcomes[3].error, "status_code", None) == 500
    assert outcomes[4].error is not None
    assert outcomes[4].text == ""


def test_the_server_stays_up_and_metrics_count_each_poisoned_request(plain: Server) -> None:
    assert plain.health() == (200, {"status": "ok"})
    after = chat(plain, CLEAN[2], GREEDY)
    assert (after.error, after.finish_reason) == (None, "length")
    sent = plain.poisoned_sent
    assert sent == 6
    site = {"site": "sampler.logits"}
    rows = wait_for_sample(
        plain, "guardrails_flagged_rows_total", sent, reason="no_valid_token", **site
    )
    assert rows == sent  # one step each: ended at its first row
    nan = wait_for_sample(
        plain, "guardrails_nonfinite_values_total", sent * tiny_llama.VOCAB, kind="nan", **site
    )
    assert nan == sent * tiny_llama.VOCAB
    assert wait_for_sample(plain, "guardrails_guard_calls_total", sent + 1, **site) > sent
    # The liveness self-check ran (its gauge exists) and found every watched site called.
    silent = not_called(plain)
    assert silent.get("sampler.logits") == 0.0, silent
    assert set(silent.values()) == {0.0}, silent


def test_guardrails_own_host_time_is_on_the_servers_metrics(plain: Server) -> None:
    """`guardrails_host_seconds_total`: the sampler's site, the attach point on generate's
    logits processors, the hook's parts, the heartbeat and the report poller."""
    parts = {
        "site:sampler.logits",
        "attach:sampler.logits",
        "hook:transformers.end_poisoned_requests",
        "heartbeat",
        "poller",
    }
    assert_host_time_grows(plain, parts, lambda: chat(plain, CLEAN[0], GREEDY))


def test_each_ended_request_is_counted_and_named_by_its_request_id(plain: Server) -> None:
    """The id the client sent (X-Request-Id) is the one transformers serve gives the request:
    generate() runs on serve's inference thread, where guardrails carries it."""

    def send(request_id: str) -> None:
        outcome = complete(plain, POISONED[0], GREEDY, extra_headers={"X-Request-Id": request_id})
        assert getattr(outcome.error, "status_code", None) == 500

    assert_reported_while_idle(plain, HOOK, send)
    streamed = stream(plain, POISONED[1], GREEDY, extra_headers={"X-Request-Id": "stream-7f3a"})
    assert streamed.error is not None
    named = aborted_events(plain, "request_id=stream-7f3a")
    assert len(named) == 1, named
