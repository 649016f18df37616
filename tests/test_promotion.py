"""The promotion core (mirrorq.classic.promotion): the protocol's steps
one member at a time, the election rule, and one run of three members
driven to the end with an in-order broadcast."""

from __future__ import annotations

import pytest

from mirrorq.classic.promotion import (
    Broadcast,
    Cutoff,
    Elect,
    NoMaster,
    Phase,
    Promote,
    Promotion,
    Ready,
    Report,
    elect_master,
    promote_unsynced,
)

MEMBERS = ("b", "c", "d")  # a died; b is the oldest survivor: the promoter


def _holds(delivered: dict[str, int]):
    return lambda marks: all(delivered.get(o, 0) >= k for o, k in marks.items())


def test_the_promoter_waits_for_every_report_then_elects_at_once_when_they_agree():
    p = Promotion("b", 2, MEMBERS, "a")
    for m in MEMBERS:
        assert p.advance(_holds({"a": 5}), {}, None, False) is None  # reports missing
        p.report(m, Report(2, {"a": 5}, True))
    assert p.advance(_holds({"a": 5}), {}, None, False) == Promote()
    assert p.phase is Phase.ELECTED
    assert p.advance(_holds({"a": 5}), {}, None, False) is None  # once per view


def test_reports_that_differ_need_a_cutoff_every_member_holds_before_the_election():
    p = Promotion("b", 2, MEMBERS, "a")
    p.report("b", Report(2, {"a": 5}, True))
    p.report("c", Report(2, {"a": 7}, True))
    p.report("d", Report(2, {"a": 6}, False))
    assert p.advance(_holds({"a": 5}), {}, None, False) is None  # the promoter does not hold 7 yet
    assert p.advance(_holds({"a": 7}), {}, None, False) == Broadcast(Cutoff(2, {"a": 7}))
    assert p.phase is Phase.CUTOFF_SENT
    assert p.advance(_holds({"a": 7}), {}, None, False) is None  # waits for its cutoff to come back
    p.cut(Cutoff(2, {"a": 7}))
    assert p.advance(_holds({"a": 7}), {}, None, False) == Broadcast(Ready(2))
    p.readied("b", Ready(2))
    p.readied("c", Ready(2))
    assert p.advance(_holds({"a": 7}), {}, None, False) is None  # d is not ready
    p.readied("d", Ready(2))
    assert p.advance(_holds({"a": 7}), {}, None, False) == Promote()  # b: the oldest synchronised


def test_a_member_says_ready_only_once_it_holds_the_cutoff():
    p = Promotion("c", 2, MEMBERS, "a")
    p.cut(Cutoff(2, {"a": 4}))
    assert p.phase is Phase.CUTOFF_KNOWN
    assert p.advance(_holds({"a": 3}), {}, None, False) is None
    assert p.advance(_holds({"a": 4}), {}, None, False) == Broadcast(Ready(2))
    assert p.phase is Phase.READY_SENT
    assert p.advance(_holds({"a": 4}), {}, None, False) is None  # not the promoter: it never elects


def test_payloads_of_another_view_are_ignored():
    p = Promotion("b", 3, MEMBERS, "a")
    p.report("c", Report(2, {"a": 1}, True))
    p.cut(Cutoff(2, {"a": 1}))
    p.readied("c", Ready(2))
    assert p.reports == {} and p.cutoff is None and p.ready == set() and p.phase is Phase.REPORTED
    assert not p.elected_me(Elect(2, "b")) and p.elected_me(Elect(3, "b")) and not p.elected_me(Elect(3, "c"))


def _agreeing(p: Promotion, synced: dict[str, bool]) -> Promotion:
    for m in p.members:
        p.report(m, Report(p.version, {"a": 1}, synced[m]))
    return p


def test_the_promoter_names_the_oldest_synchronised_member():
    p = _agreeing(Promotion("b", 2, MEMBERS, "a"), {"b": False, "c": True, "d": True})
    assert p.advance(_holds({"a": 1}), {}, None, False) == Broadcast(Elect(2, "c"))


