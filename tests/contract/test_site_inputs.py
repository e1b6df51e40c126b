"""Fuzzing what a site is given: every tensor either is guarded exactly as the oracle says or
gets a clear TypeError/ValueError that leaves it untouched.

Values are built as bit patterns through integer views, so every class of float is reached on
purpose: NaN with any payload and sign, +-Inf, +-0.0, subnormals, the largest finite values.
Exhaustive where the space is small: all 65,536 float16 and bfloat16 patterns, and all
16,777,214 float32 NaN payloads. Layouts: ranks 1-4, zero-size dims, strided and padded views
of larger tensors, vocab-major, non-flattenable leading dims, expanded (stride 0) views, each
kept through `requires_grad` leaves and views and inference tensors; the host's flush-denormal
mode. All through the public `site(x)`: these are about what the site accepts and how it
drives its kernel (the kernels themselves: `test_logits_contract.py`).

Memory that overlaps itself (an expanded view, an `as_strided` window) cannot be healed in
place consistently (a value shared by two rows would have to become two things): a healing
site refuses it whatever it holds, with a ValueError and the tensor untouched; a detect-only
site reads it and flags and counts per element, as the oracle does. Meta, sparse and nested
tensors are refused with an error naming them, before the site makes any state for them.

`RELIABILITY_FUZZ_SCALE` (default 1) multiplies the example budgets (`tests/budget.py`);
`make reliability` raises it and records the case counts in docs/reliability.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import numpy
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from guardrails import Guardrails, RowFlag
from guardrails.testing import SilentLogger, fresh_guardrails
from tests.budget import budget
from tests.contract.oracle import Expected, expected_logits

# dtype -> (integer view, exponent bits, mantissa bits)
FORMATS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    torch.float16: (torch.int16, 5, 10),
    torch.bfloat16: (torch.int16, 8, 7),
    torch.float32: (torch.int32, 8, 23),
    torch.float64: (torch.int64, 11, 52),
}
LOGITS_KINDS = ("nan", "posinf", "neginf", "rows_nonfinite", "rows_no_valid_token", "calls")


# -- bit patterns -------------------------------------------------------------------------


def compose(dtype: torch.dtype, sign: int, exponent: int, mantissa: int) -> int:
    """The signed integer whose bits are (sign, exponent, mantissa) in `dtype`'s format."""
    _int, exp_bits, mant_bits = FORMATS[dtype]
    width = 1 + exp_bits + mant_bits
    unsigned = (sign << (width - 1)) | (exponent << mant_bits) | mantissa
    return unsigned - (1 << width) if sign else unsigned


PATTERN_CLASSES = ("nan", "inf", "zero", "subnormal", "normal", "largest")


@st.composite
def bit_patterns(draw: st.DrawFn, dtype: torch.dtype) -> int:
    _int, exp_bits, mant_bits = FORMATS[dtype]
    top = (1 << exp_bits) - 1
    kind = draw(st.sampled_from(PATTERN_CLASSES))
    sign = draw(st.integers(0, 1))
    any_mantissa = st.integers(0, (1 << mant_bits) - 1)
    nonzero_mantissa = st.integers(1, (1 << mant_bits) - 1)
    if kind == "nan":
        return compose(dtype, sign, top, draw(nonzero_mantissa))
    if kind == "inf":
        return compose(dtype, sign, top, 0)
    if kind == "zero":
        return compose(dtype, sign, 0, 0)
    if kind == "subnormal":
        return compose(dtype, sign, 0, draw(nonzero_mantissa))
    if kind == "largest":
        return compose(dtype, sign, top - 1, (1 << mant_bits) - 1)
    return compose(dtype, sign, draw(st.integers(1, top - 1)), draw(any_mantissa))


