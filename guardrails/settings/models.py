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

Each field is a kind of value from `guardrails.settings.fields` (which checks it) plus a
`setting(accepted, meaning)` (which the errors and the generated reference read).
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from guardrails._suggest import closest
from guardrails.exceptions import ConfigError, Problem
from guardrails.flags import RowFlag
from guardrails.names import HOOK_ACTS_ON, KNOWN_HOOKS, KNOWN_SITES
from guardrails.settings.checks import Where, cross_field_problems
from guardrails.settings.fields import (
    ALL_DTYPES,
    BindAddress,
    CallCount,
    DtypeName,
    FlagNames,
    HookNames,
    LabelPairs,
    MultiprocDir,
    Port,
    PositiveFinite,
    Ref,
    Requirement,
    SiteName,
    StepCount,
    Switch,
    Target,
    Targets,
    TokenId,
    TraceMode,
    TracePatterns,
    Verified,
    VocabSize,
    is_loopback,
    site_table_names,
)
from guardrails.settings.problems import problems_from, site_hint
from guardrails.settings.schema import part, plain, setting
from guardrails.settings.sources import COLLECTOR, Collector, EnvSource, FileSource, InitSource
from guardrails.settings.targets import REF_SYNTAX, TARGET_SYNTAX
from guardrails.tracing.modes import MODE_SYNTAX

__all__ = [
    "ALL_DTYPES",
    "AttachSettings",
    "GuardSettings",
    "MetricsSettings",
    "ReportingSettings",
    "SiteSettings",
    "TraceSettings",
]

_BOOL = "true or false (also 1/0, yes/no, on/off)"
_ID = "an integer >= 0"
_SITES = "comma-separated site names or glob patterns"
_ABORT_FLAGS = "row flag names: nan, posinf, neginf, no_valid_token, any; [] heals and carries on"


@functools.cache
def _flag_mask(names: tuple[str, ...]) -> int:
    # Engine hooks read a site's mask at every step; parsing it costs about 10 us.
    return int(RowFlag.parse(names))


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SiteSettings(_Frozen):
    """Per-site overrides: a `[sites."name"]` table in the config file."""

    sanitize: Annotated[
        Switch | None, setting(_BOOL, "heal in place at this site; unset: the global value")
    ] = None
    async_assert: Annotated[
        Switch | None, setting(_BOOL, "device-side assert at this site; unset: the global value")
    ] = None
    count_neginf: Annotated[
        Switch, setting(_BOOL, "count -inf as bad (raw logits before any mask); never rewritten")
    ] = False
    nan_value: Annotated[
        float,
        setting(
            "-inf, or a finite number that stays finite in every dtype",
            "what NaN becomes while its row keeps a valid entry",
        ),
    ] = -math.inf
    posinf_value: Annotated[
        float | None,
        setting(
            "a finite number that stays finite in every dtype after / T (in float32)",
            "what +Inf becomes; unset: the dtype's largest value, at most 1e30",
        ),
    ] = None
    dtypes: Annotated[
        tuple[DtypeName, ...],
        setting(
            ", ".join(ALL_DTYPES),
            "logits dtypes the site accepts (others: TypeError)",
            min_length=1,
        ),
    ] = ALL_DTYPES
    replacement_id: Annotated[TokenId, setting(_ID, "what an out-of-vocab token id becomes")] = 0
    # Policy for integrations that can end a request (GuardLogitsProcessor): rows carrying
    # any of these flags are forced to end (EOS) instead of sampling from healed logits.
    abort_on: Annotated[
        FlagNames,
        setting(_ABORT_FLAGS, "rows with these flags end with EOS (GuardLogitsProcessor)"),
    ] = ()

    # Engine-agnostic ending of poisoned requests, at a token-id site: the ids sampled for
    # rows that the logits site flagged NO_VALID_TOKEN in the same step become EOS, so the
    # engine stops that request as if the model had ended it.
    on_no_valid_token: Annotated[
        Literal["sample", "eos"],
        setting(
            "sample, eos", "token-id sites: what a row with no valid token gets (eos: eos_token_id)"
        ),
    ] = "sample"
    eos_token_id: Annotated[
        TokenId | None, setting(_ID, "the stop token on_no_valid_token=eos uses")
    ] = None
    logits_site: Annotated[
        SiteName, setting("a site name", "the logits site whose row flags on_no_valid_token reads")
    ] = "sampler.logits"
    # The liveness self-check (`heartbeat`): a site attached where the engine never calls it
    # guards nothing, and says so. Unset: expected, except at `eagle.*` sites, which only run
    # when speculative decoding is configured.
    expect_calls: Annotated[
        Switch | None,
        setting(
            _BOOL,
            "report this attached site when the heartbeat runs liveness_steps times "
            "without a call; unset: true, false for eagle.* sites",
        ),
    ] = None

    @model_validator(mode="after")
    def _fields_agree(self) -> SiteSettings:
        if self.on_no_valid_token == "eos" and self.eos_token_id is None:
            raise ValueError(
                'on_no_valid_token = "eos" needs eos_token_id = N (the model\'s stop token)'
            )
        return self

    @property
    def abort_flags(self) -> int:
        """`abort_on` as a bit mask of `RowFlag`s (0: heal and carry on)."""
        return _flag_mask(self.abort_on)


