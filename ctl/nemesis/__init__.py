"""Jepsen-style fault injection for a local mirrorq cluster.

* :mod:`.schedule` -- which faults, when (pure, seeded);
* :mod:`.net` -- partitions by real packet filtering (cgroup v2 + iptables);
* :mod:`.clients` -- pika publishers (confirms) and consumers (one ack per
  message) that reconnect elsewhere and record a history;
* :mod:`.history` -- the history's JSON-lines format;
* :mod:`.checker` -- total-queue checker (pure);
* :mod:`.runner` -- one run on a real cluster (always stopped and cleaned).

``bench/nemesis.py --minutes N`` runs long ones; ``tests/cluster/test_nemesis.py``
the seeded acceptance run.
"""
