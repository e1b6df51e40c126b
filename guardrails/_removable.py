"""`Removable`: what every attach returns (a site on a function, a module or a method, a
trace), torch's `RemovableHandle` in spirit. A floor every layer may import."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Removable"]


class Removable:
    """A handle that `remove()`s what it put on; as a context manager, at the block's end."""

    def remove(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()
