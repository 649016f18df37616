"""Raw record copy (sync's cheap path): SegmentLog.read_raw / check_raw /
append_raw and BackingQueue.replay_raw.

What must hold: a copy made by raw batches of any size holds exactly the
records (offsets, types, bodies) of the source, survives a reopen, and puts
the same queue state in the copy as replaying record by record; a bad batch
(framing, checksums, offsets) raises a clear error and appends nothing.
"""

from __future__ import annotations

import struct

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mirrorq.classic.backing_queue import BackingQueue, InvalidOperation, Op
from mirrorq.store.segment_log import (
    HEADER_SIZE,
    MAGIC_LEN,
    CorruptRecord,
    SegmentLog,
    encode_record,
)


def fill(log: SegmentLog, sizes: list[int], gaps: list[int], flush_every: int) -> None:
    for i, size in enumerate(sizes):
        gap = gaps[i % len(gaps)] if gaps else 0
        log.append([(1 + i % 5, {"i": i, "pad": b"p" * size})], at=log.next_offset + gap)
        if flush_every and i % flush_every == flush_every - 1:
            log.flush()


def copy_raw(src: SegmentLog, dst: SegmentLog, max_records, max_bytes, include_pending=True, flush=False) -> int:
    pos, until, batches = 0, src.next_offset, 0
    while pos < until:
        raw = src.read_raw(
            pos, max_records=max_records, max_bytes=max_bytes, until=until, include_pending=include_pending
        )
        assert raw.next_offset > pos, "read_raw must make progress"
        frames = dst.append_raw(raw.data)
        assert frames.count == raw.count
        if flush:
            dst.flush()
        pos = raw.next_offset
        batches += 1
    return batches


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 120), max_size=60),
    gaps=st.lists(st.sampled_from([0, 0, 0, 1, 7]), max_size=5),
    flush_every=st.sampled_from([0, 1, 4, 100]),
    src_seg=st.sampled_from([100, 300, 4096]),
    dst_seg=st.sampled_from([100, 300, 4096]),
    max_records=st.sampled_from([None, 1, 3, 50]),
    max_bytes=st.sampled_from([None, 1, 200, 5000]),
    memory=st.booleans(),
    flush_dst=st.booleans(),
)
def test_raw_copy_holds_the_same_records(
    tmp_path_factory, sizes, gaps, flush_every, src_seg, dst_seg, max_records, max_bytes, memory, flush_dst
):
    d = tmp_path_factory.mktemp("raw")
    src = SegmentLog(None if memory else d / "src", segment_bytes=src_seg, fsync=False)
    fill(src, sizes, gaps, flush_every)
    dst = SegmentLog(d / "dst", segment_bytes=dst_seg, fsync=False)
    copy_raw(src, dst, max_records, max_bytes, flush=flush_dst)
    want = src.read_from(0, include_pending=True)
    assert dst.read_from(0, include_pending=True) == want
    assert dst.next_offset == (want[-1][0] + 1 if want else 0)
    dst.close()
    reopened = SegmentLog(d / "dst", segment_bytes=dst_seg, fsync=False)  # recovery re-verifies every record
    assert reopened.read_from(0) == want
    reopened.close()
    src.close()


def test_read_raw_limits_and_positions(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=400)
    fill(log, [30] * 20, [], 0)
    log.flush()
    log.append([(2, "pending")])
    one = len(encode_record(0, 1, {"i": 0, "pad": b"p" * 30}))

    r = log.read_raw(0, max_records=5)
    assert (r.count, r.next_offset) == (5, 5)
    r = log.read_raw(3, max_bytes=2 * one + 1)  # whole records only
    assert (r.count, r.next_offset, len(r.data)) == (2, 5, 2 * len(encode_record(3, 4, {"i": 3, "pad": b"p" * 30})))
    r = log.read_raw(3, max_bytes=1)  # at least one record, whatever the budget
    assert (r.count, r.next_offset) == (1, 4)
    r = log.read_raw(0)  # flushed only, across segment files
    assert len(log.segment_bases) > 2
    assert (r.count, r.next_offset) == (20, 20)
    r = log.read_raw(0, include_pending=True)
    assert (r.count, r.next_offset) == (21, 21)
    r = log.read_raw(15, until=18)
    assert (r.count, r.next_offset) == (3, 18)
    r = log.read_raw(25, include_pending=True)
    assert (r.count, r.next_offset, r.data) == (0, 25, b"")


def test_read_raw_across_a_gap_and_a_deleted_segment(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=200)
    fill(log, [40] * 12, [0, 0, 5], 0)
    log.flush()
    first_base = log.segment_bases[0]
    log.delete_segment(first_base)
    first = log.first_offset
    r = log.read_raw(0)  # below first_offset: starts at the oldest record kept
    copy = SegmentLog(None)
    copy.append_raw(r.data)
    assert copy.read_from(0, include_pending=True) == log.read_from(0)
    assert copy.read_from(0, include_pending=True)[0][0] == first
    # a read that stops at a limit continues right after its last record, even across a gap
    r1 = log.read_raw(first, max_records=2)
    r2 = log.read_raw(r1.next_offset, max_records=2)
    got = [o for o, _ in log.read_from(first)]
    assert r1.next_offset == got[1] + 1 and r2.count == 2


