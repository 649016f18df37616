"""amqqueue: the master-side semantics of one classic queue, sans-IO.

:class:`AMQQueue` is what RabbitMQ's ``rabbit_amqqueue_process`` is to a
classic queue: the consumer table, round-robin delivery with per-consumer
prefetch, ``basic.get``, ack / reject / nack / recover, purge, delete,
message TTL, length limits and exclusive / auto-delete / expiring queues.  It
keeps no messages of its own: every message and every state change lives in
the :class:`~mirrorq.classic.backing_queue.BackingQueue` ``bq`` it is
given (a log of PUBLISH / DELIVER / ACK / REQUEUE / PURGE records); the queue
only decides *which* operation to write and *who* gets what.  A mirror layer
replicates ``bq``'s log and, through :attr:`AMQQueue.consumers`, the
consumer table; on failover the mirror that takes over builds an
``AMQQueue`` on its own replica and calls :meth:`AMQQueue.promote`.

Driving it
----------
Every entry point takes ``now`` (seconds, float, from the caller) and returns
a list of :mod:`mirrorq.sansio` actions: ``Emit(event)`` for what the world
must hear (deliveries, replies, cancellations, deletion), ``SetTimer`` /
``CancelTimer`` for the message-TTL timer (key :data:`TTL_TIMER`) and the
queue-expiry timer (key :data:`EXPIRES_TIMER`); the driver calls
:meth:`AMQQueue.timer` when one fires.  :meth:`AMQQueue.purge` and
:meth:`AMQQueue.delete` return ``(count, actions)``.  Replies go to a
*channel*, an opaque hashable id; the front end maps channels to
connections and owns delivery tags (RabbitMQ assigns them in the channel
too): the queue names messages by their ``bq`` offset, and acks name them
the same way.  ``connection_of(channel)`` (constructor argument) tells which
connection a channel belongs to, for exclusive queues; by default a tuple
channel id ``(connection, number)`` belongs to its first element, any other
channel id is its own connection.

The queue never flushes ``bq``: the owner calls ``bq.flush()`` once per
incoming actor message (group commit), before it confirms anything.
Batching is kept through to the log: :meth:`AMQQueue.publish_many` takes
one incoming batch, and consecutive deliveries of one step share one
DELIVER record.

Events (frozen dataclasses, below): :class:`PublishAccepted`,
:class:`PublishRejected`, :class:`Deliver`, :class:`GetOk`,
:class:`GetEmpty`, :class:`ConsumeOk`, :class:`CancelOk`,
:class:`ConsumerCancelled`, :class:`MessagesDropped`, :class:`QueueDeleted`.

Semantics (RabbitMQ's classic queue)
------------------------------------
* FIFO: ready messages are delivered in publish-offset order; a requeued
  message (reject/nack/recover with requeue, its channel closing, promotion)
  goes back to its original position and is delivered with
  ``redelivered=True``.  ``redelivered`` is true exactly when the message
  was delivered before (by ``bq``'s DELIVER records, so it survives restarts
  and failover).
* Consumers are served round-robin; among consumers with credit the highest
  ``x-priority`` (default 0) wins, round-robin within a priority.  A consumer
  with ``prefetch > 0`` and ``no_ack=False`` never holds more than
  ``prefetch`` unacked deliveries (``basic.qos`` with ``global=false``, per
  consumer); its credit comes back on ack, reject, nack, recover and when
  messages are requeued.  Channel-wide (``global=true``) prefetch is the
  channel's business.  ``basic.get`` ignores prefetch.  Whatever its
  prefetch (none, or no-ack), a consumer is sent at most
  :data:`LINK_CREDIT_BYTES` of bodies (and one message more) that its
  front end has not given back with :meth:`AMQQueue.link_credit` (it does
  once it wrote them to the client): a client that stops reading stops
  its deliveries, instead of filling a buffer on the way.
* A message is at any time in exactly one of: ready, unacked by exactly one
  channel (delivered with ack required; the consumer may since have been
  cancelled -- the channel can still ack it), gone.  Acks, rejects and nacks
  name offsets; an offset that is not unacked *by that channel* is ignored
  (RabbitMQ does the same: after a failover requeued every unacked message,
  a late ack from the old delivery must not ack the new one).  Mapping
  delivery tags to offsets, and refusing unknown tags with 406, is the
  channel's job.
* ``x-message-ttl`` (queue) and the ``expiration`` property (per message,
  milliseconds as a decimal string) give a message a deadline: publish time
  + the smaller of the two.  As in RabbitMQ's classic queues, expiry happens
  at the head only: a message is discarded (DELIVER without ack, event
  :class:`MessagesDropped` reason ``"expired"``) when it is, or reaches, the
  head of the queue after its deadline -- on any operation or when the TTL
  timer, always set for the head's deadline, fires.  Unacked messages never
  expire; a requeued message keeps its deadline.  A message published with
  TTL 0 is delivered if a consumer can take it at once, else discarded.
  The deadline is stored with the message, in its properties under
  :data:`EXPIRES_AT_KEY` (an absolute time on the caller's clock, so mirrors
  and restarts know it), and removed from the properties handed out in
  events.  TTLs therefore assume the drivers of all replicas pass
  comparable clocks (wall-clock seconds): a new master whose clock is ahead
  expires messages early, one behind expires them late.
* ``x-max-length`` / ``x-max-length-bytes`` count *ready* messages and their
  body bytes, as RabbitMQ does.  ``x-overflow=drop-head`` (default): a
  publish is first offered to consumers, then the oldest ready messages are
  discarded until the queue is within its limits (event
  :class:`MessagesDropped` reason ``"maxlen"``); after a requeue the limit is
  applied before delivering.  ``reject-publish``: a publish that would take
  the ready count or bytes over a limit is refused before it is offered to
  anyone (event :class:`PublishRejected`; the channel nacks it if it is in
  confirm mode, and the master remembers the refusal, so a resend of it
  after a failover is nacked again: :mod:`.coordinator`); the limit is checked message by message, so earlier
  messages of a batch that went straight to a consumer do not count.
  ``reject-publish-dlx``: the same, and the refused message is
  dead-lettered (reason ``"maxlen"``) when the queue has a dead-letter
  exchange: it is written PUBLISH, DELIVER (that offset alone) and
  DEAD_LETTER, so it is replicated and handed out in :class:`DeadLettered`
  like any other dead letter, and never counts as ready or unacked (without
  a dead-letter exchange nothing is written, as with ``reject-publish``).
  Accepted publishes get :class:`PublishAccepted` with their offset, even
  if they are dropped or expire at once (RabbitMQ confirms those too).
* Exclusive queue (``exclusive_owner`` = a connection id): ``consume``,
  ``get``, ``purge``, ``delete`` and :meth:`AMQQueue.check_access` from
  another connection raise :class:`ResourceLocked` (405); publishing to it is
  allowed from anywhere (as in RabbitMQ).  :meth:`AMQQueue.owner_down`
  deletes it.  An exclusive *consumer* makes ``consume`` from anyone else
  raise :class:`AccessRefused` (403), and it cannot be added beside others.
* ``auto_delete``: the queue is deleted when its last consumer goes
  (``cancel`` or ``channel_down``) after it has had at least one.  Consumers
  cancelled by the queue itself at failover (``x-cancel-on-ha-failover``) do
  not trigger it: the client is told to re-consume, so the queue must stay.
* Dead-lettering (``x-dead-letter-exchange`` and ``x-dead-letter-routing-key``
  by argument, or :attr:`AMQQueue.policy_dead_letter` set from a policy;
  an argument wins, as in RabbitMQ): a message rejected or nacked without
  requeue (reason ``"rejected"``), expired at the head (``"expired"``) or
  dropped by ``x-overflow=drop-head`` or refused by ``reject-publish-dlx``
  (``"maxlen"``) is not discarded but
  written ``DEAD_LETTER`` (see :mod:`.backing_queue`) and handed out in
  :class:`DeadLettered` with its dead-letter sequence number; it stays
  there, counted nowhere, until :meth:`AMQQueue.dead_lettered` says its
  exchange has it (an ACK).  Routing it, the ``x-death`` header and
  cycles are the dead-lettering router's business
  (:mod:`mirrorq.amqp.dead_letter`).  Without a dead-letter exchange such
  messages are discarded (:class:`MessagesDropped`).
* ``x-expires``: the queue is deleted once it has had no consumer and no
  ``basic.get`` / redeclare (:meth:`AMQQueue.touch`) for that long.
* ``delete`` sends :class:`ConsumerCancelled` (reason ``"queue-deleted"``)
  to every consumer, then :class:`QueueDeleted`; every later call raises
  :class:`NotFound`.  The store itself is the owner's to remove.
* Promotion (:meth:`AMQQueue.promote`): every unacked message in ``bq`` --
  the old master's deliveries, whoever they went to -- is requeued (so it is
  redelivered with ``redelivered=True``); consumers whose arguments say
  ``x-cancel-on-ha-failover: true`` get :class:`ConsumerCancelled` (reason
  ``"ha-failover"``) and are dropped; then the remaining consumers are
  served.  A durable queue restarted from disk is recovered the same way
  (the owner calls ``bq.drop_transient()`` first after a full restart).

Assumptions
-----------
* One owner drives the queue (one actor); not thread-safe.
* The queue is the only writer of ``bq`` while it exists.  Unacked messages
  already in ``bq`` when the queue is built belong to no channel until
  :meth:`AMQQueue.promote` requeues them.
* Building an ``AMQQueue`` reads every live message once (body sizes for the
  byte counters, deadlines); that is the cost of a promotion.

Failure
-------
Malformed arguments raise ``TypeError`` or an :class:`AMQPError` subclass
carrying the AMQP reply code and a text naming what was wrong:
:class:`PreconditionFailed` (406: bad x-argument, bad expiration, delete
``if_unused`` / ``if_empty``), :class:`ResourceLocked` (405),
:class:`AccessRefused` (403), :class:`NotFound` (404: the queue was
deleted), :class:`NotAllowed` (530: a reused consumer tag),
:class:`NotImplementedFeature` (540: ``basic.recover`` with
``requeue=false``).  A refused call changes nothing: batches are validated
whole before anything is written.  Store errors from ``bq`` propagate; the
owner must then rebuild the queue from a reopened store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mirrorq.classic.backing_queue import BackingQueue, Message, UnknownMessage
from mirrorq.queues.semantics import (
    LINK_CREDIT_BYTES,
    LOOKAHEAD_BYTES,
    MAX_PREFETCH,
    AccessRefused,
    NotAllowed,
    NotFound,
    NotImplementedFeature,
    PreconditionFailed,
    ResourceLocked,
    is_int,
    parse_expiration,
    validate_consumer_arguments,
    validate_queue_arguments,
)
from mirrorq.sansio import Action, CancelTimer, Emit, SetTimer

__all__ = [
    "AMQQueue",
    "CancelOk",
    "ConsumeOk",
    "Consumer",
    "ConsumerCancelled",
    "Deliver",
    "EXPIRES_AT_KEY",
    "EXPIRES_TIMER",
    "GetEmpty",
    "GetOk",
    "MessagesDropped",
    "DeadLettered",
    "Publish",
    "PublishAccepted",
    "PublishRejected",
    "QueueDeleted",
    "TTL_TIMER",
]

EXPIRES_AT_KEY = "x-mirrorq-expires-at"
"""Properties key under which a message's absolute deadline (seconds) is stored."""

