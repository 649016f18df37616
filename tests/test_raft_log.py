"""Storage under the Raft core: MemoryRaftLog (simulator disk dict) and
FileRaftLog (append-only CRC32C log, atomic hard state and snapshot)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq import preallocate
from mirrorq.fsapi import OsFileSystem
from mirrorq.mnesia_like.raft import ELECTION_TIMER, Committed, RaftNode
from mirrorq.mnesia_like.raft_log import (
    COMMAND,
    CONFIG,
    Config,
    Entry,
    FileRaftLog,
    MemoryRaftLog,
    RaftLogCorrupt,
    Snapshot,
)
from mirrorq.sansio import Emit


def E(i, t, data=None):
    return Entry(i, t, COMMAND, data if data is not None else f"cmd{i}")


def state(log):
    return (
        log.term,
        log.voted_for,
        log.snapshot,
        log.snapshot_index,
        log.last_index,
        [log.entry(i) for i in range(log.snapshot_index + 1, log.last_index + 1)],
    )


def segments(directory):
    """The segment files of a FileRaftLog directory, oldest first."""
    return sorted(p for p in directory.iterdir() if p.name.startswith("log.") and p.name[4:].isdigit())


def only_segment(directory):
    segs = segments(directory)
    assert len(segs) == 1, segs
    return segs[0]


def record_offsets(path):
    """Byte offsets of each record (header 12 bytes, length first)."""
    blob = open(path, "rb").read()
    offs, off = [], 0
    while off < len(blob):
        offs.append(off)
        off += 12 + int.from_bytes(blob[off : off + 4], "big")
    return offs, blob


@pytest.fixture(params=["memory", "file"])
def make(request, tmp_path):
    disk: dict = {}

    def opener():
        return MemoryRaftLog(disk) if request.param == "memory" else FileRaftLog(tmp_path / "raft")

    return opener


def test_hard_state_entries_and_snapshot_survive_reopen(make):
    log = make()
    assert state(log) == (0, None, None, 0, 0, [])
    log.set_hard_state(3, "n2")
    log.append([E(1, 1), E(2, 1), Entry(3, 2, CONFIG, Config(("a", "b"), ("c",))), E(4, 3, {"k": [1, 2]})])
    log.flush()
    log.close()
    again = make()
    assert state(again) == state(log)
    assert again.entry(3).data == Config(("a", "b"), ("c",))
    assert again.term_at(0) == 0 and again.term_at(4) == 3 and again.term_at(5) is None


def test_append_replaces_a_conflicting_suffix_and_replays_so(make):
    log = make()
    log.append([E(1, 1), E(2, 1), E(3, 1)])
    log.append([E(2, 2, "new2")])
    assert log.last_index == 2 and log.entry(2).data == "new2"
    log.append([E(3, 2), E(4, 2)])
    log.flush()
    log.close()
    again = make()
    assert [again.entry(i) for i in (1, 2, 3, 4)] == [E(1, 1), E(2, 2, "new2"), E(3, 2), E(4, 2)]


def test_bad_input_is_refused(make):
    log = make()
    log.append([E(1, 1)])
    with pytest.raises(ValueError, match="within 1..2"):
        log.append([E(5, 1)])
    with pytest.raises(ValueError, match="expected an Entry with index 3"):
        log.append([E(2, 1), E(4, 1)])
    log.set_hard_state(4, None)
    with pytest.raises(ValueError, match="term"):
        log.set_hard_state(2, None)
    with pytest.raises(IndexError, match="no log entry 9"):
        log.entry(9)


def test_snapshot_compacts_and_round_trips(make):
    log = make()
    log.append([E(i, 1 + i // 10) for i in range(1, 31)])
    snap = Snapshot(20, log.term_at(20), Config(("a",)), {"state": [1, 2, 3]})
    log.install_snapshot(snap)
    assert log.snapshot_index == 20 and log.last_index == 30
    assert log.term_at(20) == snap.term and log.term_at(19) is None
    with pytest.raises(IndexError):
        log.entry(20)
    log.append([E(31, 4)])
    log.flush()
    log.close()
    again = make()
    assert state(again) == state(log)
    assert again.snapshot == snap
    # a snapshot from another history (term mismatch) drops the whole log
    again.install_snapshot(Snapshot(25, 99, Config(("a",)), "other"))
    assert again.snapshot_index == again.last_index == 25
    again.close()
    assert state(make()) == state(again)


def test_file_compaction_shrinks_the_log(tmp_path):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    log.append([E(i, 1, "x" * 100) for i in range(1, 101)])
    log.close()  # the zeros written ahead are cut off: the files hold the records
    size = sum(os.path.getsize(p) for p in segments(tmp_path))
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    log.install_snapshot(Snapshot(90, 1, Config(("a",)), b"blob"))
    log.close()
    assert sum(os.path.getsize(p) for p in segments(tmp_path)) < size / 5
    assert FileRaftLog(tmp_path, segment_bytes=1000).last_index == 100


def test_group_fsync_one_per_flush(tmp_path, monkeypatch):
    log = FileRaftLog(tmp_path)
    calls = []
    real = os.fsync
    monkeypatch.setattr(OsFileSystem, "fsync", staticmethod(lambda fd: (calls.append(fd), real(fd))))
    for i in range(1, 101):
        log.append([E(i, 1)])
    assert calls == []
    log.flush()
    assert len(calls) == 1
    log.flush()  # nothing new: no fsync
    assert len(calls) == 1


@pytest.mark.parametrize("ahead", [0, 4096], ids=["at-the-end", "zeros-ahead-after-it"])
@pytest.mark.parametrize("cut", [1, 5, 11, 12, 20])
def test_torn_tail_is_truncated_on_open(tmp_path, cut, ahead):
    """A crash mid-write: the first ``cut`` bytes of the last record reached
    the disk, followed by the end of the file or by the zeros written ahead."""
    log = FileRaftLog(tmp_path)
    log.append([E(i, 1) for i in range(1, 6)])
    log.close()
    seg = only_segment(tmp_path)
    offs, blob = record_offsets(seg)
    last = offs[-1]
    seg.write_bytes(blob[: last + cut] + b"\0" * ahead)
    again = FileRaftLog(tmp_path)
    assert again.last_index == 4
    assert os.path.getsize(seg) == last
    again.append([E(5, 2, "rewritten")])
    again.close()
    assert FileRaftLog(tmp_path).entry(5) == E(5, 2, "rewritten")


@pytest.mark.parametrize("tail", ["zeros", "bad_last_payload"])
def test_torn_tail_variants(tmp_path, tail):
    log = FileRaftLog(tmp_path)
    log.append([E(i, 1) for i in range(1, 4)])
    log.close()
    seg = only_segment(tmp_path)
    offs, blob = record_offsets(seg)
    if tail == "zeros":
        with open(seg, "ab") as f:
            f.write(b"\0" * 40)
        expect_size, expect_last = len(blob), 3
    else:
        with open(seg, "r+b") as f:
            f.seek(len(blob) - 1)
            f.write(bytes([blob[-1] ^ 0xFF]))
        expect_size, expect_last = offs[-1], 2
    again = FileRaftLog(tmp_path)
    assert again.last_index == expect_last
    assert os.path.getsize(seg) == expect_size


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corruption_in_the_middle_names_file_and_offset(tmp_path, where):
    log = FileRaftLog(tmp_path)
    log.append([E(i, 1) for i in range(1, 6)])
    log.close()
    seg = only_segment(tmp_path)
    offs, blob = record_offsets(seg)
    victim = offs[2]
    pos = victim + (14 if where == "payload" else 2)
    with open(seg, "r+b") as f:
        f.seek(pos)
        f.write(bytes([blob[pos] ^ 0x55]))
    with pytest.raises(RaftLogCorrupt) as info:
        FileRaftLog(tmp_path)
    err = info.value
    assert err.offset == victim and err.path == str(seg)
    assert f"{seg}: corrupt record at byte offset {victim}" in str(err)
    assert os.path.getsize(seg) == len(blob)  # nothing was thrown away


def test_corrupt_hard_state_is_reported(tmp_path):
    log = FileRaftLog(tmp_path)
    log.set_hard_state(7, "n3")
    log.close()
    raw = bytearray(open(tmp_path / "hardstate", "rb").read())
    raw[-1] ^= 1
    open(tmp_path / "hardstate", "wb").write(bytes(raw))
    with pytest.raises(RaftLogCorrupt, match="hardstate: corrupt record at byte offset 0"):
        FileRaftLog(tmp_path)


def test_crash_between_snapshot_and_log_rewrite_is_reconciled(tmp_path):
    """The snapshot file is replaced first, the log rewritten second; a crash
    in between leaves an old log that must not be glued to the snapshot."""
    other = FileRaftLog(tmp_path / "other")
    other.append([E(i, 2) for i in range(1, 26)])
    other.install_snapshot(Snapshot(25, 2, Config(("a",)), "s"))
    other.close()
    log = FileRaftLog(tmp_path / "main")
    log.append([E(i, 1) for i in range(1, 31)])  # another history, longer
    log.close()
    os.replace(tmp_path / "other" / "snapshot", tmp_path / "main" / "snapshot")
    again = FileRaftLog(tmp_path / "main")
    assert again.snapshot_index == 25 and again.last_index == 25
    again.append([E(26, 3)])
    again.close()
    assert FileRaftLog(tmp_path / "main").entry(26) == E(26, 3)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 6), st.integers(1, 5), st.integers(0, 2)),
        st.tuples(st.just("vote"), st.integers(0, 3), st.sampled_from([None, "a", "b"]), st.just(0)),
        st.tuples(st.just("snapshot"), st.integers(0, 8), st.just(0), st.just(0)),
        st.tuples(st.just("reopen"), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=25,
)


def _run_against_memory_log(program, opener, flush_every_append: bool, compare_entries: bool) -> None:
    """Carry ``program`` out on a MemoryRaftLog and on ``opener()``'s
    FileRaftLog (reopened where it says) and compare them after each step.
    Without ``flush_every_append``, an append of an odd count is not flushed
    (more appends wait: truncation of records not yet written)."""
    mem, disk = MemoryRaftLog({}), opener()
    for op, a, b, c in program:
        if op == "append":
            start = max(mem.snapshot_index + 1, mem.last_index + 1 - a)
            terms = [max(mem.term_at(start - 1) or 0, 1) + c] * b
            batch = [E(start + k, terms[k], f"v{start + k}.{c}") for k in range(b)]
            mem.append(batch)
            disk.append(batch)
        elif op == "vote":
            t = mem.term + a
            mem.set_hard_state(t, b)
            disk.set_hard_state(t, b)
        elif op == "snapshot":
            idx = min(mem.snapshot_index + a, mem.last_index)
            if idx > mem.snapshot_index:
                s = Snapshot(idx, mem.term_at(idx), Config(("a",)), [idx])
                mem.install_snapshot(s)
                disk.install_snapshot(s)
        else:
            disk.close()
            disk = opener()
        if op != "append" or flush_every_append or b % 2 == 0:
            disk.flush()
        assert state(disk) == state(mem)
        if compare_entries and mem.last_index > mem.snapshot_index:
            lo, hi = mem.snapshot_index + 1, mem.last_index + 1
            assert disk.entries(lo, hi) == mem.entries(lo, hi)
    disk.close()
    assert state(opener()) == state(mem)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_file_log_matches_memory_log_across_reopens(tmp_path_factory, program):
    """Any sequence of appends (with truncation), votes, snapshots and
    reopens leaves FileRaftLog in the same state as MemoryRaftLog."""
    path = tmp_path_factory.mktemp("prop")
    _run_against_memory_log(program, lambda: FileRaftLog(path), flush_every_append=True, compare_entries=False)


def test_raft_node_restarts_from_a_file_log(tmp_path):
    def boot():
        node = RaftNode("solo", FileRaftLog(tmp_path), random.Random(0), voters=("solo",))
        node.start(0.0)
        return node

    n = boot()
    n.timer(1.0, ELECTION_TIMER)
    out = n.propose(1.1, "hello")
    assert Emit(Committed(2, 1, "hello")) in out
    n.log.close()
    n = boot()
    assert (n.term, n.log.voted_for, n.last_index) == (1, "solo", 2)
    out = n.timer(2.0, ELECTION_TIMER)  # re-elected: its no-op commits, re-applying the old entry
    assert n.term == 2
    out += n.propose(2.1, "again")
    committed = [a.event for a in out if type(a) is Emit and type(a.event) is Committed]
    assert committed == [Committed(2, 1, "hello"), Committed(4, 2, "again")]


def test_zeros_are_written_ahead_of_the_records_and_cut_off_on_close(tmp_path):
    log = FileRaftLog(tmp_path)
    log.append([E(i, 1, "x" * 50) for i in range(1, 30)])
    log.flush()
    path = only_segment(tmp_path)
    blob = path.read_bytes()
    end = len(blob.rstrip(b"\0"))
    assert len(blob) == preallocate.target(end, 1 << 62) > end and not any(blob[end:])
    size = len(blob)
    log.append([E(30, 1, "y")])
    log.flush()  # inside the zeros: the file keeps its length
    assert os.path.getsize(path) == size
    log.close()
    offs, blob = record_offsets(path)
    assert os.path.getsize(path) == len(blob) and blob[-1] != 0
    assert FileRaftLog(tmp_path).entry(30) == E(30, 1, "y")


# ---- segments, compaction by whole segments, the entry cache, checkpoints --------------------


def seg_first(path):
    return int(path.name[4:])


def fill(log, lo, hi, term=1, size=100):
    log.append([E(i, term, f"{i}:{term}:" + "x" * size) for i in range(lo, hi + 1)])


def test_segments_roll_and_reopen(tmp_path):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    for lo in range(1, 101, 10):
        fill(log, lo, lo + 9)
        log.flush()
    segs = segments(tmp_path)
    assert len(segs) > 5
    # each segment is named by its first entry; every one but the last has passed the size, by one record at most
    firsts = [seg_first(p) for p in segs]
    assert firsts[0] == 1 and firsts == sorted(firsts)
    for p in segs[:-1]:
        assert 1000 <= os.path.getsize(p) < 1000 + 200
    expect = [E(i, 1, f"{i}:1:" + "x" * 100) for i in range(1, 101)]
    assert list(log.entries(1, 101)) == expect
    log.close()
    again = FileRaftLog(tmp_path, segment_bytes=1000)
    assert again.last_index == 100 and list(again.entries(1, 101)) == expect
    assert [again.entry(i) for i in (1, firsts[3], firsts[3] - 1, 100)] == [
        expect[i - 1] for i in (1, firsts[3], firsts[3] - 1, 100)
    ]
    fill(again, 101, 130)
    again.close()
    assert FileRaftLog(tmp_path, segment_bytes=1000).entry(130).data.startswith("130:1:")


def test_a_batch_crossing_rolls_in_one_write_out_fsyncs_the_finished_segments_first(tmp_path, monkeypatch):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    synced = []
    real = os.fsync
    monkeypatch.setattr(OsFileSystem, "fsync", staticmethod(lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd))))
    fill(log, 1, 40)  # about five segments' worth, none written yet
    assert segments(tmp_path) == [tmp_path / f"log.{1:020d}"]
    fd = log.write_out()
    segs = segments(tmp_path)
    assert len(segs) >= 4
    assert os.fstat(fd).st_ino == os.stat(segs[-1]).st_ino  # the one to sync is the last
    inodes = {os.stat(p).st_ino: p for p in segs}
    assert [inodes[i] for i in synced if i in inodes] == segs[:-1]  # every finished one, in order
    assert all(not open(p, "rb").read().endswith(b"\0") for p in segs[:-1])  # cut at their last record
    os.fsync(fd)
    log.close()
    assert list(FileRaftLog(tmp_path, segment_bytes=1000).entries(1, 41)) == [
        E(i, 1, f"{i}:1:" + "x" * 100) for i in range(1, 41)
    ]


def test_compaction_deletes_whole_segments_and_keeps_later_entries(tmp_path):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    fill(log, 1, 100)
    log.flush()
    before = segments(tmp_path)
    holding_60 = max(p for p in before if seg_first(p) <= 60)
    kept_bytes = {p: p.read_bytes() for p in before if p >= holding_60}
    log.install_snapshot(Snapshot(60, 1, Config(("a",)), "s60"))
    after = segments(tmp_path)
    assert after == [p for p in before if p >= holding_60]  # older ones gone, whole
    assert {p: p.read_bytes() for p in after} == kept_bytes  # the kept ones not rewritten
    assert [log.entry(i).data for i in (61, 62, 100)] == [f"{i}:1:" + "x" * 100 for i in (61, 62, 100)]
    with pytest.raises(IndexError):
        log.entry(60)
    log.close()
    again = FileRaftLog(tmp_path, segment_bytes=1000)  # the entries up to 60 left in the first segment are skipped
    assert (again.snapshot_index, again.last_index) == (60, 100)
    assert list(again.entries(61, 101)) == [E(i, 1, f"{i}:1:" + "x" * 100) for i in range(61, 101)]
    # compacting everything keeps only the last segment
    again.install_snapshot(Snapshot(100, 1, Config(("a",)), "s100"))
    assert segments(tmp_path) == after[-1:]
    fill(again, 101, 103, term=2)
    again.close()
    last = FileRaftLog(tmp_path, segment_bytes=1000)
    assert (last.snapshot_index, last.last_index, last.entry(101).term) == (100, 103, 2)


def test_a_crash_between_snapshot_and_segment_deletion_is_completed_on_open(tmp_path):
    log = FileRaftLog(tmp_path / "a", segment_bytes=1000)
    fill(log, 1, 100)
    log.close()
    shadow = tmp_path / "b"
    os.makedirs(shadow)
    for p in segments(tmp_path / "a"):  # the segments as they were before compaction
        (shadow / p.name).write_bytes(p.read_bytes())
    log = FileRaftLog(tmp_path / "a", segment_bytes=1000)
    log.install_snapshot(Snapshot(60, 1, Config(("a",)), "s60"))
    log.close()
    for p in segments(tmp_path / "a"):
        os.unlink(p)
    for p in segments(shadow):
        os.replace(p, tmp_path / "a" / p.name)
    again = FileRaftLog(tmp_path / "a", segment_bytes=1000)
    assert (again.snapshot_index, again.last_index) == (60, 100)
    assert all(seg_first(p) <= 61 for p in segments(tmp_path / "a")[:1])
    assert seg_first(segments(tmp_path / "a")[1]) > 61
    assert again.entry(61).data == "61:1:" + "x" * 100


@pytest.mark.parametrize("flush_between", [True, False], ids=["on-disk", "pending"])
def test_conflict_truncation_across_a_segment_boundary(tmp_path, flush_between):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    fill(log, 1, 60)
    if flush_between:
        log.flush()
    segs = segments(tmp_path) if flush_between else None
    at = 12  # in the first or second segment: the later ones go
    log.append([E(i, 2, f"new{i}") for i in range(at, at + 3)])
    assert log.last_index == at + 2
    expect = [E(i, 1, f"{i}:1:" + "x" * 100) for i in range(1, at)] + [E(i, 2, f"new{i}") for i in range(at, at + 3)]
    assert [log.entry(i) for i in range(1, at + 3)] == expect
    if flush_between:
        assert len(segments(tmp_path)) < len(segs)
    log.flush()
    assert max(seg_first(p) for p in segments(tmp_path)) <= at + 2  # none of the old history's later ones left
    log.close()
    again = FileRaftLog(tmp_path, segment_bytes=1000)
    assert again.last_index == at + 2 and list(again.entries(1, at + 3)) == expect
    # and it goes on, rolling again
    again.append([E(i, 2, f"more{i}" + "y" * 100) for i in range(at + 3, 40)])
    again.close()
    last = FileRaftLog(tmp_path, segment_bytes=1000)
    assert last.last_index == 39 and last.entry(39).data.startswith("more39")
    assert last.entry(at).data == f"new{at}"


def test_a_truncation_of_records_not_yet_written_that_replaced_written_ones(tmp_path):
    """Written: 1, 2.  Pending: 1', 2', 3' (1' truncates on replay; the
    segment is full, so 3' starts the next one).  Then 1'' replaces 1':
    the pending records go, and 1'' must truncate the written 1, 2 in their
    segment -- not start a segment of its own."""
    log = FileRaftLog(tmp_path, segment_bytes=80)
    log.append([E(1, 1, "a" * 30), E(2, 1, "a" * 30)])
    log.flush()
    log.append([E(1, 2, "b" * 30), E(2, 2, "b" * 30), E(3, 2, "b" * 30)])
    log.append([E(1, 3, "c")])
    assert log.last_index == 1 and log.entry(1) == E(1, 3, "c")
    log.close()
    assert [seg_first(p) for p in segments(tmp_path)] == [1]
    again = FileRaftLog(tmp_path, segment_bytes=80)
    assert again.last_index == 1 and again.entry(1) == E(1, 3, "c")


def test_truncation_inside_the_last_segment_is_an_append(tmp_path):
    log = FileRaftLog(tmp_path, segment_bytes=1 << 20)
    fill(log, 1, 10)
    log.flush()
    size = os.path.getsize(only_segment(tmp_path))
    log.append([E(5, 2, "five")])
    log.close()
    seg = only_segment(tmp_path)
    offs, _ = record_offsets(seg)
    assert len(offs) == 11 and offs[-1] >= 10 * 100 and os.path.getsize(seg) <= size
    again = FileRaftLog(tmp_path)
    assert again.last_index == 5 and again.entry(5) == E(5, 2, "five") and again.entry(4).term == 1


@pytest.mark.parametrize("cut", [0, 1, 13, "zeros"])
def test_torn_tail_of_the_last_segment(tmp_path, cut):
    """A crash in or after a roll: the new last segment lost (part of) its
    records -- all of them (``0``, or only the zeros written ahead left) or
    the last one's tail."""
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    fill(log, 1, 30)
    log.close()
    segs = segments(tmp_path)
    older = [p.read_bytes() for p in segs[:-1]]
    last = segs[-1]
    offs, blob = record_offsets(last)
    if cut == "zeros":
        last.write_bytes(b"\0" * 8192)
    else:
        last.write_bytes(blob[: offs[-1] + cut] if cut else b"")
    expect_last = 29 if cut in (1, 13) else seg_first(last) - 1
    again = FileRaftLog(tmp_path, segment_bytes=1000)
    assert again.last_index == expect_last
    assert segments(tmp_path) == segs  # an emptied last segment stays, for what follows
    assert [p.read_bytes() for p in segs[:-1]] == older
    assert os.path.getsize(last) == (offs[-1] if cut in (1, 13) else 0)
    again.append([E(expect_last + 1, 2, "after")])
    again.close()
    reopened = FileRaftLog(tmp_path, segment_bytes=1000)
    assert reopened.entry(expect_last + 1) == E(expect_last + 1, 2, "after")
    assert reopened.entry(expect_last) == E(expect_last, 1, f"{expect_last}:1:" + "x" * 100)


