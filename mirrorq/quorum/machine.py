"""The quorum queue's state machine: what every member applies, in log order.

:class:`QuorumQueueMachine` is to a quorum queue what RabbitMQ's
``rabbit_fifo`` is to its quorum queues: a deterministic, pure function of the
committed Raft log.  Every member of a queue's Raft group applies the same
entries in the same order and so holds the same queue; no member ever reads a
clock, a random number or anything not in the entry.  The Raft core lives in
:mod:`mirrorq.mnesia_like.raft`; the member that drives both is
:mod:`mirrorq.quorum.replica`.

Entries and time
----------------
One Raft entry holds ``[now, [command, ...]]`` (:func:`encode_entry` /
:func:`decode_entry`): the commands the leader collected in one turn and the
leader's ``now`` (seconds) when it proposed them.  Every command of the entry
is applied at that time.  The machine's clock is the largest ``now`` it has
applied (a new leader's clock may be behind the old one's: time never goes
back inside the machine), so TTL decisions are the same on every member.

Message ids
-----------
A message's id is ``index << MSG_ID_SHIFT | k``: ``index`` is the Raft index
of the entry that enqueued it, ``k`` the position of its ``enqueue`` in that
entry (an entry holds at most :data:`MAX_COMMANDS_PER_ENTRY` commands).  Ids
therefore follow log order and name the same message on every member;
channels use them as offsets (``Deliveries`` items, ``Settle``).

Commands (rabbit_fifo's vocabulary; plain dataclasses below)
------------------------------------------------------------
``enqueue(publisher, seq, body, properties)``
    Publisher ids are channel ids ``(dst, number)``; each publisher numbers
    its publishes 1, 2, 3...  The machine keeps each publisher's high-water
    mark ``hwm``: ``seq <= hwm`` is a resend (after a leader change) and is
    confirmed again without being stored -- or nacked again if it was
    rejected (the last :data:`MAX_REJECTED_RANGES` runs of rejected seqs are
    remembered per publisher); ``seq == hwm + 1`` is new; ``seq > hwm + 1``
    would leave a gap and is nacked (``out-of-sequence``), nothing stored --
    the leader only proposes a publisher's seqs in order.  Overflow
    ``reject-publish`` nacks a new publish that would take the ready
    messages over ``x-max-length`` / ``x-max-length-bytes``.
``checkout(consumer, prefetch, no_ack, cancel, request_id, lookahead)``
    Attach (or update) consumer ``(channel, consumer_tag)``: it gets at most
    ``prefetch`` unsettled messages (0: no limit), plus ``lookahead`` more
    while that takes nothing from anyone (see *Lookahead*); ``no_ack``
    consumers' deliveries are settled when made.  ``cancel`` stops deliveries; what it
    holds stays checked out until settled, returned or its channel goes down.
    A checkout from a channel that went ``down`` is refused (a late or
    reordered request of a closed channel must not leave a ghost consumer).
``dequeue(channel, request_id, no_ack)``
    ``basic.get``: the head message, checked out to the channel (settled at
    once with ``no_ack``), or an empty answer.
``settle(channel, msg_ids)``
    Ack: each message checked out to a consumer (or a get) of ``channel`` is
    removed.  AMQP acks are per channel, so settlements name the channel;
    ids it does not hold are ignored (a late ack after a leader change
    returned the message must not ack its next delivery).
``return(channel, msg_ids)``
    Nack/reject with requeue: the message goes back to the head of the queue
    (the *returns*, served before never-delivered messages, in return order)
    with ``delivery_count + 1``.
``release(channel, msg_ids)``
    The channel gives back messages it never passed on to its client (AMQP
    1.0's *released* outcome: a lookahead delivery whose consumer was
    cancelled, say): back to the head like ``return``, but the delivery
    count is unchanged -- nobody saw them.  They are flagged ``acquired``
    (redelivered: later messages may have overtaken them).
``discard(channel, msg_ids)``
    Nack/reject without requeue: removed, effect ``Dropped("rejected")``.
``purge``
    Removes every ready message (checked-out ones stay), effect
    ``Dropped("purged")`` and ``Purged(count)``.
``credit(channel, grants)``
    Link credit back: for each ``(consumer_tag, nbytes)`` the channel's
    front end wrote that many more bytes of the consumer's deliveries to its
    client.  Every consumer, whatever its prefetch (0, or ``no_ack``), is
    sent at most :data:`~mirrorq.classic.amqqueue.LINK_CREDIT_BYTES`
    of bodies (and one message more) not credited back, as a classic queue's
    consumers are: a client that stops reading stops its deliveries.
``down(channel)``
    The channel is gone: its consumers are removed, everything they (or its
    gets) hold is returned with ``delivery_count + 1``; the channel stays
    closed.  ``down(None)`` does that to every consumer of every channel
    without closing them: a new leader proposes it first in its term (see
    :mod:`.replica`).

Queue semantics
---------------
* Ready order: returned messages first (in return order), then the others by
  id.  Consumers with credit are served round-robin in attach order, one
  message each turn of the rotation.  So the first deliveries of messages
  never returned follow id order, hence each publisher's seq order.
* Lookahead: a consumer's front end holds deliveries beyond the client's
  prefetch and hands the next one over the moment the client acks, instead
  of after a Raft round.  A consumer with ``lookahead`` ``k`` may hold
  ``prefetch + k`` messages, but only while every active consumer with a
  prefetch is at its prefetch (none could take a message now) and the ready
  backlog holds at least every such consumer's lookahead together; so it
  takes nothing another consumer could have had; and a consumer takes
  lookahead only while the bodies it holds stay under
  ``LOOKAHEAD_BYTES`` (4 MiB: its front end keeps them in memory).  Whether it is granted is
  worked out from the state before each delivery (nothing to remember: a
  snapshot need not carry it).  ``no_ack`` and prefetch-0 consumers get
  none (they have no limit to look ahead of).
* ``x-delivery-limit`` ``L``: a return that takes ``delivery_count`` above
  ``L`` drops the message (effect ``Dropped("delivery_limit")``) instead of
  making it ready.  Every delivery carries its ``delivery_count`` (the number
  of returns before it; channels show it as ``x-delivery-count``), which is
  therefore never above ``L``, and a message is delivered at most ``L + 1``
  times.
* ``x-message-ttl`` (ms) and the per-message ``expiration`` property give a
  deadline ``enqueue time + min(ttl, expiration)``.  As RabbitMQ's quorum
  queues, expiry happens at the head: a ready message is dropped (effect
  ``Dropped("expired")``) when it is at the head and its deadline is not
  after the machine's clock; no message is delivered after its deadline.  A
  message enqueued with TTL 0 is delivered if a consumer takes it at once,
  else dropped.  Something must apply an entry for time to pass: the leader
  proposes an empty entry at :meth:`QuorumQueueMachine.next_deadline`.
  Checked-out messages do not expire; a returned message keeps its deadline.
* ``x-max-length`` / ``x-max-length-bytes`` count ready messages.  Overflow
  ``drop-head`` (default): after each command the head is dropped until
  within limits (effect ``Dropped("maxlen")``); a publish is offered to
  consumers first.  ``reject-publish``: see ``enqueue``.
* Settled messages are simply gone: the state holds only live messages
  (ready or checked out), so a snapshot's size follows the live backlog,
  never the history.

Effects
-------
:meth:`QuorumQueueMachine.apply` returns a list of effects (dataclasses
below): :class:`Deliver`, :class:`GetResult`, :class:`Confirm`,
:class:`Reject`, :class:`Dropped` (with the dropped messages, the hook for
dead-lettering), :class:`Settled`, :class:`CheckoutOk`,
:class:`CheckoutRefused`, :class:`Purged`, :class:`ConsumersDown`.  Every
member computes the same effects; which member acts on them (sends a
delivery, a confirm) is the replica's business.

Bodies
------
A machine built with ``bodies_in_log=True`` (every replica's) keeps no
message body or properties: they stay in the Raft entry that enqueued the
message, which the message id names (``id >> MSG_ID_SHIFT``, command
``id & (MAX_COMMANDS_PER_ENTRY - 1)``), and the machine keeps the id, the
body's size, the delivery count, the deadline and the acquired flag.  Its
effects' :class:`Message` then have ``body`` and ``properties`` None; whoever
sends one reads them back from the log (:mod:`.replica`).
:meth:`QuorumQueueMachine.release_index` is the lowest index the live
messages still need, so the log below it may be dropped (RabbitMQ's
*release cursor*).  The machine's memory thus grows with the number of
messages, not their bytes.  Without ``bodies_in_log`` (tests, tools) the
machine keeps bodies itself.  A snapshot row says where its body is (inline,
or in the log when ``None``), so a machine restores a snapshot of either
kind.

Snapshots
---------
:meth:`QuorumQueueMachine.snapshot` returns the whole state as plain data
(dicts, lists, str, int, float, bytes, None: msgpack-able), and
:meth:`QuorumQueueMachine.restore` rebuilds it; the Raft core stores it with
``compact`` and hands it back as ``ApplySnapshot``.  A machine restored from a
snapshot is equal, command for command, to the one that took it.

Assumptions and failure
-----------------------
Entries are applied once each, in strictly increasing index order (a lower
or equal index raises ``ValueError``: a replay bug, not input).  Every
member is built with the same queue ``arguments``.  Malformed commands (a
wrong type, a negative seq, a bad channel id...) raise :class:`BadCommand`,
a ``ValueError`` naming the field and the value, when they are built or
decoded -- the replica builds them from client input before proposing, so a
bad request is refused there and never reaches the log.  Semantic misses
(an ack of a message not held, a cancel of an unknown consumer) are
no-ops, as in RabbitMQ.  The publishers table and the closed-channel set
grow by one entry per channel ever seen (channel ids are never reused).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from mirrorq.bounds import ITEM_BYTES, SCALAR_BYTES, plain_size, props_size
from mirrorq.queues.semantics import (
    LINK_CREDIT_BYTES,
    LOOKAHEAD_BYTES,
    MAX_PREFETCH,
    QUORUM_OVERFLOW,
    AMQPError,
    InvalidArgument,
    parse_expiration,
    quorum_arguments,
)

__all__ = [
    "QuorumQueueMachine",
    "BadCommand",
    "MSG_ID_SHIFT",
    "MAX_COMMANDS_PER_ENTRY",
    "MAX_REJECTED_RANGES",
    "Enqueue",
    "Checkout",
    "Dequeue",
    "Settle",
    "Return",
    "Release",
    "Discard",
    "Purge",
    "Down",
    "Credit",
    "Command",
    "Effect",
    "Message",
    "Deliver",
    "GetResult",
    "Confirm",
    "Reject",
    "Dropped",
    "Settled",
    "CheckoutOk",
    "CheckoutRefused",
    "Purged",
    "ConsumersDown",
    "encode_entry",
    "decode_entry",
    "validate_arguments",
    "command_size",
    "entry_size",
]

MSG_ID_SHIFT = 16
MAX_COMMANDS_PER_ENTRY = 1 << MSG_ID_SHIFT
MAX_REJECTED_RANGES = 64
SNAPSHOT_VERSION = 2
_SNAPSHOT_VERSIONS = (1, 2)  # 1: bodies inline, rows of 5 or 6 fields

OVERFLOW_MODES = QUORUM_OVERFLOW


class BadCommand(ValueError):
    """A command (or entry, or snapshot) that is malformed; the text names what."""


#: a channel: (its front end's address, its number)
ChannelId = tuple[str, int]
#: a consumer: (its channel, its consumer tag)
ConsumerId = tuple[ChannelId, str]
#: what holds checked-out messages: a consumer, or ``(channel, None)`` for a channel's gets
HolderId = tuple[ChannelId, str | None]


# ---- validation helpers ---------------------------------------------------------------
def _is_int(x: Any) -> TypeGuard[int]:
    return type(x) is int


def _channel(value: Any, where: str) -> ChannelId:
    if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) and _is_int(value[1]):
        return (value[0], value[1])
    raise BadCommand(f"{where}: a channel id is a (dst: str, number: int) pair, got {value!r}")


def _consumer(value: Any, where: str) -> ConsumerId:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        tag = value[1]
        if isinstance(tag, str):
            return (_channel(value[0], where), tag)
    raise BadCommand(f"{where}: a consumer id is a (channel id, consumer_tag: str) pair, got {value!r}")


def _ids(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)) and all(_is_int(i) and i >= 0 for i in value):
        return tuple(value)
    raise BadCommand(f"{where}: message ids must be a sequence of non-negative ints, got {value!r}")


def _request_id(value: Any, where: str) -> Any:
    if value is None or _is_int(value):
        return value
    raise BadCommand(f"{where}: request_id must be an int or None, got {value!r}")


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise BadCommand(f"{where} must be a bool, got {value!r}")


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return value
    return value


def validate_arguments(arguments: Any) -> dict[str, Any]:
    """The queue arguments the machine acts on, checked (the rules:
    :func:`mirrorq.queues.semantics.quorum_arguments`); a copy."""
    try:
        return quorum_arguments(arguments)
    except InvalidArgument as e:
        raise BadCommand(str(e)) from None


# ---- commands -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Enqueue:
    publisher: ChannelId
    seq: int
    body: bytes
    properties: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "publisher", _channel(self.publisher, "enqueue.publisher"))
        if not _is_int(self.seq) or self.seq < 1:
            raise BadCommand(f"enqueue.seq must be an int >= 1, got {self.seq!r}")
        if not isinstance(self.body, bytes):
            raise BadCommand(f"enqueue.body must be bytes, got {type(self.body).__name__}")
        if not isinstance(self.properties, dict) or not all(isinstance(k, str) for k in self.properties):
            raise BadCommand(f"enqueue.properties must be a dict with str keys, got {self.properties!r}")
        try:
            parse_expiration(self.properties.get("expiration"))
        except AMQPError as e:
            raise BadCommand(f"enqueue.properties: {e.text}") from None

    def encode(self) -> list[Any]:
        return ["enqueue", list(self.publisher), self.seq, self.body, self.properties]


@dataclass(frozen=True, slots=True)
class Checkout:
    consumer: ConsumerId
    prefetch: int = 0
    no_ack: bool = False
    cancel: bool = False
    request_id: int | None = None
    lookahead: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "consumer", _consumer(self.consumer, "checkout.consumer"))
        if not _is_int(self.prefetch) or not 0 <= self.prefetch <= MAX_PREFETCH:
            raise BadCommand(f"checkout.prefetch must be an int in [0, {MAX_PREFETCH}], got {self.prefetch!r}")
        if not _is_int(self.lookahead) or not 0 <= self.lookahead <= MAX_PREFETCH:
            raise BadCommand(f"checkout.lookahead must be an int in [0, {MAX_PREFETCH}], got {self.lookahead!r}")
        _bool(self.no_ack, "checkout.no_ack")
        _bool(self.cancel, "checkout.cancel")
        _request_id(self.request_id, "checkout")

    def encode(self) -> list[Any]:
        ch, tag = self.consumer
        return ["checkout", [list(ch), tag], self.prefetch, self.no_ack, self.cancel, self.request_id, self.lookahead]


@dataclass(frozen=True, slots=True)
class Dequeue:
    channel: ChannelId
    request_id: int
    no_ack: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "channel", _channel(self.channel, "dequeue.channel"))
        if not _is_int(self.request_id):
            raise BadCommand(f"dequeue.request_id must be an int, got {self.request_id!r}")
        _bool(self.no_ack, "dequeue.no_ack")

    def encode(self) -> list[Any]:
        return ["dequeue", list(self.channel), self.request_id, self.no_ack]


@dataclass(frozen=True, slots=True)
class _Settlement:
    channel: ChannelId
    msg_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        name = _NAMES[type(self)]
        object.__setattr__(self, "channel", _channel(self.channel, f"{name}.channel"))
        object.__setattr__(self, "msg_ids", _ids(self.msg_ids, f"{name}.msg_ids"))

    def encode(self) -> list[Any]:
        return [_NAMES[type(self)], list(self.channel), list(self.msg_ids)]


class Settle(_Settlement):
    """Ack ``msg_ids`` held by ``channel``."""

    __slots__ = ()


class Return(_Settlement):
    """Requeue ``msg_ids`` held by ``channel`` (nack/reject, requeue=true)."""

    __slots__ = ()


class Release(_Settlement):
    """Give back ``msg_ids`` held by ``channel`` that its client never saw
    (requeued, delivery count unchanged)."""

    __slots__ = ()


class Discard(_Settlement):
    """Drop ``msg_ids`` held by ``channel`` (nack/reject, requeue=false)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Purge:
    channel: ChannelId | None = None
    request_id: int | None = None

    def __post_init__(self) -> None:
        if self.channel is not None:
            object.__setattr__(self, "channel", _channel(self.channel, "purge.channel"))
        _request_id(self.request_id, "purge")

    def encode(self) -> list[Any]:
        return ["purge", None if self.channel is None else list(self.channel), self.request_id]


