"""Unit tests of the quorum queue's state machine (mirrorq.quorum.machine):
each command and its edges, snapshots, and refusal of malformed input."""

from __future__ import annotations

import msgpack
import pytest

from mirrorq.queues.semantics import LINK_CREDIT_BYTES, LOOKAHEAD_BYTES
from mirrorq.quorum.machine import (
    MAX_REJECTED_RANGES,
    MSG_ID_SHIFT,
    BadCommand,
    Checkout,
    CheckoutOk,
    CheckoutRefused,
    Confirm,
    ConsumersDown,
    Credit,
    Deliver,
    Dequeue,
    Discard,
    Down,
    Dropped,
    Enqueue,
    GetResult,
    Purge,
    Purged,
    QuorumQueueMachine,
    Reject,
    Release,
    Return,
    Settle,
    Settled,
    decode_entry,
    encode_entry,
)

P = ("front", 1)  # a publisher (channel id)
P2 = ("front", 2)
CH = ("front", 7)  # a consumer's channel
CH2 = ("other", 8)


class Q:
    """A machine plus an index counter: each ``run`` is one entry."""

    def __init__(self, **arguments):
        self.m = QuorumQueueMachine(arguments)
        self.i = 0

    def run(self, now, *commands):
        self.i += 1
        return self.m.apply(self.i, now, commands)

    def pub(self, now, *seqs, publisher=P, props=None):
        return self.run(now, *(Enqueue(publisher, s, f"m{s}".encode(), dict(props or {})) for s in seqs))


def of(effects, kind):
    return [e for e in effects if type(e) is kind]


def delivered(effects):
    return [(e.consumer, e.message.body, e.message.delivery_count) for e in of(effects, Deliver)]


def mid(index, k=0):
    return index << MSG_ID_SHIFT | k


def dropped(effects, reason):
    return [m.body for e in of(effects, Dropped) if e.reason == reason for m in e.messages]


# ---- enqueue ----------------------------------------------------------------------------
def test_enqueue_confirms_and_ids_follow_the_log():
    q = Q()
    eff = q.pub(1.0, 1, 2, 3)
    assert of(eff, Confirm) == [Confirm(P, 1), Confirm(P, 2), Confirm(P, 3)]
    assert list(q.m.ready) == [mid(1, 0), mid(1, 1), mid(1, 2)]
    q.pub(1.0, 4)
    assert list(q.m.ready)[-1] == mid(2, 0)
    assert q.m.hwm(P) == 4 and q.m.ready_count == 4 and q.m.ready_bytes == 8


def test_resend_is_confirmed_not_stored_twice():
    q = Q()
    q.pub(1.0, 1, 2)
    eff = q.pub(2.0, 1, 2, 3)  # a resend after a leader change, plus one new
    assert of(eff, Confirm) == [Confirm(P, 1), Confirm(P, 2), Confirm(P, 3)]
    assert [q.m.messages[i].body for i in q.m.ready] == [b"m1", b"m2", b"m3"]


def test_out_of_sequence_publish_is_nacked_and_not_stored():
    q = Q()
    q.pub(1.0, 1)
    eff = q.pub(1.0, 3)
    assert of(eff, Reject) == [Reject(P, 3, "out-of-sequence: expected seq 2")]
    assert q.m.hwm(P) == 1 and q.m.ready_count == 1
    eff = q.pub(1.0, 2, 3)
    assert of(eff, Confirm) == [Confirm(P, 2), Confirm(P, 3)]


def test_publishers_are_independent():
    q = Q()
    q.pub(1.0, 1, publisher=P)
    eff = q.pub(1.0, 1, publisher=P2)
    assert of(eff, Confirm) == [Confirm(P2, 1)] and q.m.ready_count == 2


