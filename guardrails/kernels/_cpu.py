"""CPU fast path: one pass of sums proves a clean batch clean; exact work only where it is not.

On a CPU a host branch is free, so the work follows the data:

1. One pass of sums. A finite sum proves there is no NaN and no +/-Inf in what it covers
   (both propagate through addition); `sum` is torch's cheapest full reduction on CPU for all
   three dtypes (`amax` is 2-4x slower on the 16-bit ones). Float32/bfloat16/float64 are
   summed per row, the floor's own reduction (`x.sum(-1)`): each thread takes whole rows.
   One sum of the batch combines per-thread partial sums (5-15% slower at B=8); per-chunk
   sums `[rows, chunks]` make many short reductions (1.1-1.65x the floor at B=16-64, where
   row sums are 1.02-1.08x; measured on 2 cores, V=151936). The site runs this check itself
   for a small batch (`check`); one row, or a tensor too small for torch to split, is summed
   whole. Float16 is summed per chunk of each row (~1K values, so chunk sums of real logits
   cannot overflow the dtype, where a row sum would): the same pass tells where a bad value
   is.
2. Where a sum is not finite, chunk sums tell where: of each row whose sum is not finite (a
   large batch), or of every row (a small batch whose check failed: one more pass, cheap at
   that size). A chunk whose sum is NaN or +Inf holds a NaN or +Inf (or overflowed: a false
   alarm, which costs time, never correctness). A -Inf sum means -Inf masks and nothing
   worse, so it is looked at only when -Inf is counted or when no chunk of its row is finite
   or +Inf (the row may hold no valid entry).
3. The selected chunks are gathered, classified exactly, healed with one `nan_to_num_` and
   written back; the per-row verdicts are assembled on the host from a few numbers.

Clean calls touch no memory besides the one read (the flags buffer is only re-zeroed after a
dirty call). The counts are exact per chunk (`_tallies`), so the flags and counts equal the
reference's bit for bit; tests check that on random inputs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from guardrails.flags import RowFlag
from guardrails.kernels.base import HealSpec, as_rows
from guardrails.kernels.reference import guard_logits_reference_
from guardrails.kernels.values import stored_value

__all__ = ["CPU_KERNEL", "CpuLogitsKernel", "chunk_sums", "guard_logits_cpu_"]

_INF = math.inf
_NEG_INF = -math.inf
# Target chunk lengths (values per chunk sum). Float16: 1K values of magnitude < 64 cannot
# overflow 65504, and its chunk sums are the clean check too. Float32/bfloat16 rows are
# chunked only where their sum is not finite. Short chunks keep the exact work on a dirty
# one small.
_TARGET_CHUNK = {torch.float16: 1024, torch.bfloat16: 1024}
_DEFAULT_TARGET_CHUNK = 4096
# Below this many values (13 rows of a 151936 vocab) the site's check sums the rows (the
# Python of two layers would be a visible share of the call), and a dirty call chunk-sums
# every row: one more pass, dominated at that size by per-op overhead anyway. From it the
# kernel sums the rows itself and chunk-sums only those that are not finite.
_CHUNKED_CHECK_MIN = 1 << 21
# From this many values (torch's parallel grain size) the small check sums rows, not the
# batch: below it one thread reduces either way, and `.item()` is cheaper than a list.
_ROW_SUMS_MIN = 1 << 15
# Runs of consecutive rows whose sums are not finite, chunk-summed one by one; past this, the
# whole batch is (a few small ops per run against one more pass).
_MAX_RUNS = 16
_FIELD_BITS = 16  # per count in a `_tallies` code: chunks stay shorter than 65536
_FIELD = (1 << _FIELD_BITS) - 1
_NAN = int(RowFlag.NAN)
_POSINF = int(RowFlag.POSINF)
_NEGINF = int(RowFlag.NEGINF)
_NO_VALID = int(RowFlag.NO_VALID_TOKEN)
_FLOAT16 = torch.float16


@functools.cache
def chunk_plan(vocab: int, target: int) -> tuple[int, int]:
    """`(chunk, count)`: `count` chunks of `chunk` values cover the first `chunk * count`
    columns; the rest (a tail shorter than a chunk) is summed as one more chunk.

    A divisor of `vocab` near `target` is preferred, so the common vocabularies need no tail
    (151936 = 128 * 1187).
    """
    if vocab <= target:
        return vocab, 1
    best = 0
    for size in range(max(1, target // 2), min(2 * target, vocab) + 1):
        if vocab % size == 0 and (best == 0 or abs(size - target) < abs(best - target)):
            best = size
    if best:
        return best, vocab // best
    return target, vocab // target


def chunk_sums(x: torch.Tensor, chunk: int, count: int) -> torch.Tensor:
    """Per-chunk sums of the rows of `x` ([rows, V]): `[rows, chunks]` in `x.dtype`."""
    rows, vocab = x.shape
    whole = chunk * count
    if whole == vocab:
        return x.view(rows, count, chunk).sum(-1)
    head = x.narrow(1, 0, whole).view(rows, count, chunk).sum(-1)
    tail = x.narrow(1, whole, vocab - whole).sum(-1, keepdim=True)
    return torch.cat((head, tail), 1)


def _all_finite(sums: torch.Tensor) -> bool:
    # Float32 accumulation: many finite float16 chunk sums may overflow float16 together.
    total = sums.sum(dtype=torch.float32) if sums.dtype == torch.float16 else sums.sum()
    return math.isfinite(total.item())


class _Workspace:
    """Host bookkeeping: the chunk plans by `(vocab, dtype)`, how far the flags buffer may
    hold non-zero bytes from an earlier dirty call, and the verdict of a `check` that the
    kernel call which follows it need not take again."""

    __slots__ = ("checked", "chunk", "extent", "plans")

    def __init__(self, chunk: int | None) -> None:
        self.chunk = chunk
        self.extent = 0
        self.plans: dict[tuple[int, torch.dtype], tuple[int, int]] = {}
        # False: `check` found this call's small batch not finite. Only ever False or None,
        # so a stale verdict (a call that raised in between) costs time, never correctness.
        self.checked: bool | None = None

    def plan(self, vocab: int, dtype: torch.dtype) -> tuple[int, int]:
        key = (vocab, dtype)
        plan = self.plans.get(key)
        if plan is None:
            target = self.chunk or _TARGET_CHUNK.get(dtype, _DEFAULT_TARGET_CHUNK)
            plan = self.plans[key] = chunk_plan(vocab, target)
        return plan


def _clean_rows(
    x: torch.Tensor, rows: int, vocab: int, dtype: torch.dtype, flags: torch.Tensor, ws: _Workspace
) -> bool:
    """The clean check of a small float32/bfloat16 batch `x` [rows, vocab] of `dtype`, which
    the caller has read (`CpuLogitsKernel.check_rows`: the site's short path calls it on every
    clean call, in one frame and without asking torch again; each getter is about a
    microsecond on a cold cache). True: clean (flags settled). False: not finite (kept in
    `ws.checked`, so the kernel call that follows skips the sum), or float16 or a large batch
    (the kernel's own check applies).

    Row sums where torch splits the rows between its threads (see the module docstring),
    added up on the host: a NaN or +/-Inf in any of them stays in the total. One row, or a
    tensor too small to split: one sum and `.item()`, cheaper than a list."""
    values = rows * vocab
    if dtype is _FLOAT16 or values >= _CHUNKED_CHECK_MIN or not values:
        return False  # not values: an empty vocabulary, whose rows have no valid token
    total = x.sum().item() if values < _ROW_SUMS_MIN or rows == 1 else sum(x.sum(-1).tolist())
    if not math.isfinite(total):
        ws.checked = False
        return False
    if ws.extent:
        _zero_flags(flags, ws)
    return True


def _clean(x: torch.Tensor, flags: torch.Tensor, ws: _Workspace) -> bool:
    """`_clean_rows` for logits of any shape `[..., vocab]` (`CpuLogitsKernel.check`); `flags`
    holds one entry per row."""
    dtype, rows, vocab = x.dtype, flags.numel(), x.shape[-1]
    if x.dim() != 2:
        if dtype is _FLOAT16 or not 0 < rows * vocab < _CHUNKED_CHECK_MIN:
            return False  # not this check's: before a reshape that may copy
        x = x.reshape(rows, vocab)  # a copy only for a non-contiguous N-d view: rare
    return _clean_rows(x, rows, vocab, dtype, flags, ws)


def _small_and_clean(x: torch.Tensor, flags: torch.Tensor, ws: _Workspace) -> bool | None:
    """`_clean` as three answers, its verdict returned, not kept. True: clean (flags
    settled); False: not finite; None: float16 or a large batch. (Off the site's hot path:
    the site asks `check`/`check_rows` first, and the kernel then reuses that verdict.)"""
    if x.dtype is _FLOAT16 or not 0 < x.numel() < _CHUNKED_CHECK_MIN:
        return None
    if _clean(x, flags, ws):
        return True
    ws.checked = None
    return False


def guard_logits_cpu_(
    x: torch.Tensor,
    flags: torch.Tensor,
    counts: torch.Tensor,
    spec: HealSpec,
    ws: _Workspace,
    small: bool | None = None,
) -> None:
    """Same contract as `guard_logits_reference_`, for 2-D `x` [rows, V] on the CPU.

    `small` is `_small_and_clean`'s answer when the caller already asked it."""
    if small is None:
        small = _small_and_clean(x, flags, ws)
    if small:
        return
    plan = ws.plan(x.shape[1], x.dtype)
    if small is False:  # a small batch whose check failed: chunk sums of every row
        _guard_chunks_(x, chunk_sums(x, *plan), plan, flags, counts, spec, ws)
        return
    if x.dtype is torch.float16:
        sums = chunk_sums(x, *plan)
        if not _all_finite(sums):
            _guard_chunks_(x, sums, plan, flags, counts, spec, ws)
            return
    else:
        bad = _nonfinite_rows(x)
        if bad:
            sums, of_rows = _row_chunk_sums(x, bad, plan)
            _guard_chunks_(x, sums, plan, flags, counts, spec, ws, of_rows)
            return
    if ws.extent:
        _zero_flags(flags, ws)


def _nonfinite_rows(x: torch.Tensor) -> list[int]:
    """The rows of `x` whose sums are not finite (the rows that may hold a bad value)."""
    # On the host: one list, where finding the rows on the device would take four small ops
    # (each 10-25 us right after a large reduction, measured). A float64 total that overflows
    # from finite row sums is a false alarm: no row is returned.
    sums: list[float] = x.sum(-1).tolist()
    if math.isfinite(sum(sums)):
        return []
    return [row for row, value in enumerate(sums) if not math.isfinite(value)]


def _row_chunk_sums(
    x: torch.Tensor, rows: list[int], plan: tuple[int, int]
) -> tuple[torch.Tensor, list[int] | None]:
    """Chunk sums of rows `rows` (ascending) of `x`, and the rows they are of (None: every
    row). A run of consecutive rows is summed in place, not copied out: a copy of three
    scattered rows measured 3-4x their sums (it reads and writes them once more). Past
    `_MAX_RUNS` runs, every row is summed: one pass, fewer small ops."""
    runs: list[list[int]] = []  # [first row, rows]
    for row in rows:
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, 1])
    if len(runs) > _MAX_RUNS:
        return chunk_sums(x, *plan), None
    parts = [chunk_sums(x.narrow(0, first, n), *plan) for first, n in runs]
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), rows


