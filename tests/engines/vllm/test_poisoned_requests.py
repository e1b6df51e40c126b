"""`vllm.end_poisoned_requests`: a request whose logits had no valid token ends with
finish_reason="error" through vLLM 0.33.0's real Scheduler and NaN report.

What runs is vLLM's: `Sampler.forward` (guarded by the profile), `nans_to_dict`,
`ModelRunnerOutput`, `Scheduler.schedule/update_from_output/finish_requests` and
`EngineCoreOutput`. One piece cannot run on CPU: the body of
`GPUModelRunner._bookkeeping_sync` needs a model runner with a model, an InputBatch and a
device; a stand-in (below, labelled) returns what it returns, and the hook wraps that.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from . import faults
from .faults import VOCAB, guarded, metadata, runner_states

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REQS = ["r0", "r1", "r2"]
POISONED = "r1"  # its row is all NaN


@pytest.fixture
def scheduler(tmp_path):  # type: ignore[no-untyped-def]
    """vLLM's own Scheduler, built from a VllmConfig of a local config.json (no weights, no
    tokenizer: the scheduler needs neither), with three running requests."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sched = faults.scheduler(faults.vllm_config(tmp_path))
    for req_id in REQS:
        sched.add_request(Request(req_id, [1, 5, 7, 9], SamplingParams(max_tokens=8), None))
    return sched


def sampled_step() -> tuple[torch.Tensor, list[list[int]]]:
    """One decode step through the real (guarded, when patched) Sampler: row 1 all NaN."""
    from vllm.v1.sample.sampler import Sampler

    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[1] = float("nan")
    out = Sampler()(logits, metadata("greedy", rows=3))
    return out.sampled_token_ids, out.sampled_token_ids.tolist()


@contextmanager
def bookkeeping_stand_in(monkeypatch: pytest.MonkeyPatch, num_nans: torch.Tensor | None):  # type: ignore[no-untyped-def]
    """STAND-IN (test only) for GPUModelRunner._bookkeeping_sync's body, which needs a model
    runner on a device: it returns the same 8-tuple, for the three requests, with vLLM's own
    NaN counts as given (None/{}: VLLM_COMPUTE_NANS_IN_LOGITS off, the default)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def stand_in(self, scheduler_output, sampler_output, *rest):  # type: ignore[no-untyped-def]
        ids = sampler_output.sampled_token_ids.tolist()
        index = {req_id: i for i, req_id in enumerate(REQS)}
        return ({}, num_nans, None, ids, {}, list(REQS), index, [])

    monkeypatch.setattr(GPUModelRunner, "_bookkeeping_sync", stand_in)
    yield GPUModelRunner


def bookkeeping(runner_cls, runner):  # type: ignore[no-untyped-def]
    """`runner._bookkeeping_sync`, bound as vLLM's `self._bookkeeping_sync` binds it."""
    return runner_cls.__dict__["_bookkeeping_sync"].__get__(runner, runner_cls)