# ---- checkout, settle, credit ------------------------------------------------------------------
def test_checkout_prefetch_credit_and_settle():
    q = Q()
    q.pub(1.0, 1, 2, 3)
    eff = q.run(1.0, Checkout((CH, "a"), prefetch=2, request_id=5))
    assert of(eff, CheckoutOk) == [CheckoutOk((CH, "a"), 5)]
    assert delivered(eff) == [((CH, "a"), b"m1", 0), ((CH, "a"), b"m2", 0)]
    assert q.m.checked_out_count == 2 and q.m.ready_count == 1
    eff = q.run(1.0, Settle(CH, (mid(1, 0),)))
    assert of(eff, Settled) == [Settled(CH, (mid(1, 0),))]
    assert delivered(eff) == [((CH, "a"), b"m3", 0)]
    assert mid(1, 0) not in q.m.messages


def test_round_robin_between_consumers():
    q = Q()
    q.run(1.0, Checkout((CH, "a")), Checkout((CH2, "b")))
    eff = q.pub(1.0, 1, 2, 3, 4)
    assert [c for c, _, _ in delivered(eff)] == [(CH, "a"), (CH2, "b"), (CH, "a"), (CH2, "b")]


def test_settle_from_another_channel_or_of_unheld_ids_is_ignored():
    q = Q()
    q.pub(1.0, 1)
    q.run(1.0, Checkout((CH, "a"), prefetch=1))
    eff = q.run(1.0, Settle(CH2, (mid(1),)), Settle(CH, (mid(9), 12345)))
    assert of(eff, Settled) == [] and q.m.checked_out_count == 1


def test_no_ack_consumer_settles_at_delivery():
    q = Q()
    q.pub(1.0, 1, 2)
    eff = q.run(1.0, Checkout((CH, "a"), prefetch=1, no_ack=True))
    assert [e.settled for e in of(eff, Deliver)] == [True, True]  # no_ack ignores prefetch
    assert q.m.message_count == 0


def test_cancel_keeps_checked_out_messages_until_settled():
    q = Q()
    q.pub(1.0, 1, 2)
    q.run(1.0, Checkout((CH, "a"), prefetch=1))
    eff = q.run(1.0, Checkout((CH, "a"), cancel=True))
    assert delivered(eff) == [] and q.m.checked_out_count == 1 and (CH, "a") in q.m.consumers
    eff = q.pub(1.0, 3)
    assert delivered(eff) == []  # cancelled: no more deliveries
    q.run(1.0, Settle(CH, (mid(1),)))
    assert (CH, "a") not in q.m.consumers  # gone once it holds nothing
    eff = q.run(1.0, Checkout((CH, "a"), prefetch=5))  # consume again
    assert [b for _, b, _ in delivered(eff)] == [b"m2", b"m3"]


def test_checkout_again_updates_prefetch():
    q = Q()
    q.pub(1.0, 1, 2, 3)
    q.run(1.0, Checkout((CH, "a"), prefetch=1))
    eff = q.run(1.0, Checkout((CH, "a"), prefetch=3))
    assert [b for _, b, _ in delivered(eff)] == [b"m2", b"m3"]


# ---- return, discard, delivery limit ------------------------------------------------------------
def test_return_goes_to_the_head_with_delivery_count():
    q = Q()
    q.pub(1.0, 1, 2, 3)
    q.run(1.0, Checkout((CH, "a"), prefetch=2))  # holds m1, m2
    q.run(1.0, Checkout((CH, "a"), cancel=True))
    q.run(1.0, Return(CH, (mid(1, 1), mid(1, 0))))  # m2 then m1
    assert list(q.m.returns) == [mid(1, 1), mid(1, 0)]
    eff = q.run(1.0, Checkout((CH2, "b")))
    assert delivered(eff) == [((CH2, "b"), b"m2", 1), ((CH2, "b"), b"m1", 1), ((CH2, "b"), b"m3", 0)]
    assert [e.message.redelivered for e in of(eff, Deliver)] == [True, True, False]


