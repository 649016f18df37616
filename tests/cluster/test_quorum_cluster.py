"""Quorum queues (``x-queue-type: quorum``) on a real 3-node cluster, through pika.

A declare places one Raft member per node in the nodes' queue hosts and
the elected leader writes the queue's record; confirmed publishes are
consumed once each with per-message acks; a nack with requeue comes back
redelivered with ``x-delivery-count``, and ``x-delivery-limit`` drops it;
RabbitMQ's declare rules answer 406 naming the argument; a kill of the
leader's node (repeated) loses no confirmed message while a publisher and
a per-message-ack consumer keep going; a restarted node's member comes
back from its log; delete removes the queue everywhere.
"""

from __future__ import annotations

import contextlib
import threading
import time

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

QUORUM = {"x-queue-type": "quorum"}


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster(3) as c:
        yield c


def _channel(c, node: int = 0, confirm: bool = True):
    return c.channel(node, confirm)


def _row(c, name: str, node: str = "node1") -> dict:
    rows = c.json("list_queues", "-n", node, "name", "type", "pid", "members", "leader", "messages")
    return next((r for r in rows if r["name"] == name), {})


def _leader_node(c, name: str, via: str = "node1") -> str:
    row = wait_for(lambda: (bool(_row(c, name, via).get("leader")), _row(c, name, via)), 30, f"{name}'s leader")
    return row["leader"]


def test_declare_publish_consume_with_per_message_acks(cluster):
    c = cluster
    with _channel(c) as ch:
        ok = ch.queue_declare("qq.basic", durable=True, arguments=QUORUM)
        assert ok.method.queue == "qq.basic"
        row = _row(c, "qq.basic")
        assert row["type"] == "quorum"
        assert sorted(m.split("/")[0] for m in row["members"]) == ["node1", "node2", "node3"]
        for i in range(200):
            ch.basic_publish("", "qq.basic", str(i).encode(), pika.BasicProperties(delivery_mode=2))
        # a re-declare with the same arguments is fine, through another node too
        with _channel(c, 2) as ch3:
            assert ch3.queue_declare("qq.basic", durable=True, arguments=QUORUM).method.message_count == 200
        ch.basic_qos(prefetch_count=50)
        got: list[int] = []
        for method, _props, body in ch.consume("qq.basic", inactivity_timeout=10):
            assert method is not None, f"stalled after {len(got)} messages"
            got.append(int(body))
            ch.basic_ack(method.delivery_tag)
            if len(got) == 200:
                break
        ch.cancel()
        assert got == list(range(200))  # once each, in publish order
        assert ch.queue_declare("qq.basic", passive=True).method.message_count == 0


def test_requeued_message_carries_delivery_count_and_the_limit_drops_it(cluster):
    c = cluster
    with _channel(c, 1) as ch:
        ch.queue_declare("qq.limit", durable=True, arguments={**QUORUM, "x-delivery-limit": 2})
        ch.basic_publish("", "qq.limit", b"poison", pika.BasicProperties(delivery_mode=2))
        counts = []
        for _ in range(3):
            m = wait_for(lambda: ((r := ch.basic_get("qq.limit"))[0] is not None, r), 15, "the message again")
            method, props, _body = m
            counts.append(((props.headers or {}).get("x-delivery-count"), method.redelivered))
            ch.basic_nack(method.delivery_tag, requeue=True)
        assert counts == [(None, False), (1, True), (2, True)]
        # its third return takes the count above the limit: dropped
        wait_for(
            lambda: (ch.queue_declare("qq.limit", passive=True).method.message_count == 0, None),
            15,
            "the message dropped by x-delivery-limit",
        )
        assert ch.basic_get("qq.limit")[0] is None


