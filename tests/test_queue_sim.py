"""A mirrored queue under the simulator: master and mirror kills, failovers.

Every seed runs a publisher (confirms) and a consumer (prefetch, acks after a
random delay) against a queue mirrored on 2-4 replicas, kills the master
(sometimes a mirror too, sometimes the next master as well) and checks:

* every confirmed publish is delivered (never lost), nothing unexpected is;
* at-least-once, exactly (the master delivers before its mirrors hold a
  message): a further delivery of a message carries redelivered=true,
  unless every earlier delivery of it came from a master that died before
  the publish was confirmed to its publisher (so its resend was enqueued
  again), or flagged that very record redelivered (the old master's
  delivery arriving after the new master's); with ``ha-deliver-mode:
  replicated`` only the latter;
* one master never holds a publish twice (delivers it at two offsets);
* a message whose ack was replicated is never delivered again;
* per-publisher order of first deliveries, overall and per master (links
  FIFO or not);
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


def _check(sim, names, total, killed, *, cancel_on_failover=False, deliver_replicated=False):
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

    _check_deliveries(sim, con.received, pub.confirm_times, total, deliver_replicated=deliver_replicated)
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


def _check_deliveries(sim, received, confirm_times, total, *, deliver_replicated=False):
    """At-least-once, exactly: ``received`` is the consumer's ``(time,
    Delivery)`` list, ``confirm_times`` seq -> when the publisher got its
    confirm, ``sim.kills`` when each replica died.  A master delivers before
    its mirrors hold a message (coordinator: deliveries leave at once), so a
    message it delivered may die with it unconfirmed; its publisher resends
    it and the new master delivers it again, as a first delivery.  That, and
    only that, may repeat a delivery with redelivered=false; with
    ``deliver_replicated`` (``ha-deliver-mode: replicated``) nothing may."""

    # what arrived at ``t`` left its sender after ``t - sim.max_delay`` (a
    # master may die with its deliveries still on their way)
    def life(node, t):  # which life of ``node`` sent what arrived at ``t``: kills before it
        return sum(1 for tk, n in sim.kills if n == node and tk < t - sim.max_delay)

    def death(node, t):  # when the life of ``node`` that delivered at ``t`` died (None: it lives)
        return min((tk for tk, n in sim.kills if n == node and tk >= t - sim.max_delay), default=None)

    earlier: dict[str, list[tuple[float, str, int, bool]]] = {}  # msg_id -> its deliveries (time, master, offset, flag)
    offsets: dict[tuple[str, int, str], int] = {}  # (master, life, msg_id) -> the offset it delivered it at
    first_plain: list[int] = []  # seqs in order of their first redelivered=false delivery
    plain_by_master: dict[tuple[str, int], list[int]] = {}
    for t, d in received:
        pubname, _, seq_s = d.msg_id.split("|")
        seq = int(seq_s)
        assert pubname == "pub" and 1 <= seq <= total, f"unexpected message {d.msg_id}"
        key = (d.epoch, life(d.epoch, t), d.msg_id)
        assert offsets.setdefault(key, d.offset) == d.offset, (
            f"{d.msg_id} enqueued twice by master {d.epoch}: delivered at offsets {offsets[key]} and {d.offset}"
        )
        before = earlier.setdefault(d.msg_id, [])
        if not d.redelivered:
            if not before:
                first_plain.append(seq)
            for t0, m0, o0, r0 in before:
                assert (m0, life(m0, t0)) != (d.epoch, life(d.epoch, t)), (
                    f"{d.msg_id} delivered again at {t} without redelivered=true by {m0}, which delivered it at {t0}"
                )
                if r0 and o0 == d.offset:
                    # the next master flagged that record redelivered (it may have been
                    # delivered): this is the old master's delivery of it, arriving after
                    continue
                died = death(m0, t0)
                assert not deliver_replicated, (
                    f"{d.msg_id} delivered again at {t} without redelivered=true (ha-deliver-mode replicated; "
                    f"first by {m0} at {t0})"
                )
                assert died is not None and died <= t, (
                    f"{d.msg_id} delivered again at {t} without redelivered=true while {m0}, "
                    f"which delivered it at {t0}, still served"
                )
                assert confirm_times.get(seq, float("inf")) > died, (
                    f"{d.msg_id} delivered again at {t} without redelivered=true although it was confirmed at "
                    f"{confirm_times[seq]}, before {m0} (which delivered it at {t0}) died at {died}"
                )
            plain_by_master.setdefault((d.epoch, life(d.epoch, t)), []).append(seq)
        before.append((t, d.epoch, d.offset, d.redelivered))
    assert first_plain == sorted(first_plain), "first deliveries out of publisher order"
    for m, seqs in plain_by_master.items():
        assert seqs == sorted(seqs), f"master {m[0]} delivered out of publisher order"

    # acks that were replicated are final: the message is never delivered again
    by_offset = {(d.epoch, d.offset): d.msg_id for _, d in received}
    acked_at: dict[str, float] = {}
    for t, node, ev in sim.emitted:
        if isinstance(ev, AcksReplicated):
            for o in ev.offsets:
                if (node, o) in by_offset:
                    acked_at.setdefault(by_offset[(node, o)], t)
    for t, d in received:
        if d.msg_id in acked_at:
            assert t <= acked_at[d.msg_id], (
                f"{d.msg_id} delivered at {t} after its ack was replicated at {acked_at[d.msg_id]}"
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


@pytest.mark.parametrize("seed", range(SEEDS // 3), ids=lambda s: f"seed={s}")
def test_failover_deliver_replicated(seed):
    """``ha-deliver-mode: replicated``: a message is delivered only once every
    member holds it, so no failover repeats a first delivery."""
    rng = random.Random(seed)
    replicas = rng.choice([2, 3, 3, 4])
    total = rng.choice([100, 200, 300])
    sim, names = build(
        seed,
        replicas=replicas,
        total=total,
        fifo=rng.random() < 0.5,
        founded=seed % 2 == 1,
        policy={"ha-mode": "all", "ha-deliver-mode": "replicated"},
    )
    killed = _schedule_kills(sim, names, rng)
    _check(sim, names, total, killed, deliver_replicated=True)


def test_early_delivery_repeats_first_deliveries_after_a_failover():
    """The default (deliveries leave at once) does repeat first deliveries
    after master kills over the suite's seeds -- what the checker's
    at-least-once rule allows -- so the failover seeds exercise that rule."""
    repeated = 0
    for seed in range(0, SEEDS, 10):
        rng = random.Random(seed)
        replicas = rng.choice([2, 3, 3, 4])
        total = rng.choice([100, 200, 300])
        sim, names = build(seed, replicas=replicas, total=total, fifo=rng.random() < 0.5, founded=seed % 2 == 1)
        killed = _schedule_kills(sim, names, rng)
        _check(sim, names, total, killed)
        plain = [d.msg_id for _, d in sim.core("con").received if not d.redelivered]
        repeated += len(plain) - len(set(plain))
    assert repeated > 0


def test_the_checker_fails_a_master_that_delivers_a_message_twice_without_a_failover(monkeypatch):
    """Control: a broken master that enqueues a publish again once it was
    acked (so it is delivered twice, both times as a first delivery, by a
    master that lives) fails the check."""
    from mirrorq.classic import amqqueue as aq
    from mirrorq.classic.coordinator import Coordinator

    publish = Coordinator._publish
    state = {"held": False, "again": False}

    def broken(self, now, msg):
        out = publish(self, now, msg)
        if self.r.bq.holds("pub|1|7"):
            state["held"] = True
        elif state["held"] and not state["again"]:
            state["again"] = True  # 7 was acked: take it again, as a new message
            out += self._events(
                now, self.queue.publish_many(now, [aq.Publish(msg.publisher, 7, "pub|1|7", b"m7", {}, True)])
            )
        return out

    monkeypatch.setattr(Coordinator, "_publish", broken)
    sim, names = build(5, replicas=3, total=100)
    with pytest.raises(
        AssertionError, match=r"pub\|1\|7 (enqueued twice by master q0|delivered again .* still served)"
    ):
        _check(sim, names, 100, [])
    assert state["again"] and sim.kills == []


def test_the_at_least_once_rule_by_itself():
    """The rule on repeated first deliveries, on hand-made histories: allowed
    only after the delivering master died with the publish unconfirmed."""
    from types import SimpleNamespace

    from mirrorq.queues.channel import Delivery

    def d(epoch, offset, redelivered=False):
        return Delivery("c1", epoch, offset, "pub|1|7", b"m7", {}, redelivered)

    def check(kills, received, confirmed_at, **kw):
        sim = SimpleNamespace(kills=kills, max_delay=0.004, emitted=[])
        _check_deliveries(sim, received, {7: confirmed_at}, 10, **kw)

    check([(0.15, "q0")], [(0.1, d("q0", 7)), (0.3, d("q1", 9))], 0.4)  # lost with q0, resent, enqueued again
    check([(0.15, "q0")], [(0.1, d("q0", 7)), (0.3, d("q1", 7, True))], 0.12)  # held by q1: redelivered
    check([], [(0.1, d("q1", 7, True)), (0.12, d("q0", 7))], 0.05)  # q0's delivery of what q1 flagged, late
    with pytest.raises(AssertionError, match="still served"):
        check([], [(0.1, d("q0", 7)), (0.3, d("q1", 9))], 0.4)
    with pytest.raises(AssertionError, match="by q0, which delivered it"):
        check([(0.5, "q0")], [(0.1, d("q0", 7)), (0.3, d("q0", 7))], 0.6)
    with pytest.raises(AssertionError, match="although it was confirmed"):
        check([(0.15, "q0")], [(0.1, d("q0", 7)), (0.3, d("q1", 9))], 0.12)
    with pytest.raises(AssertionError, match="ha-deliver-mode replicated"):
        check([(0.15, "q0")], [(0.1, d("q0", 7)), (0.3, d("q1", 9))], 0.4, deliver_replicated=True)


def test_the_checker_fails_a_new_master_that_does_not_flag_redeliveries(monkeypatch):
    """Control: a broken new master that does not mark what its predecessor
    may have delivered (``suspect_below``) delivers confirmed messages again
    as first deliveries; the check fails on failover seeds."""
    from mirrorq.classic.coordinator import Coordinator

    promote = Coordinator.promote

    def broken(self, now):
        out = promote(self, now)
        self.suspect_below = 0
        return out

    monkeypatch.setattr(Coordinator, "promote", broken)
    caught = []
    for seed in range(0, SEEDS, 10):
        rng = random.Random(seed)
        replicas = rng.choice([2, 3, 3, 4])
        total = rng.choice([100, 200, 300])
        sim, names = build(seed, replicas=replicas, total=total, fifo=rng.random() < 0.5, founded=seed % 2 == 1)
        killed = _schedule_kills(sim, names, rng)
        try:
            _check(sim, names, total, killed)
        except AssertionError as e:
            assert "without redelivered=true although it was confirmed" in str(e), e
            caught.append(seed)
    assert len(caught) >= 5, caught  # 8 of these 30 seeds


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
