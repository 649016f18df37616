"""AMQQueue: a classic queue's semantics on a BackingQueue (unit tests).

The randomized model check lives in tests/test_amqqueue_props.py."""

from __future__ import annotations

import pytest

from mirrorq.classic.amqqueue import (
    EXPIRES_AT_KEY,
    EXPIRES_TIMER,
    TTL_TIMER,
    AMQQueue,
    CancelOk,
    ConsumeOk,
    Consumer,
    ConsumerCancelled,
    DeadLettered,
    Deliver,
    GetEmpty,
    GetOk,
    MessagesDropped,
    Publish,
    PublishAccepted,
    PublishRejected,
    QueueDeleted,
)
from mirrorq.classic.backing_queue import PRIORITY_KEY, BackingQueue, Op
from mirrorq.queues.semantics import (
    LINK_CREDIT_BYTES,
    LOOKAHEAD_BYTES,
    AccessRefused,
    NotAllowed,
    NotFound,
    NotImplementedFeature,
    PreconditionFailed,
    ResourceLocked,
    parse_expiration,
)
from mirrorq.sansio import CancelTimer, Emit, SetTimer

A = ("conn-a", 1)  # channel 1 of connection conn-a
A2 = ("conn-a", 2)
B = ("conn-b", 1)


def mem_bq() -> BackingQueue:
    return BackingQueue(None, durable=False)


def make(args=None, **kw) -> AMQQueue:
    kw.setdefault("durable", False)
    return AMQQueue("q", kw.pop("bq", None) or mem_bq(), arguments=args, **kw)


def ev(actions, kind=None):
    out = [a.event for a in actions if isinstance(a, Emit)]
    return out if kind is None else [e for e in out if isinstance(e, kind)]


def delivered(actions):
    return [(d.channel, d.consumer_tag, d.message.msg_id, d.redelivered) for d in ev(actions, Deliver)]


def timers(actions, key):
    return [a for a in actions if isinstance(a, (SetTimer, CancelTimer)) and a.key == key]


def pub(q, now, ids, channel=A, props=None, body=b"x", persistent=True):
    items = [Publish(channel, f"p-{i}", str(i), body, dict(props or {}), persistent) for i in ids]
    return q.publish_many(now, items)


def offsets(q, ids):
    return [q.bq.offset_of(i) for i in ids]


def check_counts(q):
    """The queue's bookkeeping agrees with its store."""
    info = q.info()
    bq = q.bq
    assert (info["messages"], info["messages_ready"], info["messages_unacknowledged"]) == (
        bq.message_count,
        bq.ready_count,
        bq.unacked_count,
    )
    assert info["message_bytes_ready"] == sum(len(m.body) for m in bq.peek(bq.ready_count))
    assert info["message_bytes_unacknowledged"] == sum(len(bq.get(o).body) for o in bq.unacked_offsets())


# ------------------------------------------------------------ delivery


def test_lookahead_only_when_every_consumer_is_busy_and_the_backlog_covers_it():
    q = make()
    pub(q, 0, [f"m{i}" for i in range(12)])
    # alone, a backlog of 12 >= its lookahead 3: prefetch 2 + lookahead 3
    acts = q.consume(1, A, "t1", prefetch=2, lookahead=3)
    assert len(delivered(acts)) == 5 and q.in_flight(A, "t1") == 5
    # a second consumer with credit of its own: no extra credit for anyone while it can take messages
    acts = q.consume(1, B, "t2", prefetch=2, lookahead=3)
    got = delivered(acts)
    assert [t for _, t, _, _ in got][:2] == ["t2", "t2"]  # it is served first, from its own prefetch
    # both at their prefetch, backlog 12-5-2=5 < 6 (both lookaheads): no lookahead for t2
    assert q.in_flight(B, "t2") == 2 and q.bq.ready_count == 5
    # acks bring t1 below its prefetch+lookahead: it takes back only up to... prefetch (no lookahead now)
    q.ack(2, A, offsets(q, ["m0", "m1", "m2", "m3"]))
    assert q.in_flight(A, "t1") == 2
    check_counts(q)


def test_lookahead_stops_at_lookahead_bytes():
    """Lookahead is held in the front end's memory: a consumer takes it only
    while the bodies it holds stay under LOOKAHEAD_BYTES."""
    q = make()
    mib = b"b" * (1 << 20)
    pub(q, 0, [f"m{i}" for i in range(40)], body=mib)
    acts = q.consume(1, A, "t1", prefetch=2, lookahead=30)
    # 2 (its prefetch) + lookahead while under 4 MiB: the 3rd and 4th, then no more
    assert len(delivered(acts)) == (LOOKAHEAD_BYTES >> 20) and q.in_flight(A, "t1") == 4
    q.ack(2, A, offsets(q, ["m0", "m1"]))
    assert q.in_flight(A, "t1") == 4  # acks free bytes: two more, up to the bound again
    check_counts(q)


def test_lookahead_needs_prefetch_and_acks():
    q = make()
    pub(q, 0, [f"m{i}" for i in range(10)])
    assert len(delivered(q.consume(1, A, "na", no_ack=True, lookahead=3))) == 10  # no_ack: unlimited, no lookahead
    pub(q, 1, [f"n{i}" for i in range(10)])
    with pytest.raises(TypeError, match="lookahead"):
        q.consume(1, B, "bad", prefetch=1, lookahead=-1)


