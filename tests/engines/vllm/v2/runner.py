"""vLLM 0.33.0's Model Runner V2, its sampler and its scheduler path, driven on the CPU.

What runs is vLLM's: `GPUModelRunner.__init__`, `load_model` (model states, the `Sampler`,
the prompt-logprobs and structured-output workers, built from the VllmConfig),
`finish_requests`/`add_requests`/`update_requests`, `gather_batch_req_state`,
`prepare_inputs`, `sample_tokens` (`sample`, `Sampler.__call__` or the `RejectionSampler`,
`AsyncOutput`, `postprocess_sampled`), `AsyncOutput.get_output`, and the `Scheduler` with its
`KVCacheManager` and `BlockPool`; V2's Triton kernels run in Triton's interpreter (see
conftest.py). The stand-ins, each for what cannot run on a CPU with vLLM's CUDA wheel, are
labelled STAND-IN below:

- the model: the forward pass needs an attention backend, which the CUDA wheel has none of
  for a CPU. `LogitsModel` has what `sample_tokens` calls on the model, `compute_logits`,
  written as LlamaForCausalLM's (vLLM's `LogitsProcessor` on a `ParallelLMHead`), with the
  processor's `logits_as_input` mode, so the hidden states a test passes are the logits the
  model produces: faults are injected there.
- the KV cache side of the runner (`initialize_kv_cache` allocates KV tensors and builds
  attention metadata builders): `BlockTablesStandIn` takes the block ids the scheduler hands
  out and the batch descriptor is the one `dispatch_cg_and_sync_dp` returns for an eager
  step; nothing reads a KV cache because no forward pass runs.
- the platform's memory probe (`load_model` measures device memory; the unspecified
  platform has none to measure), and two of V2's Triton kernels that Triton's interpreter
  cannot run: top-k/top-p (it asks the platform for a compute-unit count), for which vLLM's
  own PyTorch top-k/top-p (`apply_top_k_top_p_pytorch`) stands in, and the NaN count of
  VLLM_COMPUTE_NANS_IN_LOGITS (`get_num_nans`: CUDA's libdevice `isnan`), for which a
  PyTorch count of the same per-row values stands in.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ..faults import VOCAB, vllm_config

DEVICE = torch.device("cpu")


class LogitsModel(torch.nn.Module):
    """STAND-IN (test only) for a loaded model: `compute_logits` as vLLM's Llama writes it,
    with a `LogitsProcessor(logits_as_input=True)`, so the runner's hidden states are the
    logits."""

    def __init__(self, vocab: int = VOCAB) -> None:
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        super().__init__()
        self.lm_head = ParallelLMHead(vocab, 64)
        self.logits_processor = LogitsProcessor(vocab, logits_as_input=True)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)  # type: ignore[no-any-return]


class BlockTablesStandIn:
    """STAND-IN (test only) for V2's BlockTables, which initialize_kv_cache builds with the
    KV cache: keeps the block ids the scheduler assigned, per request slot."""

    def __init__(self) -> None:
        self.block_ids: dict[int, Any] = {}

    def append_block_ids(self, req_index: int, block_ids: Any, overwrite: bool) -> None:
        if overwrite or req_index not in self.block_ids:
            self.block_ids[req_index] = block_ids

    def apply_staged_writes(self) -> None:
        pass


def top_k_top_p_stand_in(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    has_topp_only_rows: bool = True,
) -> torch.Tensor:
    """STAND-IN (test only) for V2's Triton top-k/top-p kernel: vLLM's own PyTorch version,
    which vLLM itself runs where Triton is missing."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)  # type: ignore[no-any-return]


def num_nans_stand_in(logits: torch.Tensor) -> torch.Tensor:
    """STAND-IN (test only) for V2's Triton `get_num_nans` (vllm/v1/worker/gpu/metrics/
    logits.py): the NaN count of each row, int32, as its kernel stores it."""
    return logits.float().isnan().sum(dim=-1, dtype=torch.int32)


def apply_cpu_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process-level stand-ins: V2's top-k/top-p and NaN count, load_model's memory
    probe."""
    import vllm.v1.worker.gpu.sample.sampler as v2_sampler
    import vllm.v1.worker.gpu.spec_decode.rejection_sampler as v2_rejection
    from vllm.platforms import current_platform

    monkeypatch.setattr(v2_sampler, "apply_top_k_top_p", top_k_top_p_stand_in)
    monkeypatch.setattr(v2_sampler, "get_num_nans", num_nans_stand_in)
    monkeypatch.setattr(v2_rejection, "get_num_nans", num_nans_stand_in)
    # STAND-IN (test only): the unspecified platform has no device memory to report.
    monkeypatch.setattr(
        type(current_platform), "get_current_memory_usage", classmethod(lambda cls, d=None: 0.0)
    )


_distributed: list[bool] = []


def init_distributed(config: Any, tmp: Path) -> None:
    """One-process tensor/pipeline groups on gloo, as a single-GPU worker has (V2's runner
    reads its PP and TP rank at construction); once per process."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    if _distributed:
        return
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{tmp / 'dist-init'}",
        local_rank=0,
        backend="gloo",
    )
    with set_current_vllm_config(config):
        initialize_model_parallel(1, 1)
    _distributed.append(True)


