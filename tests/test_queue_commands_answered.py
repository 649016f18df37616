"""A classic master answers the commands that change nothing in its log
(info, sync, cancel_sync) at once, even while a mirror holds its ring up;
commands that change the log (purge) are answered once replicated
(mirrorq.classic.coordinator, "Other replies wait for replication")."""

from __future__ import annotations

import pytest
from queue_sim_support import Operator, build


def _stuck_ring(seed: int):
    """A 3-replica queue whose mirror q2 is cut off from everyone (and
    nobody reports it down) while a publisher goes on: no round completes."""
    sim, _names = build(seed, replicas=3, total=100_000, consumer=False, policy={"ha-mode": "all"})
    sim.add_node("op", lambda n, d: Operator(n))
    pub = sim.core("pub")
    assert sim.run_until(lambda: len(pub.confirmed) >= 200, timeout=10)
    sim.partition(["q2"])
    sim.run_for(0.5)  # what was in flight settles; the ring stays stuck
    return sim, pub


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed={s}")
@pytest.mark.parametrize("command", ["info", "sync", "cancel_sync"])
def test_commands_that_change_nothing_are_answered_while_the_ring_is_stuck(seed, command):
    sim, pub = _stuck_ring(seed)
    confirmed = len(pub.confirmed)
    op = sim.core("op")
    sim.call("op", "command", command)
    assert sim.run_until(lambda: op.results, timeout=1.0), f"{command} not answered while q2 is cut off"
    (_at, done) = op.results[-1]
    assert done.ok, done
    if command == "info":
        assert done.value["messages"] > confirmed  # it counts what waits for the ring too
    assert len(pub.confirmed) == confirmed  # the ring really was stuck meanwhile
    assert pub.ch.unconfirmed


def test_a_purge_waits_for_its_round():
    """Control: a command that changes the log is answered only once every
    mirror holds it, so it waits on the stuck ring and comes after the heal."""
    sim, pub = _stuck_ring(1)
    op = sim.core("op")
    sim.call("op", "command", "purge")
    sim.run_for(1.0)
    assert not op.results, "a purge was answered before its round completed"
    sim.heal()
    assert sim.run_until(lambda: op.results, timeout=10)
    assert op.results[-1][1].ok
