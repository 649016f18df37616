"""Issue #7's AMQP gaps on the sans-IO connection core (tests/amqp_harness.py):
channel-wide prefetch (basic.qos global=true), channel.flow, consume-ok only
after the master registered the consumer, basic.get resent after a failover,
bindings of deleted queues."""

from __future__ import annotations

from amqp_harness import FE_DST, Harness, LocalMaster
from pamqp import commands as C

from mirrorq.amqp.states import ChanState
from mirrorq.amqp.topology import deleted_queues, queue_binding_deletes
from mirrorq.queues import messages as qm


def opened() -> Harness:
    h = Harness()
    h.handshake()
    h.open_channel(1)
    return h


def delivers(fr) -> list:
    return [v for _, v in fr if isinstance(v, C.Basic.Deliver)]


def bodies(fr) -> list:
    return [v.value for _, v in fr if hasattr(v, "value") and isinstance(v.value, bytes)]


def fill(h: Harness, queue: str, n: int, prefix: bytes = b"m") -> None:
    h.send_raw(b"".join(h.publish(1, prefix + b"%d" % i, "", queue) for i in range(n)))


def consuming(n: int, prefetch: int) -> tuple[Harness, list]:
    """A channel consuming queue q1 (holding ``n`` messages) with ``prefetch``:
    the harness and the frames the consume brought."""
    h = opened()
    h.send(1, C.Queue.Declare(queue="q1"))
    h.frames()
    fill(h, "q1", n)
    h.send(1, C.Basic.Qos(prefetch_count=prefetch))
    h.send(1, C.Basic.Consume(queue="q1", consumer_tag="c"))
    return h, h.frames()


# ---- basic.qos global=true ---------------------------------------------------------------
def test_global_prefetch_is_shared_by_the_channels_consumers_across_queues():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q1"), C.Queue.Declare(queue="q2"))
    h.frames()
    fill(h, "q1", 3, b"a")
    fill(h, "q2", 3, b"b")
    h.send(1, C.Basic.Qos(prefetch_count=2, global_=True))
    assert [n for _, n in h.methods()] == ["Basic.QosOk"]
    h.send(1, C.Basic.Consume(queue="q1", consumer_tag="a"), C.Basic.Consume(queue="q2", consumer_tag="b"))
    fr = h.frames()
    assert [v.consumer_tag for _, v in fr if isinstance(v, C.Basic.ConsumeOk)] == ["a", "b"]
    assert [d.delivery_tag for d in delivers(fr)] == [1, 2]  # 2 in all, not 2 per consumer
    # each consumer is registered with min(per-consumer, channel-wide) = 2 at its master
    assert {c.consumer_tag: c.prefetch for m in h.masters.values() for c in m.q.consumers} == {"a": 2, "b": 2}
    h.send(1, C.Basic.Ack(delivery_tag=1))
    fr = h.frames()
    assert [d.delivery_tag for d in delivers(fr)] == [3]
    h.send(1, C.Basic.Ack(delivery_tag=3, multiple=True))
    fr = h.frames()
    assert [d.delivery_tag for d in delivers(fr)] == [4, 5]
    assert len(h.conn.chans[1].dlv.limited) == 2
    h.send(1, C.Basic.Ack(delivery_tag=0, multiple=True))
    fr = h.frames()
    assert [d.delivery_tag for d in delivers(fr)] == [6]
    got = set()
    for m in h.masters.values():
        got |= {c.consumer_tag for c in m.q.consumers}
    assert got == {"a", "b"}
    h.send(1, C.Basic.Ack(delivery_tag=6))
    assert delivers(h.frames()) == [] and not h.conn.chans[1].dlv.held


