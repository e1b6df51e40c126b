"""The checks that need several settings at once, apart from the models they read.

- `cross_field_problems`: across the whole configuration (enable lists against the declared
  sites, one kind per attach site, replacement values against dtypes and min_temperature). It
  reads the merged raw values, not a built `GuardSettings`, so that it also runs when another
  part is invalid and one run reports every problem; `GuardSettings.__init__` calls it.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from guardrails._suggest import closest
from guardrails.exceptions import Problem
from guardrails.names import KNOWN_SITES
from guardrails.settings.problems import site_hint
from guardrails.settings.schema import model_at

__all__ = ["cross_field_problems"]


# The origin of a key path, as the construction's `Collector` names it.
Where = Callable[[tuple[str | int, ...]], str]


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
