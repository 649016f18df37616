"""The outbox protocol (mirrorq/outbox.py), one checker per guarantee:

* order and exactly-once: whatever the transport does (completes late,
  fails transmits that it did or did not deliver, reports dead targets
  that come back), a receiver sees each posted message once, in post order,
  as long as the destination is not given up;
* coalescing: one bundle in flight per destination; what is posted meanwhile
  leaves together, in one bundle, when the one in flight completes;
* bounded transport queue: never more bundles in flight than destinations;
* bounded bundles: at most MAX_BUNDLE messages and MAX_BUNDLE_BYTES of
  estimated size, unless one message alone is bigger;
* giving up: a destination reported dead DEAD_ATTEMPTS times in a row, or
  failing for GIVE_UP seconds, is given up and its messages counted dropped.

The randomised run is seeded; replay one with
``pytest 'tests/test_outbox.py::test_random_transport[seed=7]'``.
"""

from __future__ import annotations

import random

import pytest

from mirrorq.bounds import size_of
from mirrorq.outbox import DEAD_ATTEMPTS, GIVE_UP, MAX_BUNDLE, MAX_BUNDLE_BYTES, RETRY_DELAYS, Bundle, Inbox, Outbox


def test_idle_destination_sends_at_once_and_busy_one_coalesces():
    ob = Outbox("a:1/x")
    ob.post("b:2", "m1")
    first = ob.take(0.0)
    assert first == [("b:2", Bundle("a:1/x", 1, ("m1",)))]
    for m in ("m2", "m3", "m4"):
        ob.post("b:2", m)
    assert ob.take(0.0) == []  # one in flight: the rest waits
    nxt = ob.sent("b:2", 1, 0.01)
    assert nxt == [("b:2", Bundle("a:1/x", 2, ("m2", "m3", "m4")))]
    assert ob.sent("b:2", 2, 0.02) == []
    assert ob.busy() == 0


def test_sent_during_a_turn_leaves_the_successor_to_take():
    ob = Outbox("a:1/x")
    ob.post("b:2", 1)
    ob.take(0.0)
    ob.post("b:2", 2)
    assert ob.sent("b:2", 1, 0.0, start_next=False) == []
    assert ob.take(0.0) == [("b:2", Bundle("a:1/x", 2, (2,)))]


def test_bundles_leave_in_the_order_their_destinations_were_first_posted_to():
    """An answer posted before a note to a peer leaves first, whatever order
    the destinations were first seen in (a last mirror's confirm to the
    front end goes before its GM frame back to the master)."""
    ob = Outbox("a:1/x")
    for d in ("master:1", "fe:2", "other:3"):
        ob.post(d, "hello")
    for d, b in ob.take(0.0):
        ob.sent(d, b.seq, 0.0)
    ob.post("fe:2", "confirm")
    ob.post("master:1", "frame")
    ob.post("fe:2", "more")  # fe:2 already waits: it keeps its place
    assert [(d, b.msgs) for d, b in ob.take(0.0)] == [("fe:2", ("confirm", "more")), ("master:1", ("frame",))]
    # a destination with a bundle in flight keeps its place when posted to
    ob.post("other:3", "x")
    ob.post("fe:2", "late")
    assert [d for d, _ in ob.take(0.0)] == ["other:3"]
    assert [d for d, _ in ob.sent("fe:2", 2, 0.0)] == ["fe:2"]


def test_destinations_are_independent():
    ob = Outbox("a:1/x")
    ob.post("b:2", "to-b")
    ob.post("c:3", "to-c")
    out = dict(ob.take(0.0))
    assert out["b:2"].msgs == ("to-b",) and out["c:3"].msgs == ("to-c",)
    assert ob.busy() == 2
    ob.post("b:2", "again")
    assert ob.sent("c:3", 1, 0.0) == []  # c's completion does not release b's
    assert ob.take(0.0) == []


def test_failed_transmit_is_retried_unchanged_and_new_posts_wait():
    ob = Outbox("a:1/x")
    ob.post("b:2", "m1")
    ((dst, b1),) = ob.take(0.0)
    ob.post("b:2", "m2")
    delay = ob.failed("b:2", b1.seq, 1.0, dead=False)
    assert delay == RETRY_DELAYS[0]
    assert ob.take(1.0) == []  # waiting for the retry
    assert ob.due(1.0) == []
    assert ob.next_retry() == pytest.approx(1.0 + delay)
    again = ob.due(1.0 + delay)
    assert again == [("b:2", b1)]  # same seq, same messages
    assert ob.sent("b:2", b1.seq, 1.1) == [("b:2", Bundle("a:1/x", 2, ("m2",)))]


