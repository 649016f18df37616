"""Registry membership under the simulator: a new server joins (JoinRequest ->
learner -> voter) and reads what was written before it joined; a dead server
is forgotten (configuration shrinks, its ``node`` row goes, writes go on); a
forgotten server that comes back never disrupts the leader and is not
re-added.  Chaos seeds replay by id: pytest 'tests/test_registry_membership_sim.py::test_join_under_chaos[seed=3]'."""

from __future__ import annotations

import random

import pytest

from mirrorq.mnesia_like.raft import LEADER, MemoryRaftLog, RaftNode
from mirrorq.mnesia_like.server import JoinRequest, RegistryServer, TxnDone
from mirrorq.simulator import Simulator

NAMES = ["a", "b", "c"]


def _factory(seed: int, voters=NAMES):
    def make(name: str, disk: dict) -> RegistryServer:
        disk["boots"] = disk.get("boots", 0) + 1
        rng = random.Random(f"{seed}/{name}/{disk['boots']}")
        raft = RaftNode(
            name,
            MemoryRaftLog(disk),
            rng,
            voters=voters,
            election_timeout=(0.3, 0.6),
            heartbeat_interval=0.1,
            catchup_margin=4,
        )
        return RegistryServer(name, raft, snapshot_every=15)

    return make


def _put(k: str) -> dict:
    return {"ops": [{"op": "put", "table": "vhost", "key": k, "record": {"name": k}}]}


def _done(sim):
    return {e.req_id: e for (_t, _n, e) in sim.emitted if isinstance(e, TxnDone)}


def _leader(sim, names):
    ls = [n for n in names if sim.nodes[n].alive and sim.core(n).raft.role == LEADER]
    return ls[0] if ls else None


def _ask_to_join_every(sim, node, peers, period=0.2, until=30.0):
    """What the node agent does on every probe round."""

    def tick(s):
        if s.nodes[node].alive:
            s.call(node, "join_requests", [p for p in peers if s.nodes[p].alive])
        if s.now + period < until:
            s.schedule(s.now + period, tick)

    sim.schedule(sim.now, tick)


def _write(sim, node, key, timeout=5.0):
    sim.call(node, "transact", key, _put(key))
    assert sim.run_until(lambda: key in _done(sim), timeout), f"{key} not answered"
    return _done(sim)[key]


def _write_until_ok(sim, names, key, timeout=10.0):
    deadline = sim.now + timeout
    i = 0
    while sim.now < deadline:
        i += 1
        node = _leader(sim, names) or names[i % len(names)]
        k = f"{key}#{i}"
        sim.call(node, "transact", k, _put(k))
        sim.run_until(lambda: k in _done(sim), 3.0)
        if k in _done(sim) and _done(sim)[k].ok:
            return k
        sim.run_for(0.1)
    raise AssertionError(f"no write of {key} committed within {timeout}s")


def test_joiner_is_passive_until_added_then_votes_and_reads_old_data():
    sim = Simulator(5)
    for n in NAMES:
        sim.add_node(n, _factory(5))
    assert sim.run_until(lambda: _leader(sim, NAMES), 5.0)
    for i in range(40):  # more than snapshot_every: the joiner needs a snapshot
        assert _write(sim, NAMES[i % 3], f"old{i}").ok
    sim.add_node("d", _factory(5))
    d = sim.core("d")
    assert d.joining and d.raft.config.voters == tuple(NAMES)
    sim.run_for(3.0)  # nobody adds it unless it asks; it never campaigns
    assert d.raft.term == 0 and d.raft.role == "follower" and d.joining
    assert all("d" not in sim.core(n).raft.config.members for n in NAMES)
    # a follower ignores a join request; only the leader adds
    follower = next(n for n in NAMES if sim.core(n).raft.role != LEADER)
    assert sim.core(follower).receive(sim.now, "d", JoinRequest()) == []
    leader = _leader(sim, NAMES)
    _ask_to_join_every(sim, "d", NAMES)
    everyone = NAMES + ["d"]
    assert sim.run_until(lambda: all("d" in sim.core(n).raft.committed_config.voters for n in everyone), 10.0)
    assert not sim.core("d").joining and sim.core("d").join_requests(sim.now, NAMES) == []
    assert _leader(sim, everyone) == leader  # joining does not disturb the leader
    assert {f"old{i}" for i in range(40)} <= {k[0] for k in sim.core("d").registry.tables["vhost"]}
    # it forwards writes like any member; 4 voters: killing two stops commits
    assert _write(sim, "d", "from-d").ok
    assert sim.run_until(lambda: ("from-d",) in sim.core("d").registry.tables["vhost"], 2.0)
    others = [n for n in NAMES if n != leader]
    sim.kill(others[0])
    sim.kill(others[1])
    r = _write(sim, leader, "needs-three", timeout=8.0)
    assert not r.ok, "4 voters, 2 alive: nothing may commit"


