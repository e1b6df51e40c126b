"""vLLM's real `RejectionSampler.forward` (greedy speculative verification) with faults in the
target and bonus logits, unguarded and guarded by the profile's eagle.verify site.

One piece cannot run on CPU: the acceptance step `_rejection_greedy_sample` is a Triton
kernel. The test swaps in a PyTorch stand-in for that one kernel (below, labelled), written
from the kernel's source in vLLM 0.33.0; everything around it (bonus sampling through
`Sampler.forward`, index selection, float32 conversion, logits processors) is vLLM's.
"""

from __future__ import annotations

import pytest
import torch

from .faults import VOCAB, guarded, metadata

DRAFT = [11, 12]
BONUS = 13


def greedy_acceptance_stand_in(
    output_token_ids,
    cu_num_draft_tokens,
    draft_token_ids,
    target_argmax,
    bonus_token_ids,
    is_greedy,
    max_spec_len,
    uniform_probs,
    synthetic_conditional_rates,
):  # type: ignore[no-untyped-def]
    """STAND-IN (test only) for vLLM's Triton `rejection_greedy_sample_kernel` (non-synthetic
    mode): per request, accept drafts while they equal the target argmax, write the argmax at
    each visited position, and append the bonus token when nothing was rejected."""
    start = 0
    for req, end in enumerate(cu_num_draft_tokens.tolist()):
        if is_greedy is not None and not bool(is_greedy[req]):
            start = end
            continue
        rejected = False
        for pos in range(end - start):
            token = int(target_argmax[start + pos])
            output_token_ids[req, pos] = token
            rejected = int(draft_token_ids[start + pos]) != token
            if rejected:
                break
        if not rejected:
            output_token_ids[req, end - start] = int(bonus_token_ids.flatten()[req])
        start = end


@pytest.fixture
def rejection_sampler(monkeypatch):  # type: ignore[no-untyped-def]
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler

    sampler = rs.RejectionSampler(Sampler())  # registers the real kernels' warm-ups
    monkeypatch.setattr(rs, "_rejection_greedy_sample", greedy_acceptance_stand_in)
    return sampler


def spec_metadata():  # type: ignore[no-untyped-def]
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    # As GPUModelRunner._calc_spec_decode_metadata lays out one request with two drafts:
    # logits rows [draft 1, draft 2, bonus].
    i32 = torch.int32
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(DRAFT, dtype=i32),
        num_draft_tokens=[len(DRAFT)],
        cu_num_draft_tokens=torch.tensor([2], dtype=i32),
        cu_num_sampled_tokens=torch.tensor([3], dtype=i32),
        target_logits_indices=torch.tensor([0, 1], dtype=i32),
        bonus_logits_indices=torch.tensor([2], dtype=i32),
        logits_indices=torch.tensor([0, 1, 2], dtype=i32),
    )


def target_logits(fault: str) -> torch.Tensor:
    """Rows: target for draft 11, target for draft 12, bonus row (argmax 13)."""
    x = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    for row, top in enumerate([*DRAFT, BONUS]):
        x[row, top] = 8.0
    if fault == "NaN entries (bonus row)":
        x[2, [55, 70]] = float("nan")
    elif fault == "NaN entries (target row)":
        x[1, [55, 70]] = float("nan")
    elif fault == "+Inf at the bonus token":
        x[2, BONUS] = float("inf")
    elif fault == "+Inf at a draft token":
        x[0, DRAFT[0]] = float("inf")
    return x


FAULTS = [
    "clean",
    "NaN entries (bonus row)",
    "NaN entries (target row)",
    "+Inf at the bonus token",
    "+Inf at a draft token",
]


@pytest.mark.parametrize("fault", FAULTS)
def test_guarded_speculative_verification_accepts_the_drafts_and_the_bonus(  # type: ignore[no-untyped-def]
    outcome, rejection_sampler, fault
) -> None:
    logits = target_logits(fault)
    bare = rejection_sampler(spec_metadata(), None, logits.clone(), metadata("greedy", rows=1))
    with guarded() as guards:
        out = rejection_sampler(spec_metadata(), None, logits.clone(), metadata("greedy", rows=1))
        verify = guards.counts()
    ids = out.sampled_token_ids.tolist()[0]
    bare_ids = bare.sampled_token_ids.tolist()[0]
    assert ids == [*DRAFT, BONUS]
    bad = 2 if "NaN" in fault else (1 if "Inf" in fault else 0)
    assert verify[("eagle.verify", "nan")] + verify[("eagle.verify", "posinf")] == bad
    outcome(
        component="RejectionSampler.forward",
        dtype="float32",
        mode="greedy spec decode (Triton acceptance kernel: PyTorch stand-in)",
        fault=fault,
        unguarded=f"ids {bare_ids}" + ("" if bare_ids == [*DRAFT, BONUS] else " (wrong)"),
        guarded=f"ids {ids}",
    )
