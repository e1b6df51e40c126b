"""A poisoned request's KV never reaches another request, on SGLang's real server (CPU engine,
`torch_native` attention, page size 1, radix prefix cache on).

What keeps it out, read from SGLang 0.5.23's code and checked here on the server:
- the hook sets `req.skip_radix_cache_insert`, so `release_kv_cache`
  (sglang/srt/mem_cache/common.py) frees the request's own slots without inserting them into
  the radix tree: no later prompt can match them as a prefix;
- the freed slots go back to the allocator and are handed out again, but `torch_native`
  reads a request's keys and values through `req_to_token[req_pool_idx, start_kv:end_kv]`
  (sglang/srt/layers/attention/torch_native_backend.py): exactly the slots the request itself
  wrote this step or before, never a stale slot past its length (with page size 1 every slot
  it holds is one it wrote).

Paged backends with pages of more than one token (FlashInfer, FlashAttention 3) may read slots
past a request's length; for them the hook zeroes the slots the aborted request wrote itself
before SGLang frees them (the last test checks it ran on every abort). They are not run here
(no GPU): docs/engines.md says what is and is not covered there.

The fault is switched off and on through SGLang's own `POST /update_weights_from_disk`
(`flush_cache: false`, so whatever KV SGLang kept stays kept): off loads a copy of the model
whose trigger row is a copy of SUBSTITUTE's, on loads the poisoned model again. Every reference
is the same server's greedy answer before any poisoned request, with the prefix cache flushed
afterwards so that the later prompts compute their KV again in reused slots.

This module's server reports by time alone (`BY_TIME_ONLY`): the last test checks that one
poisoned request on the idle server reaches SGLang's /metrics within seconds. It is started
plainly, guardrails coming in through SGLang's plugin entry point, and logs guardrails' events
as JSON lines (`GUARDRAILS_LOG_FORMAT=json`): the first test reads how guardrails came into
each process.
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from guardrails.names import HOOK_ERROR_EVENT
from tests import tiny_llama
from tests.e2e.client import (
    CLEAN,
    GREEDY,
    aborted_events,
    assert_installed_once_per_process,
    assert_reported_while_idle,
    complete,
    event_fields,
    log_lines,
)
from tests.e2e.prompts import SUBSTITUTE_ID, TRIGGER_ID, healed, words
from tests.e2e.server import BY_TIME_ONLY, Server
from tests.e2e.sglang.serve import assert_aborted, flush_cache, serving

PREFIX = words(40, 2)
POISONED = f"{PREFIX} {tiny_llama.TRIGGER} {words(40, 3)}"  # 81 slots of NaN KV, then freed
SHARED = f"{PREFIX} {words(20, 4)}"  # the poisoned prompt's clean prefix, another ending
SHORT = CLEAN[:2]
REFERENCE_PROMPTS = (*SHORT, SHARED)


@pytest.fixture(scope="module")
def guarded(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The guarded server (conftest.py's), its counts reported by time alone."""
    log = tmp_path_factory.mktemp("contained") / "server.log"
    with serving(model_dir, log, env={**BY_TIME_ONLY, "GUARDRAILS_LOG_FORMAT": "json"}) as server:
        yield server


