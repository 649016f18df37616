"""The channel side of a queue: publishing with confirms, consuming, settling.

:class:`QueueChannel` is the sans-IO core behind the internal client (and,
later, behind an AMQP channel's use of one queue).  It

* numbers its publishes 1, 2, 3... and keeps each until the master confirms
  (or nacks) it.  When the queue's master changes (:class:`NewMaster`, from
  the registry or from the new master itself) it sends every unconfirmed
  publish again, in order, to the new master, *before* anything new.  The
  master drops seqs it already holds (its replicated per-publisher
  high-water mark) and confirms them, so a publish in flight when a master
  dies is neither lost nor duplicated (see :mod:`mirrorq.classic.coordinator`);
* sends publishes in at most :data:`MAX_PUBLISH_BATCHES` ``Publish``
  messages in flight, each of at most :data:`~mirrorq.bounds.MAX_BATCH_BYTES`
  (estimated: bodies and properties, :func:`~.messages.publish_item_size`;
  a publish bigger than that goes alone); what is published meanwhile
  waits and goes when a batch is fully confirmed.  Batches thus grow with
  the load up to that size (a publisher with many confirms outstanding
  sends few, large messages, so the master makes one fsync and one GM
  round for many publishes) while a lone publish still leaves at once.
  After a failover the unconfirmed publishes go to the new master the same
  way: the oldest first, at most that many messages of that size at once;
* keeps its consumers and registers them again with a new master (a no-op
  when the consume was replicated), except those that asked for
  ``x-cancel-on-ha-failover``: a failover cancels them (:class:`Cancelled`,
  reason ``ha-failover``) even when their registration died with the old
  master before any mirror had it (the new master cancels those it knows
  itself);
* remembers which master delivered what (``epoch``): settlements go to that
  master only; deliveries of a master that died are void (they were
  requeued and come again, redelivered);
* coalesces settlements: ``settle`` only records (ack, requeue, discard per
  master); :meth:`QueueChannel.flush` -- which the driver calls at the end
  of its turn -- turns everything recorded into ONE :class:`Settle` per
  master, so a client acking each message separately costs one message per
  turn, not one per ack.  Any other message this core sends to a master
  carries the recorded settlements ahead of it (a ``Cancel`` or
  ``ChannelClosed`` never overtakes an ack: the master would requeue a
  message the client had acked);
* keeps each ``basic.get`` until it is answered and sends the unanswered
  ones again to a new master (a get sent to a master that died, or to a
  replica that answered NotMaster, would otherwise never be answered).
  Exactly one :class:`GetResult` is emitted per get: the first answer
  wins; a later answer to the same request (the old master answered after
  all) is dropped, and the message it carried is given back (requeued at
  its master; void if that master is gone -- it requeued it itself when
  it died).  A resend always asks for an acknowledged get; when the client
  asked for ``no_ack`` and the winning answer came from such a resend, the
  channel acks it itself.  So a get's message is delivered at least once
  (a late answer of the old master may repeat a message the new master
  also hands out, marked redelivered), never lost by the resend;
* registers consumers with a request id when asked (``request_id``): the
  master answers ``CommandResult(request_id)`` once the consumer is
  registered (or refused), so an AMQP ``basic.consume-ok`` can wait for it;
* keeps each command (info, purge, delete, sync, stream reads and commits)
  until answered and sends the unanswered ones again to a new master, as
  for gets: a command sent to a master that died would otherwise never be
  answered (a ``queue.declare`` after a failover hung on exactly that).
  Commands are idempotent or harmless to repeat (a repeated delete of a
  queue deleted meanwhile is answered 404, which a delete accepts).

Events (``Emit``): :class:`Confirmed`, :class:`Nacked`, :class:`Delivery`,
:class:`GetResult`, :class:`Cancelled`, :class:`CommandDone`, :class:`Refused`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from mirrorq.bounds import ENTRY_BYTES, ITEM_BYTES, MAX_BATCH_BYTES, MESSAGE_BYTES
from mirrorq.queues import messages as m
from mirrorq.queues.messages import epoch_term
from mirrorq.sansio import Emit, Send

MAX_PUBLISH_BATCHES = 2  # Publish messages unconfirmed at once (one being served, one waiting)


@dataclass(frozen=True)
class Confirmed:
    seqs: tuple
    nbytes: int = 0  # the bodies' bytes those publishes held (QueueChannel.unconfirmed_bytes fell by it)


@dataclass(frozen=True)
class Nacked:
    seqs: tuple
    reason: str
    nbytes: int = 0


@dataclass(frozen=True)
class Delivery:
    consumer_tag: str
    epoch: str
    offset: int
    msg_id: Any
    body: bytes
    properties: dict
    redelivered: bool


@dataclass(frozen=True)
class GetResult:
    request_id: int
    delivery: Delivery | None
    remaining: int = 0


@dataclass(frozen=True)
class Cancelled:
    consumer_tag: str
    reason: str


@dataclass(frozen=True)
class CommandDone:
    request_id: int
    ok: bool
    value: Any
    error: str
    code: int


@dataclass(frozen=True)
class Refused:
    """The replica we talked to is not the master; what was sent waits for
    the next NewMaster (publishes and consumes are sent again then)."""

    master: str | None


class QueueChannel:
    def __init__(self, channel: m.ChannelId, queue: str, master_dst: Any, master: str | None = None) -> None:
        self.channel = m.channel_id(channel)
        self.queue = queue
        self.master_dst = master_dst
        self.master = master
        self.next_seq = 1
        self.unconfirmed: OrderedDict[int, tuple] = OrderedDict()
        self.unconfirmed_bytes = 0  # the bodies of ``unconfirmed``
        self.sent_upto = 0  # publishes up to this seq were sent to the current master
        self.batches: deque[int] = deque()  # last seq of each Publish message in flight
        self.consumers: dict[str, m.Consume] = {}
        self.next_request = 0
        self.past_masters: set[str] = set()
        self.held_settles: dict[str, list] = {}
        self.next_dseq: dict[str, int] = {}  # epoch -> next Deliveries seq expected
        self.early_deliveries: dict[str, dict[int, Any]] = {}
        # unanswered gets: request id -> (client's no_ack, {master: no_ack it was sent with})
        self.pending_gets: OrderedDict[int, tuple] = OrderedDict()
        self.settles: dict[str, tuple] = {}  # epoch -> (ack, requeue, discard, release, credit) lists, not sent yet
        self.pending_commands: OrderedDict[int, m.QueueCommand] = OrderedDict()  # unanswered commands

    # ---- requests -----------------------------------------------------------------
    def publish(self, now: float, items: list) -> list:
        """``items``: ``(body, properties, persistent)``; returns one Send."""
        batch = []
        for body, properties, persistent in items:
            seq = self.next_seq
            self.next_seq += 1
            it = (seq, body, properties or {}, bool(persistent))
            self.unconfirmed[seq] = it
            self.unconfirmed_bytes += len(body)
            batch.append(it)
        if not batch:
            return []
        return self._send_waiting()

    def _send_waiting(self) -> list:
        """The publishes not yet sent, while batch slots are free (:meth:`_batches`)."""
        if self.master_dst is None:
            return []
        out: list = []
        for msg in self._batches():
            out += self._to_master(msg)
        return out

    def _batches(self, window: bool = True) -> list:
        """``Publish`` messages of the oldest publishes not yet sent, one per
        free batch slot (all of them without the ``window``), each of at most
        MAX_BATCH_BYTES (or one publish)."""
        msgs: list = []
        last = self.next_seq - 1
        get = self.unconfirmed.get
        while (not window or len(self.batches) < MAX_PUBLISH_BATCHES) and self.sent_upto < last:
            items: list = []
            total = 0
            for s in range(self.sent_upto + 1, last + 1):
                it = get(s)
                if it is None:
                    continue  # settled already (a resend's confirm came first)
                # m.publish_item_size(it), inline: this runs once per publish
                n = len(it[1]) + ITEM_BYTES
                p = it[2]
                if p:
                    n += ENTRY_BYTES * len(p)
                    h = p.get("headers")
                    if h:
                        n += ENTRY_BYTES * len(h)
                if items and total + n > MAX_BATCH_BYTES:
                    break
                items.append(it)
                total += n
            if not items:
                self.sent_upto = last
                break
            self.sent_upto = items[-1][0]
            self.batches.append(self.sent_upto)
            msgs.append(
                m.Publish(self.queue, self.channel, tuple(items), MESSAGE_BYTES + total, next(iter(self.unconfirmed)))
            )
        return msgs

    def _to_master(self, msg: Any) -> list:
        """``msg`` to the current master, behind the settlements recorded so far."""
        return self.flush(0.0) + [Send(self.master_dst, msg)]

    def request_id(self) -> int:
        """A fresh request id (for :meth:`consume` with ``request_id``)."""
        self.next_request += 1
        return self.next_request

    def consume(
        self,
        now: float,
        consumer_tag: str,
        *,
        no_ack: bool = False,
        prefetch: int = 0,
        arguments: dict | None = None,
        exclusive: bool = False,
        request_id: int | None = None,
        lookahead: int = 0,
    ) -> list:
        """Register a consumer (again with every new master).  With a
        ``request_id`` (from :meth:`request_id`) the master answers
        :class:`CommandDone` with it once the consumer is registered or refused.
        ``lookahead``: deliveries beyond ``prefetch`` the caller holds for the
        client itself (the master may send them when nobody else needs them)."""
        c = m.Consume(
            self.queue,
            self.channel,
            consumer_tag,
            no_ack,
            prefetch,
            bool(exclusive),
            dict(arguments or {}),
            request_id,
            lookahead,
        )
        self.consumers[consumer_tag] = c
        return self._to_master(c) if self.master_dst is not None else []

    def cancel(self, now: float, consumer_tag: str) -> list:
        self.consumers.pop(consumer_tag, None)
        return self._to_master(m.Cancel(self.queue, self.channel, consumer_tag))

    def settle(self, now: float, epoch: str, ack=(), requeue=(), discard=(), release=(), credit=()) -> list:
        """Record settlements of ``epoch``'s deliveries; they leave with the
        next :meth:`flush` (or ahead of the next message to the master).
        ``release``: deliveries given back that the client never saw;
        ``credit``: ``(consumer_tag, bytes)`` of link credit given back."""
        if epoch in self.past_masters:
            return []  # delivered by a master that is gone: requeued already
        rec = self.settles.get(epoch)
        if rec is None:
            rec = self.settles[epoch] = ([], [], [], [], [])
        rec[0].extend(ack)
        rec[1].extend(requeue)
        rec[2].extend(discard)
        rec[3].extend(release)
        rec[4].extend(credit)
        return []

    def flush(self, now: float) -> list:
        """One Settle per master with everything recorded since the last flush."""
        if not self.settles:
            return []
        out = []
        recorded, self.settles = self.settles, {}
        for epoch, (ack, requeue, discard, release, credit) in recorded.items():
            msg = m.Settle(
                self.queue,
                self.channel,
                epoch,
                tuple(ack),
                tuple(requeue),
                tuple(discard),
                tuple(release),
                tuple(credit),
            )
            if epoch == self.master and self.master_dst is not None:
                out.append(Send(self.master_dst, msg))
            elif epoch not in self.past_masters:
                # delivered by a master we have not been told of yet (its
                # deliveries overtook the news): settle once we know where it is
                self.held_settles.setdefault(epoch, []).append(msg)
        return out

    def get(self, now: float, no_ack: bool = False) -> tuple[int, list]:
        """A basic.get; exactly one :class:`GetResult` with the returned
        request id follows (resent to a new master until answered)."""
        self.next_request += 1
        rid = self.next_request
        self.pending_gets[rid] = (bool(no_ack), {self.master: bool(no_ack)})
        if self.master_dst is None:
            return rid, []
        return rid, self._to_master(m.Get(self.queue, self.channel, rid, bool(no_ack)))

    def _get_answered(self, request_id: Any, d: Delivery | None) -> tuple[bool, list]:
        """(is this the first answer to the get, actions it needs)."""
        entry = self.pending_gets.pop(request_id, None)
        if entry is None:
            # a second answer (or one for a get we never sent): give its message back
            if d is not None:
                return False, self.settle(0.0, d.epoch, release=[d.offset])
            return False, []
        client_no_ack, sent = entry
        if d is not None and client_no_ack and sent.get(d.epoch, True) is False:
            return True, self.settle(0.0, d.epoch, ack=[d.offset])  # a resend asked for an acked get
        return True, []

    def command(self, now: float, command: str, **args: Any) -> tuple[int, list]:
        self.next_request += 1
        cmd = m.QueueCommand(self.queue, self.channel, self.next_request, command, args)
        self.pending_commands[self.next_request] = cmd
        if self.master_dst is None:
            return self.next_request, []
        return self.next_request, self._to_master(cmd)

    def resend_commands(self, now: float) -> list:
        """The unanswered commands, sent again to the current master: for a
        driver that heard ``Refused`` from the replica it takes for the master
        while the registry still names that replica (it refused before its
        promotion was complete), so no ``NewMaster`` will resend them."""
        if self.master_dst is None:
            return []
        return [Send(self.master_dst, cmd) for cmd in self.pending_commands.values()]

    def close(self, now: float) -> list:
        """The channel is closing: every publish it was given and has not sent
        yet goes to the master now (in batches of at most MAX_BATCH_BYTES,
        whatever the batch window), then ``ChannelClosed`` behind them, so
        the queue takes everything published before the close.  (What it
        had sent and the master had not confirmed is the master's: a failover
        meanwhile loses it unless the publisher used confirms, whose resends
        end with the channel.)"""
        if self.master_dst is None:
            return []
        out: list = []
        for msg in self._batches(window=False):
            out += self._to_master(msg)
        return out + self._to_master(m.ChannelClosed(self.queue, self.channel))

    # ---- replies ------------------------------------------------------------------
    def receive(self, now: float, src: Any, msg: Any) -> list:
        if isinstance(msg, m.Confirm):
            out = []
            acks, acked = self._settled(msg.acks)
            nacks, nacked = self._settled(msg.nacks)
            if acks:
                out.append(Emit(Confirmed(acks, acked)))
            if nacks:
                out.append(Emit(Nacked(nacks, msg.reason, nacked)))
            oldest = next(iter(self.unconfirmed), self.next_seq)
            while self.batches and self.batches[0] < oldest:
                self.batches.popleft()  # every publish of that message is settled
            return out + self._send_waiting()
        if isinstance(msg, m.Deliveries):
            if msg.seq:
                # Thespian may reorder two messages between the same actors:
                # hand deliveries over in the order the master sent them
                want = self.next_dseq.get(msg.epoch, 1)
                if msg.seq != want:
                    if msg.seq > want:
                        self.early_deliveries.setdefault(msg.epoch, {})[msg.seq] = msg
                    return []
                out = self._deliveries(msg)
                self.next_dseq[msg.epoch] = want + 1
                early = self.early_deliveries.get(msg.epoch, {})
                while self.next_dseq[msg.epoch] in early:
                    out += self._deliveries(early.pop(self.next_dseq[msg.epoch]))
                    self.next_dseq[msg.epoch] += 1
                return out
            return self._deliveries(msg)
        if isinstance(msg, m.GetEmpty):
            first, acts = self._get_answered(msg.request_id, None)
            return [Emit(GetResult(msg.request_id, None))] if first else []
        if isinstance(msg, m.ConsumerCancelled):
            self.consumers.pop(msg.consumer_tag, None)
            return [Emit(Cancelled(msg.consumer_tag, msg.reason))]
        if isinstance(msg, m.CommandResult):
            self.pending_commands.pop(msg.request_id, None)
            return [Emit(CommandDone(msg.request_id, msg.ok, msg.value, msg.error, msg.code))]
        if isinstance(msg, m.NotMaster):
            return [Emit(Refused(msg.master))]
        if isinstance(msg, m.NewMaster):
            return self.new_master(now, msg.master, msg.dst)
        raise TypeError(f"channel {self.channel!r}: unexpected message {type(msg).__name__}")

    def _deliveries(self, msg: m.Deliveries) -> list:
        evs = [Delivery(tag, msg.epoch, off, mid, body, props, red) for tag, off, mid, body, props, red in msg.items]
        if msg.request_id is not None:
            first, acts = self._get_answered(msg.request_id, evs[0])
            return acts + ([Emit(GetResult(msg.request_id, evs[0], msg.remaining))] if first else [])
        return [Emit(e) for e in evs]

    def _settled(self, seqs: tuple) -> tuple[tuple, int]:
        """Forget the unconfirmed publishes ``seqs`` names: the seqs that were
        unconfirmed and their bodies' bytes."""
        pop = self.unconfirmed.pop
        out = []
        nbytes = 0
        for s in seqs:
            it = pop(s, None)
            if it is not None:
                out.append(s)
                nbytes += len(it[1])
        self.unconfirmed_bytes -= nbytes
        return tuple(out), nbytes

    def confirm_all(self) -> Confirmed:
        """Every unconfirmed publish counts as confirmed (its queue is gone)."""
        ev = Confirmed(tuple(self.unconfirmed), self.unconfirmed_bytes)
        self.unconfirmed.clear()
        self.unconfirmed_bytes = 0
        return ev

    def new_master(self, now: float, master: str, dst: Any) -> list:
        """The queue's master is now ``master`` at ``dst``: resend what is
        unconfirmed (in order) and re-register consumers."""
        if master == self.master and dst == self.master_dst:
            return []
        if master in self.past_masters:
            # stale news (a registry read older than the NewMaster we already
            # had): a replaced master never becomes master again (member
            # names are unique for ever), so going back to it would void the
            # current master's deliveries and drop their settlements
            return []
        if self.master is not None and 0 <= epoch_term(master) <= epoch_term(self.master):
            # a quorum queue's leaders are epochs "member#term": news of a term
            # not above the current one's is stale (a deposed leader's late word)
            return []
        failover = self.master is not None
        if self.master is not None:  # failover
            self.past_masters.add(self.master)
        self.master, self.master_dst = master, dst
        self.early_deliveries = {e: d for e, d in self.early_deliveries.items() if e == master}  # others are void
        self.batches.clear()
        self.sent_upto = next(iter(self.unconfirmed)) - 1 if self.unconfirmed else self.next_seq - 1
        out: list = [Send(dst, p) for p in self._batches()]
        for tag, c in list(self.consumers.items()):
            if failover and c.arguments.get("x-cancel-on-ha-failover") is True:
                del self.consumers[tag]
                out.append(Emit(Cancelled(tag, "ha-failover")))
            else:
                out.append(Send(dst, c))
        for rid, (_no_ack, sent) in self.pending_gets.items():
            sent[master] = False  # acknowledged: a second answer's message can be given back
            out.append(Send(dst, m.Get(self.queue, self.channel, rid, False)))
        out += self.resend_commands(now)
        out += [Send(dst, st) for st in self.held_settles.pop(master, [])]
        self.held_settles = {e: v for e, v in self.held_settles.items() if e not in self.past_masters}
        self.settles = {e: v for e, v in self.settles.items() if e not in self.past_masters}
        return out + self.flush(now)
