"""Keyed one-shot timers behind one Thespian wakeup: the timer table of an
actor shell whose core speaks ``SetTimer(key, delay)`` / ``CancelTimer(key)``.

Thespian cannot cancel a ``wakeupAfter``: a shell that armed one wakeup per
``SetTimer`` paid a turn for every timer it ever armed, superseded and
cancelled ones included.  A Raft follower re-arms its election timer on
every ``AppendEntries``, a queue manager arms a timeout for every declare
and cancels it when the declare is answered: under load those turns were a
tenth of the node agent's and the manager's.

:class:`TimerTable` keeps the live deadline of each key and asks its shell
for a Thespian wakeup only when a deadline is earlier than every wakeup
already armed; a superseded or cancelled timer costs no turn.

Guarantees
----------
* A key fires at most once per ``set`` and never after ``cancel`` or after
  a later ``set`` of the same key replaced it (the later deadline counts).
* A key fires in the first ``due(now)`` with ``now`` at or past its
  deadline; :meth:`set` and :meth:`due` return the time of the wakeup the
  shell must arm so that such a call happens (``None``: one armed already
  covers it).  Keys due together fire in deadline order (ties: in the order
  they were set).

Assumes the shell hands every wakeup's ``at`` to :meth:`fired` and then
calls :meth:`due`; all times are on the shell's one clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Any

#: a deadline this close to ``now`` counts as due (a wakeup may come a hair early)
SLACK = 0.001


class TimerTable:
    def __init__(self) -> None:
        self._at: dict[Hashable, tuple[float, int]] = {}  # key -> (deadline, seq) of its live timer
        self._heap: list[tuple[float, int, Any]] = []  # (deadline, seq, key), superseded entries included
        self._seq = itertools.count()
        self._armed: list[float] = []  # times of the wakeups armed and not yet fired (a heap)

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._at

    def set(self, key: Hashable, at: float) -> float | None:
        """Arm (or re-arm) ``key`` for ``at``; the time of a wakeup to arm, or None."""
        entry = (at, next(self._seq))
        self._at[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 64 + 4 * len(self._at):  # superseded entries pile up: drop them
            self._heap = [(a, s, k) for k, (a, s) in self._at.items()]
            heapq.heapify(self._heap)
        return self._arm_for(at)

    def cancel(self, key: Hashable) -> None:
        self._at.pop(key, None)

    def fired(self, at: float) -> None:
        """The wakeup armed for ``at`` came."""
        if at in self._armed:
            self._armed.remove(at)
            heapq.heapify(self._armed)

    def due(self, now: float) -> tuple[list[Hashable], float | None]:
        """The keys due at ``now`` (removed), and the time of a wakeup to arm
        for the earliest deadline left, or None."""
        keys = []
        heap = self._heap
        while heap and heap[0][0] <= now + SLACK:
            at, seq, key = heapq.heappop(heap)
            if self._at.get(key) == (at, seq):
                del self._at[key]
                keys.append(key)
        while heap and self._at.get(heap[0][2]) != heap[0][:2]:
            heapq.heappop(heap)  # superseded or cancelled: no wakeup for it
        return keys, (self._arm_for(heap[0][0]) if heap else None)

    def _arm_for(self, at: float) -> float | None:
        if self._armed and self._armed[0] <= at + SLACK:
            return None
        heapq.heappush(self._armed, at)
        return at
