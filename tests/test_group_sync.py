"""Group fsync (mirrorq.store.group_sync) and the Raft log's
write_out half of a flush: one syncfs per filesystem for many files, a lone
file fsynced, failures named per file."""

from __future__ import annotations

import os

import pytest

from mirrorq.mnesia_like.raft import Entry
from mirrorq.mnesia_like.raft_log import FileRaftLog
from mirrorq.store.group_sync import sync_files, syncfs_available


def _files(tmp_path, n):
    fds = {}
    for i in range(n):
        fd = os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT)
        os.write(fd, b"x" * 100)
        fds[f"k{i}"] = fd
    return fds


def test_many_files_on_one_filesystem_cost_one_syncfs(tmp_path):
    fds = _files(tmp_path, 5)
    calls = []
    try:
        failed = sync_files(
            fds, syncfs=lambda fd: calls.append(("syncfs", fd)), fsync=lambda fd: calls.append(("fsync", fd))
        )
        assert failed == {} and calls == [("syncfs", fds["k0"])]
        calls.clear()
        assert (
            sync_files(
                {"k3": fds["k3"]},
                syncfs=lambda fd: calls.append(("syncfs", fd)),
                fsync=lambda fd: calls.append(("fsync", fd)),
            )
            == {}
        )
        assert calls == [("fsync", fds["k3"])]  # a lone file: its own fsync
    finally:
        for fd in fds.values():
            os.close(fd)


def test_a_failed_syncfs_fails_every_file_it_covered_and_a_bad_descriptor_only_itself(tmp_path):
    fds = _files(tmp_path, 3)
    bad = os.open(tmp_path / "gone", os.O_RDWR | os.O_CREAT)
    os.close(bad)

    def broken(fd):
        raise OSError(5, "syncfs: Input/output error")

    try:
        failed = sync_files({**fds, "bad": bad}, syncfs=broken, fsync=lambda fd: None)
        assert set(failed) == {"k0", "k1", "k2", "bad"}
        assert failed["k1"].errno == 5 and failed["bad"].errno == 9  # EBADF: only that key
        failed = sync_files({"k0": fds["k0"], "bad": bad}, syncfs=broken, fsync=lambda fd: None)
        assert set(failed) == {"bad"}  # k0 alone on its filesystem: fsynced
    finally:
        for fd in fds.values():
            os.close(fd)


def test_the_real_calls_succeed_here(tmp_path):
    fds = _files(tmp_path, 3)
    try:
        assert sync_files(fds) == {}
        if os.uname().sysname == "Linux":
            assert syncfs_available()
    finally:
        for fd in fds.values():
            os.close(fd)


def test_write_out_hands_appends_to_the_os_and_names_the_file_to_sync(tmp_path):
    log = FileRaftLog(tmp_path / "g")
    assert log.write_out() is None  # nothing appended
    log.append([Entry(1, 1, 0, b"a"), Entry(2, 1, 0, b"b")])
    fd = log.write_out()
    assert isinstance(fd, int) and log.write_out() is None
    assert sync_files({"g": fd}) == {}
    again = FileRaftLog(tmp_path / "g")  # what a restart reads: both entries
    assert again.last_index == 2 and again.entry(2).data == b"b"
    again.close()
    log.close()


def test_nothing_to_sync_is_nothing_done():
    assert sync_files({}, syncfs=lambda fd: pytest.fail("no call"), fsync=lambda fd: pytest.fail("no call")) == {}


def test_a_classic_store_hands_its_fsync_to_the_caller_only_when_a_record_carries_a_promise(tmp_path):
    from mirrorq.classic.backing_queue import BackingQueue

    bq = BackingQueue(tmp_path / "q")
    owed: list = []
    fsyncs: list = []
    import mirrorq.store.segment_log as sl
    from mirrorq.fsapi import OsFileSystem

    real = sl.os.fsync
    OsFileSystem.fsync = staticmethod(lambda fd: fsyncs.append(fd) or real(fd))  # the logs' file system (fsapi.OS)
    try:
        bq.publish("m1", b"x" * 100)  # a publish: its confirm waits for the disk
        bq.flush_turn(owed.extend)
        assert len(owed) == 1 and fsyncs == []  # the caller owes the fsync, the store did none
        assert sync_files({"q": owed[0]}) == {}
        owed.clear()
        bq.ack([m.offset for m in bq.fetch(1)])  # deliveries and acks alone promise nothing
        bq.flush_turn(owed.extend)
        assert owed == [] and fsyncs == []
        bq.publish("m2", b"y")
        bq.flush_turn()  # without a caller to owe it: the store fsyncs itself
        assert len(fsyncs) == 1 and owed == []
    finally:
        OsFileSystem.fsync = staticmethod(real)
    reopened_after = bq.log.next_offset
    bq.close()
    again = BackingQueue(tmp_path / "q")
    assert again.log.next_offset == reopened_after and [m.body for m in again.peek(5)] == [b"y"]
    again.close()
