"""vLLM 0.33.0's own sampler, scheduler and output classes, driven on CPU with faults injected.

Without an accelerator vLLM's platform is "unspecified": `Sampler` takes its PyTorch-native
path (greedy: argmax; random and top-k/top-p: `TopKTopPSampler.forward_native`). What runs
here is vLLM's code; only the inputs (logits, metadata, model runner output) are built by the
tests, as vLLM's InputBatch and model runner build them.
"""

from __future__ import annotations

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


def profile_settings(**overrides: object) -> gr.GuardSettings:
    return gr.GuardSettings(environ={"GUARDRAILS_CONFIG_FILE": str(PROFILE)}, **overrides)


@contextmanager
def guarded(**overrides: object) -> Iterator[gr.Guardrails]:
    """A fresh Guardrails with the vLLM profile's [[attach]] entries applied in-process (as
    `guardrails run` does; vLLM's classes are patched) and removed on leaving."""
    guards = gr.Guardrails(profile_settings(**overrides), registry=CollectorRegistry())
    handles = guards.attach_configured()
    try:
        yield guards
    finally:
        for handle in handles:
            handle.remove()
        guards.close()


def ids_of(output) -> list[int]:  # type: ignore[no-untyped-def]
    return output.sampled_token_ids.flatten().tolist()
