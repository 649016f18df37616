"""GM messages on the wire (between member actors) and for driving the test /
benchmark actor :class:`mirrorq.gm.actor.GMMemberActor`.

Between members, one Thespian message is one :class:`GMFrame`: the group,
the sending and the receiving member's names, and a ``body`` of msgpack bytes
holding one or more core messages (:class:`~mirrorq.gm.core.Activity` /
:class:`~mirrorq.gm.core.Nudge`) in send order.  Packing the core messages
with msgpack instead of letting Thespian pickle the dataclasses keeps the
per-hop cost low; several core messages for the same right neighbour that
arise in one handler call ride in one frame, up to
:data:`~mirrorq.bounds.MAX_BATCH_BYTES` of pubs (the core keeps each
activity to that bound).

Payloads go through msgpack: bytes, str, int, float, bool, None, lists and
dicts of those.  Tuples arrive as tuples (and lists too: the decoder uses
``use_list=False``), so payloads are best kept as ``bytes``.

The control messages below are plain dataclasses pickled by Thespian; they
are for tests, benchmarks and tools, not for the ring itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from mirrorq.bounds import MESSAGE_BYTES
from mirrorq.gm.core import Activity, Item, Nudge
from mirrorq.packing import pack

_ACTIVITY = 0
_NUDGE = 1


class GMCodecError(ValueError):
    """A frame body that is not a list of GM core messages."""


@dataclass(slots=True, repr=False)
class GMFrame:
    group: str
    src: str
    dst: str
    body: bytes

    def wire_size(self) -> int:
        return len(self.body) + len(self.group) + len(self.src) + len(self.dst) + MESSAGE_BYTES

    def __repr__(self) -> str:
        # short on purpose: Thespian formats str(message) for every transmit
        # (its log lines), and the repr of a 100 KiB body costs ~1.5 ms
        return f"GMFrame({self.group!r}, {self.src!r} -> {self.dst!r}, {len(self.body)} bytes)"

    __str__ = __repr__


def encode(msgs: Iterable[Activity | Nudge], dst: str | None = None) -> bytes:
    """Pack core messages for member ``dst``.  Pubs of ``dst``'s own origin
    are left out: a member never takes its own pubs from its left (it is
    their source), so carrying them back is pure cost."""
    out: list[tuple[Any, ...]] = []
    for m in msgs:
        if isinstance(m, Activity):
            items = []
            for it in m.items:
                pubs = () if it.origin == dst else it.pubs
                items.append((it.origin, pubs, it.marker, it.ack, it.full))
            out.append((_ACTIVITY, m.version, items))
        elif isinstance(m, Nudge):
            out.append((_NUDGE, m.version))
        else:
            raise TypeError(f"GM frames carry Activity or Nudge, got {type(m).__name__}")
    try:
        return pack(out)
    except TypeError as e:
        raise TypeError(f"GM payloads must be msgpack-friendly (bytes, str, numbers, lists, dicts): {e}") from None


def decode(body: bytes) -> list[Activity | Nudge]:
    if not isinstance(body, (bytes, bytearray)):
        raise GMCodecError(f"GM frame body must be bytes, got {type(body).__name__}")
    try:
        raw = msgpack.unpackb(body, raw=False, use_list=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise GMCodecError(f"GM frame body is not msgpack: {e}") from None
    if not isinstance(raw, tuple):
        raise GMCodecError(f"GM frame body must be a list of messages, got {type(raw).__name__}")
    msgs: list[Activity | Nudge] = []
    try:
        for m in raw:
            if m[0] == _ACTIVITY:
                items = tuple(Item(o, pubs, mk, ack, full) for o, pubs, mk, ack, full in m[2])
                msgs.append(Activity(m[1], items))
            elif m[0] == _NUDGE:
                msgs.append(Nudge(m[1]))
            else:
                raise GMCodecError(f"unknown GM message kind {m[0]!r}")
    except (TypeError, ValueError, IndexError) as e:
        if isinstance(e, GMCodecError):
            raise
        raise GMCodecError(f"malformed GM message in frame: {e}") from None
    return msgs


# ---- driving GMMemberActor (tests, benchmarks) ---------------------------
@dataclass
class GMMemberInit:
    """First message to a new member actor.  ``node``: the name of the node
    it runs on.  ``options``: GMShell/GMMember keyword arguments.  ``agent``:
    the node agent's address; None: the sender if it is the agent
    (``CreateLocal.init``), else looked up by the agent's global name."""

    group: str
    node: str
    options: dict[str, Any] = field(default_factory=dict)
    via_agent: bool = False


@dataclass
class GMInfoQuery:
    pass


@dataclass
class GMInfo:
    name: str
    view: tuple[int, list[str]] | None  # (version, [members]) or None
    removed: bool


@dataclass
class GMCreateGroup:
    """Found the group with these members (ring order), version 1."""

    founders: tuple[str, ...]


@dataclass
class GMJoinGroup:
    pass


@dataclass
class GMBroadcastMany:
    """Broadcast ``count`` payloads of ``size`` bytes, at most ``window``
    unconfirmed at a time, ``chunk`` per call into the shell; the round
    latency of every ``sample_every``-th seq is recorded."""

    count: int
    size: int = 1024
    window: int = 4000
    chunk: int = 100
    sample_every: int = 10


@dataclass
class GMReportQuery:
    pass


@dataclass
class GMReport:
    name: str
    view: tuple[int, list[str]] | None
    removed: bool
    delivered: dict[str, tuple[int, int, str]]  # origin -> (count, last seq, digest hex)
    published: int
    confirmed: int
    errors: list[str]
    stats: dict[str, Any]
    started: float | None  # monotonic time of the first broadcast
    finished: float | None  # monotonic time of the last confirm
    latencies_ms: list[float]  # sampled broadcast -> Confirmed latencies of the last GMBroadcastMany


@dataclass
class GMAck:
    ok: bool = True
    error: str = ""
