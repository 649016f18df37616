"""A fixed-bucket latency histogram a queue master feeds and ``info`` reports.

The master observes once per GM round that completes (not per message):
the round's confirms, weighted by their count, took ``now - t`` where ``t``
is the turn that broadcast them (:meth:`Coordinator.on_confirmed`).  So it
is the replication part of a publisher confirm's latency (fsync and the
ring), as the master sees it; the hops from the client to the master are
not in it.  One ``bisect`` per round: nothing the data path notices.

:meth:`snapshot` is plain data (``buckets`` upper bounds in seconds,
cumulative-free ``counts`` per bucket plus one for +Inf, ``sum``,
``count``) that the management server turns into a Prometheus histogram
(:mod:`mirrorq.mgmt.metrics`).
"""

from __future__ import annotations

from bisect import bisect_left

#: upper bounds in seconds (Prometheus' le); a last bucket holds the rest (+Inf)
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LatencyHistogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float, n: int = 1) -> None:
        """``n`` events that each took ``seconds``."""
        self.counts[bisect_left(BUCKETS, seconds)] += n
        self.sum += seconds * n
        self.count += n

    def snapshot(self) -> dict:
        return {"buckets": list(BUCKETS), "counts": list(self.counts), "sum": self.sum, "count": self.count}
