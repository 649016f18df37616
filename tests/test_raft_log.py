"""Storage under the Raft core: MemoryRaftLog (simulator disk dict) and
FileRaftLog (append-only CRC32C log, atomic hard state and snapshot)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq import preallocate
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
    return (log.term, log.voted_for, log.snapshot, log.snapshot_index, log.last_index,
            [log.entry(i) for i in range(log.snapshot_index + 1, log.last_index + 1)])


def record_offsets(path):
    """Byte offsets of each record (header 12 bytes, length first)."""
    blob = open(path, "rb").read()
    offs, off = [], 0
    while off < len(blob):
        offs.append(off)
        off += 12 + int.from_bytes(blob[off:off + 4], "big")
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


def test_file_compaction_shrinks_the_log_file(tmp_path):
    log = FileRaftLog(tmp_path)
    log.append([E(i, 1, "x" * 100) for i in range(1, 101)])
    log.flush()
    size = os.path.getsize(tmp_path / "log")
    log.install_snapshot(Snapshot(90, 1, Config(("a",)), b"blob"))
    assert os.path.getsize(tmp_path / "log") < size / 5
    log.close()
    assert FileRaftLog(tmp_path).last_index == 100


def test_group_fsync_one_per_flush(tmp_path, monkeypatch):
    log = FileRaftLog(tmp_path)
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
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
    offs, blob = record_offsets(tmp_path / "log")
    last = offs[-1]
    (tmp_path / "log").write_bytes(blob[: last + cut] + b"\0" * ahead)
    again = FileRaftLog(tmp_path)
    assert again.last_index == 4
    assert os.path.getsize(tmp_path / "log") == last
    again.append([E(5, 2, "rewritten")])
    again.close()
    assert FileRaftLog(tmp_path).entry(5) == E(5, 2, "rewritten")


@pytest.mark.parametrize("tail", ["zeros", "bad_last_payload"])
def test_torn_tail_variants(tmp_path, tail):
    log = FileRaftLog(tmp_path)
    log.append([E(i, 1) for i in range(1, 4)])
    log.close()
    offs, blob = record_offsets(tmp_path / "log")
    if tail == "zeros":
        with open(tmp_path / "log", "ab") as f:
            f.write(b"\0" * 40)
        expect_size, expect_last = len(blob), 3
    else:
        with open(tmp_path / "log", "r+b") as f:
            f.seek(len(blob) - 1)
            f.write(bytes([blob[-1] ^ 0xFF]))
        expect_size, expect_last = offs[-1], 2
    again = FileRaftLog(tmp_path)
    assert again.last_index == expect_last
    assert os.path.getsize(tmp_path / "log") == expect_size


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corruption_in_the_middle_names_file_and_offset(tmp_path, where):
    log = FileRaftLog(tmp_path)
    log.append([E(i, 1) for i in range(1, 6)])
    log.close()
    offs, blob = record_offsets(tmp_path / "log")
    victim = offs[2]
    pos = victim + (14 if where == "payload" else 2)
    with open(tmp_path / "log", "r+b") as f:
        f.seek(pos)
        f.write(bytes([blob[pos] ^ 0x55]))
    with pytest.raises(RaftLogCorrupt) as info:
        FileRaftLog(tmp_path)
    err = info.value
    assert err.offset == victim and err.path == str(tmp_path / "log")
    assert f"{tmp_path / 'log'}: corrupt record at byte offset {victim}" in str(err)
    assert os.path.getsize(tmp_path / "log") == len(blob)  # nothing was thrown away


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


@settings(max_examples=60, deadline=None)
@given(ops)
def test_file_log_matches_memory_log_across_reopens(tmp_path_factory, program):
    """Any sequence of appends (with truncation), votes, snapshots and
    reopens leaves FileRaftLog in the same state as MemoryRaftLog."""
    path = tmp_path_factory.mktemp("prop")
    mem, disk = MemoryRaftLog({}), FileRaftLog(path)
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
            disk = FileRaftLog(path)
        disk.flush()
        assert state(disk) == state(mem)
    disk.close()
    assert state(FileRaftLog(path)) == state(mem)


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
    path = tmp_path / "log"
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
