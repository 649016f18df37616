"""Resource alarms on a real 3-node cluster (mirrorq.node.alarms).

A tiny memory watermark set on node1 with mirrorctl blocks a pika publisher
connected to node2 (connection.blocked, "low on memory"): it stops making
progress while a consumer on node3 drains another queue; the alarm shows in
``status``, ``cluster status``, /api/nodes, /api/health/checks/alarms (503)
and /metrics, and node1's log.  Raising the watermark unblocks it
(connection.unblocked); the publisher finishes and every message is in its
queue.  An alarm of a node that goes down stops counting.
"""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request

import conftest
import pytest
from conftest import wait_for

from mirrorq.node.log import read as read_log

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

PUBLISHES = 400
BACKLOG = 200


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        yield c


def http(c, node: int, path: str):
    """(status, JSON body) of a GET on node ``node``'s management server (guest)."""
    req = urllib.request.Request(f"http://127.0.0.1:{c.management_base_port + node}{path}")
    req.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    except OSError:
        return None, None  # not listening yet
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def connect(c, node: int):
    return pika.BlockingConnection(
        pika.ConnectionParameters("127.0.0.1", c.amqp_base_port + node, connection_attempts=3)
    )


class Publisher(threading.Thread):
    """Publishes PUBLISHES persistent messages with confirms, one at a time,
    on its own connection; counts the confirmed ones and records
    connection.blocked / connection.unblocked."""

    def __init__(self, c, node: int, queue: str) -> None:
        super().__init__(daemon=True)
        self.c, self.node, self.queue = c, node, queue
        self.confirmed = 0
        self.blocked: list[str] = []
        self.unblocked = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = connect(self.c, self.node)
            # on the connection under pika's BlockingConnection: the blocking one runs its
            # own callbacks only once the call waiting (here basic_publish, for a confirm) returns
            conn._impl.add_on_connection_blocked_callback(lambda _c, frame: self.blocked.append(frame.method.reason))
            conn._impl.add_on_connection_unblocked_callback(lambda _c, _frame: self.unblocked.set())
            ch = conn.channel()
            ch.confirm_delivery()
            for i in range(PUBLISHES):
                ch.basic_publish("", self.queue, b"p%d" % i, pika.BasicProperties(delivery_mode=2))
                self.confirmed += 1
            conn.close()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def messages(c, queue: str, node: str = "node1") -> int | None:
    return c.queue_row(queue, node).get("messages")


