"""Model Runner V2's own `Sampler.__call__` on a batch with one fault per row, unguarded and
guarded by the profile (its `[[attach]]` entries applied by `attach_configured()`, as
`guardrails run` applies them).

The sampler is the one V2's `load_model` builds from the VllmConfig; the batch is made as
V2's warm-up makes its sampler batch (`InputBatch.make_dummy`, one `add_request` per row).
Its kernels (Gumbel-max sampling, logprobs, NaN count) run in Triton's interpreter; its
top-k/top-p kernel cannot, and vLLM's PyTorch top-k/top-p stands in (runner.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from guardrails import RowFlag

from ..faults import (
    ALL_NAN,
    ALL_NEGINF,
    CLEAN,
    MASKED,
    MASKED_UPTO,
    NAN_ENTRIES,
    NAN_IDS,
    POSINF,
    POSINF_ID,
    ROWS,
    VOCAB,
    faulty_logits,
    guarded,
    masked_reference,
)
from .runner import Engine, engine

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = {
    "greedy": {"temperature": 0.0},
    "random": {"temperature": 0.8},
    "top-k/top-p": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
}
FAULTS = {
    NAN_ENTRIES: "NaN entries",
    POSINF: "one +Inf",
    ALL_NAN: "all-NaN row",
    ALL_NEGINF: "all -inf row",
    MASKED: "-inf mask (control)",
}


@pytest.fixture
def v2(tmp_path: Path) -> Iterator[Engine]:
    with engine(tmp_path) as built:
        yield built


def sample(v2: Engine, x: torch.Tensor, mode: str) -> tuple[list[int], list[bool]]:
    """V2's Sampler.__call__ on `x`, one request per row, seeded per request (so that two
    runs draw the same Gumbel noise), two logprobs each."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.input_batch import InputBatch

    sampler = v2.runner.sampler
    rows = x.shape[0]
    for i in range(rows):
        sampler.add_request(i, SamplingParams(**MODES[mode], seed=100 + i, logprobs=2))
    sampler.apply_staged_writes()
    batch = InputBatch.make_dummy(rows, rows, v2.runner.input_buffers)
    with torch.inference_mode():
        out = sampler(x.clone(), batch)
    finite = out.logprobs_tensors.logprobs.isfinite().all(dim=1).tolist()
    return out.sampled_token_ids.flatten().tolist(), finite


def bare_sample(v2: Engine, x: torch.Tensor, mode: str) -> tuple[list[int], list[bool], str]:
    """Unguarded: V2's kernels on the faulty batch. The all-NaN row makes the interpreter's
    argmax raise for the whole batch; then the batch without that row (all -inf instead)
    tells what the other rows get."""
    try:
        ids, finite = sample(v2, x, mode)
        return ids, finite, ""
    except Exception as exc:
        if "All-NaN slice" not in str(exc):
            raise
    rest = x.clone()
    rest[ALL_NAN] = float("-inf")
    ids, finite = sample(v2, rest, mode)
    return ids, finite, "the batch raises (Triton interpreter: argmax of an all-NaN row)"


def healed_reference(x: torch.Tensor) -> torch.Tensor:
    """What the guarded batch must sample like: NaN entries masked (-inf), and the rows with
    no valid token uniform (all 0), as the guard writes them."""
    ref = masked_reference(x)
    ref[[ALL_NAN, ALL_NEGINF]] = 0
    return ref