TTL_TIMER = "amqqueue.message-ttl"
EXPIRES_TIMER = "amqqueue.expires"

_CHUNK = 512  # messages read per step when delivering / dropping
_TIMER_SLACK = 1e-6  # a timer set for a deadline fires just after it
STREAM_LEASE = 30.0  # s: a range reader's claim on the queue after each read or commit

# ------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class PublishAccepted:
    """The publish is in the queue at ``offset`` (confirmable once replicated)."""

    channel: Hashable
    publish_id: Any
    offset: int


@dataclass(frozen=True, slots=True)
class PublishRejected:
    """``x-overflow=reject-publish`` or ``reject-publish-dlx`` refused the
    publish: it is not in the queue (with ``reject-publish-dlx`` and a
    dead-letter exchange a :class:`DeadLettered` for it follows)."""

    channel: Hashable
    publish_id: Any
    reason: str


@dataclass(frozen=True, slots=True)
class Deliver:
    """``basic.deliver`` to a consumer; ``message.properties`` as published."""

    channel: Hashable
    consumer_tag: str
    offset: int
    message: Message
    redelivered: bool
    ack_required: bool


@dataclass(frozen=True, slots=True)
class GetOk:
    channel: Hashable
    request_id: Any
    offset: int
    message: Message
    redelivered: bool
    message_count: int  # ready messages left
    ack_required: bool


@dataclass(frozen=True, slots=True)
class GetEmpty:
    channel: Hashable
    request_id: Any


@dataclass(frozen=True, slots=True)
class ConsumeOk:
    channel: Hashable
    consumer_tag: str


@dataclass(frozen=True, slots=True)
class CancelOk:
    channel: Hashable
    consumer_tag: str


@dataclass(frozen=True, slots=True)
class ConsumerCancelled:
    """A server-initiated ``basic.cancel`` (reason: "ha-failover", "queue-deleted")."""

    channel: Hashable
    consumer_tag: str
    reason: str


@dataclass(frozen=True, slots=True)
class MessagesDropped:
    """Messages discarded by the queue: reason "expired", "maxlen" or "rejected"."""

    offsets: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """Messages on their way to the queue's dead-letter exchange: ``items``
    are ``(seq, message, reason)`` (seq: the dead-letter sequence number)."""

    items: tuple[tuple[int, Message, str], ...]


@dataclass(frozen=True, slots=True)
class QueueDeleted:
    """The queue is gone (reason: "deleted", "auto-delete", "expired", "owner-down")."""

    name: str
    reason: str
    message_count: int


# ---------------------------------------------------------------- consumers


@dataclass(frozen=True)
class Consumer:
    """One entry of the consumer table (what a mirror layer replicates)."""

    channel: Hashable
    consumer_tag: str
    no_ack: bool = False
    prefetch: int = 0
    exclusive: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    #: deliveries beyond ``prefetch`` the consumer's front end may hold for it
    #: (see ``_grant_lookahead``); the front end enforces ``prefetch`` toward the client
    lookahead: int = 0

    @property
    def key(self) -> tuple[Hashable, str]:
        return (self.channel, self.consumer_tag)

    @property
    def priority(self) -> int:
        priority: int = self.arguments.get("x-priority", 0)  # an int: _validate_consumer_arguments
        return priority

    @property
    def cancel_on_ha_failover(self) -> bool:
        return self.arguments.get("x-cancel-on-ha-failover", False) is True


