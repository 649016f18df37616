"""The dead-letter router: what a node's front end does with the messages its
queues' masters dead-letter.

A master whose queue has a dead-letter exchange (``x-dead-letter-exchange``
or a policy's ``dead-letter-exchange``) sends what it rejects, expires or
drops for length to its node's front end as
:class:`~mirrorq.queues.messages.DeadLetter`.  :class:`DeadLetterRouter`
(sans-IO, no clock of its own, driven by :class:`~mirrorq.amqp.frontend.FrontEnd`)

* rewrites each message as RabbitMQ does: the ``x-death`` header (a list of
  tables, newest first, one per ``(queue, reason)``: ``count``, ``reason``,
  ``queue``, ``time``, ``exchange``, ``routing-keys`` and, for a message
  that had one, ``original-expiration``; a repeated ``(queue, reason)`` has
  its count raised and moves to the front), ``x-first-death-reason`` /
  ``-queue`` / ``-exchange`` once, and no ``expiration`` any more;
* routes it through the dead-letter exchange with the dead-letter routing
  key, or the message's own routing key when the queue has none, and its
  rewritten headers (a headers exchange matches them); a missing
  exchange or no match drops it (as RabbitMQ does);
* drops it for a target queue that would close a cycle: the target is the
  queue it dies in now, or appears in its ``x-death`` history, with no
  ``rejected`` death since (RabbitMQ's rule: a cycle without a rejection
  would loop for ever);
* publishes it to every target queue through a
  :class:`~mirrorq.queues.channel.QueueChannel` per target (publisher
  confirms; resends to a new master), carrying ``_d = [source, seq]``:
  the source queue (vhost, name and incarnation) and the message's
  dead-letter sequence number;
* answers the source's master with
  :class:`~mirrorq.queues.messages.DeadLetterDone` once every
  target confirmed (or nacked: the target refused it, e.g. full with
  ``reject-publish``) -- one message per master per call.

Guarantees: a message is published to each of its targets at most once per
router while in progress (a master's resend of it is not published again;
the answer goes to whoever asked last); a source's messages are published
to a target in the order the master listed them, so the target's
high-water-mark de-duplication on the dead-letter ref
(:data:`~mirrorq.amqp.properties.DEAD_LETTER_REF`) is exact (see
``Coordinator._send_dead_letters`` for why the master's order makes it so).
Assumes the shell routes the replies of the router's channels (channel key
:attr:`DeadLetterRouter.key`) and every ``NewMaster`` / ``NotMaster`` and
queue-record change to it.  Fails: a router that dies forgets what it was
publishing; the masters send it again (their retry), and the targets'
de-duplication drops what was already stored.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from pamqp import commands as C
from pamqp import header as H

from mirrorq.amqp.connection import dst_of_member, master_dst
from mirrorq.amqp.properties import EXCHANGE, HEADER, PRIORITY, ROUTING_KEY
from mirrorq.amqp.properties import encode as encode_properties
from mirrorq.queues import channel as qch
from mirrorq.queues import messages as qm
from mirrorq.sansio import Emit, Send


@dataclass
class _Item:
    source: str  # "vhost/name/incarnation"
    queue: str
    master_dst: Any
    waiting: set = field(default_factory=set)  # target queue names not confirmed yet


def source_id(msg: qm.DeadLetter) -> str:
    return f"{msg.vhost}/{msg.queue}/{msg.incarnation}"


def _text(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def rewrite(body_size: int, properties: dict, queue: str, reason: str, now: float) -> tuple[bytes, list, dict]:
    """The content header of a message dead-lettered from ``queue`` for
    ``reason`` at ``now`` (unix seconds), its deaths newest first as
    ``[(queue, reason)]``, and its new headers (what a headers exchange
    routes it by)."""
    h = properties.get(HEADER)
    props = C.Basic.Properties()
    if isinstance(h, (bytes, bytearray)):
        ch = H.ContentHeader()
        ch.unmarshal(bytes(h))
        props = ch.properties
    # the publisher's headers, as decoded (any field values)
    headers: dict[str, Any] = dict(props.headers or {}) if isinstance(props.headers, dict) else {}
    exchange = properties.get(EXCHANGE, "")
    routing_keys = [properties.get(ROUTING_KEY, "")]
    deaths = [dict(d) for d in headers.get("x-death") or [] if isinstance(d, dict)]
    match = next(
        (i for i, d in enumerate(deaths) if _text(d.get("queue")) == queue and _text(d.get("reason")) == reason), None
    )
    if match is not None:
        entry = deaths.pop(match)
        entry["count"] = int(entry.get("count") or 0) + 1
        entry["time"] = datetime.datetime.fromtimestamp(int(now), datetime.UTC).replace(tzinfo=None)
    else:
        entry = {
            "count": 1,
            "reason": reason,
            "queue": queue,
            "time": datetime.datetime.fromtimestamp(int(now), datetime.UTC).replace(tzinfo=None),
            "exchange": exchange,
            "routing-keys": routing_keys,
        }
        if props.expiration is not None:
            entry["original-expiration"] = props.expiration
    deaths.insert(0, entry)
    headers["x-death"] = deaths
    headers.setdefault("x-first-death-reason", reason)
    headers.setdefault("x-first-death-queue", queue)
    headers.setdefault("x-first-death-exchange", exchange)
    props.headers = headers
    props.expiration = None
    history = [(_text(d.get("queue")), _text(d.get("reason"))) for d in deaths]
    return H.ContentHeader(0, body_size, props).marshal(), history, headers


def is_cycle(target: str, history: list) -> bool:
    """Would dead-lettering into ``target`` close a cycle with no rejection?
    ``history``: the message's ``(queue, reason)`` deaths, newest first
    (the death happening now included)."""
    for queue, reason in history:
        if reason == "rejected":
            return False
        if queue == target:
            return True
    return False


class DeadLetterRouter:
    def __init__(self, topo: Any, dst: str, key: int) -> None:
        self.topo = topo
        self.dst = dst
        self.key = key  # channel numbers key << 32 | n: the shell routes their replies here
        self.channels: dict[tuple, qch.QueueChannel] = {}  # (vhost, queue) -> channel
        self.by_number: dict[int, tuple] = {}
        self.items: dict[tuple, _Item] = {}  # (source, seq) -> what waits for confirms
        self.published: dict[tuple, dict[int, tuple]] = {}  # (vhost, queue) -> {channel seq: (source, seq)}
        self._done: dict[Any, dict[str, list]] = {}  # master dst -> {queue: [seqs]}
        self.stats = {"dead_lettered": 0, "dropped": 0, "cycles": 0, "published": 0}

    # ---- entry points ---------------------------------------------------------------------
    def dead_letter(self, now: float, msg: qm.DeadLetter) -> list:
        """A master's DeadLetter: route and publish what is new, answer what is done."""
        src = source_id(msg)
        out: list = []
        pubs: dict[str, list] = {}
        for seq, body, props, reason, persistent in msg.items:
            key = (src, seq)
            item = self.items.get(key)
            if item is not None:
                item.master_dst, item.queue = msg.master_dst, msg.queue  # in progress: answer the latest asker
                continue
            props = props or {}
            header, history, headers = rewrite(len(body), props, msg.queue, reason, msg.at)
            rk = msg.routing_key if msg.routing_key is not None else props.get(ROUTING_KEY, "")
            targets = self.topo.route(msg.vhost, msg.exchange, rk, headers)
            kept = [t for t in targets if not is_cycle(t, history)]
            self.stats["cycles"] += len(targets) - len(kept)
            if not kept:
                self.stats["dropped"] += 1
                self._answer(msg.master_dst, msg.queue, seq)
                continue
            self.stats["dead_lettered"] += 1
            self.items[key] = _Item(src, msg.queue, msg.master_dst, set(kept))
            qprops = encode_properties(
                header, msg.exchange, rk, dead_letter_ref=[src, seq], priority=props.get(PRIORITY)
            )
            for t in kept:
                pubs.setdefault(t, []).append((key, (body, qprops, persistent)))
        for t, lst in pubs.items():
            qc = self._channel(msg.vhost, t)
            first = qc.next_seq
            for i, (key, _) in enumerate(lst):
                self.published.setdefault((msg.vhost, t), {})[first + i] = key
            self.stats["published"] += len(lst)
            out += self._events(now, msg.vhost, t, qc.publish(now, [p for _, p in lst]))
        return out + self.flush()

    def receive(self, now: float, src: Any, msg: Any) -> list:
        """A reply for one of the router's channels (Confirm, NotMaster...)."""
        if isinstance(msg, qm.NewMaster):
            out: list = []
            for (vhost, q), qc in list(self.channels.items()):
                if q == msg.queue:
                    out += self._events(now, vhost, q, qc.new_master(now, msg.master, msg.dst))
            return out + self.flush()
        cid = getattr(msg, "publisher", None) or getattr(msg, "channel", None)
        try:
            number = qm.channel_id(cid)[1]
        except ValueError:
            return []
        target = self.by_number.get(number)
        if target is None:
            return []
        qc = self.channels[target]
        return self._events(now, target[0], target[1], qc.receive(now, src, msg)) + self.flush()

    def queue_moved(self, now: float, vhost: str, name: str, record: dict | None) -> list:
        """The registry's row of a queue changed (a new master, or deleted)."""
        qc = self.channels.get((vhost, name))
        if qc is None:
            return []
        if record is None:  # deleted: what waited for it will not be confirmed
            self._settled(vhost, name, list(self.published.pop((vhost, name), {}).values()))
            del self.channels[(vhost, name)]
            self.by_number.pop(qc.channel[1], None)
            return self.flush()
        pid, dst = record.get("pid"), master_dst(record)
        if not pid or pid == qc.master or dst is None:
            return []
        return self._events(now, vhost, name, qc.new_master(now, pid, dst)) + self.flush()

    def flush(self) -> list:
        """The DeadLetterDone answers collected, one message per master."""
        done, self._done = self._done, {}
        return [Send(dst, qm.DeadLetterDone(q, tuple(seqs))) for dst, per in done.items() for q, seqs in per.items()]

    # ---- inside ------------------------------------------------------------------------------
    def _channel(self, vhost: str, queue: str) -> qch.QueueChannel:
        qc = self.channels.get((vhost, queue))
        if qc is None:
            number = self.key << 32 | (len(self.by_number) + 1)
            while number in self.by_number:
                number += 1
            rec = self.topo.queue(vhost, queue) or {}
            qc = qch.QueueChannel((self.dst, number), queue, master_dst(rec), rec.get("pid"))
            self.channels[(vhost, queue)] = qc
            self.by_number[number] = (vhost, queue)
        return qc

    def _events(self, now: float, vhost: str, queue: str, actions: list) -> list:
        out: list = []
        for a in actions:
            if isinstance(a, Send):
                out.append(a)
            elif isinstance(a, Emit) and isinstance(a.event, (qch.Confirmed, qch.Nacked)):
                if isinstance(a.event, qch.Nacked):
                    self.stats["dropped"] += len(a.event.seqs)  # the target refused it (full)
                pub = self.published.get((vhost, queue), {})
                self._settled(vhost, queue, [pub.pop(s) for s in a.event.seqs if s in pub])
            elif (
                isinstance(a, Emit)
                and isinstance(a.event, qch.Refused)
                and a.event.master
                and "#" not in a.event.master
            ):  # a quorum leader's epoch: its record names where it is
                qc = self.channels[(vhost, queue)]
                out += self._events(
                    now, vhost, queue, qc.new_master(now, a.event.master, dst_of_member(a.event.master))
                )
        return out

    def _settled(self, vhost: str, queue: str, keys: list) -> None:
        for key in keys:
            item = self.items.get(key)
            if item is None:
                continue
            item.waiting.discard(queue)
            if not item.waiting:
                del self.items[key]
                self._answer(item.master_dst, item.queue, key[1])

    def _answer(self, master_dst: Any, queue: str, seq: int) -> None:
        self._done.setdefault(master_dst, {}).setdefault(queue, []).append(seq)
