"""The settings models: `GuardSettings` and its tables, validated once at construction.

Precedence, first wins: explicit arguments > `GUARDRAILS_*` environment variables > the TOML
file named by `GUARDRAILS_CONFIG_FILE` (or the `config_file` argument) > defaults. The object is
a frozen snapshot; nothing re-reads the environment afterwards.

Every bad value is collected and raised together as one `ConfigError` that names its origin
(variable, file key or argument) and the accepted values. An unknown `GUARDRAILS_*` variable,
an unknown file key and an unknown site name in an enable list are errors too, each with the
closest valid name. No value, however malformed, silently switches protection off: only
`GUARDRAILS_ENABLED=false` does that.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from guardrails.exceptions import ConfigError, Problem
from guardrails.flags import RowFlag
from guardrails.names import KNOWN_SITES, validate_site_name
from guardrails.settings.problems import closest, problems_from, site_hint
from guardrails.settings.schema import field_meta, part
from guardrails.settings.sources import COLLECTOR, Collector, EnvSource, FileSource, InitSource
from guardrails.settings.targets import REF_SYNTAX, TARGET_SYNTAX, parse_ref, parse_target

__all__ = [
    "ALL_DTYPES",
    "AttachSettings",
    "GuardSettings",
    "MetricsSettings",
    "ReportingSettings",
    "SiteSettings",
]

DtypeName = Literal["float32", "bfloat16", "float16", "float64"]
ALL_DTYPES: tuple[DtypeName, ...] = ("float32", "bfloat16", "float16", "float64")

_BOOL = "true or false (also 1/0, yes/no, on/off)"
_ABORT_FLAGS = "row flag names: nan, posinf, neginf, no_valid_token, any; [] heals and carries on"


def _no_float_switch(value: object) -> object:
    # pydantic's lax bool also takes the floats 0.0 and 1.0 (from TOML): no documented
    # spelling is a float, and `enabled = 0.0` must not be one more way to switch off.
    if isinstance(value, float):
        raise ValueError("a switch takes true or false, not a float")
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SiteSettings(_Frozen):
    """Per-site overrides: a `[sites."name"]` table in the config file."""

    sanitize: Annotated[
        bool | None,
        Field(**field_meta(_BOOL, "heal in place at this site; unset: the global value")),
    ] = None
    async_assert: Annotated[
        bool | None,
        Field(**field_meta(_BOOL, "device-side assert at this site; unset: the global value")),
    ] = None
    count_neginf: Annotated[
        bool,
        Field(
            **field_meta(_BOOL, "count -inf as bad (raw logits before any mask); never rewritten")
        ),
    ] = False
    nan_value: Annotated[
        float,
        Field(
            **field_meta(
                "-inf, or a finite number that stays finite in every dtype",
                "what NaN becomes while its row keeps a valid entry",
            )
        ),
    ] = -math.inf
    posinf_value: Annotated[
        float | None,
        Field(
            **field_meta(
                "a finite number that stays finite in every dtype after / T",
                "what +Inf becomes; unset: min(1e30, 0.5 * finfo.max * min(1, min_temperature))",
            )
        ),
    ] = None
    dtypes: Annotated[
        tuple[DtypeName, ...],
        Field(
            min_length=1,
            **field_meta(
                ", ".join(ALL_DTYPES), "logits dtypes the site accepts (others: TypeError)"
            ),
        ),
    ] = ALL_DTYPES
    replacement_id: Annotated[
        int, Field(ge=0, **field_meta("an integer >= 0", "what an out-of-vocab token id becomes"))
    ] = 0
    # Policy for integrations that can end a request (GuardLogitsProcessor): rows carrying
    # any of these flags are forced to end (EOS) instead of sampling from healed logits.
    abort_on: Annotated[
        tuple[str, ...],
        Field(
            **field_meta(_ABORT_FLAGS, "rows with these flags end with EOS (GuardLogitsProcessor)")
        ),
    ] = ()

    @field_validator("sanitize", "async_assert", "count_neginf", mode="before")
    @classmethod
    def _site_switch(cls, value: object) -> object:
        return _no_float_switch(value)

    @field_validator("abort_on")
    @classmethod
    def _known_flags(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        RowFlag.parse(names)  # raises ValueError naming the unknown flag
        return tuple(name.strip().lower() for name in names)

    @property
    def abort_flags(self) -> int:
        """`abort_on` as a bit mask of `RowFlag`s (0: heal and carry on)."""
        return int(RowFlag.parse(self.abort_on))


class AttachSettings(_Frozen):
    """One `[[attach]]` entry: guard a value of someone else's callable at `site`.

    Applied when `target`'s module is imported (see `guardrails.attach.patching`).
    Only the syntax is checked here; whether the target exists is checked when it is applied
    and by `guardrails check`.
    """

    site: Annotated[
        str, Field(**field_meta("a site name such as sampler.logits", "the site that guards"))
    ]
    target: Annotated[str, Field(**field_meta(TARGET_SYNTAX, "the callable to patch"))]
    tensor: Annotated[
        str, Field(**field_meta(REF_SYNTAX, "which argument or return value is guarded"))
    ] = "return"
    kind: Annotated[
        Literal["logits", "token_ids"],
        Field(**field_meta("logits, token_ids", "a logits site or a token-id site")),
    ] = "logits"
    vocab_size: Annotated[
        int | None, Field(gt=0, **field_meta("an integer > 0", "vocabulary size (token ids)"))
    ] = None
    vocab_size_from: Annotated[
        str | None,
        Field(
            **field_meta(
                REF_SYNTAX + ", naming an int or a [..., vocab] tensor",
                "where to read the vocabulary size at the first call (token ids)",
            )
        ),
    ] = None

    @field_validator("site")
    @classmethod
    def _site_name(cls, name: str) -> str:
        return validate_site_name(name)

    @field_validator("target")
    @classmethod
    def _target_syntax(cls, text: str) -> str:
        parse_target(text)
        return text

    @field_validator("tensor", "vocab_size_from")
    @classmethod
    def _ref_syntax(cls, text: str | None) -> str | None:
        if text is not None:
            parse_ref(text)
        return text

    @model_validator(mode="after")
    def _vocab_for_token_ids(self) -> AttachSettings:
        given = (self.vocab_size is not None) + (self.vocab_size_from is not None)
        if self.kind == "token_ids" and given != 1:
            raise ValueError(
                'kind = "token_ids" needs exactly one of vocab_size = N or '
                'vocab_size_from = "arg:..." (ids outside [0, vocab_size) are flagged)'
            )
        if self.kind == "logits" and given:
            raise ValueError('vocab_size and vocab_size_from apply only to kind = "token_ids"')
        return self


class ReportingSettings(_Frozen):
    """How device counts reach logs: the `[reporting]` table."""

    log_interval_s: Annotated[
        float,
        Field(
            gt=0,
            allow_inf_nan=False,
            **field_meta(
                "a finite number of seconds > 0",
                "at most one log event per site per interval; counts are never throttled",
            ),
        ),
    ] = 60.0
    log_format: Annotated[
        Literal["host", "json"],
        Field(
            **field_meta(
                "host (leave logging to the host), json",
                "json: set up JSON log lines if the host has not configured structlog",
            )
        ),
    ] = "host"
    every_calls: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000,
            **field_meta(
                "an integer 1-1000000",
                "calls of a site between non-blocking copies of its counts to the host",
            ),
        ),
    ] = 32


class MetricsSettings(_Frozen):
    """Prometheus exposition: the `[metrics]` table."""

    port: Annotated[
        int,
        Field(
            ge=0,
            le=65535,
            **field_meta(
                "an integer 0-65535", "0: only register counters; >0: also serve /metrics here"
            ),
        ),
    ] = 0
    addr: Annotated[
        str,
        Field(
            min_length=1,
            **field_meta("an IP address or host name", "bind address of the /metrics server"),
        ),
    ] = "127.0.0.1"


class GuardSettings(BaseSettings):
    """Everything guardrails reads from its environment, validated once.

    Construct with no arguments to read `GUARDRAILS_*` variables and the optional TOML file;
    keyword arguments override both (nested tables as dicts: `metrics={"port": 9400}`).
    `environ=` replaces `os.environ` (tests, launchers).
    """

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    enabled: Annotated[
        bool, Field(**field_meta(_BOOL, "master switch; false makes every site a no-op"))
    ] = True
    sanitize: Annotated[
        bool, Field(**field_meta(_BOOL, "heal in place; false: detect, flag and count only"))
    ] = True
    async_assert: Annotated[
        bool,
        Field(
            **field_meta(
                _BOOL,
                "CI mode: device-side assert on NaN, +Inf, rows with no valid token and "
                "out-of-vocab ids",
            )
        ),
    ] = False
    enabled_sites: Annotated[
        tuple[str, ...],
        Field(
            **field_meta(
                "comma-separated site names or glob patterns", "sites that guard (not empty)"
            )
        ),
    ] = ("*",)
    disabled_sites: Annotated[
        tuple[str, ...],
        Field(
            **field_meta(
                "comma-separated site names or glob patterns",
                "sites switched off, applied after the enable list",
            )
        ),
    ] = ()
    config_file: Annotated[
        Path | None, Field(**field_meta("a path to a TOML file", "the TOML configuration file"))
    ] = None
    min_temperature: Annotated[
        float,
        Field(
            gt=0,
            allow_inf_nan=False,
            **field_meta(
                "a finite number > 0",
                "smallest temperature the engine divides by; bounds the +Inf replacement",
            ),
        ),
    ] = 1e-5
    reporting: ReportingSettings = ReportingSettings()
    metrics: MetricsSettings = MetricsSettings()
    sites: dict[str, SiteSettings] = Field(default_factory=dict)
    # `[[attach]]` entries (config file only): import paths to patch, never code.
    attach: tuple[AttachSettings, ...] = ()

    _origins: dict[tuple[str, ...], str] = PrivateAttr(default_factory=dict)

    def __init__(self, *, environ: Mapping[str, str] | None = None, **values: Any) -> None:
        collector = Collector(os.environ if environ is None else environ, values)
        token = COLLECTOR.set(collector)
        try:
            try:
                # Values arrive through the sources below, never as pydantic-settings' own
                # init kwargs, so that every one of them carries its origin.
                super().__init__()
            except ValidationError as exc:
                problems = [
                    *collector.problems,
                    *problems_from(exc, GuardSettings, collector.where),
                ]
                raise ConfigError(problems) from None
        finally:
            COLLECTOR.reset(token)
        problems = [*collector.problems, *self._semantic_problems(collector)]
        if problems:
            raise ConfigError(problems)
        self._origins = collector.origins

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return InitSource(settings_cls), EnvSource(settings_cls), FileSource(settings_cls)

    @field_validator("enabled", "sanitize", "async_assert", mode="before")
    @classmethod
    def _switch(cls, value: object) -> object:
        return _no_float_switch(value)

    # -- semantic checks that need several fields at once --------------------------------

    def _semantic_problems(self, collector: Collector) -> Iterator[Problem]:
        declared = set(KNOWN_SITES) | set(self.sites) | {point.site for point in self.attach}
        kinds: dict[str, tuple[str, int]] = {}
        for index, point in enumerate(self.attach):
            first = kinds.setdefault(point.site, (point.kind, index))
            if first[0] != point.kind:
                yield Problem(
                    collector.where(("attach", index, "kind")),
                    f"site {point.site!r} is a {first[0]} site in attach[{first[1]}]",
                    point.kind,
                    accepted="one kind per site name",
                )
        for field_name, entries in (
            ("enabled_sites", self.enabled_sites),
            ("disabled_sites", self.disabled_sites),
        ):
            where = collector.where((field_name,))
            if field_name == "enabled_sites" and not entries:
                yield Problem(
                    where,
                    "empty enable list would switch every site off; use GUARDRAILS_ENABLED=false "
                    "to disable guardrails",
                    accepted="site names or glob patterns, default '*'",
                )
            for entry in entries:
                if any(ch in entry for ch in "*?["):
                    if not any(fnmatch.fnmatchcase(name, entry) for name in declared):
                        yield Problem(
                            where,
                            f"pattern {entry!r} matches no known site" + closest(entry, declared),
                            accepted=site_hint(),
                        )
                elif entry not in declared:
                    yield Problem(
                        where,
                        f"unknown site {entry!r}" + closest(entry, declared),
                        accepted=site_hint(),
                    )
        for name, site in self.sites.items():
            for key in ("nan_value", "posinf_value"):
                value = getattr(site, key)
                if value is None:
                    continue
                # Late: settings are usable (and testable) without paying torch's import.
                from guardrails.kernels.values import replacement_problem

                message = replacement_problem(key, value, site.dtypes, self.min_temperature)
                if message:
                    yield Problem(
                        collector.where(("sites", name, key)),
                        message,
                        value,
                        accepted="a smaller magnitude, or restrict this site's dtypes",
                    )

    # -- derived views --------------------------------------------------------------------

    def is_site_enabled(self, name: str) -> bool:
        """Whether the site `name` guards at all (master switch and both lists)."""
        return (
            self.enabled
            and any(fnmatch.fnmatchcase(name, p) for p in self.enabled_sites)
            and not any(fnmatch.fnmatchcase(name, p) for p in self.disabled_sites)
        )

    def site_settings(self, name: str) -> SiteSettings:
        """The `[sites."name"]` table with global values filled in for unset keys."""
        site = self.sites.get(name, SiteSettings())
        return site.model_copy(
            update={
                "sanitize": self.sanitize if site.sanitize is None else site.sanitize,
                "async_assert": self.async_assert
                if site.async_assert is None
                else site.async_assert,
            }
        )

    def origin(self, *keys: str | int) -> str:
        """Where the value at `keys` came from: a variable, a file key, an argument or default.

        List positions are ints: `origin("attach", 0, "target")`. A key that a file table
        leaves out is a default; a model object passed as an argument covers all its keys."""
        path = tuple(part(key) for key in keys)
        found = self._origins.get(path)
        if found is not None:
            return found
        for n in range(len(path) - 1, 0, -1):
            found = self._origins.get(tuple(path[:n]))
            if found is not None and found.startswith("argument"):
                return found
        return "default"