@pytest.fixture(scope="module")
def healed_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model with the fault gone: the trigger's embedding row is SUBSTITUTE's."""
    directory = tmp_path_factory.mktemp("healed-model")
    for source in model_dir.iterdir():
        (directory / source.name).write_bytes(source.read_bytes())
    (weights,) = directory.glob("*.safetensors")
    tensors = load_file(weights)
    embed = tensors["model.embed_tokens.weight"]
    embed[TRIGGER_ID] = embed[SUBSTITUTE_ID]
    save_file(tensors, weights, metadata={"format": "pt"})
    return directory


def load_weights(server: Server, model: Path) -> None:
    """SGLang's own weight reload, its caches kept."""
    body = json.dumps({"model_path": str(model), "flush_cache": False}).encode()
    request = urllib.request.Request(
        f"{server.base_url}/update_weights_from_disk",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.loads(reply.read())
    assert answer.get("success") is True, answer


@contextlib.contextmanager
def fault_off(server: Server, healed_model: Path, model_dir: Path) -> Iterator[None]:
    load_weights(server, healed_model)
    try:
        yield
    finally:
        load_weights(server, model_dir)


@pytest.fixture(scope="module")
def unpoisoned(guarded: Server, healed_model: Path, model_dir: Path) -> dict[str, str]:
    """Greedy texts taken when the module's server starts, before any poisoned request; the
    poisoned prompt's own with the fault off. The prefix cache is flushed after them."""
    texts = {}
    for prompt in REFERENCE_PROMPTS:
        got = complete(guarded, prompt, GREEDY)
        assert (got.error, got.finish_reason) == (None, "length"), got
        texts[prompt] = got.text
    with fault_off(guarded, healed_model, model_dir):
        got = complete(guarded, POISONED, GREEDY)
        assert (got.error, got.finish_reason) == (None, "length"), got
        texts[POISONED] = got.text
        assert got.text == complete(guarded, healed(POISONED), GREEDY).text
    assert flush_cache(guarded)[0] == 200
    return texts


def test_the_plugin_installed_guardrails_in_the_servers_processes(guarded: Server) -> None:
    # The HTTP process, the scheduler and the detokenizer: each says how guardrails came in,
    # none twice. No launcher, no configuration: the shipped profile.
    assert_installed_once_per_process(
        guarded, "plugin:sglang", 2, "sglang.toml", "sglang.abort_poisoned_requests"
    )


def test_a_short_prompt_after_a_poisoned_one_answers_as_before(
    guarded: Server, unpoisoned: dict[str, str]
) -> None:
    for prompt in SHORT:  # each in slots the poisoned request has just freed
        assert_aborted(complete(guarded, POISONED, GREEDY))
        got = complete(guarded, prompt, GREEDY)
        assert (got.error, got.text, got.finish_reason) == (None, unpoisoned[prompt], "length")


def test_a_prompt_sharing_a_poisoned_prompts_prefix_answers_as_before(
    guarded: Server, unpoisoned: dict[str, str]
) -> None:
    assert_aborted(complete(guarded, POISONED, GREEDY))
    got = complete(guarded, SHARED, GREEDY)
    assert (got.error, got.text, got.finish_reason) == (None, unpoisoned[SHARED], "length")


def test_the_poisoned_prompts_retry_once_the_fault_is_gone_answers_as_unpoisoned(
    guarded: Server, unpoisoned: dict[str, str], healed_model: Path, model_dir: Path
) -> None:
    assert_aborted(complete(guarded, POISONED, GREEDY))
    with fault_off(guarded, healed_model, model_dir):
        got = complete(guarded, POISONED, GREEDY)
    assert (got.error, got.text, got.finish_reason) == (None, unpoisoned[POISONED], "length")
    # The fault is back: the retry's clean KV is in the prefix cache (the whole prompt is a
    # hit), so only once it is flushed does the prompt read the NaN row again.
    assert flush_cache(guarded)[0] == 200
    assert_aborted(complete(guarded, POISONED, GREEDY))


def test_an_idle_servers_poisoned_request_reaches_metrics_within_seconds(
    guarded: Server,
) -> None:
    """No site ticks (BY_TIME_ONLY): only the scheduler's background poll can bring the
    poisoned request's flagged row to SGLang's /metrics."""

    def send(request_id: str) -> None:
        # One step: one flagged row. SGLang's id is the request's `rid`.
        assert_aborted(complete(guarded, POISONED, GREEDY, 1, extra_body={"rid": request_id}))

    assert_reported_while_idle(guarded, "sglang.abort_poisoned_requests", send)


def test_each_aborted_requests_own_kv_slots_are_zeroed(guarded: Server) -> None:
    """The hook zeroes the slots a poisoned request wrote before SGLang frees them (what
    backends that read past a request's length need; `torch_native` here does not): every
    abort's event says how many, none failed."""
    request_id = "zeroed-kv"
    assert_aborted(complete(guarded, POISONED, GREEDY, extra_body={"rid": request_id}))
    (line,) = aborted_events(guarded, request_id)
    zeroed = int(event_fields(line)["kv_slots_zeroed"])
    # Its whole prompt but what it matched in the radix cache (the prefix of earlier
    # requests): at least the trigger and the 40 words after it.
    assert 41 <= zeroed <= len(POISONED.split()) + 2, line
    assert log_lines(guarded, HOOK_ERROR_EVENT) == []
