"""The nemesis' pure parts: the total-queue checker and the seeded schedule."""

from __future__ import annotations

from ctl.nemesis import checker, schedule


def pub(v, t0, t1, typ="ok", proc="p1", **kw):
    return [
        {"type": "invoke", "f": "publish", "value": v, "time": t0, "process": proc},
        {"type": typ, "f": "publish", "value": v, "time": t1, "process": proc, **kw},
    ]


def con(v, t, proc="c1"):
    return {"type": "ok", "f": "consume", "value": v, "time": t, "process": proc}


def test_clean_history_is_valid():
    ops = pub("a", 0, 0.1) + pub("b", 0.2, 0.3) + [con("a", 0.4), con("b", 0.5)]
    r = checker.check(ops, final_depth=0)
    assert r.valid and (r.confirmed, r.consumed, r.lost, r.duplicates) == (2, 2, [], {})
    assert r.latency["max"] == 0.1


def test_lost_unexpected_duplicates_recovered():
    ops = (
        pub("a", 0, 1)
        + pub("b", 1, 2)
        + pub("c", 2, 3, typ="info", error="StreamLostError")
        + pub("d", 3, 4, typ="fail", error="nack")
        + [con("a", 5), con("a", 6), con("c", 7), con("zz", 8), con("d", 9)]
    )
    r = checker.check(ops, final_depth=0)
    assert r.lost == ["b"]
    assert r.unexpected == ["zz"]
    assert r.duplicates == {"a": 2}
    assert r.recovered == 1
    assert r.failed_delivered == ["d"]
    assert not r.valid


def test_stuck_is_what_the_broker_still_holds():
    ops = pub("a", 0, 1) + pub("b", 1, 2) + pub("c", 2, 3) + [con("a", 4)]
    r = checker.check(ops, final_depth=1)
    assert r.stuck == 1 and len(r.lost) == 1 and not r.valid
    assert checker.check(ops).lost == ["b", "c"]  # no final depth: all of them count as lost


def test_unanswered_and_stall():
    ops = pub("a", 0, 1) + pub("b", 1, 41) + pub("c", 41, 42, typ="info", error="timeout")
    ops += [{"type": "invoke", "f": "declare", "value": "q", "time": 50, "process": "c1"}]
    r = checker.check(ops, bound=30)
    kinds = sorted((u["value"], u["error"]) for u in r.unanswered)
    assert kinds == [("b", None), ("c", "timeout"), ("q", "never completed")]
    assert r.longest_stall == 40.0
    assert not r.valid


def test_nemesis_ops_are_counted_as_faults():
    ops = [
        {"type": "info", "f": "kill", "value": "node1", "process": "nemesis", "time": 0},
        {
            "type": "info",
            "f": "partition",
            "value": [["node1"], ["node2"]],
            "mode": "reset",
            "process": "nemesis",
            "time": 1,
        },
        {"type": "info", "f": "heal", "value": "node1", "process": "nemesis", "time": 2},
    ]
    assert checker.check(ops).faults == {"kill": 1, "partition-reset": 1}


def test_schedules_are_deterministic_from_the_seed():
    assert schedule.random_schedule(3, 120) == schedule.random_schedule(3, 120)
    assert schedule.random_schedule(3, 120) != schedule.random_schedule(4, 120)
    steps = schedule.random_schedule(5, 300)
    assert sum(s.hold + s.quiet for s in steps) >= 300
    acc = schedule.acceptance_schedule(7)
    assert acc == schedule.acceptance_schedule(7)
    assert sorted((s.fault, s.target) for s in acc) == sorted(
        [
            ("kill", "consumer"),
            ("kill", "master"),
            ("restart", "any"),
            ("partition-drop", "master"),
            ("partition-drop", "mirror"),
        ]
    )
    assert schedule.parse("kill:master:5:6,pause:any:1:2") == [
        schedule.Step("kill", "master", 5, 6),
        schedule.Step("pause", "any", 1, 2),
    ]


# ---- two masters, control plane ----------------------------------------------------------------
def _ev(ts, event, comp="queue_host1", **kw):
    return {"ts": ts, "event": event, "component": comp, **kw}


