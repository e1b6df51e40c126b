"""vLLM hook `vllm.end_poisoned_requests`: end a request whose logits could not be healed with
finish_reason="error", through the path vLLM already has for NaN logits, and keep its KV out
of the prefix cache.

    hooks = ["vllm.end_poisoned_requests"]       # config file, top level
    [sites."sampler.logits"]
    abort_on = ["no_valid_token"]

Contract: a request with a row of `sampler.logits` (or, under speculative decoding,
`eagle.verify`) whose flags intersect that site's `abort_on` ends as FINISHED_ERROR with
finish_reason ERROR and the count in its output; the tokens sampled from its healed rows are
dropped; its KV blocks leave the prefix cache and are zeroed (through vLLM's own
`new_block_ids_to_zero`) before any request can read them; clean requests' blocks are never
zeroed. Each end is counted and named by its engine request id
(`guardrails.reporting.request_aborts`). The halves are joined by vLLM's own
`num_nans_in_logits`; one runner half runs per worker (Model Runner V2, the V1 runner or the
standalone CPU runner, each for the vLLM versions its `when` names), and each declares what it
reads of vLLM (`guardrails.attach.expects`; a half whose vLLM lacks one is not applied).
How each half does it, step by step: docs/integrating.md, "How the vLLM hook works".

No host sync is added: the marks are new device tensors made from the flags before the next
step can reuse the flags buffer, and they reach the host with copies vLLM already waits for.
Nothing here imports vLLM: each half waits for its module's import (wrapt post-import hooks).
Any exception of ours is logged once and the engine's call goes on as if unhooked.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Final

import torch

from guardrails.attach.expects import Expect, calls, reads
from guardrails.flags import RowFlag
from guardrails.integrations._hooks import MethodHook, PartFailures, request_aborts

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["end_poisoned_requests"]

SITE: Final = "sampler.logits"
VERIFY_SITE: Final = "eagle.verify"
HOOK: Final = "vllm.end_poisoned_requests"
RUNNER_MODULE: Final = "vllm.v1.worker.gpu_model_runner"
RUNNER_TARGET: Final = "GPUModelRunner._bookkeeping_sync"
RUNNER_V2_MODULE: Final = "vllm.v1.worker.gpu.model_runner"
RUNNER_V2_TARGET: Final = "GPUModelRunner.sample"
# vLLM >= 0.34 on CPUs without Triton (non-x86): Model Runner V2's standalone CPU runner.
RUNNER_CPU_MODULE: Final = "vllm.v1.worker.cpu.standalone_model_runner"
RUNNER_CPU_TARGET: Final = "StandaloneCPUModelRunner.sample"
ZERO_CPU_TARGET: Final = "StandaloneCPUModelRunner.update_requests"
# vLLM 0.34.0 removed the V1 model runner and its sampler modules.
V1: Final = "vllm<0.34"
V2: Final = "vllm>=0.32"
VERIFY_MODULE: Final = "vllm.v1.sample.rejection_sampler"
VERIFY_TARGET: Final = "RejectionSampler.forward"
SCHEDULER_MODULE: Final = "vllm.v1.core.sched.scheduler"
SCHEDULER_TARGET: Final = "Scheduler.update_from_output"
SCHEDULE_TARGET: Final = "Scheduler.schedule"
ZERO_TARGET: Final = "GPUModelRunner._zero_block_ids"
ZERO_V2_TARGET: Final = "GPUModelRunner.update_requests"
# _bookkeeping_sync returns (num_nans_in_logits, num_nans, ..., req_id_to_index, ...).
_NANS_DICT, _NANS_DEVICE, _REQ_ID_TO_INDEX = 0, 1, 6
_NAN: Final = int(RowFlag.NAN)


def end_poisoned_requests(guards: Guardrails) -> list[MethodHook]:
    """Build every half (each wraps its method when its vLLM module is imported); returns
    their handles. Nothing is wrapped when `sampler.logits` is disabled or its `abort_on` is
    empty: decided here, once.

    The runner halves run in the worker process at every sampling step, where the vLLM
    profile's heartbeat (the model's `LogitsProcessor.forward`) runs: the liveness self-check
    watches them, as alternatives (a worker builds one runner; both modules may be imported).
    The scheduler half runs in the engine-core process, which holds the worker only under the
    single-process executor: it is not watched (a worker of the multiprocess executor beats
    and never schedules)."""
    enabled = guards.is_enabled(SITE) and bool(guards.settings.site_settings(SITE).abort_flags)
    raises = _vllm_raises_on_nans()  # read once: the engine's environment is set at start-up
    verify = _SpecMarks()
    freed = _FreedBlocks()

    def part(module: str, target: str, half: Any, on: bool = True, **options: Any) -> MethodHook:
        return MethodHook(guards, HOOK, module, target, half, enabled and on, **options)

    return [
        part(
            RUNNER_V2_MODULE,
            RUNNER_V2_TARGET,
            _RunnerV2Half(guards, RUNNER_V2_TARGET, raises),
            expect_calls=True,
            when=V2,
            reads=_runner_v2_reads(RUNNER_V2_MODULE, RUNNER_V2_TARGET, _V2_TYPES),
        ),
        part(
            RUNNER_CPU_MODULE,
            RUNNER_CPU_TARGET,
            _RunnerV2Half(guards, RUNNER_CPU_TARGET, raises),
            expect_calls=True,
            when="vllm>=0.34",
            reads=_runner_v2_reads(RUNNER_CPU_MODULE, RUNNER_CPU_TARGET, _CPU_TYPES),
        ),
        part(
            RUNNER_MODULE,
            RUNNER_TARGET,
            _RunnerHalf(guards, verify, raises),
            expect_calls=True,
            when=V1,
            reads=[calls(f"{RUNNER_MODULE}:{RUNNER_TARGET}")],
        ),
        # Not watched: only speculative steps call it.
        part(
            VERIFY_MODULE,
            VERIFY_TARGET,
            _VerifyHalf(guards, verify),
            _verify_aborts(guards),
            when=V1,
            reads=[
                calls(f"{VERIFY_MODULE}:{VERIFY_TARGET}", "metadata"),
                reads("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "bonus_logits_indices"),
            ],
        ),
        part(SCHEDULER_MODULE, SCHEDULER_TARGET, _SchedulerHalf(guards, freed), reads=_SCHEDULER),
        # Not watched: schedule runs in the engine core; the zeroer halves act only on a step
        # that zeroes a poisoned request's blocks.
        part(
            SCHEDULER_MODULE,
            SCHEDULE_TARGET,
            _ScheduleHalf(guards, freed),
            reads=[reads("vllm.v1.core.sched.output:SchedulerOutput", "new_block_ids_to_zero")],
        ),
        part(
            RUNNER_MODULE,
            ZERO_TARGET,
            _ZeroerHalf(guards, ZERO_TARGET, v2=False),
            when=V1,
            reads=[reads(f"{RUNNER_MODULE}:GPUModelRunner", "_init_kv_zero_meta")],
        ),
        part(
            RUNNER_V2_MODULE,
            ZERO_V2_TARGET,
            _ZeroerHalf(guards, ZERO_V2_TARGET, v2=True),
            when=V2,
            reads=_zeroer_v2_reads(RUNNER_V2_MODULE, ZERO_V2_TARGET),
        ),
        part(
            RUNNER_CPU_MODULE,
            ZERO_CPU_TARGET,
            _ZeroerHalf(guards, ZERO_CPU_TARGET, v2=True),
            when="vllm>=0.34",
            reads=_zeroer_v2_reads(RUNNER_CPU_MODULE, ZERO_CPU_TARGET),
        ),
    ]


# -- what the halves read from vLLM (checked by `guardrails check` and before applying) ----

# Model Runner V2's batch and sampler output types: GPU runner, standalone CPU runner.
_V2_TYPES: Final = (
    "vllm.v1.worker.gpu.input_batch:InputBatch",
    "vllm.v1.worker.gpu.sample.output:SamplerOutput",
)
_CPU_TYPES: Final = (
    "vllm.v1.worker.cpu.input_batch:InputBatch",
    "vllm.v1.worker.cpu.sampler:SamplerOutput",
)


def _runner_v2_reads(module: str, target: str, types: tuple[str, str]) -> list[Expect]:
    batch, output = types
    return [
        calls(f"{module}:{target}", "hidden_states", "input_batch"),
        reads(batch, "num_reqs", "cu_num_logits"),
        reads(output, "num_nans"),
    ]


def _zeroer_v2_reads(module: str, target: str) -> list[Expect]:
    owner = target.partition(".")[0]
    return [
        calls(f"{module}:{target}", "scheduler_output"),
        reads(f"{module}:{owner}", "kv_block_zeroer", "_init_kv_zero_meta"),
        reads("vllm.v1.core.sched.output:SchedulerOutput", "new_block_ids_to_zero"),
    ]


# The scheduler half: the runner's output, the scheduler's requests and KV cache, and what
# it builds to end a request the way vLLM's own update_from_output does.
_SCHEDULER: Final = (
    calls(f"{SCHEDULER_MODULE}:{SCHEDULER_TARGET}", "scheduler_output", "model_runner_output"),
    calls(f"{SCHEDULER_MODULE}:Scheduler.finish_requests", "request_ids", "finished_status"),
    reads(f"{SCHEDULER_MODULE}:Scheduler", "requests", "kv_cache_manager"),
    reads(
        "vllm.v1.outputs:ModelRunnerOutput", "req_ids", "sampled_token_ids", "num_nans_in_logits"
    ),
    reads(
        "vllm.v1.core.kv_cache_manager:KVCacheManager",
        "evict_blocks",
        "get_block_ids",
        "block_pool",
    ),
    reads("vllm.v1.core.block_pool:BlockPool", "blocks"),
    reads("vllm.v1.core.kv_cache_utils:KVCacheBlock", "ref_cnt", "is_null"),
    reads(
        "vllm.v1.request:Request",
        "request_id",
        "client_index",
        "num_nans_in_logits",
        "trace_headers",
        "get_finished_reason",
        "take_events",
    ),
    reads("vllm.v1.request:RequestStatus", "FINISHED_ERROR"),
    reads(
        "vllm.v1.engine:EngineCoreOutput",
        "request_id",
        "new_token_ids",
        "finish_reason",
        "events",
        "trace_headers",
        "num_nans_in_logits",
    ),
    reads("vllm.v1.engine:EngineCoreOutputs", "outputs"),
)


def _verify_aborts(guards: Guardrails) -> bool:
    return guards.is_enabled(VERIFY_SITE) and bool(
        guards.settings.site_settings(VERIFY_SITE).abort_flags
    )


def _abort_marks(
    guards: Guardrails,
    flags: torch.Tensor,
    *,
    nan_rows_only: bool = False,
    site: str = SITE,
) -> torch.Tensor:
    """Rows whose flags intersect the site's abort_on, as a new bool tensor (enqueued now:
    the flags buffer is rewritten by the site's next call).

    `nan_rows_only`: the marks go into device NaN counts that vLLM itself checks, and raises
    for, under VLLM_RAISE_ON_LOGIT_NANS=1 (V2, and V1 under async scheduling). There only rows
    that held NaN are marked, so vLLM raises where its own check would have found
    NaN had guardrails not healed it first, never for a row that was all -inf (a grammar
    over-mask holds no NaN): in that mode such a row is healed and counted, not ended."""
    marks = flags.bitwise_and(guards.settings.site_settings(site).abort_flags).ne(0)
    if nan_rows_only:
        marks.logical_and_(flags.bitwise_and(_NAN).ne(0))
    return marks


def _vllm_raises_on_nans() -> bool:
    # Read as vllm.envs reads it (bool(int(...))), without importing vLLM; the engine's own
    # start-up fails on a malformed value before any step runs.
    try:
        return bool(int(os.environ.get("VLLM_RAISE_ON_LOGIT_NANS", "0")))
    except ValueError:
        return False


class _RunnerV2Half:
    """Model Runner V2 worker side: fold this step's abort rows into the sampler output's
    per-request NaN counts, which V2 carries to the scheduler itself."""

    def __init__(
        self, guards: Guardrails, target: str = RUNNER_V2_TARGET, raises_on_nans: bool = False
    ) -> None:
        self._guards = guards
        # V2 hands its NaN counts to vLLM's own check: under VLLM_RAISE_ON_LOGIT_NANS only
        # the rows that held NaN are marked (see _abort_marks).
        self._nan_rows_only = raises_on_nans
        self._failed = PartFailures(HOOK, target, guards)

    def __call__(self, wrapped: Any, runner: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            before = self._latest_call()
        except Exception as exc:
            self._failed(exc)
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        try:
            self._report(runner, result, before, *args, **kwargs)
        except Exception as exc:
            self._failed(exc)
        return result

    def _latest_call(self) -> int | None:
        """The site's latest call number on this thread; None where nothing can be ended."""
        site = self._guards.site(SITE)
        if not site.enabled or not self._guards.settings.site_settings(SITE).abort_flags:
            return None
        found = site.recent()
        return -1 if found is None else found[0]

    def _report(
        self,
        runner: Any,
        result: Any,
        before: int | None,
        hidden_states: Any,
        input_batch: Any,
        *rest: Any,
        **kwargs: Any,
    ) -> None:
        if before is None:
            return
        found = self._guards.site(SITE).recent()
        if found is None or found[0] == before:
            return  # the guard did not run inside this call (a batch with no requests)
        if getattr(runner, "batch_sharder", None) is not None:
            # Each rank samples a shard of the batch and the gathered output keeps NaN counts
            # only under VLLM_COMPUTE_NANS_IN_LOGITS: these rows cannot be placed.
            raise ValueError(
                "batch-sharded sampling (enable_batch_sharded_sampling) is not supported: "
                "poisoned requests are healed and counted, not ended"
            )
        marks = _abort_marks(self._guards, found[1], nan_rows_only=self._nan_rows_only)
        marks = marks.to(torch.int32)
        output = result[0]
        num_reqs = int(input_batch.num_reqs)
        nans = output.num_nans
        if marks.shape[0] != num_reqs:
            # A speculative step: one row per draft target and bonus token of each request.
            owner = self._row_owner(input_batch, marks)
            marks = torch.zeros(num_reqs, dtype=torch.int32, device=marks.device).scatter_reduce_(
                0, owner, marks, "amax"
            )
            if nans is not None and nans.shape[0] == owner.shape[0]:
                # vLLM's own counts are per row there too; its get_output pairs them with
                # request ids one to one, so they are summed per request.
                nans = torch.zeros_like(marks).index_add_(0, owner, nans.to(torch.int32))
        if nans is not None and nans.shape[0] != num_reqs:
            raise ValueError(f"{nans.shape[0]} NaN-count rows for {num_reqs} requests")
        output.num_nans = marks if nans is None else torch.maximum(nans.to(torch.int32), marks)

    @staticmethod
    def _row_owner(input_batch: Any, marks: torch.Tensor) -> torch.Tensor:
        """The batch index of each logits row, from the device `cu_num_logits` (adaptive
        verification keeps its true request bounds only there); no host read."""
        cu = input_batch.cu_num_logits.to(device=marks.device, dtype=torch.int64)
        rows = torch.arange(marks.shape[0], device=marks.device, dtype=torch.int64)
        return torch.searchsorted(cu[1:], rows, right=True)


