"""EAGLE verification's target logits, guarded at `eagle.verify` before SGLang reads them.

The profile's target per version: 0.5.14+ `eagle_utils.eagle_sample`, 0.5.13
`EagleVerifyInputV2Mixin.sample` (what the EAGLE v2 worker calls). What cannot run here: the
tree verification after the argmax. On CUDA it is SGLang's own kernel; on a CPU it needs the
sgl_kernel CPU extension (SGLANG_USE_CPU_ENGINE=1), which these venvs cannot install. Without
either, 0.5.23's `verify_tree_greedy_func` matches no platform branch and returns its buffers
untouched, so its result means nothing here; the test records how the call ended and checks
what the verification reads, because the guard runs before the call: the healed logits,
their counts, and the +Inf entry still on top. The verify input and batch are namespaces with the
fields the function reads (the real ones need a draft worker and a KV pool).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch

from tests.engines.sglang.engine import NEW, POSINF_COL, V, batch_info, clean_logits, guarded

BS, DRAFT = 2, 3  # requests, draft tokens per request: logits rows = BS * DRAFT
NAN_ROW, POSINF_ROW = 1, 4


def verify(engine: Any, output: Any) -> str:
    """Call the profile's target for this version; returns SGLang's outcome, observed."""
    rows = BS * DRAFT
    verify_input = SimpleNamespace(
        draft_token=torch.zeros(rows, dtype=torch.int64),
        draft_token_num=DRAFT,
        spec_steps=DRAFT - 1,
        topk=1,
        max_tree_depth=DRAFT,
        tree_topk=1,
        retrieve_index=torch.arange(rows).view(BS, DRAFT),
        retrieve_next_token=torch.full((BS, DRAFT), -1),
        retrieve_next_sibling=torch.full((BS, DRAFT), -1),
        draft_probs=None,
        custom_mask=None,
        positions=torch.zeros(rows, dtype=torch.int64),
    )
    batch = SimpleNamespace(
        device="cpu",
        forward_mode=SimpleNamespace(is_idle=lambda: False),
        seq_lens=torch.ones(BS, dtype=torch.int64),
        sampling_info=batch_info(engine, "greedy", BS, V),
        return_logprob=False,
    )
    try:
        if NEW:
            from sglang.srt.speculative import eagle_utils

            eagle_utils.eagle_sample(verify_input, batch, output)
        else:
            from sglang.srt.speculative import eagle_info_v2

            eagle_info_v2.EagleVerifyInputV2Mixin.sample(verify_input, batch, output)
    except Exception as exc:  # the tree kernel this machine lacks: observed, not hidden
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
    return "returned"


def faulty_logits() -> torch.Tensor:
    logits = clean_logits(torch.float32, rows=BS * DRAFT)
    logits[NAN_ROW] = math.nan
    logits[POSINF_ROW, POSINF_COL] = math.inf
    return logits


def test_eagle_verify_logits_are_healed_and_counted_before_sglang_reads_them(
    engine: Any, outcome: Any
) -> None:
    unguarded_logits = faulty_logits()
    unguarded = verify(engine, engine.LogitsProcessorOutput(next_token_logits=unguarded_logits))
    left = int((~torch.isfinite(unguarded_logits)).sum())
    logits = faulty_logits()
    with guarded() as guards:
        guarded_call = verify(engine, engine.LogitsProcessorOutput(next_token_logits=logits))
        counts = {
            k: guards.count("eagle.verify", k) for k in ("nan", "posinf", "rows_no_valid_token")
        }
    assert counts == {"nan": V, "posinf": 1, "rows_no_valid_token": 1}
    assert torch.isfinite(logits).all()
    assert logits[POSINF_ROW].argmax().item() == POSINF_COL
    outcome(
        component="EAGLE verify (eagle_sample)" if NEW else "EAGLE verify (V2 sample)",
        dtype="float32",
        mode="greedy",
        fault="all-NaN row + one +Inf",
        unguarded=f"{left} non-finite logits reach verify; {unguarded}",
        guarded=f"healed, counted {V} NaN + 1 +Inf, +Inf on top; {guarded_call}",
    )
