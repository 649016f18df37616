"""Differences from RabbitMQ 3.x that the client libraries' own test suites
(pika's acceptance tests, aio-pika's tests, kombu's py-amqp integration
tests) showed, on the sans-IO connection core (tests/amqp_harness.py)."""

from __future__ import annotations

from amqp_harness import Harness, LocalMaster
from pamqp import commands as C

from mirrorq.amqp import connection as cn
from mirrorq.amqp.topology import Topology, hash_password
from mirrorq.queues import messages as qm


def opened(**handshake) -> Harness:
    h = Harness()
    h.handshake(**handshake)
    h.open_channel(1)
    return h


def names(fr) -> list:
    return [(ch, getattr(v, "name", type(v).__name__)) for ch, v in fr]


# ---- basic.cancel from the server ------------------------------------------------------------
def test_a_channel_deleting_the_queue_it_consumes_gets_delete_ok_before_the_cancel():
    # kombu: a consumer's channel deletes its queue; py-amqp raises on a
    # basic.cancel that arrives while it waits for delete-ok
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="mine"))
    assert names(h.frames()) == [(1, "Basic.ConsumeOk")]
    h.send(1, C.Queue.Delete(queue="q"))
    fr = h.frames()
    assert names(fr) == [(1, "Queue.DeleteOk"), (1, "Basic.Cancel")]
    assert fr[1][1].consumer_tag == "mine" and fr[1][1].nowait
    # the consumer is gone: cancelling it is a no-op answered cancel-ok
    h.send(1, C.Basic.Cancel(consumer_tag="mine"))
    assert names(h.frames()) == [(1, "Basic.CancelOk")]


def test_consumers_hear_of_a_deletion_once_the_registry_has_it_and_after_delete_ok():
    # aio-pika's robust channel re-declares its queue on the cancel: the
    # queue must be gone by then (RabbitMQ deletes it before telling its
    # consumers), so the re-declare makes a new queue
    h = opened()
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="mine"))
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="theirs"))
    h.frames()
    old = h.by_queue["q"]
    h.hold_registry = True  # the deletion is not in the registry yet
    h.send(1, C.Queue.Delete(queue="q", nowait=True))
    assert h.frames() == []
    h.release_registry()
    assert names(h.frames()) == [(1, "Basic.Cancel"), (2, "Basic.Cancel")]
    h.send(2, C.Queue.Declare(queue="q"))
    assert names(h.frames()) == [(2, "Queue.DeclareOk")]
    assert h.by_queue["q"] is not old


def test_a_deletion_by_another_connection_is_told_once_the_registry_has_it():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    h.frames()
    m = h.by_queue["q"]
    _, events = m.q.delete(h.now)  # another connection's queue.delete, at the master
    for _, reply in m._events(events):
        h._run(h.conn.receive(h.now, m.dst, reply))
    assert h.frames() == [] and h.conn.chans[1].cons.consumers == {}
    rec = h.topo.queue("/", "q")
    h.topo.delete("amqqueue", ("/", "q"))
    h._run(h.conn.queue_moved(h.now, "/", "q", None, rec))
    fr = h.frames()
    assert names(fr) == [(1, "Basic.Cancel")] and fr[0][1].consumer_tag == "c"


def test_a_deletion_the_registry_never_reports_is_told_after_a_while():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    h.frames()
    m = h.by_queue["q"]
    _, events = m.q.delete(h.now)
    for _, reply in m._events(events):
        h._run(h.conn.receive(h.now, m.dst, reply))
    h.advance(cn.MASTER_ANSWER_TIMEOUT - 1)
    assert h.frames() == []
    h.advance(2)
    assert names(h.frames()) == [(1, "Basic.Cancel")]


def test_delete_ok_comes_first_when_the_registry_reports_the_deletion_before_the_master_answers():
    # a mirrored queue's master answers once its mirrors have the delete;
    # the registry row may be gone before that
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="mine"))
    h.frames()
    del h.masters[h.by_queue["q"].dst]  # its answers are late
    h.send(1, C.Queue.Delete(queue="q"))
    assert h.frames() == []
    rec = h.topo.queue("/", "q")
    h.hold_registry = True
    h.topo.delete("amqqueue", ("/", "q"))
    h._run(h.conn.queue_moved(h.now, "/", "q", None, rec))
    assert h.frames() == []  # delete-ok waits for this channel's registry write
    h.release_registry()
    assert names(h.frames()) == [(1, "Queue.DeleteOk"), (1, "Basic.Cancel")]


def test_no_server_cancel_for_a_client_that_did_not_announce_consumer_cancel_notify():
    h = opened(cancel_notify=False)
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="watcher"))
    assert names(h.frames()) == [(2, "Basic.ConsumeOk")]
    h.send(1, C.Queue.Delete(queue="q"))
    assert names(h.frames()) == [(1, "Queue.DeleteOk")]
    assert h.conn.chans[2].cons.consumers == {}  # forgotten all the same