@dataclass(frozen=True, slots=True)
class Down:
    channel: ChannelId | None = None  # None: every consumer (a leader change)

    def __post_init__(self) -> None:
        if self.channel is not None:
            object.__setattr__(self, "channel", _channel(self.channel, "down.channel"))

    def encode(self) -> list[Any]:
        return ["down", None if self.channel is None else list(self.channel)]


@dataclass(frozen=True, slots=True)
class Credit:
    """Link credit back: ``channel``'s front end wrote ``nbytes`` more of
    consumer ``tag``'s deliveries to its client, per ``(tag, nbytes)``."""

    channel: ChannelId
    grants: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "channel", _channel(self.channel, "credit.channel"))
        grants = self.grants
        if not isinstance(grants, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and len(g) == 2 and isinstance(g[0], str) and _is_int(g[1]) and g[1] >= 0
            for g in grants
        ):
            raise BadCommand(f"credit.grants must be (consumer_tag: str, nbytes: int >= 0) pairs, got {grants!r}")
        object.__setattr__(self, "grants", tuple((tag, n) for tag, n in grants))

    def encode(self) -> list[Any]:
        return ["credit", list(self.channel), [[tag, n] for tag, n in self.grants]]


Command = Enqueue | Checkout | Dequeue | Settle | Return | Release | Discard | Purge | Down | Credit

