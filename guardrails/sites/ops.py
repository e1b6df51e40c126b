"""The guard as PyTorch operators, so that compiled and captured code keeps it.

`torch.compile` traces Python: left to itself it would trace into a site's call, specialise
the CPU kernel's host branch on the tensors it saw while tracing and so bake "clean" into the
graph. Under compilation a site therefore calls one of these `torch.library` custom ops
instead, which the compiler keeps opaque (no graph break, `fullgraph=True` included):

    guardrails::guard_logits_(Tensor(a!) logits, str site) -> Tensor      # uint8 flags [rows]
    guardrails::guard_token_ids_(Tensor(a!) token_ids, str site, SymInt vocab_size) -> Tensor

The op heals its tensor in place, exactly as the eager call does (its implementation *is* the
eager call: the CPU fast path or the Triton kernel, with the site's counts and reporting),
and returns a copy of the row flags: an op's output may not alias the site's buffers. `site`
is the key a site got from `register()` at creation (a string: `dynamic=True` would trace an
int argument as a symbol); the vocabulary a token-id call is checked against is an argument
of the op (a symbol under `dynamic=True`, such as `logits.shape[-1]`), so a compiled
`site(ids, vocab)` guards against the vocabulary it passes, as the eager call does. The fake
(meta) implementations check dtype and shape at trace time, so a bad tensor fails when the
graph is traced, as it would in eager code; a bad vocabulary fails when the op runs.

Under a CUDA graph (`mode="reduce-overhead"`) the op's kernel is captured and replays with
the graph: values, flags and device counts stay exact on every replay, while what runs in
Python (the call counter, the reporting tick) runs when the op runs in Python, not per replay.
This module imports torch only; sites reach it, it never reaches them but through `register`.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Protocol, cast

import torch

from guardrails import _process

__all__ = [
    "CompiledSite",
    "CompiledTokenSite",
    "guard_logits_",
    "guard_token_ids_",
    "register",
]


class CompiledSite(Protocol):
    """What the ops need of a site: its eager call, and the trace-time check."""

    def __call__(self, tensor: torch.Tensor, /) -> torch.Tensor: ...

    def rows_of(self, tensor: torch.Tensor, /) -> int | torch.SymInt:
        """The number of row flags a call on `tensor` returns; raises what the call would
        for a bad tensor (TypeError for its dtype, ValueError for its shape)."""
        ...


class CompiledTokenSite(CompiledSite, Protocol):
    """A token-id site: its eager call takes the vocabulary to check against."""

    def __call__(self, tensor: torch.Tensor, vocab_size: int | None = None, /) -> torch.Tensor: ...


_SITES: dict[str, weakref.ref[CompiledSite]] = {}
_KEYS = itertools.count(1)
_LOCK = _process.module_lock(__name__, "_LOCK")


def register(site: CompiledSite) -> str:
    """A key for `site`, held weakly: a dropped site's graphs fail loudly, never guard
    with another site's settings."""
    with _LOCK:
        key = str(next(_KEYS))
        _SITES[key] = weakref.ref(site, _forget(key))
    return key


def _forget(key: str) -> Callable[[weakref.ref[CompiledSite]], None]:
    def forget(_ref: weakref.ref[CompiledSite]) -> None:
        _SITES.pop(key, None)

    return forget


def _site(key: str) -> CompiledSite:
    ref = _SITES.get(key)
    site = None if ref is None else ref()
    if site is None:
        raise RuntimeError(
            f"guardrails: a compiled graph calls site #{key}, which no longer exists (its "
            "Guardrails instance was dropped); compile again against the new instance"
        )
    return site


@torch.library.custom_op("guardrails::guard_logits_", mutates_args=("logits",))
def guard_logits_(logits: torch.Tensor, site: str) -> torch.Tensor:
    """Guard `logits` in place at the logits site `site`; returns its row flags."""
    return _site(site)(logits).clone()


@guard_logits_.register_fake
def _guard_logits_fake(logits: torch.Tensor, site: str) -> torch.Tensor:
    return logits.new_empty((_site(site).rows_of(logits),), dtype=torch.uint8)


@torch.library.custom_op("guardrails::guard_token_ids_", mutates_args=("token_ids",))
def guard_token_ids_(token_ids: torch.Tensor, site: str, vocab_size: int) -> torch.Tensor:
    """Guard `token_ids` in place against `[0, vocab_size)` at the token-id site `site`;
    returns its row flags."""
    token_site = cast(CompiledTokenSite, _site(site))
    return token_site(token_ids, vocab_size).clone()


@guard_token_ids_.register_fake
def _guard_token_ids_fake(token_ids: torch.Tensor, site: str, vocab_size: int) -> torch.Tensor:
    return token_ids.new_empty((_site(site).rows_of(token_ids),), dtype=torch.uint8)