def test_per_consumer_and_global_prefetch_both_apply_and_no_ack_is_not_limited():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Queue.Declare(queue="free"))
    h.frames()
    fill(h, "q", 6)
    fill(h, "free", 4, b"f")
    h.send(1, C.Basic.Qos(prefetch_count=2), C.Basic.Qos(prefetch_count=3, global_=True))
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="x"), C.Basic.Consume(queue="q", consumer_tag="y"))
    fr = h.frames()
    per = {}
    for d in delivers(fr):
        per[d.consumer_tag] = per.get(d.consumer_tag, 0) + 1
    assert sum(per.values()) == 3 and max(per.values()) <= 2, per  # global 3, each at most 2
    h.send(1, C.Basic.Consume(queue="free", consumer_tag="n", no_ack=True))
    fr = h.frames()
    assert [d.consumer_tag for d in delivers(fr)] == ["n"] * 4  # no_ack: not counted, not held
    assert bodies(fr) == [b"f0", b"f1", b"f2", b"f3"]
    # raising the channel-wide limit lets held deliveries go at once
    h.send(1, C.Basic.Qos(prefetch_count=0, global_=True))
    fr = h.frames()
    assert len(delivers(fr)) == 1  # the consumers' own limits (2 each) are now the bound
    ch = h.conn.chans[1]
    assert ch.dlv.outstanding == {"x": 2, "y": 2}
    # what still waits here is lookahead for a consumer at its own limit (x came first and was alone)
    assert all(ch.dlv.outstanding[d.consumer_tag] >= 2 for _, d in ch.dlv.held)


def test_a_held_delivery_of_a_cancelled_consumer_goes_back_to_its_queue():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Queue.Declare(queue="r"))
    h.frames()
    fill(h, "q", 2)
    fill(h, "r", 2, b"r")
    h.send(
        1,
        C.Basic.Qos(prefetch_count=1, global_=True),
        C.Basic.Consume(queue="q", consumer_tag="a"),
        C.Basic.Consume(queue="r", consumer_tag="b"),
    )
    fr = h.frames()
    assert bodies(fr) == [b"m0"]
    assert len(h.conn.chans[1].dlv.held) == 1  # r's first message waits here
    h.send(1, C.Basic.Cancel(consumer_tag="b"))
    assert [n for _, n in h.methods()] == ["Basic.CancelOk"]
    assert not h.conn.chans[1].dlv.held
    r = h.by_queue["r"].q
    assert r.info()["messages_ready"] == 2  # given back
    h.send(1, C.Basic.Get(queue="r"))
    fr = h.frames()
    assert isinstance(fr[0][1], C.Basic.GetOk) and fr[0][1].redelivered and bodies(fr) == [b"r0"]


# ---- channel.flow -----------------------------------------------------------------------------
def test_flow_pauses_deliveries_but_not_publishes_or_gets():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Queue.Declare(queue="g"), C.Confirm.Select())
    h.frames()
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"), C.Channel.Flow(active=False))
    fr = h.frames()
    assert [getattr(v, "name", "") for _, v in fr] == ["Basic.ConsumeOk", "Channel.FlowOk"]
    assert fr[1][1].active is False
    fill(h, "q", 3)
    fill(h, "g", 1, b"g")
    fr = h.frames()
    assert delivers(fr) == []
    acks = [v for _, v in fr if isinstance(v, C.Basic.Ack)]
    assert acks and acks[-1].delivery_tag == 4 and acks[-1].multiple  # publishes confirmed
    h.send(1, C.Basic.Get(queue="g", no_ack=True))
    fr = h.frames()
    assert isinstance(fr[0][1], C.Basic.GetOk) and bodies(fr) == [b"g0"]
    h.send(1, C.Channel.Flow(active=True))
    fr = h.frames()
    assert isinstance(fr[0][1], C.Channel.FlowOk) and fr[0][1].active is True
    assert [d.delivery_tag for d in delivers(fr)] == [2, 3, 4] and bodies(fr) == [b"m0", b"m1", b"m2"]


# ---- consume-ok after the master ---------------------------------------------------------------
def test_consume_ok_comes_before_the_deliveries_the_consume_caused():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    fill(h, "q", 2)
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"))
    # the local master answers the consume AFTER the deliveries it caused
    names = [getattr(v, "name", "") for _, v in h.frames() if hasattr(v, "name")]
    assert names[0] == "Basic.ConsumeOk" and names.count("Basic.Deliver") == 2


def test_exclusive_consumer_conflict_closes_the_channel_with_403_and_no_consume_ok():
    h = opened()
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"), C.Basic.Consume(queue="q", consumer_tag="mine", exclusive=True))
    h.frames()
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="other"), C.Basic.Qos(prefetch_count=1))
    fr = h.frames()
    assert not any(isinstance(v, C.Basic.ConsumeOk) for _, v in fr)
    closes = [v for ch, v in fr if ch == 2 and isinstance(v, C.Channel.Close)]
    assert closes and closes[0].reply_code == 403 and "exclusive use" in closes[0].reply_text
    assert (closes[0].class_id, closes[0].method_id) == (60, 20)  # basic.consume
    assert not any(isinstance(v, C.Basic.QosOk) for _, v in fr)  # the qos behind it was never run


