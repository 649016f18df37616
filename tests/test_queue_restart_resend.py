"""A queue's only replica restarted from its store (no mirror kept its
publishers' high-water marks) and the publishes its channel sends again
(mirrorq.classic.coordinator: Publish.settled_below, a resent publish
already in the store)."""

from __future__ import annotations

from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.classic.replica import QueueReplica, QueueSpec
from mirrorq.gm.view import View
from mirrorq.queues import channel as chmod
from mirrorq.queues import messages as m
from mirrorq.sansio import Emit, Send

PUB = "pub"


def replica(directory, member: str) -> tuple[QueueReplica, list]:
    """The queue's only replica on the store in ``directory``, master of a view of itself."""
    r = QueueReplica(
        member,
        member,
        QueueSpec("q", durable=True),
        BackingQueue(directory, durable=True, fsync=False),
        master=member,
        gm_options={"flush_interval": None, "tick_interval": 0.2, "ack_delay": 0.02},
    )
    return r, r.start(0.0) + r.install_view(0.0, View(1, (member,)))


def run(r: QueueReplica, ch: chmod.QueueChannel, actions: list, now: float, lose_confirms: bool = False) -> set:
    """Carry messages between the channel and the replica until none is left;
    the seqs confirmed to the channel (``lose_confirms``: the replica's
    confirms are lost, as when its process dies before they leave)."""
    confirmed: set = set()
    work = list(actions)
    while work:
        a = work.pop(0)
        if isinstance(a, Send) and a.dst == r.dst:
            work += r.receive(now, PUB, a.msg)
        elif isinstance(a, Send) and a.dst == PUB and not (lose_confirms and isinstance(a.msg, m.Confirm)):
            work += ch.receive(now, r.member, a.msg)
        elif isinstance(a, Emit) and isinstance(a.event, chmod.Confirmed):
            confirmed.update(a.event.seqs)
    return confirmed


def bodies(r: QueueReplica) -> list[bytes]:
    return [msg.body for msg in r.bq.peek(r.bq.message_count)]


def publish(ch: chmod.QueueChannel, now: float, lo: int, hi: int) -> list:
    return ch.publish(now, [(b"m%d" % i, {}, True) for i in range(lo, hi + 1)])


def test_a_publish_in_the_store_whose_confirm_died_is_confirmed_once_resent(tmp_path):
    r, out = replica(tmp_path, "m1")
    ch = chmod.QueueChannel((PUB, 1), "q", "m1", "m1")
    assert run(r, ch, out + publish(ch, 0.1, 1, 10), 0.1) == set(range(1, 11))
    assert run(r, ch, publish(ch, 0.2, 11, 11), 0.2, lose_confirms=True) == set()
    r.bq.close()
    r2, out = replica(tmp_path, "m2")  # restarted from the store: it knows no publisher
    assert r2.hwm == {} and len(bodies(r2)) == 11
    assert run(r2, ch, out + ch.new_master(0.3, "m2", "m2"), 0.3) == {11}
    assert not ch.unconfirmed and bodies(r2) == [b"m%d" % i for i in range(1, 12)]  # not stored twice
    assert run(r2, ch, publish(ch, 0.4, 12, 12), 0.4) == {12}  # and it goes on
    assert bodies(r2)[-1] == b"m12"


def test_publishes_the_store_never_got_are_taken_after_the_settled_ones(tmp_path):
    """Seqs 11-12 reached the store, 13-14 did not: the resend confirms the
    first two as held and stores the others, each once."""
    r, out = replica(tmp_path, "m1")
    ch = chmod.QueueChannel((PUB, 1), "q", "m1", "m1")
    run(r, ch, out + publish(ch, 0.1, 1, 10), 0.1)
    run(r, ch, publish(ch, 0.2, 11, 12), 0.2, lose_confirms=True)
    lost = [a.msg for a in publish(ch, 0.3, 13, 14) if isinstance(a, Send)]  # never delivered: the master died
    assert [(p.items[0][0], p.settled_below) for p in lost] == [(13, 11)]  # 11 and 12 are not settled
    r.bq.close()
    r2, out = replica(tmp_path, "m2")
    assert run(r2, ch, out + ch.new_master(0.4, "m2", "m2"), 0.4) == {11, 12, 13, 14}
    assert bodies(r2) == [b"m%d" % i for i in range(1, 15)]


def test_without_the_settled_mark_a_restarted_replica_would_wait_for_seqs_never_resent(tmp_path):
    """The control: a Publish that does not say what is settled (an older
    sender) parks the resent seq behind the missing ones, unconfirmed."""
    r, out = replica(tmp_path, "m1")
    ch = chmod.QueueChannel((PUB, 1), "q", "m1", "m1")
    run(r, ch, out + publish(ch, 0.1, 1, 10), 0.1)
    r.bq.close()
    r2, out = replica(tmp_path, "m2")
    bare = m.Publish("q", (PUB, 1), ((11, b"m11", {}, True),))
    assert run(r2, ch, out + [Send("m2", bare)], 0.2) == set() and len(bodies(r2)) == 10
