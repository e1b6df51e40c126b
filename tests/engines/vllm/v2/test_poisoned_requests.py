"""`vllm.end_poisoned_requests` under Model Runner V2: a request whose logits had no valid
token ends with finish_reason="error" through V2's own NaN report, and its KV leaves the
prefix cache.

Each step is an engine-core step of vLLM's own code (runner.py): Scheduler.schedule, the V2
runner's request updates and prepare_inputs, sample_tokens (GPUModelRunner.sample, the
guarded Sampler.__call__, AsyncOutput), AsyncOutput.get_output (what the executor calls),
Scheduler.update_from_output. The model (its logits are the test's) and the KV-cache side
of the runner are the labelled stand-ins of runner.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from guardrails import Guardrails

from ..faults import BLOCK_SIZE, NAN_IDS, VOCAB, fault_row, guarded, runner_states
from .runner import Engine, engine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REQS = ["r0", "r1", "r2"]
POISONED = "r1"
HEALABLE = "r2"  # NaN entries only: healed, never ended
PROMPT = [1, 5, 7, 9]


@pytest.fixture
def v2(tmp_path: Path) -> Iterator[Engine]:
    with engine(tmp_path) as built:
        yield built


@contextmanager
def hooked() -> Iterator[Guardrails]:
    """The profile's points and hook, as the bootstrap installs them."""
    with guarded() as guards:
        handles = guards.install_hooks()
        try:
            # Only V2's runner module is imported in this process, as in a V2 worker.
            assert {h.target: h.state for h in handles} == runner_states(v2_imported=True)
            yield guards
        finally:
            for handle in handles:
                handle.remove()


@pytest.mark.parametrize("compute_nans", [False, True], ids=["default", "COMPUTE_NANS"])
@pytest.mark.parametrize("fault", ["all-NaN row", "all -inf row"])
def test_a_poisoned_request_ends_with_finish_reason_error_under_v2(  # type: ignore[no-untyped-def]
    outcome, tmp_path, monkeypatch, fault, compute_nans
) -> None:
    from vllm.v1.engine import FinishReason

    # V2's Sampler reads it when load_model builds it.
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1" if compute_nans else "0")
    with engine(tmp_path) as v2, hooked() as guards:
        assert v2.runner.sampler.compute_nans is compute_nans
        for req_id in REQS:
            v2.add(req_id, PROMPT, temperature=0.0)
        step = v2.step({POISONED: fault_row(fault), HEALABLE: fault_row("NaN entries")})
        assert guards.count("sampler.logits", "rows_no_valid_token") == 1
        following = v2.step()

    got = step.by_id()
    # V2's own report, through AsyncOutput.get_output: one count per request, in its order.
    nans = step.output.num_nans_in_logits
    assert nans[POISONED] >= 1
    assert nans["r0"] == 0
    # vLLM's own count (COMPUTE_NANS) runs inside __call__, after the guard healed the rows.
    assert nans[HEALABLE] == 0
    assert got[POISONED].finish_reason == FinishReason.ERROR
    assert str(got[POISONED].finish_reason) == "error"
    assert got[POISONED].new_token_ids == []  # the token of the uniform row never leaves
    assert got[POISONED].num_nans_in_logits >= 1  # vLLM's stats: a corrupted request
    assert got["r0"].finish_reason is None
    assert got["r0"].new_token_ids != []
    assert got[HEALABLE].finish_reason is None
    assert got[HEALABLE].new_token_ids[0] not in NAN_IDS
    assert POISONED not in v2.scheduler.requests
    assert set(following.scheduled.num_scheduled_tokens) == {"r0", HEALABLE}
    outcome(
        component="V2 GPUModelRunner.sample -> Scheduler.update_from_output",
        dtype="float32",
        mode="greedy" + (", VLLM_COMPUTE_NANS_IN_LOGITS=1" if compute_nans else ""),
        fault=fault,
        unguarded="see test_unguarded_v2_hands_out_the_token_of_an_all_inf_row",
        guarded=f"no token, finish_reason=error, num_nans_in_logits={nans[POISONED]}, "
        "request freed",
    )


