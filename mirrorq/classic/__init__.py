"""Classic mirrored queues: a master and its mirrors on a GM ring (RabbitMQ's classic mirrored queues).

* :mod:`.amqqueue` -- the queue's semantics on the master (consumers, TTL, limits);
* :mod:`.backing_queue` -- a replica's messages as a log of operations (on :mod:`mirrorq.store.segment_log`);
* :mod:`.replica` -- one replica: a GM member driving a master (:mod:`.coordinator`) or a mirror
  (:mod:`.mirror_queue_slave`) behaviour; :mod:`.actor` hosts it in a queue host;
* :mod:`.payloads` -- what replicas broadcast, typed, one encode/decode table;
* :mod:`.confirms` -- publisher confirms, the master's ledger (:mod:`.confirm_probe` names a slow mirror);
* :mod:`.promotion` -- how the survivors agree on what a dead master sent and elect its successor;
* :mod:`.sync` -- a late mirror catching up by log offset;
* :mod:`.history`, :mod:`.latency` -- the master's operation history in the node log, its confirm latency.
"""
