from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

import msgspec

K = TypeVar("K")
V = TypeVar("V")


class Diff(msgspec.Struct, Generic[K, V], frozen=True):
    """What one DiffStore round changed."""

    created: dict[K, V]
    updated: dict[K, V]
    deleted: dict[K, V]
    """The deleted keys, with the values they had."""

    def __bool__(self) -> bool:
        return bool(self.created or self.updated or self.deleted)


class DiffStore(Mapping[K, V], Generic[K, V]):
    """Turns full desired states into minimal changes.

    Each round, ``set`` every object the backend wants (keys are anything hashable, values
    anything comparable with ==), then ``done()`` returns what was created, updated and deleted
    since the previous round, and makes this round's objects the store's content. Keys not set
    in a round are deleted. The store reads as a Mapping of the last completed round.
    """

    def __init__(self) -> None:
        self._current: dict[K, V] = {}
        self._next: dict[K, V] = {}

    def set(self, key: K, value: V) -> None:
        self._next[key] = value

    def done(self) -> Diff[K, V]:
        current, wanted = self._current, self._next
        created = {k: v for k, v in wanted.items() if k not in current}
        updated = {k: v for k, v in wanted.items() if k in current and current[k] != v}
        deleted = {k: v for k, v in current.items() if k not in wanted}
        self._current, self._next = wanted, {}
        return Diff(created=created, updated=updated, deleted=deleted)

    def __getitem__(self, key: K) -> V:
        return self._current[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._current)

    def __len__(self) -> int:
        return len(self._current)