class AttachSettings(_Frozen):
    """One `[[attach]]` entry: guard a value of someone else's callable at `site`.

    Applied when `target`'s module is imported (see `guardrails.attach.patching`).
    Only the syntax is checked here; whether the target exists is checked when it is applied
    and by `guardrails check`.
    """

    site: Annotated[SiteName, setting("a site name such as sampler.logits", "the site that guards")]
    target: Annotated[Target, setting(TARGET_SYNTAX, "the callable to patch")]
    tensor: Annotated[Ref, setting(REF_SYNTAX, "which argument or return value is guarded")] = (
        "return"
    )
    kind: Annotated[
        Literal["logits", "token_ids"],
        setting("logits, token_ids", "a logits site or a token-id site"),
    ] = "logits"
    vocab_size: Annotated[
        VocabSize | None, setting("an integer > 0", "vocabulary size (token ids)")
    ] = None
    vocab_size_from: Annotated[
        Ref | None,
        setting(
            REF_SYNTAX + ", naming an int or a [..., vocab] tensor",
            "where to read the vocabulary size at every call (token ids)",
        ),
    ] = None
    when: Annotated[
        Requirement | None,
        setting(
            "a requirement such as sglang>=0.5.14",
            "apply only when the installed distribution matches (else: inapplicable)",
        ),
    ] = None
    # A target that only some engine steps call (V2's Sampler.__call__: not on speculative
    # steps, which sample in RejectionSampler.__call__) must not make its site look silent.
    expect_calls: Annotated[
        Switch,
        setting(
            _BOOL,
            "false: a target that only some engine steps call; its site is watched by the "
            "liveness self-check only through its other points",
        ),
    ] = True

    @model_validator(mode="after")
    def _fields_agree(self) -> AttachSettings:
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
        PositiveFinite,
        setting(
            "a finite number of seconds > 0",
            "at most one log event per site per interval; counts are never throttled",
        ),
    ] = 60.0
    log_format: Annotated[
        Literal["host", "json"],
        setting(
            "host (leave logging to the host), json",
            "json: set up JSON log lines if the host has not configured structlog",
        ),
    ] = "host"
    every_calls: Annotated[
        CallCount,
        setting(
            "an integer 1-1000000",
            "calls of a site between non-blocking copies of its counts to the host",
        ),
    ] = 32
    report_interval_s: Annotated[
        PositiveFinite,
        setting(
            "a finite number of seconds > 0",
            "longest time before a guarded step's counts and events reach the counters and "
            "logs, whether or not another guarded call comes (a background poll)",
        ),
    ] = 2.0


class MetricsSettings(_Frozen):
    """Prometheus exposition: the `[metrics]` table."""

    port: Annotated[
        Port,
        setting("an integer 0-65535", "0: only register counters; >0: also serve /metrics here"),
    ] = 0
    addr: Annotated[
        BindAddress, setting("an IP address or host name", "bind address of the /metrics server")
    ] = "127.0.0.1"
    labels: Annotated[
        LabelPairs,
        setting(
            "name=value pairs, comma-separated (a [metrics.labels] table in the file)",
            "constant labels on every guardrails series (e.g. the engine's model_name)",
        ),
    ] = Field(default_factory=dict)
    dir: Annotated[
        MultiprocDir,
        setting(
            "a path to an existing directory (empty when the processes start)",
            "where every guardrails process of a process tree writes its series "
            "(prometheus-client multiprocess files) when the host has no "
            "PROMETHEUS_MULTIPROC_DIR; `guardrails run` sets a fresh one when unset",
        ),
    ] = None