def describe(ids: list[int], finite: list[bool], row: int, good: int | None) -> str:
    verdict = "" if good is None else (" (correct)" if ids[row] == good else " (silent garbage)")
    logprobs = "finite logprobs" if finite[row] else "NaN logprobs"
    return f"id {ids[row]}{verdict}, {logprobs}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_guarded_v2_sampler_heals_every_fault_row_as_if_masked(  # type: ignore[no-untyped-def]
    outcome, v2, dtype, mode
) -> None:
    x = faulty_logits(dtype)
    bare = bare_sample(v2, x, mode)
    ref_ids, _ = sample(v2, healed_reference(x), mode)

    with guarded() as guards:
        ids, finite = sample(v2, x, mode)
        flags = guards.site("sampler.logits").recent_flags().tolist()
        counts = guards.counts()

    assert ids == ref_ids  # every row, the two healed-to-uniform ones included
    assert ids[NAN_ENTRIES] not in NAN_IDS
    assert ids[MASKED] >= MASKED_UPTO
    assert ids[POSINF] == POSINF_ID  # +Inf stays the row's top entry
    assert all(0 <= i < VOCAB for i in ids)
    assert finite == [True] * ROWS  # raw logprobs come from the logits __call__ received
    nan, posinf, nvt = int(RowFlag.NAN), int(RowFlag.POSINF), int(RowFlag.NO_VALID_TOKEN)
    assert flags == [0, nan, posinf, nan | nvt, nvt, 0]
    assert counts[("sampler.logits", "calls")] == 1
    assert counts[("sampler.logits", "nan")] == len(NAN_IDS) + VOCAB
    assert counts[("sampler.logits", "posinf")] == 1
    assert counts[("sampler.logits", "rows_nonfinite")] == 3
    assert counts[("sampler.logits", "rows_no_valid_token")] == 2
    assert counts[("sampler.token_ids", "calls")] == 1
    assert counts[("sampler.token_ids", "rows_oob_token")] == 0

    good = {CLEAN: ref_ids[CLEAN], NAN_ENTRIES: ref_ids[NAN_ENTRIES], POSINF: POSINF_ID}
    good[MASKED] = ref_ids[MASKED]
    for row, fault in FAULTS.items():
        guarded_text = describe(ids, finite, row, good.get(row))
        if row in (ALL_NAN, ALL_NEGINF):
            guarded_text += f", flagged {RowFlag(flags[row])!r} (the hook ends it)"
        outcome(
            component="V2 Sampler.__call__",
            dtype=str(dtype).removeprefix("torch."),
            mode=mode + (" (top-k/top-p: PyTorch stand-in)" if "top" in mode else ""),
            fault=fault,
            unguarded=bare[2]
            if row == ALL_NAN and bare[2]
            else describe(*bare[:2], row, good.get(row)),
            guarded=guarded_text,
        )


def test_unguarded_v2_sampler_returns_nan_logprobs(v2) -> None:  # type: ignore[no-untyped-def]
    """What the guard is for, as V2 does it: NaN or +Inf in a row make its raw logprobs NaN
    (which ids its Gumbel kernel then picks is the interpreter's NaN ordering here, not the
    GPU's, so it is recorded, not asserted); an all-NaN row makes the kernel's argmax raise
    in the interpreter."""
    x = faulty_logits(torch.float32)
    healable = x.clone()
    healable[[ALL_NAN, ALL_NEGINF]] = 0
    _, finite = sample(v2, healable, "greedy")
    assert finite == [True, False, False, True, True, True]
    with pytest.raises(Exception, match="All-NaN slice"):
        sample(v2, x, "greedy")


def _faulty_ids(bad_id: int) -> Any:
    """FAULT INJECTION (test only): V2's Sampler.sample returning `bad_id` for row 0, as a
    broken sampling kernel or a padded-vocab argmax would; vLLM's own code runs around it."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    real = Sampler.sample

    def sample(self, logits, *args, **kwargs):  # type: ignore[no-untyped-def]
        ids, processed = real(self, logits, *args, **kwargs)
        ids = ids.clone()
        ids[0] = bad_id
        return ids, processed

    return sample


def test_an_out_of_vocab_id_from_v2s_sampler_is_replaced(outcome, v2, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    monkeypatch.setattr(Sampler, "sample", _faulty_ids(VOCAB + 7))
    x = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    bare, _ = sample(v2, x, "greedy")
    with guarded() as guards:
        ids, _ = sample(v2, x, "greedy")
        assert guards.count("sampler.token_ids", "oob_token") == 1
    assert bare[0] == VOCAB + 7
    assert ids == [0, bare[1]]  # replacement_id, and the other row as it was
    outcome(
        component="V2 Sampler.__call__ (token ids)",
        dtype="int64",
        mode="greedy",
        fault="out-of-vocab id (padded vocab)",
        unguarded=f"id {bare[0]} returned (>= vocab {VOCAB})",
        guarded=f"id {ids[0]} (replacement_id), counted oob_token=1",
    )
