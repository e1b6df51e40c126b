"""vLLM 0.34.0's standalone CPU runner (Model Runner V2 for CPUs without Triton, vLLM's choice
on non-x86 CPUs: test_runner_choice.py) driven through its own classes: a request whose
logits row had no valid token ends with finish_reason="error", its KV blocks leave the prefix
cache and the blocks it freed are zeroed by the runner's own zeroer.

What runs is vLLM's: `StandaloneCPUModelRunner.__init__`, `load_model` (its `CPUSampler`,
prompt-logprobs and structured-output workers), `finish_requests`/`free_states`/
`add_requests`/`update_requests`, `gather_batch_req_state`, `prepare_inputs`, `sample_tokens`
(`sample`, the guarded `CPUSampler.__call__`, `postprocess_sampled`), `_init_kv_zero_meta`
and its `CPUKVBlockZeroer`, and the `Scheduler` with its `KVCacheManager` and `BlockPool`.
The stand-ins are runner.py's (the model: its hidden states are the test's logits; the block
tables) and these, each labelled STAND-IN below:

- the runner's C++ ops. vLLM's CUDA wheel has no `vllm._C` CPU extension, so the CPU
  runner's batch kernels (`vllm/v1/worker/cpu/input_batch.py`: `prepare_prefill_inputs`,
  `prepare_pos_seq_lens`, `combine_sampled_and_draft_tokens`, `post_update`) and its Gumbel
  sampler (`vllm/v1/worker/cpu/gumbel.py`: `gumbel_sample`) cannot run. Their Python
  wrappers have the signatures of Model Runner V2's Triton versions of the same ops
  (`vllm/v1/worker/gpu/input_batch.py`, `vllm/v1/worker/gpu/sample/gumbel.py`, whose
  signature extends the CPU one with trailing keyword arguments), which run here in Triton's
  interpreter (conftest.py): vLLM's own GPU ops stand in for its CPU ops, where the runner
  and its sampler look them up.
- the KV cache the zeroer reads. `initialize_kv_cache` needs the model's attention layers
  and a CPU attention backend; `KVCacheStandIn` sets what `_init_kv_zero_meta` reads (one
  `AttentionGroup` of vLLM's, the kernel block size, the scheduler's KVCacheConfig, and a
  real KV tensor bound to the layer in the forward context) so vLLM's `CPUKVBlockZeroer`
  zeroes real blocks.

The Triton interpreter's argmax raises on a row that is all NaN (test_sampler.py): unguarded,
such a batch raises here, in the Gumbel stand-in, which says nothing of what vLLM's C++ op
does with it. The unguarded baseline that runs through vLLM's whole step is an all -inf row
(no valid token either, as a grammar over-mask or an overflow makes it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from guardrails import Guardrails
from guardrails.settings.targets import requirement_holds

from ..faults import BLOCK_SIZE, NAN_IDS, NUM_BLOCKS, VOCAB, fault_row, guarded, vllm_config
from .runner import Engine, Step, loaded

pytestmark = [
    pytest.mark.skipif(
        not requirement_holds("vllm>=0.34"),
        reason="the standalone CPU runner came with vLLM 0.34.0",
    ),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

REQS = ["r0", "r1", "r2"]
POISONED = "r1"
PROMPT = [1, 5, 7, 9]
RUNNER_MODULE = "vllm.v1.worker.cpu.standalone_model_runner"
COMPONENT = "standalone CPU runner: StandaloneCPUModelRunner.sample -> CPUSampler.__call__"
# The standalone runner's parts of `vllm.end_poisoned_requests`, and the scheduler's.
STANDALONE_PARTS = {
    "StandaloneCPUModelRunner.sample": "applied",
    "StandaloneCPUModelRunner.update_requests": "applied",
    "Scheduler.update_from_output": "applied",
    "Scheduler.schedule": "applied",
}


@pytest.fixture(autouse=True)
def cpu_op_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """STAND-IN (test only) for the standalone runner's C++ ops (`vllm._C`, absent from the
    CUDA wheel): Model Runner V2's Triton versions of the same ops, same signatures, put
    where the runner and its sampler look them up (they imported them by name)."""
    import vllm.v1.worker.cpu.gumbel as cpu_gumbel
    import vllm.v1.worker.cpu.input_batch as cpu_input_batch
    import vllm.v1.worker.cpu.sampler as cpu_sampler
    import vllm.v1.worker.cpu.standalone_model_runner as standalone
    import vllm.v1.worker.gpu.input_batch as gpu_input_batch
    import vllm.v1.worker.gpu.sample.gumbel as gpu_gumbel

    for name in (
        "prepare_prefill_inputs",
        "prepare_pos_seq_lens",
        "combine_sampled_and_draft_tokens",
        "post_update",
    ):
        op = getattr(gpu_input_batch, name)
        monkeypatch.setattr(cpu_input_batch, name, op)
        monkeypatch.setattr(standalone, name, op)
    monkeypatch.setattr(cpu_gumbel, "gumbel_sample", gpu_gumbel.gumbel_sample)
    monkeypatch.setattr(cpu_sampler, "gumbel_sample", gpu_gumbel.gumbel_sample)


class KVCacheStandIn:
    """STAND-IN (test only) for what the runner's `initialize_kv_cache` leaves for its KV block
    zeroer (`_init_kv_zero_meta`): one full-attention group of vLLM's `AttentionGroup` over
    layer "l0" (the scheduler's only layer), its kernel block size, the scheduler's
    KVCacheConfig, and a KV tensor of NUM_BLOCKS blocks (all NaN: a block zeroed is one
    the zeroer wrote) bound to the layer in the forward context, as vLLM binds it."""

    def __init__(self, runner: Any, kv_cache_config: Any) -> None:
        from vllm.v1.worker.utils import AttentionGroup

        group = kv_cache_config.kv_cache_groups[0]
        spec = group.kv_cache_spec
        self.kv_cache = torch.full(
            (NUM_BLOCKS, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_size), float("nan")
        )
        runner.kv_cache_config = kv_cache_config
        runner.attn_groups = [
            [
                AttentionGroup(
                    backend=object,  # type: ignore[arg-type]  (read by attention only)
                    layer_names=list(group.layer_names),
                    kv_cache_spec=spec,
                    kv_cache_group_id=0,
                )
            ]
        ]
        runner.kernel_block_sizes = [BLOCK_SIZE]
        context = runner.compilation_config.static_forward_context
        for name in group.layer_names:
            context[name] = SimpleNamespace(kv_cache=self.kv_cache)

    def zeroed(self) -> list[int]:
        """The blocks whose every slot is 0."""
        flat = self.kv_cache.flatten(1)
        return [i for i in range(NUM_BLOCKS) if bool((flat[i] == 0).all())]


class Standalone(Engine):
    """The standalone CPU runner and the scheduler that feeds it, stepped as vLLM's engine
    core does with the CPU worker (schedule, execute_model, sample_tokens, update_from_output;
    sync scheduling). Requests are added as for V2's runner (`Engine.add`)."""

    def step(self, logits: Mapping[str, torch.Tensor] | None = None) -> Step:
        """One engine step; `logits[req_id]` is the row the model produces for that request
        (the others: seeded random logits)."""
        return self.update(self.execute(self.scheduler.schedule(), logits))

    def update(self, step: Step) -> Step:
        step.engine_outputs = self.scheduler.update_from_output(step.scheduled, step.output)
        return step

    def execute(self, scheduled: Any, logits: Mapping[str, torch.Tensor] | None = None) -> Step:
        """The runner's execute_model (its request updates and input preparation; the forward
        pass is the model stand-in's: hidden states are logits) and sample_tokens."""
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.cpu.standalone_model_runner import ExecuteModelState

        logits = logits or {}
        runner = self.runner
        with set_current_vllm_config(self.config), torch.inference_mode():
            runner.finish_requests(scheduled)
            runner.free_states(scheduled)
            runner.add_requests(scheduled)
            runner.update_requests(scheduled)
            state, _ = runner.gather_batch_req_state(scheduled, False)
            batch = runner.prepare_inputs(scheduled, state)
            g = torch.Generator().manual_seed(11)
            hidden = torch.randn(batch.num_tokens_after_padding, VOCAB, generator=g) * 3
            rows = batch.logits_indices.tolist()
            for i, req_id in enumerate(batch.req_ids):
                if req_id in logits:
                    hidden[rows[i]] = logits[req_id]
            # What execute_model leaves for sample_tokens (no KV or EC connector).
            runner.execute_model_state = ExecuteModelState(
                input_batch=batch,
                hidden_states=hidden,
                finished_req_ids=set(),
                ec_connector_output=None,
            )
            output = runner.sample_tokens(None)
        return Step(scheduled, batch, output, None)


@contextmanager
def standalone(tmp: Path) -> Iterator[Standalone]:
    """A fresh standalone CPU runner (load_model with runner.py's model stand-in) and a
    scheduler over the same config."""
    from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner

    from ..faults import block_hasher, scheduler

    tmp.mkdir(parents=True, exist_ok=True)
    config = vllm_config(tmp)
    runner = loaded(StandaloneCPUModelRunner, config, tmp)
    yield Standalone(config, runner, scheduler(config), block_hasher(config))


@contextmanager
def hooked() -> Iterator[Guardrails]:
    """The profile's points and hook, as the bootstrap installs them, in a process that
    imported the standalone runner's module (as its CPU worker does)."""
    import vllm.v1.worker.cpu.standalone_model_runner  # noqa: F401

    with guarded() as guards:
        handles = guards.install_hooks()
        try:
            states = {h.target: h.state for h in handles}
            assert {t: states[t] for t in STANDALONE_PARTS} == STANDALONE_PARTS
            points = {(p.point.site, str(p.point.target)): p.state for p in guards.patches()}
            sampler_call = "vllm.v1.worker.cpu.sampler:CPUSampler.__call__"
            assert points[("sampler.logits", sampler_call)] == "applied"
            assert points[("sampler.token_ids", sampler_call)] == "applied"
            yield guards
        finally:
            for handle in handles:
                handle.remove()


def clean_rows() -> dict[str, torch.Tensor]:
    """Each request's own clean row (seeded per request)."""
    return {
        req_id: torch.randn(VOCAB, generator=torch.Generator().manual_seed(20 + i)) * 3
        for i, req_id in enumerate(REQS)
    }


def first_step(
    tmp: Path, rows: Mapping[str, torch.Tensor], *, hook: bool, **params: Any
) -> tuple[Step, dict[tuple[str, str], int]]:
    """The prefill step of r0, r1, r2 (greedy) on a fresh standalone runner, and the guards'
    counts (none unguarded)."""
    params.setdefault("temperature", 0.0)
    with standalone(tmp) as cpu:
        for req_id in REQS:
            cpu.add(req_id, PROMPT, **params)
        if not hook:
            return cpu.step(rows), {}
        with hooked() as guards:
            step = cpu.step(rows)
            counts = guards.counts()
        assert counts[("sampler.logits", "calls")] > 0  # through CPUSampler.__call__
        return step, counts


def test_unguarded_standalone_runner_hands_out_the_token_of_a_row_with_no_valid_token(  # type: ignore[no-untyped-def]
    outcome, tmp_path
) -> None:
    """vLLM 0.34.0's standalone CPU runner as it is: an all -inf row samples a token like any
    other, and the request runs on; an all-NaN row raises for the whole batch here (the
    Triton interpreter's argmax in the Gumbel stand-in)."""
    rows = clean_rows()
    with standalone(tmp_path) as cpu:
        for req_id in REQS:
            cpu.add(req_id, PROMPT, temperature=0.0)
        step = cpu.step({**rows, POISONED: fault_row("all -inf row")})
        got = step.by_id()
        assert got[POISONED].finish_reason is None
        assert len(got[POISONED].new_token_ids) == 1
        assert 0 <= got[POISONED].new_token_ids[0] < VOCAB
        assert step.output.num_nans_in_logits is None  # vLLM counts nothing by default
        assert POISONED in cpu.scheduler.requests
        following = cpu.step()
        assert POISONED in following.scheduled.num_scheduled_tokens
    with standalone(tmp_path / "nan") as cpu:
        for req_id in REQS:
            cpu.add(req_id, PROMPT, temperature=0.0)
        with pytest.raises(Exception, match="All-NaN slice"):
            cpu.step({**rows, POISONED: fault_row("all-NaN row")})
    outcome(
        component=COMPONENT,
        dtype="float32",
        mode="greedy",
        fault="all -inf row (unguarded)",
        unguarded=f"token {got[POISONED].new_token_ids} handed out, request runs on "
        "(all-NaN row: the batch raises in the Triton-interpreter Gumbel stand-in)",
        guarded="(test_a_poisoned_request_of_the_standalone_runner_ends_with_error)",
    )


@pytest.mark.parametrize("compute_nans", [False, True], ids=["default", "COMPUTE_NANS"])
@pytest.mark.parametrize("fault", ["all-NaN row", "all -inf row"])
def test_a_poisoned_request_of_the_standalone_runner_ends_with_error(  # type: ignore[no-untyped-def]
    outcome, tmp_path, monkeypatch, fault, compute_nans
) -> None:
    from vllm.v1.engine import FinishReason

    # The CPUSampler reads it when load_model builds it.
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1" if compute_nans else "0")
    rows = clean_rows()
    bare = first_step(tmp_path / "bare", rows, hook=False)[0].by_id()
    step, counts = first_step(tmp_path / "hooked", {**rows, POISONED: fault_row(fault)}, hook=True)
    got = step.by_id()
    assert counts[("sampler.logits", "rows_no_valid_token")] == 1

    nans = step.output.num_nans_in_logits
    assert nans[POISONED] >= 1
    assert nans["r0"] == 0
    assert nans["r2"] == 0
    assert got[POISONED].finish_reason == FinishReason.ERROR
    assert str(got[POISONED].finish_reason) == "error"
    assert got[POISONED].new_token_ids == []  # the token of the uniform row never leaves
    assert got[POISONED].num_nans_in_logits >= 1
    for clean in ("r0", "r2"):
        assert got[clean].finish_reason is None
        assert got[clean].new_token_ids == bare[clean].new_token_ids
        assert len(got[clean].new_token_ids) == 1
    outcome(
        component=COMPONENT + " -> Scheduler.update_from_output",
        dtype="float32",
        mode="greedy" + (", VLLM_COMPUTE_NANS_IN_LOGITS=1" if compute_nans else ""),
        fault=fault,
        unguarded="see test_unguarded_standalone_runner_hands_out_the_token_of_a_row_with_"
        "no_valid_token",
        guarded=f"no token, finish_reason=error, num_nans_in_logits={nans[POISONED]}; "
        "clean neighbours' tokens as unguarded",
    )


def test_a_row_with_some_nan_entries_is_healed_not_ended(outcome, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = {**clean_rows(), POISONED: fault_row("NaN entries")}
    bare, _ = first_step(tmp_path / "bare", rows, hook=False, logprobs=2)
    step, counts = first_step(tmp_path / "hooked", rows, hook=True, logprobs=2)
    row = rows[POISONED]
    masked = torch.where(row.isnan(), float("-inf"), row)

    def logprobs_of(s: Step, req_id: str) -> Any:
        return s.output.logprobs.logprobs[s.output.req_ids.index(req_id)]

    got = step.by_id()
    assert got[POISONED].finish_reason is None
    assert len(got[POISONED].new_token_ids) == 1
    assert got[POISONED].new_token_ids == [int(masked.argmax())]  # greedy, NaN ids masked
    assert counts[("sampler.logits", "nan")] == len(NAN_IDS)
    assert counts[("sampler.logits", "rows_no_valid_token")] == 0
    # The raw logprobs come from the logits CPUSampler.__call__ received, healed in place.
    assert torch.as_tensor(logprobs_of(step, POISONED)).isfinite().all()
    assert not torch.as_tensor(logprobs_of(bare, POISONED)).isfinite().all()  # unguarded
    assert not any((step.output.num_nans_in_logits or {}).values())  # nothing to end
    outcome(
        component=COMPONENT,
        dtype="float32",
        mode="greedy, logprobs=2",
        fault="NaN entries",
        unguarded=f"token {bare.by_id()[POISONED].new_token_ids}, NaN logprobs",
        guarded=f"token {got[POISONED].new_token_ids} (no NaN id), finite logprobs, not ended",
    )


def long_prompt(seed: int) -> list[int]:
    """Two full KV blocks and a partial one: prefix caching stores the full ones."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2 * BLOCK_SIZE + 8,), generator=g).tolist()


def test_a_poisoned_requests_blocks_leave_the_prefix_cache_and_are_zeroed_by_its_zeroer(  # type: ignore[no-untyped-def]
    outcome, tmp_path
) -> None:
    """The prefix cache (vLLM #55766: retries of a poisoned prompt failed the same way) and
    the KV zeroing of the standalone runner: `update_requests` zeroes the next step's
    `new_block_ids_to_zero` with its `CPUKVBlockZeroer`, which vLLM builds only for caches
    that zero every new block; the hook builds it (`_init_kv_zero_meta`) the first time ids
    are sent."""
    prompts = {"poisoned": long_prompt(1), "clean": long_prompt(2)}
    with standalone(tmp_path) as cpu, hooked():
        kv = KVCacheStandIn(cpu.runner, cpu.scheduler.kv_cache_config)
        assert cpu.runner.kv_block_zeroer is None  # vLLM built none
        for req_id, prompt in prompts.items():
            cpu.add(req_id, prompt, temperature=0.0)
        first = cpu.step({"poisoned": fault_row("all-NaN row")})
        assert first.scheduled.new_block_ids_to_zero is None  # nothing zeroed on a clean path
        assert str(first.by_id()["poisoned"].finish_reason) == "error"
        assert kv.zeroed() == []
        held = list(cpu.scheduler.kv_cache_manager.get_block_ids("clean")[0])
        scheduled = cpu.scheduler.schedule()
        sent = list(scheduled.new_block_ids_to_zero or [])
        following = cpu.update(cpu.execute(scheduled))
        zeroer = cpu.runner.kv_block_zeroer
        zeroed = kv.zeroed()

        # A retry of each prompt: the prefix-cache hit the scheduler finds for it.
        for req_id, prompt in prompts.items():
            cpu.add(f"{req_id}-retry", prompt, temperature=0.0)
        cached = {
            new.req_id.removesuffix("-retry"): new.num_computed_tokens
            for new in cpu.scheduler.schedule().scheduled_new_reqs
        }

    assert sent, "the poisoned request's blocks were not sent to be zeroed"
    assert not set(sent) & set(held)  # never a running request's block
    assert type(zeroer).__name__ == "CPUKVBlockZeroer"  # vLLM's own, built by the hook
    assert zeroed == sorted(sent)  # every sent block, and only those, zeroed
    assert str(following.by_id()["clean"].finish_reason) != "error"
    assert cached["poisoned"] == 0
    assert cached["clean"] == 2 * BLOCK_SIZE
    outcome(
        component="standalone CPU runner: Scheduler.schedule -> "
        "StandaloneCPUModelRunner.update_requests (KV zeroing), prefix cache",
        dtype="float32",
        mode="prefix caching",
        fault="all-NaN row at prefill",
        unguarded="(vLLM alone: the request is not ended, its blocks stay cached and are "
        "reused as they are; the runner builds no zeroer)",
        guarded=f"retry hits {cached['poisoned']} cached tokens (clean: {cached['clean']}); "
        f"the next step zeroes blocks {sent} with vLLM's CPUKVBlockZeroer",
    )


def test_where_the_zeroer_cannot_be_built_the_step_runs_and_the_failure_is_logged(  # type: ignore[no-untyped-def]
    tmp_path, caplog
) -> None:
    # vLLM's own _init_kv_zero_meta on a runner without a KV cache: it fails; the runner
    # would assert on the ids it was sent, so they are dropped and the step runs.
    prompts = {"poisoned": long_prompt(1), "clean": long_prompt(2)}
    with (
        caplog.at_level(logging.WARNING, logger="guardrails"),
        standalone(tmp_path) as cpu,
        hooked(),
    ):
        for req_id, prompt in prompts.items():
            cpu.add(req_id, prompt, temperature=0.0)
        cpu.step({"poisoned": fault_row("all-NaN row")})
        scheduled = cpu.scheduler.schedule()
        assert scheduled.new_block_ids_to_zero
        following = cpu.update(cpu.execute(scheduled))
    assert following.scheduled.new_block_ids_to_zero is None
    assert str(following.by_id()["clean"].finish_reason) != "error"
    assert "guardrails.hook_error" in caplog.text
    assert "StandaloneCPUModelRunner.update_requests" in caplog.text


def break_the_runner_half(monkeypatch: pytest.MonkeyPatch) -> None:
    """FAULT INJECTION (test only): a bug in the runner half of the hook."""
    from guardrails.integrations import vllm as hook

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug in guardrails")

    monkeypatch.setattr(hook._RunnerV2Half, "_report", broken)


def test_a_failure_of_the_runner_half_leaves_the_step_as_if_unhooked(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch, caplog
) -> None:
    break_the_runner_half(monkeypatch)
    rows = {**clean_rows(), POISONED: fault_row("all -inf row")}
    with caplog.at_level(logging.WARNING, logger="guardrails"):
        got = first_step(tmp_path, rows, hook=True)[0].by_id()
    assert [got[r].finish_reason for r in REQS] == [None, None, None]
    assert [len(got[r].new_token_ids) for r in REQS] == [1, 1, 1]
    assert "guardrails.hook_error" in caplog.text
    assert "a bug in guardrails" in caplog.text


def test_a_failure_of_the_runner_half_names_the_standalone_runners_method(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch, caplog
) -> None:
    break_the_runner_half(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="guardrails"):
        first_step(tmp_path, {POISONED: fault_row("all -inf row")}, hook=True)
    assert "guardrails.hook_error" in caplog.text
    assert "StandaloneCPUModelRunner.sample" in caplog.text
    assert "GPUModelRunner.sample" not in caplog.text.replace("StandaloneCPUModelRunner", "")


@pytest.mark.parametrize("fault", ["all -inf row", "all-NaN row"])
def test_with_vllms_raise_on_nans_only_a_row_that_held_nan_makes_vllm_raise(  # type: ignore[no-untyped-def]
    outcome, tmp_path, monkeypatch, fault
) -> None:
    """VLLM_RAISE_ON_LOGIT_NANS=1 (vLLM's CI mode): the standalone runner's sample_tokens
    raises for any NaN count in its output. An all -inf row (no NaN in it) must not make
    vLLM raise; an all-NaN row raises, as vLLM's own check would have."""
    monkeypatch.setenv("VLLM_RAISE_ON_LOGIT_NANS", "1")
    rows = {**clean_rows(), POISONED: fault_row(fault)}
    if fault == "all-NaN row":
        with pytest.raises(RuntimeError, match="NaNs detected in logits"):
            first_step(tmp_path, rows, hook=True)
        observed = "vLLM raised (its CI mode), as for NaN logits"
    else:
        step, counts = first_step(tmp_path, rows, hook=True)
        assert step.by_id()[POISONED].finish_reason is None  # healed and counted, not ended
        assert counts[("sampler.logits", "rows_no_valid_token")] == 1
        observed = "no raise: healed and counted (not ended in this mode)"
    outcome(
        component=COMPONENT + ", VLLM_RAISE_ON_LOGIT_NANS=1",
        dtype="float32",
        mode="greedy",
        fault=fault,
        unguarded="(vLLM raises only for NaN it counts)",
        guarded=observed,
    )
