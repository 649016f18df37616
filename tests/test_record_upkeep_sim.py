"""The record upkeep under the deterministic simulator, racing through the real registry.

Three node agents (:class:`manager_sim_support.SimAgent`: the real
:class:`~mirrorq.mnesia_like.server.RegistryServer` over Raft, with
membership) and, beside them, owners of the real
:class:`~mirrorq.queues.record_upkeep.RecordUpkeep` that never learn they
were deposed, each asking its own node's agent:

* quorum: a leader of an older term and one of a newer term keep the row
  at nearly the same time, and the older one again later (a configuration
  it commits before it hears of the newer term); its node may be cut off
  meanwhile, and messages between nodes may be lost;
* classic: a master of view 1 and the head of view 2 (proposed at a random
  moment) keep the row, the deposed master again later.

Checkers, on the history one registry applied and on the end state:

* :func:`check_terms_never_go_back` -- no write lands over a row of a
  higher term (quorum);
* :func:`check_writes_name_the_current_view` -- every write names the view
  current when it lands (classic);
* :func:`check_newest_wins` -- the row ends as the newest owner wants it,
  and that owner's upkeep is done.

Replay one seed: ``pytest 'tests/test_record_upkeep_sim.py::test_two_leaders_race[seed=7]'``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from manager_sim_support import NODES, SimAgent, node_of_actor

from mirrorq.gm.core import ProposeView
from mirrorq.gm.names import GM_TABLE, create_txn, propose_txn
from mirrorq.mnesia_like.server import TableChanges
from mirrorq.queues.messages import epoch, epoch_term
from mirrorq.queues.record_upkeep import (
    RecordUpkeep,
    Superseded,
    TermFence,
    UpkeepDone,
    ViewFence,
    Wanted,
    WriteRefused,
)
from mirrorq.quorum.hosted import record_of
from mirrorq.simulator import Simulator

SEEDS = 30
KEY = ("/", "q")
GROUP = "queue://q"
RUN = 30.0  # virtual seconds after the first keep: several RECORD_RETRY_MAX backoffs


class Owner:
    """A master or leader as its record upkeep sees it: ``keep`` and
    ``release`` are the test's calls, everything else is the core's."""

    def __init__(self, member: str, agent: str) -> None:
        self.upkeep = RecordUpkeep(member, agent, KEY)

    def start(self, now: float) -> list:
        return self.upkeep.start(now)

    def receive(self, now: float, src: str, msg: Any) -> list:
        return self.upkeep.receive(now, src, msg)

    def timer(self, now: float, key: Any) -> list:
        return self.upkeep.timer(now, key)

    def keep(self, now: float, wanted: Wanted) -> list:
        return self.upkeep.keep(now, wanted)


def cluster(seed: int, rng: random.Random) -> Simulator:
    sim = Simulator(
        seed,
        drop=rng.choice([0.0, 0.0, 0.05]),
        min_delay=0.0005,
        max_delay=rng.choice([0.002, 0.01, 0.03]),
        fifo=True,
        lossless=lambda s, d: node_of_actor(s) == node_of_actor(d),
    )
    for n in NODES:
        sim.add_node(n, lambda name, disk: SimAgent(name, disk, seed))
    ready = lambda: all(sim.core(n).registry.leader is not None for n in NODES)  # noqa: E731
    assert sim.run_until(ready, 15.0), f"seed {seed}: no registry leader"
    return sim


def owner(sim: Simulator, node: str, member: str) -> str:
    name = f"{node}.{member.replace('/', '_')}"
    sim.add_node(name, lambda _n, _d: Owner(member, node))
    return name


def history(sim: Simulator, witness: str) -> list[tuple[str, dict | None]]:
    """The ``gm_group`` and ``amqqueue`` rows of the queue as ``witness`` applied them."""
    out = []
    for _t, _n, ev in sim.events(node=witness, kind=TableChanges):
        for ch in ev.changes:
            if (ch.table, ch.key) in ((GM_TABLE, (GROUP,)), ("amqqueue", KEY)):
                out.append((ch.table, ch.new))
    return out


def upkeep_events(sim: Simulator, name: str, kind: type) -> list:
    return [e for _t, _n, e in sim.events(node=name, kind=kind)]


# ---- checkers ------------------------------------------------------------------------------------
def check_terms_never_go_back(seed: int, sim: Simulator, witness: str) -> None:
    """No write lands over a row naming a higher term."""
    highest = -1
    for table, row in history(sim, witness):
        if table == "amqqueue" and row is not None:
            term = epoch_term(str(row["pid"] or ""))
            assert term >= highest, f"seed {seed}: a row of term {term} landed over one of term {highest}: {row}"
            highest = term


def check_writes_name_the_current_view(seed: int, sim: Simulator, witness: str) -> None:
    """Every write names the view current when it lands: its head, its members."""
    view = None
    for table, row in history(sim, witness):
        if table == GM_TABLE:
            view = row
        elif row is not None:
            assert view is not None and (row["pid"], row["gm_pids"]) == (view["members"][0], view["members"]), (
                f"seed {seed}: a write naming {row['pid']} {row['gm_pids']} landed in view {view}"
            )


def check_newest_wins(seed: int, sim: Simulator, newest: str, wanted: Wanted) -> None:
    """The row ends as the newest owner wants it, and its upkeep knows it is done."""
    row = sim.core(NODES[0]).registry.registry.get("amqqueue", list(KEY))
    assert row is not None and all(row[k] == v for k, v in wanted.fields.items()), (
        f"seed {seed}: the row is {row}, the newest owner wants {dict(wanted.fields)}"
    )
    assert not sim.core(newest).upkeep.pending and upkeep_events(sim, newest, UpkeepDone), (
        f"seed {seed}: the newest owner's upkeep is not done"
    )


# ---- quorum: two leaders of different terms ----------------------------------------------------------
MEMBERS = ["a/quorum/1", "b/quorum/2", "c/quorum/3"]
SPEC = {"name": "q", "vhost": "/", "arguments": {"x-queue-type": "quorum"}, "incarnation": "i1"}


def leader_wants(member: str, term: int, members: list[str]) -> Wanted:
    pid, dst = epoch(member, term), f"{member[0]}/{member[0]}-host:1/x"
    fields = {"pid": pid, "leader_dst": dst, "members": members}
    return Wanted(fields, record_of(SPEC, members, pid, dst, MEMBERS), TermFence(term), whole=True)


def leaders_race(seed: int) -> tuple[Simulator, str, str, Wanted]:
    rng = random.Random(seed)
    sim = cluster(seed, rng)
    old_node, new_node = rng.sample(NODES, 2)
    old_member = next(m for m in MEMBERS if m[0] == old_node)
    new_member = next(m for m in MEMBERS if m[0] == new_node)
    old_term = rng.randint(1, 3)
    new_term = old_term + rng.randint(1, 2)
    old, new = owner(sim, old_node, old_member), owner(sim, new_node, new_member)
    t0 = sim.now
    old_at, new_at = t0 + rng.uniform(0.0, 0.05), t0 + rng.uniform(0.0, 0.05)
    newest = leader_wants(new_member, new_term, MEMBERS)
    sim.schedule(old_at, lambda s: s.call(old, "keep", leader_wants(old_member, old_term, MEMBERS)))
    sim.schedule(new_at, lambda s: s.call(new, "keep", newest))
    # the old leader commits a configuration before it hears of the newer term
    later = leader_wants(old_member, old_term, [m for m in MEMBERS if m != new_member])
    sim.schedule(t0 + rng.uniform(0.0, 2.0), lambda s: s.call(old, "keep", later))
    if rng.random() < 0.5:  # its node cut off for a while
        cut = t0 + rng.uniform(0.0, 0.1)
        sim.schedule(cut, lambda s: s.partition([old_node, old]))
        sim.schedule(cut + rng.uniform(0.5, 3.0), lambda s: s.heal())
    sim.run(t0 + RUN)
    return sim, old, new, newest


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed={s}")
def test_two_leaders_race(seed: int) -> None:
    """A leader of an older term never writes over a newer one's row; the
    newer one's row is what stays."""
    sim, old, new, newest = leaders_race(seed)
    witness = random.Random(seed).choice(NODES)
    check_terms_never_go_back(seed, sim, witness)
    check_newest_wins(seed, sim, new, newest)
    assert not sim.core(old).upkeep.pending, f"seed {seed}: the older leader still writes"


