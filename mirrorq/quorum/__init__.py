"""Quorum queues: one Raft group per queue (``x-queue-type: quorum``).

* :mod:`.machine` -- the queue's state machine, applied to committed entries;
* :mod:`.replica` -- one member of a queue's group: a Raft node, the machine,
  and the channel protocol of :mod:`mirrorq.queues.messages`;
* :mod:`.hosted` -- the shell of a member inside a node's queue host
  (names, addresses, the queue's record, durability and time per turn);
* the declare rules live with every queue's in :mod:`mirrorq.queues.semantics` (406 naming what is wrong).

A declare places the members (:mod:`mirrorq.queues.manager_core`);
front ends talk to the leader exactly as to a classic master
(:class:`~mirrorq.queues.channel.QueueChannel`, epochs ordered by term).
"""
