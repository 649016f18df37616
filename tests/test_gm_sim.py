"""GM ring under the deterministic simulator: kills, joins, partitions, drops.

Every seeded scenario ends with the network healed and the failures reported,
runs until the group is quiet, and then a checker verifies every guarantee of
mirrorq.gm.core on the full event record:

* FIFO + no duplicates: each member delivers each origin's seqs as a run
  without gaps or repeats; payloads are the ones published under that seq;
  a member delivers an origin from seq 1 unless it joined after the origin.
* Confirm: when an origin emits Confirmed(first, last), every member of its
  current view has already delivered first..last; confirms are contiguous.
* AllHold: when a member emits AllHold(origin, upto), every member of its
  current view has already delivered the origin's pubs up to upto (and some
  are emitted: the checker is not vacuous).
* Agreement: all surviving members end with the same last_pub for every
  origin and their runs end there (so what one survivor delivered, all did,
  joiners' older messages excepted).
* Liveness: every message of a surviving origin is confirmed; every survivor
  is idle (no pending_ack left), dead members are out of the view.
* stats.anomalies == 0 everywhere.

The same runs with activities bounded to a pub or two (``max_bytes``): the
guarantees hold when every pub list, catch-ups included, is cut into runs.

Replay one seed: pytest 'tests/test_gm_sim.py::test_ring_chaos[seed=137]'.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from gm_registry_oracle import REGISTRY, GMNode, RegistryOracle

from mirrorq.bounds import ITEM_BYTES, plain_size
from mirrorq.gm.core import Activity, AllHold, Confirmed, Delivered, GMStopped, MembersChanged, Removed
from mirrorq.simulator import Simulator

N_SEEDS = 2000


class Scenario:
    def __init__(
        self,
        seed: int,
        *,
        fifo: bool = True,
        drop: float = 0.0,
        max_delay: float | None = None,
        max_bytes: int | None = None,
    ):
        self.seed = seed
        self.rng = random.Random(seed * 1_000_003 + 17)
        if max_delay is None:
            max_delay = self.rng.choice([0.003, 0.010, 0.030])
        self.sim = Simulator(seed, fifo=fifo, drop=drop, max_delay=max_delay)
        self.published: dict[str, int] = defaultdict(int)
        self.members: dict[str, object] = {}  # name -> GMMember (kept after kill)
        self.kw = dict(
            # None: flushed at the end of every turn (production's shells); a number: a flush timer
            flush_interval=self.rng.choice([None, 0.002]),
            max_batch=self.rng.choice([1, 3, 100]),
            tick_interval=0.1,
            ack_delay=self.rng.choice([None, 0.005, 0.03]),  # the ack round rides on later traffic
        )
        if max_bytes is not None:
            self.kw["max_bytes"] = max_bytes
        self.initial: list[str] = []
        self.killed: set[str] = set()

    # ---- topology helpers ----------------------------------------------
    def factory(self, subscribe: bool):
        def make(name: str, disk: dict):
            node = GMNode(name, subscribe=subscribe, **self.kw)
            self.members[name] = node.member
            return node

        return make

    def add_initial(self, n: int) -> None:
        self.initial = [f"m{i}" for i in range(n)]
        for name in self.initial:
            self.sim.add_node(name, self.factory(False))
        names = tuple(self.initial)
        self.sim.add_node(REGISTRY, lambda name, disk: RegistryOracle(names))

    @property
    def registry(self) -> RegistryOracle:
        return self.sim.core(REGISTRY)

    def live(self, name: str) -> bool:
        node = self.sim.nodes.get(name)
        return bool(node and node.alive and not self.members[name].removed)

    def live_members(self) -> list[str]:
        return [n for n in self.members if self.live(n)]

    # ---- scheduled actions -----------------------------------------------
    def publish(self, at: float, name: str) -> None:
        def fn(sim: Simulator) -> None:
            if not self.live(name):
                return
            seq = self.published[name] + 1
            try:
                sim.call(name, "broadcast", (name, seq))
            except GMStopped:
                return
            self.published[name] = seq
            assert self.members[name].pub_count == seq

        self.sim.schedule(at, fn)

    def kill(self, at: float, name: str) -> None:
        rng = self.rng

        def fn(sim: Simulator) -> None:
            if name not in sim.nodes or not sim.nodes[name].alive:
                return
            sim.kill(name)
            self.killed.add(name)
            others = [n for n in self.live_members() if n != name]
            told = [n for n in others if rng.random() < 0.7] or others[:1]
            for n in told:
                self.notify(sim.now + rng.uniform(0.005, 0.08), n, "member_down", name)

        self.sim.schedule(at, fn)

    def notify(self, at: float, name: str, method: str, arg: str) -> None:
        def fn(sim: Simulator) -> None:
            if self.live(name):
                sim.call(name, method, arg)

        self.sim.schedule(at, fn)

    def join(self, at: float, name: str) -> None:
        def fn(sim: Simulator) -> None:
            sim.add_node(name, self.factory(True))
            sim.call(name, "join")

        self.sim.schedule(at, fn)

    # ---- the run -----------------------------------------------------------
    def build(self) -> float:
        rng, sim = self.rng, self.sim
        n = rng.randint(2, 7)
        self.add_initial(n)
        horizon = 0.4
        # publishers: initial members and joiners
        for name in self.initial:
            for _ in range(rng.randint(0, 8)):
                self.publish(rng.uniform(0.0, horizon), name)
        joiners = [f"j{i}" for i in range(rng.choice([0, 0, 1, 1, 2, 3]))]
        for name in joiners:
            t = rng.uniform(0.0, horizon)
            self.join(t, name)
            for _ in range(rng.randint(0, 4)):
                self.publish(t + rng.uniform(0.0, horizon), name)
        # kills: initial members, several at once sometimes, never all
        victims = rng.sample(self.initial, rng.randint(0, min(3, n - 1)))
        t = rng.uniform(0.0, horizon)
        for v in victims:
            if rng.random() < 0.6:
                t = rng.uniform(0.0, horizon)
            self.kill(t, v)
        if joiners and rng.random() < 0.2:
            self.kill(rng.uniform(0.0, horizon + 0.2), rng.choice(joiners))
        end = horizon + 0.2
        # a partition: short (nobody notices) or long (liveness reports it)
        if rng.random() < 0.3:
            everyone = self.initial + joiners
            side = rng.sample(everyone, rng.randint(1, max(1, len(everyone) - 1)))
            if rng.random() < 0.5:
                side = side + [REGISTRY]
            tp = rng.uniform(0.0, horizon)
            long = rng.random() < 0.5
            dur = rng.uniform(0.3, 0.6) if long else rng.uniform(0.02, 0.15)
            sim.schedule(tp, lambda s: s.partition(side))
            if long:

                def report(s: Simulator, side=frozenset(side)) -> None:
                    for a in self.live_members():
                        for b in self.live_members():
                            if (a in side) != (b in side):
                                s.call(a, "member_down", b)

                sim.schedule(tp + 0.1, report)
            sim.schedule(tp + dur, lambda s: s.heal())

            def recover(s: Simulator) -> None:
                live = self.live_members()
                for a in live:
                    for b in live:
                        if a != b:
                            s.call(a, "member_up", b)

            if long:
                sim.schedule(tp + dur + 0.01, recover)
            end = max(end, tp + dur + 0.05)
        return end

    def quiet(self) -> bool:
        reg = self.registry
        actors = [n for n in self.live_members() if n in reg.view or self.members[n].joining]
        if any(n in reg.view for n in self.killed) and actors:
            return False  # (with nobody left to act the group is simply dead)
        for name in self.live_members():
            m = self.members[name]
            if name not in reg.view:
                continue  # a joiner still waiting, or about to learn it was removed
            if m.view != reg.view or not m.idle():
                return False
        # removed-but-alive members must have learnt it
        for name in self.members:
            node = self.sim.nodes[name]
            if node.alive and not self.members[name].removed and name not in reg.view and self.members[name].view:
                return False
        return True

    def run(self) -> int:
        """Run to quiet and check; returns the number of AllHold events."""
        end = self.build()
        self.sim.run(end)
        self.sim.heal()
        # liveness eventually tells every survivor about every dead member
        for a in self.live_members():
            for b in sorted(self.killed):
                if self.live(a):
                    self.sim.call(a, "member_down", b)
        deadline = self.sim.now + 20.0
        while not self.quiet():
            assert self.sim.now < deadline, f"seed {self.seed}: group never became quiet\n{self.describe()}"
            self.sim.run_for(0.05)
        return check(self)

    def describe(self) -> str:
        lines = [f"registry {self.registry.view}", f"killed {sorted(self.killed)}"]
        for name, m in self.members.items():
            alive = self.sim.nodes[name].alive
            lines.append(f"{name} alive={alive} {m.info()}")
        return "\n".join(lines)


def check(sc: Scenario) -> int:
    sim, reg = sc.sim, sc.registry
    join_version: dict[str, int] = {}
    for v in reg.history:
        for m in v.members:
            join_version.setdefault(m, v.version)
    view_of: dict = {}
    runs: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    confirmed_upto: dict[str, int] = defaultdict(int)
    removed: set[str] = set()
    first_view_at: dict[str, int] = {}
    delivered_at: dict[str, list[int]] = defaultdict(list)
    all_holds = 0
    for i, (t, node, ev) in enumerate(sim.emitted):
        where = f"seed {sc.seed} event #{i} at {t:.4f} on {node}: {ev!r}"
        assert node not in removed, f"{where}: event after Removed"
        if isinstance(ev, MembersChanged):
            first_view_at.setdefault(node, i)
            old = view_of.get(node)
            assert node in ev.view, where
            assert old is None or ev.view.version > old.version, where
            assert ev.view in reg.history, f"{where}: view never committed"
            view_of[node] = ev.view
        elif isinstance(ev, Delivered):
            assert ev.payload == (ev.origin, ev.seq), f"{where}: payload mismatch"
            run = runs[node][ev.origin]
            if run:
                assert ev.seq == run[-1] + 1, f"{where}: after seq {run[-1]} (gap, duplicate or reorder)"
            else:
                from_start = node == ev.origin or (
                    node in join_version
                    and ev.origin in join_version
                    and (
                        join_version[node] < join_version[ev.origin]
                        or join_version[node] == 1 == join_version[ev.origin]
                    )
                )
                if from_start:
                    assert ev.seq == 1, f"{where}: first delivery of this origin must be seq 1"
            run.append(ev.seq)
            delivered_at[ev.origin].append(i)
        elif isinstance(ev, Confirmed):
            assert ev.first == confirmed_upto[node] + 1 and ev.last >= ev.first, f"{where}: not contiguous"
            confirmed_upto[node] = ev.last
            view = view_of.get(node)
            assert view is not None, f"{where}: confirmed without a view"
            for m in view.members:
                run = runs[m][node]
                assert run and run[0] <= ev.first and run[-1] >= ev.last, (
                    f"{where}: member {m} of view {view.version} lacks it (has {run[:1]}..{run[-1:]})"
                )
        elif isinstance(ev, AllHold):
            all_holds += 1
            view = view_of.get(node)
            assert view is not None and node in view.members, f"{where}: AllHold without a view"
            for m in view.members:
                run = runs[m][ev.origin]
                assert run and run[-1] >= ev.upto, (
                    f"{where}: member {m} of view {view.version} lacks it (has up to {run[-1:]})"
                )
        elif isinstance(ev, Removed):
            removed.add(node)

    for name, m in sc.members.items():
        assert m.stats.anomalies == 0, f"seed {sc.seed}: {name} anomalies {m.stats.anomalies}"

    survivors = [n for n in reg.view.members if sc.live(n)]
    for n in survivors:
        assert view_of.get(n) == reg.view, f"seed {sc.seed}: {n} did not install the final view"
    origins = sorted({o for n in survivors for o in sc.members[n].members_state})
    for o in origins:
        ends = {n: sc.members[n].members_state[o].last_pub for n in survivors if o in sc.members[n].members_state}
        for n in survivors:
            # a survivor may not know an origin only if nothing of that origin
            # was delivered anywhere after the survivor's first view
            if n not in ends:
                late = [i for i in delivered_at[o] if i > first_view_at[n]]
                assert not late, f"seed {sc.seed}: survivor {n} never heard of origin {o}, delivered at {late}"
        assert len(set(ends.values())) == 1, f"seed {sc.seed}: survivors disagree on {o}: {ends}\n{sc.describe()}"
        end = next(iter(ends.values()))
        for n in survivors:
            run = runs[n][o]
            if run:
                assert run[-1] == end, f"seed {sc.seed}: {n} delivered {o} up to {run[-1]}, last_pub {end}"
    for n in survivors:
        assert confirmed_upto[n] == sc.published[n], (
            f"seed {sc.seed}: {n} published {sc.published[n]} but confirmed {confirmed_upto[n]}"
        )
        assert sc.members[n].idle(), f"seed {sc.seed}: {n} not idle"
    return all_holds


@pytest.mark.parametrize("seed", range(N_SEEDS), ids=lambda s: f"seed={s}")
def test_ring_chaos(seed: int) -> None:
    Scenario(seed).run()


def test_all_hold_is_emitted():
    """The AllHold checker above is not vacuous: rings of two or more emit it."""
    assert sum(Scenario(seed).run() for seed in range(20)) > 20


@pytest.mark.parametrize("seed", range(300), ids=lambda s: f"seed={s}")
def test_ring_chaos_lossy_reordering_network(seed: int) -> None:
    """Messages dropped (5%) and reordered at random, not only at link
    breaks: retransmission must fill every gap, never skip one."""
    sc = Scenario(seed + 50_000, fifo=False, drop=0.05)
    sc.run()


#: a pub ("m3", 17) weighs about 50 bytes with its item overhead: activities of one or two
SMALL_ACTIVITY = 120


def _bounded_run(seed: int) -> tuple[Scenario, int]:
    """A chaos run with activities of at most SMALL_ACTIVITY bytes of pubs;
    returns it and the largest activity of more than one pub it sent."""
    sc = Scenario(seed + 90_000, max_bytes=SMALL_ACTIVITY)
    biggest = [0]
    send = sc.sim._send

    def measured(src, dst, msg):
        if isinstance(msg, Activity):
            pubs = [p for it in msg.items for p in it.pubs]
            if len(pubs) > 1:
                biggest[0] = max(biggest[0], sum(plain_size(p) + ITEM_BYTES for _s, p in pubs))
        send(src, dst, msg)

    sc.sim._send = measured
    sc.run()
    return sc, biggest[0]


@pytest.mark.parametrize("seed", range(400), ids=lambda s: f"seed={s}")
def test_ring_chaos_with_bounded_activities(seed: int) -> None:
    """Every activity holds pubs of at most SMALL_ACTIVITY bytes (or one
    pub), catch-ups and forwarded runs included, and every guarantee holds."""
    _sc, biggest = _bounded_run(seed)
    assert biggest <= SMALL_ACTIVITY


def test_bounded_activities_do_cut_pub_lists():
    """The runs above are not vacuous: pub lists are cut into several activities."""
    assert sum(m.stats.split for seed in range(10) for m in _bounded_run(seed)[0].members.values()) > 10
