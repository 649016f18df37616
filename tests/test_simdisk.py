"""The simulated disk (mirrorq.simdisk): what a crash keeps, and the logs over it.

The model's own guarantees first (synced data kept, unsynced data lost or
kept as a prefix with a torn last write, names durable only with their
directory's fsync, determinism per seed), then the two production logs run
over it through many crashes: what was fsynced survives, and recovery never
fails on what a crash left.
"""

from __future__ import annotations

import fcntl
import os
import random

import pytest

from mirrorq.mnesia_like.raft_log import COMMAND, Entry, FileRaftLog
from mirrorq.simdisk import SimDisk, of
from mirrorq.store.segment_log import SegmentLog

SEEDS = range(60)
RW = os.O_RDWR | os.O_CREAT


def durable_file(disk: SimDisk, path: str, data: bytes) -> int:
    """``path`` created, written, fsynced with its directory; its fd."""
    fd = disk.open(path, RW, 0o644)
    disk.pwrite(fd, data, 0)
    disk.fsync(fd)
    dfd = disk.open(os.path.dirname(path), os.O_RDONLY)
    disk.fsync(dfd)
    disk.close(dfd)
    return fd


def test_reads_see_unsynced_writes_until_a_crash():
    disk = SimDisk()
    disk.makedirs("/d", exist_ok=True)
    fd = disk.open("/d/f", RW)
    disk.pwrite(fd, b"hello", 0)
    disk.pwrite(fd, b"!", 7)  # past the end: a hole of zeros
    assert disk.pread(fd, 100, 0) == b"hello\0\0!"
    assert disk.fstat(fd).st_size == 8 == disk.getsize("/d/f")
    disk.ftruncate(fd, 2)
    assert disk.read("/d/f") == b"he"
    assert disk.listdir("/d") == ["f"] and disk.exists("/d/f") and disk.exists("/d")


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed={s}")
def test_synced_data_survives_every_crash(seed):
    disk = SimDisk()
    disk.makedirs("/d", exist_ok=True)
    fd = durable_file(disk, "/d/f", b"A" * 100)
    disk.pwrite(fd, b"B" * 50, 100)
    disk.fsync(fd)
    disk.pwrite(fd, b"C" * 50, 150)  # not synced
    disk.crash(random.Random(seed))
    got = disk.read("/d/f")
    assert got[:150] == b"A" * 100 + b"B" * 50
    tail = got[150:]
    landed = tail.rstrip(b"\0")  # a prefix of the unsynced write, maybe zeros after it (size without data)
    assert landed == b"C" * len(landed)
    assert len(tail) <= 50


def test_unsynced_writes_are_lost_kept_whole_or_torn_across_seeds():
    outcomes = set()
    for seed in range(200):
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        fd = durable_file(disk, "/d/f", b"")
        disk.pwrite(fd, b"1" * 10, 0)
        disk.pwrite(fd, b"2" * 10, 10)
        disk.crash(random.Random(seed))
        got = disk.read("/d/f")
        # in order, up to a point: a prefix of the writes, the last possibly cut (or zeros past what landed)
        landed = got.rstrip(b"\0")
        assert (b"1" * 10 + b"2" * 10).startswith(landed), got
        assert len(got) <= 20
        if got == b"":
            outcomes.add("lost")
        elif got == b"1" * 10 + b"2" * 10:
            outcomes.add("kept")
        elif got == b"1" * 10:
            outcomes.add("first only")
        elif got.endswith(b"\0"):
            outcomes.add("size without data")
        else:
            outcomes.add("torn")
    assert outcomes == {"lost", "kept", "first only", "torn", "size without data"}


def test_a_torn_write_keeps_what_was_durable_under_the_rest_of_its_range():
    seen_torn = False
    for seed in range(100):
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        fd = durable_file(disk, "/d/f", b"." * 20)
        disk.pwrite(fd, b"x" * 10, 5)
        disk.crash(random.Random(seed))
        got = disk.read("/d/f")
        n = got.count(b"x")
        assert got == b"." * 5 + b"x" * n + b"." * (15 - n)
        seen_torn |= 0 < n < 10
    assert seen_torn


def test_an_unsynced_truncate_may_be_lost():
    results = set()
    for seed in range(40):
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        fd = durable_file(disk, "/d/f", b"abcdef")
        disk.ftruncate(fd, 3)
        disk.crash(random.Random(seed))
        results.add(disk.read("/d/f"))
    assert results == {b"abc", b"abcdef"}


