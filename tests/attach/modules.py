"""Engine modules written to disk for a test and imported for real (the attach tests patch
them by import path)."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["module_on_path"]

_names = itertools.count()


@contextmanager
def module_on_path(
    source: str, prefix: str, directory: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """The name of a fresh, not yet imported module holding `source`, on sys.path: a new
    name each time, so import hooks and sys.modules entries never leak between tests. Its
    sys.modules entry is dropped afterwards."""
    name = f"{prefix}_{next(_names)}"
    (directory / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(directory))
    try:
        yield name
    finally:
        sys.modules.pop(name, None)