_NAMES: dict[type, str] = {
    Enqueue: "enqueue",
    Checkout: "checkout",
    Dequeue: "dequeue",
    Settle: "settle",
    Return: "return",
    Release: "release",
    Discard: "discard",
    Purge: "purge",
    Down: "down",
    Credit: "credit",
}
#: name -> (class, fields, fewest fields: entries written before a field was added)
_DECODERS: dict[str, tuple[type[Command], int, int]] = {
    "enqueue": (Enqueue, 4, 4),
    "checkout": (Checkout, 6, 5),
    "dequeue": (Dequeue, 3, 3),
    "settle": (Settle, 2, 2),
    "return": (Return, 2, 2),
    "release": (Release, 2, 2),
    "discard": (Discard, 2, 2),
    "purge": (Purge, 2, 2),
    "down": (Down, 1, 1),
    "credit": (Credit, 2, 2),
}


def decode_command(raw: Any) -> Command:
    """A command from its encoded (log) form."""
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise BadCommand(f"an encoded command is [name, fields...], got {raw!r}")
    spec = _DECODERS.get(raw[0])
    if spec is None:
        raise BadCommand(f"unknown command {raw[0]!r} (known: {', '.join(_DECODERS)})")
    cls, arity, fewest = spec
    if not fewest <= len(raw) - 1 <= arity:
        want = arity if fewest == arity else f"{fewest} to {arity}"
        raise BadCommand(f"command {raw[0]!r} takes {want} fields, got {len(raw) - 1}: {raw!r}")
    return cls(*raw[1:])


