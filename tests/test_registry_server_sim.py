"""The registry server (Raft + tables) under the simulator: writes from any
node, leader kills, partitions, snapshots.  After healing every live replica
holds the same tables, and every write answered ok is in them."""

from __future__ import annotations

import random

import pytest

from mirrorq.mnesia_like.raft import MemoryRaftLog, RaftNode
from mirrorq.mnesia_like.server import RegistryServer, TxnDone
from mirrorq.simulator import Simulator

NAMES = ["a", "b", "c"]


def _factory(seed: int):
    def make(name: str, disk: dict) -> RegistryServer:
        disk["boots"] = disk.get("boots", 0) + 1
        rng = random.Random(f"{seed}/{name}/{disk['boots']}")
        raft = RaftNode(
            name, MemoryRaftLog(disk), rng, voters=NAMES, election_timeout=(0.3, 0.6), heartbeat_interval=0.1
        )
        return RegistryServer(name, raft, snapshot_every=15)

    return make


def _put(k: str) -> dict:
    return {"ops": [{"op": "put", "table": "vhost", "key": k, "record": {"name": k}}]}


def _done(sim):
    return {e.req_id: e for (_t, _n, e) in sim.emitted if isinstance(e, TxnDone)}


@pytest.mark.parametrize("seed", range(300), ids=lambda s: f"seed={s}")
def test_acknowledged_writes_survive_chaos(seed):
    sim = Simulator(seed, min_delay=0.001, max_delay=0.02)
    rng = random.Random(seed)
    for n in NAMES:
        sim.add_node(n, _factory(seed))
    sent = []
    t = 0.5
    for i in range(60):
        t += rng.uniform(0.02, 0.15)
        node = rng.choice(NAMES)
        key = f"k{i}"
        sent.append(key)
        sim.schedule(t, lambda s, n=node, k=key: s.nodes[n].alive and s.call(n, "transact", k, _put(k)))
        if rng.random() < 0.08:
            victim = rng.choice(NAMES)
            sim.schedule(t, lambda s, v=victim: s.kill(v))
            sim.schedule(t + rng.uniform(0.2, 1.5), lambda s, v=victim: (not s.nodes[v].alive) and s.start(v))
        if rng.random() < 0.05:
            side = [rng.choice(NAMES)]
            sim.schedule(t, lambda s, side=side: s.partition(side))
            sim.schedule(t + rng.uniform(0.3, 2.0), lambda s: s.heal())
        if rng.random() < 0.05:
            sim.schedule(t, lambda s, p=rng.choice([0.0, 0.05, 0.2]): setattr(s, "drop", p))
    sim.run(t + 3.0)
    sim.heal()
    sim.drop = 0.0
    for n in NAMES:
        if not sim.nodes[n].alive:
            sim.start(n)
    # a last write through the leader proves progress and flushes commit to all
    assert sim.run_until(lambda: any(sim.core(n).raft.is_leader() for n in NAMES), 10.0)
    leader = next(n for n in NAMES if sim.core(n).raft.is_leader())
    sim.call(leader, "transact", "final", _put("final"))
    assert sim.run_until(lambda: "final" in _done(sim), 5.0) and _done(sim)["final"].ok
    target = sim.core(leader).raft.commit_index
    assert sim.run_until(lambda: all(sim.core(n).raft.applied_index >= target for n in NAMES), 5.0)
    tables = [sim.core(n).registry.tables for n in NAMES]
    assert tables[0] == tables[1] == tables[2], f"seed {seed}: replicas differ"
    present = {k[0] for k in tables[0]["vhost"]}
    done = _done(sim)
    acked = {k for k, e in done.items() if e.ok}
    assert acked <= present, f"seed {seed}: acknowledged writes missing: {sorted(acked - present)}"
    assert any(done[k].ok for k in done if k != "final") or not done


def test_one_view_change_wins_and_malformed_is_refused_before_the_log():
    sim = Simulator(7)
    for n in NAMES:
        sim.add_node(n, _factory(7))
    assert sim.run_until(lambda: any(sim.core(n).raft.is_leader() for n in NAMES), 5.0)
    sim.call(
        "a",
        "transact",
        "init",
        {
            "ops": [
                {"op": "put", "table": "gm_group", "key": "g", "record": {"name": "g", "version": 1, "members": NAMES}}
            ]
        },
    )
    assert sim.run_until(lambda: "init" in _done(sim), 3.0) and _done(sim)["init"].ok
    for n, members in (("b", ["a", "b"]), ("c", ["a", "c"])):
        sim.call(
            n,
            "transact",
            f"view-{n}",
            {
                "checks": [{"table": "gm_group", "key": "g", "field": "version", "equals": 1}],
                "ops": [
                    {"op": "update", "table": "gm_group", "key": "g", "fields": {"version": 2, "members": members}}
                ],
            },
        )
    assert sim.run_until(lambda: {"view-b", "view-c"} <= set(_done(sim)), 3.0)
    results = sorted(_done(sim)[k].ok for k in ("view-b", "view-c"))
    assert results == [False, True]
    sim.run_for(1.0)  # let every replica apply both view changes
    applied_before = sim.core("a").registry.applied
    sim.call("b", "transact", "bad", {"ops": [{"op": "put", "table": "nope", "key": "x", "record": {}}]})
    bad = _done(sim)["bad"]
    assert not bad.ok and "no table 'nope'" in bad.error
    sim.run_for(1.0)
    assert sim.core("a").registry.applied == applied_before


