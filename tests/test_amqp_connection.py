"""The AMQP connection state machine, in-process (tests/amqp_harness.py)."""

from __future__ import annotations

import struct

import pytest
from amqp_harness import Harness, LocalMaster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import body as B
from pamqp import commands as C
from pamqp import frame as F
from pamqp import header as H

from mirrorq.amqp import connection as cn
from mirrorq.amqp import framing
from mirrorq.amqp.topology import Topology, hash_password
from mirrorq.queues import messages as qm


def opened(**kw) -> Harness:
    h = Harness(**kw)
    h.handshake()
    h.open_channel(1)
    return h


def only(h: Harness, cls):
    fr = h.frames()
    assert len(fr) == 1 and isinstance(fr[0][1], cls), [getattr(v, "name", v) for _, v in fr]
    return fr[0][1]


def closed_with(h: Harness, code: int, *, channel: bool, words: str = ""):
    fr = h.frames()
    want = C.Channel.Close if channel else C.Connection.Close
    closes = [v for _, v in fr if isinstance(v, want)]
    assert closes, f"expected a {want.name}, got {[getattr(v, 'name', v) for _, v in fr]}"
    c = closes[0]
    assert c.reply_code == code, c.reply_text
    assert words in c.reply_text
    return c


# ---- handshake -------------------------------------------------------------------------------
def test_handshake_and_close():
    h = Harness()
    h.handshake()
    assert h.conn.state == "opened" and h.conn.user == "guest"
    h.send(0, C.Connection.Close(200, "bye", 0, 0))
    only(h, C.Connection.CloseOk)
    # the client got close-ok: it closes the socket (RabbitMQ waits for it), so the shell lingers
    assert h.closed and h.linger is True


def test_a_server_initiated_close_does_not_linger():
    """We sent connection.close and got close-ok: we close the socket at once
    (AMQP: the receiver of close-ok does); so does a refused protocol header."""
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Basic.Consume(queue="q", consumer_tag="c"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    closed_with(h, 530, channel=False, words="reuse consumer tag")
    assert h.closed is None
    h.send(0, C.Connection.CloseOk())
    assert h.closed == "closed" and h.linger is False
    h2 = Harness()
    h2.send_raw(b"AMQP\x00\x00\x08\x00")
    assert h2.closed and h2.linger is False


def test_bad_protocol_header_gets_ours_back_and_is_closed():
    h = Harness()
    h.send_raw(b"AMQP\x00\x00\x08\x00")
    assert bytes(h.inbox) == cn.PROTOCOL_HEADER
    assert h.closed and "bad protocol header" in h.closed


def test_guest_refused_from_a_remote_host():
    h = Harness(peer_host="10.1.2.3")
    h.send_raw(cn.PROTOCOL_HEADER)
    h.frames()
    h.send(0, C.Connection.StartOk(response="\0guest\0guest"))
    closed_with(h, 403, channel=False, words="localhost")


def test_wrong_password_and_registry_users():
    topo = Topology()
    topo.put("user", {"name": "alice", "password_hash": hash_password("s3cret"), "tags": []})
    topo.put("vhost", {"name": "v1"})
    topo.put("permission", {"user": "alice", "vhost": "v1", "configure": "^a", "write": ".*", "read": ".*"})
    h = Harness(topology=topo, peer_host="10.0.0.9")
    h.send_raw(cn.PROTOCOL_HEADER)
    h.frames()
    h.send(0, C.Connection.StartOk(response="\0alice\0wrong"))
    closed_with(h, 403, channel=False, words="invalid credentials")
    # right password, a vhost without permission -> 530
    h = Harness(topology=topo, peer_host="10.0.0.9")
    h.send_raw(cn.PROTOCOL_HEADER)
    h.frames()
    h.send(0, C.Connection.StartOk(response="\0alice\0s3cret"))
    only(h, C.Connection.Tune)
    h.send(0, C.Connection.TuneOk(2047, 131072, 0), C.Connection.Open("/"))
    closed_with(h, 530, channel=False, words="access to vhost '/' refused")
    # the permitted vhost works; configure permission is enforced (403)
    h = Harness(topology=topo, peer_host="10.0.0.9")
    h.handshake("alice", "s3cret", "v1")
    h.open_channel(1)
    h.send(1, C.Queue.Declare(queue="b-queue"))
    closed_with(h, 403, channel=True, words="configure access to queue 'b-queue'")
    h.open_channel(2)
    h.send(2, C.Queue.Declare(queue="a-queue"))
    assert only(h, C.Queue.DeclareOk).queue == "a-queue"


def test_unknown_vhost_is_530():
    h = Harness()
    h.send_raw(cn.PROTOCOL_HEADER)
    h.frames()
    h.send(0, C.Connection.StartOk(response="\0guest\0guest"))
    h.frames()
    h.send(0, C.Connection.TuneOk(2047, 131072, 0), C.Connection.Open("nope"))
    closed_with(h, 530, channel=False, words="vhost 'nope' not found")


def test_tune_ok_frame_max_out_of_range_is_530():
    h = Harness()
    h.send_raw(cn.PROTOCOL_HEADER)
    h.frames()
    h.send(0, C.Connection.StartOk(response="\0guest\0guest"))
    h.frames()
    h.send(0, C.Connection.TuneOk(2047, 1024, 0))
    closed_with(h, 530, channel=False, words="frame_max 1024")


def test_handshake_timeout_closes():
    h = Harness()
    h.send_raw(cn.PROTOCOL_HEADER)
    h.advance(cn.HANDSHAKE_TIMEOUT + 0.1)
    assert h.closed == "handshake timed out"


def test_heartbeats_sent_when_idle_and_missing_ones_close():
    h = Harness()
    h.handshake(heartbeat=2)
    h.advance(1.01)
    assert bytes(h.inbox) == b"\x08\x00\x00\x00\x00\x00\x00\xce"
    h.inbox.clear()
    h.send_raw(b"\x08\x00\x00\x00\x00\x00\x00\xce")  # the client's heartbeat keeps it alive
    h.advance(3.5)
    assert h.closed is None
    h.advance(1.0)
    assert h.closed and "missed heartbeats" in h.closed


def test_channel_max_and_double_open():
    h = Harness()
    h.handshake()
    h.send(3000, C.Channel.Open())
    closed_with(h, 530, channel=False, words="channel_max")
    h = opened()
    h.send(1, C.Channel.Open())
    closed_with(h, 504, channel=False, words="second 'channel.open'")


# ---- publishing, confirms, returns ---------------------------------------------------------------
def test_confirms_multiple_ack_and_mandatory_return():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Confirm.Select())
    assert [type(v) for _, v in h.frames()] == [C.Queue.DeclareOk, C.Confirm.SelectOk]
    data = b"".join(h.publish(1, b"m%d" % i, "", "q") for i in range(5))
    data += h.publish(1, b"lost", "", "nowhere", mandatory=True)
    h.send_raw(data)
    fr = h.frames()
    kinds = [getattr(v, "name", type(v).__name__) for _, v in fr]
    # the return is written while parsing; the masters' confirms of this read
    # come after it, and all six tags go out as one multiple ack
    assert kinds == ["Basic.Return", "ContentHeader", "ContentBody", "Basic.Ack"], kinds
    assert fr[0][1].reply_code == 312 and fr[2][1].value == b"lost"
    assert fr[3][1].delivery_tag == 6 and fr[3][1].multiple
    # one message per queue per read reached the master (batch per hop)
    assert h.conn.stats["publishes"] == 6


