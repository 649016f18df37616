"""The master's confirm state (mirrorq.classic.confirms.ConfirmLedger):
earned per handler, owed per round, sent by the master or backed up after
the last mirror's, nacked when overdue."""

from __future__ import annotations

from mirrorq.classic.confirms import ConfirmLedger

P, Q = ("fe1", 1), ("fe2", 7)  # two publishers (channel ids)


def test_a_handlers_earned_confirms_ride_its_round_and_are_owed_until_it_is_held():
    led = ConfirmLedger()
    led.earn(P, [1, 2])
    led.earn(Q, [5])
    led.earn(P, [3])
    earned = led.take_earned()
    assert earned == {P: [1, 2, 3], Q: [5]} and led.earned == {}
    led.broadcast(10, earned, at=1.0, by_mirror=False)
    assert dict(led.waiting(P)) == {1: 10, 2: 10, 3: 10} and led.count(10) == 4 and led.sent_at(10) == 1.0
    assert led.held(10) == ({P: [1, 2, 3], Q: [5]}, False)  # alone in its view: the master sends them
    assert dict(led.waiting(P)) == {} and led.count(10) == 0 and led.held(10) == ({}, False)


def test_the_last_mirrors_confirms_are_backed_up_by_the_master_not_sent_twice_at_once():
    led = ConfirmLedger()
    led.broadcast(1, {P: [1]}, at=0.0, by_mirror=True)
    led.broadcast(2, {P: [2], Q: [9]}, at=0.1, by_mirror=True)
    assert led.held(1) == ({}, True)
    assert led.held(2) == ({}, True)
    assert led.take_backup() == {P: [1, 2], Q: [9]} and led.take_backup() == {}  # one message per publisher
    assert dict(led.waiting(P)) == {}


def test_a_round_without_confirms_owes_nothing():
    led = ConfirmLedger()
    led.broadcast(4, {}, at=0.0, by_mirror=True)
    assert led.held(4) == ({}, False) and led.take_backup() == {}


def test_overdue_rounds_are_handed_back_once_and_the_next_deadline_named():
    led = ConfirmLedger()
    led.broadcast(1, {P: [1, 2]}, at=0.0, by_mirror=False)
    led.broadcast(2, {}, at=0.5, by_mirror=False)
    led.broadcast(3, {Q: [4]}, at=0.8, by_mirror=False)
    late, due = led.overdue(now=1.0, limit=1.0)
    assert late == [(1, {P: [1, 2]})] and abs(due - 0.8) < 1e-9  # round 3 is due 0.8 s later
    assert dict(led.waiting(P)) == {} and dict(led.waiting(Q)) == {4: 3}
    assert led.held(1) == ({}, False)  # completed later: nacked already, nothing to confirm
    late, due = led.overdue(now=1.8, limit=1.0)
    assert late == [(3, {Q: [4]})] and due is None


def test_the_history_line_sees_the_confirms_of_every_round_up_to_a_seq():
    led = ConfirmLedger()
    led.broadcast(1, {P: [1]}, at=0.0, by_mirror=False)
    led.broadcast(2, {P: [2], Q: [3]}, at=0.0, by_mirror=False)
    led.broadcast(3, {P: [4]}, at=0.0, by_mirror=False)
    assert led.confirms_upto(2) == {P: [1, 2], Q: [3]}
    led.forget_rounds()
    assert led.confirms_upto(3) == {} and led.held(3) == ({}, False)
