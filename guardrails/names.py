"""Names every part of guardrails shares: site names, the well-known sites, log event names.

Site names become metric label values and config-file keys, so they are checked in one
place. This module imports nothing from guardrails (nor torch): everything may import it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

__all__ = [
    "ATTACH_ERROR_EVENT",
    "EVENT_NAMES",
    "GUARD_ERROR_EVENT",
    "HOOK_ACTS_ON",
    "HOOK_ERROR_EVENT",
    "KNOWN_HOOKS",
    "KNOWN_SITES",
    "LOGGER_NAME",
    "METRICS_SERVED_ELSEWHERE_EVENT",
    "NONFINITE_EVENT",
    "NONFINITE_ORIGIN_EVENT",
    "NO_VALID_TOKEN_EVENT",
    "OOB_EVENT",
    "REPORTING_ERROR_EVENT",
    "REQUEST_ABORTED_EVENT",
    "SITE_NOT_CALLED_EVENT",
    "STARTED_EVENT",
    "TRACE_INSTALLED_EVENT",
    "TRACE_NOT_INSTALLED_EVENT",
    "validate_site_name",
]

_SITE_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,99}")

# Well-known sampling sites. An enable list may name these, any site declared in the config
# file (a `[sites."name"]` table, possibly empty) and glob patterns matching either.
KNOWN_SITES: Final[Mapping[str, str]] = {
    "model.logits": "raw LM-head output, before any mask (a place to count -inf)",
    "sampler.logits": "logits entering the sampler, after masks, before temperature",
    "sampler.token_ids": "token ids returned by the sampler",
    "eagle.draft": "draft-model logits in speculative decoding",
    "eagle.verify": "target-model logits sampled at speculative verification",
    "eagle.token_ids": "token ids accepted at speculative verification",
}

# Engine hooks a config file may turn on (`hooks = [...]`): name -> "module:function" of
# guardrails' own integration code, called as `function(guards) -> list of handles` by
# `Guardrails.install_hooks()`. Only these names are accepted: nothing named in a config
# file is imported or evaluated beyond this table.
KNOWN_HOOKS: Final[Mapping[str, str]] = {
    # vLLM (V1 engine, both model runners): end a request whose logits had no valid token
    # with finish_reason="error", its KV evicted from the prefix cache.
    "vllm.end_poisoned_requests": "guardrails.integrations.vllm:end_poisoned_requests",
    # SGLang: end a request whose sampler.logits row matches abort_on through SGLang's own
    # FINISH_ABORT (HTTP 503), its KV kept out of the prefix cache.
    "sglang.abort_poisoned_requests": "guardrails.integrations.sglang:abort_poisoned_requests",
    # transformers (`generate()`, `transformers serve` in both modes): end a request whose
    # sampler.logits row matches abort_on with transformers' own error (HTTP 500, a stream's
    # error event); in continuous batching its non-finite keys/values are zeroed before the
    # batch's shared attention reads them, so the requests batched with it stay clean.
    "transformers.end_poisoned_requests": (
        "guardrails.integrations.transformers_hooks:end_poisoned_requests"
    ),
}

# The sites whose `abort_on` each hook acts on. A site whose `abort_on` no configured hook
# acts on ends nothing under `guardrails run`: `guardrails check` and the launcher say so.
HOOK_ACTS_ON: Final[Mapping[str, tuple[str, ...]]] = {
    "vllm.end_poisoned_requests": ("sampler.logits", "eagle.verify"),
    "sglang.abort_poisoned_requests": ("sampler.logits",),
    "transformers.end_poisoned_requests": ("sampler.logits",),
}

LOGGER_NAME: Final = "guardrails"
NONFINITE_EVENT: Final = "guardrails.nonfinite_logits"
NO_VALID_TOKEN_EVENT: Final = "guardrails.no_valid_token"
OOB_EVENT: Final = "guardrails.oob_token_ids"
REPORTING_ERROR_EVENT: Final = "guardrails.reporting_error"
# An attach point or hook whose target does not resolve: logged, counted, never fatal at run.
ATTACH_ERROR_EVENT: Final = "guardrails.attach_error"
# A patched target's call whose tensor the site refused: counted, logged once, call unguarded.
GUARD_ERROR_EVENT: Final = "guardrails.guard_error"
STARTED_EVENT: Final = "guardrails.started"  # once per Guardrails: what guards, what is off
# An attached site (or a hook half) the engine did not call while the heartbeat ran
# liveness_steps times: it is on no path this engine runs, so it guards nothing.
SITE_NOT_CALLED_EVENT: Final = "guardrails.site_not_called"
# An engine hook's own code failed at run time: counted, logged once per part, call unhooked.
HOOK_ERROR_EVENT: Final = "guardrails.hook_error"
# An engine hook ended a request through the engine's own path: one event per request, with the
# engine's request id (never a label, never a prompt or token).
REQUEST_ABORTED_EVENT: Final = "guardrails.request_aborted"
# GUARDRAILS_METRICS_PORT is served by another process of the same process tree.
METRICS_SERVED_ELSEWHERE_EVENT: Final = "guardrails.metrics_served_elsewhere"
# Tracing named the traced module where a site's non-finite values were born.
NONFINITE_ORIGIN_EVENT: Final = "guardrails.nonfinite_origin"
# A model's modules were traced (by `guards.trace()` or a loader under `guardrails run`).
TRACE_INSTALLED_EVENT: Final = "guardrails.trace_installed"
# Tracing was asked for, and the heartbeat ran liveness_steps times in a process that traced
# no model: the engine built its model through a loader guardrails does not patch.
TRACE_NOT_INSTALLED_EVENT: Final = "guardrails.trace_not_installed"
EVENT_NAMES: Final = (
    NONFINITE_EVENT,
    NO_VALID_TOKEN_EVENT,
    OOB_EVENT,
    REPORTING_ERROR_EVENT,
    GUARD_ERROR_EVENT,
    ATTACH_ERROR_EVENT,
    SITE_NOT_CALLED_EVENT,
    STARTED_EVENT,
    HOOK_ERROR_EVENT,
    REQUEST_ABORTED_EVENT,
    METRICS_SERVED_ELSEWHERE_EVENT,
    NONFINITE_ORIGIN_EVENT,
    TRACE_INSTALLED_EVENT,
    TRACE_NOT_INSTALLED_EVENT,
)


def validate_site_name(name: object) -> str:
    """Site names become metric labels: short, printable, no spaces."""
    if not isinstance(name, str) or not _SITE_NAME.fullmatch(name):
        raise ValueError(
            f"invalid site name {name!r}: use 1-100 characters from letters, digits and "
            "'_.:-', such as 'sampler.logits'"
        )
    return name