def test_unguarded_v2_hands_out_the_token_of_an_all_inf_row(outcome, v2) -> None:  # type: ignore[no-untyped-def]
    """vLLM 0.33.0 V2 as it is: an all -inf row samples a token like any other, and the
    request runs on (an all-NaN row stops the interpreter's argmax, test_sampler.py)."""
    for req_id in REQS:
        v2.add(req_id, PROMPT, temperature=0.0)
    got = v2.step({POISONED: fault_row("all -inf row")}).by_id()
    assert got[POISONED].finish_reason is None
    assert len(got[POISONED].new_token_ids) == 1
    assert POISONED in v2.scheduler.requests
    outcome(
        component="V2 GPUModelRunner.sample -> Scheduler.update_from_output",
        dtype="float32",
        mode="greedy",
        fault="all -inf row (unguarded)",
        unguarded=f"token {got[POISONED].new_token_ids} handed out, request runs on",
        guarded="(test_a_poisoned_request_ends_with_finish_reason_error_under_v2)",
    )


def test_under_async_scheduling_the_poisoned_request_ends_before_its_next_token_leaves(  # type: ignore[no-untyped-def]
    outcome, tmp_path
) -> None:
    """vLLM's AsyncScheduler, stepped as the engine core's batch queue does: step 2 is
    scheduled (the poisoned request still in it) before step 1's output is in."""
    with engine(tmp_path, async_scheduling=True) as v2, hooked():
        assert type(v2.scheduler).__name__ == "AsyncScheduler"
        for req_id in REQS:
            v2.add(req_id, PROMPT, temperature=0.0)
        first = v2.execute(v2.scheduler.schedule(), {POISONED: fault_row("all-NaN row")})
        ahead = v2.scheduler.schedule()
        assert POISONED in ahead.num_scheduled_tokens
        v2.update(first)
        second = v2.update(v2.execute(ahead))
        third = v2.scheduler.schedule()
    got = first.by_id()
    assert str(got[POISONED].finish_reason) == "error"
    assert got[POISONED].new_token_ids == []
    # Its token from the step scheduled ahead is dropped by vLLM: the request is finished.
    assert POISONED not in second.by_id()
    assert [len(second.by_id()[r].new_token_ids) for r in ("r0", HEALABLE)] == [1, 1]
    assert POISONED not in third.num_scheduled_tokens
    outcome(
        component="V2 GPUModelRunner.sample -> AsyncScheduler.update_from_output",
        dtype="float32",
        mode="greedy, async scheduling (next step scheduled ahead)",
        fault="all-NaN row",
        unguarded="(see the sync case)",
        guarded="no token in either step, finish_reason=error, not scheduled again",
    )