@pytest.mark.parametrize("where", ["payload", "header", "cut-short"])
def test_a_bad_record_in_a_middle_segment_is_corruption(tmp_path, where):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    fill(log, 1, 40)
    log.close()
    victim_seg = segments(tmp_path)[1]
    offs, blob = record_offsets(victim_seg)
    if where == "cut-short":  # a torn tail, but not in the last segment
        victim = offs[-1]
        victim_seg.write_bytes(blob[: victim + 20])
    else:
        victim = offs[-1]  # even its last record: a later segment exists, so it was durable
        pos = victim + (14 if where == "payload" else 2)
        raw = bytearray(blob)
        raw[pos] ^= 0x55
        victim_seg.write_bytes(bytes(raw))
    size = os.path.getsize(victim_seg)
    with pytest.raises(RaftLogCorrupt) as info:
        FileRaftLog(tmp_path, segment_bytes=1000)
    assert info.value.path == str(victim_seg) and info.value.offset == victim
    assert os.path.getsize(victim_seg) == size  # nothing thrown away


def test_a_bad_record_read_back_names_file_and_offset(tmp_path):
    log = FileRaftLog(tmp_path, segment_bytes=1000, cache_bytes=0)
    fill(log, 1, 40)
    log.flush()
    seg = segments(tmp_path)[1]
    offs, blob = record_offsets(seg)
    with open(seg, "r+b") as f:
        f.seek(offs[1] + 20)
        f.write(b"Z")
    k = seg_first(seg) + 1
    with pytest.raises(RaftLogCorrupt) as info:
        log.entry(k)
    assert info.value.path == str(seg) and info.value.offset == offs[1]
    with pytest.raises(RaftLogCorrupt):
        log.entries(k - 1, k + 2)
    assert log.entry(k - 1).index == k - 1  # its neighbours are fine


