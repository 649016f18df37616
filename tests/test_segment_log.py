"""SegmentLog: format, group fsync, offsets, torn tails and corruption."""

from __future__ import annotations

import logging
import os

import pytest

from mirrorq import preallocate
from mirrorq.store import segment_log as sl
from mirrorq.store.segment_log import (
    HEADER_SIZE,
    MAGIC_LEN,
    CorruptRecord,
    LogClosed,
    Record,
    SegmentLog,
    StoreError,
    segment_name,
)

LOGGER = "mirrorq.backing_queue"


def recs(n, start=0, size=10):
    return [(1 + i % 3, {"i": start + i, "pad": b"x" * size}) for i in range(n)]


def seg_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".seg"))


@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory"])
def test_append_flush_read_roundtrip(tmp_path, memory):
    log = SegmentLog(None if memory else tmp_path, segment_bytes=400)
    written = recs(50)
    offsets = log.append(written[:20]) + log.append(written[20:])
    assert offsets == list(range(50))
    assert log.next_offset == 50 and log.flushed_offset == 0
    assert log.read_from(0) == []  # nothing flushed yet: readers see only durable records
    assert [o for o, _ in log.read_from(0, include_pending=True)] == offsets
    log.flush()
    assert log.flushed_offset == 50
    got = log.read_from(0)
    assert [o for o, _ in got] == offsets
    assert [tuple(r) for _, r in got] == [(t, b) for t, b in written]
    assert all(isinstance(r, Record) for _, r in got)
    assert len(log.segment_bases) > 3  # it rolled
    assert log.read_at(33) == Record(*written[33])
    log.close()


def test_read_from_returns_exactly_the_records_from_offset(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=300)
    log.append(recs(40))
    log.flush()
    log.append(recs(5, start=40))  # pending tail
    for start in (0, 1, 7, 17, 39, 40, 44, 45, 100):
        got = log.read_from(start)
        assert [o for o, _ in got] == list(range(start, 40))
        assert [r.body["i"] for _, r in got] == list(range(start, 40))
        got = log.read_from(start, include_pending=True)
        assert [o for o, _ in got] == list(range(start, 45))
    for start, n in ((0, 0), (3, 1), (5, 12), (38, 10)):
        assert [o for o, _ in log.read_from(start, n)] == list(range(start, min(start + n, 40)))
    log.close()


def test_segments_named_by_first_offset_and_bounded(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=500)
    log.append(recs(60))
    log.flush()
    names = seg_files(tmp_path)
    assert names == [segment_name(b) for b in log.segment_bases]
    for name in names:
        first = int(name[:-4])
        assert log.read_from(first, 1)[0][0] == first
        assert os.path.getsize(tmp_path / name) <= 500
    log.close()


def test_group_fsync_one_per_batch(tmp_path, fsyncs):
    log = SegmentLog(tmp_path, segment_bytes=16 * 1024 * 1024)
    fsyncs.clear()
    for batch in range(3):
        for _i in range(100):
            log.append([(1, b"y" * 1024)] * 10)
        assert len(fsyncs) == batch  # append never syncs
        log.flush()
        assert len(fsyncs) == batch + 1  # 1000 records, one fsync
        assert log.flushed_offset == 1000 * (batch + 1)
    log.flush()  # nothing buffered: no fsync
    assert len(fsyncs) == 3
    log.close()
    assert len(fsyncs) == 3


def test_flush_across_a_roll_fsyncs_old_new_and_directory(tmp_path, fsyncs):
    log = SegmentLog(tmp_path, segment_bytes=4200)
    log.append([(1, b"z" * 1000)] * 3)
    log.flush()
    fsyncs.clear()
    log.append([(1, b"z" * 1000)] * 2)  # one fits, one opens a new segment
    log.flush()
    assert len(log.segment_bases) == 2
    assert len(fsyncs) == 3  # old segment, new segment, directory
    log.close()