class TraceSettings(_Frozen):
    """Origin tracing (`guardrails.tracing`): the `[trace]` table."""

    modules: Annotated[
        TracePatterns,
        setting(
            "glob patterns over named_modules() names, comma-separated in the variable "
            "(e.g. model.layers.*,model.norm)",
            "modules to probe under guardrails run; empty: no tracing",
        ),
    ] = ()
    mode: Annotated[
        TraceMode,
        setting(
            MODE_SYNTAX,
            "always; armed: probes on only after a site's first hit; every:N: one model call in N",
        ),
    ] = "always"


class GuardSettings(BaseSettings):
    """Everything guardrails reads from its environment, validated once.

    Construct with no arguments to read `GUARDRAILS_*` variables and the optional TOML file;
    keyword arguments override both (nested tables as dicts: `metrics={"port": 9400}`).
    `environ=` replaces `os.environ` (tests, launchers).
    """

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    enabled: Annotated[Switch, setting(_BOOL, "master switch; false makes every site a no-op")] = (
        True
    )
    sanitize: Annotated[
        Switch, setting(_BOOL, "heal in place; false: detect, flag and count only")
    ] = True
    async_assert: Annotated[
        Switch,
        setting(
            _BOOL,
            "CI mode: device-side assert on NaN, +Inf, rows with no valid token and "
            "out-of-vocab ids",
        ),
    ] = False
    enabled_sites: Annotated[tuple[str, ...], setting(_SITES, "sites that guard (not empty)")] = (
        "*",
    )
    disabled_sites: Annotated[
        tuple[str, ...], setting(_SITES, "sites switched off, applied after the enable list")
    ] = ()
    config_file: Annotated[
        Path | None, setting("a path to a TOML file", "the TOML configuration file")
    ] = None
    min_temperature: Annotated[
        PositiveFinite,
        setting(
            "a finite number > 0",
            "smallest temperature the engine divides by; bounds the +Inf replacement",
        ),
    ] = 1e-5
    strict_attach: Annotated[
        Switch,
        setting(
            _BOOL,
            "an attach point or hook whose target does not resolve ends the process "
            "(default: logged, counted, every other site still guarded)",
        ),
    ] = False
    hooks: Annotated[
        HookNames,
        setting(
            "comma-separated names: " + ", ".join(KNOWN_HOOKS) if KNOWN_HOOKS else "none yet",
            "engine hooks to install (guardrails run): e.g. ending poisoned requests",
        ),
    ] = ()
    heartbeat: Annotated[
        Targets,
        setting(
            "one target or a list of them (" + TARGET_SYNTAX + "), comma-separated in the variable",
            "a call every engine step passes; attached sites that see no call while it "
            "runs liveness_steps times are reported (guardrails.site_not_called)",
        ),
    ] = ()
    verified_with: Annotated[
        Verified,
        setting(
            "engine versions such as vllm==0.34.0, comma-separated in the variable",
            "the newest engine versions this configuration was verified against; a newer "
            "one installed is a start-up warning (guardrails check --strict: an error)",
        ),
    ] = ()
    liveness_steps: Annotated[
        StepCount,
        setting(
            "an integer 1-1000000000",
            "heartbeat calls after which an attached site never called is reported",
        ),
    ] = 256
    reporting: ReportingSettings = ReportingSettings()
    metrics: MetricsSettings = MetricsSettings()
    trace: TraceSettings = TraceSettings()
    sites: Annotated[dict[str, SiteSettings], AfterValidator(site_table_names)] = Field(
        default_factory=dict
    )
    # `[[attach]]` entries (config file only): import paths to patch, never code.
    attach: tuple[AttachSettings, ...] = ()

    _origins: dict[tuple[str, ...], str] = PrivateAttr(default_factory=dict)
    _notices: tuple[Problem, ...] = PrivateAttr(default=())
    # `site_settings(name)` by name: engine hooks ask at every step, and a `model_copy` costs
    # tens of microseconds. A copy of these settings starts its own (`__copy__`).
    _resolved: dict[str, SiteSettings] = PrivateAttr(default_factory=dict)

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
                    *cross_field_problems(GuardSettings, collector.merged(), collector.where),
                ]
                raise ConfigError(problems) from None
        finally:
            COLLECTOR.reset(token)
        problems = [
            *collector.problems,
            *cross_field_problems(GuardSettings, collector.merged(), collector.where),
        ]
        if problems:
            raise ConfigError(problems)
        self._origins = collector.origins
        self._notices = tuple(_notice_problems(self, collector.where))

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

    def __copy__(self) -> GuardSettings:
        # `model_copy(update=...)` copies, then changes fields: not the resolved tables.
        copied = super().__copy__()
        copied._resolved = {}
        return copied

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> GuardSettings:
        copied = super().__deepcopy__(memo)
        copied._resolved = {}
        return copied

    def site_settings(self, name: str) -> SiteSettings:
        """The `[sites."name"]` table with global values filled in for unset keys."""
        # The private attributes' own dict (documented pydantic v2 API): `self._resolved`
        # goes through BaseModel.__getattr__, about 1.7 us, 0.05 us this way.
        table: dict[str, SiteSettings] = self.__pydantic_private__["_resolved"]  # type: ignore[index]
        resolved = table.get(name)
        if resolved is None:
            resolved = table[name] = self._site_settings(name)
        return resolved

    def _site_settings(self, name: str) -> SiteSettings:
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