def test_lookahead_held_by_the_front_end_goes_back_uncounted_when_the_consumer_cancels(cluster):
    """A per-message-ack consumer with prefetch 2 on a deep backlog: its
    front end is sent deliveries beyond the prefetch (the queue counts them
    unacknowledged) and hands one over per ack; when the consumer cancels,
    those the client never saw go back as released: at the head, in order,
    flagged redelivered but without an ``x-delivery-count``."""
    c = cluster
    name = "qq.lookahead"
    with _channel(c) as ch:
        ch.queue_declare(name, durable=True, arguments=QUORUM)
        for i in range(700):
            ch.basic_publish("", name, str(i).encode(), pika.BasicProperties(delivery_mode=2))
        ch.basic_qos(prefetch_count=2)
        got = []
        for method, _props, body in ch.consume(name, inactivity_timeout=10):
            assert method is not None, f"stalled after {len(got)} messages"
            got.append((method.delivery_tag, int(body)))
            if len(got) == 2:
                break
        assert [b for _, b in got] == [0, 1]

        def unacked() -> int:
            rows = c.json("list_queues", "name", "messages_unacknowledged")
            return next(r["messages_unacknowledged"] for r in rows if r["name"] == name)

        wait_for(lambda: (unacked() > 2, unacked()), 20, "deliveries beyond the prefetch held by the front end")
        ch.cancel()
        wait_for(lambda: (unacked() == 2, unacked()), 20, "the held deliveries given back")
        with _channel(c, 1, confirm=False) as other:
            method, props, body = wait_for(lambda: ((r := other.basic_get(name))[0] is not None, r), 15, "a message")
            assert int(body) == 2  # the first one the client never saw, back at the head
            assert method.redelivered and "x-delivery-count" not in (props.headers or {})
            other.basic_ack(method.delivery_tag)
        for tag, _ in got:
            ch.basic_ack(tag)
        ch.queue_delete(name)


def test_dead_lettering_rejected_and_over_the_delivery_limit(cluster):
    """x-dead-letter-exchange on a quorum queue: a rejected message and one
    returned past x-delivery-limit reach the dead-letter queue with RabbitMQ's
    x-death header (reasons rejected and delivery_limit)."""
    c = cluster
    with _channel(c, 1) as ch:
        ch.queue_declare("qq.dlx.target", durable=True)
        ch.queue_declare(
            "qq.dlx",
            durable=True,
            arguments={
                **QUORUM,
                "x-delivery-limit": 0,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": "qq.dlx.target",
            },
        )
        for body in (b"rejected", b"returned"):
            ch.basic_publish("", "qq.dlx", body, pika.BasicProperties(delivery_mode=2))
        for requeue in (False, True):
            method, _props, _body = wait_for(lambda: ((r := ch.basic_get("qq.dlx"))[0] is not None, r), 15, "a message")
            ch.basic_nack(method.delivery_tag, requeue=requeue)
        got = {}
        for _ in range(2):
            method, props, body = wait_for(
                lambda: ((r := ch.basic_get("qq.dlx.target"))[0] is not None, r), 15, "a dead-lettered message"
            )
            death = props.headers["x-death"][0]
            got[body] = (death["reason"], death["queue"], death["count"])
            ch.basic_ack(method.delivery_tag)
        assert got == {b"rejected": ("rejected", "qq.dlx", 1), b"returned": ("delivery_limit", "qq.dlx", 1)}
        assert ch.queue_declare("qq.dlx", passive=True).method.message_count == 0
        ch.queue_delete("qq.dlx")
        ch.queue_delete("qq.dlx.target")


@pytest.mark.parametrize(
    "arguments,flags,words",
    [
        ({"x-max-priority": 5}, {}, "x-max-priority"),
        ({"x-queue-mode": "lazy"}, {}, "x-queue-mode"),
        ({"x-quorum-initial-group-size": 0}, {}, "x-quorum-initial-group-size"),
        ({}, {"durable": False}, "non-durable"),
        ({}, {"exclusive": True}, "exclusive"),
        ({}, {"auto_delete": True}, "auto-delete"),
    ],
)
def test_declare_rules_refuse_with_406_naming_what(cluster, arguments, flags, words):
    with _channel(cluster, confirm=False) as ch:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            ch.queue_declare("qq.refused", **{"durable": True, **flags}, arguments={**QUORUM, **arguments})
        assert e.value.reply_code == 406
        assert words in e.value.reply_text


