"""A mirrored queue on a real 3-node cluster, driven by the internal client.

* kill -9 the master's node in the middle of 20k confirmed publishes of
  1 KiB persistent messages; drain from a survivor: nothing confirmed is
  lost, nothing unexpected arrives (10 repetitions, one fresh queue each,
  the killed node restarted between them);
* a full cluster stop and start brings back a durable queue and its
  persistent messages.
"""

from __future__ import annotations

import os
import time

import pytest
from conftest import LocalCluster

from mirrorq.admin.cluster import wait_until
from mirrorq.gm.shell import parse_member_name
from mirrorq.queues.client import ClientError, InternalClient

pytestmark = pytest.mark.cluster

TOTAL = 20_000
BATCH = 500
REPETITIONS = int(os.environ.get("MIRRORQ_KILL_REPETITIONS", "10"))


admin_port = LocalCluster.admin_port


def tracebacks(c) -> str:
    """The nodes' daemon.out tracebacks (what a failed assertion should show)."""
    out = []
    for f in sorted(c.data_dir.glob("*/daemon.out")):
        text = f.read_text(errors="replace")
        if "Traceback" in text:
            out.append(f"--- {f.parent.name}:\n" + text[text.index("Traceback") :][-3000:])
    return "\n".join(out)


def seqs_of(deliveries):
    out = []
    for msg_id, body, redelivered, _epoch in deliveries:
        dst, n, seq = msg_id.split("|")
        out.append((int(seq), body, redelivered))
    return out


def test_kill_master_mid_publish_loses_nothing(cluster3):
    c = cluster3
    nodes = ["node1", "node2", "node3"]
    body = b"x" * 1024
    for rep in range(REPETITIONS):
        victim = nodes[rep % 3]
        survivor = nodes[(rep + 1) % 3]
        order = [victim] + [n for n in nodes if n != victim]
        qname = f"kill-{rep}"
        with InternalClient(admin_port(c, survivor)) as cl:
            rec = cl.declare_queue(qname, durable=True, nodes=order)
            assert parse_member_name(rec["pid"]).node == victim
            assert len(rec["slave_pids"]) == 2
            cl.open(qname)
            killed_at = None
            for i in range(0, TOTAL, BATCH):
                cl.publish(qname, [body] * BATCH)
                if killed_at is None and i + BATCH >= TOTAL // 2:
                    # half published: kill the master once a quarter is confirmed
                    # (waited for, so the kill always happens mid-publish)
                    wait_until(
                        lambda: cl.confirms(qname)["confirmed"] >= TOTAL // 4,
                        30,
                        what=f"{TOTAL // 4} confirms before the kill",
                    )
                    c.cluster.kill_node(victim)
                    killed_at = time.monotonic()
                if i % 5000 == 0:
                    cl.wait_confirms(qname, timeout=0.2)  # keep the window bounded
            st = cl.wait_confirms(qname, timeout=60)
            assert st["unconfirmed"] == 0 and st["nacked"] == 0, st
            assert st["confirmed"] == TOTAL
            assert parse_member_name(st["master"]).node != victim
            cl.consume(qname, prefetch=1000)
            got = seqs_of(cl.fetch_until(qname, TOTAL, timeout=60, idle=10.0))
            info = cl.info(qname)
        seen = {}
        for seq, b, redelivered in got:
            assert 1 <= seq <= TOTAL and b == body, f"unexpected message seq={seq}"
            if seq in seen:
                assert redelivered, f"seq {seq} delivered twice without redelivered"
            seen[seq] = True
        lost = TOTAL - len(seen)
        missing = sorted(set(range(1, TOTAL + 1)) - set(seen))
        assert lost == 0, (
            f"repetition {rep}: {lost} confirmed messages lost: {missing[:5]}..{missing[-5:]}; queue {info}\n{tracebacks(c)}"
        )
        c.cluster.start_node(victim)
        c.cluster.wait_all_up(nodes, timeout=30)


def test_full_cluster_restart_keeps_durable_queue_and_persistent_messages(cluster3):
    c = cluster3
    nodes = ["node1", "node2", "node3"]
    n_persistent, n_transient = 1000, 300
    with InternalClient(admin_port(c, "node1")) as cl:
        cl.declare_queue("durable-q", durable=True, nodes=nodes)
        cl.open("durable-q")
        cl.publish("durable-q", [b"p%d" % i for i in range(n_persistent)], persistent=True)
        cl.publish("durable-q", [b"t%d" % i for i in range(n_transient)], persistent=False)
        st = cl.wait_confirms("durable-q", timeout=30)
        assert st["confirmed"] == n_persistent + n_transient and st["unconfirmed"] == 0
    c.cluster.stop_all()
    for n in nodes:
        c.cluster.start_node(n)
    c.cluster.wait_all_up(nodes, timeout=30)
    with InternalClient(admin_port(c, "node3")) as cl:
        master = cl.open("durable-q")  # waits until a master is recorded
        assert master

        def recovered():
            try:
                return cl.info("durable-q", timeout=1.0)["messages"] == n_persistent
            except ClientError:
                return False  # the recorded master is the one that stopped: not recovered yet

        wait_until(recovered, 30, "the recovered queue's master")
        cl.consume("durable-q", prefetch=500)
        got = cl.fetch_until("durable-q", n_persistent, timeout=30, idle=10.0)
    bodies = sorted(b for _, b, _, _ in got)
    assert bodies == sorted(b"p%d" % i for i in range(n_persistent)), "persistent messages lost or transient ones back"


