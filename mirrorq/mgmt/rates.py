"""Per-second rates of counters and gauges, from the samples the API reads.

RabbitMQ's management API gives every counter a ``<name>_details`` object
with its ``rate``.  The masters keep only totals (cheap), so the server
samples: every time it reads a queue's totals it hands them to
:meth:`Rates.sample`, which keeps the samples of the last :data:`WINDOW`
seconds per key and answers the slope between the oldest and the newest.
A counter that went down (a failover: the new master counts from zero)
starts its window again, so a rate is never negative for a counter.  Keys
not sampled for :data:`FORGET` seconds are dropped (deleted queues).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from typing import Any

WINDOW = 10.0
FORGET = 120.0


class Rates:
    def __init__(self, clock=time.monotonic, window: float = WINDOW) -> None:
        self.clock = clock
        self.window = window
        self.samples: dict[Hashable, deque] = {}
        self.last_gc = clock()

    def sample(self, key: Hashable, value: Any, counter: bool = True) -> float:
        """Record ``value`` for ``key`` now; the rate per second over the window
        (0.0 until two samples at different times exist; None values are skipped)."""
        now = self.clock()
        self._gc(now)
        if not isinstance(value, (int, float)):
            return 0.0
        q = self.samples.get(key)
        if q is None:
            q = self.samples[key] = deque()
        if counter and q and value < q[-1][1]:
            q.clear()
        q.append((now, value))
        while len(q) > 2 and now - q[1][0] >= self.window:
            q.popleft()
        t0, v0 = q[0]
        return round((value - v0) / (now - t0), 2) if now > t0 else 0.0

    def _gc(self, now: float) -> None:
        if now - self.last_gc < FORGET:
            return
        self.last_gc = now
        for k in [k for k, q in self.samples.items() if not q or now - q[-1][0] > FORGET]:
            del self.samples[k]