def test_the_entry_cache_is_bounded_and_serves_the_tail(tmp_path, monkeypatch):
    import mirrorq.mnesia_like.raft_log as rl

    reads = []
    real = os.pread
    monkeypatch.setattr(OsFileSystem, "pread", staticmethod(lambda fd, n, off: (reads.append(n), real(fd, n, off))[1]))
    log = FileRaftLog(tmp_path, cache_bytes=100_000)
    fill(log, 1, 500)  # ~130 bytes each, counted with the overhead: ~130 of them fit
    log.flush()
    assert log._cache_used <= 100_000 and 100 < len(log._cache) < 150
    assert list(log.entries(450, 501)) == [E(i, 1, f"{i}:1:" + "x" * 100) for i in range(450, 501)]
    assert log.entry(500).index == 500
    assert reads == []  # the tail came from memory
    assert log.entry(3) == E(3, 1, "3:1:" + "x" * 100)  # an old one from the disk
    assert reads
    reads.clear()
    assert log.entry(3).index == 3 and reads == []  # and now cached
    assert list(log.entries(10, 30)) == [E(i, 1, f"{i}:1:" + "x" * 100) for i in range(10, 30)]
    assert len(reads) == 1  # adjacent records: one pread
    assert log._cache_used <= 100_000
    big = E(501, 1, "b" * 200_000)  # larger than the bound: never cached
    log.append([big])
    assert log.entry(501) == big  # pending: readable
    log.flush()
    reads.clear()
    assert log.entry(501) == big and reads
    assert 501 not in log._cache and log._cache_used <= 100_000
    assert rl.ENTRY_CACHE_BYTES <= 16 << 20 and FileRaftLog(tmp_path / "d").cache_bytes == rl.ENTRY_CACHE_BYTES