def random_nan_bits(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """`n` NaNs with random payloads and signs, as int64 bit patterns."""
    _int, exp_bits, mant_bits = FORMATS[dtype]
    width = 1 + exp_bits + mant_bits
    mantissa = torch.randint(1, 1 << mant_bits, (n,), generator=gen, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64)
    positive = (((1 << exp_bits) - 1) << mant_bits) | mantissa
    return positive - sign * (1 << (width - 1))  # the sign bit, in two's complement


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns of `dtype` (every class of float appears), as int64."""
    _int, exp_bits, mant_bits = FORMATS[dtype]
    width = 1 + exp_bits + mant_bits
    low, high = -(1 << (width - 1)), (1 << (width - 1)) - 1  # randint's high is exclusive
    return torch.randint(low, high, shape, generator=gen, dtype=torch.int64)


# -- tensors of any layout ----------------------------------------------------------------

LAYOUTS = ("contiguous", "padded_view", "strided_vocab", "vocab_major", "permuted", "expanded")
ROW_MODES = ("keep", "keep", "keep", "all_nan", "all_neginf", "nan_and_neginf")


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A zeroed tensor of `shape` laid out as `layout` (a view of a larger one, mostly)."""
    lead, vocab = shape[:-1], shape[-1]
    if layout == "padded_view":
        base = torch.zeros(tuple(d + 3 for d in shape), dtype=dtype)
        return base[tuple(slice(1, 1 + d) for d in shape)]
    if layout == "strided_vocab":
        return torch.zeros((*lead, 2 * vocab + 1), dtype=dtype)[..., 1::2]
    if layout == "vocab_major" and lead:
        return torch.zeros((vocab, *lead), dtype=dtype).movedim(0, -1)
    if layout == "permuted" and len(lead) >= 2:
        reverse = tuple(reversed(range(len(lead))))
        base = torch.zeros((*(lead[i] for i in reverse), vocab), dtype=dtype)
        return base.permute(*reverse, len(lead))
    return torch.zeros(shape, dtype=dtype)


@st.composite
def logits_tensors(
    draw: st.DrawFn,
    dtypes: tuple[torch.dtype, ...] = tuple(FORMATS),
    layouts: tuple[str, ...] = LAYOUTS,
) -> Any:
    """(tensor, description): bits from every class, any layout, special rows, chosen bits."""
    dtype = draw(st.sampled_from(dtypes))
    rank = draw(st.integers(1, 4))
    vocab = draw(st.one_of(st.integers(0, 40), st.integers(1000, 5000)))
    lead_max = 5 if vocab <= 40 else 2
    lead = tuple(draw(st.lists(st.integers(0, lead_max), min_size=rank - 1, max_size=rank - 1)))
    shape = (*lead, vocab)
    layout = draw(st.sampled_from(layouts))
    if layout == "expanded" and not (lead and lead[0] > 1):
        layout = "contiguous"
    raw = draw(st.booleans())  # raw bits everywhere, or moderate logits
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    int_dtype = FORMATS[dtype][0]

    if layout == "expanded":
        base_shape = (1, *lead[1:], vocab)
        x = torch.zeros(base_shape, dtype=dtype)
    else:
        x = _allocate(shape, dtype, layout)
    fill_shape = tuple(x.shape)
    if raw:
        x.view(int_dtype).copy_(random_bits(dtype, fill_shape, gen))
    else:
        x.copy_((torch.randn(fill_shape, generator=gen, dtype=torch.float64) * 8).to(dtype))
    if x.numel():
        flat = x.view(int_dtype)
        for row in range(math.prod(fill_shape[:-1])):
            mode = draw(st.sampled_from(ROW_MODES))
            if mode == "keep":
                continue
            index = _row_index(fill_shape, row)
            if mode == "all_nan":
                flat[index] = random_nan_bits(dtype, vocab, gen).to(int_dtype)
            elif mode == "all_neginf":
                flat[index] = compose(dtype, 1, (1 << FORMATS[dtype][1]) - 1, 0)
            else:
                nan = random_nan_bits(dtype, vocab, gen).to(int_dtype)
                ninf = torch.full_like(nan, compose(dtype, 1, (1 << FORMATS[dtype][1]) - 1, 0))
                pick = torch.rand(vocab, generator=gen) < 0.5
                flat[index] = torch.where(pick, nan, ninf)
    if x.numel():
        spots = st.tuples(st.integers(0, x.numel() - 1), bit_patterns(dtype))
        flat = x.view(int_dtype)
        for position, bits in draw(st.lists(spots, max_size=20)):
            flat[_unravel(position, fill_shape)] = bits
    if layout == "expanded":
        x = x.expand(shape)
    return x, f"{dtype} shape={shape} layout={layout} strides={x.stride()} raw={raw} seed={seed}"


def _unravel(position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(position % size)
        position //= size
    return tuple(reversed(index))


def _row_index(shape: tuple[int, ...], row: int) -> tuple[int, ...]:
    return _unravel(row, shape[:-1]) if len(shape) > 1 else ()


# -- the oracle's answer, as this file compares it ------------------------------------------


def _bits_of(value: float, dtype: torch.dtype) -> int:
    return int(torch.tensor([value], dtype=dtype).view(FORMATS[dtype][0])[0])


def contract(
    original: torch.Tensor, *, sanitize: bool, count_neginf: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """(healed bits, row flags, counts with the call) that the oracle requires for `original`."""
    expected: Expected = expected_logits(original, sanitize=sanitize, count_neginf=count_neginf)
    return expected.bits, expected.flags, {**expected.counts, "calls": 1}


SITE = "fuzz.logits"


@pytest.fixture(scope="module")
def instances() -> Iterator[dict[tuple[bool, bool], Guardrails]]:
    """One instance per (sanitize, count_neginf); counts are compared as deltas."""
    made = {
        (sanitize, neginf): fresh_guardrails(
            sanitize=sanitize, sites={SITE: {"count_neginf": neginf}}, logger=SilentLogger()
        )
        for sanitize in (True, False)
        for neginf in (True, False)
    }
    yield made
    for guards in made.values():
        guards.close()


def _deltas(guards: Guardrails, before: dict[tuple[str, str], int], kinds: tuple[str, ...]) -> Any:
    after = guards.counts()
    return {kind: after.get((SITE, kind), 0) - before.get((SITE, kind), 0) for kind in kinds}


@st.composite
def call_modes(draw: st.DrawFn) -> tuple[str, str, bool]:
    """(autograd, inference mode, flush denormals) for one call."""
    return (
        draw(st.sampled_from(("none", "leaf", "view_of_leaf"))),
        draw(st.sampled_from(("none", "inference_tensor", "called_in_inference", "both"))),
        draw(st.booleans()),
    )


def _storage_bits(x: torch.Tensor) -> torch.Tensor:
    """All of `x`'s storage (padding included) as a 1-D tensor of integers."""
    n = x.untyped_storage().nbytes() // x.element_size()
    whole = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, (n,), (1,))
    return whole.view(FORMATS[x.dtype][0])


def _prepare(x: torch.Tensor, grad: str, inference: str) -> torch.Tensor:
    """`x` as an inference tensor, a leaf requiring grad or a view of one, in the same layout
    (sizes, strides, offset: padded, transposed and expanded views stay what they are)."""
    if inference in ("inference_tensor", "both"):
        # Inference tensors cannot require grad: `grad` is not applied.
        with torch.inference_mode():
            base = _storage_bits(x).clone().view(x.dtype)
            return base.as_strided(x.shape, x.stride(), x.storage_offset())
    if grad == "leaf":
        # The leaf itself has x's strides (its storage starts where x's first element is).
        leaf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        span = _storage_bits(leaf).numel()
        offset = x.storage_offset()
        _storage_bits(leaf).copy_(_storage_bits(x)[offset : offset + span])
        return leaf.requires_grad_(True)
    if grad == "view_of_leaf":
        base = _storage_bits(x).clone().view(x.dtype).requires_grad_(True)
        return base.as_strided(x.shape, x.stride(), x.storage_offset())
    return x


def _overlapping(x: torch.Tensor) -> bool:
    """Whether two elements of `x` share memory: its offsets, counted."""
    if x.numel() <= 1:
        return False
    span = sum(st * (sz - 1) for sz, st in zip(x.shape, x.stride(), strict=True)) + 1
    offsets = torch.arange(span).as_strided(x.shape, x.stride()).flatten()
    return bool(torch.bincount(offsets).max() > 1)


@budget(150)
@given(
    calls=st.lists(st.tuples(logits_tensors(), call_modes()), min_size=1, max_size=3),
    sanitize=st.booleans(),
    count_neginf=st.booleans(),
)
def test_any_sequence_of_tensors_is_handled_per_the_contract(
    calls: list[tuple[Any, tuple[str, str, bool]]], sanitize: bool, count_neginf: bool
) -> None:
    # Several calls on one site: what a call leaves in the site's buffers must not leak into
    # the next call's flags or counts.
    with fresh_guardrails(
        sanitize=sanitize, sites={SITE: {"count_neginf": count_neginf}}, logger=SilentLogger()
    ) as guards:
        site = guards.site(SITE)
        for (drawn, description), (grad, inference, flush_denormal) in calls:
            x = _prepare(drawn, grad, inference)
            assert (x.shape, x.stride()) == (drawn.shape, drawn.stride()), description
            original = x.detach().clone()
            bits, flags, counts = contract(original, sanitize=sanitize, count_neginf=count_neginf)
            refused = sanitize and _overlapping(x)
            if refused:  # untouched and uncounted
                bits = original.view(FORMATS[x.dtype][0])
                counts = dict.fromkeys(LOGITS_KINDS, 0)
            before = guards.counts()
            # A host may flush subnormals to zero; finite values must still pass bit for bit.
            torch.set_flush_denormal(flush_denormal)
            try:
                with torch.inference_mode(inference in ("called_in_inference", "both")):
                    if refused:
                        with pytest.raises(ValueError, match="overlaps itself"):
                            site(x)
                    else:
                        got = site(x).clone()
            finally:
                torch.set_flush_denormal(False)  # torch's default; it has no getter
            assert torch.equal(x.detach().view(FORMATS[x.dtype][0]), bits), description
            if not refused:
                assert torch.equal(got, flags), description
            assert _deltas(guards, before, LOGITS_KINDS) == counts, description


@budget(60)
@given(
    case=logits_tensors(layouts=("expanded",)),
    modes=call_modes(),
    sanitize=st.booleans(),
    count_neginf=st.booleans(),
)
def test_expanded_tensors_are_refused_when_healing_and_guarded_when_detecting(
    case: Any, modes: tuple[str, str, bool], sanitize: bool, count_neginf: bool
) -> None:
    # The sequence fuzz above meets expanded views now and then; here every case is one
    # (or, with fewer than two rows to expand, a contiguous tensor), in every call mode.
    drawn, description = case
    grad, inference, _flush = modes
    x = _prepare(drawn, grad, inference)
    original = x.detach().clone()
    bits, flags, counts = contract(original, sanitize=sanitize, count_neginf=count_neginf)
    with fresh_guardrails(
        sanitize=sanitize, sites={SITE: {"count_neginf": count_neginf}}, logger=SilentLogger()
    ) as guards:
        site = guards.site(SITE)
        with torch.inference_mode(inference in ("called_in_inference", "both")):
            if sanitize and _overlapping(x):
                with pytest.raises(ValueError, match="overlaps itself"):
                    site(x)
                as_int = FORMATS[x.dtype][0]
                assert torch.equal(x.detach().view(as_int), original.view(as_int)), description
                assert _deltas(guards, {}, LOGITS_KINDS) == dict.fromkeys(LOGITS_KINDS, 0)
                return
            got = site(x).clone()
        assert torch.equal(x.detach().view(FORMATS[x.dtype][0]), bits), description
        assert torch.equal(got, flags), description
        assert _deltas(guards, {}, LOGITS_KINDS) == counts, description


def test_clean_rows_after_a_zero_vocab_call_are_not_flagged(guards: Guardrails) -> None:
    # Found by the sequence fuzz: the CPU kernel re-zeroes only flags it wrote itself, and a
    # [rows, 0] call writes NO_VALID_TOKEN outside it; the next clean call returned them.
    site = guards.site("sampler.logits")
    assert site(torch.zeros(3, 0)).tolist() == [int(RowFlag.NO_VALID_TOKEN)] * 3
    assert site(torch.zeros(3, 8)).tolist() == [0, 0, 0]
    assert guards.count("sampler.logits", "rows_no_valid_token") == 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@budget(12)
@given(seed=st.integers(0, 2**31 - 1), log2_vocab=st.integers(0, 16), sanitize=st.booleans())
def test_every_16_bit_pattern_is_handled_per_the_contract(
    instances: dict[tuple[bool, bool], Guardrails],
    dtype: torch.dtype,
    seed: int,
    log2_vocab: int,
    sanitize: bool,
) -> None:
    # All 65,536 patterns, shuffled into rows of 2**k: each meets other neighbours per case.
    gen = torch.Generator().manual_seed(seed)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    every = every[torch.randperm(every.numel(), generator=gen)]
    x = every.view(dtype).reshape(-1, 1 << log2_vocab).clone()
    bits, flags, counts = contract(x.clone(), sanitize=sanitize, count_neginf=False)
    guards = instances[(sanitize, False)]
    before = guards.counts()
    got = guards.site(SITE)(x).clone()
    assert torch.equal(x.view(torch.int16), bits)
    assert torch.equal(got, flags)
    assert _deltas(guards, before, LOGITS_KINDS) == counts


@pytest.mark.parametrize("sanitize", [True, False], ids=["heal", "detect_only"])
def test_every_float32_nan_payload_and_sign(
    instances: dict[tuple[bool, bool], Guardrails], sanitize: bool
) -> None:
    # 2 * (2**23 - 1) NaN patterns, 1,024 per row beside one finite logit: each becomes -inf
    # (or, detect only, keeps its exact payload) and is counted once.
    guards = instances[(sanitize, False)]
    site = guards.site(SITE)
    neg_inf = _bits_of(-math.inf, torch.float32)
    finite = _bits_of(1.5, torch.float32)
    block = 1 << 20
    total = 0
    for sign in (0, 1):
        mantissas = torch.arange(1, 1 << 23, dtype=torch.int64)
        for start in range(0, mantissas.numel(), block):
            part = mantissas[start : start + block]
            pad = (-part.numel()) % 1024
            part = torch.cat((part, part[:pad]))  # repeat a few to fill the last row
            patterns = torch.tensor(compose(torch.float32, sign, 255, 0)) + part
            x = torch.empty(part.numel() // 1024, 1025, dtype=torch.float32)
            x.view(torch.int32)[:, 0] = finite
            x.view(torch.int32)[:, 1:] = patterns.view(-1, 1024).to(torch.int32)
            original = x.view(torch.int32).clone()
            before = guards.count(SITE, "nan")
            flags = site(x)
            assert guards.count(SITE, "nan") - before == part.numel()
            assert bool((flags == int(RowFlag.NAN)).all())
            after = x.view(torch.int32)
            assert bool((after[:, 0] == finite).all())
            if sanitize:
                assert bool((after[:, 1:] == neg_inf).all())
            else:
                assert torch.equal(after, original)
            total += part.numel() - pad
    assert total == 2 * ((1 << 23) - 1)


@budget(200)
@given(
    sign=st.integers(0, 1),
    mantissa=st.integers(1, (1 << 52) - 1),
    neighbours=st.lists(bit_patterns(torch.float64), min_size=1, max_size=30),
)
def test_any_float64_nan_payload_is_healed_and_neighbours_kept(
    instances: dict[tuple[bool, bool], Guardrails],
    sign: int,
    mantissa: int,
    neighbours: list[int],
) -> None:
    x = torch.tensor([[0, *neighbours]], dtype=torch.int64).view(torch.float64).clone()
    x.view(torch.int64)[0, 0] = compose(torch.float64, sign, 2047, mantissa)
    bits, flags, counts = contract(x.clone(), sanitize=True, count_neginf=False)
    guards = instances[(True, False)]
    before = guards.counts()
    got = guards.site(SITE)(x).clone()
    assert torch.equal(x.view(torch.int64), bits)
    assert torch.equal(got, flags)
    assert _deltas(guards, before, LOGITS_KINDS) == counts


# -- inputs that must be rejected ----------------------------------------------------------

REJECTED_DTYPES = [
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).reshape(-1).tolist())


@pytest.mark.parametrize("dtype", REJECTED_DTYPES, ids=str)
def test_non_float_dtypes_are_a_type_error_naming_the_dtype(dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    with fresh_guardrails() as guards:
        x = torch.ones(2, 8).to(dtype)
        before = _bytes(x)
        with pytest.raises(TypeError, match=f"{name} is not accepted") as info:
            guards.site("sampler.logits")(x)
        assert "accepted: float32" in str(info.value)
        assert _bytes(x) == before
        assert guards.count("sampler.logits", "calls") == 0


@budget(50)
@given(
    allowed=st.lists(st.sampled_from(list(FORMATS)), min_size=1, max_size=3, unique=True),
    given_dtype=st.sampled_from(list(FORMATS)),
)
def test_float_dtype_outside_the_sites_list_is_a_type_error(
    allowed: list[torch.dtype], given_dtype: torch.dtype
) -> None:
    names = [str(d).removeprefix("torch.") for d in allowed]
    with fresh_guardrails(sites={"sampler.logits": {"dtypes": names}}) as guards:
        site = guards.site("sampler.logits")
        x = torch.full((2, 4), math.nan, dtype=given_dtype)
        before = _bytes(x)
        if given_dtype in allowed:
            assert site(x).tolist() == [RowFlag.NAN | RowFlag.NO_VALID_TOKEN] * 2
            assert bool((x == 0).all())
            return
        with pytest.raises(TypeError, match=str(given_dtype).removeprefix("torch.")) as info:
            site(x)
        assert f"(accepted: {', '.join(names)})" in str(info.value)
        assert _bytes(x) == before


NOT_TENSORS = st.one_of(
    st.none(),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
    st.lists(st.floats(), max_size=4),
    st.builds(lambda v: numpy.full((2, 3), v), st.floats()),
)


@budget(50)
@given(value=NOT_TENSORS)
def test_anything_but_a_tensor_is_a_type_error_naming_its_type(value: object) -> None:
    with fresh_guardrails() as guards:
        for site in (
            guards.site("sampler.logits"),
            guards.token_site("sampler.token_ids", vocab_size=8),
        ):
            with pytest.raises(TypeError, match=type(value).__name__) as info:
                site(value)  # type: ignore[arg-type]
            assert "expects a torch.Tensor" in str(info.value)


def test_zero_dim_logits_are_a_value_error() -> None:
    with fresh_guardrails() as guards, pytest.raises(ValueError, match="0-d"):
        guards.site("sampler.logits")(torch.tensor(math.nan))


# -- memory that overlaps itself -------------------------------------------------------------


def test_expanded_logits_are_refused_untouched_when_healing() -> None:
    # Was half-written: torch refused the in-place heal after 2048 of the values were set.
    x = torch.full((1, 2459), math.nan, dtype=torch.float16).expand(2, 2459)
    with fresh_guardrails() as guards:
        with pytest.raises(ValueError, match="memory overlaps itself") as info:
            guards.site("sampler.logits")(x)
        assert "strides (0, 1)" in str(info.value)
        assert bool(x.isnan().all())
        assert guards.count("sampler.logits", "calls") == 0


def test_expanded_logits_are_read_and_flagged_when_detecting_only() -> None:
    base = torch.randn(1, 2459, dtype=torch.float16)
    base[0, [5, 2000]] = math.nan
    x = base.expand(3, 2459)
    original = x.clone()
    bits, flags, counts = contract(original, sanitize=False, count_neginf=False)
    with fresh_guardrails(sanitize=False) as guards:
        before = guards.counts()
        got = guards.site(SITE)(x)
        assert got.tolist() == flags.tolist() == [int(RowFlag.NAN)] * 3
        assert _deltas(guards, before, LOGITS_KINDS) == counts
        assert guards.count(SITE, "nan") == 6  # counted per element, as read
    assert torch.equal(x.view(torch.int16), bits)


@pytest.mark.parametrize(
    ("storage", "size", "stride", "overlaps"),
    [
        (10, (3, 4), (2, 1), True),  # sliding windows: rows share values
        (20, (3, 4), (5, 1), False),  # padded rows
        (12, (3, 2), (1, 3), False),  # vocab-major
        (12, (2, 3, 2), (1, 2, 6), False),  # interleaved strides, no shared memory
        (6, (2, 2, 2), (2, 1, 2), True),  # two dims walk onto the same memory
    ],
)
def test_as_strided_views_are_refused_exactly_when_they_overlap(
    storage: int, size: tuple[int, ...], stride: tuple[int, ...], overlaps: bool
) -> None:
    x = torch.full((storage,), math.nan).as_strided(size, stride)
    assert _overlapping(x) == overlaps  # the test's own count of shared offsets
    with fresh_guardrails() as guards:
        site = guards.site("sampler.logits")
        if overlaps:
            with pytest.raises(ValueError, match="overlaps itself"):
                site(x)
            assert bool(x.isnan().all())
        else:
            rows = math.prod(size[:-1])
            assert site(x).tolist() == [int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)] * rows
            assert bool((x == 0).all())


@pytest.mark.parametrize(
    ("storage", "size", "stride", "overlaps"),
    [
        (10, (3, 4), (2, 1), True),  # sliding windows: rows share values
        (20, (3, 4), (5, 1), False),  # padded rows (vLLM's [:, :vocab] of its LM head)
        (12, (3, 2), (1, 3), False),  # vocab-major
        (4, (1, 4), (0, 1), False),  # one row, any row stride
        (4, (3, 4), (0, 1), True),  # expanded
    ],
)
def test_clean_views_after_clean_calls_get_the_verdict_of_their_layout(
    storage: int, size: tuple[int, ...], stride: tuple[int, ...], overlaps: bool
) -> None:
    """A clean 2-d view read from its shape and strides alone (a thread that has called with
    its row count: buffers and flags ready) gets the verdict of the full layout check and no
    other: a clean view that overlaps itself is still refused when healing."""
    x = torch.zeros(storage).as_strided(size, stride)
    with fresh_guardrails() as guards:
        site = guards.site("sampler.logits")
        for _ in range(2):  # the buffers and the flags view for these rows, then a warm call
            assert site(torch.zeros(size)).tolist() == [0] * size[0]
        if overlaps:
            with pytest.raises(ValueError, match="overlaps itself"):
                site(x)
            assert guards.count("sampler.logits", "calls") == 2
        else:
            assert site(x).tolist() == [0] * size[0]
            assert guards.count("sampler.logits", "calls") == 3
        x.as_strided((storage,), (1,)).fill_(math.nan)  # the same memory, now all NaN
        if not overlaps:
            assert site(x).tolist() == [int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)] * size[0]
            assert bool((x == 0).all())
    x.as_strided((storage,), (1,)).fill_(math.nan)
    with fresh_guardrails(sanitize=False) as guards:  # detect only: every layout is read
        site = guards.site("sampler.logits")
        site(torch.zeros(size))
        assert site(x).tolist() == [int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)] * size[0]


