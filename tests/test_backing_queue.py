"""BackingQueue: queue semantics on top of the segment log, recovery, compaction, mirrors."""

from __future__ import annotations

import copy
import logging
import os
import random
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mirrorq.classic.backing_queue import (
    BackingQueue,
    BodyCache,
    DuplicateMessage,
    InvalidOperation,
    Message,
    Op,
    UnknownMessage,
)
from mirrorq.store.segment_log import CorruptRecord, Record, segment_name


def body_of(i: int, size: int = 20) -> bytes:
    return (f"body-{i}-".encode() * (size // 8 + 1))[:size]


def publish_n(bq, n, start=0, size=20, persistent=True):
    return [bq.publish(f"m{start + i}", body_of(start + i, size), {"n": start + i}, persistent) for i in range(n)]


def snapshot(bq: BackingQueue):
    """Everything observable about a queue's state (used to compare replicas)."""
    ready = bq.peek(bq.ready_count)
    unacked = [bq.get(o) for o in bq.unacked_offsets()]
    return {
        "ready": ready,
        "unacked": unacked,
        "counts": (bq.message_count, bq.ready_count, bq.unacked_count, len(bq)),
        "refused": {p: bq.refused_runs(p) for p in sorted(bq.refused_publishers(), key=repr)},
    }


# ------------------------------------------------------------- semantics


def test_publish_fetch_ack_fifo(tmp_path):
    with BackingQueue(tmp_path) as bq:
        offs = publish_n(bq, 5)
        assert offs == sorted(offs) and len(set(offs)) == 5
        assert (bq.message_count, bq.ready_count, bq.unacked_count, len(bq)) == (5, 5, 0, 5)
        first = bq.peek(2)
        assert [m.msg_id for m in first] == ["m0", "m1"] and bq.ready_count == 5  # peek changes nothing
        got = bq.fetch(2)
        assert got == first
        assert got[0] == Message(offs[0], "m0", body_of(0), {"n": 0}, True, False)
        assert (bq.message_count, bq.ready_count, bq.unacked_count) == (5, 3, 2)
        bq.ack([got[0].offset])
        bq.ack("m1")  # by msg_id
        assert (bq.message_count, bq.ready_count, bq.unacked_count) == (3, 3, 0)
        assert [m.msg_id for m in bq.fetch(10, ack_required=False)] == ["m2", "m3", "m4"]
        assert bq.message_count == 0 and bq.fetch() == [] and bq.is_empty()


def test_reopen_recovers_ready_in_fifo_order_with_acks_honoured(tmp_path):
    bq = BackingQueue(tmp_path)
    offs = publish_n(bq, 10)
    got = bq.fetch(6)
    bq.ack([got[1].offset, got[3].offset, got[5].offset])
    bq.requeue([got[0].offset, got[4].offset])  # back at their original positions, redelivered
    before = snapshot(bq)
    bq.close()
    bq = BackingQueue(tmp_path)
    assert snapshot(bq) == before
    assert bq.ready_offsets() == [offs[0], offs[4], offs[6], offs[7], offs[8], offs[9]]
    assert bq.unacked_offsets() == [offs[2]]
    assert [m.redelivered for m in bq.peek(3)] == [True, True, False]
    # Unacked stays unacked until the owner decides: requeue on a cold start.
    assert bq.requeue_unacked() == 1
    assert bq.ready_offsets()[:3] == [offs[0], offs[2], offs[4]]
    bq.close()
    assert BackingQueue(tmp_path).ready_offsets()[:3] == [offs[0], offs[2], offs[4]]


def test_requeue_returns_to_original_position_and_flags_redelivered(tmp_path):
    with BackingQueue(tmp_path) as bq:
        offs = publish_n(bq, 4)
        a, b = bq.fetch(2)
        bq.requeue([b.msg_id])
        assert bq.ready_offsets() == [offs[1], offs[2], offs[3]]
        m = bq.fetch()[0]
        assert m.offset == offs[1] and m.redelivered
        bq.requeue([a.offset, m.offset])
        assert bq.ready_offsets() == offs
        assert [x.redelivered for x in bq.peek(4)] == [True, True, False, False]


def test_purge_drops_ready_keeps_unacked_and_survives_reopen(tmp_path):
    bq = BackingQueue(tmp_path)
    offs = publish_n(bq, 6)
    held = bq.fetch(2)
    assert bq.purge() == 4
    assert bq.ready_count == 0 and bq.unacked_offsets() == offs[:2]
    assert bq.purge() == 0
    later = publish_n(bq, 2, start=10)
    bq.close()
    bq = BackingQueue(tmp_path)
    assert bq.ready_offsets() == later
    assert bq.unacked_offsets() == [m.offset for m in held]
    bq.requeue([held[1].offset])
    assert bq.ready_offsets() == [offs[1]] + later
    bq.close()


def test_drop_transient(tmp_path):
    with BackingQueue(tmp_path) as bq:
        p = bq.publish("p", b"1", persistent=True)
        bq.publish("t1", b"2", persistent=False)
        bq.publish("t2", b"3", persistent=False)
        bq.fetch(2)  # p and t1 unacked
        assert bq.drop_transient() == 2
        assert bq.unacked_offsets() == [p] and bq.ready_count == 0
        assert bq.drop_transient() == 0


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    with BackingQueue(tmp_path) as bq:
        o = bq.publish("a", b"x")
        nxt = bq.log.next_offset
        with pytest.raises(DuplicateMessage, match="'a'"):
            bq.publish("a", b"y")
        with pytest.raises(TypeError, match="bytes"):
            bq.publish("b", "not bytes")
        with pytest.raises(TypeError, match="msg_id"):
            bq.publish(7, b"x")
        with pytest.raises(TypeError, match="msgpack"):
            bq.publish("c", b"x", {"bad": {1, 2}})
        with pytest.raises(InvalidOperation, match="ready"):
            bq.ack([o])  # not delivered
        with pytest.raises(UnknownMessage, match="offset 99"):
            bq.ack([99])
        with pytest.raises(UnknownMessage, match="'zz'"):
            bq.requeue("zz")
        with pytest.raises(TypeError, match="reference"):
            bq.ack([1.5])
        bq.fetch()
        with pytest.raises(InvalidOperation, match="repeat"):
            bq.ack([o, o])
        with pytest.raises(InvalidOperation, match="unknown operation"):
            bq.apply((99, []))
        with pytest.raises(InvalidOperation, match="items"):
            bq.apply((Op.ACK, []))
        with pytest.raises(ValueError):
            bq.fetch(-1)
        assert bq.log.next_offset == nxt + 1  # only the fetch was written
        assert bq.unacked_offsets() == [o]
    with pytest.raises(ValueError, match="directory"):
        BackingQueue(None)


def test_group_fsync_one_per_flush(tmp_path, fsyncs):
    bq = BackingQueue(tmp_path)
    fsyncs.clear()
    publish_n(bq, 1000, size=1024)
    got = bq.fetch(500)
    bq.ack([m.offset for m in got])
    assert fsyncs == []
    bq.flush()
    assert len(fsyncs) == 1
    bq.close()


def test_non_durable_queue_without_a_directory_never_touches_disk(tmp_path, fsyncs):
    bq = BackingQueue(None, durable=False)
    offs = publish_n(bq, 50, persistent=False)
    bq.ack([m.offset for m in bq.fetch(10)])
    bq.flush()
    assert bq.ready_offsets() == offs[10:]
    assert bq.log.read_from(offs[10], 1)[0][1].body[0] == "m10"
    bq.close()
    assert list(tmp_path.iterdir()) == [] and fsyncs == []


def test_non_durable_queue_with_a_directory_pages_its_log_out_and_never_fsyncs(tmp_path, fsyncs):
    where = tmp_path / "nd"
    bq = BackingQueue(where, durable=False, fsync=False, segment_bytes=64 << 10)
    offs = publish_n(bq, 500, persistent=False)
    bq.ack([m.offset for m in bq.fetch(10)])
    bq.flush()
    assert bq.ready_offsets() == offs[10:]
    assert bq.log.read_from(offs[10], 1)[0][1].body[0] == "m10"
    assert sum(f.stat().st_size for f in where.iterdir()) > 0  # the bodies are in files, not in memory
    bq.close()
    assert fsyncs == []


# ------------------------------------------------------------- compaction


def test_compaction_deletes_fully_acked_segments_offsets_stay_monotonic(tmp_path):
    bq = BackingQueue(tmp_path, segment_bytes=512, auto_compact=False)
    publish_n(bq, 40, size=60)
    bq.flush()
    nsegs = len(bq.log.segment_bases)
    assert nsegs > 5
    got = bq.fetch(30)
    bq.ack([m.offset for m in got])
    bq.flush()  # auto_compact=False: nothing deleted yet
    total = len(bq.log.segment_bases)
    assert total >= nsegs
    deleted = bq.compact()
    assert len(deleted) >= 3 and len(bq.log.segment_bases) == total - len(deleted)
    m30 = bq.offset_of("m30")
    assert all(b < m30 for b in deleted)  # only segments of acked messages
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".seg"))
    assert files == [segment_name(b) for b in bq.log.segment_bases]
    assert all(segment_name(b) not in files for b in deleted)
    remaining = bq.ready_offsets()
    assert [m.msg_id for m in bq.peek(10)] == [f"m{i}" for i in range(30, 40)]
    first, nxt = bq.log.first_offset, bq.log.next_offset
    assert first <= remaining[0]
    bq.close()
    bq = BackingQueue(tmp_path, segment_bytes=512)
    assert bq.ready_offsets() == remaining
    assert (bq.log.first_offset, bq.log.next_offset) == (first, nxt)
    bq.ack([m.offset for m in bq.fetch(10)])
    bq.flush()  # auto-compaction: everything but the active segment goes
    assert len(bq.log.segment_bases) == 1
    nxt = bq.log.next_offset
    bq.close()
    bq = BackingQueue(tmp_path, segment_bytes=512)
    assert bq.message_count == 0 and bq.log.next_offset == nxt
    assert bq.publish("new", b"x") == nxt  # never reused
    bq.close()