def long_prompt(seed: int) -> list[int]:
    """Two full KV blocks and a partial one: prefix caching stores the full ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2 * BLOCK_SIZE + 8,), generator=g).tolist()


def cached_tokens_on_retry(v2: Engine, prompts: dict[str, list[int]]) -> dict[str, int]:
    """Submit each prompt again; the prefix-cache hit the scheduler finds for it."""
    for req_id, prompt in prompts.items():
        v2.add(f"{req_id}-retry", prompt, temperature=0.0)
    scheduled = v2.scheduler.schedule()
    return {
        new.req_id.removesuffix("-retry"): new.num_computed_tokens
        for new in scheduled.scheduled_new_reqs
    }


@pytest.mark.parametrize("evict", [True, False], ids=["hook", "hook-without-eviction"])
def test_a_retry_of_a_poisoned_prompt_recomputes_instead_of_reading_its_kv(  # type: ignore[no-untyped-def]
    outcome, v2, monkeypatch, evict
) -> None:
    """vLLM #55766: retries of a poisoned prompt failed the same way until the prefix cache
    turned over. After the hook ends a request, its blocks are out of vLLM's prefix cache
    (KVCacheManager / BlockPool); a clean request's blocks still serve its retry."""
    from guardrails.integrations import vllm as hook

    if not evict:
        # What vLLM does on its own when it ends a request: free the blocks, hashes kept.
        monkeypatch.setattr(hook._SchedulerHalf, "_evict", staticmethod(lambda *a: None))
    prompts = {"poisoned": long_prompt(1), "clean": long_prompt(2)}
    with hooked():
        v2.add("poisoned", prompts["poisoned"], temperature=0.0)
        v2.add("clean", prompts["clean"], temperature=0.0, max_tokens=1)
        got = v2.step({"poisoned": fault_row("all-NaN row")}).by_id()
        assert str(got["poisoned"].finish_reason) == "error"
        assert str(got["clean"].finish_reason) == "length"  # finished cleanly, blocks freed
        cached = cached_tokens_on_retry(v2, prompts)
    full = 2 * BLOCK_SIZE
    assert cached["clean"] == full
    assert cached["poisoned"] == (0 if evict else full)
    outcome(
        component="Scheduler KVCacheManager/BlockPool (prefix cache)",
        dtype="float32",
        mode="retry of the same prompt" + ("" if evict else " (eviction switched off)"),
        fault="all-NaN row at prefill",
        unguarded=f"(vLLM alone: the request is not ended; with the hook but no eviction the "
        f"retry hits {full} poisoned tokens)",
        guarded=f"retry hits {cached['poisoned']} cached tokens; a clean prompt's retry hits "
        f"{cached['clean']}",
    )


def test_a_failure_of_the_v2_half_leaves_the_step_as_if_unhooked(  # type: ignore[no-untyped-def]
    v2, monkeypatch, caplog
) -> None:
    from guardrails.integrations import vllm as hook

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in guardrails")

    monkeypatch.setattr(hook._RunnerV2Half, "_report", broken)
    for req_id in REQS:
        v2.add(req_id, PROMPT, temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="guardrails"), hooked():
        got = v2.step({POISONED: fault_row("all -inf row")}).by_id()
    assert [got[r].finish_reason for r in REQS] == [None, None, None]
    assert [len(got[r].new_token_ids) for r in REQS] == [1, 1, 1]
    assert "guardrails.hook_error" in caplog.text
    assert "a bug in guardrails" in caplog.text


