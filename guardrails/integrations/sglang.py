"""SGLang hook `sglang.abort_poisoned_requests`: end a request whose logits could not be healed
through SGLang's own abort path (FINISH_ABORT), its KV kept out of the prefix cache.

    hooks = ["sglang.abort_poisoned_requests"]       # config file, top level
    [sites."sampler.logits"]
    abort_on = ["no_valid_token"]

A row with no valid token (all NaN, or all -inf) is healed to uniform logits, and the token
sampled from it means nothing (SGLang issue #33187: the request carried on). SGLang ends a
request it must not continue by setting `req.to_finish = FINISH_ABORT(message, status)`: the
scheduler's result processing turns that into the request's finish reason, and the client
gets that HTTP status (non-streaming) or a final chunk with finish_reason type "abort" and
the status (streaming). `req.skip_radix_cache_insert = True` keeps its KV out of the prefix
cache when it is released (both 0.5.13 and 0.5.23 honour it). Two halves, joined by an
attribute on the step's `LogitsProcessorOutput`:

- sampler (`Sampler.forward`, after the call): the rows whose `sampler.logits` flags of this
  call intersect that site's `abort_on` become a new bool tensor (enqueued on the device, no
  sync), copied non-blocking into pinned host memory on CUDA, and kept on the call's
  `logits_output`.
- scheduler (`SchedulerBatchResultProcessor.process_batch_result_prefill` / `_decode`, before
  the call): each marked row's request (`batch.reqs[row]`) gets FINISH_ABORT (503) and
  `skip_radix_cache_insert`; SGLang's own code then finishes and releases it. Each is counted
  and named by its `rid` (`guardrails.reporting.request_aborts`).

Where the host reads the marks, and why that adds no sync: with overlap scheduling after
`result.copy_done.synchronize()`, the event SGLang itself waits on first thing in the wrapped
call; it is recorded on the copy stream after that stream waited for the forward stream that
enqueued our copy. Without overlap there is no event and SGLang reads the sampled ids with
`.tolist()` in the same call, which waits for the same stream; our read is that wait, a few
microseconds earlier. Nothing here imports SGLang: each half waits for its module's import
(wrapt post-import hooks). Any exception of ours is logged once per half and the engine's
call goes on as if unhooked.

Not covered: speculative verification (`eagle_sample` samples bs * draft_token_num rows that
do not map one to one onto requests; its logits are healed, not ended), and with watermark
`logprob_logits` the marks are those of the sampler's second (logprob) preprocessing call.
"""

from __future__ import annotations

import threading
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final

import torch

from guardrails.attach.expects import calls, reads
from guardrails.integrations._hooks import MethodHook, PartFailures, request_aborts

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["ABORT_MESSAGE", "abort_poisoned_requests", "zero_own_kv"]

SITE: Final = "sampler.logits"
HOOK: Final = "sglang.abort_poisoned_requests"
SAMPLER_MODULE: Final = "sglang.srt.layers.sampler"
SAMPLER_TARGET: Final = "Sampler.forward"
RESULTS_MODULE: Final = "sglang.srt.managers.scheduler_components.batch_result_processor"
RESULTS_TARGETS: Final = (
    "SchedulerBatchResultProcessor.process_batch_result_prefill",
    "SchedulerBatchResultProcessor.process_batch_result_decode",
)
# The attribute that carries one step's marks from the sampler to the scheduler.
MARKS_ATTR: Final = "_guardrails_abort_rows"
ABORT_MESSAGE: Final = (
    "guardrails: the model produced logits with no valid token for this request "
    "(NaN or -inf everywhere); it was aborted instead of sampling from healed logits"
)
# 503 like SGLang's own timeout aborts: the server failed this request, a retry may succeed.
ABORT_STATUS: Final = HTTPStatus.SERVICE_UNAVAILABLE
ABORT_ERR_TYPE: Final = "ServiceUnavailableError"


