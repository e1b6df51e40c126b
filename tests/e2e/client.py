"""The openai client against a `Server`, with what each request ended as.

Every request has a timeout and is never retried (the openai client retries 5xx answers
twice by default: a poisoned request would be sent three times).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

from guardrails.names import NONFINITE_ORIGIN_EVENT as ORIGIN_EVENT
from guardrails.names import REQUEST_ABORTED_EVENT, STARTED_EVENT
from tests import tiny_llama
from tests.e2e.server import REPORT_INTERVAL_S, Server

REQUEST_TIMEOUT_S = 60.0
CLEAN = ("kalo mipe rita", "nuso veta bogi", "fegi dara kami")
POISONED = ("kalo quasar rita", "zuve quasar nuri")  # the trigger in the prompt
GREEDY, SAMPLED = 0.0, 1.0


@dataclass
class Outcome:
    """What a client saw: the text, the finish reason, or the error the client raised."""

    text: str = ""
    finish_reason: str | None = None
    error: openai.APIError | None = None
    chunks_after_error: int = 0
    content_chunks: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    ended_at: float = 0.0


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=REQUEST_TIMEOUT_S,
    )


def _count(server: Server, text: str) -> None:
    if tiny_llama.TRIGGER in text:
        server.poisoned_sent += 1


def chat(server: Server, text: str, temperature: float, max_tokens: int = 12) -> Outcome:
    _count(server, text)
    outcome = Outcome()
    try:
        reply = client(server).chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=temperature,
        )
        choice = reply.choices[0]
        outcome.text, outcome.finish_reason = choice.message.content or "", choice.finish_reason
    except openai.APIError as exc:
        outcome.error = exc
    outcome.ended_at = time.monotonic()
    return outcome


def complete(
    server: Server,
    text: str,
    temperature: float,
    max_tokens: int = 12,
    seed: int | None = None,
    **extra: Any,
) -> Outcome:
    """/v1/completions, not streamed; `extra`: the openai client's `extra_headers` (vLLM's and
    transformers serve's `X-Request-Id`) or `extra_body` (SGLang's `rid`)."""
    _count(server, text)
    outcome = Outcome()
    try:
        reply = client(server).completions.create(
            model=server.model,
            prompt=text,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            **extra,
        )
        choice = reply.choices[0]
        outcome.text, outcome.finish_reason = choice.text or "", choice.finish_reason
    except openai.APIError as exc:
        outcome.error = exc
    outcome.ended_at = time.monotonic()
    return outcome


def stream_completion(
    server: Server, text: str, temperature: float, max_tokens: int = 12, outcome: Any = None
) -> Outcome:
    """/v1/completions, streamed."""
    _count(server, text)
    return _drain(
        lambda: client(server).completions.create(
            model=server.model,
            prompt=text,
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
        ),
        lambda choice: choice.text,
        outcome,
    )


def stream(
    server: Server,
    text: str,
    temperature: float,
    max_tokens: int = 12,
    outcome: Any = None,
    **extra: Any,
) -> Outcome:
    """/v1/chat/completions, streamed; `extra` as for `complete`."""
    _count(server, text)
    return _drain(
        lambda: client(server).chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            **extra,
        ),
        lambda choice: choice.delta.content,
        outcome,
    )


def _drain(open_stream: Any, content: Any, outcome: Outcome | None) -> Outcome:
    """Read a stream into `outcome`: its text (`content(choice)` of each chunk's choices),
    finish reason, chunks, and the error that ended it, if any."""
    outcome = outcome or Outcome()
    try:
        for chunk in open_stream():
            if outcome.error is not None:
                outcome.chunks_after_error += 1
            for choice in chunk.choices:
                if piece := content(choice):
                    outcome.text += piece
                    outcome.content_chunks += 1
                    outcome.started.set()
                if choice.finish_reason is not None:
                    outcome.finish_reason = choice.finish_reason
    except openai.APIError as exc:
        outcome.error = exc
    outcome.started.set()
    outcome.ended_at = time.monotonic()
    return outcome


def in_thread(target: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, Outcome]:
    outcome = kwargs.pop("outcome", None) or Outcome()
    thread = threading.Thread(
        target=lambda: (
            target(*args, outcome=outcome, **kwargs)
            if target in (stream, stream_completion)
            else _store(outcome, target(*args, **kwargs))
        ),
        daemon=True,
    )
    thread.start()
    return thread, outcome


def _store(into: Outcome, got: Outcome) -> None:
    into.text, into.finish_reason, into.error = got.text, got.finish_reason, got.error
    into.ended_at = got.ended_at
    into.started.set()


def join(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(timeout=2 * REQUEST_TIMEOUT_S)
        assert not thread.is_alive(), "a request outlived its timeout"


def samples(server: Server) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    found = {}
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def sample(server: Server, name: str, **labels: str) -> float:
    key = (name, frozenset({"rank": "0", **labels}.items()))
    return samples(server).get(key, float("nan"))


def wait_for_sample(
    server: Server, name: str, expected: float, timeout_s: float = 30.0, **labels: str
) -> float:
    """The sample's value once it reaches `expected` (counts arrive a report tick late)."""
    deadline = time.monotonic() + timeout_s
    value = sample(server, name, **labels)
    while not value >= expected and time.monotonic() < deadline:
        time.sleep(0.25)
        value = sample(server, name, **labels)
    return value


def settled(
    server: Server, name: str, expected: float = 0.0, hold_s: float = 1.5, **labels: str
) -> float:
    """A guardrails sample once it reaches `expected` and holds for `hold_s` (what earlier
    steps counted has all arrived: a baseline)."""
    value = wait_for_sample(server, name, expected, **labels)
    time.sleep(hold_s)
    return wait_for_sample(server, name, value, **labels)


def arrival_s(server: Server, name: str, expected: float, **labels: str) -> float:
    """Seconds until the sample reaches `expected`, read every 50 ms (at most 60 s: then
    `inf`). With nothing else sent meanwhile, this is how long the counts took to come."""
    start = time.monotonic()
    deadline = start + 60.0
    while time.monotonic() < deadline:
        if sample(server, name, **labels) >= expected:
            return time.monotonic() - start
        time.sleep(0.05)
    return float("inf")


def assert_reported_while_idle(
    server: Server, hook: str, send_poisoned: Callable[[str], None]
) -> None:
    """One poisoned request (`send_poisoned(request_id)` sends it with that id and checks the
    client's error), then silence: its one flagged row and its one ended request (`hook`'s
    guardrails_requests_aborted_total) reach /metrics within the interval (the slack is for a
    loaded 2-core machine's scrapes), nothing more comes, and the server's log names it in
    exactly one `guardrails.request_aborted` event, by the engine's id (which holds the
    client's)."""
    rows = {"site": "sampler.logits", "reason": "no_valid_token"}
    ended = {"hook": hook, "reason": "nonfinite_logits"}
    before = settled(server, "guardrails_flagged_rows_total", **rows)
    ended_before = settled(server, "guardrails_requests_aborted_total", **ended)
    request_id = f"idle-{uuid.uuid4().hex[:12]}"
    send_poisoned(request_id)
    took = arrival_s(server, "guardrails_flagged_rows_total", before + 1, **rows)
    took_ended = arrival_s(server, "guardrails_requests_aborted_total", ended_before + 1, **ended)
    print(
        f"flagged row on /metrics {took:.2f} s, ended request {took_ended:.2f} s after the answer "
        f"(interval {REPORT_INTERVAL_S} s)"
    )
    assert took <= REPORT_INTERVAL_S + 10.0, took
    assert took_ended <= REPORT_INTERVAL_S + 10.0, took_ended
    assert settled(server, "guardrails_flagged_rows_total", **rows) == before + 1
    assert settled(server, "guardrails_requests_aborted_total", **ended) == ended_before + 1
    named = aborted_events(server, request_id)
    assert len(named) == 1, named
    assert event_fields(named[0])["hook"] == hook, named[0]


def aborted_events(server: Server, request_id: str, timeout_s: float = 10.0) -> list[str]:
    """The server log's `guardrails.request_aborted` lines that name `request_id`, once there
    is one (a process's log line may land after the client's answer), or none after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [
            line
            for line in server.log.read_text(errors="replace").splitlines()
            if REQUEST_ABORTED_EVENT in line and request_id in line
        ]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.25)


def origins(server: Server) -> dict[tuple[str, str], float]:
    """`guardrails_nonfinite_origin_total` by (module, kind)."""
    return {
        (dict(labels)["module"], dict(labels)["kind"]): value
        for (name, labels), value in samples(server).items()
        if name == "guardrails_nonfinite_origin_total"
    }


def log_lines(server: Server, event: str) -> list[str]:
    """The server log's lines holding `event` (a guardrails event name)."""
    text = server.log.read_text(errors="replace")
    return [line for line in text.splitlines() if event in line]


def event_fields(line: str) -> dict[str, Any]:
    """The fields of one guardrails event line, logged as text (`name key=value ...`) or as
    JSON (`GUARDRAILS_LOG_FORMAT=json`; the engine's prefix before the object is skipped).
    Text values stay strings."""
    if "{" in line and line.rstrip().endswith("}"):
        found: dict[str, Any] = json.loads(line[line.index("{") :])
        return found
    return dict(re.findall(r"\b(\w+)=(\S+)", line))


def started_events(server: Server) -> list[dict[str, Any]]:
    """The `guardrails.started` events of a server whose guardrails log JSON
    (`GUARDRAILS_LOG_FORMAT=json`): one per process guardrails was installed in. The engine's
    prefix before each line ("(EngineCore pid=...)") is skipped."""
    return [event_fields(line) for line in log_lines(server, f'"{STARTED_EVENT}"')]


def assert_installed_once_per_process(
    server: Server,
    installed_by: str,
    processes: int,
    profile: str | None = None,
    hook: str | None = None,
) -> None:
    """Each of at least `processes` processes of `server` logged one start-up event, all
    saying guardrails came in by `installed_by`, with the shipped `profile` file (its name)
    and `hook` first among the hooks, where given."""
    events = started_events(server)
    pids = [event["pid"] for event in events]
    assert len(pids) == len(set(pids)) >= processes, events
    assert {event["installed_by"] for event in events} == {installed_by}, events
    if profile is not None:
        assert {Path(event["config_file"]).name for event in events} == {profile}, events
    if hook is not None:
        assert {event["hooks"][0] for event in events} == {hook}, events


def wait_for_origin(server: Server, timeout_s: float = 30.0) -> dict[tuple[str, str], float]:
    """`origins(server)` once it and the log's `guardrails.nonfinite_origin` line are there
    (or whatever there is after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not (origins(server) and log_lines(server, ORIGIN_EVENT)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return origins(server)


def host_seconds(server: Server) -> dict[str, float]:
    """`guardrails_host_seconds_total` by part, summed over the server's ranks."""
    found: dict[str, float] = {}
    for (name, labels), value in samples(server).items():
        if name == "guardrails_host_seconds_total":
            part = dict(labels)["part"]
            found[part] = found.get(part, 0.0) + value
    return found


def assert_host_time_grows(
    server: Server, parts: set[str], serve: Callable[[], object], timeout_s: float = 30.0
) -> dict[str, float]:
    """guardrails' own host time is on the server's /metrics: every one of `parts` is there and
    grows while `serve()` sends requests. Returns the increase by part (every part's)."""
    deadline = time.monotonic() + timeout_s
    before = host_seconds(server)
    while not parts <= set(before) and time.monotonic() < deadline:
        time.sleep(0.25)
        before = host_seconds(server)
    assert parts <= set(before), sorted(before)
    serve()
    after = host_seconds(server)
    while time.monotonic() < deadline and not all(after[p] > before[p] for p in parts):
        time.sleep(0.25)
        after = host_seconds(server)
    grown = {part: after[part] - before.get(part, 0.0) for part in after}
    assert all(grown[part] > 0 for part in parts), grown
    return grown


def families(server: Server) -> set[str]:
    """The metric family names on the server's /metrics."""
    return {family.name for family in text_string_to_metric_families(server.metrics())}


def not_called(server: Server) -> dict[str, float]:
    """`guardrails_site_not_called` by site: 1 for a guard or hook half the running mode's
    heartbeat found silent."""
    return {
        dict(labels)["site"]: value
        for (name, labels), value in samples(server).items()
        if name == "guardrails_site_not_called"
    }