def test_a_created_file_is_durable_only_with_its_directory_fsync():
    vanished = 0
    for seed in range(40):
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        fd = disk.open("/d/new", RW | os.O_EXCL)
        disk.pwrite(fd, b"data", 0)
        disk.fsync(fd)  # the content, not the name
        disk.crash(random.Random(seed))
        if not disk.exists("/d/new"):
            vanished += 1
        else:
            assert disk.read("/d/new") == b"data"
    assert 0 < vanished < 40
    disk = SimDisk()
    durable_file(disk, "/new", b"data")
    for seed in range(10):
        disk.crash(random.Random(seed))
        assert disk.read("/new") == b"data"


def test_a_rename_is_not_durable_before_the_directory_fsync():
    old_seen = new_seen = 0
    for seed in range(60):
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        durable_file(disk, "/d/state", b"old")
        fd = disk.open("/d/state.tmp", RW)
        disk.pwrite(fd, b"new", 0)
        disk.fsync(fd)
        disk.close(fd)
        disk.replace("/d/state.tmp", "/d/state")
        assert disk.read("/d/state") == b"new" and not disk.exists("/d/state.tmp")
        disk.crash(random.Random(seed))
        got = disk.read("/d/state")
        assert got in (b"old", b"new")
        old_seen += got == b"old"
        new_seen += got == b"new"
    assert old_seen and new_seen
    for seed in range(20):  # with the directory fsynced it always holds
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        durable_file(disk, "/d/state", b"old")
        fd = disk.open("/d/state.tmp", RW)
        disk.pwrite(fd, b"new", 0)
        disk.fsync(fd)
        disk.close(fd)
        disk.replace("/d/state.tmp", "/d/state")
        dfd = disk.open("/d", os.O_RDONLY)
        disk.fsync(dfd)
        disk.crash(random.Random(seed))
        assert disk.read("/d/state") == b"new" and disk.listdir("/d") == ["state"]


def test_a_rename_of_an_unsynced_file_can_leave_it_empty():
    empty = 0
    for seed in range(40):
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        fd = disk.open("/d/state.tmp", RW)
        disk.pwrite(fd, b"new", 0)  # no fsync before the rename: the classic mistake
        disk.replace("/d/state.tmp", "/d/state")
        dfd = disk.open("/d", os.O_RDONLY)
        disk.fsync(dfd)
        disk.crash(random.Random(seed))
        empty += disk.read("/d/state") == b""
    assert empty


def test_an_unlink_is_durable_with_the_directory_fsync():
    back = 0
    for seed in range(40):
        disk = SimDisk()
        disk.makedirs("/d", exist_ok=True)
        durable_file(disk, "/d/f", b"x")
        disk.unlink("/d/f")
        assert not disk.exists("/d/f")
        disk.crash(random.Random(seed))
        back += disk.exists("/d/f")
    assert 0 < back < 40


def test_a_crash_closes_every_descriptor_and_frees_the_locks():
    disk = SimDisk()
    disk.makedirs("/d", exist_ok=True)
    fd = durable_file(disk, "/d/LOCK", b"")
    disk.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other = disk.open("/d/LOCK", os.O_RDWR)
    with pytest.raises(BlockingIOError):
        disk.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    disk.crash(random.Random(1))
    with pytest.raises(OSError):
        disk.pread(fd, 1, 0)
    again = disk.open("/d/LOCK", os.O_RDWR)
    disk.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_errors_are_the_os_ones():
    disk = SimDisk()
    with pytest.raises(FileNotFoundError):
        disk.open("/nope/f", RW)
    with pytest.raises(FileNotFoundError):
        disk.open("/f", os.O_RDONLY)
    fd = disk.open("/f", RW | os.O_EXCL)
    with pytest.raises(FileExistsError):
        disk.open("/f", RW | os.O_EXCL)
    ro = disk.open("/f", os.O_RDONLY)
    with pytest.raises(OSError):
        disk.pwrite(ro, b"x", 0)
    disk.close(fd)
    with pytest.raises(OSError):
        disk.close(fd)
    disk.makedirs("/a/b", exist_ok=True)
    with pytest.raises(OSError):
        disk.rename("/f", "/a/f")  # across directories: not modelled
    with pytest.raises(FileNotFoundError):
        disk.unlink("/a/f")


def _history(seed: int) -> tuple:
    """A random run of operations and crashes; the disk it leaves."""
    rng = random.Random(seed)
    disk = SimDisk()
    disk.makedirs("/d", exist_ok=True)
    for _ in range(60):
        name = f"/d/f{rng.randrange(3)}"
        fd = disk.open(name, RW)
        for _ in range(rng.randrange(4)):
            disk.pwrite(fd, bytes([rng.randrange(256)]) * rng.randrange(1, 30), rng.randrange(50))
        if rng.random() < 0.3:
            disk.fsync(fd)
        if rng.random() < 0.1:
            disk.unlink(name)
        disk.close(fd)
        if rng.random() < 0.1:
            disk.crash(rng)
    disk.crash(rng)
    return tuple((n, disk.read(f"/d/{n}")) for n in disk.listdir("/d")), disk.crashes, disk.lost, disk.torn


