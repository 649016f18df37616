"""The membership/liveness core under the deterministic simulator.

Each seed builds a random cluster, runs a chaotic phase (message loss,
partitions, kills, restarts), then heals the network and checks that every
live node converged: it sees every other live node up with its current
incarnation and every dead node it knows down.  A failing seed replays alone:
``pytest 'tests/test_membership_sim.py::test_converges_after_chaos[seed=137]'``.
"""

from __future__ import annotations

import random

import pytest

from mirrorq.node.membership import Heartbeat, KnownPeers, Leave, Membership, NodeDown, NodeUp
from mirrorq.sansio import Emit, Send, SetTimer
from mirrorq.simulator import Simulator

INTERVAL = 0.2
TIMEOUT = 1.5


class _Shell:
    """What the real node agent does around the core, in miniature: keep
    KnownPeers on disk and hand them back as seeds on the next start."""

    def __init__(self, core: Membership, disk: dict):
        self.core, self.disk = core, disk

    def __getattr__(self, attr):
        return getattr(self.core, attr)

    def _keep(self, actions):
        for a in actions:
            if isinstance(a, Emit) and isinstance(a.event, KnownPeers):
                self.disk["peers"] = list(a.event.nodes)
        return actions

    def start(self, now):
        return self._keep(self.core.start(now))

    def receive(self, now, src, msg):
        return self._keep(self.core.receive(now, src, msg))

    def timer(self, now, key):
        return self._keep(self.core.timer(now, key))


def _factory(seeds: dict[str, list[str]]):
    def make(name: str, disk: dict) -> _Shell:
        disk["incarnation"] = disk.get("incarnation", 0) + 1
        known = sorted(set(seeds[name]) | set(disk.get("peers", ())))
        core = Membership(name, disk["incarnation"], known, interval=INTERVAL, timeout=TIMEOUT)
        return _Shell(core, disk)

    return make


def _build(seed: int, n: int):
    sim = Simulator(seed, min_delay=0.0005, max_delay=0.02)
    names = [f"n{i}" for i in range(n)]
    rng = random.Random(seed * 7919 + 1)
    # each node knows one earlier node (node 0 knows nobody): only gossip
    # can make the cluster whole.
    seeds = {name: ([names[rng.randrange(i)]] if i else []) for i, name in enumerate(names)}
    make = _factory(seeds)
    for name in names:
        sim.add_node(name, make)
    return sim, names, rng, seeds


def _check_transitions(sim: Simulator) -> None:
    """Per life of an observer and per peer, events alternate up/down,
    starting with up."""
    state: dict[tuple[str, str], bool] = {}
    starts = {}
    for pos, name, _inc in sim.starts:
        starts.setdefault(pos, []).append(name)
    for pos, (_t, observer, ev) in enumerate(sim.emitted):
        for restarted in starts.get(pos, ()):
            state = {k: v for k, v in state.items() if k[0] != restarted}
        if isinstance(ev, NodeUp):
            key = (observer, ev.node)
            assert not state.get(key, False), f"{observer} reported {ev.node} up twice in a row"
            state[key] = True
        elif isinstance(ev, NodeDown):
            key = (observer, ev.node)
            assert state.get(key, False), f"{observer} reported {ev.node} down while not up"
            state[key] = False


def _converged(sim: Simulator, names: list[str], since: float = 0.0) -> bool:
    """Every live node sees every other live node up, in its current life and
    heard from at or after ``since``, and no dead node up."""
    live = sim.alive()
    for obs in live:
        core = sim.core(obs)
        for other in names:
            if other == obs:
                continue
            if other in live:
                inc = sim.nodes[other].disk["incarnation"]
                peer = core.peers.get(other)
                if not (peer and peer.up and peer.incarnation == inc and peer.last_heard >= since):
                    return False
            elif core.is_up(other):
                return False
    return True


