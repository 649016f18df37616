"""NodeLog: one JSON line per record; lines of a turn are written after the
turn's messages have left (mirrorq.node.log, PostingActor._run_turn)."""

from __future__ import annotations

import os

import pytest

from mirrorq.node.log import NodeLog, read
from mirrorq.node.posting import PostingActor


def test_lines_are_written_at_once_outside_hold(tmp_path):
    log = NodeLog(str(tmp_path), "n1", "test")
    log("one", x=1)
    assert [(r["event"], r["x"], r["node"], r["component"]) for r in read(str(tmp_path))] == [("one", 1, "n1", "test")]


def test_held_lines_wait_for_release_and_keep_their_order(tmp_path):
    log = NodeLog(str(tmp_path), "n1", "test")
    log.hold()
    log("a")
    log("b", level="warning")
    assert read(str(tmp_path)) == []
    log.release()
    assert [(r["event"], r["level"]) for r in read(str(tmp_path))] == [("a", "info"), ("b", "warning")]
    log("c")  # released: written at once again
    assert [r["event"] for r in read(str(tmp_path))] == ["a", "b", "c"]


def test_close_writes_what_is_held(tmp_path):
    log = NodeLog(str(tmp_path), "n1", "test")
    log.hold()
    log("kept")
    log.close()
    assert [r["event"] for r in read(str(tmp_path))] == ["kept"]


class _Turns(PostingActor):
    """A PostingActor outside any actor system: its transmit step records
    what the log file held at that moment."""

    def __init__(self, data_dir: str) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.log = NodeLog(data_dir, "n1", "turns")
        self.seen_at_transmit: list = []

    def on_message(self, msg, sender):
        self.log("handled", msg=msg)
        if msg == "boom":
            raise RuntimeError("handler failed")

    def _transmit_ready(self) -> None:
        self.seen_at_transmit.append([r["event"] for r in read(self.data_dir)])


def test_a_turns_lines_are_written_after_its_messages_left(tmp_path):
    a = _Turns(str(tmp_path))
    a._turn("first", None)
    assert a.seen_at_transmit == [[]]  # nothing of the turn was written before its transmit
    assert [(r["event"], r["msg"]) for r in read(str(tmp_path))] == [("handled", "first")]


def test_a_turn_that_fails_still_writes_its_lines(tmp_path):
    a = _Turns(str(tmp_path))
    with pytest.raises(RuntimeError):
        a._run_turn(lambda: a.on_message("boom", None), "boom")
    assert [r["msg"] for r in read(str(tmp_path))] == ["boom"]
    a.log("after")  # not held any more
    assert [r["event"] for r in read(str(tmp_path))] == ["handled", "after"]


def test_lines_a_full_disk_refuses_are_written_once_it_takes_them_again(tmp_path, monkeypatch):
    """/dev/full refuses every write with ENOSPC, as a full file system does:
    the refused lines are kept and written first once writes go through;
    past BACKLOG_BYTES they are dropped, counted, and said to be."""
    from mirrorq.node import log as node_log

    log = NodeLog(str(tmp_path), "n1", "test")
    log("before")
    real, log._fd = log._fd, os.open("/dev/full", os.O_WRONLY)
    log("kept1")
    log.hold()
    log("kept2")
    log("kept3")
    log.release()
    monkeypatch.setattr(node_log, "BACKLOG_BYTES", len(log._backlog) + 10)
    log("lost", pad="x" * 20)  # no room left in the backlog
    os.close(log._fd)
    log._fd = real
    log("after")
    recs = read(str(tmp_path))
    assert [r["event"] for r in recs] == ["before", "log_lines_dropped", "kept1", "kept2", "kept3", "after"]
    assert recs[1]["count"] == 1 and recs[1]["level"] == "warning" and "space" in recs[1]["error"]
    assert recs[2]["ts"] <= recs[1]["ts"]  # the kept lines have the times they were logged at


def test_a_line_cut_short_by_a_full_disk_is_written_again_whole(tmp_path):
    """A file size limit (RLIMIT_FSIZE, in a child process) cuts a write
    short as a disk filling up does: the torn piece is ended by the next
    write and read() skips it; the torn line is written again whole, in
    its order, and nothing is lost."""
    import subprocess
    import sys

    code = f"""
import os, resource, signal, sys
sys.path.insert(0, {os.getcwd()!r})
from mirrorq.node.log import NodeLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
log = NodeLog({str(tmp_path)!r}, "n1", "test")
log("first", pad="x" * 50)
size = os.fstat(log._fd).st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, resource.RLIM_INFINITY))
log("torn", pad="y" * 200)
log("refused")
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
log("last")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    lines = (tmp_path / "node.log").read_text().splitlines()
    assert (
        len(lines) == 5
        and lines[1].startswith('{"ts"')
        and len(lines[1]) == 40
        and lines[2].endswith('"' + "y" * 200 + '"}')
    )  # the piece, then the line whole
    recs = read(str(tmp_path))
    assert [r["event"] for r in recs] == ["first", "torn", "refused", "last"]
    assert recs[1]["pad"] == "y" * 200 and recs[1]["ts"] <= recs[2]["ts"]