def test_forget_dead_node_then_it_comes_back_without_disruption():
    sim = Simulator(9)
    for n in NAMES:
        sim.add_node(n, _factory(9))
    assert sim.run_until(lambda: _leader(sim, NAMES), 5.0)
    leader = _leader(sim, NAMES)
    victim = next(n for n in NAMES if n != leader)
    other = next(n for n in NAMES if n not in (leader, victim))
    row = {"ops": [{"op": "put", "table": "node", "key": victim, "record": {"name": victim}}]}
    sim.call(other, "transact", "row", row)
    assert sim.run_until(lambda: "row" in _done(sim), 3.0) and _done(sim)["row"].ok
    sim.kill(victim)
    # unknown node: refused with Raft's reason, nothing changes
    sim.call(other, "forget_node", "f-unknown", "zz")
    assert sim.run_until(lambda: "f-unknown" in _done(sim), 3.0)
    assert not _done(sim)["f-unknown"].ok and "'zz' is not a member" in _done(sim)["f-unknown"].error
    # forget through a follower (forwarded to the leader)
    sim.call(other, "forget_node", "forget", victim)
    assert sim.run_until(lambda: "forget" in _done(sim), 3.0) and _done(sim)["forget"].ok, _done(sim).get("forget")
    live = [leader, other]
    for n in live:
        core = sim.core(n)
        assert victim not in core.raft.config.members
    assert sim.run_until(lambda: all((victim,) not in sim.core(n).registry.tables["node"] for n in live), 2.0)
    # two voters now: both are needed, and enough to commit
    assert _write(sim, other, "after-forget").ok
    term = sim.core(leader).raft.term
    # the forgotten node comes back with its old log (it still thinks it votes)
    sim.start(victim)
    assert not sim.core(victim).joining
    assert sim.core(victim).join_requests(sim.now, live) == []
    _ask_to_join_every(sim, victim, live, until=sim.now + 5.0)
    for i in range(10):
        assert _write(sim, live[i % 2], f"back{i}").ok
        sim.run_for(0.4)
    assert _leader(sim, live) == leader and sim.core(leader).raft.term == term
    assert victim not in sim.core(leader).raft.config.members
    assert sim.core(victim).raft.role != LEADER


@pytest.mark.parametrize("seed", range(200), ids=lambda s: f"seed={s}")
def test_join_under_chaos(seed):
    """A joiner asks while leaders are killed, links drop messages and a
    partition comes and goes: once healed it ends a voter everywhere, every
    replica holds the same tables, and every acknowledged write is there."""
    sim = Simulator(seed, min_delay=0.001, max_delay=0.02)
    rng = random.Random(seed)
    for n in NAMES:
        sim.add_node(n, _factory(seed))
    everyone = NAMES + ["d"]
    sim.add_node("d", _factory(seed), start=False)
    join_at = rng.uniform(0.2, 2.0)
    sim.schedule(join_at, lambda s: (not s.nodes["d"].alive) and s.start("d"))
    sim.schedule(join_at, lambda s: _ask_to_join_every(s, "d", NAMES, until=60.0))
    t = 0.3
    for i in range(40):
        t += rng.uniform(0.02, 0.12)
        node = rng.choice(everyone)
        sim.schedule(t, lambda s, n=node, k=f"k{i}": s.nodes[n].alive and s.call(n, "transact", k, _put(k)))
        if rng.random() < 0.06:
            victim = rng.choice(everyone)
            sim.schedule(t, lambda s, v=victim: s.kill(v))
            sim.schedule(t + rng.uniform(0.3, 1.5), lambda s, v=victim: (not s.nodes[v].alive) and s.start(v))
        if rng.random() < 0.04:
            sim.schedule(t, lambda s, side=[rng.choice(everyone)]: s.partition(side))
            sim.schedule(t + rng.uniform(0.3, 1.5), lambda s: s.heal())
        if rng.random() < 0.05:
            sim.schedule(t, lambda s, p=rng.choice([0.0, 0.05, 0.2]): setattr(s, "drop", p))
    sim.run(max(t, join_at) + 2.0)
    sim.heal()
    sim.drop = 0.0
    for n in everyone:
        if not sim.nodes[n].alive:
            sim.start(n)
    assert sim.run_until(
        lambda: all(sim.nodes[n].alive and "d" in sim.core(n).raft.committed_config.voters for n in everyone), 20.0
    ), f"seed {seed}: d never became a voter"
    final = _write_until_ok(sim, everyone, "final")
    target = sim.core(_leader(sim, everyone)).raft.commit_index
    assert sim.run_until(lambda: all(sim.core(n).raft.applied_index >= target for n in everyone), 5.0)
    tables = [sim.core(n).registry.tables for n in everyone]
    assert all(t == tables[0] for t in tables), f"seed {seed}: replicas differ"
    present = {k[0] for k in tables[0]["vhost"]}
    acked = {k for k, e in _done(sim).items() if e.ok}
    assert final in present and acked <= present, f"seed {seed}: lost {sorted(acked - present)}"
    leaders = {}
    for _t, n, e in sim.emitted:
        if type(e).__name__ == "LeaderChanged" and e.leader == n:
            assert leaders.setdefault(e.term, n) == n, f"seed {seed}: two leaders in term {e.term}"
