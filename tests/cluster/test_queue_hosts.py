"""Queue hosts on a real 3-node cluster: many replicas per process, and a
fault in one replica stops that replica only.

* A node's OS processes do not grow with its queues: declaring 40 mirrored
  queues adds no process on any node (each replica lives in one of the
  node's fixed queue hosts).
* Crash isolation: the test-only hook ``FailReplica`` (honoured with
  MIRRORQ_TEST_HOOKS=1) makes one replica's code raise inside its host.
  That replica -- a mirror of queue A on node2 -- is reported
  (``replica_crashed``), removed from A's view and started again by
  placement (a new member on node2 that syncs); queue B, whose node2 mirror
  lives in the same host process, keeps its member and serves throughout;
  no confirmed message of either queue is lost.
"""

from __future__ import annotations

import os
from pathlib import Path

import conftest
import pytest
from conftest import wait_for

from mirrorq.gm.shell import member_address, parse_member_name
from mirrorq.node.client import NodeClient
from mirrorq.node.posting import ToReplica
from mirrorq.node.registry_client import RegistryClient
from mirrorq.queues.host import FailReplica, default_hosts, host_index

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

POLICY = '{"ha-mode":"all","ha-sync-mode":"automatic"}'


@pytest.fixture(scope="module")
def cluster():
    os.environ["MIRRORQ_TEST_HOOKS"] = "1"
    try:
        with conftest.running_cluster() as c:
            assert c.ctl("set_policy", "--apply-to", "queues", "ha-hosts", r"^hosts\.", POLICY) == 0
            yield c
    finally:
        os.environ.pop("MIRRORQ_TEST_HOOKS", None)


def _row(c, name: str) -> dict:
    rows = [
        r
        for r in c.json("list_queues", "name", "messages", "slave_pids", "synchronised_slave_pids", "pid")
        if r["name"] == name
    ]
    return rows[0] if rows else {}


def _record(c, name: str) -> dict:
    """The queue's amqqueue row, member names in full."""
    nc = NodeClient(c.admin_port("node1"))
    try:
        reg = RegistryClient("test")
        r = nc.ask(reg.get(0.0, "amqqueue", ["/", name], "row"), 5)
    finally:
        nc.close()
    return r.rows[0] if r is not None and r.ok and r.rows else {}


def _node_processes(c, node: str) -> int:
    pgid = int(c.cluster.pid_info(node)["pgid"])
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                n += os.getpgid(int(d)) == pgid
            except OSError:
                pass
    return n


def _declare_and_fill(c, names: list[str], messages: int) -> None:
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for q in names:
            ch.queue_declare(q, durable=True)
            for i in range(messages):
                ch.basic_publish("", q, b"%s-%d" % (q.encode(), i), pika.BasicProperties(delivery_mode=2))
    finally:
        conn.close()


def _mirrored(c, name: str) -> dict:
    return wait_for(
        lambda: (len(_row(c, name).get("synchronised_slave_pids") or []) == 2, _row(c, name)),
        60,
        f"{name} synchronised on both other nodes",
    )


def test_processes_per_node_do_not_grow_with_queues(cluster):
    c = cluster
    _declare_and_fill(c, ["hosts.warm"], 0)
    _mirrored(c, "hosts.warm")
    before = {n: _node_processes(c, n) for n in ("node1", "node2", "node3")}
    names = [f"hosts.many.{i}" for i in range(40)]
    _declare_and_fill(c, names, 0)
    for q in names:
        _mirrored(c, q)
    after = {n: _node_processes(c, n) for n in ("node1", "node2", "node3")}
    assert all(after[n] <= before[n] for n in before), (
        f"processes per node before {before}, after 40 more mirrored queues {after}"
    )


def test_a_crashing_replica_stops_alone_and_is_started_again(cluster):
    c = cluster
    hosts = default_hosts()
    a = "hosts.crash.a"
    b = next(
        f"hosts.crash.b{i}"
        for i in range(1000)
        if host_index("/", f"hosts.crash.b{i}", hosts) == host_index("/", a, hosts)
    )
    _declare_and_fill(c, [a, b], 50)
    _mirrored(c, a)
    _mirrored(c, b)
    victim = next(m for m in _record(c, a)["slave_pids"] if parse_member_name(m).node == "node2")
    b_mirror = next(m for m in _record(c, b)["slave_pids"] if parse_member_name(m).node == "node2")
    assert member_address(victim) == member_address(b_mirror)  # one host process holds both

    nc = NodeClient(c.admin_port("node2"))
    try:
        nc.asys.tell(member_address(victim), ToReplica(victim, FailReplica()))
    finally:
        nc.close()

    log = Path(c.data_dir) / "node2" / "node.log"
    wait_for(
        lambda: ('"replica_crashed"' in log.read_text() and victim in log.read_text(), None),
        20,
        "node2 to report the crashed replica",
    )
    # A: the crashed member leaves the view; placement starts a new node2 mirror, which syncs
    wait_for(
        lambda: (
            (
                lambda rec: (
                    victim not in rec.get("gm_pids", [victim])
                    and any(parse_member_name(m).node == "node2" for m in rec.get("sync_slave_pids", []))
                )
            )(_record(c, a)),
            _record(c, a),
        ),
        60,
        f"{a}: the crashed mirror replaced by a new synchronised one on node2",
    )
    # B: untouched, same member on node2, still serving
    assert b_mirror in _record(c, b)["sync_slave_pids"]
    _declare_and_fill(c, [b], 5)
    assert wait_for(lambda: (_row(c, b).get("messages") == 55, _row(c, b)), 20, f"{b} has 55 messages")
    assert wait_for(lambda: (_row(c, a).get("messages") == 50, _row(c, a)), 20, f"{a} kept its 50 messages")
    text = log.read_text()
    assert text.count('"replica_crashed"') == 1, "only the one replica crashed"
