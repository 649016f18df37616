"""Publishing over AMQP 0-9-1: content assembly, routing, publisher confirms.

The connection (:class:`~mirrorq.amqp.connection.Connection`, through the
:class:`PublishHost` interface) hands this module a channel's
``basic.publish`` (:func:`start`), every later frame of that channel until
the publish is complete (:func:`content_frame`), ``confirm.select``
(:func:`confirm_select`), what the queue masters confirmed or refused
(:func:`confirmed`), and, once per read, the channel's publishes to send
(:func:`flush`).  A channel's publish state is its
:class:`~mirrorq.amqp.channel.Publishing` record (``ch.pub``).

Content assembly
    ``basic.publish``, its content header, then body frames until the
    header's body size: the states and the frames each takes are
    :data:`~mirrorq.amqp.states.CONTENT_EXPECTS`; a frame of another type
    is 505 UNEXPECTED_FRAME (:data:`~mirrorq.amqp.states.CONTENT_REFUSALS`,
    a connection error).  A content header of a class other than 60 is
    505; one announcing a body larger than ``max_message_size`` closes
    the channel with 406 PRECONDITION_FAILED "message size N is larger
    than configured max size M (max_message_size)" (RabbitMQ's words)
    before any of its body is buffered (the body frames that follow on
    the closing channel are dropped); body frames beyond the announced size are 501
    FRAME_ERROR.  A bad ``expiration`` property is 406 once the publish is
    complete.
Routing
    A complete publish is routed on the connection's topology cache.  If
    nothing matches and the topology was not re-read in the last
    :data:`REFRESH_EVERY` seconds, it is re-read through the registry
    leader first (a queue or binding committed through another node may
    not have reached this node yet) and the channel's later frames wait.
    Routed publishes are buffered per queue and go to each queue's master
    as ONE ``Publish`` per read (:func:`flush`; the connection counts them
    against its credit, ``unconfirmed`` / ``unconfirmed_bytes``).  An
    unroutable ``mandatory`` publish comes back as ``basic.return`` 312
    NO_ROUTE.  On a transactional channel a complete publish is held in
    the channel's :class:`~mirrorq.amqp.channel.Transaction` record and
    routed at ``tx.commit`` (:mod:`mirrorq.amqp.tx`).
Publisher confirms
    In confirm (or tx) mode each publish gets the next tag, 1, 2, 3...; one
    routed to k queues is confirmed once all k masters confirmed it and
    nacked if any refused it; an unroutable one is acked at once (after its
    ``basic.return``).  Confirms go out in tag order, each run of acks (or
    nacks) as one ``multiple=true`` frame.

Nothing here raises but :class:`~mirrorq.amqp.errors.AMQPException`; the
connection turns those into channel or connection errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pamqp import commands as C

from mirrorq.amqp import stream as _stream
from mirrorq.amqp.channel import Channel, Content
from mirrorq.amqp.errors import AMQPException, amqp_error, unknown_exchange
from mirrorq.amqp.framing import FrameWriter
from mirrorq.amqp.properties import encode as encode_properties
from mirrorq.amqp.states import (
    CONTENT_EXPECTS,
    CONTENT_REFUSALS,
    MODE_REFUSALS,
    MODE_TRANSITIONS,
    ChanMode,
    ContentState,
    ModeEvent,
)
from mirrorq.amqp.topology import Topology
from mirrorq.queues import channel as qch
from mirrorq.queues import semantics

#: an unroutable publish re-reads the topology first, at most this often
REFRESH_EVERY = 1.0

_PLAIN, _CONFIRM, _TX = ChanMode.PLAIN, ChanMode.CONFIRM, ChanMode.TX
_HEADER, _BODY = ContentState.HEADER, ContentState.BODY
# the frame types the states take, as module globals (compared once per frame)
_HEADER_FRAME, _BODY_FRAME = CONTENT_EXPECTS[_HEADER], CONTENT_EXPECTS[_BODY]
_CONFIRMED, _NACKED = qch.Confirmed, qch.Nacked


class PublishHost(Protocol):
    """What publishing needs of the connection."""

    topo: Topology  # exchanges and routing
    vhost: str
    max_message_size: int
    writer: FrameWriter  # frames to the client
    stats: dict[str, int]  # "publishes"
    acts: list  # the actions of this turn (sends to masters)
    unconfirmed: int  # publishes sent to masters, not confirmed (the connection's credit)
    unconfirmed_bytes: int  # ... their bodies
    refreshed_at: float  # when the topology was last re-read through the registry leader

    def check(self, what: str, kind: str, name: str, method: Any) -> None:
        """403 unless the user has ``what`` permission on ``name``."""
        ...

    def queue_channel(self, ch: Channel, name: str) -> qch.QueueChannel:
        """``ch``'s queue channel to queue ``name`` (made on first use)."""
        ...

    def refresh(self, ch: Channel, tables: tuple, then: Callable[[float], None]) -> None:
        """Re-read ``tables`` through the registry leader, then ``then(now)``; ``ch`` waits meanwhile."""
        ...

    def resume(self, now: float, ch: Channel) -> None:
        """``ch``'s synchronous wait is over: run the frames that waited behind it."""
        ...