def test_an_unsynced_flush_across_a_roll_still_fsyncs_the_old_segment_before_the_new_exists(tmp_path, fsyncs):
    """Else a machine crash could keep the new segment and lose the old one's
    tail: a torn record in a segment that is not the last, which recovery
    refuses (CorruptRecord).  Found by the simulated disk (tests/test_simdisk.py,
    the segment log's crash test, seed 2 and 18 others of the first 150)."""
    log = SegmentLog(tmp_path, segment_bytes=4200)
    fsyncs.clear()  # (creating the log synced its first segment)
    log.append([(1, b"z" * 1000)] * 3)
    log.flush(sync=False)  # the old segment is written, not synced
    assert fsyncs == []
    log.append([(1, b"z" * 1000)] * 2)  # one fits, one opens a new segment
    log.flush(sync=False)
    assert len(log.segment_bases) == 2
    assert len(fsyncs) == 2  # the old segment (before the new was created), the directory
    new = log.take_unsynced()
    assert len(new) == 1 and new[0] not in fsyncs  # the new segment is the caller's to sync
    log.close()


def test_no_fsync_when_disabled(tmp_path, fsyncs):
    log = SegmentLog(tmp_path, fsync=False)
    log.append(recs(100))
    log.flush()
    log.close()
    assert fsyncs == []


def test_reopen_keeps_offsets_and_records(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=300)
    log.append(recs(30))
    log.close()
    seen = []
    log = SegmentLog(tmp_path, segment_bytes=300, on_record=lambda o, r, b: seen.append((o, r, b)))
    assert [o for o, _, _ in seen] == list(range(30))
    assert all(log.segment_of(o) == b for o, _, b in seen)
    assert log.next_offset == 30 and log.first_offset == 0
    assert log.append(recs(1)) == [30]
    log.close()


def test_unflushed_records_are_lost_on_crash_but_never_exposed(tmp_path):
    log = SegmentLog(tmp_path)
    log.append(recs(5))
    log.flush()
    log.append(recs(5, start=5))
    assert [o for o, _ in log.read_from(0)] == [0, 1, 2, 3, 4]
    log.close(flush=False)
    log = SegmentLog(tmp_path)
    assert log.next_offset == 5
    assert [r.body["i"] for _, r in log.read_from(0)] == [0, 1, 2, 3, 4]
    log.close()


def test_append_at_keeps_a_masters_numbering(tmp_path):
    log = SegmentLog(tmp_path)
    assert log.append(recs(2), at=100) == [100, 101]
    assert log.first_offset == 100
    with pytest.raises(ValueError, match="101"):
        log.append(recs(1), at=101)
    log.close()
    log = SegmentLog(tmp_path)
    assert log.next_offset == 102
    assert log.read_from(0)[0][0] == 100
    log.close()


def test_bad_records_append_nothing(tmp_path):
    log = SegmentLog(tmp_path)
    with pytest.raises(ValueError, match="1..255"):
        log.append([(1, "ok"), (0, "bad type")])
    with pytest.raises(ValueError, match="1..255"):
        log.append([(256, "bad type")])
    with pytest.raises(TypeError, match="msgpack"):
        log.append([(1, "ok"), (2, {1, 2, 3})])
    with pytest.raises(TypeError, match="pair"):
        log.append([5])
    assert log.next_offset == 0 and len(log) == 0
    with pytest.raises(ValueError):
        SegmentLog(tmp_path / "other", segment_bytes=10)
    log.close()
    with pytest.raises(LogClosed):
        log.append(recs(1))


def test_directory_is_locked(tmp_path):
    log = SegmentLog(tmp_path)
    with pytest.raises(StoreError, match="already open"):
        SegmentLog(tmp_path)
    log.close()
    SegmentLog(tmp_path).close()