def test_a_reserve_from_another_thread_during_a_call_never_returns_stale_flags() -> None:
    """A call reads its thread's flags and workspace under the site lock. A `reserve()` from
    another thread started while the call looks its flags up re-allocates both; the call must
    not pair the last call's dirty flags with the fresh workspace, which says they hold
    nothing (a clean batch came back flagged NAN|NO_VALID_TOKEN, and a hook with
    abort_on = ["no_valid_token"] would end it)."""
    import threading

    dirty = int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)
    with fresh_guardrails() as guards:
        site = guards.site("sampler.logits")
        assert site(torch.zeros(4, 8)).tolist() == [0] * 4  # buffers and the view for 4 rows
        assert site(torch.full((4, 8), math.nan)).tolist() == [dirty] * 4
        buffers = site._state.buffers[threading.get_ident()]  # type: ignore[union-attr]
        capacity = buffers.capacity
        started: list[threading.Thread] = []

        class ReserveDuringLookUp(dict):  # type: ignore[type-arg]
            def get(self, key: Any, default: Any = None) -> Any:
                found = super().get(key, default)
                if not started:
                    other = threading.Thread(target=site.reserve, args=(capacity * 4, "cpu"))
                    started.append(other)
                    other.start()
                    other.join(0.5)  # done by now, unless the call holds the site lock
                return found

        buffers.views = ReserveDuringLookUp(buffers.views)
        assert site(torch.zeros(4, 8)).tolist() == [0] * 4
        started[0].join()
        assert buffers.capacity == capacity * 4  # the reserve did happen