def _candidates(sums: torch.Tensor, rows: list[int] | None) -> tuple[list[int], list[float]]:
    """Flat `row * chunks + chunk` ids in `x` and values of the non-finite chunk sums; row `i`
    of `sums` is row `rows[i]` of `x` (every row in order where `rows` is None)."""
    flat = sums.view(-1)
    # x * 0 is NaN exactly where x is NaN or +/-Inf; two cheap ops where `isfinite` is five.
    where = (flat * 0).isnan().nonzero().view(-1)
    ids: list[int] = where.tolist()
    if rows is not None:
        n_chunks = sums.shape[1]
        ids = [rows[i // n_chunks] * n_chunks + i % n_chunks for i in ids]
    return ids, flat[where].tolist()


def _tallies(values: torch.Tensor) -> list[int]:
    """Per row of `values` ([n, <= 65535]): NaN + (+Inf << 16) + (-Inf << 32), exactly.

    Float ops only: comparisons that make bool masks, and reductions over them, run several
    times slower than arithmetic on the CPU. `values - finite` keeps exactly the NaN and
    +/-Inf entries (x - x = 0 for every finite x); in float64 each becomes its weight, and one
    float64 sum per row (integers below 2**53) holds all three counts.
    """
    special = (values - values.nan_to_num(0.0, 0.0, 0.0)).double()
    weights = special.nan_to_num_(1.0, float(1 << _FIELD_BITS), float(1 << (2 * _FIELD_BITS)))
    return [int(code) for code in weights.sum(-1).tolist()]


def _select(
    sums: torch.Tensor, rows: list[int] | None, count_neginf: bool
) -> tuple[list[int], dict[int, int]]:
    """Flat `row * chunks + chunk` ids of the chunks to examine, and for each row that may
    hold no valid entry, its number of chunks (all of them are selected)."""
    n_chunks = sums.shape[1]
    where, values = _candidates(sums, rows)
    # A row is empty only if every chunk sum is NaN or -Inf (no finite or +Inf chunk).
    masked: dict[int, int] = {}
    for flat, value in zip(where, values, strict=True):
        if value != _INF:
            row = flat // n_chunks
            masked[row] = masked.get(row, 0) + 1
    empty = {row: n for row, n in masked.items() if n == n_chunks}
    if count_neginf or not masked:
        return where, empty
    # A -Inf sum means -Inf masks and no NaN or +Inf: not counted at this site, so such a
    # chunk matters only in a row that may be empty.
    return [
        flat
        for flat, value in zip(where, values, strict=True)
        if value != _NEG_INF or flat // n_chunks in empty
    ], empty


def _guard_chunks_(
    x: torch.Tensor,
    sums: torch.Tensor,
    plan: tuple[int, int],
    flags: torch.Tensor,
    counts: torch.Tensor,
    spec: HealSpec,
    ws: _Workspace,
    rows: list[int] | None = None,
) -> None:
    """Exact work on the chunks `sums` flags; row `i` of `sums` is row `rows[i]` of `x`
    (every row in order where `rows` is None)."""
    vocab = x.shape[1]
    chunk, count = plan
    n_chunks = sums.shape[1]  # count, plus one for a tail
    selected, empty = _select(sums, rows, spec.count_neginf)
    if not selected:
        # Only -Inf masks (not counted here) and no empty row: clean after all.
        if ws.extent:
            _zero_flags(flags, ws)
        return

    per_row: dict[int, list[int]] = {}
    nan_value = stored_value(spec.nan_value, x.dtype)
    posinf_value = stored_value(spec.posinf_value, x.dtype)
    for gather, scatter, owners in _groups(x, selected, n_chunks, chunk, count):
        values = gather()  # a copy, [selected chunks, chunk]
        for row, code in zip(owners, _tallies(values), strict=True):
            acc = per_row.get(row)
            tally = [code & _FIELD, (code >> _FIELD_BITS) & _FIELD, code >> (2 * _FIELD_BITS)]
            if acc is None:
                per_row[row] = tally
            else:
                acc[0] += tally[0]
                acc[1] += tally[1]
                acc[2] += tally[2]
        if spec.sanitize:
            scatter(values.nan_to_num_(nan_value, posinf_value, _NEG_INF))

    totals = [0, 0, 0, 0, 0]
    row_flags: list[tuple[int, int]] = []
    for row, (n_nan, n_pinf, n_ninf) in per_row.items():
        flag = (_NAN if n_nan else 0) | (_POSINF if n_pinf else 0)
        totals[0] += n_nan
        totals[1] += n_pinf
        if spec.count_neginf:
            flag |= _NEGINF if n_ninf else 0
            totals[2] += n_ninf
        if flag:
            totals[3] += 1
        if row in empty and n_nan + n_ninf == vocab:
            flag |= _NO_VALID
            totals[4] += 1
            if spec.sanitize:
                # Nothing left to sample: written uniform, flagged NO_VALID_TOKEN.
                x.select(0, row).zero_()
        if flag:
            row_flags.append((row, flag))
    _zero_flags(flags, ws)
    if row_flags:
        if len(row_flags) <= 8:  # a few scalar writes beat building two index tensors
            for row, flag in row_flags:
                flags[row] = flag
        else:
            ids, row_bits = zip(*row_flags, strict=True)
            flags[torch.tensor(ids)] = torch.tensor(row_bits, dtype=torch.uint8)
        ws.extent = max(ws.extent, flags.numel())
    if any(totals):
        counts.add_(torch.tensor(totals, dtype=torch.int64))


# (read the chunks, write them back, the row of each chunk)
_Group = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], object], list[int]]