def test_lookahead_is_granted_only_while_every_consumer_is_at_its_prefetch_and_the_backlog_covers_it():
    q = Q()
    q.pub(1.0, *range(1, 11))
    eff = q.run(1.0, Checkout((CH, "a"), 2, lookahead=3))
    # a lone consumer at its prefetch with 8 ready (>= 3): prefetch 2 + lookahead 3
    assert [b for _, b, _ in delivered(eff)] == [b"m1", b"m2", b"m3", b"m4", b"m5"]
    eff = q.run(1.0, Checkout((CH2, "b"), 2, lookahead=3))
    assert [b for _, b, _ in delivered(eff)] == [b"m6", b"m7"]  # b below its prefetch: no lookahead for anyone
    eff = q.run(1.0, Settle(CH, (mid(1, 0),)))
    assert delivered(eff) == []  # 3 ready < 3 + 3 wanted: a holds 4 >= 2 and gets nothing more
    eff = q.run(1.0, Settle(CH, (mid(1, 1), mid(1, 2), mid(1, 3))))
    assert [(c, b) for c, b, _ in delivered(eff)] == [((CH, "a"), b"m8")]  # back to a plain prefetch of 2


def test_lookahead_stops_at_lookahead_bytes():
    q = Q()
    mib = b"b" * (1 << 20)
    q.run(1.0, *(Enqueue(P, s, mib) for s in range(1, 41)))
    eff = q.run(1.0, Checkout((CH, "a"), 2, lookahead=30))
    # its prefetch, then lookahead only while it holds under LOOKAHEAD_BYTES (4 MiB)
    assert len(of(eff, Deliver)) == LOOKAHEAD_BYTES >> 20
    eff = q.run(1.0, Settle(CH, (mid(1, 0), mid(1, 1))))
    assert len(of(eff, Deliver)) == 2 and q.m.consumers[(CH, "a")].held_bytes == LOOKAHEAD_BYTES


def test_lookahead_needs_a_prefetch_and_acks():
    q = Q()
    q.pub(1.0, *range(1, 6))
    eff = q.run(1.0, Checkout((CH, "a"), 0, lookahead=3), Checkout((CH2, "n"), 1, no_ack=True, lookahead=3))
    assert len(delivered(eff)) == 5  # prefetch 0 and no_ack have no limit to look ahead of
    assert q.m.consumers[(CH2, "n")].lookahead == 0 and q.m.consumers[(CH, "a")].lookahead == 0


def test_release_requeues_at_the_head_without_counting_a_delivery():
    q = Q(**{"x-delivery-limit": 0})
    q.pub(1.0, 1, 2, 3)
    eff = q.run(1.0, Checkout((CH, "a"), 2))
    assert [b for _, b, _ in delivered(eff)] == [b"m1", b"m2"]
    q.run(1.0, Checkout((CH, "a"), cancel=True))
    eff = q.run(1.0, Release(CH, (mid(1, 1),)), Release(CH2, (mid(1, 0),)))  # another channel's: ignored
    assert dropped(eff, "delivery_limit") == []  # not counted, so a limit of 0 does not drop it
    eff = q.run(1.0, Checkout((CH2, "b"), 5))
    got = [e.message for e in of(eff, Deliver)]
    assert [m.body for m in got] == [b"m2", b"m3"]
    assert got[0].delivery_count == 0 and got[0].redelivered  # released: flagged, not counted
    assert not got[1].redelivered


def test_snapshot_carries_lookahead_and_released_flags_and_reads_older_rows():
    q = Q()
    q.pub(1.0, 1, 2, 3, 4)
    q.run(1.0, Checkout((CH, "a"), 1, lookahead=2))
    q.run(1.0, Release(CH, (mid(1, 0),)))
    snap = msgpack.unpackb(msgpack.packb(q.m.snapshot(), use_bin_type=True), raw=False)
    back = QuorumQueueMachine()
    back.restore(snap)
    assert back.snapshot() == q.m.snapshot()
    assert back.consumers[(CH, "a")].lookahead == 2 and back.messages[mid(1, 0)].acquired
    old = dict(snap, messages=[row[:5] for row in snap["messages"]], consumers=[row[:6] for row in snap["consumers"]])
    back.restore(old)  # written before the two fields existed
    assert back.consumers[(CH, "a")].lookahead == 0 and not back.messages[mid(1, 0)].acquired
    assert decode_entry([1.0, [["checkout", [list(CH), "a"], 2, False, False, None]]])[1] == [Checkout((CH, "a"), 2)]


