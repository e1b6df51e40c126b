"""What a site accepts: its row count, and the refusals raised before anything is touched.

Refused, each with an error naming the site and what was wrong: a dtype the site does not
accept (`logits_type_error`, `token_type_error`: TypeError), a tensor that is sparse or nested
(TypeError), on the meta device or not on the site's pinned device (ValueError), logits without
a vocab dimension (ValueError), when healing one whose memory overlaps itself, such as an
expanded view (ValueError: writing it in place could not be consistent), and at a token-id site
a per-call vocabulary that is not an int > 0 or that the ids guardrails writes itself
(`replacement_id`, `eos_token_id`) fall outside (ValueError).

Row counts come in two kinds. `logits_rows` / `token_rows` only count: the hot paths call them
(written out, for logits) and let torch's own IndexError or RuntimeError out for a tensor with
no sizes. `checked_logits_rows` / `checked_token_rows` count or raise the site's clear error for
that tensor; the hot paths call them only after the plain count failed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import torch

from guardrails.exceptions import TensorTypeError, TensorValueError
from guardrails.sites._buffers import normalise

__all__ = [
    "INTEGER_DTYPES",
    "checked_logits_rows",
    "checked_token_rows",
    "checked_vocab",
    "leading_rows",
    "logits_rows",
    "logits_type_error",
    "overlaps",
    "refuse_device",
    "refuse_layout",
    "token_rows",
    "token_type_error",
    "written_id_outside",
]

_STRIDED: Final = torch.strided
# Not uint16/32/64: torch has no comparison kernels for them ("lt_cpu" not implemented), so
# they get a TypeError naming these instead of an error from inside the guard.
INTEGER_DTYPES: Final = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


# -- rows ----------------------------------------------------------------------------------


def leading_rows(tensor: torch.Tensor) -> int:
    """The product of every dimension but the last."""
    rows = 1
    for size in tensor.shape[:-1]:
        rows *= size
    return rows


def logits_rows(logits: torch.Tensor) -> int:
    """One row per `[..., vocab]` slice (an empty vocabulary too). Only counts: a 0-d tensor
    raises IndexError, a strided nested one RuntimeError (see `checked_logits_rows`)."""
    vocab = logits.shape[-1]
    return logits.numel() // vocab if vocab else leading_rows(logits)


def token_rows(ids: torch.Tensor) -> int:
    """One row per id for 0-d and 1-d ids, one per `[..., k]` slice otherwise. Only counts:
    a strided nested tensor raises RuntimeError (see `checked_token_rows`)."""
    dim = ids.dim()
    return leading_rows(ids) if dim >= 2 else ids.numel() if dim == 1 else 1


def checked_logits_rows(site: str, logits: torch.Tensor) -> int:
    """`logits_rows`, or the site's error for logits it cannot count."""
    try:
        return logits_rows(logits)
    except IndexError:
        raise TensorValueError(
            f"guardrails site {site!r}: logits must have a vocab dimension, got a 0-d tensor"
        ) from None
    except RuntimeError:
        if logits.is_nested:  # a strided nested tensor has no sizes
            refuse_layout(site, logits, False, "logits")
        raise


def checked_token_rows(site: str, ids: torch.Tensor) -> int:
    """`token_rows`, or the site's error for ids it cannot count."""
    try:
        return token_rows(ids)
    except RuntimeError:
        if ids.is_nested:  # a strided nested tensor has no sizes
            refuse_layout(site, ids, False, "token ids")
        raise


# -- layout and device ---------------------------------------------------------------------


def refuse_layout(site: str, tensor: torch.Tensor, sanitize: bool, what: str) -> None:
    """The slow half of the layout check, for tensors that are not plain contiguous ones:
    sparse and nested tensors are refused, and (when healing) memory that overlaps itself;
    any other strided view, and tensor subclasses, are fine."""
    if tensor.is_nested or tensor.layout is not _STRIDED:
        kind = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
        raise TensorTypeError(
            f"guardrails site {site!r}: {what} must be a dense strided tensor, got a "
            f"{kind} tensor; the tensor was not modified",
            "layout",
        )
    if sanitize and not tensor.is_contiguous() and overlaps(tensor):
        raise TensorValueError(
            f"guardrails site {site!r}: the {what}' memory overlaps itself (shape "
            f"{tuple(tensor.shape)}, strides {tensor.stride()}, e.g. an expanded view), "
            "so they cannot be healed in place consistently; pass a tensor that owns its "
            "memory (.contiguous()) or set sanitize = false for this site; the tensor was "
            "not modified",
            "layout",
        )