def _groups(
    x: torch.Tensor, selected: list[int], n_chunks: int, chunk: int, count: int
) -> list[_Group]:
    """How to read and write back the selected chunks: whole chunks, then a short tail."""
    rows, vocab = x.shape
    body = [flat for flat in selected if flat % n_chunks < count]
    tail = [flat // n_chunks for flat in selected if flat % n_chunks == count]
    groups: list[_Group] = []
    if body:
        owners = [flat // n_chunks for flat in body]
        if n_chunks == count and x.is_contiguous():
            # One index over [rows * chunks, chunk]: the cheapest gather and scatter.
            flat_view = x.view(rows * count, chunk)
            ids = torch.tensor(body, dtype=torch.long)
            groups.append(
                (
                    lambda: flat_view.index_select(0, ids),
                    lambda v: flat_view.index_copy_(0, ids, v),
                    owners,
                )
            )
        else:
            view = x.narrow(1, 0, chunk * count).view(rows, count, chunk)
            pair = torch.tensor([owners, [flat % n_chunks for flat in body]], dtype=torch.long)
            index = (pair[0], pair[1])
            groups.append((lambda: view[index], lambda v: view.index_put_(index, v), owners))
    if tail:
        tail_view = x.narrow(1, chunk * count, vocab - chunk * count)
        tail_ids = torch.tensor(tail, dtype=torch.long)
        groups.append(
            (
                lambda: tail_view.index_select(0, tail_ids),
                lambda v: tail_view.index_copy_(0, tail_ids, v),
                tail,
            )
        )
    return groups


def _zero_flags(flags: torch.Tensor, ws: _Workspace) -> None:
    flags.zero_()
    # Bytes past this view (left by a call with more rows) stay dirty until a longer view.
    if flags.numel() >= ws.extent:
        ws.extent = 0


class CpuLogitsKernel:
    """The CPU `LogitsKernel`; `chunk` overrides the chunk length (tests use tiny ones)."""

    name = "cpu"

    def __init__(self, chunk: int | None = None) -> None:
        # A plan may double the target to hit a divisor; a chunk's counts fit in 16 bits.
        if chunk is not None and not 1 <= chunk <= _FIELD // 2:
            raise ValueError(f"chunk must be in [1, {_FIELD // 2}], got {chunk}")
        self._chunk = chunk

    def workspace(self, rows: int, device: torch.device) -> Any:
        return _Workspace(self._chunk)

    # The site's first step (see `LogitsKernel`): a small float32/bfloat16 batch proved
    # clean by one pass of sums. At B=1 the whole call is a ~15 us sum, and every Python
    # layer between the site and it shows in the ratio.
    check = staticmethod(_clean)
    check_rows = staticmethod(_clean_rows)

    def __call__(
        self, x: torch.Tensor, flags: torch.Tensor, counts: torch.Tensor, spec: HealSpec, ws: Any
    ) -> None:
        small = ws.checked
        if small is None:
            # First, before any reshaping (see `check`).
            small = _small_and_clean(x, flags, ws)
            if small:
                return
        else:
            ws.checked = None
        rows = as_rows(x)
        if rows is None or rows.shape[1] == 0:
            # The reference writes every flag; `extent` says they may now be non-zero.
            ws.extent = max(ws.extent, flags.numel())
            guard_logits_reference_(x, flags, counts, spec)
            return
        guard_logits_cpu_(rows, flags, counts, spec, ws, small)


CPU_KERNEL = CpuLogitsKernel()
