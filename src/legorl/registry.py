"""One registry for every kind of backend chosen by short name: engines, sandbox backends,
harnesses. A name is either a registered short name or ``module:Class``, so a user's own class
plugs in without editing legorl:

    from legorl.harnesses import HARNESSES
    harness = HARNESSES.build("mini", max_turns=12)
    harness = HARNESSES.build("my_pkg.agents:MyHarness", retries=2)

``build`` takes the class's options as keywords: the fields of its ``config_class`` when it has
one (engines, sandbox backends: the class is built from that config), else the fields of the
class itself (harnesses are their own dataclass). An unknown name or option is a
``ConfigError`` that names it and lists what is known.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from legorl.protocols import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes of one kind by short name (``kind`` names it in messages: "engine", …)."""

    def __init__(self, kind: str, entries: dict[str, type[T] | str] | None = None) -> None:
        """``entries``: classes, or ``module:Class`` strings imported when first used (listing
        the names, as ``--help`` does, imports nothing)."""
        self.kind = kind
        self._entries: dict[str, type[T] | str] = dict(entries or {})

    def register(self, name: str, cls: type[T]) -> type[T]:
        self._entries[name] = cls
        return cls

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __getitem__(self, name: str) -> type[T]:
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = self._entries[name] = self._import(entry)
        return entry

    def items(self) -> Iterator[tuple[str, type[T]]]:
        return iter([(name, self[name]) for name in self._entries])

    def names(self) -> str:
        return ", ".join(self._entries)

    def resolve(self, name: str) -> type[T]:
        """The class registered as ``name``, or imported from ``module:Class``."""
        if name in self._entries:
            return self[name]
        if ":" in name:
            return self._import(name)
        raise ConfigError(f"unknown {self.kind} {name!r} (one of {self.names()}, or module:Class)")

    def _import(self, name: str) -> type[T]:
        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{self.kind} {name!r}: cannot import it ({exc})") from None
        if not isinstance(cls, type):
            raise ConfigError(f"{self.kind} {name!r}: is not a class")
        found: type[T] = cls
        return found

    def build(self, name: str, **options: Any) -> T:
        """An instance of ``name`` with ``options``; unknown or missing options are errors."""
        cls: Any = self.resolve(name)
        config_class = getattr(cls, "config_class", None)
        target: Any = config_class if config_class is not None else cls
        try:
            known = {f.name for f in dataclasses.fields(target) if f.init}
        except TypeError:
            raise ConfigError(f"{self.kind} {name!r}: its options are not a dataclass") from None
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown option(s) for {self.kind} {name!r}: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known)) or 'none'})"
            )
        try:
            built: Any = target(**options)
        except TypeError as exc:  # a required option is missing
            raise ConfigError(f"{self.kind} {name!r}: {exc}") from None
        instance: T = cls(built) if config_class is not None else built
        return instance