def test_settling_a_delivery_of_a_queue_deleted_meanwhile_is_no_channel_error():
    # aio-pika's JSON-RPC on a mirrored queue: a delivery overtaken by its
    # consumer's cancel is given back after the cancel auto-deleted the
    # queue; its master refuses the settlement (404), the channel goes on
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send_raw(h.publish(1, b"m", "", "q"))
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    fr = h.frames()
    tag = next(v.delivery_tag for _, v in fr if isinstance(v, C.Basic.Deliver))
    m = h.by_queue["q"]
    m.q.delete(h.now)  # gone, the registry has not said so yet
    h.send(1, C.Basic.Ack(delivery_tag=tag), C.Basic.Qos(prefetch_count=5))
    assert names(h.frames()) == [(1, "Basic.QosOk")]


# ---- ordering behind a method that waits twice ---------------------------------------------
def test_frames_behind_a_delete_wait_for_its_registry_write():
    # the master answered the delete, the registry write is pending: a
    # re-declare pipelined behind it must not be served first (its queue
    # would be created, then removed by the delete's write)
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.hold_registry = True
    h.send(1, C.Queue.Delete(queue="q"), C.Queue.Declare(queue="q"))
    assert h.frames() == []
    h.release_registry()
    assert names(h.frames()) == [(1, "Queue.DeleteOk"), (1, "Queue.DeclareOk")]
    assert h.topo.queue("/", "q") is not None


# ---- unbinding what is not there -------------------------------------------------------------
def test_queue_unbind_of_a_deleted_queue_is_unbind_ok():
    # aio-pika's cleanups delete a queue, then unbind it
    h = opened()
    h.send(
        1,
        C.Exchange.Declare(exchange="x", exchange_type="direct"),
        C.Queue.Declare(queue="q"),
        C.Queue.Bind(queue="q", exchange="x", routing_key="k"),
    )
    h.frames()
    h.send(1, C.Queue.Delete(queue="q"))
    assert names(h.frames()) == [(1, "Queue.DeleteOk")]
    before = h.refreshes
    h.send(1, C.Queue.Unbind(queue="q", exchange="x", routing_key="k"))
    assert names(h.frames()) == [(1, "Queue.UnbindOk")]
    assert h.refreshes == before + 1  # confirmed missing through the registry first
    h.send(1, C.Queue.Unbind(queue="q", exchange="gone", routing_key="k"))
    assert names(h.frames()) == [(1, "Queue.UnbindOk")]


def test_exchange_unbind_with_a_missing_side_is_unbind_ok_and_nowait_is_silent():
    h = opened()
    h.send(1, C.Exchange.Declare(exchange="a", exchange_type="fanout"))
    h.frames()
    h.send(1, C.Exchange.Unbind(destination="a", source="nope"))
    assert names(h.frames()) == [(1, "Exchange.UnbindOk")]
    h.send(1, C.Exchange.Unbind(destination="nope", source="a", nowait=True), C.Basic.Qos(prefetch_count=1))
    assert names(h.frames()) == [(1, "Basic.QosOk")]


def test_an_unbind_that_finds_the_queue_after_a_registry_re_read_removes_the_binding():
    h = opened()
    h.send(
        1,
        C.Exchange.Declare(exchange="x", exchange_type="direct"),
        C.Queue.Declare(queue="q"),
        C.Queue.Bind(queue="q", exchange="x", routing_key="k"),
    )
    h.frames()
    rec = h.topo.queue("/", "q")
    h.topo.delete("amqqueue", ("/", "q"))  # this node has not seen it (declared through another node)
    h.elsewhere.append(("amqqueue", rec))
    h.send(1, C.Queue.Unbind(queue="q", exchange="x", routing_key="k"))
    assert names(h.frames()) == [(1, "Queue.UnbindOk")]
    assert h.topo.route("/", "x", "k") == []
    assert any(op["op"] == "delete" and op["table"] == "binding" for txn in h.registry_log for op in txn["ops"])


def test_unbind_of_a_missing_queue_still_needs_permissions():
    topo = Topology()
    topo.put("user", {"name": "u", "password_hash": hash_password("p"), "tags": []})
    topo.put("permission", {"user": "u", "vhost": "/", "configure": ".*", "write": "^$", "read": ".*"})
    h = Harness(topology=topo)
    h.handshake("u", "p")
    h.open_channel(1)
    h.send(1, C.Queue.Unbind(queue="q", exchange="amq.direct", routing_key="k"))
    fr = h.frames()
    assert names(fr) == [(1, "Channel.Close")] and fr[0][1].reply_code == 403


# ---- a queue deleted and declared again -----------------------------------------------------
def seqs_seen(master) -> list:
    """Record the publish sequence numbers ``master`` is sent."""
    seen: list = []
    handle = master.handle

    def recording(now, msg):
        if isinstance(msg, qm.Publish):
            seen.extend(item[0] for item in msg.items)
        return handle(now, msg)

    master.handle = recording
    return seen


