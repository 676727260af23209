"""Name → function registries (policy losses, advantage estimators, KL estimators, ...).

A decorator registers a function under a name; looking up an unknown name raises a ``KeyError``
whose message lists the valid names; registering a name twice with a different function raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named family of interchangeable functions sharing one signature."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            existing = self._fns.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(
                    f"{self.family} {name!r} is already registered to "
                    f"{existing.__module__}.{existing.__qualname__}; pick another name"
                )
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._fns[name]
        except KeyError:
            valid = ", ".join(sorted(self._fns))
            raise KeyError(f"unknown {self.family} {name!r}; valid names: {valid}") from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._fns)