def test_fifo_round_robin_and_prefetch():
    q = make()
    acts = pub(q, 0, ["m0", "m1", "m2", "m3", "m4", "m5"])
    assert [e.offset for e in ev(acts, PublishAccepted)] == offsets(q, ["m0", "m1", "m2", "m3", "m4", "m5"])
    assert [e.publish_id for e in ev(acts, PublishAccepted)] == [f"p-m{i}" for i in range(6)]
    acts = q.consume(1, A, "t1", prefetch=2)
    assert ev(acts)[0] == ConsumeOk(A, "t1")
    assert delivered(acts) == [(A, "t1", "m0", False), (A, "t1", "m1", False)]
    acts = q.consume(1, B, "t2", prefetch=3)
    assert delivered(acts) == [(B, "t2", "m2", False), (B, "t2", "m3", False), (B, "t2", "m4", False)]
    assert q.in_flight(A, "t1") == 2 and q.in_flight(B, "t2") == 3
    # credit comes back on ack; the next message goes to the consumer that has credit
    acts = q.ack(2, B, offsets(q, ["m2"]))
    assert delivered(acts) == [(B, "t2", "m5", False)]
    assert q.bq.ready_count == 0
    # both have credit now: round-robin, in FIFO order
    q.ack(3, A, offsets(q, ["m0", "m1"]))
    q.ack(3, B, offsets(q, ["m3", "m4", "m5"]))
    acts = pub(q, 4, [f"n{i}" for i in range(5)])
    got = delivered(acts)
    assert [m for _, _, m, _ in got] == [f"n{i}" for i in range(5)]
    tags = [t for _, t, _, _ in got]
    assert all(tags[i] != tags[i + 1] for i in range(len(tags) - 2))  # alternates while both have credit
    assert q.in_flight(A, "t1") == 2 and q.in_flight(B, "t2") == 3
    check_counts(q)


def test_unlimited_and_no_ack_consumers():
    q = make()
    pub(q, 0, range(50))
    acts = q.consume(0, A, "all", prefetch=0)
    assert len(ev(acts, Deliver)) == 50 and q.bq.unacked_count == 50
    q2 = make()
    pub(q2, 0, range(10))
    acts = q2.consume(0, A, "noack", no_ack=True, prefetch=1)  # prefetch does not limit no-ack
    ds = ev(acts, Deliver)
    assert len(ds) == 10 and not any(d.ack_required for d in ds)
    assert q2.bq.message_count == 0 and q2.unacked_by(A) == []
    check_counts(q2)


@pytest.mark.parametrize("no_ack", [True, False])
def test_link_credit_stops_an_unlimited_consumer_until_its_front_end_wrote_its_deliveries(no_ack):
    """Prefetch 0 (or no_ack) sets no limit, but the link does: a consumer
    is sent at most LINK_CREDIT_BYTES of bodies (plus one message) its front
    end has not credited back; credit brings the next ones, in order."""
    size = 1 << 20
    q = make()
    pub(q, 0, range(20), body=bytes(size))
    first = delivered(q.consume(0, A, "c", prefetch=0, no_ack=no_ack))
    assert len(first) == LINK_CREDIT_BYTES // size
    assert delivered(pub(q, 0, [99])) == []  # nothing more, not even a fresh publish
    assert delivered(q.link_credit(0, A, [("other", 5 * size)])) == []  # not its consumer
    more = delivered(q.link_credit(0, A, [("c", 3 * size)]))
    assert [m[2] for m in more] == [str(i) for i in range(8, 11)]
    rest = []
    while True:
        got = delivered(q.link_credit(0, A, [("c", LINK_CREDIT_BYTES)]))
        if not got:
            break
        rest += got
    assert [m[2] for m in first + more + rest] == [str(i) for i in range(20)] + ["99"]
    with pytest.raises(TypeError):
        q.link_credit(0, A, [("c", -1)])


def test_batch_to_consumer_writes_one_deliver_record():
    q = make()
    q.consume(0, A, "t")
    before = q.bq.log.next_offset
    acts = pub(q, 0, range(100))
    assert len(ev(acts, Deliver)) == 100
    recs = q.bq.log.read_from(before, include_pending=True)
    assert [r.rtype for _, r in recs].count(Op.DELIVER) == 1
    assert [r.rtype for _, r in recs].count(Op.PUBLISH) == 100


def test_a_priority_queue_delivers_a_batch_in_arrival_order_to_a_consumer_with_credit():
    """Priorities order what waits, not what a consumer with room is handed
    as it comes: a batch reaches it in arrival order, as one message at a
    time would; what is left over waits by priority."""
    q = AMQQueue(
        "qp", BackingQueue(None, durable=False, max_priority=5), durable=False, arguments={"x-max-priority": 5}
    )
    q.consume(0, A, "t", prefetch=2)
    items = [
        Publish(A, i, name, b"x", {PRIORITY_KEY: pr}, True)
        for i, (name, pr) in enumerate([("low", 0), ("mid", 2), ("top", 5), ("high", 4)])
    ]
    acts = q.publish_many(0, items)
    assert [d[2] for d in delivered(acts)] == ["low", "mid"]
    assert [m.msg_id for m in q.bq.peek(5)] == ["top", "high"]
    check_counts(q)


def test_consumer_priority():
    q = make()
    q.consume(0, A, "low", prefetch=10)
    q.consume(0, B, "high", prefetch=2, arguments={"x-priority": 5})
    got = delivered(pub(q, 0, range(6)))
    assert [t for _, t, _, _ in got] == ["high", "high", "low", "low", "low", "low"]
    with pytest.raises(PreconditionFailed, match="x-priority"):
        q.consume(0, B, "bad", arguments={"x-priority": "5"})


def test_reject_nack_requeue_to_original_position_redelivered():
    q = make()
    pub(q, 0, ["a", "b", "c", "d"])
    q.consume(0, A, "t", prefetch=2)  # a, b
    oa, ob, oc, od = offsets(q, ["a", "b", "c", "d"])
    acts = q.reject(1, A, [ob], requeue=True)
    # b goes back before c and d and is redelivered first, with redelivered=True
    assert delivered(acts) == [(A, "t", "b", True)]
    acts = q.nack(2, A, [oa, ob], requeue=True)
    assert delivered(acts) == [(A, "t", "a", True), (A, "t", "b", True)]
    acts = q.nack(3, A, [oa, ob], requeue=False)
    assert ev(acts, MessagesDropped) == [MessagesDropped((oa, ob), "rejected")]
    assert delivered(acts) == [(A, "t", "c", False), (A, "t", "d", False)]
    q.ack(4, A, [oc, od])
    assert q.bq.message_count == 0
    with pytest.raises(TypeError, match="requeue"):
        q.reject(5, A, [oa], requeue="yes")