def test_a_publish_routed_to_two_queues_is_nacked_if_either_refuses_it():
    """A publish routed to k queues is confirmed once all k answered, and
    nacked if any refused it -- whichever answers first; confirms go out
    in tag order, each run of acks or nacks as one multiple frame."""
    h = opened()
    full = {"x-max-length": 1, "x-overflow": "reject-publish"}
    h.send(1, C.Queue.Declare(queue="full", arguments=full), C.Queue.Declare(queue="ok"), C.Confirm.Select())
    h.send(1, C.Queue.Bind(queue="full", exchange="amq.fanout"), C.Queue.Bind(queue="ok", exchange="amq.fanout"))
    h.frames()
    data = b"".join(h.publish(1, b"m%d" % i, "amq.fanout") for i in range(3))  # the 2nd and 3rd overflow "full"
    data += h.publish(1, b"direct", "", "ok")
    h.send_raw(data)
    confirms = [(type(v).__name__, v.delivery_tag, v.multiple) for _, v in h.frames()]
    assert confirms == [("Ack", 1, True), ("Nack", 3, True), ("Ack", 4, True)]
    assert h.conn.chans[1].pub.pending == {} and h.conn.chans[1].pub.nacked == set()
    assert h.by_queue["ok"].q.bq.message_count == 4 and h.by_queue["full"].q.bq.message_count == 1


def test_repeated_publish_frames_are_decoded_once_and_route_as_before(monkeypatch):
    """A publisher's basic.publish and content-header frames repeat byte for
    byte: each distinct frame is decoded once per connection (the cache is
    bounded by DECODED_KEPT) and every message still lands where its own
    frames say, with its own properties and body."""
    decoded = []
    unmarshal = F.unmarshal
    monkeypatch.setattr(framing.F, "unmarshal", lambda raw: decoded.append(raw) or unmarshal(raw))
    h = opened()
    h.send(1, C.Queue.Declare(queue="a"), C.Queue.Declare(queue="b"), C.Confirm.Select())
    h.frames()
    decoded.clear()
    hot = C.Basic.Properties(delivery_mode=2, headers={"k": 1})
    data = b"".join(h.publish(1, b"%04d" % i, "", "a", properties=hot) for i in range(50))
    data += h.publish(1, b"to-b", "", "b", properties=C.Basic.Properties(priority=3))
    h.send_raw(data)
    assert len(decoded) == 4  # one publish and one header frame per destination
    acks = [v for _, v in h.frames()]
    assert all(isinstance(v, C.Basic.Ack) for v in acks) and acks[-1].delivery_tag == 51
    many = b"".join(h.publish(1, b"x" * (i + 1), "", "b") for i in range(framing.DECODED_KEPT * 2))
    h.send_raw(many)  # distinct header frames (body sizes): the cache stays bounded
    assert len(h.conn.reader.decoded) <= framing.DECODED_KEPT
    h.send(1, C.Basic.Get(queue="a", no_ack=True))
    fr = h.frames()
    got = [v for _, v in fr if isinstance(v, C.Basic.GetOk)]
    hdrs = [v for _, v in fr if type(v).__name__ == "ContentHeader"]
    assert got and hdrs[0].properties.delivery_mode == 2 and hdrs[0].properties.headers == {"k": 1}
    assert [v.value for _, v in fr if type(v).__name__ == "ContentBody"] == [b"0000"]
    h.send(1, C.Basic.Get(queue="b", no_ack=True))
    fr = h.frames()
    assert [v.properties.priority for _, v in fr if type(v).__name__ == "ContentHeader"] == [3]
    assert [v.value for _, v in fr if type(v).__name__ == "ContentBody"] == [b"to-b"]


@pytest.mark.parametrize("limit", [None, 1000])
def test_a_message_over_max_message_size_is_refused_naming_the_limit(limit):
    """A content header announcing more than max_message_size closes the
    channel with 406 naming the limit, before any body is kept; the body
    frames already on their way are dropped and the connection goes on: a
    message of exactly the limit is stored on a new channel."""
    h = opened() if limit is None else opened(max_message_size=limit)
    size = h.conn.max_message_size
    assert size == (16 << 20 if limit is None else limit)
    h.send(1, C.Queue.Declare(queue="q"), C.Confirm.Select())
    h.frames()
    h.send_raw(h.publish(1, bytes(size + 1), "", "q"))
    c = closed_with(h, 406, channel=True, words=f"message size {size + 1} is larger than configured max size {size}")
    assert "max_message_size" in c.reply_text
    assert h.closed is None  # the connection stays
    h.send(1, C.Channel.CloseOk())
    h.open_channel(2)
    h.send(2, C.Confirm.Select())
    h.frames()
    h.send_raw(h.publish(2, bytes(size), "", "q"))
    assert [type(v).__name__ for _, v in h.frames()] == ["Ack"]
    h.send(2, C.Basic.Get(queue="q", no_ack=True))
    bodies = [v.value for _, v in h.frames() if type(v).__name__ == "ContentBody"]
    assert b"".join(bodies) == bytes(size)


def test_max_message_size_outside_the_allowed_range_is_refused():
    with pytest.raises(ValueError, match="from 1 to"):
        opened(max_message_size=(32 << 20) + 1)