def test_delete_segment_keeps_offsets_monotonic(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=300)
    log.append(recs(40))
    log.flush()
    bases = log.segment_bases
    with pytest.raises(ValueError, match="active"):
        log.delete_segment(bases[-1])
    for b in bases[:-1]:
        log.delete_segment(b)
    assert seg_files(tmp_path) == [segment_name(bases[-1])]
    assert log.first_offset == bases[-1]
    assert log.read_from(0)[0][0] == bases[-1]
    log.close()
    log = SegmentLog(tmp_path, segment_bytes=300)
    assert log.next_offset == 40 and log.first_offset == bases[-1]
    assert log.append(recs(1)) == [40]
    log.close()


# --------------------------------------------------------------- damage


def _layout(tmp_path, n=8, segment_bytes=16 * 1024 * 1024):
    """A log of ``n`` records; returns the record start positions of the last segment."""
    log = SegmentLog(tmp_path, segment_bytes=segment_bytes)
    log.append(recs(n, size=30))
    log.close()
    path = tmp_path / segment_name(0)
    data = path.read_bytes()
    positions = []
    pos = MAGIC_LEN
    while pos < len(data):
        positions.append(pos)
        length = int.from_bytes(data[pos + 4 : pos + 8], "little")
        pos += HEADER_SIZE + length
    assert len(positions) == n
    return path, positions


def _flip(path, pos):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x40
    path.write_bytes(bytes(data))


# byte offsets inside a record: header CRC, length, type, offset, body CRC, body
@pytest.mark.parametrize(
    "delta", [0, 5, 8, 12, 18, HEADER_SIZE + 3], ids=["hcrc", "length", "rtype", "offset", "bcrc", "body"]
)
@pytest.mark.parametrize("victim", [0, 3, 6])
def test_flipped_byte_mid_segment_is_reported(tmp_path, victim, delta):
    path, positions = _layout(tmp_path)
    _flip(path, positions[victim] + delta)
    with pytest.raises(CorruptRecord) as info:
        SegmentLog(tmp_path)
    err = info.value
    assert err.path == str(path) and err.offset == positions[victim]
    assert str(path) in str(err) and f"byte offset {positions[victim]}" in str(err)


def test_flipped_byte_in_an_older_segment_is_reported(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=300)
    log.append(recs(30))
    log.close()
    first = tmp_path / seg_files(tmp_path)[0]
    _flip(first, os.path.getsize(first) - 2)  # body of the segment's last record
    with pytest.raises(CorruptRecord, match=str(first)):
        SegmentLog(tmp_path)


def test_torn_tail_in_an_older_segment_is_reported(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=300)
    log.append(recs(30))
    log.close()
    first = tmp_path / seg_files(tmp_path)[0]
    os.truncate(first, os.path.getsize(first) - 3)
    with pytest.raises(CorruptRecord, match="runs past the end"):
        SegmentLog(tmp_path)


