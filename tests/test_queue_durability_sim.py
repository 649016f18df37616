"""The queue replica's durability path in the simulator -- the production one.

A replica driven with turns (``defer_flush``) flushes its store once per
turn, as the ``Persist`` action its ``end_turn`` returns; drivers hold a
turn's sends until the turn ends, after its Persist (mirrorq.sansio).  The
store is on the node's simulated disk (mirrorq.simdisk) and the kill is a
power loss: whatever was not fsynced may be lost or torn (the store's
unflushed buffer dies with the core object; what it wrote without an fsync
-- the turns whose records carry no promise -- survives only in part).

Checker (the guarantee): every publish confirmed to the publisher before the
queue's only replica is killed is in the store the replica restarts from,
and that store opens (its recovery copes with whatever the crash left).

The kill comes at a random instant between turns, or (the power cut) in the
middle of a turn's Persist: its records are written, not fsynced, and the
turn's sends never leave.

Control (the checker sees a loss when there is one): a driver that flushes
the store one turn late -- after the turn's confirms have left -- loses a
confirmed publish on some seed of the same runs.
"""

from __future__ import annotations

import random

import pytest
from queue_sim_support import REGISTRY, PublisherNode, QueueRegistry, ReplicaNode, gm_wire

from mirrorq import simdisk
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.simulator import Simulator

SEEDS = range(40)


class LateFlushNode(ReplicaNode):
    """A broken driver: the turn's Persist is carried out at the start of the
    NEXT turn, after this turn's sends (confirms) have left."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.owed = False

    def persist(self, now: float) -> None:
        self.owed = True

    def _settle(self, now: float) -> None:
        if self.owed:
            self.owed = False
            self.replica.persist(now)

    def receive(self, now, src, msg):
        self._settle(now)
        return super().receive(now, src, msg)

    def timer(self, now, key):
        self._settle(now)
        return super().timer(now, key)


class PowerCutNode(ReplicaNode):
    """The power goes during the ``cut_at``-th Persist: the turn's records
    are written to the store's files, never fsynced, and the turn's sends
    never leave (``on_cut`` kills the node)."""

    def __init__(self, *a, cut_at: int, on_cut, **kw):
        super().__init__(*a, **kw)
        self.cut_at, self.on_cut, self.persists = cut_at, on_cut, 0

    #: a broken driver (the control): from the cut on, Persist writes without
    #: an fsync and the turn's sends leave; the power goes a little later
    leaky = False

    def persist(self, now: float) -> None:
        self.persists += 1
        if self.persists < self.cut_at:
            return super().persist(now)
        self.replica.bq.log.flush(sync=False)  # written; the fsync never happens
        if not self.leaky:
            self.on_cut()
        elif self.persists == self.cut_at:
            self.on_cut(later=0.01)


class LeakyCutNode(PowerCutNode):
    leaky = True


def _run(seed: int, directory: str, node_cls, power_cut: bool = False) -> tuple[set[int], set[bytes], int]:
    """Publish to a one-replica durable queue, kill the replica at a random
    instant (``power_cut``: during a random turn's Persist instead); ->
    (seqs confirmed before the kill, bodies in its store, persists)."""
    rng = random.Random(seed)
    sim = Simulator(seed, min_delay=0.0005, max_delay=0.004, fifo=True, wire=gm_wire)
    sim.add_node(REGISTRY, lambda n, d: QueueRegistry(("q0",), "q0"))
    pub = PublisherNode("pub", "q0", 400, random.Random(seed + 1))
    kill_at = rng.uniform(0.02, 0.4)
    confirmed_at_kill: set[int] = set()

    def kill(s: Simulator) -> None:
        if s.nodes["q0"].alive:
            confirmed_at_kill.update(pub.confirmed)
            s.kill("q0")

    if power_cut:
        cut_at = rng.randrange(5, 36)  # a run of 400 publishes takes about 39 persists

        def on_cut(later: float = 0.0) -> None:
            if later:
                sim.schedule(sim.now + later, kill)
            else:
                kill(sim)

        sim.add_node("q0", lambda n, d: node_cls(n, "q0", directory=directory, disk=d, cut_at=cut_at, on_cut=on_cut))
    else:
        sim.add_node("q0", lambda n, d: node_cls(n, "q0", directory=directory, disk=d))
    sim.add_node("pub", lambda n, d: pub)
    if not power_cut:
        sim.schedule(kill_at, kill)
    sim.run(1.0 if power_cut else kill_at + 0.05)
    assert not sim.nodes["q0"].alive, f"seed {seed}: the replica was not killed"
    persists = sim.stats.persists
    bq = BackingQueue(directory, durable=True, fs=simdisk.of(sim.nodes["q0"].disk))  # what a restart finds on disk
    try:
        bodies = {m.body for m in bq.peek(bq.message_count)}
    finally:
        bq.close()
    return confirmed_at_kill, bodies, persists


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed={s}")
def test_a_publish_confirmed_before_a_kill_is_in_the_store_after_it(seed, tmp_path):
    confirmed, bodies, persists = _run(seed, str(tmp_path / "q0"), ReplicaNode)
    assert persists > 0  # the durability path ran (Persist actions)
    lost = sorted(s for s in confirmed if f"m{s}".encode() not in bodies)
    assert not lost, f"seed {seed}: confirmed before the kill but not in the store: {lost[:10]}"


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed={s}")
def test_a_power_cut_between_a_persist_s_write_and_its_fsync_loses_nothing_confirmed(seed, tmp_path):
    confirmed, bodies, _ = _run(seed, str(tmp_path / "q0"), PowerCutNode, power_cut=True)
    assert confirmed, f"seed {seed}: nothing was confirmed before the cut: the run checks nothing"
    lost = sorted(s for s in confirmed if f"m{s}".encode() not in bodies)
    assert not lost, f"seed {seed}: confirmed before the power cut but not in the store: {lost[:10]}"


def test_the_checker_sees_the_loss_a_late_flush_causes(tmp_path):
    losses = 0
    for seed in SEEDS:
        confirmed, bodies, _ = _run(seed, str(tmp_path / f"late{seed}"), LateFlushNode)
        losses += any(f"m{s}".encode() not in bodies for s in confirmed)
    assert losses > 0, "a driver flushing after the sends lost nothing confirmed in any seed: the checker is blind"


def test_the_checker_sees_the_loss_of_confirms_sent_before_the_fsync(tmp_path):
    losses = 0
    for seed in SEEDS:
        confirmed, bodies, _ = _run(seed, str(tmp_path / f"leaky{seed}"), LeakyCutNode, power_cut=True)
        losses += any(f"m{s}".encode() not in bodies for s in confirmed)
    assert losses > 0, "confirms sent for writes never fsynced lost nothing in any seed: the power cut is blind"
