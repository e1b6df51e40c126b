"""A small TOML writer for the values guardrails' settings hold (tomllib only reads).

Used by `guardrails config --format toml`, whose output must parse back to the same settings,
and by the settings fuzz tests to write their random documents.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from pathlib import PurePath
from typing import Any

__all__ = ["key", "string", "value"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def string(text: str) -> str:
    """A TOML basic string. JSON's escapes are TOML's, but TOML also forbids a raw DEL."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def key(name: str) -> str:
    """A bare key where TOML allows one, else a quoted key."""
    return name if _BARE_KEY.fullmatch(name) else string(name)


def value(obj: Any) -> str:
    """The TOML spelling of a scalar, a list/tuple or a dict (as an inline table)."""
    if isinstance(obj, bool):
        return "true" if obj else "false"
    if isinstance(obj, int):
        return str(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return repr(obj)
    if isinstance(obj, str | PurePath):
        return string(str(obj))
    if isinstance(obj, dt.datetime | dt.date | dt.time):
        return obj.isoformat()
    if isinstance(obj, list | tuple):
        return "[" + ", ".join(value(item) for item in obj) + "]"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{key(str(k))} = {value(v)}" for k, v in obj.items()) + "}"
    raise TypeError(f"no TOML spelling for {type(obj).__name__}")
