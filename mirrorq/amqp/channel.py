"""An AMQP channel's state: what the connection keeps per open channel.

A :class:`Channel` is a plain record: the connection
(:mod:`mirrorq.amqp.connection`) keeps its lifecycle, its queue channels
and its synchronous-method queue; each feature keeps its own part in a
sub-record of its own, read and changed by that feature's module:

* :class:`Publishing` (``ch.pub``): the publish being assembled and the
  publisher-confirm bookkeeping -- :mod:`mirrorq.amqp.publish`;
* :class:`Consuming` (``ch.cons``): the channel's consumers and its
  ``basic.qos`` limits -- :mod:`mirrorq.amqp.consume`;
* :class:`Delivering` (``ch.dlv``): what was delivered and not settled,
  what is held back (flow, prefetch, consume-ok) and the link credit owed
  -- :mod:`mirrorq.amqp.consume`;
* :class:`Transaction` (``ch.tx``): what a transactional channel holds
  until ``tx.commit`` -- :mod:`mirrorq.amqp.tx` (publishing and consuming
  put a transactional channel's complete publishes and settlements there).

Range reads (:mod:`mirrorq.amqp.stream`) register their consumer in
``ch.cons`` and take delivery tags from ``ch.dlv`` as any consumer.

Its lifecycle, its confirm / tx mode and its content assembly are the
transition tables of :mod:`mirrorq.amqp.states`.  Nothing here is private;
nothing here does anything but hold state.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from enum import Enum, auto
from typing import Any

from pamqp import commands as C
from pamqp import header as H

from mirrorq.amqp.states import ChanMode, ChanState, ContentState
from mirrorq.queues import channel as qch

_AWAIT_HEADER = ContentState.HEADER


class Content:
    """A publish being assembled (held as it is until its commit in a transaction)."""

    __slots__ = ("method", "state", "header", "payload", "body", "size")

    def __init__(self, method: C.Basic.Publish) -> None:
        self.method = method
        self.state = _AWAIT_HEADER  # HEADER or BODY: the frame it takes next (states.CONTENT_EXPECTS)
        self.header: H.ContentHeader | None = None  # None until the content header frame came
        self.payload = b""  # the content header frame's payload
        self.body: list[bytes] = []  # the body frames
        self.size = 0  # bytes of body so far


class Publishing:
    """Publishes and their confirms (:mod:`mirrorq.amqp.publish`)."""

    __slots__ = ("content", "next_tag", "pending", "nacked", "done", "confirm_low", "seq_tags", "buffer")

    def __init__(self) -> None:
        self.content: Content | None = None  # a publish being assembled
        self.next_tag = 1  # the next confirm tag (confirm or tx mode)
        self.pending: dict[int, int] = {}  # confirm tag -> queues yet to confirm it
        self.nacked: set[int] = set()  # pending confirm tags some queue refused (nacked once all answered)
        self.done: dict[int, bool] = {}  # confirm tag -> nacked, not yet sent
        self.confirm_low = 1  # the lowest confirm tag not sent yet
        self.seq_tags: dict[str, dict[int, int]] = {}  # queue -> {queue seq: confirm tag}
        self.buffer: dict[str, list] = {}  # queue -> (body, properties, persistent) of this read, not yet sent


class Consuming:
    """The channel's consumers and its prefetch limits (:mod:`mirrorq.amqp.consume`)."""

    __slots__ = (
        "consumers",
        "arguments",
        "next_ctag",
        "prefetch",
        "global_prefetch",
        "limit",
        "registering",
        "rids",
        "gone_no_ack",
    )

    def __init__(self) -> None:
        self.consumers: dict[str, tuple] = {}  # consumer tag -> (queue, no_ack)
        self.arguments: dict[str, dict] = {}  # consumer tag -> its basic.consume arguments (for listings)
        self.next_ctag = 0  # Channel.new_consumer_tag
        self.prefetch = 0  # basic.qos global=false: per new consumer
        self.global_prefetch = 0  # basic.qos global=true: shared by the channel's consumers
        self.limit: dict[str, int] = {}  # consumer tag -> its prefetch (enforced here)
        self.registering: set[str] = set()  # consume sent, consume-ok not yet
        self.rids: dict[tuple, tuple] = {}  # (queue, request id) -> (consumer tag, nowait)
        self.gone_no_ack: set[str] = set()  # cancelled no_ack consumers (their late deliveries are not given back)


