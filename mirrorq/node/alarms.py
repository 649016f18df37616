"""Resource alarms: RabbitMQ's memory high watermark and disk free limit, cluster-wide (sans-IO).

Each node watches two resources and raises an **alarm** when one runs low,
as RabbitMQ's ``vm_memory_monitor``, ``rabbit_disk_monitor`` and
``rabbit_alarm`` do; while any node of the cluster has an alarm raised,
every node's AMQP front end blocks its publishing connections
(``connection.blocked``, :mod:`mirrorq.amqp.connection`).

Limits (node.yaml, :func:`parse_memory_watermark`, :func:`parse_disk_free_limit`)
-------------------------------------------------------------------------------
* ``vm_memory_high_watermark``: a fraction of the machine's RAM (default
  0.4; 0 raises the alarm at once and so blocks every publisher), or
  ``{absolute: SIZE}``.  The memory alarm is raised while the memory used
  (resident memory of the node's whole process group) is *above* the limit.
* ``disk_free_limit``: a SIZE (default 50 MB, RabbitMQ 3.10's), or
  ``{absolute: SIZE}``, or ``{mem_relative: X}`` (X times the machine's
  RAM).  The disk alarm is raised while the free space of the file system
  holding the node's data dir (what ``df`` shows as available) is *below*
  the limit.
* A SIZE is a number of bytes or a string with a unit: ``k``/``K``/``KiB``,
  ``M``/``MiB``, ``G``/``GiB``, ``T``/``TiB`` are powers of 1024, ``kB``,
  ``MB``, ``GB``, ``TB`` powers of 1000 (RabbitMQ's convention).
* :meth:`Alarms.set_limit` changes a limit until the node restarts
  (``mirrorctl set_vm_memory_high_watermark`` / ``set_disk_free_limit``,
  as rabbitmqctl's); the next check applies it.

Protocol
--------
* The shell measures the memory every :data:`CHECK_INTERVAL` seconds and
  the free disk space every :meth:`Alarms.disk_check_interval` seconds
  (as RabbitMQ's disk monitor: the time a disk writing
  :data:`FAST_DISK_WRITE_RATE` would take to fill the room left above the
  limit, from :data:`MIN_DISK_CHECK_INTERVAL` to :data:`CHECK_INTERVAL`, so
  a disk filling up is caught about when it crosses the limit), and hands
  the figures to :meth:`Alarms.check` (None for a figure it did not read).
  There is no hysteresis, as in RabbitMQ: a check over the limit raises the
  alarm, the first check back under it clears it.  Each raise and clear is
  emitted once: ``Emit(AlarmSet(node, resource, figures))`` /
  ``Emit(AlarmCleared(...))`` (for this node's alarms with the figures that
  decided, for a peer's with none).
* Every node tells each peer it sees up its own alarmed resources,
  ``Send(peer, AlarmState(incarnation, seq, resources))``: at once when
  they change, when the peer comes up (:meth:`node_up`), and every
  :data:`RESEND_INTERVAL` seconds (checks pass the time), so a lost message
  is repaired.  ``seq`` grows with every state a node sends; a receiver
  keeps, per peer, the newest (incarnation, seq) it got.
* The cluster's alarms are the union of this node's and of the last state
  heard from every peer that membership sees up (a state that arrives
  before the peer's ``node_up`` counts from then on);
  ``Emit(ClusterAlarms(alarms))`` (sorted ``(node, resource)`` pairs)
  whenever the union changes, after an ``AlarmSet`` / ``AlarmCleared`` for
  each peer's alarm that began or ceased to count.

Guarantees
----------
* An alarm never outlives the node that raised it: a peer reported down
  (:meth:`node_down`: timeout, left, restarted, unreachable -- a node is
  down before it can be forgotten) takes its alarms with it, and a message
  from a life of a node already reported down (its incarnation is not newer)
  is ignored, so a dead node cannot block the cluster.
* Convergence: with messages between live nodes getting through, every
  node's union holds every live node's alarms within one
  :data:`RESEND_INTERVAL` (at once, normally: a change is sent when it is
  made).
* Blocking is per observer, as liveness is (:mod:`mirrorq.node.membership`):
  in a partition each side sees only the alarms of the nodes it reaches.

Assumptions
-----------
* The shell reports membership's up/down transitions (with incarnations)
  in the order membership emitted them, and delivers a peer's messages in
  the order that peer sent them (the agents' outboxes do).
* Node names are unique; incarnations grow with each start of a node.

Failure
-------
A figure the shell could not read (None) leaves that resource's alarm as it
was: a failing measurement neither raises nor clears an alarm.
:func:`parse_memory_watermark` and :func:`parse_disk_free_limit` raise
``ValueError`` naming what is wrong; a bad setting never reaches the core.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mirrorq.sansio import Emit, Send

MEMORY = "memory"
DISK = "disk"
RESOURCES = (MEMORY, DISK)
#: the words of a connection.blocked reason, RabbitMQ's (joined with " & ")
BLOCKED_BY = {MEMORY: "low on memory", DISK: "low on disk"}
#: seconds between two checks of a node's memory, and at most between two of its disk
CHECK_INTERVAL = 1.0
#: the least seconds between two checks of a node's free disk space
MIN_DISK_CHECK_INTERVAL = 0.1
#: bytes/s a fast disk may fill at (RabbitMQ's disk monitor assumes 250 MB/s)
FAST_DISK_WRITE_RATE = 250_000_000
#: seconds after which a node sends its alarm state to its peers again, changed or not
RESEND_INTERVAL = 5.0
DEFAULT_MEMORY_WATERMARK = 0.4
DEFAULT_DISK_FREE_LIMIT = 50_000_000

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string with a unit (see the module docstring)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a size (bytes, or a string such as '50MB' or '1GiB'), got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must not be negative, got {value}")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"must be a size (bytes, or a string such as '50MB' or '1GiB'), got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _fraction(value: Any, what: str, upper: float | None) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (upper is not None and value > upper)
    ):
        bound = f"from 0 to {upper:g}" if upper is not None else "0 or more"
        raise ValueError(f"{what} must be a number {bound}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Limit:
    """A limit in bytes: ``absolute``, or ``relative`` times the machine's RAM."""

    absolute: int | None = None
    relative: float | None = None
    #: node.yaml's key for the relative form: "relative" (``vm_memory_high_watermark``,
    #: where a plain number is relative) or "mem_relative" (``disk_free_limit``, absolute)
    relative_key: str = "relative"

    def limit(self, total_memory: int) -> int:
        if self.absolute is not None:
            return self.absolute
        assert self.relative is not None, "a Limit is absolute or relative (_parse_limit)"
        return int(total_memory * self.relative)

    def setting(self) -> Any:
        """As node.yaml takes it."""
        if self.relative_key == "relative":
            return self.relative if self.absolute is None else {"absolute": self.absolute}
        return self.absolute if self.relative is None else {self.relative_key: self.relative}


