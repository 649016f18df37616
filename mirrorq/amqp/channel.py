"""An AMQP channel's state: what the connection keeps per open channel.

A :class:`Channel` is a plain record; the connection
(:mod:`mirrorq.amqp.connection`) and the stream extensions
(:mod:`mirrorq.amqp.stream`) read and change it.  Its lifecycle and its
confirm / tx mode are the transition tables of :mod:`mirrorq.amqp.states`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TypedDict

from pamqp import commands as C
from pamqp import header as H

from mirrorq.amqp.states import ChanMode, ChanState
from mirrorq.queues import channel as qch


class Content(TypedDict):
    """A publish being assembled (held as it is until its commit in a transaction)."""

    method: C.Basic.Publish
    header: H.ContentHeader | None  # None until the content header frame came
    payload: bytes  # the content header frame's payload
    body: list[bytes]  # the body frames
    size: int  # bytes of body so far


class Channel:
    """One AMQP channel's state (its fields are read and written by the
    connection and its feature modules: nothing here is private)."""

    def __init__(self, number: int, uid: int) -> None:
        self.number, self.uid = number, uid
        self.state = ChanState.OPEN  # see mirrorq.amqp.states: CHANNEL_TRANSITIONS
        self.mode = ChanMode.PLAIN  # confirm or tx: MODE_TRANSITIONS
        self.tx_publishes: list[Content] = []  # content (as _publish_done takes it) of each held publish
        self.tx_settles: list = []  # (delivery tags, how) of each held ack / reject / nack
        self.tx_settled: set[int] = set()  # delivery tags a held settlement names
        self.tx_commit: int | None = None  # a commit in progress waits for the confirms of publish tags up to this
        self.next_pub_tag = 1
        self.pending: dict[int, list] = {}  # confirm tag -> [queues left, nacked]
        self.done: dict[int, bool] = {}  # confirm tag -> nacked, not yet sent
        self.confirm_low = 1
        self.seq_tags: dict[str, dict[int, int]] = {}  # queue -> {queue seq: confirm tag}
        self.queues: dict[str, qch.QueueChannel] = {}
        self.incarnations: dict[str, str | None] = {}  # queue -> the incarnation its QueueChannel talks to
        self.pub_buffer: dict[str, list] = {}
        self.next_delivery_tag = 1
        self.unacked: OrderedDict[int, tuple] = OrderedDict()  # delivery tag -> (queue, epoch, offset)
        self.written: dict[tuple, int] = {}  # (queue, epoch, consumer tag) -> body bytes written, not credited back
        self.consumers: dict[str, tuple] = {}  # consumer tag -> (queue, no_ack)
        self.consumer_args: dict[str, dict] = {}  # consumer tag -> its basic.consume arguments (for listings)
        self.next_ctag = 0  # new_consumer_tag
        self.prefetch = 0  # basic.qos global=false: per new consumer
        self.global_prefetch = 0  # basic.qos global=true: shared by the channel's consumers
        self.flow_active = True  # channel.flow
        self.held: deque = deque()  # (queue, Delivery) received, not sent yet (flow, global prefetch, consume-ok)
        self.limited: set[int] = set()  # delivery tags to consumers that count against global_prefetch
        self.consumer_limit: dict[str, int] = {}  # consumer tag -> its prefetch (enforced here)
        self.outstanding: dict[str, int] = {}  # consumer tag -> deliveries sent, not settled
        self.dtag_consumer: dict[int, str] = {}  # delivery tag -> its limited consumer
        self.held_count: dict[str, int] = {}  # consumer tag -> deliveries in ``held``
        self.pending_consumers: set[str] = set()  # consume sent, consume-ok not yet
        self.consume_rids: dict[tuple, tuple] = {}  # (queue, request id) -> (consumer tag, nowait)
        self.gone_no_ack: set[str] = set()  # cancelled no_ack consumers (their late deliveries are not given back)
        self.content: Content | None = None  # a publish being assembled
        self.waiting = False  # a synchronous method waits for an answer
        self.deferred: list = []
        self.last_queue = ""
        self.callbacks: dict[tuple, Callable] = {}  # (queue, request id) -> fn(event)
        self.deleting: set[str] = set()  # queues this channel's queue.delete waits on
        self.cancels_when_gone: dict[str, list[str]] = {}  # queue -> consumer tags to notify once it is gone

    def new_consumer_tag(self, conn_name: str) -> str:
        """A server-named consumer tag (``basic.consume`` with none), as RabbitMQ names them."""
        self.next_ctag += 1
        return f"amq.ctag-{conn_name}-{self.number}-{self.next_ctag}"


def room(ch: Channel, tag: str) -> bool:
    """Consumer ``tag`` may be sent one more delivery (its own prefetch)."""
    lim = ch.consumer_limit.get(tag, 0)
    return not lim or ch.outstanding.get(tag, 0) < lim


def recount(ch: Channel) -> None:
    """Count ``ch.held`` per consumer again (``held_count``)."""
    counts: dict[str, int] = {}
    for _q, d in ch.held:
        counts[d.consumer_tag] = counts.get(d.consumer_tag, 0) + 1
    ch.held_count = counts
