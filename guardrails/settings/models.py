"""The settings models: `GuardSettings` and its tables, validated once at construction.

Precedence, first wins: explicit arguments > `GUARDRAILS_*` environment variables > the TOML
file named by `GUARDRAILS_CONFIG_FILE` (or the `config_file` argument) > defaults. The object is
a frozen snapshot; nothing re-reads the environment afterwards.

Every bad value is collected and raised together as one `ConfigError` that names its origin
(variable, file key or argument) and the accepted values: the checks that need several fields
(enable lists against the declared sites, replacement values against dtypes and
min_temperature) run on every part that validated, also when another part did not, so one run
reports every problem. An unknown `GUARDRAILS_*` variable, an unknown file key and an unknown
site name in an enable list are errors too, each with the closest valid name. No value,
however malformed, silently switches protection off: only `GUARDRAILS_ENABLED=false` does
that. What is valid but worth a look (every site off, a `[sites]` section that no site uses, a
metrics server reachable from other hosts) is in `notices`, which the start-up event and
`guardrails check` report as warnings.
"""

from __future__ import annotations

import fnmatch
import functools
import ipaddress
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from guardrails.exceptions import ConfigError, Problem
from guardrails.flags import RowFlag
from guardrails.names import HOOK_ACTS_ON, KNOWN_HOOKS, KNOWN_SITES, validate_site_name
from guardrails.settings.problems import closest, problems_from, site_hint
from guardrails.settings.schema import field_meta, part, plain
from guardrails.settings.sources import COLLECTOR, Collector, EnvSource, FileSource, InitSource
from guardrails.settings.targets import (
    REF_SYNTAX,
    TARGET_SYNTAX,
    parse_ref,
    parse_requirement,
    parse_target,
)
from guardrails.tracing.modes import MODE_SYNTAX, parse_mode

__all__ = [
    "ALL_DTYPES",
    "AttachSettings",
    "GuardSettings",
    "MetricsSettings",
    "ReportingSettings",
    "SiteSettings",
    "TraceSettings",
]

DtypeName = Literal["float32", "bfloat16", "float16", "float64"]
ALL_DTYPES: tuple[DtypeName, ...] = ("float32", "bfloat16", "float16", "float64")

_BOOL = "true or false (also 1/0, yes/no, on/off)"
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Labels of guardrails' own series (guardrails.reporting.metrics), which constant labels
# must not shadow.
_OWN_LABELS = frozenset({"site", "kind", "reason", "rank", "stage", "target", "module"})
_ABORT_FLAGS = "row flag names: nan, posinf, neginf, no_valid_token, any; [] heals and carries on"


def _no_float_switch(value: object) -> object:
    # pydantic's lax bool also takes the floats 0.0 and 1.0 (from TOML): no documented
    # spelling is a float, and `enabled = 0.0` must not be one more way to switch off.
    if isinstance(value, float):
        raise ValueError("a switch takes true or false, not a float")
    return value


def _no_bool_count(value: object) -> object:
    # pydantic's lax int takes true/false (from TOML) as 1/0: `every_calls = true` is no count.
    if isinstance(value, bool):
        raise ValueError("a number is needed here, not true/false")
    return value


