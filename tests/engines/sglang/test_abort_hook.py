"""`sglang.abort_poisoned_requests`: a request whose logits row had no valid token ends
through SGLang's own FINISH_ABORT, its KV kept out of the prefix cache.

What runs for real: SGLang's Sampler.forward (the sampler half keeps its marks on the real
LogitsProcessorOutput), SGLang's Req (built with its own constructor) and the lines of
SchedulerBatchResultProcessor.process_batch_result_decode that commit a token
(`req.output_ids.extend`, `req.update_finish_state`), then SGLang's `finished_reason.to_json()`
(what the tokenizer manager turns into HTTP 503 or a final abort chunk). What cannot run
here: the result processor's method itself, which needs a live scheduler (KV pool allocator,
tree cache, output streamer, metrics); the hook's wrapper is shown applied to it, and its
scheduler half is called with the real batch's requests.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from guardrails.integrations import sglang as hook
from tests.engines.sglang.engine import (
    FAULT_ROW,
    clean_logits,
    guarded,
    inject,
    sample,
    try_sample,
)


def make_reqs(rows: int) -> list[Any]:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for i in range(rows):
        params = SamplingParams(max_new_tokens=16, temperature=0.7)
        params.normalize(None)
        reqs.append(Req(f"req-{i}", "hello", array("q", [1, 2, 3]), params, vocab_size=4096))
    return reqs


def commit_decode_step(
    processor_half: Any, reqs: list[Any], output: Any, ids: torch.Tensor
) -> None:
    """The hook's scheduler half, then the token-commit lines of SGLang's decode loop."""
    batch = SimpleNamespace(reqs=reqs)
    result = SimpleNamespace(logits_output=output, copy_done=None)
    processor_half(lambda *args, **kwargs: None, None, (batch, result), {})
    commit_tokens(reqs, ids)


def commit_tokens(reqs: list[Any], ids: torch.Tensor) -> None:
    """SGLang's decode loop committing one sampled id per request."""
    for req, token in zip(reqs, ids.tolist(), strict=True):
        req.output_ids.extend([token])
        req.update_finish_state(1)


def guarded_decode_step(engine: Any, dtype: torch.dtype, fault: str, mode: str) -> list[Any]:
    """One guarded sampler call on logits with `fault`, committed through the hook; the
    requests it leaves."""
    logits = clean_logits(dtype)
    inject(logits, fault)
    reqs = make_reqs(logits.shape[0])
    with guarded():
        ids, output = sample(engine, logits, mode)
        commit_decode_step(hook._SchedulerHalf(), reqs, output, ids)
    return reqs


def test_a_poisoned_request_ends_with_sglangs_finish_abort_503(engine: Any, outcome: Any) -> None:
    logits = clean_logits(torch.float32)
    inject(logits, "all_nan")
    plain_reqs = make_reqs(logits.shape[0])
    plain_ids, unguarded = try_sample(engine, logits.clone(), "random")
    if plain_ids is None:
        # torch.multinomial (0.5.13's random path) refuses the NaN row: the whole batch fails.
        unguarded += " (whole batch)"
    else:
        # The Gumbel-max path (0.5.23) returns an id for the NaN row and SGLang commits it.
        commit_tokens(plain_reqs, plain_ids)
        assert not any(req.finished() for req in plain_reqs)
        unguarded += ": request carries on (no finish reason)"

    reqs = make_reqs(logits.shape[0])
    registry = CollectorRegistry()
    with guarded(registry=registry) as guards, capture_logs() as logs:
        ids, output = sample(engine, logits, "random")
        marks = getattr(output, hook.MARKS_ATTR)
        commit_decode_step(hook._SchedulerHalf(guards), reqs, output, ids)
    assert marks.device.tolist() == [row == FAULT_ROW for row in range(len(reqs))]
    assert getattr(output, hook.MARKS_ATTR) is None  # consumed once
    poisoned = reqs[FAULT_ROW]
    reason = poisoned.finished_reason.to_json()
    assert reason["type"] == "abort"
    assert reason["status_code"] == 503
    assert reason["err_type"] == "ServiceUnavailableError"
    assert poisoned.skip_radix_cache_insert is True
    assert [req.finished() for req in reqs] == [i == FAULT_ROW for i in range(len(reqs))]
    # The operator learns which request: one event with SGLang's rid, one count.
    [ended] = [e for e in logs if e["event"] == "guardrails.request_aborted"]
    assert ended["request_id"] == poisoned.rid == f"req-{FAULT_ROW}"
    assert (ended["hook"], ended["site"], ended["reason"]) == (
        hook.HOOK,
        hook.SITE,
        "nonfinite_logits",
    )
    assert (ended["status"], ended["finish_reason"]) == (503, "abort")
    labels = {"hook": hook.HOOK, "reason": "nonfinite_logits", "rank": "0"}
    assert registry.get_sample_value("guardrails_requests_aborted_total", labels) == 1.0
    outcome(
        component="scheduler abort hook",
        dtype="float32",
        mode="random",
        fault="all_nan",
        unguarded=unguarded,
        guarded="FINISH_ABORT 503 ServiceUnavailableError, skip_radix_cache_insert",
    )