def test_minority_cannot_write_majority_can():
    sim = Simulator(11)
    for n in NAMES:
        sim.add_node(n, _factory(11))
    assert sim.run_until(lambda: any(sim.core(n).raft.is_leader() for n in NAMES), 5.0)
    old = next(n for n in NAMES if sim.core(n).raft.is_leader())
    sim.partition([old])
    sim.call(old, "transact", "minority", _put("minority"))
    majority = [n for n in NAMES if n != old]
    assert sim.run_until(lambda: any(sim.core(n).raft.is_leader() for n in majority), 5.0)
    new = next(n for n in majority if sim.core(n).raft.is_leader())
    sim.call(new, "transact", "majority", _put("majority"))
    assert sim.run_until(lambda: "majority" in _done(sim), 3.0) and _done(sim)["majority"].ok
    sim.run_for(3.0)
    m = _done(sim).get("minority")
    assert m is None or not m.ok
    assert sim.core(old).registry.get("vhost", "minority") is None
    sim.heal()
    assert sim.run_until(lambda: sim.core(old).registry.get("vhost", "majority") is not None, 5.0)
    assert all(sim.core(n).registry.get("vhost", "minority") is None for n in NAMES)


@pytest.mark.parametrize("seed", range(200), ids=lambda s: f"seed={s}")
def test_linearizable_reads_from_any_node_see_acknowledged_writes(seed):
    """A read started (at any node, follower or leader) after a write was
    acknowledged, once answered ok, sees that write in the local tables."""
    from mirrorq.mnesia_like.server import ReadDone

    # on odd seeds lossy, slow links: followers lag behind the leader's commit
    lossy = seed % 2 == 1
    sim = Simulator(seed, min_delay=0.001, max_delay=0.05, drop=0.15 if lossy else 0.0)
    rng = random.Random(seed)
    for n in NAMES:
        sim.add_node(n, _factory(seed))
    seen: dict = {}  # read id -> (node, keys held when ReadDone(ok) was emitted)
    orig_apply = sim._apply

    def apply(name, actions):
        actions = list(actions or [])
        for a in actions:
            ev = getattr(a, "event", None)
            if isinstance(ev, ReadDone) and ev.ok:
                seen[ev.rid] = (name, {k[0] for k in sim.core(name).registry.tables.get("vhost", {})})
        return orig_apply(name, actions)

    sim._apply = apply
    started: dict = {}  # read id -> acked keys when the read started
    t = 0.8
    for i in range(30):
        t += rng.uniform(0.02, 0.1)
        key = f"k{i}"
        sim.schedule(t, lambda s, n=rng.choice(NAMES), k=key: s.nodes[n].alive and s.call(n, "transact", k, _put(k)))
        if rng.random() < 0.1:
            victim = rng.choice(NAMES)
            sim.schedule(t, lambda s, v=victim: s.kill(v))
            sim.schedule(t + rng.uniform(0.2, 1.0), lambda s, v=victim: (not s.nodes[v].alive) and s.start(v))
        rid = f"r{i}"

        def read(s, n=rng.choice(NAMES), rid=rid):
            if s.nodes[n].alive:
                started[rid] = {k for k, e in _done(s).items() if e.ok}
                s.call(n, "read", rid)

        sim.schedule(t + rng.uniform(0.0, 0.1), read)
    sim.run(t + 3.0)
    assert seen or lossy, "no read was answered"
    for rid, (node, keys) in seen.items():
        missing = started[rid] - keys
        assert not missing, f"read {rid} at {node} missed acknowledged writes {sorted(missing)}"


def test_a_lost_forward_is_answered_outcome_unknown():
    """A write forwarded to the leader whose Forward is lost on the way (a peer
    restarted under our feet) is answered after FORWARD_TIMEOUT, not never."""
    from mirrorq.mnesia_like.server import FORWARD_TIMEOUT, Forward

    sim = Simulator(11, min_delay=0.001, max_delay=0.01)
    for n in NAMES:
        sim.add_node(n, _factory(11))
    assert sim.run_until(lambda: any(sim.core(n).raft.is_leader() for n in NAMES), 5.0)
    leader = next(n for n in NAMES if sim.core(n).raft.is_leader())
    follower = next(n for n in NAMES if n != leader)
    sim.run_for(0.5)  # the follower knows the leader
    real_send = sim._send

    def send(src, dst, msg):
        if src == follower and isinstance(msg, Forward):
            return  # lost
        return real_send(src, dst, msg)

    sim._send = send
    sim.call(follower, "transact", "w1", _put("w1"))
    t0 = sim.now
    assert sim.run_until(lambda: "w1" in _done(sim), FORWARD_TIMEOUT + 1.0)
    done = _done(sim)["w1"]
    assert not done.ok and "outcome unknown" in done.error
    assert sim.now - t0 >= FORWARD_TIMEOUT - 0.01