def test_mid_message_while_a_frame_or_a_messages_frames_are_incomplete():
    """What the listener reads again for in the same turn: part of a frame
    buffered, or a publish whose header or body has not all come (pika
    writes method, header and body frames one send each)."""
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Confirm.Select())
    h.frames()
    assert not h.conn.mid_message()
    data = h.publish(1, b"x" * 300, "", "q")
    method_end = 7 + struct.unpack(">I", data[3:7])[0] + 1  # type, channel, size, payload, frame-end
    header_end = method_end + 7 + struct.unpack(">I", data[method_end + 3 : method_end + 7])[0] + 1
    seen = []
    for cut in (3, method_end, header_end, header_end + 100, len(data)):
        h.send_raw(data[sum(len(x) for x in seen) : cut])
        seen.append(data[sum(len(x) for x in seen) : cut])
        assert h.conn.mid_message() == (cut < len(data)), cut
    assert [type(v).__name__ for _, v in h.frames()] == ["Ack"]
    h.send_raw(data[:method_end])
    h.conn.close_forced(h.now, "bye")
    h.frames()
    assert not h.conn.mid_message()  # closing: nothing more will be read for it


def test_reject_publish_overflow_is_nacked():
    h = opened()
    h.send(
        1,
        C.Queue.Declare(queue="small", arguments={"x-max-length": 1, "x-overflow": "reject-publish"}),
        C.Confirm.Select(),
    )
    h.frames()
    h.send_raw(h.publish(1, b"a", "", "small") + h.publish(1, b"b", "", "small"))
    fr = [v for _, v in h.frames()]
    assert [(type(v).__name__, v.delivery_tag) for v in fr] == [("Ack", 1), ("Nack", 2)]


def test_large_message_split_over_frames_and_reassembled():
    h = opened()
    h.send(1, C.Queue.Declare(queue="big"))
    h.frames()
    body = bytes(range(256)) * 2000  # 512000 bytes, > frame_max
    h.send_raw(h.publish(1, body, "", "big"))
    h.send(1, C.Basic.Get(queue="big", no_ack=True))
    fr = h.frames()
    assert isinstance(fr[0][1], C.Basic.GetOk)
    assert b"".join(v.value for _, v in fr[2:]) == body
    assert all(len(v.value) <= 131072 - 8 for _, v in fr[2:])


def test_bad_expiration_is_406():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send_raw(h.publish(1, b"x", "", "q", properties=C.Basic.Properties(expiration="soon")))
    closed_with(h, 406, channel=True, words="invalid expiration")


# ---- exchanges and routing ---------------------------------------------------------------------------
def test_exchange_types_route_and_e2e_bindings():
    h = opened()
    for q in ("qa", "qb", "qc"):
        h.send(1, C.Queue.Declare(queue=q))
    h.send(
        1,
        C.Exchange.Declare(exchange="d", exchange_type="direct"),
        C.Exchange.Declare(exchange="f", exchange_type="fanout"),
        C.Exchange.Declare(exchange="t", exchange_type="topic"),
        C.Exchange.Declare(exchange="h", exchange_type="headers"),
    )
    h.send(
        1,
        C.Queue.Bind(queue="qa", exchange="d", routing_key="k"),
        C.Queue.Bind(queue="qa", exchange="f"),
        C.Queue.Bind(queue="qb", exchange="f"),
        C.Queue.Bind(queue="qc", exchange="t", routing_key="a.*.z"),
        C.Queue.Bind(queue="qb", exchange="h", arguments={"x-match": "any", "color": "red", "size": 1}),
        C.Exchange.Bind(destination="t", source="d", routing_key="a.b.z"),
    )
    assert len([1 for _, v in h.frames() if isinstance(v, (C.Queue.BindOk, C.Exchange.BindOk))]) == 6
    topo = h.topo
    assert topo.route("/", "d", "k") == ["qa"]
    assert topo.route("/", "d", "a.b.z") == ["qc"]  # through the e2e binding to the topic exchange
    assert topo.route("/", "f", "whatever") == ["qa", "qb"]
    assert topo.route("/", "t", "a.x.z") == ["qc"] and topo.route("/", "t", "a.z") == []
    assert topo.route("/", "h", "", {"color": "red"}) == ["qb"] and topo.route("/", "h", "", {"color": "blue"}) == []
    assert topo.route("/", "", "qb") == ["qb"] and topo.route("/", "", "nope") == []
    h.send(1, C.Queue.Unbind(queue="qa", exchange="f"))
    only(h, C.Queue.UnbindOk)
    assert topo.route("/", "f", "") == ["qb"]
    h.send(1, C.Exchange.Delete(exchange="d"))
    only(h, C.Exchange.DeleteOk)
    assert topo.route("/", "d", "a.b.z") == [] and topo.exchange("/", "d") is None
    assert not [b for d in topo.bindings.values() for b in d.values() if "d" in (b["source"], b["destination"])]


