"""SGLang's `launch_server` (0.5.23, CPU engine) started plainly, guardrails coming in through
SGLang's plugin entry point (the shipped profile, no configuration), driven by the openai
client over 127.0.0.1, next to the same server with the plugin left out (unguarded).

The model (tests/tiny_llama.py, FAULT_NAN_ROW) has a NaN embedding row for its trigger word:
a prompt holding it has all-NaN logits from its first step. Unguarded, SGLang answers such a
request with HTTP 200, finish_reason "length" and empty text (it samples token 0, `<pad>`,
every step), and keeps the request's NaN KV in its prefix cache, where the next clean prompt
sharing its first word reads it and answers empty text too. Guarded, the scheduler ends the
request through SGLang's own abort (HTTP 503 with guardrails' message; a stream gets an error
event) and its KV stays out of the prefix cache.

SGLang schedules with overlap by default: the next step of a batch is launched before the
previous step's results are processed, which is where guardrails' hook ends the request. A
poisoned request sent alone therefore reaches the sampler twice (its prefill, then the decode
step already in flight), and is counted as two flagged rows; with max_tokens=1 (no second
step) as one.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    POISONED,
    REQUEST_TIMEOUT_S,
    SAMPLED,
    assert_host_time_grows,
    chat,
    complete,
    families,
    in_thread,
    join,
    not_called,
    samples,
    stream,
    stream_completion,
    wait_for_sample,
)
from tests.e2e.server import Server
from tests.e2e.sglang.serve import (
    WATCHED,
    aborted_in_log,
    assert_aborted,
    flush_cache,
    wait_for_log,
)

TOKENS = 12  # the client helpers' max_tokens
LONG = 256  # clean requests still decode while the poisoned ones are prefilled and ended
ROUNDS = 3  # rounds of the batched-with-poisoned test until its premise holds
SITE = {"site": "sampler.logits"}
ROWS = "guardrails_flagged_rows_total"
NAN = "guardrails_nonfinite_values_total"
CALLS = "guardrails_guard_calls_total"
PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), .*#running-req: (\d+),")
GUARDRAILS_FAMILIES = {
    "guardrails_guard_calls",
    "guardrails_flagged_rows",
    "guardrails_nonfinite_values",
    "guardrails_guard_errors",
    "guardrails_site_not_called",
    "guardrails_hook_errors",
    "guardrails_requests_aborted",
    "guardrails_reporting_errors",
    "guardrails_host_seconds",
}
# SGLang 0.5.23's series made in its HTTP process (TokenizerMetricsCollector, the HTTP
# middleware's, the start-up timers; counters without `_total`, as the parser names families).
HTTP_PROCESS_FAMILIES = {
    "sglang:cached_tokens",
    "sglang:e2e_request_latency_seconds",
    "sglang:generation_tokens",
    "sglang:generation_tokens_histogram",
    "sglang:get_loads_duration_seconds",
    "sglang:http_requests",
    "sglang:http_requests_active",
    "sglang:http_responses",
    "sglang:inter_token_latency_seconds",
    "sglang:num_aborted_requests",
    "sglang:num_requests",
    "sglang:num_so_requests",
    "sglang:prompt_tokens",
    "sglang:prompt_tokens_histogram",
    "sglang:request_time_per_output_token_seconds",
    "sglang:routing_keys_active",
    "sglang:spec_verify_calls",
    "sglang:startup_cuda_graph_time_seconds",
    "sglang:startup_latency_breakdown_seconds_max",
    "sglang:startup_time_seconds",
    "sglang:time_to_first_token_seconds",
    "sglang:uncached_prompt_tokens_histogram",
}
NON_STREAMED = {"chat": chat, "completions": complete}
STREAMED = {"chat": stream, "completions": stream_completion}
TEMPERATURES = pytest.mark.parametrize("temperature", [GREEDY, SAMPLED], ids=["greedy", "sampled"])


@pytest.fixture(scope="module")
def alone(plain: Server) -> dict[tuple[str, str, int], str]:
    """The unguarded server's greedy text for clean prompts sent alone, by endpoint, prompt
    and max_tokens; taken before any poisoned request reaches that server (its NaN KV would
    then sit in the prefix cache)."""
    wanted = [("chat", CLEAN[0], TOKENS), ("completions", CLEAN[0], TOKENS)]
    wanted += [("chat", text, LONG) for text in CLEAN] + [("completions", CLEAN[0], LONG)]
    texts = {}
    for endpoint, text, tokens in wanted:
        outcome = NON_STREAMED[endpoint](plain, text, GREEDY, tokens)
        assert (outcome.error, outcome.finish_reason) == (None, "length"), outcome
        if tokens == TOKENS:  # one word per token (a longer text may hold a special token)
            assert len(outcome.text.split()) == tokens, outcome
        texts[(endpoint, text, tokens)] = outcome.text
    return texts


def rows_of(server: Server) -> tuple[float, float, float]:
    """(no_valid_token rows, NaN values, guard calls) at sampler.logits, rank 0."""
    found = samples(server)

    def get(name: str, **labels: str) -> float:
        return found.get((name, frozenset({"rank": "0", **SITE, **labels}.items())), 0.0)

    return get(ROWS, reason="no_valid_token"), get(NAN, kind="nan"), get(CALLS)


def test_clean_requests_answer_as_usual(
    guarded: Server, alone: dict[tuple[str, str, int], str]
) -> None:
    for endpoint in NON_STREAMED:
        expected = alone[(endpoint, CLEAN[0], TOKENS)]
        answered = NON_STREAMED[endpoint](guarded, CLEAN[0], GREEDY)
        streamed = STREAMED[endpoint](guarded, CLEAN[0], GREEDY)
        # Greedy, guarded: the unguarded server's text, streamed or not.
        assert (answered.error, answered.text, answered.finish_reason) == (
            None,
            expected,
            "length",
        )
        assert (streamed.error, streamed.text, streamed.finish_reason) == (
            None,
            expected,
            "length",
        )
        for call in (NON_STREAMED[endpoint], STREAMED[endpoint]):
            sampled = call(guarded, CLEAN[1], SAMPLED)
            assert (sampled.error, sampled.finish_reason) == (None, "length")
            assert sampled.text  # sampled: a special id may decode to nothing


@TEMPERATURES
@pytest.mark.parametrize("endpoint", NON_STREAMED)
def test_a_poisoned_request_is_an_http_503_with_guardrails_message(
    guarded: Server, endpoint: str, temperature: float
) -> None:
    assert_aborted(NON_STREAMED[endpoint](guarded, POISONED[0], temperature))


@TEMPERATURES
@pytest.mark.parametrize("endpoint", STREAMED)
def test_a_poisoned_stream_ends_with_an_error_event_and_no_content(
    guarded: Server, endpoint: str, temperature: float
) -> None:
    assert_aborted(STREAMED[endpoint](guarded, POISONED[1], temperature), streamed=True)


@pytest.mark.parametrize(("tokens", "steps"), [(TOKENS, 2), (1, 1)], ids=["12-tokens", "1-token"])
def test_a_poisoned_request_alone_is_counted_once_per_step_it_reached(
    guarded: Server, tokens: int, steps: int
) -> None:
    # Its prefill, and (with more than one token to go) the decode step SGLang's overlap
    # scheduler had launched before the hook ended the request: all-NaN rows both.
    rows, nan, calls = rows_of(guarded)
    aborted = aborted_in_log(guarded)
    assert_aborted(complete(guarded, POISONED[0], GREEDY, tokens))
    site = {"reason": "no_valid_token", **SITE}
    assert wait_for_sample(guarded, ROWS, rows + steps, **site) == rows + steps
    vocab = tiny_llama.VOCAB
    assert wait_for_sample(guarded, NAN, nan + steps * vocab, kind="nan", **SITE) == (
        nan + steps * vocab
    )
    assert wait_for_sample(guarded, CALLS, calls + steps, **SITE) == calls + steps
    assert rows_of(guarded) == (rows + steps, nan + steps * vocab, calls + steps)
    assert wait_for_log(lambda: aborted_in_log(guarded), aborted + 1) == aborted + 1  # once


def test_clean_requests_sent_with_poisoned_ones_get_their_unguarded_text(
    guarded: Server, alone: dict[tuple[str, str, int], str]
) -> None:
    # The premise (below) depends on how SGLang schedules the clean requests on a busy
    # machine: once one clean request ran nearly to its end before the others started
    # ([252, 1, 1, 1]). A round whose premise fails is run again, at most ROUNDS times; every
    # round's outcomes are checked in full.
    for _ in range(ROUNDS):
        decoded_at_send = _clean_and_poisoned_together(guarded, alone)
        if all(0 < n <= LONG // 2 for n in decoded_at_send):
            break
    assert all(0 < n <= LONG // 2 for n in decoded_at_send), decoded_at_send


def _clean_and_poisoned_together(
    guarded: Server, alone: dict[tuple[str, str, int], str]
) -> list[int]:
    """Four clean streams, then four poisoned requests while they decode: the clean ones get
    their text alone, the poisoned ones are ended, each prefilled once. Returns how far each
    clean request had decoded when the poisoned ones were sent."""
    clean = [in_thread(stream, guarded, text, GREEDY, LONG) for text in CLEAN]
    clean += [in_thread(stream_completion, guarded, CLEAN[0], GREEDY, LONG)]
    for _, outcome in clean:  # every clean request is decoding, so the next ones join it
        assert outcome.started.wait(REQUEST_TIMEOUT_S)
    mark = len(guarded.log.read_text(errors="replace"))
    # Greedy too: a batch that holds a sampled request takes SGLang's sampling path for all of
    # its rows (top-k 1 for the greedy ones), and there a greedy request's text can part from
    # its argmax text alone at a near tie, guarded or not (seen unguarded with clean requests).
    poisoned = [
        in_thread(chat, guarded, POISONED[0], GREEDY),
        in_thread(stream, guarded, POISONED[1], GREEDY),
        in_thread(complete, guarded, POISONED[1], GREEDY),
        in_thread(stream_completion, guarded, POISONED[0], GREEDY),
    ]
    # How far each clean request had decoded when the poisoned ones were sent.
    decoded_at_send = [o.content_chunks for _, o in clean]
    join(*(thread for thread, _ in clean + poisoned))
    expected = [alone[("chat", text, LONG)] for text in CLEAN]
    expected += [alone[("completions", CLEAN[0], LONG)]]
    assert [(o.error, o.text, o.finish_reason) for _, o in clean] == [
        (None, text, "length") for text in expected
    ]
    for (_, outcome), streamed in zip(poisoned, [False, True, False, True], strict=True):
        assert_aborted(outcome, streamed=streamed)
    # They shared the server: the poisoned requests were sent while every clean request had at
    # least half of its tokens still to decode (the caller checks), and each was prefilled once
    # (SGLang's prefill log). Not the running count SGLang logs with a prefill: with the tiny
    # model decoding at ~1,100 tokens/s its log line can come after the clean requests ended,
    # though the abort came first (two runs on an idle machine: prefills [1 with 0 running, 3
    # with 1]).
    prefills = PREFILL.findall(guarded.log.read_text(errors="replace")[mark:])
    assert sum(int(seqs) for seqs, _ in prefills) == len(poisoned), prefills
    return decoded_at_send


def test_a_poisoned_requests_kv_stays_out_of_the_prefix_cache(
    plain: Server, guarded: Server, alone: dict[tuple[str, str, int], str]
) -> None:
    # POISONED[0] and CLEAN[0] share their first word; the poisoned prompt is the first to put
    # it in an empty prefix cache, then the clean one is sent.
    expected = alone[("completions", CLEAN[0], TOKENS)]
    assert flush_cache(guarded)[0] == 200
    assert_aborted(complete(guarded, POISONED[0], GREEDY))
    after = complete(guarded, CLEAN[0], GREEDY)
    assert (after.error, after.text, after.finish_reason) == (None, expected, "length")
    # Unguarded, the poisoned prompt's KV goes into the prefix cache, and the clean prompt
    # reuses that of their shared first word: NaN already from layer 1 on (the prefill weighs
    # the trigger's NaN values by a masked 0, as tests/tiny_llama.py says), so it answers
    # nothing either.
    assert flush_cache(plain)[0] == 200
    poisoned = complete(plain, POISONED[0], GREEDY)
    assert (poisoned.error, poisoned.text, poisoned.finish_reason) == (None, "", "length")
    spoiled = complete(plain, CLEAN[0], GREEDY)
    assert (spoiled.error, spoiled.text, spoiled.finish_reason) == (None, "", "length")
    assert flush_cache(plain)[0] == 200  # the plain server's later requests start clean


@pytest.mark.parametrize(
    ("call", "temperature"),
    [(chat, GREEDY), (complete, SAMPLED), (stream, SAMPLED), (stream_completion, GREEDY)],
    ids=["chat-greedy", "completions-sampled", "chat-stream-sampled", "completions-stream-greedy"],
)
@pytest.mark.usefixtures("alone")  # taken first: poisoned prompts spoil the prefix cache
def test_unguarded_a_poisoned_request_answers_200_with_empty_text(
    plain: Server, call: Any, temperature: float
) -> None:
    # The "before": no error at all, twelve `<pad>` tokens that decode to nothing.
    outcome = call(plain, POISONED[1], temperature)
    assert (outcome.error, outcome.text, outcome.finish_reason) == (None, "", "length")


def test_the_server_stays_up_and_metrics_count_every_poisoned_request(guarded: Server) -> None:
    # After everything above, one more of each.
    assert_aborted(chat(guarded, POISONED[0], SAMPLED))
    after = chat(guarded, CLEAN[2], GREEDY)
    assert (after.error, after.finish_reason) == (None, "length")
    assert len(after.text.split()) == TOKENS
    assert guarded.alive()
    assert guarded.health()[0] == 200
    sent = guarded.poisoned_sent
    # Each poisoned request reached the sampler at its prefill and at most once more (the step
    # in flight when it was ended): alone, exactly twice (once with max_tokens=1, see above);
    # sent with others, once or twice, as the scheduler happened to batch it.
    rows = wait_for_sample(guarded, ROWS, sent, reason="no_valid_token", **SITE)
    assert sent <= rows <= 2 * sent, (rows, sent)
    # Only their rows were flagged, every value NaN: no clean row had a non-finite value.
    assert wait_for_sample(guarded, ROWS, rows, reason="nonfinite", **SITE) == rows
    nan = wait_for_sample(guarded, NAN, rows * tiny_llama.VOCAB, kind="nan", **SITE)
    assert nan == rows * tiny_llama.VOCAB
    # The guard ran on the step the server really runs: every sampling step, clean ones too.
    assert wait_for_sample(guarded, CALLS, rows + TOKENS, **SITE) >= rows + TOKENS
    # The hook ended each poisoned request exactly once.
    assert wait_for_log(lambda: aborted_in_log(guarded), sent) == sent
    # The liveness self-check ran (its gauge exists) and found every watched site called.
    silent = not_called(guarded)
    assert set(silent) == WATCHED, silent
    assert set(silent.values()) == {0.0}, silent
    assert "guardrails.site_not_called" not in guarded.log.read_text(errors="replace")


def test_guardrails_own_host_time_is_on_sglangs_metrics(guarded: Server) -> None:
    """`guardrails_host_seconds_total` from the scheduler process: the sampler's site, the
    attach point that finds its logits, the hook's parts (without SGLang's calls inside them),
    the heartbeat and the report poller."""
    parts = {
        "site:sampler.logits",
        "attach:sampler.logits",
        "hook:sglang.abort_poisoned_requests",
        "heartbeat",
        "poller",
    }
    assert_host_time_grows(guarded, parts, lambda: chat(guarded, CLEAN[0], GREEDY))


def test_guardrails_families_are_on_sglangs_own_metrics(plain: Server, guarded: Server) -> None:
    # Late in the module: both servers have served clean and poisoned requests by now.
    unguarded, mine = families(plain), families(guarded)
    assert not any(name.startswith("guardrails_") for name in unguarded)
    ours = {name for name in mine if name.startswith("guardrails_")}
    assert ours == GUARDRAILS_FAMILIES, sorted(ours)
    # The scheduler's series (written into SGLang's multiprocess directory) are all there.
    scheduler = {name for name in unguarded if name.startswith("sglang:")} - HTTP_PROCESS_FAMILIES
    assert len(scheduler) > 50, sorted(unguarded)
    assert scheduler - mine == set()


def test_every_sglang_family_of_the_unguarded_server_is_still_there(
    plain: Server, guarded: Server
) -> None:
    unguarded, mine = families(plain), families(guarded)
    sglang = {name for name in unguarded if name.startswith("sglang:")}
    # Made in SGLang's HTTP process too (latencies, token counts, HTTP requests): there
    # guardrails makes its sites at import, before SGLang picks multiprocess mode.
    assert sglang - mine == set(), sorted(sglang - mine)
