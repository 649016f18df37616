"""Total-queue checker over a nemesis history (Jepsen's ``total-queue``
semantics, plus what a broker user cares about).  Pure: ops in, a report out.

Sets (message ids, from :mod:`ctl.nemesis.history` records):

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

* ``control_slow``: control-plane operations on the majority (a declare, a
  policy change, ``list_queues``, recorded as ``control`` ops with their
  ``latency``) that failed or took longer than ``control_bound`` seconds.
  An op whose node a fault cut, stopped or killed while it ran carries
  ``"majority": false`` and is not counted: it was the minority's.
* ``two_masters`` (:func:`mastership_overlaps`, from the nodes' logs): an
  interval in which replicas on two nodes both served as the queue's master.

Reported, not failing: ``duplicates`` (ids consumed more than once: redelivery
after a lost ack is allowed at-least-once behaviour), ``recovered``
(indeterminate publishes that were consumed), ``longest_stall`` (the longest
time during the publishing window with no confirm while a publish was
outstanding), publish latency percentiles.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


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
    control_slow: list = field(default_factory=list)
    control: dict = field(default_factory=dict)  # n, max latency, by operation
    two_masters: list = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not (
            self.lost
            or self.stuck
            or self.unexpected
            or self.unanswered
            or self.failed_delivered
            or self.control_slow
            or self.two_masters
        )

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} confirmed messages lost (e.g. {self.lost[:5]})")
        if self.stuck:
            out.append(
                f"{self.stuck} confirmed messages stuck in the broker, never delivered to a live consumer "
                f"(unconsumed confirmed ids e.g. {self.not_consumed[:5]})"
            )
        if self.unexpected:
            out.append(f"{len(self.unexpected)} unexpected messages consumed (e.g. {self.unexpected[:5]})")
        if self.unanswered:
            out.append(f"{len(self.unanswered)} operations not answered within the bound (e.g. {self.unanswered[:3]})")
        if self.failed_delivered:
            out.append(
                f"{len(self.failed_delivered)} nacked publishes were delivered (e.g. {self.failed_delivered[:5]})"
            )
        if self.control_slow:
            out.append(
                f"{len(self.control_slow)} control-plane operations on the majority failed or were slow "
                f"(e.g. {self.control_slow[:3]})"
            )
        if self.two_masters:
            out.append(f"two nodes served as master at once: {self.two_masters[:3]}")
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


def check(
    ops: Iterable[dict], bound: float = 30.0, final_depth: int | None = None, control_bound: float = 5.0
) -> Report:
    ops = list(ops)
    r = Report(final_depth=final_depth)
    control: dict = {}
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
                r.unanswered.append(
                    {"f": f, "value": v, "latency": round(lat, 3), "node": op.get("node"), "error": op.get("error")}
                )
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
        elif f == "control":
            lat = op.get("latency")
            c = control.setdefault(v, {"n": 0, "max": 0.0})
            c["n"] += 1
            c["max"] = max(c["max"], lat or 0.0)
            # one whose node a fault cut or stopped while it ran was not the majority's
            if op.get("majority", True) and (typ != "ok" or lat is None or lat > control_bound):
                r.control_slow.append(
                    {"op": v, "latency": lat, "node": op.get("node"), "error": op.get("error"), "time": t}
                )
    for _proc, f, v in invoked_at:
        r.unanswered.append({"f": f, "value": v, "latency": None, "error": "never completed"})
        if f == "publish":
            indet.add(v)
    r.attempted, r.confirmed, r.failed, r.indeterminate = len(attempted), len(confirmed), len(failed), len(indet)
    r.consumed, r.deliveries = len(consumed), sum(consumed.values())
    not_consumed = sorted(confirmed - set(consumed), key=str)
    r.not_consumed = not_consumed
    if final_depth is not None and final_depth > 0:
        r.stuck = min(len(not_consumed), final_depth)
    r.lost = not_consumed[r.stuck :]
    r.unexpected = sorted((v for v in consumed if v not in attempted), key=str)
    r.failed_delivered = sorted((v for v in failed if v in consumed), key=str)
    r.duplicates = {v: n for v, n in consumed.items() if n > 1}
    r.recovered = len([v for v in indet if v in consumed])
    r.faults = dict(faults)
    r.control = control
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
        r.latency = {
            "p50": round(_pct(latencies, 0.5), 4),
            "p99": round(_pct(latencies, 0.99), 4),
            "max": round(max(latencies), 4),
            "n": len(latencies),
        }
    return r


def mastership_overlaps(
    logs: dict[str, list[dict]], queue: str, stopped: dict[str, list[float]] | None = None
) -> list[dict]:
    """Intervals in which replicas of ``queue`` on two nodes both served as
    its master, from the nodes' structured logs (``node -> events``, each a
    node.log line).  A replica serves as master from its ``promoted`` event
    until it is stopped (``replica_stopped`` / ``replica_exited``), names
    another master (``master_known``), or its queue host pauses
    (``host_paused``, pause_minority) -- it serves again once the Raft
    leader's record confirmed it (``master_confirmed``) after the pause.
    ``stopped``: times at which a node's processes were killed or stopped
    (SIGKILL, SIGSTOP): a process that does not run serves nothing, and one
    resumed serves again only once confirmed.  Times are the lines'
    wall-clock ``ts`` (the nodes share one machine's clock)."""
    intervals: list[tuple[float, float, str, str]] = []  # (start, end, node, member)
    for node, events in logs.items():
        # member, as the node.log lines name it -> [start or None (paused), host component]
        serving: dict[Any, list[Any]] = {}
        marks = [{"ts": t, "event": "process_stopped"} for t in (stopped or {}).get(node, ())]
        for ev in sorted(list(events) + marks, key=lambda e: e.get("ts", 0.0)):
            kind, ts, comp = ev.get("event"), ev.get("ts", 0.0), ev.get("component")
            if kind == "process_stopped":
                for member, st in serving.items():
                    if st[0] is not None:
                        intervals.append((st[0], ts, node, member))
                        st[0] = None
                continue
            q = ev.get("queue")
            q = q[1] if isinstance(q, list) and len(q) == 2 else q
            if kind == "promoted" and q == queue:
                serving[ev.get("member")] = [ts, comp]
            elif kind in ("replica_stopped", "replica_exited", "master_known") and q == queue:
                for member, (start, c) in list(serving.items()):
                    if c != comp or (kind == "master_known" and ev.get("master") == member):
                        continue
                    if kind != "replica_exited" or ev.get("member") in (None, member):
                        if start is not None:
                            intervals.append((start, ts, node, member))
                        del serving[member]
            elif kind == "host_paused":
                for member, st in serving.items():
                    if st[1] == comp and st[0] is not None:
                        intervals.append((st[0], ts, node, member))
                        st[0] = None
            elif kind == "master_confirmed":
                confirmed = serving.get(ev.get("member"))
                if confirmed is not None and confirmed[0] is None:
                    confirmed[0] = ts
        for member, (start, _c) in serving.items():
            if start is not None:
                intervals.append((start, float("inf"), node, member))
    intervals.sort()
    out = []
    for i, (_s1, e1, n1, m1) in enumerate(intervals):
        for s2, e2, n2, m2 in intervals[i + 1 :]:
            if s2 >= e1:
                break
            if n2 != n1:
                out.append({"nodes": [n1, n2], "members": [m1, m2], "from": s2, "until": min(e1, e2)})
    return out
