"""Who confirms a publish to a mirrored queue (mirrorq.classic.coordinator,
mirror_queue_slave and GM's AllHold): the last mirror of the ring, a hop before
the master could; the master sends the same confirms again
CONFIRM_BACKUP_DELAY later, so a confirm lost on the way from that mirror
still comes; the channel reports each seq confirmed once."""

from __future__ import annotations

from queue_sim_support import build

from mirrorq.classic.confirms import CONFIRM_BACKUP_DELAY
from mirrorq.queues.messages import Confirm


def _watch_confirms(sim, lose_from: str | None = None) -> list:
    """(time, source, seqs) of every Confirm the publisher receives; those
    from ``lose_from`` are lost on the way."""
    pub = sim.core("pub")
    seen: list = []
    receive = pub.receive

    def watched(now, src, msg):
        if isinstance(msg, Confirm) and msg.acks:
            if src == lose_from:
                return []
            seen.append((now, src, msg.acks))
        return receive(now, src, msg)

    pub.receive = watched
    return seen


def _run(sim, total: int) -> None:
    pub = sim.core("pub")
    assert sim.run_until(pub.done, 30.0), f"confirmed {len(pub.confirmed)} of {total}"
    sim.run_for(CONFIRM_BACKUP_DELAY * 2)  # the master's copies
    assert pub.confirmed == set(range(1, total + 1)) and not pub.nacked


def _sources(seen: list) -> dict[int, list]:
    """seq -> [(time, source)] of the confirms the publisher received for it."""
    out: dict[int, list] = {}
    for t, src, seqs in seen:
        for q in seqs:
            out.setdefault(q, []).append((t, src))
    return out


def _check_mirror_first(seen: list, master: str, last: str, total: int) -> None:
    """Every seq is confirmed first by ``last`` and again, later, by the
    master -- except before the master saw a mirror in its view (it then
    confirms alone, once)."""
    by_seq = _sources(seen)
    assert set(by_seq) == set(range(1, total + 1))
    mirrored = [q for q, got in by_seq.items() if got[0][1] == last]
    assert len(mirrored) > total // 2, by_seq
    for q, got in by_seq.items():
        if got[0][1] == last:
            assert [src for _t, src in got] == [last, master], (q, got)  # then the master's copy
        else:
            assert got == [got[0]] and got[0][1] == master, (q, got)  # the master alone, once


def test_the_last_mirror_confirms_first_and_the_master_again_later():
    sim, names = build(1, replicas=3, total=60, consumer=False)
    sim.run_for(0.001)
    seen = _watch_confirms(sim)
    _run(sim, 60)
    _check_mirror_first(seen, names[0], names[-1], 60)  # the master's left in the ring q0 -> q1 -> q2


def test_a_confirm_lost_from_the_last_mirror_still_comes_from_the_master():
    sim, names = build(2, replicas=3, total=40, consumer=False)
    sim.run_for(0.001)
    seen = _watch_confirms(sim, lose_from=names[-1])
    _run(sim, 40)
    assert {src for _t, src, _s in seen} == {names[0]}


def test_two_replicas_the_mirror_confirms_and_alone_the_master_does():
    sim, names = build(3, replicas=2, total=30, consumer=False)
    sim.run_for(0.001)
    seen = _watch_confirms(sim)
    _run(sim, 30)
    _check_mirror_first(seen, names[0], names[1], 30)
    sim, names = build(4, replicas=1, total=30, consumer=False)
    sim.run_for(0.001)
    seen = _watch_confirms(sim)
    _run(sim, 30)
    assert all(got == [got[0]] and got[0][1] == names[0] for got in _sources(seen).values())


def test_a_publish_batch_reaching_a_waiting_consumer_writes_one_deliver_record():
    """The master enqueues a Publish message's items in one call, so the
    consumer waiting on the queue gets them in one delivery round: one
    DELIVER record per Publish message, not one per message."""
    from mirrorq.classic.backing_queue import Op
    from mirrorq.queues.messages import Publish

    total = 300
    sim, names = build(
        5, replicas=1, total=total, prefetch=total
    )  # credit never runs out: deliveries come with publishes
    master = sim.core(names[0])
    batches: list[int] = []
    receive = master.receive

    def counted(now, src, msg):
        if isinstance(msg, Publish):
            batches.append(len(msg.items))
        return receive(now, src, msg)

    master.receive = counted
    start = master.replica.bq.log.next_offset
    assert sim.run_until(lambda: len(sim.core("con").received) == total, 30.0)
    kinds = [r.rtype for _, r in master.replica.bq.log.read_from(start, include_pending=True)]
    assert kinds.count(Op.PUBLISH) == total
    assert sum(batches) == total and max(batches) > 1  # the publisher did batch
    assert kinds.count(Op.DELIVER) <= len(batches) < total
