"""A quorum queue's leader cut off in a minority partition confirms nothing.

Three nodes started in the nemesis' cgroups (ctl/nemesis/net.py: real
packet filtering between the nodes; clients are never cut).  The queue is
declared through node3, so node3's member leads (client-local).  node3 is
then partitioned from node1 and node2: a publisher connected to node3 gets
no confirm while the partition holds (its leader cannot reach a majority),
while a publisher connected to node1 is confirmed by the new leader the
majority elects.  node3, in a minority, pauses (pause_minority) and closes
its client with 320 CONNECTION_FORCED; the client publishes again through
node1, and after the heal every confirmed message is in the queue once
(the minority leader's unconfirmed entry is not).
"""

from __future__ import annotations

import contextlib
import io
import json
import threading

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")
from ctl.nemesis import net  # noqa: E402

ok, why = net.available()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not ok, reason=why)]


@pytest.fixture
def cut_cluster():
    with conftest.nemesis_cluster(3) as (cluster, nem):
        yield cluster, nem


def _queue_leader(cluster, name: str, node: str) -> str | None:
    """The queue's leader as ``node``'s registry copy says (mirrorctl list_queues)."""
    from ctl.mirrorctl import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(
            ["--data-dir", str(cluster.data_dir), "--formatter", "json", "list_queues", "-n", node, "name", "leader"]
        )
    rows = json.loads(out.getvalue()) if rc == 0 else []
    return next((r["leader"] for r in rows if r["name"] == name), None)


def test_minority_leader_confirms_nothing(cut_cluster):
    cluster, nem = cut_cluster
    port = cluster.amqp_base_port
    q = "qq.partition"
    conn3 = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port + 2))
    conn1 = None
    try:
        ch3 = conn3.channel()
        ch3.queue_declare(q, durable=True, arguments={"x-queue-type": "quorum"})
        ch3.confirm_delivery()
        ch3.basic_publish("", q, b"before", pika.BasicProperties(delivery_mode=2))
        assert _queue_leader(cluster, q, "node1") == "node3"
        nem.partition([{"node3"}, {"node1", "node2"}])
        confirmed3 = threading.Event()
        closed3: list = []
        failed: list = []

        def publish_on_minority() -> None:
            try:
                ch3.basic_publish("", q, b"minority", pika.BasicProperties(delivery_mode=2))
                confirmed3.set()
            except pika.exceptions.ConnectionClosedByBroker as e:
                closed3.append((e.reply_code, e.reply_text))
            except Exception as e:  # pragma: no cover - reported below
                failed.append(repr(e))

        t = threading.Thread(target=publish_on_minority, daemon=True)
        t.start()
        # the majority elects a leader and confirms what node1's client publishes
        conn1 = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        ch1 = conn1.channel()
        ch1.confirm_delivery()
        wait_for(
            lambda: (_queue_leader(cluster, q, "node1") in ("node1", "node2"), _queue_leader(cluster, q, "node1")),
            30,
            "a leader on the majority side",
        )
        for i in range(20):
            ch1.basic_publish("", q, f"majority-{i}".encode(), pika.BasicProperties(delivery_mode=2))
        # node3's publish is not confirmed (its side has no majority): node3 pauses and
        # closes its client with 320, which then publishes again through the majority
        wait_for(
            lambda: (bool(closed3 or failed or confirmed3.is_set()), (closed3, failed)), 30, "node3 closing its client"
        )
        assert not confirmed3.is_set(), "a minority leader confirmed a publish"
        assert not failed and closed3[0][0] == 320 and "minority" in closed3[0][1], (closed3, failed)
        ch1.basic_publish("", q, b"minority", pika.BasicProperties(delivery_mode=2))
        nem.heal()
        bodies = []
        ch1.basic_qos(prefetch_count=100)
        for method, _p, body in ch1.consume(q, inactivity_timeout=5):
            if method is None:
                break
            bodies.append(body.decode())
            ch1.basic_ack(method.delivery_tag)
        assert sorted(bodies) == sorted(["before", "minority"] + [f"majority-{i}" for i in range(20)])
    finally:
        for c in (conn1, conn3):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