def test_discard_drops_with_reason_rejected():
    q = Q()
    q.pub(1.0, 1)
    q.run(1.0, Checkout((CH, "a")))
    eff = q.run(1.0, Discard(CH, (mid(1),)))
    assert dropped(eff, "rejected") == [b"m1"] and q.m.message_count == 0


def test_delivery_limit_drops_after_limit_returns():
    q = Q(**{"x-delivery-limit": 1})
    q.pub(1.0, 1)
    eff = q.run(1.0, Checkout((CH, "a"), prefetch=1))
    assert delivered(eff) == [((CH, "a"), b"m1", 0)]
    eff = q.run(1.0, Return(CH, (mid(1),)))
    assert delivered(eff) == [((CH, "a"), b"m1", 1)]  # count 1 == limit: still delivered
    eff = q.run(1.0, Return(CH, (mid(1),)))
    assert delivered(eff) == []
    [d] = of(eff, Dropped)
    assert d.reason == "delivery_limit" and d.messages[0].delivery_count == 2
    assert q.m.message_count == 0


def test_delivery_limit_counts_down_returns_too():
    q = Q(**{"x-delivery-limit": 0})
    q.pub(1.0, 1)
    q.run(1.0, Checkout((CH, "a")))
    eff = q.run(1.0, Down(None))
    assert dropped(eff, "delivery_limit") == [b"m1"]


def test_dead_letter_sequence_numbers_count_every_drop_but_purge_and_survive_a_snapshot():
    q = Q(**{"x-max-length": 1})
    eff = q.pub(1.0, 1, 2, 3)  # m1, m2 dropped for length
    assert [(d.reason, d.seqs) for d in of(eff, Dropped)] == [("maxlen", (1,)), ("maxlen", (2,))]
    eff = q.run(1.0, Purge(CH2, 1))
    assert [(d.reason, d.seqs) for d in of(eff, Dropped)] == [("purged", ())]  # not dead-lettered: no number
    q.pub(1.0, 4)
    [d] = of(q.run(1.0, Checkout((CH, "a"), prefetch=1)), Deliver)
    eff = q.run(1.0, Discard(CH, (d.message.msg_id,)))
    assert [(d.reason, d.seqs) for d in of(eff, Dropped)] == [("rejected", (3,))]
    r = QuorumQueueMachine()
    r.restore(msgpack.unpackb(msgpack.packb(q.m.snapshot()), raw=False, strict_map_key=False))
    for m in (q.m, r):  # the restored copy numbers on where the original does
        eff = m.apply(q.i + 1, 1.0, [Enqueue(P, s, b"m") for s in (5, 6, 7)])  # m5 delivered, m6 dropped
        assert [(d.reason, d.seqs) for d in of(eff, Dropped)] == [("maxlen", (4,))]
    with pytest.raises(BadCommand, match="dead_lettered"):
        QuorumQueueMachine().restore(dict(q.m.snapshot(), dead_lettered=-1))


# ---- max length --------------------------------------------------------------------------------
def test_max_length_drop_head():
    q = Q(**{"x-max-length": 2})
    eff = q.pub(1.0, 1, 2, 3, 4)
    assert dropped(eff, "maxlen") == [b"m1", b"m2"]
    assert len(of(eff, Confirm)) == 4  # dropped publishes are confirmed too
    assert [q.m.messages[i].body for i in q.m.ready] == [b"m3", b"m4"]