@pytest.mark.parametrize("bad", ["bad_arg", "bad_max", "bad_until"])
def test_read_raw_bad_arguments(tmp_path, bad):
    log = SegmentLog(None)
    with pytest.raises(ValueError, match={"bad_arg": "offset", "bad_max": "max_records", "bad_until": "until"}[bad]):
        if bad == "bad_arg":
            log.read_raw(-1)
        elif bad == "bad_max":
            log.read_raw(0, max_records=0)
        else:
            log.read_raw(0, until="x")


def _header(length: int, rtype: int, offset: int, body: bytes) -> bytes:
    tail = struct.pack("<IBQI", length, rtype, offset, crc32c.crc32c(body))
    return struct.pack("<I", crc32c.crc32c(tail)) + tail


def _batch(start: int, n: int) -> bytes:
    return b"".join(encode_record(start + i, 1, {"i": start + i}) for i in range(n))


def _damaged(kind: str) -> tuple[bytes, type, str]:
    good = _batch(10, 3)
    second = len(encode_record(10, 1, {"i": 10}))
    if kind == "partial-header":
        return good + b"\x01\x02\x03", CorruptRecord, "partial record header"
    if kind == "body-past-end":
        return good[:-2], CorruptRecord, "runs past the end"
    if kind == "header-crc":
        b = bytearray(good)
        b[second + 5] ^= 0x40  # the second record's length field
        return bytes(b), CorruptRecord, "header CRC32C mismatch"
    if kind == "body-crc":
        b = bytearray(good)
        b[-1] ^= 0x01
        return bytes(b), CorruptRecord, "body CRC32C mismatch"
    if kind == "type-0":
        body = b"\x90"
        return good + _header(len(body), 0, 13, body) + body, CorruptRecord, "record type 0"
    if kind == "offset-taken":
        return _batch(2, 3), ValueError, "offsets below next_offset 10 are taken"
    if kind == "offset-backwards":
        return _batch(20, 2) + _batch(15, 1), ValueError, "offset 15 does not follow offset 21"
    if kind == "offset-repeats":
        return _batch(20, 2) + _batch(21, 1), ValueError, "offset 21 does not follow offset 21"
    raise AssertionError(kind)


KINDS = [
    "partial-header",
    "body-past-end",
    "header-crc",
    "body-crc",
    "type-0",
    "offset-taken",
    "offset-backwards",
    "offset-repeats",
]


@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory"])
@pytest.mark.parametrize("kind", KINDS)
def test_append_raw_refuses_a_bad_batch_and_appends_nothing(tmp_path, kind, memory):
    log = SegmentLog(None if memory else tmp_path, segment_bytes=300)
    log.append([(1, {"i": i}) for i in range(10)])
    log.flush()
    before = (log.next_offset, len(log), log.pending_bytes, log.segment_bases, log.read_from(0, include_pending=True))
    data, exc, message = _damaged(kind)
    with pytest.raises(exc, match=message):
        log.append_raw(data)
    assert (
        log.next_offset,
        len(log),
        log.pending_bytes,
        log.segment_bases,
        log.read_from(0, include_pending=True),
    ) == before
    log.append_raw(_batch(10, 3))  # the log is still usable
    log.flush()
    assert [o for o, _ in log.read_from(0)] == list(range(13))


def test_corrupt_record_names_source_and_position():
    data, _exc, _m = _damaged("body-crc")
    last = len(data) - len(encode_record(12, 1, {"i": 12}))
    with pytest.raises(CorruptRecord) as info:
        SegmentLog(None).check_raw(data, source="sync batch from q0")
    assert info.value.path == "sync batch from q0" and info.value.offset == last


def test_append_raw_checked_frames_go_stale_and_count_prefix(tmp_path):
    log = SegmentLog(tmp_path)
    frames = log.check_raw(_batch(0, 5))
    log.append([(1, "x")])
    with pytest.raises(ValueError, match="earlier state of the log"):
        log.append_raw(frames)
    frames = log.check_raw(_batch(1, 5))
    with pytest.raises(ValueError, match="count must be"):
        log.append_raw(frames, 6)
    log.append_raw(frames, 2)
    assert [o for o, _ in log.read_from(0, include_pending=True)] == [0, 1, 2]
    with pytest.raises(TypeError, match="must be bytes"):
        log.append_raw([1, 2])


