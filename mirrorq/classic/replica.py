"""A queue replica: one GM member and one queue behaviour, driven together.

Every replica of a mirrored queue (the master and each mirror) is one
:class:`QueueReplica`: a :class:`~mirrorq.gm.core.GMMember` plus a behaviour,
either :class:`~.coordinator.Coordinator` (the master: amqqueue_process,
mirror_queue_master and GM callback in one) or
:class:`~.mirror_queue_slave.MirrorQueueSlave`.  RabbitMQ runs the GM member
and the queue as separate processes; here they share one actor's turn
(a queue host process, :mod:`mirrorq.queues.host`, runs many replicas, each with its own
address within it).  Promotion swaps the behaviour object in place: same
replica, same address, same data.

Protocol
--------
* The master's operations travel through GM; mirrors apply them in order.
  See :mod:`.coordinator` for what confirms mean, :mod:`.promotion` for
  the promotion protocol and :mod:`.payloads` for what replicas broadcast.
* Durability before forwarding: at the end of every turn the replica
  flushes its backing queue (``flush_turn``: one write, and one fsync when
  the turn appended a record that carries a promise -- a PUBLISH, a PURGE,
  a REFUSED (a nack), sync records; acks, deliveries and requeues alone are written and fsync'd
  with the next such turn; with ``sync_later`` set, the fsync is handed
  to the caller, a queue host that syncs all its replicas' files of the
  turn at once) *before* anything of the turn leaves, so a
  replica forwards a round marker only for publishes it has made durable.
  A confirm therefore means "fsync'd on every member of the view".
* Views come from the registry (``install_view``), deaths from node liveness
  (``member_down``), exactly as for a bare GM member.

Failure behaviour
-----------------
A replica removed from the view (``Removed``) stops serving and emits
:class:`ReplicaStopped`; its data stays on disk.  A mirror that receives an
operation it cannot apply has diverged: the exception propagates (the
actor dies and its node reports it) rather than serving wrong data.
Client requests to a mirror get :class:`~mirrorq.queues.messages.NotMaster`.

Joining
-------
A replica created with ``joining=True`` joins the GM group at the end of the
ring as an unsynchronised mirror and catches up by sync (:mod:`.sync`).  The
master re-announces itself (a ``promoted`` payload) whenever a view brings
new members, so a joiner learns whom to ask.  Promotion picks the oldest
*synchronised* member (``ha-promote-on-failure``: ``always``, the default,
falls back to the oldest member; ``when-synced`` keeps the queue down).

Master hand-over
----------------
:meth:`QueueReplica.hand_over`: a live master leaves in favour of a named
synchronised mirror (placement's ``TransferMaster``); see its docstring.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from mirrorq.bounds import batches
from mirrorq.classic import payloads as pl
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.classic.coordinator import Coordinator
from mirrorq.classic.latency import LatencyHistogram
from mirrorq.classic.mirror_queue_slave import MirrorQueueSlave
from mirrorq.classic.promotion import Broadcast as PromotionBroadcast
from mirrorq.classic.promotion import Cutoff, Elect, Marks, NoMaster, Promotion, Ready, Report
from mirrorq.gm.core import (
    Activity,
    AllHold,
    Confirmed,
    Delivered,
    GMMember,
    MembersChanged,
    Nudge,
    ProposeView,
    Removed,
)
from mirrorq.gm.view import View
from mirrorq.queues.messages import ChannelId, HwmKey
from mirrorq.sansio import Action, CancelTimer, Emit, Persist, Send, SetTimer


@dataclass(frozen=True)
class QueueSpec:
    """What amqqueue says about a queue (the parts a replica needs)."""

    name: str
    vhost: str = "/"
    durable: bool = True
    auto_delete: bool = False
    exclusive_owner: str | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    #: set once when the queue is created (random): tells this queue from an
    #: earlier one of the same name (dead-letter de-duplication keys use it)
    incarnation: str = ""


@dataclass(frozen=True)
class Promoted:
    """This replica became the master (the shell records it in amqqueue)."""

    member: str
    dst: Any


@dataclass(frozen=True)
class MasterKnown:
    """Every replica emits this when it learns who the master is."""

    member: str


@dataclass(frozen=True)
class QueueDown:
    """No replica may become master (the queue is down until one comes back)."""

    reason: str


@dataclass(frozen=True)
class QueueGone:
    """The master deleted the queue: this mirror stops and drops its store."""

    reason: str


@dataclass(frozen=True)
class ReplicaStopped:
    reason: str


@dataclass(frozen=True)
class HandingOver:
    """The master's "leaving" announcement naming ``target`` is held by every
    member and it has asked the registry for a view without itself: the
    shell lets it exit (its successor is elected by the survivors)."""

    target: str


@dataclass(frozen=True)
class HandOverRefused:
    target: str
    reason: str


class QueueReplica:
    """``QueueReplica(member, dst, spec, bq, master=...)``.

    ``member`` is this replica's GM member name (unique for ever), ``dst``
    where channels reach it, ``bq`` its backing queue, ``master`` the member
    name of the master when the replica is created (founders all know it).
    """

    def __init__(
        self,
        member: str,
        dst: Any,
        spec: QueueSpec,
        bq: BackingQueue,
        *,
        master: str | None,
        now: float = 0.0,
        gm_options: dict[str, Any] | None = None,
        joining: bool = False,
        bq_factory: Callable[[bool], BackingQueue] | None = None,
        dst_of: Callable[[str], Any] | None = None,
        policy: dict[str, Any] | None = None,
        log: Callable[..., None] | None = None,
    ) -> None:
        self.member = member
        self.dst = dst
        self.spec = spec
        self.bq = bq
        self.gm = GMMember(member, **{"payload_size": pl.encoded_size, **(gm_options or {})})
        self.master: str | None = master
        #: (channel, consumer tag) -> the consumer's record (channel, consumer_tag, no_ack, prefetch,
        #: exclusive, arguments, lookahead), replicated
        self.consumers: dict[tuple[ChannelId, str], dict[str, Any]] = {}
        self.hwm: dict[HwmKey, int] = {}  # publisher high-water marks, replicated
        self.stats: Counter[str] = Counter()
        #: a master's confirms' replication latency (mirrorq.mgmt's histogram)
        self.confirm_latency = LatencyHistogram()
        self.stopped = False
        self.promo: Promotion | None = None
        self.joining = joining
        self.synced_members: set[str] = set()
        self.policy: dict[str, Any] = dict(policy or {})
        #: where a master sends what it dead-letters (its node's front end); None: unknown yet
        self.dead_letter_dst: Any = None
        self._bq_factory = bq_factory
        self._dst_of = dst_of
        self._log = log
        self._had_view = False
        self.graceful: set[str] = set()  # masters that announced a graceful stop
        self.successor: dict[str, str] = {}  # master -> the synchronised mirror it hands over to
        # True: every turn ends with a Persist action (end_turn) that the
        # driver performs before the turn's sends leave: one store flush per
        # turn (mirrorq.sansio); False: every entry point flushes the store
        # itself (for callers without turns)
        self.defer_flush = False
        #: given: ``persist`` hands the files owing an fsync to it instead of
        #: fsyncing (a queue host's group sync, BackingQueue.flush_turn)
        self.sync_later: Callable[[list[int]], None] | None = None
        self.handover: tuple[str, int, bool] | None = None  # (target, seq of our "leaving", view proposed)
        self.behaviour: Coordinator | MirrorQueueSlave = (
            Coordinator(self, now) if master == member else MirrorQueueSlave(self, synced=not joining)
        )

    # ---- helpers for behaviours ------------------------------------------------------
    @property
    def is_master(self) -> bool:
        return isinstance(self.behaviour, Coordinator)

    @property
    def coordinator(self) -> Coordinator:
        """The master behaviour (for callers that checked :attr:`is_master`)."""
        b = self.behaviour
        if not isinstance(b, Coordinator):
            raise RuntimeError(f"replica {self.member} of queue {self.spec.name!r} is not the master")
        return b

    @property
    def mirror(self) -> MirrorQueueSlave:
        """The mirror behaviour (for callers that checked :attr:`is_master`)."""
        b = self.behaviour
        if not isinstance(b, MirrorQueueSlave):
            raise RuntimeError(f"replica {self.member} of queue {self.spec.name!r} is the master, not a mirror")
        return b

    def send(self, dst: Any, msg: Any) -> Send:
        return Send(dst, msg)

    def dst_of(self, member: str) -> Any:
        """Where a member's replica receives channel and sync messages."""
        return member if self._dst_of is None else self._dst_of(member)

    def log_event(self, event: str, **fields: Any) -> None:
        if self._log is not None:
            self._log(event, queue=self.spec.name, member=self.member, **fields)

    def reset_store(self) -> None:
        """Empty this replica's store (sync found its log diverged)."""
        if self._bq_factory is None:
            raise RuntimeError(f"replica {self.member}: no bq_factory to reset the store with")
        self.bq.close(flush=False)
        self.bq = self._bq_factory(True)
        self.log_event("store_reset")

    def truncate_store(self, offset: int) -> None:
        """Cut this replica's store back to ``offset`` (sync found its log
        parted from the master's there): every record from ``offset`` on
        goes, and the queue state is rebuilt from the records that stay."""
        if self._bq_factory is None:
            raise RuntimeError(f"replica {self.member}: no bq_factory to reopen the store with")
        dropped = self.bq.log.next_offset - offset
        self.bq.log.truncate(offset)
        self.bq.close()
        self.bq = self._bq_factory(False)
        self.log_event("store_truncated", offset=offset, records_dropped=dropped)

    @property
    def is_synced(self) -> bool:
        return self.is_master or self.mirror.synced

    def set_policy(self, now: float, definition: dict[str, Any]) -> list[Action]:
        """The effective policy definition changed (ha-sync-mode, ...)."""
        self.policy = dict(definition or {})
        if self.is_master:
            self.coordinator.policy_changed()
        return []

    def broadcast(self, now: float, payload: pl.Payload) -> list[Action]:
        """Broadcast ``payload`` to the queue's GM group (encoded: :mod:`.payloads`)."""
        return self.gm.broadcast(now, pl.encode(payload))

    def info(self) -> dict[str, Any]:
        q = self.coordinator.queue.info() if self.is_master else {}
        return {
            "name": self.spec.name,
            "member": self.member,
            "role": self.behaviour.role,
            "master": self.master,
            "messages": self.bq.message_count,
            "messages_ready": self.bq.ready_count,
            "messages_unacknowledged": self.bq.unacked_count,
            "consumers": len(self.consumers),
            "next_offset": self.bq.log.next_offset,
            "sync": self.behaviour.sync_info(),
            "sync_records_sent": self.stats["sync_records_sent"],
            # broadcasts not yet held by every mirror (what async confirms let lag)
            "mirror_lag": (self.gm.pub_count - self.coordinator.replicated_gm) if self.is_master else None,
            "sync_records_received": self.stats["sync_records_received"],
            "synchronised": sorted(self.synced_members),
            # message counters since this replica became master (RabbitMQ's
            # message_stats; a failover starts them again, as a counter reset)
            "message_stats": {k: self.stats[k] for k in ("publish", "deliver_get", "ack", "confirm")},
            "confirm_latency": self.confirm_latency.snapshot(),
            "sync_progress": self.coordinator.sync_progress() if self.is_master else {},
            **{k: v for k, v in q.items() if k not in ("messages", "messages_ready", "messages_unacknowledged")},
        }

    # ---- the sansio contract -----------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        actions = self.gm.start(now)
        if self.is_master:
            actions += self.coordinator.start(now)
        return self._gm(now, actions)

    def receive(self, now: float, src: Any, msg: Any) -> list[Action]:
        if self.stopped:
            return []
        if isinstance(msg, (Activity, Nudge)):
            return self._gm(now, self.gm.receive(now, src, msg))
        return self._gm(now, self.behaviour.handle(now, src, msg))

    def receive_many(self, now: float, msgs: list[Any]) -> list[Action]:
        """Client and sync messages that arrived together (one turn): the
        master handles them in runs of at most
        :data:`~mirrorq.bounds.MAX_BATCH_BYTES` (estimated; a bigger
        message alone) and broadcasts what each run did as ONE GM payload
        (one round, one confirm message per publisher), so a payload is
        about as big as the requests that made it."""
        if self.stopped or not msgs:
            return []
        if len(msgs) == 1:
            return self.receive(now, None, msgs[0])
        out: list[Action] = []
        for run in batches(msgs):
            if self.stopped:
                break
            out += (
                self.receive(now, None, run[0])
                if len(run) == 1
                else self._gm(now, self.behaviour.handle_many(now, run))
            )
        return out

    def dst_down(self, now: float, dst: Any) -> list[Action]:
        """Nothing listens at ``dst`` any more: a master drops the channels there."""
        if self.stopped or not self.is_master:
            return []
        return self._gm(now, self.coordinator.dst_down(now, dst))

    def channels_live(self, now: float, dst: Any, keys: frozenset[int]) -> list[Action]:
        """The front end at ``dst`` has live connections under ``keys`` only:
        a master drops its other channels there."""
        if self.stopped or not self.is_master:
            return []
        return self._gm(now, self.coordinator.channels_live(now, dst, keys))

    def end_turn(self, now: float) -> list[Action]:
        """The driver's turn ends: GM's buffered broadcasts leave now, after
        the store is made durable (``Persist``, with ``defer_flush``)."""
        out = [] if self.stopped else self._gm(now, self.gm.end_turn(now))
        if self.defer_flush and not self.bq.log.closed:
            out.append(Persist())
        return out

    def persist(self, now: float) -> None:
        """Carry out ``Persist``: the turn's writes reach the store (fsync'd
        if any carries a promise: :meth:`BackingQueue.flush_turn`)."""
        if not self.bq.log.closed:
            self.bq.flush_turn(self.sync_later)

    def timer(self, now: float, key: Hashable) -> list[Action]:
        if self.stopped:
            return []
        if isinstance(key, tuple) and key and key[0] == "q":
            return self._gm(now, self.behaviour.timer(now, key[1]))
        return self._gm(now, self.gm.timer(now, key))

    def install_view(self, now: float, view: View) -> list[Action]:
        if self.stopped:
            return []
        return self._gm(now, self.gm.install_view(now, view))

    def member_down(self, now: float, name: str) -> list[Action]:
        if self.stopped:
            return []
        return self._gm(now, self.gm.member_down(now, name))

    def member_up(self, now: float, name: str) -> list[Action]:
        if self.stopped:
            return []
        return self._gm(now, self.gm.member_up(now, name))

    def shutdown(self, now: float) -> list[Action]:
        """A graceful stop (the node is shutting down): a master says so
        first, so that ``ha-promote-on-shutdown`` rather than
        ``ha-promote-on-failure`` decides who may take over."""
        if self.stopped or not self.is_master or self.gm.view is None:
            return []
        self.graceful.add(self.member)
        actions = self.coordinator.flush_lazy(now)
        return self._gm(now, actions + self.broadcast(now, pl.Leaving(self.member)) + self.gm.flush(now))

    def hand_over(self, now: float, target: str) -> list[Action]:
        """Master hand-over (a ``nodes`` policy that no longer lists the
        master's node): the master announces through GM that it leaves in
        favour of ``target``, a synchronised mirror; once every member holds
        that announcement (GM confirms it) it proposes a view without itself.
        The survivors then run the promotion protocol as after any departure
        (every survivor holds the same prefix before the new master writes)
        and elect ``target`` instead of the oldest synchronised member.
        Publishers resend what the old master did not confirm (deduplicated
        by the high-water marks), unacked deliveries come back redelivered:
        RabbitMQ's behaviour when a master migrates.  Refused, with a reason,
        unless this replica is the master and ``target`` a synchronised
        mirror of its view."""
        view = self.gm.view
        why = None
        if self.stopped:
            why = "this replica is stopped"
        elif not self.is_master:
            why = "this replica is not the master"
        elif view is None or target not in view or target == self.member:
            why = "the target is not a mirror in the master's view"
        elif target not in self.synced_members:
            why = "the target is not synchronised"
        elif self.handover is not None:
            why = f"already handing over to {self.handover[0]}"
        if why is not None:
            self.log_event("master_transfer_refused", level="warning", target=target, reason=why)
            return [Emit(HandOverRefused(target, why))]
        self.graceful.add(self.member)
        actions = self.coordinator.flush_lazy(now) + self.broadcast(now, pl.Leaving(self.member, target))
        self.handover = (target, self.gm.pub_count, False)
        self.log_event("master_transfer_started", target=target)
        return self._gm(now, actions + self.gm.flush(now))

    def _handover_progress(self, last_confirmed: int) -> list[Action]:
        h = self.handover
        view = self.gm.view
        if h is None or h[2] or last_confirmed < h[1] or view is None:
            return []
        self.handover = (h[0], h[1], True)
        rest = tuple(m for m in view.members if m != self.member)
        return [Emit(ProposeView(view.version, rest)), Emit(HandingOver(h[0]))]

    def join(self, now: float) -> list[Action]:
        if self.stopped:
            return []
        return self._gm(now, self.gm.join(now))

    # ---- GM callbacks ------------------------------------------------------------------
    def _gm(self, now: float, actions: list[Action]) -> list[Action]:
        """Run GM's events through the behaviour; GM's sends go last, after
        the flush (durable before forwarded)."""
        out: list[Action] = []
        tail: list[Action] = []
        pending = deque(actions)
        while pending:
            a = pending.popleft()
            if not isinstance(a, Emit):
                tail.append(a)
                continue
            ev = a.event
            if isinstance(ev, Delivered):
                more = self._delivered(now, ev)
            elif isinstance(ev, Confirmed):
                more = self.behaviour.on_confirmed(now, ev.first, ev.last) + self._handover_progress(ev.last)
            elif isinstance(ev, AllHold):
                more = self.behaviour.on_all_hold(now, ev.origin, ev.upto)
            elif isinstance(ev, MembersChanged):
                out.append(a)
                more = self._members_changed(now, ev)
            elif isinstance(ev, Removed):
                self.stopped = True
                out.append(Emit(ReplicaStopped("removed from the GM view")))
                more = []
            else:
                out.append(a)  # ProposeView etc.: for the shell
                more = []
            # actions produced by GM calls we made (broadcasts) are processed too
            for m in more:
                if isinstance(m, Emit) and isinstance(
                    m.event, (Delivered, Confirmed, AllHold, MembersChanged, Removed)
                ):
                    pending.append(m)
                elif isinstance(m, (Send,)) and isinstance(m.msg, (Activity, Nudge)):
                    tail.append(m)
                elif isinstance(m, (SetTimer, CancelTimer)) and not (isinstance(m.key, tuple) and m.key[:1] == ("q",)):
                    tail.append(m)
                else:
                    out.append(m)
        if not self.bq.log.closed and not self.defer_flush:
            self.bq.flush()
        return out + tail

    def _delivered(self, now: float, ev: Delivered) -> list[Action]:
        out = self._deliver_payload(now, ev)
        if self.promo is not None:
            # whatever was delivered may be what a step of the promotion waits
            # for (a report, the cutoff, a ready; or any pub, since a member
            # holds the cutoff once it delivered up to it)
            out += self._promotion_progress(now)
        return out

    def _deliver_payload(self, now: float, ev: Delivered) -> list[Action]:
        try:
            payload = pl.decode(ev.payload)
        except pl.BadPayload:
            self.stats["unknown_payload"] += 1
            return []
        if type(payload) is pl.Ops:  # the hot one: every round of the master
            if ev.origin != self.member:
                self.behaviour.on_ops(ev.origin, payload, ev.seq)
            return []
        if isinstance(payload, pl.Promoted):
            view = self.gm.view
            if view is not None and ev.origin not in view:
                return []  # the announcement of a master that is gone since
            member = payload.member
            changed = member != self.master
            self.master = member
            self.promo = None
            out: list[Action] = [Emit(MasterKnown(member))]
            if not self.is_master and not self.mirror.synced and (changed or self.mirror.sync_state == "unsynced"):
                out += self.mirror.master_changed(now)
            return out
        if isinstance(payload, pl.Synced):
            self.synced_members.add(payload.member)
        elif isinstance(payload, pl.Leaving):
            self.graceful.add(payload.member)
            if payload.successor is not None:
                self.successor[payload.member] = payload.successor
        elif isinstance(payload, pl.Deleted):
            if ev.origin == self.member:
                return []
            self.stopped = True
            return [Emit(QueueGone(payload.reason))]
        elif self.promo is None:
            return []  # a promotion payload while no promotion runs here
        elif isinstance(payload, Elect):
            if self.promo.elected_me(payload):
                return self._promote(now)
        elif isinstance(payload, Report):
            self.promo.report(ev.origin, payload)
            if (
                payload.version == self.promo.version
                and payload.synced
                and self.gm.view is not None
                and ev.origin in self.gm.view
            ):
                # a mirror that finished its sync just before the old master
                # died (its "synced" announcement lost with it) says so here;
                # it holds the agreed prefix like every survivor, and would
                # otherwise never ask for a sync again
                self.synced_members.add(ev.origin)
        elif isinstance(payload, Cutoff):
            self.promo.cut(payload)
        elif isinstance(payload, Ready):
            self.promo.readied(ev.origin, payload)
        return []

    # ---- promotion (the protocol: :mod:`.promotion`) ---------------------------------------
    def _members_changed(self, now: float, ev: MembersChanged) -> list[Action]:
        view = ev.view
        self.log_event("view_change", version=view.version, members=list(view.members))  # for the audit's timeline
        first_view = not self._had_view
        if first_view:
            self._had_view = True
            if not self.joining:
                self.synced_members |= set(view.members)  # founders hold everything from the start
        self.synced_members &= set(view.members)
        if self.master is not None and self.master in view:
            if self.is_master and ev.births and not first_view:
                # tell joiners who the master is (they ask it for sync)
                return self.broadcast(now, pl.Promoted(self.member, self.dst))
            return []
        if first_view and not self.joining and view.version == 1 and self.master is None:
            # a declare's founding view: no old master, every founder synchronised,
            # so the protocol would elect the promoter (:mod:`.promotion`)
            return self._promote(now) if view.members[0] == self.member else []
        old_master = self.master if self.master is not None else (self.promo.old_master if self.promo else None)
        self.master = None
        members = set(view.members)
        marks = {o: st.last_pub for o, st in self.gm.members_state.items() if o not in members}
        self.promo = Promotion(self.member, view.version, tuple(view.members), old_master)
        return self.broadcast(now, Report(view.version, marks, self.is_synced))

    def _holds(self, marks: Marks) -> bool:
        ms = self.gm.members_state
        return all(ms[o].last_pub >= k if o in ms else k <= 0 for o, k in marks.items())

    def _promotion_progress(self, now: float) -> list[Action]:
        """Run the promotion's next step (:meth:`Promotion.advance`) and carry out its decision."""
        p = self.promo
        if p is None or self.stopped:
            return []
        old = p.old_master
        d = p.advance(
            self._holds,
            self.policy,
            self.successor.get(old) if old is not None else None,
            old is not None and old in self.graceful,
        )
        if d is None:
            return []
        if isinstance(d, PromotionBroadcast):
            return self.broadcast(now, d.payload)  # it comes back to us as a Delivered event too
        if isinstance(d, NoMaster):
            self.log_event("queue_down", level="warning", reason=d.reason)
            return [Emit(QueueDown(d.reason))]
        return self._promote(now)

    def _promote(self, now: float) -> list[Action]:
        self.promo = None
        self.master = self.member
        actions = self.broadcast(now, pl.Promoted(self.member, self.dst))
        self.behaviour = Coordinator(self, now)
        actions += [Emit(Promoted(self.member, self.dst))]
        actions += self.behaviour.promote(now)
        return actions
