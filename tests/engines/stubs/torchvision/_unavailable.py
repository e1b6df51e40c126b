"""Shared by the torchvision stub: names that exist to be imported, never to be used."""

from __future__ import annotations

from typing import Any, NoReturn


class Unavailable:
    """Stands in for any torchvision name: importable, but any use of it fails loudly."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"{self._name} is a stub (tests/engines/stubs/torchvision): the engine suites "
            "never process images; a call here means a test left the sampling code path"
        )

    def __getattr__(self, attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


def module_getattr(module: str) -> Any:
    """A module `__getattr__` that answers every public name with an `Unavailable`."""

    def __getattr__(name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module}.{name}")

    return __getattr__
