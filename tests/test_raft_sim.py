"""Seeded chaos simulations of the Raft core (mirrorq.mnesia_like.raft).

Each seed builds a 3- or 5-server cluster (sometimes with a joining server
and a removal), runs it through crashes, restarts, partitions, message loss
and reordering while clients propose and read, then heals everything and
checks Raft's safety properties plus liveness after healing:

* election safety   -- at most one leader per term;
* log matching      -- two logs with an entry of the same index and term are
                       identical up to that index;
* leader completeness -- a leader elected after an entry was known committed
                       holds that entry;
* state-machine safety -- no two servers apply different commands at one index
                       (checked on every Committed and every ApplySnapshot);
* acknowledged proposals -- every ProposalCommitted is, after healing, in the
                       applied state of every member at its index; a
                       ProposalLost really lost its index;
* linearizable reads -- a ReadReady index covers every proposal acknowledged
                       before the read was asked.

The same runs with tiny messages (``max_bytes_per_message``): appends cut by
bytes and snapshots sent in many chunks keep every property.

Replay one seed: pytest 'tests/test_raft_sim.py::test_chaos[seed=137]'.
"""

from __future__ import annotations

import random

import pytest

from mirrorq.mnesia_like.raft import (
    LEADER,
    AppendEntries,
    ApplySnapshot,
    Committed,
    InstallSnapshot,
    LeaderChanged,
    MemoryRaftLog,
    ProposalCommitted,
    ProposalLost,
    RaftNode,
    ReadReady,
)
from mirrorq.sansio import Emit, Send
from mirrorq.simulator import Simulator

SEEDS = 2000


class World:
    """Cross-node checker state, fed by the App wrappers as events happen."""

    def __init__(self, sim: Simulator):
        self.sim = sim
        self.committed: dict[int, tuple[int, object]] = {}  # index -> (term, command)
        self.first_seen: dict[int, float] = {}
        self.leaders: dict[int, str] = {}
        self.elections: list[tuple[float, int, str, int, dict]] = []
        self.commands: dict[int, object] = {}  # pid -> command
        self.acked_max = 0  # highest index acknowledged by ProposalCommitted so far
        self.reads: dict[object, int] = {}  # rid -> acked_max when the read was asked
        self.reads_done = 0
        self.power_cuts = 0  # servers killed inside a persist, before the flush (early appends runs)
        self.early_cuts = 0  # ... of them leaders whose appends of the unflushed entries had left

    def saw_committed(self, node: str, index: int, term: int | None, command: object) -> None:
        known = self.committed.get(index)
        if known is None:
            if term is None:
                return  # from a snapshot: the index must have been committed before, unseen here
            self.committed[index] = (term, command)
            self.first_seen[index] = self.sim.now
        elif known[1] != command or (term is not None and known[0] != term):
            raise AssertionError(
                f"state-machine safety: {node} applies {command!r} (term {term}) at {index}, "
                f"others applied {known[1]!r} (term {known[0]})"
            )

    def saw_leader(self, node: str, term: int, raft: RaftNode) -> None:
        other = self.leaders.setdefault(term, node)
        if other != node:
            raise AssertionError(f"election safety: {other} and {node} both lead term {term}")
        log = raft.log
        terms = {i: log.term_at(i) for i in range(log.snapshot_index + 1, log.last_index + 1)}
        self.elections.append((self.sim.now, term, node, log.snapshot_index, terms))