def abort_poisoned_requests(guards: Guardrails) -> list[MethodHook]:
    """Install the sampler half and both scheduler halves (each when its SGLang module is
    imported); returns their handles. Nothing is wrapped when `sampler.logits` is disabled
    or its `abort_on` is empty: decided here, once."""
    enabled = guards.is_enabled(SITE) and bool(guards.settings.site_settings(SITE).abort_flags)
    sampler = _SamplerHalf(guards)
    scheduler = _SchedulerHalf(guards)
    # Both run in the scheduler process at every sampling step (where the heartbeat,
    # ModelRunner.sample, runs): each is watched by the liveness self-check, the two result
    # processors as alternatives of one another.
    hooks = [
        MethodHook(
            guards,
            HOOK,
            SAMPLER_MODULE,
            SAMPLER_TARGET,
            sampler,
            enabled,
            expect_calls=True,
            reads=[calls(f"{SAMPLER_MODULE}:{SAMPLER_TARGET}", "logits_output")],
        )
    ]
    hooks += [
        MethodHook(
            guards,
            HOOK,
            RESULTS_MODULE,
            target,
            scheduler,
            enabled,
            expect_calls="results",
            reads=[calls(f"{RESULTS_MODULE}:{target}", "batch", "result"), *_RESULTS_READ],
        )
        for target in RESULTS_TARGETS
    ]
    return hooks


# What the scheduler half reads besides its arguments (checked by `guardrails check` and
# before it is applied). The KV fields zero_own_kv reads moved between versions (`req.kv`
# on 0.5.23, the request itself on 0.5.13) and are looked up where they are.
_BATCH: Final = "sglang.srt.managers.schedule_batch"
_RESULTS_READ: Final = (
    reads(f"{_BATCH}:ScheduleBatch", "reqs", "req_to_token_pool", "token_to_kv_pool_allocator"),
    reads(f"{_BATCH}:Req", "rid", "to_finish", "skip_radix_cache_insert", "finished"),
    reads(f"{_BATCH}:FINISH_ABORT"),
)


class _Marks:
    """One step's abort rows: the device tensor, and its host copy once it is enqueued."""

    __slots__ = ("device", "host")

    def __init__(self, device: torch.Tensor, host: torch.Tensor) -> None:
        self.device = device
        self.host = host