def test_compaction_keeps_segments_whose_records_touch_live_segments(tmp_path):
    """A segment of dead messages that holds the ack of a message in a kept
    segment must stay, or that message would come back on replay."""
    bq = BackingQueue(tmp_path, segment_bytes=400)
    keep = bq.publish("keep", body_of(0, 60))
    doomed = publish_n(bq, 2, start=1, size=60)  # same first segment as keep
    bq.fetch(3)
    bq.flush()
    publish_n(bq, 20, start=10, size=60)  # more segments
    bq.ack(doomed)  # this ACK lands in a later segment but names the first one
    later = bq.fetch(20)
    bq.ack([m.offset for m in later])
    bq.compact()
    before = snapshot(bq)
    assert bq.unacked_offsets() == [keep] and bq.message_count == 1
    bq.close()
    bq = BackingQueue(tmp_path, segment_bytes=400)
    assert snapshot(bq) == before  # the doomed messages did not come back
    bq.ack([keep])
    bq.compact()
    assert len(bq.log.segment_bases) == 1
    bq.close()
    assert BackingQueue(tmp_path, segment_bytes=400).message_count == 0


# ---------------------------------------------------------------- damage


def test_flipped_byte_mid_segment_is_reported(tmp_path):
    bq = BackingQueue(tmp_path)
    publish_n(bq, 10)
    bq.close()
    path = tmp_path / segment_name(0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord) as info:
        BackingQueue(tmp_path)
    assert info.value.path == str(path)
    assert f"{path} at byte offset {info.value.offset}" in str(info.value)
    assert 0 < info.value.offset <= len(data) // 2


