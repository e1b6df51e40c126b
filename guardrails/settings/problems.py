"""Turning what is wrong with the settings into `Problem`s that name the origin and the
accepted values, with the closest valid name for a misspelt one."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pydantic import BaseModel, ValidationError

from guardrails._suggest import closest
from guardrails.exceptions import Problem
from guardrails.names import KNOWN_SITES
from guardrails.settings.schema import accepted_for, field_names, part

__all__ = ["problems_from", "site_hint"]


def site_hint() -> str:
    return "a known site (" + ", ".join(sorted(KNOWN_SITES)) + ") or one declared in [sites]"


def problems_from(
    exc: ValidationError, root: type[BaseModel], where_of: Callable[[tuple[str, ...]], str]
) -> Iterator[Problem]:
    """One `Problem` per pydantic error, at the origin `where_of` names for its key."""
    for err in exc.errors(include_url=False):
        loc = tuple(part(p) for p in err["loc"])
        where = where_of(loc)
        if err["type"] == "extra_forbidden":
            siblings = field_names(root, loc[:-1])
            hint = closest(loc[-1], siblings)
            if loc[:1] == ("sites",) and len(loc) == 3:
                hint += '; site names containing dots must be quoted: [sites."sampler.logits"]'
            if len(loc) == 1 and where.startswith("argument"):
                hint = closest(loc[-1], siblings)
            yield Problem(where, "unknown key" + hint, accepted=", ".join(sorted(siblings)))
            continue
        value = err.get("input")
        yield Problem(
            where, err["msg"], value if _is_scalar(value) else None, accepted_for(root, loc)
        )


def _is_scalar(value: object) -> bool:
    return isinstance(value, str | int | float | bool)