def test_a_failed_eviction_still_ends_the_poisoned_request(v2, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    from guardrails.integrations import vllm as hook

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kv_cache_manager here")

    monkeypatch.setattr(hook._SchedulerHalf, "_evict", staticmethod(broken))
    for req_id in REQS:
        v2.add(req_id, PROMPT, temperature=0.0)
    with caplog.at_level(logging.WARNING, logger="guardrails"), hooked():
        got = v2.step({POISONED: fault_row("all-NaN row")}).by_id()
    assert str(got[POISONED].finish_reason) == "error"
    assert got[POISONED].new_token_ids == []
    assert "KVCacheManager.evict_blocks" in caplog.text
    assert "no kv_cache_manager here" in caplog.text


@pytest.mark.parametrize("fault", ["all -inf row", "all-NaN row"])
def test_with_vllms_raise_on_nans_only_a_row_that_held_nan_makes_vllm_raise(  # type: ignore[no-untyped-def]
    outcome, tmp_path, monkeypatch, fault
) -> None:
    """VLLM_RAISE_ON_LOGIT_NANS=1 (vLLM's CI mode) raises for any NaN count in V2's report.
    The hook's marks ride those counts: an all -inf row (a grammar over-mask, no NaN in it)
    must not make vLLM raise (issue 21, defect 7); an all-NaN row raises, as vLLM's own check
    would have without guardrails healing the row first."""
    monkeypatch.setenv("VLLM_RAISE_ON_LOGIT_NANS", "1")
    with engine(tmp_path) as v2, hooked() as guards:
        for req_id in REQS:
            v2.add(req_id, PROMPT, temperature=0.0)
        if fault == "all-NaN row":
            with pytest.raises(RuntimeError, match="NaNs detected in logits"):
                v2.step({POISONED: fault_row(fault)})
            observed = "vLLM raised (its CI mode), as for NaN logits"
        else:
            got = v2.step({POISONED: fault_row(fault)}).by_id()
            assert got[POISONED].finish_reason is None  # healed and counted, not ended here
            assert guards.count("sampler.logits", "rows_no_valid_token") == 1
            observed = "no raise: healed and counted (not ended in this mode)"
    outcome(
        component="V2 GPUModelRunner.sample, VLLM_RAISE_ON_LOGIT_NANS=1",
        dtype="float32",
        mode="greedy",
        fault=fault,
        unguarded="(vLLM raises only for NaN it counts)",
        guarded=observed,
    )


class ZeroerStandIn:
    """STAND-IN (test only) for vLLM's KVBlockZeroer (a Triton kernel over the device KV
    cache, which runner.py does not allocate): records the block ids V2 asks it to zero."""

    def __init__(self) -> None:
        self.zeroed: list[list[int]] = []

    def zero_block_ids(self, block_ids: list[int]) -> None:
        self.zeroed.append(list(block_ids))


def poisoned_then_next(v2: Engine) -> tuple[list[int], list[int], object]:
    """A poisoned and a clean long prompt, one poisoned step, then the next step: (the blocks
    the clean request holds, the ids the next step sent to be zeroed, that step)."""
    prompts = {"poisoned": long_prompt(1), "clean": long_prompt(2)}
    for req_id, prompt in prompts.items():
        v2.add(req_id, prompt, temperature=0.0)
    first = v2.step({"poisoned": fault_row("all-NaN row")})
    assert first.scheduled.new_block_ids_to_zero is None  # nothing zeroed on a clean path
    assert str(first.by_id()["poisoned"].finish_reason) == "error"
    held = list(v2.scheduler.kv_cache_manager.get_block_ids("clean")[0])
    scheduled = v2.scheduler.schedule()
    sent = list(scheduled.new_block_ids_to_zero or [])
    return held, sent, v2.update(v2.execute(scheduled))


def test_the_blocks_a_poisoned_request_freed_reach_v2s_kv_block_zeroer(  # type: ignore[no-untyped-def]
    outcome, v2, monkeypatch
) -> None:
    """V2's `update_requests` zeroes the next step's `new_block_ids_to_zero` with its KV
    block zeroer, which vLLM builds only for caches that zero every new block: the hook builds
    it (`_init_kv_zero_meta`, here the stand-in's builder) the first time ids are sent."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    zeroer = ZeroerStandIn()
    monkeypatch.setattr(
        GPUModelRunner, "_init_kv_zero_meta", lambda self: setattr(self, "kv_block_zeroer", zeroer)
    )
    assert v2.runner.kv_block_zeroer is None  # vLLM built none
    with hooked():
        held, sent, _ = poisoned_then_next(v2)
    assert sent, "the poisoned request's blocks were not sent to be zeroed"
    assert not set(sent) & set(held)  # never a running request's block
    assert zeroer.zeroed == [sent]  # zeroed by V2's own update_requests, once
    outcome(
        component="V2 Scheduler.schedule -> GPUModelRunner.update_requests (KV zeroing)",
        dtype="float32",
        mode="prefix caching",
        fault="all-NaN row at prefill",
        unguarded="(vLLM alone: freed blocks are reused as they are; V2 builds no zeroer)",
        guarded=f"the next step zeroes blocks {sent} with the zeroer the hook built",
    )


def test_where_v2s_zeroer_cannot_be_built_the_step_runs_and_the_failure_is_logged(  # type: ignore[no-untyped-def]
    v2, caplog
) -> None:
    # vLLM's own _init_kv_zero_meta, on a runner without a KV cache: it fails; V2 would
    # assert on the ids it was sent, so they are dropped from the step and the step runs.
    with hooked():
        _, sent, following = poisoned_then_next(v2)
    assert sent
    assert following.scheduled.new_block_ids_to_zero is None
    assert str(following.by_id()["clean"].finish_reason) != "error"
    assert "guardrails.hook_error" in caplog.text
    assert "GPUModelRunner.update_requests" in caplog.text
