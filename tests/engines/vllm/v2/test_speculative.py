"""Model Runner V2's speculative decoding: V2 samples a step with drafts from its
`RejectionSampler.__call__` alone (the target logits, bonus rows included), so the profile
guards those logits as that step's `sampler.logits`, and the hook ends a request with a
target row without a valid token.

vLLM's n-gram speculative decoding is configured (no draft model); V2 schedules the drafts,
lays out one logits row per draft target and bonus token (prepare_inputs), and verifies them
with its RejectionSampler's kernels in Triton's interpreter. The drafter's proposal is the
labelled stand-in of runner.py (its Triton scan does not run in the interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ..faults import VOCAB
from .runner import DrafterStandIn, Engine, engine
from .test_poisoned_requests import hooked

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPT = [1, 5, 7, 9, 1, 5, 7, 9, 1, 5, 7]
DRAFTS = [9, 1]
BONUS = 5
FAULTS = ["clean", "NaN entries (draft target)", "+Inf at the bonus token", "all-NaN target row"]


def targets(fault: str) -> torch.Tensor:
    """The target rows of one request: for draft 9, for draft 1, the bonus row (5 on top)."""
    rows = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8))
    for row, top in enumerate([*DRAFTS, BONUS]):
        rows[row, top] = 12.0
    if fault == "NaN entries (draft target)":
        rows[1, [55, 70]] = float("nan")
    elif fault == "+Inf at the bonus token":
        rows[2, BONUS] = float("inf")
    elif fault == "all-NaN target row":
        rows[1] = float("nan")
    return rows


def drafting(v2: Engine, **params: Any) -> dict[str, Any]:
    """Two requests prefilled (a draft-free step: Sampler.__call__), drafts proposed;
    `params`: their other sampling parameters."""
    DrafterStandIn(v2.runner, DRAFTS)
    for req_id in ("r0", "r1"):
        v2.add(req_id, PROMPT, temperature=0.0, **params)
    first = one_hot_rows(DRAFTS[0])
    return v2.step({"r0": first, "r1": first}).by_id()


def one_hot_rows(top: int) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[top] = 12.0
    return row


@pytest.fixture
def v2(tmp_path: Path) -> Iterator[Engine]:
    with engine(tmp_path, speculative_tokens=len(DRAFTS)) as built:
        yield built


@pytest.mark.parametrize("fault", FAULTS)
def test_v2_verification_is_guarded_as_the_steps_sampler_logits(outcome, v2, fault) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.engine import FinishReason

    with hooked() as guards:
        drafting(v2)
        step = v2.step({"r0": targets("clean"), "r1": targets(fault)})
        counts = guards.counts()
    got = step.by_id()
    assert step.batch.num_draft_tokens == 2 * len(DRAFTS)  # V2 verified drafts this step
    # Prefill through Sampler.__call__, then verification through RejectionSampler.__call__.
    assert counts[("sampler.logits", "calls")] == 2
    assert counts[("sampler.token_ids", "calls")] == 1
    assert got["r0"].new_token_ids == [*DRAFTS, BONUS]
    bad = {"clean": 0, "NaN entries (draft target)": 2, "+Inf at the bonus token": 1}
    if fault == "all-NaN target row":
        assert counts[("sampler.logits", "rows_no_valid_token")] == 1
        assert step.output.num_nans_in_logits == {"r0": 0, "r1": 1}  # one count per request
        assert got["r1"].finish_reason == FinishReason.ERROR
        assert got["r1"].new_token_ids == []
        guarded_text = "no token, finish_reason=error (request ended)"
    else:
        assert (
            counts[("sampler.logits", "nan")] + counts[("sampler.logits", "posinf")] == (bad[fault])
        )
        assert got["r1"].new_token_ids == [*DRAFTS, BONUS]  # healed: drafts and bonus accepted
        assert got["r1"].finish_reason is None
        guarded_text = f"ids {got['r1'].new_token_ids}"
    outcome(
        component="V2 RejectionSampler.__call__",
        dtype="float32",
        mode="greedy n-gram spec decode (drafter: stand-in)",
        fault=fault,
        unguarded="(not run: the interpreter's NaN ordering is not the GPU's)",
        guarded=guarded_text,
    )


def test_vllms_own_nan_counts_are_summed_per_request_under_v2_verification(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch
) -> None:
    """With VLLM_COMPUTE_NANS_IN_LOGITS, V2's RejectionSampler counts NaNs per logits row and
    get_output pairs those counts with request ids one to one; the hook reduces them per
    request first (the counts are of the healed rows, so 0 where nothing was poisoned)."""
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
    with engine(tmp_path, speculative_tokens=len(DRAFTS)) as v2, hooked():
        assert v2.runner.sampler.compute_nans
        drafting(v2)
        step = v2.step({"r0": targets("clean"), "r1": targets("all-NaN target row")})
    assert step.output.num_nans_in_logits == {"r0": 0, "r1": 1}
    assert str(step.by_id()["r1"].finish_reason) == "error"