@pytest.mark.parametrize("argument, reason", [("x-max-length", "maxlen"), ("x-message-ttl", "expired")])
def test_a_zero_limit_still_offers_the_publish_to_a_consumer_first(argument, reason):
    q = Q(**{argument: 0})
    q.run(1.0, Checkout((CH, "a"), prefetch=1))
    eff = q.pub(1.0, 1, 2)
    assert delivered(eff) == [((CH, "a"), b"m1", 0)]  # taken at once
    assert dropped(eff, reason) == [b"m2"]  # nobody could take it


def test_max_length_bytes_drop_head():
    q = Q(**{"x-max-length-bytes": 5})
    eff = q.pub(1.0, 1, 2, 3)  # 2 bytes each
    assert dropped(eff, "maxlen") == [b"m1"] and q.m.ready_bytes == 4


def test_reject_publish_nacks_and_remembers_the_nack():
    q = Q(**{"x-max-length": 2, "x-overflow": "reject-publish"})
    eff = q.pub(1.0, 1, 2, 3)
    assert of(eff, Confirm) == [Confirm(P, 1), Confirm(P, 2)]
    assert of(eff, Reject) == [Reject(P, 3, "x-overflow reject-publish: queue is full")]
    assert q.m.hwm(P) == 3 and q.m.ready_count == 2
    eff = q.pub(2.0, 3)  # a resend of the nacked publish is nacked again
    assert [type(e) for e in eff] == [Reject]
    q.run(2.0, Dequeue(CH, 1, no_ack=True))
    eff = q.pub(2.0, 4)
    assert of(eff, Confirm) == [Confirm(P, 4)]


def test_rejected_runs_are_bounded():
    q = Q(**{"x-max-length": 0, "x-overflow": "reject-publish"})
    q.pub(1.0, *range(1, 200))
    assert q.m.publishers[P].rejected == [[1, 199]]  # consecutive rejections make one run
    q2 = Q(**{"x-max-length": 1, "x-overflow": "reject-publish"})
    n = MAX_REJECTED_RANGES + 5
    for k in range(n):  # accepted, rejected, accepted, rejected...: one run per rejection
        eff = q2.pub(1.0, 2 * k + 1, 2 * k + 2)
        assert [type(e) for e in eff] == [Confirm, Reject]
        q2.run(1.0, Dequeue(CH, k, no_ack=True))
    runs = q2.m.publishers[P].rejected
    assert len(runs) == MAX_REJECTED_RANGES and runs[-1] == [2 * n, 2 * n] and runs[0] == [12, 12]


# ---- ttl ---------------------------------------------------------------------------------------
def test_message_ttl_expires_at_the_head_with_the_entry_time():
    q = Q(**{"x-message-ttl": 1000})
    q.pub(10.0, 1)
    q.pub(10.5, 2)
    assert q.m.next_deadline() == 11.0
    eff = q.run(10.9)  # an empty entry: time passes
    assert dropped(eff, "expired") == []
    eff = q.run(11.0)
    assert dropped(eff, "expired") == [b"m1"]
    assert q.m.next_deadline() == 11.5
    eff = q.run(12.0, Checkout((CH, "a")))
    assert dropped(eff, "expired") == [b"m2"] and delivered(eff) == []


def test_per_message_expiration_takes_the_smaller():
    q = Q(**{"x-message-ttl": 5000})
    q.pub(0.0, 1, props={"expiration": "200"})
    assert q.m.next_deadline() == pytest.approx(0.2)
    q2 = Q()
    q2.pub(0.0, 1, props={"expiration": "300"})
    assert q2.m.next_deadline() == pytest.approx(0.3)


def test_no_delivery_after_the_deadline_and_clock_never_goes_back():
    q = Q(**{"x-message-ttl": 1000})
    q.pub(10.0, 1)
    q.run(12.0)  # expired
    q.pub(5.0, 2)  # a leader with a slower clock: the machine's clock stays at 12
    assert q.m.clock == 12.0 and q.m.next_deadline() == 13.0
    eff = q.run(13.5, Checkout((CH, "a")))
    assert delivered(eff) == [] and dropped(eff, "expired") == [b"m2"]


