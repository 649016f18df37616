"""A mirrored queue under the simulator: master and mirror kills, failovers.

Every seed runs a publisher (confirms) and a consumer (prefetch, acks after a
random delay) against a queue mirrored on 2-4 replicas, kills the master
(sometimes a mirror too, sometimes the next master as well) and checks:

* every confirmed publish is delivered (never lost), nothing unexpected is;
* no publish is enqueued twice (at most one delivery with redelivered=false);
* a message whose ack was replicated is never delivered again;
* every further delivery of a message carries redelivered=true;
* per-publisher order of first deliveries (links FIFO or not);
* survivors end with identical logs; no replica saw a second master's ops;
* consumers with x-cancel-on-ha-failover are cancelled on failover.

Replay a seed: ``pytest 'tests/test_queue_sim.py::test_failover[seed=17]'``.
"""

from __future__ import annotations

import random

import pytest
from queue_sim_support import QueueRegistry, build

from mirrorq.classic.coordinator import AcksReplicated
from mirrorq.classic.replica import ReplicaStopped

SEEDS = 300


def _schedule_kills(sim, names, rng):
    """Kill the master at a random moment; maybe a mirror too; maybe the next master."""
    killed: list[str] = []

    def kill(victims):
        def fn(s):
            for v in victims:
                if v in s.alive():
                    s.kill(v)
                    killed.append(v)
            for v in victims:
                for n in names:
                    if n not in killed:
                        s.schedule(
                            s.now + rng.uniform(0.005, 0.08),
                            lambda s2, n=n, v=v: n in s2.alive() and s2.call(n, "member_down", v),
                        )

        return fn

    t1 = rng.uniform(0.02, 0.25)
    first = ["q0"]
    if len(names) >= 3 and rng.random() < 0.3:
        first.append(rng.choice(names[1:]))
    sim.schedule(t1, kill(first))
    if len(names) - len(first) >= 2 and rng.random() < 0.35:
        # the next master: the first survivor in ring order
        nxt = next(n for n in names if n not in first)
        sim.schedule(t1 + rng.uniform(0.001, 0.3), kill([nxt]))
    return killed


def _check(sim, names, total, killed, *, cancel_on_failover=False):
    pub = sim.core("pub")
    con = sim.core("con")
    reg: QueueRegistry = sim.core("registry")

    def quiet():
        if not pub.done():
            return False
        got = {d.msg_id for _, d in con.received}
        if not all(f"pub|1|{s}" in got for s in pub.confirmed):
            return False
        alive = [sim.core(n).replica for n in names if n in sim.alive()]
        return (
            all(r.bq.message_count == 0 for r in alive)
            and len({r.bq.log.next_offset for r in alive}) == 1
            and all(r.master == alive[0].master for r in alive)
            and any(r.is_master for r in alive)
        )

    assert sim.run_until(quiet, timeout=60), (
        f"not quiet: confirmed {len(pub.confirmed)}/{total} unconfirmed={list(pub.ch.unconfirmed)[:10]} "
        f"masters={reg.master_history} killed={killed} "
        f"replicas={[sim.core(n).replica.info() for n in names if n in sim.alive()]}"
    )
    assert not pub.nacked
    assert pub.confirmed == set(range(1, total + 1))

    # deliveries
    first_plain: dict[str, float] = {}
    seen: set[str] = set()
    order: list[int] = []
    for t, d in con.received:
        pubname, _, seq = d.msg_id.split("|")
        assert pubname == "pub" and 1 <= int(seq) <= total, f"unexpected message {d.msg_id}"
        if d.msg_id in seen:
            assert d.redelivered, f"{d.msg_id} delivered again without redelivered=true at {t}"
        if not d.redelivered:
            assert d.msg_id not in first_plain, f"{d.msg_id} enqueued twice (two deliveries with redelivered=false)"
            first_plain[d.msg_id] = t
            order.append(int(seq))
        seen.add(d.msg_id)
    assert order == sorted(order), "first deliveries out of publisher order"

    # acks that were replicated are final
    acked_at: dict[int, float] = {}
    for t, _node, ev in sim.emitted:
        if isinstance(ev, AcksReplicated):
            for o in ev.offsets:
                acked_at.setdefault(o, t)
    for t, d in con.received:
        if d.offset in acked_at:
            assert t <= acked_at[d.offset], (
                f"offset {d.offset} delivered at {t} after its ack was replicated at {acked_at[d.offset]}"
            )

    alive = [sim.core(n).replica for n in names if n in sim.alive()]
    for r in alive:
        assert r.stats["foreign_ops"] == 0, f"{r.member} applied ops from a second master"
    masters = [r for r in alive if r.is_master]
    assert len(masters) == 1, [r.member for r in masters]
    assert not any(isinstance(ev, ReplicaStopped) for _, n, ev in sim.emitted if n in sim.alive())
    if cancel_on_failover and len(reg.master_history) > 1:
        assert any(c.reason == "ha-failover" for _, c in con.cancelled), (
            "x-cancel-on-ha-failover consumer not cancelled"
        )


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed={s}")
def test_failover(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3, 3, 4])
    total = rng.choice([100, 200, 300])
    cancel = rng.random() < 0.2
    sim, names = build(
        seed,
        replicas=replicas,
        total=total,
        fifo=rng.random() < 0.5,  # Thespian does not keep sends in order under backpressure
        consumer_args={"x-cancel-on-ha-failover": True} if cancel else None,
        founded=seed % 2 == 1,  # odd seeds: the replicas start as a declare starts them, no master yet
    )
    killed = _schedule_kills(sim, names, rng)
    _check(sim, names, total, killed, cancel_on_failover=cancel)


