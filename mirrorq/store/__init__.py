"""On-disk storage shared by the queues and the registry.

* :mod:`.segment_log` -- an append-only log of typed records in segment files (classic replicas' store);
* :mod:`.group_sync` -- one device flush for the writes of many files (a queue host's turn, the registry);
* :mod:`.corruption` -- what a replica does when its store is corrupt at start.
"""