@dataclass
class Engine:
    """A V2 model runner and the scheduler that feeds it, stepped as vLLM's engine core does
    (schedule, execute, sample, get_output, update_from_output)."""

    config: Any
    runner: Any
    scheduler: Any
    block_hasher: Any

    def add(self, req_id: str, prompt: list[int], **params: Any) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params.setdefault("max_tokens", 8)
        request = Request(
            req_id, prompt, SamplingParams(**params), None, block_hasher=self.block_hasher
        )
        self.scheduler.add_request(request)

    def step(self, logits: Mapping[str, torch.Tensor] | None = None) -> Step:
        """One engine step (sync scheduling); `logits[req_id]` is what the model produces for
        that request: a row, or one row per logit under speculative decoding (the other
        rows: seeded random logits)."""
        return self.update(self.execute(self.scheduler.schedule(), logits))

    def update(self, step: Step) -> Step:
        """The engine core's update_from_output of an executed step (and post_step)."""
        step.engine_outputs = self.scheduler.update_from_output(step.scheduled, step.output)
        if self.runner.speculator is not None:
            # EngineCore.post_step (sync scheduling): the drafts for the next step.
            drafts = self.runner.take_draft_token_ids()
            if drafts is not None:
                self.scheduler.update_draft_token_ids(drafts)
        return step

    def execute(self, scheduled: Any, logits: Mapping[str, torch.Tensor] | None = None) -> Step:
        """The worker's execute_model and sample_tokens, and the executor's get_output, for
        a scheduled step."""
        from vllm.config import set_current_vllm_config
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
        from vllm.v1.worker.gpu.model_runner import ExecuteModelState

        logits = logits or {}
        runner = self.runner
        vocab = VOCAB
        with set_current_vllm_config(self.config), torch.inference_mode():
            # execute_model's request-state updates, then its input preparation.
            runner.finish_requests(scheduled)
            runner.free_states(scheduled)
            runner.add_requests(scheduled)
            runner.update_requests(scheduled)
            runner.block_tables.apply_staged_writes()
            state, _ = runner.gather_batch_req_state(scheduled, False)
            # STAND-IN (test only): the eager descriptor dispatch_cg_and_sync_dp returns.
            desc = BatchExecutionDescriptor(
                cg_mode=CUDAGraphMode.NONE, num_tokens=state.num_tokens, num_reqs=None
            )
            batch = runner.prepare_inputs(scheduled, state, desc, 0)
            g = torch.Generator().manual_seed(11)
            hidden = torch.randn(batch.num_tokens_after_padding, vocab, generator=g) * 3
            rows = batch.logits_indices.tolist()
            cu = batch.cu_num_logits_np.tolist()
            for i, req_id in enumerate(batch.req_ids):
                if req_id in logits:
                    # One row per logit of the request: its draft targets, then its bonus.
                    hidden[rows[cu[i] : cu[i + 1]]] = logits[req_id]
            # What execute_model leaves for sample_tokens (no KV connector).
            runner.execute_model_state = ExecuteModelState(
                input_batch=batch,
                attn_metadata=None,
                slot_mappings_by_layer=None,
                hidden_states=hidden,
                aux_hidden_states=None,
                dp_sync_state=None,
                finished_req_ids=set(),
                ec_connector_output=None,
                cudagraph_stats=None,
                num_spec_tokens_to_schedule=scheduled.num_spec_tokens_to_schedule,
            )
            output = runner.sample_tokens(None).get_output()
        return Step(scheduled, batch, output, None)


class DrafterStandIn:
    """STAND-IN (test only) for the drafter's proposal (the n-gram speculator's Triton scan
    does not run in Triton's interpreter): `propose` returns the draft ids the test set, as
    a [num_reqs, num_speculative_steps] tensor, which V2 then schedules and verifies."""

    def __init__(self, runner: Any, drafts: list[int]) -> None:
        self.drafts = drafts
        runner.speculator.propose = self.propose

    def propose(self, input_batch: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor([self.drafts] * input_batch.num_reqs, dtype=torch.int64)


@dataclass
class Step:
    scheduled: Any
    batch: Any  # the InputBatch prepare_inputs made
    output: Any  # ModelRunnerOutput, as the executor hands it to the engine core
    engine_outputs: Any  # update_from_output's, once the engine core has run it

    def by_id(self) -> dict[str, Any]:
        return {o.request_id: o for eco in self.engine_outputs.values() for o in eco.outputs}


@contextmanager
def engine(
    tmp: Path, *, speculative_tokens: int = 0, async_scheduling: bool = False
) -> Iterator[Engine]:
    """A fresh V2 runner (load_model with the LogitsModel stand-in) and scheduler; with
    `speculative_tokens`, vLLM's n-gram speculative decoding (prompt lookup: no draft model),
    so that V2 verifies drafts with its RejectionSampler; with `async_scheduling`, vLLM's
    AsyncScheduler (the engine core then schedules a step before the previous one's output is
    in: `execute` and `update` apart)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from ..faults import block_hasher, scheduler

    config = vllm_config(tmp, async_scheduling=async_scheduling)
    if speculative_tokens:
        from vllm.config import SpeculativeConfig

        config.speculative_config = SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=speculative_tokens,
            prompt_lookup_min=1,
            prompt_lookup_max=3,
            target_model_config=config.model_config,
            target_parallel_config=config.parallel_config,
        )
    runner = loaded(GPUModelRunner, config, tmp)
    yield Engine(config, runner, scheduler(config), block_hasher(config))


def loaded(runner_class: Any, config: Any, tmp: Path) -> Any:
    """A model runner of `runner_class` built from `config` with the LogitsModel stand-in
    loaded and the BlockTables stand-in (the one-process groups made first)."""
    from vllm.config import set_current_vllm_config

    init_distributed(config, tmp)
    with set_current_vllm_config(config):
        runner = runner_class(config, DEVICE)
        runner.load_model(model=LogitsModel())
    runner.block_tables = BlockTablesStandIn()
    return runner
