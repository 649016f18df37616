"""Messages between a queue's channels (publishers, consumers) and its replicas.

A *channel* is whatever speaks for one client channel: the internal client
(:mod:`mirrorq.queues.channel`) today, the AMQP front end later.  Its id
is a pair ``(dst, number)``: ``dst`` is where replies go (a simulator node
name, or an actor address string in the real cluster) and ``number`` tells
several channels behind one ``dst`` apart.  Publisher ids are channel ids.

A channel id must never be used twice, not even by a later process: masters
keep each publisher's high-water mark (replicated, for ever) and confirm
without storing every publish at or below it, as a resend.  An actor address
``host:port`` *is* reused (a restarted node's process may get the port a
dead one had), so ``number`` carries 32 random bits per connection
(:func:`channel_key`, ``number = key << 32 | n``): two channels collide only
if the same address, the same key and the same ``n`` meet.

Every message carries batches: one message per hop carries many operations
(Thespian costs 1-3 ms per message between processes, whatever its size),
up to :data:`mirrorq.bounds.MAX_BATCH_BYTES` of estimated size
(:func:`mirrorq.bounds.size_of`: the messages that carry bodies say what
they weigh with ``wire_size``).  Everything here is plain data (tuples,
lists, dicts, bytes) so that it pickles small and could be msgpack'd.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from mirrorq.bounds import ENTRY_BYTES, ITEM_BYTES, MAX_BATCH_BYTES, MESSAGE_BYTES, SCALAR_BYTES, props_size

ChannelId = tuple[str, int]  # (dst, number)
#: a key of a master's publisher high-water marks (``QueueReplica.hwm``): a
#: publisher's channel id, or ``(history.REF_KEY, ref)`` / ``(history.DEAD_LETTER_KEY, source)``
HwmKey = tuple[str, int | str]


def epoch(member: str, term: int) -> str:
    """The name of ``member``'s leadership in ``term``: what a quorum
    queue's leader answers as its master (``Deliveries.epoch``, the
    ``amqqueue`` row's ``pid``); channels follow a newer one only at a
    higher term (:func:`epoch_term`)."""
    return f"{member}#{term}"


def epoch_term(value: str) -> int:
    """The term of an epoch (-1 if ``value`` is not one: a classic master's member name)."""
    _, sep, term = str(value).rpartition("#")
    return int(term) if sep and term.isdigit() else -1


def epoch_member(value: str) -> str:
    """The member an epoch names."""
    return str(value).rpartition("#")[0]


def channel_key(taken: Any = ()) -> int:
    """A random key in [1, 2**32) not in ``taken``: channel numbers
    ``key << 32 | n`` (n < 2**32) then fit msgpack's 64-bit integers."""
    while True:
        key = secrets.randbelow(2**32 - 1) + 1
        if key not in taken:
            return key


def channel_id(value: Any) -> ChannelId:
    """Normalise a channel id (msgpack turns tuples into lists)."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (value[0], value[1])
    raise ValueError(f"a channel id is a (dst, number) pair, got {value!r}")


# ---- channel -> master -------------------------------------------------------------
@dataclass(frozen=True)
class Publish:
    """Publishes from one publisher, in its seq order: items are
    ``(seq, body, properties, persistent)``.  Seqs start at 1 and grow by 1
    per publish of that publisher (its own counter, like AMQP's confirm
    delivery tags); a resend after a failover repeats the same seqs."""

    queue: str
    publisher: ChannelId
    items: tuple
    #: the sender's estimate of :meth:`wire_size` (0: not given; for batching only, never trusted)
    nbytes: int = field(default=0, compare=False)
    #: every seq of the publisher below this one was settled by a master (0: not said): a
    #: master that lost the publisher's high-water mark (its only replica restarted from its
    #: log) takes them as held instead of waiting for seqs that will never come again
    settled_below: int = 0

    def wire_size(self) -> int:
        return self.nbytes or MESSAGE_BYTES + _items_size(self.items, 1, 2)


def publish_item_size(item: tuple) -> int:
    """A ``Publish`` item's estimated size: its body, its properties, a constant."""
    p = item[2]
    return len(item[1]) + ITEM_BYTES + (props_size(p) if p else 0)


def _items_size(items: tuple, body: int, props: int) -> int:
    """Items' estimated size: each one's body (at index ``body``), its
    properties (at ``props``, as :func:`mirrorq.bounds.props_size` counts
    them) and a constant."""
    n = ITEM_BYTES * len(items) + sum([len(it[body]) for it in items])
    for it in items:
        p = it[props]
        if p:
            n += ENTRY_BYTES * len(p)
            h = p.get("headers")
            if h:
                n += ENTRY_BYTES * len(h)
    return n


@dataclass(frozen=True)
class Consume:
    """Register a consumer.  With a ``request_id`` the master answers
    ``CommandResult(request_id, ok)`` once the consumer is registered (held,
    like every reply, until replicated) or refused (403 exclusive use, 404
    ...); a channel re-registering after a failover sends the same request
    id again and gets ok again.  Without one (None) only a refusal is
    answered, with request id -1."""

    queue: str
    channel: ChannelId
    consumer_tag: str
    no_ack: bool = False
    prefetch: int = 0
    exclusive: bool = False
    arguments: dict = field(default_factory=dict)
    request_id: int | None = None
    lookahead: int = 0  # deliveries beyond prefetch the front end holds (amqqueue's _grant_lookahead)


@dataclass(frozen=True)
class Cancel:
    queue: str
    channel: ChannelId
    consumer_tag: str


@dataclass(frozen=True)
class Settle:
    """Acks and rejects from one channel.  ``epoch`` is the master that
    delivered them (settlements for another master's deliveries are void:
    that master's unacked messages were requeued on failover)."""

    queue: str
    channel: ChannelId
    epoch: str
    ack: tuple = ()  # offsets
    requeue: tuple = ()  # offsets rejected/nacked with requeue
    discard: tuple = ()  # offsets rejected/nacked without requeue
    release: tuple = ()  # offsets given back that the client never saw (lookahead of a cancelled consumer...)
    #: (consumer_tag, bytes): link credit given back, what the front end
    #: wrote to its client of that consumer's deliveries (amqqueue.LINK_CREDIT_BYTES)
    credit: tuple = ()

    def wire_size(self) -> int:
        offsets = len(self.ack) + len(self.requeue) + len(self.discard) + len(self.release) + 2 * len(self.credit)
        return MESSAGE_BYTES + SCALAR_BYTES * offsets


@dataclass(frozen=True)
class Get:
    queue: str
    channel: ChannelId
    request_id: int
    no_ack: bool = False


@dataclass(frozen=True)
class ChannelClosed:
    queue: str
    channel: ChannelId


@dataclass(frozen=True)
class FrontEndProbe:
    """A master asks whether anything still listens where its channels live
    (sent when a node went down, and when one came back up); a front end
    answers :class:`FrontEndChannels`, and a transmit refused for good means
    its node or process is gone."""

    master: str


@dataclass(frozen=True)
class FrontEndChannels:
    """A front end's answer to :class:`FrontEndProbe`: the channel keys
    (``number >> 32`` of a channel id) of its live connections.  Its channels
    under other keys are gone (closed while the master could not hear of it:
    a partition, a paused node); the master drops them as closed."""

    dst: str
    keys: frozenset


@dataclass(frozen=True)
class QueueCommand:
    """purge / delete / info, answered with CommandResult."""

    queue: str
    channel: ChannelId
    request_id: int
    command: str  # "purge" | "delete" | "info"
    args: dict = field(default_factory=dict)


# ---- master -> channel -------------------------------------------------------------
@dataclass(frozen=True)
class Confirm:
    """Publisher confirms: ``acks`` and ``nacks`` are publisher seqs."""

    queue: str
    publisher: ChannelId
    acks: tuple = ()
    nacks: tuple = ()
    reason: str = ""

    def wire_size(self) -> int:
        return MESSAGE_BYTES + SCALAR_BYTES * (len(self.acks) + len(self.nacks)) + len(self.reason)


@dataclass(frozen=True)
class Deliveries:
    """Messages for consumers of one channel (or basic.get answers).  A
    classic queue's master sends deliveries at once (with ``ha-deliver-mode:
    replicated``, once every replica of the view holds the message) and a
    basic.get answer once its DELIVER is held by every replica of the view
    (:mod:`mirrorq.classic.coordinator`).
    items: ``(consumer_tag, offset, msg_id, body, properties, redelivered)``;
    consumer_tag is None for a basic.get answer (then ``request_id`` says
    which and ``remaining`` is the message count after it)."""

    queue: str
    channel: ChannelId
    epoch: str
    items: tuple
    request_id: int | None = None
    remaining: int = 0
    seq: int = 0  # per channel and epoch, from 1: the channel restores the master's order
    #: the sender's estimate of :meth:`wire_size` (0: not given; for batching only, never trusted)
    nbytes: int = field(default=0, compare=False)

    def wire_size(self) -> int:
        return self.nbytes or MESSAGE_BYTES + _items_size(self.items, 3, 4)


def delivery_item_size(item: tuple) -> int:
    """A ``Deliveries`` item's estimated size: its body, its properties, a constant."""
    return len(item[3]) + props_size(item[4]) + ITEM_BYTES


@dataclass(frozen=True)
class GetEmpty:
    queue: str
    channel: ChannelId
    request_id: int


@dataclass(frozen=True)
class ConsumerCancelled:
    """Server-initiated basic.cancel (x-cancel-on-ha-failover, queue deleted)."""

    queue: str
    channel: ChannelId
    consumer_tag: str
    reason: str


@dataclass(frozen=True)
class CommandResult:
    queue: str
    channel: ChannelId
    request_id: int
    ok: bool
    value: Any = None
    error: str = ""
    code: int = 0  # AMQP reply code for errors (404, 405, 406...)


@dataclass(frozen=True)
class NotMaster:
    """The replica asked is not (or not yet) the master; ``master`` is the
    master's member name when known.  Nothing in the request was done."""

    queue: str
    master: str | None
    request: Any = None


@dataclass(frozen=True)
class NewMaster:
    """A queue's master changed (promotion); ``dst`` is where to send now."""

    queue: str
    master: str
    dst: Any


# ---- master <-> its node's dead-letter router ----------------------------------------------
@dataclass(frozen=True)
class DeadLetter:
    """A master's messages on their way to its dead-letter exchange (rejected,
    expired, dropped by max-length), sent once the DEAD_LETTER record naming
    them is held by every mirror.  ``items`` are ``(seq, body, properties,
    reason, persistent)``: ``seq`` is the message's dead-letter sequence number (unique
    per queue and increasing, the same on every replica), which the router
    uses to de-duplicate at the target queues.  ``routing_key`` None: the
    message's own routing key.  Answered with :class:`DeadLetterDone`."""

    queue: str
    vhost: str
    master_dst: Any
    exchange: str
    routing_key: str | None
    items: tuple
    incarnation: str = ""  # the source queue's (QueueSpec.incarnation)
    at: float = 0.0  # the master's wall-clock time when it sent them: the x-death time

    def wire_size(self) -> int:
        return MESSAGE_BYTES + _items_size(self.items, 1, 2)


@dataclass(frozen=True)
class DeadLetterDone:
    """The router to the master: every target queue of these dead-letter
    sequence numbers has confirmed them (or they routed nowhere)."""

    queue: str
    seqs: tuple


#: seconds without a DeadLetterDone before a queue sends its unanswered DeadLetter again
DEAD_LETTER_RETRY = 5.0
#: dead-lettered messages (and estimated bytes) in one DeadLetter message at most
DEAD_LETTER_BATCH = 1000
DEAD_LETTER_BATCH_BYTES = MAX_BATCH_BYTES


def dead_letter_prefix(items: Any) -> list:
    """The next DeadLetter's ``items``: the head of ``items`` (``(seq, body,
    properties, reason, persistent)`` in sequence order) up to
    :data:`DEAD_LETTER_BATCH` messages and :data:`DEAD_LETTER_BATCH_BYTES`
    (the first one whatever its size).  Classic masters and quorum leaders
    send one such prefix at a time (stop and wait), which is what lets the
    router's targets de-duplicate by a high-water mark."""
    batch: list = []
    size = 0
    for item in items:
        n = len(item[1]) + props_size(item[2]) + ITEM_BYTES
        if batch and (len(batch) >= DEAD_LETTER_BATCH or size + n > DEAD_LETTER_BATCH_BYTES):
            break
        batch.append(item)
        size += n
    return batch