def delete_elsewhere(h: Harness, name: str) -> dict:
    """Another connection's queue.delete (or an auto-delete) removes ``name``;
    this connection hears of it from the registry."""
    rec = h.topo.queue("/", name)
    m = h.by_queue[name]
    m.q.delete(h.now)
    m.deleted = True
    del h.masters[m.dst]
    h.topo.delete("amqqueue", ("/", name))
    h._run(h.conn.queue_moved(h.now, "/", name, None, rec))
    return rec


def declare_elsewhere(h: Harness, name: str, incarnation: str) -> LocalMaster:
    spec = {"name": name, "vhost": "/", "durable": False, "auto_delete": True, "exclusive_owner": None, "arguments": {}}
    m = LocalMaster(len(h.masters) + 10, spec)
    h.masters[m.dst] = m
    h.by_queue[name] = m
    rec = dict(spec, pid=m.member, incarnation=incarnation)
    h.topo.put("amqqueue", rec)
    h._run(h.conn.queue_moved(h.now, "/", name, rec, None))
    return m


def test_a_publisher_talks_to_a_re_declared_queue_from_publish_sequence_one():
    # aio-pika's reconnect test: the consumer's auto-delete queue goes with
    # its connection and comes back re-declared; a second connection's
    # publisher must reach the new queue (whose master expects the
    # publisher's sequence from 1) and get its confirm
    h = opened()
    h.send(1, C.Confirm.Select(), C.Queue.Declare(queue="q", auto_delete=True))
    h.frames()
    h.topo.put("amqqueue", dict(h.topo.queue("/", "q"), incarnation="one"))
    h.send_raw(h.publish(1, b"before", "", "q"))
    assert names(h.frames()) == [(1, "Basic.Ack")]
    delete_elsewhere(h, "q")
    new = declare_elsewhere(h, "q", "two")
    seen = seqs_seen(new)
    h.send_raw(h.publish(1, b"after", "", "q"))
    fr = h.frames()
    assert names(fr) == [(1, "Basic.Ack")] and fr[0][1].delivery_tag == 2
    assert seen == [1] and new.q.info()["messages_ready"] == 1


def test_the_channel_that_deleted_a_queue_talks_to_its_re_declaration_from_sequence_one():
    h = opened()
    h.send(1, C.Confirm.Select(), C.Queue.Declare(queue="q"))
    h.frames()
    h.send_raw(h.publish(1, b"a", "", "q"))
    h.send(1, C.Queue.Delete(queue="q"), C.Queue.Declare(queue="q"))
    assert names(h.frames()) == [(1, "Basic.Ack"), (1, "Queue.DeleteOk"), (1, "Queue.DeclareOk")]
    seen = seqs_seen(h.by_queue["q"])
    h.send_raw(h.publish(1, b"b", "", "q"))
    assert names(h.frames()) == [(1, "Basic.Ack")]
    assert seen == [1]


def test_publishes_unconfirmed_when_their_queue_is_deleted_are_confirmed():
    h = opened()
    h.send(1, C.Confirm.Select(), C.Queue.Declare(queue="q"))
    h.frames()
    del h.masters[h.by_queue["q"].dst]  # its master answers no more
    h.send_raw(h.publish(1, b"a", "", "q") + h.publish(1, b"b", "", "q"))
    assert h.frames() == []
    rec = h.topo.queue("/", "q")
    h.topo.delete("amqqueue", ("/", "q"))
    h._run(h.conn.queue_moved(h.now, "/", "q", None, rec))
    fr = h.frames()
    assert names(fr) == [(1, "Basic.Ack")] and (fr[0][1].delivery_tag, fr[0][1].multiple) == (2, True)


def test_consumers_of_a_queue_deleted_without_a_word_from_its_master_are_cancelled():
    h = opened()
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="c"))
    h.frames()
    del h.masters[h.by_queue["q"].dst]
    rec = h.topo.queue("/", "q")
    h.topo.delete("amqqueue", ("/", "q"))
    h._run(h.conn.queue_moved(h.now, "/", "q", None, rec))
    assert names(h.frames()) == [(2, "Basic.Cancel")]
    assert h.conn.chans[2].cons.consumers == {}


def test_the_deletion_of_an_older_incarnation_leaves_the_current_one_alone():
    h = opened()
    h.send(1, C.Confirm.Select(), C.Queue.Declare(queue="q"))
    h.frames()
    h.topo.put("amqqueue", dict(h.topo.queue("/", "q"), incarnation="two"))
    h.send_raw(h.publish(1, b"a", "", "q"))
    h.frames()
    qc = h.conn.chans[1].queues["q"]
    h._run(h.conn.queue_moved(h.now, "/", "q", None, {"name": "q", "vhost": "/", "incarnation": "one"}))
    assert h.conn.chans[1].queues.get("q") is qc