def refused(state: ContentState, ftype: int, channel: int, value: Any) -> AMQPException:
    """The error for a frame of type ``ftype`` on a channel in content ``state`` that does not take it."""
    code, text, names_method = CONTENT_REFUSALS[state, ftype]
    return amqp_error(code, text.format(channel=channel), value if names_method else None)


def start(host: PublishHost, now: float, ch: Channel, m: Any) -> None:
    """``basic.publish``: its content comes next."""
    if m.immediate:
        raise amqp_error(540, "immediate=true is not supported (as in RabbitMQ 3)", m)
    ex = host.topo.exchange(host.vhost, m.exchange)
    if ex is None:
        raise unknown_exchange(f"no exchange '{m.exchange}' in vhost '{host.vhost}'", m)
    if ex.get("internal"):
        raise amqp_error(403, f"cannot publish to internal exchange '{m.exchange}' in vhost '{host.vhost}'", m)
    host.check("write", "exchange", m.exchange, m)
    ch.pub.content = Content(m)


def content_frame(host: PublishHost, now: float, ch: Channel, c: Content, ftype: int, value: Any) -> None:
    """A frame of the publish ``c`` being assembled on ``ch`` (``ch.pub.content``)."""
    if c.state is _HEADER:
        if ftype != _HEADER_FRAME:
            ch.pub.content = None
            raise refused(_HEADER, ftype, ch.number, value)
        hdr, payload = value
        if hdr.class_id != 60:
            ch.pub.content = None
            raise amqp_error(505, f"content header for class {hdr.class_id}, expected 60")
        if hdr.body_size > host.max_message_size:
            ch.pub.content = None
            raise amqp_error(
                406,
                f"message size {hdr.body_size} is larger than configured max size "
                f"{host.max_message_size} (max_message_size)",
                c.method,
            )
        c.header, c.payload = hdr, payload
        if hdr.body_size == 0:
            ch.pub.content = None
            return complete(host, now, ch, c)
        c.state = _BODY
        return
    if ftype != _BODY_FRAME:
        ch.pub.content = None
        raise refused(_BODY, ftype, ch.number, value)
    c.body.append(value)
    c.size += len(value)
    size = c.header.body_size  # type: ignore[union-attr]  # (set with the BODY state)
    if c.size > size:
        ch.pub.content = None
        raise amqp_error(501, f"content body of {c.size} bytes exceeds the header's body size {size}")
    if c.size == size:
        ch.pub.content = None
        complete(host, now, ch, c)


def complete(host: PublishHost, now: float, ch: Channel, c: Content, held: bool = True) -> None:
    """Publish ``c`` is complete: route it (a transactional channel holds
    it); ``held=False``: a transaction's publish routed at its commit (no
    topology re-read: commit-ok waits)."""
    m, hdr = c.method, c.header
    assert hdr is not None  # a publish is complete with its content header
    body = b"".join(c.body)
    props = hdr.properties
    headers = props.headers if isinstance(props.headers, dict) else None
    expiration = props.expiration
    if expiration is not None:
        try:
            semantics.parse_expiration(expiration)
        except semantics.AMQPError as e:
            raise amqp_error(406, e.text, m) from None
    mode = ch.mode
    if mode is _TX and held:
        ch.tx.publishes.append(c)  # routed by tx.commit
        return
    host.stats["publishes"] += 1
    queues = host.topo.route(host.vhost, m.exchange, m.routing_key or "", headers)
    if not queues and held and now - host.refreshed_at > REFRESH_EVERY:
        # Unroutable by what this node knows; a queue or binding just
        # committed through another node may not have reached us yet
        # (RabbitMQ's declare is visible cluster-wide once declare-ok is
        # sent).  Re-read the topology through the registry leader, then
        # route; later frames of the channel wait (order is kept).
        def route_again(now: float) -> None:
            complete(host, now, ch, c)
            host.resume(now, ch)

        host.refresh(ch, ("exchange", "binding", "amqqueue"), route_again)
        host.stats["publishes"] -= 1  # counted when it is routed
        return
    pub = ch.pub
    tag = 0
    if mode is not _PLAIN:
        tag = pub.next_tag
        pub.next_tag += 1
    if not queues:
        if m.mandatory:
            host.writer.content(
                ch.number, C.Basic.Return(312, "NO_ROUTE", m.exchange, m.routing_key or ""), c.payload, body
            )
        if tag:
            pub.done[tag] = False
            if mode is _CONFIRM:
                emit_confirms(host, ch)
        return
    qprops = encode_properties(
        c.payload,
        m.exchange,
        m.routing_key or "",
        publisher_ref=_stream.publisher_ref(headers),  # x-publisher-ref / x-publishing-id: the master de-duplicates
        expiration=expiration,
        priority=props.priority,
    )
    persistent = props.delivery_mode == 2
    if tag:
        pub.pending[tag] = len(queues)
    for q in queues:
        qc = host.queue_channel(ch, q)
        buf = pub.buffer.setdefault(q, [])
        if tag:
            pub.seq_tags.setdefault(q, {})[qc.next_seq + len(buf)] = tag
        buf.append((body, qprops, persistent))