def test_a_cut_master_that_paused_before_the_promotion_is_not_a_second_master():
    from ctl.nemesis.checker import mastership_overlaps

    logs = {
        "node3": [
            _ev(1.0, "promoted", queue="q", member="m3"),
            _ev(10.0, "host_paused"),
            _ev(70.0, "host_resumed"),
            _ev(70.1, "replica_stopped", queue="q"),
        ],
        "node1": [_ev(11.0, "promoted", queue="q", member="m1")],
        "node2": [_ev(11.0, "promoted", queue="other", member="x2")],
    }
    assert mastership_overlaps(logs, "q") == []
    # the same history without the pause: node3 served until it was stopped at the heal
    logs["node3"] = [e for e in logs["node3"] if e["event"] not in ("host_paused", "host_resumed")]
    got = mastership_overlaps(logs, "q")
    assert got == [{"nodes": ["node3", "node1"], "members": ["m3", "m1"], "from": 11.0, "until": 70.1}]
    # confirmed as master after a resume although node1 serves: an overlap too
    logs["node3"] = [
        _ev(1.0, "promoted", queue="q", member="m3"),
        _ev(10.0, "host_paused"),
        _ev(70.0, "host_resumed"),
        _ev(70.0, "master_confirmed", member="m3"),
        _ev(70.5, "master_known", queue="q", master="m1"),
    ]
    assert mastership_overlaps(logs, "q") == [
        {"nodes": ["node1", "node3"], "members": ["m1", "m3"], "from": 70.0, "until": 70.5}
    ]


def test_control_plane_operations_slower_than_the_bound_or_failed_fail_the_run():
    from ctl.nemesis.checker import check

    ops = [
        {"type": "ok", "f": "control", "value": "set_policy", "latency": 0.4, "process": "control", "time": 1.0},
        {"type": "ok", "f": "control", "value": "list_queues", "latency": 1.2, "process": "control", "time": 2.0},
    ]
    r = check(ops, control_bound=5.0)
    assert r.valid and r.control == {"set_policy": {"n": 1, "max": 0.4}, "list_queues": {"n": 1, "max": 1.2}}
    r = check(
        ops
        + [
            {
                "type": "ok",
                "f": "control",
                "value": "declare",
                "latency": 7.5,
                "process": "control",
                "node": "node1",
                "time": 3.0,
            },
            {
                "type": "fail",
                "f": "control",
                "value": "set_policy",
                "latency": 0.1,
                "process": "control",
                "error": "no leader",
                "time": 4.0,
            },
        ],
        control_bound=5.0,
    )
    assert not r.valid and [c["op"] for c in r.control_slow] == ["declare", "set_policy"]
    assert any("control-plane" in p for p in r.problems())


def test_a_killed_or_stopped_master_serves_nothing_until_confirmed_again():
    from ctl.nemesis.checker import mastership_overlaps

    logs = {
        "node3": [_ev(1.0, "promoted", queue="q", member="m3")],
        "node1": [_ev(6.5, "promoted", queue="q", member="m1")],
    }
    assert mastership_overlaps(logs, "q", {"node3": [5.0]}) == []  # killed at 5 s (no line of its own)
    assert mastership_overlaps(logs, "q")[0]["nodes"] == ["node3", "node1"]
    # SIGSTOPped at 5 s, resumed and confirmed by the leader at 40 s while node1 serves
    logs["node3"].append(_ev(40.0, "master_confirmed", member="m3"))
    assert mastership_overlaps(logs, "q", {"node3": [5.0]})[0]["from"] == 40.0


def test_partition_times_count_a_majority_logged_just_before_the_heal_was_recorded():
    """The node may hear the majority again before the nemesis writes its
    heal down: that pause ended at the heal (0 s), not at the node's next
    pause, minutes later; a flap's many pauses count from the last."""
    from ctl.nemesis.runner import partition_times

    ops = [
        {"process": "nemesis", "f": "partition", "node": "n1", "time": 100.0},
        {"process": "nemesis", "f": "heal", "time": 160.05},
        {"process": "nemesis", "f": "partition", "node": "n1", "time": 200.0},
        {"process": "nemesis", "f": "heal", "time": 260.0},
    ]
    logs = {
        "n1": [
            {"event": "minority", "ts": 101.0},
            {"event": "majority", "ts": 160.0},
            {"event": "minority", "ts": 200.9},
            {"event": "majority", "ts": 203.0},
            {"event": "minority", "ts": 204.9},
            {"event": "majority", "ts": 260.4},
            {"event": "minority", "ts": 400.0},
            {"event": "majority", "ts": 500.0},
        ]
    }
    step_down, heal = partition_times(ops, logs)
    assert step_down == [1.0, 0.9]
    assert heal == [0.0, 0.4]


def test_a_control_op_whose_node_a_fault_cut_while_it_ran_is_not_the_majoritys():
    """A list_queues begun on a settled node a moment before the next fault
    cut that node answered after 6.9 s: not a slow majority.  The same op
    on a node that stayed in the majority is."""
    from ctl.nemesis.checker import check

    ops = [
        {
            "type": "ok",
            "f": "control",
            "value": "list_queues",
            "time": 10.0,
            "process": "control",
            "node": "n1",
            "latency": 6.874,
            "majority": False,
        },
        {
            "type": "ok",
            "f": "control",
            "value": "declare",
            "time": 11.0,
            "process": "control",
            "node": "n2",
            "latency": 0.2,
            "majority": True,
        },
    ]
    assert check(ops).control_slow == []
    ops[0]["majority"] = True
    assert [c["op"] for c in check(ops).control_slow] == ["list_queues"]