def test_truncated_tail_recovers_up_to_last_good_record(tmp_path, caplog):
    path, positions = _layout(tmp_path)
    full = path.read_bytes()
    last = positions[-1]
    for cut in range(last + 1, len(full)):  # every possible tear inside the last record
        path.write_bytes(full[:cut])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            log = SegmentLog(tmp_path)
        assert any("torn tail" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
        assert log.next_offset == 7
        assert [r.body["i"] for _, r in log.read_from(0)] == list(range(7))
        log.close()
        assert os.path.getsize(path) == last  # truncated on disk
    # and the log continues after the last good record
    log = SegmentLog(tmp_path)
    assert log.append([(1, "after")]) == [7]
    log.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log = SegmentLog(tmp_path)
    assert not caplog.records
    assert log.read_at(7) == Record(1, "after")
    log.close()


@pytest.mark.parametrize("damage", ["bad-crc-last", "partial-header", "torn-magic"])
def test_other_torn_tails_are_truncated(tmp_path, caplog, damage):
    path, positions = _layout(tmp_path)
    expect = 7
    if damage == "bad-crc-last":
        _flip(path, os.path.getsize(path) - 1)
    elif damage == "partial-header":
        with open(path, "ab") as f:
            f.write(b"\1\2\3")
        expect = 8
    else:  # a freshly rolled segment whose magic never fully reached the disk
        (tmp_path / segment_name(8)).write_bytes(b"MQS")
        expect = 8
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log = SegmentLog(tmp_path)
    assert [r for r in caplog.records if "torn tail" in r.getMessage()]
    assert log.next_offset == expect
    assert [r.body["i"] for _, r in log.read_from(0)] == list(range(min(expect, 8)))
    assert log.append([(1, "next")]) == [expect]
    log.close()
    assert SegmentLog(tmp_path).read_at(expect) == Record(1, "next")


def _records_end(path):
    data = path.read_bytes()
    pos = MAGIC_LEN
    while pos + HEADER_SIZE <= len(data) and any(data[pos : pos + HEADER_SIZE]):
        pos += HEADER_SIZE + int.from_bytes(data[pos + 4 : pos + 8], "little")
    return pos


@pytest.mark.parametrize("n,size", [(20, 100), (10, 1024 * 1024)], ids=["small", "10MiB"])
def test_the_active_segment_is_preallocated_and_a_closed_log_ends_at_its_last_record(tmp_path, n, size):
    log = SegmentLog(tmp_path, segment_bytes=64 * 1024 * 1024, fsync=False)
    log.append(recs(n, size=size))
    log.flush()
    path = tmp_path / segment_name(0)
    end = _records_end(path)
    assert os.path.getsize(path) == preallocate.target(end, 64 * 1024 * 1024)  # zeros written ahead
    assert not any(path.read_bytes()[end:])
    before = os.path.getsize(path)
    log.append(recs(2, start=n, size=min(size, 500)))
    log.flush()  # inside the zeros: the file keeps its length
    assert os.path.getsize(path) == before and _records_end(path) > end
    log.close()
    assert os.path.getsize(path) == _records_end(path)
    assert [r.body["i"] for _, r in SegmentLog(tmp_path).read_from(0)] == list(range(n + 2))


def test_preallocation_stops_at_segment_bytes(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=3000)
    log.append(recs(5, size=100))
    log.flush()
    assert os.path.getsize(tmp_path / segment_name(0)) == 3000
    log.close()


def test_zeros_after_the_records_are_preallocation_not_a_torn_tail(tmp_path, caplog):
    """What a crash leaves of a preallocated segment: the records, then zeros."""
    path, positions = _layout(tmp_path)
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        log = SegmentLog(tmp_path)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert log.next_offset == 8
    assert log.append([(1, "next")]) == [8]
    log.flush()
    log.close()
    log = SegmentLog(tmp_path)
    assert [r.body for _, r in log.read_from(7)][1] == "next"
    log.close()


@pytest.mark.parametrize("kept", [3, HEADER_SIZE, HEADER_SIZE + 5])
def test_a_record_torn_inside_the_preallocated_zeros_is_a_torn_tail(tmp_path, caplog, kept):
    """A crash mid-write: the first ``kept`` bytes of a record reached the
    disk, the zeros written ahead of it are still there after them."""
    path, positions = _layout(tmp_path, n=9)
    data = path.read_bytes()
    last = positions[-1]
    path.write_bytes(data[:last] + data[last : last + kept] + b"\0" * 8192)
    _continues_after_a_torn_tail(tmp_path, caplog, 8)
    assert os.path.getsize(path) == _records_end(path)


def _continues_after_a_torn_tail(tmp_path, caplog, next_offset):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log = SegmentLog(tmp_path)
    assert [r for r in caplog.records if "torn tail" in r.getMessage()]
    assert log.next_offset == next_offset
    assert log.append([(1, "after")]) == [next_offset]
    log.close()
    assert SegmentLog(tmp_path).read_at(next_offset) == Record(1, "after")


def test_a_rolled_segment_is_trimmed_before_the_next_is_written(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=4000)
    log.append(recs(10, size=100))
    log.flush()
    first = tmp_path / segment_name(0)
    assert os.path.getsize(first) == 4000  # preallocated to segment_bytes
    log.append(recs(40, start=10, size=100))
    log.flush()
    assert len(log.segment_bases) >= 2
    for name in seg_files(tmp_path)[:-1]:
        assert os.path.getsize(tmp_path / name) == _records_end(tmp_path / name)
    log.close()
    assert [r.body["i"] for _, r in SegmentLog(tmp_path).read_from(0)] == list(range(50))


def test_zeros_left_after_an_older_segment_are_trimmed_on_open(tmp_path, caplog):
    """A crash after a roll, before the old segment's zeros were cut."""
    log = SegmentLog(tmp_path, segment_bytes=300)
    log.append(recs(30))
    log.close()
    first = tmp_path / seg_files(tmp_path)[0]
    size = os.path.getsize(first)
    with open(first, "ab") as f:
        f.write(b"\0" * 1000)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log = SegmentLog(tmp_path)
    assert not caplog.records
    assert os.path.getsize(first) == size
    assert [r.body["i"] for _, r in log.read_from(0)] == list(range(30))
    log.close()


def test_a_last_segment_of_nothing_but_zeros_starts_again(tmp_path, caplog):
    """A segment created and preallocated whose first page a crash lost."""
    _layout(tmp_path)
    (tmp_path / segment_name(8)).write_bytes(b"\0" * 5000)
    _continues_after_a_torn_tail(tmp_path, caplog, 8)


@pytest.mark.parametrize("head", [b"M", b"MQSEGv1", b"MQSEGv1\n"[:3]])
def test_a_last_segment_whose_magic_was_torn_before_zeros_starts_again(tmp_path, caplog, head):
    """The first write of a new segment torn inside its magic, the file's
    size committed without the rest of the data (zeros): found by the
    simulated disk (tests/test_simdisk.py, segment log seed 99)."""
    _layout(tmp_path)
    (tmp_path / segment_name(8)).write_bytes(head + b"\0" * 160)
    _continues_after_a_torn_tail(tmp_path, caplog, 8)


def test_a_magic_cut_short_before_other_bytes_is_corruption(tmp_path):
    _layout(tmp_path)
    (tmp_path / segment_name(8)).write_bytes(b"MQ" + b"\0" * 10 + b"x")
    with pytest.raises(CorruptRecord, match="magic"):
        SegmentLog(tmp_path)


def test_corruption_after_open_is_reported_on_read(tmp_path):
    path, positions = _layout(tmp_path)
    log = SegmentLog(tmp_path)
    _flip(path, positions[2] + HEADER_SIZE + 1)
    with pytest.raises(CorruptRecord) as info:
        log.read_from(0)
    assert info.value.offset == positions[2]
    assert log.read_at(1).body["i"] == 1
    log.close()


def test_bad_segment_magic_is_reported(tmp_path):
    _layout(tmp_path)
    path = tmp_path / segment_name(0)
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord, match="magic"):
        SegmentLog(tmp_path)


