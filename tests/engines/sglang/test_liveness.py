"""The SGLang profile's liveness self-check on SGLang's own sampling step.

The heartbeat is `ModelRunner.sample`, the call every sampling step passes. What runs is
SGLang's: `ModelRunner.sample` and `ModelRunner._preprocess_logits` (the real methods, called
on a ModelRunner made without `__init__`), its `Sampler`, `SamplingBatchInfo` and
`LogitsProcessorOutput`. Stand-ins, labelled where they are made: the runner's attributes a
loaded model would set (its sampler is SGLang's own; no sampling observer, watermark or
n-gram table), and the `ForwardBatch` fields `sample` reads (a real one needs a model, a KV
pool and a ScheduleBatch).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails import Guardrails, GuardSettings
from guardrails.names import SITE_NOT_CALLED_EVENT
from tests.engines.sglang.engine import (
    NEW,
    PROFILE,
    B,
    V,
    batch_info,
    clean_logits,
    guarded,
    inject,
)

STEPS = 8  # GUARDRAILS_LIVENESS_STEPS for these tests (the profile's default is 256)


def runner(engine: Any) -> Any:
    """SGLang's ModelRunner, its methods real, without a model: what `sample` reads of it."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    model_runner = object.__new__(ModelRunner)
    model_runner.sampler = engine.sampler  # SGLang's own Sampler
    # Stand-ins for what a loaded model sets: nothing observes, watermarks or tracks n-grams.
    model_runner.sampling_observer = None
    model_runner.watermark_state = None
    model_runner.ngram_embedding_manager = SimpleNamespace(update_after_decode=lambda **_: None)
    return model_runner


def forward_batch(engine: Any, rows: int = B) -> Any:
    """Stand-in for ForwardBatch: the fields ModelRunner.sample reads, for a decode step."""
    return SimpleNamespace(
        sampling_info=batch_info(engine, "greedy", rows, V),
        return_logprob=False,
        top_logprobs_nums=[0] * rows,
        token_ids_logprobs=[None] * rows,
        positions=torch.zeros(rows, dtype=torch.int64),
        seq_lens=torch.ones(rows, dtype=torch.int64),
        forward_mode=SimpleNamespace(is_decode=lambda: True),
        ngram_embedding_info=None,
        req_pool_indices=torch.arange(rows),
    )


def step(engine: Any, model_runner: Any, fault: str | None = None) -> tuple[Any, Any]:
    logits = clean_logits(torch.float32)
    if fault is not None:
        inject(logits, fault)
    output = engine.LogitsProcessorOutput(next_token_logits=logits)
    return model_runner.sample(output, forward_batch(engine)), output


def profile(tmp_path: Path, replace: dict[str, str] | None = None) -> Path:
    """The shipped SGLang profile, with some targets replaced (a profile written for another
    runner), and a short liveness window."""
    text = PROFILE.read_text(encoding="utf-8")
    for old, new in (replace or {}).items():
        text, n = re.subn(re.escape(f'target = "{old}"'), f'target = "{new}"', text)
        assert n >= 1, old
    path = tmp_path / "sglang.toml"
    path.write_text(f"liveness_steps = {STEPS}\n" + text, encoding="utf-8")
    return path


def run_profile(engine: Any, path: Path, registry: CollectorRegistry, steps: int) -> tuple:
    settings = GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(path)})
    guards = Guardrails(settings, registry=registry)
    handles: list[Any] = [*guards.attach_configured(), *guards.install_hooks()]
    model_runner = runner(engine)
    try:
        with capture_logs() as logs:
            for _ in range(steps):
                step(engine, model_runner)
        events = [e for e in logs if e["event"] == SITE_NOT_CALLED_EVENT]
        values = {
            name: registry.get_sample_value(
                "guardrails_site_not_called", {"site": name, "rank": "0"}
            )
            for name in (
                "sampler.logits",
                "sampler.token_ids",
                "sglang.abort_poisoned_requests",
                "sglang.abort_poisoned_requests:results",
            )
        }
        calls = guards.count("sampler.logits", "calls")
        beats = guards.liveness.beats if guards.liveness is not None else 0
    finally:
        for handle in reversed(handles):
            handle.remove()
        guards.close()
    return events, values, calls, beats


def test_the_profile_on_sglangs_own_step_is_not_reported(
    engine: Any, tmp_path: Path, registry: CollectorRegistry, outcome: Any
) -> None:
    events, values, calls, beats = run_profile(engine, profile(tmp_path), registry, STEPS)
    assert beats == STEPS  # ModelRunner.sample is the heartbeat, and it beat every step
    assert calls == STEPS  # the sampler site is on that path
    assert values["sampler.logits"] == 0.0
    assert values["sampler.token_ids"] == 0.0
    assert values["sglang.abort_poisoned_requests"] == 0.0  # its sampler half ran
    # The scheduler's result processing is not driven here: its half is (rightly) reported.
    assert [e["site"] for e in events] == ["sglang.abort_poisoned_requests:results"]
    assert values["sglang.abort_poisoned_requests:results"] == 1.0
    outcome(
        component="liveness (ModelRunner.sample heartbeat)",
        dtype="float32",
        mode="greedy",
        fault="none",
        unguarded="no self-check",
        guarded=f"{beats} beats, sampler.logits called {calls}x: gauge 0",
    )


def test_a_profile_for_another_path_is_reported_on_sglangs_own_step(
    engine: Any, tmp_path: Path, registry: CollectorRegistry, outcome: Any
) -> None:
    # The sampler site put on a method this step never calls (the Ascend NPU backend's): what
    # a profile written for another SGLang version, backend or runner does.
    elsewhere = "sglang.srt.layers.sampler:Sampler._forward_ascend_backend"
    moved = {
        "sglang.srt.layers.sampler:sanitize_nan_logits"
        if NEW
        else "sglang.srt.layers.sampler:Sampler._preprocess_logits": elsewhere
    }
    events, values, calls, beats = run_profile(engine, profile(tmp_path, moved), registry, STEPS)
    assert beats == STEPS
    assert calls == 0
    [event] = [e for e in events if e["site"] == "sampler.logits"]
    assert event["targets"] == [elsewhere]
    assert event["state"] == ["applied"]
    assert event["heartbeat"] == "sglang.srt.model_executor.model_runner:ModelRunner.sample"
    assert values["sampler.logits"] == 1.0
    assert values["sampler.token_ids"] == 0.0  # still on the path
    outcome(
        component="liveness (ModelRunner.sample heartbeat)",
        dtype="float32",
        mode="greedy",
        fault="site on a method never called",
        unguarded="nothing said: every NaN row left as is",
        guarded=f"guardrails.site_not_called after {beats} beats, gauge 1",
    )


def test_the_heartbeat_step_still_guards_and_samples_as_sglang_does(engine: Any) -> None:
    with guarded(hooks=False) as guards:
        ids, output = step(engine, runner(engine), fault="nan_entries")
        assert not torch.isnan(output.next_token_logits).any()
        assert guards.count("sampler.logits", "nan") == 4
        assert guards.liveness is not None
        assert guards.liveness.beats == 1
    assert ids.shape == (B,)