def flush(host: PublishHost, now: float, ch: Channel) -> None:
    """Send ``ch``'s buffered publishes: one ``Publish`` per queue."""
    pub = ch.pub
    if not pub.buffer:
        return
    bufs, pub.buffer = pub.buffer, {}
    for q, items in bufs.items():
        qc = host.queue_channel(ch, q)
        host.unconfirmed += len(items)
        before = qc.unconfirmed_bytes
        host.acts += qc.publish(now, items)
        host.unconfirmed_bytes += qc.unconfirmed_bytes - before


def confirmed(host: PublishHost, ch: Channel, queue: str, ev: qch.Confirmed | qch.Nacked) -> bool:
    """Queue ``queue``'s master confirmed (or refused) publishes of ``ch``:
    True if some publish is now confirmed by all its queues (its confirm can go)."""
    nack = isinstance(ev, _NACKED)
    host.unconfirmed -= len(ev.seqs)
    host.unconfirmed_bytes -= ev.nbytes
    pub = ch.pub
    tags = pub.seq_tags.get(queue)
    if tags is None:
        return False
    pending, nacked, ready = pub.pending, pub.nacked, False
    for s in ev.seqs:
        t = tags.pop(s, None)
        if t is None:
            continue
        left = pending.get(t)
        if left is None:
            continue
        if nack:
            nacked.add(t)
        if left > 1:
            pending[t] = left - 1
            continue
        del pending[t]
        if nacked and t in nacked:
            nacked.discard(t)
            pub.done[t] = True
        else:
            pub.done[t] = False
        ready = True
    return ready


def emit_confirms(host: PublishHost, ch: Channel) -> None:
    """Send the confirms that may go, in tag order: each run of acks (or nacks) as one ``multiple`` frame."""
    pub = ch.pub
    t = pub.confirm_low
    runs: list = []
    while t in pub.done:
        nacked = pub.done.pop(t)
        if runs and runs[-1][0] == nacked:
            runs[-1][1] = t
        else:
            runs.append([nacked, t])
        t += 1
    pub.confirm_low = t
    for nacked, last in runs:
        if nacked:
            host.writer.method(ch.number, C.Basic.Nack(last, True, False))
        else:
            host.writer.method(ch.number, C.Basic.Ack(last, True))


def buffered(ch: Channel, name: str) -> bool:
    """Publishes to queue ``name`` are buffered on ``ch``, not sent yet."""
    return name in ch.pub.buffer


def drop(ch: Channel) -> None:
    """The channel closed: a publish being assembled is dropped."""
    ch.pub.content = None


def forget_queue(ch: Channel, name: str) -> None:
    """Queue ``name`` is gone: its confirm tags are done with (its publishes were confirmed)."""
    ch.pub.seq_tags.pop(name, None)


def mode_step(ch: Channel, ev: ModeEvent, m: Any) -> None:
    """Confirm / tx mode (:data:`~mirrorq.amqp.states.MODE_TRANSITIONS`); refused: 406."""
    nxt = MODE_TRANSITIONS.get((ch.mode, ev))
    if nxt is None:
        code, text = MODE_REFUSALS[ch.mode, ev]
        raise amqp_error(code, text, m)
    ch.mode = nxt


def confirm_select(host: PublishHost, now: float, ch: Channel, m: Any) -> None:
    mode_step(ch, ModeEvent.CONFIRM_SELECT, m)
    if not m.nowait:
        host.writer.method(ch.number, C.Confirm.SelectOk())


def unconfirmed_upto(ch: Channel, upto: int) -> bool:
    """Some publish with a tag up to ``upto`` is not confirmed by all its queues yet."""
    return any(t <= upto for t in ch.pub.pending)


def confirmed_upto(ch: Channel, upto: int) -> None:
    """Every publish up to tag ``upto`` is confirmed and its confirm is not
    sent (a transaction's commit-ok stands for them)."""
    pub = ch.pub
    for t in [t for t in pub.done if t <= upto]:
        del pub.done[t]
    pub.confirm_low = upto + 1