def test_truncated_tail_recovers_up_to_last_good_record(tmp_path, caplog):
    bq = BackingQueue(tmp_path)
    offs = publish_n(bq, 5)
    bq.close()
    size = os.path.getsize(tmp_path / segment_name(0))  # a closed log's file ends at its last record
    bq = BackingQueue(tmp_path)
    bq.ack([m.offset for m in bq.fetch(2)])  # two more records: DELIVER, ACK
    bq.close()
    path = tmp_path / segment_name(0)
    os.truncate(path, os.path.getsize(path) - 2)  # tear the ACK
    with caplog.at_level(logging.WARNING, logger="mirrorq.backing_queue"):
        bq = BackingQueue(tmp_path)
    assert any("torn tail" in r.getMessage() for r in caplog.records)
    assert bq.ready_offsets() == offs[2:] and bq.unacked_offsets() == offs[:2]  # the DELIVER survived
    assert os.path.getsize(path) > size
    bq.requeue(offs[:2])
    bq.close()
    assert BackingQueue(tmp_path).ready_offsets() == offs


# ---------------------------------------------------------------- mirrors


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"seed={s}")
def test_mirror_applying_the_masters_records_matches(tmp_path, seed):
    rng = random.Random(seed)
    master = BackingQueue(tmp_path / "master", segment_bytes=1024)
    mirror = BackingQueue(tmp_path / "mirror", segment_bytes=1024)
    late = None  # a mirror that joins later and syncs from an offset
    n = 0
    for step in range(150):
        r = rng.random()
        if r < 0.45:
            master.publish(f"m{n}", body_of(n, rng.randint(0, 40)), {"k": n}, rng.random() < 0.8)
            n += 1
        elif r < 0.65:
            master.fetch(rng.randint(1, 3), ack_required=rng.random() < 0.8)
        elif r < 0.8 and master.unacked_count:
            u = master.unacked_offsets()
            master.ack(rng.sample(u, rng.randint(1, len(u))))
        elif r < 0.9 and master.unacked_count:
            master.requeue([rng.choice(master.unacked_offsets())])
        elif r < 0.93:
            master.purge()
        elif r < 0.95:
            master.drop_transient()
        elif r < 0.97:
            pub = ("fe", rng.randint(1, 3))
            if rng.random() < 0.8:
                master.refuse(pub, sorted(rng.sample(range(1, 200), rng.randint(1, 4))))
            else:
                master.forget_refused(pub)
        else:
            master.flush()
        # the relay: ops flow by offset, in order, possibly repeated
        for off, rec in master.log.read_from(mirror.log.next_offset, include_pending=True):
            assert mirror.apply(rec, off) == off
            assert mirror.apply(rec, off) is None  # a repeat is harmless
        if step == 60:
            master.flush()
            late = BackingQueue(None, durable=False)
            start = master.log.next_offset
            # sync by offset: the late mirror copies the master's log from its start
            for off, rec in master.log.read_from(0):
                late.replay(rec, off)
            assert late.log.next_offset == start
        if late is not None:
            for off, rec in master.log.read_from(late.log.next_offset, include_pending=True):
                late.apply(rec, off)
            assert snapshot(late) == snapshot(master)
        assert snapshot(mirror) == snapshot(master)
        assert mirror.log.next_offset == master.log.next_offset
    master.close()
    mirror.close()
    assert snapshot(BackingQueue(tmp_path / "mirror", segment_bytes=1024)) == snapshot(
        BackingQueue(tmp_path / "master", segment_bytes=1024)
    )


