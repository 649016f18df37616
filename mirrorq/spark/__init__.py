"""mirrorq on Spark: the ``mirrorq`` data source (:mod:`.source`), the queue
-> parquet driver (:mod:`.pipe`) and the audit of cluster histories
(:mod:`.audit`, ``mirrorctl audit``).  The guarantees are stated in
:mod:`.source`; the broker's side in :mod:`mirrorq.amqp.stream`."""