def test_a_layout_seen_before_gets_the_same_verdict_and_no_other_layout_shares_it() -> None:
    """The overlap verdict is kept per (shape, strides) (engines guard the same view at every
    step): asked again, and after a same-shape layout with other strides, each keeps its own."""
    windows = torch.full((10,), math.nan).as_strided((3, 4), (2, 1))  # rows share values
    padded = torch.full((20,), math.nan).as_strided((3, 4), (5, 1))
    with fresh_guardrails() as guards:
        site = guards.site("sampler.logits")
        for _ in range(2):
            with pytest.raises(ValueError, match="overlaps itself"):
                site(windows)
            assert site(padded).tolist() == [int(RowFlag.NAN | RowFlag.NO_VALID_TOKEN)] * 3
            padded.fill_(math.nan)
        with pytest.raises(ValueError, match="overlaps itself"):
            site(windows)
    assert bool(windows.isnan().all())


def test_expanded_token_ids_are_refused_untouched_when_replacing() -> None:
    ids = torch.tensor([7]).expand(4)
    with fresh_guardrails() as guards:
        site = guards.token_site("sampler.token_ids", vocab_size=5)
        with pytest.raises(ValueError, match="memory overlaps itself"):
            site(ids)
        assert ids.tolist() == [7] * 4
        assert guards.count("sampler.token_ids", "calls") == 0
    with fresh_guardrails(sanitize=False) as guards:
        flags = guards.token_site("sampler.token_ids", vocab_size=5)(ids)
        assert flags.tolist() == [int(RowFlag.OOB_TOKEN)] * 4