def test_append_raw_rolls_segments_like_append(tmp_path):
    a = SegmentLog(tmp_path / "a", segment_bytes=MAGIC_LEN + 3 * (HEADER_SIZE + 40))
    b = SegmentLog(tmp_path / "b", segment_bytes=MAGIC_LEN + 3 * (HEADER_SIZE + 40))
    recs = [(1, b"x" * 37) for _ in range(10)]  # 40-byte bodies: 3 per segment
    a.append(recs)
    b.append_raw(b"".join(encode_record(i, 1, b"x" * 37) for i in range(10)))
    a.flush()
    b.flush()
    assert a.segment_bases == b.segment_bases == [0, 3, 6, 9]
    for base in a.segment_bases:
        name = f"{base:020d}.seg"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


# ---- BackingQueue.replay_raw -------------------------------------------------------------------


def _busy_queue(directory, rng_seed: int, n: int = 250) -> BackingQueue:
    import random

    rng = random.Random(rng_seed)
    q = BackingQueue(directory, segment_bytes=rng.choice([300, 1500]), fsync=False)
    for i in range(n):
        x = rng.random()
        if x < 0.5:
            q.publish(f"m{i}", b"b" * rng.randint(0, 40), {"k": i} if i % 7 == 0 else None, rng.random() < 0.8)
        elif x < 0.7 and q.ready_count:
            q.fetch(rng.randint(1, 3), ack_required=rng.random() < 0.9)
        elif x < 0.85 and q.unacked_count:
            q.ack(rng.sample(q.unacked_offsets(), 1))
        elif x < 0.97 and q.unacked_count:
            q.requeue(q.unacked_offsets()[:2])
        elif x >= 0.97:
            q.purge()
        if rng.random() < 0.2:
            q.flush()
    q.flush()
    return q


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"seed={s}")
def test_replay_raw_gives_the_state_of_replay(tmp_path, seed):
    """From a master whose log was compacted (references to compacted
    messages are skipped), copied in raw batches of varying size: same
    queue state and same records as replay() record by record, also after
    reopening."""
    master = _busy_queue(tmp_path / "m", seed)
    assert master.log.first_offset > 0, "the master's log must be compacted for this test to mean something"
    one = BackingQueue(tmp_path / "one", fsync=False)
    for off, rec in master.log.read_from(0):
        one.replay(rec, off)
    raw = BackingQueue(tmp_path / "raw", segment_bytes=700, fsync=False)
    pos, sizes = 0, [1, 9, 40, 1000]
    k = 0
    while pos < master.log.next_offset:
        r = master.log.read_raw(pos, max_records=sizes[k % 4])
        assert raw.replay_raw(r.data) == r.count
        pos, k = r.next_offset, k + 1
    for q in (one, raw):
        assert q.ready_offsets() == master.ready_offsets()
        assert q.unacked_offsets() == master.unacked_offsets()
        assert [m.body for m in q.peek(q.ready_count)] == [m.body for m in master.peek(master.ready_count)]
    assert raw.log.read_from(0, include_pending=True) == one.log.read_from(0, include_pending=True)
    raw.close()
    again = BackingQueue(tmp_path / "raw", segment_bytes=700, fsync=False)
    assert again.ready_offsets() == master.ready_offsets() and again.unacked_offsets() == master.unacked_offsets()


def test_replay_raw_installs_the_prefix_before_an_invalid_operation(tmp_path):
    q = BackingQueue(tmp_path, fsync=False)
    data = (
        encode_record(0, int(Op.PUBLISH), ["a", b"1", {}, True])
        + encode_record(1, int(Op.PUBLISH), ["b", b"2", {}, True])
        + encode_record(2, int(Op.PUBLISH), ["a", b"3", {}, True])  # msg_id "a" is live: invalid
        + encode_record(3, int(Op.PUBLISH), ["c", b"4", {}, True])
    )
    with pytest.raises(InvalidOperation, match="msg_id 'a' is already live"):
        q.replay_raw(data)
    assert q.ready_offsets() == [0, 1] and q.log.next_offset == 2
    assert [o for o, _ in q.log.read_from(0, include_pending=True)] == [0, 1]


def test_replay_raw_bad_batch_changes_nothing(tmp_path):
    q = BackingQueue(tmp_path, fsync=False)
    q.publish("x", b"1")
    data = bytearray(encode_record(5, int(Op.PUBLISH), ["y", b"2", {}, True]) + encode_record(6, int(Op.ACK), [[0]]))
    data[-1] ^= 0xFF
    with pytest.raises(CorruptRecord, match="body CRC32C mismatch"):
        q.replay_raw(bytes(data), source="batch 7")
    assert q.ready_offsets() == [0] and q.log.next_offset == 1


def test_retain_from_keeps_segments_a_transfer_still_reads(tmp_path):
    q = BackingQueue(tmp_path, segment_bytes=300, fsync=False)
    for i in range(40):
        q.publish(f"m{i}", b"x" * 20)
    q.flush()
    bases = q.log.segment_bases
    assert len(bases) > 4
    q.retain_from = bases[2]  # a transfer reads from the third segment on
    q.fetch(40, ack_required=False)
    q.flush()
    assert q.log.segment_bases[0] == bases[2], "segments below the transfer may go, the rest must stay"
    q.retain_from = None
    q.compact()
    assert q.log.segment_bases[0] > bases[2]