class Delivering:
    """Deliveries: sent and not settled, held back, credit owed (:mod:`mirrorq.amqp.consume`)."""

    __slots__ = (
        "next_tag",
        "unacked",
        "outstanding",
        "dtag_consumer",
        "limited",
        "held",
        "held_count",
        "flow_active",
        "written",
    )

    def __init__(self) -> None:
        self.next_tag = 1  # the next delivery tag
        self.unacked: OrderedDict[int, tuple] = OrderedDict()  # delivery tag -> (queue, epoch, offset)
        self.outstanding: dict[str, int] = {}  # consumer tag -> deliveries sent, not settled
        self.dtag_consumer: dict[int, str] = {}  # delivery tag -> its limited consumer
        self.limited: set[int] = set()  # delivery tags to consumers that count against global_prefetch
        self.held: deque = deque()  # (queue, Delivery) received, not sent yet (flow, global prefetch, consume-ok)
        self.held_count: dict[str, int] = {}  # consumer tag -> deliveries in ``held``
        self.flow_active = True  # channel.flow
        self.written: dict[tuple, int] = {}  # (queue, epoch, consumer tag) -> body bytes written, not credited back


class Settlement(Enum):
    """What an ack / nack / reject / recover does with the deliveries it names."""

    ACK = auto()  # basic.ack: done with
    REQUEUE = auto()  # nack / reject with requeue, recover: back to the queue
    DISCARD = auto()  # nack / reject without requeue: dropped (or dead-lettered)


class Transaction:
    """What a transactional channel holds until ``tx.commit`` (:mod:`mirrorq.amqp.tx`)."""

    __slots__ = ("publishes", "settles", "settled", "commit")

    def __init__(self) -> None:
        self.publishes: list[Content] = []  # each held publish, complete
        self.settles: list[tuple[list[int], Settlement]] = []  # (delivery tags, how) of each held ack / reject / nack
        self.settled: set[int] = set()  # delivery tags a held settlement names
        self.commit: int | None = None  # a commit in progress waits for the confirms of publish tags up to this


class Channel:
    """One AMQP channel's state (its fields are read and written by the
    connection and its feature modules: nothing here is private)."""

    def __init__(self, number: int, uid: int) -> None:
        self.number, self.uid = number, uid
        self.state = ChanState.OPEN  # see mirrorq.amqp.states: CHANNEL_TRANSITIONS
        self.mode = ChanMode.PLAIN  # confirm or tx: MODE_TRANSITIONS
        self.pub = Publishing()
        self.cons = Consuming()
        self.dlv = Delivering()
        self.tx = Transaction()
        self.queues: dict[str, qch.QueueChannel] = {}
        self.incarnations: dict[str, str | None] = {}  # queue -> the incarnation its QueueChannel talks to
        self.waiting = False  # a synchronous method waits for an answer
        self.deferred: list = []  # (frame type, value) waiting behind it
        self.last_queue = ""
        self.callbacks: dict[tuple, Callable[[Any], None]] = {}  # (queue, request id) -> fn(event)
        self.deleting: set[str] = set()  # queues this channel's queue.delete waits on
        self.cancels_when_gone: dict[str, list[str]] = {}  # queue -> consumer tags to notify once it is gone

    def new_consumer_tag(self, conn_name: str) -> str:
        """A server-named consumer tag (``basic.consume`` with none), as RabbitMQ names them."""
        self.cons.next_ctag += 1
        return f"amq.ctag-{conn_name}-{self.number}-{self.cons.next_ctag}"
