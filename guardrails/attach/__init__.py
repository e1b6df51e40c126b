"""Attaching sites to code you do not own, removably.

- `handles`: `Handle` and `GuardedFunction` (what every attach returns), the forward hook,
  and `logits_of` (finding the logits in a model output).
- `points`: `AttachPoint`, one parsed `[[attach]]` entry or `guards.patch(...)` call, and
  `AttachError`.
- `resolve`: walking a target with `getattr` and picking a value out of a call, changing
  nothing (shared by patching and `guardrails check`).
- `patching`: `PatchHandle`, which wraps the target when its module is imported.

May import `guardrails.exceptions`, `flags`, `names`, `settings` and (lazily, to count the
calls a patch leaves unguarded) `reporting.metrics`; never the service or the sites, which it
sees through small protocols (`SiteCall`, `PatchOwner`).
"""

from __future__ import annotations

from guardrails.attach.handles import GuardedFunction, Handle, SiteCall, attach_module, logits_of

__all__ = ["GuardedFunction", "Handle", "SiteCall", "attach_module", "logits_of"]