def test_ack_of_offsets_the_channel_does_not_hold_is_ignored():
    q = make()
    pub(q, 0, ["a", "b"])
    q.consume(0, A, "t")
    oa, ob = offsets(q, ["a", "b"])
    assert q.ack(1, B, [oa]) == [] and q.unacked_by(A) == [oa, ob]  # other channel
    assert q.ack(1, A, [999]) == []
    q.ack(1, A, [oa, oa])  # repeated in one call: acked once
    assert q.unacked_by(A) == [ob] and q.bq.message_count == 1
    q.ack(1, A, [oa])  # again: it is gone, nothing happens
    assert q.bq.message_count == 1
    with pytest.raises(TypeError, match="offset"):
        q.ack(1, A, ["b"])


def test_basic_get():
    q = make()
    assert ev(q.get(0, A, "r1")) == [GetEmpty(A, "r1")]
    pub(q, 0, ["a", "b", "c"])
    (g,) = ev(q.get(1, A, "r2"))
    assert isinstance(g, GetOk) and g.message.msg_id == "a" and g.message_count == 2 and g.ack_required
    assert not g.redelivered and q.unacked_by(A) == [g.offset]
    (g2,) = ev(q.get(1, A, "r3", no_ack=True))
    assert g2.message.msg_id == "b" and not g2.ack_required and q.bq.message_count == 2
    q.reject(2, A, [g.offset])  # requeued at the head
    (g3,) = ev(q.get(3, A, "r4"))
    assert g3.message.msg_id == "a" and g3.redelivered and g3.message_count == 1
    q.ack(4, A, [g3.offset])
    assert [m.msg_id for m in q.bq.peek(5)] == ["c"]
    check_counts(q)


def test_recover_requeues_the_channels_unacked():
    q = make()
    pub(q, 0, ["a", "b", "c"])
    q.consume(0, A, "t", prefetch=2)
    q.consume(0, B, "u", prefetch=1)  # gets c
    pub(q, 0, ["d"])  # both consumers are full
    (g,) = ev(q.get(0, A, "r"), GetOk)  # d is fetched by basic.get on A
    assert g.message.msg_id == "d"
    q.cancel(1, B, "u")
    acts = q.recover(2, A)
    # a, b and d come back; t (prefetch 2) gets a and b again
    assert delivered(acts) == [(A, "t", "a", True), (A, "t", "b", True)]
    assert [m.msg_id for m in q.bq.peek(5)] == ["d"]
    assert q.unacked_by(B) == offsets(q, ["c"])  # untouched
    with pytest.raises(NotImplementedFeature, match="requeue=false") as ei:
        q.recover(3, A, requeue=False)
    assert ei.value.reply_code == 540


def test_cancel_keeps_unacked_with_channel_and_unknown_tag_is_ok():
    q = make()
    pub(q, 0, ["a", "b"])
    q.consume(0, A, "t", prefetch=1)
    oa = q.bq.offset_of("a")
    acts = q.cancel(1, A, "t")
    assert ev(acts) == [CancelOk(A, "t")] and q.consumers == []
    assert q.unacked_by(A) == [oa]
    assert ev(q.cancel(1, A, "never")) == [CancelOk(A, "never")]
    q.ack(2, A, [oa])
    assert q.bq.message_count == 1 and q.bq.ready_count == 1
    # the same tag can be reused after cancel; old deliveries do not count toward its prefetch
    pub(q, 3, ["c"])
    q.consume(3, A, "t", prefetch=1)
    assert q.in_flight(A, "t") == 1


def test_channel_down_requeues_and_removes_its_consumers():
    q = make()
    pub(q, 0, ["a", "b", "c"])
    q.consume(0, A, "t1", prefetch=2)
    q.consume(0, A2, "t2", prefetch=5)  # another channel of the same connection: c
    acts = q.consume(0, B, "u", prefetch=5)
    assert delivered(acts) == []
    acts = q.channel_down(1, A)
    assert ev(acts, ConsumerCancelled) == []  # the channel is gone: nobody to tell
    assert sorted((t, m, r) for _, t, m, r in delivered(acts)) == [("t2", "a", True), ("u", "b", True)]
    assert [c.consumer_tag for c in q.consumers] == ["t2", "u"]
    assert q.unacked_by(A) == []
    check_counts(q)


def test_bad_consume_arguments():
    q = make()
    q.consume(0, A, "t")
    with pytest.raises(NotAllowed, match="reuse consumer tag 't'") as ei:
        q.consume(0, A, "t")
    assert ei.value.reply_code == 530
    q.consume(0, B, "t")  # the same tag on another channel is fine
    with pytest.raises(TypeError, match="prefetch"):
        q.consume(0, A, "x", prefetch=-1)
    with pytest.raises(TypeError, match="prefetch"):
        q.consume(0, A, "x", prefetch=70000)
    with pytest.raises(TypeError, match="no_ack"):
        q.consume(0, A, "x", no_ack=1)
    with pytest.raises(TypeError, match="consumer_tag"):
        q.consume(0, A, "")
    with pytest.raises(PreconditionFailed, match="x-cancel-on-ha-failover"):
        q.consume(0, A, "x", arguments={"x-cancel-on-ha-failover": "true"})
    assert [c.consumer_tag for c in q.consumers] == ["t", "t"]


def test_exclusive_consumer():
    q = make()
    q.consume(0, A, "ex", exclusive=True)
    with pytest.raises(AccessRefused, match="'q' in exclusive use") as ei:
        q.consume(0, B, "other")
    assert ei.value.reply_code == 403
    q.cancel(0, A, "ex")
    q.consume(0, B, "other")
    with pytest.raises(AccessRefused, match="exclusive use"):
        q.consume(0, A, "ex", exclusive=True)


# -------------------------------------------------- exclusive, auto-delete


def test_exclusive_queue_is_locked_to_its_connection():
    q = make(exclusive_owner="conn-a")
    for call in (
        lambda: q.consume(0, B, "t"),
        lambda: q.get(0, B, "r"),
        lambda: q.purge(0, connection="conn-b"),
        lambda: q.delete(0, connection="conn-b"),
        lambda: q.check_access("conn-b"),
        lambda: q.touch(0, connection="conn-b"),
    ):
        with pytest.raises(ResourceLocked, match="locked queue 'q'") as ei:
            call()
        assert ei.value.reply_code == 405
    pub(q, 0, ["a"], channel=B)  # anyone may publish to it
    assert delivered(q.consume(0, A2, "t")) == [(A2, "t", "a", False)]
    assert q.owner_down(1, "conn-b") == []
    acts = q.owner_down(1, "conn-a")
    assert ev(acts, QueueDeleted) == [QueueDeleted("q", "owner-down", 0)]
    assert q.deleted