class _ConsumerState:
    __slots__ = ("consumer", "cid", "in_flight", "in_flight_bytes", "priority", "limited", "extra", "link_bytes")

    def __init__(self, consumer: Consumer, cid: int) -> None:
        self.consumer = consumer
        self.cid = cid
        self.in_flight = 0
        self.in_flight_bytes = 0  # body bytes of what it holds unacked
        self.priority = consumer.priority
        self.limited = not consumer.no_ack and consumer.prefetch > 0
        self.extra = 0  # lookahead granted now (0 or consumer.lookahead)
        self.link_bytes = 0  # delivered, not yet credited back (LINK_CREDIT_BYTES)

    def credit(self) -> int | None:
        """Deliveries it can take now; None for unlimited.  Lookahead only
        while what it holds is under :data:`LOOKAHEAD_BYTES`; nothing while
        its link credit is used up (:data:`LINK_CREDIT_BYTES`)."""
        if self.link_bytes >= LINK_CREDIT_BYTES:
            return 0
        if not self.limited:
            return None
        extra = self.extra if self.in_flight_bytes < LOOKAHEAD_BYTES else 0
        return self.consumer.prefetch + extra - self.in_flight


class Publish(NamedTuple):
    """One item of :meth:`AMQQueue.publish_many`."""

    channel: Hashable
    publish_id: Any
    msg_id: str | bytes
    body: bytes
    properties: dict[str, Any] | None = None
    persistent: bool = True


#: a publish item as :meth:`AMQQueue._check_publishes` passes it on: (channel,
#: publish_id, msg_id, body, properties, persistent, expiration in ms or None)
_Checked = tuple[Hashable, Any, str | bytes, bytes, dict[str, Any], bool, int | None]


def _default_connection_of(channel: Hashable) -> Hashable:
    return channel[0] if isinstance(channel, tuple) and channel else channel


def _public(msg: Message) -> Message:
    if EXPIRES_AT_KEY in msg.properties:
        props = {k: v for k, v in msg.properties.items() if k != EXPIRES_AT_KEY}
        return Message(msg.offset, msg.msg_id, msg.body, props, msg.persistent, msg.redelivered)
    return msg


# -------------------------------------------------------------------- queue