@pytest.mark.parametrize(
    "method,code,words",
    [
        (C.Exchange.Declare(exchange="amq.mine", exchange_type="direct"), 403, "reserved prefix"),
        (C.Exchange.Declare(exchange="x", exchange_type="bogus"), 503, "invalid exchange type"),
        (C.Exchange.Declare(exchange="nope", passive=True), 404, "no exchange 'nope'"),
        (C.Queue.Declare(queue="nope", passive=True), 404, "no queue 'nope'"),
        (C.Queue.Declare(queue="amq.q"), 403, "reserved prefix"),
        (C.Queue.Declare(queue="q", arguments={"x-max-length": -1}), 406, "x-max-length"),
        (C.Queue.Bind(queue="nope", exchange="amq.direct"), 404, "no queue 'nope'"),
        (C.Queue.Bind(queue="q0", exchange="nope"), 404, "no exchange 'nope'"),
        (C.Queue.Bind(queue="q0", exchange=""), 403, "default exchange"),
        (C.Exchange.Delete(exchange="amq.direct"), 403, "built-in"),
        (C.Basic.Consume(queue="nope"), 404, "no queue 'nope'"),
        (C.Basic.Get(queue="nope"), 404, "no queue 'nope'"),
        (C.Basic.Ack(delivery_tag=7), 406, "unknown delivery tag 7"),
        (C.Basic.Reject(delivery_tag=3), 406, "unknown delivery tag 3"),
        (C.Basic.Qos(prefetch_size=10), 540, "prefetch_size"),
        (C.Basic.Recover(requeue=False), 540, "requeue=false"),
        (C.Tx.Commit(), 406, "not transactional"),
        (C.Tx.Rollback(), 406, "not transactional"),
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_protocol_errors_have_codes_and_causes(method, code, words):
    h = opened()
    h.send(1, C.Queue.Declare(queue="q0"))
    h.frames()
    h.send(1, method)
    hard = code in cn.HARD_ERRORS
    c = closed_with(h, code, channel=not hard, words=words)
    assert (c.class_id << 16 | c.method_id) == method.index
    if not hard:  # the channel is closed, the connection lives on
        h.send(1, C.Channel.CloseOk())
        h.open_channel(1)


def test_inequivalent_redeclare_is_406_and_exclusive_is_405():
    h = opened()
    h.send(1, C.Queue.Declare(queue="dq", durable=True), C.Queue.Declare(queue="mine", exclusive=True))
    h.frames()
    h.send(1, C.Queue.Declare(queue="dq", durable=False))
    closed_with(h, 406, channel=True, words="inequivalent arg 'durable'")
    # another connection of the same node sharing the topology cache
    other = Harness(topology=h.topo)
    other.masters, other.by_queue = h.masters, h.by_queue
    other.conn.conn_id = "n1.2"
    other.handshake()
    other.open_channel(1)
    other.send(1, C.Basic.Consume(queue="mine"))
    closed_with(other, 405, channel=True, words="exclusive access")
    # the owner's connection closing deletes its exclusive queue
    h.send(0, C.Connection.Close(200, "bye", 0, 0))
    assert h.topo.queue("/", "mine") is None


def test_reused_consumer_tag_is_530():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Basic.Consume(queue="q", consumer_tag="c"))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    closed_with(h, 530, channel=False, words="reuse consumer tag 'c'")


# ---- consuming, settling -------------------------------------------------------------------------------
def test_consume_ack_nack_requeue_redelivered_and_recover():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Basic.Qos(prefetch_count=2))
    h.frames()
    h.send_raw(b"".join(h.publish(1, b"m%d" % i, "", "q") for i in range(4)))
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    fr = h.frames()
    dels = [v for _, v in fr if isinstance(v, C.Basic.Deliver)]
    assert [d.delivery_tag for d in dels] == [1, 2]  # prefetch 2
    h.send(1, C.Basic.Nack(delivery_tag=2, multiple=True, requeue=True))
    fr = h.frames()
    dels = [(v.delivery_tag, v.redelivered) for _, v in fr if isinstance(v, C.Basic.Deliver)]
    bodies = [v.value for _, v in fr if isinstance(v, bytes) or hasattr(v, "value")]
    assert dels == [(3, True), (4, True)] and bodies == [b"m0", b"m1"]
    h.send(1, C.Basic.Ack(delivery_tag=4, multiple=True))
    fr = h.frames()
    assert [v.value for _, v in fr if hasattr(v, "value")] == [b"m2", b"m3"]
    h.send(1, C.Basic.Reject(delivery_tag=5, requeue=False), C.Basic.Recover(requeue=True))
    fr = h.frames()
    assert [getattr(v, "name", "") for _, v in fr][0] == "Basic.RecoverOk"
    dels = [(v.delivery_tag, v.redelivered) for _, v in fr if isinstance(v, C.Basic.Deliver)]
    assert dels == [(7, True)]  # m3 again; m2 was rejected without requeue
    h.send(1, C.Basic.Cancel(consumer_tag="c"))
    assert only(h, C.Basic.CancelOk).consumer_tag == "c"


def test_get_purge_delete_counts_and_cancel_notification():
    h = opened()
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    h.send_raw(b"".join(h.publish(1, b"x", "", "q") for _ in range(3)))
    h.send(1, C.Basic.Get(queue="q"))
    ok = h.frames()[0][1]
    assert isinstance(ok, C.Basic.GetOk) and ok.message_count == 2
    h.send(1, C.Queue.Purge(queue="q"))
    assert only(h, C.Queue.PurgeOk).message_count == 2
    h.send(1, C.Basic.Get(queue="q"))
    only(h, C.Basic.GetEmpty)
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="watcher"))
    only(h, C.Basic.ConsumeOk)
    h.send(1, C.Queue.Delete(queue="q"))
    fr = h.frames()
    cancel = [v for ch, v in fr if ch == 2 and isinstance(v, C.Basic.Cancel)]
    assert cancel and cancel[0].consumer_tag == "watcher"
    assert [v.message_count for ch, v in fr if isinstance(v, C.Queue.DeleteOk)] == [0]
    assert h.topo.queue("/", "q") is None


def test_server_named_queue_and_default_queue():
    h = opened()
    h.send(1, C.Queue.Declare(queue="", exclusive=True))
    name = only(h, C.Queue.DeclareOk).queue
    assert name.startswith("amq.gen-")
    h.send(1, C.Queue.Bind(queue="", exchange="amq.fanout"))  # "" = the channel's last queue
    only(h, C.Queue.BindOk)
    assert h.topo.route("/", "amq.fanout", "") == [name]


def test_sync_methods_wait_in_order_behind_the_registry():
    h = opened()
    h.hold_registry = True
    h.send(1, C.Exchange.Declare(exchange="e1", exchange_type="fanout"), C.Basic.Qos(prefetch_count=5))
    assert h.frames() == []  # qos waits behind the declare
    h.release_registry()
    assert [getattr(v, "name", "") for _, v in h.frames()] == ["Exchange.DeclareOk", "Basic.QosOk"]


# ---- framing errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw,code,words",
    [
        (struct.pack(">BHI", 1, 1, 1 << 20), 501, "exceeds frame_max"),
        (struct.pack(">BHI", 1, 1, 4) + b"\x00\x3c\x00\x28" + b"\x00", 501, "does not end with 0xCE"),
        (struct.pack(">BHI", 9, 1, 1) + b"\x00\xce", 501, "unknown frame type 9"),
        (struct.pack(">BHI", 1, 1, 4) + b"\xff\xff\xff\xff\xce", 502, "malformed method"),
        (struct.pack(">BHI", 1, 1, 6) + b"\x00\x3c\x00\x28\x00\x05\xce", 502, "malformed method"),
        (F.marshal(__import__("pamqp.body", fromlist=["x"]).ContentBody(b"zz"), 1), 505, "content body"),
        (struct.pack(">BHI", 8, 1, 0) + b"\xce", 501, "heartbeat frame on channel 1"),
    ],
    ids=[
        "oversized",
        "no-frame-end",
        "unknown-type",
        "unknown-method",
        "truncated-method",
        "stray-body",
        "heartbeat-ch1",
    ],
)
def test_bad_frames_close_the_connection(raw, code, words):
    h = opened()
    h.send_raw(raw)
    closed_with(h, code, channel=False, words=words)
    h.send(0, C.Connection.CloseOk())
    assert h.closed


