"""Message TTL, per-message expiration and queue expiry (x-expires) on a real
3-node cluster with the queues mirrored on every node: idle queues, a queue
being published to, and across a kill of the master's node.

Time lives in the queue core as wall-clock deadlines stored with each
message (so a mirror promoted after a failover expires the same messages at
the same instants); the replica hands its core one clock per turn.  Before,
the replica's actor fed the core wall-clock time while its GM shell fed it
monotonic time: a TTL timer armed with the difference of the two crashed the
master in a loop ("OverflowError: timeout is too large") and nothing expired.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

POLICY = '{"ha-mode":"all","ha-sync-mode":"automatic"}'


def _row(c, name: str, node: str = "node1") -> dict:
    return c.queue_row(name, node)


def _channel(c, node: int = 0):
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + node))
    ch = conn.channel()
    ch.confirm_delivery()
    return conn, ch


def _no_crash(c) -> None:
    for node in ("node1", "node2", "node3"):
        p = Path(c.data_dir) / node / "node.log"
        text = p.read_text() if p.exists() else ""
        assert "OverflowError" not in text and "message_failed" not in text, f"{node}: {text[-2000:]}"


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        assert c.ctl("set_policy", "--apply-to", "queues", "ha-ttl", r"^ttl\.", POLICY) == 0
        yield c


def test_idle_queue_expires_messages_by_queue_ttl_and_per_message_expiration(cluster):
    c = cluster
    conn, ch = _channel(c)
    try:
        ch.queue_declare("ttl.q", durable=True, arguments={"x-message-ttl": 400})
        ch.queue_declare("ttl.per", durable=True)
        c.wait_mirrored("ttl.q")
        c.wait_mirrored("ttl.per")
        for i in range(20):
            ch.basic_publish("", "ttl.q", b"q%d" % i, pika.BasicProperties(delivery_mode=2))
            ch.basic_publish("", "ttl.per", b"p%d" % i, pika.BasicProperties(delivery_mode=2, expiration="300"))
        ch.basic_publish("", "ttl.per", b"keep", pika.BasicProperties(delivery_mode=2))  # no expiration: stays
    finally:
        conn.close()
    # nobody touches the queues: the TTL timers alone expire them, on every replica
    for node in ("node1", "node2", "node3"):
        wait_for(
            lambda: (_row(c, "ttl.q", node).get("messages") == 0, _row(c, "ttl.q", node)),
            10,
            f"ttl.q expired on {node}",
        )
        wait_for(
            lambda: (_row(c, "ttl.per", node).get("messages") == 1, _row(c, "ttl.per", node)),
            10,
            f"ttl.per's expiring messages gone on {node}",
        )
    assert _row(c, "ttl.q")["state"] == "running" and len(_row(c, "ttl.q")["synchronised_slave_pids"]) == 2
    _no_crash(c)


def test_busy_queue_keeps_expiring_while_published_to(cluster):
    c = cluster
    conn, ch = _channel(c, node=1)
    try:
        ch.queue_declare("ttl.busy", durable=True, arguments={"x-message-ttl": 200})
        c.wait_mirrored("ttl.busy")
        # publish (confirmed, one at a time) for 10 TTLs and at least 100 messages
        deadline = time.monotonic() + 2.0
        n = 0
        while time.monotonic() < deadline or n <= 100:
            ch.basic_publish("", "ttl.busy", b"b%d" % n, pika.BasicProperties(delivery_mode=2))
            n += 1
        got = ch.basic_get("ttl.busy", auto_ack=True)  # a consumer reads only what has not expired
        assert got[0] is None or int(got[2][1:]) > n - 2000
    finally:
        conn.close()
    wait_for(lambda: (_row(c, "ttl.busy").get("messages") == 0, _row(c, "ttl.busy")), 10, "ttl.busy drained by TTL")
    _no_crash(c)


def test_x_expires_deletes_an_unused_queue(cluster):
    c = cluster
    conn, ch = _channel(c)
    try:
        ch.queue_declare("ttl.expires", durable=True, arguments={"x-expires": 800})
    finally:
        conn.close()
    wait_for(lambda: (not _row(c, "ttl.expires"), _row(c, "ttl.expires")), 15, "the unused queue deleted")
    conn, ch = _channel(c)
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
            ch.queue_declare("ttl.expires", passive=True)
        assert err.value.reply_code == 404
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def test_ttl_across_a_failover(cluster3):
    """Deadlines travel with the messages: after the master's node is killed
    the promoted mirror expires them at the same time, and TTL keeps working
    for what is published to it."""
    c = cluster3
    assert c.ctl("set_policy", "--apply-to", "queues", "ha-ttl", r"^ttl\.", POLICY) == 0
    conn, ch = _channel(c)
    try:
        ch.queue_declare("ttl.fo", durable=True, arguments={"x-message-ttl": 3000})
        c.wait_mirrored("ttl.fo")
        for i in range(20):
            ch.basic_publish("", "ttl.fo", b"f%d" % i, pika.BasicProperties(delivery_mode=2))
    finally:
        conn.close()
    master = _row(c, "ttl.fo")["pid"]
    c.cluster.kill_node(master)
    survivor = next(n for n in ("node1", "node2", "node3") if n != master)
    wait_for(
        lambda: (_row(c, "ttl.fo", survivor).get("pid") not in (None, master), _row(c, "ttl.fo", survivor)),
        15,
        "a new master",
    )
    wait_for(
        lambda: (_row(c, "ttl.fo", survivor).get("messages") == 0, _row(c, "ttl.fo", survivor)),
        15,
        "the old master's messages expired by the new one",
    )
    port = int(c.cluster.pid_info(survivor)["amqp_port"])
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", "ttl.fo", b"late", pika.BasicProperties(delivery_mode=2, expiration="300"))
    finally:
        conn.close()
    wait_for(
        lambda: (_row(c, "ttl.fo", survivor).get("messages") == 0, _row(c, "ttl.fo", survivor)),
        10,
        "a message published to the new master expired",
    )
    _no_crash(c)