def _mute_consumes(h: Harness) -> None:
    """The masters never answer consumes (as one that died)."""
    for m in h.masters.values():
        real = m.handle
        m.handle = lambda now, msg, real=real: [] if isinstance(msg, qm.Consume) else real(now, msg)


def test_consume_waits_for_the_master_and_fails_404_when_the_queue_goes():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    _mute_consumes(h)
    h.send(1, C.Basic.Consume(queue="q", consumer_tag="c"), C.Basic.Qos(prefetch_count=1))
    assert h.frames() == []  # no consume-ok yet; the qos waits behind it
    h._run(h.conn.queue_moved(h.now, "/", "q", None))
    fr = h.frames()
    assert [(v.reply_code, "was deleted" in v.reply_text) for _, v in fr if isinstance(v, C.Channel.Close)] == [
        (404, True)
    ]
    assert not any(isinstance(v, (C.Basic.ConsumeOk, C.Basic.QosOk)) for _, v in fr)


def test_a_consumer_refused_after_a_failover_is_cancelled_by_the_server():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Basic.Consume(queue="q", consumer_tag="c"))
    h.frames()
    ch = h.conn.chans[1]
    ((q, rid),) = list(ch.cons.rids)
    m = h.by_queue["q"]
    h._run(
        h.conn.receive(
            h.now,
            m.dst,
            qm.CommandResult(
                "q", (FE_DST, ch.uid), rid, False, error="ACCESS_REFUSED - queue 'q' in exclusive use", code=403
            ),
        )
    )
    fr = h.frames()
    assert [(v.consumer_tag, type(v).__name__) for _, v in fr] == [("c", "Cancel")]
    assert "c" not in ch.cons.consumers and h.conn.chans.get(1) is ch and ch.state is ChanState.OPEN


def test_nowait_consume_refused_closes_the_channel():
    h = opened()
    h.open_channel(2)
    h.send(1, C.Queue.Declare(queue="q"), C.Basic.Consume(queue="q", consumer_tag="mine", exclusive=True))
    h.frames()
    h.send(2, C.Basic.Consume(queue="q", consumer_tag="other", nowait=True))
    fr = h.frames()
    assert [(ch, v.reply_code) for ch, v in fr if isinstance(v, C.Channel.Close)] == [(2, 403)]


# ---- basic.get across a failover ------------------------------------------------------------------
def test_a_get_lost_with_its_master_is_sent_again_to_the_new_master():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"))
    h.frames()
    old = h.by_queue["q"]
    del h.masters[old.dst]  # the master died: what is sent to it is lost
    h.send(1, C.Basic.Get(queue="q"), C.Basic.Qos(prefetch_count=1))
    assert h.frames() == []
    new = LocalMaster(9, old.spec)
    new.q.publish(h.now, ("elsewhere", 1), 1, "m-1", b"kept", {}, True)
    h.masters[new.dst] = new
    rec = dict(h.topo.queue("/", "q"), pid=new.member)
    h.topo.put("amqqueue", rec)
    h._run(h.conn.queue_moved(h.now, "/", "q", rec))
    fr = h.frames()
    oks = [v for _, v in fr if isinstance(v, C.Basic.GetOk)]
    assert len(oks) == 1 and bodies(fr) == [b"kept"]
    assert any(isinstance(v, C.Basic.QosOk) for _, v in fr)  # the frames behind the get resumed
    assert new.q.info()["messages_unacknowledged"] == 1
    h.send(1, C.Basic.Ack(delivery_tag=oks[0].delivery_tag))
    h.frames()
    assert new.q.info()["messages_unacknowledged"] == 0 and new.q.info()["messages"] == 0


# ---- bindings of deleted queues ----------------------------------------------------------------
def test_queue_bind_checks_the_queue_still_exists_and_maps_a_refusal_to_404():
    h = opened()
    h.send(1, C.Queue.Declare(queue="q"), C.Exchange.Declare(exchange="x", exchange_type="direct"))
    h.frames()
    h.hold_registry = True
    h.send(1, C.Queue.Bind(queue="q", exchange="x", routing_key="k"))
    (ev,) = h.held
    assert ev.txn["checks"] == [{"table": "amqqueue", "key": ["/", "q"], "exists": True}]
    h.held, h.hold_registry = [], False
    h._run(h.conn.registry_result(h.now, ev.tag, False, "precondition failed: amqqueue ('/', 'q') does not exist"))
    fr = h.frames()
    closes = [v for _, v in fr if isinstance(v, C.Channel.Close)]
    assert closes and closes[0].reply_code == 404 and "'q'" in closes[0].reply_text


