"""The AMQP connection core's side of issue #17: broker-added queue
arguments hidden from the equivalence check, protocol errors reported to
the shell (for node.log), connection info for the listings, and an
operator's close."""

from __future__ import annotations

from amqp_harness import Harness
from pamqp import commands as C
from pamqp import frame as F

from mirrorq.amqp import connection as cn
from mirrorq.amqp.topology import INTERNAL_MARK, client_arguments, with_internal_arguments
from mirrorq.sansio import Emit


def test_internal_arguments_are_marked_and_stripped():
    args = with_internal_arguments({"x-message-ttl": 5}, {"x-ha-policy": "nodes", "x-ha-policy-params": ["n1"]})
    assert args[INTERNAL_MARK] == ["x-ha-policy", "x-ha-policy-params"]
    assert client_arguments(args) == {"x-message-ttl": 5}
    # a client's own x-ha-policy (no mark) is the client's
    assert client_arguments({"x-ha-policy": "all"}) == {"x-ha-policy": "all"}
    assert client_arguments(None) == {}


def test_exclusive_queue_redeclared_with_identical_arguments():
    h = Harness()
    h.handshake()
    h.open_channel()
    args = {"x-message-ttl": 1000}
    h.send(1, C.Queue.Declare(queue="excl", exclusive=True, arguments=args))
    assert h.methods() == [(1, "Queue.DeclareOk")]
    rec = h.topo.queue("/", "excl")
    assert rec["arguments"]["x-ha-policy"] == "nodes" and rec["arguments"]["x-ha-policy-params"] == ["n1"]
    h.send(1, C.Queue.Declare(queue="excl", exclusive=True, arguments=args))
    assert h.methods() == [(1, "Queue.DeclareOk")]
    h.send(1, C.Queue.Declare(queue="excl", exclusive=True, arguments={"x-message-ttl": 1}))
    ((ch, close),) = h.frames()
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406 and "x-message-ttl" in close.reply_text


def test_clients_cannot_send_the_internal_mark():
    h = Harness()
    h.handshake()
    h.open_channel()
    h.send(1, C.Queue.Declare(queue="q", arguments={INTERNAL_MARK: ["x-max-length"]}))
    ((ch, close),) = h.frames()
    assert close.reply_code == 406 and INTERNAL_MARK in close.reply_text


def _errors(actions):
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, cn.ProtocolError)]


def test_refused_login_and_channel_errors_are_reported():
    h = Harness()
    h.send_raw(cn.PROTOCOL_HEADER)
    h.frames()
    acts = h.conn.data_received(h.now, F.marshal(C.Connection.StartOk(response="\0guest\0wrong"), 0))
    (ev,) = _errors(acts)
    assert (ev.code, ev.name, ev.channel) == (403, "ACCESS_REFUSED", 0) and "invalid credentials" in ev.text

    h = Harness()
    h.handshake()
    h.open_channel()
    acts = h.conn.data_received(h.now, F.marshal(C.Queue.Declare(queue="nope", passive=True), 1))
    assert _errors(acts) == []  # not before the topology was re-read
    (refresh,) = [a.event for a in acts if isinstance(a, Emit) and isinstance(a.event, cn.RefreshRequest)]
    (ev,) = _errors(h.conn.registry_result(h.now, refresh.tag, True, ""))
    assert (ev.code, ev.name, ev.channel, ev.user, ev.vhost) == (404, "NOT_FOUND", 1, "guest", "/")


def test_info_lists_channels_and_consumers_and_close_forced():
    h = Harness()
    h.handshake()
    h.open_channel()
    h.send(1, C.Queue.Declare(queue="work"))
    h.send(1, C.Basic.Qos(prefetch_count=5))
    h.send(1, C.Basic.Consume(queue="work", consumer_tag="c1", arguments={"x-priority": 1}))
    h.frames()
    info = h.conn.info()
    assert info["state"] == "running" and info["user"] == "guest" and info["auth_mechanism"] == "PLAIN"
    (chan,) = info["channels"]
    assert chan["number"] == 1 and chan["consumer_count"] == 1 and chan["prefetch_count"] == 5
    assert chan["consumers"] == [
        {
            "queue": "work",
            "consumer_tag": "c1",
            "ack_required": True,
            "prefetch_count": 5,
            "arguments": {"x-priority": 1},
        }
    ]
    h._run(h.conn.close_forced(h.now, "maintenance"))
    ((ch, close),) = h.frames()
    assert isinstance(close, C.Connection.Close) and close.reply_code == 320 and "maintenance" in close.reply_text
    assert h.conn.close_forced(h.now, "again") == []