@pytest.mark.parametrize("seed", range(20), ids=lambda s: f"seed={s}")
def test_no_failure_keeps_order_and_confirms_everything(seed):
    sim, names = build(seed, replicas=3, total=200)
    _check(sim, names, 200, [])
    assert sim.core("registry").master_history == ["q0"]


def test_delete_stops_every_replica():
    from queue_sim_support import Operator

    from mirrorq.classic.replica import QueueGone

    sim, names = build(1, replicas=3, total=50)
    sim.add_node("op", lambda n, d: Operator(n))
    pub = sim.core("pub")
    assert sim.run_until(lambda: pub.done(), timeout=10)
    sim.call("op", "command", "delete")
    gone = lambda: {n for _, n, ev in sim.emitted if isinstance(ev, QueueGone)}  # noqa: E731
    assert sim.run_until(lambda: gone() == {"q1", "q2"} and sim.core("op").results, timeout=5), gone()
    assert sim.core("op").results[-1][1].ok
    assert all(sim.core(n).replica.stopped for n in ("q1", "q2"))


def test_the_founding_view_elects_the_first_founder_without_a_report_round(monkeypatch):
    """A declared queue's founders (no master yet, view version 1) take the
    first founder as master at once: no report/cutoff/ready broadcasts."""
    from mirrorq.classic.payloads import encode
    from mirrorq.classic.replica import QueueReplica

    kinds: list[tuple[str, str]] = []
    broadcast = QueueReplica.broadcast

    def spy(self, now, payload):
        kinds.append((self.member, encode(payload)[0]))
        return broadcast(self, now, payload)

    monkeypatch.setattr(QueueReplica, "broadcast", spy)
    sim, names = build(3, replicas=3, total=50, founded=True)
    _check(sim, names, 50, [])
    assert sim.core("registry").master_history == ["q0"]
    assert ("q0", "promoted") in kinds
    assert not [k for k in kinds if k[1] in ("report", "cutoff", "ready", "elect")], kinds


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"seed={s}")
def test_a_founder_killed_before_the_founding_view_settles(seed):
    """The first founder dies while the founding view is being installed (it
    may or may not have promoted itself): the survivors run the promotion
    protocol and nothing confirmed is lost."""
    rng = random.Random(seed)
    sim, names = build(seed, replicas=rng.choice([2, 3, 4]), total=100, founded=True, fifo=rng.random() < 0.5)
    killed: list[str] = []

    def kill(s):
        s.kill("q0")
        killed.append("q0")
        for n in names[1:]:
            s.schedule(
                s.now + rng.uniform(0.005, 0.08), lambda s2, n=n: n in s2.alive() and s2.call(n, "member_down", "q0")
            )

    sim.schedule(rng.uniform(0.0, 0.006), kill)
    _check(sim, names, 100, killed)


def test_a_member_that_reaches_the_cutoff_through_a_non_ops_payload_says_ready():
    """The promotion's "ready" step waits until a member has delivered up to
    the cutoff; the delivery that gets it there may carry any payload (here
    the dead master's "promoted" announcement to a joiner, the case a
    simulated run found stuck for ever), and must run that step too."""
    from queue_sim_support import ReplicaNode

    from mirrorq.classic.promotion import Cutoff, Phase
    from mirrorq.gm.core import Delivered, MemberState
    from mirrorq.gm.view import View
    from mirrorq.sansio import Emit

    r = ReplicaNode("q1", None).replica
    r.start(0.0)
    r.install_view(0.0, View(1, ("q0", "q1", "q2")))  # q0 promotes itself; q1 waits for its word
    r.gm.members_state["q0"] = MemberState(3, 3)  # q0's pubs 1-3 delivered here
    r.install_view(0.1, View(2, ("q1", "q2")))  # q0 died: the promotion protocol runs
    r.promo.cut(Cutoff(2, {"q0": 4}))  # the promoter's cutoff: someone delivered q0's 4th pub
    assert r._promotion_progress(0.2) == []  # q1 does not hold it yet: no ready
    st = r.gm.members_state["q0"]
    st.last_pub = 4  # GM delivers q0's 4th pub, an announcement, not an "ops"
    out = r._delivered(0.3, Delivered("q0", 4, ["promoted", "q0", "q0-dst"]))
    readies = [
        a.event.payload
        for a in out
        if isinstance(a, Emit) and isinstance(a.event, Delivered) and a.event.payload[0] == "ready"
    ]
    assert readies == [["ready", 2]] and r.promo.phase is Phase.READY_SENT