@pytest.mark.parametrize("seed", range(500), ids=lambda s: f"seed={s}")
def test_converges_after_chaos(seed: int) -> None:
    sim, names, rng, seeds = _build(seed, n=random.Random(seed).randint(2, 6))
    # chaos: 8 virtual seconds of random faults
    t = 0.0
    while True:
        t += rng.uniform(0.2, 1.5)
        if t >= 8.0:
            break
        fault = rng.choice(["drop", "partition", "heal", "kill", "restart", "nothing"])
        if fault == "drop":
            p = rng.choice([0.0, 0.1, 0.3, 0.6])
            sim.schedule(t, lambda s, p=p: setattr(s, "drop", p))
        elif fault == "partition":
            side = rng.sample(names, rng.randint(1, len(names) - 1)) if len(names) > 1 else names
            sim.schedule(t, lambda s, side=side: s.partition(side))
        elif fault == "heal":
            sim.schedule(t, lambda s: s.heal())
        elif fault == "kill":
            victim = rng.choice(names)
            sim.schedule(t, lambda s, v=victim: s.kill(v))
        elif fault == "restart":
            victim = rng.choice(names)
            sim.schedule(t, lambda s, v=victim: s.restart(v))
    sim.run(8.0)
    sim.heal()
    sim.drop = 0.0
    healed = sim.now
    # a node left dead in the chaos may come back or stay dead ...
    for name in names:
        if not sim.nodes[name].alive and rng.random() < 0.5:
            sim.start(name)
    if not sim.alive():
        sim.start(names[0])
    # ... but a live node's configured seed is brought back (a node that knows
    # no live node cannot join; that is the documented assumption)
    changed = True
    while changed:
        changed = False
        for name in sim.alive():
            for s in seeds[name]:
                if not sim.nodes[s].alive:
                    sim.start(s)
                    changed = True
    settle = TIMEOUT + 2 * INTERVAL + 0.5 * len(names)
    assert sim.run_until(lambda: _converged(sim, names, since=healed), timeout=settle + 5.0), (
        f"seed {seed}: not converged; views: " + repr({n: sim.core(n).view(sim.now) for n in sim.alive()})
    )
    _check_transitions(sim)
    # accuracy: with the network whole and no loss, nobody live is reported down
    mark = len(sim.emitted)
    sim.run_for(10 * TIMEOUT)
    live = set(sim.alive())
    false_downs = [(o, e) for (_t, o, e) in sim.emitted[mark:] if isinstance(e, NodeDown) and e.node in live]
    assert not false_downs, f"seed {seed}: live nodes reported down in a quiet network: {false_downs}"


def test_same_seed_same_run() -> None:
    def run(seed):
        sim, names, _, _ = _build(seed, 4)
        sim.schedule(1.0, lambda s: s.kill("n2"))
        sim.schedule(1.5, lambda s: s.partition(["n0"]))
        sim.schedule(3.0, lambda s: s.heal())
        sim.schedule(3.5, lambda s: s.start("n2"))
        sim.drop = 0.2
        sim.run(6.0)
        return [(round(t, 9), n, e) for (t, n, e) in sim.emitted]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_kill_is_detected_within_timeout_plus_interval() -> None:
    sim, names, _, _ = _build(1, 3)
    assert sim.run_until(lambda: _converged(sim, names), timeout=5.0)
    killed_at = sim.now
    sim.kill("n1")
    assert sim.run_until(
        lambda: all(not sim.core(o).is_up("n1") for o in ("n0", "n2")), timeout=TIMEOUT + INTERVAL + 0.05
    )
    downs = sim.events(kind=NodeDown)
    assert {o for (_t, o, e) in downs if e.node == "n1"} == {"n0", "n2"}
    assert all(t - killed_at <= TIMEOUT + INTERVAL + 0.05 for (t, _o, e) in downs if e.node == "n1")


def test_fast_restart_reports_down_then_up() -> None:
    sim, names, _, _ = _build(2, 3)
    assert sim.run_until(lambda: _converged(sim, names), timeout=5.0)
    sim.restart("n2")  # back before any timeout can fire
    assert sim.run_until(lambda: _converged(sim, names), timeout=2.0)
    seen = [
        (o, type(e).__name__, e.reason if isinstance(e, NodeDown) else None)
        for (_t, o, e) in sim.emitted
        if isinstance(e, (NodeUp, NodeDown)) and e.node == "n2"
    ]
    for obs in ("n0", "n1"):
        mine = [s[1:] for s in seen if s[0] == obs]
        assert mine == [("NodeUp", None), ("NodeDown", "restarted"), ("NodeUp", None)]


def test_graceful_leave_is_immediate_and_late_heartbeats_ignored() -> None:
    core = Membership("a", 1, [], interval=INTERVAL, timeout=TIMEOUT)
    core.start(0.0)
    assert core.receive(0.1, "b", Heartbeat(5)) == [Emit(KnownPeers(("b",))), Emit(NodeUp("b", 5))]
    assert core.receive(0.2, "b", Leave(5)) == [Emit(NodeDown("b", 5, "left"))]
    assert core.receive(0.3, "b", Heartbeat(5)) == []  # in flight before the Leave
    assert not core.is_up("b")
    assert core.receive(0.4, "b", Heartbeat(6)) == [Emit(NodeUp("b", 6))]  # a new life


