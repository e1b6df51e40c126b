"""The liveness self-check on vLLM's Model Runner V2: the profile's heartbeat, vLLM's own
`LogitsProcessor.forward`, beats at every step of V2's runner (runner.py: the model's
compute_logits is that layer); a profile whose sites sit where V2 never samples is reported,
the shipped profile is not.

"Where V2 never samples" is issue 18's profile: the V1 sampler's points only. Under it every
step of a default GPU deployment went through V2's Sampler.__call__ unguarded, and
`guardrails check --strict` said ok.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.names import SITE_NOT_CALLED_EVENT

from ..faults import PROFILE, guarded
from .runner import Engine, engine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

STEPS = 4  # liveness_steps for these tests: a report after 4 beats
HEARTBEAT = "vllm.model_executor.layers.logits_processor:LogitsProcessor.forward"


def v1_only_profile(tmp: Path) -> Path:
    """The shipped profile without its Model Runner V2 points (issue 18's profile)."""
    text = PROFILE.read_text()
    start = text.index("# --- Model Runner V2")
    end = text.index("# --- V1 model runner")
    path = tmp / "vllm-v1-only.toml"
    # As issue 18 had them: for every vLLM from 0.30 on (the shipped profile now stops them
    # at 0.34, which has no V1 runner), so that they are watched on 0.34.0 too.
    text = text.replace('when = "vllm>=0.30,<0.34"', 'when = "vllm>=0.30"')
    path.write_text(text[:start] + text[end:])
    return path


@pytest.fixture
def v2(tmp_path: Path) -> Iterator[Engine]:
    with engine(tmp_path) as built:
        yield built


def run_steps(v2: Engine, profile: Path) -> tuple[list[dict[str, Any]], CollectorRegistry, Any]:
    """STEPS + 1 engine steps of three requests under `profile` (its heartbeat included)."""
    registry = CollectorRegistry()
    with guarded(profile, registry, liveness_steps=STEPS) as guards, capture_logs() as logs:
        handles = guards.install_hooks()
        try:
            [heartbeat] = guards.heartbeats()
            assert heartbeat.state == "applied"
            for req_id in ("r0", "r1", "r2"):
                v2.add(req_id, [1, 5, 7, 9], temperature=0.0)
            for _ in range(STEPS + 1):
                v2.step()
            counts = guards.counts()
            beats = guards.liveness.beats  # type: ignore[union-attr]
        finally:
            for handle in handles:
                handle.remove()
    assert beats == STEPS + 1  # one compute_logits per step
    return [e for e in logs if e["event"] == SITE_NOT_CALLED_EVENT], registry, counts


def gauge(registry: CollectorRegistry, site: str) -> float | None:
    return registry.get_sample_value("guardrails_site_not_called", {"site": site, "rank": "0"})


def test_a_profile_whose_sampler_sites_v2_never_calls_is_reported(  # type: ignore[no-untyped-def]
    outcome, v2, tmp_path
) -> None:
    events, registry, counts = run_steps(v2, v1_only_profile(tmp_path))
    assert counts[("sampler.logits", "calls")] == 0  # V2 sampled unguarded
    assert sorted(e["site"] for e in events) == ["sampler.logits", "sampler.token_ids"]
    for event in events:
        assert event["log_level"] == "warning"
        assert event["heartbeat"] == HEARTBEAT
        assert event["steps"] == STEPS
        assert all(t.startswith("vllm.v1.sample.sampler:") for t in event["targets"])
    assert gauge(registry, "sampler.logits") == 1.0
    assert gauge(registry, "sampler.token_ids") == 1.0
    # The hook's V2 half is on the path: it is not reported.
    assert gauge(registry, "vllm.end_poisoned_requests") == 0.0
    outcome(
        component="liveness (heartbeat LogitsProcessor.forward)",
        dtype="float32",
        mode=f"V2 runner, liveness_steps={STEPS}",
        fault="profile with V1 sampler points only (issue 18)",
        unguarded="0 guard calls, check --strict ok, nothing said",
        guarded="guardrails.site_not_called for sampler.logits and sampler.token_ids, gauge 1",
    )


def test_the_shipped_profile_on_v2s_path_is_not_reported(outcome, v2) -> None:  # type: ignore[no-untyped-def]
    events, registry, counts = run_steps(v2, PROFILE)
    assert counts[("sampler.logits", "calls")] == STEPS + 1
    assert events == []
    assert counts[("sampler.token_ids", "calls")] == STEPS + 1
    for site in ("sampler.logits", "vllm.end_poisoned_requests"):
        assert gauge(registry, site) == 0.0
    assert gauge(registry, "eagle.verify") is None  # not expected: speculative decoding is off
    # Not watched under V2 (its point is expect_calls = false: speculative steps never call
    # it); sampler.logits, on the same Sampler.__call__, is.
    assert gauge(registry, "sampler.token_ids") is None
    outcome(
        component="liveness (heartbeat LogitsProcessor.forward)",
        dtype="float32",
        mode=f"V2 runner, liveness_steps={STEPS}",
        fault="shipped profile",
        unguarded="-",
        guarded="no guardrails.site_not_called, gauge 0 for every watched site and the hook",
    )


def test_the_shipped_profile_under_v2_speculative_decoding_is_not_reported(  # type: ignore[no-untyped-def]
    outcome, tmp_path
) -> None:
    """Speculative steps sample in RejectionSampler.__call__ only: sampler.token_ids' V2 point
    (on Sampler.__call__) sees only the draft-free prefill. It is marked `expect_calls = false`
    in the profile, so a healthy speculative server is not reported silent (it was, at every
    window: issue 25)."""
    from .test_speculative import DRAFTS, drafting, targets

    registry = CollectorRegistry()
    spec_steps = 2 * STEPS
    with (
        engine(tmp_path, speculative_tokens=len(DRAFTS)) as v2,
        guarded(PROFILE, registry, liveness_steps=STEPS) as guards,
        capture_logs() as logs,
    ):
        handles = guards.install_hooks()
        try:
            drafting(v2, max_tokens=64)  # long enough for every speculative step
            for _ in range(spec_steps):
                step = v2.step({"r0": targets("clean"), "r1": targets("clean")})
                assert step.batch.num_draft_tokens == 2 * len(DRAFTS)
            counts = guards.counts()
        finally:
            for handle in handles:
                handle.remove()
    assert counts[("sampler.token_ids", "calls")] == 1  # the prefill only
    assert counts[("sampler.logits", "calls")] == 1 + spec_steps
    assert [e for e in logs if e["event"] == SITE_NOT_CALLED_EVENT] == []
    assert gauge(registry, "sampler.logits") == 0.0
    assert gauge(registry, "sampler.token_ids") is None  # not watched under V2
    outcome(
        component="liveness (heartbeat LogitsProcessor.forward)",
        dtype="float32",
        mode=f"V2 runner, n-gram spec decode, liveness_steps={STEPS}",
        fault="shipped profile, healthy server",
        unguarded="-",
        guarded="no guardrails.site_not_called (sampler.token_ids: only draft-free steps)",
    )