def encode_entry(now: float, commands: Sequence[Command]) -> list[Any]:
    """The Raft entry for ``commands`` proposed at ``now``."""
    if not isinstance(now, (int, float)) or isinstance(now, bool):
        raise BadCommand(f"an entry's time must be a number, got {now!r}")
    if len(commands) > MAX_COMMANDS_PER_ENTRY:
        raise BadCommand(f"an entry holds at most {MAX_COMMANDS_PER_ENTRY} commands, got {len(commands)}")
    out = []
    for c in commands:
        if type(c) not in _NAMES:
            raise BadCommand(f"not a quorum queue command: {c!r}")
        out.append(c.encode())
    return [float(now), out]


def command_size(c: Command) -> int:
    """A command's estimated size in an entry (:mod:`mirrorq.bounds`): an
    enqueue by its body and properties, a settlement by its ids."""
    if type(c) is Enqueue:
        return len(c.body) + props_size(c.properties) + ITEM_BYTES
    ids = getattr(c, "msg_ids", None) or getattr(c, "grants", None)
    return ITEM_BYTES + (SCALAR_BYTES * len(ids) if ids is not None else 0)


def entry_size(raw: Any) -> int:
    """An encoded entry's estimated size (``[now, [command, ...]]`` as
    :func:`encode_entry` makes it): enqueues by their bodies and
    properties, settlements by their ids.  Anything else by
    :func:`~mirrorq.bounds.plain_size`."""
    if type(raw) is not list or len(raw) != 2 or type(raw[1]) is not list:
        return plain_size(raw)
    n = ITEM_BYTES
    for c in raw[1]:
        n += ITEM_BYTES
        if c[0] == "enqueue":
            n += len(c[3]) + props_size(c[4])
        elif len(c) == 3 and type(c[2]) is list:
            n += SCALAR_BYTES * len(c[2])
    return n


def decode_entry(raw: Any) -> tuple[float, list[Command]]:
    """``(now, commands)`` of an encoded entry."""
    if not isinstance(raw, (list, tuple)) or len(raw) != 2 or not isinstance(raw[1], (list, tuple)):
        raise BadCommand(f"an encoded entry is [now, [commands]], got {raw!r}")
    now = raw[0]
    if not isinstance(now, (int, float)) or isinstance(now, bool):
        raise BadCommand(f"an entry's time must be a number, got {now!r}")
    return float(now), [decode_command(c) for c in raw[1]]


# ---- effects --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Message:
    msg_id: int
    body: bytes | None  # None: in the log (see *Bodies*)
    properties: dict[str, Any] | None  # None: in the log
    delivery_count: int  # returns before this delivery (x-delivery-count)
    acquired: bool = False  # checked out before and released unseen (RabbitMQ 4's acquired count > 0)

    @property
    def redelivered(self) -> bool:
        """AMQP's flag: it may have been delivered before, so it may come
        out of order (a released message was not seen, but others may have
        overtaken it)."""
        return self.delivery_count > 0 or self.acquired


@dataclass(frozen=True, slots=True)
class Deliver:
    """``message`` is checked out to ``consumer`` (settled already if the
    consumer is ``no_ack``)."""

    consumer: HolderId
    message: Message
    settled: bool = False