def test_the_member_the_old_master_handed_over_to_wins_if_synchronised():
    p = _agreeing(Promotion("b", 2, MEMBERS, "a"), {"b": True, "c": True, "d": True})
    assert p.advance(_holds({"a": 1}), {}, "d", True) == Broadcast(Elect(2, "d"))
    p = _agreeing(Promotion("b", 2, MEMBERS, "a"), {"b": True, "c": True, "d": False})
    assert p.advance(_holds({"a": 1}), {}, "d", True) == Promote()  # d is not synchronised


@pytest.mark.parametrize(
    ("policy", "graceful", "decision"),
    [
        ({}, False, Promote()),  # ha-promote-on-failure: always (default)
        ({"ha-promote-on-failure": "when-synced"}, False, "ha-promote-on-failure"),
        ({}, True, "ha-promote-on-shutdown"),  # ha-promote-on-shutdown: when-synced (default)
        ({"ha-promote-on-shutdown": "always"}, True, Promote()),
    ],
)
def test_with_no_synchronised_member_the_policy_decides(policy, graceful, decision):
    p = _agreeing(Promotion("b", 2, MEMBERS, "a"), {"b": False, "c": False, "d": False})
    out = p.advance(_holds({"a": 1}), policy, None, graceful)
    if isinstance(decision, str):
        assert isinstance(out, NoMaster) and decision in out.reason and p.down == out.reason
    else:
        assert out == decision and p.down is None


def test_the_election_rule():
    synced = {"b": False, "c": True, "d": True}.get
    assert elect_master(MEMBERS, synced, False) == "c"
    assert elect_master(MEMBERS, synced, False, preferred="d") == "d"
    assert elect_master(MEMBERS, synced, False, preferred="b") == "c"  # not synchronised
    assert elect_master(MEMBERS, synced, False, preferred="x") == "c"  # not a member
    none = {}.get
    assert elect_master(MEMBERS, none, True) == "b" and elect_master(MEMBERS, none, False) is None
    assert elect_master((), none, True) is None
    assert promote_unsynced({}, False) == (True, "ha-promote-on-failure")
    assert promote_unsynced({}, True) == (False, "ha-promote-on-shutdown")


def test_three_members_reach_one_master_through_an_ordered_broadcast():
    """Every member delivers every broadcast in one order; members hold
    different prefixes of the dead master's messages and catch up as the
    run goes (what GM's retransmission does): exactly one member is
    promoted, after every member held the cutoff."""
    delivered = {"b": {"a": 3}, "c": {"a": 5}, "d": {"a": 4}}
    runs = {m: Promotion(m, 2, MEMBERS, "a") for m in MEMBERS}
    queue = [(m, Report(2, dict(delivered[m]), True)) for m in MEMBERS]
    promoted, held_at_election = [], None
    for _round in range(20):
        for m in MEMBERS:  # catch up one message per round
            delivered[m]["a"] = min(5, delivered[m]["a"] + 1)
        batch, queue = queue, []
        for origin, payload in batch:
            for m, p in runs.items():
                if isinstance(payload, Report):
                    p.report(origin, payload)
                elif isinstance(payload, Cutoff):
                    p.cut(payload)
                elif isinstance(payload, Ready):
                    p.readied(origin, payload)
                elif isinstance(payload, Elect) and p.elected_me(payload):
                    promoted.append(m)
        for m, p in runs.items():
            d = p.advance(_holds(delivered[m]), {}, None, False)
            if isinstance(d, Broadcast):
                queue.append((m, d.payload))
            elif isinstance(d, Promote):
                promoted.append(m)
                held_at_election = {n: dict(v) for n, v in delivered.items()}
    assert promoted == ["b"]
    assert held_at_election is not None and all(v["a"] == 5 for v in held_at_election.values())
