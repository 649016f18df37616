"""A GM group view: a version number and the members in ring order.

The view is what the replicated registry (table ``gm_group``: name, version,
members) stores for a group.  ``members`` is the ring: every member sends to
the member after it (its *right*) and receives from the member before it (its
*left*); the last member's right is the first.  Views are values: a view
change is a new ``View`` with a higher version, decided by the registry (see
:mod:`mirrorq.gm.core`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class View:
    version: int
    members: tuple[str, ...]

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"View.version must be an int >= 0, got {self.version!r}")
        if not isinstance(self.members, tuple):
            raise TypeError(f"View.members must be a tuple of names, got {type(self.members).__name__}")
        if not self.members:
            raise ValueError("View.members must name at least one member")
        for m in self.members:
            if not isinstance(m, str) or not m:
                raise ValueError(f"View member names must be non-empty strings, got {m!r}")
        if len(set(self.members)) != len(self.members):
            dupes = sorted({m for m in self.members if self.members.count(m) > 1})
            raise ValueError(f"View.members names a member twice: {dupes}")

    def __contains__(self, name: object) -> bool:
        return name in self.members

    def __len__(self) -> int:
        return len(self.members)

    def _index(self, name: str) -> int:
        try:
            return self.members.index(name)
        except ValueError:
            raise ValueError(f"{name!r} is not a member of view {self.version} {list(self.members)}") from None

    def left(self, name: str) -> str:
        """The member ``name`` receives from."""
        i = self._index(name)
        return self.members[i - 1]

    def right(self, name: str) -> str:
        """The member ``name`` sends to."""
        i = self._index(name)
        return self.members[(i + 1) % len(self.members)]

    def without(self, *names: str) -> tuple[str, ...]:
        """The members, in ring order, minus ``names``."""
        gone = set(names)
        return tuple(m for m in self.members if m not in gone)