def test_after_a_full_restart_every_node_declares_at_once(cluster3):
    """The whole cluster stops and starts again; at once, before the queues
    are recovered, a client on every node re-declares the mirrored queue that
    holds messages and declares a new one.  Every declare is answered, each
    queue exists once, the old one with all its persistent messages."""
    import threading

    pika = pytest.importorskip("pika")
    c = cluster3
    nodes = ["node1", "node2", "node3"]
    assert (
        c.ctl(
            "set_policy",
            "--apply-to",
            "queues",
            "ha-restart",
            r"^restart\.",
            '{"ha-mode":"all","ha-sync-mode":"automatic"}',
        )
        == 0
    )
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("restart.q", durable=True)
    for i in range(200):
        ch.basic_publish("", "restart.q", b"r%d" % i, pika.BasicProperties(delivery_mode=2))
    conn.close()

    c.cluster.stop_all()
    for n in nodes:
        c.cluster.start_node(n)
    c.cluster.wait_all_up(nodes, timeout=30)

    answers: dict = {}

    def declare(k: int) -> None:
        try:
            cn = pika.BlockingConnection(
                pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + k, blocked_connection_timeout=60)
            )
            try:
                chan = cn.channel()
                answers[k] = [chan.queue_declare(q, durable=True).method.queue for q in ("restart.q", "restart.new")]
            finally:
                cn.close()
        except Exception as e:  # reported by the assertion below
            answers[k] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=declare, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == {k: ["restart.q", "restart.new"] for k in range(3)}, answers

    def rows():
        try:
            listed = c.json("list_queues", "name", "messages", "pid", "synchronised_slave_pids")
        except AssertionError:
            return {}  # mirrorctl failed (a master still recovering): look again
        return {r["name"]: r for r in listed if r["name"].startswith("restart.")}

    got = wait_until(
        lambda: (
            lambda r: (
                sorted(r) == ["restart.new", "restart.q"]
                and r["restart.q"]["messages"] == 200
                and all(len(x["synchronised_slave_pids"] or []) == 2 for x in r.values())
            )
        )(rows()),
        60,
        "both queues mirrored, the old one with its 200 messages",
    )
    assert got
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + 1))
    ch = conn.channel()
    bodies = []
    for _ in range(200):
        m, _p, body = ch.basic_get("restart.q", auto_ack=True)
        assert m is not None, f"restart.q ran dry after {len(bodies)} messages"
        bodies.append(body)
    conn.close()
    assert sorted(bodies) == sorted(b"r%d" % i for i in range(200))


def test_delete_stops_replicas_and_the_name_can_be_declared_again(cluster3):
    from mirrorq.node.client import NodeClient
    from mirrorq.node.messages import RegistryGet

    c = cluster3
    nodes = ["node1", "node2", "node3"]
    with InternalClient(admin_port(c, "node2")) as cl:
        cl.declare_queue("del-q", durable=True, nodes=nodes)
        cl.open("del-q")
        cl.publish("del-q", [b"m"] * 100)
        assert cl.wait_confirms("del-q", timeout=30)["confirmed"] == 100
        assert cl.command("del-q", "delete") == 100

    def records_gone():
        with NodeClient(admin_port(c, "node3")) as nc:
            q = nc.ask(RegistryGet("amqqueue", ["/", "del-q"]))
            g = nc.ask(RegistryGet("gm_group", ["queue:/del-q"]))
        return q.ok and not q.rows and g.ok and not g.rows

    wait_until(records_gone, 15, "the amqqueue and gm_group records of the deleted queue to go")

    def stores_gone():
        return not any((c.data_dir / n / "queues" / "%2F" / "del-q").exists() for n in nodes)

    wait_until(stores_gone, 15, "every replica to drop its store")
    with InternalClient(admin_port(c, "node1")) as cl:
        rec = cl.declare_queue("del-q", durable=True, nodes=nodes)
        assert len(rec["slave_pids"]) == 2
        cl.open("del-q")
        cl.publish("del-q", [b"n%d" % i for i in range(10)])
        assert cl.wait_confirms("del-q", timeout=30)["confirmed"] == 10
        cl.consume("del-q", prefetch=10)
        got = cl.fetch_until("del-q", 10, timeout=20)
    assert sorted(b for _, b, _, _ in got) == sorted(b"n%d" % i for i in range(10))
