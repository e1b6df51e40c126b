"""Configuration: `GuardSettings`, read once at start-up.

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

import contextvars
import difflib
import fnmatch
import math
import os
import stat
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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
from guardrails.integrations.targets import REF_SYNTAX, TARGET_SYNTAX, parse_ref, parse_target

__all__ = [
    "ENV_VARS",
    "KNOWN_SITES",
    "AttachSettings",
    "GuardSettings",
    "MetricsSettings",
    "ReportingSettings",
    "SiteSettings",
]

DtypeName = Literal["float32", "bfloat16", "float16", "float64"]
ALL_DTYPES: tuple[DtypeName, ...] = ("float32", "bfloat16", "float16", "float64")

# Well-known sampling sites. An enable list may name these, any site declared in the config
# file (a `[sites."name"]` table, possibly empty) and glob patterns matching either.
KNOWN_SITES: Mapping[str, str] = {
    "model.logits": "raw LM-head output, before any mask (a place to count -inf)",
    "sampler.logits": "logits entering the sampler, after masks, before temperature",
    "sampler.token_ids": "token ids returned by the sampler",
    "eagle.draft": "draft-model logits in speculative decoding",
    "eagle.verify": "target-model logits sampled at speculative verification",
    "eagle.token_ids": "token ids accepted at speculative verification",
}

_BOOL = "true or false (also 1/0, yes/no, on/off)"
_ABORT_FLAGS = "row flag names: nan, posinf, neginf, no_valid_token, any; [] heals and carries on"


def _accepted(text: str, meaning: str = "") -> dict[str, Any]:
    """Field metadata: the accepted values (for errors) and the meaning (for the reference
    that `guardrails.reference` generates from these models)."""
    return {"json_schema_extra": {"accepted": text}, "description": meaning}


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
        Field(**_accepted(_BOOL, "heal in place at this site; unset: the global value")),
    ] = None
    async_assert: Annotated[
        bool | None,
        Field(**_accepted(_BOOL, "device-side assert at this site; unset: the global value")),
    ] = None
    count_neginf: Annotated[
        bool,
        Field(
            **_accepted(_BOOL, "count -inf as bad (raw logits before any mask); never rewritten")
        ),
    ] = False
    nan_value: Annotated[
        float,
        Field(
            **_accepted(
                "-inf, or a finite number that stays finite in every dtype",
                "what NaN becomes while its row keeps a valid entry",
            )
        ),
    ] = -math.inf
    posinf_value: Annotated[
        float | None,
        Field(
            **_accepted(
                "a finite number that stays finite in every dtype after / T",
                "what +Inf becomes; unset: min(1e30, 0.5 * finfo.max * min(1, min_temperature))",
            )
        ),
    ] = None
    dtypes: Annotated[
        tuple[DtypeName, ...],
        Field(
            min_length=1,
            **_accepted(
                ", ".join(ALL_DTYPES), "logits dtypes the site accepts (others: TypeError)"
            ),
        ),
    ] = ALL_DTYPES
    replacement_id: Annotated[
        int, Field(ge=0, **_accepted("an integer >= 0", "what an out-of-vocab token id becomes"))
    ] = 0
    # Policy for integrations that can end a request (GuardLogitsProcessor): rows carrying
    # any of these flags are forced to end (EOS) instead of sampling from healed logits.
    abort_on: Annotated[
        tuple[str, ...],
        Field(
            **_accepted(_ABORT_FLAGS, "rows with these flags end with EOS (GuardLogitsProcessor)")
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

    Applied when `target`'s module is imported (see `guardrails.integrations.patching`).
    Only the syntax is checked here; whether the target exists is checked when it is applied
    and by `guardrails check`.
    """

    site: Annotated[
        str, Field(**_accepted("a site name such as sampler.logits", "the site that guards"))
    ]
    target: Annotated[str, Field(**_accepted(TARGET_SYNTAX, "the callable to patch"))]
    tensor: Annotated[
        str, Field(**_accepted(REF_SYNTAX, "which argument or return value is guarded"))
    ] = "return"
    kind: Annotated[
        Literal["logits", "token_ids"],
        Field(**_accepted("logits, token_ids", "a logits site or a token-id site")),
    ] = "logits"
    vocab_size: Annotated[
        int | None, Field(gt=0, **_accepted("an integer > 0", "vocabulary size (token ids)"))
    ] = None
    vocab_size_from: Annotated[
        str | None,
        Field(
            **_accepted(
                REF_SYNTAX + ", naming an int or a [..., vocab] tensor",
                "where to read the vocabulary size at the first call (token ids)",
            )
        ),
    ] = None

    @field_validator("site")
    @classmethod
    def _site_name(cls, name: str) -> str:
        from guardrails.sites import validate_site_name  # late: sites imports torch

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
            **_accepted(
                "a finite number of seconds > 0",
                "at most one log event per site per interval; counts are never throttled",
            ),
        ),
    ] = 60.0
    log_format: Annotated[
        Literal["host", "json"],
        Field(
            **_accepted(
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
            **_accepted(
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
            **_accepted(
                "an integer 0-65535", "0: only register counters; >0: also serve /metrics here"
            ),
        ),
    ] = 0
    addr: Annotated[
        str,
        Field(
            min_length=1,
            **_accepted("an IP address or host name", "bind address of the /metrics server"),
        ),
    ] = "127.0.0.1"


@dataclass(frozen=True)
class EnvVar:
    name: str
    path: tuple[str, ...]
    is_list: bool = False


ENV_VARS: Mapping[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar("GUARDRAILS_ENABLED", ("enabled",)),
        EnvVar("GUARDRAILS_SANITIZE", ("sanitize",)),
        EnvVar("GUARDRAILS_ASYNC_ASSERT", ("async_assert",)),
        EnvVar("GUARDRAILS_SITES", ("enabled_sites",), is_list=True),
        EnvVar("GUARDRAILS_DISABLED_SITES", ("disabled_sites",), is_list=True),
        EnvVar("GUARDRAILS_CONFIG_FILE", ("config_file",)),
        EnvVar("GUARDRAILS_MIN_TEMPERATURE", ("min_temperature",)),
        EnvVar("GUARDRAILS_LOG_INTERVAL_S", ("reporting", "log_interval_s")),
        EnvVar("GUARDRAILS_LOG_FORMAT", ("reporting", "log_format")),
        EnvVar("GUARDRAILS_REPORT_EVERY", ("reporting", "every_calls")),
        EnvVar("GUARDRAILS_METRICS_PORT", ("metrics", "port")),
        EnvVar("GUARDRAILS_METRICS_ADDR", ("metrics", "addr")),
    )
}


class _Collector:
    """Origins of values and problems found by the sources during one construction."""

    def __init__(self, environ: Mapping[str, str], kwargs: dict[str, Any]) -> None:
        self.environ = environ
        self.kwargs = kwargs
        self.origins: dict[tuple[str, ...], str] = {}
        self.problems: list[Problem] = []
        self.file: Path | None = None

    def where(self, loc: tuple[str | int, ...]) -> str:
        path = tuple(_part(p) for p in loc)
        for n in range(len(path), 0, -1):
            origin = self.origins.get(path[:n])
            if origin is not None:
                return origin if n == len(path) else f"{origin} ({_dotted(path)})"
        return f"default {_dotted(path)}"


_COLLECTOR: contextvars.ContextVar[_Collector] = contextvars.ContextVar("guardrails_settings")


def _part(key: str | int) -> str:
    # List positions (pydantic reports them as ints) are kept as "[i]" so that a key reads
    # the way a user would write it: attach[0].target.
    return f"[{key}]" if isinstance(key, int) else str(key)


def _dotted(path: tuple[str, ...]) -> str:
    out = ""
    for p in path:
        if out and p.startswith("["):
            out += p
        else:
            quoted = f'"{p}"' if "." in p or not p else p
            out = f"{out}.{quoted}" if out else quoted
    return out


def _closest(name: str, candidates: Any) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else ""


def _set_path(out: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        out = out.setdefault(key, {})
    out[path[-1]] = value


def _leaves(data: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        path = (*prefix, str(key))
        yield path
        if isinstance(value, Mapping):
            yield from _leaves(value, path)
        elif _is_table_list(value):
            for index, item in enumerate(value):
                yield (*path, _part(index))
                yield from _leaves(item, (*path, _part(index)))


def _is_table_list(value: object) -> bool:
    """A TOML array of tables (`[[attach]]`), whose entries get origins of their own."""
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(v, Mapping) for v in value)
    )


class _EnvSource(PydanticBaseSettingsSource):
    """`GUARDRAILS_*` variables, mapped through the fixed table `ENV_VARS`."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ builds the whole mapping

    def __call__(self) -> dict[str, Any]:
        collector = _COLLECTOR.get()
        out: dict[str, Any] = {}
        for key, raw in collector.environ.items():
            if not key.startswith("GUARDRAILS_"):
                continue
            var = ENV_VARS.get(key)
            if var is None:
                collector.problems.append(
                    Problem(key, "unknown guardrails variable" + _closest(key, ENV_VARS), raw)
                )
                continue
            value: Any = raw
            if var.is_list:
                value = tuple(item.strip() for item in raw.split(",") if item.strip())
            elif var.path == ("config_file",) and not raw.strip():
                continue  # an empty path means "no file", as templated pod specs produce
            _set_path(out, var.path, value)
            collector.origins.setdefault(var.path, key)
        return out


# Far above any real configuration; a bound, so that a path to a device or a huge file fails
# at once instead of exhausting memory at start-up.
_MAX_CONFIG_BYTES = 1 << 20


def _read_config(path: Path) -> str:
    # Only regular files (symlinks to them, as Kubernetes ConfigMap mounts are, included): a
    # FIFO would block start-up, /dev/zero would never end.
    if not stat.S_ISREG(path.stat().st_mode):
        raise OSError(f"{path} is not a regular file")
    with path.open("rb") as handle:
        data = handle.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise OSError(f"{path} is larger than {_MAX_CONFIG_BYTES} bytes")
    return data.decode("utf-8")


class _FileSource(PydanticBaseSettingsSource):
    """The TOML file named by the `config_file` argument or `GUARDRAILS_CONFIG_FILE`."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        collector = _COLLECTOR.get()
        raw = self.current_state.get("config_file")
        if raw is None or raw == "":
            return {}
        where = collector.origins.get(("config_file",), "config_file")
        try:
            path = Path(raw).expanduser()
        except RuntimeError as exc:  # "~nosuchuser/...": no home directory to expand to
            collector.problems.append(Problem(where, f"invalid config file path: {exc}", raw))
            return {}
        collector.file = path
        try:
            data = tomllib.loads(_read_config(path))
        except FileNotFoundError:
            collector.problems.append(Problem(where, "config file does not exist", str(path)))
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            collector.problems.append(Problem(where, f"cannot read config file: {exc}", str(path)))
            return {}
        except tomllib.TOMLDecodeError as exc:
            collector.problems.append(Problem(f"{path}", f"malformed TOML: {exc}"))
            return {}
        except ValueError as exc:
            # A path the OS cannot take at all ("embedded null byte"): an argument, since
            # environment variables cannot hold NUL.
            collector.problems.append(Problem(where, f"invalid config file path: {exc}", raw))
            return {}
        if "config_file" in data:
            collector.problems.append(
                Problem(f"{path}: config_file", "a config file cannot name another config file")
            )
            del data["config_file"]
        for leaf in _leaves(data):
            collector.origins.setdefault(leaf, f"{path}: {_dotted(leaf)}")
        return data


class _InitSource(PydanticBaseSettingsSource):
    """Explicit keyword arguments; unlike pydantic-settings' own, unknown names are errors."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        collector = _COLLECTOR.get()
        for key, value in collector.kwargs.items():
            collector.origins[(key,)] = f"argument {key}"
            if isinstance(value, Mapping) or _is_table_list(value):
                for leaf in _leaves({key: value}):
                    collector.origins[leaf] = f"argument {_dotted(leaf)}"
        return dict(collector.kwargs)


class GuardSettings(BaseSettings):
    """Everything guardrails reads from its environment, validated once.

    Construct with no arguments to read `GUARDRAILS_*` variables and the optional TOML file;
    keyword arguments override both (nested tables as dicts: `metrics={"port": 9400}`).
    `environ=` replaces `os.environ` (tests, launchers).
    """

    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    enabled: Annotated[
        bool, Field(**_accepted(_BOOL, "master switch; false makes every site a no-op"))
    ] = True
    sanitize: Annotated[
        bool, Field(**_accepted(_BOOL, "heal in place; false: detect, flag and count only"))
    ] = True
    async_assert: Annotated[
        bool,
        Field(
            **_accepted(
                _BOOL,
                "CI mode: device-side assert on NaN, +Inf, rows with no valid token and "
                "out-of-vocab ids",
            )
        ),
    ] = False
    enabled_sites: Annotated[
        tuple[str, ...],
        Field(
            **_accepted(
                "comma-separated site names or glob patterns", "sites that guard (not empty)"
            )
        ),
    ] = ("*",)
    disabled_sites: Annotated[
        tuple[str, ...],
        Field(
            **_accepted(
                "comma-separated site names or glob patterns",
                "sites switched off, applied after the enable list",
            )
        ),
    ] = ()
    config_file: Annotated[
        Path | None, Field(**_accepted("a path to a TOML file", "the TOML configuration file"))
    ] = None
    min_temperature: Annotated[
        float,
        Field(
            gt=0,
            allow_inf_nan=False,
            **_accepted(
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
        collector = _Collector(os.environ if environ is None else environ, values)
        token = _COLLECTOR.set(collector)
        try:
            try:
                # Values arrive through the sources below, never as pydantic-settings' own
                # init kwargs, so that every one of them carries its origin.
                super().__init__()
            except ValidationError as exc:
                problems = [*collector.problems, *_problems_from(exc, collector)]
                raise ConfigError(problems) from None
        finally:
            _COLLECTOR.reset(token)
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
        return _InitSource(settings_cls), _EnvSource(settings_cls), _FileSource(settings_cls)

    @field_validator("enabled", "sanitize", "async_assert", mode="before")
    @classmethod
    def _switch(cls, value: object) -> object:
        return _no_float_switch(value)

    # -- semantic checks that need several fields at once --------------------------------

    def _semantic_problems(self, collector: _Collector) -> Iterator[Problem]:
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
                            f"pattern {entry!r} matches no known site" + _closest(entry, declared),
                            accepted=_site_hint(),
                        )
                elif entry not in declared:
                    yield Problem(
                        where,
                        f"unknown site {entry!r}" + _closest(entry, declared),
                        accepted=_site_hint(),
                    )
        for name, site in self.sites.items():
            for key in ("nan_value", "posinf_value"):
                value = getattr(site, key)
                if value is None:
                    continue
                message = _replacement_problem(key, value, site.dtypes, self.min_temperature)
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
        path = tuple(_part(key) for key in keys)
        found = self._origins.get(path)
        if found is not None:
            return found
        for n in range(len(path) - 1, 0, -1):
            found = self._origins.get(tuple(path[:n]))
            if found is not None and found.startswith("argument"):
                return found
        return "default"


def _site_hint() -> str:
    return "a known site (" + ", ".join(sorted(KNOWN_SITES)) + ") or one declared in [sites]"


def _replacement_problem(
    key: str, value: float, dtypes: tuple[DtypeName, ...], min_temperature: float
) -> str:
    """Why `value` is not a safe replacement for every dtype in `dtypes`, or ''."""
    import torch  # late: settings are usable (and testable) without paying torch's import here

    if math.isnan(value) or value == math.inf:
        return f"{key} must not be NaN or +inf"
    if key == "posinf_value" and not math.isfinite(value):
        return "posinf_value must be finite"
    if not math.isfinite(value):
        return ""  # -inf is the default NaN replacement: a mask, safe at any temperature
    for name in dtypes:
        dtype = getattr(torch, name)
        as_dtype = torch.tensor(value, dtype=dtype)
        scaled = as_dtype / torch.tensor(min_temperature, dtype=dtype)
        if not (bool(torch.isfinite(as_dtype)) and bool(torch.isfinite(scaled))):
            limit = torch.finfo(dtype).max * min(1.0, min_temperature)
            return (
                f"{key}={value:g} overflows {name} after division by min_temperature="
                f"{min_temperature:g} (largest safe magnitude about {limit:.4g})"
            )
    return ""


def _problems_from(exc: ValidationError, collector: _Collector) -> Iterator[Problem]:
    for err in exc.errors(include_url=False):
        loc = tuple(_part(p) for p in err["loc"])
        where = collector.where(loc)
        if err["type"] == "extra_forbidden":
            siblings = _field_names(loc[:-1])
            hint = _closest(loc[-1], siblings)
            if loc[:1] == ("sites",) and len(loc) == 3:
                hint += '; site names containing dots must be quoted: [sites."sampler.logits"]'
            if len(loc) == 1 and where.startswith("argument"):
                hint = _closest(loc[-1], siblings)
            yield Problem(where, "unknown key" + hint, accepted=", ".join(sorted(siblings)))
            continue
        value = err.get("input")
        yield Problem(where, err["msg"], value if _is_scalar(value) else None, _accepted_for(loc))


def _is_scalar(value: object) -> bool:
    return isinstance(value, str | int | float | bool)


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = GuardSettings
    i = 0
    while i < len(loc):
        field = model.model_fields.get(loc[i])
        if field is None:
            return None
        annotation = field.annotation
        if annotation is not None and getattr(annotation, "__origin__", None) is dict:
            annotation = annotation.__args__[1]
            i += 1  # skip the dict key (site name)
        elif annotation is not None and getattr(annotation, "__origin__", None) is tuple:
            annotation = annotation.__args__[0]
            i += 1  # skip the list position ([[attach]] entries)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            i += 1
            continue
        return None
    return model


def _field_names(loc: tuple[str, ...]) -> list[str]:
    model = _model_at(loc)
    return list(model.model_fields) if model is not None else []


def _accepted_for(loc: tuple[str, ...]) -> str:
    for cut in range(len(loc), 0, -1):
        model = _model_at(loc[: cut - 1])
        if model is None:
            continue
        field = model.model_fields.get(loc[cut - 1])
        extra = field.json_schema_extra if field is not None else None
        if isinstance(extra, dict):
            return str(extra.get("accepted", ""))
    return ""