def test_appends_past_the_write_buffer_are_written_early_and_still_need_write_out(tmp_path, monkeypatch):
    import mirrorq.mnesia_like.raft_log as rl

    monkeypatch.setattr(rl, "WRITE_BUFFER_BYTES", 2000)
    log = FileRaftLog(tmp_path, cache_bytes=0)
    fill(log, 1, 30)  # ~3900 bytes: written once past 2000
    seg = only_segment(tmp_path)
    assert 2000 < len(seg.read_bytes().rstrip(b"\0")) < 3900
    assert [log.entry(i).index for i in (1, 16, 30)] == [1, 16, 30]  # written or pending, all readable
    assert log.write_out() is not None
    log.close()
    assert FileRaftLog(tmp_path).last_index == 30


def write_old_log(directory, records):
    """The single-file format of old: ``log`` holding framed msgpack records."""
    import msgpack
    from crc32c import crc32c

    out = b""
    for rec in records:
        payload = msgpack.packb(rec, use_bin_type=True)
        head = len(payload).to_bytes(4, "big") + crc32c(payload).to_bytes(4, "big")
        out += head + crc32c(head).to_bytes(4, "big") + payload
    os.makedirs(directory, exist_ok=True)
    (directory / "log").write_bytes(out)


def test_a_directory_of_the_old_single_file_format_opens(tmp_path):
    log = FileRaftLog(tmp_path / "src")
    log.set_hard_state(3, "n1")
    fill(log, 1, 5)
    log.install_snapshot(Snapshot(2, 1, Config(("a",)), "snap"))
    log.close()
    d = tmp_path / "old"
    os.makedirs(d)
    for name in ("hardstate", "snapshot"):
        (d / name).write_bytes((tmp_path / "src" / name).read_bytes())
    write_old_log(
        d, [[i, 1, COMMAND, f"v{i}"] for i in range(3, 9)] + [[7, 2, CONFIG, [["a", "b"], []]], [8, 2, COMMAND, "v8'"]]
    )
    log = FileRaftLog(d, segment_bytes=100)
    assert not (d / "log").exists() and [p.name for p in segments(d)] == [f"log.{3:020d}"]
    assert (log.term, log.voted_for, log.snapshot_index, log.last_index) == (3, "n1", 2, 8)
    assert [log.entry(i) for i in (3, 6, 7, 8)] == [
        E(3, 1, "v3"),
        E(6, 1, "v6"),
        Entry(7, 2, CONFIG, Config(("a", "b"))),
        E(8, 2, "v8'"),
    ]
    assert log.config_entries(1) == [(7, Config(("a", "b")))]
    fill(log, 9, 12, term=2)  # rolls: the old file is the first segment
    log.close()
    again = FileRaftLog(d, segment_bytes=100)
    assert len(segments(d)) > 1 and again.last_index == 12 and again.entry(8) == E(8, 2, "v8'")