def test_byte_at_a_time_gives_the_same_answers():
    whole, dribble = opened(), opened()
    frames = b"".join(F.marshal(m, 1) for m in (C.Queue.Declare(queue="q"), C.Confirm.Select()))
    frames += b"".join(whole.publish(1, b"body%d" % i, "", "q") for i in range(3))
    whole.send_raw(frames)
    for i in range(len(frames)):
        dribble.send_raw(frames[i : i + 1])
    assert [(c, getattr(v, "name", "")) for c, v in whole.frames()][:2] == [
        (1, "Queue.DeclareOk"),
        (1, "Confirm.SelectOk"),
    ]
    acks = [v.delivery_tag for _, v in dribble.frames() if isinstance(v, C.Basic.Ack)]
    assert acks and acks[-1] == 3


# ---- fuzz ---------------------------------------------------------------------------------------------
_VALID = [
    F.marshal(C.Queue.Declare(queue="fz"), 1),
    F.marshal(C.Basic.Consume(queue="fz", consumer_tag="t"), 1),
    F.marshal(C.Basic.Get(queue="fz"), 1),
    F.marshal(C.Basic.Ack(delivery_tag=1), 1),
    F.marshal(C.Confirm.Select(), 1),
    F.marshal(C.Exchange.Declare(exchange="fx", exchange_type="topic"), 1),
    F.marshal(C.Queue.Bind(queue="fz", exchange="fx", routing_key="#"), 1),
    F.marshal(C.Channel.Close(200, "x", 0, 0), 1),
    F.marshal(C.Channel.Open(), 2),
    F.marshal(C.Queue.Purge(queue="fz"), 1),
    Harness.publish(None, 1, b"p" * 300, "fx", "a.b"),
]


@st.composite
def _streams(draw):
    parts = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            parts.append(draw(st.sampled_from(_VALID)))
        elif kind == 1:  # a valid frame with a mutated byte
            f = bytearray(draw(st.sampled_from(_VALID)))
            i = draw(st.integers(0, len(f) - 1))
            f[i] = draw(st.integers(0, 255))
            parts.append(bytes(f))
        elif kind == 2:  # truncated
            f = draw(st.sampled_from(_VALID))
            parts.append(f[: draw(st.integers(0, len(f) - 1))])
        else:
            parts.append(draw(st.binary(max_size=64)))
    return b"".join(parts), draw(st.integers(1, 64))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_streams())
def test_fuzz_never_raises_and_answers_in_valid_frames(stream):
    data, chunk = stream
    h = opened()
    for i in range(0, len(data), chunk):
        h.send_raw(data[i : i + chunk])  # must not raise
    h.frames()  # everything the server wrote decodes
    assert h.conn.state in ("opened", "closing", "closed")
    if h.conn.state == "closing":  # never stalls: closed once the close-ok deadline passes
        h.advance(cn.CLOSE_TIMEOUT + 0.1)
        assert h.closed
    # a well-behaved client on the same broker is served normally
    ok = Harness(topology=h.topo)
    ok.masters, ok.by_queue = h.masters, h.by_queue
    ok.handshake()
    ok.open_channel(1)
    ok.send(1, C.Queue.Declare(queue="well"), C.Confirm.Select())
    ok.frames()
    ok.send_raw(ok.publish(1, b"fine", "", "well"))
    assert [v.delivery_tag for _, v in ok.frames() if isinstance(v, C.Basic.Ack)] == [1]


def test_a_queue_declared_through_another_node_is_routed_not_dropped():
    """The local topology may lag behind a declare committed through another
    node: an unroutable publish first re-reads the topology (linearizable),
    so the message reaches the queue instead of being confirmed and dropped;
    a truly unroutable one is returned, and re-reads are rate-limited."""
    from amqp_harness import LocalMaster

    h = opened()
    spec = {
        "name": "fresh",
        "vhost": "/",
        "durable": True,
        "auto_delete": False,
        "exclusive_owner": None,
        "arguments": {},
    }
    m = LocalMaster(99, spec)
    h.masters[m.dst] = m
    h.by_queue["fresh"] = m
    rec = dict(spec, pid=m.member, slave_pids=[], sync_slave_pids=[], gm_pids=[m.member], policy=None, state="live")
    h.elsewhere.append(("amqqueue", rec))
    h.send(1, C.Confirm.Select())
    h.frames()
    h.send_raw(h.publish(1, b"hello", "", "fresh"))
    acks = [v for _, v in h.frames()]
    assert [type(v).__name__ for v in acks] == ["Ack"] and h.refreshes == 1
    assert m.q.bq.message_count == 1, "the message was dropped as unroutable"
    h.send_raw(h.publish(1, b"x", "", "nowhere", mandatory=True))
    kinds = [getattr(v, "name", type(v).__name__) for _, v in h.frames()]
    assert kinds[0] == "Basic.Return" and h.refreshes == 1  # re-read at most every REFRESH_EVERY


@pytest.mark.parametrize(
    "method",
    [
        C.Basic.Consume(queue="fresh"),
        C.Basic.Get(queue="fresh"),
        C.Queue.Declare(queue="fresh", passive=True),
        C.Queue.Bind(queue="fresh", exchange="amq.direct", routing_key="k"),
        C.Queue.Purge(queue="fresh"),
    ],
    ids=lambda m: m.name,
)
def test_a_queue_declared_through_another_node_is_found_by_every_method(method):
    """A 404 comes only after the topology was re-read through the registry:
    a queue whose declare-ok another node already sent is found (consume on
    node 3 right after a declare on node 1 got 404 in CI), and the frames
    behind the method wait for the re-read and keep their order."""
    from amqp_harness import LocalMaster

    h = opened()
    spec = {
        "name": "fresh",
        "vhost": "/",
        "durable": True,
        "auto_delete": False,
        "exclusive_owner": None,
        "arguments": {},
    }
    m = LocalMaster(98, spec)
    m.q.publish(h.now, ("elsewhere", 1), 1, "m-1", b"kept", {}, True)
    h.masters[m.dst] = m
    h.by_queue["fresh"] = m
    rec = dict(spec, pid=m.member, slave_pids=[], sync_slave_pids=[], gm_pids=[m.member], policy=None, state="live")
    h.elsewhere.append(("amqqueue", rec))
    h.send(1, method, C.Basic.Qos(prefetch_count=5))
    names = [getattr(v, "name", type(v).__name__) for _, v in h.frames()]
    assert h.refreshes == 1
    assert not any("Close" in n for n in names), names
    assert names[-1] == "Basic.QosOk" and names[0] != "Basic.QosOk", names


