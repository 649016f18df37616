"""The GM payloads of a classic mirrored queue, typed, with one encode/decode table.

The replicas of a queue talk to each other by broadcasting through their GM
group (:mod:`mirrorq.gm.core`: total order per origin, delivered to every
survivor).  A payload travels encoded, as ``[name, fields...]`` (msgpack
lists between nodes); :func:`encode` and :func:`decode` are the only places
that know the encoded form, and :data:`_KINDS` is its table;
:func:`encoded_size` is what GM weighs an encoded payload at when it
batches (:mod:`mirrorq.bounds`).  A payload
from another node arrives with tuples where its sender had lists (GM's
codec, :mod:`mirrorq.gm.messages`): the decoder takes either.

Kinds:

* :class:`Ops` -- the master's round: the log records it wrote (offset,
  record type, body), the publisher marks (``hwm``) and consumer-table
  changes it made, and the confirms the round earns (sent by the last
  mirror when every member holds the round; :mod:`.coordinator`);
* :class:`Promoted` -- a master announces itself (after a promotion, and
  again to joiners);
* :class:`Synced` -- a mirror finished its sync (:mod:`.sync`);
* :class:`Leaving` -- a replica stops gracefully (and whom its master hands
  over to);
* :class:`Deleted` -- the master deleted the queue;
* :class:`~.promotion.Report`, :class:`~.promotion.Cutoff`,
  :class:`~.promotion.Ready`, :class:`~.promotion.Elect` -- the promotion
  protocol (:mod:`.promotion`).

A payload this table does not know, or one of a known kind with the wrong
number of fields, is :class:`BadPayload` (the receiver counts it and drops
it: a newer node's kind must not crash an older one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mirrorq.bounds import ENTRY_BYTES, ITEM_BYTES, MESSAGE_BYTES, SCALAR_BYTES, plain_size, props_size
from mirrorq.classic.promotion import Cutoff, Elect, Ready, Report


class BadPayload(ValueError):
    """An encoded payload this table cannot decode."""


@dataclass(frozen=True, slots=True)
class Ops:
    """The master's round: ``records`` ``[offset, record type, body]``,
    ``hwm`` ``[[publisher], seq]`` changes, ``consumers`` (consumer-table
    changes), ``confirms`` ``[[publisher], [seqs]]`` the round earns (empty
    when the master sends them itself)."""

    records: Sequence[Any]
    hwm: Sequence[Any]
    consumers: Sequence[Any]
    confirms: Sequence[Any]


@dataclass(frozen=True, slots=True)
class Promoted:
    """``member`` is the master; channels reach it at ``dst``."""

    member: str
    dst: Any


@dataclass(frozen=True, slots=True)
class Synced:
    """The mirror ``member`` holds everything its master holds."""

    member: str


@dataclass(frozen=True, slots=True)
class Leaving:
    """``member`` stops gracefully; a master names the mirror it hands over to."""

    member: str
    successor: str | None = None


@dataclass(frozen=True, slots=True)
class Deleted:
    """The master deleted the queue (``reason``: deleted, auto-delete, expired, owner-down)."""

    reason: str


Payload = Ops | Promoted | Synced | Leaving | Deleted | Report | Cutoff | Ready | Elect

#: name -> (class, fewest fields, most fields); the encoded form is [name, fields in declaration order]
_KINDS: dict[str, tuple[Callable[..., Payload], int, int]] = {
    "ops": (Ops, 4, 4),
    "promoted": (Promoted, 2, 2),
    "synced": (Synced, 1, 1),
    "leaving": (Leaving, 1, 2),
    "deleted": (Deleted, 1, 1),
    "report": (Report, 3, 3),
    "cutoff": (Cutoff, 2, 2),
    "ready": (Ready, 1, 1),
    "elect": (Elect, 2, 2),
}
_NAMES: dict[Any, str] = {cls: name for name, (cls, _f, _m) in _KINDS.items()}


def encode(payload: Payload) -> list[Any]:
    """The encoded form GM carries: ``[name, fields...]`` (a leaver without
    a successor is ``["leaving", member]``)."""
    if type(payload) is Ops:  # the hot one: a master's every round
        return ["ops", payload.records, payload.hwm, payload.consumers, payload.confirms]
    name = _NAMES.get(type(payload))
    if name is None:
        raise TypeError(f"not a classic queue payload: {payload!r}")
    fields = [getattr(payload, f) for f in type(payload).__slots__]
    if type(payload) is Leaving and payload.successor is None:
        fields.pop()
    return [name, *fields]


def decode(raw: Any) -> Payload:
    """A payload from its encoded form; :class:`BadPayload` if it is not one."""
    if type(raw) not in (list, tuple) or not raw:
        raise BadPayload(f"a classic queue payload is [name, fields...], got {raw!r:.200}")
    if raw[0] == "ops" and len(raw) == 5:
        return Ops(raw[1], raw[2], raw[3], raw[4])
    spec = _KINDS.get(raw[0]) if isinstance(raw[0], str) else None
    if spec is None:
        raise BadPayload(f"unknown classic queue payload {raw[0]!r:.50} (known: {', '.join(_KINDS)})")
    cls, fewest, most = spec
    if not fewest <= len(raw) - 1 <= most:
        raise BadPayload(f"payload {raw[0]!r} takes {fewest}..{most} fields, got {len(raw) - 1}: {raw!r:.200}")
    return cls(*raw[1:])


def encoded_size(payload: Any) -> int:
    """An encoded payload's estimated size (:mod:`mirrorq.bounds`; GM weighs
    what it batches with it): an encoded :class:`Ops` by its
    PUBLISH records' bodies and properties and its lists of offsets and
    seqs; any other payload by :func:`~mirrorq.bounds.plain_size`."""
    if type(payload) is not list or len(payload) != 5 or payload[0] != "ops":
        return plain_size(payload)
    n = MESSAGE_BYTES
    for op in payload[1]:
        body = op[2]
        n += ITEM_BYTES
        if op[1] == 1:  # PUBLISH: [msg_id, body, properties, persistent]
            n += len(body[1]) + props_size(body[2])
        elif body and type(body[0]) is list:  # offsets
            n += SCALAR_BYTES * len(body[0])
    n += ENTRY_BYTES * (len(payload[2]) + len(payload[3]))
    for confirm in payload[4]:
        n += ENTRY_BYTES + SCALAR_BYTES * len(confirm[1])
    return n
