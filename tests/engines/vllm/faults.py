"""vLLM 0.33.0's own sampler, scheduler and output classes, driven on CPU with faults injected.

Without an accelerator vLLM's platform is "unspecified": `Sampler` takes its PyTorch-native
path (greedy: argmax; random and top-k/top-p: `TopKTopPSampler.forward_native`). What runs
here is vLLM's code; only the inputs (logits, metadata, model runner output) are built by the
tests, as vLLM's InputBatch and model runner build them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

import guardrails as gr

PROFILE = Path(__file__).resolve().parents[3] / "config" / "profiles" / "vllm.toml"
VOCAB = 4096
NAN = float("nan")
INF = float("inf")

# The batch every sampler case runs: one row per fault, seeded logits (std 3).
CLEAN, NAN_ENTRIES, POSINF, ALL_NAN, ALL_NEGINF, MASKED = range(6)
ROWS = 6
NAN_IDS = [5, 17, 900]
POSINF_ID = 311
MASKED_UPTO = 2000  # row MASKED: ids [0, 2000) are -inf (an allowed-token style mask)


def faulty_logits(dtype: torch.dtype, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, vocab, generator=g) * 3
    x[NAN_ENTRIES, NAN_IDS] = NAN
    x[POSINF, POSINF_ID] = INF
    x[ALL_NAN] = NAN
    x[ALL_NEGINF] = -INF
    x[MASKED, :MASKED_UPTO] = -INF
    return x.to(dtype)


def masked_reference(x: torch.Tensor) -> torch.Tensor:
    """What a healed batch must sample like: NaN entries masked (-inf) in rows that keep a
    valid entry."""
    ref = x.clone()
    ref[NAN_ENTRIES, NAN_IDS] = -INF
    return ref


def metadata(mode: str, rows: int = ROWS, *, logprobs: int | None = None):  # type: ignore[no-untyped-def]
    """SamplingMetadata as vLLM's InputBatch makes it for `rows` requests of one mode, with a
    seeded generator per request (so that two runs draw the same noise)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    greedy = mode == "greedy"
    return SamplingMetadata(
        temperature=None if greedy else torch.full((rows,), 0.8),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=torch.full((rows,), 0.9) if mode == "top-k/top-p" else None,
        top_k=torch.full((rows,), 50, dtype=torch.int64) if mode == "top-k/top-p" else None,
        generators={}
        if greedy
        else {i: torch.Generator().manual_seed(100 + i) for i in range(rows)},
        max_num_logprobs=logprobs,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


# A one-layer Llama config: the scheduler and the model runners need a model config, never
# weights or a tokenizer.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BLOCK_SIZE = 16
NUM_BLOCKS = 64


def vllm_config(model_dir: Path, *, async_scheduling: bool = False):  # type: ignore[no-untyped-def]
    """A VllmConfig of a local config.json (written into `model_dir`), on the CPU device.
    vLLM 0.33.0 turns async scheduling on by default; the tests say which they run."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG))
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, max_model_len=512, dtype="float32"
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig(device="cpu"),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS  # what the engine core sets after profiling
    config.scheduler_config.async_scheduling = async_scheduling
    return config


def scheduler(config):  # type: ignore[no-untyped-def]
    """vLLM's own Scheduler (with its KVCacheManager and BlockPool, prefix caching on, as
    vLLM defaults) over a KV cache of NUM_BLOCKS blocks of one full-attention group; its
    AsyncScheduler when the config says async_scheduling, as vLLM picks the class."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=4, head_size=16, dtype=torch.float32
    )
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    cls = AsyncScheduler if config.scheduler_config.async_scheduling else Scheduler
    return cls(
        config,
        kv,
        StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
        include_finished_set=True,
    )


def block_hasher(config):  # type: ignore[no-untyped-def]
    """The per-request block hasher vLLM's EngineCore gives every Request when prefix
    caching is on (the default): without it a request has no block hashes to cache."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn, config.num_hash_lookahead_tokens)


def profile_settings(profile: Path = PROFILE, **overrides: object) -> gr.GuardSettings:
    return gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(profile)}, **overrides)


def fault_row(fault: str) -> torch.Tensor:
    """One request's logits row for the V2 suites: seeded random logits with `fault`
    ("all-NaN row", "all -inf row" or "NaN entries": only `NAN_IDS`, healable)."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    if fault == "all-NaN row":
        row[:] = float("nan")
    elif fault == "all -inf row":
        row[:] = float("-inf")
    elif fault == "NaN entries":
        row[NAN_IDS] = float("nan")
    else:
        raise ValueError(f"unknown fault {fault!r}")
    return row


def runner_states(v2_imported: bool) -> dict[str, str]:
    """The states of `vllm.end_poisoned_requests`' parts in a process that imported one
    runner's module (V2's when `v2_imported`, else V1's) and the scheduler's, by target:
    the other runners' parts wait for their module (pending), or are for other versions of
    vLLM (inapplicable: V1's from 0.34.0 on, the standalone CPU runner's before it)."""
    from guardrails.settings.targets import requirement_holds

    v034 = bool(requirement_holds("vllm>=0.34"))
    v1 = "inapplicable" if v034 else ("pending" if v2_imported else "applied")
    v2 = "applied" if v2_imported else "pending"
    # Applied once a test of this process imported it (test_standalone_cpu.py).
    imported = "vllm.v1.worker.cpu.standalone_model_runner" in sys.modules
    standalone = ("applied" if imported else "pending") if v034 else "inapplicable"
    return {
        "GPUModelRunner.sample": v2,
        "StandaloneCPUModelRunner.sample": standalone,
        "GPUModelRunner._bookkeeping_sync": v1,
        "RejectionSampler.forward": v1,  # V1's speculative half
        "Scheduler.update_from_output": "applied",
        "Scheduler.schedule": "applied",
        "GPUModelRunner._zero_block_ids": v1,
        "GPUModelRunner.update_requests": v2,
        "StandaloneCPUModelRunner.update_requests": standalone,
    }


@contextmanager
def guarded(
    profile: Path = PROFILE, registry: CollectorRegistry | None = None, **overrides: object
) -> Iterator[gr.Guardrails]:
    """A fresh Guardrails with the vLLM profile's [[attach]] entries (and its heartbeat)
    applied in-process (as `guardrails run` does; vLLM's classes are patched) and removed on
    leaving."""
    registry = CollectorRegistry() if registry is None else registry
    guards = gr.Guardrails(profile_settings(profile, **overrides), registry=registry)
    handles = guards.attach_configured()
    try:
        yield guards
    finally:
        for handle in [*handles, *guards.heartbeats()]:
            handle.remove()
        guards.close()


def ids_of(output) -> list[int]:  # type: ignore[no-untyped-def]
    return output.sampled_token_ids.flatten().tolist()
