"""vLLM hook `vllm.end_poisoned_requests`: end a request whose logits could not be healed with
finish_reason="error", through the path vLLM already has for NaN logits.

    hooks = ["vllm.end_poisoned_requests"]       # config file, top level
    [sites."sampler.logits"]
    abort_on = ["no_valid_token"]

A row with no valid token (all NaN, or all -inf) is healed to uniform logits and sampling
from it gives a token that means nothing. vLLM's model runner already reports NaN logits to
its scheduler per request (`ModelRunnerOutput.num_nans_in_logits`, req id -> count; vLLM
fills it only under VLLM_COMPUTE_NANS_IN_LOGITS, and its own count sees the logits after the
guard healed them in place). This hook has two halves, one per process, joined by that field:

- worker (`GPUModelRunner._bookkeeping_sync`): the rows of this step's `sampler.logits` call
  whose flags intersect that site's `abort_on` are reported there with a count of at least 1.
- scheduler (`Scheduler.update_from_output`): a request reported with NaNs loses the token
  sampled from its healed row and ends as FINISHED_ERROR; its output carries finish_reason
  ERROR and the count, which vLLM's own stats mark as a corrupted request.

No host sync is added. Under async scheduling the marks ride vLLM's own device NaN counts
(`num_nans`), which vLLM copies to the host on its output copy stream and reads after that
copy's event. Under sync scheduling the marks are copied (non-blocking, pinned on CUDA) before
the bookkeeping call, whose `_to_list` waits for an event recorded after them on the same
stream; they are read once it returns. The marks are a new tensor made from the flags before
the next step can reuse the flags buffer. Nothing here imports vLLM: both halves wait for
their module's import (wrapt post-import hooks). Any exception of ours is logged once and the
engine's call goes on as if unhooked.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Final

import torch

from guardrails.integrations._hooks import MethodHook, OnceLog

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["end_poisoned_requests"]

SITE: Final = "sampler.logits"
HOOK: Final = "vllm.end_poisoned_requests"
RUNNER_MODULE: Final = "vllm.v1.worker.gpu_model_runner"
RUNNER_TARGET: Final = "GPUModelRunner._bookkeeping_sync"
SCHEDULER_MODULE: Final = "vllm.v1.core.sched.scheduler"
SCHEDULER_TARGET: Final = "Scheduler.update_from_output"
# _bookkeeping_sync returns (num_nans_in_logits, num_nans, ..., req_id_to_index, ...).
_NANS_DICT, _NANS_DEVICE, _REQ_ID_TO_INDEX = 0, 1, 6


def end_poisoned_requests(guards: Guardrails) -> list[MethodHook]:
    """Install both halves (each when its vLLM module is imported); returns their handles."""
    return [
        MethodHook(guards, HOOK, RUNNER_MODULE, RUNNER_TARGET, _RunnerHalf(guards)),
        MethodHook(guards, HOOK, SCHEDULER_MODULE, SCHEDULER_TARGET, _SchedulerHalf()),
    ]


class _RunnerHalf:
    """Worker side: report this step's abort rows in the model runner's NaN counts."""

    def __init__(self, guards: Guardrails) -> None:
        self._guards = guards
        self._failed = OnceLog(HOOK, RUNNER_TARGET)
        self._local = threading.local()  # per model-runner thread: calls seen, host mirror

    def __call__(self, wrapped: Any, runner: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            marks, mirror = self._marks(runner)
        except Exception as exc:
            self._failed(exc)
            marks = mirror = None
        result = wrapped(*args, **kwargs)
        if marks is None:
            return result
        try:
            return self._report(runner, result, marks, mirror)
        except Exception as exc:
            self._failed(exc)
            return result

    def _marks(self, runner: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        site = self._guards.site(SITE)
        mask = self._guards.settings.site_settings(SITE).abort_flags
        local = self._local
        found = site.recent() if site.enabled and mask else None
        if found is None or found[0] == getattr(local, "seen", -1):
            return None, None  # no sampler call since the last step (pooling, a dummy run)
        local.seen, flags = found
        # A new tensor, enqueued now: the flags buffer is rewritten by the next step's sampler
        # (async scheduling runs it before this step's output is read).
        marks = flags.bitwise_and(mask).ne(0)
        if getattr(runner, "use_async_scheduling", False):
            return marks, None
        mirror = self._mirror(marks)
        mirror.copy_(marks, non_blocking=True)
        return marks, mirror

    def _mirror(self, marks: torch.Tensor) -> torch.Tensor:
        rows = marks.shape[0]
        mirror: torch.Tensor | None = getattr(self._local, "mirror", None)
        if mirror is None or mirror.shape[0] < rows:
            # Pinned so the copy is asynchronous; pin_memory raises where no accelerator is
            # present, and a CPU tensor needs no staging at all.
            pin = marks.device.type != "cpu"
            mirror = torch.zeros(max(rows, 256), dtype=torch.bool, pin_memory=pin)
            self._local.mirror = mirror
        return mirror[:rows]

    def _report(
        self, runner: Any, result: Any, marks: torch.Tensor, mirror: torch.Tensor | None
    ) -> Any:
        if mirror is None:
            # Async scheduling: fold into vLLM's device counts, copied with the sampled ids.
            nans = result[_NANS_DEVICE]
            if nans is not None and nans.shape != marks.shape:
                raise ValueError(
                    f"{nans.shape[0]} NaN-count rows for {marks.shape[0]} sampler rows"
                )
            ones = marks.to(torch.int32)
            merged = ones if nans is None else torch.maximum(nans, ones)
            return (*result[:_NANS_DEVICE], merged, *result[_NANS_DEVICE + 1 :])
        # Sync scheduling: the wrapped call waited for the copy (see the module docstring).
        rows = mirror.tolist()
        if not any(rows):
            return result
        counts = dict(result[_NANS_DICT] or {})
        for req_id, index in result[_REQ_ID_TO_INDEX].items():
            if index < len(rows) and rows[index]:
                counts[req_id] = max(counts.get(req_id, 0), 1)
        return (counts, *result[1:])


class _SchedulerHalf:
    """Scheduler side: end each request the model runner reported NaNs for, with an error."""

    def __init__(self) -> None:
        self._failed = OnceLog(HOOK, SCHEDULER_TARGET)

    def __call__(self, wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            # Before anything is changed: what _finish needs must be there once a token is
            # stripped, or that request would run on without it.
            self._engine_types()
            poisoned = self._strip(*args, **kwargs)
        except Exception as exc:
            self._failed(exc)
            poisoned = {}
        outputs = wrapped(*args, **kwargs)
        if not poisoned:
            return outputs
        try:
            self._finish(scheduler, outputs, poisoned)
        except Exception as exc:
            self._failed(exc)
        return outputs

    @staticmethod
    def _strip(scheduler_output: Any, model_runner_output: Any) -> dict[str, int]:
        counts = model_runner_output.num_nans_in_logits
        if not counts:
            return {}
        poisoned = {req_id: n for req_id, n in counts.items() if n > 0}
        if poisoned:
            # The token sampled from a healed row means nothing: never hand it to the client.
            index = model_runner_output.req_id_to_index
            sampled = list(model_runner_output.sampled_token_ids)
            for req_id in poisoned:
                i = index.get(req_id)
                if i is not None and i < len(sampled):
                    sampled[i] = []
            model_runner_output.sampled_token_ids = sampled
        return poisoned

    @staticmethod
    def _engine_types() -> tuple[Any, Any, Any]:
        # Late: this runs inside the engine, after vLLM is imported.
        # vLLM is not installed where guardrails is type-checked.
        from vllm.v1.engine import (  # type: ignore[import-not-found, unused-ignore]
            EngineCoreOutput,
            EngineCoreOutputs,
        )
        from vllm.v1.request import RequestStatus  # type: ignore[import-not-found, unused-ignore]

        return EngineCoreOutput, EngineCoreOutputs, RequestStatus

    def _finish(self, scheduler: Any, outputs: dict[int, Any], poisoned: dict[str, int]) -> None:
        EngineCoreOutput, EngineCoreOutputs, RequestStatus = self._engine_types()

        for request in scheduler.finish_requests(poisoned, RequestStatus.FINISHED_ERROR):
            request.num_nans_in_logits = max(
                request.num_nans_in_logits, poisoned[request.request_id]
            )
            out = outputs.get(request.client_index)
            if out is None:
                out = outputs[request.client_index] = EngineCoreOutputs()
            out.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                    num_nans_in_logits=request.num_nans_in_logits,
                )
            )