# -- meta, sparse and nested tensors -----------------------------------------------------------


def test_meta_logits_are_a_value_error_and_leave_no_state_behind() -> None:
    with fresh_guardrails() as guards:
        site = guards.site("sampler.logits")
        tokens = guards.token_site("sampler.token_ids", vocab_size=8)
        with pytest.raises(ValueError, match="meta tensor holds no values"):
            site(torch.empty(2, 8, device="meta"))
        with pytest.raises(ValueError, match="meta tensor holds no values"):
            tokens(torch.zeros(3, dtype=torch.int64, device="meta"))
        # Meta counts cannot be read: counts() used to raise NotImplementedError for good.
        assert set(guards.counts().values()) == {0}
        x = torch.randn(2, 8)
        x[1, 1] = math.nan
        assert site(x).tolist() == [0, int(RowFlag.NAN)]
        assert guards.count("sampler.logits", "nan") == 1


def test_a_site_cannot_be_made_for_the_meta_device() -> None:
    with fresh_guardrails() as guards:
        with pytest.raises(ValueError, match="meta device"):
            guards.site("sampler.logits", device="meta")
        with pytest.raises(ValueError, match="meta device"):
            guards.site("eagle.verify").reserve(8, "meta")
        assert set(guards.counts().values()) <= {0}


