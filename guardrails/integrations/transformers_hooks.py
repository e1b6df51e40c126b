"""transformers hook `transformers.end_poisoned_requests`: end a poisoned request with an error,
in both modes of `transformers serve`, and keep its poison away from the requests batched
with it.

    hooks = ["transformers.end_poisoned_requests"]
    [sites."sampler.logits"]
    abort_on = ["no_valid_token"]

Contract: a request with a `sampler.logits` row whose flags intersect `abort_on` ends through
transformers' own error paths before the token sampled from that row reaches the client
(`generate()`: `PoisonedRequestError` from the call; under `transformers serve` HTTP 500 with
`{"detail": MESSAGE}`, or a stream's `data: {"error": MESSAGE}` event and nothing after it;
continuous batching: that request fails, the batch carries on, its KV blocks leave the prefix
cache). In continuous batching non-finite keys and values written to the paged cache are
zeroed in place before attention reads them, so one request's overflow never reaches another
in the same forward pass; the request they came from is still ended. No synchronisation is
added. How each half does it, by transformers version: docs/integrating.md, "How the
transformers hook works".

Each ended request is counted and logged once (`guardrails.reporting.request_aborts`) with the
id transformers serve's API server gave it (the client's X-Request-Id, or one it made up); a
bare `generate()` has none (None), a bare `generate_batch` the batch's own.

Each half declares what it reads from transformers beyond its method's name (its parameters,
the members of transformers' objects: `guardrails.attach.expects`, after `end_poisoned_requests`):
checked when its module is imported and by `guardrails check`; a half whose transformers lacks
one is not applied (state "mismatch", reported once).

Any exception of ours is logged once per half and the engine's call goes on as if unhooked
(the error raised on purpose excepted). Not covered: beam search and assisted decoding in
`generate()` (they do not call `StopCheck`), `DeferredStopCheck` (MPS), CUDA-graph replays in
continuous batching (a replay runs no Python).
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch

from guardrails import _process
from guardrails.attach.expects import Expect, calls, reads
from guardrails.integrations._hooks import MethodHook, PartFailures, request_aborts

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["HOOK", "MESSAGE", "PoisonedRequestError", "end_poisoned_requests"]

SITE: Final = "sampler.logits"
HOOK: Final = "transformers.end_poisoned_requests"
# No quote or backslash: transformers serve writes a stream error as f'{{"error": "{msg}"}}'.
MESSAGE: Final = (
    "guardrails: the model produced logits with no valid token for this request "
    "(NaN or -inf everywhere); it was ended instead of sampling from healed logits"
)
STATUS: Final = 500  # what transformers serve itself answers for a failed request

_LOGITS_MODULE: Final = "transformers.generation.logits_process"
_LOGITS_TARGET: Final = "LogitsProcessorList.__call__"
_STOP_MODULE: Final = "transformers.generation.utils"
_STOP_TARGET: Final = "StopCheck.__call__"
_RUNNER_MODULE: Final = "transformers.generation.continuous_batching.model_runner"
_RUNNER_TARGET: Final = "ModelRunner._sample"
_IO_MODULE: Final = "transformers.generation.continuous_batching.input_outputs"
_IO_TARGET: Final = "ContinuousBatchingIOs.prepare_batch_update"
_BATCH_MODULE: Final = "transformers.generation.continuous_batching.continuous_api"
_BATCH_TARGET: Final = "ContinuousBatchProcessor.update_batch"
_SERVE_MODULE: Final = "transformers.cli.serving.utils"
# transformers serve before 5.25 generates in the server's own process (one inference thread,
# or the batching worker); from 5.25 on, the model runs in a process of its own that the API
# server's `EngineClient` sends each request to (both are guarded under `guardrails run`).
_ONE_PROCESS: Final = "transformers<5.25.0.dev0"
_MODEL_PROCESS: Final = "transformers>=5.25.0.dev0"
# Before 5.25: continuous batching's non-streaming answer; plain serve's handlers, where the
# request id is known, and where generate() is handed to the inference thread that runs it.
_SERVE_TARGET: Final = "CBGenerateManager.generate_non_streaming"
_PLAIN_STREAM_TARGET: Final = "GenerateManager.generate_streaming"
_PLAIN_TARGET: Final = "GenerateManager.generate_non_streaming"
_SUBMIT_TARGETS: Final = ("InferenceThread.submit", "InferenceThread.async_submit")
# From 5.25: the API server's handlers (request id known), what sends a request to the model's
# process and hands its end back, and the model process's runners that take each request.
_HANDLER_TARGETS: Final = (
    ("transformers.cli.serving.chat_completion", "ChatCompletionHandler.handle_request"),
    ("transformers.cli.serving.completion", "CompletionHandler.handle_request"),
    ("transformers.cli.serving.response", "ResponseHandler.handle_request"),
)
_CLIENT_MODULE: Final = "transformers.cli.serving.model_manager"
_CLIENT_TARGET: Final = "EngineClient._send_request"
_RUNNER_PLAIN_TARGET: Final = "GenerateRunner.generate"
_RUNNER_BATCH_TARGET: Final = "CBGenerateRunner.generate"
_CACHE_MODULE: Final = "transformers.generation.continuous_batching.cache"
_CACHE_TARGET: Final = "PagedAttentionCache.update"
# Where a step's abort rows wait on the IO buffers its results are read from.
_MARKS_ATTR: Final = "_guardrails_abort_rows"


class PoisonedRequestError(RuntimeError):
    """A request ended because its logits had no valid token (raised from `generate()`)."""


_served_error: type[PoisonedRequestError] | None = None


def _error() -> PoisonedRequestError:
    """The error to raise: also starlette's HTTPException when the process serves HTTP with it,
    so FastAPI answers a non-streaming request with STATUS and a JSON body."""
    global _served_error
    starlette = sys.modules.get("starlette.exceptions")
    if starlette is None:
        return PoisonedRequestError(MESSAGE)
    if _served_error is None:
        http_exception = starlette.HTTPException

        class ServedPoisonedRequestError(PoisonedRequestError, starlette.HTTPException):  # type: ignore[misc, name-defined]
            def __init__(self, message: str) -> None:
                PoisonedRequestError.__init__(self, message)
                http_exception.__init__(self, status_code=STATUS, detail=message)

            def __str__(self) -> str:  # the stream's error event carries str(exc)
                return str(self.detail)

        _served_error = ServedPoisonedRequestError
    return _served_error(MESSAGE)


def end_poisoned_requests(guards: Guardrails) -> list[MethodHook]:
    """Install every half (each when its transformers module is imported); returns their
    handles. Nothing is wrapped when `sampler.logits` is disabled or its `abort_on` is empty:
    decided here, once."""
    mask = guards.settings.site_settings(SITE).abort_flags
    enabled = guards.is_enabled(SITE) and bool(mask)
    rows = _StepRows(guards, mask)
    kv = _HealKV(guards)
    served = _ServedIds()
    batch = _BatchHalf(guards, served)
    # Watched by the liveness self-check (a heartbeat every step of either mode): in each
    # group one half of each mode runs at every step, so the pair is judged on their sum.
    # The last column: what the half reads from transformers (below).
    halves: list[tuple[str, str, Any, bool | str, str | None, Sequence[Expect]]] = [
        (_LOGITS_MODULE, _LOGITS_TARGET, _ProcessorsHalf(rows), "sampler", None, _PROCESSORS),
        (_STOP_MODULE, _STOP_TARGET, _StopHalf(rows), "update", None, _STOP),
        (_CACHE_MODULE, _CACHE_TARGET, kv, False, None, _HEAL_KV),
        (_RUNNER_MODULE, _RUNNER_TARGET, _SampleHalf(rows, kv), "sampler", None, _SAMPLE),
        (_IO_MODULE, _IO_TARGET, _UpdateFilterHalf(batch, guards), False, None, _UPDATE_FILTER),
        (_BATCH_MODULE, _BATCH_TARGET, batch, "update", None, _BATCH),
        # transformers serve before 5.25: one process.
        (_SERVE_MODULE, _SERVE_TARGET, _NonStreamingHalf(), False, _ONE_PROCESS, _CB_NON_STREAMING),
        (_SERVE_MODULE, _PLAIN_STREAM_TARGET, _ServedIdHalf(4), False, _ONE_PROCESS, _STREAMING),
        (_SERVE_MODULE, _PLAIN_TARGET, _AsyncServedIdHalf(4), False, _ONE_PROCESS, _NON_STREAMING),
        *(
            (_SERVE_MODULE, target, _CarryIdHalf(), False, _ONE_PROCESS, _submit(target))
            for target in _SUBMIT_TARGETS
        ),
        # transformers serve from 5.25: the API server's process, then the model's.
        *(
            (module, target, _AsyncServedIdHalf(1), False, _MODEL_PROCESS, _handler(module, target))
            for module, target in _HANDLER_TARGETS
        ),
        (_CLIENT_MODULE, _CLIENT_TARGET, _EngineClientHalf(guards), False, _MODEL_PROCESS, _CLIENT),
        (
            _SERVE_MODULE,
            _RUNNER_PLAIN_TARGET,
            _RunnerIdHalf(guards),
            False,
            _MODEL_PROCESS,
            _RUNNER,
        ),
        (
            _SERVE_MODULE,
            _RUNNER_BATCH_TARGET,
            _RunnerIdHalf(guards, served),
            False,
            _MODEL_PROCESS,
            _CB_RUNNER,
        ),
    ]
    return [
        MethodHook(
            guards, HOOK, module, target, half, enabled, expect_calls=expect, when=when, reads=read
        )
        for module, target, half, expect, when, read in halves
    ]


# -- what the halves read from transformers (checked by `guardrails check` and before applying) --
# Each part's method with the parameters its half takes by position or name (`calls`; none when
# it only calls the method as it is), then what it reads on transformers' objects (`reads`). A
# read through getattr() with a default is not declared, unless the half relies on it (writes
# it back, or only works through it). The serve parts hold for their own versions (`when`).
_CB: Final = "transformers.generation.continuous_batching"
_REQUESTS: Final = f"{_CB}.requests"

# generate(): the `sampler.logits` call inside is the attach point's; the half reads nothing.
_PROCESSORS: Final = (calls(f"{_LOGITS_MODULE}:{_LOGITS_TARGET}"),)
# generate(): StopCheck hands each step's tokens to its streamer's put(): swapped for a _Gate
# for the step, which puts them on.
_STOP: Final = (
    reads(f"{_STOP_MODULE}:StopCheck", "streamer"),
    reads("transformers.generation.streamers:BaseStreamer", "put"),
)
# Continuous batching, every attention layer: the new keys and values, the layer, and the
# forward's attention kwargs (the IOs' `PagedAttentionArgs`) with the requests' query starts.
_HEAL_KV: Final = (
    calls(f"{_CACHE_MODULE}:{_CACHE_TARGET}", "key_states", "value_states", "layer_idx", "kwargs"),
    reads(f"{_IO_MODULE}:PagedAttentionArgs", "cu_seq_lens_q"),
)
# The step's logits, and the IO buffers (the runner's, or the async pair's current ones): the
# device's logits indices (row -> query position), the host's batch its results are read with.
_SAMPLE: Final = (
    calls(f"{_RUNNER_MODULE}:{_RUNNER_TARGET}", "scores"),
    reads(f"{_RUNNER_MODULE}:ModelRunner", "inputs_and_outputs"),
    reads(f"{_IO_MODULE}:ContinuousBatchingAsyncIOs", "io_pairs", "current_pair"),
    reads(f"{_IO_MODULE}:HostDeviceIOPair", "device_io", "host_io"),
    reads(f"{_IO_MODULE}:ContinuousBatchingIOs", "logits_indices", "requests_in_batch"),
)
# The batch update it returns filtered, (requests, tokens, logprobs): each request's tokens in
# the step, whether it sampled one, its state and status.
_UPDATE_FILTER: Final = (
    calls(f"{_IO_MODULE}:{_IO_TARGET}"),
    reads(f"{_REQUESTS}:FutureRequestState", "state", "query_length", "has_new_token"),
    reads(f"{_REQUESTS}:RequestState", "status"),
    reads(f"{_REQUESTS}:RequestStatus", "FINISHED", "FAILED", "PENDING"),
)
# Failing a dropped request as transformers' own error path does, its blocks freed uncached,
# and the scheduler told.
_BATCH: Final = (
    reads(f"{_BATCH_MODULE}:ContinuousBatchProcessor", "scheduler", "cache"),
    calls(f"{_BATCH_MODULE}:ContinuousBatchProcessor._handle_request_error", "error", "state"),
    calls(f"{_CACHE_MODULE}:PagedAttentionCache.free_blocks", "request_id", "no_cache"),
    calls(f"{_CB}.scheduler:Scheduler.finish_request", "request_id"),
    reads(f"{_CB}.scheduler:Scheduler", "block_new_requests"),
    reads(f"{_REQUESTS}:RequestState", "request_id"),
)
# Before 5.25: continuous batching's non-streaming answer; its RuntimeError is read as text.
_CB_NON_STREAMING: Final = (calls(f"{_SERVE_MODULE}:{_SERVE_TARGET}"),)
# Before 5.25, plain serve's `GenerateManager`: the request id at position 4 (`_ServedIdHalf(4)`).
_MANAGER: Final = ("model", "processor", "inputs", "gen_config", "request_id")
_STREAMING: Final = (calls(f"{_SERVE_MODULE}:{_PLAIN_STREAM_TARGET}", *_MANAGER),)
_NON_STREAMING: Final = (calls(f"{_SERVE_MODULE}:{_PLAIN_TARGET}", *_MANAGER),)


def _submit(target: str) -> tuple[Expect, ...]:
    """Before 5.25, `InferenceThread`: the job first (`_CarryIdHalf` wraps args[0])."""
    return (calls(f"{_SERVE_MODULE}:{target}", "fn"),)


def _handler(module: str, target: str) -> tuple[Expect, ...]:
    """From 5.25, the API server's handlers: the request id at position 1."""
    return (calls(f"{module}:{target}", "body", "request_id"),)


