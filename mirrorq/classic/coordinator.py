"""coordinator: the master's behaviour (amqqueue_process + mirror_queue_master).

The master runs the queue's semantics (:class:`~.amqqueue.AMQQueue`) on its
backing queue.  Every record the backing queue appends is collected
(``bq.on_append``) and, at the end of the handler that caused it, broadcast
through GM as ONE payload with the part of the state that is not in the log
(publisher high-water marks, consumer-table changes).  So one client batch
costs one GM broadcast, and GM packs many broadcasts into one message per
hop.  A handler takes at most :data:`~mirrorq.bounds.MAX_BATCH_BYTES` of
requests (``QueueReplica.receive_many``), so a payload stays about that
size.

What the master promises
------------------------
* **Publisher confirms** are sent when the GM round of the broadcast that
  carried the publish completes: every member of the current view has applied
  it and, for a durable queue, fsync'd it (a replica flushes its store before
  it forwards anything, see :mod:`.replica`).  The broadcast names the
  confirms its round earns, and the last mirror of the ring (the master's
  left), which knows it one hop before the master (GM's ``AllHold``, as it
  forwards the round's marker home), sends them to the publishers; the
  master, when the round completes, sends the same confirms again
  :data:`.confirms.CONFIRM_BACKUP_DELAY` later (one message per publisher for all the
  rounds of that while), so a confirm lost with that mirror still comes --
  channels drop a confirm they already had.  A master alone in its view, and
  duplicates confirmed at once, answer directly.  A publish refused by
  x-overflow=reject-publish or reject-publish-dlx (or for an
  x-publisher-ref gap) is nacked, the nack held like a confirm until the
  broadcast of the turn (the publisher's high-water mark, the REFUSED
  record naming the seq -- see below; with reject-publish-dlx and a
  dead-letter exchange also the refused message's PUBLISH, DELIVER and
  DEAD_LETTER records) is replicated.
* **Deliveries leave at once: at-least-once.**  A message the master has
  accepted is handed to a waiting consumer in the same turn, without
  waiting for its mirrors (RabbitMQ's master, too, delivers while its
  mirrors replicate).  For a durable queue the turn's ``Persist``, which
  precedes every send of the turn (:mod:`mirrorq.sansio`), has written the
  message to the master's own store first.  Nor does a delivery wait for
  the replication of its DELIVER record.  A channel's deliveries of one
  handler leave as ``Deliveries`` messages of at most
  :data:`~mirrorq.bounds.MAX_BATCH_BYTES` each (estimated; a bigger message
  alone), numbered per channel in send order (the channel restores it);
  a channel's deliveries never overtake a held reply to that channel (a
  basic.get answer, a consumer cancellation, a command result: see
  below): they are held behind it and leave with it, in order.  What this
  keeps when the master dies:

  - *confirmed messages are never lost*: a confirm waits for every member
    of the view (above), and the promotion keeps every operation any
    survivor holds;
  - *a message delivered and then lost with its master was never
    confirmed* (its PUBLISH had not reached every member), so its
    publisher resends it to the new master, which enqueues it again and
    may deliver it again -- as a first delivery, ``redelivered=false``
    (RabbitMQ does the same);
  - *a message the survivors hold may have been delivered*: the new master
    marks ``redelivered=true`` on the first delivery of every message that
    was in the log when it was promoted (``suspect_below``), since a
    DELIVER the mirrors never got leaves that message ready there (the
    old master's delivery of it, still on its way, may even arrive after
    that redelivery);
  - *a message whose ACK was replicated is never delivered again*: its
    PUBLISH went before it through the same ring, so a resend of it is a
    duplicate (the replicated high-water mark) and is not enqueued.

  ``ha-deliver-mode: replicated`` (policy key, or the queue argument
  ``x-ha-deliver-mode``, which wins) delivers a message only once its
  PUBLISH is held by every member of the view (``replicated_offset``;
  the deliveries of messages not yet there are held until the round that
  carries them completes): a consumer then never gets a message that a
  failover can take back, and no publish is delivered twice as a first
  delivery, at the cost of a ring round before each delivery of a new
  message.  ``immediate`` is the default.  A master handing over
  (:meth:`~.replica.QueueReplica.hand_over`) delivers as ``replicated``
  from its announcement on: what it broadcast before is held by every
  member before it leaves, what it accepts after may not be, so a planned
  migration repeats no first delivery.
* **Other replies wait for replication.**  basic.get answers, command results
  and consumer cancellations caused by a handler are released with the
  confirm of that handler's broadcast (replies that follow them are queued
  behind them, so a channel sees them in order).  The answers of the
  commands that change nothing in the log leave at once: ``info`` (what
  ``list_queues`` and the management API show), ``sync`` and
  ``cancel_sync``; so a mirror that holds the ring up (stopped, or cut off
  and not yet reported down) does not hide the queue from its operators.
* **In-flight publishes survive a master's death** by the publisher resending
  (this is the "something better" than RabbitMQ's publish-to-all-mirrors, which
  sends every message to every mirror): a channel keeps each publish until
  confirmed and, when the queue's master changes, sends the unconfirmed ones
  again, in order, to the new master.  Each publisher numbers its publishes
  1, 2, 3...; the master processes one publisher's publishes in order, so
  ``hwm[publisher]`` (replicated with the operations) says exactly which seqs
  are in the log -- except those the master refused: each refusal is
  written to the log as a ``REFUSED`` record (the publisher's refused seqs
  as runs, :mod:`.backing_queue`), so the mirrors, a mirror synced later
  and a replica restarted from its store all hold it.  A resent seq the
  queue refused is nacked again (reason :data:`REFUSED_BEFORE`), never
  enqueued nor dead-lettered a second time; any other resent seq <= hwm is
  a duplicate: it is confirmed (at once if its own broadcast is confirmed,
  else with it) and not enqueued.  A replica restarted from its store
  alone (a queue's only replica, after a crash) has no ``hwm``: a
  ``Publish`` says which seqs its publisher has settled (``settled_below``,
  the channel's oldest unconfirmed seq), so the master takes every seq
  below it as held instead of waiting for them, and a resent seq whose
  message is live in its store (written before the crash, its confirm
  lost with it) is confirmed, not stored twice.  So no publish is acked unless the queue
  stored it, and publishes are neither lost nor duplicated, unless the
  publisher's own node dies too (then it is the client's business, as in
  AMQP).  Refusals are forgotten by a bounded rule: per publisher, the
  highest :data:`.backing_queue.MAX_REFUSED_RUNS` (64) runs of refused seqs
  are kept (refusing, accepting, refusing... a publisher's publishes makes
  one run per refusal), and none once its channel closes or its front end
  is gone (``dst_down``).  The limit of the guarantee: a resent seq whose
  run was pushed out by 64 later runs (all of them refused before the
  publisher heard the first nack) is acked as a duplicate.
  Thespian may deliver two batches of one publisher out of order (a send
  that meets backpressure is retried later while later sends go ahead), so
  the master enqueues strictly in seq order and keeps seqs after a gap
  until it is filled.
* Settlements (ack/reject/nack) name the master that delivered the messages
  (``epoch``); others are void, their messages were requeued on failover.
* **Dead-lettering** (:class:`~mirrorq.queues.messages.DeadLetter`): a message the queue
  dead-letters is sent to the node's dead-letter router
  (``replica.dead_letter_dst``, the front end) once the DEAD_LETTER record
  naming it is held by every member of the view (it is a held reply, like a
  confirm), and is removed (ACK) when the router answers
  :class:`~mirrorq.queues.messages.DeadLetterDone`.  Until then it is sent again every
  :data:`DEAD_LETTER_RETRY` seconds, and a new master (or a restarted one)
  sends every such message it holds at once; the router de-duplicates by
  the messages' dead-letter sequence numbers, so a failover neither loses
  nor doubles a dead-lettered message.
* **Deliveries, acks and requeues are replicated lazily.**  A handler that
  appended only such records (a consumer acking, the queue delivering the
  next messages) promises nobody anything that waits for replication, so
  its records wait, at most :data:`LAZY_OPS_DELAY`, for the next broadcast
  (they go first in it, in log order) instead of costing a ring round each.
  A failover in that window redelivers what they acked (flagged
  ``redelivered``): at-least-once, as for any ack not yet replicated.

Assumes one master per view, which promotion (:mod:`.promotion`)
guarantees.  Bad client input (unknown consumer, ack of a message that is not
unacked by that channel...) gets an error reply naming it; nothing is applied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypedDict, cast

from mirrorq.amqp.properties import DEAD_LETTER_REF, PUBLISHER_REF
from mirrorq.bounds import MAX_BATCH_BYTES, MESSAGE_BYTES
from mirrorq.classic import amqqueue as aq
from mirrorq.classic import confirm_probe, history, sync
from mirrorq.classic import payloads as pl
from mirrorq.classic.confirms import CONFIRM_BACKUP_DELAY, ConfirmLedger
from mirrorq.queues import semantics
from mirrorq.queues.messages import (
    DEAD_LETTER_RETRY,
    Cancel,
    ChannelClosed,
    ChannelId,
    CommandResult,
    Confirm,
    Consume,
    ConsumerCancelled,
    DeadLetter,
    DeadLetterDone,
    Deliveries,
    Get,
    GetEmpty,
    HwmKey,
    NewMaster,
    Publish,
    QueueCommand,
    Settle,
    channel_id,
    dead_letter_prefix,
    delivery_item_size,
)
from mirrorq.sansio import Action, CancelTimer, Emit, SetTimer

if TYPE_CHECKING:
    from mirrorq.classic.replica import QueueReplica

#: seconds a handler's delivery / ack / requeue records may wait for the next broadcast
LAZY_OPS_DELAY = 0.01
_LAZY_RTYPES = frozenset((2, 3, 4))  # DELIVER, ACK, REQUEUE (backing_queue.Op)
#: the nack reason of a resent publish this queue had refused
REFUSED_BEFORE = "the queue refused this publish before (a resend after a failover)"


def policy_dead_letter(policy: dict[str, Any] | None) -> tuple[str, str | None] | None:
    """``(exchange, routing key or None)`` from a policy definition, or None."""
    ex = (policy or {}).get("dead-letter-exchange")
    return None if ex is None else (ex, (policy or {}).get("dead-letter-routing-key"))


class Coordinator:
    """The master behaviour of a :class:`~mirrorq.classic.replica.QueueReplica`."""

    role = "master"

    def __init__(self, replica: QueueReplica, now: float) -> None:
        self.r = r = replica
        spec = r.spec
        consumers = [
            aq.Consumer(
                channel=c["channel"],
                consumer_tag=c["consumer_tag"],
                no_ack=c["no_ack"],
                prefetch=c["prefetch"],
                lookahead=c.get("lookahead", 0),
                exclusive=c["exclusive"],
                arguments=dict(c["arguments"]),
            )
            for c in r.consumers.values()
        ]
        self.queue = aq.AMQQueue(
            spec.name,
            r.bq,
            durable=spec.durable,
            auto_delete=spec.auto_delete,
            exclusive_owner=spec.exclusive_owner,
            arguments=dict(spec.arguments),
            consumers=consumers,
        )
        r.bq.on_append = self._on_append
        self._ops: list[list[Any]] = []  # [offset, rtype, body] of the records appended
        self._hwm_changes: dict[HwmKey, int] = {}
        self._consumer_changes: list[list[Any]] = []  # ["add", record] / ["remove", channel, tag]
        self._replies: dict[str, list[_Reply]] = {}  # dst -> messages, in order, this handler
        self.ledger = ConfirmLedger()  # the confirms: earned this handler, owed per round, backed up
        self._acked: list[int] = []  # msg offsets acked this handler (for AcksReplicated)
        self.held: deque[_Held] = deque()  # our broadcasts' rounds not yet completed, oldest first
        # every message below this offset is held by every member of the view
        # (at creation: founders, a recovered store, a promotion's agreed prefix)
        self.replicated_offset = r.bq.log.next_offset
        self.suspect_below = 0  # promoted: messages below this may have been delivered by the old master
        # channel -> held replies to it not yet sent (its deliveries queue behind them)
        self._held_for: dict[ChannelId, int] = {}
        self._lazy_ops: list[list[Any]] = []  # records waiting for the next broadcast (LAZY_OPS_DELAY)
        self._lazy_acked: list[int] = []
        self._lazy_armed = False
        self.early: dict[ChannelId, dict[int, tuple[Any, ...]]] = {}  # publisher -> {seq: item} beyond a gap
        self._dseq: dict[ChannelId, int] = {}  # channel -> Deliveries messages sent
        self._probe: _Probe | None = None  # a running confirm_probe
        self._probe_id = 0
        self.transfers: dict[str, sync.Transfer] = {}  # mirror member -> running sync
        self.sync_waiting: dict[str, Any] = {}  # manual mode: mirrors waiting for sync_queue
        self.sync_invited: set[str] = set()
        self._housekeeping_armed = False
        self._confirm_timer = False
        self._deleted: aq.QueueDeleted | None = None
        self._deleted_sent = False
        self.replicated_gm = 0  # our broadcasts every member of the view holds
        self._backup_armed = False
        self.queue.policy_dead_letter = policy_dead_letter(r.policy)
        self._dl_timer = False
        self._dl_in_flight = False  # a DeadLetter is unanswered (stop and wait, see _send_dead_letters)

    # ---- entry points -------------------------------------------------------------
    def promote(self, now: float) -> list[Action]:
        """Actions of a freshly promoted master (after ``promoted`` was broadcast)."""
        r = self.r
        self.suspect_below = r.bq.log.next_offset
        r.bq.begin_epoch(
            r.member
        )  # the first record of its mastership (where sync finds a deposed master's log parting)
        actions = self._events(now, self.queue.promote(now))
        actions += self._send_dead_letters(now)
        actions += self._end(now)
        note = NewMaster(r.spec.name, r.member, r.dst)
        dsts = {c[0] for c in r.hwm if c[0] not in history.NOT_CHANNELS} | {
            c["channel"][0] for c in r.consumers.values()
        }
        actions += [r.send(d, note) for d in sorted(dsts, key=repr)]
        return actions

    def start(self, now: float) -> list[Action]:
        """A fresh (or recovered) master arms the queue's timers; a fresh
        one's log opens with its epoch."""
        if not self.r.bq.log.next_offset:
            self.r.bq.begin_epoch(self.r.member)
        actions = self._events(now, self.queue.start(now))
        return actions + self._send_dead_letters(now) + self._end(now)

    def handle(self, now: float, src: Any, msg: Any) -> list[Action]:
        return self._handle(now, msg) + self._end(now)

    def handle_many(self, now: float, msgs: list[Any]) -> list[Action]:
        """Several requests as one handler: one broadcast for all of them."""
        actions: list[Action] = []
        for msg in msgs:
            actions += self._handle(now, msg)
        return actions + self._end(now)

    def _handle(self, now: float, msg: Any) -> list[Action]:
        actions: list[Action] = []
        if isinstance(msg, Publish):
            actions += self._publish(now, msg)
        elif isinstance(msg, Settle):
            actions += self._settle(now, msg)
        elif isinstance(msg, Consume):
            actions += self._consume(now, msg)
        elif isinstance(msg, Cancel):
            ch = channel_id(msg.channel)
            actions += self._guard(ch, None, lambda: self.queue.cancel(now, ch, msg.consumer_tag))
            if (ch, msg.consumer_tag) in self.r.consumers:
                self._consumer_changes.append(["remove", list(ch), msg.consumer_tag])
                del self.r.consumers[(ch, msg.consumer_tag)]
        elif isinstance(msg, Get):
            ch = channel_id(msg.channel)
            actions += self._guard(ch, msg.request_id, lambda: self.queue.get(now, ch, msg.request_id, msg.no_ack))
        elif isinstance(msg, ChannelClosed):
            actions += self._channel_gone(now, channel_id(msg.channel))
        elif isinstance(msg, QueueCommand):
            actions += self._command(now, msg)
        elif isinstance(msg, DeadLetterDone):
            self.queue.dead_lettered(self.r.bq.dead_letter_offsets(msg.seqs))
            self._dl_in_flight = False
            actions += self._send_dead_letters(now)
        elif isinstance(msg, confirm_probe.Progress):
            actions += self._probe_answer(msg)
        elif isinstance(msg, confirm_probe.ProgressQuery):
            pass  # asked while this replica was a mirror; it is the master now
        elif isinstance(msg, (sync.SyncRequest, sync.SyncAck, sync.SyncDone)):
            actions += self._sync(now, msg)
        else:
            raise TypeError(f"queue {self.r.spec.name!r}: unexpected message {type(msg).__name__}")
        return actions

    def deliver_replicated(self) -> bool:
        """``ha-deliver-mode: replicated`` (the queue's ``x-ha-deliver-mode``
        argument, else its policy's key): a message goes to a consumer only
        once every member of the view holds its PUBLISH."""
        if self.r.handover is not None:
            return True  # leaving: what it accepts now may not reach its successor
        mode = self.r.spec.arguments.get("x-ha-deliver-mode") or self.r.policy.get("ha-deliver-mode")
        return mode == "replicated"

    def policy_changed(self) -> None:
        """The queue's policy changed: its dead-letter exchange may have."""
        self.queue.policy_dead_letter = policy_dead_letter(self.r.policy)

    def flush_lazy(self, now: float) -> list[Action]:
        """Broadcast the lazily held records now (before the master leaves)."""
        return self._end(now, force=True)

    def _channel_gone(self, now: float, ch: ChannelId) -> list[Action]:
        """A channel closed, or died with its node: its consumers go, its
        unacked messages are requeued (redelivered), as RabbitMQ does --
        unless the queue was deleted meanwhile (an auto-delete queue goes
        with the cancel that comes just before its channel's close)."""
        self.early.pop(ch, None)
        self._dseq.pop(ch, None)
        if self._deleted is None:
            self.r.bq.forget_refused(ch)  # it resends nothing any more
            actions = self._events(now, self.queue.channel_down(now, ch))
        else:
            actions = []
        for key in [k for k in self.r.consumers if k[0] == ch]:
            self._consumer_changes.append(["remove", list(ch), key[1]])
            del self.r.consumers[key]
        return actions

    def channel_dsts(self) -> list[str]:
        """Where the channels holding consumers or unacked messages, or
        publishers with refused seqs, live (front ends' addresses), to probe
        after a node died."""
        return sorted(
            {_channel(ch)[0] for ch in self.queue.channels()}
            | {_channel(p)[0] for p in self.r.bq.refused_publishers()},
            key=str,
        )

    def dst_down(self, now: float, dst: Any) -> list[Action]:
        """Nothing listens at ``dst`` any more (the front end's node or process
        died): every channel there is gone -- no ghost consumer keeps
        messages unacked for ever."""
        return self._channels_gone(now, dst, lambda ch: ch[0] == dst)

    def channels_live(self, now: float, dst: Any, keys: frozenset[int]) -> list[Action]:
        """The front end at ``dst`` answered a probe: its live connections'
        channel keys are ``keys``; its other channels here closed while we
        could not hear it (a partition, a paused node) and are gone."""
        return self._channels_gone(now, dst, lambda ch: ch[0] == dst and (ch[1] >> 32) not in keys)

    def _channels_gone(self, now: float, dst: Any, is_gone: Callable[[ChannelId], bool]) -> list[Action]:
        gone = [ch for ch in map(_channel, self.queue.channels()) if is_gone(ch)]
        actions: list[Action] = []
        for ch in sorted(gone, key=str):
            actions += self._channel_gone(now, ch)
        for p in sorted(self.r.bq.refused_publishers(), key=str):
            if is_gone(_channel(p)):
                self.r.bq.forget_refused(p)
        if gone:
            self.r.log_event("channels_gone", dst=str(dst), channels=len(gone))
        return actions + self._end(now)

    def timer(self, now: float, key: Hashable) -> list[Action]:
        if key == "lazy-ops":
            self._lazy_armed = False
            return self._end(now, force=True)
        if key == "sync-housekeeping":
            return self._housekeeping(now)
        if key == "confirm-timeout":
            return self._confirm_timeouts(now)
        if key == "confirm-backup":
            self._backup_armed = False
            backup = self.ledger.take_backup()
            return [self.r.send(p[0], Confirm(self.r.spec.name, p, tuple(seqs))) for p, seqs in backup.items()]
        if key == "probe-deadline":
            return self._probe_end()
        if key == "dead-letter-retry":
            self._dl_timer = False
            return self._send_dead_letters(now, retry=True) + self._end(now)
        if key == "sync-retry":
            return []  # armed while this replica was a mirror, before its promotion
        return self._events(now, self.queue.timer(now, key)) + self._end(now)

    # ---- sync, the master's side (protocol: sync.py) -----------------------------------
    def _sync(self, now: float, msg: sync.SyncRequest | sync.SyncAck | sync.SyncDone) -> list[Action]:
        r = self.r
        name = r.spec.name
        if isinstance(msg, sync.SyncRequest):
            view = r.gm.view
            if view is None or msg.member not in view:
                return [r.send(msg.dst, sync.SyncRetry(name, "not in the master's view yet"))]
            mode = r.policy.get("ha-sync-mode", "manual")
            if mode != "automatic" and msg.member not in self.sync_invited and not self._nothing_to_sync(msg):
                self.sync_waiting[msg.member] = msg.dst
                return [r.send(msg.dst, sync.SyncWait(name))]
            self.sync_invited.discard(msg.member)
            self.sync_waiting.pop(msg.member, None)
            return self._start_transfer(now, msg)
        t = self.transfers.get(msg.member)
        if t is None or msg.req != t.req:
            return []  # of a transfer that was closed or replaced since
        if isinstance(msg, sync.SyncAck):
            t.acked = max(t.acked, msg.next_offset)
            while t.inflight and t.inflight[0] <= t.acked:
                t.inflight.popleft()
            t.last_activity = now
            return self._fill(t)
        # SyncDone
        del self.transfers[msg.member]
        self._retain()
        r.synced_members.add(msg.member)
        r.log_event("mirror_synchronised", mirror=msg.member, records=t.sent)
        return r.broadcast(now, pl.Synced(msg.member)) + [Emit(SyncState(tuple(sorted(r.synced_members))))]

    def _nothing_to_sync(self, msg: sync.SyncRequest) -> bool:
        """Manual mode still lets a mirror in at once when it lacks nothing
        (its log ends where ours does, with the same record) or when the queue
        holds no message (consumers drained what it lacked): RabbitMQ counts
        such a mirror as synchronised."""
        log = self.r.bq.log
        if self.r.bq.message_count == 0:
            return True
        if msg.next_offset != log.next_offset or msg.last_offset < log.first_offset:
            return False
        try:
            rec = log.read_at(msg.last_offset)
        except KeyError:
            return False
        return sync.record_crc(rec.rtype, rec.body) == msg.last_crc

    def _start_transfer(self, now: float, msg: sync.SyncRequest) -> list[Action]:
        r = self.r
        log = r.bq.log
        same = False
        if 0 <= msg.last_offset and msg.next_offset <= log.next_offset and msg.last_offset >= log.first_offset:
            try:
                rec = log.read_at(msg.last_offset)
                same = sync.record_crc(rec.rtype, rec.body) == msg.last_crc
            except KeyError:
                same = False
        truncate = -1
        if r.bq.epochs and msg.epochs:
            # the epochs both logs hold say where they part (a last record
            # alike proves nothing: a deposed master's records may repeat ours
            # one by one at the same offsets after parting)
            point = sync.parting_point(r.bq.epochs, msg.epochs, log.next_offset, msg.next_offset)
            same = same and point is not None and msg.next_offset <= point
            if not same and point is not None and r.spec.durable and log.first_offset <= point < msg.next_offset:
                truncate = point  # it cuts its log back to there and takes the rest
        if same:
            start, reset = msg.next_offset, False
        elif truncate >= 0:
            start, reset = truncate, False
        else:
            start, reset = log.first_offset, msg.next_offset > 0
        consumers = [dict(c, channel=list(c["channel"])) for c in r.consumers.values()]
        t = sync.Transfer(msg.member, msg.dst, start, log.next_offset, now, req=msg.req, acked=start, start=start)
        self.transfers[msg.member] = t
        r.log_event(
            "sync_started",
            mirror=msg.member,
            start=start,
            until=t.until,
            reset=reset,
            truncate=truncate,
            mirror_next=msg.next_offset,
            first=log.first_offset,
        )
        st = sync.SyncStart(
            r.spec.name,
            start,
            t.until,
            r.gm.pub_count,
            reset,
            [[list(p), s] for p, s in r.hwm.items()],
            consumers,
            sorted(r.synced_members),
            req=msg.req,
            first=self._batch(t),
            truncate=truncate,
        )
        self._retain()
        actions: list[Action] = [r.send(msg.dst, st)]
        if not self._housekeeping_armed:
            self._housekeeping_armed = True
            actions.append(SetTimer(("q", "sync-housekeeping"), 1.0))
        return actions

    def _batch(self, t: sync.Transfer) -> sync.SyncBatch | None:
        """The next batch of ``t``: raw log bytes, one pread per segment, nothing per record."""
        if t.next >= t.until:
            return None
        size = int(self.r.policy.get("ha-sync-batch-size", sync.DEFAULT_BATCH))
        raw = self.r.bq.log.read_raw(
            t.next, max_records=size, max_bytes=sync.SYNC_BATCH_BYTES, until=t.until, include_pending=True
        )
        batch = sync.SyncBatch(self.r.spec.name, t.req, t.next, raw.next_offset, raw.count, raw.data)
        t.next = raw.next_offset
        t.inflight.append(raw.next_offset)
        t.sent += raw.count
        self.r.stats["sync_records_sent"] += raw.count
        return batch

    def _fill(self, t: sync.Transfer) -> list[Action]:
        """Keep ``SYNC_WINDOW`` batches in flight (the mirror reorders them by ``start``)."""
        out: list[Action] = []
        while len(t.inflight) < sync.SYNC_WINDOW:
            batch = self._batch(t)
            if batch is None:
                break
            out.append(self.r.send(t.dst, batch))
        if out:
            self._retain()
        return out

    def _retain(self) -> None:
        """Compaction must keep what a running transfer has still to read."""
        self.r.bq.retain_from = min((t.next for t in self.transfers.values()), default=None)

    def _housekeeping(self, now: float) -> list[Action]:
        self._housekeeping_armed = False
        for m, t in list(self.transfers.items()):
            if now - t.last_activity > sync.SYNC_TIMEOUT:
                del self.transfers[m]
                self.r.log_event("sync_timeout", level="warning", mirror=m, next=t.next, until=t.until)
        self._retain()
        if self.transfers:
            self._housekeeping_armed = True
            return [SetTimer(("q", "sync-housekeeping"), 1.0)]
        return []

    def sync_info(self) -> dict[str, str]:
        r = self.r
        view = r.gm.view
        out: dict[str, str] = {}
        for m in view.members if view is not None else ():
            if m == r.member:
                continue
            if m in self.transfers:
                t = self.transfers[m]
                out[m] = f"syncing {t.sent}"
            else:
                out[m] = "synchronised" if m in r.synced_members else "unsynchronised"
        return out

    def sync_progress(self) -> dict[str, dict[str, int]]:
        """Each running transfer's progress: records ``sent``, offsets
        ``start``, ``position`` (what the mirror acknowledged) and ``until``
        (where the transfer ends), for the management API's progress bars."""
        return {
            m: {"sent": t.sent, "start": t.start, "position": t.acked, "until": t.until}
            for m, t in self.transfers.items()
        }

    def on_ops(self, origin: str, payload: pl.Ops, gm_seq: int = 0) -> None:
        if origin != self.r.member:
            self.r.stats["foreign_ops"] += 1  # two masters in one view: must never happen

    def on_all_hold(self, now: float, origin: str, upto: int) -> list[Action]:
        return []  # the master learns it from its own round (on_confirmed)

    def on_confirmed(self, now: float, first: int, last: int) -> list[Action]:
        actions: list[Action] = []
        r = self.r
        self.replicated_gm = max(self.replicated_gm, last)
        if self.held and self.held[0].gm_seq <= last and history.enabled(r):
            history.log_confirms(r, self.ledger.confirms_upto(last))
        while self.held and self.held[0].gm_seq <= last:
            h = self.held.popleft()
            replies = h.replies
            self.replicated_offset = max(self.replicated_offset, h.upto)
            n = self.ledger.count(h.gm_seq)
            if n:  # the management counters: once per round, not per message
                r.stats["confirm"] += n
                r.confirm_latency.observe(now - h.at, n)
            direct, backed_up = self.ledger.held(h.gm_seq)
            for publisher, seqs in direct.items():
                replies.append((publisher[0], Confirm(r.spec.name, publisher, tuple(seqs))))
            if backed_up and not self._backup_armed:
                self._backup_armed = True
                actions.append(SetTimer(("q", "confirm-backup"), CONFIRM_BACKUP_DELAY))
            for dst, m in replies:
                actions.append(r.send(dst, self._numbered(m)))
            if h.acked:
                actions.append(Emit(AcksReplicated(tuple(h.acked))))
        return actions

    # ---- requests ---------------------------------------------------------------------
    def _publish(self, now: float, msg: Publish) -> list[Action]:
        """Enqueue a publisher's publishes in seq order.  Thespian does not
        keep two messages between the same actors in order when a send
        meets backpressure, so a batch may overtake an earlier one: seqs
        beyond ``hwm + 1`` wait in ``early`` until the gap is filled (by the
        late batch, or by the publisher's resend to a new master)."""
        r = self.r
        pub = channel_id(msg.publisher)
        hwm = max(r.hwm.get(pub, 0), msg.settled_below - 1)  # the publisher settled every seq below that
        pend = self.ledger.waiting(pub)
        early = self.early.setdefault(pub, {})
        for seq in [s for s in early if s <= hwm]:
            del early[seq]  # waited for a gap the publisher says is settled
        dup_now: list[int] = []
        refused_before: list[int] = []
        for item in msg.items:
            seq = item[0]
            if r.bq.was_refused(pub, seq):
                refused_before.append(seq)  # a resend of a publish this queue refused: refused again
            elif seq <= hwm:
                if seq not in pend:
                    dup_now.append(seq)  # already in the log and replicated
            else:
                early.setdefault(seq, item)
        accepted: list[int] = []
        refused: list[int] = []
        actions: list[Action] = []
        batch: list[aq.Publish] = []
        # seq -> x-publisher-ref key and its seq, for the batch's publishes that name one
        refs: dict[int, tuple[HwmKey, int]] = {}
        # a queue that may refuse a publish takes them one by one: a refused
        # publish's x-publishing-id is given back before the next is judged
        one_by_one = self.queue.may_refuse_publishes
        while hwm + 1 in early:
            seq, body, properties, persistent = early.pop(hwm + 1)
            hwm = seq
            ref = properties.get(PUBLISHER_REF) if properties else None  # x-publisher-ref / x-publishing-id
            if ref is not None and self._ref_seen(pub, seq, ref, accepted, refused, refs):
                continue
            dref = properties.get(DEAD_LETTER_REF) if properties else None  # from a dead-letter router
            if dref is not None and self._dead_letter_seen(seq, dref, accepted):
                continue
            msg_id = f"{pub[0]}|{pub[1]}|{seq}"
            if r.bq.holds(msg_id):
                dup_now.append(seq)  # held already: a resend to a master that lost the mark (see settled_below)
                continue
            batch.append(aq.Publish(pub, seq, msg_id, body, properties, persistent))
            if one_by_one:
                actions += self._enqueue(now, pub, batch, accepted, refused, refs)
                batch = []
        if batch:  # one call: one delivery round (one DELIVER record) for the whole batch
            actions += self._enqueue(now, pub, batch, accepted, refused, refs)
        accepted.sort()  # settled here and enqueued interleave: seq order for the confirms
        refused.sort()
        if not early:
            del self.early[pub]
        if refused:
            r.bq.refuse(pub, refused)  # in the log, so replicated with the high-water mark below
        if hwm > r.hwm.get(pub, 0):
            r.hwm[pub] = hwm
            self._hwm_changes[pub] = hwm
        if accepted:
            self.ledger.earn(pub, accepted)
        if dup_now:
            self._reply(pub[0], Confirm(r.spec.name, pub, tuple(dup_now)))
        if refused_before:
            r.stats["refused_resends"] += len(refused_before)
            self._reply(pub[0], Confirm(r.spec.name, pub, (), tuple(refused_before), REFUSED_BEFORE))
        return actions

    def _enqueue(
        self,
        now: float,
        pub: ChannelId,
        batch: list[aq.Publish],
        accepted: list[int],
        refused: list[int],
        refs: dict[int, tuple[HwmKey, int]],
    ) -> list[Action]:
        """Enqueue ``batch`` (in seq order) in one call; a publish the queue
        refuses (x-overflow) is nacked, and if it named an x-publisher-ref
        that ref's high-water mark goes back below it, so the client's retry
        of the same x-publishing-id is enqueued, not taken for a duplicate."""
        r = self.r
        ev = self.queue.publish_many(now, batch)
        rejected = {e.event.publish_id for e in ev if isinstance(e, Emit) and isinstance(e.event, aq.PublishRejected)}
        if rejected:
            ev = [e for e in ev if not (isinstance(e, Emit) and isinstance(e.event, aq.PublishRejected))]
            overflow = self.queue.arguments.get("x-overflow")
            for seq in sorted(rejected):
                self._reply(pub[0], Confirm(r.spec.name, pub, (), (seq,), f"x-overflow {overflow}: queue is full"))
                if seq in refs:
                    key, rseq = refs[seq]
                    if r.hwm.get(key, 0) >= rseq:
                        r.hwm[key] = rseq - 1
                        self._hwm_changes[key] = rseq - 1
            refused += rejected
        accepted += [p.publish_id for p in batch if p.publish_id not in rejected]
        if len(batch) > len(rejected):
            r.stats["publish"] += len(batch) - len(rejected)
        return self._events(now, ev)

    def _dead_letter_seen(self, seq: int, dref: Any, accepted: list[int]) -> bool:
        """A dead-lettered message names its source queue (incarnation
        included) and its dead-letter sequence number there; the router
        publishes a source's messages to this queue in increasing sequence
        order, never one after a higher one it had not published before it
        (see ``Coordinator._send_dead_letters``), so a number at or below the
        source's high-water mark here is a resend: confirmed, not enqueued.
        Kept and replicated like a channel's, under ``(DEAD_LETTER_KEY,
        source)``.  Returns True when the publish is settled here."""
        r = self.r
        try:
            key, dseq = (history.DEAD_LETTER_KEY, str(dref[0])), int(dref[1])
        except (TypeError, ValueError, IndexError):
            return False  # not ours to judge: enqueued as any publish
        if dseq <= r.hwm.get(key, -1):
            accepted.append(seq)
            r.stats["dead_letter_duplicates"] += 1
            return True
        r.hwm[key] = dseq
        self._hwm_changes[key] = dseq
        return False

    def _ref_seen(
        self,
        pub: ChannelId,
        seq: int,
        ref: Any,
        accepted: list[int],
        refused: list[int],
        refs: dict[int, tuple[HwmKey, int]],
    ) -> bool:
        """A publish that names its publisher (``x-publisher-ref``) and its
        seq there (``x-publishing-id``, 1, 2, 3... per ref) is enqueued only
        if that seq is the ref's next one: a lower seq is a replay (a retried
        Spark task, a restarted driver) and is confirmed without being
        enqueued; a higher one leaves a gap and is nacked.  The ref's
        high-water mark is kept and replicated like a channel's, under
        ``(REF_KEY, ref)``; a publish let through is noted in ``refs``
        (seq -> key, ref seq) so :meth:`_enqueue` can give its id back if
        the queue refuses it.  Returns True when the publish is settled here."""
        r = self.r
        try:
            name, rseq = str(ref[0]), int(ref[1])
        except (TypeError, ValueError, IndexError):
            name, rseq = "", 0
        key = (history.REF_KEY, name)
        if not name or rseq < 1:
            reason = f"x-publisher-ref/x-publishing-id must be a name and a seq >= 1, got {ref!r}"
        else:
            top = r.hwm.get(key, 0)
            if rseq <= top:
                accepted.append(seq)  # a duplicate: confirmed with this handler's broadcast
                r.stats["ref_duplicates"] += 1
                return True
            if rseq == top + 1:
                r.hwm[key] = rseq
                self._hwm_changes[key] = rseq
                refs[seq] = (key, rseq)
                return False
            reason = (
                f"x-publishing-id {rseq} of x-publisher-ref '{name}' leaves a gap: the queue holds "
                f"up to {top}, so the next must be {top + 1}"
            )
        self._reply(pub[0], Confirm(r.spec.name, pub, (), (seq,), reason))
        refused.append(seq)
        if history.enabled(r):
            history.log_nacks(r, pub, (seq,), reason)
        return True

    def _settle(self, now: float, msg: Settle) -> list[Action]:
        ch = channel_id(msg.channel)
        if msg.epoch != self.r.member:
            self.r.stats["void_settlements"] += 1
            return []
        actions: list[Action] = []
        if msg.ack:
            self.r.stats["ack"] += len(msg.ack)
            actions += self._guard(ch, None, lambda: self.queue.ack(now, ch, list(msg.ack)))
        requeue = list(msg.requeue) + list(msg.release)  # a classic queue requeues both
        if requeue:
            actions += self._guard(ch, None, lambda: self.queue.reject(now, ch, requeue, True))
        if msg.discard:
            actions += self._guard(ch, None, lambda: self.queue.reject(now, ch, list(msg.discard), False))
        if msg.credit:
            actions += self._guard(ch, None, lambda: self.queue.link_credit(now, ch, msg.credit))
        return actions

    def _consume(self, now: float, msg: Consume) -> list[Action]:
        ch = channel_id(msg.channel)
        key = (ch, msg.consumer_tag)
        rid = getattr(msg, "request_id", None)  # set: answer ok too (AMQP sends consume-ok on it)
        if key in self.r.consumers:
            if rid is not None:
                self._reply(ch[0], CommandResult(self.r.spec.name, ch, rid, True))
            return []  # a channel re-registering after a failover: it is known
        actions = self._guard(
            ch,
            rid,
            lambda: self.queue.consume(
                now,
                ch,
                msg.consumer_tag,
                no_ack=msg.no_ack,
                prefetch=msg.prefetch,
                exclusive=msg.exclusive,
                arguments=dict(msg.arguments),
                lookahead=msg.lookahead,
            ),
        )
        if any(c.channel == ch and c.consumer_tag == msg.consumer_tag for c in self.queue.consumers):
            rec = {
                "channel": ch,
                "consumer_tag": msg.consumer_tag,
                "no_ack": msg.no_ack,
                "prefetch": msg.prefetch,
                "exclusive": msg.exclusive,
                "arguments": dict(msg.arguments),
                "lookahead": msg.lookahead,
            }
            self.r.consumers[key] = rec
            self._consumer_changes.append(["add", dict(rec, channel=list(ch))])
            if rid is not None:
                self._reply(ch[0], CommandResult(self.r.spec.name, ch, rid, True))
        return actions

    def _command(self, now: float, msg: QueueCommand) -> list[Action]:
        ch = channel_id(msg.channel)
        name = self.r.spec.name
        if msg.command == "info":  # a read: nothing in it waits for the ring
            return [self.r.send(ch[0], CommandResult(name, ch, msg.request_id, True, self.r.info()))]
        if msg.command == "sync":
            r = self.r
            waiting = dict(self.sync_waiting)
            self.sync_invited |= set(waiting)
            self.sync_waiting.clear()
            # also the unsynchronised mirrors whose request has not arrived yet
            view = r.gm.view
            self.sync_invited |= {
                m
                for m in (view.members if view is not None else ())
                if m != r.member and m not in r.synced_members and m not in self.transfers
            }
            answer = CommandResult(
                name, ch, msg.request_id, True, {"invited": sorted(waiting), "running": sorted(self.transfers)}
            )
            invites: list[Action] = [r.send(dst, sync.SyncInvite(name)) for m, dst in sorted(waiting.items())]
            return [r.send(ch[0], answer), *invites]
        if msg.command == "cancel_sync":
            r = self.r
            cancelled = sorted(self.transfers)
            out: list[Action] = [r.send(t.dst, sync.SyncCancelled(name)) for t in self.transfers.values()]
            self.transfers.clear()
            self._retain()
            self.sync_invited.clear()
            return [r.send(ch[0], CommandResult(name, ch, msg.request_id, True, {"cancelled": cancelled}))] + out
        if msg.command.startswith("stream_"):
            return self._stream(now, ch, msg)
        if msg.command == "purge":
            return self._guard_result(ch, msg.request_id, lambda: self.queue.purge(now))
        if msg.command == "delete":
            a = msg.args
            return self._guard_result(
                ch,
                msg.request_id,
                lambda: self.queue.delete(now, if_unused=bool(a.get("if_unused")), if_empty=bool(a.get("if_empty"))),
            )
        self._reply(
            ch[0], CommandResult(name, ch, msg.request_id, False, error=f"unknown command {msg.command!r}", code=540)
        )
        return []

    def _stream(self, now: float, ch: ChannelId, msg: QueueCommand) -> list[Action]:
        """Range reads and commits of a range reader (x-stream-offset; see
        :mod:`mirrorq.amqp.stream`).  A commit's result, like every reply,
        is released once its DELIVER record is held by every replica of the
        view: a commit that was answered survives a failover."""
        a, q = msg.args or {}, self.queue
        if msg.command == "stream_bounds":
            fn = lambda: q.stream_bounds(now, a.get("start"), a.get("max_messages"), a.get("until"))  # noqa: E731
        elif msg.command == "stream_read":
            fn = lambda: q.stream_read(  # noqa: E731
                now, a.get("start"), a.get("end"), a.get("max_messages", 10000), a.get("max_bytes", 4 << 20)
            )
        elif msg.command == "stream_commit":

            def fn() -> tuple[dict[str, Any], list[Action]]:
                value, events = q.stream_commit(now, a.get("end"))
                self.r.log_event("stream_commit", end=value["committed_below"], removed=value["removed"])
                return value, events
        else:
            self._reply(
                ch[0],
                CommandResult(
                    self.r.spec.name, ch, msg.request_id, False, error=f"unknown command {msg.command!r}", code=540
                ),
            )
            return []
        return self._guard_result(ch, msg.request_id, fn)

    def _guard(self, ch: ChannelId, request_id: int | None, fn: Callable[[], list[Action]]) -> list[Action]:
        """Run a queue operation; an error becomes a reply naming it."""
        try:
            out = fn()
        except semantics.AMQPError as e:
            self._refused(ch, request_id, e)
            return []
        return self._events(0.0, out)

    def _guard_result(self, ch: ChannelId, request_id: int, fn: Callable[[], tuple[Any, list[Action]]]) -> list[Action]:
        """Run a queue operation that has a result, ``(value, actions)``: the
        value is the reply; an error becomes a reply naming it."""
        try:
            out = fn()
        except semantics.AMQPError as e:
            self._refused(ch, request_id, e)
            return []
        value, events = out
        self._reply(ch[0], CommandResult(self.r.spec.name, ch, request_id, True, value))
        return self._events(0.0, events)

    def _refused(self, ch: ChannelId, request_id: int | None, e: semantics.AMQPError) -> None:
        """The error reply of a queue operation that raised ``e``."""
        self._reply(
            ch[0],
            CommandResult(
                self.r.spec.name,
                ch,
                -1 if request_id is None else request_id,
                False,
                error=str(e),
                code=e.reply_code,
            ),
        )

    # ---- plumbing -------------------------------------------------------------------
    def _on_append(self, offset: int, rtype: int, body: list[Any]) -> None:
        self._ops.append([offset, rtype, body])
        if rtype == 3:  # ACK
            self._acked.extend(body[0])

    def _reply(self, dst: str, msg: _Reply) -> None:
        self._replies.setdefault(dst, []).append(msg)

    def _events(self, now: float, actions: list[Action]) -> list[Action]:
        """Translate the queue core's actions: events become (held) replies."""
        out: list[Action] = []
        name = self.r.spec.name
        for a in actions:
            if isinstance(a, SetTimer):
                out.append(SetTimer(("q", a.key), a.delay))
                continue
            if isinstance(a, CancelTimer):
                out.append(CancelTimer(("q", a.key)))
                continue
            if not isinstance(a, Emit):
                out.append(a)
                continue
            ev = a.event
            if isinstance(ev, aq.Deliver):
                m = ev.message
                item: _Item = (
                    ev.consumer_tag,
                    m.offset,
                    m.msg_id,
                    m.body,
                    m.properties,
                    ev.redelivered or m.offset < self.suspect_below,
                )
                self._deliveries_for(_channel(ev.channel), delivery_item_size(item)).append(item)
            elif isinstance(ev, aq.GetOk):
                m, ch = ev.message, _channel(ev.channel)
                item = (None, m.offset, m.msg_id, m.body, m.properties, ev.redelivered or m.offset < self.suspect_below)
                self._reply(ch[0], Deliveries(name, ch, self.r.member, (item,), ev.request_id, ev.message_count))
            elif isinstance(ev, aq.GetEmpty):
                ch = _channel(ev.channel)
                self._reply(ch[0], GetEmpty(name, ch, ev.request_id))
            elif isinstance(ev, aq.ConsumerCancelled):
                ch = _channel(ev.channel)
                key = (ch, ev.consumer_tag)
                if key in self.r.consumers:
                    del self.r.consumers[key]
                    self._consumer_changes.append(["remove", list(ch), ev.consumer_tag])
                self._reply(ch[0], ConsumerCancelled(name, ch, ev.consumer_tag, ev.reason))
            elif isinstance(ev, aq.QueueDeleted):
                self._deleted = ev
                out.append(a)  # the shell removes the records and stops the replica
            elif isinstance(ev, aq.DeadLettered):
                out += self._send_dead_letters(now)
            elif isinstance(ev, (aq.ConsumeOk, aq.CancelOk, aq.PublishAccepted)):
                pass  # the channel learns of success from what follows (or of failure from an error)
            else:
                out.append(a)  # other queue events go to the shell (QueueDeleted, MessagesDropped)
        return out

    # ---- dead-lettering -------------------------------------------------------------------
    def _send_dead_letters(self, now: float, retry: bool = False) -> list[Action]:
        """Send the router the oldest messages waiting for it, in dead-letter
        sequence order, as ONE held reply (it leaves once every member holds
        their DEAD_LETTER records): at most one DeadLetter unanswered at a
        time (``retry``: the last one was not answered in time), each the
        *prefix* of what waits.  So when the router publishes a message to a
        target, every message of this queue with a lower sequence number that
        routes there was published before it on the same router channel, or
        is gone -- which is what lets the target de-duplicate by a high-water
        mark alone (a message is never skipped as "seen" before it arrived),
        even when Thespian reorders two DeadLetters or a new master's router
        and the old one's overlap."""
        r = self.r
        if not r.bq.dead_letter_count or (self._dl_in_flight and not retry):
            return []
        target = self.queue.dead_letter_target
        if r.dead_letter_dst is not None and target is not None:
            batch = dead_letter_prefix(
                (seq, m.body, m.properties, reason, m.persistent) for seq, m, reason in self.queue.dead_lettering()
            )
            self._reply(
                r.dead_letter_dst,
                DeadLetter(
                    r.spec.name, r.spec.vhost, r.dst, target[0], target[1], tuple(batch), r.spec.incarnation, now
                ),
            )
            self._dl_in_flight = True
        if self._dl_timer:
            return []
        self._dl_timer = True
        return [SetTimer(("q", "dead-letter-retry"), DEAD_LETTER_RETRY)]

    def _deliveries_for(self, ch: ChannelId, size: int) -> list[_Item]:
        """The items list of the channel's ``Deliveries`` to add an item of
        ``size`` (estimated bytes) to: the last reply queued for that
        channel, or a new one when there is none or the item would take it
        past MAX_BATCH_BYTES (one message per channel and bound)."""
        lst = self._replies.setdefault(ch[0], [])
        if lst and isinstance(lst[-1], _Pending) and lst[-1].channel == ch and lst[-1].bytes + size <= MAX_BATCH_BYTES:
            p = lst[-1]
        else:
            p = _Pending(ch)
            lst.append(p)
        p.bytes += size
        return p.items

    def _numbered(self, m: _Reply) -> _Message:
        """A reply as it leaves: deliveries become one Deliveries message,
        numbered per channel in send order (the channel restores it)."""
        held_ch = (m.channel if m.held else None) if isinstance(m, _Pending) else _bound_channel(m)
        if held_ch is not None:
            n = self._held_for[held_ch] = self._held_for.get(held_ch, 1) - 1
            if n <= 0:
                self._held_for.pop(held_ch, None)
        if isinstance(m, _Pending):
            m = Deliveries(
                self.r.spec.name,
                m.channel,
                self.r.member,
                tuple(m.items),
                nbytes=MESSAGE_BYTES + m.bytes if m.bytes else 0,
            )
        if isinstance(m, Deliveries):
            self.r.stats["deliver_get"] += len(m.items)
            n = self._dseq[m.channel] = self._dseq.get(m.channel, 0) + 1
            m = replace(m, seq=n)
        return m

    def _end(self, now: float, force: bool = False) -> list[Action]:
        """Broadcast what this handler did (or keep it for the next broadcast
        when it is only lazy records; ``force``: broadcast what waits); send
        deliveries now (with ``ha-deliver-mode: replicated``, those of
        replicated messages only) unless a held reply to their channel
        comes first, and hold the other replies until replicated."""
        r = self.r
        replies: list[tuple[str, _Reply]] = []
        actions: list[Action] = []
        only_replicated = self.deliver_replicated()
        for dst, msgs in self._replies.items():
            for m in msgs:
                if isinstance(m, _Pending):
                    # a channel's deliveries leave in order and never overtake
                    # a held reply to that channel (a get answer, a cancel)
                    if m.channel in self._held_for:
                        ready = []
                    elif only_replicated:
                        ready = [it for it in m.items if it[1] < self.replicated_offset]
                    else:
                        ready = m.items
                    if ready:
                        now_part = _Pending(m.channel)
                        now_part.items = ready
                        now_part.bytes = m.bytes if len(ready) == len(m.items) else 0
                        actions.append(r.send(dst, self._numbered(now_part)))
                        if len(ready) == len(m.items):
                            continue
                        m.items = [it for it in m.items if it[1] >= self.replicated_offset]
                        m.bytes = 0  # not known any more: weighed when it leaves
                    m.held = True
                    held_ch: ChannelId | None = m.channel
                else:
                    held_ch = _bound_channel(m)
                if held_ch is not None:
                    self._held_for[held_ch] = self._held_for.get(held_ch, 0) + 1
                replies.append((dst, m))
        self._replies = {}
        if self.sync_waiting and r.bq.message_count == 0:
            # manual mode: consumers drained what the waiting mirrors lacked
            waiting, self.sync_waiting = self.sync_waiting, {}
            self.sync_invited |= set(waiting)
            actions += [r.send(dst, sync.SyncInvite(r.spec.name)) for _m, dst in sorted(waiting.items())]
        if self._deleted is not None:
            # the queue is gone: mirrors stop on hearing it (so no round will
            # complete); answer now, nothing is left to wait for
            if not self._deleted_sent:
                self._deleted_sent = True
                actions += r.broadcast(now, pl.Deleted(self._deleted.reason))
                actions += r.gm.flush(now)  # now: the replica stops, its flush timer will not run
            for entry in self.held:
                actions += [r.send(dst, self._numbered(m)) for dst, m in entry.replies]
            self.held.clear()
            self.ledger.forget_rounds()
            return actions + [r.send(dst, self._numbered(m)) for dst, m in replies]
        if (
            self._ops
            and not (self._consumer_changes or self._hwm_changes or self.ledger.earned or force)
            and all(op[1] in _LAZY_RTYPES for op in self._ops)
        ):
            self._lazy_ops += self._ops
            self._lazy_acked += self._acked
            self._ops, self._acked = [], []
            if not self._lazy_armed:
                self._lazy_armed = True
                actions.append(SetTimer(("q", "lazy-ops"), LAZY_OPS_DELAY))
        elif self._lazy_ops:
            self._ops = self._lazy_ops + self._ops  # in log order, ahead of this handler's
            self._acked = self._lazy_acked + self._acked
            self._lazy_ops, self._lazy_acked = [], []
        if self._ops or self._consumer_changes or self._hwm_changes:
            confirms = self._confirm_mode(now, actions)
            view = r.gm.view
            by_mirror = bool(confirms) and view is not None and len(view) > 1
            payload = pl.Ops(
                self._ops,
                [[list(p), s] for p, s in self._hwm_changes.items()],
                self._consumer_changes,
                # the confirms this round earns: the last mirror sends them (AllHold)
                [[list(p), list(seqs)] for p, seqs in confirms.items()] if by_mirror else [],
            )
            if self._ops and history.enabled(r):
                history.log_ops(r, self._ops)
            actions += r.broadcast(now, payload)
            gm_seq = r.gm.pub_count
            self.ledger.broadcast(gm_seq, confirms, now, by_mirror)
            self.held.append(_Held(gm_seq, replies, self._acked, now, r.bq.log.next_offset))
            self._ops, self._hwm_changes, self._consumer_changes = [], {}, []
            self._acked = []
        elif self.held:
            self.held[-1].replies.extend(replies)  # keep a channel's replies in order
        else:
            actions += [r.send(dst, self._numbered(m)) for dst, m in replies]
        return actions

    # ---- confirm modes ------------------------------------------------------------------
    def _confirm_mode(self, now: float, actions: list[Action]) -> dict[ChannelId, list[int]]:
        """``ha-confirm-mode``: ``sync`` (default) confirms once every member of
        the view has the publish; ``async`` (RocketMQ's ASYNC_MASTER) as soon
        as the master has fsync'd it -- mirrors may lag (``info`` shows by
        how many broadcasts).  With ``ha-confirm-mode: sync`` set explicitly,
        a queue whose policy wants mirrors but that is alone in its view nacks
        (RocketMQ's SLAVE_NOT_AVAILABLE; unset, it confirms, as RabbitMQ),
        and with ``ha-confirm-timeout`` (ms) publishes not replicated in time
        are nacked (RocketMQ's FLUSH_SLAVE_TIMEOUT) with a log line naming the
        mirror where the ring stopped (:mod:`.confirm_probe`).  Returns the confirms that wait for the GM round."""
        r = self.r
        confirms, name = self.ledger.take_earned(), r.spec.name
        if not confirms:
            return {}
        mode = r.policy.get("ha-confirm-mode", "sync")
        view = r.gm.view
        if mode == "async":
            r.stats["confirm"] += sum(len(seqs) for seqs in confirms.values())
            actions += [r.send(p[0], Confirm(name, p, tuple(seqs))) for p, seqs in confirms.items()]
            return {}
        if (
            r.policy.get("ha-confirm-mode") == "sync"
            and _wants_mirrors(r.policy)
            and view is not None
            and len(view) == 1
        ):
            reason = f"SLAVE_NOT_AVAILABLE: queue '{name}' has no mirror in its view (ha-confirm-mode sync)"
            actions += [r.send(p[0], Confirm(name, p, (), tuple(seqs), reason)) for p, seqs in confirms.items()]
            return {}
        timeout = r.policy.get("ha-confirm-timeout")
        if timeout and not self._confirm_timer:
            self._confirm_timer = True
            actions.append(SetTimer(("q", "confirm-timeout"), timeout / 1000.0))
        return confirms

    def _confirm_timeouts(self, now: float) -> list[Action]:
        self._confirm_timer = False
        r = self.r
        timeout = r.policy.get("ha-confirm-timeout")
        if not timeout:
            return []
        limit = timeout / 1000.0
        actions: list[Action] = []
        late = wanted = 0
        overdue, next_due = self.ledger.overdue(now, limit)
        if next_due is not None and not self._confirm_timer:
            self._confirm_timer = True
            actions.append(SetTimer(("q", "confirm-timeout"), next_due))
        reason = f"FLUSH_SLAVE_TIMEOUT: not replicated to every mirror within {timeout} ms"
        for gm_seq, confirms in overdue:
            for pub, seqs in confirms.items():
                late += len(seqs)
                actions.append(r.send(pub[0], Confirm(r.spec.name, pub, (), tuple(seqs), reason)))
            wanted = max(wanted, gm_seq)
        if late:
            view = r.gm.view
            mirrors = [m for m in (view.members if view is not None else ()) if m != r.member]
            r.log_event("confirm_timeout", level="warning", publishes=late, timeout_ms=timeout, mirrors=mirrors)
            actions += self._probe_start(wanted)
        return actions

    # ---- which mirror is slow (protocol: confirm_probe.py) ------------------------------
    def _probe_start(self, wanted: int) -> list[Action]:
        r = self.r
        view = r.gm.view
        if view is None or self._probe is not None:
            return []
        self._probe_id += 1
        self._probe = {"id": self._probe_id, "wanted": wanted, "ring": tuple(view.members), "answers": {}}
        q = confirm_probe.ProgressQuery(r.spec.name, r.member, wanted, self._probe_id, r.dst)
        actions: list[Action] = [r.send(r.dst_of(m), q) for m in view.members if m != r.member]
        return actions + [SetTimer(("q", "probe-deadline"), confirm_probe.PROBE_DEADLINE)]

    def _probe_answer(self, msg: confirm_probe.Progress) -> list[Action]:
        p = self._probe
        if p is None or msg.probe != p["id"]:
            return []
        p["answers"][msg.member] = msg.held
        if set(p["answers"]) >= set(p["ring"]) - {self.r.member}:
            return self._probe_end()
        return []

    def _probe_end(self) -> list[Action]:
        p, self._probe = self._probe, None
        if p is None:
            return []
        mirror, why = confirm_probe.culprit(p["ring"], self.r.member, p["answers"], p["wanted"])
        self.r.log_event(
            "confirm_timeout_mirror",
            level="warning",
            mirror=mirror,
            reason=why,
            wanted=p["wanted"],
            held=dict(p["answers"]),
        )
        return [CancelTimer(("q", "probe-deadline"))]


