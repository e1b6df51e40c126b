"""`GuardLogitsProcessor`: a transformers `LogitsProcessor` that guards the scores `generate`
samples from.

    from guardrails.integrations.transformers import GuardLogitsProcessor
    guard = GuardLogitsProcessor(guards, eos_token_id=model.generation_config.eos_token_id)
    model.generate(**inputs, logits_processor=LogitsProcessorList([guard]))

Every call guards the scores in place at `site` (heal, flag, count; see the numeric contract).
Policy, from `[sites."<site>"] abort_on` in the settings or the `abort_on` argument:
- `[]` (default): heal and carry on; a row with no valid token samples from uniform scores.
- e.g. `["no_valid_token"]`: rows carrying any listed flag are forced to end: their scores
  become -inf except 0 at the EOS id(s), so generation stops that row instead of sampling
  garbage. Counted in `aborted_rows()`; the flags themselves are counted by the site.
No host sync: the decision is a `torch.where` on the device flags. One processor may serve
several threads at once: each call acts on its own call's flags (see `guardrails.sites._site`).
Under the abort policy the first call per (device, dtype, vocab) and per (device, thread)
makes the EOS row and a counter; inside a CUDA-graph capture that would be recorded into the
graph (the counter re-zeroed on every replay), so it is refused there: call the processor
once before capturing.
This module imports transformers; `import guardrails` never imports this module.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from transformers import LogitsProcessor

from guardrails.flags import RowFlag
from guardrails.service import default

if TYPE_CHECKING:
    from guardrails.service import Guardrails

__all__ = ["GuardLogitsProcessor"]


class GuardLogitsProcessor(LogitsProcessor):
    """Guard `generate`'s scores at `site`; end flagged rows with EOS under the abort policy."""

    def __init__(
        self,
        guards: Guardrails | None = None,
        site: str = "sampler.logits",
        *,
        eos_token_id: int | Sequence[int] | torch.Tensor | None = None,
        abort_on: str | Iterable[str] | None = None,
    ) -> None:
        self.guards = default() if guards is None else guards
        self.site = self.guards.site(site)
        if abort_on is None:
            self.abort_flags = self.guards.settings.site_settings(site).abort_flags
        else:
            names = [abort_on] if isinstance(abort_on, str) else list(abort_on)
            self.abort_flags = int(RowFlag.parse(names))
        self.eos_token_ids = _eos_ids(eos_token_id)
        if self.abort_flags and not self.eos_token_ids:
            raise ValueError(
                f"GuardLogitsProcessor at site {site!r}: the abort policy "
                f"({RowFlag(self.abort_flags)!r}) ends rows with EOS and needs eos_token_id "
                "(e.g. model.generation_config.eos_token_id)"
            )
        self.last_flags: torch.Tensor | None = None
        # Per (device, dtype, vocab): the row an aborted request is forced to; per (device,
        # thread): a device counter of aborted rows (an in-place add from two threads at once
        # could lose one). Both made outside the per-step path.
        self._ended: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
        self._aborted: dict[tuple[torch.device, int], torch.Tensor] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        # Exactly two parameters: LogitsProcessorList passes extra kwargs to processors that
        # declare more.
        flags = self.site(scores)
        self.last_flags = flags
        if flags is None or not self.abort_flags:
            return scores
        abort = flags.bitwise_and(self.abort_flags).ne(0)
        key = (scores.device, scores.dtype, scores.shape[-1])
        ended = self._ended.get(key)
        if ended is None:
            self._refuse_inside_capture(scores)
            ended = self._ended[key] = self._end_row(*key)
        where = (scores.device, threading.get_ident())
        counter = self._aborted.get(where)
        if counter is None:
            self._refuse_inside_capture(scores)
            counter = self._aborted[where] = torch.zeros(
                (), dtype=torch.int64, device=scores.device
            )
        counter.add_(abort.sum())
        return torch.where(abort.view(*scores.shape[:-1], 1), ended, scores)

    def _end_row(self, device: torch.device, dtype: torch.dtype, vocab: int) -> torch.Tensor:
        outside = [i for i in self.eos_token_ids if not 0 <= i < vocab]
        if outside:
            raise ValueError(
                f"GuardLogitsProcessor: eos_token_id {outside} outside the vocabulary [0, {vocab})"
            )
        row = torch.full((vocab,), float("-inf"), dtype=dtype, device=device)
        for i in self.eos_token_ids:
            row.narrow(0, i, 1).fill_(0.0)  # a fill per id: no index tensor to copy over
        return row

    def _refuse_inside_capture(self, scores: torch.Tensor) -> None:
        if scores.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"GuardLogitsProcessor at site {self.site.name!r}: first call on "
                f"{scores.device} ({scores.dtype}, vocab {scores.shape[-1]}) inside a "
                "CUDA-graph capture; call the processor once on this device, in this "
                "thread, before capturing"
            )

    def aborted_rows(self) -> int:
        """Rows ended with EOS so far (waits for the devices)."""
        return sum(int(counter) for counter in list(self._aborted.values()))

    def __repr__(self) -> str:
        policy = f"abort_on={RowFlag(self.abort_flags)!r}" if self.abort_flags else "heal"
        return f"<GuardLogitsProcessor site={self.site.name!r} {policy}>"


def _eos_ids(eos: int | Sequence[int] | torch.Tensor | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, torch.Tensor):
        return tuple(int(v) for v in eos.flatten().tolist())
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(v) for v in eos)