def _one_key(value: dict, allowed: tuple[str, ...]) -> tuple[str, Any]:
    if len(value) != 1 or next(iter(value)) not in allowed:
        raise ValueError(f"a mapping must have exactly one of the keys {', '.join(allowed)}, got {value!r}")
    return next(iter(value.items()))


def _parse_limit(value: Any, relative_key: str, plain: str, upper: float | None) -> Limit:
    """``{"absolute": SIZE}``, ``{relative_key: X}`` or a plain value (``plain``: which of the two it is)."""
    if isinstance(value, Limit):
        return value
    key = plain
    if isinstance(value, dict):
        key, value = _one_key(value, ("absolute", relative_key))
    if key == "absolute":
        return Limit(absolute=parse_size(value), relative_key=relative_key)
    return Limit(relative=_fraction(value, f"a {relative_key} limit (times RAM)", upper), relative_key=relative_key)


def parse_memory_watermark(value: Any) -> Limit:
    """A fraction of RAM (0..1), or ``{"absolute": SIZE}`` (or ``{"relative": fraction}``)."""
    return _parse_limit(value, "relative", "relative", 1.0)


def parse_disk_free_limit(value: Any) -> Limit:
    """A SIZE, ``{"absolute": SIZE}`` or ``{"mem_relative": X}``."""
    return _parse_limit(value, "mem_relative", "absolute", None)