@pytest.mark.parametrize(
    "method,words",
    [
        (C.Basic.Consume(queue="nope"), "no queue 'nope'"),
        (C.Exchange.Declare(exchange="nope", passive=True), "no exchange 'nope'"),
        (C.Basic.Publish(exchange="nope", routing_key="k"), "no exchange 'nope'"),
    ],
    ids=lambda m: getattr(m, "name", str(m)),
)
def test_a_missing_queue_or_exchange_is_404_after_one_re_read(method, words):
    h = opened()
    h.send(1, method)
    closed_with(h, 404, channel=True, words=words)
    assert h.refreshes == 1


def test_declare_of_an_existing_queue_after_its_master_died_is_answered_by_the_new_master():
    """queue.declare of an existing queue asks its master for the message
    count; a master that died never answers, the new one must (it hung)."""
    h = Harness()
    h.handshake()
    h.open_channel()
    h.send(1, C.Queue.Declare(queue="q1", durable=True))
    assert h.methods() == [(1, "Queue.DeclareOk")]
    old = h.by_queue["q1"]
    del h.masters[old.dst]  # the master's node dies: what is sent to it vanishes
    h.open_channel(2)
    h.send(2, C.Queue.Declare(queue="q1", durable=True))
    assert h.methods() == []  # waiting for the dead master
    new = LocalMaster(9, old.spec)
    h.masters[new.dst], h.by_queue["q1"] = new, new
    rec = dict(h.topo.queue("/", "q1"), pid=new.member)
    h.topo.put("amqqueue", rec)
    h._run(h.conn.queue_moved(h.now, "/", "q1", rec))
    assert h.methods() == [(2, "Queue.DeclareOk")]
    h.advance(cn.MASTER_ANSWER_TIMEOUT + 1)  # its timer was cancelled: nothing more happens
    assert h.methods() == [] and h.closed is None


def test_a_request_no_master_answers_ends_after_the_timeout_instead_of_hanging():
    h = Harness()
    h.handshake()
    h.open_channel()
    h.send(1, C.Queue.Declare(queue="q1", durable=True))
    assert h.methods() == [(1, "Queue.DeclareOk")]
    del h.masters[h.by_queue["q1"].dst]  # dead, and no mirror takes over
    h.send(1, C.Queue.Declare(queue="q1", durable=True))
    h.advance(cn.MASTER_ANSWER_TIMEOUT - 1)
    assert h.methods() == []
    h.advance(2)
    # declare-ok does not need the master: it comes, with counts unknown (0)
    fr = h.frames()
    assert [(c, type(v).__name__, v.message_count) for c, v in fr] == [(1, "DeclareOk", 0)]
    h.send(1, C.Basic.Get(queue="q1"))
    h.advance(cn.MASTER_ANSWER_TIMEOUT + 1)
    fr = h.frames()
    assert fr and isinstance(fr[-1][1], C.Connection.Close) and fr[-1][1].reply_code == 541, fr
    assert "did not answer" in fr[-1][1].reply_text


# ---- lost contact with a master --------------------------------------------------------------------
def _publishing(h: Harness, n: int) -> LocalMaster:
    h.handshake()
    h.open_channel()
    h.send(1, C.Queue.Declare(queue="q1", durable=True), C.Confirm.Select())
    h.frames()
    if n:
        h.send_raw(b"".join(h.publish(1, b"m%d" % i, "", "q1") for i in range(n)))
        assert [type(v).__name__ for _, v in h.frames()] == ["Ack"]
    return h.by_queue["q1"]


def test_publishes_dropped_on_a_lost_link_close_the_connection_unless_a_new_master_takes_over():
    """The transport gave up on the master's host (a partition reset every
    connection to it) and dropped a publish; the master lives on.  Nothing
    would ever confirm it: after LINK_GRACE the connection is closed (320),
    so the publisher knows the publish is in doubt instead of waiting."""
    h = Harness()
    m = _publishing(h, 3)
    del h.masters[m.dst]  # cut off: what is sent to it vanishes
    h.send_raw(h.publish(1, b"dropped", "", "q1"))
    h._run(h.conn.link_lost(h.now, host=m.member.split("/")[1]))
    h.advance(cn.LINK_GRACE - 1)
    assert h.methods() == [] and h.closed is None
    h.masters[m.dst] = m  # the partition heals, but the publish is gone for good
    h.advance(2)
    fr = h.frames()
    assert fr and isinstance(fr[-1][1], C.Connection.Close) and fr[-1][1].reply_code == 320, fr
    assert "queue 'q1'" in fr[-1][1].reply_text and "lost contact" in fr[-1][1].reply_text
    assert m.q.bq.message_count == 3


def test_a_failover_within_the_grace_keeps_the_connection_and_confirms():
    h = Harness()
    m = _publishing(h, 2)
    del h.masters[m.dst]  # the master's node died
    h.send_raw(h.publish(1, b"in flight", "", "q1"))
    h._run(h.conn.link_lost(h.now, node="n1"))
    new = LocalMaster(9, m.spec)
    h.masters[new.dst], h.by_queue["q1"] = new, new
    rec = dict(h.topo.queue("/", "q1"), pid=new.member)
    h.topo.put("amqqueue", rec)
    h._run(h.conn.queue_moved(h.now, "/", "q1", rec))
    fr = [v for _, v in h.frames()]
    assert [(type(v).__name__, v.delivery_tag) for v in fr] == [("Ack", 3)]
    h.advance(cn.LINK_GRACE + 1)
    assert h.methods() == [] and h.closed is None


def test_a_lost_link_with_nothing_outstanding_closes_nothing():
    h = Harness()
    m = _publishing(h, 2)
    h._run(h.conn.link_lost(h.now, host=m.member.split("/")[1]))
    h.advance(cn.LINK_GRACE + 1)
    assert h.methods() == [] and h.closed is None
    h.send_raw(h.publish(1, b"later", "", "q1"))  # the link works again
    assert [(type(v).__name__, v.delivery_tag) for _, v in h.frames()] == [("Ack", 3)]