def test_an_alarm_on_one_node_blocks_publishers_on_another_while_consumers_drain(cluster):
    c = cluster
    with connect(c, 0) as conn:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("alarm.pub", durable=True)
        ch.queue_declare("alarm.backlog", durable=True)
        for i in range(BACKLOG):
            ch.basic_publish("", "alarm.backlog", b"b%d" % i, pika.BasicProperties(delivery_mode=2))
    pub = Publisher(c, 1, "alarm.pub")  # on node2
    pub.start()
    consumer = connect(c, 2)  # on node3: it only consumes
    try:
        wait_for(lambda: (pub.confirmed >= 50 or pub.error is not None, pub.confirmed), 30, "the publisher under way")
        assert pub.error is None, pub.error
        assert c.ctl("set_vm_memory_high_watermark", "-n", "node1", "absolute", "1MB") == 0
        wait_for(lambda: (bool(pub.blocked), pub.confirmed), 15, "connection.blocked at the publisher on node2")
        assert pub.blocked == ["low on memory"]

        # node2 has handled what it read before the block: the publisher's
        # connection is blocked and none of its publishes waits for a confirm
        def settled():
            chans = c.json("list_channels", "-n", "node2", "messages_unconfirmed")
            conns = c.json("list_connections", "-n", "node2", "state")
            return (
                [r["state"] for r in conns] == ["blocked"] and len(chans) == 1 and chans[0]["messages_unconfirmed"] == 0
            ), (conns, chans)

        wait_for(settled, 15, "the publisher's connection blocked with nothing unconfirmed")
        stuck = messages(c, "alarm.pub")
        wait_for(lambda: (pub.confirmed == stuck, (pub.confirmed, stuck)), 15, "the client holding every confirm sent")
        assert stuck < PUBLISHES

        # the consumer on node3 drains the backlog; meanwhile the publisher makes no progress
        cch = consumer.channel()
        cch.basic_qos(prefetch_count=10)
        drained = 0
        for method, _props, _body in cch.consume("alarm.backlog", inactivity_timeout=15):
            assert method is not None, f"the consumer stalled after {drained} messages"
            cch.basic_ack(method.delivery_tag)
            drained += 1
            if drained == BACKLOG:
                break
        cch.cancel()
        assert messages(c, "alarm.pub") == stuck and pub.confirmed == stuck
        assert pub.error is None and not pub.unblocked.is_set()

        conns = c.json("list_connections", "-n", "node2", "pid", "node", "state")
        states = {r["node"]: r["state"] for r in c.json("list_connections", "pid", "node", "state")}
        assert [r["state"] for r in conns if r["node"] == "node2"] == ["blocked"], conns
        assert states.get("node3") == "blocking"  # an alarm is on; it has not published
        assert {"node": "node1", "resource": "memory"} in c.json("status", "-n", "node3")["alarms"]
        rows = {r["name"]: r for r in c.json("cluster", "status")}
        assert rows["node1"]["alarms"] == ["memory"] and rows["node2"]["alarms"] == []
        status, body = wait_for(
            lambda: ((s := http(c, 1, "/api/health/checks/alarms"))[0] == 503, s),
            30,
            "the alarms health check of node2 failing",
        )
        assert body["status"] == "failed" and {"node": "node1", "resource": "memory"} in body["alarms"]
        status, nodes = wait_for(lambda: ((s := http(c, 2, "/api/nodes"))[0] == 200, s), 30, "/api/nodes of node3")
        n1 = next(n for n in nodes if n["name"] == "node1")
        assert n1["mem_alarm"] is True and n1["mem_limit"] == 1_000_000
        assert n1["disk_free_alarm"] is False and n1["disk_free"] > n1["disk_free_limit"] == 50_000_000
        metrics = scrape(c, 0)
        assert metrics["rabbitmq_alarms_memory_used_watermark"] == 1
        assert metrics["rabbitmq_alarms_free_disk_space_watermark"] == 0
        assert metrics["rabbitmq_resident_memory_limit_bytes"] == 1_000_000
        assert metrics["rabbitmq_disk_space_available_limit_bytes"] == 50_000_000

        assert c.ctl("set_vm_memory_high_watermark", "-n", "node1", "0.4") == 0
        wait_for(lambda: (pub.unblocked.is_set(), pub.confirmed), 15, "connection.unblocked at the publisher")
        pub.join(60)
        assert not pub.is_alive() and pub.error is None and pub.confirmed == PUBLISHES
        assert messages(c, "alarm.pub") == PUBLISHES
        assert messages(c, "alarm.backlog") == 0
        wait_for(
            lambda: ((s := http(c, 1, "/api/health/checks/alarms"))[0] == 200, s),
            30,
            "the alarms health check of node2 passing again",
        )
        log = read_log(str(c.data_dir / "node1"))
        sets = [r for r in log if r["event"] == "alarm_set" and r.get("alarm_node") == "node1"]
        clears = [r for r in log if r["event"] == "alarm_cleared" and r.get("alarm_node") == "node1"]
        assert sets and sets[-1]["resource"] == "memory" and sets[-1]["used"] > sets[-1]["limit"] == 1_000_000
        assert clears and clears[-1]["used"] <= clears[-1]["limit"]
    finally:
        consumer.close()
        pub.join(5)


def scrape(c, node: int) -> dict:
    """node ``node``'s /metrics: unlabelled samples by name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{c.management_base_port + node}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_the_alarm_of_a_node_that_goes_down_stops_counting(cluster):
    c = cluster
    assert c.ctl("set_disk_free_limit", "-n", "node3", "mem_relative", "100") == 0  # more than any disk here
    wait_for(
        lambda: ((s := http(c, 0, "/api/health/checks/alarms"))[0] == 503, s), 30, "node3's disk alarm seen from node1"
    )
    assert http(c, 0, "/api/health/checks/local-alarms")[0] == 200  # node1's own: none
    assert c.json("status", "-n", "node1")["alarms"] == [{"node": "node3", "resource": "disk"}]
    assert c.ctl("kill_node", "node3") == 0
    wait_for(lambda: ((s := http(c, 0, "/api/health/checks/alarms"))[0] == 200, s), 30, "node3's alarm gone with node3")
    with connect(c, 0) as conn:  # publishers are served again
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", "alarm.pub", b"after", pika.BasicProperties(delivery_mode=2))
    cleared = [
        r
        for r in read_log(str(c.data_dir / "node1"))
        if r["event"] == "alarm_cleared" and r.get("alarm_node") == "node3"
    ]
    assert cleared and cleared[-1]["reason"] == "node down"


def test_bad_limits_are_usage_errors(cluster):
    c = cluster
    assert c.ctl("set_vm_memory_high_watermark", "-n", "node1", "2") == 64
    assert c.ctl("set_vm_memory_high_watermark", "-n", "node1", "absolute", "lots") == 64
    assert c.ctl("set_disk_free_limit", "-n", "node1", "fifty") == 64
    assert c.ctl("set_disk_free_limit", "-n", "node1", "mem_relative", "x") == 64