class AMQQueue:
    """A classic queue's master-side state machine on top of a BackingQueue."""

    def __init__(
        self,
        name: str,
        bq: BackingQueue,
        *,
        durable: bool,
        auto_delete: bool = False,
        exclusive_owner: Hashable | None = None,
        arguments: dict[str, Any] | None = None,
        consumers: Iterable[Consumer] = (),
        connection_of: Callable[[Hashable], Hashable] | None = None,
    ) -> None:
        if not isinstance(name, str):
            raise TypeError(f"queue name must be a str, got {name!r}")
        if not isinstance(bq, BackingQueue):
            raise TypeError(f"bq must be a BackingQueue, got {bq!r}")
        for flag, v in (("durable", durable), ("auto_delete", auto_delete)):
            if not isinstance(v, bool):
                raise TypeError(f"{flag} must be a bool, got {v!r}")
        if durable and not bq.durable:
            raise ValueError(f"durable queue '{name}' needs a durable BackingQueue (bq.durable is False)")
        self.name = name
        self.bq = bq
        self.durable = durable
        self.auto_delete = auto_delete
        self.exclusive_owner = exclusive_owner
        self.arguments = validate_queue_arguments(name, arguments)
        a = self.arguments
        if bq.max_priority != a.get("x-max-priority", 0):
            raise ValueError(
                f"queue '{name}' has x-max-priority {a.get('x-max-priority', 0)} but its "
                f"BackingQueue orders {bq.max_priority} priority levels"
            )
        self._ttl = a["x-message-ttl"] / 1000 if "x-message-ttl" in a else None
        self._expires = a["x-expires"] / 1000 if "x-expires" in a else None
        self._max_length: int | None = a.get("x-max-length")
        self._max_bytes: int | None = a.get("x-max-length-bytes")
        self._reject_publish = a.get("x-overflow") in ("reject-publish", "reject-publish-dlx")
        self._reject_publish_dlx = a.get("x-overflow") == "reject-publish-dlx"
        #: (exchange, routing key or None) from a policy; the arguments win
        self.policy_dead_letter: tuple[str, str | None] | None = None
        self._connection_of = connection_of or _default_connection_of

        self._consumers: dict[tuple[Hashable, str], _ConsumerState] = {}  # in round-robin order
        self._by_cid: dict[int, _ConsumerState] = {}
        self._cid = 0
        self._exclusive_consumer: tuple[Hashable, str] | None = None
        self._had_consumers = False
        # offset -> (channel, consumer id or None for basic.get); (None, None): orphan
        self._unacked: dict[int, tuple[Hashable, int | None]] = {}
        self._by_channel: dict[Hashable, set[int]] = {}
        self._size: dict[int, int] = {}
        self._expiry: dict[int, float] = {}  # live messages that have a deadline
        self._ready_bytes = 0
        self._unacked_bytes = 0
        self._ttl_timer_at: float | None = None
        self._expires_at: float | None = None
        self._deleted: str | None = None

        # what is already in the store (restart, promotion)
        for m in bq.peek(bq.ready_count):
            self._learn(m)
            self._ready_bytes += len(m.body)
        for o in bq.unacked_offsets():
            m = bq.get(o)
            self._learn(m)
            self._unacked_bytes += len(m.body)
            self._unacked[o] = (None, None)
        for c in consumers:
            self._add_consumer(self._checked_consumer(c))

    # ------------------------------------------------------------ queries

    @property
    def consumers(self) -> list[Consumer]:
        """The consumer table, in the order consumers were added."""
        return [s.consumer for s in sorted(self._consumers.values(), key=lambda s: s.cid)]

    @property
    def deleted(self) -> bool:
        return self._deleted is not None

    @property
    def dead_letter_target(self) -> tuple[str, str | None] | None:
        """``(exchange, routing key or None)`` where discarded messages go, or
        None: the queue's arguments, else its policy's."""
        a = self.arguments
        if "x-dead-letter-exchange" in a:
            return a["x-dead-letter-exchange"], a.get("x-dead-letter-routing-key")
        return self.policy_dead_letter

    def unacked_by(self, channel: Hashable) -> list[int]:
        """Offsets the channel holds unacked, in offset order."""
        return sorted(self._by_channel.get(channel, ()))

    def in_flight(self, channel: Hashable, consumer_tag: str) -> int:
        """Unacked deliveries a consumer holds (what its prefetch limits)."""
        st = self._consumers.get((channel, consumer_tag))
        if st is None:
            raise NotFound(f"no consumer '{consumer_tag}' on channel {channel!r} for queue '{self.name}'")
        return st.in_flight

    def info(self) -> dict[str, Any]:
        bq = self.bq
        return {
            "name": self.name,
            "durable": self.durable,
            "auto_delete": self.auto_delete,
            "exclusive": self.exclusive_owner is not None,
            "exclusive_owner": self.exclusive_owner,
            "arguments": dict(self.arguments),
            "state": "deleted" if self._deleted else "running",
            "messages": bq.message_count,
            "messages_ready": bq.ready_count,
            "messages_unacknowledged": bq.unacked_count,
            "messages_dead_lettering": bq.dead_letter_count,
            "message_bytes": self._ready_bytes + self._unacked_bytes,
            "message_bytes_ready": self._ready_bytes,
            "message_bytes_unacknowledged": self._unacked_bytes,
            "consumers": len(self._consumers),
            "exclusive_consumer_tag": self._exclusive_consumer[1] if self._exclusive_consumer else None,
            "head_deadline": self._ttl_timer_at,
            "expires_at": self._expires_at,
            "next_offset": bq.log.next_offset,
        }

    def check_access(self, connection: Hashable) -> None:
        """Raise ResourceLocked (405) unless ``connection`` may use this queue."""
        self._alive()
        if self.exclusive_owner is not None and connection != self.exclusive_owner:
            raise ResourceLocked(
                f"cannot obtain exclusive access to locked queue '{self.name}'; "
                "it could be originally declared on another connection or the exclusive property value "
                "does not match that of the original declaration"
            )

    # ---------------------------------------------------------- lifecycle

    def start(self, now: float) -> list[Action]:
        """Arm the timers of a freshly declared (or recovered) queue."""
        self._alive()
        out: list[Action] = []
        self._settle(now, out)
        self._arm_expires(now, out)
        return out

    def promote(self, now: float) -> list[Action]:
        """Become the master: requeue every unacked message, cancel the
        consumers that asked for x-cancel-on-ha-failover, serve the rest."""
        self._alive()
        out: list[Action] = []
        self.bq.requeue_unacked()
        self._ready_bytes += self._unacked_bytes
        self._unacked_bytes = 0
        self._unacked.clear()
        self._by_channel.clear()
        for st in list(self._consumers.values()):
            st.in_flight = st.in_flight_bytes = 0
        for st in sorted(self._consumers.values(), key=lambda s: s.cid):
            c = st.consumer
            if c.cancel_on_ha_failover:
                self._remove_consumer(c.key)
                out.append(Emit(ConsumerCancelled(c.channel, c.consumer_tag, "ha-failover")))
        self._settle(now, out, requeued=True)
        self._arm_expires(now, out)
        return out

    def timer(self, now: float, key: Hashable) -> list[Action]:
        if self._deleted:
            return []
        out: list[Action] = []
        if key == TTL_TIMER:
            self._ttl_timer_at = None
            self._settle(now, out)
        elif key == EXPIRES_TIMER:
            at = self._expires_at
            self._expires_at = None
            if self._consumers or at is None:
                return out
            if now + _TIMER_SLACK < at:  # fired early (a driver quirk): wait again
                self._expires_at = at
                return [SetTimer(EXPIRES_TIMER, at - now)]
            return self._delete(now, "expired")[1]
        else:
            raise ValueError(f"queue '{self.name}' has no timer {key!r}")
        return out

    def touch(self, now: float, connection: Hashable | None = None) -> list[Action]:
        """A redeclare (``queue.declare`` of the existing queue): checks
        exclusive access when ``connection`` is given and restarts x-expires."""
        if connection is not None:
            self.check_access(connection)
        self._alive()
        out: list[Action] = []
        self._arm_expires(now, out)
        return out

    # ------------------------------------------------------------ publish

    def publish(
        self,
        now: float,
        channel: Hashable,
        publish_id: Any,
        msg_id: str | bytes,
        body: bytes,
        properties: dict[str, Any] | None = None,
        persistent: bool = True,
    ) -> list[Action]:
        return self.publish_many(now, [Publish(channel, publish_id, msg_id, body, properties, persistent)])

    @property
    def may_refuse_publishes(self) -> bool:
        """x-overflow reject-publish(-dlx) with a length limit: a publish may be refused."""
        return self._reject_publish and (self._max_length is not None or self._max_bytes is not None)

    def publish_many(self, now: float, items: Iterable[Publish | tuple[Any, ...]]) -> list[Action]:
        """Enqueue a batch (one incoming actor message); validated whole first.
        Consumers with credit get the batch in one delivery round (one
        DELIVER record), except on a queue with reject-publish limits or
        priorities, where each message is delivered as it is enqueued."""
        self._alive()
        checked = self._check_publishes(items)
        out: list[Action] = []
        fresh: set[int] = set()
        limited = self.may_refuse_publishes
        self._drop_expired(now, out)
        for channel, publish_id, msg_id, body, props, persistent, ttl_ms in checked:
            size = len(body)
            if limited:
                why = self._would_overflow(size)
                if why:
                    out.append(Emit(PublishRejected(channel, publish_id, why)))
                    if self._reject_publish_dlx and self.dead_letter_target is not None:
                        # in the log only to be dead-lettered: never ready for anyone, never counted
                        offset = self.bq.publish(msg_id, body, props, persistent)
                        self.bq.fetch_at([offset])
                        self._discard([offset], "maxlen", out)
                    continue
            ttl = self._ttl
            if ttl_ms is not None:
                ttl = ttl_ms / 1000 if ttl is None else min(ttl, ttl_ms / 1000)
            deadline = None
            if ttl is not None:
                deadline = now + ttl
                props = {**props, EXPIRES_AT_KEY: deadline}
            offset = self.bq.publish(msg_id, body, props, persistent)
            self._size[offset] = size
            self._ready_bytes += size
            if deadline is not None:
                self._expiry[offset] = deadline
            fresh.add(offset)
            out.append(Emit(PublishAccepted(channel, publish_id, offset)))
            if limited or self.bq.max_priority:
                # each as it comes: room for the next (reject-publish), or the
                # arrival order to a consumer with credit (a priority queue
                # serves its highest level first from what is ready)
                self._deliver(now, fresh, out)
        self._settle(now, out, fresh)
        return out

    def _check_publishes(self, items: Iterable[Any]) -> list[_Checked]:
        try:
            items = list(items)
        except TypeError:
            raise TypeError(f"publish_many needs an iterable of Publish items, got {items!r}") from None
        seen: set[str | bytes] = set()
        checked: list[_Checked] = []
        for i, item in enumerate(items):
            try:
                channel, publish_id, msg_id, body, props, persistent = item
            except (TypeError, ValueError):
                raise TypeError(
                    f"publish item {i} must be (channel, publish_id, msg_id, body, properties, persistent), "
                    f"got {item!r}"
                ) from None
            if not isinstance(msg_id, (str, bytes)):
                raise TypeError(f"publish item {i}: msg_id must be str or bytes, got {msg_id!r}")
            if isinstance(body, (bytearray, memoryview)):
                body = bytes(body)
            if not isinstance(body, bytes):
                raise TypeError(f"publish item {i}: body must be bytes, got {type(body).__name__}")
            if props is None:
                props = {}
            if not isinstance(props, dict):
                raise TypeError(f"publish item {i}: properties must be a dict, got {props!r}")
            if EXPIRES_AT_KEY in props:
                raise PreconditionFailed(f"publish item {i}: property {EXPIRES_AT_KEY!r} is reserved")
            if not isinstance(persistent, bool):
                raise TypeError(f"publish item {i}: persistent must be a bool, got {persistent!r}")
            ttl_ms = parse_expiration(props.get("expiration"))
            if msg_id in seen:
                raise PreconditionFailed(f"publish item {i}: msg_id {msg_id!r} repeats in the batch")
            seen.add(msg_id)
            try:
                at = self.bq.offset_of(msg_id)
            except UnknownMessage:
                pass
            else:
                raise PreconditionFailed(
                    f"publish item {i}: msg_id {msg_id!r} is already in queue '{self.name}' at offset {at}"
                )
            checked.append((channel, publish_id, msg_id, body, props, persistent, ttl_ms))
        return checked

    def _would_overflow(self, size: int) -> str | None:
        if self._max_length is not None and self.bq.ready_count + 1 > self._max_length:
            return f"queue '{self.name}' is at x-max-length {self._max_length}"
        if self._max_bytes is not None and self._ready_bytes + size > self._max_bytes:
            return f"queue '{self.name}' would exceed x-max-length-bytes {self._max_bytes}"
        return None

    # ---------------------------------------------------------- consumers

    def consume(
        self,
        now: float,
        channel: Hashable,
        consumer_tag: str,
        *,
        no_ack: bool = False,
        prefetch: int = 0,
        exclusive: bool = False,
        arguments: dict[str, Any] | None = None,
        lookahead: int = 0,
    ) -> list[Action]:
        """``basic.consume``: add a consumer (ConsumeOk), then deliver to it."""
        self._alive()
        self._check_owner(channel)
        self.check_stream_lease(now, "basic.consume")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise TypeError(f"lookahead must be an int >= 0, got {lookahead!r}")
        c = self._checked_consumer(
            Consumer(
                channel,
                consumer_tag,
                no_ack,
                prefetch,
                exclusive,
                arguments or {},
                lookahead if prefetch > 0 and not no_ack else 0,
            )
        )
        out: list[Action] = [Emit(ConsumeOk(channel, consumer_tag))]
        self._add_consumer(c)
        self._arm_expires(now, out)
        self._settle(now, out)
        return out

    def cancel(self, now: float, channel: Hashable, consumer_tag: str) -> list[Action]:
        """``basic.cancel``: CancelOk (also for an unknown tag, as RabbitMQ);
        the consumer's unacked messages stay with its channel."""
        self._alive()
        out: list[Action] = [Emit(CancelOk(channel, consumer_tag))]
        if (channel, consumer_tag) in self._consumers:
            self._remove_consumer((channel, consumer_tag))
            if self._auto_deleted(now, out):
                return out
            self._arm_expires(now, out)
        return out

    def link_credit(self, now: float, channel: Hashable, grants: Iterable[tuple[str, int]]) -> list[Action]:
        """The channel's front end wrote ``nbytes`` more of consumer
        ``consumer_tag``'s deliveries to its client, for each
        ``(consumer_tag, nbytes)`` of ``grants``: that much link credit
        comes back (:data:`LINK_CREDIT_BYTES`), and the queue delivers
        again.  Unknown consumers are ignored (cancelled meanwhile)."""
        self._alive()
        freed = False
        for tag, nbytes in grants:
            if not is_int(nbytes) or nbytes < 0:
                raise TypeError(f"link credit must be an int >= 0, got {nbytes!r}")
            st = self._consumers.get((channel, tag))
            if st is not None and nbytes:
                freed = freed or st.link_bytes >= LINK_CREDIT_BYTES
                st.link_bytes = max(0, st.link_bytes - nbytes)
        out: list[Action] = []
        if freed:
            self._settle(now, out)
        return out

    def channels(self) -> set[Hashable]:
        """Every channel with a consumer or unacked messages here."""
        return {k[0] for k in self._consumers} | {c for c, offs in self._by_channel.items() if offs}

    def channel_down(self, now: float, channel: Hashable) -> list[Action]:
        """The channel closed: its consumers go (no notification) and its
        unacked messages are requeued."""
        self._alive()
        out: list[Action] = []
        gone = [k for k in self._consumers if k[0] == channel]
        for k in gone:
            self._remove_consumer(k)
        self._requeue(list(self._by_channel.get(channel, ())))
        if gone and self._auto_deleted(now, out):
            return out
        self._settle(now, out, requeued=True)
        self._arm_expires(now, out)
        return out

    def owner_down(self, now: float, connection: Hashable) -> list[Action]:
        """The connection closed: an exclusive queue it owns is deleted."""
        self._alive()
        if self.exclusive_owner is not None and connection == self.exclusive_owner:
            return self._delete(now, "owner-down")[1]
        return []

    # ------------------------------------------------------ get, ack, ...

    def get(self, now: float, channel: Hashable, request_id: Any, no_ack: bool = False) -> list[Action]:
        """``basic.get``: GetOk with the head message, or GetEmpty."""
        self._alive()
        self._check_owner(channel)
        self.check_stream_lease(now, "basic.get")
        if not isinstance(no_ack, bool):
            raise TypeError(f"no_ack must be a bool, got {no_ack!r}")
        out: list[Action] = []
        self._drop_expired(now, out)
        self._arm_expires(now, out)
        if not self.bq.ready_count:
            out.append(Emit(GetEmpty(channel, request_id)))
        else:
            (m,) = self.bq.fetch(1, ack_required=not no_ack)
            self._delivered(m.offset, channel, None, not no_ack)
            out.append(
                Emit(GetOk(channel, request_id, m.offset, _public(m), m.redelivered, self.bq.ready_count, not no_ack))
            )
        self._settle(now, out)
        return out

    def ack(self, now: float, channel: Hashable, offsets: Iterable[int] | int) -> list[Action]:
        """``basic.ack``: the channel's unacked messages at ``offsets`` are gone."""
        self._alive()
        mine = self._held(channel, offsets)
        out: list[Action] = []
        if mine:
            self.bq.ack(mine)
            for o in mine:
                self._settled(o)
                self._forget(o)
            self._settle(now, out)
        return out

    def reject(self, now: float, channel: Hashable, offsets: Iterable[int] | int, requeue: bool = True) -> list[Action]:
        """``basic.reject`` / ``basic.nack``: requeue (redelivered) or discard."""
        self._alive()
        if not isinstance(requeue, bool):
            raise TypeError(f"requeue must be a bool, got {requeue!r}")
        mine = self._held(channel, offsets)
        out: list[Action] = []
        if not mine:
            return out
        if requeue:
            self._requeue(mine)
            self._settle(now, out, requeued=True)
        else:
            for o in mine:
                self._settled(o)
            self._discard(mine, "rejected", out)
            self._settle(now, out)
        return out

    nack = reject

    def recover(self, now: float, channel: Hashable, requeue: bool = True) -> list[Action]:
        """``basic.recover``: requeue every message the channel holds unacked."""
        self._alive()
        if requeue is not True:
            raise NotImplementedFeature("basic.recover with requeue=false is not supported (RabbitMQ neither)")
        out: list[Action] = []
        self._requeue(list(self._by_channel.get(channel, ())))
        self._settle(now, out, requeued=True)
        return out

    # ----------------------------------------------------- purge, delete

    def purge(self, now: float, *, connection: Hashable | None = None) -> tuple[int, list[Action]]:
        """``queue.purge``: drop every ready message; unacked ones stay."""
        if connection is not None:
            self.check_access(connection)
        self._alive()
        n = self.bq.purge()
        self._size = {o: self._size[o] for o in self._unacked}
        self._expiry = {o: d for o, d in self._expiry.items() if o in self._unacked}
        self._ready_bytes = 0
        out: list[Action] = []
        self._arm_ttl(now, out)
        return n, out

    def delete(
        self, now: float, if_unused: bool = False, if_empty: bool = False, *, connection: Hashable | None = None
    ) -> tuple[int, list[Action]]:
        """``queue.delete``; returns (ready messages it held, actions)."""
        if connection is not None:
            self.check_access(connection)
        self._alive()
        if if_unused and self._consumers:
            raise PreconditionFailed(f"queue '{self.name}' in use ({len(self._consumers)} consumers)")
        if if_empty and self.bq.ready_count:
            raise PreconditionFailed(f"queue '{self.name}' not empty ({self.bq.ready_count} messages ready)")
        return self._delete(now, "deleted")

    # ------------------------------------- range reads (x-stream-offset: the Spark source)
    #
    # A *range reader* reads messages by their log offset without removing
    # them, and removes them later with a commit below an offset (see
    # mirrorq/amqp/stream.py for the AMQP face and mirrorq/spark for the
    # guarantees built on it).  It must be the queue's only consumer: a
    # range read or commit while the queue has consumers, or messages
    # unacked by one, is refused naming them; and for STREAM_LEASE seconds
    # after a range read or commit, basic.consume / basic.get are refused
    # naming the range reader.  The lease is the master's (not replicated):
    # after a failover the next range read takes it again.

    _stream_lease_until: float = float("-inf")

    def _stream_checks(self, now: float, what: str) -> None:
        self._alive()
        if self._consumers:
            tags = ", ".join(sorted(repr(k[1]) for k in self._consumers))
            raise AccessRefused(
                f"queue '{self.name}' has {len(self._consumers)} consumer(s) ({tags}): a range reader "
                f"(x-stream-offset, e.g. the Spark source) must be the queue's only consumer; {what} refused"
            )

    def _stream_offsets(self, **named: Any) -> None:
        for k, v in named.items():
            self._stream_offset(k, v)

    def _stream_offset(self, name: str, v: Any) -> int:
        """``v``, checked to be a non-negative int offset (PreconditionFailed naming ``name`` if not)."""
        if not is_int(v) or v < 0:
            raise PreconditionFailed(f"{name} must be a non-negative integer offset, got {v!r}")
        return v

    def check_stream_lease(self, now: float, what: str) -> None:
        """Refuse ``what`` (basic.consume, basic.get) while a range reader holds the queue."""
        if now < self._stream_lease_until:
            raise AccessRefused(
                f"queue '{self.name}' is read by a range reader (x-stream-offset, e.g. the Spark source), "
                f"which must be its only consumer: {what} refused for another "
                f"{self._stream_lease_until - now:.1f} s after its last read or commit"
            )

    def stream_bounds(
        self, now: float, start: int | None = None, max_messages: int | None = None, until: int | None = None
    ) -> tuple[dict[str, Any], list[Action]]:
        """The log's bounds, and with ``start`` where a range of at most
        ``max_messages`` live messages from ``start`` (below ``until``,
        default the log's end) ends, exclusive: the offset after its last
        message when the limit cut it, else ``until`` / ``next_offset``;
        and how many it holds.  Reads no body and takes no lease."""
        self._alive()
        bq = self.bq
        nxt = bq.log.next_offset
        first = bq.live_in_range(0, nxt, 1)
        out = {
            "first_offset": first[0] if first else nxt,
            "next_offset": nxt,
            "messages": bq.message_count,
            "consumers": len(self._consumers),
        }
        if start is not None:
            self._stream_offsets(start=start)
            if max_messages is not None and (not is_int(max_messages) or max_messages <= 0):
                raise PreconditionFailed(f"x-stream-max-messages must be a positive integer, got {max_messages!r}")
            if until is not None:
                self._stream_offsets(until=until)
            stop = nxt if until is None else min(until, nxt)
            offsets = bq.live_in_range(start, stop, max_messages)
            limited = max_messages is not None and len(offsets) >= max_messages
            out["start"] = start
            out["end"] = offsets[-1] + 1 if limited else max(stop, start)
            out["count"] = len(offsets)
        return out, []

    def stream_read(
        self, now: float, start: int | None, end: int | None, max_messages: int = 10000, max_bytes: int = 4 << 20
    ) -> tuple[dict[str, Any], list[Action]]:
        """Non-destructive read of the live messages at offsets in ``[start,
        end)``: at most ``max_messages`` and (after the first) ``max_bytes``
        of bodies.  Returns ``{"items": [(offset, body, properties,
        redelivered)], "next": where to read on, "done": whether [start,
        end) is exhausted}``; ``end`` None is the log's end now.  Writes nothing (expired head messages aside,
        which go as on any operation)."""
        self._stream_checks(now, "range read")
        if end is None:
            end = max(start, self.bq.log.next_offset) if is_int(start) else end
        start = self._stream_offset("start", start)
        end = self._stream_offset("end", end)
        if not is_int(max_messages) or max_messages <= 0:
            raise PreconditionFailed(f"x-stream-max-messages must be a positive integer, got {max_messages!r}")
        nxt = self.bq.log.next_offset
        if start > end:
            raise PreconditionFailed(f"range read of queue '{self.name}': start {start} is after end {end}")
        if end > nxt:
            raise PreconditionFailed(
                f"range read [{start}, {end}) of queue '{self.name}' reaches beyond the end of its log "
                f"(next offset {nxt})"
            )
        out: list[Action] = []
        self._drop_expired(now, out)
        self._arm_ttl(now, out)
        offsets = self.bq.live_in_range(start, end, max_messages)
        held = [o for o in offsets if self.bq.is_unacked(o)]
        if held:
            raise PreconditionFailed(
                f"range read [{start}, {end}) of queue '{self.name}': {len(held)} message(s) "
                f"(first at offset {held[0]}) "
                "are unacked by another consumer; a range reader must be the queue's only consumer"
            )
        items: list[tuple[int, bytes, dict[str, Any], bool]] = []
        size = 0
        for m in self.bq.read_range(offsets):
            if items and size + len(m.body) > max_bytes:
                break
            size += len(m.body)
            m = _public(m)
            items.append((m.offset, m.body, m.properties, m.redelivered))
        if len(items) < len(offsets) or len(offsets) >= max_messages:
            nxt_start, done = (items[-1][0] + 1 if items else start), False
        else:
            nxt_start, done = end, True
        if nxt_start >= end:
            nxt_start, done = end, True
        self._stream_lease_until = now + STREAM_LEASE
        return {"items": items, "next": nxt_start, "done": done}, out

    def stream_commit(self, now: float, end: int | None) -> tuple[dict[str, Any], list[Action]]:
        """The range reader's commit: every live message at an offset below
        ``end`` is removed (one DELIVER-without-ack record, replicated like
        any operation).  Idempotent: what is gone already is fine."""
        self._stream_checks(now, "commit")
        end = self._stream_offset("end", end)
        nxt = self.bq.log.next_offset
        if end > nxt:
            raise PreconditionFailed(
                f"commit below offset {end} of queue '{self.name}' names offsets beyond the end of its log "
                f"(next offset {nxt})"
            )
        offsets = self.bq.live_in_range(0, end)
        held = [o for o in offsets if self.bq.is_unacked(o)]
        if held:
            raise PreconditionFailed(
                f"commit below offset {end} of queue '{self.name}': {len(held)} message(s) (first at offset {held[0]}) "
                "are unacked by another consumer; a range reader must be the queue's only consumer"
            )
        out: list[Action] = []
        if offsets:
            self.bq.remove_ready(offsets)
            for o in offsets:
                self._delivered(o, None, None, False)
        self._settle(now, out)
        self._stream_lease_until = now + STREAM_LEASE
        return {"committed_below": end, "removed": len(offsets)}, out

    # ---------------------------------------------------------- internals

    def _alive(self) -> None:
        if self._deleted:
            raise NotFound(f"queue '{self.name}' was deleted ({self._deleted})")

    def _check_owner(self, channel: Hashable) -> None:
        if self.exclusive_owner is not None:
            self.check_access(self._connection_of(channel))

    def _learn(self, m: Message) -> None:
        self._size[m.offset] = len(m.body)
        d = m.properties.get(EXPIRES_AT_KEY)
        if isinstance(d, (int, float)) and not isinstance(d, bool):
            self._expiry[m.offset] = float(d)

    def _forget(self, o: int) -> None:
        self._size.pop(o, None)
        self._expiry.pop(o, None)

    def _checked_consumer(self, c: Any) -> Consumer:
        if not isinstance(c, Consumer):
            raise TypeError(f"expected a Consumer, got {c!r}")
        if not isinstance(c.consumer_tag, str) or not c.consumer_tag:
            raise TypeError(f"consumer_tag must be a non-empty str, got {c.consumer_tag!r}")
        for flag in ("no_ack", "exclusive"):
            if not isinstance(getattr(c, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(c, flag)!r}")
        if not is_int(c.prefetch) or not 0 <= c.prefetch <= MAX_PREFETCH:
            raise TypeError(f"prefetch must be an int in 0..{MAX_PREFETCH}, got {c.prefetch!r}")
        try:
            hash(c.channel)
        except TypeError:
            raise TypeError(f"channel ids must be hashable, got {c.channel!r}") from None
        args = validate_consumer_arguments(c.arguments)
        if c.key in self._consumers:
            raise NotAllowed(f"attempt to reuse consumer tag '{c.consumer_tag}' on queue '{self.name}'")
        if self._exclusive_consumer is not None or (c.exclusive and self._consumers):
            raise AccessRefused(f"queue '{self.name}' in exclusive use")
        return dataclasses.replace(c, arguments=args)

    def _add_consumer(self, c: Consumer) -> None:
        self._cid += 1
        st = self._consumers[c.key] = _ConsumerState(c, self._cid)
        self._by_cid[self._cid] = st
        self._had_consumers = True
        if c.exclusive:
            self._exclusive_consumer = c.key

    def _remove_consumer(self, key: tuple[Hashable, str]) -> None:
        st = self._consumers.pop(key)
        del self._by_cid[st.cid]
        if self._exclusive_consumer == key:
            self._exclusive_consumer = None

    def _auto_deleted(self, now: float, out: list[Action]) -> bool:
        if self.auto_delete and self._had_consumers and not self._consumers:
            out.extend(self._delete(now, "auto-delete")[1])
            return True
        return False

    def _delete(self, now: float, reason: str) -> tuple[int, list[Action]]:
        out: list[Action] = []
        for st in sorted(self._consumers.values(), key=lambda s: s.cid):
            c = st.consumer
            out.append(Emit(ConsumerCancelled(c.channel, c.consumer_tag, "queue-deleted")))
        self._consumers.clear()
        self._by_cid.clear()
        self._exclusive_consumer = None
        if self._ttl_timer_at is not None:
            out.append(CancelTimer(TTL_TIMER))
            self._ttl_timer_at = None
        if self._expires_at is not None:
            out.append(CancelTimer(EXPIRES_TIMER))
            self._expires_at = None
        n = self.bq.ready_count
        self._deleted = reason
        out.append(Emit(QueueDeleted(self.name, reason, n)))
        return n, out

    def _held(self, channel: Hashable, offsets: Any) -> list[int]:
        """The offsets among ``offsets`` that ``channel`` holds unacked."""
        if is_int(offsets):
            offsets = [offsets]
        try:
            offsets = list(offsets)
        except TypeError:
            raise TypeError(f"expected offsets (ints), got {offsets!r}") from None
        held = self._by_channel.get(channel, ())
        mine: dict[int, None] = {}  # in the order given, each once
        for o in offsets:
            if not is_int(o):
                raise TypeError(f"an offset is an int, got {o!r}")
            if o in held:
                mine[o] = None
        return list(mine)

    def _delivered(self, o: int, channel: Hashable, cid: int | None, ack_required: bool) -> None:
        size = self._size.get(o, 0)
        self._ready_bytes -= size
        if ack_required:
            self._unacked_bytes += size
            self._unacked[o] = (channel, cid)
            self._by_channel.setdefault(channel, set()).add(o)
            st = self._by_cid.get(cid) if cid is not None else None
            if st is not None:
                st.in_flight_bytes += size
        else:
            self._forget(o)

    def _settled(self, o: int) -> None:
        """``o`` leaves the unacked set (ack or requeue): give its consumer credit back."""
        channel, cid = self._unacked.pop(o)
        self._unacked_bytes -= self._size.get(o, 0)
        if channel is not None:
            held = self._by_channel[channel]
            held.discard(o)
            if not held:
                del self._by_channel[channel]
        st = self._by_cid.get(cid) if cid is not None else None
        if st is not None:
            st.in_flight -= 1
            st.in_flight_bytes -= self._size.get(o, 0)

    def _requeue(self, offsets: list[int]) -> None:
        if not offsets:
            return
        offsets = sorted(offsets)
        self.bq.requeue(offsets)
        for o in offsets:
            self._settled(o)
            self._ready_bytes += self._size.get(o, 0)

    def _expired(self, o: int, now: float) -> bool:
        d = self._expiry.get(o)
        return d is not None and d <= now

    def _grant_lookahead(self) -> None:
        """Lookahead: a consumer may be given ``lookahead`` deliveries beyond
        its prefetch -- its front end holds them and hands one over as soon
        as the client acks, instead of waiting a round trip to the master --
        but only while that takes nothing from anyone: every consumer is at
        its prefetch (none could take a message now) and the ready backlog is
        deeper than every consumer's lookahead together; and for one consumer
        only while the bodies it holds are under :data:`LOOKAHEAD_BYTES`
        (:meth:`_ConsumerState.credit`).  Otherwise no extra credit (what is
        already out stays)."""
        states = self._consumers.values()
        if not any(st.consumer.lookahead for st in states):
            return
        busy = all(st.limited and st.consumer.prefetch - st.in_flight <= 0 for st in states)
        ok = busy and self.bq.ready_count >= sum(st.consumer.lookahead for st in states)
        for st in states:
            st.extra = st.consumer.lookahead if ok else 0

    def _pick(self) -> _ConsumerState | None:
        best: _ConsumerState | None = None
        for st in self._consumers.values():
            credit = st.credit()
            if (credit is None or credit > 0) and (best is None or st.priority > best.priority):
                best = st
        return best

    def _deliver(self, now: float, fresh: AbstractSet[int], out: list[Action]) -> None:
        """Serve consumers with credit from the head, round-robin; expired
        messages met at the head (except ones published in this call) go."""
        bq = self.bq
        while bq.ready_count and self._consumers:
            self._grant_lookahead()
            budget = 0
            for st in self._consumers.values():
                credit = st.credit()
                budget = _CHUNK if credit is None else budget + max(credit, 0)  # < 0: lookahead taken back
                if budget >= _CHUNK:
                    break
            if budget <= 0:
                return
            heads = bq.head(min(budget, _CHUNK, bq.ready_count))  # offsets: bodies are read once, by fetch
            plan: list[tuple[int, _ConsumerState | None]] = []
            taken = 0
            for o in heads:
                if o not in fresh and self._expired(o, now):
                    plan.append((o, None))
                    continue
                if taken == budget:
                    break
                pick = self._pick()
                if pick is None:
                    break
                taken += 1
                plan.append((o, pick))
                pick.link_bytes += self._size.get(o, 0)
                if pick.limited:
                    pick.in_flight += 1  # reserve; recorded for real below
                    pick.in_flight_bytes += self._size.get(o, 0)
                key = pick.consumer.key
                self._consumers[key] = self._consumers.pop(key)  # to the back: round-robin
            if not plan:
                return
            self._execute(plan, out)

    def _execute(self, plan: list[tuple[int, _ConsumerState | None]], out: list[Action]) -> None:
        """Write the DELIVER records for ``plan`` (head messages, in order)
        and emit what they mean; runs of equal ack mode share one record."""
        i = 0
        expired: list[int] = []
        dlx = self.dead_letter_target is not None

        def acked(st: _ConsumerState | None) -> bool:
            return dlx if st is None else not st.consumer.no_ack  # an expired one is held to be dead-lettered

        while i < len(plan):
            ack = acked(plan[i][1])
            j = i
            while j < len(plan) and acked(plan[j][1]) == ack:
                j += 1
            got = self.bq.fetch(j - i, ack_required=ack)
            assert [m.offset for m in got] == [o for o, _ in plan[i:j]], "delivery plan and store disagree"
            for m, (_, st) in zip(got, plan[i:j]):
                if st is None:
                    expired.append(m.offset)
                    self._delivered(m.offset, None, None, False)
                    continue
                if expired:  # events keep the head order: drops before what came after them
                    self._discard(expired, "expired", out, held=False)
                    expired = []
                c = st.consumer
                if st.limited:
                    st.in_flight -= 1  # the reservation becomes the real count
                    st.in_flight_bytes -= self._size.get(m.offset, 0)
                self._delivered(m.offset, c.channel, st.cid, ack)
                if ack:
                    st.in_flight += 1
                out.append(Emit(Deliver(c.channel, c.consumer_tag, m.offset, _public(m), m.redelivered, ack)))
            i = j
        if expired:
            self._discard(expired, "expired", out, held=False)

    def _drop_head(self, n: int) -> list[int]:
        """Take ``n`` messages off the head, to be discarded (:meth:`_discard`):
        gone at once without a dead-letter exchange, held for it with one."""
        got = self.bq.fetch(n, ack_required=self.dead_letter_target is not None)
        for m in got:
            self._delivered(m.offset, None, None, False)
        return [m.offset for m in got]

    def _discard(self, offsets: list[int], reason: str, out: list[Action], held: bool = True) -> None:
        """Messages the queue no longer holds for anyone (``held``: still
        unacked in ``bq``, a reject; else taken off the head by
        :meth:`_drop_head` or an expiring delivery): dead-lettered when the
        queue has a dead-letter exchange, else gone."""
        if self.dead_letter_target is None:
            if held:
                self.bq.ack(offsets)
            for o in offsets:
                self._forget(o)
            out.append(Emit(MessagesDropped(tuple(offsets), reason)))
            return
        msgs = [_public(self.bq.get(o)) for o in offsets]
        seqs = self.bq.dead_letter(offsets, reason)
        for o in offsets:
            self._forget(o)
        out.append(Emit(DeadLettered(tuple((seq, m, reason) for seq, m in zip(seqs, msgs)))))

    def dead_lettered(self, offsets: Iterable[int]) -> None:
        """The dead-letter exchange has these messages (its router says so):
        they are gone.  Offsets not being dead-lettered (any more) are ignored."""
        self._alive()
        live = [o for o in offsets if is_int(o) and self.bq.is_dead_lettering(o)]
        if live:
            self.bq.ack(live)

    def dead_lettering(self) -> Iterator[tuple[int, Message, str]]:
        """``(seq, message, reason)`` of every message waiting for its
        dead-letter exchange, in sequence order (a new master sends them
        again); bodies are read as the caller goes."""
        for seq, o, reason in self.bq.dead_lettering():
            yield seq, _public(self.bq.get(o)), reason

    def _drop_expired(self, now: float, out: list[Action]) -> None:
        dropped: list[int] = []
        while self._expiry and self.bq.ready_count:
            heads = self.bq.peek(min(_CHUNK, self.bq.ready_count))
            n = 0
            while n < len(heads) and self._expired(heads[n].offset, now):
                n += 1
            if n:
                dropped += self._drop_head(n)
            if n < len(heads):
                break
        if dropped:
            self._discard(dropped, "expired", out, held=False)

    def _enforce_limits(self, out: list[Action]) -> None:
        if self._reject_publish:
            return
        dropped: list[int] = []
        if self._max_length is not None and self.bq.ready_count > self._max_length:
            dropped += self._drop_head(self.bq.ready_count - self._max_length)
        if self._max_bytes is not None:
            while self._ready_bytes > self._max_bytes:
                excess = self._ready_bytes - self._max_bytes
                n = 0
                for m in self.bq.peek(min(_CHUNK, self.bq.ready_count)):
                    n += 1
                    excess -= len(m.body)
                    if excess <= 0:
                        break
                dropped += self._drop_head(n)
        if dropped:
            self._discard(dropped, "maxlen", out, held=False)

    def _arm_ttl(self, now: float, out: list[Action]) -> None:
        at = None
        if self._expiry and self.bq.ready_count:
            at = self._expiry.get(self.bq.peek(1)[0].offset)
        if at == self._ttl_timer_at:
            return
        self._ttl_timer_at = at
        if at is None:
            out.append(CancelTimer(TTL_TIMER))
        else:
            out.append(SetTimer(TTL_TIMER, max(0.0, at - now) + _TIMER_SLACK))

    def _arm_expires(self, now: float, out: list[Action]) -> None:
        """(Re)start the x-expires countdown if unused; stop it if consumed."""
        if self._expires is None:
            return
        if self._consumers:
            if self._expires_at is not None:
                self._expires_at = None
                out.append(CancelTimer(EXPIRES_TIMER))
            return
        self._expires_at = now + self._expires
        out.append(SetTimer(EXPIRES_TIMER, self._expires))

    def _settle(
        self, now: float, out: list[Action], fresh: AbstractSet[int] = frozenset(), requeued: bool = False
    ) -> None:
        """After any change: limits (first, after a requeue, as RabbitMQ's
        requeue_and_run), deliveries, expiry at the head, limits, TTL timer."""
        if requeued:
            self._enforce_limits(out)
        self._deliver(now, fresh, out)
        self._drop_expired(now, out)
        self._enforce_limits(out)
        self._arm_ttl(now, out)
