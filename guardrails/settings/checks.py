"""The checks that need several settings at once, apart from the models they read.

- `check_site_table`, `check_attach_point`: one table's own fields together, raised as a
  `ValueError` from that model's validator (pydantic reports it at the table).
- `cross_field_problems`: across the whole configuration (enable lists against the declared
  sites, one kind per attach site, replacement values against dtypes and min_temperature). It
  reads the merged raw values, not a built `GuardSettings`, so that it also runs when another
  part is invalid and one run reports every problem; `GuardSettings.__init__` calls it.
- `notice_problems`: what is valid but worth a warning (`GuardSettings.notices`).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, TypeAdapter, ValidationError

from guardrails._suggest import closest
from guardrails.exceptions import Problem
from guardrails.names import HOOK_ACTS_ON, KNOWN_SITES
from guardrails.settings.fields import is_loopback
from guardrails.settings.problems import site_hint
from guardrails.settings.schema import model_at, plain

__all__ = ["check_attach_point", "check_site_table", "cross_field_problems", "notice_problems"]


# What the checks read of the models (`SiteSettings`, `AttachSettings`, `GuardSettings` in
# settings/models.py, which calls these checks): named by shape, so that this module never
# imports the models (no import cycle, TYPE_CHECKING included; tests/system/test_layering.py).
class SiteTable(Protocol):
    @property
    def on_no_valid_token(self) -> str: ...
    @property
    def eos_token_id(self) -> int | None: ...
    @property
    def abort_on(self) -> tuple[str, ...]: ...


class AttachPoint(Protocol):
    @property
    def site(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def vocab_size_from(self) -> object: ...


class MetricsTable(Protocol):
    @property
    def port(self) -> int: ...
    @property
    def addr(self) -> str: ...


class Settings(Protocol):
    @property
    def enabled(self) -> bool: ...
    @property
    def enabled_sites(self) -> tuple[str, ...]: ...
    @property
    def disabled_sites(self) -> tuple[str, ...]: ...
    @property
    def hooks(self) -> tuple[str, ...]: ...
    @property
    def heartbeat(self) -> tuple[str, ...]: ...
    @property
    def metrics(self) -> MetricsTable: ...
    @property
    def sites(self) -> Mapping[str, SiteTable]: ...
    @property
    def attach(self) -> tuple[AttachPoint, ...]: ...
    def is_site_enabled(self, name: str) -> bool: ...
    def site_settings(self, name: str) -> SiteTable: ...
    def unacted_abort_sites(self) -> tuple[str, ...]: ...


# The origin of a key path, as the construction's `Collector` names it.
Where = Callable[[tuple[str | int, ...]], str]


def check_site_table(site: SiteTable) -> None:
    """ValueError where the fields of one `[sites."name"]` table do not go together."""
    if site.on_no_valid_token == "eos" and site.eos_token_id is None:
        raise ValueError(
            'on_no_valid_token = "eos" needs eos_token_id = N (the model\'s stop token)'
        )


def check_attach_point(point: AttachPoint) -> None:
    """ValueError where the fields of one `[[attach]]` entry do not go together."""
    given = (point.vocab_size is not None) + (point.vocab_size_from is not None)
    if point.kind == "token_ids" and given != 1:
        raise ValueError(
            'kind = "token_ids" needs exactly one of vocab_size = N or '
            'vocab_size_from = "arg:..." (ids outside [0, vocab_size) are flagged)'
        )
    if point.kind == "logits" and given:
        raise ValueError('vocab_size and vocab_size_from apply only to kind = "token_ids"')


def notice_problems(settings: Settings, where: Where) -> Iterator[Problem]:
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
def _adapter(root: type[BaseModel], name: str) -> TypeAdapter[Any]:
    info = root.model_fields[name]
    # The field's type with its constraints (gt=0, allow_inf_nan=False), as the model has it.
    annotated: Any = Annotated[info.annotation, info]
    return TypeAdapter(annotated)


def _field(root: type[BaseModel], data: Mapping[str, Any], name: str) -> Any:
    """The validated value of a top-level field (its default if absent), None if invalid."""
    if name not in data:
        return root.model_fields[name].get_default(call_default_factory=True)
    try:
        return _adapter(root, name).validate_python(data[name])
    except ValidationError:
        return None


def _table(root: type[BaseModel], *loc: str) -> type[BaseModel]:
    model = model_at(root, loc)
    if model is None:
        raise TypeError(f"{root.__name__} has no table at {loc}")
    return model


def cross_field_problems(
    root: type[BaseModel], data: Mapping[str, Any], where: Where
) -> Iterator[Problem]:
    """Problems across the fields of `root` (`GuardSettings`), on the merged raw values `data`:
    each part is used if it validates on its own, so these checks run (and report) also when
    another part is invalid."""
    site_model = _table(root, "sites", "name")
    attach_model = _table(root, "attach", "[0]")
    raw_attach = data.get("attach", ())
    raw_points = list(raw_attach) if isinstance(raw_attach, list | tuple) else []
    raw_sites = data.get("sites", {})
    tables: Mapping[Any, Any] = raw_sites if isinstance(raw_sites, Mapping) else {}
    attach_sites = {site for p in raw_points if isinstance(site := _raw(p, "site"), str)}
    declared = set(KNOWN_SITES) | {n for n in tables if isinstance(n, str)} | attach_sites
    kinds: dict[str, tuple[str, int]] = {}
    for index, raw in enumerate(raw_points):
        point = _valid(attach_model, raw)
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
        entries = _field(root, data, field_name)
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
    min_temperature = _field(root, data, "min_temperature")
    if min_temperature is None:
        return  # its own problem is reported; the replacement bounds depend on it
    for name, raw in tables.items():
        site = _valid(site_model, raw)
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
