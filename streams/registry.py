"""Named, registered singletons: one instance per class, looked up by name.

What the data sources (``job/sources``) and the input formats (``streams/formats``) are
registered in: a class decorator sets the class's ``name`` and keeps one instance of it;
names are unique (a clash is a programming error and raises ``ValueError`` at import).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(Generic[T]):
    """Instances of registered classes by name, in registration order; ``what`` names them
    in errors ("data source", "input format")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._by_name: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[C], C]:
        """Class decorator: ``cls.name = name`` and one instance of ``cls`` under ``name``."""

        def decorate(cls: C) -> C:
            if name in self._by_name and type(self._by_name[name]) is not cls:
                raise ValueError(f"{self.what} {name!r} registered twice")
            cls.name = name
            self._by_name[name] = cls()
            return cls

        return decorate

    def unregister(self, name: str) -> None:
        """Remove what is registered as ``name`` (for tests that register a toy one)."""
        self._by_name.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def get(self, name: str) -> T:
        """The instance registered as ``name``; ``KeyError`` with the valid names otherwise."""
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise KeyError(f"{self.what} {name!r} is not one of {', '.join(self.names())}") from None