def test_replay_of_a_compacted_log_skips_messages_compacted_away(tmp_path):
    master = BackingQueue(tmp_path / "m", segment_bytes=300)
    gone = publish_n(master, 12, start=1, size=50)
    keep = master.publish("keep", body_of(0, 50))
    master.fetch(13)
    master.flush()
    master.ack(gone)
    master.compact()
    assert gone[0] < master.log.first_offset  # publishes of `gone` were compacted away
    records = master.log.read_from(0)
    strict = BackingQueue(None, durable=False)
    with pytest.raises(UnknownMessage):
        for off, rec in records:
            strict.apply(rec, off)
    late = BackingQueue(None, durable=False)
    for off, rec in records:
        late.replay(rec, off)
    assert snapshot(late) == snapshot(master) and late.unacked_offsets() == [keep]
    assert late.log.read_from(0, include_pending=True) == records  # stored unchanged, same offsets
    master.close()


def test_apply_refuses_a_diverged_op_and_writes_nothing(tmp_path):
    with BackingQueue(tmp_path) as bq:
        o = bq.apply(Record(Op.PUBLISH, ["x", b"1", {}, True]), 10)
        assert o == 10 and bq.log.next_offset == 11
        with pytest.raises(InvalidOperation, match="ready"):
            bq.apply((Op.ACK, [[10]]), 11)
        with pytest.raises(UnknownMessage):
            bq.apply((Op.DELIVER, [[3], True]), 11)
        assert bq.log.next_offset == 11 and bq.ready_offsets() == [10]


# ------------------------------------------------- model-based (hypothesis)


class Model:
    """The obvious in-memory queue: what the store must behave like."""

    def __init__(self):
        self.msgs = {}  # offset -> [msg_id, body, props, persistent, delivered, unacked]
        self.next = 0

    def ready(self):
        return sorted(o for o, m in self.msgs.items() if not m[5])

    def unacked(self):
        return sorted(o for o, m in self.msgs.items() if m[5])

    def message(self, o):
        m = self.msgs[o]
        return Message(o, m[0], m[1], m[2], m[3], m[4])