def test_two_leaders_race_is_not_vacuous() -> None:
    """Over the seeds, the older leader's put is refused by its check (a
    newer row landed between its read and its put), and it reads a newer
    term and stops without writing."""
    refused = superseded = 0
    for seed in range(SEEDS):
        sim, old, _new, _ = leaders_race(seed)
        refused += any("precondition failed: amqqueue" in e.error for e in upkeep_events(sim, old, WriteRefused))
        superseded += bool(upkeep_events(sim, old, Superseded))
    assert refused and superseded, f"refused in {refused} seeds, superseded in {superseded}"


# ---- classic: a deposed master and its successor ---------------------------------------------------------
def master_wants(master: str, members: list[str], version: int, synced: bool = True) -> Wanted:
    fields = {
        "pid": master,
        "slave_pids": [m for m in members if m != master],
        "sync_slave_pids": [m for m in members if m != master] if synced else [],
        "gm_pids": list(members),
        "state": "live",
    }
    row = {"name": "q", "vhost": "/", "durable": True, **fields}
    return Wanted(fields, row, ViewFence(GROUP, version))


def masters_race(seed: int) -> tuple[Simulator, str, str, Wanted]:
    rng = random.Random(seed)
    sim = cluster(seed, rng)
    old_node, new_node = rng.sample(NODES, 2)
    m1, m2 = f"{old_node}/{old_node}-host:1/r1", f"{new_node}/{new_node}-host:1/r1"
    sim.call(NODES[0], "transact", create_txn(GROUP, [m1, m2]))
    sim.run_for(0.5)
    old, new = owner(sim, old_node, m1), owner(sim, new_node, m2)
    t0 = sim.now
    newest = master_wants(m2, [m2], 2)
    sim.schedule(t0 + rng.uniform(0.0, 0.05), lambda s: s.call(old, "keep", master_wants(m1, [m1, m2], 1, False)))
    deposed = t0 + rng.uniform(0.0, 0.1)
    sim.schedule(deposed, lambda s: s.call(new_node, "transact", propose_txn(GROUP, ProposeView(1, (m2,)))))
    sim.schedule(deposed + rng.uniform(0.0, 0.1), lambda s: s.call(new, "keep", newest))
    # the deposed master finishes a sync before it hears of the new view
    sim.schedule(t0 + rng.uniform(0.0, 2.0), lambda s: s.call(old, "keep", master_wants(m1, [m1, m2], 1)))
    sim.run(t0 + RUN)
    return sim, old, new, newest


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed={s}")
def test_deposed_master_and_successor_race(seed: int) -> None:
    """A deposed master's writes never land in its successor's view; the
    successor's record is what stays."""
    sim, _old, new, newest = masters_race(seed)
    check_writes_name_the_current_view(seed, sim, random.Random(seed).choice(NODES))
    check_newest_wins(seed, sim, new, newest)


def test_deposed_master_race_is_not_vacuous() -> None:
    """Over the seeds, the deposed master's writes are refused by its view fence."""
    refused = 0
    for seed in range(SEEDS):
        sim, old, _new, _ = masters_race(seed)
        refused += any("version is 2" in e.error for e in upkeep_events(sim, old, WriteRefused))
    assert refused, "the deposed master's write was never refused"
