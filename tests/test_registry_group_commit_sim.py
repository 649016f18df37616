"""Group commit in the registry server (``max_inflight_batches``): requests
arriving while batches replicate are held and proposed together; under chaos
no acknowledged write is lost, every request is answered, and a request held
when leadership is lost is answered "not the registry leader".  Replay a seed:
pytest 'tests/test_registry_group_commit_sim.py::test_group_commit_under_chaos[seed=5]'."""

from __future__ import annotations

import random

import pytest

from mirrorq.mnesia_like.raft import MemoryRaftLog, RaftNode
from mirrorq.mnesia_like.server import RegistryServer, TxnDone
from mirrorq.simulator import Simulator

NAMES = ["a", "b", "c"]


def _factory(seed: int, inflight: int):
    def make(name: str, disk: dict) -> RegistryServer:
        disk["boots"] = disk.get("boots", 0) + 1
        rng = random.Random(f"{seed}/{name}/{disk['boots']}")
        raft = RaftNode(
            name, MemoryRaftLog(disk), rng, voters=NAMES, election_timeout=(0.3, 0.6), heartbeat_interval=0.1
        )
        return RegistryServer(name, raft, snapshot_every=15, max_inflight_batches=inflight)

    return make


def _put(k: str) -> dict:
    return {"ops": [{"op": "put", "table": "vhost", "key": k, "record": {"name": k}}]}


def _done(sim):
    return {e.req_id: e for (_t, _n, e) in sim.emitted if isinstance(e, TxnDone)}


def _leader(sim):
    ls = [n for n in NAMES if sim.nodes[n].alive and sim.core(n).raft.is_leader()]
    return ls[0] if ls else None


@pytest.mark.parametrize("inflight", [1, 2])
def test_requests_held_while_batches_replicate_go_as_one_batch(inflight):
    sim = Simulator(3)
    for n in NAMES:
        sim.add_node(n, _factory(3, inflight))
    assert sim.run_until(lambda: _leader(sim), 5.0)
    sim.run_for(0.5)
    lead = _leader(sim)
    core = sim.core(lead)
    batches = []
    real_propose = core.raft.propose_batch
    core.raft.propose_batch = lambda now, items: (batches.append(len(items)), real_propose(now, items))[1]
    for i in range(20):  # all at one instant: the first `inflight` go, the rest wait
        sim.call(lead, "transact", f"w{i}", _put(f"w{i}"))
    assert len(core._held) == 20 - inflight and batches == [1] * inflight
    assert sim.run_until(lambda: len(_done(sim)) == 20, 3.0)
    assert all(e.ok for e in _done(sim).values())
    assert not core._held
    assert batches == [1] * inflight + [20 - inflight], batches  # the held ones: one proposal, one fsync


def test_held_requests_are_refused_when_leadership_is_lost():
    sim = Simulator(4)
    for n in NAMES:
        sim.add_node(n, _factory(4, 1))
    assert sim.run_until(lambda: _leader(sim), 5.0)
    sim.run_for(0.5)
    lead = _leader(sim)
    sim.partition([lead])  # the first batch cannot commit; the rest wait
    for i in range(5):
        sim.call(lead, "transact", f"h{i}", _put(f"h{i}"))
    assert len(sim.core(lead)._held) == 4
    assert sim.run_until(lambda: len(_done(sim)) == 5, 5.0)  # check-quorum makes it step down
    done = _done(sim)
    assert all(not done[f"h{i}"].ok and "not the registry leader" in done[f"h{i}"].error for i in range(1, 5))
    assert not done["h0"].ok  # proposed, never committed: outcome unknown, not ok
    sim.heal()
    assert sim.run_until(lambda: _leader(sim), 5.0)
    sim.run_for(1.0)
    present = {k[0] for k in sim.core(_leader(sim)).registry.tables["vhost"]}
    assert not {f"h{i}" for i in range(1, 5)} & present, "a refused held request was committed"


@pytest.mark.parametrize("seed", range(150), ids=lambda s: f"seed={s}")
def test_group_commit_under_chaos(seed):
    rng = random.Random(seed)
    sim = Simulator(seed, min_delay=0.001, max_delay=0.02)
    for n in NAMES:
        sim.add_node(n, _factory(seed, 1 + seed % 2))
    t = 0.3
    keys = []
    for i in range(60):
        t += rng.uniform(0.0, 0.05)  # bursts: many requests per replication round
        node = rng.choice(NAMES)
        keys.append(f"k{i}")
        sim.schedule(t, lambda s, n=node, k=f"k{i}": s.nodes[n].alive and s.call(n, "transact", k, _put(k)))
        if rng.random() < 0.05:
            victim = rng.choice(NAMES)
            sim.schedule(t, lambda s, v=victim: s.kill(v))
            sim.schedule(t + rng.uniform(0.2, 1.0), lambda s, v=victim: (not s.nodes[v].alive) and s.start(v))
        if rng.random() < 0.04:
            sim.schedule(t, lambda s, side=[rng.choice(NAMES)]: s.partition(side))
            sim.schedule(t + rng.uniform(0.3, 1.5), lambda s: s.heal())
        if rng.random() < 0.05:
            sim.schedule(t, lambda s, p=rng.choice([0.0, 0.05, 0.2]): setattr(s, "drop", p))
    sim.run(t + 3.0)
    sim.heal()
    sim.drop = 0.0
    for n in NAMES:
        if not sim.nodes[n].alive:
            sim.start(n)
    assert sim.run_until(lambda: _leader(sim), 10.0)
    lead = _leader(sim)
    sim.call(lead, "transact", "final", _put("final"))
    assert sim.run_until(lambda: "final" in _done(sim), 5.0) and _done(sim)["final"].ok
    target = sim.core(lead).raft.commit_index
    assert sim.run_until(lambda: all(sim.core(n).raft.applied_index >= target for n in NAMES), 5.0)
    tables = [sim.core(n).registry.tables for n in NAMES]
    assert tables[0] == tables[1] == tables[2], f"seed {seed}: replicas differ"
    present = {k[0] for k in tables[0]["vhost"]}
    done = _done(sim)
    assert {k for k, e in done.items() if e.ok} <= present, f"seed {seed}: acknowledged write lost"
    assert not any(sim.core(n)._held for n in NAMES), f"seed {seed}: requests still held"
