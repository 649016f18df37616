"""The nemesis' pure parts: the total-queue checker and the seeded schedule."""

from __future__ import annotations

from mirrorq.nemesis import checker, schedule


def pub(v, t0, t1, typ="ok", proc="p1", **kw):
    return [{"type": "invoke", "f": "publish", "value": v, "time": t0, "process": proc},
            {"type": typ, "f": "publish", "value": v, "time": t1, "process": proc, **kw}]


def con(v, t, proc="c1"):
    return {"type": "ok", "f": "consume", "value": v, "time": t, "process": proc}


def test_clean_history_is_valid():
    ops = pub("a", 0, 0.1) + pub("b", 0.2, 0.3) + [con("a", 0.4), con("b", 0.5)]
    r = checker.check(ops, final_depth=0)
    assert r.valid and (r.confirmed, r.consumed, r.lost, r.duplicates) == (2, 2, [], {})
    assert r.latency["max"] == 0.1


def test_lost_unexpected_duplicates_recovered():
    ops = (pub("a", 0, 1) + pub("b", 1, 2) + pub("c", 2, 3, typ="info", error="StreamLostError")
           + pub("d", 3, 4, typ="fail", error="nack")
           + [con("a", 5), con("a", 6), con("c", 7), con("zz", 8), con("d", 9)])
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
    ops = [{"type": "info", "f": "kill", "value": "node1", "process": "nemesis", "time": 0},
           {"type": "info", "f": "partition", "value": [["node1"], ["node2"]], "mode": "reset",
            "process": "nemesis", "time": 1},
           {"type": "info", "f": "heal", "value": "node1", "process": "nemesis", "time": 2}]
    assert checker.check(ops).faults == {"kill": 1, "partition-reset": 1}


def test_schedules_are_deterministic_from_the_seed():
    assert schedule.random_schedule(3, 120) == schedule.random_schedule(3, 120)
    assert schedule.random_schedule(3, 120) != schedule.random_schedule(4, 120)
    steps = schedule.random_schedule(5, 300)
    assert sum(s.hold + s.quiet for s in steps) >= 300
    acc = schedule.acceptance_schedule(7)
    assert acc == schedule.acceptance_schedule(7)
    assert sorted((s.fault, s.target) for s in acc) == sorted(
        [("kill", "consumer"), ("kill", "master"), ("restart", "any"),
         ("partition-drop", "master"), ("partition-drop", "mirror")])
    assert schedule.parse("kill:master:5:6,pause:any:1:2") == [schedule.Step("kill", "master", 5, 6),
                                                             schedule.Step("pause", "any", 1, 2)]