def test_stale_incarnation_is_ignored_and_gossip_introduces() -> None:
    core = Membership("a", 1, [], interval=INTERVAL, timeout=TIMEOUT)
    first = core.receive(0.0, "b", Heartbeat(3, (("c", 9),)))
    assert Emit(KnownPeers(("b", "c"))) in first
    assert core.receive(0.1, "b", Heartbeat(2)) == []
    assert "c" in core.peers and not core.is_up("c")
    round_ = core.timer(0.2, "membership.tick")
    assert {a.dst for a in round_ if isinstance(a, Send)} == {"b", "c"}
    assert SetTimer("membership.tick", INTERVAL) in round_


def test_bad_parameters_and_messages_are_refused() -> None:
    with pytest.raises(ValueError, match="interval < timeout"):
        Membership("a", 1, interval=1.0, timeout=0.5)
    core = Membership("a", 1)
    with pytest.raises(TypeError, match="unexpected message from 'b'"):
        core.receive(0.0, "b", "hello")


def test_refused_deliveries_mark_a_peer_down_at_once_but_a_heartbeat_clears_one():
    core = Membership("a", 1, [], interval=INTERVAL, timeout=TIMEOUT)
    core.start(0.0)
    core.receive(0.1, "b", Heartbeat(5))
    assert core.unreachable(0.2, "b") == [Send("b", Heartbeat(1, (("b", 5),)))]  # a probe, not yet down
    assert core.receive(0.21, "b", Heartbeat(5)) == [] and core.is_up("b")  # it answered: the refusal was stale
    assert core.unreachable(0.3, "b")[0].dst == "b" and core.is_up("b")
    # refused twice: gone, but not before `timeout` since it was last heard (0.21): a reset
    # partition refuses connections too, and the peer steps down only after pause_after
    assert core.unreachable(0.31, "b") == [] and core.is_up("b")
    assert not any(isinstance(a, Emit) for a in core.timer(0.21 + TIMEOUT - 0.01, "membership.tick"))
    assert Emit(NodeDown("b", 5, "unreachable")) in core.timer(0.21 + TIMEOUT, "membership.tick")
    assert not core.is_up("b")
    assert core.unreachable(0.4, "b") == [] and core.unreachable(0.4, "nobody") == []
    assert core.receive(0.5, "b", Heartbeat(6)) == [Emit(NodeUp("b", 6))]  # restarted
    assert core.unreachable(0.6, "b")[0].dst == "b" and core.is_up("b")  # the count starts again
    # refused twice long after it was last heard: down at once
    assert core.unreachable(0.5 + TIMEOUT, "b") == [Emit(NodeDown("b", 6, "unreachable"))]


def test_an_observer_that_paused_does_not_blame_its_peer_but_still_notices_a_silent_one():
    """Accuracy under a pause of the observer itself: heartbeats that arrived
    while it did not tick are in its inbox, not missing.  Completeness: once
    it ticks on time again, a peer that really went silent is reported down."""
    from mirrorq.node.membership import TICK, Heartbeat, Membership, NodeDown
    from mirrorq.sansio import Emit

    def downs(actions):
        return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, NodeDown)]

    a = Membership("a", 1, ("b",), interval=0.2, timeout=1.5)
    a.start(0.0)
    a.receive(0.1, "b", Heartbeat(7))
    assert a.is_up("b")
    assert not downs(a.timer(0.2, TICK) + a.timer(0.4, TICK))
    # a long turn of a's own: its next tick comes 2.6 s late
    assert not downs(a.timer(3.0, TICK)), "a blamed b for a's own pause"
    a.receive(3.0, "b", Heartbeat(7))  # b's heartbeat was waiting behind the pause
    # b now really falls silent; a ticks on time: down after timeout / interval ticks
    t, out = 3.0, []
    for _ in range(20):
        t += 0.2
        out = downs(a.timer(t, TICK))
        if out:
            break
    assert [d.node for d in out] == ["b"] and 3.0 + 1.5 < t <= 3.0 + 1.5 + 2 * 0.2


# ---- minority (pause_minority) ----------------------------------------------------------
def _quorum_cluster(seed: int, n: int):
    from mirrorq.node.membership import Membership

    sim = Simulator(seed, min_delay=0.0005, max_delay=0.02)
    names = [f"n{i}" for i in range(n)]

    def make(name: str, disk: dict):
        disk["incarnation"] = disk.get("incarnation", 0) + 1
        return Membership(
            name,
            disk["incarnation"],
            [x for x in names if x != name],
            interval=INTERVAL,
            timeout=TIMEOUT,
            cluster=names,
        )

    for name in names:
        sim.add_node(name, make)
    return sim, names


