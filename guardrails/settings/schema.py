"""Walking the settings models: field metadata, key paths, and how values are spelled.

The models carry, per field, the accepted values (for error messages) and the meaning (for
the generated reference); this module writes and reads that metadata, turns key paths into
the spelling a user would type (`sites."sampler.logits".posinf_value`, `attach[0].target`),
and finds the model of a table from a path. It imports no other part of guardrails.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

__all__ = [
    "accepted",
    "accepted_for",
    "dotted",
    "field_names",
    "model_at",
    "part",
    "plain",
    "setting",
]


def setting(accepts: str, meaning: str = "", **constraints: Any) -> Any:
    """A settings field: the accepted values (for errors), the meaning (for the reference that
    `guardrails.settings.docs` generates from the models) and any pydantic constraints
    such as `min_length=1`; the value's own checks live in its type (`settings.fields`)."""
    return Field(json_schema_extra={"accepted": accepts}, description=meaning, **constraints)


def accepted(info: FieldInfo) -> str:
    """What `setting` recorded as the field's accepted values."""
    extra = info.json_schema_extra
    return str(extra.get("accepted", "")) if isinstance(extra, dict) else ""


def plain(
    value: Any,
    *,
    unset: str = "unset",
    empty: str = "empty",
    sep: str = ", ",
    number: str = "g",
) -> str:
    """A setting's value as people read it: true/false, inf/-inf, lists joined by `sep`;
    other floats in the format spec `number` ("" for Python's own spelling)."""
    if value is None:
        return unset
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "-inf" if value < 0 else "inf"
        return format(value, number)
    if isinstance(value, tuple | list):
        if not value:
            return empty
        return sep.join(plain(v, unset=unset, empty=empty, sep=sep, number=number) for v in value)
    if isinstance(value, dict):  # constant metric labels: name=value, as their variable reads
        if not value:
            return empty
        return sep.join(f"{k}={v}" for k, v in value.items())
    return str(value)


def part(key: str | int) -> str:
    # List positions (pydantic reports them as ints) are kept as "[i]" so that a key reads
    # the way a user would write it: attach[0].target.
    return f"[{key}]" if isinstance(key, int) else str(key)


def dotted(path: tuple[str, ...]) -> str:
    out = ""
    for p in path:
        if out and p.startswith("["):
            out += p
        else:
            quoted = f'"{p}"' if "." in p or not p else p
            out = f"{out}.{quoted}" if out else quoted
    return out


def model_at(root: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The model of the table at `loc` under `root` (dict keys and list positions skipped)."""
    model: type[BaseModel] = root
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


def field_names(root: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    model = model_at(root, loc)
    return list(model.model_fields) if model is not None else []


def accepted_for(root: type[BaseModel], loc: tuple[str, ...]) -> str:
    """The accepted values of the field at `loc`, or of the nearest field above it."""
    for cut in range(len(loc), 0, -1):
        model = model_at(root, loc[: cut - 1])
        if model is None:
            continue
        field = model.model_fields.get(loc[cut - 1])
        if field is not None and isinstance(field.json_schema_extra, dict):
            return accepted(field)
    return ""