def test_a_consumer_whose_masters_node_went_down_without_a_failover_is_closed():
    """The master's node went down from here (a partition: the master lives
    on the other side and drops this node's channels); a consumer would wait
    for ever for deliveries that master no longer sends it."""
    h = Harness()
    m = _publishing(h, 0)
    h.send(1, C.Basic.Consume(queue="q1", consumer_tag="c1"))
    assert h.methods() == [(1, "Basic.ConsumeOk")]
    h._run(h.conn.link_lost(h.now, node="n2"))  # another node: not this queue's master
    h.advance(cn.LINK_GRACE + 1)
    assert h.methods() == []
    h._run(h.conn.link_lost(h.now, node=m.member.split("/")[0]))
    h.advance(cn.LINK_GRACE + 1)
    fr = h.frames()
    assert fr and isinstance(fr[-1][1], C.Connection.Close) and fr[-1][1].reply_code == 320, fr


# ---- transactions ------------------------------------------------------------------------------
def _tx_channel(h: Harness) -> LocalMaster:
    h.handshake()
    h.open_channel()
    h.send(1, C.Queue.Declare(queue="q1", durable=True), C.Tx.Select())
    assert h.methods() == [(1, "Queue.DeclareOk"), (1, "Tx.SelectOk")]
    return h.by_queue["q1"]


def test_tx_publishes_wait_for_commit_and_rollback_drops_them():
    h = Harness()
    m = _tx_channel(h)
    h.send_raw(h.publish(1, b"a", "", "q1") + h.publish(1, b"b", "", "q1"))
    assert h.methods() == [] and m.q.bq.message_count == 0  # held until the commit
    h.send(1, C.Tx.Commit())
    assert h.methods() == [(1, "Tx.CommitOk")]  # no basic.ack: the channel is not in confirm mode
    assert m.q.bq.message_count == 2
    h.send_raw(h.publish(1, b"c", "", "q1"))
    h.send(1, C.Tx.Rollback())
    assert h.methods() == [(1, "Tx.RollbackOk")]
    h.send(1, C.Tx.Commit())  # an empty transaction commits at once
    assert h.methods() == [(1, "Tx.CommitOk")] and m.q.bq.message_count == 2


def test_list_channels_shows_a_transaction_s_uncommitted_publishes_and_acks():
    h = Harness()
    _tx_channel(h)
    h.send_raw(b"".join(h.publish(1, b"m%d" % i, "", "q1") for i in range(3)))
    h.send(1, C.Tx.Commit(), C.Basic.Consume(queue="q1", consumer_tag="c"))
    assert h.methods().count((1, "Basic.Deliver")) == 3
    h.send_raw(h.publish(1, b"held", "", "q1"))
    h.send(1, C.Basic.Ack(delivery_tag=2, multiple=True))
    (ch,) = h.conn.info()["channels"]
    assert ch["transactional"] is True and ch["confirm"] is False
    assert (ch["messages_uncommitted"], ch["acks_uncommitted"]) == (1, 2)
    h.send(1, C.Tx.Commit())
    (ch,) = h.conn.info()["channels"]
    assert (ch["messages_uncommitted"], ch["acks_uncommitted"]) == (0, 0)


def test_tx_commit_ok_waits_for_the_master_and_later_frames_wait_behind_it():
    h = Harness()
    m = _tx_channel(h)
    del h.masters[m.dst]  # the master does not answer (yet)
    h.send_raw(h.publish(1, b"a", "", "q1"))
    h.send(1, C.Tx.Commit(), C.Queue.Declare(queue="q1", durable=True, passive=True))
    assert h.methods() == []
    new = LocalMaster(9, m.spec)  # a failover: the publish goes to the new master
    h.masters[new.dst], h.by_queue["q1"] = new, new
    rec = dict(h.topo.queue("/", "q1"), pid=new.member)
    h.topo.put("amqqueue", rec)
    h._run(h.conn.queue_moved(h.now, "/", "q1", rec))
    assert h.methods() == [(1, "Tx.CommitOk"), (1, "Queue.DeclareOk")]
    assert new.q.bq.message_count == 1


def test_tx_acks_settle_at_commit_and_rolled_back_acks_leave_messages_unacked():
    h = Harness()
    m = _tx_channel(h)
    h.send_raw(b"".join(h.publish(1, b"m%d" % i, "", "q1") for i in range(3)))
    h.send(1, C.Tx.Commit())
    assert h.methods() == [(1, "Tx.CommitOk")]
    h.send(1, C.Basic.Consume(queue="q1", consumer_tag="c"))
    fr = h.methods()
    assert fr.count((1, "Basic.Deliver")) == 3
    h.send(1, C.Basic.Ack(delivery_tag=1))
    assert m.q.info()["messages_unacknowledged"] == 3  # held by the transaction
    h.send(1, C.Basic.Ack(delivery_tag=1))  # already settled in this transaction
    closed_with(h, 406, channel=True, words="unknown delivery tag 1")
    h.send(1, C.Channel.CloseOk())
    assert m.q.info()["messages_unacknowledged"] == 0 and m.q.bq.message_count == 3  # the close requeued them

    h2 = Harness()
    m2 = _tx_channel(h2)
    h2.send_raw(b"".join(h2.publish(1, b"m%d" % i, "", "q1") for i in range(3)))
    h2.send(1, C.Tx.Commit(), C.Basic.Consume(queue="q1", consumer_tag="c"))
    h2.frames()
    h2.send(1, C.Basic.Ack(delivery_tag=2, multiple=True))
    h2.send(1, C.Tx.Rollback())
    assert h2.methods() == [(1, "Tx.RollbackOk")]
    assert m2.q.info()["messages_unacknowledged"] == 3
    h2.send(1, C.Basic.Ack(delivery_tag=2, multiple=True), C.Basic.Reject(delivery_tag=3, requeue=False), C.Tx.Commit())
    assert h2.methods() == [(1, "Tx.CommitOk")]
    assert m2.q.info()["messages_unacknowledged"] == 0 and m2.q.bq.message_count == 0