def _quietly(make: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "prototype stage", "beta state"
        return make()


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x.to_dense() if not x.is_nested else torch.cat(x.unbind())


SPARSE_AND_NESTED = {
    "sparse_coo": (lambda x: x.to_sparse(), "sparse_coo tensor"),
    "sparse_csr": (lambda x: x.to_sparse_csr(), "sparse_csr tensor"),
    "nested": (lambda x: torch.nested.nested_tensor([x[:1], x[1:]]), "nested tensor"),
    # Two dimensions, like a batch of logits: what the site reads from shape and strides first.
    "nested_rows": (lambda x: torch.nested.nested_tensor(list(x.unbind())), "nested tensor"),
    "nested_jagged": (
        lambda x: torch.nested.nested_tensor([x[:1], x[1:]], layout=torch.jagged),
        "nested tensor",
    ),
}


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "after_clean_calls"])
@pytest.mark.parametrize("sanitize", [True, False], ids=["heal", "detect_only"])
@pytest.mark.parametrize("kind", SPARSE_AND_NESTED, ids=str)
def test_sparse_and_nested_logits_are_a_type_error_naming_the_layout(
    kind: str, sanitize: bool, warm: bool
) -> None:
    make, expected = SPARSE_AND_NESTED[kind]
    x = _quietly(lambda: make(torch.full((3, 8), math.nan)))
    with fresh_guardrails(sanitize=sanitize) as guards:
        site = guards.site("sampler.logits")
        # Warm: clean dense calls with every row count these tensors could show first, so
        # the site has buffers and flags views ready for them.
        warm_calls = [site(torch.zeros(rows, 8)) for rows in (2, 3)] if warm else []
        with pytest.raises(TypeError, match=f"dense strided tensor, got a {expected}"):
            site(x)
        with pytest.raises(TypeError, match="dense strided tensor"):
            site.rows_of(x)  # what compiled code is traced with
        assert guards.count("sampler.logits", "calls") == len(warm_calls)
        assert guards.count("sampler.logits", "nan") == 0
    assert bool(_quietly(lambda: _dense(x)).isnan().all())


@pytest.mark.parametrize("kind", ["sparse_coo", "nested"], ids=str)
def test_sparse_and_nested_token_ids_are_a_type_error(kind: str) -> None:
    ids = torch.tensor([[1, 9], [9, 1]])
    x = _quietly(
        lambda: ids.to_sparse() if kind == "sparse_coo" else torch.nested.nested_tensor(list(ids))
    )
    with fresh_guardrails() as guards, pytest.raises(TypeError, match="dense strided tensor"):
        guards.token_site("sampler.token_ids", vocab_size=5)(x)