class App:
    """The application around one RaftNode: its state machine is the map
    index -> command; it snapshots every ``snap_every`` applied entries."""

    def __init__(self, name: str, disk: dict, world: World, voters: tuple, snap_every: int, options: dict):
        self.name = name
        self.world = world
        self.snap_every = snap_every
        self.state: dict[int, object] = {}
        rng = random.Random(world.sim.rng.getrandbits(64))
        self.raft = RaftNode(name, MemoryRaftLog(disk), rng, voters=voters, **options)
        #: the power goes at the next persist, before the flush (a leader's: at the
        #: next one after it sent entries early, which are on the network then)
        self.doomed = False
        self.sent_early = False

    def _observe(self, now: float, actions: list) -> list:
        world = self.world
        raft = self.raft
        for a in actions:
            if type(a) is Send and a.early and type(a.msg) is AppendEntries and a.msg.entries:
                self.sent_early = True
            if type(a) is not Emit:
                continue
            ev = a.event
            t = type(ev)
            if t is Committed:
                self.state[ev.index] = ev.command
                world.saw_committed(self.name, ev.index, ev.term, ev.command)
            elif t is ApplySnapshot:
                self.state = dict(ev.data)
                for index, command in ev.data:
                    world.saw_committed(self.name, index, None, command)
            elif t is LeaderChanged and ev.leader == self.name:
                world.saw_leader(self.name, ev.term, raft)
            elif t is ProposalCommitted and ev.pid in world.commands:
                assert self.state.get(ev.index) == world.commands[ev.pid], "ProposalCommitted before applied"
                world.acked_max = max(world.acked_max, ev.index)
            elif t is ReadReady:
                asked = world.reads.pop(ev.request_id)
                assert ev.index >= asked, f"read {ev.request_id} at {ev.index} misses acked index {asked}"
                assert raft.applied_index >= ev.index
                world.reads_done += 1
        if raft.applied_index - raft.log.snapshot_index >= self.snap_every:
            actions = actions + raft.compact(now, raft.applied_index, tuple(sorted(self.state.items())))
        return actions

    def persist(self, now):
        early, self.sent_early = self.sent_early, False
        if not self.doomed or (self.raft.role == LEADER and not early):
            return self._observe(now, self.raft.persist(now))
        self.world.power_cuts += 1
        self.world.early_cuts += early
        self.world.sim.kill(self.name)  # the log's unflushed writes are lost
        return []

    def start(self, now):
        return self._observe(now, self.raft.start(now))

    def receive(self, now, src, msg):
        return self._observe(now, self.raft.receive(now, src, msg))

    def timer(self, now, key):
        return self._observe(now, self.raft.timer(now, key))

    def propose_batch(self, now, items):
        return self._observe(now, self.raft.propose_batch(now, items))

    def read_index(self, now, rid):
        self.world.reads[rid] = self.world.acked_max
        return self._observe(now, self.raft.read_index(now, rid))

    def add_server(self, now, node, rid):
        return self._observe(now, self.raft.add_server(now, node, rid))

    def remove_server(self, now, node, rid):
        return self._observe(now, self.raft.remove_server(now, node, rid))


def leader_of(sim: Simulator) -> App | None:
    best = None
    for name in sim.alive():
        app = sim.core(name)
        if app.raft.role == LEADER and (best is None or app.raft.term > best.raft.term):
            best = app
    return best


