"""vLLM's real `Sampler.forward` on a batch with one fault per row, unguarded and guarded."""

from __future__ import annotations

import pytest
import torch

from guardrails import RowFlag

from .faults import (
    ALL_NAN,
    ALL_NEGINF,
    CLEAN,
    MASKED,
    NAN_ENTRIES,
    NAN_IDS,
    POSINF,
    POSINF_ID,
    ROWS,
    VOCAB,
    faulty_logits,
    guarded,
    ids_of,
    masked_reference,
    metadata,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MODES = ["greedy", "random", "top-k/top-p"]
FAULTS = {
    NAN_ENTRIES: "NaN entries",
    POSINF: "one +Inf",
    ALL_NAN: "all-NaN row",
    ALL_NEGINF: "all -inf row",
    MASKED: "-inf mask (control)",
}


def sample(x: torch.Tensor, mode: str) -> tuple[list[int], list[bool]]:
    from vllm.v1.sample.sampler import Sampler

    out = Sampler()(x.clone(), metadata(mode, logprobs=2))
    finite = out.logprobs_tensors.logprobs.isfinite().all(dim=1).tolist()
    return ids_of(out), finite


def describe(ids: list[int], finite: list[bool], row: int, good: int | None) -> str:
    verdict = "" if good is None else (" (correct)" if ids[row] == good else " (silent garbage)")
    logprobs = "finite logprobs" if finite[row] else "NaN logprobs"
    return f"id {ids[row]}{verdict}, {logprobs}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_guarded_sampler_heals_every_fault_row_as_if_masked(outcome, dtype, mode) -> None:  # type: ignore[no-untyped-def]
    x = faulty_logits(dtype)
    bare_ids, bare_finite = sample(x, mode)
    ref_ids, _ = sample(masked_reference(x), mode)  # unguarded: NaN entries set to -inf

    with guarded() as guards:
        ids, finite = sample(x, mode)
        flags = guards.site("sampler.logits").recent_flags().tolist()
        counts = guards.counts()

    # The healed rows sample like their masked reference (same seeded noise).
    assert ids[CLEAN] == ref_ids[CLEAN]
    assert ids[NAN_ENTRIES] == ref_ids[NAN_ENTRIES]
    assert ids[NAN_ENTRIES] not in NAN_IDS
    assert ids[MASKED] == ref_ids[MASKED]
    assert ids[MASKED] >= 2000
    # +Inf stays the row's top entry: every mode picks it.
    assert ids[POSINF] == POSINF_ID
    assert all(0 <= i < VOCAB for i in ids)
    # Logprobs are computed from the logits Sampler.forward receives: healed there.
    assert finite == [True] * ROWS
    nan, posinf, nvt = int(RowFlag.NAN), int(RowFlag.POSINF), int(RowFlag.NO_VALID_TOKEN)
    assert flags == [0, nan, posinf, nan | nvt, nvt, 0]
    assert counts[("sampler.logits", "nan")] == len(NAN_IDS) + VOCAB
    assert counts[("sampler.logits", "posinf")] == 1
    assert counts[("sampler.logits", "rows_nonfinite")] == 3
    assert counts[("sampler.logits", "rows_no_valid_token")] == 2
    assert counts[("sampler.logits", "calls")] == 1
    assert counts[("sampler.token_ids", "rows_oob_token")] == 0

    good = {NAN_ENTRIES: ref_ids[NAN_ENTRIES], POSINF: POSINF_ID, MASKED: ref_ids[MASKED]}
    for row, fault in FAULTS.items():
        guarded_text = describe(ids, finite, row, good.get(row))
        if row in (ALL_NAN, ALL_NEGINF):
            guarded_text += f", flagged {RowFlag(flags[row])!r} (the hook ends it)"
        outcome(
            component="Sampler.forward",
            dtype=str(dtype).removeprefix("torch."),
            mode=mode,
            fault=fault,
            unguarded=describe(bare_ids, bare_finite, row, good.get(row)),
            guarded=guarded_text,
        )


def test_unguarded_sampler_returns_nan_logprobs_and_the_nan_entry_greedily() -> None:
    """What the guard is for, as vLLM 0.33.0 does it: greedy argmax picks a NaN entry, and
    random sampling from a row with NaN or +Inf returns id 0 (NaN probabilities)."""
    x = faulty_logits(torch.float32)
    ids, finite = sample(x, "greedy")
    assert ids[NAN_ENTRIES] == NAN_IDS[0]
    assert finite == [True, False, False, False, False, True]
    ids, _ = sample(x, "random")
    assert [ids[NAN_ENTRIES], ids[POSINF], ids[ALL_NAN]] == [0, 0, 0]


def _faulty_sample(bad_id: int):  # type: ignore[no-untyped-def]
    """FAULT INJECTION (test only): a sampling kernel that returns `bad_id` for row 0, as a
    broken FlashInfer/Triton kernel or a padded-vocab argmax would; vLLM's own code runs
    around it."""
    from vllm.v1.sample.sampler import Sampler

    real = Sampler.sample

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):  # type: ignore[no-untyped-def]
        ids, processed = real(self, logits, sampling_metadata, logprobs_mode_override)
        ids = ids.clone()
        ids[0] = bad_id
        return ids, processed

    return sample


@pytest.mark.parametrize("mode", ["greedy", "top-k/top-p"])
def test_an_out_of_vocab_id_is_replaced_at_the_token_site(outcome, monkeypatch, mode) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.sample.sampler import Sampler

    # The padded vocabulary of a TP-sharded LM head: ids up to 4096 + 64 exist in its
    # weights, the tokenizer knows 4096.
    monkeypatch.setattr(Sampler, "sample", _faulty_sample(VOCAB + 7))
    x = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    bare = ids_of(Sampler()(x.clone(), metadata(mode, rows=2)))
    with guarded() as guards:
        ids = ids_of(Sampler()(x.clone(), metadata(mode, rows=2)))
        assert guards.count("sampler.token_ids", "oob_token") == 1
        assert guards.count("sampler.token_ids", "rows_oob_token") == 1
    assert bare[0] == VOCAB + 7
    assert ids[0] == 0  # replacement_id
    assert ids[1] == bare[1]
    outcome(
        component="Sampler.forward (token ids)",
        dtype="int32",
        mode=mode,
        fault="out-of-vocab id (padded vocab)",
        unguarded=f"id {bare[0]} returned (>= vocab {VOCAB})",
        guarded=f"id {ids[0]} (replacement_id), counted oob_token=1",
    )


def test_the_token_site_reads_the_vocab_size_on_every_call(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm.v1.sample.sampler import Sampler

    monkeypatch.setattr(Sampler, "sample", _faulty_sample(2000))
    with guarded() as guards:
        wide = ids_of(Sampler()(torch.zeros(2, VOCAB), metadata("greedy", rows=2)))
        narrow = ids_of(Sampler()(torch.zeros(2, 1000), metadata("greedy", rows=2)))
        assert guards.count("sampler.token_ids", "oob_token") == 1
    assert wide[0] == 2000  # inside a 4096 vocabulary
    assert narrow[0] == 0  # outside a 1000 one