def test_deleted_queues_names_only_deletions_mastered_on_this_node():
    rec = lambda name, pid: {"vhost": "/", "name": name, "pid": pid}  # noqa: E731
    changes = [
        ("amqqueue", ["/", "a"], rec("a", "n1/h:1/u1"), None),  # deleted, master on n1
        ("amqqueue", ["/", "b"], rec("b", "n2/h:2/u2"), None),  # deleted elsewhere
        ("amqqueue", ["/", "c"], rec("c", "n1/h:1/u3"), rec("c", "n2/h:2/u4")),  # moved, not deleted
        ("amqqueue", ["/", "d"], None, rec("d", "n1/h:1/u5")),  # created
        ("binding", ["/", "x", "queue", "a", "", ""], {"vhost": "/"}, None),
        ("amqqueue", ["/", "e"], rec("e", None), None),  # never had a master
    ]
    assert deleted_queues(changes, "n1") == [("/", "a")]
    assert deleted_queues(changes, "n2") == [("/", "b")]


def test_queue_binding_deletes_removes_exactly_the_queues_bindings():
    def b(src, kind, dest, rk="", vhost="/"):
        return {
            "vhost": vhost,
            "source": src,
            "destination_kind": kind,
            "destination": dest,
            "routing_key": rk,
            "arguments_key": "",
            "arguments": {},
        }

    rows = [
        b("x", "queue", "q", "k1"),
        b("y", "queue", "q", "k2"),
        b("x", "queue", "q2"),
        b("x", "exchange", "q"),
        b("x", "queue", "q", vhost="other"),
    ]
    ops = queue_binding_deletes(rows, "/", "q")
    assert [o["key"] for o in ops] == [["/", "x", "queue", "q", "k1", ""], ["/", "y", "queue", "q", "k2", ""]]
    assert all(o["op"] == "delete" and o["table"] == "binding" for o in ops)
    from mirrorq.mnesia_like.registry import check_txn

    check_txn({"ops": ops})  # well-formed for the registry


# ---- prefetch enforced here, lookahead from the master --------------------------------------
def test_a_consumer_never_holds_more_than_its_prefetch_and_an_ack_is_answered_from_the_lookahead():
    from mirrorq.amqp.consume import MIN_LOOKAHEAD

    h, fr = consuming(200, 10)
    assert [d.delivery_tag for d in delivers(fr)] == list(range(1, 11))  # the client sees its prefetch, no more
    master = h.by_queue["q1"]
    chan = h.conn.chans[1].queues["q1"].channel
    assert master.q.in_flight(chan, "c") == 10 + MIN_LOOKAHEAD  # the backlog (190) covers the lookahead
    assert len(h.conn.chans[1].dlv.held) == MIN_LOOKAHEAD
    # each ack is answered from what waits here, in queue order
    for t in range(1, 191):
        h.send(1, C.Basic.Ack(delivery_tag=t))
        fr = h.frames()
        assert [d.delivery_tag for d in delivers(fr)] == [t + 10]
        assert len(h.conn.chans[1].dlv.unacked) == 10
    assert bodies(fr) == [b"m199"]
    for t in range(191, 201):
        h.send(1, C.Basic.Ack(delivery_tag=t))
    assert master.q.bq.message_count == 0 and not h.conn.chans[1].dlv.held


def test_prefetch_one_gets_no_lookahead():
    h, fr = consuming(5, 1)
    assert len(delivers(fr)) == 1
    assert h.by_queue["q1"].q.in_flight(h.conn.chans[1].queues["q1"].channel, "c") == 1  # fair dispatch kept


def test_a_cancelled_consumers_lookahead_goes_back_to_the_queue():
    h, fr = consuming(300, 5)
    assert len(delivers(fr)) == 5
    assert h.conn.chans[1].dlv.held  # lookahead waits here
    h.send(1, C.Basic.Cancel(consumer_tag="c"))
    h.frames()
    q = h.by_queue["q1"].q
    assert q.bq.unacked_count == 5 and q.bq.ready_count == 295  # what waited here was given back
