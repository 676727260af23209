"""Name → function registries (policy losses, advantage estimators, KL estimators, ...).

A decorator registers a function under a name; looking up an unknown name raises a ``KeyError``
whose message lists the valid names; registering a name twice with a different function raises.
:meth:`Registry.require` ties a registry to the torch-free list of its names
(:mod:`training.algorithms.names`), which recipes are checked against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
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

    def require(self, names: Iterable[str], where: str = "training.algorithms.names") -> None:
        """Raise unless exactly ``names`` are registered: the torch-free name lists recipes are
        checked against (``where``) and the registry must not drift apart."""
        want, have = set(names), set(self._fns)
        if want != have:
            raise RuntimeError(
                f"{self.family} registry and {where} disagree: listed but not registered "
                f"{sorted(want - have)}, registered but not listed {sorted(have - want)}; "
                f"register the function and list its name in {where}")

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._fns)
