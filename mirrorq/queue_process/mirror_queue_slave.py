"""mirror_queue_slave: a mirror's behaviour, and how a mirror takes over.

A mirror applies the operations its master broadcasts through GM to its own
backing queue, in the master's order and at the master's offsets
(:meth:`BackingQueue.apply`), so its log is a prefix of the master's.  Besides
the log it keeps what it needs to become master: the consumer table and, per
publisher, the highest publisher seq the master has enqueued (``hwm``).  It
answers every client request with :class:`NotMaster`: channels talk to the
master only.

Promotion protocol (run by every replica; see :mod:`.replica`)
--------------------------------------------------------------
When a view is installed without the master, the master is unknown until a
new one announces itself.  The *promoter* is the first member of the view
(ring order is age order: founders in creation order, joiners at the end, so
it is the oldest surviving mirror).  Before it may write anything it must
hold every operation of the dead master(s) that any survivor holds, and every
survivor must hold them too; otherwise its own operations would conflict with
late ones.  So, in view ``v``:

1. every member broadcasts ``report(v, {dead origin: last delivered seq})``
   when it installs ``v``;
2. when the promoter has the reports of all members of ``v`` it takes the
   per-origin maximum ``K``.  Once it has delivered up to ``K`` itself: if
   every report equals ``K`` it promotes at once; otherwise it broadcasts
   ``cutoff(v, K)``;
3. a member that delivered ``cutoff(v, K)`` and has delivered up to ``K``
   broadcasts ``ready(v)``;
4. with ``ready(v)`` from every member of ``v`` the promoter promotes.

A view change restarts the protocol with the new version.  Why ``K`` covers
everything: a dead origin's messages only travel, in ``v``, from members
that hold them; every member reports after installing ``v`` a seq at least as
high as anything it holds then; so no survivor ever delivers a seq above
``K``, and after step 3/4 every survivor holds everything up to ``K``.
(GM's agreement guarantee says a survivor's message reaches every survivor.)

Promotion itself (:meth:`Coordinator.promote`): the same replica, same
address, same data swaps its behaviour to the coordinator; it broadcasts
``promoted(name, dst)`` first, then requeues every unacked message
(redelivered), cancels consumers that asked for x-cancel-on-ha-failover and
delivers to the others; it tells the registry (``Promoted``) and the channels
it knows (``NewMaster``).
"""

from __future__ import annotations

from typing import Any

from mirrorq.queue_process.messages import NotMaster, channel_id


class MirrorQueueSlave:
    """The mirror behaviour of a :class:`~mirrorq.queue_process.replica.QueueReplica`."""

    role = "slave"

    def __init__(self, replica: Any) -> None:
        self.r = replica

    # ---- client requests: not ours ---------------------------------------------
    def handle(self, now: float, src: Any, msg: Any) -> list:
        dst = _reply_dst(msg)
        if dst is None:
            return []
        return [self.r.send(dst, NotMaster(self.r.spec.name, self.r.master, msg))]

    # ---- operations from the master ---------------------------------------------
    def on_ops(self, origin: str, payload: list) -> None:
        r = self.r
        if r.master is not None and origin != r.master:
            r.stats["foreign_ops"] += 1
        _, ops, hwm, consumer_changes = payload
        for offset, rtype, body in ops:
            r.bq.apply((rtype, body), offset)
        apply_replicated_state(r, hwm, consumer_changes)

    def on_confirmed(self, now: float, first: int, last: int) -> list:
        return []  # a mirror broadcasts only control messages; nobody waits on them

    def timer(self, now: float, key: Any) -> list:
        return []


def apply_replicated_state(r: Any, hwm: list, consumer_changes: list) -> None:
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
