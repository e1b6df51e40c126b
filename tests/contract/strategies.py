"""Hypothesis strategies for logits tensors with bad values, shared by the contract's property
tests: moderate or extreme finite values, NaN/+Inf/-Inf at random positions, whole rows of
NaN, of -Inf and of both, clean rows; ranks 1-3, empty leading dims, and five memory layouts
(contiguous, strided vocab, vocab-major, non-flattenable leading dims, a slice of a larger
tensor)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_DTYPES = (*DTYPES, torch.float64)
LAYOUTS = ("contiguous", "last_dim_strided", "vocab_major", "leading_transposed", "sliced_view")
ROW_MODES = ("random", "random", "random", "all_nan", "all_neginf", "nan_and_neginf", "clean")


@dataclass
class Case:
    tensor: torch.Tensor
    description: str


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A tensor of `shape` whose memory layout is `layout` (a view where not contiguous)."""
    if layout == "last_dim_strided":
        base = torch.zeros((*shape[:-1], 2 * shape[-1] + 1), dtype=dtype)
        return base[..., 1::2]
    if layout == "vocab_major" and len(shape) >= 2:
        base = torch.zeros((shape[-1], *shape[:-1]), dtype=dtype)
        return base.movedim(0, -1)  # the vocab dim has the largest stride
    if layout == "leading_transposed" and len(shape) == 3:
        base = torch.zeros((shape[1], shape[0], shape[2]), dtype=dtype)
        return base.transpose(0, 1)  # leading dims cannot be flattened without a copy
    if layout == "sliced_view" and len(shape) >= 2:
        base = torch.zeros((shape[0] + 2, *shape[1:]), dtype=dtype)
        return base[1 : 1 + shape[0]]
    return torch.zeros(shape, dtype=dtype)


@st.composite
def logits_cases(
    draw: st.DrawFn,
    *,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    max_rows: int = 5,
    min_vocab: int = 1,
    max_vocab: int = 40,
    max_abs: float | None = 1e4,
    layouts: tuple[str, ...] = LAYOUTS,
    vocab: st.SearchStrategy[int] | None = None,
) -> Case:
    """Random logits with NaN/+Inf/-Inf at random positions, whole bad rows, any rank/layout.

    `max_abs` bounds the finite values (None: anything the dtype holds, subnormals included).
    `vocab` draws the vocabulary size (default: uniform in [min_vocab, max_vocab]).
    """
    dtype = draw(st.sampled_from(dtypes))
    rank = draw(st.integers(1, 3))
    vocab_size = draw(st.integers(min_vocab, max_vocab) if vocab is None else vocab)
    lead = tuple(draw(st.lists(st.integers(0, max_rows), min_size=rank - 1, max_size=rank - 1)))
    shape = (*lead, vocab_size)
    layout = draw(st.sampled_from(layouts))
    seed = draw(st.integers(0, 2**31 - 1))
    probs = [draw(st.sampled_from((0.0, 0.02, 0.2, 0.6))) for _ in range(3)]
    gen = torch.Generator().manual_seed(seed)

    x = _allocate(shape, dtype, layout)
    if max_abs is None:
        finfo = torch.finfo(dtype)
        scale = draw(st.sampled_from((finfo.tiny, 1.0, 1e3, finfo.max / 4)))
        values = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        values = values.clamp(-finfo.max, finfo.max)
    else:
        values = torch.randn(shape, generator=gen, dtype=torch.float64) * (max_abs / 4)
        values = values.clamp(-max_abs, max_abs)
    x.copy_(values.to(dtype))
    flat_rows = x.reshape(-1, vocab_size) if x.numel() else None
    rows = flat_rows.shape[0] if flat_rows is not None else 0
    for row in range(rows):
        mode = draw(st.sampled_from(ROW_MODES))
        index = _row_index(x, row)
        if mode == "clean":
            continue
        if mode == "all_nan":
            x[index] = math.nan
        elif mode == "all_neginf":
            x[index] = -math.inf
        elif mode == "nan_and_neginf":
            pick = torch.rand(vocab_size, generator=gen) < 0.5
            x[index] = torch.where(pick, math.nan, -math.inf).to(dtype)
        else:
            r = torch.rand(vocab_size, generator=gen)
            line = x[index].clone()
            line[r < probs[0]] = math.nan
            line[(r >= probs[0]) & (r < probs[0] + probs[1])] = math.inf
            lo = probs[0] + probs[1]
            line[(r >= lo) & (r < lo + probs[2])] = -math.inf
            x[index] = line
    return Case(x, f"{dtype} shape={shape} layout={layout} strides={x.stride()} seed={seed}")


def _row_index(x: torch.Tensor, row: int) -> tuple[int, ...]:
    """The index of flat row `row` of `x` ([..., V]) as a tuple over the leading dims."""
    index = []
    for size in reversed(x.shape[:-1]):
        index.append(row % size)
        row //= size
    return tuple(reversed(index))


def dirty_logits(
    rows: int, vocab: int, dtype: torch.dtype, *, strided: bool = False
) -> torch.Tensor:
    """Logits on the GPU with every kind of bad row (rows >= 6): NaN among finite values, +Inf,
    all NaN, all -inf, NaN and -inf only, +Inf beside NaN; -inf masks in every row."""
    generator = torch.Generator(device="cuda").manual_seed(rows * 1000 + vocab)
    if strided:
        base = torch.empty(rows, 2 * vocab, device="cuda", dtype=dtype)
        x = base[:, ::2]
    else:
        x = torch.empty(rows, vocab, device="cuda", dtype=dtype)
    x.copy_(torch.randn(rows, vocab, device="cuda", generator=generator) * 4 - 3)
    x[:, 17::97] = -math.inf  # masks: legitimate, counted only where configured
    x[0, [3, vocab // 2, vocab - 1]] = math.nan
    x[1, [5, 4096]] = math.inf
    x[2] = math.nan
    x[3] = -math.inf
    x[4, ::2] = math.nan
    x[4, 1::2] = -math.inf
    x[5, 0] = math.inf
    x[5, 1] = math.nan
    return x
