"""`transformers.end_poisoned_requests` on transformers' own `generate()` and continuous batching
(`generate_batch`, the engine `transformers serve --continuous-batching` runs), in process,
with the tiny float16 Llama that overflows by itself on its trigger word (tests/tiny_llama.py).
The served version of the same is `make e2e` (tests/e2e/).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

pytest.importorskip("transformers")

from guardrails import Guardrails, GuardSettings
from guardrails.integrations.transformers_hooks import (
    HOOK,
    MESSAGE,
    PoisonedRequestError,
)
from tests import tiny_llama

PROFILE = Path(__file__).resolve().parents[2] / "config" / "profiles" / "transformers-serve.toml"
CLEAN = [[4, 33, 75, 88], [60, 12, 140, 9, 30], [101, 7, 55]]
POISONED = [4, len(tiny_llama.SPECIALS) + tiny_llama.WORDS.index(tiny_llama.TRIGGER), 75, 88]
NEW = 10


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama.build_model()


@pytest.fixture
def registry() -> Any:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


def aborted(registry: Any, reason: str = "nonfinite_logits") -> Any:
    """guardrails_requests_aborted_total of the profile's hook."""
    return registry.get_sample_value(
        "guardrails_requests_aborted_total", {"hook": HOOK, "reason": reason, "rank": "0"}
    )


@pytest.fixture
def profile(registry: Any) -> Iterator[Guardrails]:
    guards = Guardrails(
        GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}), registry=registry
    )
    handles = [*guards.attach_configured(), *guards.install_hooks()]
    # Every half but the serving layer's (transformers.cli.serving is not imported here).
    states = {getattr(h, "target", "attach"): getattr(h, "state", "applied") for h in handles}
    serving = [
        "CBGenerateManager.generate_non_streaming",
        "GenerateManager.generate_streaming",
        "GenerateManager.generate_non_streaming",
        "InferenceThread.submit",
        "InferenceThread.async_submit",
    ]
    assert [states.pop(target) for target in serving] == ["pending"] * len(serving)
    assert set(states.values()) == {"applied"}
    yield guards
    for handle in handles:
        handle.remove()
    guards.close()


class Streamer:
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def _generate(model: Any, ids: list[int], streamer: Any = None, **kwargs: Any) -> torch.Tensor:
    return model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=NEW,
        streamer=streamer,
        **kwargs,
    )


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_generate_raises_before_the_poisoned_token_is_streamed(
    model: Any, profile: Guardrails, do_sample: bool
) -> None:
    streamer = Streamer()
    with pytest.raises(PoisonedRequestError, match="no valid token"):
        _generate(model, POISONED, streamer, do_sample=do_sample)
    assert streamer.puts == [POISONED]  # the prompt, and no sampled token
    assert not streamer.ended
    assert profile.count("sampler.logits", "rows_no_valid_token") == 1
    assert profile.count("sampler.logits", "nan") == tiny_llama.VOCAB


def test_generate_without_a_streamer_raises_too(model: Any, profile: Guardrails) -> None:
    with pytest.raises(PoisonedRequestError) as raised:
        _generate(model, POISONED, do_sample=False)
    assert str(raised.value) == MESSAGE


def test_an_ended_generate_is_counted_and_named_by_its_streamers_request_id(
    model: Any, profile: Guardrails, registry: Any
) -> None:
    streamer = Streamer()
    streamer.request_id = 7003  # type: ignore[attr-defined]  # what transformers serve's carries
    with capture_logs() as logs:
        with pytest.raises(PoisonedRequestError):
            _generate(model, POISONED, streamer, do_sample=False)
        with pytest.raises(PoisonedRequestError):
            _generate(model, POISONED, do_sample=False)  # a bare generate(): no id
    ended = [e for e in logs if e["event"] == "guardrails.request_aborted"]
    assert [(e["request_id"], e["hook"], e["site"], e["reason"]) for e in ended] == [
        ("7003", HOOK, "sampler.logits", "nonfinite_logits"),
        (None, HOOK, "sampler.logits", "nonfinite_logits"),
    ]
    assert aborted(registry) == 2.0


def test_clean_generate_is_unchanged_under_the_hook(model: Any) -> None:
    unguarded = _generate(model, CLEAN[0], do_sample=False)
    from prometheus_client import CollectorRegistry

    guards = Guardrails(
        GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}),
        registry=CollectorRegistry(),
    )
    handles = [*guards.attach_configured(), *guards.install_hooks()]
    try:
        guarded = _generate(model, CLEAN[0], do_sample=False)
    finally:
        for handle in handles:
            handle.remove()
        guards.close()
    assert torch.equal(guarded, unguarded)
    assert guards.count("sampler.logits", "nan") == 0


def _batch(model: Any, inputs: list[list[int]]) -> dict[str, Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=tiny_llama.EOS)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
    outputs = model.generate_batch(
        inputs, generation_config=config, continuous_batching_config=cb, progress_bar=False
    )
    return {  # request ids are req_0, req_1, ... in input order
        key: outputs[key] for key in sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))
    }


def test_batching_ends_the_poisoned_request_and_its_neighbours_match_their_solo_text(
    model: Any, profile: Guardrails, registry: Any
) -> None:
    alone = [next(iter(_batch(model, [ids]).values())).generated_tokens for ids in CLEAN]
    with capture_logs() as logs:
        results = list(_batch(model, [CLEAN[0], POISONED, CLEAN[1], CLEAN[2]]).values())
    poisoned = results[1]
    assert poisoned.error == MESSAGE
    assert poisoned.generated_tokens == []  # the token sampled from its healed row is dropped
    assert [r.error for r in results[:1] + results[2:]] == [None, None, None]
    assert [r.generated_tokens for r in results[:1] + results[2:]] == alone
    assert profile.count("sampler.logits", "rows_no_valid_token") == 1
    assert aborted(registry) == 1.0
    [ended] = [e for e in logs if e["event"] == "guardrails.request_aborted"]
    assert (ended["request_id"], ended["status"]) == ("req_1", 500)


def test_unguarded_batching_lets_the_poison_reach_the_neighbours(model: Any) -> None:
    # What the hook is for: in the same batch, the clean requests' logits go NaN (greedy
    # argmax then picks id 0, the pad token) through the shared attention call.
    alone = [next(iter(_batch(model, [ids]).values())).generated_tokens for ids in CLEAN]
    results = list(_batch(model, [CLEAN[0], POISONED, CLEAN[1], CLEAN[2]]).values())
    clean = [r.generated_tokens for r in results[:1] + results[2:]]
    assert clean != alone
    assert any(tiny_llama.PAD in tokens for tokens in clean)
