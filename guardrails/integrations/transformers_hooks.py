"""transformers hook `transformers.end_poisoned_requests`: end a poisoned request with an error,
in both modes of `transformers serve`, and keep its poison away from the requests batched
with it.

    hooks = ["transformers.end_poisoned_requests"]
    [sites."sampler.logits"]
    abort_on = ["no_valid_token"]

A row with no valid token (all NaN, or all -inf) is healed to uniform logits; the token sampled
from it means nothing. This hook ends such a request through transformers' own error paths,
and the token sampled from the healed row never reaches the client. Its halves, each waiting
for its module's import (nothing here imports transformers):

- `generate()` (plain `transformers serve`, one request per call): `LogitsProcessorList.__call__`
  keeps this step's rows that match `abort_on` (a new tensor made from the flags of the
  `sampler.logits` call inside it); `StopCheck.__call__`, which hands each step's tokens to the
  streamer, raises `PoisonedRequestError` from `generate()` before the token is streamed, once
  the host has the tokens (transformers' own wait of that step: no synchronisation is added).
  Under `transformers serve` that error is an HTTP exception: a non-streaming request gets
  HTTP 500 with the JSON body `{"detail": MESSAGE}`, a stream an SSE `data: {"error": MESSAGE}`
  event and nothing after it. A direct `generate()` caller gets the exception for the whole
  call (transformers' `generate` has no per-row error; `GuardLogitsProcessor(abort_on=...)`
  ends rows with EOS instead).
- continuous batching (`transformers serve --continuous-batching`, `generate_batch`):
  `PagedAttentionCache.update`, where every attention layer hands the batch's new keys and
  values to the paged cache before attention reads them, turns NaN and +-Inf there into 0 in
  place, branch-free (finite values unchanged), and keeps which query tokens had them. Batched
  requests share one attention call whose masks give the other requests' positions a weight
  of exactly 0, and 0 * NaN is NaN: without this, one request's overflow reaches every request
  batched with it in the same forward pass, before any sampler could flag it. The zeroed
  entries would also hide the fault from the request itself (its later positions read them as
  finite), so `ModelRunner._sample` first writes NaN into the logits row of each request whose
  tokens had them in this step (device ops, no sync): the `sampler.logits` guard then counts and
  flags that row as it would have unhealed. After the guard it keeps this step's abort rows on
  the IO buffers the step's results are read from. `ContinuousBatchingIOs.prepare_batch_update`
  (inside `ContinuousBatchProcessor.update_batch` only) drops those requests and their sampled
  tokens from the batch update, and any request whose non-finite tokens were in a prefill
  chunk without a logits row (ended at once: not counted by the site). `update_batch` then
  fails each with transformers' own `_handle_request_error` (status FAILED, `error` = MESSAGE),
  frees its KV blocks out of the prefix cache (`no_cache=True`) and removes it from the
  scheduler: the batching worker carries on with the others. A stream gets the
  `data: {"error": MESSAGE}` event; for a non-streaming request
  `CBGenerateManager.generate_non_streaming` turns transformers' `RuntimeError` for it into the
  same HTTP 500 with a JSON body. The host reads the rows after transformers' own wait for the
  step's outputs (`retrieve_device_outputs`, or the async IO pair's event).

Each ended request is counted and logged once (`guardrails.reporting.request_aborts`) with the
id transformers serve gave it: in continuous batching the request's own; in plain serve the
`request_id` that `GenerateManager.generate_streaming` / `generate_non_streaming` receive, set
in a context variable there and carried into the job `InferenceThread.submit` / `async_submit`
hands to the inference thread (where `generate()` runs); a bare `generate()` has none (None).

Any exception of ours is logged once per half and the engine's call goes on as if unhooked
(the error raised on purpose excepted). Not covered: beam search and assisted decoding in
`generate()` (they do not call `StopCheck`), `DeferredStopCheck` (MPS), CUDA-graph replays in
continuous batching (a replay runs no Python).
"""

from __future__ import annotations

import contextvars
import sys
import threading
from typing import TYPE_CHECKING, Any, Final