def test_auto_delete_after_last_consumer_goes():
    q = make(auto_delete=True)
    pub(q, 0, ["a"])
    q.get(0, A, "r", no_ack=True)  # basic.get does not make it "used"
    q.consume(0, A, "t1")
    q.consume(0, B, "t2")
    assert ev(q.cancel(1, A, "t1")) == [CancelOk(A, "t1")]
    assert not q.deleted
    acts = q.channel_down(2, B)
    assert ev(acts, QueueDeleted) == [QueueDeleted("q", "auto-delete", 0)]
    with pytest.raises(NotFound, match="'q' was deleted"):
        q.publish(3, A, 1, "z", b"")
    q2 = make(auto_delete=True)
    q2.consume(0, A, "t")
    assert ev(q2.cancel(1, A, "t"), QueueDeleted) == [QueueDeleted("q", "auto-delete", 0)]


def test_x_expires():
    q = make({"x-expires": 2000})
    acts = q.start(0)
    assert timers(acts, EXPIRES_TIMER) == [SetTimer(EXPIRES_TIMER, 2.0)]
    assert timers(q.get(1, A, "r"), EXPIRES_TIMER) == [SetTimer(EXPIRES_TIMER, 2.0)]  # reset
    assert timers(q.touch(1.5), EXPIRES_TIMER) == [SetTimer(EXPIRES_TIMER, 2.0)]
    assert timers(q.consume(2, A, "t"), EXPIRES_TIMER) == [CancelTimer(EXPIRES_TIMER)]
    assert q.timer(3.5, EXPIRES_TIMER) == []  # a stale fire while consumed: ignored
    assert not q.deleted
    assert timers(q.cancel(4, A, "t"), EXPIRES_TIMER) == [SetTimer(EXPIRES_TIMER, 2.0)]
    pub(q, 5, ["a"])  # publishing does not count as use
    acts = q.timer(6, EXPIRES_TIMER)
    assert ev(acts, QueueDeleted) == [QueueDeleted("q", "expired", 1)] and q.deleted
    assert q.timer(7, TTL_TIMER) == []  # timers after deletion are no-ops


# -------------------------------------------------------------------- TTL


def test_queue_ttl_expires_at_the_head_on_timer():
    q = make({"x-message-ttl": 1000})
    acts = pub(q, 0, ["a"])
    (t,) = timers(acts, TTL_TIMER)
    assert isinstance(t, SetTimer) and t.delay == pytest.approx(1.0, abs=1e-5)
    assert timers(pub(q, 0.5, ["b"]), TTL_TIMER) == []  # the head's deadline is unchanged
    acts = q.timer(1.0 + 1e-6, TTL_TIMER)
    assert ev(acts, MessagesDropped) == [MessagesDropped((q.info()["next_offset"] - 3,), "expired")]
    assert [m.msg_id for m in q.bq.peek(5)] == ["b"]
    (t,) = timers(acts, TTL_TIMER)
    assert t.delay == pytest.approx(0.5, abs=1e-5)
    acts = q.consume(2, A, "t")  # b expired at 1.5: never delivered
    assert delivered(acts) == [] and ev(acts, MessagesDropped)[0].reason == "expired"
    assert q.bq.message_count == 0
    assert timers(acts, TTL_TIMER) == [CancelTimer(TTL_TIMER)]


def test_per_message_expiration_min_with_queue_ttl_and_head_only():
    q = make({"x-message-ttl": 5000})
    pub(q, 0, ["long"])  # deadline 5
    pub(q, 0, ["short"], props={"expiration": "1000"})  # deadline 1, but behind "long"
    pub(q, 0, ["longer"], props={"expiration": "60000"})  # queue TTL wins: deadline 5
    acts = q.timer(2, TTL_TIMER)  # the head lives until 5: nothing goes, the timer is set again
    assert ev(acts) == [] and [t.delay for t in timers(acts, TTL_TIMER)] == [pytest.approx(3.0, abs=1e-5)]
    assert [m.msg_id for m in q.bq.peek(5)] == ["long", "short", "longer"]
    assert [q.bq.get(i).properties[EXPIRES_AT_KEY] for i in ("long", "short", "longer")] == [5.0, 1.0, 5.0]
    acts = q.get(2, A, "r", no_ack=True)
    (g,) = ev(acts, GetOk)
    assert g.message.msg_id == "long"
    # now "short" is at the head and past its deadline: dropped, never handed out
    assert ev(acts, MessagesDropped) == [MessagesDropped((q.bq.offset_of("longer") - 1,), "expired")]
    (g,) = ev(q.get(2, A, "r", no_ack=True), GetOk)
    assert g.message.msg_id == "longer"
    assert g.message.properties == {"expiration": "60000"}  # the stored deadline is not shown


def test_ttl_zero_delivered_only_if_a_consumer_can_take_it():
    q = make({"x-message-ttl": 0})
    acts = pub(q, 0, ["a"])
    assert ev(acts, MessagesDropped)[0].reason == "expired" and q.bq.message_count == 0
    assert ev(acts, PublishAccepted)  # accepted (confirmable), then expired
    q.consume(1, A, "t", prefetch=1)
    acts = pub(q, 2, ["b", "c"])
    assert delivered(acts) == [(A, "t", "b", False)]
    assert [m.reason for m in ev(acts, MessagesDropped)] == ["expired"] and q.bq.ready_count == 0
    # an unacked message does not expire; requeued after its deadline, it goes
    ob = q.bq.offset_of("b")
    acts = q.reject(3, A, [ob])
    assert delivered(acts) == [] and ev(acts, MessagesDropped) == [MessagesDropped((ob,), "expired")]