def _channel(channel: Hashable) -> ChannelId:
    """A channel the queue core handed back: the coordinator gives it nothing
    but channel ids (:func:`~mirrorq.queues.messages.channel_id`), so that is what it holds."""
    return cast(ChannelId, channel)


def _bound_channel(m: _Reply) -> ChannelId | None:
    """The channel a reply is for, when that channel's deliveries must not
    overtake it (get answers, cancellations, command results); None for
    confirms and dead letters, which deliveries need not follow."""
    if isinstance(m, (Deliveries, GetEmpty, ConsumerCancelled, CommandResult)):
        return m.channel
    return None


def _wants_mirrors(policy: dict[str, Any]) -> bool:
    mode, params = policy.get("ha-mode"), policy.get("ha-params")
    if mode == "all":
        return True
    if mode == "exactly":
        return isinstance(params, int) and params > 1
    if mode == "nodes":
        return isinstance(params, (list, tuple)) and len(params) > 1
    return False


#: a ``Deliveries`` item: ``(consumer_tag or None for basic.get, offset, msg_id, body, properties, redelivered)``
_Item = tuple[str | None, int, str | bytes, bytes, dict[str, Any], bool]


class _Pending:
    __slots__ = ("channel", "items", "held", "bytes")

    def __init__(self, channel: ChannelId) -> None:
        self.channel = channel
        self.items: list[_Item] = []
        self.held = False
        self.bytes = 0  # the items' estimated size (delivery_item_size)


