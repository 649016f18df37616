"""Naming the slow mirror behind an ``ha-confirm-timeout`` nack.

RocketMQ's SYNC_MASTER logs which slave did not answer when a flush to it
times out (FLUSH_SLAVE_TIMEOUT).  On a GM ring the master cannot see that
directly: a publish travels master -> m1 -> m2 -> ... -> master and only its
return is observed, so "not back in time" says nothing about *where* it
stopped.  This probe finds out.

Protocol
--------
1. When publishes are nacked for the timeout, the master remembers the GM
   seq ``wanted`` of the newest late publish and sends every mirror of its
   view, directly (outside the ring), ``ProgressQuery(queue, master, wanted,
   probe)``.
2. A mirror answers ``Progress(queue, member, probe, held)``: the highest
   seq of the master's broadcasts GM has delivered to it.
3. When every mirror answered, or after ``PROBE_DEADLINE`` seconds, the
   master calls :func:`culprit` with the ring order and logs one line naming
   the mirror where the publish stopped: the first mirror in ring order (from
   the master) that does not hold ``wanted`` -- every mirror after it lacks it
   only because that one has not forwarded it -- or, when all hold it, that
   the ring's last hop (back to the master) is what is late.  A mirror that
   did not answer counts as not holding it.

Guarantees: the probe is advisory; it never changes a confirm, a nack or the
ring.  Assumes the ring forwards in view order (GM's).  Fails soft: an answer
to an older probe is ignored; a probe whose mirrors all died names nobody.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PROBE_DEADLINE = 1.0


@dataclass(frozen=True)
class ProgressQuery:
    queue: str
    master: str  # the origin whose broadcasts are asked about
    wanted: int
    probe: int
    reply_to: object = None


@dataclass(frozen=True)
class Progress:
    queue: str
    member: str
    probe: int
    held: int


def culprit(ring: Sequence[str], master: str, answers: Mapping[str, int], wanted: int) -> tuple[str | None, str]:
    """``(mirror, why)``: where a broadcast ``wanted`` of ``master`` stopped.

    ``ring`` is the view's member order; the ring is walked from the member
    after ``master``.  ``answers`` maps mirrors to the seq they hold (absent:
    no answer).  ``mirror`` is None when every mirror holds ``wanted``."""
    if master not in ring:
        raise ValueError(f"the master {master!r} is not in the ring {list(ring)!r}")
    i = list(ring).index(master)
    order = list(ring[i + 1 :]) + list(ring[:i])
    for m in order:
        held = answers.get(m)
        if held is None:
            return m, "did not answer the progress probe"
        if held < wanted:
            behind = order[order.index(m) + 1 :]
            tail = f"; {', '.join(behind)} wait behind it" if behind else ""
            return m, f"holds {held} of the master's broadcasts, {wanted} needed{tail}"
    return None, f"every mirror holds broadcast {wanted}: the last hop back to the master is late"