def refuse_device(
    site: str, device: torch.device, pinned: torch.device | None, *, tensor: bool
) -> None:
    """Refuse the meta device (it holds no values and no counts) and, for a tensor (`tensor`),
    a device other than the site's pinned one."""
    if tensor and pinned is not None and normalise(device) != normalise(pinned):
        raise TensorValueError(
            f"guardrails site {site!r} was created for device {pinned}; got a tensor on {device}",
            "device",
        )
    if device.type == "meta":
        detail = (
            "a meta tensor holds no values to guard; the tensor was not modified"
            if tensor
            else "the meta device holds no values to guard and no counts; use a real device"
        )
        raise TensorValueError(f"guardrails site {site!r}: {detail}", "device")


# Verdicts of `overlaps` by (shape, strides), which alone decide it. Engines guard the same
# view at every step (vLLM's logits are `[:, :vocab]` of a padded LM head's output), and the
# check of a view torch finds "too hard" costs 10-20 us of Python.
_VERDICTS: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}
_MAX_VERDICTS = 256  # a few shapes per engine; past this, new layouts are checked each call


def overlaps(x: torch.Tensor) -> bool:
    """Whether two elements of `x` share memory (writing them in place cannot be done
    consistently)."""
    if x.numel() <= 1:
        return False
    key = (tuple(x.shape), x.stride())
    verdict = _VERDICTS.get(key)
    if verdict is None:
        verdict = _overlaps(x)
        if len(_VERDICTS) < _MAX_VERDICTS:
            _VERDICTS[key] = verdict
    return verdict


def _overlaps(x: torch.Tensor) -> bool:
    verdict = torch._debug_has_internal_overlap(x)  # 0: no, 1: yes (stride 0), 2: too hard
    if verdict != 2:
        return verdict == 1
    # Strides sorted ascending, each past everything the smaller ones reach: no overlap.
    # That covers every slice, transpose and padded view.
    dims = sorted((st, sz) for sz, st in zip(x.shape, x.stride(), strict=True) if sz > 1)
    reach = 0
    for stride, size in dims:
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    # An unusual `as_strided` view: count the distinct offsets its elements use.
    span = sum(st * (sz - 1) for sz, st in zip(x.shape, x.stride(), strict=True)) + 1
    offsets = torch.arange(span, dtype=torch.int64).as_strided(x.shape, x.stride())
    ordered = offsets.flatten().sort().values
    return bool((ordered[1:] == ordered[:-1]).any())


# -- types ---------------------------------------------------------------------------------


def logits_type_error(
    site: str, logits: object, accepted: Iterable[torch.dtype]
) -> TensorTypeError:
    """The error for logits that are not a tensor of one of the `accepted` dtypes."""
    return _type_error(
        f"guardrails site {site!r}", "logits", logits, "logits dtype {} is not accepted", accepted
    )


def token_type_error(site: str, ids: object) -> TensorTypeError:
    """The error for token ids that are not a tensor of one of `INTEGER_DTYPES`."""
    return _type_error(
        f"guardrails token site {site!r}",
        "token ids",
        ids,
        "token ids must be an integer tensor, got {}",
        INTEGER_DTYPES,
    )


def _type_error(
    lead: str, what: str, value: object, wrong_dtype: str, accepted: Iterable[torch.dtype]
) -> TensorTypeError:
    if not isinstance(value, torch.Tensor):
        return TensorTypeError(
            f"{lead} expects a torch.Tensor of {what}, got {type(value).__name__}"
        )
    names = ", ".join(str(d).removeprefix("torch.") for d in accepted)
    return TensorTypeError(
        f"{lead}: {wrong_dtype.format(value.dtype)} (accepted: {names}); the tensor was not "
        "modified"
    )


# -- vocabulary ----------------------------------------------------------------------------


def written_id_outside(
    vocab_size: int, written: Iterable[tuple[str, int | None]]
) -> tuple[str, int] | None:
    """The first (setting, id) of the ids guardrails writes itself that `[0, vocab_size)` does
    not hold: the engine's embedding lookup would fail on it (a device-side assert on CUDA)."""
    for key, value in written:
        if value is not None and value >= vocab_size:
            return key, value
    return None


def checked_vocab(site: str, vocab_size: object, written: Iterable[tuple[str, int | None]]) -> int:
    """A call's own vocabulary, refused unless it is an int > 0 that holds the `written` ids."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise TensorValueError(
            f"guardrails token site {site!r}: vocab_size must be an int > 0, got {vocab_size!r}",
            "reference",
        )
    outside = written_id_outside(vocab_size, written)
    if outside is not None:
        raise TensorValueError(
            f"guardrails token site {site!r}: {outside[0]}={outside[1]} is outside the "
            f"vocabulary [0, {vocab_size}) of this call",
            "reference",
        )
    return vocab_size