def runner_output(result, *, async_scheduling: bool):  # type: ignore[no-untyped-def]
    """The ModelRunnerOutput vLLM's sample_tokens builds from the bookkeeping result; under
    async scheduling, get_output's nans_to_dict of the device counts."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import nans_to_dict

    nans_dict, nans_device, _, sampled, prompt_logprobs, req_ids, index, _ = result
    if async_scheduling:
        nans_dict = None if nans_device is None else nans_to_dict(nans_device.tolist(), index)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=index,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict=prompt_logprobs,
        num_nans_in_logits=nans_dict,
    )


def outputs_by_id(engine_outputs) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {o.request_id: o for eco in engine_outputs.values() for o in eco.outputs}


@contextmanager
def hooked(registry: CollectorRegistry | None = None) -> Iterator[object]:
    with guarded(registry=registry) as guards:
        handles = guards.install_hooks()
        try:
            # This process drives the V1 model runner: Model Runner V2's module is never
            # imported here, so its half stays pending (tests/engines/vllm/v2 runs it).
            assert {h.target: h.state for h in handles} == runner_states(v2_imported=False)
            yield guards
        finally:
            for handle in handles:
                handle.remove()


def test_unguarded_vllm_hands_out_the_token_of_an_all_nan_row(scheduler, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # vLLM 0.33.0 with VLLM_COMPUTE_NANS_IN_LOGITS on: counted, recorded, not ended.
    step = scheduler.schedule()
    _, lists = sampled_step()
    nans = {"r0": 0, "r1": VOCAB, "r2": 0}
    from vllm.v1.outputs import ModelRunnerOutput

    out = ModelRunnerOutput(
        req_ids=REQS,
        req_id_to_index={r: i for i, r in enumerate(REQS)},
        sampled_token_ids=lists,
        logprobs=None,
        prompt_logprobs_dict={},
        num_nans_in_logits=nans,
    )
    got = outputs_by_id(scheduler.update_from_output(step, out))
    assert got[POISONED].new_token_ids == lists[1]
    assert got[POISONED].finish_reason is None
    assert got[POISONED].num_nans_in_logits == VOCAB


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_hook_ends_a_request_with_no_valid_token_with_finish_reason_error(  # type: ignore[no-untyped-def]
    outcome, scheduler, monkeypatch, async_scheduling
) -> None:
    from vllm.v1.engine import FinishReason

    step = scheduler.schedule()
    registry = CollectorRegistry()
    with bookkeeping_stand_in(monkeypatch, None) as runner_cls, hooked(registry) as guards:
        sampler_output = SimpleNamespace(sampled_token_ids=sampled_step()[0])
        runner = SimpleNamespace(use_async_scheduling=async_scheduling)
        result = bookkeeping(runner_cls, runner)(step, sampler_output, None, None, 3)
        out = runner_output(result, async_scheduling=async_scheduling)
        assert out.num_nans_in_logits == (
            {"r0": 0, "r1": 1, "r2": 0} if async_scheduling else {"r1": 1}
        )
        with capture_logs() as logs:
            got = outputs_by_id(scheduler.update_from_output(step, out))
        assert guards.count("sampler.logits", "rows_no_valid_token") == 1

    # The operator learns which request: one event with vLLM's request_id, one count.
    [ended] = [e for e in logs if e["event"] == "guardrails.request_aborted"]
    assert (ended["request_id"], ended["site"], ended["reason"]) == (
        POISONED,
        "sampler.logits",
        "nonfinite_logits",
    )
    assert (ended["status"], ended["finish_reason"]) == (500, "error")
    labels = {"hook": "vllm.end_poisoned_requests", "reason": "nonfinite_logits", "rank": "0"}
    assert registry.get_sample_value("guardrails_requests_aborted_total", labels) == 1.0

    poisoned = got[POISONED]
    assert poisoned.finish_reason == FinishReason.ERROR
    assert str(poisoned.finish_reason) == "error"
    assert poisoned.new_token_ids == []  # the token sampled from the uniform row never leaves
    assert poisoned.num_nans_in_logits == 1  # vLLM's stats count it as a corrupted request
    assert got["r0"].new_token_ids == out.sampled_token_ids[0] != []
    assert got["r0"].finish_reason is None
    assert got["r2"].finish_reason is None
    assert POISONED not in scheduler.requests
    assert [r.request_id for r in scheduler.running] == ["r0", "r2"]
    following = scheduler.schedule()
    assert set(following.num_scheduled_tokens) == {"r0", "r2"}
    outcome(
        component="Scheduler.update_from_output",
        dtype="float32",
        mode=f"greedy, {'async' if async_scheduling else 'sync'} scheduling",
        fault="all-NaN row",
        unguarded="token of the NaN row handed out, request runs on",
        guarded="no token, finish_reason=error, num_nans_in_logits=1, request freed",
    )


def test_the_client_sees_finish_reason_error_and_vllm_counts_a_corrupted_request(  # type: ignore[no-untyped-def]
    scheduler, monkeypatch
) -> None:
    """The scheduler's outputs through vLLM's own OutputProcessor (what LLM/AsyncLLM and
    the OpenAI server read), with VLLM_COMPUTE_NANS_IN_LOGITS on for its corrupted count."""
    import time

    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
    processor = OutputProcessor(None, log_stats=True)
    for req_id in REQS:
        request = EngineCoreRequest(
            req_id,
            [1, 5, 7, 9],
            None,
            SamplingParams(max_tokens=8, detokenize=False),
            None,
            time.time(),
            None,
            None,
            None,
        )
        request.external_req_id = req_id
        processor.add_request(request, prompt=None)
    step = scheduler.schedule()
    with bookkeeping_stand_in(monkeypatch, None) as runner_cls, hooked():
        sampler_output = SimpleNamespace(sampled_token_ids=sampled_step()[0])
        runner = SimpleNamespace(use_async_scheduling=False)
        result = bookkeeping(runner_cls, runner)(step, sampler_output, None, None, 3)
        engine_outputs = scheduler.update_from_output(
            step, runner_output(result, async_scheduling=False)
        )
    stats = IterationStats()
    seen = processor.process_outputs(engine_outputs[0].outputs, time.monotonic(), stats)
    by_id = {o.request_id: o for o in seen.request_outputs}
    assert by_id[POISONED].finished
    assert [(c.token_ids, c.finish_reason) for c in by_id[POISONED].outputs] == [([], "error")]
    assert not by_id["r0"].finished
    assert stats.num_corrupted_reqs == 1


def test_the_hook_leaves_requests_whose_rows_were_healed(scheduler, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.sample.sampler import Sampler

    step = scheduler.schedule()
    with bookkeeping_stand_in(monkeypatch, None) as runner_cls, hooked():
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
        logits[1, :10] = float("nan")  # healable: the row keeps valid entries
        sampled = Sampler()(logits, metadata("greedy", rows=3)).sampled_token_ids
        runner = SimpleNamespace(use_async_scheduling=False)
        result = bookkeeping(runner_cls, runner)(
            step, SimpleNamespace(sampled_token_ids=sampled), None, None, 3
        )
        got = outputs_by_id(
            scheduler.update_from_output(step, runner_output(result, async_scheduling=False))
        )
    assert [got[r].finish_reason for r in REQS] == [None, None, None]
    assert got[POISONED].new_token_ids == [sampled[1, 0].item()]


def test_a_failure_of_the_hook_leaves_the_engine_call_as_if_unhooked(  # type: ignore[no-untyped-def]
    scheduler, monkeypatch, caplog
) -> None:
    from vllm.v1.outputs import ModelRunnerOutput

    from guardrails.integrations import vllm as hook

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in guardrails")

    monkeypatch.setattr(hook._SchedulerHalf, "_strip", staticmethod(broken))
    step = scheduler.schedule()
    out = ModelRunnerOutput(
        req_ids=REQS,
        req_id_to_index={r: i for i, r in enumerate(REQS)},
        sampled_token_ids=[[3], [4], [5]],
        logprobs=None,
        prompt_logprobs_dict={},
        num_nans_in_logits={"r1": 1},
    )
    with hooked():
        got = outputs_by_id(scheduler.update_from_output(step, out))
    assert [got[r].new_token_ids for r in REQS] == [[3], [4], [5]]
    assert [got[r].finish_reason for r in REQS] == [None, None, None]
    assert "guardrails.hook_error" in caplog.text
    assert "a bug in guardrails" in caplog.text


def spec_step(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """One speculative decode step through vLLM's real RejectionSampler.forward (guarded by
    the profile's eagle.verify site when patched), as GPUModelRunner lays out three requests
    with 2, 1 and 2 drafts: rows [r0 d1, r0 d2, r0 bonus, r1 d1, r1 bonus, r2 d1, r2 d2,
    r2 bonus]. r1's target rows are all NaN; the acceptance kernel (Triton) is the PyTorch
    stand-in of test_rejection_sampler."""
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from .test_rejection_sampler import greedy_acceptance_stand_in

    sampler = rs.RejectionSampler(Sampler())  # registers the real kernels' warm-ups
    monkeypatch.setattr(rs, "_rejection_greedy_sample", greedy_acceptance_stand_in)
    i32 = torch.int32
    spec = SpecDecodeMetadata(
        draft_token_ids=torch.tensor([11, 12, 21, 31, 32], dtype=i32),
        num_draft_tokens=[2, 1, 2],
        cu_num_draft_tokens=torch.tensor([2, 3, 5], dtype=i32),
        cu_num_sampled_tokens=torch.tensor([3, 5, 8], dtype=i32),
        target_logits_indices=torch.tensor([0, 1, 3, 5, 6], dtype=i32),
        bonus_logits_indices=torch.tensor([2, 4, 7], dtype=i32),
        logits_indices=torch.arange(8, dtype=i32),
    )
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(6))
    logits[3:5] = float("nan")
    out = sampler(spec, None, logits, metadata("greedy", rows=3))
    return out.sampled_token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_under_speculative_decoding_a_request_whose_target_rows_had_no_valid_token_ends(  # type: ignore[no-untyped-def]
    outcome, scheduler, monkeypatch, async_scheduling
) -> None:
    from vllm.v1.engine import FinishReason

    step = scheduler.schedule()
    with bookkeeping_stand_in(monkeypatch, None) as runner_cls, hooked() as guards:
        sampled = spec_step(monkeypatch)
        runner = SimpleNamespace(use_async_scheduling=async_scheduling)
        result = bookkeeping(runner_cls, runner)(
            step, SimpleNamespace(sampled_token_ids=sampled), None, None, 3
        )
        out = runner_output(result, async_scheduling=async_scheduling)
        got = outputs_by_id(scheduler.update_from_output(step, out))
        # Healed at eagle.verify, before the bonus rows reach Sampler.forward.
        assert guards.count("eagle.verify", "rows_no_valid_token") == 2
        assert guards.count("sampler.logits", "rows_no_valid_token") == 0
    assert got[POISONED].finish_reason == FinishReason.ERROR
    assert got[POISONED].new_token_ids == []
    assert [got[r].finish_reason for r in ("r0", "r2")] == [None, None]
    assert got["r0"].new_token_ids != []
    outcome(
        component="RejectionSampler.forward + Scheduler.update_from_output",
        dtype="float32",
        mode=f"greedy spec decode, {'async' if async_scheduling else 'sync'} scheduling",
        fault="all-NaN target rows of one request",
        unguarded="(see test_rejection_sampler)",
        guarded="no token, finish_reason=error; its neighbours go on",
    )
