"""guardrails: detect, heal, flag and count NaN/Inf logits at named sampling sites.

    import guardrails as gr
    guards = gr.Guardrails()                 # settings from GUARDRAILS_* and the config file
    flags = guards.site("sampler.logits")(logits)   # in place; uint8 row flags, or None

Importing this package has no side effects: no logging set-up, no metrics registered, no
environment read. Those happen when a `Guardrails` is built. (The one thing an import leaves
is an `os.register_at_fork` hook, `guardrails._process`, that re-makes guardrails' own locks in
a forked child: a lock is held from the first `default()` on, before any instance exists.)
"""

from __future__ import annotations

from guardrails.attach.handles import GuardedFunction, Handle
from guardrails.exceptions import ConfigError, Problem
from guardrails.flags import CountKind, RowFlag
from guardrails.logs import configure_json_logs
from guardrails.service import Guardrails, default, sanitize_logits_
from guardrails.settings.models import AttachSettings, GuardSettings, SiteSettings
from guardrails.sites import DisabledSite, LogitsSite, TokenSite

__all__ = [
    "AttachSettings",
    "ConfigError",
    "CountKind",
    "DisabledSite",
    "GuardSettings",
    "GuardedFunction",
    "Guardrails",
    "Handle",
    "LogitsSite",
    "Problem",
    "RowFlag",
    "SiteSettings",
    "TokenSite",
    "configure_json_logs",
    "default",
    "sanitize_logits_",
]

__version__ = "0.1.0"
