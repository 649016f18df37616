"""NodeLog: one JSON line per record; lines of a turn are written after the
turn's messages have left (mirrorq.node.log, PostingActor._run_turn)."""

from __future__ import annotations

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