def test_an_empty_old_log_file_opens(tmp_path):
    write_old_log(tmp_path, [])
    log = FileRaftLog(tmp_path)
    assert log.last_index == 0 and not (tmp_path / "log").exists()
    log.append([E(1, 1)])
    log.close()
    assert FileRaftLog(tmp_path).entry(1) == E(1, 1)


def test_config_entries_read_no_other_entry(tmp_path, monkeypatch):
    log = FileRaftLog(tmp_path, segment_bytes=500, cache_bytes=0)
    fill(log, 1, 10)
    log.append([Entry(11, 1, CONFIG, Config(("a", "b")))])
    fill(log, 12, 20)
    log.append([Entry(21, 2, CONFIG, Config(("a",), ("b",)))])
    log.close()
    log = FileRaftLog(tmp_path, segment_bytes=500, cache_bytes=0)
    monkeypatch.setattr(OsFileSystem, "pread", staticmethod(lambda *a: pytest.fail("config_entries read the disk")))
    assert log.config_entries(1) == [(11, Config(("a", "b"))), (21, Config(("a",), ("b",)))]
    assert log.config_entries(12) == [(21, Config(("a",), ("b",)))]
    log.append([E(21, 3)])  # truncated away
    assert log.config_entries(1) == [(11, Config(("a", "b")))]
    monkeypatch.undo()
    log.install_snapshot(Snapshot(15, 1, Config(("a", "b")), None))
    assert log.config_entries(1) == []