def test_stale_completion_is_ignored():
    ob = Outbox("a:1/x")
    ob.post("b:2", "m1")
    ob.take(0.0)
    assert ob.sent("b:2", 99, 0.0) == []
    assert ob.failed("b:2", 99, 0.0, dead=True) is None
    assert ob.busy() == 1


def test_dead_target_given_up_after_dead_attempts():
    ob = Outbox("a:1/x")
    for i in range(3):
        ob.post("b:2", i)
    ((_, b),) = ob.take(0.0)
    ob.post("b:2", "later")
    t = 0.0
    for _k in range(DEAD_ATTEMPTS - 1):
        d = ob.failed("b:2", b.seq, t, dead=True)
        assert d is not None
        t += d
        assert ob.due(t) == [("b:2", b)]
    assert ob.failed("b:2", b.seq, t, dead=True) is None
    assert ob.stats["dropped"] == 4 and ob.stats["given_up"] == 1
    assert ob.busy() == 0 and ob.take(t) == []
    # the destination is usable again (e.g. the address now belongs to a live actor)
    ob.post("b:2", "fresh")
    ((_, nb),) = ob.take(t)
    assert nb.seq == b.seq + 1 and nb.msgs == ("fresh",)


def test_failing_target_given_up_after_give_up_seconds():
    ob = Outbox("a:1/x")
    ob.post("b:2", "m")
    ((_, b),) = ob.take(0.0)
    t = 0.0
    while True:
        d = ob.failed("b:2", b.seq, t, dead=False)
        if d is None:
            break
        t += d
        ob.due(t)
    assert t >= GIVE_UP
    assert ob.stats["given_up"] == 1


def test_a_dead_report_followed_by_success_resets_the_count():
    ob = Outbox("a:1/x")
    ob.post("b:2", "m")
    ((_, b),) = ob.take(0.0)
    for _ in range(DEAD_ATTEMPTS - 1):
        ob.failed("b:2", b.seq, 0.0, dead=True)
    ob.due(10.0)
    ob.sent("b:2", b.seq, 10.0)
    ob.post("b:2", "n")
    ((_, b2),) = ob.take(10.0)
    assert ob.failed("b:2", b2.seq, 10.0, dead=True) is not None  # counting starts again


def test_bundles_are_capped():
    ob = Outbox("a:1/x")
    for i in range(MAX_BUNDLE + 5):
        ob.post("b:2", i)
    ((_, b),) = ob.take(0.0)
    assert len(b.msgs) == MAX_BUNDLE
    ((_, b2),) = ob.sent("b:2", b.seq, 0.0)
    assert b2.msgs == tuple(range(MAX_BUNDLE, MAX_BUNDLE + 5))


def test_bundles_are_bounded_by_bytes_and_keep_post_order():
    """Messages posted while a bundle is in flight leave in bundles of at
    most MAX_BUNDLE_BYTES (estimated), in post order, none dropped."""
    ob = Outbox("a:1/x")
    ob.post("b:2", b"first")
    ((_, b1),) = ob.take(0.0)
    mib = 1 << 20
    bodies = [bytes([i]) * mib for i in range(10)]
    for body in bodies:
        ob.post("b:2", body)
    assert ob.pending_bytes("b:2") == sum(size_of(x) for x in bodies)
    bundles = [(b"first",)]
    ((_, b),) = ob.sent("b:2", b1.seq, 0.0)
    bundles.append(b.msgs)
    ready = ob.sent("b:2", b.seq, 0.0)
    while ready:
        ((_, b),) = ready
        bundles.append(b.msgs)
        ready = ob.sent("b:2", b.seq, 0.0)
    assert [m for msgs in bundles for m in msgs] == [b"first"] + bodies
    assert all(sum(size_of(m) for m in msgs) <= MAX_BUNDLE_BYTES for msgs in bundles)
    assert [len(msgs) for msgs in bundles] == [1, 3, 3, 3, 1]  # 3 MiB and a little fit, 4 do not
    assert ob.pending_bytes("b:2") == 0


def test_a_message_over_the_byte_bound_travels_alone():
    ob = Outbox("a:1/x")
    big = bytes(MAX_BUNDLE_BYTES + 1)
    ob.post("b:2", b"a")
    ((_, b1),) = ob.take(0.0)
    for m in (b"b", big, b"c", b"d"):
        ob.post("b:2", m)
    ((_, b2),) = ob.sent("b:2", b1.seq, 0.0)
    assert b2.msgs == (b"b",)
    ((_, b3),) = ob.sent("b:2", b2.seq, 0.0)
    assert b3.msgs == (big,)
    ((_, b4),) = ob.sent("b:2", b3.seq, 0.0)
    assert b4.msgs == (b"c", b"d")


