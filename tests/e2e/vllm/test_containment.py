"""A poisoned request's KV never reaches another request, on vLLM's real server: chunked
prefill at 128 tokens a step (one KV block on the CPU backend), prefix caching on.

vLLM's free queue hands out hashless blocks first, and the hook's eviction strips the hashes
of a poisoned request's blocks: the very next allocation gets them back, and attention reads
their slots past a shorter prompt's length (0 x NaN = NaN). The hook has vLLM zero exactly
those blocks before the next step runs. The fault is switched off and on in the running
server (tests/e2e/vllm/fault.py), so the poisoned prompt's retry can be checked once it is
gone. Every reference is the same server's greedy answer (the session's guarded server,
conftest.py).
"""

from __future__ import annotations

import pytest

from tests import tiny_llama
from tests.e2e.client import CLEAN, GREEDY, Outcome, complete, samples, settled
from tests.e2e.prompts import healed, words
from tests.e2e.server import Server
from tests.e2e.vllm import fault
from tests.e2e.vllm.launch import CHUNK, SITE, server_error

# The trigger at token 3: NaN from the first chunk on, in every block the prompt holds.
EARLY = f"{words(3, 0)} {tiny_llama.TRIGGER} {words(200, 1)}"
# 140 clean tokens (the first block is clean, and cached), then the trigger: NaN is born in
# the second chunk (tokens 128-255) of three.
PREFIX = words(140, 2)
LATE = f"{PREFIX} {tiny_llama.TRIGGER} {words(150, 3)}"
SHARED = f"{PREFIX} {words(60, 4)}"  # LATE's clean prefix, another ending
SHORT = CLEAN[:2]
REFERENCE_PROMPTS = (*SHORT, SHARED, healed(EARLY), healed(LATE))


@pytest.fixture(scope="module")
def unpoisoned(served: Server) -> dict[str, str]:
    """Greedy texts, one request at a time, taken when this module starts (before any
    poisoned request when it runs first, as it does by name; any poisoned KV they read would
    fail them here)."""
    texts = {}
    for prompt in REFERENCE_PROMPTS:
        got = complete(served, prompt, GREEDY)
        assert (got.error, got.finish_reason) == (None, "length"), got
        texts[prompt] = got.text
    return texts


def total(server: Server, name: str) -> float:
    """A sample summed over its label sets (vLLM's carry model and engine labels)."""
    return sum(value for (sample, _), value in samples(server).items() if sample == name)


def answered(outcome: Outcome) -> tuple[object, str, str | None]:
    return outcome.error, outcome.text, outcome.finish_reason


def test_a_nan_born_in_a_prefill_chunk_ends_the_request_at_that_chunk(
    served: Server, unpoisoned: dict[str, str]
) -> None:
    calls, flagged = "guardrails_guard_calls_total", "guardrails_flagged_rows_total"
    calls_before = settled(served, calls, **SITE)
    flagged_before = settled(served, flagged, reason="no_valid_token", **SITE)
    hits = total(served, "vllm:prefix_cache_hits_total")
    assert server_error(complete(served, LATE, GREEDY))
    # The first block may be a prefix-cache hit (SHARED's unpoisoned left it); every chunk
    # vLLM prefills is one sampler call, and the one holding the trigger must be the last.
    cached = total(served, "vllm:prefix_cache_hits_total") - hits
    assert cached in (0, CHUNK), cached
    chunks = (2 * CHUNK - int(cached)) // CHUNK  # up to the chunk of token 140
    assert settled(served, calls, calls_before + chunks, **SITE) == calls_before + chunks
    got = settled(served, flagged, flagged_before + 1, reason="no_valid_token", **SITE)
    assert got == flagged_before + 1


def test_a_short_prompt_after_a_poisoned_one_answers_as_before(
    served: Server, unpoisoned: dict[str, str]
) -> None:
    for short in SHORT:
        assert server_error(complete(served, EARLY, GREEDY))
        # Its blocks are free, hashless, and first in line for this allocation.
        assert answered(complete(served, short, GREEDY)) == (None, unpoisoned[short], "length")


def test_a_prompt_sharing_a_poisoned_prompts_clean_prefix_answers_as_before(
    served: Server, unpoisoned: dict[str, str]
) -> None:
    assert server_error(complete(served, LATE, GREEDY))
    assert answered(complete(served, SHARED, GREEDY)) == (None, unpoisoned[SHARED], "length")


def test_a_poisoned_prompts_retry_once_the_fault_is_gone_answers_as_the_healed_prompt(
    served: Server, unpoisoned: dict[str, str]
) -> None:
    for poisoned in (LATE, EARLY):
        assert server_error(complete(served, poisoned, GREEDY))
    with fault.off(served):
        for poisoned in (LATE, EARLY):
            got = complete(served, poisoned, GREEDY)
            served.poisoned_sent -= 1  # the trigger, with the fault off: not poisoned
            assert answered(got) == (None, unpoisoned[healed(poisoned)], "length")