# RFC 1123 host name labels; the idna codec refuses longer ones with a UnicodeError at bind.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _bind_address(addr: str) -> str:
    with_zone = addr.partition("%")[0] if ":" in addr else addr
    try:
        ipaddress.ip_address(with_zone)
    except ValueError:
        name = addr.removesuffix(".")
        if not (0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(p) for p in name.split("."))):
            raise ValueError(
                "not an IP address nor a host name (labels of 1-63 letters, digits and '-', "
                "253 characters in all)"
            ) from None
    return addr


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.partition("%")[0]).is_loopback
    except ValueError:
        name = addr.removesuffix(".").lower()
        return name == "localhost" or name.endswith(".localhost")


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
                "a finite number that stays finite in every dtype after / T (in float32)",
                "what +Inf becomes; unset: the dtype's largest value, at most 1e30",
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

    # Engine-agnostic ending of poisoned requests, at a token-id site: the ids sampled for
    # rows that the logits site flagged NO_VALID_TOKEN in the same step become EOS, so the
    # engine stops that request as if the model had ended it.
    on_no_valid_token: Annotated[
        Literal["sample", "eos"],
        Field(
            **field_meta(
                "sample, eos",
                "token-id sites: what a row with no valid token gets (eos: eos_token_id)",
            )
        ),
    ] = "sample"
    eos_token_id: Annotated[
        int | None,
        Field(ge=0, **field_meta("an integer >= 0", "the stop token on_no_valid_token=eos uses")),
    ] = None
    logits_site: Annotated[
        str,
        Field(
            **field_meta("a site name", "the logits site whose row flags on_no_valid_token reads")
        ),
    ] = "sampler.logits"
    # The liveness self-check (`heartbeat`): a site attached where the engine never calls it
    # guards nothing, and says so. Unset: expected, except at `eagle.*` sites, which only run
    # when speculative decoding is configured.
    expect_calls: Annotated[
        bool | None,
        Field(
            **field_meta(
                _BOOL,
                "report this attached site when the heartbeat runs liveness_steps times "
                "without a call; unset: true, false for eagle.* sites",
            )
        ),
    ] = None

    @field_validator("sanitize", "async_assert", "count_neginf", "expect_calls", mode="before")
    @classmethod
    def _site_switch(cls, value: object) -> object:
        return _no_float_switch(value)

    @field_validator("replacement_id", "eos_token_id", mode="before")
    @classmethod
    def _id_count(cls, value: object) -> object:
        return _no_bool_count(value)

    @field_validator("logits_site")
    @classmethod
    def _logits_site_name(cls, name: str) -> str:
        return validate_site_name(name)

    @model_validator(mode="after")
    def _eos_needs_an_id(self) -> SiteSettings:
        if self.on_no_valid_token == "eos" and self.eos_token_id is None:
            raise ValueError(
                'on_no_valid_token = "eos" needs eos_token_id = N (the model\'s stop token)'
            )
        return self

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
                "where to read the vocabulary size at every call (token ids)",
            )
        ),
    ] = None
    when: Annotated[
        str | None,
        Field(
            **field_meta(
                "a requirement such as sglang>=0.5.14",
                "apply only when the installed distribution matches (else: inapplicable)",
            )
        ),
    ] = None

    @field_validator("site")
    @classmethod
    def _site_name(cls, name: str) -> str:
        return validate_site_name(name)

    @field_validator("vocab_size", mode="before")
    @classmethod
    def _vocab_count(cls, value: object) -> object:
        return _no_bool_count(value)

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

    @field_validator("when")
    @classmethod
    def _requirement(cls, text: str | None) -> str | None:
        if text is not None:
            parse_requirement(text)
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

    @field_validator("every_calls", mode="before")
    @classmethod
    def _calls_count(cls, value: object) -> object:
        return _no_bool_count(value)


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
    labels: Annotated[
        dict[str, str],
        Field(
            **field_meta(
                "name=value pairs, comma-separated (a [metrics.labels] table in the file)",
                "constant labels on every guardrails series (e.g. the engine's model_name)",
            )
        ),
    ] = Field(default_factory=dict)
    dir: Annotated[
        Path | None,
        Field(
            **field_meta(
                "a path to an existing directory (empty when the processes start)",
                "where every guardrails process of a process tree writes its series "
                "(prometheus-client multiprocess files) when the host has no "
                "PROMETHEUS_MULTIPROC_DIR; `guardrails run` sets a fresh one when unset",
            )
        ),
    ] = None

    @field_validator("labels", mode="before")
    @classmethod
    def _label_pairs(cls, value: object) -> object:
        # GUARDRAILS_METRICS_LABELS arrives as ("model_name=m", "engine=0").
        if isinstance(value, list | tuple):
            pairs: dict[str, object] = {}
            for item in value:
                name, eq, label = str(item).partition("=")
                if not eq:
                    raise ValueError(f"{item!r} is not name=value")
                pairs[name.strip()] = label.strip()
            return pairs
        return value

    @field_validator("labels")
    @classmethod
    def _label_names(cls, labels: dict[str, str]) -> dict[str, str]:
        for name in labels:
            if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
                raise ValueError(
                    f"{name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                    "not starting with __)"
                )
            if name in _OWN_LABELS:
                raise ValueError(f"{name!r} is a label guardrails sets itself")
        return labels

    @field_validator("port", mode="before")
    @classmethod
    def _port_number(cls, value: object) -> object:
        return _no_bool_count(value)

    @field_validator("addr")
    @classmethod
    def _address(cls, addr: str) -> str:
        return _bind_address(addr)

    @field_validator("dir", mode="before")
    @classmethod
    def _unset_when_empty(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("dir")
    @classmethod
    def _directory(cls, path: Path | None) -> Path | None:
        # Absolute: the processes of a tree may change their working directory.
        if path is not None and not path.is_dir():
            raise ValueError(f"{str(path)!r} is not an existing directory")
        return None if path is None else path.absolute()


class TraceSettings(_Frozen):
    """Origin tracing (`guardrails.tracing`): the `[trace]` table."""

    modules: Annotated[
        tuple[str, ...],
        Field(
            **field_meta(
                "glob patterns over named_modules() names, comma-separated in the variable "
                "(e.g. model.layers.*,model.norm)",
                "modules to probe under guardrails run; empty: no tracing",
            )
        ),
    ] = ()
    mode: Annotated[
        str,
        Field(
            **field_meta(
                MODE_SYNTAX,
                "always; armed: probes on only after a site's first hit; every:N: one model "
                "call in N",
            )
        ),
    ] = "always"

    @field_validator("modules", mode="before")
    @classmethod
    def _one_or_more_patterns(cls, value: object) -> object:
        # `modules = "model.layers.*"` in the file is one pattern, not a list of characters.
        return (value,) if isinstance(value, str) else value

    @field_validator("modules")
    @classmethod
    def _patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            if not pattern.strip() or any(ch.isspace() for ch in pattern):
                raise ValueError(
                    f"{pattern!r} is not a module pattern (a dotted name or glob, no spaces)"
                )
        return tuple(dict.fromkeys(patterns))

    @field_validator("mode")
    @classmethod
    def _mode(cls, mode: str) -> str:
        return str(parse_mode(mode))


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
    strict_attach: Annotated[
        bool,
        Field(
            **field_meta(
                _BOOL,
                "an attach point or hook whose target does not resolve ends the process "
                "(default: logged, counted, every other site still guarded)",
            )
        ),
    ] = False
    hooks: Annotated[
        tuple[str, ...],
        Field(
            **field_meta(
                "comma-separated names: " + ", ".join(KNOWN_HOOKS) if KNOWN_HOOKS else "none yet",
                "engine hooks to install (guardrails run): e.g. ending poisoned requests",
            )
        ),
    ] = ()
    heartbeat: Annotated[
        tuple[str, ...],
        Field(
            **field_meta(
                "one target or a list of them (" + TARGET_SYNTAX + "), comma-separated in "
                "the variable",
                "a call every engine step passes; attached sites that see no call while it "
                "runs liveness_steps times are reported (guardrails.site_not_called)",
            )
        ),
    ] = ()
    liveness_steps: Annotated[
        int,
        Field(
            ge=1,
            le=1_000_000_000,
            **field_meta(
                "an integer 1-1000000000",
                "heartbeat calls after which an attached site never called is reported",
            ),
        ),
    ] = 256
    reporting: ReportingSettings = ReportingSettings()
    metrics: MetricsSettings = MetricsSettings()
    trace: TraceSettings = TraceSettings()
    sites: dict[str, SiteSettings] = Field(default_factory=dict)
    # `[[attach]]` entries (config file only): import paths to patch, never code.
    attach: tuple[AttachSettings, ...] = ()

    _origins: dict[tuple[str, ...], str] = PrivateAttr(default_factory=dict)
    _notices: tuple[Problem, ...] = PrivateAttr(default=())

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
                    *_semantic_problems(collector.merged(), collector.where),
                ]
                raise ConfigError(problems) from None
        finally:
            COLLECTOR.reset(token)
        problems = [*collector.problems, *_semantic_problems(collector.merged(), collector.where)]
        if problems:
            raise ConfigError(problems)
        self._origins = collector.origins
        self._notices = tuple(self._notice_problems(collector.where))

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

    @field_validator("enabled", "sanitize", "async_assert", "strict_attach", mode="before")
    @classmethod
    def _switch(cls, value: object) -> object:
        return _no_float_switch(value)

    @field_validator("heartbeat", mode="before")
    @classmethod
    def _one_or_more_targets(cls, value: object) -> object:
        # `heartbeat = "pkg.mod:Cls.meth"` in the file is one target, not a list of characters.
        return (value,) if isinstance(value, str) else value

    @field_validator("heartbeat")
    @classmethod
    def _heartbeat_syntax(cls, targets: tuple[str, ...]) -> tuple[str, ...]:
        for text in targets:
            parse_target(text)
        return tuple(dict.fromkeys(targets))

    @field_validator("liveness_steps", mode="before")
    @classmethod
    def _steps_count(cls, value: object) -> object:
        return _no_bool_count(value)

    @field_validator("sites")
    @classmethod
    def _site_names(cls, sites: dict[str, SiteSettings]) -> dict[str, SiteSettings]:
        for name in sites:
            validate_site_name(name)  # they become metric labels, like attach sites
        return sites

    @field_validator("hooks")
    @classmethod
    def _known_hooks(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        for name in names:
            if name not in KNOWN_HOOKS:
                known = ", ".join(sorted(KNOWN_HOOKS)) or "none"
                raise ValueError(f"unknown hook {name!r} (known: {known})")
        return tuple(dict.fromkeys(names))

    # -- valid, but worth a word ---------------------------------------------------------

    def _notice_problems(self, where: Callable[[tuple[str | int, ...]], str]) -> Iterator[Problem]:
        attach_sites = {point.site for point in self.attach}
        if not self.enabled:
            yield Problem(where(("enabled",)), "guardrails is switched off: every site is a no-op")
        elif not any(
            self.is_site_enabled(name) for name in {*KNOWN_SITES, *self.sites, *attach_sites}
        ):
            yield Problem(
                where(("disabled_sites",)),
                "switches every site off: nothing is guarded",
                plain(self.disabled_sites, sep=","),
                accepted="GUARDRAILS_ENABLED=false, to say so plainly",
            )
        listed = {*self.enabled_sites, *self.disabled_sites}
        exact = {entry for entry in listed if not any(ch in entry for ch in "*?[")}
        patterns = {entry for entry in listed - exact if entry != "*"}
        for name in self.sites:
            if name in KNOWN_SITES or name in attach_sites or name in exact:
                continue
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
                continue
            candidates = {*KNOWN_SITES, *attach_sites, *exact} - {name}
            yield Problem(
                where(("sites", name)),
                f"[sites.{_quoted(name)}] is no known site, no [[attach]] site and in no enable "
                "list: it applies only if code asks for a site of that name"
                + closest(name, candidates),
                accepted=site_hint(),
            )
        if self.attach and not self.heartbeat:
            yield Problem(
                where(("heartbeat",)),
                "no heartbeat: an [[attach]] point on a method this engine never calls would "
                "guard nothing without a word",
                accepted='heartbeat = "package.module:Class.method", a call every engine step '
                "passes (the shipped profiles name one)",
            )
        for hook in self.hooks:
            acted = [name for name in HOOK_ACTS_ON.get(hook, ()) if self.is_site_enabled(name)]
            if not any(self.site_settings(name).abort_on for name in acted):
                sites = ", ".join(f"sites.{_quoted(n)}" for n in HOOK_ACTS_ON.get(hook, ()))
                yield Problem(
                    where(("hooks",)),
                    f"hook {hook} ends nothing: it acts on the abort_on of {sites or 'no site'}, "
                    "which is empty or switched off",
                    hook,
                    accepted='abort_on = ["no_valid_token"] in that site table',
                )
        if not self.attach:
            # A configuration for code (GuardLogitsProcessor reads abort_on itself); with
            # [[attach]] points, `guardrails check` and the launcher make this an error.
            for name in self.unacted_abort_sites():
                yield Problem(
                    where(("sites", name, "abort_on")),
                    "no configured hook acts on it: under guardrails run it ends nothing "
                    "(only GuardLogitsProcessor in code reads it)",
                    plain(self.sites[name].abort_on),
                    accepted="hooks = [...] naming one of " + _hooks_for(name),
                )
        if self.metrics.port and not _is_loopback(self.metrics.addr):
            yield Problem(
                where(("metrics", "addr")),
                f"/metrics is served on {self.metrics.addr}:{self.metrics.port}, reachable from "
                "other hosts",
                self.metrics.addr,
                accepted="127.0.0.1 (the default) to serve this host only",
            )

    @property
    def notices(self) -> tuple[Problem, ...]:
        """Valid settings worth a warning (see the module docstring); empty when all is plain."""
        return self._notices

    # -- derived views --------------------------------------------------------------------

    def unacted_abort_sites(self) -> tuple[str, ...]:
        """Enabled sites whose `abort_on` is set but that no configured hook acts on
        (`guardrails.names.HOOK_ACTS_ON`): under `guardrails run` nothing ends their rows."""
        acted = {name for hook in self.hooks for name in HOOK_ACTS_ON.get(hook, ())}
        return tuple(
            name
            for name, table in self.sites.items()
            if table.abort_on and name not in acted and self.is_site_enabled(name)
        )

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
                "expect_calls": not name.startswith("eagle.")
                if site.expect_calls is None
                else site.expect_calls,
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


# -- checks that need several fields at once -----------------------------------------------


def _hooks_for(site: str) -> str:
    hooks = [hook for hook, sites in HOOK_ACTS_ON.items() if site in sites]
    return ", ".join(sorted(hooks)) if hooks else "(none acts on this site)"


def _quoted(name: str) -> str:
    return f'"{name}"' if "." in name else name


def _raw(entry: object, key: str) -> object:
    if isinstance(entry, Mapping):
        return entry.get(key)
    return getattr(entry, key, None) if isinstance(entry, BaseModel) else None


def _valid(model: type[BaseModel], raw: object) -> Any:
    """`raw` validated as `model`, or None where it is not valid (pydantic reports why)."""
    if isinstance(raw, model):
        return raw
    try:
        return model.model_validate(raw)
    except ValidationError:
        return None


@functools.cache
def _adapter(name: str) -> TypeAdapter[Any]:
    info = GuardSettings.model_fields[name]
    # The field's type with its constraints (gt=0, allow_inf_nan=False), as the model has it.
    annotated: Any = Annotated[info.annotation, info]
    return TypeAdapter(annotated)


def _field(data: Mapping[str, Any], name: str) -> Any:
    """The validated value of a top-level field (its default if absent), None if invalid."""
    if name not in data:
        return GuardSettings.model_fields[name].get_default(call_default_factory=True)
    try:
        return _adapter(name).validate_python(data[name])
    except ValidationError:
        return None


def _semantic_problems(
    data: Mapping[str, Any], where: Callable[[tuple[str | int, ...]], str]
) -> Iterator[Problem]:
    """Problems across fields, on the merged raw values: each part is used if it validates on
    its own, so these checks run (and report) also when another part is invalid."""
    raw_attach = data.get("attach", ())
    raw_points = list(raw_attach) if isinstance(raw_attach, list | tuple) else []
    raw_sites = data.get("sites", {})
    tables: Mapping[Any, Any] = raw_sites if isinstance(raw_sites, Mapping) else {}
    attach_sites = {site for p in raw_points if isinstance(site := _raw(p, "site"), str)}
    declared = set(KNOWN_SITES) | {n for n in tables if isinstance(n, str)} | attach_sites
    kinds: dict[str, tuple[str, int]] = {}
    for index, raw in enumerate(raw_points):
        point = _valid(AttachSettings, raw)
        if point is None:
            continue
        first = kinds.setdefault(point.site, (point.kind, index))
        if first[0] != point.kind:
            yield Problem(
                where(("attach", index, "kind")),
                f"site {point.site!r} is a {first[0]} site in attach[{first[1]}]",
                point.kind,
                accepted="one kind per site name",
            )
    for field_name in ("enabled_sites", "disabled_sites"):
        entries = _field(data, field_name)
        if entries is None:
            continue
        at = where((field_name,))
        if field_name == "enabled_sites" and not entries:
            yield Problem(
                at,
                "empty enable list would switch every site off; use GUARDRAILS_ENABLED=false "
                "to disable guardrails",
                accepted="site names or glob patterns, default '*'",
            )
        for entry in entries:
            if any(ch in entry for ch in "*?["):
                if not any(fnmatch.fnmatchcase(name, entry) for name in declared):
                    yield Problem(
                        at,
                        f"pattern {entry!r} matches no known site" + closest(entry, declared),
                        accepted=site_hint(),
                    )
            elif entry not in declared:
                yield Problem(
                    at, f"unknown site {entry!r}" + closest(entry, declared), accepted=site_hint()
                )
    min_temperature = _field(data, "min_temperature")
    if min_temperature is None:
        return  # its own problem is reported; the replacement bounds depend on it
    for name, raw in tables.items():
        site = _valid(SiteSettings, raw)
        if site is None:
            continue
        for key in ("nan_value", "posinf_value"):
            value = getattr(site, key)
            if value is None:
                continue
            # Late: settings are usable (and testable) without paying torch's import.
            from guardrails.kernels.values import replacement_problem

            message = replacement_problem(key, value, site.dtypes, min_temperature)
            if message:
                yield Problem(
                    where(("sites", name, key)),
                    message,
                    value,
                    accepted="a smaller magnitude, or restrict this site's dtypes",
                )