def test_requeued_message_keeps_its_deadline():
    q = make({"x-message-ttl": 1000})
    pub(q, 0, ["a"])
    q.consume(0, A, "t")
    oa = q.bq.offset_of("a")
    q.cancel(0.2, A, "t")
    acts = q.reject(0.5, A, [oa])  # back, with its original deadline 1.0
    (t,) = timers(acts, TTL_TIMER)
    assert t.delay == pytest.approx(0.5, abs=1e-5)
    assert ev(q.timer(1.0 + 1e-6, TTL_TIMER), MessagesDropped) == [MessagesDropped((oa,), "expired")]


def test_deadline_survives_reopen_and_promotion(tmp_path):
    bq = BackingQueue(tmp_path, fsync=False)
    q = AMQQueue("q", bq, durable=True, arguments={"x-message-ttl": 10_000})
    pub(q, 100, ["a"])
    pub(q, 100, ["b"], props={"expiration": "2000"})
    bq.close()
    bq = BackingQueue(tmp_path, fsync=False)
    assert bq.get("a").properties[EXPIRES_AT_KEY] == pytest.approx(110.0)
    q = AMQQueue("q", bq, durable=True, arguments={"x-message-ttl": 10_000})
    acts = q.promote(105)
    (t,) = timers(acts, TTL_TIMER)
    assert t.delay == pytest.approx(5.0, abs=1e-5)
    q.get(106, A, "r", no_ack=True)  # a; b (deadline 102) is now expired at the head
    assert q.bq.message_count == 0
    bq.close()


def test_bad_expiration_refuses_the_whole_batch():
    q = make()
    for bad, why in (
        ("-1", "value_negative"),
        ("1.5", "decimal digits"),
        (100, "decimal digits"),
        ("4294967296", "value_too_large"),
        ("", "decimal digits"),
    ):
        with pytest.raises(PreconditionFailed, match=why):
            q.publish_many(0, [Publish(A, 1, "ok", b""), Publish(A, 2, "bad", b"", {"expiration": bad})])
    assert q.bq.log.next_offset == 0
    assert parse_expiration("0") == 0 and parse_expiration(b"4294967295") == 4294967295
    with pytest.raises(PreconditionFailed, match="reserved"):
        q.publish(0, A, 1, "x", b"", {EXPIRES_AT_KEY: 1.0})


# ------------------------------------------------------------- max length


def test_max_length_drop_head():
    q = make({"x-max-length": 2})
    acts = pub(q, 0, ["a", "b", "c", "d"])
    assert len(ev(acts, PublishAccepted)) == 4
    assert ev(acts, MessagesDropped) == [MessagesDropped(tuple(range(2)), "maxlen")]
    assert [m.msg_id for m in q.bq.peek(5)] == ["c", "d"]
    # a publish first goes to a consumer that can take it; only the rest count
    q.consume(1, A, "t", prefetch=3)  # takes c, d
    acts = pub(q, 2, ["e", "f", "g"])
    assert [m for _, _, m, _ in delivered(acts)] == ["e"] and [m.msg_id for m in q.bq.peek(5)] == ["f", "g"]
    # unacked messages do not count; after a requeue the limit applies before delivering
    oc = q.bq.offset_of("c")
    acts = q.reject(3, A, [oc])  # ready would be c, f, g: c is dropped, f is delivered
    assert ev(acts, MessagesDropped) == [MessagesDropped((oc,), "maxlen")]
    assert [m for _, _, m, _ in delivered(acts)] == ["f"]
    check_counts(q)


def test_max_length_bytes_drop_head():
    q = make({"x-max-length-bytes": 10})
    q.publish(0, A, 1, "a", b"1234")
    q.publish(0, A, 2, "b", b"1234")
    acts = q.publish(0, A, 3, "c", b"1234")
    assert [e.reason for e in ev(acts, MessagesDropped)] == ["maxlen"]
    assert [m.msg_id for m in q.bq.peek(5)] == ["b", "c"] and q.info()["message_bytes_ready"] == 8
    acts = q.publish(0, A, 4, "big", b"x" * 11)  # bigger than the limit: everything goes
    assert q.bq.ready_count == 0 and len(ev(acts, MessagesDropped)[0].offsets) == 3


def test_reject_publish_overflow():
    q = make({"x-max-length": 2, "x-overflow": "reject-publish"})
    acts = pub(q, 0, ["a", "b", "c"])
    assert [e.publish_id for e in ev(acts, PublishAccepted)] == ["p-a", "p-b"]
    (r,) = ev(acts, PublishRejected)
    assert r.publish_id == "p-c" and r.channel == A and "x-max-length 2" in r.reason
    assert [m.msg_id for m in q.bq.peek(5)] == ["a", "b"]
    q.consume(1, A, "t", prefetch=3)  # a, b; room for one more delivery
    # checked message by message: d goes straight to the consumer, e and f fit, g does not
    acts = pub(q, 2, ["d", "e", "f", "g"])
    assert [m for _, _, m, _ in delivered(acts)] == ["d"]
    assert [e.publish_id for e in ev(acts, PublishRejected)] == ["p-g"]
    # requeue may exceed the limit: nothing is dropped under reject-publish
    assert [m.msg_id for m in q.bq.peek(5)] == ["e", "f"]
    q.cancel(3, A, "t")
    acts = q.reject(3, A, offsets(q, ["a", "b"]))
    assert ev(acts) == [] and [m.msg_id for m in q.bq.peek(5)] == ["a", "b", "e", "f"]
    qb = make({"x-max-length-bytes": 5, "x-overflow": "reject-publish"})
    acts = qb.publish_many(0, [Publish(A, 1, "a", b"123"), Publish(A, 2, "b", b"123"), Publish(A, 3, "c", b"12")])
    assert [e.publish_id for e in ev(acts, PublishRejected)] == [2] and qb.bq.ready_count == 2