def test_offsets_going_backwards_are_reported(tmp_path):
    _layout(tmp_path)
    # A well-formed record whose offset repeats an earlier one.
    with open(tmp_path / segment_name(0), "ab") as f:
        f.write(sl.encode_record(3, 1, "dup"))
        f.write(sl.encode_record(9, 1, "fine"))
    with pytest.raises(CorruptRecord, match="offset 3 does not follow"):
        SegmentLog(tmp_path)


def test_many_segments_keep_few_files_open(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=100)
    log.append(recs(200))
    log.flush()
    assert len(log.segment_bases) > 2 * sl._FD_CACHE
    got = log.read_from(0)
    assert [o for o, _ in got] == list(range(200))
    assert sum(1 for o in range(0, 200, 3) if log.read_at(o).body["i"] == o) == len(range(0, 200, 3))
    open_fds = [s for s in log._segments if s.fd is not None]
    assert len(open_fds) <= sl._FD_CACHE
    log.close()
    assert all(s.fd is None for s in log._segments)


@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory"])
@pytest.mark.parametrize("at", [1, 7, 23, 24, 25, 49, 50])
def test_truncate_drops_every_record_from_an_offset_and_survives_a_reopen(tmp_path, memory, at):
    """Records below the offset stay byte for byte, those at or after it are
    gone (whole later segments deleted, the one holding it cut), appends go
    on from the offset, and a reopened log holds exactly that."""
    log = SegmentLog(None if memory else tmp_path, segment_bytes=400)
    written = recs(50)
    log.append(written[:30])
    log.flush()
    log.append(written[30:])  # the rest unflushed: truncate flushes first
    log.truncate(at)
    assert log.next_offset == at == log.flushed_offset
    assert [(o, r.body["i"]) for o, r in log.read_from(0)] == [(i, i) for i in range(at)]
    more = recs(5, start=100)
    assert log.append(more) == list(range(at, at + 5))
    log.flush()
    want = [(i, i) for i in range(at)] + [(at + k, 100 + k) for k in range(5)]
    assert [(o, r.body["i"]) for o, r in log.read_from(0)] == want
    if not memory:
        log.close()
        again = SegmentLog(tmp_path, segment_bytes=400)
        assert [(o, r.body["i"]) for o, r in again.read_from(0)] == want
        assert again.next_offset == at + 5
        again.close()