def run_chaos(seed: int, max_bytes: int | None = None, seen: dict | None = None, early: bool = False) -> dict:
    """``max_bytes``: the servers' ``max_bytes_per_message``; ``seen``
    collects the sizes of what they send (``_watch_sizes``); ``early``: the
    servers send their appends before their persist (``early_appends``) and
    half the kills strike inside a persist, before its flush (a leader's:
    inside the persist of entries whose appends have left)."""
    plan = random.Random(seed * 7919 + 17)
    n = plan.choice((3, 3, 5))
    sim = Simulator(
        seed,
        drop=plan.choice((0.0, 0.02, 0.1)),
        min_delay=0.001,
        max_delay=plan.choice((0.005, 0.02, 0.08)),
    )
    options = {
        "pre_vote": plan.random() < 0.6,
        "check_quorum": plan.random() < 0.6,
        "max_entries_per_message": plan.choice((4, 512, 512)),
    }
    if max_bytes is not None:
        options["max_bytes_per_message"] = max_bytes
    doom = random.Random(seed * 7919 + 101)  # which kills strike inside a persist (apart: plan's draws unchanged)
    if early:
        options["early_appends"] = True
        options["commit_notice_delay"] = doom.choice((0.0, 0.02))

    def kill(s: Simulator, name: str) -> None:
        if early and s.nodes[name].alive and doom.random() < 0.5:
            s.core(name).doomed = True
        else:
            s.kill(name)

    if seen is not None:
        _watch_sizes(sim, seen)
    world = World(sim)
    voters = tuple(f"n{i}" for i in range(n))
    snap_every = plan.choice((8, 25, 1000))
    joiner = "n9" if plan.random() < 0.3 else None
    to_remove = plan.choice(voters) if joiner and plan.random() < 0.7 else None

    def factory(name, disk):
        return App(name, disk, world, voters, snap_every, options)

    for name in voters + ((joiner,) if joiner else ()):
        sim.add_node(name, factory)

    chaos_end = 2.5
    pid_counter = [0]

    def client(s: Simulator) -> None:
        if s.now > chaos_end:
            return
        alive = s.alive()
        leaders = [s.core(m) for m in alive if s.core(m).raft.role == LEADER]
        target = plan.choice(leaders) if leaders and plan.random() < 0.85 else None
        if target is None and alive:
            target = s.core(plan.choice(alive))
        if target is not None:
            if plan.random() < 0.15:
                pid_counter[0] += 1
                s.call(target.name, "read_index", ("read", pid_counter[0]))
            else:
                items = []
                for _ in range(plan.choice((1, 1, 1, 3, 8))):
                    pid_counter[0] += 1
                    world.commands[pid_counter[0]] = f"c{pid_counter[0]}"
                    items.append((pid_counter[0], f"c{pid_counter[0]}"))
                s.call(target.name, "propose_batch", items)
        if s.now < chaos_end:
            s.schedule(s.now + plan.uniform(0.01, 0.06), client)

    sim.schedule(0.3, client)

    def fault(s: Simulator) -> None:
        if s.now > chaos_end:
            return
        kind = plan.choice(("kill", "kill", "restart", "partition", "partition", "heal", "leader", "leader"))
        names = sorted(s.nodes)
        if kind == "leader":  # depose the leader: kill it or cut it off with a minority
            app = leader_of(s)
            if app is not None:
                if plan.random() < 0.5:
                    kill(s, app.name)
                else:
                    others = [m for m in names if m != app.name]
                    plan.shuffle(others)
                    s.partition(
                        [app.name] + others[: plan.randint(0, (len(names) - 1) // 2 - 1)]
                        if len(names) > 3
                        else [app.name]
                    )
        elif kind == "kill":
            kill(s, plan.choice(names))
        elif kind == "restart":
            victim = plan.choice(names)
            if s.nodes[victim].alive:
                s.restart(victim)
            else:
                s.start(victim)
        elif kind == "partition":
            shuffled = names[:]
            plan.shuffle(shuffled)
            cut = plan.randint(1, len(shuffled) - 1)
            s.partition(shuffled[:cut])
        else:
            s.heal()
        if s.now < chaos_end:
            s.schedule(s.now + plan.uniform(0.05, 0.3), fault)

    sim.schedule(plan.uniform(0.2, 0.6), fault)

    def committed_config(s: Simulator):
        app = leader_of(s)
        return app.raft.committed_config if app else None

    def change(s: Simulator) -> None:
        cfg = committed_config(s)
        app = leader_of(s)
        if cfg is not None and app is not None:
            if joiner not in cfg.voters and joiner not in cfg.learners:
                s.call(app.name, "add_server", joiner, ("add", s.now))
            elif joiner in cfg.voters and to_remove and to_remove in cfg.members:
                s.call(app.name, "remove_server", to_remove, ("remove", s.now))
        if s.now < chaos_end + 3:
            s.schedule(s.now + 0.2, change)

    if joiner:
        sim.schedule(0.4, change)

    sim.run(chaos_end)

    # ---- heal: network back, every server restarted, no more loss -------------
    sim.heal()
    sim.drop = 0.0
    for name in sorted(sim.nodes):
        if not sim.nodes[name].alive:
            sim.start(name)
        else:
            sim.core(name).doomed = False

    def settled() -> bool:
        app = leader_of(sim)
        if app is None:
            return False
        raft = app.raft
        if raft.log.term_at(raft.commit_index) != raft.term or raft.config.learners:
            return False
        if joiner and (
            joiner not in raft.committed_config.voters or (to_remove and to_remove in raft.committed_config.members)
        ):
            return False
        if raft.config != raft.committed_config:
            return False
        return all(sim.core(m).raft.applied_index == raft.commit_index for m in raft.config.members)

    def run_until(pred, timeout: float) -> bool:
        deadline = sim.now + timeout
        while sim.now < deadline:
            if pred():
                return True
            sim.run_for(0.05)
        return pred()

    assert run_until(settled, 15.0), f"seed {seed}: cluster did not settle after healing"

    # liveness: a fresh proposal commits and reaches every member (retried
    # with a new pid if the leader it went to is deposed meanwhile)
    final_ok = False
    for attempt in range(5):
        leader = leader_of(sim)
        assert leader is not None, f"seed {seed}: no leader after healing"
        pid_counter[0] += 1
        final_pid = pid_counter[0]
        world.commands[final_pid] = f"final{attempt}"
        mark = len(sim.emitted)
        sim.call(leader.name, "propose_batch", [(final_pid, f"final{attempt}")])

        def final_done() -> bool:
            return any(type(e) is ProposalCommitted and e.pid == final_pid for _, _, e in sim.emitted[mark:])

        if (
            run_until(
                lambda: (
                    final_done()
                    or any(type(e) is ProposalLost and e.pid == final_pid for _, _, e in sim.emitted[mark:])
                ),
                3.0,
            )
            and final_done()
            and run_until(settled, 5.0)
        ):
            final_ok = True
            break
        assert run_until(settled, 10.0), f"seed {seed}: cluster did not settle again"
    assert final_ok, f"seed {seed}: no proposal commits after healing"
    members = leader_of(sim).raft.config.members

    # ---- checks ------------------------------------------------------------
    apps = {m: sim.core(m) for m in members}
    states = {m: a.state for m, a in apps.items()}
    first = states[members[0]]
    for m, st in states.items():
        assert st == first, f"seed {seed}: {m} applied a different sequence than {members[0]}"

    # acknowledged proposals are applied everywhere; lost ones really lost
    acked = 0
    for _, _node, ev in sim.events():
        if type(ev) is ProposalCommitted and ev.pid in world.commands:
            acked += 1
            for m, st in states.items():
                assert st.get(ev.index) == world.commands[ev.pid], (
                    f"seed {seed}: acked pid {ev.pid} at {ev.index} missing on {m}"
                )
        elif type(ev) is ProposalLost and ev.pid in world.commands:
            assert world.committed.get(ev.index, (0, None))[1] != world.commands[ev.pid]
    values = list(first.values())
    assert len(values) == len(set(values)), f"seed {seed}: a command applied twice"

    # log matching across every live server
    logs = {}
    for name in sim.alive():
        log = sim.core(name).raft.log
        logs[name] = {i: log.entry(i) for i in range(log.snapshot_index + 1, log.last_index + 1)}
    names = sorted(logs)
    for ai, a in enumerate(names):
        for b in names[ai + 1 :]:
            common = sorted(set(logs[a]) & set(logs[b]), reverse=True)
            matched = False
            for i in common:
                if logs[a][i].term == logs[b][i].term:
                    matched = True
                if matched:
                    assert logs[a][i] == logs[b][i], f"seed {seed}: log matching broken at {i} ({a}, {b})"

    # leader completeness
    for t_elected, term, node, snap_index, terms in world.elections:
        for index, (cterm, _) in world.committed.items():
            if world.first_seen[index] < t_elected and index > snap_index:
                assert terms.get(index) == cterm, (
                    f"seed {seed}: leader {node} of term {term} lacks committed entry {index}"
                )

    return {
        "acked": acked,
        "leaders": len(world.leaders),
        "reads": world.reads_done,
        "committed": len(world.committed),
        "members": members,
        "power_cuts": world.power_cuts,
        "early_cuts": world.early_cuts,
    }


def _watch_sizes(sim: Simulator, seen: dict) -> None:
    """Record the largest AppendEntries of more than one entry (its
    estimate), the largest snapshot chunk, and the chunks sent past the first."""
    send = sim._send

    def measured(src, dst, msg):
        if type(msg) is AppendEntries and len(msg.entries) > 1:
            seen["entries_bytes"] = max(seen.get("entries_bytes", 0), msg.nbytes)
        elif type(msg) is InstallSnapshot:
            seen["chunk_bytes"] = max(seen.get("chunk_bytes", 0), len(msg.chunk))
            seen["later_chunks"] = seen.get("later_chunks", 0) + (msg.offset > 0)
        send(src, dst, msg)

    sim._send = measured


#: a command weighs about 40 bytes in an estimate: messages of a few entries, snapshots in many chunks
SMALL_MESSAGES = 128


@pytest.mark.parametrize("seed", range(500), ids=lambda s: f"seed={s}")
def test_chaos_with_small_messages(seed):
    """The same chaos with AppendEntries of at most SMALL_MESSAGES bytes of
    entries (or one entry) and snapshots sent in chunks of that size: every
    property holds and no message is over the bound."""
    seen: dict = {}
    result = run_chaos(seed + 70_000, max_bytes=SMALL_MESSAGES, seen=seen)
    assert result["committed"] >= 1
    assert seen.get("entries_bytes", 0) <= SMALL_MESSAGES
    assert seen.get("chunk_bytes", 0) <= SMALL_MESSAGES


def test_small_messages_do_cut_appends_and_snapshots():
    """The runs above are not vacuous: appends are cut by bytes and
    snapshots travel in several chunks, and those runs still commit."""
    seen: dict = {}
    for seed in range(40):
        run_chaos(seed + 70_000, max_bytes=SMALL_MESSAGES, seen=seen)
    assert seen["later_chunks"] > 20
    assert 0 < seen["entries_bytes"] <= SMALL_MESSAGES


@pytest.mark.parametrize("seed", range(500), ids=lambda s: f"seed={s}")
def test_chaos_with_early_appends(seed):
    """The same chaos with the leaders' appends sent before their own
    persist, and kills inside persists: no committed entry is lost."""
    result = run_chaos(seed + 90_000, early=True)
    assert result["committed"] >= 1


def test_early_appends_chaos_cuts_leaders_between_send_and_flush():
    """The runs above are not vacuous: leaders lose the power after their
    appends left and before their flush, and the runs still commit."""
    totals = [run_chaos(seed + 90_000, early=True) for seed in range(40)]
    assert sum(r["early_cuts"] for r in totals) > 10
    assert sum(r["acked"] for r in totals) > 500


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed={s}")
def test_chaos(seed):
    result = run_chaos(seed)
    assert result["committed"] >= 1


def test_chaos_is_deterministic_and_does_work():
    """Same seed, same run; and across seeds the runs really commit, elect
    several leaders, serve reads and change membership (so the checks above
    are not vacuous)."""
    assert run_chaos(11) == run_chaos(11)
    totals = [run_chaos(s) for s in range(40)]
    assert sum(r["acked"] for r in totals) > 500
    assert sum(r["leaders"] for r in totals) > 60
    assert sum(r["reads"] for r in totals) > 20
    assert any("n9" in r["members"] for r in totals)