def test_checkpoints_save_promote_drop_and_reopen(tmp_path):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    fill(log, 1, 100)
    log.flush()
    c30 = Snapshot(30, 1, Config(("a",)), {"at": 30})
    c50 = Snapshot(50, 1, Config(("a",)), {"at": 50})
    c80 = Snapshot(80, 1, Config(("a",)), {"at": 80})
    for c in (c50, c30, c80):
        log.save_checkpoint(c)
    with pytest.raises(ValueError):
        log.save_checkpoint(Snapshot(101, 1, Config(("a",)), None))
    assert log.checkpoints == (30, 50, 80)
    log.drop_checkpoint(30)
    log.drop_checkpoint(31)  # none there: nothing
    assert log.checkpoints == (50, 80)
    log.close()
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    assert log.checkpoints == (50, 80) and log.snapshot is None
    stored = (tmp_path / "checkpoint.50").read_bytes()
    ino = os.stat(tmp_path / "checkpoint.50").st_ino
    assert log.promote_checkpoint(50) == c50
    assert (tmp_path / "snapshot").read_bytes() == stored and os.stat(tmp_path / "snapshot").st_ino == ino  # renamed
    assert not (tmp_path / "checkpoint.50").exists()
    assert (log.snapshot, log.snapshot_index, log.last_index, log.checkpoints) == (c50, 50, 100, (80,))
    assert min(seg_first(p) for p in segments(tmp_path)) > 40  # whole segments below it went
    assert log.entry(51).data.startswith("51:")
    log.close()
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    assert (log.snapshot, log.last_index, log.checkpoints) == (c50, 100, (80,))
    # install_snapshot drops the checkpoints at or below it
    log.save_checkpoint(Snapshot(90, 1, Config(("a",)), {"at": 90}))
    log.install_snapshot(Snapshot(85, 1, Config(("a",)), {"at": 85}))
    assert log.checkpoints == (90,) and not (tmp_path / "checkpoint.80").exists()
    with pytest.raises(KeyError):
        log.promote_checkpoint(80)
    log.close()
    assert FileRaftLog(tmp_path, segment_bytes=1000).checkpoints == (90,)