def test_truncate_below_the_first_segment_is_refused(tmp_path):
    log = SegmentLog(tmp_path, segment_bytes=400)
    log.append(recs(10))
    with pytest.raises(ValueError, match="first segment"):
        log.truncate(0)
    log.truncate(10)  # at the end: nothing to do
    assert log.next_offset == 10
    log.close()


@pytest.mark.parametrize("stage", ["records", "zeros"])
def test_a_full_disk_is_a_clear_error_and_reopening_keeps_what_reached_the_disk(tmp_path, monkeypatch, stage):
    """The device fills in the middle of a flush (``records``: half of the
    records' bytes written, then ENOSPC; ``zeros``: the records written,
    then ENOSPC on the preallocated zeros after them).  The flush raises
    DiskFull naming the directory; the log refuses further work; reopened
    on a disk with room, it has every record that was flushed before and
    every whole record that reached the disk, cut at the torn one."""
    import errno

    log = SegmentLog(tmp_path, segment_bytes=1 << 20)
    log.append(recs(10))
    log.flush()
    log.append(recs(10, start=10, size=1000))  # past the zeros the first flush wrote ahead
    real = preallocate.write_at
    calls = []

    def filling(fd, data, pos, pwrite=os.pwrite):
        calls.append(len(data))
        if stage == "records" and len(calls) == 1:
            real(fd, memoryview(data)[: len(data) // 2], pos, pwrite)
            raise OSError(errno.ENOSPC, "No space left on device")
        if stage == "zeros" and len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, pos, pwrite)

    monkeypatch.setattr(preallocate, "write_at", filling)
    with pytest.raises(sl.DiskFull, match=f"flushing {tmp_path} failed: no space left on its device"):
        log.flush()
    assert isinstance(sl.DiskFull("x"), sl.LogFailed)
    with pytest.raises(sl.LogFailed, match="reopen it"):
        log.append(recs(1))
    monkeypatch.setattr(preallocate, "write_at", real)
    log.close(flush=False)  # as the queue host closes a crashed replica's log
    again = SegmentLog(tmp_path, segment_bytes=1 << 20)
    got = [r.body["i"] for _, r in again.read_from(0)]
    if stage == "zeros":
        assert got == list(range(20))  # the records were written whole
    else:
        assert got[:10] == list(range(10)) and 10 <= len(got) < 20 and got == list(range(len(got)))
    assert again.next_offset == len(got)
    again.append(recs(1, start=len(got)))
    again.flush()
    assert [r.body["i"] for _, r in again.read_from(0)][-1] == len(got)
    again.close()
