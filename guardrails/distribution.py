"""Who else installs the import name `guardrails`.

This project is distributed as `guardrails-logits` and imported as `guardrails`. So is the
unrelated, popular `guardrails-ai`, which also installs a `guardrails` console script. pip
does not warn when two distributions write the same files: installing both overwrites one
with the other, and uninstalling either deletes files the other needs. This module finds such
a clash from the installed metadata (`importlib.metadata`), so that `guardrails check` and
the start-up event can say what to do. It imports nothing from guardrails.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Final

from packaging.utils import canonicalize_name

__all__ = ["DISTRIBUTION", "IMPORT_NAME", "clash_advice", "other_owners"]

DISTRIBUTION: Final = "guardrails-logits"
IMPORT_NAME: Final = "guardrails"
# Checked by name at every start-up: a lookup costs well under a millisecond, where reading
# every installed distribution's file list (`thorough`) costs about 0.1 s.
KNOWN_CLASHES: Final = ("guardrails-ai",)


@functools.cache
def other_owners(*, thorough: bool = False) -> tuple[str, ...]:
    """Installed distributions other than `guardrails-logits` that provide `guardrails`.

    Quick: the projects known to clash, by name. `thorough`: every installed distribution
    whose top-level names (or files) include `guardrails`. Cached: installs do not change
    under a running process that matters here.
    """
    found: set[str] = set()
    for name in KNOWN_CLASHES:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.add(dist.metadata["Name"] or name)
    if thorough:
        owners = importlib.metadata.packages_distributions().get(IMPORT_NAME, [])
        found.update(owner for owner in owners if canonicalize_name(owner) != DISTRIBUTION)
    return tuple(sorted(found, key=canonicalize_name))


def clash_advice(owners: tuple[str, ...]) -> str:
    """One line saying what the clash does and how to get out of it."""
    names = ", ".join(owners)
    return (
        f"the import name 'guardrails' is also installed by {names}: the two overwrite each "
        "other's files (pip does not warn) and uninstalling one breaks the other; keep them in "
        f"separate virtual environments, or repair this one with `pip uninstall {' '.join(owners)} "
        f"{DISTRIBUTION}` then `pip install {DISTRIBUTION}` (its command is also installed as "
        f"`{DISTRIBUTION}`)"
    )
