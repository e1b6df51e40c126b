"""Attaching sites to code you do not own, removably.

- `handles`: `Handle` and `GuardedFunction` (what every attach returns), the forward hook,
  and `logits_of` (finding the logits in a model output).
- `points`: `AttachPoint`, one parsed `[[attach]]` entry or `guards.patch(...)` call, and
  `AttachError`.
- `resolve`: walking a target with `getattr` and picking a value out of a call, changing
  nothing (shared by patching and `guardrails check`).
- `patching`: `PatchHandle`, which wraps the target when its module is imported.
- `liveness`, `loaders`: the heartbeat and the liveness self-check; the loader patches that
  trace each model an engine builds.
- One `Guardrails`'s parts: `attachment` (`Attachment`: its patches, heartbeat and engine
  hooks), `traces` (`Traces`: its traces and trace loaders), `errors` (`Recorders`: its error
  recorders and the rule for an attach failure).

May import `guardrails.exceptions`, `flags`, `names`, `logs`, `settings`, `reporting` and
`tracing`; never the service or the sites, which it sees through small protocols
(`SiteCall`, `PatchOwner`) or the callables it is given.
"""

from __future__ import annotations

from guardrails.attach.handles import GuardedFunction, Handle, SiteCall, attach_module, logits_of

__all__ = ["GuardedFunction", "Handle", "SiteCall", "attach_module", "logits_of"]
