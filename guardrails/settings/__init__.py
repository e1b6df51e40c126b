"""Configuration: `GuardSettings`, read once at start-up from arguments, `GUARDRAILS_*`
variables and an optional TOML file.

- `models`: the pydantic models (`GuardSettings` and its tables).
- `fields`: the kinds of value the fields hold (`Switch`, `Port`, `Targets`, ...), each with
  its validation bound to the type.
- `checks`: the checks that need several fields at once, and the notices.
- `sources`: the three sources (arguments, environment, file) and the origin of every key.
- `problems`: pydantic errors as `Problem`s with "did you mean".
- `schema`: field metadata, key paths and value spellings shared by errors, docs and the CLI.
- `targets`: the two small attach languages (`package.module:Class.method`, `arg:NAME.attr`).
- `docs`: the settings reference generated from the models (`make docs`).
- `toml`: a small TOML writer (tomllib only reads).

May import `guardrails.exceptions`, `flags` and `names`; torch only late, inside the check
of configured replacement values (`guardrails.kernels.values`).
"""

from __future__ import annotations

from guardrails.names import KNOWN_SITES
from guardrails.settings.models import (
    ALL_DTYPES,
    AttachSettings,
    GuardSettings,
    MetricsSettings,
    ReportingSettings,
    SiteSettings,
    TraceSettings,
)
from guardrails.settings.sources import ENV_VARS, EnvVar

__all__ = [
    "ALL_DTYPES",
    "ENV_VARS",
    "KNOWN_SITES",
    "AttachSettings",
    "EnvVar",
    "GuardSettings",
    "MetricsSettings",
    "ReportingSettings",
    "SiteSettings",
    "TraceSettings",
]
