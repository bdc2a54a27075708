"""One registry type behind every plug-in kind: schedules, resharding strategies, reshard schedulers, model
specs, step hooks and the planner's cost terms.

One rule for all of them:

* ``register(item)`` adds ``item`` under its name; registering a name again is accepted when it is the same
  item (a module imported twice, ``--custom-import`` of a module the package imports too) and refused, naming
  both, when it is another;
* ``get(name)`` returns the item; an unknown name is a ``ConfigError`` (a ``ValueError``) that lists what is
  registered: ``unknown schedule 'x'; registered: gpipe, 1f1b, ...``;
* ``names()`` lists the names, built-in ones first, then in registration order; a built-in name may be declared
  ``lazy`` (its module is imported on the first ``get``, which registers it).

This module sits at the bottom of the package with ``config_fields``: it imports nothing else of ours.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Generic, Iterator, TypeVar

from .config_fields import ConfigError

__all__ = ["Registry"]

T = TypeVar("T")


def _name_attr(item: object) -> str:
    return item.name  # type: ignore[attr-defined]


class Registry(Generic[T]):
    """Named items of one kind (module docstring: the one rule)."""

    def __init__(self, kind: str, *, key: Callable[[T], str] = _name_attr, type_: type | None = None,
                 lazy: dict[str, str] | None = None) -> None:
        self.kind = kind
        """What the items are, as messages name them ("schedule", "resharding strategy")."""
        self._key = key
        self._type = type_
        self._lazy = dict(lazy or {})
        self._items: dict[str, T] = {}

    def register(self, item: T) -> T:
        """Add ``item`` under its name; returns it (so it can decorate)."""
        if self._type is not None and not isinstance(item, self._type):
            raise TypeError(f"a {self.kind} must be a {self._type.__name__}, got {type(item).__name__}")
        name = self._key(item)
        if not name:
            raise ValueError(f"{item!r} has no name: a {self.kind} is registered by name")
        old = self._items.get(name)
        if old is not None and old is not item and old != item:
            raise ValueError(f"{self.kind} {name!r} is registered already ({_origin(old)}); {_origin(item)} "
                             "registers another under the same name")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        """The item registered as ``name``; ``ConfigError`` listing the registered names otherwise."""
        if name not in self._items and name in self._lazy:
            importlib.import_module(self._lazy[name])        # registers it
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}") from None

    def names(self) -> tuple[str, ...]:
        """Every name: those declared lazy (the built-ins found on first use) in their order, then the others in
        registration order."""
        return tuple(self._lazy) + tuple(n for n in self._items if n not in self._lazy)

    def items(self) -> tuple[T, ...]:
        """The registered items, in registration order (lazy ones only once imported)."""
        return tuple(self._items.values())

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Registry[T]]:
        """What is registered inside the ``with`` block is gone after it (tests register examples this way)."""
        saved = dict(self._items)
        try:
            yield self
        finally:
            self._items = saved

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def _origin(item: object) -> str:
    """Where an item comes from, for the duplicate message."""
    mod = getattr(item, "__module__", None) or type(item).__module__
    return f"{mod}.{getattr(item, '__qualname__', type(item).__qualname__)}" if callable(item) else repr(item)[:80]