def test_inbox_drops_retransmissions():
    ib = Inbox()
    b1, b2 = Bundle("a", 1, ("x",)), Bundle("a", 2, ("y",))
    assert ib.accept(b1) and not ib.accept(b1)
    assert ib.accept(b2) and not ib.accept(b1)
    assert ib.accept(Bundle("other", 1, ("z",)))  # origins are independent
    assert ib.stats == {"bundles": 3, "duplicates": 2}


def test_bad_origin_is_refused():
    with pytest.raises(ValueError, match="origin"):
        Outbox("")


def _world(seed: int, max_dsts: int):
    """A seeded sender with 1..max_dsts destinations, their inboxes, and what each got and was posted."""
    rng = random.Random(seed)
    dsts = [f"d{i}:1" for i in range(rng.randint(1, max_dsts))]
    return (rng, Outbox("src:1/nonce"), dsts, {d: Inbox() for d in dsts}, {d: [] for d in dsts}, {d: [] for d in dsts})


def _check_each_once_in_order(got: dict, posted: dict) -> None:
    for d in posted:
        assert got[d] == posted[d], (
            f"{d}: got {len(got[d])} of {len(posted[d])}, first difference at "
            f"{next((i for i, (a, b) in enumerate(zip(got[d], posted[d])) if a != b), None)}"
        )


@pytest.mark.parametrize("seed", range(200), ids=lambda s: f"seed={s}")
def test_random_transport(seed):
    """A transport that completes transmits late and out of order across
    destinations, fails some it delivered and some it did not: every
    receiver gets each message once, in post order."""
    rng, ob, dsts, inboxes, got, posted = _world(seed, 4)
    inflight: list = []  # (dst, bundle)
    now = 0.0
    n = 0
    max_busy = 0
    for _step in range(600):
        now += rng.uniform(0.0, 0.05)
        for _ in range(rng.randint(0, 5)):
            d = rng.choice(dsts)
            n += 1
            ob.post(d, n)
            posted[d].append(n)
        inflight += ob.take(now) + ob.due(now)
        max_busy = max(max_busy, ob.busy())
        rng.shuffle(inflight)
        keep = []
        for dst, b in inflight:
            r = rng.random()
            if r < 0.5:
                keep.append((dst, b))  # not completed yet
                continue
            delivered = r < 0.9 or rng.random() < 0.5  # some failures happened after delivery
            if delivered and inboxes[dst].accept(b):
                got[dst].extend(b.msgs)
            if r < 0.9:
                inflight_next = ob.sent(dst, b.seq, now)
                keep += inflight_next
            else:
                ob.failed(dst, b.seq, now, dead=False)  # never DEAD: nothing is given up here
        inflight = keep
    # drain: everything completes
    for _ in range(10_000):
        now += 1.0
        inflight += ob.take(now) + ob.due(now)
        if not inflight and ob.busy() == 0 and all(not lk.pending for lk in ob.links.values()):
            break
        keep = []
        for dst, b in inflight:
            if inboxes[dst].accept(b):
                got[dst].extend(b.msgs)
            keep += ob.sent(dst, b.seq, now)
        inflight = keep
    assert max_busy <= len(dsts)
    assert ob.stats["given_up"] == 0
    _check_each_once_in_order(got, posted)


def test_replayed_bundles_go_first_in_order_and_unchanged():
    ob = Outbox("a:1/x")
    sent = []
    for i in range(3):
        ob.post("b:2", i)
        ((_, b),) = ob.take(0.0)
        sent.append(b)
        assert ob.sent("b:2", b.seq, 0.0) == []  # a link reports it done once written
    ob.post("b:2", "new")
    ((_, inflight),) = ob.take(0.0)
    ob.post("b:2", "newer")
    ob.replay("b:2", sent[1:] + [inflight])  # the link broke holding 2, 3 and the one in flight
    out = []
    nxt = ob.take(0.0)
    while nxt:
        ((_, b),) = nxt
        out.append(b)
        nxt = ob.sent("b:2", b.seq, 0.0)
    assert out[:3] == sent[1:] + [inflight]  # the same bundles, in order, before anything new
    assert [b.msgs for b in out[3:]] == [("newer",)] and out[3].seq == inflight.seq + 1
    assert ob.stats["replayed"] == 3


