"""Dead-lettering on a real 3-node cluster, queues mirrored on every node,
through pika: rejected, expired and max-length messages reach the
dead-letter exchange with RabbitMQ's ``x-death`` header; the retry-with-delay
pattern (a TTL queue dead-lettering back to the work queue) loops; a cycle
without a rejection is dropped; a policy sets a dead-letter exchange; and a
kill of the master's node while messages are being rejected neither loses
nor doubles one of them.
"""

from __future__ import annotations

import collections
import contextlib
import time

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

POLICY = '{"ha-mode":"all","ha-sync-mode":"automatic"}'


def _row(c, name: str, node: str = "node1") -> dict:
    return c.queue_row(name, node)


def _channel(c, node: int = 0, confirm: bool = True):
    return c.channel(node, confirm)


def _fanout_dead_letters(c, ch, prefix: str) -> None:
    """``PREFIX.work`` dead-letters to the fanout ``PREFIX.x``, bound to ``PREFIX.dead``; both mirrored."""
    ch.exchange_declare(f"{prefix}.x", "fanout", durable=True)
    ch.queue_declare(f"{prefix}.dead", durable=True)
    ch.queue_bind(f"{prefix}.dead", f"{prefix}.x")
    ch.queue_declare(f"{prefix}.work", durable=True, arguments={"x-dead-letter-exchange": f"{prefix}.x"})
    c.wait_mirrored(f"{prefix}.work")
    c.wait_mirrored(f"{prefix}.dead")