class _SpecMarks(threading.local):
    """Per model-runner thread: the latest speculative step's per-request abort marks, left
    by the verify half for the runner half of the same step (same thread, same stream):
    every abort row, and those whose rows held NaN (what vLLM's own check would see)."""

    def __init__(self) -> None:
        self.marks: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self, *, nan_rows_only: bool) -> torch.Tensor | None:
        marks, self.marks = self.marks, None
        if marks is None:
            return None
        return marks[1] if nan_rows_only else marks[0]


class _VerifyHalf:
    """V1 `RejectionSampler.forward`: this speculative step's `eagle.verify` abort rows (the
    target model's logits: each request's draft positions, then its bonus row), one mark per
    request, for the runner half to report with the step's own."""

    def __init__(self, guards: Guardrails, spec: _SpecMarks) -> None:
        self._guards = guards
        self._spec = spec
        self._failed = PartFailures(HOOK, VERIFY_TARGET, guards)

    def __call__(self, wrapped: Any, sampler: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            found = self._guards.site(VERIFY_SITE).recent()
            before = -1 if found is None else found[0]
        except Exception as exc:
            self._failed(exc)
            return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        try:
            self._mark(before, *args, **kwargs)
        except Exception as exc:
            self._failed(exc)
        return result

    def _mark(self, before: int, metadata: Any, *rest: Any, **kwargs: Any) -> None:
        found = self._guards.site(VERIFY_SITE).recent()
        if found is None or found[0] == before:
            return  # the guard did not run inside this call
        flags = found[1]
        abort = _abort_marks(self._guards, flags, site=VERIFY_SITE)
        # Request i's rows end at its bonus row: the owner of row r is the first request
        # whose bonus index is >= r. On the device, no host read.
        bonus = metadata.bonus_logits_indices.to(device=flags.device, dtype=torch.int64)
        rows = torch.arange(flags.shape[0], device=flags.device, dtype=torch.int64)
        owner = torch.searchsorted(bonus, rows).clamp_(max=bonus.shape[0] - 1)
        both = torch.stack([abort, abort.logical_and(flags.bitwise_and(_NAN).ne(0))])
        per_request = torch.zeros(2, bonus.shape[0], dtype=torch.int32, device=flags.device)
        per_request.scatter_reduce_(1, owner.expand(2, -1), both.to(torch.int32), "amax")
        self._spec.marks = (per_request[0].bool(), per_request[1].bool())


class _RunnerHalf:
    """V1 model runner worker side: report this step's abort rows in its NaN counts."""

    def __init__(
        self, guards: Guardrails, spec: _SpecMarks | None = None, raises_on_nans: bool = False
    ) -> None:
        self._guards = guards
        self._raises_on_nans = raises_on_nans
        self._spec = spec or _SpecMarks()
        self._failed = PartFailures(HOOK, RUNNER_TARGET, guards)
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

    def _marks(self, runner: Any) -> tuple[torch.Tensor | None, torch.Tensor | list[bool] | None]:
        site = self._guards.site(SITE)
        mask = self._guards.settings.site_settings(SITE).abort_flags
        local = self._local
        found = site.recent() if site.enabled and mask else None
        # Async scheduling runs the next step's sampler before this step's output is read.
        checked = bool(getattr(runner, "use_async_scheduling", False))
        nan_rows_only = checked and self._raises_on_nans
        verified = self._spec.take(nan_rows_only=nan_rows_only)  # a speculative step's
        if found is None or found[0] == getattr(local, "seen", -1):
            return None, None  # no sampler call since the last step (pooling, a dummy run)
        local.seen, flags = found
        if flags.is_cpu and not checked and verified is None:
            # On the CPU the flags are final once the sampler returned: one read on the host,
            # no marks tensor, no mirror, no copy (a few small ops at every step).
            values = flags.tolist()
            if not any(values):
                return None, None  # a clean step: no row is flagged at all
            rows = [bool(flag & mask) for flag in values]
            return (flags, rows) if any(rows) else (None, None)
        marks = _abort_marks(self._guards, flags, nan_rows_only=nan_rows_only)
        marks = self._with_verified(marks, verified)
        if checked:
            return marks, None
        mirror = self._mirror(marks)
        mirror.copy_(marks, non_blocking=True)
        return marks, mirror

    @staticmethod
    def _with_verified(marks: torch.Tensor, verified: torch.Tensor | None) -> torch.Tensor:
        """The sampler's (bonus) rows' marks or'd with the same requests' verify marks."""
        if verified is None:
            return marks
        if verified.shape != marks.shape:
            raise ValueError(
                f"{verified.shape[0]} speculative requests for {marks.shape[0]} sampler rows"
            )
        return marks.logical_or(verified)

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
        self,
        runner: Any,
        result: Any,
        marks: torch.Tensor,
        mirror: torch.Tensor | list[bool] | None,
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
        # Sync scheduling: the wrapped call waited for the copy (see the module docstring);
        # on the CPU the rows were read before it.
        rows = mirror if isinstance(mirror, list) else mirror.tolist()
        if not any(rows):
            return result
        counts = dict(result[_NANS_DICT] or {})
        for req_id, index in result[_REQ_ID_TO_INDEX].items():
            if index < len(rows) and rows[index]:
                counts[req_id] = max(counts.get(req_id, 0), 1)
        return (counts, *result[1:])


class _FreedBlocks:
    """Per scheduler (engine core): the KV blocks freed by ended poisoned requests, until the
    next scheduled step takes them to the workers to be zeroed."""

    def __init__(self) -> None:
        self._pending: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()

    def add(self, scheduler: Any, block_ids: list[int]) -> None:
        if block_ids:
            self._pending.setdefault(scheduler, []).extend(block_ids)

    def take(self, scheduler: Any) -> list[int]:
        if not self._pending:  # every step: no weak reference made for the look-up
            return []
        return self._pending.pop(scheduler, None) or []


class _SchedulerHalf:
    """Scheduler side: end each request the model runner reported NaNs for, with an error."""

    def __init__(self, guards: Guardrails | None = None, freed: _FreedBlocks | None = None) -> None:
        self._failed = PartFailures(HOOK, SCHEDULER_TARGET, guards)
        self._evict_failed = PartFailures(HOOK, "KVCacheManager.evict_blocks", guards)
        self._zero_failed = PartFailures(HOOK, "new_block_ids_to_zero", guards)
        self._freed = freed or _FreedBlocks()
        self._aborts = request_aborts(guards)

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
            # The output's rows follow its req_ids (vLLM < 0.34 also kept req_id_to_index).
            index = {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}
            sampled = list(model_runner_output.sampled_token_ids)
            for req_id in poisoned:
                i = index.get(req_id)
                if i is not None and i < len(sampled):
                    sampled[i] = []
            model_runner_output.sampled_token_ids = sampled
        return poisoned

    @staticmethod
    @functools.cache
    def _engine_types() -> tuple[Any, Any, Any]:
        # Late: this runs inside the engine, after vLLM is imported. Once: an import statement
        # costs about 10 us even for a loaded module, and this runs at every step.
        # vLLM is not installed where guardrails is type-checked.
        from vllm.v1.engine import (  # type: ignore[import-not-found, unused-ignore]
            EngineCoreOutput,
            EngineCoreOutputs,
        )
        from vllm.v1.request import RequestStatus  # type: ignore[import-not-found, unused-ignore]

        return EngineCoreOutput, EngineCoreOutputs, RequestStatus

    def _finish(self, scheduler: Any, outputs: dict[int, Any], poisoned: dict[str, int]) -> None:
        EngineCoreOutput, EngineCoreOutputs, RequestStatus = self._engine_types()

        # Before the blocks are freed: freed, they keep their hashes and serve the next
        # request with the same prefix (vLLM #55766, "retries fail the same way").
        try:
            self._evict(scheduler, poisoned)
        except Exception as exc:  # the request still ends
            self._evict_failed(exc)
        try:
            held = self._block_ids(scheduler, poisoned)
        except Exception as exc:  # the request still ends
            self._zero_failed(exc)
            held = set()
        ended = scheduler.finish_requests(poisoned, RequestStatus.FINISHED_ERROR)
        try:
            self._freed.add(scheduler, self._now_free(scheduler, held))
        except Exception as exc:
            self._zero_failed(exc)
        # The scheduler learns only that a request's rows were poisoned: under speculative
        # decoding they may be its target (eagle.verify) rows or its sampled (bonus) rows.
        site = f"{SITE},{VERIFY_SITE}" if getattr(scheduler, "num_spec_tokens", 0) else SITE
        for request in ended:
            request.num_nans_in_logits = max(
                request.num_nans_in_logits, poisoned[request.request_id]
            )
            # vLLM's engine id: the client's (X-Request-Id, or vLLM's own cmpl-...) with
            # vLLM's random suffix; what the client gets is finish_reason "error", HTTP 500.
            self._aborts.record(
                HOOK,
                site=site,
                reason="nonfinite_logits",
                request_id=request.request_id,
                status=500,
                finish_reason="error",
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

    @staticmethod
    def _evict(scheduler: Any, poisoned: dict[str, int]) -> None:
        """Take every KV block of the poisoned requests out of the prefix cache.

        Shared blocks too: which block holds the bad values is unknown, and a block another
        running request uses stays allocated to it (`evict_blocks` drops only the hash); its
        prefix is recomputed by the next request that would have hit it."""
        block_ids = _SchedulerHalf._block_ids(scheduler, poisoned)
        if block_ids:
            scheduler.kv_cache_manager.evict_blocks(block_ids)

    @staticmethod
    def _block_ids(scheduler: Any, poisoned: dict[str, int]) -> set[int]:
        """Every KV block the poisoned requests hold, in every KV cache group (one pool)."""
        manager = scheduler.kv_cache_manager
        block_ids: set[int] = set()
        for req_id in poisoned:
            if req_id in scheduler.requests:
                for group in manager.get_block_ids(req_id):
                    block_ids.update(group)
        return block_ids

    @staticmethod
    def _now_free(scheduler: Any, held: set[int]) -> list[int]:
        """Of the blocks the ended requests held, those their end freed (no other request
        holds them: a shared prefix block stays as it is for the request reading it; a block
        a KV connector still sends is freed, and zeroed, by vLLM later)."""
        blocks = scheduler.kv_cache_manager.block_pool.blocks
        return sorted(i for i in held if blocks[i].ref_cnt == 0 and not blocks[i].is_null)


class _ScheduleHalf:
    """Scheduler side: hand the blocks freed by ended poisoned requests to the workers with the
    next step, in vLLM's own `new_block_ids_to_zero` (zeroed before that step's forward pass,
    the first that can read them: a block freed after step N is allocated at N+1 at the
    earliest, also under async scheduling, where N+1 was scheduled before N's output)."""

    def __init__(self, guards: Guardrails | None, freed: _FreedBlocks) -> None:
        self._failed = PartFailures(HOOK, SCHEDULE_TARGET, guards)
        self._freed = freed

    def __call__(self, wrapped: Any, scheduler: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        output = wrapped(*args, **kwargs)
        try:
            block_ids = self._freed.take(scheduler)
            if block_ids:
                ours = output.new_block_ids_to_zero or []
                output.new_block_ids_to_zero = [*ours, *block_ids]
        except Exception as exc:
            self._failed(exc)
        return output


class _ZeroerHalf:
    """Worker side: the blocks the scheduler half sends are zeroed by the runner's KV block
    zeroer, which vLLM builds only for caches that zero every new block. Where it is missing
    it is built at the first step that sends any (`_init_kv_zero_meta`, a table of each
    layer's block addresses).

    V1 (`GPUModelRunner._zero_block_ids`) does nothing without its zeroer; a runner that
    overrides the method (the CPU runner zeroes its blocks directly) never reaches this half.
    Model Runner V2 (`GPUModelRunner.update_requests`) asserts the zeroer exists when a step
    sends block ids: if it cannot be built, the ids are dropped from the step (and the failure
    logged) rather than let that assertion end the worker."""

    def __init__(self, guards: Guardrails | None, target: str, *, v2: bool) -> None:
        self._failed = PartFailures(HOOK, target, guards)
        self._v2 = v2

    def __call__(self, wrapped: Any, runner: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            if self._v2:
                self._ensure_v2(runner, *args, **kwargs)
            elif not hasattr(runner, "_kv_block_zeroer"):
                runner._init_kv_zero_meta()
        except Exception as exc:
            self._failed(exc)
        return wrapped(*args, **kwargs)

    @staticmethod
    def _ensure_v2(runner: Any, scheduler_output: Any, *rest: Any, **kwargs: Any) -> None:
        if not scheduler_output.new_block_ids_to_zero or runner.kv_block_zeroer is not None:
            return
        try:
            runner._init_kv_zero_meta()
        finally:
            if runner.kv_block_zeroer is None:
                scheduler_output.new_block_ids_to_zero = None