# From 5.25, the model process's runners take each request as `generate(request_id, inputs,
# generation_kwargs, stream)`: what `EngineClient` sends for "generate" after the request's number
# (its `args`, rebuilt by `_EngineClientHalf`), where `_RunnerIdHalf` reads the kwargs and id.
_RUNNER_GENERATE: Final = ("request_id", "inputs", "generation_kwargs")
_CLIENT: Final = (
    calls(f"{_CLIENT_MODULE}:{_CLIENT_TARGET}", "method", "args"),
    calls(f"{_SERVE_MODULE}:{_RUNNER_PLAIN_TARGET}", *_RUNNER_GENERATE),
    calls(f"{_SERVE_MODULE}:{_RUNNER_BATCH_TARGET}", *_RUNNER_GENERATE),
)
# Plain: the queue its thread takes jobs from. Batching: its requests in flight, by number.
_RUNNER: Final = (
    calls(f"{_SERVE_MODULE}:{_RUNNER_PLAIN_TARGET}", *_RUNNER_GENERATE),
    reads(f"{_SERVE_MODULE}:GenerateRunner", "queue"),
)
_CB_RUNNER: Final = (
    calls(f"{_SERVE_MODULE}:{_RUNNER_BATCH_TARGET}", *_RUNNER_GENERATE),
    reads(f"{_SERVE_MODULE}:CBGenerateRunner", "active_requests"),
)


