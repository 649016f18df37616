"""mirrorq.bounds: the size estimates every batching point uses, checked
against what the messages really weigh pickled (what Thespian and the links
carry), and the places that cut a batch by them: a replica's turn of
requests (one GM payload each), a classic master's and a quorum leader's
Deliveries, a quorum leader's entries and dead-letter batches."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest

from mirrorq.bounds import MAX_BATCH_BYTES, batches, plain_size, size_of
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.classic.payloads import encoded_size as payload_size
from mirrorq.classic.replica import QueueReplica, QueueSpec
from mirrorq.classic.sync import SyncBatch
from mirrorq.gm.messages import GMFrame
from mirrorq.gm.view import View
from mirrorq.mnesia_like.raft import MemoryRaftLog
from mirrorq.node.posting import ToReplica
from mirrorq.queues import messages as qm
from mirrorq.quorum import machine as qmach
from mirrorq.quorum.replica import QuorumReplica
from mirrorq.sansio import Send

CH = ("fe:1", 7 << 32 | 1)
PROPS = {"delivery_mode": 2, "content_type": "application/json", "headers": {"trace": "abc", "n": 1}}


def pickled(msg) -> int:
    return len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.parametrize("body", [0, 100, 4096, 1 << 20])
def test_estimates_follow_the_pickled_size_of_the_messages_that_carry_bodies(body):
    """Bodies are counted exactly, the rest roughly: the estimate is within
    a small factor (and a few hundred bytes) of the pickled size."""
    b = [bytes([i]) * body for i in range(50)]  # distinct objects: pickle would write a shared one once
    p = [dict(PROPS, headers=dict(PROPS["headers"])) for _ in range(50)]
    msgs = [
        qm.Publish("q", CH, tuple((i, b[i], p[i], True) for i in range(50))),
        qm.Deliveries("q", CH, "m", tuple(("ctag", i, f"id{i}", b[i], p[i], False) for i in range(50))),
        qm.DeadLetter("q", "/", "m:1", "dlx", None, tuple((i, b[i], p[i], "rejected", True) for i in range(50))),
        GMFrame("g", "a/1:2/x", "b/1:3/y", bytes(50 * body)),
        SyncBatch("q", 1, 0, 50, 50, bytes(50 * body)),
        ToReplica("n/127.0.0.1:4/u", qm.Publish("q", CH, tuple((i, b[i], p[i], True) for i in range(50)))),
    ]
    for m in msgs:
        est, real = size_of(m), pickled(m)
        assert real <= 2 * est + 512 and est <= 3 * real + 512, (type(m).__name__, est, real)


def test_settlements_are_weighed_by_their_offsets():
    s = qm.Settle("q", CH, "m", tuple(range(100_000)))
    assert size_of(s) >= 0.5 * pickled(s)
    c = qm.Confirm("q", CH, tuple(range(100_000)))
    assert size_of(c) >= 0.5 * pickled(c)


def test_plain_size_looks_into_containers_size_of_does_not():
    data = [[1, b"x" * 1000, {"k": "v" * 500}]] * 10
    assert plain_size(data) >= 15_000 > size_of(data)


def test_batches_keep_order_fit_the_limit_and_take_a_big_item_alone():
    items = [b"a" * 40, b"b" * 40, b"c" * 200, b"d" * 10, b"e" * 10]
    runs = batches(items, len, limit=100)
    assert runs == [[b"a" * 40, b"b" * 40], [b"c" * 200], [b"d" * 10, b"e" * 10]]
    assert batches([1, 2, 3, 4, 5], lambda x: 1, limit=100, max_count=2) == [[1, 2], [3, 4], [5]]
    assert batches([], len) == []


def _master_in_a_pair() -> QueueReplica:
    r = QueueReplica(
        "m",
        "m",
        QueueSpec("q", durable=False),
        BackingQueue(None, durable=False),
        master="m",
        gm_options={"flush_interval": None, "tick_interval": 0.2, "ack_delay": 0.02},
    )
    r.start(0.0)
    r.install_view(0.0, View(1, ("m", "x")))
    return r


def test_a_turn_of_requests_is_broadcast_in_payloads_of_at_most_the_bound():
    """Five 1.5 MB publishes that arrived in one turn: the master handles
    them in runs of at most MAX_BATCH_BYTES, one GM payload each (not one
    payload of all five), every one estimated within the bound and the
    estimate within 2x of the payload's encoded size."""
    from mirrorq.packing import pack

    r = _master_in_a_pair()
    before = r.gm.pub_count
    msgs = [qm.Publish("q", CH, ((i + 1, bytes([i]) * 1_500_000, PROPS, True),)) for i in range(5)]
    r.receive_many(0.1, msgs)
    r.end_turn(0.1)
    pending = [p for _seq, p in r.gm.members_state["m"].pending_ack][before:]
    assert len(pending) == 3  # 2 + 2 + 1
    for p in pending:
        assert payload_size(p) <= MAX_BATCH_BYTES
        real = len(pack(p))
        assert real <= 2 * payload_size(p) and payload_size(p) <= 2 * real
    assert r.bq.message_count == 5