def test_returned_message_keeps_its_deadline():
    q = Q(**{"x-message-ttl": 1000})
    q.pub(0.0, 1)
    q.run(0.5, Checkout((CH, "a")))
    eff = q.run(2.0, Return(CH, (mid(1),)))
    assert dropped(eff, "expired") == [b"m1"] and delivered(eff) == []


# ---- purge, down, dequeue -------------------------------------------------------------------
def test_purge_removes_ready_and_keeps_checked_out():
    q = Q()
    q.pub(1.0, 1, 2, 3)
    q.run(1.0, Checkout((CH, "a"), prefetch=1))
    eff = q.run(1.0, Purge(CH2, 9))
    assert of(eff, Purged) == [Purged(CH2, 9, 2)]
    assert dropped(eff, "purged") == [b"m2", b"m3"]
    assert q.m.message_count == 1 and q.m.checked_out_count == 1


def test_down_of_a_channel_returns_its_messages_and_closes_it():
    q = Q()
    q.pub(1.0, 1, 2, 3)
    q.run(1.0, Checkout((CH, "a"), prefetch=1), Checkout((CH, "b"), prefetch=1), Dequeue(CH, 1))
    assert q.m.checked_out_count == 3
    eff = q.run(1.0, Down(CH))
    assert of(eff, ConsumersDown) == [ConsumersDown(CH, ((CH, "a"), (CH, "b"), (CH, None)))]
    assert q.m.ready_count == 3 and list(q.m.returns) == [mid(1, 0), mid(1, 1), mid(1, 2)]
    assert all(q.m.messages[i].count == 1 for i in q.m.returns)
    eff = q.run(1.0, Checkout((CH, "c"), request_id=4))  # a late consume of the closed channel
    assert of(eff, CheckoutRefused) == [CheckoutRefused((CH, "c"), 4, "channel closed")]
    assert delivered(eff) == []


def test_down_of_every_consumer_keeps_channels_open():
    q = Q()
    q.pub(1.0, 1)
    q.run(1.0, Checkout((CH, "a")), Checkout((CH2, "b")))
    eff = q.run(2.0, Down(None))
    assert of(eff, ConsumersDown) == [ConsumersDown(None, ((CH, "a"), (CH2, "b")))]
    assert not q.m.consumers and not q.m.rotation
    eff = q.run(2.0, Checkout((CH, "a")))  # re-attach after the leader change
    assert delivered(eff) == [((CH, "a"), b"m1", 1)]


def test_dequeue_acked_then_settled_and_empty_answer():
    q = Q()
    q.pub(1.0, 1, 2)
    eff = q.run(1.0, Dequeue(CH, 3))
    [g] = of(eff, GetResult)
    assert g.message.body == b"m1" and g.remaining == 1 and g.request_id == 3 and not g.settled
    assert q.m.holder[g.message.msg_id] == (CH, None)
    q.run(1.0, Settle(CH, (g.message.msg_id,)))
    assert q.m.message_count == 1 and (CH, None) not in q.m.consumers
    [g] = of(q.run(1.0, Dequeue(CH, 4, no_ack=True)), GetResult)
    assert g.settled and q.m.message_count == 0
    assert of(q.run(1.0, Dequeue(CH, 5)), GetResult) == [GetResult(CH, 5, None, 0)]


# ---- snapshots ------------------------------------------------------------------------------
def busy_queue() -> Q:
    q = Q(**{"x-max-length": 10, "x-delivery-limit": 3, "x-message-ttl": 60000})
    q.pub(1.0, 1, 2, 3, 4, 5)
    q.pub(1.0, 1, publisher=P2)
    q.run(1.5, Checkout((CH, "a"), prefetch=2), Checkout((CH2, "b"), prefetch=1), Dequeue(CH, 1))
    q.run(2.0, Return(CH, (mid(3, 0),)), Checkout((CH2, "b"), cancel=True))
    q.run(2.0, Down(("gone", 1)))
    return q