class _StepRows:
    """This thread's abort rows of its latest `sampler.logits` call, taken once per call."""

    def __init__(self, guards: Guardrails, mask: int) -> None:
        self._guards = guards
        self._mask = mask
        self._local = threading.local()

    @property
    def guards(self) -> Guardrails:
        return self._guards

    def before(self) -> int | None:
        found = self._guards.site(SITE).recent()
        return None if found is None else found[0]

    def after(self, before: int | None) -> torch.Tensor | None:
        """The rows of the call made since `before`, as a new bool tensor (enqueued on the
        current stream, no sync), or None when the guard did not run in between."""
        found = self._guards.site(SITE).recent()
        if found is None or found[0] == before:
            return None
        # A new tensor: the flags buffer is rewritten by the thread's next call.
        return found[1].bitwise_and(self._mask).ne(0)

    def keep(self, marks: torch.Tensor | None) -> None:
        self._local.marks = marks

    def take(self) -> torch.Tensor | None:
        marks: torch.Tensor | None = getattr(self._local, "marks", None)
        self._local.marks = None
        return marks


class _ProcessorsHalf:
    """generate(): keep the abort rows of the guard call inside `LogitsProcessorList.__call__`."""

    def __init__(self, rows: _StepRows) -> None:
        self._rows = rows
        self._failed = PartFailures(HOOK, _LOGITS_TARGET, rows.guards)

    def __call__(self, wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        before = None
        try:
            before = self._rows.before()
        except Exception as exc:
            self._failed(exc)
        result = wrapped(*args, **kwargs)
        try:
            self._rows.keep(self._rows.after(before))
        except Exception as exc:
            self._failed(exc)
        return result


class _StopHalf:
    """generate(): end the call before this step's tokens are streamed when a row is marked."""

    def __init__(self, rows: _StepRows) -> None:
        self._rows = rows
        self._failed = PartFailures(HOOK, _STOP_TARGET, rows.guards)
        self._aborts = request_aborts(rows.guards)

    def __call__(self, wrapped: Any, stop_check: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            marks = self._rows.take()
            streamer = getattr(stop_check, "streamer", None)
        except Exception as exc:
            self._failed(exc)
            return wrapped(*args, **kwargs)
        if marks is None:
            return wrapped(*args, **kwargs)
        if streamer is None:
            result = wrapped(*args, **kwargs)  # it waited for the step (unfinished.max())
            if self._poisoned(marks):
                raise self.ended(None)
            return result
        # The streamer's put() receives tokens already on the host: reading the marks there
        # adds no wait, and raising there keeps the token from the stream.
        stop_check.streamer = _Gate(streamer, marks, self)
        try:
            return wrapped(*args, **kwargs)
        finally:
            stop_check.streamer = streamer

    def _poisoned(self, marks: torch.Tensor) -> bool:
        try:
            return bool(marks.any())
        except Exception as exc:
            self._failed(exc)
            return False

    def ended(self, streamer: Any) -> PoisonedRequestError:
        """The error that ends this `generate()` call, its request counted and named: by the
        id transformers serve handed to this thread with the job (`_SERVED_ID`), else the id
        a streamer carries (from 5.25 on, serve's streamer carries its model process's own
        number, not the server's id), else None (a bare `generate()` has none)."""
        request_id = _SERVED_ID.get()
        if request_id is None:
            request_id = getattr(streamer, "request_id", None)
        self._aborts.record(
            HOOK,
            site=SITE,
            reason="nonfinite_logits",
            request_id=request_id,
            status=STATUS if sys.modules.get("starlette.exceptions") else None,
            finish_reason=None,
        )
        return _error()


class _Gate:
    """A streamer stand-in for one step: raises instead of streaming a poisoned step."""

    def __init__(self, streamer: Any, marks: torch.Tensor, stop: _StopHalf) -> None:
        self._streamer, self._marks, self._stop = streamer, marks, stop

    def put(self, value: Any) -> None:
        if self._stop._poisoned(self._marks):
            raise self._stop.ended(self._streamer)
        self._streamer.put(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._streamer, name)


class _Marks:
    """One step's abort rows and tokens with non-finite keys or values (host copies, complete
    once transformers has waited for the step's outputs), with the batch they belong to."""

    __slots__ = ("batch", "rows", "tokens")

    def __init__(self, batch: Any, rows: torch.Tensor | None, tokens: torch.Tensor | None):
        self.batch, self.rows, self.tokens = batch, _to_host(rows), _to_host(tokens)


def _to_host(marks: torch.Tensor | None) -> torch.Tensor | None:
    if marks is None or marks.device.type == "cpu":
        return marks
    # Pinned, so the copy is asynchronous; transformers waits for the step's outputs (enqueued
    # after it on the same stream) before the batch update reads it.
    host = torch.empty(marks.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(marks, non_blocking=True)
    return host


class _SampleHalf:
    """Continuous batching: NaN into the logits rows of requests whose keys or values were
    non-finite in this step (before the guard), then keep the step's abort rows where its
    results will be read."""

    def __init__(self, rows: _StepRows, kv: _HealKV) -> None:
        self._rows = rows
        self._kv = kv
        self._failed = PartFailures(HOOK, _RUNNER_TARGET, rows.guards)

    def __call__(self, wrapped: Any, runner: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        before = tokens = None
        try:
            tokens = self._kv.take()
            if tokens is not None:
                scores = args[0] if args else kwargs["scores"]
                self._poison_rows(runner, scores, *tokens)
            before = self._rows.before()
        except Exception as exc:
            self._failed(exc)
        result = wrapped(*args, **kwargs)
        try:
            self._keep(runner, self._rows.after(before), None if tokens is None else tokens[0])
        except Exception as exc:
            self._failed(exc)
        return result

    @staticmethod
    def _poison_rows(
        runner: Any, scores: torch.Tensor, bad: torch.Tensor, starts: torch.Tensor
    ) -> None:
        """Row i samples at query position logits_indices[i], the last one of its request;
        the request's tokens are [cu_seq_lens_q[j], that position]. Branch-free."""
        rows = scores.shape[-2]
        io = runner.inputs_and_outputs
        pairs = getattr(io, "io_pairs", None)
        if pairs is not None:
            io = pairs[io.current_pair].device_io
        ends = io.logits_indices[:rows].to(torch.int64)
        ends = ends.clamp(max=bad.shape[0] - 1)
        request = torch.searchsorted(starts, ends, right=True) - 1
        first = starts.gather(0, request.clamp(min=0))
        seen = torch.cat([bad.new_zeros(1, dtype=torch.int64), bad.to(torch.int64).cumsum(0)])
        poisoned = seen.gather(0, ends + 1) > seen.gather(0, first)
        scores.view(-1, scores.shape[-1]).masked_fill_(poisoned.unsqueeze(-1), float("nan"))

    @staticmethod
    def _keep(runner: Any, rows: torch.Tensor | None, tokens: torch.Tensor | None) -> None:
        io = runner.inputs_and_outputs
        pairs = getattr(io, "io_pairs", None)
        if pairs is not None:  # async batching: this step's results are read from this pair
            io = pairs[io.current_pair].host_io
        if rows is None and tokens is None:
            setattr(io, _MARKS_ATTR, None)
            return
        setattr(io, _MARKS_ATTR, _Marks(io.requests_in_batch, rows, tokens))


class _BatchHalf:
    """Continuous batching: around `update_batch`, fail the requests the update dropped."""

    def __init__(self, guards: Guardrails, served: _ServedIds) -> None:
        self._failed = PartFailures(HOOK, _BATCH_TARGET, guards)
        self._aborts = request_aborts(guards)
        self._served = served
        self.local = threading.local()

    def __call__(self, wrapped: Any, processor: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        local = self.local
        local.active, local.dropped = True, []
        try:
            result = wrapped(*args, **kwargs)
        finally:
            local.active = False
        dropped, local.dropped = local.dropped, []
        if dropped:
            try:
                self._fail(processor, dropped)
            except Exception as exc:
                self._failed(exc)
        return result

    def _fail(self, processor: Any, dropped: list[tuple[Any, str]]) -> None:
        error = _error()
        for state, reason in dropped:
            processor._handle_request_error(error, state)  # FAILED, error=MESSAGE, delivered
            # Its KV holds healed or non-finite values: never reused as a cached prefix.
            processor.cache.free_blocks(state.request_id, no_cache=True)
            processor.scheduler.finish_request(state.request_id)
            self._aborts.record(
                HOOK,
                site=SITE,
                reason=reason,
                request_id=self._served.get(state.request_id),
                status=STATUS,
                finish_reason=None,  # a stream gets an error event, no finish_reason
            )
        processor.scheduler.block_new_requests = False  # blocks were freed, as a finish does


class _UpdateFilterHalf:
    """Continuous batching: the batch update never sees a marked request or its token."""

    def __init__(self, batch: _BatchHalf, guards: Guardrails) -> None:
        self._batch = batch
        self._failed = PartFailures(HOOK, _IO_TARGET, guards)

    def __call__(self, wrapped: Any, io: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if not getattr(self._batch.local, "active", False):
            return result  # another caller (transformers' batch-error path): untouched
        try:
            return self._filter(io, result)
        except Exception as exc:
            self._failed(exc)
            return result

    def _filter(self, io: Any, result: Any) -> Any:
        marks: _Marks | None = getattr(io, _MARKS_ATTR, None)
        setattr(io, _MARKS_ATTR, None)  # once per step
        if marks is None:
            return result
        requests, tokens, logprobs = result
        if marks.batch is not requests:
            return result  # marks of another batch (a warmup): not these requests
        rows = [] if marks.rows is None else marks.rows.tolist()
        bad = [] if marks.tokens is None else marks.tokens.tolist()
        if not any(rows) and not any(bad):
            return result
        from transformers.generation.continuous_batching.requests import (  # type: ignore[import-not-found, unused-ignore]
            RequestStatus,  # loaded by now: the batch processor imported it
        )

        done = (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.PENDING)
        kept, kept_tokens, kept_logprobs = [], [], []
        dropped: list[tuple[Any, str]] = self._batch.local.dropped
        row = position = 0
        for future_state in requests:
            span = future_state.query_length
            kv = any(bad[position : position + span])
            position += span
            logits = False
            if future_state.has_new_token:
                # A request whose keys or values were non-finite has its row NaN (_SampleHalf).
                logits = row < len(rows) and bool(rows[row])
                if not (kv or logits):
                    kept_tokens.append(tokens[row])
                    if logprobs is not None:
                        kept_logprobs.append(logprobs[row])
                row += 1
            if not (kv or logits):
                kept.append(future_state)
            elif future_state.state.status not in done:
                reason = "nonfinite_logits" if logits else "nonfinite_kv"
                dropped.append((future_state.state, reason))
        return kept, kept_tokens, kept_logprobs if logprobs is not None else None


class _NonStreamingHalf:
    """transformers serve before 5.25, continuous batching, non-streaming: HTTP 500 with a
    JSON body."""

    async def __call__(self, wrapped: Any, manager: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        # transformers raises RuntimeError(f"CB generation failed for {id}: {error}"), a
        # plain-text 500; the error it carries says whether the request was ours.
        return await _as_ours(wrapped(*args, **kwargs))


async def _as_ours(call: Awaitable[Any]) -> Any:
    """Await transformers' `call`; a RuntimeError that carries our message as text (transformers
    turned our error into its own) is raised as ours again, anything else as it came."""
    try:
        return await call
    except RuntimeError as exc:
        if MESSAGE in str(exc) and not isinstance(exc, PoisonedRequestError):
            raise _error() from exc
        raise


# The id transformers serve's API server gave the request being handled (the client's
# X-Request-Id, or one it made up): in the handler's context, in the job that generates for it
# (before 5.25, on the server's inference thread; from 5.25 on, in the model's process).
_SERVED_ID: contextvars.ContextVar[object] = contextvars.ContextVar(
    "guardrails_served_request_id", default=None
)


class _ServedIdHalf:
    """transformers serve, a sync handler: the request id (argument `position`, or keyword
    `request_id`) is this call's context's."""

    def __init__(self, position: int) -> None:
        self._position = position

    def __call__(self, wrapped: Any, owner: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            token = _SERVED_ID.set(_argument(args, kwargs, self._position, "request_id"))
        except Exception:  # an id we cannot find only leaves the event without one
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*args, **kwargs)
        finally:
            _SERVED_ID.reset(token)


class _AsyncServedIdHalf(_ServedIdHalf):
    """transformers serve, an async handler: the request id is this coroutine's context's (its
    task's own: concurrent requests never see each other's; a task it creates, as a stream's,
    starts with a copy)."""

    async def __call__(self, wrapped: Any, owner: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            token = _SERVED_ID.set(_argument(args, kwargs, self._position, "request_id"))
        except Exception:  # an id we cannot find only leaves the event without one
            return await wrapped(*args, **kwargs)
        try:
            return await wrapped(*args, **kwargs)
        finally:
            _SERVED_ID.reset(token)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[position]


def _with_served_id(fn: Any, request_id: object) -> Any:
    """`fn`, run with `_SERVED_ID` set to `request_id` (only that context variable: nothing
    else of the caller's context), on whatever thread runs it."""

    def job(*job_args: Any, **job_kwargs: Any) -> Any:
        token = _SERVED_ID.set(request_id)
        try:
            return fn(*job_args, **job_kwargs)
        finally:
            _SERVED_ID.reset(token)

    return job


class _CarryIdHalf:
    """transformers serve before 5.25: its inference thread runs each submitted job with the
    id of the request that submitted it."""

    def __call__(self, wrapped: Any, thread: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        request_id = _SERVED_ID.get()
        if request_id is None or not args:
            return wrapped(*args, **kwargs)
        return wrapped(_with_served_id(args[0], request_id), *args[1:], **kwargs)


class _ServedKwargs(dict[str, Any]):
    """transformers serve from 5.25: a request's generation kwargs on their way to the model's
    process, with the id the API server gave the request (pickled with them; the model's process
    reads it in `_RunnerIdHalf`, and anything else sees the dict it was)."""

    def __init__(self, kwargs: dict[str, Any], request_id: object) -> None:
        super().__init__(kwargs)
        self.request_id = request_id


class _EngineClientHalf:
    """transformers serve from 5.25, the API server: `EngineClient._send_request(method, args,
    streamer=None)` sends a request to the model's process and raises the error that failed it,
    which crossed as text (`RuntimeError("ServedPoisonedRequestError: MESSAGE")` from plain
    serve's runner, `RuntimeError("Continuous batching failed for the request: MESSAGE")` from
    continuous batching's). A "generate" request carries the handler's request id
    (`_ServedKwargs`); an error of ours is raised as ours again: a non-streaming request gets
    HTTP 500 with the JSON body `{"detail": MESSAGE}`, a stream the error event with MESSAGE
    (transformers sends `str(error)`)."""

    def __init__(self, guards: Guardrails) -> None:
        self._failed = PartFailures(HOOK, _CLIENT_TARGET, guards)

    async def __call__(self, wrapped: Any, client: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            args, kwargs = self._named(args, kwargs)
        except Exception as exc:
            self._failed(exc)
        return await _as_ours(wrapped(*args, **kwargs))

    @staticmethod
    def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
        request_id = _SERVED_ID.get()
        if request_id is None or _argument(args, kwargs, 0, "method") != "generate":
            return args, kwargs
        inputs, generation_kwargs, *rest = _argument(args, kwargs, 1, "args")
        request = (inputs, _ServedKwargs(generation_kwargs, request_id), *rest)
        if "args" in kwargs:
            return args, {**kwargs, "args": request}
        return (args[0], request, *args[2:]), kwargs


class _ServedIds:
    """transformers serve from 5.25, continuous batching in the model's process: the API
    server's id of each request in the batch, by the batch's id for it (`str` of the runner's
    number); an entry goes once its request left the runner (`active_requests`)."""

    def __init__(self) -> None:
        self._ids: dict[str, object] = {}
        # Re-made in a forked child, like every lock of guardrails (guardrails._process).
        self._lock = _process.lock(self, "_lock")

    def name(self, runner: Any, request_id: object, served_id: object) -> None:
        live = {str(key) for key in list(runner.active_requests)}
        with self._lock:
            for gone in [key for key in self._ids if key not in live]:
                del self._ids[gone]
            self._ids[str(request_id)] = served_id

    def get(self, batch_id: str) -> object:
        """The API server's id of the batch's request `batch_id`, else `batch_id` itself
        (before 5.25, or a bare `generate_batch`, the batch's id is the only one)."""
        with self._lock:
            return self._ids.get(batch_id, batch_id)


class _RunnerIdHalf:
    """transformers serve from 5.25, the model's process: `GenerateRunner.generate(request_id,
    inputs, generation_kwargs, stream)` (and `CBGenerateRunner`'s) takes a request whose kwargs
    carry the API server's id for it (`_ServedKwargs`). Plain: the runner puts the request's
    generate() job on its queue for its own thread, which runs it with that id (`_SERVED_ID`,
    carried by the queue: `_carry_ids`). Continuous batching (`served` given): the batch's id
    for the request maps to it."""

    def __init__(self, guards: Guardrails, served: _ServedIds | None = None) -> None:
        target = _RUNNER_PLAIN_TARGET if served is None else _RUNNER_BATCH_TARGET
        self._failed = PartFailures(HOOK, target, guards)
        self._served = served

    def __call__(self, wrapped: Any, runner: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        request_id = None
        try:
            generation_kwargs = _argument(args, kwargs, 2, "generation_kwargs")
            if isinstance(generation_kwargs, _ServedKwargs):
                request_id = generation_kwargs.request_id
                if self._served is None:
                    _carry_ids(runner.queue)
                else:
                    number = _argument(args, kwargs, 0, "request_id")
                    self._served.name(runner, number, request_id)
        except Exception as exc:
            self._failed(exc)
            request_id = None
        if request_id is None:
            return wrapped(*args, **kwargs)
        token = _SERVED_ID.set(request_id)
        try:
            return wrapped(*args, **kwargs)
        finally:
            _SERVED_ID.reset(token)


def _carry_ids(queue: Any) -> None:
    """From now on, a job put on this runner queue while `_SERVED_ID` is set runs with it: the
    queue's `put` on this instance (once) wraps the job of `(request_id, job, args, stream)`.
    Only the model process's request loop puts there (`generate`, `submit`), one at a time."""
    if not isinstance(vars(queue).get("put"), _CarryingPut):
        queue.put = _CarryingPut(queue.put)


class _CarryingPut:
    def __init__(self, put: Any) -> None:
        self._put = put

    def __call__(self, item: Any, *args: Any, **kwargs: Any) -> Any:
        request_id = _SERVED_ID.get()
        if request_id is not None and isinstance(item, tuple) and len(item) == 4:
            number, job, job_args, stream = item
            item = (number, _with_served_id(job, request_id), job_args, stream)
        return self._put(item, *args, **kwargs)


class _HealKV:
    """Non-finite keys and values become 0 before the paged cache stores them and attention
    reads them (in place; finite values unchanged); which query tokens had them is kept for
    this thread's next `_sample` (one bool per token, OR-ed over the layers of a forward)."""

    def __init__(self, guards: Guardrails) -> None:
        self._failed = PartFailures(HOOK, _CACHE_TARGET, guards)
        self._local = threading.local()

    def __call__(self, wrapped: Any, cache: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            self._heal(*args, **kwargs)
        except Exception as exc:
            self._failed(exc)
        return wrapped(*args, **kwargs)

    def _heal(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict[str, Any],
    ) -> None:
        # [1, kv_heads, tokens, head_dim] each: one flag per query token.
        bad = key_states.isfinite().logical_and_(value_states.isfinite()).all(-1).all(1)
        bad = bad[0].logical_not_()
        key_states.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        value_states.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        local = self._local
        seen = getattr(local, "bad", None)
        # The first layer starts a forward; a batch's layers all see the same query tokens.
        if layer_idx == 0 or seen is None or seen.shape != bad.shape:
            local.bad = bad
            local.starts = kwargs["cu_seq_lens_q"].to(torch.int64)
        else:
            seen.logical_or_(bad)

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This thread's (token flags, request starts) of its latest forward, once."""
        local = self._local
        bad: torch.Tensor | None = getattr(local, "bad", None)
        if bad is None:
            return None
        local.bad = None
        return bad, local.starts
