"""A node restarted with a different ``host`` than it had (here 127.0.0.2:
any address other than the tool's own 127.0.0.1) rejoins through
``mirrorctl start_node``, and its peers know it at the new address: the
tools reach a node at the address it runs on, not at the tool's own."""

from __future__ import annotations

import pytest
import yaml

pytestmark = pytest.mark.cluster


def test_a_node_restarted_on_another_address_rejoins(cluster3, capsys):
    c = cluster3
    assert c.ctl("stop_node", "node3") == 0
    path = c.data_dir / "node3" / "node.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["host"] = "127.0.0.2"
    path.write_text(yaml.safe_dump(raw))
    assert c.ctl("start_node", "node3") == 0  # waits until every node sees every other one up
    assert c.cluster.admin_address("node3") == ("127.0.0.2", raw["admin_port"])
    rows = c.json("cluster", "status")
    assert {r["name"]: (r["state"], len(r["sees_up"])) for r in rows} == {
        n: ("running", 3) for n in ("node1", "node2", "node3")
    }
    st = c.cluster.status("node1")
    assert st is not None and st.peers["node3"] == f"127.0.0.2:{raw['admin_port']}"
    assert c.json("-n", "node3", "list_queues") == []  # a session with the moved node