def test_a_checkpoint_from_another_history_drops_the_log_when_promoted(tmp_path):
    log = FileRaftLog(tmp_path, segment_bytes=1000)
    fill(log, 1, 40)
    log.save_checkpoint(Snapshot(30, 1, Config(("a",)), "c"))
    log.append([E(20, 2, "other")])  # the log below the checkpoint changed (cannot happen in Raft; still defined)
    fill(log, 21, 35, term=2)
    log.promote_checkpoint(30)
    assert (log.snapshot_index, log.last_index) == (30, 30)
    log.append([E(31, 3)])
    log.close()
    again = FileRaftLog(tmp_path, segment_bytes=1000)
    assert (again.snapshot_index, again.last_index, again.entry(31)) == (30, 31, E(31, 3))


def test_snapshot_data_is_read_from_the_file_when_large(tmp_path, monkeypatch):
    import mirrorq.mnesia_like.raft_log as rl

    monkeypatch.setattr(rl, "SNAPSHOT_CACHE_BYTES", 1000)
    log = FileRaftLog(tmp_path)
    fill(log, 1, 10)
    small = Snapshot(5, 1, Config(("a",)), "s")
    log.install_snapshot(small)
    assert log.snapshot is log.snapshot  # small: kept
    big = Snapshot(8, 1, Config(("a",)), "b" * 5000)
    log.install_snapshot(big)
    assert log._snap_cache is None and log.snapshot == big and log.snapshot is not log.snapshot
    log.close()
    again = FileRaftLog(tmp_path)
    assert again._snap_cache is None and (again.snapshot_index, again.snapshot_term) == (8, 1) and again.snapshot == big


@settings(max_examples=60, deadline=None)
@given(ops)
def test_small_segments_and_cache_match_memory_log_across_reopens(tmp_path_factory, program):
    """As above with segments of a few records and a cache of a few: rolls,
    truncation across segments and compaction by whole segments."""
    path = tmp_path_factory.mktemp("prop")
    _run_against_memory_log(
        program,
        lambda: FileRaftLog(path, segment_bytes=60, cache_bytes=80),
        flush_every_append=False,
        compare_entries=True,
    )