publish = st.tuples(st.just("publish"), st.integers(0, 60), st.booleans())
fetch = st.tuples(st.just("fetch"), st.integers(1, 4), st.booleans())
ack = st.tuples(st.just("ack"), st.integers(0, 50), st.integers(1, 3))
# weighted towards the common path (publish, fetch, ack) so segments fill,
# die and get compacted; the rarer operations and restarts are sprinkled in
ops = st.one_of(
    publish,
    publish,
    publish,
    fetch,
    fetch,
    ack,
    ack,
    st.tuples(st.just("requeue"), st.integers(0, 50), st.integers(1, 3)),
    st.tuples(st.sampled_from(["purge", "drop_transient", "requeue_unacked", "bad_ack"])),
    st.tuples(st.sampled_from(["flush", "reopen", "crash", "compact"])),
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=20, max_size=120), st.sampled_from([100, 250, 4096]))
def test_against_model_with_reopens_and_crashes(script, segment_bytes):
    with tempfile.TemporaryDirectory() as d:

        def open_bq():
            return BackingQueue(d, segment_bytes=segment_bytes, fsync=False)

        bq = open_bq()
        model, durable = Model(), Model()
        n = 0
        for step in script:
            kind = step[0]
            if kind == "publish":
                o = bq.publish(f"m{n}", body_of(n, step[1]), {"n": n}, step[2])
                assert o == model.next
                model.msgs[o] = [f"m{n}", body_of(n, step[1]), {"n": n}, step[2], False, False]
                model.next += 1
                n += 1
            elif kind == "fetch":
                want = model.ready()[: step[1]]
                got = bq.fetch(step[1], ack_required=step[2])
                assert got == [model.message(o) for o in want]
                for o in want:
                    if step[2]:
                        model.msgs[o][4] = model.msgs[o][5] = True
                    else:
                        del model.msgs[o]
                model.next += bool(want)
            elif kind in ("ack", "requeue"):
                u = model.unacked()
                if not u:
                    continue
                pick = sorted({u[(step[1] + i * 7) % len(u)] for i in range(step[2])})
                getattr(bq, kind)(pick)
                for o in pick:
                    if kind == "ack":
                        del model.msgs[o]
                    else:
                        model.msgs[o][5] = False
                model.next += 1
            elif kind == "purge":
                r = model.ready()
                assert bq.purge() == len(r)
                for o in r:
                    del model.msgs[o]
                model.next += bool(r)
            elif kind == "drop_transient":
                t = [o for o, m in model.msgs.items() if not m[3]]
                assert bq.drop_transient() == len(t)
                for o in t:
                    del model.msgs[o]
                model.next += bool(t)
            elif kind == "requeue_unacked":
                u = model.unacked()
                assert bq.requeue_unacked() == len(u)
                for o in u:
                    model.msgs[o][5] = False
                model.next += bool(u)
            elif kind == "bad_ack":
                r = model.ready()
                if r:
                    with pytest.raises(InvalidOperation):
                        bq.ack([r[0]])
            elif kind in ("flush", "compact"):
                bq.flush() if kind == "flush" else bq.compact()
                durable = copy.deepcopy(model)
            elif kind == "reopen":
                bq.close()
                durable = copy.deepcopy(model)
                bq = open_bq()
            elif kind == "crash":
                bq.close(flush=False)
                model = copy.deepcopy(durable)
                bq = open_bq()
            # the store and the model agree after every step
            assert bq.ready_offsets() == model.ready()
            assert bq.unacked_offsets() == model.unacked()
            assert (bq.message_count, bq.ready_count, bq.unacked_count) == (
                len(model.msgs),
                len(model.ready()),
                len(model.unacked()),
            )
            assert bq.log.next_offset == model.next
        # full comparison, including bodies and flags, after a final reopen
        bq.close()
        bq = open_bq()
        assert bq.peek(bq.ready_count) == [model.message(o) for o in model.ready()]
        assert [bq.get(o) for o in bq.unacked_offsets()] == [model.message(o) for o in model.unacked()]
        live = list(model.msgs)
        assert bq.log.first_offset <= min(live, default=model.next)
        bq.close()


def test_flush_turn_fsyncs_only_for_records_that_carry_a_promise(tmp_path, fsyncs):
    bq = BackingQueue(tmp_path / "q")
    for i in range(3):
        bq.publish(f"m{i}", b"x")
    fsyncs.clear()
    bq.flush_turn()
    assert len(fsyncs) == 1  # publishes: a confirm waits for them
    msgs = bq.fetch(3)
    fsyncs.clear()
    bq.flush_turn()
    bq.ack([msgs[0].offset])
    bq.requeue([msgs[1].offset])
    bq.flush_turn()
    assert fsyncs == []  # deliveries, acks, requeues: written, fsync'd later
    assert bq.log.flushed_offset == bq.log.next_offset  # written (a process crash loses nothing)
    bq.publish("m3", b"x")
    bq.flush_turn()
    assert len(fsyncs) == 1  # one fsync covers the publish and everything written before
    bq.refuse(("fe", 1), [9])
    fsyncs.clear()
    bq.flush_turn()
    assert len(fsyncs) == 1  # a refusal: a nack waits for it
    bq.ack([msgs[2].offset])
    bq.flush_turn()
    fsyncs.clear()
    bq.close()
    assert len(fsyncs) == 1  # close fsyncs what flush_turn only wrote
    again = BackingQueue(tmp_path / "q")
    assert again.ready_count == 2 and again.unacked_count == 0  # m1 requeued, m3; m0 and m2 acked


def test_flush_turn_survives_a_process_crash(tmp_path):
    bq = BackingQueue(tmp_path / "q")
    bq.publish("a", b"x")
    bq.flush_turn()
    (m,) = bq.fetch(1)
    bq.ack([m.offset])
    bq.flush_turn()  # written, not fsync'd
    bq._log._release()  # the process dies: no close, no flush (the page cache keeps what was written)
    again = BackingQueue(tmp_path / "q")
    assert again.message_count == 0


# ---- priority queues (x-max-priority) ----------------------------------------------------------
def _pub(bq, mid, prio=None):
    props = {} if prio is None else {"_pr": prio}
    return bq.publish(mid, mid.encode(), props)


def test_priority_levels_go_out_highest_first_each_in_fifo_order_and_survive_reopen(tmp_path):
    bq = BackingQueue(tmp_path, max_priority=5)
    for mid, p in [("a", None), ("b", 3), ("c", 9), ("d", 3), ("e", 0), ("f", 5), ("g", -2)]:
        _pub(bq, mid, p)
    want = ["c", "f", "b", "d", "a", "e", "g"]  # 9 counts as the maximum (5); none / 0 / negative are 0
    assert [m.msg_id for m in bq.peek(7)] == want
    bq.flush()
    bq.close()
    bq = BackingQueue(tmp_path, max_priority=5)
    assert [m.msg_id for m in bq.peek(7)] == want
    got = bq.fetch(3)
    assert [m.msg_id for m in got] == ["c", "f", "b"]
    bq.requeue([got[2].offset, got[0].offset])  # back at their places within their levels
    assert [m.msg_id for m in bq.peek(7)] == ["c", "b", "d", "a", "e", "g"]  # f is still unacked
    bq.close()