def test_snapshot_round_trip_through_msgpack_is_equal_and_behaves_the_same():
    q = busy_queue()
    snap = q.m.snapshot()
    raw = msgpack.unpackb(msgpack.packb(snap, use_bin_type=True), raw=False, strict_map_key=False)
    r = QuorumQueueMachine()
    r.restore(raw)
    assert r.snapshot() == snap
    more = [
        Checkout((CH2, "c"), prefetch=3),
        Enqueue(P, 6, b"m6"),
        Return(CH, (mid(3, 1),)),
        Settle(CH2, (mid(3, 2),)),
        Down(CH),
    ]
    a = q.m.apply(q.i + 1, 3.0, more)
    b = r.apply(q.i + 1, 3.0, more)
    assert a == b and r.snapshot() == q.m.snapshot()


def test_snapshot_is_plain_data_not_aliasing_the_state():
    q = busy_queue()
    snap = q.m.snapshot()
    before = msgpack.packb(snap, use_bin_type=True)
    q.pub(5.0, 6, 7)
    q.run(5.0, Down(None))
    assert msgpack.packb(snap, use_bin_type=True) == before


def test_restore_refuses_a_malformed_snapshot():
    snap = busy_queue().m.snapshot()
    with pytest.raises(BadCommand, match="not a quorum queue snapshot"):
        QuorumQueueMachine().restore({"messages": []})
    broken = dict(snap, ready=snap["ready"] + snap["ready"][:1])
    with pytest.raises(BadCommand, match="do not partition"):
        QuorumQueueMachine().restore(broken)
    with pytest.raises(BadCommand, match="malformed"):
        QuorumQueueMachine().restore(dict(snap, messages=[[1, 2]]))


def test_entry_round_trip_through_msgpack():
    cmds = [
        Enqueue(P, 1, b"x", {"expiration": "5"}),
        Checkout((CH, "t"), 3, False, False, 2),
        Dequeue(CH, 1),
        Settle(CH, (1, 2)),
        Return(CH, (3,)),
        Release(CH, (4,)),
        Discard(CH, ()),
        Purge(),
        Purge(CH, 4),
        Down(),
        Down(CH),
        Checkout((CH, "u"), 10, False, False, None, 64),
    ]
    raw = msgpack.unpackb(msgpack.packb(encode_entry(7.5, cmds), use_bin_type=True), raw=False)
    now, back = decode_entry(raw)
    assert now == 7.5 and back == cmds


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Enqueue(("a",), 1, b""), "enqueue.publisher"),
        (lambda: Enqueue(P, 0, b""), "enqueue.seq"),
        (lambda: Enqueue(P, True, b""), "enqueue.seq"),
        (lambda: Enqueue(P, 1, "text"), "enqueue.body must be bytes"),
        (lambda: Enqueue(P, 1, b"", {1: 2}), "enqueue.properties"),
        (lambda: Enqueue(P, 1, b"", {"expiration": "-1"}), "invalid expiration"),
        (lambda: Checkout((CH, 5)), "checkout.consumer"),
        (lambda: Checkout((CH, "a"), prefetch=-1), "checkout.prefetch"),
        (lambda: Checkout((CH, "a"), no_ack=1), "checkout.no_ack"),
        (lambda: Checkout((CH, "a"), request_id="x"), "request_id"),
        (lambda: Checkout((CH, "a"), 2, lookahead=-1), "checkout.lookahead"),
        (lambda: Release(CH, (None,)), "release.msg_ids"),
        (lambda: Dequeue(CH, None), "dequeue.request_id"),
        (lambda: Settle(CH, (1, -2)), "settle.msg_ids"),
        (lambda: Return(CH, "12"), "return.msg_ids"),
        (lambda: Discard(5, ()), "discard.channel"),
        (lambda: Down(("x", "y")), "down.channel"),
        (lambda: decode_entry([1.0, [["frobnicate"]]]), "unknown command 'frobnicate'"),
        (lambda: decode_entry([1.0, [["settle", ["a", 1]]]]), "takes 2 fields"),
        (lambda: decode_entry(["soon", []]), "time must be a number"),
        (lambda: decode_entry({"now": 1}), r"\[now, \[commands\]\]"),
        (lambda: QuorumQueueMachine({"x-max-length": -1}), "x-max-length"),
        (lambda: QuorumQueueMachine({"x-overflow": "drop-tail"}), "x-overflow"),
        (lambda: QuorumQueueMachine({"x-delivery-limit": "3"}), "x-delivery-limit"),
        (lambda: QuorumQueueMachine().apply(1, 0.0, ["enqueue"]), "not a quorum queue command"),
    ],
)
def test_bad_input_raises_a_clear_error(build, match):
    with pytest.raises(BadCommand, match=match):
        build()


