"""`vllm.end_poisoned_requests` zeroes the KV blocks a poisoned request's end freed, through
vLLM 0.33.0's own machinery: the next `Scheduler.schedule()` carries them in
`SchedulerOutput.new_block_ids_to_zero`, which every worker zeroes before that step's forward
pass. vLLM fills that list only where every new block needs zeroing (Mamba, mixed precision):
here, as on a plain attention model, it is empty until a request is poisoned.

What runs is vLLM's: Scheduler.schedule/update_from_output/finish_requests, its
KVCacheManager, BlockPool and prefix cache, the block hasher its EngineCore gives every
request. The model runner's bookkeeping is the labelled stand-in of test_poisoned_requests.
The worker side (the V1 GPU runner builds its zeroer when first sent blocks) runs vLLM's own
runner method.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from . import faults
from .faults import BLOCK_SIZE
from .test_poisoned_requests import (
    bookkeeping,
    bookkeeping_stand_in,
    hooked,
    runner_output,
    sampled_step,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REQS = ["r0", "r1", "r2"]  # the stand-in's rows; r1's is all NaN
SHARED = list(range(10, 10 + BLOCK_SIZE))  # one full block, cached by r0, hit by r1


@pytest.fixture
def scheduler(tmp_path):  # type: ignore[no-untyped-def]
    """vLLM's Scheduler with prefix caching; r1 shares r0's first (full) block."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    config = faults.vllm_config(tmp_path)
    sched = faults.scheduler(config)
    hasher = faults.block_hasher(config)
    prompts = {"r0": [*SHARED, 3, 4], "r1": [*SHARED, 5, 6, 7], "r2": [40, 41, 42]}
    for req_id in REQS:
        request = Request(
            req_id, prompts[req_id], SamplingParams(max_tokens=8), None, block_hasher=hasher
        )
        sched.add_request(request)
    return sched


def blocks_of(scheduler, req_id):  # type: ignore[no-untyped-def]
    return [i for group in scheduler.kv_cache_manager.get_block_ids(req_id) for i in group]


def poisoned_step(scheduler, runner_cls):  # type: ignore[no-untyped-def]
    """One scheduled step whose r1 row is all NaN, through the hooked update_from_output."""
    step = scheduler.schedule()
    held = {req_id: blocks_of(scheduler, req_id) for req_id in REQS}
    sampler_output = SimpleNamespace(sampled_token_ids=sampled_step()[0])
    runner = SimpleNamespace(use_async_scheduling=False)
    result = bookkeeping(runner_cls, runner)(step, sampler_output, None, None, 3)
    scheduler.update_from_output(step, runner_output(result, async_scheduling=False))
    return step, held


def test_the_blocks_a_poisoned_request_freed_are_zeroed_with_the_next_step(  # type: ignore[no-untyped-def]
    outcome, scheduler, monkeypatch
) -> None:
    with bookkeeping_stand_in(monkeypatch, None) as runner_cls, hooked():
        step, held = poisoned_step(scheduler, runner_cls)
        assert step.new_block_ids_to_zero is None  # clean until then: nothing zeroed
        shared = held["r0"][0]
        assert held["r1"][0] == shared  # r1's first block is r0's (a prefix-cache hit)
        assert "r1" not in scheduler.requests
        following = scheduler.schedule()
        after = scheduler.schedule()
    # r1's own block, not the one r0 still reads; once only.
    assert following.new_block_ids_to_zero == held["r1"][1:] != []
    assert shared not in following.new_block_ids_to_zero
    assert after.new_block_ids_to_zero is None
    outcome(
        component="Scheduler.update_from_output + Scheduler.schedule (KV zeroing)",
        dtype="float32",
        mode="prefix caching, one block shared with a running request",
        fault="all-NaN row at prefill",
        unguarded="(vLLM alone: the request runs on; freed, its blocks are reused as they are)",
        guarded=f"next step's new_block_ids_to_zero = {following.new_block_ids_to_zero} (its "
        f"own blocks); the block shared with r0 is kept",
    )


def test_without_a_poisoned_request_no_block_is_zeroed(scheduler, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.request import RequestStatus

    with bookkeeping_stand_in(monkeypatch, None), hooked():
        first = scheduler.schedule()
        scheduler.finish_requests(REQS, RequestStatus.FINISHED_ABORTED)
        second = scheduler.schedule()
    assert (first.new_block_ids_to_zero, second.new_block_ids_to_zero) == (None, None)


def test_the_v1_gpu_runner_builds_its_zeroer_when_first_sent_blocks(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """vLLM builds the GPU runners' zeroer only when every new block needs zeroing; the hook's
    V1 half (`GPUModelRunner._zero_block_ids`) builds it the first time a step sends block ids,
    and once. vLLM's runner class, not initialised (`object.__new__`: no device here); its
    `_init_kv_zero_meta` and the zeroer it builds are labelled stand-ins (they need a device
    KV cache)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    zeroed: list[list[int]] = []

    class ZeroerStandIn:  # STAND-IN (test only) for vLLM's KVBlockZeroer
        def zero_block_ids(self, block_ids: list[int]) -> None:
            zeroed.append(block_ids)

    built = []

    def init_kv_zero_meta(self) -> None:  # type: ignore[no-untyped-def]
        built.append(self)
        self._kv_block_zeroer = ZeroerStandIn()

    monkeypatch.setattr(GPUModelRunner, "_init_kv_zero_meta", init_kv_zero_meta)
    runner = object.__new__(GPUModelRunner)
    runner._zero_block_ids([3, 5])
    assert (built, zeroed) == ([], [])  # unhooked: vLLM's own method does nothing
    with hooked():
        runner._zero_block_ids([3, 5])
        runner._zero_block_ids([7])
    assert (built, zeroed) == ([runner], [[3, 5], [7]])