def _notice_problems(settings: GuardSettings, where: Where) -> Iterator[Problem]:
    """What is valid in `settings` but worth a warning (`GuardSettings.notices`)."""
    attach_sites = {point.site for point in settings.attach}
    if not settings.enabled:
        yield Problem(where(("enabled",)), "guardrails is switched off: every site is a no-op")
    elif not any(
        settings.is_site_enabled(name) for name in {*KNOWN_SITES, *settings.sites, *attach_sites}
    ):
        yield Problem(
            where(("disabled_sites",)),
            "switches every site off: nothing is guarded",
            plain(settings.disabled_sites, sep=","),
            accepted="GUARDRAILS_ENABLED=false, to say so plainly",
        )
    listed = {*settings.enabled_sites, *settings.disabled_sites}
    exact = {entry for entry in listed if not any(ch in entry for ch in "*?[")}
    patterns = {entry for entry in listed - exact if entry != "*"}
    for name in settings.sites:
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
    if settings.attach and not settings.heartbeat:
        yield Problem(
            where(("heartbeat",)),
            "no heartbeat: an [[attach]] point on a method this engine never calls would "
            "guard nothing without a word",
            accepted='heartbeat = "package.module:Class.method", a call every engine step '
            "passes (the shipped profiles name one)",
        )
    for hook in settings.hooks:
        acted = [name for name in HOOK_ACTS_ON.get(hook, ()) if settings.is_site_enabled(name)]
        if not any(settings.site_settings(name).abort_on for name in acted):
            sites = ", ".join(f"sites.{_quoted(n)}" for n in HOOK_ACTS_ON.get(hook, ()))
            yield Problem(
                where(("hooks",)),
                f"hook {hook} ends nothing: it acts on the abort_on of {sites or 'no site'}, "
                "which is empty or switched off",
                hook,
                accepted='abort_on = ["no_valid_token"] in that site table',
            )
    if not settings.attach:
        # A configuration for code (GuardLogitsProcessor reads abort_on itself); with
        # [[attach]] points, `guardrails check` and the launcher make this an error.
        for name in settings.unacted_abort_sites():
            yield Problem(
                where(("sites", name, "abort_on")),
                "no configured hook acts on it: under guardrails run it ends nothing "
                "(only GuardLogitsProcessor in code reads it)",
                plain(settings.sites[name].abort_on),
                accepted="hooks = [...] naming one of " + _hooks_for(name),
            )
    if settings.metrics.port and not is_loopback(settings.metrics.addr):
        yield Problem(
            where(("metrics", "addr")),
            f"/metrics is served on {settings.metrics.addr}:{settings.metrics.port}, reachable "
            "from other hosts",
            settings.metrics.addr,
            accepted="127.0.0.1 (the default) to serve this host only",
        )


def _hooks_for(site: str) -> str:
    hooks = [hook for hook, sites in HOOK_ACTS_ON.items() if site in sites]
    return ", ".join(sorted(hooks)) if hooks else "(none acts on this site)"


def _quoted(name: str) -> str:
    return f'"{name}"' if "." in name else name