import torch

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
_SERVE_TARGET: Final = "CBGenerateManager.generate_non_streaming"
# Plain transformers serve: where the request id is known, and where generate() is handed to
# the inference thread that runs it.
_PLAIN_STREAM_TARGET: Final = "GenerateManager.generate_streaming"
_PLAIN_TARGET: Final = "GenerateManager.generate_non_streaming"
_SUBMIT_TARGETS: Final = ("InferenceThread.submit", "InferenceThread.async_submit")
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
    batch = _BatchHalf(guards)
    # Watched by the liveness self-check (a heartbeat every step of either mode): in each
    # group one half of each mode runs at every step, so the pair is judged on their sum.
    halves: list[tuple[str, str, Any, bool | str]] = [
        (_LOGITS_MODULE, _LOGITS_TARGET, _ProcessorsHalf(rows), "sampler"),
        (_STOP_MODULE, _STOP_TARGET, _StopHalf(rows), "update"),
        (_CACHE_MODULE, _CACHE_TARGET, kv, False),
        (_RUNNER_MODULE, _RUNNER_TARGET, _SampleHalf(rows, kv), "sampler"),
        (_IO_MODULE, _IO_TARGET, _UpdateFilterHalf(batch, guards), False),
        (_BATCH_MODULE, _BATCH_TARGET, batch, "update"),
        (_SERVE_MODULE, _SERVE_TARGET, _NonStreamingHalf(), False),
        (_SERVE_MODULE, _PLAIN_STREAM_TARGET, _ServedIdHalf(), False),
        (_SERVE_MODULE, _PLAIN_TARGET, _AsyncServedIdHalf(), False),
        *((_SERVE_MODULE, target, _CarryIdHalf(), False) for target in _SUBMIT_TARGETS),
    ]
    return [
        MethodHook(guards, HOOK, module, target, half, enabled, expect_calls=expect)
        for module, target, half, expect in halves
    ]


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
        id a streamer carries or transformers serve handed to this thread (`_ServedIdHalf`),
        else None (a bare `generate()` has none)."""
        request_id = getattr(streamer, "request_id", None)
        self._aborts.record(
            HOOK,
            site=SITE,
            reason="nonfinite_logits",
            request_id=_SERVED_ID.get() if request_id is None else request_id,
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

    def __init__(self, guards: Guardrails) -> None:
        self._failed = PartFailures(HOOK, _BATCH_TARGET, guards)
        self._aborts = request_aborts(guards)
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
                request_id=state.request_id,
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
    """transformers serve, continuous batching, non-streaming: HTTP 500 with a JSON body."""

    async def __call__(self, wrapped: Any, manager: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            return await wrapped(*args, **kwargs)
        except RuntimeError as exc:
            # transformers raises RuntimeError(f"CB generation failed for {id}: {error}"),
            # a plain-text 500; the error it carries says whether the request was ours.
            if MESSAGE in str(exc) and not isinstance(exc, PoisonedRequestError):
                raise _error() from exc
            raise


# The id of the request plain transformers serve is generating for, in the handler's context and
# in the job it hands to its inference thread.
_SERVED_ID: contextvars.ContextVar[object] = contextvars.ContextVar(
    "guardrails_served_request_id", default=None
)


def _request_id_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    # (model, processor, inputs, gen_config, request_id, ...)
    return kwargs["request_id"] if "request_id" in kwargs else args[4]


class _ServedIdHalf:
    """Plain transformers serve, streaming: the request id is this call's (sync) context's."""

    def __call__(self, wrapped: Any, manager: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            token = _SERVED_ID.set(_request_id_argument(args, kwargs))
        except Exception:  # an id we cannot find only leaves the event without one
            return wrapped(*args, **kwargs)
        try:
            return wrapped(*args, **kwargs)
        finally:
            _SERVED_ID.reset(token)


class _AsyncServedIdHalf:
    """Plain transformers serve, non-streaming: the request id is this coroutine's context's
    (its task's own: concurrent requests never see each other's)."""

    async def __call__(self, wrapped: Any, manager: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        try:
            token = _SERVED_ID.set(_request_id_argument(args, kwargs))
        except Exception:  # an id we cannot find only leaves the event without one
            return await wrapped(*args, **kwargs)
        try:
            return await wrapped(*args, **kwargs)
        finally:
            _SERVED_ID.reset(token)


class _CarryIdHalf:
    """transformers serve's inference thread runs each submitted job with the id of the request
    that submitted it (only that context variable: nothing else of the handler's context)."""

    def __call__(self, wrapped: Any, thread: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        request_id = _SERVED_ID.get()
        if request_id is None or not args:
            return wrapped(*args, **kwargs)
        fn, rest = args[0], args[1:]

        def job(*job_args: Any, **job_kwargs: Any) -> Any:
            token = _SERVED_ID.set(request_id)
            try:
                return fn(*job_args, **job_kwargs)
            finally:
                _SERVED_ID.reset(token)

        return wrapped(job, *rest, **kwargs)


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
