"""What both queue types share: semantics, the channel protocol, hosting and the queue manager.

* :mod:`.semantics` -- errors, limits and argument rules of every queue;
* :mod:`.messages` -- what channels and replicas say to each other (publish, deliver, settle);
* :mod:`.channel` -- a channel's side of that protocol (:mod:`.channel_actor`, :mod:`.client`: the internal client);
* :mod:`.control` -- what the queue manager, its queue hosts and the replicas in them say to each other;
* :mod:`.manager_core` -- declares, placement steps, recovery (:mod:`.manager`: its actor);
* :mod:`.host` -- a queue host: one process running many replicas of both types.

Classic queues: :mod:`mirrorq.classic`; quorum queues: :mod:`mirrorq.quorum`.
"""