class AcksReplicated:
    """Event: the ACKs of these offsets are held by every replica of the view."""

    __slots__ = ("offsets",)

    def __init__(self, offsets: tuple[int, ...]) -> None:
        self.offsets = offsets

    def __repr__(self) -> str:
        return f"AcksReplicated({self.offsets!r})"


class SyncState:
    """Event: the synchronised replicas changed (the shell updates sync_slave_pids)."""

    __slots__ = ("synced",)

    def __init__(self, synced: tuple[str, ...]) -> None:
        self.synced = synced

    def __repr__(self) -> str:
        return f"SyncState({self.synced!r})"


#: a reply as it leaves (:meth:`Coordinator._numbered`)
_Message = Confirm | CommandResult | Deliveries | GetEmpty | ConsumerCancelled | DeadLetter
#: a reply while the handler runs: deliveries are gathered per channel first
_Reply = _Message | _Pending


@dataclass(slots=True)
class _Held:
    """One broadcast of the master, until every member of the view holds it."""

    gm_seq: int
    replies: list[tuple[str, _Reply]]  # (dst, reply), in order: released with the round
    acked: list[int]  # offsets its ACK records name (AcksReplicated)
    at: float  # when it was broadcast
    upto: int  # the log's next offset then: every message below is replicated with the round


class _Probe(TypedDict):
    """A running confirm probe (:mod:`.confirm_probe`)."""

    id: int
    wanted: int
    ring: tuple[str, ...]
    answers: dict[str, int]
