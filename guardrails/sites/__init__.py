"""Sites: the named objects a guarded call goes through, and the registry that makes them.

- `registry`: `SiteRegistry`, the sites of one `Guardrails` by name, made on first request
  from its settings and registered with its reporter.
- `_site`: `LogitsSite`, `TokenSite`, `DisabledSite`: the hot paths (dtype check, buffers,
  kernel, counts, reporting tick).
- `_buffers`: a site's per-device counts and per-thread (on CUDA per thread and stream) row
  flags and kernel workspace.
- `_inputs`: what a site refuses, with which error, and its row count.
- `ops`: the same call as `torch.library` ops (`guardrails::guard_logits_`,
  `guardrails::guard_token_ids_`) for compiled code.

May import `guardrails.kernels`, `reporting` (the host mirror, the reporter), `settings`,
`_cuda`, `_process` and the shared vocabulary; never `attach`, the service or the
integrations, which use sites through what this package exports.
"""

from __future__ import annotations

from guardrails.sites._site import DisabledSite, LogitsSite, Site, TokenSite
from guardrails.sites.registry import SiteRegistry

__all__ = ["DisabledSite", "LogitsSite", "Site", "SiteRegistry", "TokenSite"]