def blocked_reason(resources) -> str:
    """The ``connection.blocked`` reason for these alarmed resources ("" for none)."""
    alarmed = set(resources)
    return " & ".join(BLOCKED_BY[r] for r in RESOURCES if r in alarmed)


# ---- messages between agents --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AlarmState:
    """A node's own alarmed resources (every one it has raised)."""

    incarnation: int
    seq: int
    resources: tuple[str, ...]


# ---- events ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AlarmSet:
    node: str
    resource: str
    figures: tuple[tuple[str, int], ...] = ()  # this node's: ("used"|"free", bytes), ("limit", bytes)


@dataclass(frozen=True, slots=True)
class AlarmCleared:
    node: str
    resource: str
    figures: tuple[tuple[str, int], ...] = ()
    reason: str = ""  # a peer's: "" (it cleared it) or why it no longer counts ("node down")


@dataclass(frozen=True, slots=True)
class ClusterAlarms:
    """Every alarm in effect in the cluster, as this node sees it: sorted (node, resource)."""

    alarms: tuple[tuple[str, str], ...]


@dataclass
class _Peer:
    incarnation: int = 0
    seq: int = -1
    resources: frozenset = frozenset()


class Alarms:
    """The resource alarm core of one node (see the module docstring)."""

    def __init__(
        self,
        node: str,
        incarnation: int,
        total_memory: int,
        *,
        memory: Any = DEFAULT_MEMORY_WATERMARK,
        disk: Any = DEFAULT_DISK_FREE_LIMIT,
    ) -> None:
        self.node, self.incarnation = node, incarnation
        self.total_memory = int(total_memory)
        self.memory = parse_memory_watermark(memory)
        self.disk = parse_disk_free_limit(disk)
        self.mem_used: int | None = None
        self.disk_free: int | None = None
        self.local: set[str] = set()
        self.seq = 0
        self.last_sent = float("-inf")
        self.up: dict[str, int] = {}  # peers up -> incarnation
        self.dead: dict[str, int] = {}  # peer -> the newest incarnation reported down
        self.peers: dict[str, _Peer] = {}  # the last state heard from each peer not reported down
        self.union: tuple[tuple[str, str], ...] = ()

    # ---- queries -------------------------------------------------------------------------------
    @property
    def mem_limit(self) -> int:
        return self.memory.limit(self.total_memory)

    @property
    def disk_free_limit(self) -> int:
        return self.disk.limit(self.total_memory)

    def disk_check_interval(self) -> float:
        """Seconds until the free disk space should be measured again (see the module docstring)."""
        if self.disk_free is None:
            return CHECK_INTERVAL
        room = self.disk_free - self.disk_free_limit
        return min(CHECK_INTERVAL, max(MIN_DISK_CHECK_INTERVAL, room / FAST_DISK_WRITE_RATE))

    def resources(self) -> frozenset:
        """The resources alarmed anywhere in the cluster (what blocks publishers)."""
        return frozenset(r for _, r in self.union)

    def status(self) -> dict:
        """This node's figures (RabbitMQ's /api/nodes names) and the cluster's alarms."""
        return {
            "mem_used": self.mem_used,
            "mem_limit": self.mem_limit,
            "mem_alarm": MEMORY in self.local,
            "vm_memory_high_watermark": self.memory.setting(),
            "total_memory": self.total_memory,
            "disk_free": self.disk_free,
            "disk_free_limit": self.disk_free_limit,
            "disk_free_alarm": DISK in self.local,
            "disk_free_limit_setting": self.disk.setting(),
            "alarms": [{"node": n, "resource": r} for n, r in self.union],
        }

    # ---- entry points --------------------------------------------------------------------------
    def set_limit(self, resource: str, setting: Any) -> None:
        """Change the memory watermark or the disk free limit (ValueError if bad); the next check applies it."""
        if resource == MEMORY:
            self.memory = parse_memory_watermark(setting)
        elif resource == DISK:
            self.disk = parse_disk_free_limit(setting)
        else:
            raise ValueError(f"unknown resource {resource!r} (known: {', '.join(RESOURCES)})")

    def check(self, now: float, mem_used: int | None, disk_free: int | None) -> list:
        """This node's measured figures (None: not measured this time): raise or clear its alarms."""
        if mem_used is not None:
            self.mem_used = mem_used = int(mem_used)
        if disk_free is not None:
            self.disk_free = disk_free = int(disk_free)
        out: list = []
        for resource, alarmed, figures in (
            (
                MEMORY,
                None if mem_used is None else mem_used > self.mem_limit,
                (("used", self.mem_used or 0), ("limit", self.mem_limit)),
            ),
            (
                DISK,
                None if disk_free is None else disk_free < self.disk_free_limit,
                (("free", self.disk_free or 0), ("limit", self.disk_free_limit)),
            ),
        ):
            if alarmed is None or alarmed == (resource in self.local):
                continue
            if alarmed:
                self.local.add(resource)
                out.append(Emit(AlarmSet(self.node, resource, figures)))
            else:
                self.local.discard(resource)
                out.append(Emit(AlarmCleared(self.node, resource, figures)))
        if out:
            out += self._announce(now)
        elif now - self.last_sent >= RESEND_INTERVAL:
            out += self._announce(now)
        return out + self._union()

    def node_up(self, now: float, node: str, incarnation: int) -> list:
        """Membership saw ``node`` (this incarnation) come up: it hears this node's state at once."""
        if node == self.node:
            return []
        self.up[node] = incarnation
        if self.dead.get(node) == incarnation:
            del self.dead[node]  # back in the life reported down (a partition healed): heard from again
        return [Send(node, self._state())] + self._union()

    def node_down(self, now: float, node: str, incarnation: int) -> list:
        """Membership reported ``node`` down: its alarms no longer count."""
        self.up.pop(node, None)
        self.dead[node] = max(self.dead.get(node, -1), incarnation)
        self.peers.pop(node, None)
        return self._union("node down")

    def receive(self, now: float, src: str, msg: Any) -> list:
        if not isinstance(msg, AlarmState):
            raise TypeError(f"alarms: unexpected message from {src!r}: {msg!r}")
        if src == self.node or msg.incarnation <= self.dead.get(src, -1):
            return []  # from a life of that node reported down: its alarms died with it
        p = self.peers.get(src)
        if p is not None and (msg.incarnation, msg.seq) <= (p.incarnation, p.seq):
            return []  # older than what is known
        self.peers[src] = _Peer(msg.incarnation, msg.seq, frozenset(r for r in msg.resources if r in RESOURCES))
        return self._union()

    # ---- internals ------------------------------------------------------------------------------
    def _state(self) -> AlarmState:
        return AlarmState(self.incarnation, self.seq, tuple(r for r in RESOURCES if r in self.local))

    def _announce(self, now: float) -> list:
        self.seq += 1
        self.last_sent = now
        state = self._state()
        return [Send(n, state) for n in sorted(self.up)]

    def _union(self, why: str = "") -> list:
        """Recompute the cluster's alarms: this node's, and those of the peers
        that are up (a peer's state heard before membership saw it up waits
        for that); a peer's alarm counted or no longer counted is emitted."""
        union = {(self.node, r) for r in self.local}
        for n, p in self.peers.items():
            if n in self.up:
                union |= {(n, r) for r in p.resources}
        new = tuple(sorted(union))
        if new == self.union:
            return []
        old, self.union = set(self.union), new
        out: list = [Emit(AlarmSet(n, r)) for n, r in new if n != self.node and (n, r) not in old]
        out += [Emit(AlarmCleared(n, r, reason=why)) for n, r in sorted(old - union) if n != self.node]
        return out + [Emit(ClusterAlarms(new))]
