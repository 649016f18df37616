"""mirror_queue_slave: a mirror's behaviour, and how a mirror takes over.

A mirror applies the operations its master broadcasts through GM to its own
backing queue, in the master's order and at the master's offsets
(:meth:`BackingQueue.apply`), so its log is a prefix of the master's.  Besides
the log it keeps what it needs to become master: the consumer table and, per
publisher, the highest publisher seq the master has enqueued (``hwm``).  The
publisher seqs the master refused are in the log (``REFUSED`` records), so a
promoted mirror nacks their resends as the old master would have.  It
answers every client request with :class:`NotMaster`: channels talk to the
master only.  One thing it sends them: a master's broadcast names the
confirms its round earns, and the mirror just before the master in the ring
sends those confirms when GM tells it every member holds the broadcast
(``AllHold``), a hop before the master knows (see :mod:`.coordinator`).

How a mirror becomes master
---------------------------
When a view is installed without the master, every survivor runs the
promotion protocol (:mod:`.promotion`: reports, a cutoff every survivor
holds, the election) and the member elected promotes itself.

Promotion itself (:meth:`Coordinator.promote`): the same replica, same
address, same data swaps its behaviour to the coordinator; it broadcasts
``promoted(name, dst)`` first, then requeues every unacked message
(redelivered), cancels consumers that asked for x-cancel-on-ha-failover and
delivers to the others; it tells the registry (``Promoted``) and the channels
it knows (``NewMaster``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from mirrorq.classic import confirm_probe, sync
from mirrorq.classic import payloads as pl
from mirrorq.queues.messages import ChannelId, Confirm, NotMaster, channel_id
from mirrorq.sansio import Action, SetTimer

if TYPE_CHECKING:
    from mirrorq.classic.replica import QueueReplica


class MirrorQueueSlave:
    """The mirror behaviour of a :class:`~mirrorq.classic.replica.QueueReplica`.

    ``synced``: a founder holds everything from the start; a joiner is
    unsynchronised until sync (:mod:`.sync`) completes."""

    role = "slave"

    def __init__(self, replica: QueueReplica, synced: bool = True) -> None:
        self.r = replica
        self.sync_state = "synced" if synced else "unsynced"  # | "waiting" | "requested" | "receiving"
        self.recv = sync.Receiving()
        self.recv_progress = 0.0
        self.retry_armed = False
        self.req = 0  # sync requests made: the transfer answering the latest one is the only one heard
        #: (origin, gm seq, [[publisher, seqs]...]) of the master's broadcasts, until sent or acked
        self.confirms: list[tuple[str, int, Sequence[Any]]] = []

    @property
    def synced(self) -> bool:
        return self.sync_state == "synced"

    # ---- client requests: not ours; sync messages: ours ---------------------------
    def handle_many(self, now: float, msgs: list[Any]) -> list[Action]:
        actions: list[Action] = []
        for msg in msgs:
            actions += self.handle(now, None, msg)
        return actions

    def handle(self, now: float, src: Any, msg: Any) -> list[Action]:
        if isinstance(msg, sync.SyncStart):
            return self._sync_start(now, msg)
        if isinstance(msg, sync.SyncBatch):
            return self._sync_batch(now, msg)
        if isinstance(msg, (sync.SyncRetry, sync.SyncCancelled)):
            if not self.synced:
                self.sync_state = "unsynced"
                self.recv = sync.Receiving()
                return self._arm_retry()
            return []
        if isinstance(msg, sync.SyncWait):
            if not self.synced:
                self.sync_state = "waiting"
                self.recv = sync.Receiving()
            return []
        if isinstance(msg, sync.SyncInvite):
            if not self.synced and self.sync_state in ("waiting", "unsynced"):
                return self.request(now)
            return []
        if isinstance(msg, confirm_probe.ProgressQuery):
            st = self.r.gm.members_state.get(msg.master)
            held = st.last_pub if st is not None else 0
            return [self.r.send(msg.reply_to, confirm_probe.Progress(msg.queue, self.r.member, msg.probe, held))]
        if isinstance(msg, confirm_probe.Progress):
            return []  # an answer to a probe of ours from when we were the master
        dst = _reply_dst(msg)
        if dst is None:
            return []
        return [self.r.send(dst, NotMaster(self.r.spec.name, self.r.master, msg))]

    # ---- operations from the master ---------------------------------------------
    def on_ops(self, origin: str, payload: pl.Ops, gm_seq: int = 0) -> None:
        r = self.r
        if r.master is not None and origin != r.master:
            r.stats["foreign_ops"] += 1
        elif payload.confirms:
            # the confirms this broadcast's round earns: ours to send if we
            # turn out to be the last member before the master (AllHold)
            st = r.gm.members_state.get(origin)
            acked = st.last_ack if st is not None else 0
            # acked rounds (the master sent them) and an earlier master's
            # (its publishers resend to this one) are not ours to send
            self.confirms = [c for c in self.confirms if c[0] == origin and c[1] > acked]
            self.confirms.append((origin, gm_seq, payload.confirms))
        if self.synced:
            self._apply(payload)
        elif self.sync_state in ("requested", "receiving"):
            self.recv.kept.append((origin, gm_seq, payload))
        # unsynchronised and not syncing: nothing to apply these to

    def _apply(self, payload: pl.Ops) -> None:
        r = self.r
        for offset, rtype, body in payload.records:
            r.bq.apply((rtype, body), offset)
        apply_replicated_state(r, payload.hwm, payload.consumers)

    def on_confirmed(self, now: float, first: int, last: int) -> list[Action]:
        return []  # a mirror broadcasts only control messages; nobody waits on them

    def on_all_hold(self, now: float, origin: str, upto: int) -> list[Action]:
        """Every member holds the master's broadcasts up to ``upto`` (we are
        the last before it in the ring): confirm their publishes now, a hop
        before the master could."""
        r = self.r
        if origin != r.master or not self.confirms:
            return []
        due: dict[ChannelId, list[int]] = {}
        while self.confirms and self.confirms[0][0] == origin and self.confirms[0][1] <= upto:
            for pub, seqs in self.confirms.pop(0)[2]:
                due.setdefault(channel_id(pub), []).extend(seqs)
        return [r.send(pub[0], Confirm(r.spec.name, pub, tuple(seqs))) for pub, seqs in due.items()]

    def timer(self, now: float, key: Any) -> list[Action]:
        if key == "sync-retry":
            self.retry_armed = False
            if not self.synced and self.sync_state == "unsynced":
                return self.request(now)
            quiet = now - self.recv_progress
            if (
                self.sync_state == "requested"
                and quiet > sync.SYNC_ANSWER_TIMEOUT
                or self.sync_state == "receiving"
                and quiet > sync.SYNC_TIMEOUT
            ):
                # the request or its answer was lost (a link reset at a heal), or the transfer died
                # with its master: ask again (the master replaces a transfer on a new request)
                self.sync_state = "unsynced"
                self.recv = sync.Receiving()
                return self.request(now)
            return self._arm_retry()
        return []

    # ---- sync, the mirror's side (protocol: sync.py) ------------------------------
    def master_changed(self, now: float) -> list[Action]:
        """A new master: a transfer from the old one is void; ask the new one."""
        if self.synced:
            return []
        self.sync_state = "unsynced"
        self.recv = sync.Receiving()
        return self.request(now)

    def request(self, now: float) -> list[Action]:
        r = self.r
        if r.master is None or r.master == r.member or self.synced:
            return self._arm_retry()
        log = r.bq.log
        nxt = log.next_offset
        last, crc = -1, 0
        if len(log):
            try:
                rec = log.read_at(nxt - 1)
                last, crc = nxt - 1, sync.record_crc(rec.rtype, rec.body)
            except KeyError:
                pass
        self.sync_state = "requested"
        self.recv = sync.Receiving()
        self.recv_progress = now
        self.req += 1
        req = sync.SyncRequest(r.spec.name, r.member, r.dst, nxt, last, crc, self.req, tuple(r.bq.epochs))
        return [r.send(r.dst_of(r.master), req)] + self._arm_retry()

    def _arm_retry(self) -> list[Action]:
        if self.retry_armed or self.synced:
            return []
        self.retry_armed = True
        return [SetTimer(("q", "sync-retry"), sync.SYNC_RETRY)]

    def _sync_start(self, now: float, msg: sync.SyncStart) -> list[Action]:
        r = self.r
        master = r.master
        if self.sync_state != "requested" or msg.req != self.req or master is None:
            return []  # master None: it left the view, its transfer is void (master_changed asks the next)
        if msg.reset:
            r.reset_store()
        elif msg.truncate >= 0:
            r.truncate_store(msg.truncate)
        r.hwm.clear()
        r.consumers.clear()
        apply_replicated_state(r, msg.hwm, [["add", c] for c in msg.consumers])
        r.synced_members = set(msg.synced)
        self.sync_state = "receiving"
        self.recv.start = replace(msg, first=None)
        self.recv.position = msg.start
        self.recv_progress = now
        if msg.first is not None:
            return self._sync_batch(now, msg.first)
        return self._maybe_done(now, master) or self._ack(master)

    def _sync_batch(self, now: float, msg: sync.SyncBatch) -> list[Action]:
        r = self.r
        recv = self.recv
        master = r.master
        if self.sync_state != "receiving" or msg.req != self.req or master is None:
            return []  # master None: it left the view, its transfer is void (master_changed asks the next)
        if msg.start != recv.position:
            if msg.start > recv.position:
                recv.early[msg.start] = msg  # overtook its predecessor: wait for it
            return []
        batch: sync.SyncBatch | None = msg
        while batch is not None:
            n = r.bq.replay_raw(batch.data, source=f"sync batch [{batch.start}, {batch.next}) from {r.master}")
            if n != batch.count:
                raise ValueError(
                    f"sync batch [{batch.start}, {batch.next}) from {r.master} announced {batch.count} records, "
                    f"held {n}"
                )
            recv.position = batch.next
            recv.received += n
            r.stats["sync_records_received"] += n
            batch = recv.early.pop(recv.position, None)
        self.recv_progress = now
        return self._maybe_done(now, master) or self._ack(master)

    def _ack(self, master: str) -> list[Action]:
        r = self.r
        return [r.send(r.dst_of(master), sync.SyncAck(r.spec.name, r.member, self.recv.position, self.req))]

    def _maybe_done(self, now: float, master: str) -> list[Action]:
        """Once the stream reached ``until``: apply what ``master`` broadcast
        after it, and tell it the mirror is synchronised."""
        r = self.r
        start = self.recv.start
        assert start is not None  # receiving: _sync_start set it
        if self.recv.position < start.until:
            return []
        for origin, gm_seq, payload in self.recv.kept:
            if origin == master and gm_seq > start.gm_seq:
                self._apply(payload)
        self.sync_state = "synced"
        self.recv = sync.Receiving()
        return [r.send(r.dst_of(master), sync.SyncDone(r.spec.name, r.member, self.req))]

    def sync_info(self) -> str:
        if self.sync_state == "receiving":
            return f"syncing {self.recv.received}"
        return "synchronised" if self.synced else "unsynchronised"


def apply_replicated_state(
    r: QueueReplica, hwm: Sequence[Sequence[Any]], consumer_changes: Sequence[Sequence[Any]]
) -> None:
    """The part of a master's state that is not in the log: publisher
    high-water marks and the consumer table."""
    for publisher, seq in hwm:
        p = channel_id(publisher)
        if seq > r.hwm.get(p, 0):
            r.hwm[p] = seq
    for change in consumer_changes:
        if change[0] == "add":
            c = dict(change[1])
            c["channel"] = channel_id(c["channel"])
            r.consumers[(c["channel"], c["consumer_tag"])] = c
        else:
            _, ch, tag = change
            r.consumers.pop((channel_id(ch), tag), None)


def _reply_dst(msg: Any) -> Any:
    for attr in ("publisher", "channel"):
        ch = getattr(msg, attr, None)
        if ch is not None:
            return channel_id(ch)[0]
    return None