def _quorum_events(sim, kind):
    return [(t, o, e) for (t, o, e) in sim.emitted if isinstance(e, kind)]


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"seed={s}")
def test_the_cut_side_counts_itself_a_minority_before_the_majority_reports_it_down(seed: int) -> None:
    from mirrorq.node.membership import QuorumLost, QuorumRegained

    sim, names = _quorum_cluster(seed, 5)
    assert sim.run_until(lambda: all(len(sim.core(n).up_nodes()) == 5 for n in names), timeout=3.0)
    assert not any(sim.core(n).in_minority for n in names)
    start = len(sim.emitted)
    cut_at = sim.now
    sim.partition(["n0", "n1"], ["n2", "n3", "n4"])
    assert sim.run_until(lambda: sim.core("n0").in_minority and sim.core("n1").in_minority, timeout=TIMEOUT)
    sim.run_for(30.0)  # a long cut: the sides' views stay put
    new = sim.emitted[start:]
    lost = [(t, o, e) for (t, o, e) in new if isinstance(e, QuorumLost)]
    assert sorted(o for _t, o, _e in lost) == ["n0", "n1"], "only the two-node side is a minority, once each"
    for t, o, e in lost:
        assert t - cut_at <= sim.core(o).pause_after + INTERVAL + 0.05
        assert set(e.sees) == {"n0", "n1"} and e.cluster == tuple(names)
    downs = [t for (t, o, e) in new if isinstance(e, NodeDown) and o in ("n2", "n3", "n4") and e.node in ("n0", "n1")]
    assert len(downs) == 6
    assert max(t for t, _o, _e in lost) < min(downs), "a majority node reported the cut side down before it paused"
    healed_at = sim.now
    sim.heal()
    assert sim.run_until(lambda: not any(sim.core(n).in_minority for n in names), timeout=1.0)
    regained = [(t, o) for (t, o, e) in sim.emitted[start:] if isinstance(e, QuorumRegained)]
    assert sorted(o for _t, o in regained) == ["n0", "n1"] and all(t >= healed_at for t, _o in regained)


def test_a_node_starts_in_a_minority_and_small_clusters_never_pause() -> None:
    from mirrorq.node.membership import TICK, Membership, QuorumLost, QuorumRegained

    a = Membership("a", 1, ("b", "c"), interval=INTERVAL, timeout=TIMEOUT, cluster=("a", "b", "c"))
    assert a.in_minority and Emit(QuorumLost(("a",), ("a", "b", "c"))) in a.start(0.0)
    assert Emit(QuorumRegained(("a", "b"), ("a", "b", "c"))) in a.receive(0.1, "b", Heartbeat(4))
    assert not a.in_minority
    assert not any(
        isinstance(x, Emit)
        for x in a.receive(0.15, "c", Heartbeat(2))
        if isinstance(x.event, (QuorumLost, QuorumRegained))
    )
    # b and c fall silent: a minority once pause_after passed in time and in ticks
    t, acts = 0.15, []
    while not a.in_minority:
        t += INTERVAL
        acts = a.timer(t, TICK)
    assert t - 0.15 > a.pause_after and t - 0.15 <= a.pause_after + 2 * INTERVAL
    assert Emit(QuorumLost(("a",), ("a", "b", "c"))) in acts
    two = Membership("a", 1, ("b",), interval=INTERVAL, timeout=TIMEOUT, cluster=("a", "b"))
    assert not two.in_minority and not any(
        isinstance(x, Emit) and isinstance(x.event, QuorumLost) for x in two.start(0.0)
    )
    for k in range(1, 40):
        assert not any(isinstance(x, Emit) and isinstance(x.event, QuorumLost) for x in two.timer(k * INTERVAL, TICK))
    # learning a third voter makes the rule apply
    assert a.set_cluster(t, ("a", "b")) == [Emit(QuorumRegained(("a",), ("a", "b")))]
    with pytest.raises(ValueError, match="pause_after"):
        Membership("a", 1, interval=0.2, timeout=1.5, pause_after=1.5)


def test_a_paused_observer_does_not_count_itself_alone() -> None:
    from mirrorq.node.membership import TICK, Membership, QuorumLost

    a = Membership("a", 1, ("b", "c"), interval=INTERVAL, timeout=TIMEOUT, cluster=("a", "b", "c"))
    a.start(0.0)
    a.receive(0.1, "b", Heartbeat(4))
    a.receive(0.1, "c", Heartbeat(2))
    a.timer(0.2, TICK)
    # a's own next tick comes 5 s late (its process was stalled): not a minority
    assert not any(isinstance(x, Emit) and isinstance(x.event, QuorumLost) for x in a.timer(5.2, TICK))
    assert not a.in_minority