# ------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    "args, match",
    [
        ({"x-message-ttl": -1}, "'x-message-ttl'.*value_negative"),
        ({"x-message-ttl": "100"}, "'x-message-ttl'.*unacceptable type"),
        ({"x-message-ttl": 2**32}, "'x-message-ttl'.*value_too_large"),
        ({"x-message-ttl": True}, "'x-message-ttl'.*unacceptable type"),
        ({"x-expires": 0}, "'x-expires'.*value_zero"),
        ({"x-expires": -5}, "'x-expires'.*value_negative"),
        ({"x-max-length": -1}, "'x-max-length'.*value_negative"),
        ({"x-max-length-bytes": 1.5}, "'x-max-length-bytes'.*unacceptable type"),
        ({"x-overflow": "drop-tail"}, "'x-overflow'.*invalid_overflow"),
        ({"x-dead-letter-routing-key": "k"}, "'x-dead-letter-routing-key'.*together with x-dead-letter-exchange"),
        ({"x-dead-letter-exchange": 5}, "'x-dead-letter-exchange'.*expected a string"),
        ({"x-max-priority": 256}, "'x-max-priority'.*out of range"),
        ({"x-max-priority": "10"}, "'x-max-priority'.*unacceptable type"),
        ({"x-queue-type": "stream"}, "'x-queue-type'.*classic' and 'quorum"),
        ({"x-single-active-consumer": True}, "'x-single-active-consumer'"),
        ({"x-ha-deliver-mode": "sync"}, "'x-ha-deliver-mode'.*'sync'.*immediate, replicated"),
        ({"x-ha-deliver-mode": 1}, "'x-ha-deliver-mode'.*expected one of immediate, replicated"),
    ],
)
def test_queue_arguments_validated_with_rabbitmq_rules(args, match):
    with pytest.raises(PreconditionFailed, match=match) as ei:
        make(args)
    assert ei.value.reply_code == 406 and "queue 'q'" in str(ei.value)


def test_valid_arguments_accepted():
    q = make(
        {
            "x-message-ttl": 0,
            "x-max-length": 0,
            "x-max-length-bytes": 0,
            "x-overflow": b"reject-publish",
            "x-ha-deliver-mode": b"replicated",
            "x-queue-type": "classic",
            "x-expires": 1,
            "x-custom": [1, 2],
        }
    )
    assert q.arguments["x-overflow"] == "reject-publish" and q.arguments["x-custom"] == [1, 2]
    assert q.arguments["x-ha-deliver-mode"] == "replicated"
    assert ev(q.publish(0, A, 1, "a", b""), PublishRejected)  # max-length 0 with reject-publish
    assert make({"x-overflow": "reject-publish-dlx"}).arguments["x-overflow"] == "reject-publish-dlx"
    with pytest.raises(TypeError, match="arguments"):
        make(["x-message-ttl"])


# ------------------------------------------------------ purge and delete


def test_purge_keeps_unacked():
    q = make({"x-message-ttl": 1000})
    pub(q, 0, ["a", "b", "c"])
    q.consume(0, A, "t", prefetch=1)
    n, acts = q.purge(0.5)
    assert n == 2 and timers(acts, TTL_TIMER) == [CancelTimer(TTL_TIMER)]
    assert q.bq.ready_count == 0 and q.unacked_by(A) == offsets(q, ["a"])
    check_counts(q)
    acts = q.reject(0.6, A, offsets(q, ["a"]))
    assert delivered(acts) == [(A, "t", "a", True)]


def test_delete_conditions_and_notifications():
    q = make()
    pub(q, 0, ["a", "b"])
    q.consume(0, A, "t", prefetch=1)
    with pytest.raises(PreconditionFailed, match="'q' in use") as ei:
        q.delete(1, if_unused=True)
    assert ei.value.reply_code == 406
    with pytest.raises(PreconditionFailed, match="'q' not empty"):
        q.delete(1, if_empty=True)
    assert not q.deleted
    n, acts = q.delete(1)
    assert n == 1
    assert ev(acts) == [ConsumerCancelled(A, "t", "queue-deleted"), QueueDeleted("q", "deleted", 1)]
    for call in (
        lambda: q.ack(2, A, [0]),
        lambda: q.get(2, A, 1),
        lambda: q.consume(2, A, "x"),
        lambda: q.purge(2),
        lambda: q.delete(2),
        lambda: q.promote(2),
    ):
        with pytest.raises(NotFound, match="'q' was deleted") as ei:
            call()
        assert ei.value.reply_code == 404
    assert q.info()["state"] == "deleted"


# --------------------------------------------------------------- promotion


def test_promote_requeues_unacked_and_cancels_ha_failover_consumers(tmp_path):
    """A mirror's replica: the old master delivered a..c; the new master
    requeues them, cancels the consumer that asked for it, serves the rest."""
    bq = BackingQueue(tmp_path, fsync=False)
    old = AMQQueue("q", bq, durable=True)
    pub(old, 0, ["a", "b", "c", "d"])
    old.consume(0, A, "stay", prefetch=2)
    old.consume(0, B, "leave", arguments={"x-cancel-on-ha-failover": True}, prefetch=1)
    old.ack(0, A, offsets(old, ["a"]))
    table = old.consumers
    assert [(c.consumer_tag, c.cancel_on_ha_failover) for c in table] == [("stay", False), ("leave", True)]
    bq.flush()
    bq.close()
    bq = BackingQueue(tmp_path, fsync=False)
    new = AMQQueue("q", bq, durable=True, consumers=table)
    assert new.bq.unacked_count == 3 and new.consumers == table
    assert new.ack(1, A, offsets(new, ["b"])) == []  # orphans: nobody holds them until promotion
    acts = new.promote(1)
    assert ev(acts, ConsumerCancelled) == [ConsumerCancelled(B, "leave", "ha-failover")]
    assert delivered(acts) == [(A, "stay", "b", True), (A, "stay", "c", True)]
    assert [c.consumer_tag for c in new.consumers] == ["stay"]
    assert [m.msg_id for m in new.bq.peek(5)] == ["d"]
    # a late ack from the old delivery of c on channel B must not touch anything
    assert new.ack(2, B, offsets(new, ["c"])) == [] and new.unacked_by(A) == offsets(new, ["b", "c"])
    check_counts(new)
    bq.close()


def test_promote_orders_requeued_before_ready_and_auto_delete_survives_failover_cancel():
    bq = mem_bq()
    old = AMQQueue("q", bq, durable=False, auto_delete=True)
    pub(old, 0, ["a", "b", "c"])
    old.get(0, A, "r")  # a unacked by A
    new = AMQQueue(
        "q",
        bq,
        durable=False,
        auto_delete=True,
        consumers=[Consumer(B, "t", arguments={"x-cancel-on-ha-failover": True})],
    )
    acts = new.promote(1)
    assert ev(acts, ConsumerCancelled) and not new.deleted  # the client re-consumes
    assert [(m.msg_id, m.redelivered) for m in new.bq.peek(3)] == [("a", True), ("b", False), ("c", False)]


