"""The fused detect+count+heal Triton kernel (device code only; see `triton_impl` for the launch).

Grid `(rows, splits)`: program `(r, p)` owns columns `[p * chunk, min((p + 1) * chunk, V))` of
row `r`. It reads them once, classifying in float32 (exact for NaN and +/-Inf) and counting
NaN, +Inf and -Inf per lane; only if it saw NaN or +Inf (and the site heals) does it read its
chunk again and store the replacements, masked to the bad entries. It adds its non-zero value
counts to `counts`, one atomic per kind that occurred: a clean program adds nothing there.

The row verdict (flag, row counts, the all-`0` write of a row with no valid entry) needs the
whole row. With `MULTI` false one program owns the row and decides alone. Otherwise every
program adds one packed word (its only atomic on a clean call) into the row's slot of
`rowstate` (int64, 12-bit fields: tickets, programs that saw NaN, +Inf, -Inf, a valid entry);
the program whose add completes the ticket count holds the whole row's summary in the
returned value, finalises the row and writes the slot back to 0 for the next call (so
CUDA-graph replays start clean).

Memory ordering: the only cross-program data dependence is "heal stores of every program of a
row, then (maybe) the all-0 stores of the last one". Each program heals before its ticket
add; `debug_barrier` makes the whole CTA's stores precede that add, which Triton issues with
acq_rel semantics at GPU scope (release: the stores are visible before the add is). The last
program's add is an acquire that reads the sum of all earlier adds (RMWs on one word extend
every release sequence), so every heal store happens-before its zero stores. The summary
itself travels inside the atomic word, so no other load needs ordering.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Width of each packed field of a row word; the host keeps splits <= MAX_SPLITS to fit.
MAX_SPLITS = 4095
MAX_ITERS = 1023  # blocks per program, so that a lane's 10-bit tallies cannot overflow
FIELD_BITS = tl.constexpr(12)
_FIELD_MASK = tl.constexpr(MAX_SPLITS)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def guard_logits_kernel(
    x_ptr: tl.tensor,
    flags_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    rowstate_ptr: tl.tensor,
    vocab: tl.tensor,
    stride_row: tl.tensor,
    stride_col: tl.tensor,
    chunk: tl.tensor,
    nan_value: tl.tensor,
    posinf_value: tl.tensor,
    BLOCK: tl.constexpr,
    SANITIZE: tl.constexpr,
    COUNT_NEGINF: tl.constexpr,
    MULTI: tl.constexpr,
) -> None:
    row = tl.program_id(0)
    part = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * stride_row
    start = part * chunk
    end = tl.minimum(start + chunk, vocab)
    lanes = tl.arange(0, BLOCK)

    # One packed tally per lane (NaN | +Inf << 10 | -Inf << 20; the host keeps the loop under
    # 1024 iterations), reduced once after the loop: few registers, no per-block cross-warp sum.
    tally = tl.full([BLOCK], 0, dtype=tl.int32)
    for base in range(start, end, BLOCK):
        cols = base + lanes
        # Classified in float32 (exact for NaN/Inf); the interpreter keeps bfloat16 as raw
        # bits, so comparing in the storage type would be wrong there.
        v = tl.load(row_ptr + cols * stride_col, mask=cols < end, other=0.0).to(tl.float32)
        tally += (
            (v != v).to(tl.int32)
            + ((v == float("inf")).to(tl.int32) << 10)
            + ((v == float("-inf")).to(tl.int32) << 20)
        )
    # `tl.sum` is itself a jitted helper, which only runs in the interpreter when triton was
    # imported under TRITON_INTERPRET; `reduce` is a builtin, and with this combine function
    # the interpreter takes its numpy fast path.
    n_nan = tl.reduce(tally & 1023, 0, tl.standard._sum_combine)
    n_pinf = tl.reduce((tally >> 10) & 1023, 0, tl.standard._sum_combine)
    n_ninf = tl.reduce(tally >> 20, 0, tl.standard._sum_combine)
    # Masked-off lanes load 0.0, so every entry neither NaN nor -Inf is a valid one.
    has_valid = (end - start) - n_nan - n_ninf > 0

    # Nested ifs: the constexpr test removes the whole branch at compile time.
    if SANITIZE:  # noqa: SIM102
        if n_nan + n_pinf > 0:
            for base in range(start, end, BLOCK):
                cols = base + lanes
                inside = cols < end
                ptrs = row_ptr + cols * stride_col
                v = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
                is_nan = v != v
                bad = inside & (is_nan | (v == float("inf")))
                fixed = tl.where(is_nan, nan_value, posinf_value).to(x_ptr.dtype.element_ty)
                tl.store(ptrs, fixed, mask=bad)

    if n_nan > 0:
        tl.atomic_add(counts_ptr + 0, n_nan.to(tl.int64), sem="relaxed")
    if n_pinf > 0:
        tl.atomic_add(counts_ptr + 1, n_pinf.to(tl.int64), sem="relaxed")
    if COUNT_NEGINF:  # noqa: SIM102  (as above)
        if n_ninf > 0:
            tl.atomic_add(counts_ptr + 2, n_ninf.to(tl.int64), sem="relaxed")

    if MULTI:
        word = (
            1
            + ((n_nan > 0).to(tl.int64) << FIELD_BITS)
            + ((n_pinf > 0).to(tl.int64) << (2 * FIELD_BITS))
            + ((n_ninf > 0).to(tl.int64) << (3 * FIELD_BITS))
            + (has_valid.to(tl.int64) << (4 * FIELD_BITS))
        )
        tl.debug_barrier()  # every lane's heal stores precede the release below
        total = tl.atomic_add(rowstate_ptr + row, word, sem="acq_rel", scope="gpu") + word
        if (total & _FIELD_MASK) == tl.num_programs(1):
            tl.debug_barrier()
            _finish_row(
                row_ptr,
                flags_ptr + row,
                counts_ptr,
                vocab,
                stride_col,
                ((total >> FIELD_BITS) & _FIELD_MASK) > 0,
                ((total >> (2 * FIELD_BITS)) & _FIELD_MASK) > 0,
                ((total >> (3 * FIELD_BITS)) & _FIELD_MASK) > 0,
                ((total >> (4 * FIELD_BITS)) & _FIELD_MASK) > 0,
                BLOCK,
                SANITIZE,
                COUNT_NEGINF,
            )
            tl.store(rowstate_ptr + row, tl.full([], 0, dtype=tl.int64))
    else:
        _finish_row(
            row_ptr,
            flags_ptr + row,
            counts_ptr,
            vocab,
            stride_col,
            n_nan > 0,
            n_pinf > 0,
            n_ninf > 0,
            has_valid,
            BLOCK,
            SANITIZE,
            COUNT_NEGINF,
        )


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _finish_row(
    row_ptr: tl.tensor,
    flag_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    vocab: tl.tensor,
    stride_col: tl.tensor,
    any_nan: tl.tensor,
    any_pinf: tl.tensor,
    any_ninf: tl.tensor,
    has_valid: tl.tensor,
    BLOCK: tl.constexpr,
    SANITIZE: tl.constexpr,
    COUNT_NEGINF: tl.constexpr,
) -> None:
    flag = any_nan.to(tl.int32) + any_pinf.to(tl.int32) * 2
    if COUNT_NEGINF:
        flag += any_ninf.to(tl.int32) * 4
    if flag != 0:
        tl.atomic_add(counts_ptr + 3, tl.full([], 1, dtype=tl.int64), sem="relaxed")
    if has_valid == 0:
        flag += 8
        tl.atomic_add(counts_ptr + 4, tl.full([], 1, dtype=tl.int64), sem="relaxed")
        if SANITIZE:
            # Nothing left to sample: the row is written uniform, flagged NO_VALID_TOKEN.
            lanes = tl.arange(0, BLOCK)
            for base in range(0, vocab, BLOCK):
                cols = base + lanes
                tl.store(
                    row_ptr + cols * stride_col,
                    tl.full([BLOCK], 0, dtype=row_ptr.dtype.element_ty),
                    mask=cols < vocab,
                )
    tl.store(flag_ptr, flag.to(tl.uint8))
