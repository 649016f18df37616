"""Consuming over AMQP 0-9-1: consumers, deliveries, settlements, prefetch, flow.

The connection (:class:`~mirrorq.amqp.connection.Connection`, through the
:class:`ConsumeHost` interface) hands this module ``basic.qos``,
``basic.consume`` / ``cancel`` / ``get``, ``basic.ack`` / ``nack`` /
``reject`` / ``recover`` and ``channel.flow`` (the functions named after
them), and each delivery a queue's master sent (:func:`on_delivery`).  A
channel's consumers are its :class:`~mirrorq.amqp.channel.Consuming`
record (``ch.cons``), its deliveries its
:class:`~mirrorq.amqp.channel.Delivering` record (``ch.dlv``).

Consumers
    ``basic.consume-ok`` is sent once the queue's master has registered
    the consumer (the Consume carries a request id; the master answers
    ``CommandResult`` after the registration is replicated); its
    deliveries are held until then.  A refusal (403 exclusive use, 404
    queue gone...) closes the channel with its code instead, and no
    consume-ok is ever sent.  A consumer refused later (re-registering
    with a new master after a failover) gets a server-initiated
    ``basic.cancel``; a ``nowait`` consume's refusal closes the channel.
    A reused consumer tag is 530 NOT_ALLOWED (a connection error).
    Range reads and commits (``x-stream-offset``, ``x-stream-control``)
    are :mod:`mirrorq.amqp.stream`'s.
Deliveries and settlements
    Deliveries carry per-channel delivery tags 1, 2, 3... (given when a
    message is actually sent, so they stay in send order); ack / nack /
    reject / recover name them and are mapped back to (queue, master
    epoch, offset).  The settlements of one read (a client acking each
    message sends many frames at once) go to each master as ONE ``Settle``
    (the queue channel's flush).  Unknown tags are a 406 channel error.
    Messages are redelivered with ``redelivered=true`` after a requeue, a
    channel close or a failover (the queue's business).  ``basic.recover`` requeues everything unacked
    (``requeue=false`` is 540, as RabbitMQ).  A requeue also gives back
    what waits here for the same queue (below), after the requeued
    messages, so they come first again.  On a transactional channel a
    settlement is held in the channel's
    :class:`~mirrorq.amqp.channel.Transaction` record (its tags checked
    when it arrives) and applied at ``tx.commit`` (:mod:`mirrorq.amqp.tx`).
Prefetch, as RabbitMQ reinterprets ``basic.qos``
    ``global=false`` sets the limit of each consumer started afterwards,
    enforced HERE toward the client; the queue's master limits what it
    sends the channel to prefetch plus a *lookahead*
    (:func:`lookahead_for`: as many again, at least :data:`MIN_LOOKAHEAD`,
    at most :data:`MAX_LOOKAHEAD`; none for prefetch 1, the fair-dispatch
    setting; a quorum queue's is four times the prefetch, 512 to 2000, as
    its settles free credit only once committed), which it grants only
    while every consumer of the queue is at its prefetch and the backlog
    is deeper than all lookaheads together -- so a consumer acking each
    message gets the next one from here at once instead of after a round
    trip to the master, and takes nothing another consumer could have
    had.  ``global=true`` sets a limit shared by all consumers of the
    channel, over all queues, enforced HERE where the deliveries of all
    queues meet (both may be set; both apply).  The queues are not asked
    for credit (one more round trip per ack across the cluster, what
    RabbitMQ's docs call "very slow when consuming across a cluster");
    instead each consumer is registered with a limit of
    ``min(per-consumer, channel-wide)`` (a consumer can never hold more
    than the channel may), so at most ``(consumers - 1) x limit``
    deliveries wait here.  ``no_ack``
    consumers and ``basic.get`` are not limited.  ``prefetch_size`` != 0
    is 540.
Held deliveries
    A delivery that may not go yet (channel flow off, a limit reached,
    consume-ok not sent yet, or others waiting before it) is held in
    arrival order and sent when room is made (an ack, a qos, flow on,
    consume-ok).  A held delivery whose consumer was cancelled is given
    back to its queue (sent, if ``no_ack``: its master forgot it); one
    from a master that has since died is dropped (that master's death
    requeued it).  A closing channel gives what it held back as released,
    after requeueing what its client saw.  Coming back, everything is
    flagged ``redelivered`` (a "may have been delivered" hint).
``channel.flow``
    ``active=false`` pauses the channel's deliveries (they are held as
    above; publishes and ``basic.get`` go on) and answers
    ``flow-ok(active=false)``; ``active=true`` resumes them in order.
    Note: RabbitMQ 3.x itself refuses ``active=false`` with 540; pausing
    is what AMQP 0-9-1 specifies.
Link credit
    Every delivered body written to the client is counted per (queue,
    master, consumer) (``ch.dlv.written``) and on the connection
    (``ungranted``); the connection gives it back to the masters
    (:func:`grant`) when its shell's buffer toward the client is short.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from pamqp import commands as C
from pamqp import header as H

from mirrorq.amqp import stream as _stream
from mirrorq.amqp.channel import Channel, Settlement
from mirrorq.amqp.errors import AMQPException, amqp_error, strip_name, unknown_queue
from mirrorq.amqp.properties import DELIVERY_COUNT, EXCHANGE, HEADER, ROUTING_KEY
from mirrorq.amqp.states import ChanMode, ChanState
from mirrorq.amqp.topology import _plain
from mirrorq.queues import channel as qch
from mirrorq.queues import semantics

MAX_LOOKAHEAD = 1000  # deliveries beyond a consumer's prefetch its master may send here (held for the client)
MIN_LOOKAHEAD = 64  # ... at least this many (prefetch 10 gets 64: an ack is answered from here, not after a round trip)
# A quorum queue frees a consumer's credit only when the settle's Raft entry
# commits (leader -> follower -> leader, two fsyncs), so its front end holds
# more to keep a per-message-ack consumer busy meanwhile.
QUORUM_LOOKAHEAD_FACTOR = 4
QUORUM_MIN_LOOKAHEAD = 512
QUORUM_MAX_LOOKAHEAD = 2000

_TX = ChanMode.TX
_CH_CLOSING = ChanState.CLOSING
_ACK, _REQUEUE, _DISCARD = Settlement.ACK, Settlement.REQUEUE, Settlement.DISCARD
_Deliver = C.Basic.Deliver


class ConsumeHost(_stream.StreamHost, Protocol):
    """What consuming needs of the connection (and, for range reads,
    :class:`~mirrorq.amqp.stream.StreamHost`: ``safe_id``, ``writer``,
    ``stats``, ``command``, ``server_cancel``)."""

    vhost: str
    acts: list  # the actions of this turn (sends to masters)
    ungranted: int  # delivered bytes written to the client, link credit not given back yet

    def queue_for(self, ch: Channel, name: str, method: Any) -> dict:
        """Queue ``name``'s record (the channel's last declared if ""); 404 / 405 if not usable."""
        ...

    def check(self, what: str, kind: str, name: str, method: Any) -> None:
        """403 unless the user has ``what`` permission on ``name``."""
        ...

    def queue_channel(self, ch: Channel, name: str) -> qch.QueueChannel:
        """``ch``'s queue channel to queue ``name`` (made on first use)."""
        ...

    def await_master(self, ch: Channel, queue: str, rid: int, fn: Callable) -> None:
        """``fn`` gets the master's answer to request ``rid`` (or a 541 after a timeout)."""
        ...

    def readable_queues(self) -> list[dict]:
        """The records of the vhost's queues the user may read (this node's copy of the registry)."""
        ...


