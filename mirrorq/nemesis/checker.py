"""Total-queue checker over a nemesis history (Jepsen's ``total-queue``
semantics, plus what a broker user cares about).  Pure: ops in, a report out.

Sets (message ids, from :mod:`mirrorq.nemesis.history` records):

* ``attempted``: publishes invoked; ``confirmed``: publishes ``ok``
  (publisher confirm); ``failed``: publishes ``fail`` (nacked);
  ``indeterminate``: ``info`` (connection lost, client deadline).
* ``consumed``: distinct ids delivered to a consumer (``consume`` ``ok``).

Verdict (``valid`` is False if any is non-empty / non-zero):

* ``lost``: confirmed, never consumed, and not accounted for by what the
  broker still holds at the end (see ``stuck``) -- the broker lost them.
* ``unexpected``: consumed but never attempted (or a malformed id).
* ``stuck``: confirmed, never consumed, while the broker says it still holds
  messages after the final drain (``final_depth``: ready + unacknowledged,
  from list_queues): the broker has them but no live client got them
  (e.g. unacked and held by a consumer that is gone).  A history cannot name
  which ids are stuck and which are lost, so ``stuck = min(not consumed,
  final_depth)`` and ``lost`` is the rest; without ``final_depth`` every
  unconsumed confirmed id counts as lost.
* ``unanswered``: publishes or declares that took longer than ``bound``
  seconds to complete (or never completed, or ended with the client's own
  deadline, ``"error": "timeout"``).
* ``failed_delivered``: nacked (``fail``) publishes that were consumed: a
  nack promised the message was not taken.

Reported, not failing: ``duplicates`` (ids consumed more than once: redelivery
after a lost ack is allowed at-least-once behaviour), ``recovered``
(indeterminate publishes that were consumed), ``longest_stall`` (the longest
time during the publishing window with no confirm while a publish was
outstanding), publish latency percentiles.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Iterable


@dataclass
class Report:
    attempted: int = 0
    confirmed: int = 0
    failed: int = 0
    indeterminate: int = 0
    consumed: int = 0
    deliveries: int = 0
    lost: list = field(default_factory=list)
    stuck: int = 0
    not_consumed: list = field(default_factory=list)
    unexpected: list = field(default_factory=list)
    unanswered: list = field(default_factory=list)
    failed_delivered: list = field(default_factory=list)
    duplicates: dict = field(default_factory=dict)
    recovered: int = 0
    longest_stall: float = 0.0
    stall_at: float | None = None
    latency: dict = field(default_factory=dict)
    faults: dict = field(default_factory=dict)
    final_depth: int | None = None

    @property
    def valid(self) -> bool:
        return not (self.lost or self.stuck or self.unexpected or self.unanswered or self.failed_delivered)

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} confirmed messages lost (e.g. {self.lost[:5]})")
        if self.stuck:
            out.append(f"{self.stuck} confirmed messages stuck in the broker, never delivered to a live consumer "
                       f"(unconsumed confirmed ids e.g. {self.not_consumed[:5]})")
        if self.unexpected:
            out.append(f"{len(self.unexpected)} unexpected messages consumed (e.g. {self.unexpected[:5]})")
        if self.unanswered:
            out.append(f"{len(self.unanswered)} operations not answered within the bound "
                       f"(e.g. {self.unanswered[:3]})")
        if self.failed_delivered:
            out.append(f"{len(self.failed_delivered)} nacked publishes were delivered (e.g. {self.failed_delivered[:5]})")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["valid"] = self.valid
        d["lost_count"] = len(self.lost)
        d["unexpected_count"] = len(self.unexpected)
        d["duplicate_count"] = len(self.duplicates)
        for k in ("lost", "not_consumed", "unexpected", "failed_delivered"):
            d[k] = d[k][:20]
        d["unanswered"] = d["unanswered"][:20]
        d["duplicates"] = dict(list(d["duplicates"].items())[:20])
        return d


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def check(ops: Iterable[dict], bound: float = 30.0, final_depth: int | None = None) -> Report:
    ops = list(ops)
    r = Report(final_depth=final_depth)
    attempted, confirmed, failed, indet = set(), set(), set(), set()
    consumed: Counter = Counter()
    invoked_at: dict = {}  # (process, f, value) -> time
    latencies: list[float] = []
    confirms: list[float] = []
    outstanding: list[tuple[float, float]] = []  # (invoke time, completion time) of publishes
    faults: Counter = Counter()
    for op in ops:
        t, f, v, typ = op.get("time", 0.0), op.get("f"), op.get("value"), op.get("type")
        if op.get("process") == "nemesis":
            if typ == "info" and f not in ("heal", "resume", "start", "replicas-restored"):
                key = f if f != "partition" else f"partition-{op.get('mode', 'drop')}"
                faults[key] += 1
            continue
        key = (op.get("process"), f, v)
        if f in ("publish", "declare"):
            if typ == "invoke":
                invoked_at[key] = t
                if f == "publish":
                    attempted.add(v)
                continue
            start = invoked_at.pop(key, None)
            lat = None if start is None else t - start
            if lat is not None and (lat > bound or op.get("error") == "timeout"):
                r.unanswered.append({"f": f, "value": v, "latency": round(lat, 3), "node": op.get("node"),
                                     "error": op.get("error")})
            if f == "publish":
                if start is not None:
                    outstanding.append((start, t))
                if typ == "ok":
                    confirmed.add(v)
                    confirms.append(t)
                    if lat is not None:
                        latencies.append(lat)
                elif typ == "fail":
                    failed.add(v)
                else:
                    indet.add(v)
        elif f == "consume" and typ == "ok":
            consumed[v] += 1
    for (proc, f, v), start in invoked_at.items():
        r.unanswered.append({"f": f, "value": v, "latency": None, "error": "never completed"})
        if f == "publish":
            indet.add(v)
    r.attempted, r.confirmed, r.failed, r.indeterminate = len(attempted), len(confirmed), len(failed), len(indet)
    r.consumed, r.deliveries = len(consumed), sum(consumed.values())
    not_consumed = sorted(confirmed - set(consumed), key=str)
    r.not_consumed = not_consumed
    if final_depth is not None and final_depth > 0:
        r.stuck = min(len(not_consumed), final_depth)
    r.lost = not_consumed[r.stuck:]
    r.unexpected = sorted((v for v in consumed if v not in attempted), key=str)
    r.failed_delivered = sorted((v for v in failed if v in consumed), key=str)
    r.duplicates = {v: n for v, n in consumed.items() if n > 1}
    r.recovered = len([v for v in indet if v in consumed])
    r.faults = dict(faults)
    # longest stall: a gap between confirms (or from a publish's invoke) while a publish was outstanding
    if outstanding:
        events = sorted(confirms)
        last_end = max(end for _, end in outstanding)
        prev = min(s for s, _ in outstanding)
        best, at = 0.0, None
        for c in events + [last_end]:
            if c - prev > best:
                best, at = c - prev, prev
            prev = max(prev, c)
        r.longest_stall, r.stall_at = round(best, 3), at
    if latencies:
        r.latency = {"p50": round(_pct(latencies, 0.5), 4), "p99": round(_pct(latencies, 0.99), 4),
                     "max": round(max(latencies), 4), "n": len(latencies)}
    return r
