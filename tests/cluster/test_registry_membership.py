"""Registry membership on a real cluster: ``mirrorctl add_node`` grows a
3-node cluster by a 4th node that joins the Raft configuration (learner, then
voter) and reads what was written before it joined; ``mirrorctl
forget_cluster_node`` refuses a running or unknown node, removes a killed one
(the voter set shrinks, writes still commit); the forgotten node restarted
neither disturbs the leader nor gets back in."""

from __future__ import annotations

import time

import pytest
from conftest import LocalCluster, free_port_block

from mirrorq.admin.cluster import poll
from mirrorq.node import log as nodelog
from mirrorq.node.client import NodeClient
from mirrorq.node.messages import RegistryForget, RegistryGet, RegistryResult, RegistryRows, RegistryTxn

pytestmark = pytest.mark.cluster


def put(table, key, record):
    return RegistryTxn({"ops": [{"op": "put", "table": table, "key": key, "record": record}]})


def ask(c, node, msg, timeout=5.0):
    with NodeClient(int(c.cluster.pid_info(node)["admin_port"])) as cl:
        return cl.ask(msg, timeout)


def vhosts(c, node):
    r = ask(c, node, RegistryGet("vhost"))
    assert isinstance(r, RegistryRows) and r.ok, r
    return {row["name"] for row in r.rows}


def registry(c, node):
    st = c.cluster.status(node)
    return st.registry if st else {}


def leader(c, nodes):
    for n in nodes:
        if registry(c, n).get("role") == "leader":
            return n
    return None


def write(c, node, name):
    r = ask(c, node, put("vhost", name, {"name": name}))
    return isinstance(r, RegistryResult) and r.ok


@pytest.fixture
def cluster3s(data_root):
    c = LocalCluster(data_root, 3, interval=0.2, timeout=1.5)
    c.snapshot_every = 30  # the joiner catches up through a snapshot
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_add_node_forget_node_and_forgotten_node_returns(cluster3s, capsys):
    c = cluster3s
    first = ["node1", "node2", "node3"]
    lead = poll(lambda: leader(c, first), 10)
    assert lead
    before = {f"before-{i}" for i in range(40)}
    for i, name in enumerate(sorted(before)):
        assert write(c, first[i % 3], name)

    # ---- a 4th node joins: learner -> voter, sees the old writes ----------------
    admin = free_port_block(1, start=c.base_port + 10)
    amqp = free_port_block(1, start=admin + 1)
    assert c.ctl("add_node", "node4", "--admin-port", str(admin), "--amqp-port", str(amqp)) == 0
    everyone = first + ["node4"]
    assert poll(lambda: all(sorted(registry(c, n).get("voters", [])) == everyone for n in everyone), 15), {
        n: registry(c, n) for n in everyone
    }
    assert poll(lambda: before <= vhosts(c, "node4"), 30)  # a local read on the new node
    assert write(c, "node4", "from-node4")  # forwarded to the leader
    assert poll(lambda: all("from-node4" in vhosts(c, n) for n in everyone), 30)
    assert leader(c, everyone) == lead, "a join must not cost a leader change"
    # node4 went through the learner stage, and caught up by a snapshot
    n4 = nodelog.read(str(c.data_dir / "node4"))
    configs = [(r["voters"], r["learners"]) for r in n4 if r["event"] == "registry_config"]
    assert (first, ["node4"]) in configs and (everyone, []) in configs, configs
    assert any(r["event"] == "registry_snapshot_installed" for r in n4)
    assert not any(r["event"] == "registry_leader" and r["leader"] == "node4" for r in n4)

    # ---- forget_cluster_node: refusals -------------------------------------------
    victim = next(n for n in first if n != lead)
    capsys.readouterr()
    assert c.ctl("forget_cluster_node", victim) == 70  # rabbitmqctl: a software error (EX_SOFTWARE)
    assert f"node {victim} is running" in capsys.readouterr().err
    assert c.ctl("forget_cluster_node", "nodeX") == 70  # rabbitmqctl: not a cluster node (EX_SOFTWARE)
    assert "unknown node 'nodeX'" in capsys.readouterr().err
    r = ask(c, lead, RegistryForget(victim))  # the agent itself refuses a node it sees up
    assert isinstance(r, RegistryResult) and not r.ok and "is up" in r.error

    # ---- kill it, forget it: the voter set shrinks, writes commit ---------------
    assert c.cluster.kill_node(victim)
    live = [n for n in everyone if n != victim]
    via = next(n for n in live if n != lead)  # through a follower: forwarded
    rc = poll(lambda: c.ctl("forget_cluster_node", victim, "-n", via) == 0, 10, step=0.3)
    assert rc, capsys.readouterr().err
    assert poll(lambda: all(sorted(registry(c, n).get("voters", [])) == live for n in live), 30)
    for i in range(5):
        assert write(c, live[i % 3], f"after-forget-{i}")
    term = registry(c, lead)["term"]
    assert leader(c, live) == lead

    # ---- the forgotten node comes back: no disruption, not re-added ------------
    assert c.ctl("start_node", victim) == 0
    t_end = time.monotonic() + 3.0  # > 2 election timeouts and 2 probe rounds
    i = 0
    while time.monotonic() < t_end:
        i += 1
        assert write(c, live[i % 3], f"back-{i}")
        time.sleep(0.1)
    assert leader(c, live) == lead and registry(c, lead)["term"] == term
    assert all(sorted(registry(c, n)["voters"]) == live for n in live)
    back = registry(c, victim)
    assert back.get("role") != "leader" and back.get("joining") is False
    assert all(f"back-{i}" in vhosts(c, n) for n in live)
