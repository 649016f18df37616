"""The replicated registry on a real 3-node cluster: writes from any node,
leader failover, catch-up through a snapshot, and a minority that cannot
commit.  The partition uses the test-only transport hook BlockPeers
(honoured only with MIRRORQ_TEST_HOOKS=1): the agents drop all traffic with
the blocked nodes, heartbeats included."""

from __future__ import annotations

import os
import time

import pytest
from conftest import LocalCluster

from mirrorq.admin.cluster import poll
from mirrorq.node import log as nodelog
from mirrorq.node.client import NodeClient
from mirrorq.node.messages import BlockPeers, RegistryGet, RegistryResult, RegistryRows, RegistryTxn

pytestmark = pytest.mark.cluster


def put_vhost(name):
    return {"ops": [{"op": "put", "table": "vhost", "key": name, "record": {"name": name}}]}


def ask(c, node, msg, timeout=5.0):
    info = c.cluster.pid_info(node)
    with NodeClient(int(info["admin_port"])) as cl:
        return cl.ask(msg, timeout)


def rows(c, node):
    r = ask(c, node, RegistryGet("vhost"))
    assert isinstance(r, RegistryRows) and r.ok
    return {row["name"] for row in r.rows}


def leader(c, nodes):
    for n in nodes:
        st = c.cluster.status(n)
        if st and st.registry.get("role") == "leader":
            return n
    return None


@pytest.fixture
def reg_cluster(data_root):
    os.environ["MIRRORQ_TEST_HOOKS"] = "1"
    c = LocalCluster(data_root, 3, interval=0.2, timeout=1.5)
    c.snapshot_every = 50
    try:
        c.start()
        yield c
    finally:
        c.stop()
        os.environ.pop("MIRRORQ_TEST_HOOKS", None)


def test_write_anywhere_failover_and_snapshot_catch_up(reg_cluster):
    c = reg_cluster
    names = ["node1", "node2", "node3"]
    first = poll(lambda: leader(c, names), 10)
    assert first
    follower = next(n for n in names if n != first)
    res = ask(c, follower, RegistryTxn(put_vhost("v-follower")))  # forwarded to the leader
    assert isinstance(res, RegistryResult) and res.ok, res
    assert poll(lambda: all("v-follower" in rows(c, n) for n in names), 30)
    bad = ask(c, follower, RegistryTxn({"ops": [{"op": "put", "table": "queues", "key": "x", "record": {}}]}))
    assert not bad.ok and "no table 'queues'" in bad.error

    # kill -9 the leader's node: a survivor commits a write within 2 s
    survivors = [n for n in names if n != first]
    killed_at = time.monotonic()
    assert c.ctl("kill_node", first) == 0
    committed_at = None
    i = 0
    while time.monotonic() - killed_at < 10 and committed_at is None:
        i += 1
        r = ask(c, survivors[i % 2], RegistryTxn(put_vhost(f"after-{i}")), timeout=3)
        if isinstance(r, RegistryResult) and r.ok:
            committed_at = time.monotonic()
    assert committed_at is not None, "no write committed after the leader died"
    assert committed_at - killed_at <= 2.5, f"failover took {committed_at - killed_at:.2f}s"

    # many writes while it is down: the log compacts past what it has
    acked = {"v-follower", f"after-{i}"}
    for j in range(120):
        r = ask(c, survivors[j % 2], RegistryTxn(put_vhost(f"bulk-{j}")))
        assert r.ok, r
        acked.add(f"bulk-{j}")
    assert c.ctl("start_node", first) == 0
    assert poll(lambda: acked <= rows(c, first), 10), (
        f"restarted node did not catch up: {sorted(acked - rows(c, first))[:5]}"
    )
    assert poll(lambda: rows(c, first) == rows(c, survivors[0]) == rows(c, survivors[1]), 30)
    assert any(r["event"] == "registry_snapshot_installed" for r in nodelog.read(str(c.data_dir / first)))


def test_minority_cannot_commit_while_majority_can(reg_cluster):
    c = reg_cluster
    names = ["node1", "node2", "node3"]
    assert poll(lambda: leader(c, names), 10)
    lonely = leader(c, names)  # cut off the leader itself: the hardest case
    rest = [n for n in names if n != lonely]
    assert ask(c, lonely, BlockPeers(tuple(rest))).ok
    for n in rest:
        assert ask(c, n, BlockPeers((lonely,))).ok
    r = ask(c, lonely, RegistryTxn(put_vhost("minority")), timeout=10)
    assert isinstance(r, RegistryResult) and not r.ok, r
    ok = poll(
        lambda: (lambda r: isinstance(r, RegistryResult) and r.ok)(ask(c, rest[0], RegistryTxn(put_vhost("majority")))),
        10,
    )
    assert ok
    # heal: the old leader learns the majority's write and never the minority's
    for n in names:
        assert ask(c, n, BlockPeers(())).ok
    assert poll(lambda: "majority" in rows(c, lonely), 10)
    assert all("minority" not in rows(c, n) for n in names)