def test_a_mirror_applying_the_masters_records_orders_priorities_the_same(tmp_path):
    master = BackingQueue(tmp_path / "m", max_priority=3)
    mirror = BackingQueue(tmp_path / "r", max_priority=3)
    master.on_append = lambda off, rtype, body: mirror.apply((rtype, body), off)
    rng = random.Random(5)
    for i in range(200):
        _pub(master, f"m{i}", rng.choice([None, 0, 1, 2, 3, 7]))
        if rng.random() < 0.3:
            got = master.fetch(rng.randint(1, 3))
            if got and rng.random() < 0.5:
                master.requeue([m.offset for m in got])
            elif got:
                master.ack([m.offset for m in got])
    assert [m.msg_id for m in mirror.peek(500)] == [m.msg_id for m in master.peek(500)]
    assert mirror.ready_count == master.ready_count
    ids = [m.msg_id for m in master.peek(500)]
    levels = [
        min(3, max(0, p)) if isinstance(p, int) else 0 for p in (master.get(i).properties.get("_pr") for i in ids)
    ]
    assert levels == sorted(levels, reverse=True)
    master.close()
    mirror.close()


def test_max_priority_is_checked():
    with pytest.raises(ValueError, match="max_priority"):
        BackingQueue(None, durable=False, max_priority=256)
    with pytest.raises(ValueError, match="max_priority"):
        BackingQueue(None, durable=False, max_priority=True)


# ---- the body cache -------------------------------------------------------------------------------
def _count_reads(bq):
    reads = []
    real = bq.log.read_many
    bq.log.read_many = lambda offs: reads.append(list(offs)) or real(offs)
    return reads


def test_recent_bodies_are_delivered_from_memory_within_the_budget(tmp_path):
    cache = BodyCache(16 * 1300)
    bq = BackingQueue(tmp_path, body_cache=cache)
    for i in range(10):
        bq.publish(f"m{i}", bytes([i]) * 1000)
    bq.flush()
    reads = _count_reads(bq)
    got = bq.fetch(10)
    assert [m.body for m in got] == [bytes([i]) * 1000 for i in range(10)]
    assert reads == []  # all ten from memory
    later = [bq.publish(f"m{i}", bytes([i]) * 1000) for i in range(10, 40)]  # 30 more: past the budget
    bq.flush()
    assert cache.bytes <= cache.max_bytes and cache.entries == 16
    bq.requeue([m.offset for m in got])
    again = bq.fetch(40)
    assert [m.body for m in again] == [bytes([i]) * 1000 for i in range(40)]
    assert reads == [later[6:]]  # the head stayed in memory; the newest 24, read back in one batch
    before = cache.bytes
    bq.ack([m.offset for m in again[:5]])
    assert cache.bytes == before - 5 * (1000 + 256)
    bq.close()
    assert cache.bytes == 0 and cache.entries == 0


def test_a_backlog_past_the_budget_keeps_its_head_cached_and_others_evict_its_newest(tmp_path):
    cache = BodyCache(64 * 1300)
    stuck = BackingQueue(tmp_path / "stuck", body_cache=cache)
    live = BackingQueue(tmp_path / "live", body_cache=cache)
    offsets = [stuck.publish(f"s{i}", b"s" * 1000) for i in range(100)]  # nobody consumes it
    assert cache.entries == 66 and all(o in stuck._cached for o in offsets[:66])
    for i in range(40):  # a queue whose consumer keeps up: it takes room from the biggest queue's tail
        live.publish(f"l{i}", b"l" * 1000)
        live.ack([m.offset for m in live.fetch(1)])
    assert live.fetch(1) == [] and cache.bytes <= cache.max_bytes
    for i in range(20):  # a backlog of its own, smaller than the stuck queue's: still cached
        live.publish(f"b{i}", b"b" * 1000)
    assert len(live._cached) == 20 and all(o in stuck._cached for o in offsets[:40])
    reads = _count_reads(stuck)
    assert [m.body for m in stuck.fetch(40)] == [b"s" * 1000] * 40 and reads == []  # the stuck queue's head
    stuck.close()
    live.close()
    assert cache.bytes == 0 and cache.entries == 0