def lookahead_for(prefetch: int, quorum: bool) -> int:
    """The lookahead asked for a consumer with ``prefetch`` (none below 2:
    prefetch 1 is the fair-dispatch setting)."""
    if prefetch < 2:
        return 0
    if quorum:
        return min(max(prefetch * QUORUM_LOOKAHEAD_FACTOR, QUORUM_MIN_LOOKAHEAD), QUORUM_MAX_LOOKAHEAD)
    return min(max(prefetch, MIN_LOOKAHEAD), MAX_LOOKAHEAD)


# ---- methods ---------------------------------------------------------------------------------
def qos(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    if m.prefetch_size:
        raise amqp_error(540, f"prefetch_size={m.prefetch_size} is not supported (only 0)", m)
    if m.global_:
        ch.cons.global_prefetch = int(m.prefetch_count or 0)
    else:
        ch.cons.prefetch = int(m.prefetch_count or 0)
    host.writer.method(ch.number, C.Basic.QosOk())
    release(host, now, ch)  # a higher (or no) channel-wide limit lets held deliveries go


def flow(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    """``channel.flow``: pause or resume the channel's deliveries."""
    ch.dlv.flow_active = bool(m.active)
    host.writer.method(ch.number, C.Channel.FlowOk(ch.dlv.flow_active))
    release(host, now, ch)


def consume(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    if _stream.is_queue_listing(m.arguments):  # x-stream-control "queues": answered by this node
        return _stream.list_queues(host, ch, m, host.readable_queues())
    rec = host.queue_for(ch, m.queue, m)
    name = rec["name"]
    host.check("read", "queue", name, m)
    if _stream.is_stream_consume(m.arguments):  # range reads and commits (mirrorq/amqp/stream.py)
        return _stream.consume(host, now, ch, m, name)
    cons = ch.cons
    tag = m.consumer_tag
    if not tag:
        tag = ch.new_consumer_tag(host.safe_id)
    if tag in cons.consumers:
        raise amqp_error(530, f"attempt to reuse consumer tag '{tag}'", m)
    args = dict(m.arguments or {})
    try:
        semantics.validate_consumer_arguments(args)
    except semantics.AMQPError as e:
        raise amqp_error(e.reply_code, e.text, m) from None
    qc = host.queue_channel(ch, name)
    limits = [p for p in (cons.prefetch, cons.global_prefetch) if p]
    prefetch = 0 if m.no_ack or not limits else min(limits)
    lookahead = lookahead_for(prefetch, rec.get("type") == "quorum")
    rid = qc.request_id()
    cons.consumers[tag] = (name, bool(m.no_ack))
    cons.arguments[tag] = _plain(args)
    cons.limit[tag] = prefetch
    cons.gone_no_ack.discard(tag)
    cons.rids[(name, rid)] = (tag, bool(m.nowait))
    host.acts += qc.consume(
        now,
        tag,
        no_ack=bool(m.no_ack),
        prefetch=prefetch,
        arguments=_plain(args),
        exclusive=bool(m.exclusive),
        request_id=rid,
        lookahead=lookahead,
    )
    if m.nowait:
        return
    # consume-ok once the master registered the consumer; its deliveries wait until then
    cons.registering.add(tag)
    ch.waiting = True

    def done(ev: qch.CommandDone) -> None:
        cons.registering.discard(tag)
        if not ev.ok:
            forget(host, now, ch, tag)
            raise amqp_error(ev.code or 541, strip_name(ev.error), m)
        host.writer.method(ch.number, C.Basic.ConsumeOk(tag))
        release(host, now, ch)

    host.await_master(ch, name, rid, done)


def forget(host: ConsumeHost, now: float, ch: Channel, tag: str) -> tuple | None:
    """Drop consumer ``tag`` from the channel: its held deliveries are
    given back to their queues (no_ack ones are sent: their master
    already forgot them).  Its ``(queue, no_ack)``, None if it was not
    there."""
    cons, dlv = ch.cons, ch.dlv
    entry = cons.consumers.pop(tag, None)
    cons.arguments.pop(tag, None)
    cons.registering.discard(tag)
    cons.limit.pop(tag, None)
    dlv.outstanding.pop(tag, None)
    for k in [k for k, v in cons.rids.items() if v[0] == tag]:
        del cons.rids[k]
    if entry is None:
        return None
    qc = ch.queues.get(entry[0])
    if qc is not None:
        qc.consumers.pop(tag, None)
    if entry[1]:
        cons.gone_no_ack.add(tag)
    keep: deque = deque()
    for q, d in dlv.held:
        if d.consumer_tag != tag:
            keep.append((q, d))
        elif entry[1]:
            deliver(host, ch, q, d, True)
        elif qc is not None and d.epoch not in qc.past_masters:
            host.acts += qc.settle(now, d.epoch, release=[d.offset])
    dlv.held = keep
    recount(ch)
    return entry


def forget_queue(host: ConsumeHost, now: float, ch: Channel, name: str) -> list[str]:
    """Queue ``name`` is gone: drop its consumers (:func:`forget`); their tags."""
    return [
        tag for tag, (q, _) in list(ch.cons.consumers.items()) if q == name and forget(host, now, ch, tag) is not None
    ]


def refused_later(host: ConsumeHost, now: float, ch: Channel, key: tuple, ev: qch.CommandDone) -> AMQPException | None:
    """The master refused request ``key`` with nothing waiting for its
    answer: if it was a consume's (``nowait``, or re-registering with a new
    master after consume-ok), the consumer is dropped -- a ``nowait``
    consume's error is returned (it closes the channel), any other is told
    to the client as a server ``basic.cancel``."""
    entry = ch.cons.rids.get(key)
    if entry is None:
        return None
    tag, nowait = entry
    if nowait:
        forget(host, now, ch, tag)
        return amqp_error(ev.code or 541, strip_name(ev.error))
    if forget(host, now, ch, tag) is not None:
        host.server_cancel(ch, tag)
    return None


def cancel(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    entry = forget(host, now, ch, m.consumer_tag)
    if entry is not None:
        qc = ch.queues.get(entry[0])
        if qc is not None and qc.master_dst is not None:
            host.acts += qc.cancel(now, m.consumer_tag)
    if not m.nowait:
        host.writer.method(ch.number, C.Basic.CancelOk(m.consumer_tag))


def get(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    rec = host.queue_for(ch, m.queue, m)
    name = rec["name"]
    host.check("read", "queue", name, m)
    qc = host.queue_channel(ch, name)
    if qc.master_dst is None:
        raise unknown_queue(f"queue '{name}' in vhost '{host.vhost}' has no master yet", m)
    rid, acts = qc.get(now, bool(m.no_ack))
    host.acts += acts
    ch.waiting = True

    def done(ev: Any) -> None:
        if isinstance(ev, qch.CommandDone):
            raise amqp_error(ev.code or 541, strip_name(ev.error), m)
        d = ev.delivery
        if d is None:
            host.writer.method(ch.number, C.Basic.GetEmpty())
            return
        dlv = ch.dlv
        dtag = dlv.next_tag
        dlv.next_tag += 1
        if not m.no_ack:
            dlv.unacked[dtag] = (name, d.epoch, d.offset)
        host.stats["deliveries"] += 1
        props = d.properties or {}
        host.writer.content(
            ch.number,
            C.Basic.GetOk(
                dtag, bool(d.redelivered), props.get(EXCHANGE, ""), props.get(ROUTING_KEY, ""), int(ev.remaining)
            ),
            header_of(d),
            d.body,
        )

    host.await_master(ch, name, rid, done)


def _settle(host: ConsumeHost, now: float, ch: Channel, m: Any, tag: int, multiple: bool, how: Settlement) -> None:
    dlv, held = ch.dlv, ch.tx.settled
    if multiple:
        tags = [t for t in dlv.unacked if (tag == 0 or t <= tag) and t not in held]
        if tag and not tags and tag >= dlv.next_tag:
            raise amqp_error(406, f"unknown delivery tag {tag}", m)
    else:
        if tag not in dlv.unacked or tag in held:
            raise amqp_error(406, f"unknown delivery tag {tag}", m)
        tags = [tag]
    if ch.mode is _TX and not isinstance(m, (C.Basic.Recover, C.Basic.RecoverAsync)):
        ch.tx.settles.append((tags, how))  # tx.commit settles them
        held.update(tags)
        return
    settle_tags(host, now, ch, tags, how)


def settle_tags(host: ConsumeHost, now: float, ch: Channel, tags: list[int], how: Settlement) -> None:
    """Settle the deliveries ``tags`` (those still unacked) at their masters."""
    dlv = ch.dlv
    unacked, outstanding = dlv.unacked, dlv.outstanding
    tags = [t for t in tags if t in unacked]
    groups: dict[tuple, list] = {}
    for t in tags:
        q, epoch, off = unacked.pop(t)
        dlv.limited.discard(t)
        ctag = dlv.dtag_consumer.pop(t, None)
        if ctag is not None and ctag in outstanding:
            outstanding[ctag] -= 1
        groups.setdefault((q, epoch), []).append(off)
    released: dict[tuple, list] = {}
    if how is _REQUEUE and dlv.held:
        # requeued messages go back to their place at the head: what waits
        # here for these queues' consumers (lookahead) goes back too, after
        # them (released: the client never saw it), so the requeued ones
        # come first again, as in RabbitMQ
        keep: deque = deque()
        for q, d in dlv.held:
            if (q, d.epoch) in groups:
                released.setdefault((q, d.epoch), []).append(d.offset)
            else:
                keep.append((q, d))
        dlv.held = keep
        recount(ch)
    for (q, epoch), offs in groups.items():
        qc = ch.queues.get(q)
        if qc is None:
            continue
        if how is _ACK:
            host.acts += qc.settle(now, epoch, ack=offs)
        elif how is _REQUEUE:
            host.acts += qc.settle(now, epoch, requeue=offs, release=released.get((q, epoch), ()))
        else:
            host.acts += qc.settle(now, epoch, discard=offs)
    release(host, now, ch)


def ack(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    _settle(host, now, ch, m, int(m.delivery_tag), bool(m.multiple), _ACK)


def nack(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    _settle(host, now, ch, m, int(m.delivery_tag), bool(m.multiple), _REQUEUE if m.requeue else _DISCARD)


def reject(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    _settle(host, now, ch, m, int(m.delivery_tag), False, _REQUEUE if m.requeue else _DISCARD)


def recover(host: ConsumeHost, now: float, ch: Channel, m: Any) -> None:
    if not m.requeue:
        raise amqp_error(540, "basic.recover with requeue=false is not supported", m)
    if ch.dlv.unacked:
        _settle(host, now, ch, m, 0, True, _REQUEUE)
    if isinstance(m, C.Basic.Recover):
        host.writer.method(ch.number, C.Basic.RecoverOk())


# ---- deliveries ------------------------------------------------------------------------------
def on_delivery(host: ConsumeHost, now: float, ch: Channel, qc: qch.QueueChannel, d: qch.Delivery) -> bool:
    """A delivery from ``qc``'s master: sent to the client, held (True:
    :func:`release` should run once the master's batch is handled) or
    given back (its consumer is gone)."""
    cons, dlv = ch.cons, ch.dlv
    tag = d.consumer_tag
    entry = cons.consumers.get(tag)
    if entry is None or entry[0] != qc.queue:
        # delivered to a consumer cancelled meanwhile: give it back
        # (a no_ack one's master has forgotten it already)
        if tag not in cons.gone_no_ack:
            host.acts += qc.settle(now, d.epoch, release=[d.offset])
        return False
    if (
        not dlv.held
        and dlv.flow_active
        and (entry[1] or not cons.global_prefetch)
        and tag not in cons.registering
        and room(ch, tag)
    ):
        deliver(host, ch, qc.queue, d, entry[1])  # the common case: nothing to wait for
        return False
    dlv.held.append((qc.queue, d))
    dlv.held_count[tag] = dlv.held_count.get(tag, 0) + 1
    return True


def deliver(host: ConsumeHost, ch: Channel, queue: str, d: qch.Delivery, no_ack: bool) -> None:
    """Send delivery ``d`` to the client with the channel's next delivery tag."""
    dlv = ch.dlv
    dtag = dlv.next_tag
    dlv.next_tag += 1
    ctag, n = d.consumer_tag, len(d.body)
    if not no_ack:
        dlv.unacked[dtag] = (queue, d.epoch, d.offset)
        dlv.limited.add(dtag)
        if ch.cons.limit.get(ctag):
            dlv.outstanding[ctag] = dlv.outstanding.get(ctag, 0) + 1
            dlv.dtag_consumer[dtag] = ctag
    host.stats["deliveries"] += 1
    key = (queue, d.epoch, ctag)
    written = dlv.written
    written[key] = written.get(key, 0) + n
    host.ungranted += n
    props = d.properties or {}
    host.writer.content(
        ch.number,
        _Deliver(ctag, dtag, bool(d.redelivered), props.get(EXCHANGE, ""), props.get(ROUTING_KEY, "")),
        header_of(d),
        d.body,
    )


def release(host: ConsumeHost, now: float, ch: Channel) -> None:
    """Send the held deliveries that may go now, in the order they came."""
    dlv, cons = ch.dlv, ch.cons
    if not dlv.held or not dlv.flow_active or ch.state is _CH_CLOSING:
        return
    keep: deque = deque()
    limit = cons.global_prefetch
    blocked: set = set()
    held, counts = dlv.held, dlv.held_count
    while held:
        q, d = held.popleft()
        tag = d.consumer_tag
        counts[tag] = counts.get(tag, 1) - 1
        qc = ch.queues.get(q)
        entry = cons.consumers.get(tag)
        if qc is None or d.epoch in qc.past_masters:
            continue  # void: its master died and requeued it
        if entry is None or entry[0] != q:
            if tag not in cons.gone_no_ack:
                host.acts += qc.settle(now, d.epoch, release=[d.offset])
            continue
        if (
            tag in blocked
            or tag in cons.registering
            or not room(ch, tag)
            or (not entry[1] and limit and len(dlv.limited) >= limit)
        ):
            blocked.add(tag)
            keep.append((q, d))
            counts[tag] += 1
            if not any(n > 0 and t not in blocked for t, n in counts.items()):
                keep.extend(held)  # everyone left is blocked: the rest stays as it is, in order
                held.clear()
            continue
        deliver(host, ch, q, d, entry[1])
    dlv.held = keep


def drop_void(ch: Channel, qc: qch.QueueChannel) -> None:
    """Forget held deliveries of ``qc``'s past masters (they come again)."""
    dlv = ch.dlv
    if dlv.held and qc.past_masters:
        dlv.held = deque((q, d) for q, d in dlv.held if q != qc.queue or d.epoch not in qc.past_masters)
        recount(ch)


def unacked_at(ch: Channel, qc: qch.QueueChannel) -> bool:
    """Does ``ch`` hold deliveries from ``qc``'s current master not settled yet?"""
    return any(q == qc.queue and epoch == qc.master for q, epoch, _ in ch.dlv.unacked.values())


def grant(host: ConsumeHost, now: float, ch: Channel) -> None:
    """Give the masters back the link credit of what was written to the
    client on ``ch``: one ``credit`` per consumer in the next Settle."""
    dlv = ch.dlv
    if not dlv.written:
        return
    written, dlv.written = dlv.written, {}
    for (queue, epoch, tag), n in written.items():
        qc = ch.queues.get(queue)
        if qc is not None:
            host.acts += qc.settle(now, epoch, credit=[(tag, n)])


def give_back_held(host: ConsumeHost, now: float, ch: Channel) -> None:
    """A closing channel still holds deliveries its client never saw:
    give them back as released (a quorum queue then does not count them
    as delivered), after requeueing what the client did see, so the
    queue's order stays as it was.  The masters' channel-close requeues
    whatever this misses."""
    dlv = ch.dlv
    if not dlv.held:
        return
    groups: dict[tuple, tuple[list, list]] = {}
    for q, epoch, off in dlv.unacked.values():
        groups.setdefault((q, epoch), ([], []))[0].append(off)
    for q, d in dlv.held:
        entry = ch.cons.consumers.get(d.consumer_tag)
        if entry is not None and not entry[1]:  # a no_ack delivery: its master forgot it
            groups.setdefault((q, d.epoch), ([], []))[1].append(d.offset)
    for (q, epoch), (requeue, released) in groups.items():
        qc = ch.queues.get(q)
        if qc is not None and qc.master_dst is not None and released:
            host.acts += qc.settle(now, epoch, requeue=requeue, release=released)


def drop(ch: Channel) -> None:
    """The channel closed: what it held is its masters' to requeue (with
    the rest of its unacked messages), its consumers wait for nothing."""
    dlv, cons = ch.dlv, ch.cons
    dlv.held.clear()
    dlv.held_count.clear()
    dlv.limited.clear()
    dlv.outstanding.clear()
    dlv.dtag_consumer.clear()
    cons.registering.clear()
    cons.rids.clear()


def room(ch: Channel, tag: str) -> bool:
    """Consumer ``tag`` may be sent one more delivery (its own prefetch)."""
    lim = ch.cons.limit.get(tag, 0)
    return not lim or ch.dlv.outstanding.get(tag, 0) < lim


def recount(ch: Channel) -> None:
    """Count ``ch.dlv.held`` per consumer again (``held_count``)."""
    counts: dict[str, int] = {}
    for _q, d in ch.dlv.held:
        counts[d.consumer_tag] = counts.get(d.consumer_tag, 0) + 1
    ch.dlv.held_count = counts


def header_of(d: qch.Delivery) -> bytes:
    """The content header payload for a delivery: the publisher's, as it
    came in (messages published through AMQP), or a plain one."""
    props = d.properties or {}
    h = props.get(HEADER)
    count = props.get(DELIVERY_COUNT)
    if count:  # a quorum queue's message returned before (RabbitMQ's header)
        return _stream.with_header(h, len(d.body), DELIVERY_COUNT, int(count))
    if isinstance(h, (bytes, bytearray)):
        return bytes(h)
    return H.ContentHeader(0, len(d.body), C.Basic.Properties()).marshal()
