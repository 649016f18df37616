"""The master's amqqueue record write (``record_txn``) against the registry
state machine: fenced by the writer's GM view, so a deposed master's late
write cannot overwrite its successor's record."""

from __future__ import annotations

from mirrorq.classic.actor import record_txn
from mirrorq.gm.core import ProposeView
from mirrorq.gm.names import create_txn, propose_txn
from mirrorq.mnesia_like.registry import Registry

GROUP = "/ q"
KEY = ["/", "q"]


def fields(master: str, members: list[str]) -> dict:
    return {
        "pid": master,
        "slave_pids": [m for m in members if m != master],
        "sync_slave_pids": [m for m in members if m != master],
        "gm_pids": list(members),
        "state": "live",
    }


def new_row(want: dict) -> dict:
    return {
        "name": "q",
        "vhost": "/",
        "durable": True,
        "auto_delete": False,
        "exclusive_owner": None,
        "arguments": {},
        "incarnation": "i1",
        **want,
    }


def founded(members: list[str]) -> Registry:
    reg = Registry()
    assert reg.apply(create_txn(GROUP, members)).ok
    return reg


def test_the_founding_master_creates_its_record_under_view_1():
    reg = founded(["a", "b", "c"])
    want = fields("a", ["a", "b", "c"])
    res = reg.apply(record_txn(KEY, want, GROUP, 1, new_row(want)))
    assert res.ok, res.error
    assert reg.get("amqqueue", KEY)["pid"] == "a"


def test_a_deposed_masters_late_write_is_refused_and_the_successors_record_stays():
    reg = founded(["a", "b", "c"])
    first = fields("a", ["a", "b", "c"])
    assert reg.apply(record_txn(KEY, first, GROUP, 1, new_row(first))).ok
    # a is taken out of the view (version 2); b, promoted, writes its record
    assert reg.apply(propose_txn(GROUP, ProposeView(expected_version=1, members=("b", "c")))).ok
    second = fields("b", ["b", "c"])
    assert reg.apply(record_txn(KEY, second, GROUP, 2)).ok
    # a's write, sent while it still held view 1, commits only now: refused
    late = fields("a", ["a", "c"])
    res = reg.apply(record_txn(KEY, late, GROUP, 1))
    assert not res.ok and "gm_group" in res.error and "version is 2" in res.error, res.error
    assert reg.get("amqqueue", KEY)["pid"] == "b"
    assert reg.get("amqqueue", KEY)["gm_pids"] == ["b", "c"]


def test_a_write_under_a_view_that_was_never_committed_is_refused():
    reg = Registry()  # no gm_group row
    want = fields("a", ["a"])
    res = reg.apply(record_txn(KEY, want, GROUP, 1, new_row(want)))
    assert not res.ok and "does not exist" in res.error, res.error
    assert reg.get("amqqueue", KEY) is None
    # no view installed yet: no fence
    assert reg.apply(record_txn(KEY, want, GROUP, None, new_row(want))).ok


def test_an_update_still_needs_the_record():
    reg = founded(["a"])
    res = reg.apply(record_txn(KEY, fields("a", ["a"]), GROUP, 1))
    assert not res.ok and "amqqueue" in res.error, res.error
