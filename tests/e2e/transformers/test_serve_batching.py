"""`transformers serve --continuous-batching` under `guardrails run` with
config/profiles/transformers-serve.toml, driven by the openai client over 127.0.0.1.

Continuous batching samples in `ModelRunner._sample`, one worker thread for every request.
Unguarded, the poisoned request's all-NaN row kills that worker for good (every later request
gets 503), and in one batch its NaN reaches the requests batched with it through the shared
attention call. Before transformers 5.25 the batching worker's sampling mode is set by the
first request it serves (from 5.25 on, each request's own), so greedy and sampling each get
their own server.
"""

from __future__ import annotations

from guardrails.integrations.transformers_hooks import HOOK, MESSAGE
from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    POISONED,
    REQUEST_TIMEOUT_S,
    SAMPLED,
    aborted_events,
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

LONG = 64  # clean requests still decode while the poisoned ones are prefilled and ended


def test_clean_requests_batched_with_poisoned_ones_return_their_text_alone(
    batching: Server,
) -> None:
    alone = [chat(batching, text, GREEDY, LONG) for text in CLEAN]
    assert all(a.error is None and a.finish_reason == "length" for a in alone)
    clean = [in_thread(stream, batching, text, GREEDY, LONG) for text in CLEAN]
    for _, outcome in clean:  # every clean request is decoding, so the next ones join it
        assert outcome.started.wait(REQUEST_TIMEOUT_S)
    poisoned = [
        in_thread(chat, batching, POISONED[0], GREEDY),
        in_thread(stream, batching, POISONED[1], GREEDY),
    ]
    # How far each clean request had decoded when the poisoned ones were sent.
    decoded_at_send = [o.content_chunks for _, o in clean]
    join(*(thread for thread, _ in clean + poisoned))
    (_, answered), (_, streamed) = poisoned
    assert getattr(answered.error, "status_code", None) == 500
    assert answered.error is not None
    assert answered.error.body == {"detail": MESSAGE}
    assert streamed.error is not None
    assert streamed.error.body == MESSAGE
    assert (streamed.text, streamed.finish_reason, streamed.chunks_after_error) == ("", None, 0)
    texts = [(o.error, o.text, o.finish_reason) for _, o in clean]
    assert texts == [(None, a.text, "length") for a in alone]
    # They shared steps: the poisoned requests were sent while every clean request had at least
    # half of its tokens still to decode, and the batching worker takes a waiting request into
    # the running batch at its next step. (Not the order in which they ended: a poisoned
    # request's prefill and abort can end a few ms after a clean request's last token.)
    assert all(0 < n <= LONG // 2 for n in decoded_at_send), decoded_at_send


def test_the_batching_worker_stays_alive(batching: Server) -> None:
    assert batching.health() == (200, {"status": "ok"})
    poisoned = chat(batching, POISONED[0], GREEDY)
    assert getattr(poisoned.error, "status_code", None) == 500
    after = [chat(batching, text, GREEDY) for text in CLEAN]
    assert [(a.error, a.finish_reason) for a in after] == [(None, "length")] * len(CLEAN)
    assert batching.health() == (200, {"status": "ok"})


def test_metrics_count_each_poisoned_request_once(batching: Server) -> None:
    sent = batching.poisoned_sent
    assert sent == 3
    site = {"site": "sampler.logits"}
    rows = wait_for_sample(
        batching, "guardrails_flagged_rows_total", sent, reason="no_valid_token", **site
    )
    assert rows == sent
    nan = wait_for_sample(
        batching, "guardrails_nonfinite_values_total", sent * tiny_llama.VOCAB, kind="nan", **site
    )
    assert nan == sent * tiny_llama.VOCAB
    # The liveness self-check ran (its gauge exists) and found every watched site called.
    silent = not_called(batching)
    assert silent.get("sampler.logits") == 0.0, silent
    assert set(silent.values()) == {0.0}, silent


def test_each_ended_request_is_counted_and_named_by_its_request_id(batching: Server) -> None:
    """Continuous batching's request id is the one the client sent (X-Request-Id)."""

    def send(request_id: str) -> None:
        outcome = complete(
            batching, POISONED[0], GREEDY, extra_headers={"X-Request-Id": request_id}
        )
        assert getattr(outcome.error, "status_code", None) == 500

    assert_reported_while_idle(batching, HOOK, send)
    streamed = stream(
        batching, POISONED[1], GREEDY, extra_headers={"X-Request-Id": "cb-stream-9e1"}
    )
    assert streamed.error is not None
    named = aborted_events(batching, "request_id=cb-stream-9e1")
    assert len(named) == 1, named


def test_sampled_poisoned_requests_end_with_errors_and_the_others_go_on(
    batching_sampled: Server,
) -> None:
    server = batching_sampled
    first = chat(server, CLEAN[0], SAMPLED)  # the first request sets the worker's sampling
    assert (first.error, first.finish_reason) == (None, "length")
    threads = [in_thread(stream, server, text, SAMPLED, LONG) for text in CLEAN]
    for _, outcome in threads:
        assert outcome.started.wait(REQUEST_TIMEOUT_S)
    poisoned = [
        in_thread(chat, server, POISONED[0], SAMPLED),
        in_thread(stream, server, POISONED[1], SAMPLED),
    ]
    join(*(thread for thread, _ in threads + poisoned))
    assert [(o.error, o.finish_reason) for _, o in threads] == [(None, "length")] * len(CLEAN)
    assert all(o.text for _, o in threads)  # sampled: special ids may decode to nothing
    (_, answered), (_, streamed) = poisoned
    assert getattr(answered.error, "status_code", None) == 500
    assert streamed.error is not None
    assert (streamed.text, streamed.chunks_after_error) == ("", 0)
    assert server.health() == (200, {"status": "ok"})
