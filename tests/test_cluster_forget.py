"""mirrorq.admin.cluster.Cluster.forget_node when the node it asks stops between its
status and the read of its pid file: a ClusterError, not a TypeError."""

from __future__ import annotations

import pytest

from mirrorq.admin.cluster import Cluster, ClusterError
from mirrorq.node.messages import NodeStatus


def test_forget_node_through_a_node_that_stopped_after_its_status(tmp_path, monkeypatch):
    c = Cluster(tmp_path)
    c.create(3, 30000, 31000, 0.2, 1.5)
    answered = NodeStatus(
        name="node1",
        incarnation=1,
        pid=1,
        pgid=1,
        admin_port=30000,
        amqp_port=31000,
        view={"node3": {"state": "down"}},
        registry={"voters": ["node1", "node2", "node3"], "learners": []},
    )
    # node1 answers its status; no node has a pid file (node1 stopped right after answering)
    monkeypatch.setattr(c, "status", lambda name, timeout=3.0: answered if name == "node1" else None)
    with pytest.raises(ClusterError, match="node node1 is not running any more"):
        c.forget_node("node3", via="node1")