def test_the_same_seed_gives_the_same_disk():
    runs = [_history(seed) for seed in range(20)]
    assert runs == [_history(seed) for seed in range(20)]
    assert len(set(runs)) > 15


def test_of_keeps_one_disk_per_simulator_node():
    disk: dict = {}
    assert of(disk) is of(disk)


# ---- the logs over the simulated disk -------------------------------------


@pytest.mark.parametrize("seed", range(1000), ids=lambda s: f"seed={s}")
def test_segment_log_keeps_what_it_fsynced_through_crashes(seed):
    rng = random.Random(seed)
    disk = SimDisk()
    segment_bytes = rng.choice([200, 600, 4096])
    log = SegmentLog("/q", segment_bytes=segment_bytes, fs=disk)
    synced: list[int] = []  # offsets durable for sure, in order
    written: dict[int, int] = {}  # offset -> body, everything ever appended
    for _ in range(rng.randrange(5, 40)):
        for off in log.append([(1, {"i": rng.randrange(1000), "pad": "x" * rng.randrange(60)})] * rng.randrange(1, 6)):
            written[off] = off
        r = rng.random()
        if r < 0.5:
            log.flush()
            synced = [o for o, _ in log.read_from(0)]
        elif r < 0.7:
            log.flush(sync=False)
        elif r < 0.8 and len(log.segment_bases) > 1:
            log.truncate(rng.randrange(log.segment_bases[0] + 1, log.next_offset + 1))
            synced = [o for o, _ in log.read_from(0)]
        elif r < 0.9 and len(log.segment_bases) > 1:
            log.flush()  # a compaction deletes a whole flushed segment: it must stay deleted through a crash
            log.delete_segment(rng.choice(log.segment_bases[:-1]))
            synced = [o for o, _ in log.read_from(0)]
        if rng.random() < 0.25:
            if rng.random() < 0.5:
                log.close(flush=False)  # a killed replica's store (its host closes it, flushing nothing)
            disk.crash(rng)
            log = SegmentLog("/q", segment_bytes=segment_bytes, fs=disk)
            got = [o for o, _ in log.read_from(0)]
            assert got[: len(synced)] == synced, f"seed {seed}: fsynced records lost"
            assert got == sorted(got) and all(o in written for o in got)
            synced = got
    log.close()


def E(i: int, term: int, data=None) -> Entry:
    return Entry(i, term, COMMAND, data)


@pytest.mark.parametrize("seed", range(1000), ids=lambda s: f"seed={s}")
def test_file_raft_log_keeps_what_it_flushed_through_crashes(seed):
    rng = random.Random(seed)
    disk = SimDisk()
    segment_bytes = rng.choice([150, 500, 1 << 16])
    log = FileRaftLog("/r", segment_bytes=segment_bytes, fs=disk)
    flushed: list[tuple[int, int]] = []  # (index, term) durable for sure
    hard = (0, None)
    term = 1
    for _ in range(rng.randrange(5, 40)):
        r = rng.random()
        if r < 0.6:
            start = log.last_index + 1 if rng.random() < 0.8 else max(log.snapshot_index + 1, log.last_index - 2)
            if rng.random() < 0.3:
                term += 1
            flushed = [x for x in flushed if x[0] < start]  # a conflicting append replaces the rest
            log.append([E(i, term, "p" * rng.randrange(40)) for i in range(start, start + rng.randrange(1, 5))])
        elif r < 0.7:
            log.set_hard_state(term, rng.choice(["a", "b", None]))
            hard = (log.term, log.voted_for)  # durable when it returns
        elif r < 0.75 and log.last_index > log.snapshot_index:
            from mirrorq.mnesia_like.raft_log import Config, Snapshot

            i = rng.randrange(log.snapshot_index + 1, log.last_index + 1)
            log.install_snapshot(Snapshot(i, log.term_at(i), Config(("a",)), b"s"))
        if rng.random() < 0.5:
            log.flush()
            flushed = [(i, log.term_at(i)) for i in range(log.snapshot_index + 1, log.last_index + 1)]
        if rng.random() < 0.25:
            disk.crash(rng)
            log = FileRaftLog("/r", segment_bytes=segment_bytes, fs=disk)
            got = [(i, log.term_at(i)) for i in range(log.snapshot_index + 1, log.last_index + 1)]
            kept = [x for x in flushed if x[0] > log.snapshot_index]
            assert got[: len(kept)] == kept, f"seed {seed}: flushed entries lost"
            assert (log.term, log.voted_for) == hard
            for i in range(log.snapshot_index + 1, log.last_index + 1):
                log.entry(i)  # every entry reads back
            flushed, hard = got, (log.term, log.voted_for)
    log.close()