class _SamplerHalf:
    """Keep the rows of this sampler call that match `abort_on` on its `logits_output`."""

    def __init__(self, guards: Guardrails) -> None:
        self._guards = guards
        self._mask = guards.settings.site_settings(SITE).abort_flags
        self._failed = PartFailures(HOOK, SAMPLER_TARGET, guards)
        self._local = threading.local()

    def __call__(self, wrapped: Any, sampler: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        site = None
        before = None
        try:
            site = self._guards.site(SITE)
            before = site.recent()
        except Exception as exc:
            self._failed(exc)
        result = wrapped(*args, **kwargs)
        if site is None:
            return result
        try:
            self._keep(site, before, args, kwargs)
        except Exception as exc:
            self._failed(exc)
        return result

    def _keep(self, site: Any, before: Any, args: tuple[Any, ...], kwargs: Any) -> None:
        found = site.recent()  # this thread's latest call: its number tells a new one
        if found is None or (before is not None and found[0] == before[0]):
            return  # the guard did not run in this call (a disabled point, an error)
        flags = found[1]
        logits_output = args[0] if args else kwargs["logits_output"]
        # A new tensor, enqueued now: with overlap scheduling the next step's sampler
        # rewrites the flags buffer before this step's result is processed.
        marks = flags.bitwise_and(self._mask).ne(0)
        if marks.device.type == "cpu":
            host = marks
        else:
            # Pinned (the caching host allocator reuses the block) so the copy is
            # asynchronous; it is complete once SGLang's copy_done event is.
            host = torch.empty(marks.shape, dtype=torch.bool, pin_memory=True)
            host.copy_(marks, non_blocking=True)
        setattr(logits_output, MARKS_ATTR, _Marks(marks, host))


class _SchedulerHalf:
    """Before SGLang processes a step's results: abort the requests of the marked rows."""

    def __init__(self, guards: Guardrails | None = None) -> None:
        self._failed = PartFailures(
            HOOK, "SchedulerBatchResultProcessor.process_batch_result_*", guards
        )
        self._zero_failed = PartFailures(HOOK, "KV zeroing (token_to_kv_pool)", guards)
        self._aborts = request_aborts(guards)

    def __call__(self, wrapped: Any, processor: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            batch = args[0] if args else kwargs["batch"]
            result = args[1] if len(args) > 1 else kwargs["result"]
            self._abort_marked(batch, result, processor)
        except Exception as exc:
            self._failed(exc)
        return wrapped(*args, **kwargs)

    def _abort_marked(self, batch: Any, result: Any, processor: Any = None) -> None:
        logits_output = getattr(result, "logits_output", None)
        marks: _Marks | None = getattr(logits_output, MARKS_ATTR, None)
        if marks is None:
            return
        setattr(logits_output, MARKS_ATTR, None)  # once per step, also under overlap
        copy_done = getattr(result, "copy_done", None)
        if copy_done is not None:
            copy_done.synchronize()  # SGLang's own first wait in this call (docstring)
            rows = marks.host.tolist()
        else:
            rows = marks.device.tolist()  # the wait SGLang's own .tolist() makes here
        if not any(rows):
            return
        reqs = batch.reqs
        if len(rows) != len(reqs):
            raise ValueError(f"{len(rows)} sampler rows for {len(reqs)} requests")
        from sglang.srt.managers.schedule_batch import (  # type: ignore[import-not-found, unused-ignore]
            FINISH_ABORT,  # loaded by now: the scheduler imported it
        )

        ended: list[int] = []
        for row, poisoned in enumerate(rows):
            req = reqs[row]
            if not poisoned or req.finished() or req.to_finish is not None:
                continue
            req.to_finish = FINISH_ABORT(ABORT_MESSAGE, ABORT_STATUS, ABORT_ERR_TYPE)
            req.skip_radix_cache_insert = True
            ended.append(row)
        zeroed: dict[int, int] = {}
        if ended:
            try:
                zeroed = zero_own_kv(batch, ended, processor)
            except Exception as exc:  # the aborts stand; the zeroing's failure is loud
                self._zero_failed(exc)
        for row in ended:
            self._aborts.record(
                HOOK,
                site=SITE,
                reason="nonfinite_logits",
                request_id=getattr(reqs[row], "rid", None),
                status=int(ABORT_STATUS),
                finish_reason="abort",
                kv_slots_zeroed=zeroed.get(row, 0),
            )


def zero_own_kv(batch: Any, rows: list[int], scheduler: Any = None) -> dict[int, int]:
    """Zero the KV slots the requests of `rows` wrote themselves, in every layer of the pool,
    before SGLang frees them; returns how many slots, by row.

    A request's own slots are `req_to_token[req_pool_idx, cache_protected_len:
    kv_allocated_len]` (SGLang's words: the radix tree owns the prefix before
    `cache_protected_len`, shared with other requests, and it stays; past `kv_allocated_len`
    nothing is the request's). 0.5.23 keeps these in `req.kv`, 0.5.13 on the request.

    SGLang hands freed slots out again, and attention backends that load whole tiles or
    pages (FlashInfer and FlashAttention 3 with pages of more than one token) read slots past
    a request's length: a NaN left there reaches the next request (probability 0 x NaN =
    NaN). One index write per layer and K/V buffer, enqueued on SGLang's forward stream where
    the scheduler has a CUDA one (ordered after the step whose results are processed and the
    one overlap scheduling launched before processing them, before any later step), else on
    the current one. The pools are the scheduler's (the result processor's receiver; the
    batch's where it has none: a batch whose results are processed no longer holds its
    allocator).
    """
    stream = getattr(scheduler, "forward_stream", None)
    if isinstance(stream, torch.cuda.Stream):
        # On SGLang's forward stream: after the step already launched under overlap
        # scheduling (which writes one more slot of the request's) and before any later one.
        with torch.cuda.stream(stream):
            return _zero_own_kv(batch, rows, scheduler)
    return _zero_own_kv(batch, rows, scheduler)


def _zero_own_kv(batch: Any, rows: list[int], scheduler: Any) -> dict[int, int]:
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    tables = getattr(scheduler, "req_to_token_pool", None)
    kv = (allocator or batch.token_to_kv_pool_allocator).get_kvcache()
    table = (tables or batch.req_to_token_pool).req_to_token
    pieces = []
    counts: dict[int, int] = {}
    for row in rows:
        req = batch.reqs[row]
        kv_info = getattr(req, "kv", None)
        if kv_info is None or not hasattr(kv_info, "kv_allocated_len"):
            kv_info = req  # SGLang 0.5.13: the fields are the request's own
        start = int(kv_info.cache_protected_len)
        stop = min(int(kv_info.kv_allocated_len), table.shape[1])
        counts[row] = max(stop - start, 0)
        if stop > start:
            pieces.append(table[kv_info.req_pool_idx, start:stop])
    if not pieces:
        return counts
    slots = torch.cat(pieces).to(torch.long)
    first = int(getattr(kv, "start_layer", 0) or 0)
    for layer in range(first, first + int(kv.layer_num)):
        for buffer in kv.get_kv_buffer(layer):
            buffer[slots.to(buffer.device)] = 0
    return counts