def _drain(ch, queue: str, n: int, timeout: float = 30) -> list:
    """n messages from ``queue`` (acked): [(body, properties)]."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        m, props, body = ch.basic_get(queue)
        if m is None:
            ch.connection.process_data_events(0.05)
            continue
        ch.basic_ack(m.delivery_tag)
        got.append((body, props))
    assert len(got) == n, f"{queue}: {len(got)} of {n} messages arrived"
    return got


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster() as c:
        assert c.ctl("set_policy", "--apply-to", "queues", "ha-dl", r"^dl\.", POLICY) == 0
        yield c


def test_rejected_messages_reach_the_dead_letter_exchange_with_x_death(cluster):
    c = cluster
    with _channel(c) as ch:
        _fanout_dead_letters(c, ch, "dl")
        for i in range(30):
            ch.basic_publish(
                "",
                "dl.work",
                b"r%02d" % i,
                pika.BasicProperties(delivery_mode=2, expiration="60000" if i % 2 else None, headers={"n": i}),
            )
    with _channel(c, node=1) as ch:  # a node other than the declaring one
        for i in range(30):
            m, _props, body = ch.basic_get("dl.work")
            assert m is not None, f"message {i} missing"
            (ch.basic_reject if i % 3 else ch.basic_nack)(m.delivery_tag, requeue=False)
        got = _drain(ch, "dl.dead", 30)
    assert sorted(b for b, _ in got) == [b"r%02d" % i for i in range(30)]
    for body, props in got:
        i = int(body[1:])
        h = props.headers
        (death,) = h["x-death"]
        assert death["count"] == 1 and death["reason"] == "rejected" and death["queue"] == "dl.work"
        assert death["exchange"] == "" and death["routing-keys"] == ["dl.work"]
        assert isinstance(death["time"], __import__("datetime").datetime)
        assert h["x-first-death-reason"] == "rejected" and h["x-first-death-queue"] == "dl.work"
        assert h["n"] == i and props.delivery_mode == 2
        assert props.expiration is None  # moved into x-death
        assert death.get("original-expiration") == ("60000" if i % 2 else None)
    for node in ("node1", "node2", "node3"):
        wait_for(
            lambda: (_row(c, "dl.work", node).get("messages") == 0, _row(c, "dl.work", node)),
            10,
            f"dl.work empty on {node}",
        )


def test_retry_with_delay_loops_and_a_cycle_without_rejection_is_dropped(cluster):
    """work --reject--> delay (TTL 200 ms) --expired--> work: the message
    comes back with both deaths counted; a queue whose expired messages
    would come straight back to itself drops them (RabbitMQ's cycle rule)."""
    c = cluster
    with _channel(c, node=2) as ch:
        ch.queue_declare(
            "dl.retry.work",
            durable=True,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dl.retry.delay"},
        )
        ch.queue_declare(
            "dl.retry.delay",
            durable=True,
            arguments={
                "x-message-ttl": 200,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": "dl.retry.work",
            },
        )
        ch.queue_declare(
            "dl.self",
            durable=True,
            arguments={"x-message-ttl": 100, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dl.self"},
        )
        ch.basic_publish("", "dl.retry.work", b"job", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("", "dl.self", b"loop", pika.BasicProperties(delivery_mode=2))
        for attempt in range(1, 4):
            deadline = time.monotonic() + 20
            m = None
            while m is None and time.monotonic() < deadline:
                m, props, body = ch.basic_get("dl.retry.work")
                if m is None:
                    ch.connection.process_data_events(0.05)
            assert m is not None and body == b"job", f"attempt {attempt}: the job did not come back"
            deaths = {(d["queue"], d["reason"]): d["count"] for d in (props.headers or {}).get("x-death", [])}
            want = (
                {}
                if attempt == 1
                else {("dl.retry.work", "rejected"): attempt - 1, ("dl.retry.delay", "expired"): attempt - 1}
            )
            assert deaths == want, f"attempt {attempt}: {props.headers}"
            ch.basic_reject(m.delivery_tag, requeue=False)
    wait_for(lambda: (_row(c, "dl.self").get("messages") == 0, _row(c, "dl.self")), 10, "the self-cycle dropped")
    # dropped for good: a message looping would be back within its 100 ms TTL, over and over
    seen = [_row(c, "dl.self").get("messages") for _ in range(8)]
    assert seen == [0] * 8, seen


def test_max_length_and_a_policy_set_dead_letter_exchange(cluster):
    c = cluster
    policy = '{"ha-mode":"all","dead-letter-exchange":"dl.pol.x","dead-letter-routing-key":"overflow"}'
    assert c.ctl("set_policy", "--apply-to", "queues", "--priority", "5", "dl-pol", r"^dl\.pol\.q$", policy) == 0
    with _channel(c) as ch:
        ch.exchange_declare("dl.pol.x", "direct", durable=True)
        ch.queue_declare("dl.pol.dead", durable=True)
        ch.queue_bind("dl.pol.dead", "dl.pol.x", "overflow")
        ch.queue_declare("dl.pol.q", durable=True, arguments={"x-max-length": 5})
        c.wait_mirrored("dl.pol.q")
        for i in range(12):
            ch.basic_publish("", "dl.pol.q", b"m%02d" % i, pika.BasicProperties(delivery_mode=2))
        got = _drain(ch, "dl.pol.dead", 7)
        assert [b for b, _ in got] == [b"m%02d" % i for i in range(7)]  # the oldest, dropped from the head
        assert all(p.headers["x-death"][0]["reason"] == "maxlen" for _, p in got)
        assert all(p.headers["x-death"][0]["routing-keys"] == ["dl.pol.q"] for _, p in got)
        assert [b for b, _ in _drain(ch, "dl.pol.q", 5)] == [b"m%02d" % i for i in range(7, 12)]


def test_reject_publish_dlx_nacks_and_dead_letters_what_it_refuses(cluster):
    c = cluster
    with _channel(c) as ch:
        ch.exchange_declare("dl.rpd.x", "fanout", durable=True)
        ch.queue_declare("dl.rpd.dead", durable=True)
        ch.queue_bind("dl.rpd.dead", "dl.rpd.x")
        ch.queue_declare(
            "dl.rpd.q",
            durable=True,
            arguments={"x-max-length": 2, "x-overflow": "reject-publish-dlx", "x-dead-letter-exchange": "dl.rpd.x"},
        )
        c.wait_mirrored("dl.rpd.q")
        c.wait_mirrored("dl.rpd.dead")
        nacked = []
        for i in range(5):
            try:
                ch.basic_publish("", "dl.rpd.q", b"m%d" % i, pika.BasicProperties(delivery_mode=2, headers={"n": i}))
            except pika.exceptions.NackError:
                nacked.append(i)
        assert nacked == [2, 3, 4]  # the publisher hears of the refusals
    with _channel(c, node=2) as ch:
        got = _drain(ch, "dl.rpd.dead", 3)
        assert [b for b, _ in got] == [b"m2", b"m3", b"m4"]  # and they were dead-lettered, in order
        for body, props in got:
            (death,) = props.headers["x-death"]
            assert death["reason"] == "maxlen" and death["queue"] == "dl.rpd.q" and death["count"] == 1
            assert props.headers["n"] == int(body[1:]) and props.delivery_mode == 2
        assert [b for b, _ in _drain(ch, "dl.rpd.q", 2)] == [b"m0", b"m1"]
    for node in ("node1", "node2", "node3"):
        for q in ("dl.rpd.q", "dl.rpd.dead"):
            wait_for(lambda: (_row(c, q, node).get("messages") == 0, _row(c, q, node)), 10, f"{q} empty on {node}")


def test_a_kill_of_the_masters_node_neither_loses_nor_doubles_a_dead_lettered_message(cluster3):
    c = cluster3
    assert c.ctl("set_policy", "--apply-to", "queues", "ha-dl", r"^dl\.", POLICY) == 0
    n = 400
    with _channel(c) as ch:
        _fanout_dead_letters(c, ch, "dl.fo")
        for i in range(n):
            ch.basic_publish("", "dl.fo.work", b"f%04d" % i, pika.BasicProperties(delivery_mode=2))
    master = _row(c, "dl.fo.work")["pid"]
    others = [i for i, name in enumerate(("node1", "node2", "node3")) if name != master]
    survivor = ("node1", "node2", "node3")[others[0]]
    port = int(c.cluster.pid_info(survivor)["amqp_port"])
    rejected = 0
    killed = False
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
        except pika.exceptions.AMQPConnectionError:
            continue
        try:
            ch = conn.channel()
            ch.basic_qos(prefetch_count=20)
            for m, _p, _body in ch.consume("dl.fo.work", inactivity_timeout=2):
                if m is None:
                    if killed and _row(c, "dl.fo.work", survivor).get("messages") == 0:
                        break
                    continue
                ch.basic_reject(m.delivery_tag, requeue=False)
                rejected += 1
                if rejected == n // 3 and not killed:
                    killed = True
                    c.cluster.kill_node(master)
            else:
                continue
            break
        except (pika.exceptions.AMQPError, pika.exceptions.ChannelClosedByBroker):
            continue  # the queue's master moved under the consumer: consume again
        finally:
            with contextlib.suppress(Exception):
                conn.close()
    assert killed, "the master was never killed"
    wait_for(
        lambda: (_row(c, "dl.fo.work", survivor).get("messages") == 0, _row(c, "dl.fo.work", survivor)),
        30,
        "every message rejected",
    )
    wait_for(
        lambda: (_row(c, "dl.fo.dead", survivor).get("messages") == n, _row(c, "dl.fo.dead", survivor)),
        30,
        f"{n} messages dead-lettered",
    )
    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    try:
        got = _drain(conn.channel(), "dl.fo.dead", n)
    finally:
        conn.close()
    counts = collections.Counter(b for b, _ in got)
    assert sorted(counts) == [b"f%04d" % i for i in range(n)], "a dead-lettered message was lost"
    assert max(counts.values()) == 1, f"doubled: {[b for b, k in counts.items() if k > 1][:5]}"
