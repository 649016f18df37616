"""The admin layer: what mirrorctl and the HTTP management API both use.

* :mod:`.cluster` -- a cluster found through its data dir: its nodes'
  configs and processes (start, stop, kill, add, forget), a node's status,
  and the errors every admin call raises (``ClusterError`` and kinds);
* :mod:`.session` -- a tool's session with one running node: registry
  reads and transactions, queue commands, connections, with deadlines;
* :mod:`.ops` -- the listings (rabbitmqctl's info items) and operations
  (policies, users, vhosts, permissions, queues, limits);
* :mod:`.ring` -- every queue's GM ring as rows, and as text.
"""