def test_initial_group_size_and_delete(cluster):
    c = cluster
    with _channel(c) as ch:
        ch.queue_declare("qq.two", durable=True, arguments={**QUORUM, "x-quorum-initial-group-size": 2})
        row = _row(c, "qq.two")
        assert len(row["members"]) == 2 and row["members"][0] == "node1"  # the declaring node first
        ch.basic_publish("", "qq.two", b"x", pika.BasicProperties(delivery_mode=2))
        assert ch.queue_delete("qq.two").method.message_count == 1
    wait_for(lambda: (not _row(c, "qq.two", "node3"), _row(c, "qq.two", "node3")), 15, "qq.two gone everywhere")
    gone = list((c.data_dir).glob("node*/quorum/*/qq.two/*"))
    wait_for(lambda: (not list(c.data_dir.glob("node*/quorum/*/qq.two/*")), gone), 15, "the members' logs removed")


def _connect(c, first: int):
    """A connection to the first node that takes one, trying ``first`` on."""
    for k in range(3 * 20):
        try:
            return pika.BlockingConnection(
                pika.ConnectionParameters(
                    "127.0.0.1", c.amqp_base_port + (first + k) % 3, connection_attempts=1, socket_timeout=2
                )
            )
        except pika.exceptions.AMQPConnectionError:
            time.sleep(0.1)  # every node refused: one is restarting
    raise AssertionError("no node accepted a connection")


def test_leader_kills_lose_no_confirmed_message(cluster):
    """A publisher (confirms) and a per-message-ack consumer keep going
    while the leader's node is killed with SIGKILL and started again, ten
    times; a client whose node died connects to another.  Every message
    whose publish was confirmed is consumed (at least once)."""
    c = cluster
    name = "qq.kills"
    with _channel(c) as ch:
        ch.queue_declare(name, durable=True, arguments=QUORUM)
    confirmed: set[int] = set()
    consumed: set[int] = set()
    stop = threading.Event()
    errors: list = []

    def publisher() -> None:
        i, node = 0, 0
        while not stop.is_set():
            conn = _connect(c, node)
            try:
                ch = conn.channel()
                ch.confirm_delivery()
                while not stop.is_set():
                    ch.basic_publish("", name, str(i).encode(), pika.BasicProperties(delivery_mode=2))
                    confirmed.add(i)  # a BlockingChannel publish returns once confirmed (raises on a nack)
                    i += 1
            except (pika.exceptions.AMQPError, OSError):
                i += 1  # that one's outcome is unknown: not counted as confirmed
                node += 1
            finally:
                with contextlib.suppress(Exception):
                    conn.close()

    def consumer() -> None:
        node = 1
        while True:
            conn = _connect(c, node)
            try:
                ch = conn.channel()
                ch.basic_qos(prefetch_count=100)
                for method, _p, body in ch.consume(name, inactivity_timeout=1):
                    if method is not None:
                        consumed.add(int(body))
                        ch.basic_ack(method.delivery_tag)
                    elif stop.is_set() and confirmed <= consumed:
                        return
            except (pika.exceptions.AMQPError, OSError):
                node += 1
            except Exception as e:  # pragma: no cover - reported below
                errors.append(repr(e))
                return
            finally:
                with contextlib.suppress(Exception):
                    conn.close()

    threads = [threading.Thread(target=publisher, daemon=True), threading.Thread(target=consumer, daemon=True)]
    for t in threads:
        t.start()
    try:
        for k in range(10):
            before = len(confirmed)
            wait_for(lambda: (len(confirmed) >= before + 100, len(confirmed)), 60, f"publishes confirmed (round {k})")
            leader = _leader_node(c, name, via="node1" if k % 2 else "node2")
            assert c.cluster.kill_node(leader), f"{leader} was not running"
            after = len(confirmed)
            wait_for(
                lambda: (len(confirmed) >= after + 100, len(confirmed)),
                60,
                f"publishes confirmed after killing {leader} (round {k})",
            )
            c.cluster.start_node(leader)
        stop.set()
        threads[0].join(30)
        threads[1].join(60)
        assert not errors, errors
        lost = confirmed - consumed
        assert not lost, f"{len(lost)} of {len(confirmed)} confirmed messages not consumed, e.g. {sorted(lost)[:10]}"
    finally:
        stop.set()