def test_read_many_reads_nearby_records_in_one_read_and_keeps_the_order_asked(tmp_path):
    bq = BackingQueue(tmp_path, body_cache=BodyCache(0))  # nothing cached: every body from the log
    offs = [bq.publish(f"m{i}", bytes([i]) * 100) for i in range(50)]
    bq.flush()
    preads = []
    import mirrorq.store.segment_log as sl

    real = sl._pread_all
    sl._pread_all = lambda pread, fd, n, at, path: preads.append(n) or real(pread, fd, n, at, path)
    try:
        picked = [offs[7], offs[3], offs[40], offs[3]]
        assert [r.body[0] for r in bq.log.read_many(picked)] == ["m7", "m3", "m40", "m3"]
        assert len(preads) == 1
        with pytest.raises(KeyError, match="no record at offset"):
            bq.log.read_many([offs[0], 10**9])
    finally:
        sl._pread_all = real
    bq.close()


def test_a_mirror_caches_nothing_and_a_huge_body_is_not_cached(tmp_path):
    cache = BodyCache(1 << 20)
    mirror = BackingQueue(tmp_path / "r", body_cache=cache)
    master = BackingQueue(tmp_path / "m", body_cache=cache, on_append=lambda o, t, b: mirror.apply((t, b), o))
    master.publish("small", b"x" * 100)
    master.publish("huge", b"y" * (1 << 17))  # above max_bytes / 16
    assert cache.bytes == 100 + 256 and mirror.peek(2)[1].body == b"y" * (1 << 17)
    master.close()
    mirror.close()
    assert cache.bytes == 0


def test_the_cache_order_does_not_grow_with_messages_long_gone(tmp_path):
    cache = BodyCache(1 << 20)
    bq = BackingQueue(None, durable=False, body_cache=cache)
    bq.publish("keep", b"k")  # stays unacked at the head of the age order
    kept = bq.fetch(1)
    for i in range(20_000):  # published and acked one by one: within the budget, never evicted
        bq.publish(f"m{i}", b"x" * 10)
        bq.ack([m.offset for m in bq.fetch(1)])
    assert cache.entries == 1 and cache.bytes == 1 + 256
    assert bq.get(kept[0].offset).body == b"k"
    bq.close()
    assert cache.entries == 0 and cache.bytes == 0


# ------------------------------------------------------------- refused publishes (REFUSED records)

PUB = ("fe", 7)


def test_refused_seqs_are_kept_as_runs_and_bounded(tmp_path):
    from mirrorq.classic.backing_queue import MAX_REFUSED_RUNS

    with BackingQueue(tmp_path) as bq:
        assert bq.refuse(PUB, [1, 2, 3]) is not None
        assert bq.refused_runs(PUB) == [[1, 3]]
        bq.refuse(["fe", 7], [5])  # a channel id as msgpack hands it over
        assert bq.refused_runs(PUB) == [[1, 3], [5, 5]]
        bq.refuse(PUB, [4])
        assert bq.refused_runs(PUB) == [[1, 5]]
        before = bq.log.next_offset
        assert bq.refuse(PUB, [2, 5]) is None and bq.log.next_offset == before  # known: nothing written
        assert bq.was_refused(PUB, 3) and not bq.was_refused(PUB, 6) and not bq.was_refused(("fe", 8), 3)
        assert bq.message_count == 0 and bq.refused_publishers() == [PUB]  # no message, no count
        # one run per refusal when refusals and acceptances alternate: the lowest go first
        n = MAX_REFUSED_RUNS + 5
        for k in range(n):
            bq.refuse(PUB, [10 + 2 * k])
        runs = bq.refused_runs(PUB)
        assert len(runs) == MAX_REFUSED_RUNS and runs[-1] == [10 + 2 * (n - 1)] * 2
        assert runs[0] == [10 + 2 * (n - MAX_REFUSED_RUNS)] * 2 and not bq.was_refused(PUB, 1)
        top = 10 + 2 * (n - 1)
        assert bq.was_refused(PUB, top) and bq.was_refused(PUB, top - 2) and not bq.was_refused(PUB, top - 1)
        assert not bq.was_refused(PUB, top + 1) and not bq.was_refused(PUB, runs[0][0] - 2)
        assert bq.forget_refused(PUB) is not None and bq.refused_publishers() == []
        assert bq.forget_refused(PUB) is None


def test_refusals_survive_a_reopen_and_a_mirror_gets_the_same(tmp_path):
    master = BackingQueue(tmp_path / "m")
    mirror = BackingQueue(None, durable=False)
    publish_n(master, 3)
    master.refuse(PUB, [4, 5])
    master.refuse(("fe", 8), [1])
    master.forget_refused(("fe", 8))
    master.refuse(("fe", 9), [2])
    for off, rec in master.log.read_from(0, include_pending=True):
        mirror.apply(rec, off)
    assert snapshot(mirror) == snapshot(master)
    want = {PUB: [[4, 5]], ("fe", 9): [[2, 2]]}
    assert snapshot(master)["refused"] == want
    master.flush_turn()  # a REFUSED record carries a promise: fsync'd
    master.close(flush=False)
    with BackingQueue(tmp_path / "m") as again:
        assert snapshot(again)["refused"] == want and again.message_count == 3


