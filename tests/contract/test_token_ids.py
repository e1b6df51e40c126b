"""The token-id contract: ids outside [0, vocab_size) are flagged OOB_TOKEN (per id for 0-d
and 1-d ids, per `[..., k]` row otherwise), counted, and replaced by `replacement_id` when
sanitizing; everything else about a token-id site's input. The fuzz compares with the oracle
(`tests/contract/oracle.py`); its budget scales with `RELIABILITY_FUZZ_SCALE`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import guardrails as gr
from guardrails.kernels.token_ids import _HOST_READ_MAX
from guardrails.testing import SilentLogger, fresh_guardrails
from tests.budget import budget
from tests.contract.oracle import expected_token_ids

SITE = "sampler.token_ids"


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).reshape(-1).tolist())


# -- fuzzed ids -----------------------------------------------------------------------------

TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@st.composite
def token_tensors(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    dtype = draw(st.sampled_from(TOKEN_DTYPES))
    info = torch.iinfo(dtype)
    vocab = draw(st.one_of(st.integers(1, 300), st.integers(1, 2**31 - 1)))
    rank = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank)))
    near = [v for v in (-1, 0, vocab - 1, vocab, info.min, info.max) if info.min <= v <= info.max]
    value = st.one_of(st.integers(info.min, info.max), st.sampled_from(near))
    numel = math.prod(shape)
    values = draw(st.lists(value, min_size=numel, max_size=numel))
    ids = torch.tensor(values, dtype=torch.int64).to(dtype).reshape(shape)
    if numel and draw(st.booleans()):
        # More ids than a CPU call reads as a list (the reduction path): copies of the drawn
        # ones stacked along a new leading dimension.
        copies = _HOST_READ_MAX // numel + 1
        ids = ids.unsqueeze(0).expand(copies, *shape).clone()
        shape = tuple(ids.shape)
        rank += 1
    if rank >= 1 and draw(st.booleans()):  # a strided view of a larger tensor
        wide = torch.zeros((*shape[:-1], 2 * shape[-1] + 1), dtype=dtype)
        wide[..., 1::2] = ids
        ids = wide[..., 1::2]
    return ids, vocab


@budget(300)
@given(
    case=token_tensors(), sanitize=st.booleans(), inference=st.booleans(), replaced=st.booleans()
)
def test_any_token_id_tensor_is_guarded_as_the_oracle_says(
    case: tuple[torch.Tensor, int], sanitize: bool, inference: bool, replaced: bool
) -> None:
    ids, vocab = case
    if inference:
        with torch.inference_mode():
            ids = ids.clone()
    # Small enough for every id dtype (a larger one would not fit int8 ids).
    replacement_id = min(vocab - 1, 7) if replaced else 0
    expected = expected_token_ids(ids, vocab, sanitize=sanitize, replacement_id=replacement_id)
    settings = {SITE: {"replacement_id": replacement_id}}
    with fresh_guardrails(sanitize=sanitize, sites=settings, logger=SilentLogger()) as guards:
        flags = guards.token_site(SITE, vocab_size=vocab)(ids)
        assert flags.dtype == torch.uint8
        assert flags.tolist() == expected.flags
        assert guards.count(SITE, "oob_token") == expected.counts["oob_token"]
        assert guards.count(SITE, "rows_oob_token") == expected.counts["rows_oob_token"]
        assert guards.count(SITE, "calls") == 1
    assert ids.reshape(-1).tolist() == expected.ids


@pytest.mark.parametrize(
    "dtype",
    [torch.uint16, torch.uint32, torch.uint64, torch.float32, torch.bool, torch.complex64],
    ids=str,
)
def test_unsupported_token_id_dtypes_are_a_type_error_naming_the_accepted(
    dtype: torch.dtype,
) -> None:
    # uint16/32/64 used to reach torch and fail inside the guard with NotImplementedError.
    ids = torch.tensor([1, 3, 2]).to(dtype)
    before = _bytes(ids)
    with fresh_guardrails() as guards:
        site = guards.token_site(SITE, vocab_size=2)
        with pytest.raises(TypeError, match="must be an integer tensor") as info:
            site(ids)
        assert "(accepted: int64, int32, int16, int8, uint8)" in str(info.value)
        assert guards.count(SITE, "calls") == 0
    assert _bytes(ids) == before


@pytest.mark.parametrize(
    ("dtype", "vocab_size"),
    [(torch.int8, 128), (torch.uint8, 256), (torch.int16, 151_936), (torch.int32, 2**31)],
    ids=["int8", "uint8", "int16", "int32"],
)
def test_valid_ids_stay_when_vocab_size_exceeds_the_id_dtype(
    guards: gr.Guardrails, dtype: torch.dtype, vocab_size: int
) -> None:
    # Found by the token fuzz: vocab_size was cast to the ids' dtype and wrapped, so every
    # valid id was flagged and replaced.
    high = min(torch.iinfo(dtype).max, vocab_size - 1)
    ids = torch.tensor([0, 5, high]).to(dtype)
    flags = guards.token_site(SITE, vocab_size=vocab_size)(ids)
    assert flags.tolist() == [0, 0, 0]
    assert ids.tolist() == [0, 5, high]


# -- by hand ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_out_of_vocab_ids_are_flagged_counted_and_replaced(
    guards: gr.Guardrails, dtype: torch.dtype
) -> None:
    ids = torch.tensor([3, 10, -1, 9, 0], dtype=dtype)
    flags = guards.token_site("sampler.token_ids", vocab_size=10)(ids)
    assert flags is not None
    assert flags.tolist() == [0, 16, 16, 0, 0]
    assert ids.tolist() == [3, 0, 0, 9, 0]
    assert guards.count("sampler.token_ids", "oob_token") == 2
    assert guards.count("sampler.token_ids", "rows_oob_token") == 2


def test_token_ids_rows_are_the_leading_dims(guards: gr.Guardrails) -> None:
    ids = torch.tensor([[1, 2, 3], [1, 99, 99]])
    flags = guards.token_site("eagle.token_ids", vocab_size=50)(ids)
    assert flags is not None
    assert flags.tolist() == [0, 16]
    assert guards.count("eagle.token_ids", "oob_token") == 2
    assert guards.count("eagle.token_ids", "rows_oob_token") == 1


def test_replacement_id_is_configurable() -> None:
    with fresh_guardrails(sites={"sampler.token_ids": {"replacement_id": 7}}) as guards:
        ids = torch.tensor([100])
        guards.token_site("sampler.token_ids", vocab_size=10)(ids)
        assert ids.tolist() == [7]


def test_replacement_id_outside_vocab_is_an_error() -> None:
    with (
        fresh_guardrails(sites={"sampler.token_ids": {"replacement_id": 10}}) as guards,
        pytest.raises(ValueError, match="replacement_id=10"),
    ):
        guards.token_site("sampler.token_ids", vocab_size=10)


def test_token_site_without_sanitize_only_flags() -> None:
    with fresh_guardrails(sanitize=False) as guards:
        ids = torch.tensor([5, 50])
        flags = guards.token_site("sampler.token_ids", vocab_size=10)(ids)
        assert flags is not None
        assert flags.tolist() == [0, 16]
        assert ids.tolist() == [5, 50]


@pytest.mark.parametrize("vocab_size", [0, -1, 2.5, True])
def test_token_site_needs_a_positive_vocab_size(guards: gr.Guardrails, vocab_size: object) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        guards.token_site("sampler.token_ids", vocab_size=vocab_size)  # type: ignore[arg-type]
