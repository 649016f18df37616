"""mirrorctl's quorum commands, the pure parts: quorum_status rows (lag vs
the leader), grow / shrink plans, error -> exit code mapping, argument
parsing; and the ring view's quorum line."""

from __future__ import annotations

import io

import pytest

from ctl import mirrorctl as mc
from ctl.ring_view import render
from mirrorq.admin import ops
from mirrorq.admin.ring import ring_rows
from mirrorq.queues.manager_core import QuorumMembersResult

A, B, C = "node1/quorum/a", "node2/quorum/b", "node3/quorum/c"


def _status(member, state, last, applied=None, membership="voter"):
    return {
        "member": member,
        "raft_state": state,
        "membership": membership,
        "last_index": last,
        "applied_index": applied if applied is not None else last,
        "commit_index": applied or last,
        "snapshot_index": 0,
        "term": 4,
    }


def test_quorum_status_rows_show_each_member_and_its_lag_behind_the_leader():
    rows = ops.quorum_status_rows(
        [
            _status(A, "follower", 40),
            _status(B, "leader", 42),
            _status(C, "follower", 12, membership="learner"),
            {"member": "node4/quorum/d", "raft_state": "down", "error": "node node4 is down"},
        ]
    )
    assert [(r["Node Name"], r["Raft State"], r["Membership"], r["Lag"]) for r in rows] == [
        ("node1", "follower", "voter", 2),
        ("node2", "leader", "voter", 0),
        ("node3", "follower", "learner", 30),
        ("node4", "down", None, None),
    ]
    assert set(rows[0]) == set(ops.QUORUM_STATUS_COLUMNS)


def test_quorum_status_without_a_leader_has_no_lag():
    rows = ops.quorum_status_rows([_status(A, "candidate", 40), _status(B, "pre_vote", 41)])
    assert [r["Lag"] for r in rows] == [None, None]


def _rec(name, members, vhost="/", kind="quorum"):
    return {"vhost": vhost, "name": name, "type": kind, "members": members, "pid": f"{members[0]}#1"}


def test_grow_plan_picks_quorum_queues_without_a_member_on_the_node():
    recs = [
        _rec("q2", [A, B]),
        _rec("q1", [A]),
        _rec("q3", [A, C]),
        _rec("q4", [A, B, C]),
        {"vhost": "/", "name": "classic", "pid": "node1/127.0.0.1:1/x", "slave_pids": []},
        _rec("other", [A], vhost="v"),
    ]
    assert [r["name"] for r in ops.grow_plan(recs, "node3")] == ["q1", "q2", "other"]
    assert [r["name"] for r in ops.grow_plan(recs, "node3", "even")] == ["q2"]
    assert [r["name"] for r in ops.grow_plan(recs, "node3", vhost_pattern="^/$", queue_pattern="1")] == ["q1"]


def test_shrink_plan_picks_quorum_queues_with_a_member_on_the_node():
    recs = [_rec("q2", [A, B]), _rec("q1", [C]), _rec("q3", [A, C])]
    assert [r["name"] for r in ops.shrink_plan(recs, "node3")] == ["q1", "q3"]


@pytest.mark.parametrize(
    "reason, code",
    [
        ("not_found", 70),
        ("not_quorum", 70),
        ("exists", 70),
        ("not_member", 70),
        ("last_member", 70),
        ("refused", 70),
        ("no_node", 69),
        ("node_down", 69),
        ("timeout", 75),
        ("bad_request", 64),
    ],
)
def test_member_errors_carry_rabbitmqctl_exit_codes(reason, code):
    e = ops.member_error(QuorumMembersResult(False, None, "why", reason), "add_member of queue 'q'")
    assert e.exit_code == code and str(e) == "add_member of queue 'q': why"


def test_membership_commands_parse():
    p = mc.build_parser()
    a = p.parse_args(["add_member", "-p", "v", "q", "node3"])
    assert (a.func, a.vhost, a.name, a.member_node) == (mc.cmd_add_member, "v", "q", "node3")
    a = p.parse_args(["grow", "node3", "even", "--queue-pattern", "^qq"])
    assert (a.func, a.member_node, a.strategy, a.queue_pattern) == (mc.cmd_grow, "node3", "even", "^qq")
    a = p.parse_args(["shrink", "node2", "--errors-only"])
    assert (a.func, a.member_node, a.errors_only) == (mc.cmd_shrink, "node2", True)
    assert p.parse_args(["quorum_status", "q"]).func is mc.cmd_quorum_status
    with pytest.raises(SystemExit) as e:
        p.parse_args(["add_member", "q"])  # no node
    assert e.value.code == 64


def test_ring_view_shows_a_quorum_group_with_follower_lags():
    from rich.console import Console

    rec = _rec("qq", [A, B, C])
    rec["pid"] = f"{B}#7"
    info = {
        ("/", "qq"): {
            "ok": True,
            "value": {"messages": 5, "last_index": 50, "commit_index": 48, "learners": [C], "match": {A: 47, C: 20}},
        }
    }
    (row,) = ring_rows([rec], info, {"node1", "node2", "node3"})
    assert [(m["node"], m["state"], m["lag"]) for m in row["ring"]] == [
        ("node1", "follower", 3),
        ("node2", "leader", None),
        ("node3", "learner", 30),
    ]
    assert (row["messages"], row["mirror_lag"], row["commit_index"]) == (5, 30, 48)
    (down,) = ring_rows([rec], {}, {"node2", "node3"})
    assert [m["state"] for m in down["ring"]] == ["down", "leader", "follower"] and down["mirror_lag"] is None
    out = io.StringIO()
    Console(file=out, width=200).print(render([row], "t"))
    text = out.getvalue()
    assert "qq (quorum)" in text and "node1 (follower, lag 3)" in text and "commit 48" in text