@dataclass(frozen=True, slots=True)
class GetResult:
    channel: ChannelId
    request_id: int
    message: Message | None  # None: the queue had no ready message
    remaining: int  # ready messages after this one
    settled: bool = False


@dataclass(frozen=True, slots=True)
class Confirm:
    publisher: ChannelId
    seq: int


@dataclass(frozen=True, slots=True)
class Reject:
    publisher: ChannelId
    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """Messages removed without an ack: reason ``rejected`` (discard),
    ``delivery_limit``, ``expired``, ``maxlen`` or ``purged``.  ``seqs``:
    each message's dead-letter sequence number (1, 2, 3... per queue, in
    the order the machine drops them, the same on every member) for every
    reason but ``purged``, which RabbitMQ does not dead-letter."""

    reason: str
    messages: tuple[Message, ...]
    seqs: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Settled:
    channel: ChannelId
    msg_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CheckoutOk:
    consumer: ConsumerId
    request_id: int | None


@dataclass(frozen=True, slots=True)
class CheckoutRefused:
    consumer: ConsumerId
    request_id: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class Purged:
    channel: ChannelId | None
    request_id: int | None
    count: int


@dataclass(frozen=True, slots=True)
class ConsumersDown:
    channel: ChannelId | None  # None: every channel (a leader change)
    consumers: tuple[HolderId, ...]  # consumer ids removed (a get holder is (channel, None))


Effect = (
    Deliver | GetResult | Confirm | Reject | Dropped | Settled | CheckoutOk | CheckoutRefused | Purged | ConsumersDown
)


# ---- state ----------------------------------------------------------------------------
class _Msg:
    __slots__ = ("id", "body", "props", "size", "count", "deadline", "acquired")

    def __init__(
        self,
        mid: int,
        body: bytes | None,
        props: dict[str, Any] | None,
        count: int,
        deadline: float | None,
        acquired: bool = False,
        size: int | None = None,
    ) -> None:
        self.id = mid
        self.body = body  # None: in the log entry that enqueued it (see *Bodies*)
        self.props = props
        if size is None:
            assert body is not None, "a message kept in the log is built with its size"
            size = len(body)
        self.size = size
        self.count = count
        self.deadline = deadline
        self.acquired = acquired

    def public(self) -> Message:
        return Message(self.id, self.body, self.props, self.count, self.acquired)


class _Consumer:
    __slots__ = ("cid", "prefetch", "no_ack", "active", "held", "held_bytes", "lookahead", "link_bytes")

    def __init__(self, cid: HolderId, prefetch: int, no_ack: bool, active: bool, lookahead: int = 0) -> None:
        self.cid = cid
        self.prefetch = prefetch
        self.no_ack = no_ack
        self.active = active
        self.held: dict[int, None] = {}  # msg ids checked out, in checkout order
        self.held_bytes = 0  # their bodies' bytes
        self.lookahead = lookahead if prefetch and not no_ack else 0
        self.link_bytes = 0  # delivered and not credited back (LINK_CREDIT_BYTES)

    @property
    def limited(self) -> bool:
        return not self.no_ack and self.prefetch > 0

    def has_credit(self, granted: bool = False) -> bool:
        if self.link_bytes >= LINK_CREDIT_BYTES:
            return False
        if not self.limited:
            return True
        n = len(self.held)
        return n < self.prefetch or (
            granted and n < self.prefetch + self.lookahead and self.held_bytes < LOOKAHEAD_BYTES
        )


class _Publisher:
    __slots__ = ("hwm", "rejected")

    def __init__(self, hwm: int = 0, rejected: list[list[int]] | None = None) -> None:
        self.hwm = hwm
        self.rejected: list[list[int]] = rejected if rejected is not None else []  # [lo, hi] runs

    def was_rejected(self, seq: int) -> bool:
        return any(lo <= seq <= hi for lo, hi in self.rejected)

    def reject(self, seq: int) -> None:
        if self.rejected and self.rejected[-1][1] == seq - 1:
            self.rejected[-1][1] = seq
        else:
            self.rejected.append([seq, seq])
            if len(self.rejected) > MAX_REJECTED_RANGES:
                del self.rejected[0]


