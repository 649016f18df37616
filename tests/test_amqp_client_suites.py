"""Differences from RabbitMQ 3.x that the client libraries' own test suites
(pika's acceptance tests, aio-pika's tests, kombu's py-amqp integration
tests) showed, on the sans-IO connection core (tests/amqp_harness.py)."""

from __future__ import annotations

from pamqp import commands as C

from amqp_harness import Harness
from mirrorq.amqp.topology import Topology, hash_password


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


def test_the_cancel_comes_after_delete_ok_with_nowait_too_and_other_channels_hear_it_at_once():
    h = opened()
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="mine"))
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="theirs"))
    h.frames()
    h.hold_registry = True  # delete-ok waits for the registry
    h.send(1, C.Queue.Delete(queue="q", nowait=True))
    assert names(h.frames()) == [(2, "Basic.Cancel")]
    h.release_registry()
    assert names(h.frames()) == [(1, "Basic.Cancel")]


def test_no_server_cancel_for_a_client_that_did_not_announce_consumer_cancel_notify():
    h = opened(cancel_notify=False)
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="watcher"))
    assert names(h.frames()) == [(2, "Basic.ConsumeOk")]
    h.send(1, C.Queue.Delete(queue="q"))
    assert names(h.frames()) == [(1, "Queue.DeleteOk")]
    assert h.conn.chans[2].consumers == {}  # forgotten all the same


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
    h.send(1, C.Exchange.Declare(exchange="x", exchange_type="direct"), C.Queue.Declare(queue="q"),
           C.Queue.Bind(queue="q", exchange="x", routing_key="k"))
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
    h.send(1, C.Exchange.Declare(exchange="x", exchange_type="direct"), C.Queue.Declare(queue="q"),
           C.Queue.Bind(queue="q", exchange="x", routing_key="k"))
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