def test_constructor_checks_the_consumer_table():
    with pytest.raises(NotAllowed):
        make(consumers=[Consumer(A, "t"), Consumer(A, "t")])
    with pytest.raises(AccessRefused):
        make(consumers=[Consumer(A, "t"), Consumer(B, "u", exclusive=True)])
    with pytest.raises(TypeError, match="Consumer"):
        make(consumers=[("a", "t")])
    with pytest.raises(ValueError, match="durable queue 'q' needs a durable BackingQueue"):
        make(durable=True)
    with pytest.raises(TypeError, match="durable"):
        make(durable=1)


# -------------------------------------------------------- durability, input


def test_crash_loses_nothing_flushed(tmp_path):
    bq = BackingQueue(tmp_path, fsync=False)
    q = AMQQueue("q", bq, durable=True)
    pub(q, 0, [f"m{i}" for i in range(10)])
    q.consume(0, A, "t", prefetch=4)  # m0..m3
    q.ack(0, A, offsets(q, ["m0", "m1"]))  # m4, m5 delivered
    bq.flush()
    q.ack(1, A, offsets(q, ["m2"]))  # not flushed: lost in the crash, as is m6's delivery
    pub(q, 1, ["late"])
    bq.close(flush=False)
    bq = BackingQueue(tmp_path, fsync=False)
    q = AMQQueue("q", bq, durable=True)
    q.promote(2)
    assert [(m.msg_id, m.redelivered) for m in bq.peek(20)] == [(f"m{i}", True) for i in range(2, 6)] + [
        (f"m{i}", False) for i in range(6, 10)
    ]
    check_counts(q)
    bq.close()


def test_bad_publish_input_changes_nothing():
    q = make()
    q.publish(0, A, 1, "a", b"x")
    nxt = q.bq.log.next_offset
    for items, exc, match in (
        ([Publish(A, 2, "b", "text")], TypeError, "body must be bytes"),
        ([Publish(A, 2, 5, b"")], TypeError, "msg_id"),
        ([Publish(A, 2, "b", b"", [])], TypeError, "properties"),
        ([Publish(A, 2, "b", b"", None, 1)], TypeError, "persistent"),
        ([Publish(A, 2, "b", b""), Publish(A, 3, "b", b"")], PreconditionFailed, "repeats"),
        ([Publish(A, 2, "c", b""), Publish(A, 3, "a", b"")], PreconditionFailed, "already in queue 'q'"),
        ([("too", "short")], TypeError, "publish item 0"),
    ):
        with pytest.raises(exc, match=match):
            q.publish_many(1, items)
    assert q.bq.log.next_offset == nxt
    with pytest.raises(ValueError, match="no timer"):
        q.timer(0, "bogus")
    q.publish(2, A, 2, "b", bytearray(b"ok"))
    assert q.bq.get("b").body == b"ok"


def test_expired_message_behind_the_head_is_dropped_when_it_reaches_the_head():
    q = make()
    pub(q, 0, ["long"], props={"expiration": "5000"})
    pub(q, 0, ["short"], props={"expiration": "1000"})
    pub(q, 0, ["none"])
    short = q.bq.offset_of("short")
    acts = q.consume(2, A, "t", no_ack=True)
    assert delivered(acts) == [(A, "t", "long", False), (A, "t", "none", False)]
    assert ev(acts, MessagesDropped) == [MessagesDropped((short,), "expired")]


# ------------------------------------------------------------ dead-lettering


def _dead(acts):
    return [(m.msg_id, reason) for e in ev(acts, DeadLettered) for _seq, m, reason in e.items]


def test_rejected_expired_and_maxlen_messages_are_dead_lettered_not_dropped():
    q = make({"x-dead-letter-exchange": "dlx", "x-max-length": 2, "x-message-ttl": 1000})
    acts = pub(q, 0, ["a", "b", "c"])  # a is dropped for length: to the dead-letter exchange
    assert _dead(acts) == [("a", "maxlen")] and ev(acts, MessagesDropped) == []
    acts = q.get(0.1, A, 1)
    (got,) = ev(acts, GetOk)
    acts = q.reject(0.2, A, [got.offset], requeue=False)
    assert _dead(acts) == [("b", "rejected")]
    acts = q.timer(1.0 + 1e-6, TTL_TIMER)
    assert _dead(acts) == [("c", "expired")]
    bq = q.bq
    assert bq.message_count == 0 and bq.dead_letter_count == 3
    check_counts(q)
    seqs = [seq for seq, _o, _r in bq.dead_lettering()]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3  # in the order they died
    # a promotion (requeue of every unacked message) leaves them alone
    bq.requeue_unacked()
    assert bq.ready_count == 0 and [m.msg_id for _s, m, _r in q.dead_lettering()] == ["a", "b", "c"]
    q.dead_lettered([bq.dead_lettering()[0][1], 10_000])  # an unknown offset is ignored
    assert [m.msg_id for _s, m, _r in q.dead_lettering()] == ["b", "c"] and bq.dead_letter_count == 2


def test_without_a_dead_letter_exchange_messages_are_dropped_and_a_policy_can_set_one():
    q = make({"x-max-length": 1})
    assert [e.reason for e in ev(pub(q, 0, ["a", "b"]), MessagesDropped)] == ["maxlen"]
    q.policy_dead_letter = ("pol-x", "rk")
    assert q.dead_letter_target == ("pol-x", "rk")
    assert _dead(pub(q, 0, ["c"])) == [("b", "maxlen")]
    q2 = make({"x-dead-letter-exchange": "arg-x"})
    q2.policy_dead_letter = ("pol-x", None)
    assert q2.dead_letter_target == ("arg-x", None)  # the argument wins over the policy