class QuorumQueueMachine:
    """One quorum queue's state (see the module docstring)."""

    def __init__(self, arguments: dict[str, Any] | None = None, bodies_in_log: bool = False) -> None:
        self._configure(validate_arguments(arguments))
        self.bodies_in_log = bodies_in_log
        self.index = 0  # last Raft index applied
        self.clock: float | None = None
        self.messages: dict[int, _Msg] = {}
        self.returns: deque[int] = deque()
        self.ready: deque[int] = deque()  # never delivered, by id
        self.ready_bytes = 0
        self.consumers: dict[HolderId, _Consumer] = {}  # attach order
        self.rotation: deque[HolderId] = deque()  # active consumers, round-robin order
        self.holder: dict[int, HolderId] = {}  # msg id -> consumer id
        self.publishers: dict[ChannelId, _Publisher] = {}
        self.closed: set[ChannelId] = set()
        self.dead_lettered = 0  # dead-letter sequence numbers given so far (Dropped.seqs)

    def _configure(self, args: dict[str, Any]) -> None:
        self.arguments = args
        self.max_length = args.get("x-max-length")
        self.max_bytes = args.get("x-max-length-bytes")
        self.overflow = args.get("x-overflow", "drop-head")
        self.ttl_ms = args.get("x-message-ttl")
        self.delivery_limit = args.get("x-delivery-limit")

    # ---- queries ----------------------------------------------------------------------
    @property
    def ready_count(self) -> int:
        return len(self.returns) + len(self.ready)

    @property
    def checked_out_count(self) -> int:
        return len(self.holder)

    @property
    def message_count(self) -> int:
        return len(self.messages)

    def hwm(self, publisher: ChannelId) -> int:
        p = self.publishers.get(publisher)
        return p.hwm if p is not None else 0

    def next_deadline(self) -> float | None:
        """The head's deadline: when an entry must be applied for it to expire."""
        head = self._head()
        return None if head is None else self.messages[head].deadline

    def release_index(self) -> int:
        """The lowest Raft index whose entry a live message's body is still
        in (``index + 1`` if none is): the log below it may go."""
        for mid, m in self.messages.items():  # in id order: enqueued so, restored sorted
            if m.body is None:
                return mid >> MSG_ID_SHIFT
        return self.index + 1

    def channels(self) -> set[ChannelId]:
        """Channels with consumers or checked-out messages."""
        return {cid[0] for cid in self.consumers}

    # ---- applying ---------------------------------------------------------------------
    def apply_entry(self, index: int, raw: Any) -> list[Effect]:
        now, commands = decode_entry(raw)
        return self.apply(index, now, commands)

    def apply(self, index: int, now: float, commands: Iterable[Command]) -> list[Effect]:
        """Apply the commands of the entry at Raft ``index``, proposed at ``now``."""
        if not _is_int(index) or index <= self.index:
            raise ValueError(f"apply: index {index!r} must be an int above the last applied index {self.index}")
        if not isinstance(now, (int, float)) or isinstance(now, bool):
            raise BadCommand(f"apply: now must be a number, got {now!r}")
        commands = list(commands)
        if len(commands) > MAX_COMMANDS_PER_ENTRY:
            raise BadCommand(f"an entry holds at most {MAX_COMMANDS_PER_ENTRY} commands, got {len(commands)}")
        for c in commands:
            if type(c) not in _HANDLERS:
                raise BadCommand(f"not a quorum queue command: {c!r}")
        self.index = index
        if self.clock is None or now > self.clock:
            self.clock = float(now)
        now = self.clock
        out: list[Effect] = []
        self._expire(now, out)
        base = index << MSG_ID_SHIFT
        for k, c in enumerate(commands):
            _HANDLERS[type(c)](self, base | k, now, c, out)
            self._service(now, out)
            self._expire(now, out)
            self._enforce_limits(out)
        return out

    def _enqueue(self, mid: int, now: float, c: Enqueue, out: list[Effect]) -> None:
        p = self.publishers.get(c.publisher)
        if p is None:
            p = self.publishers[c.publisher] = _Publisher()
        if c.seq <= p.hwm:
            if p.was_rejected(c.seq):
                out.append(Reject(c.publisher, c.seq, "x-overflow reject-publish: queue is full"))
            else:
                out.append(Confirm(c.publisher, c.seq))
            return
        if c.seq != p.hwm + 1:
            out.append(Reject(c.publisher, c.seq, f"out-of-sequence: expected seq {p.hwm + 1}"))
            return
        p.hwm = c.seq
        size = len(c.body)
        if self.overflow == "reject-publish" and (
            (self.max_length is not None and self.ready_count + 1 > self.max_length)
            or (self.max_bytes is not None and self.ready_bytes + size > self.max_bytes)
        ):
            p.reject(c.seq)
            out.append(Reject(c.publisher, c.seq, "x-overflow reject-publish: queue is full"))
            return
        deadline = None
        ttl = self.ttl_ms
        exp = parse_expiration(c.properties.get("expiration"))
        if exp is not None:
            ttl = exp if ttl is None else min(ttl, exp)
        if ttl is not None:
            deadline = now + ttl / 1000.0
        if self.bodies_in_log:
            self.messages[mid] = _Msg(mid, None, None, 0, deadline, size=size)
        else:
            self.messages[mid] = _Msg(mid, c.body, c.properties, 0, deadline)
        self.ready.append(mid)
        self.ready_bytes += size
        out.append(Confirm(c.publisher, c.seq))

    def _checkout(self, mid: int, now: float, c: Checkout, out: list[Effect]) -> None:
        cid = c.consumer
        con = self.consumers.get(cid)
        if c.cancel:
            if con is not None and con.active:
                con.active = False
                self.rotation.remove(cid)
                if not con.held:
                    del self.consumers[cid]
            return
        if cid[0] in self.closed:
            out.append(CheckoutRefused(cid, c.request_id, "channel closed"))
            return
        if con is None:
            con = self.consumers[cid] = _Consumer(cid, c.prefetch, c.no_ack, True, c.lookahead)
            self.rotation.append(cid)
        else:
            con.prefetch, con.no_ack = c.prefetch, c.no_ack
            con.lookahead = c.lookahead if con.limited else 0
            if not con.active:
                con.active = True
                self.rotation.append(cid)
        out.append(CheckoutOk(cid, c.request_id))

    def _dequeue(self, mid: int, now: float, c: Dequeue, out: list[Effect]) -> None:
        head = self._take_head(now, out) if c.channel not in self.closed else None
        if head is None:
            out.append(GetResult(c.channel, c.request_id, None, 0))
            return
        m = self.messages[head]
        if c.no_ack:
            self._remove(head)
        else:
            cid = (c.channel, None)
            con = self.consumers.get(cid)
            if con is None:
                con = self.consumers[cid] = _Consumer(cid, 0, False, False)
            con.held[head] = None
            con.held_bytes += m.size
            self.holder[head] = cid
        out.append(GetResult(c.channel, c.request_id, m.public(), self.ready_count, c.no_ack))

    def _held_by(self, channel: ChannelId, ids: tuple[int, ...]) -> list[int]:
        seen: set[int] = set()
        held = []
        for i in ids:
            cid = self.holder.get(i)
            if cid is not None and cid[0] == channel and i not in seen:
                seen.add(i)
                held.append(i)
        return held

    def _settle(self, mid: int, now: float, c: Settle, out: list[Effect]) -> None:
        done = self._held_by(c.channel, c.msg_ids)
        for i in done:
            self._release(i)
            self._remove(i)
        if done:
            out.append(Settled(c.channel, tuple(done)))

    def _return(self, mid: int, now: float, c: Return, out: list[Effect]) -> None:
        for i in self._held_by(c.channel, c.msg_ids):
            self._release(i)
            self._requeue(i, out)

    def _give_back(self, mid: int, now: float, c: Release, out: list[Effect]) -> None:
        for i in self._held_by(c.channel, c.msg_ids):
            self._release(i)
            self._requeue(i, out, counted=False)

    def _discard(self, mid: int, now: float, c: Discard, out: list[Effect]) -> None:
        done = self._held_by(c.channel, c.msg_ids)
        msgs: list[Message] = []
        for i in done:
            self._release(i)
            msgs.append(self.messages[i].public())
            self._remove(i)
        if msgs:
            out.append(self._dropped("rejected", msgs))

    def _purge(self, mid: int, now: float, c: Purge, out: list[Effect]) -> None:
        gone = list(self.returns) + list(self.ready)
        msgs = tuple(self.messages[i].public() for i in gone)
        for i in gone:
            del self.messages[i]
        self.returns.clear()
        self.ready.clear()
        self.ready_bytes = 0
        if msgs:
            out.append(Dropped("purged", msgs))
        out.append(Purged(c.channel, c.request_id, len(msgs)))

    def _credit(self, mid: int, now: float, c: Credit, out: list[Effect]) -> None:
        for tag, n in c.grants:
            con = self.consumers.get((c.channel, tag))
            if con is not None:
                con.link_bytes = max(0, con.link_bytes - n)

    def _down(self, mid: int, now: float, c: Down, out: list[Effect]) -> None:
        if c.channel is None:
            gone = list(self.consumers)
        else:
            self.closed.add(c.channel)
            gone = [cid for cid in self.consumers if cid[0] == c.channel]
        for cid in gone:
            con = self.consumers.pop(cid)
            if con.active:
                self.rotation.remove(cid)
            for i in sorted(con.held):
                del self.holder[i]
                self._requeue(i, out)
        out.append(ConsumersDown(c.channel, tuple(gone)))

    # ---- internals ----------------------------------------------------------------------
    def _head(self) -> int | None:
        if self.returns:
            return self.returns[0]
        if self.ready:
            return self.ready[0]
        return None

    def _pop_head(self) -> int:
        if self.returns:
            i = self.returns.popleft()
        else:
            i = self.ready.popleft()
        self.ready_bytes -= self.messages[i].size
        return i

    def _take_head(self, now: float, out: list[Effect]) -> int | None:
        """The next ready message that may still be delivered at ``now``
        (dropping those past their deadline on the way); None if none."""
        expired: list[Message] = []
        found = None
        while self.returns or self.ready:
            i = self._pop_head()
            d = self.messages[i].deadline
            if d is not None and d < now:
                expired.append(self.messages.pop(i).public())
                continue
            found = i
            break
        if expired:
            out.append(self._dropped("expired", expired))
        return found

    def _lookahead_granted(self) -> bool:
        """Whether consumers may take their lookahead now: every active
        consumer with a prefetch is at it and the ready backlog covers every
        such consumer's lookahead (see *Lookahead*)."""
        wanted = 0
        for cid in self.rotation:
            con = self.consumers[cid]
            if con.limited:
                if len(con.held) < con.prefetch:
                    return False
                wanted += con.lookahead
        return wanted > 0 and self.ready_count >= wanted

    def _service(self, now: float, out: list[Effect]) -> None:
        rot = self.rotation
        while rot and (self.returns or self.ready):
            granted = self._lookahead_granted()
            for _ in range(len(rot)):
                cid = rot[0]
                rot.rotate(-1)
                con = self.consumers[cid]
                if con.has_credit(granted):
                    break
            else:
                return  # no consumer has credit
            i = self._take_head(now, out)
            if i is None:
                return
            m = self.messages[i]
            con.link_bytes += m.size
            if con.no_ack:
                self._remove(i)
                out.append(Deliver(cid, m.public(), True))
            else:
                con.held[i] = None
                con.held_bytes += m.size
                self.holder[i] = cid
                out.append(Deliver(cid, m.public()))

    def _expire(self, now: float, out: list[Effect]) -> None:
        expired: list[Message] = []
        while True:
            head = self._head()
            if head is None:
                break
            d = self.messages[head].deadline
            if d is None or d > now:
                break
            self._pop_head()
            expired.append(self.messages.pop(head).public())
        if expired:
            out.append(self._dropped("expired", expired))

    def _enforce_limits(self, out: list[Effect]) -> None:
        if self.overflow != "drop-head" or (self.max_length is None and self.max_bytes is None):
            return
        dropped: list[Message] = []
        while self.ready_count and (
            (self.max_length is not None and self.ready_count > self.max_length)
            or (self.max_bytes is not None and self.ready_bytes > self.max_bytes)
        ):
            i = self._pop_head()
            dropped.append(self.messages.pop(i).public())
        if dropped:
            out.append(self._dropped("maxlen", dropped))

    def _dropped(self, reason: str, messages: list[Message]) -> Dropped:
        first = self.dead_lettered + 1
        self.dead_lettered += len(messages)
        return Dropped(reason, tuple(messages), tuple(range(first, self.dead_lettered + 1)))

    def _release(self, i: int) -> None:
        """``i`` is no longer checked out (its holder forgets it)."""
        cid = self.holder.pop(i)
        con = self.consumers[cid]
        del con.held[i]
        con.held_bytes -= self.messages[i].size
        if not con.active and not con.held:
            del self.consumers[cid]

    def _remove(self, i: int) -> None:
        del self.messages[i]

    def _requeue(self, i: int, out: list[Effect], counted: bool = True) -> None:
        m = self.messages[i]
        if counted:
            m.count += 1
        else:
            m.acquired = True
        if self.delivery_limit is not None and m.count > self.delivery_limit:
            del self.messages[i]
            out.append(self._dropped("delivery_limit", [m.public()]))
            return
        self.returns.append(i)
        self.ready_bytes += m.size

    # ---- snapshots ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The whole state as plain (msgpack-able) data."""
        return {
            "version": SNAPSHOT_VERSION,
            "arguments": dict(self.arguments),
            "index": self.index,
            "clock": self.clock,
            "bodies_in_log": self.bodies_in_log,
            "messages": [
                [m.id, m.body, m.props, m.count, m.deadline, m.acquired, m.size]
                for _, m in sorted(self.messages.items())
            ],
            "returns": list(self.returns),
            "ready": list(self.ready),
            "consumers": [
                [list(c.cid[0]), c.cid[1], c.prefetch, c.no_ack, c.active, list(c.held), c.lookahead, c.link_bytes]
                for c in self.consumers.values()
            ],
            "rotation": [[list(ch), tag] for ch, tag in self.rotation],
            "publishers": [[list(ch), p.hwm, [list(r) for r in p.rejected]] for ch, p in self.publishers.items()],
            "closed": [list(ch) for ch in sorted(self.closed)],
            "dead_lettered": self.dead_lettered,
        }

    def restore(self, data: Any) -> None:
        """Replace the whole state with a :meth:`snapshot`'s (tuples may have
        become lists on the way, as msgpack does)."""
        if not isinstance(data, dict) or data.get("version") not in _SNAPSHOT_VERSIONS:
            raise BadCommand(f"not a quorum queue snapshot (versions {_SNAPSHOT_VERSIONS}): {str(data)[:200]}")
        try:
            fresh = QuorumQueueMachine(data["arguments"], self.bodies_in_log)
            index, clock = data["index"], data["clock"]
            if not _is_int(index) or index < 0 or not (clock is None or isinstance(clock, (int, float))):
                raise BadCommand(f"bad index {index!r} or clock {clock!r}")
            fresh.index, fresh.clock = index, clock
            for row in data["messages"]:
                mid, body, props, count, deadline = row[:5]
                acquired = bool(row[5]) if len(row) > 5 else False  # rows written before it have 5 fields
                size = row[6] if len(row) > 6 else None
                if body is None and (not _is_int(size) or size < 0 or not _is_int(mid) or mid >> MSG_ID_SHIFT < 1):
                    raise BadCommand(f"message {mid!r} kept in the log needs its size and entry, got {row!r}")
                fresh.messages[mid] = _Msg(mid, body, props, count, deadline, acquired, size)
            fresh.returns = deque(data["returns"])
            fresh.ready = deque(data["ready"])
            fresh.ready_bytes = sum(fresh.messages[i].size for i in fresh.returns) + sum(
                fresh.messages[i].size for i in fresh.ready
            )
            for row in data["consumers"]:
                ch, tag, prefetch, no_ack, active, held = row[:6]
                lookahead = row[6] if len(row) > 6 else 0  # rows written before lookahead have 6 fields
                cid = (_channel(ch, "snapshot consumer"), tag)
                con = fresh.consumers[cid] = _Consumer(cid, prefetch, no_ack, active, lookahead)
                con.link_bytes = row[7] if len(row) > 7 else 0  # rows of version 1 have none
                for i in held:
                    if i not in fresh.messages or i in fresh.holder:
                        raise BadCommand(f"consumer {cid!r} holds message {i!r}, unknown or held twice")
                    con.held[i] = None
                    con.held_bytes += fresh.messages[i].size
                    fresh.holder[i] = cid
            fresh.rotation = deque((_channel(ch, "snapshot rotation"), tag) for ch, tag in data["rotation"])
            for ch, hwm, rejected in data["publishers"]:
                fresh.publishers[_channel(ch, "snapshot publisher")] = _Publisher(hwm, [list(r) for r in rejected])
            fresh.closed = {_channel(ch, "snapshot closed channel") for ch in data["closed"]}
            fresh.dead_lettered = data.get("dead_lettered", 0)  # snapshots older than it have none
            if not _is_int(fresh.dead_lettered) or fresh.dead_lettered < 0:
                raise BadCommand(f"bad dead_lettered {fresh.dead_lettered!r}")
        except BadCommand:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise BadCommand(f"malformed quorum queue snapshot: {type(e).__name__}: {e}") from None
        live = set(fresh.returns) | set(fresh.ready) | set(fresh.holder)
        if live != set(fresh.messages) or len(fresh.returns) + len(fresh.ready) + len(fresh.holder) != len(live):
            raise BadCommand(
                "malformed quorum queue snapshot: ready, returned and checked-out messages "
                "do not partition the messages"
            )
        if set(fresh.rotation) != {cid for cid, c in fresh.consumers.items() if c.active}:
            raise BadCommand("malformed quorum queue snapshot: the rotation is not the active consumers")
        self.__dict__.update(fresh.__dict__)


#: each handler takes the command class it is keyed by
_HANDLERS: dict[type, Callable[[QuorumQueueMachine, int, float, Any, list[Effect]], None]] = {
    Enqueue: QuorumQueueMachine._enqueue,
    Checkout: QuorumQueueMachine._checkout,
    Dequeue: QuorumQueueMachine._dequeue,
    Settle: QuorumQueueMachine._settle,
    Return: QuorumQueueMachine._return,
    Release: QuorumQueueMachine._give_back,
    Discard: QuorumQueueMachine._discard,
    Purge: QuorumQueueMachine._purge,
    Down: QuorumQueueMachine._down,
    Credit: QuorumQueueMachine._credit,
}