def test_tx_and_confirm_modes_exclude_each_other_and_returns_come_at_commit():
    h = Harness()
    _tx_channel(h)
    h.send(1, C.Confirm.Select())
    closed_with(h, 406, channel=True, words="cannot switch from tx to confirm mode")
    h.send(1, C.Channel.CloseOk())
    h.open_channel(1)
    h.send(1, C.Confirm.Select(), C.Tx.Select())
    closed_with(h, 406, channel=True, words="cannot switch from confirm to tx mode")
    h.send(1, C.Channel.CloseOk())
    h.open_channel(1)
    h.send(1, C.Tx.Select())
    h.frames()
    h.send_raw(h.publish(1, b"lost", "", "nowhere", mandatory=True))
    assert h.methods() == []  # routed at the commit
    h.send(1, C.Tx.Commit())
    assert [n for _, n in h.methods()] == ["Basic.Return", "ContentHeader", "ContentBody", "Tx.CommitOk"]


def test_a_priority_queue_delivers_higher_priorities_first():
    h = opened()
    h.send(1, C.Queue.Declare(queue="pq", arguments={"x-max-priority": 5}))
    assert h.methods() == [(1, "Queue.DeclareOk")]
    data = b""
    for body, prio in [(b"low", None), (b"high", 5), (b"mid", 2), (b"over", 200), (b"mid2", 2)]:
        data += h.publish(1, body, "", "pq", properties=C.Basic.Properties(priority=prio))
    h.send_raw(data)
    got = []
    for _ in range(5):
        h.send(1, C.Basic.Get(queue="pq", no_ack=True))
        fr = h.frames()
        got.append(next(v.value for _, v in fr if type(v).__name__ == "ContentBody"))
        hdr = next(v for _, v in fr if type(v).__name__ == "ContentHeader")
        assert hdr.properties.priority in (None, 2, 5, 200)  # the client's property, as published
    assert got == [b"high", b"over", b"mid", b"mid2", b"low"]
    h.send(1, C.Queue.Declare(queue="pq", arguments={"x-max-priority": 4}))
    closed_with(h, 406, channel=True, words="x-max-priority")


def test_update_secret_is_answered_and_the_connection_goes_on():
    h = opened()
    h.send(0, C.Connection.UpdateSecret(new_secret="token-2", reason="refresh"))
    assert h.methods() == [(0, "Connection.UpdateSecretOk")]
    h.send(1, C.Queue.Declare(queue="after"))
    assert h.methods() == [(1, "Queue.DeclareOk")]


# ---- credit: a publisher is not read beyond what its masters have confirmed --------------------
class _Stalled:
    """Stands in for a master that takes publishes and answers nothing yet."""

    def __init__(self, real: LocalMaster) -> None:
        self.real, self.dst, self.held = real, real.dst, []

    def handle(self, now: float, msg) -> list:
        self.held.append(msg)
        return []


def test_a_publisher_without_confirms_is_not_read_past_the_byte_credit_and_close_loses_nothing():
    """Bodies unconfirmed by the master count against MAX_UNCONFIRMED_BYTES:
    once past it the core wants no more reading (the shell stops reading the
    socket), and it wants to read again when confirms come.  A connection.close
    after publishes still waiting behind the channel's batch window sends
    them all to the master before its ChannelClosed: the queue holds every
    message read before the close-ok."""
    h = Harness()
    m = _publishing(h, 0)
    h.open_channel(2)  # no confirm mode on this one
    h.frames()
    stalled = _Stalled(m)
    h.masters[m.dst] = stalled
    body = bytes(1 << 20)
    sent = 0
    while h.conn.wants_read():
        h.send_raw(h.publish(2, body + b"%d" % sent, "", "q1"))
        sent += 1
        assert sent < 4 * (cn.MAX_UNCONFIRMED_BYTES >> 20), "the byte credit never ran out"
    assert h.conn.unconfirmed_bytes >= cn.MAX_UNCONFIRMED_BYTES
    assert sent == (cn.MAX_UNCONFIRMED_BYTES >> 20)  # stops right at the bound for 1 MiB bodies
    # the master catches up: its confirms give the credit back
    h.masters[m.dst] = m
    for msg in stalled.held:
        for _dst, reply in m.handle(h.now, msg):
            h._run(h.conn.receive(h.now, m.dst, reply))
    stalled.held.clear()
    assert h.conn.wants_read()
    assert h.conn.unconfirmed_bytes == sum(len(body) + len(b"%d" % i) for i in range(sent)) - sum(
        len(body) + len(b"%d" % i) for i in range(m.q.bq.message_count)
    )
    # more publishes, the master stalls again, the client closes: nothing is lost
    h.masters[m.dst] = stalled
    for i in range(sent, sent + 10):
        h.send_raw(h.publish(2, body + b"%d" % i, "", "q1"))
    h.send(0, C.Connection.Close(200, "bye", 0, 0))
    assert [v.name for _, v in h.frames()] == ["Connection.CloseOk"]
    h.masters[m.dst] = m
    for msg in stalled.held:
        m.handle(h.now, msg)
    assert isinstance(stalled.held[-1], qm.ChannelClosed)
    assert m.q.bq.message_count == sent + 10


def test_deliveries_written_to_the_client_give_the_link_credit_back():
    """An unlimited no-ack consumer on a deep queue of big messages: the
    master stops at its link credit; what the connection wrote to the
    client goes back as credit in a Settle (grant_credit, which the front
    end calls once the client's socket took it), and every message comes,
    in order, each once."""
    from mirrorq.queues.semantics import LINK_CREDIT_BYTES

    h = Harness()
    h.handshake()
    h.open_channel()
    h.send(1, C.Queue.Declare(queue="big"))
    h.frames()
    size = 1 << 20
    for i in range(20):
        h.send_raw(h.publish(1, b"%02d" % i + bytes(size - 2), "", "big"))

    def firsts() -> list:
        out, head = [], False
        for _, v in h.frames():
            if isinstance(v, H.ContentHeader):
                head = True
            elif isinstance(v, B.ContentBody) and head:
                out.append(v.value[:2])
                head = False
        return out

    h.send(1, C.Basic.Consume(queue="big", consumer_tag="c", no_ack=True))
    got = firsts()
    assert len(got) == LINK_CREDIT_BYTES // size
    assert h.conn.wants_credit() and h.conn.ungranted == len(got) * size
    grants = 0
    while h.conn.wants_credit():
        h._run(h.conn.grant_credit(h.now))
        grants += 1
        got += firsts()
    assert got == [b"%02d" % i for i in range(20)]
    assert grants >= 2 and h.conn.ungranted < cn.GRANT_BYTES