def test_a_classic_masters_deliveries_are_cut_at_the_bound():
    """A consumer without a prefetch limit and a backlog of 10 x 1 MiB: the
    deliveries leave as several Deliveries of at most MAX_BATCH_BYTES each,
    numbered in order, carrying every message once (the last ones once the
    consumer's link credit came back)."""
    r = QueueReplica(
        "m",
        "m",
        QueueSpec("q", durable=False),
        BackingQueue(None, durable=False),
        master="m",
        gm_options={"flush_interval": None, "tick_interval": 0.2, "ack_delay": 0.02},
    )
    r.start(0.0)
    r.install_view(0.0, View(1, ("m",)))
    bodies = [bytes([i]) * (1 << 20) for i in range(10)]
    r.receive(0.1, None, qm.Publish("q", ("fe:2", 1), tuple((i + 1, b, {}, True) for i, b in enumerate(bodies))))
    r.end_turn(0.1)
    out = r.receive(0.2, None, qm.Consume("q", CH, "c", prefetch=0)) + r.end_turn(0.2)
    dels = [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, qm.Deliveries)]
    assert len(dels) > 1
    # the consumer's link credit (8 MiB) stops the rest until its front end gives credit back
    assert sum(len(d.items) for d in dels) == 8
    out = r.receive(0.3, None, qm.Settle("q", CH, "m", credit=(("c", 8 << 20),))) + r.end_turn(0.3)
    dels += [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, qm.Deliveries)]
    assert [d.seq for d in dels] == list(range(1, len(dels) + 1))
    assert all(d.wire_size() <= MAX_BATCH_BYTES for d in dels)
    assert all(d.nbytes in (0, replace(d, nbytes=0).wire_size()) for d in dels)  # the estimate it carries
    assert [it[3] for d in dels for it in d.items] == bodies


def _quorum_leader() -> QuorumReplica:
    r = QuorumReplica("a", "qq", MemoryRaftLog({}), random.Random(1), voters=("a",), arguments={})
    r.start(0.0)
    r.timer(1.0, ("raft", "election"))
    r.end_turn(1.0)
    assert r.led_term is not None
    return r


def test_a_quorum_leaders_turn_is_proposed_in_entries_of_at_most_the_bound_and_delivered_cut_too():
    r = _quorum_leader()
    first = r.raft.last_index
    bodies = [bytes([i]) * (1 << 20) for i in range(10)]
    r.receive(1.1, "fe", qm.Publish("qq", CH, tuple((i + 1, b, {}, True) for i, b in enumerate(bodies))))
    r.end_turn(1.1)
    r.persist(1.1)  # (a lone voter commits once its log is durable)
    entries = [r.raft.log.entry(i) for i in range(first + 1, r.raft.last_index + 1)]
    assert len(entries) == 4  # 3 + 3 + 3 + 1 enqueues
    assert all(qmach.entry_size(e.data) <= MAX_BATCH_BYTES for e in entries)
    out = r.receive(1.2, "fe", qm.Consume("qq", CH, "c", prefetch=0)) + r.end_turn(1.2)
    out += r.persist(1.2)
    out += r.end_turn(1.3)
    dels = [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, qm.Deliveries)]
    assert sum(len(d.items) for d in dels) == 8  # 8 MiB of link credit (LINK_CREDIT_BYTES)
    out = r.receive(1.4, "fe", qm.Settle("qq", CH, r.epoch, credit=(("c", 8 << 20),))) + r.end_turn(1.4)
    out += r.persist(1.4)
    out += r.end_turn(1.5)
    dels += [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, qm.Deliveries)]
    assert len(dels) > 1 and all(d.wire_size() <= MAX_BATCH_BYTES for d in dels)
    assert all(d.nbytes == replace(d, nbytes=0).wire_size() for d in dels)  # the estimate it carries
    assert [d.seq for d in dels] == list(range(1, len(dels) + 1))
    assert [it[3] for d in dels for it in d.items] == bodies


def test_a_dead_letter_batch_stops_before_the_bound_and_takes_a_big_one_alone():
    mib = 1 << 20
    items = [(i, bytes(mib), {}, "rejected", True) for i in range(10)]
    first = qm.dead_letter_prefix(items)
    assert len(first) == 3 and sum(len(it[1]) for it in first) <= qm.DEAD_LETTER_BATCH_BYTES
    big = [(1, bytes(qm.DEAD_LETTER_BATCH_BYTES + 1), {}, "rejected", True), (2, b"x", {}, "rejected", True)]
    assert qm.dead_letter_prefix(big) == big[:1]
