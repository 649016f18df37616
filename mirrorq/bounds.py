"""How big one message between two mirrorq processes may be.

Thespian pickles a message whole, signs it whole (:mod:`mirrorq.node.wire`)
and its receiver gathers it in one buffer grown by concatenation; a direct
link (:mod:`mirrorq.node.link`) frames a bundle whole.  A message that grows
with a backlog therefore grows until it cannot be sent at all.  Two numbers
bound every message one mirrorq process sends another:

* :data:`MAX_BATCH_BYTES` (4 MiB).  Every place that gathers many things
  into one message stops before the next thing would take the message past
  it: the outbox's bundles, a channel's ``Publish``, a replica's turn of
  client requests (one GM payload, one quorum Raft entry), a master's or
  quorum leader's ``Deliveries``, GM activities and frames, Raft
  ``AppendEntries`` and ``InstallSnapshot`` chunks, dead-letter batches;
  sync batches use a smaller budget of their own
  (:data:`mirrorq.classic.sync.SYNC_BATCH_BYTES`).  A batch always
  takes its first thing, so a thing bigger than the bound travels alone:
  nothing is split inside a message and nothing is dropped.
* ``max_message_size``: the largest AMQP message body a front end accepts
  (``node.yaml``, default :data:`DEFAULT_MAX_MESSAGE_SIZE`, 16 MiB, at most
  :data:`MAX_MESSAGE_SIZE_LIMIT`).  A publish announcing a bigger body is
  refused at its content header, before any body frame is read, with
  ``406 PRECONDITION_FAILED`` naming the limit (as RabbitMQ does with its
  ``max_message_size``).  So the only thing that can exceed
  ``MAX_BATCH_BYTES`` is one message, which travels alone.

Hence no message between two processes is bigger than about
``max(MAX_BATCH_BYTES, max_message_size + its properties)``: at most
:data:`MAX_WIRE_BYTES`, which a direct link refuses to exceed in one frame.

Sizes are estimates (:func:`size_of`), cheap enough for every message
posted: bodies and other ``bytes``/``str`` are counted exactly, numbers and
the fixed parts of a message by a constant, properties by their number of
entries (:func:`props_size`).  A message class that carries bulk data says
what it weighs with a ``wire_size()`` method; other objects are weighed by
their attributes, containers by their length only (:func:`size_of`) or
fully (:func:`plain_size`).  An estimate undercounts only properties
(headers with long values) and containers weighed by length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

MiB = 1 << 20

#: the budget of one batched message (see the module docstring)
MAX_BATCH_BYTES = 4 * MiB
#: the largest AMQP body a front end accepts unless node.yaml says otherwise
DEFAULT_MAX_MESSAGE_SIZE = 16 * MiB
#: the highest ``max_message_size`` node.yaml accepts: half the segment
#: log's largest record (:data:`mirrorq.store.segment_log.MAX_RECORD_BYTES`,
#: 64 MiB), which must also hold the message's properties and its record
MAX_MESSAGE_SIZE_LIMIT = 32 * MiB
#: the largest message between two processes: one message of the largest
#: size allowed and room for its properties (an AMQP content header fits one
#: frame, at most 128 KiB) and envelopes, or one full batch
MAX_WIRE_BYTES = MAX_MESSAGE_SIZE_LIMIT + MAX_BATCH_BYTES

#: what an estimate counts for a number, a flag, None, and per entry of a
#: container or a properties table
SCALAR_BYTES = 9
ENTRY_BYTES = 16
#: ... for the fixed part of a message or of one item in a batch
MESSAGE_BYTES = 64
ITEM_BYTES = 32

_TEXT = (bytes, bytearray, memoryview, str)
_SCALARS = (int, float, bool, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
_FIELDS: dict[type, tuple] = {}


def props_size(props: Any) -> int:
    """An AMQP properties table's estimate: its entries and its headers'
    entries, by count (values are not looked into)."""
    if not props:
        return 0
    n = ENTRY_BYTES * len(props)
    headers = props.get("headers") if type(props) is dict else None
    if headers:
        n += ENTRY_BYTES * len(headers)
    return n


def size_of(obj: Any) -> int:
    """The estimated wire size of ``obj`` (see the module docstring):
    ``obj.wire_size()`` when its class has one; bytes and text by length;
    a container by its length alone; another object by its attributes."""
    t = type(obj)
    ws = getattr(t, "wire_size", None)
    if ws is not None:
        return ws(obj)
    if t in _TEXT:
        return len(obj) + SCALAR_BYTES
    if t in _SCALARS:
        return SCALAR_BYTES
    if t in _CONTAINERS:
        return ENTRY_BYTES * (len(obj) + 1)
    names = _FIELDS.get(t)
    if names is None:
        names = _FIELDS[t] = _field_names(t)
    n = MESSAGE_BYTES
    for name in names:
        n += size_of(getattr(obj, name, None))
    return n


def _field_names(t: type) -> tuple:
    if dataclasses.is_dataclass(t):
        return tuple(f.name for f in dataclasses.fields(t))
    slots: list = []
    for k in t.__mro__:
        s = k.__dict__.get("__slots__", ())
        slots.extend([s] if isinstance(s, str) else s)
    return tuple(slots)  # a plain object with a __dict__ weighs MESSAGE_BYTES


def plain_size(obj: Any) -> int:
    """The estimated encoded size of plain data (lists, tuples, dicts of
    bytes, text and numbers; what msgpack carries), looked into fully.
    Objects inside are weighed by :func:`size_of`."""
    t = type(obj)
    if t in _TEXT:
        return len(obj) + SCALAR_BYTES
    if t in _SCALARS:
        return SCALAR_BYTES
    if t is list or t is tuple:
        n = ENTRY_BYTES
        for x in obj:
            n += plain_size(x)
        return n
    if t is dict:
        n = ENTRY_BYTES
        for k, v in obj.items():
            n += plain_size(k) + plain_size(v)
        return n
    return size_of(obj)


def batches(
    items: Iterable[Any],
    size: Callable[[Any], int] = size_of,
    limit: int = MAX_BATCH_BYTES,
    max_count: int | None = None,
) -> list[list]:
    """``items`` in order, in runs whose estimated sizes add up to at most
    ``limit`` (and of at most ``max_count`` items): a run takes the next
    item while it fits, and always takes its first one."""
    out: list[list] = []
    run: list = []
    total = 0
    for it in items:
        n = size(it)
        if run and (total + n > limit or (max_count is not None and len(run) >= max_count)):
            out.append(run)
            run, total = [], 0
        run.append(it)
        total += n
    if run:
        out.append(run)
    return out


def check_max_message_size(value: Any) -> int:
    """``value`` as a ``max_message_size`` (bytes, 1 .. :data:`MAX_MESSAGE_SIZE_LIMIT`);
    raises ValueError naming the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_MESSAGE_SIZE_LIMIT:
        raise ValueError(
            f"must be a number of bytes from 1 to {MAX_MESSAGE_SIZE_LIMIT} "
            f"({MAX_MESSAGE_SIZE_LIMIT // MiB} MiB), got {value!r}"
        )
    return value