def test_entries_must_be_applied_in_index_order():
    m = QuorumQueueMachine()
    m.apply(5, 0.0, [])
    with pytest.raises(ValueError, match="above the last applied index 5"):
        m.apply(5, 0.0, [])
    with pytest.raises(ValueError, match="above the last applied index 5"):
        m.apply(3, 0.0, [])


# ---- link credit and bodies in the log ------------------------------------------------------
@pytest.mark.parametrize("no_ack, prefetch", [(True, 0), (False, 0), (False, 1000)])
def test_every_consumer_stops_at_its_link_credit_and_goes_on_when_credited(no_ack, prefetch):
    q = Q()
    size = 1 << 20
    q.run(0, *(Enqueue(P, s, bytes(size), {}) for s in range(1, 21)))
    out = q.run(1, Checkout((CH, "c"), prefetch, no_ack))
    assert len(of(out, Deliver)) == LINK_CREDIT_BYTES // size  # then nothing until credit comes back
    assert of(q.run(2, Credit(CH2, (("c", LINK_CREDIT_BYTES),))), Deliver) == []  # another channel's tag
    out = q.run(3, Credit(CH, (("c", 3 * size), ("other-tag", 5))))
    assert len(of(out, Deliver)) == 3
    snap = q.m.snapshot()
    again = QuorumQueueMachine()
    again.restore(msgpack.unpackb(msgpack.packb(snap), raw=False, strict_map_key=False))
    assert again.snapshot() == snap and again.consumers[(CH, "c")].link_bytes == LINK_CREDIT_BYTES


def test_a_credit_with_a_bad_grant_is_refused():
    with pytest.raises(BadCommand, match="credit.grants"):
        Credit(CH, (("c", -1),))
    with pytest.raises(BadCommand, match="credit.grants"):
        Credit(CH, ((1, 5),))


def test_a_machine_with_bodies_in_the_log_keeps_sizes_and_names_the_release_index():
    m = QuorumQueueMachine({"x-max-length-bytes": 10}, bodies_in_log=True)
    m.apply(1, 0, [Enqueue(P, 1, b"abcd", {"x": 1})])
    m.apply(2, 0, [Enqueue(P, 2, b"efgh", {})])
    assert m.release_index() == 1 and m.ready_bytes == 8
    assert [(x.body, x.props, x.size) for x in m.messages.values()] == [(None, None, 4), (None, None, 4)]
    out = m.apply(3, 0, [Enqueue(P, 3, b"ijkl", {})])  # over 10 bytes: the head goes
    [dropped] = of(out, Dropped)
    assert dropped.messages[0].msg_id == 1 << MSG_ID_SHIFT and dropped.messages[0].body is None
    assert m.release_index() == 2
    m.apply(4, 0, [Checkout((CH, "c"), 0, True)])
    assert m.message_count == 0 and m.release_index() == 5
    inline = QuorumQueueMachine()  # a snapshot of either kind restores in either machine
    inline.restore(m.snapshot())
    assert inline.snapshot()["messages"] == m.snapshot()["messages"]
