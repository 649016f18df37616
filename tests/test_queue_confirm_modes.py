"""Confirm modes (ha-confirm-mode, ha-confirm-timeout) under the simulator.

* sync (default): a mirror cut off by a partition stalls confirms;
  with ha-confirm-timeout the publishes are nacked (FLUSH_SLAVE_TIMEOUT);
* async: the master confirms what it has fsync'd, mirrors lag;
* a mirrored queue left without mirrors nacks when the policy says
  ha-confirm-mode sync (SLAVE_NOT_AVAILABLE), confirms in async mode and when
  the mode is not set (RabbitMQ's behaviour); a queue pinned to one node
  wants no mirror and always confirms;
* the timeout's log line names the mirror where the ring stopped.
"""

from __future__ import annotations

import pytest
from queue_sim_support import build


def _partition_mirror(sim):
    # q2 cannot talk to anyone (and nobody reports it dead): GM rounds stall
    sim.schedule(0.05, lambda s: s.partition(["q2"]))


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed={s}")
def test_sync_mode_stalls_then_times_out_with_nacks(seed):
    sim, names = build(seed, replicas=3, total=300, policy={"ha-mode": "all", "ha-confirm-timeout": 300})
    _partition_mirror(sim)
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.ch.next_seq - 1 == 300 and not pub.ch.unconfirmed, timeout=30)
    assert pub.nacked, "nothing was nacked although a mirror could not be reached"
    assert all(s <= 300 for s in pub.nacked | pub.confirmed)
    assert not (pub.nacked & pub.confirmed)
    master = sim.core("q0").replica
    assert master.info()["mirror_lag"] > 0


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed={s}")
def test_sync_mode_without_timeout_never_confirms_what_a_mirror_lacks(seed):
    sim, names = build(seed, replicas=3, total=200, policy={"ha-mode": "all"})
    pub = sim.core("pub")
    sim.run(0.05)
    before = set(pub.confirmed)
    sim.partition(["q2"])
    sim.run_for(2.0)
    after = set(pub.confirmed) - before
    # whatever was confirmed after the cut was held by q2 before it (sent before the partition)
    q2 = sim.nodes["q2"].core.replica
    held = {int(m.msg_id.split("|")[2]) for m in q2.bq.peek(q2.bq.ready_count)} | {
        int(q2.bq.get(o).msg_id.split("|")[2]) for o in q2.bq.unacked_offsets()
    }
    consumed = {int(d.msg_id.split("|")[2]) for _, d in sim.core("con").received}
    assert after <= held | consumed
    assert not pub.nacked


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"seed={s}")
def test_async_mode_confirms_while_a_mirror_is_cut_off(seed):
    sim, names = build(seed, replicas=3, total=300, policy={"ha-mode": "all", "ha-confirm-mode": "async"})
    _partition_mirror(sim)
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.done(), timeout=10)
    assert pub.confirmed == set(range(1, 301)) and not pub.nacked
    assert sim.core("q0").replica.info()["mirror_lag"] > 0  # the mirrors lag behind


@pytest.mark.parametrize("mode", ["sync", "async", None])
def test_mirrored_queue_alone_in_its_view(mode):
    policy = {"ha-mode": "all"} if mode is None else {"ha-mode": "all", "ha-confirm-mode": mode}
    sim, names = build(3, replicas=3, total=200, policy=policy)

    def kill_mirrors(s):
        for v in ("q1", "q2"):
            s.kill(v)
        s.schedule(s.now + 0.01, lambda s2: [s2.call("q0", "member_down", v) for v in ("q1", "q2")])

    sim.schedule(0.02, kill_mirrors)
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.ch.next_seq - 1 == 200 and not pub.ch.unconfirmed, timeout=30)
    if mode == "sync":
        assert pub.nacked, "SLAVE_NOT_AVAILABLE: publishes to a queue without mirrors must be nacked in sync mode"
    else:
        assert not pub.nacked and pub.confirmed == set(range(1, 201))


def test_queue_pinned_to_one_node_confirms():
    sim, names = build(
        4, replicas=1, total=100, policy={"ha-mode": "nodes", "ha-params": ["q0"], "ha-confirm-mode": "sync"}
    )
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.done(), timeout=10)
    assert pub.confirmed == set(range(1, 101)) and not pub.nacked


@pytest.mark.parametrize("cut", ["q1", "q2"])
def test_confirm_timeout_names_the_mirror_where_the_ring_stopped(cut):
    """The nack's log line names the cut-off mirror, not every mirror: with
    q1 (the master's right neighbour) cut off, q2 lacks the publishes too but
    only because q1 never forwarded them (confirm_probe)."""
    sim, names = build(3, replicas=3, total=200, policy={"ha-mode": "all", "ha-confirm-timeout": 300})
    logged: list = []
    sim.core("q0").replica._log = lambda event, **fields: logged.append((event, fields))
    sim.schedule(0.05, lambda s: s.partition([cut]))
    pub = sim.core("pub")
    assert sim.run_until(lambda: any(e == "confirm_timeout_mirror" for e, _ in logged), timeout=30), logged
    fields = next(f for e, f in logged if e == "confirm_timeout_mirror")
    assert fields["mirror"] == cut and "did not answer" in fields["reason"], fields
    assert pub.nacked
    if cut == "q1":
        assert fields["held"]["q2"] < fields["wanted"]  # behind, but not the culprit


def test_culprit_walks_the_ring_from_the_master():
    from mirrorq.classic.confirm_probe import culprit

    ring = ("a", "m", "b", "c")
    assert culprit(ring, "m", {"b": 10, "c": 4, "a": 4}, 10)[0] == "c"
    mirror, why = culprit(ring, "m", {"b": 7, "c": 4, "a": 4}, 10)
    assert mirror == "b" and "holds 7" in why and "c, a wait behind it" in why
    assert culprit(ring, "m", {"b": 10, "c": 10}, 10)[0] == "a"  # a did not answer
    mirror, why = culprit(ring, "m", {"b": 10, "c": 10, "a": 11}, 10)
    assert mirror is None and "last hop" in why
    with pytest.raises(ValueError, match="'z' is not in the ring"):
        culprit(ring, "z", {}, 1)