def test_bad_refused_records_are_refused(tmp_path):
    with BackingQueue(tmp_path) as bq:
        for body in (
            [["fe", 1], [[3, 2]]],
            [["fe", 1], [[0, 2]]],
            [["fe", 1], [[1, 2], [3, 4]]],
            [["fe", 1], [[5, 6], [1, 2]]],
            [["fe"], [[1, 1]]],
            [["fe", 1.5], [[1, 1]]],
            [["fe", 1], [[i, i] for i in range(1, 200, 2)]],
            [["fe", 1]],
        ):
            with pytest.raises(InvalidOperation):
                bq.apply((Op.REFUSED, body), bq.log.next_offset)
        with pytest.raises(InvalidOperation):
            bq.refuse(PUB, [0])
        assert bq.log.next_offset == 0 and bq.refused_publishers() == []


def _roll(bq, n=12, start=1000):
    """Publish and ack enough to fill segments: nothing of it stays live."""
    offsets = publish_n(bq, n, start=start, size=60)
    bq.fetch_at(offsets)
    bq.ack(offsets)


def test_compaction_keeps_the_current_refused_record_and_what_it_replaced(tmp_path):
    bq = BackingQueue(tmp_path, segment_bytes=400, auto_compact=False)
    first = bq.refuse(PUB, [1])
    old = bq.refuse(("fe", 8), [1, 2])
    _roll(bq)
    bq.compact()
    assert bq.log.first_offset <= first  # the segment holding the current records is kept
    bq.refuse(PUB, [3])  # replaces PUB's entry: its old record may go
    bq.forget_refused(("fe", 8))  # ... and so may ("fe", 8)'s
    _roll(bq, start=2000)
    bq.compact()
    assert bq.log.first_offset > old  # both old records compacted away
    want = {PUB: [[1, 1], [3, 3]]}
    assert snapshot(bq)["refused"] == want
    bq.close()
    with BackingQueue(tmp_path, segment_bytes=400, auto_compact=False) as again:
        assert snapshot(again)["refused"] == want  # the forgotten publisher does not come back


def test_a_forget_record_is_kept_while_the_record_it_replaced_is(tmp_path):
    """The segment of a replaced REFUSED record can be kept for another reason
    (a live message): the record that replaced it must be kept too, else a
    reopen would bring the old entry back."""
    bq = BackingQueue(tmp_path, segment_bytes=400, auto_compact=False)
    bq.refuse(PUB, [1, 2])
    keep = bq.publish("keep", body_of(0, 60))  # stays ready: its segment stays
    n = 0

    def unit() -> tuple[int, int]:  # a message published, delivered and acked: -> its first and last segment
        nonlocal n
        n += 1
        o = bq.publish(f"u{n}", body_of(n, 60))
        bq.fetch_at([o])
        bq.ack([o])
        return bq.log.segment_of(o), bq.log.segment_of(bq.log.next_offset - 1)

    # go on until a unit lies whole in a segment of its own: nothing there names an older segment
    seen = {bq.log.segment_of(keep)}
    while True:
        first, last = unit()
        if first == last and first not in seen:
            break
        seen |= {first, last}
    forget = bq.forget_refused(PUB)
    assert bq.log.segment_of(forget) == first  # the record that replaced PUB's is alone in naming the past
    while bq.log.segment_of(bq.log.next_offset - 1) == first:
        unit()
    unit()
    bq.compact()
    assert bq.log.first_offset <= keep and bq.log.segment_of(forget) is not None
    bq.close()
    with BackingQueue(tmp_path, segment_bytes=400, auto_compact=False) as again:
        assert again.refused_publishers() == [] and again.ready_offsets() == [keep]


def test_a_mirror_synced_from_a_compacted_log_gets_the_refusals(tmp_path):
    master = BackingQueue(tmp_path / "m", segment_bytes=400, auto_compact=False)
    master.refuse(("fe", 9), [4])
    _roll(master)
    master.refuse(PUB, [1, 2])
    master.refuse(("fe", 8), [4])
    _roll(master, start=2000)
    master.refuse(("fe", 8), [6])
    master.forget_refused(("fe", 9))
    _roll(master, start=3000)
    master.compact()
    assert master.log.first_offset > 0
    late = BackingQueue(tmp_path / "late", segment_bytes=400)
    pos = master.log.first_offset
    while pos < master.log.next_offset:  # sync's cheap path: raw bytes from first_offset
        raw = master.log.read_raw(pos, max_records=5, include_pending=True)
        late.replay_raw(raw.data)
        pos = raw.next_offset
    want = {PUB: [[1, 2]], ("fe", 8): [[4, 4], [6, 6]]}
    assert snapshot(late)["refused"] == snapshot(master)["refused"] == want
    late.close()
    with BackingQueue(tmp_path / "late", segment_bytes=400) as again:
        assert snapshot(again)["refused"] == want
    master.close()