def test_an_all_neginf_request_is_aborted_and_the_clean_ones_are_not(engine: Any) -> None:
    reqs = guarded_decode_step(engine, torch.bfloat16, "all_neginf", "top_k_top_p")
    ended = [type(req.finished_reason).__name__ if req.finished() else None for req in reqs]
    assert ended == ["FINISH_ABORT" if i == FAULT_ROW else None for i in range(len(reqs))]


def test_healed_nan_entries_do_not_abort(engine: Any) -> None:
    reqs = guarded_decode_step(engine, torch.float32, "nan_entries", "greedy")
    assert not any(req.finished() for req in reqs)


def test_the_hook_wraps_sglangs_own_result_processor_and_sampler(engine: Any) -> None:
    import sglang.srt.managers.scheduler_components.batch_result_processor as results
    from sglang.srt.layers.sampler import Sampler

    with guarded(hooks=False) as guards:
        handles = guards.install_hooks()
        assert {h.target: h.state for h in handles} == {
            "Sampler.forward": "applied",
            "SchedulerBatchResultProcessor.process_batch_result_prefill": "applied",
            "SchedulerBatchResultProcessor.process_batch_result_decode": "applied",
        }
        processor = results.SchedulerBatchResultProcessor
        assert hasattr(processor.process_batch_result_decode, "__wrapped__")
        assert hasattr(Sampler.forward, "__wrapped__")
        for handle in handles:
            handle.remove()
    assert not hasattr(processor.process_batch_result_decode, "__wrapped__")


def test_an_error_inside_the_hook_never_breaks_the_engines_call(engine: Any) -> None:
    half = hook._SchedulerHalf()
    broken = SimpleNamespace(logits_output=SimpleNamespace(**{hook.MARKS_ATTR: "not marks"}))
    assert half(lambda *args, **kwargs: "engine ran", None, (SimpleNamespace(), broken), {}) == (
        "engine ran"
    )
    assert half._failed.failures == 1


def kv_pools(rows: int, width: int = 16) -> tuple[Any, Any]:
    """SGLang's own request-to-slot table and MHA KV pool, on the CPU (2 layers)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    table = ReqToTokenPool(rows, width, "cpu", False)
    kv = MHATokenToKVPool(rows * width + 1, 1, torch.bfloat16, 2, 8, 2, "cpu", False)
    return table, kv


def test_the_aborted_requests_own_kv_slots_are_zeroed_and_nothing_else(engine: Any) -> None:
    logits = clean_logits(torch.float32)
    inject(logits, "all_nan")
    rows = logits.shape[0]
    reqs = make_reqs(rows)
    table, kv = kv_pools(rows)
    seq_len, shared = 6, 2
    for i, req in enumerate(reqs):
        # Where each version keeps a request's KV bookkeeping: 0.5.23 in `req.kv`.
        info = req.kv if hasattr(getattr(req, "kv", None), "kv_allocated_len") else req
        info.req_pool_idx = i
        table.req_to_token[i] = torch.arange(1 + i * 16, 1 + i * 16 + 16, dtype=torch.int32)
        # The poisoned request matched 2 tokens in the radix cache: those slots are shared.
        info.cache_protected_len = shared if i == FAULT_ROW else 0
        info.kv_allocated_len = seq_len
    for layer in range(2):
        for buffer in kv.get_kv_buffer(layer):
            buffer.fill_(1.0)
            buffer[table.req_to_token[FAULT_ROW, shared:seq_len].long()] = float("nan")
    # As on SGLang's server: the pools are the scheduler's (the result processor's
    # receiver); the batch whose results are processed holds no allocator any more.
    scheduler = SimpleNamespace(
        req_to_token_pool=table,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv),
    )
    batch = SimpleNamespace(
        reqs=reqs,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
    )
    with guarded() as guards, capture_logs() as logs:
        _ids, output = sample(engine, logits, "random")
        half = hook._SchedulerHalf(guards)
        result = SimpleNamespace(logits_output=output)
        half(lambda *args, **kwargs: None, scheduler, (batch, result), {})
    assert reqs[FAULT_ROW].to_finish is not None
    own = table.req_to_token[FAULT_ROW, shared:seq_len].long()
    for layer in range(2):
        for buffer in kv.get_kv_buffer(layer):
            assert torch.equal(buffer[own], torch.zeros_like(buffer[own]))  # NaN gone
            keep = torch.ones(buffer.shape[0], dtype=torch.bool)
            keep[own] = False
            assert torch.equal(buffer[keep], torch.ones_like(buffer[keep]))  # the rest kept
    assert [e for e in logs if e["event"] == "guardrails.hook_error"] == []
    [ended] = [e for e in logs if e["event"] == "guardrails.request_aborted"]
    assert ended["kv_slots_zeroed"] == seq_len - shared
