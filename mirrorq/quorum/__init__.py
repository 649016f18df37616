"""Quorum queues: one Raft group per queue (``x-queue-type: quorum``).

* :mod:`.machine` -- the queue's state machine, applied to committed entries;
* :mod:`.replica` -- one member of a queue's group: a Raft node, the machine,
  and the channel protocol of :mod:`mirrorq.queue_process.messages`.
"""
