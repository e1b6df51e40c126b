"""Hypothesis strategies for logits tensors with bad values, shared by the property tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_VIEW = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}
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
) -> Case:
    """Random logits with NaN/+Inf/-Inf at random positions, whole bad rows, any rank/layout.

    `max_abs` bounds the finite values (None: anything the dtype holds, subnormals included).
    """
    dtype = draw(st.sampled_from(dtypes))
    rank = draw(st.integers(1, 3))
    vocab = draw(st.integers(min_vocab, max_vocab))
    lead = tuple(draw(st.lists(st.integers(0, max_rows), min_size=rank - 1, max_size=rank - 1)))
    shape = (*lead, vocab)
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
    flat_rows = x.reshape(-1, vocab) if x.numel() else None
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
            pick = torch.rand(vocab, generator=gen) < 0.5
            x[index] = torch.where(pick, math.nan, -math.inf).to(dtype)
        else:
            r = torch.rand(vocab, generator=gen)
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