def test_a_given_up_destination_drops_its_replays_too():
    ob = Outbox("a:1/x")
    ob.post("b:2", "m")
    ((_, b),) = ob.take(0.0)
    ob.sent("b:2", b.seq, 0.0)
    ob.replay("b:2", [b])
    ((_, again),) = ob.take(0.0)
    t = 0.0
    while ob.failed("b:2", again.seq, t, dead=True) is not None:
        t += 1.0
        ob.due(t)
    assert ob.stats["dropped"] == 1 and ob.take(t) == []


@pytest.mark.parametrize("seed", range(300), ids=lambda s: f"seed={s}")
def test_random_pipelined_transport_with_breaks(seed):
    """A transport like a direct link: it reports a transmit done once
    written, the receiver reads the stream in order and acks cumulatively,
    and the link breaks at random with some bytes still unread (the receiver
    may read them after the replays started) and some lost; bundles with no
    link go through a Thespian-like transport that completes only what was
    received, or fails.  Every receiver gets each message once, in post order."""
    rng, ob, dsts, inbox, got, posted = _world(seed, 3)
    wire = {d: [] for d in dsts}  # written on the live link, unread
    unacked = {d: [] for d in dsts}  # written on the live link, not acked
    read = {d: [] for d in dsts}  # read from the live link, not acked
    stale = {d: [] for d in dsts}  # unread bytes of broken links (each a list, in order)
    up = {d: rng.random() < 0.5 for d in dsts}
    thespian: list = []
    n = 0
    now = 0.0

    def accept(d, b):
        if inbox[d].accept(b):
            got[d].extend(b.msgs)

    def transmit(batch):
        while batch:
            d, b = batch.pop(0)
            if up[d]:
                wire[d].append(b)
                unacked[d].append(b)
                batch += ob.sent(d, b.seq, now)
            else:
                thespian.append((d, b))

    for _step in range(800):
        now += 0.01
        for _ in range(rng.randint(0, 4)):
            d = rng.choice(dsts)
            n += 1
            ob.post(d, n)
            posted[d].append(n)
        transmit(ob.take(now) + ob.due(now))
        for d in dsts:
            r = rng.random()
            if r < 0.4 and wire[d]:  # the receiver reads some of the live stream
                k = rng.randint(1, len(wire[d]))
                for b in wire[d][:k]:
                    accept(d, b)
                read[d] += wire[d][:k]
                del wire[d][:k]
            elif r < 0.6 and read[d]:  # it acks what it read, cumulatively
                last = read[d][rng.randrange(len(read[d]))].seq
                read[d] = [b for b in read[d] if b.seq > last]
                unacked[d] = [b for b in unacked[d] if b.seq > last]
            elif r < 0.65 and up[d]:  # the link breaks: some unread bytes stay readable, the rest are lost
                keep = rng.randint(0, len(wire[d]))
                if keep:
                    stale[d].append(wire[d][:keep])
                held = unacked[d]
                wire[d], unacked[d], read[d], up[d] = [], [], [], False
                ob.replay(d, held)
            elif r < 0.7 and not up[d]:
                up[d] = True
            elif r < 0.8 and stale[d]:  # bytes of a broken link read late
                s = stale[d][0]
                k = rng.randint(1, len(s))
                for b in s[:k]:
                    accept(d, b)
                del s[:k]
                if not s:
                    stale[d].pop(0)
        transmit(ob.take(now))
        rng.shuffle(thespian)
        keep = []
        for d, b in thespian:
            r = rng.random()
            if r < 0.5:
                keep.append((d, b))
            elif r < 0.9:
                accept(d, b)
                transmit(ob.sent(d, b.seq, now))
            else:
                if rng.random() < 0.5:
                    accept(d, b)  # delivered, but the sender heard of a failure
                ob.failed(d, b.seq, now, dead=False)
        thespian = keep
    # drain: links stay down, Thespian delivers everything, stale bytes are read
    for d in dsts:
        up[d] = False
        ob.replay(d, unacked[d])
        for s in stale[d]:
            for b in s:
                accept(d, b)
        for b in wire[d]:
            accept(d, b)
    for _ in range(10_000):
        now += 1.0
        todo = thespian + ob.take(now) + ob.due(now)
        thespian = []
        if not todo and ob.busy() == 0:
            break
        for d, b in todo:
            accept(d, b)
            transmit(ob.sent(d, b.seq, now))
    assert ob.stats["given_up"] == 0 and ob.busy() == 0
    _check_each_once_in_order(got, posted)