def test_memory_does_not_grow_with_the_entries_held(tmp_path):
    """200 MiB of 4 KiB entries: what the log object keeps is an index (tens
    of bytes an entry) and the bounded cache, not the entries."""
    import tracemalloc

    from mirrorq.mnesia_like.raft_log import ENTRY_CACHE_BYTES

    n, size, batch = 50_000, 4096, 500

    def body(i):
        return i.to_bytes(8, "big") * (size // 8)

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        log = FileRaftLog(tmp_path)
        for lo in range(1, n + 1, batch):
            log.append([Entry(i, 1, COMMAND, body(i)) for i in range(lo, lo + batch)])
            log.flush()
        held = tracemalloc.get_traced_memory()[0] - before
        bound = 3 * 1024 * 1024 + ENTRY_CACHE_BYTES * 5 // 4  # the index, the cache (a bit more decoded)
        assert held < bound, f"{held} bytes held after {n * size} bytes appended"
        for i in (1, 2, 777, n // 2, n - 1, n):
            assert log.entry(i) == Entry(i, 1, COMMAND, body(i))
        assert [e.data for e in log.entries(30_000, 30_100)] == [body(i) for i in range(30_000, 30_100)]
        assert tracemalloc.get_traced_memory()[0] - before < bound
        log.close()
        again = FileRaftLog(tmp_path)
        assert tracemalloc.get_traced_memory()[0] - before < bound
        assert again.last_index == n and again.entry(12_345).data == body(12_345)
        again.close()
    finally:
        tracemalloc.stop()
    assert len(segments(tmp_path)) == 4  # 64 MiB segments


def test_compaction_of_most_of_the_last_segment_rolls_it_so_the_next_deletes_it(tmp_path):
    """The registry's way: small entries, a snapshot every 1000 at the applied
    (last) index.  The one big segment would keep every compacted record
    until it filled (and an open would scan them); instead a compaction that
    leaves mostly compacted records in the last segment starts a new one at
    the next append."""
    from mirrorq.mnesia_like.raft_log import COMPACT_ROLL_BYTES

    log = FileRaftLog(tmp_path)
    for i in range(1, 5001):
        log.append([E(i, 1, "r" * 90)])
        log.flush()
        if i % 1000 == 0:
            log.install_snapshot(Snapshot(i, 1, Config(("a",)), i))
    held = sum(os.path.getsize(p) for p in segments(tmp_path))
    assert len(segments(tmp_path)) <= 2 and held < 2 * max(COMPACT_ROLL_BYTES, 1000 * 120) + 2 * 1024 * 1024
    log.close()
    assert sum(os.path.getsize(p) for p in segments(tmp_path)) < 2 * max(COMPACT_ROLL_BYTES, 1000 * 120)
    again = FileRaftLog(tmp_path)
    assert (again.snapshot_index, again.last_index) == (5000, 5000)
    # a log that keeps most of what it holds (a queue's retained messages) is not rolled
    again.append([E(i, 1, "r" * 90) for i in range(5001, 8001)])
    again.flush()
    assert [seg_first(p) for p in segments(tmp_path)] == [4001, 5001]  # rolled after the compaction at 5000
    again.install_snapshot(Snapshot(5500, 1, Config(("a",)), 5500))  # the older one goes whole
    again.append([E(8001, 1)])
    again.flush()
    assert [seg_first(p) for p in segments(tmp_path)] == [5001]  # and 5001.. is not rolled: mostly kept


def test_a_crash_after_a_truncation_deleted_later_segments_leaves_a_prefix(tmp_path):
    """The later segments are deleted before the replacing records are
    written: a crash in between leaves the old log up to the end of the
    segment holding the truncation point -- a prefix, never a mix."""
    import shutil

    log = FileRaftLog(tmp_path / "a", segment_bytes=1000)
    fill(log, 1, 60)
    log.flush()
    holding = max(seg_first(p) for p in segments(tmp_path / "a") if seg_first(p) <= 20)
    log.append([E(20, 2, "new20")])  # not written out: what a crash now leaves is on disk as it is
    shutil.copytree(tmp_path / "a", tmp_path / "crash")
    log.close()
    crashed = FileRaftLog(tmp_path / "crash", segment_bytes=1000)
    n = crashed.last_index
    assert 20 <= n < 60 and max(seg_first(p) for p in segments(tmp_path / "crash")) == holding
    assert list(crashed.entries(1, n + 1)) == [E(i, 1, f"{i}:1:" + "x" * 100) for i in range(1, n + 1)]


def test_an_append_that_cannot_be_encoded_changes_nothing(tmp_path):
    log = FileRaftLog(tmp_path)
    fill(log, 1, 5)
    before = state(log)
    with pytest.raises(TypeError):
        log.append([E(3, 2, "ok"), E(4, 2, object())])
    assert state(log) == before
    log.close()
    assert state(FileRaftLog(tmp_path)) == before