def test_reject_publish_dlx_nacks_and_dead_letters_the_refused_message():
    q = make({"x-max-length": 2, "x-overflow": "reject-publish-dlx", "x-dead-letter-exchange": "dlx"})
    bq = q.bq
    records: list = []
    bq.on_append = lambda offset, rtype, body: records.append((offset, rtype, body))
    acts = pub(q, 0, ["a", "b", "c"], props={"headers": {"k": 1}, "expiration": "60000"}, body=b"12345")
    assert [e.publish_id for e in ev(acts, PublishAccepted)] == ["p-a", "p-b"]
    (r,) = ev(acts, PublishRejected)
    assert r.publish_id == "p-c" and "x-max-length 2" in r.reason
    assert _dead(acts) == [("c", "maxlen")] and ev(acts, MessagesDropped) == []
    kinds = [type(e) for e in ev(acts)]
    assert kinds.index(PublishRejected) < kinds.index(DeadLettered)  # nacked, and dead-lettered with it
    (dl,) = ev(acts, DeadLettered)
    ((_seq, m, _reason),) = dl.items
    # the publisher's message, as published: properties untouched (no deadline of ours in them)
    assert (m.body, m.properties) == (b"12345", {"headers": {"k": 1}, "expiration": "60000"})
    # it was never ready: not counted, not in the ready bytes, not delivered later
    assert [x.msg_id for x in bq.peek(5)] == ["a", "b"] and bq.dead_letter_count == 1
    assert q.info()["message_bytes_ready"] == 10 and q.info()["messages"] == 2
    check_counts(q)
    c_off = bq.offset_of("c")
    assert [(rt, body) for _o, rt, body in records[-3:]] == [
        (Op.PUBLISH, ["c", b"12345", {"headers": {"k": 1}, "expiration": "60000"}, True]),
        (Op.DELIVER, [[c_off], True]),
        (Op.DEAD_LETTER, [[c_off], "maxlen"]),
    ]
    # a mirror applying the same records holds the same dead letter
    mirror = mem_bq()
    for offset, rtype, body in records:
        mirror.apply((rtype, body), offset)
    assert mirror.dead_lettering() == bq.dead_lettering() and mirror.ready_offsets() == bq.ready_offsets()
    # a consumer gets a and b only; the router's answer removes c
    assert [d[2] for d in delivered(q.consume(1, A, "t", prefetch=5))] == ["a", "b"]
    q.dead_lettered([c_off])
    assert bq.dead_letter_count == 0 and bq.message_count == 2
    check_counts(q)


def test_reject_publish_dlx_by_bytes_and_in_a_priority_queue():
    qb = make({"x-max-length-bytes": 5, "x-overflow": "reject-publish-dlx", "x-dead-letter-exchange": "dlx"})
    acts = qb.publish_many(0, [Publish(A, 1, "a", b"123"), Publish(A, 2, "b", b"123"), Publish(A, 3, "c", b"12")])
    assert [e.publish_id for e in ev(acts, PublishRejected)] == [2] and _dead(acts) == [("b", "maxlen")]
    assert [m.msg_id for m in qb.bq.peek(5)] == ["a", "c"]
    check_counts(qb)
    # a refused message of a higher priority than the backlog is not delivered ahead of it: never delivered
    qp = AMQQueue(
        "qp",
        BackingQueue(None, durable=False, max_priority=5),
        durable=False,
        arguments={
            "x-max-priority": 5,
            "x-max-length": 1,
            "x-overflow": "reject-publish-dlx",
            "x-dead-letter-exchange": "dlx",
        },
    )
    pub(qp, 0, ["low"])
    acts = pub(qp, 0, ["high"], props={PRIORITY_KEY: 5})
    assert _dead(acts) == [("high", "maxlen")]
    assert [d[2] for d in delivered(qp.consume(1, A, "t", prefetch=5))] == ["low"]
    check_counts(qp)


def test_reject_publish_dlx_without_a_dead_letter_exchange_is_reject_publish():
    q = make({"x-max-length": 1, "x-overflow": "reject-publish-dlx"})
    pub(q, 0, ["a"])
    before = q.bq.log.next_offset
    acts = pub(q, 0, ["b"])
    assert [e.publish_id for e in ev(acts, PublishRejected)] == ["p-b"] and _dead(acts) == []
    assert q.bq.log.next_offset == before  # nothing written
    q.policy_dead_letter = ("pol-x", None)  # a policy's dead-letter exchange counts too
    assert _dead(pub(q, 0, ["c"])) == [("c", "maxlen")]


def test_reject_publish_dlx_dead_letters_survive_a_reopened_store(tmp_path):
    bq = BackingQueue(tmp_path / "s", durable=True)
    q = AMQQueue(
        "q",
        bq,
        durable=True,
        arguments={"x-max-length": 0, "x-overflow": "reject-publish-dlx", "x-dead-letter-exchange": "dlx"},
    )
    assert _dead(pub(q, 0, ["a", "b"])) == [("a", "maxlen"), ("b", "maxlen")]
    bq.flush()
    before = bq.dead_lettering()
    bq.close()
    again = BackingQueue(tmp_path / "s", durable=True)
    assert again.dead_lettering() == before and again.message_count == 0
    q2 = AMQQueue(
        "q",
        again,
        durable=True,
        arguments={"x-max-length": 0, "x-overflow": "reject-publish-dlx", "x-dead-letter-exchange": "dlx"},
    )
    assert [(m.msg_id, why) for _s, m, why in q2.dead_lettering()] == [("a", "maxlen"), ("b", "maxlen")]
    again.close()


def test_dead_lettering_survives_a_reopened_store(tmp_path):
    bq = BackingQueue(tmp_path / "s", durable=True)
    q = AMQQueue("q", bq, durable=True, arguments={"x-dead-letter-exchange": "dlx"})
    pub(q, 0, ["a", "b"])
    (got,) = ev(q.get(0.1, A, 1), GetOk)
    q.reject(0.2, A, [got.offset], requeue=False)
    before = bq.dead_lettering()
    bq.close()
    again = BackingQueue(tmp_path / "s", durable=True)
    assert again.dead_lettering() == before and again.message_count == 1 and again.unacked_count == 0
    with pytest.raises(Exception, match="being dead-lettered"):
        again.requeue([before[0][1]])
    again.ack([before[0][1]])
    assert again.dead_letter_count == 0
    again.close()
