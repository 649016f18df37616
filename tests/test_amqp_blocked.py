"""Resource alarms in the AMQP connection core and the front end
(mirrorq.amqp.connection: Connection.resource_alarm; mirrorq.amqp.frontend):
RabbitMQ's blocking / blocked states, connection.blocked and
connection.unblocked for clients that announced the capability, and
consumers that keep being served."""

from __future__ import annotations

from amqp_harness import Harness
from pamqp import commands as C
from test_amqp_frontend import Host

from mirrorq.amqp import connection as cn
from mirrorq.amqp.frontend import FrontEnd
from mirrorq.node.messages import AlarmSubscribe, ResourceAlarms

MEMORY = "low on memory"


def publisher(blocked_notify: bool = True, heartbeat: int = 0) -> Harness:
    h = Harness()
    h.handshake(blocked_notify=blocked_notify, heartbeat=heartbeat)
    h.open_channel(1)
    h.send(1, C.Queue.Declare(queue="q"), C.Confirm.Select())
    h.frames()
    return h


def names(h: Harness) -> list[str]:
    return [getattr(v, "name", type(v).__name__) for _, v in h.frames()]


def publish(h: Harness, n: int = 1, start: int = 0) -> None:
    h.send_raw(b"".join(h.publish(1, b"m%d" % (start + i), "", "q") for i in range(n)))


def in_queue(h: Harness) -> int:
    return h.by_queue["q"].q.info()["messages_ready"]


def test_a_connection_that_has_not_published_is_blocking_until_its_first_publish():
    h = publisher()
    h._run(h.conn.resource_alarm(h.now, MEMORY))
    assert h.frames() == [] and h.conn.throttle == "blocking" and h.conn.wants_read()
    assert h.conn.info()["state"] == "blocking"
    publish(h, 3)  # what was read is handled: routed and confirmed
    fr = h.frames()
    blocked = [v for _, v in fr if isinstance(v, C.Connection.Blocked)]
    assert len(blocked) == 1 and blocked[0].reason == MEMORY
    assert any(isinstance(v, C.Basic.Ack) and v.delivery_tag == 3 for _, v in fr)
    assert in_queue(h) == 3
    assert not h.conn.wants_read() and h.conn.info()["state"] == "blocked"
    h._run(h.conn.resource_alarm(h.now, ""))
    assert names(h) == ["Connection.Unblocked"]
    assert h.conn.wants_read() and h.conn.info()["state"] == "running"
    publish(h, 1, start=3)  # read again: it publishes as before
    assert in_queue(h) == 4 and h.conn.throttle == "running"


def test_a_connection_that_has_published_is_blocked_as_soon_as_an_alarm_is_raised():
    h = publisher()
    publish(h, 2)
    h.frames()
    h._run(h.conn.resource_alarm(h.now, MEMORY))
    fr = h.frames()
    assert len(fr) == 1 and isinstance(fr[0][1], C.Connection.Blocked) and fr[0][1].reason == MEMORY
    assert not h.conn.wants_read()


def test_blocked_is_sent_once_per_blocking_and_unblocked_once_every_alarm_cleared():
    h = publisher()
    publish(h)
    h.frames()
    h._run(h.conn.resource_alarm(h.now, MEMORY))
    assert names(h) == ["Connection.Blocked"]
    h._run(h.conn.resource_alarm(h.now, "low on memory & low on disk"))  # another alarm meanwhile
    h._run(h.conn.resource_alarm(h.now, "low on disk"))  # memory cleared, disk not
    assert h.frames() == [] and not h.conn.wants_read()
    h._run(h.conn.resource_alarm(h.now, ""))
    assert names(h) == ["Connection.Unblocked"] and h.conn.wants_read()
    h._run(h.conn.resource_alarm(h.now, "low on disk"))  # a new alarm: a new notification
    assert names(h) == ["Connection.Blocked"]


def test_a_client_without_the_capability_is_blocked_without_being_told():
    h = publisher(blocked_notify=False)
    publish(h)
    h.frames()
    h._run(h.conn.resource_alarm(h.now, MEMORY))
    assert h.frames() == [] and not h.conn.wants_read() and h.conn.info()["state"] == "blocked"
    h._run(h.conn.resource_alarm(h.now, ""))
    assert h.frames() == [] and h.conn.wants_read()


def test_the_server_announces_the_connection_blocked_capability():
    h = Harness()
    h.send_raw(cn.PROTOCOL_HEADER)
    start = h.frames()[0][1]
    assert start.server_properties["capabilities"]["connection.blocked"] is True


def test_a_connection_that_only_consumes_is_never_blocked_and_keeps_being_served():
    h = Harness()
    h.handshake(blocked_notify=True)
    h.open_channel(1)
    h.send(1, C.Queue.Declare(queue="q"), C.Basic.Qos(prefetch_count=1))
    h.frames()
    master = h.by_queue["q"]
    for i in range(3):  # published by another connection
        master.q.publish(h.now, ("elsewhere:1", 9), i + 1, f"m{i}", b"m%d" % i, {}, False)
    h._run(h.conn.resource_alarm(h.now, MEMORY))
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    got = []
    for _ in range(3):
        delivers = [v for _, v in h.frames() if isinstance(v, C.Basic.Deliver)]
        assert len(delivers) == 1  # prefetch 1: the next comes once this one is acked
        got.append(delivers[0].delivery_tag)
        assert h.conn.wants_read()  # its acks are read
        h.send(1, C.Basic.Ack(delivery_tag=delivers[0].delivery_tag))
    assert got == [1, 2, 3] and in_queue(h) == 0
    assert h.conn.info()["state"] == "blocking"  # an alarm is on; it has not published


def test_a_blocked_connection_is_not_closed_for_heartbeats_it_could_not_read():
    h = publisher(heartbeat=2)
    publish(h)
    h._run(h.conn.resource_alarm(h.now, MEMORY))
    h.advance(30.0)  # the client's heartbeats wait unread in the socket
    assert h.closed is None
    h.frames()
    h._run(h.conn.resource_alarm(h.now, ""))
    h.advance(3.5)  # read again from the unblocking on: 2 x heartbeat of silence closes
    assert h.closed is None
    h.advance(1.5)
    assert h.closed and "missed heartbeats" in h.closed


def test_the_front_end_subscribes_and_blocks_its_connections_and_new_ones():
    host = Host()
    fe = FrontEnd(host, node="n1", dst="127.0.0.1:40000")
    fe.start()
    assert any(isinstance(m, AlarmSubscribe) for m in host.agent)
    old = fe.open(0.0, "127.0.0.1", 50001)
    fe.conns[old].conn.published = True  # it has published
    assert fe.message(1.0, "agent", ResourceAlarms((("n2", "memory"), ("n3", "disk"))))
    assert fe.alarm == "low on memory & low on disk"
    assert not fe.wants_read(old)
    new = fe.open(2.0, "127.0.0.1", 50002)
    assert fe.conns[new].conn.throttle == "blocking" and fe.wants_read(new)
    assert fe.status()["blocked"] == 1
    fe.message(3.0, "agent", ResourceAlarms(()))
    assert fe.alarm == "" and fe.wants_read(old) and fe.conns[new].conn.throttle == "running"
