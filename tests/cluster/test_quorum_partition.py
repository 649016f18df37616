"""A quorum queue's leader cut off in a minority partition confirms nothing.

Three nodes started in the nemesis' cgroups (mirrorq/nemesis/net.py: real
packet filtering between the nodes; clients are never cut).  The queue is
declared through node3, so node3's member leads (client-local).  node3 is
then partitioned from node1 and node2: a publisher connected to node3 gets
no confirm while the partition holds (its leader cannot reach a majority),
while a publisher connected to node1 is confirmed by the new leader the
majority elects.  After the heal node3's unconfirmed publish is confirmed
too, and every confirmed message is in the queue once.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

import conftest
from conftest import wait_for

pika = pytest.importorskip("pika")
from mirrorq.nemesis import net  # noqa: E402

ok, why = net.available()
pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not ok, reason=why)]


@pytest.fixture
def cut_cluster():
    from ctl.cluster import Cluster

    d = Path(tempfile.mkdtemp(dir=conftest._ROOT))
    names = ["node1", "node2", "node3"]
    nem = net.NetNemesis(names).open()
    cluster = Cluster(d)
    cluster.launch_prefix = lambda name: ["sh", "-c", 'echo $$ > "$0" && exec "$@"', nem.procs_file(name)]
    try:
        base = conftest.free_port_block(7)
        cluster.create(3, base, base + 4, 0.2, 1.5)
        for n in names:
            cluster.start_node(n)
        cluster.wait_all_up(names, 60)
        cluster.amqp_base_port = base + 4
        yield cluster, nem
    finally:
        nem.close()
        cluster.stop_all()
        left = conftest.processes_under(d)
        conftest.kill_pids(left)
        shutil.rmtree(d, ignore_errors=True)


def _queue_leader(cluster, name: str, node: str) -> str | None:
    """The queue's leader as ``node``'s registry copy says (mirrorctl list_queues)."""
    from ctl.mirrorctl import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--data-dir", str(cluster.data_dir), "--formatter", "json", "list_queues", "-n", node,
                   "name", "leader"])
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
        failed: list = []

        def publish_on_minority() -> None:
            try:
                ch3.basic_publish("", q, b"minority", pika.BasicProperties(delivery_mode=2))
                confirmed3.set()
            except Exception as e:  # pragma: no cover - reported below
                failed.append(repr(e))

        t = threading.Thread(target=publish_on_minority, daemon=True)
        t.start()
        # the majority elects a leader and confirms what node1's client publishes
        conn1 = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        ch1 = conn1.channel()
        ch1.confirm_delivery()
        wait_for(lambda: (_queue_leader(cluster, q, "node1") in ("node1", "node2"), _queue_leader(cluster, q, "node1")),
                 30, "a leader on the majority side")
        for i in range(20):
            ch1.basic_publish("", q, f"majority-{i}".encode(), pika.BasicProperties(delivery_mode=2))
        # all the while, node3's publish is not confirmed: its side has no majority
        assert not confirmed3.is_set(), "a minority leader confirmed a publish"
        nem.heal()
        wait_for(lambda: (confirmed3.is_set() or bool(failed), failed), 60, "node3's publish confirmed after the heal")
        assert not failed, failed
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
