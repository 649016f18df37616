"""Dead-lettering under the simulator: a mirrored source queue whose master
is killed while a consumer rejects every message.

Nodes: the source queue's replicas (``q0``... with ``x-dead-letter-exchange``),
a publisher (confirms), a consumer that rejects (requeue=false) what it gets,
the node's dead-letter router (:class:`~mirrorq.amqp.dead_letter.DeadLetterRouter`,
``fe``: the dead-letter exchange is a fanout bound to one target queue) and
the target queue (one replica, never killed).  Sometimes the router is
killed and restarted empty too (a front end's process dying).  Links drop
nothing but reorder when ``fifo`` is off (Thespian under backpressure).

Checkers, one per guarantee:

* nothing lost: every confirmed publish ends in the target queue;
* nothing doubled: no body is in the target queue twice;
* the source ends empty: nothing is left waiting for the router
  (``dead_letter_count`` 0 on every live replica);
* every dead-lettered message carries the x-death entry of its reason.

Replay a seed: ``pytest 'tests/test_dead_letter_sim.py::test_dead_letters_survive_failover[seed=7]'``.
"""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest
from pamqp import header as H
from queue_sim_support import QueueRegistry, build

from mirrorq.amqp.dead_letter import DeadLetterRouter
from mirrorq.amqp.topology import Topology
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.classic.coordinator import DEAD_LETTER_RETRY
from mirrorq.classic.replica import QueueReplica, QueueSpec
from mirrorq.gm.view import View
from mirrorq.queues import channel as chmod
from mirrorq.queues import messages as qm
from mirrorq.sansio import Emit, Send, SetTimer

SEEDS = 500
TARGET = "n/dead:1/t0"  # a replica's member name: node/host:port/uid


class RouterNode:
    """``key``: the router's channel key -- a fresh one per process, as
    FrontEnd draws one (a channel id is never used twice)."""

    def __init__(self, name: str, key: int) -> None:
        topo = Topology()
        topo.put(
            "exchange",
            {
                "vhost": "/",
                "name": "dlx",
                "type": "fanout",
                "durable": True,
                "auto_delete": False,
                "internal": False,
                "arguments": {},
            },
        )
        topo.put(
            "amqqueue",
            {
                "vhost": "/",
                "name": "dead",
                "pid": TARGET,
                "durable": False,
                "auto_delete": False,
                "exclusive_owner": None,
                "arguments": {},
            },
        )
        topo.put(
            "binding",
            {
                "vhost": "/",
                "source": "dlx",
                "destination_kind": "queue",
                "destination": "dead",
                "routing_key": "",
                "arguments_key": "",
                "arguments": {},
            },
        )
        self.router = DeadLetterRouter(topo, name, key=key)

    def start(self, now: float) -> list:
        return []

    def receive(self, now: float, src: str, msg: Any) -> list:
        if isinstance(msg, qm.DeadLetter):
            return self.router.dead_letter(now, msg)
        return self.router.receive(now, src, msg)

    def timer(self, now: float, key: Any) -> list:
        return []


class TargetNode:
    """The dead-letter target: a one-replica queue (its own view)."""

    def __init__(self, name: str) -> None:
        self.replica = QueueReplica(
            name,
            name,
            QueueSpec("dead", durable=False),
            BackingQueue(None, durable=False),
            master=name,
            gm_options={"flush_interval": None, "tick_interval": 0.2, "ack_delay": 0.02},
        )
        self.replica.defer_flush = True

    def start(self, now: float) -> list:
        return self.replica.start(now) + self.replica.install_view(now, View(1, (self.replica.member,)))

    def receive(self, now: float, src: str, msg: Any) -> list:
        return self.replica.receive(now, src, msg)

    def timer(self, now: float, key: Any) -> list:
        return self.replica.timer(now, key)

    def end_turn(self, now: float) -> list:
        return self.replica.end_turn(now)

    def persist(self, now: float) -> None:
        self.replica.persist(now)


class RejectingConsumer:
    def __init__(self, name: str, master: str, rng: random.Random) -> None:
        self.ch = chmod.QueueChannel((name, 1), "q", master, master)
        self.rng = rng
        self.rejected: list[bytes] = []
        self.pending: list = []
        self._armed = False

    def start(self, now: float) -> list:
        from queue_sim_support import REGISTRY, Watch

        return [Send(REGISTRY, Watch())] + self.ch.consume(now, "c1", prefetch=10)

    def receive(self, now: float, src: str, msg: Any) -> list:
        out = []
        for a in self.ch.receive(now, src, msg):
            if isinstance(a, Emit) and isinstance(a.event, chmod.Delivery):
                self.pending.append(a.event)
                if not self._armed:
                    self._armed = True
                    out.append(SetTimer("reject", self.rng.uniform(0.0, 0.01)))
            elif isinstance(a, Emit) and isinstance(a.event, chmod.Cancelled):
                out += self.ch.consume(now, "c-again", prefetch=10)
            elif not isinstance(a, Emit):
                out.append(a)
        return out

    def timer(self, now: float, key: Any) -> list:
        self._armed = False
        out: list = []
        by_epoch: dict[str, list[int]] = {}
        for d in self.pending:
            by_epoch.setdefault(d.epoch, []).append(d.offset)
            self.rejected.append(d.body)
        self.pending = []
        for epoch, offsets in by_epoch.items():
            out += self.ch.settle(now, epoch, discard=offsets)
        return out

    def end_turn(self, now: float) -> list:
        return self.ch.flush(now)


def _reason(props: dict) -> str:
    ch = H.ContentHeader()
    ch.unmarshal(props["_h"])
    (death, *_) = ch.properties.headers["x-death"]
    return death["reason"]


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed={s}")
def test_dead_letters_survive_failover(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3, 3])
    total = rng.choice([60, 120])
    sim, names = build(
        seed,
        replicas=replicas,
        total=0,
        fifo=rng.random() < 0.5,
        arguments={"x-dead-letter-exchange": "dlx"},
        consumer=False,
    )
    for n in names:
        sim.core(n).replica.dead_letter_dst = "fe"
    # the publisher and rejecting consumer of this test, the router and the target
    from queue_sim_support import PublisherNode

    sim.add_node("pub2", lambda n, d: PublisherNode(n, names[0], total, rng))
    sim.add_node("rej", lambda n, d: RejectingConsumer(n, names[0], rng))
    sim.add_node("fe", lambda n, d: RouterNode(n, rng.getrandbits(32) | 1))
    sim.add_node(TARGET, lambda n, d: TargetNode(n))

    t1 = rng.uniform(0.05, 0.4)

    def kill_master(s):
        if "q0" in s.alive():
            s.kill("q0")
            for n in names[1:]:
                s.schedule(
                    s.now + rng.uniform(0.005, 0.05),
                    lambda s2, n=n: n in s2.alive() and s2.call(n, "member_down", "q0"),
                )

    sim.schedule(t1, kill_master)
    if rng.random() < 0.4:

        def bounce_router(s):
            s.kill("fe")
            s.schedule(s.now + rng.uniform(0.01, 0.2), lambda s2: s2.restart("fe"))

        sim.schedule(rng.uniform(0.02, 0.6), bounce_router)

    pub = sim.core("pub2")
    target = sim.core(TARGET).replica

    def quiet():
        alive = [sim.core(n).replica for n in names if n in sim.alive()]
        return (
            pub.done()
            and "fe" in sim.alive()
            and all(r.bq.message_count == 0 and r.bq.dead_letter_count == 0 for r in alive)
            and target.bq.message_count >= len(pub.confirmed)
        )

    reg: QueueRegistry = sim.core("registry")
    assert sim.run_until(quiet, timeout=120), (
        f"not quiet: confirmed {len(pub.confirmed)}/{total}, target holds {target.bq.message_count}, "
        f"masters={reg.master_history} replicas={[sim.core(n).replica.info() for n in names if n in sim.alive()]}"
    )
    # every resend still due (a master's retry, a channel's resend) happens within one retry period
    sim.run_for(DEAD_LETTER_RETRY + 1.0)
    msgs = [target.bq.get(o) for o in target.bq.ready_offsets()]
    bodies = collections.Counter(m.body for m in msgs)
    want = {f"m{s}".encode() for s in pub.confirmed}
    assert want <= set(bodies), f"lost: {sorted(want - set(bodies))[:10]}"
    assert max(bodies.values()) == 1, f"doubled: {[b for b, k in bodies.items() if k > 1][:10]}"
    assert all(_reason(m.properties) == "rejected" for m in msgs)
    DUPLICATES[seed] = target.stats["dead_letter_duplicates"]


DUPLICATES: dict[int, int] = {}


def _refusing_run(sim, names: list, total: int, rng: random.Random) -> None:
    """What both reject-publish-dlx runs add to a built queue: its masters
    dead-letter to the router ``fe``, a publisher ``pub2`` of ``total``
    messages, the target queue, a kill of the master ``q0`` (the others hear
    of it 5-50 ms later), and in 30% of the seeds a restart of the router."""
    from queue_sim_support import PublisherNode

    for n in names:
        sim.core(n).replica.dead_letter_dst = "fe"
    sim.add_node("pub2", lambda n, d: PublisherNode(n, names[0], total, rng))
    sim.add_node("fe", lambda n, d: RouterNode(n, rng.getrandbits(32) | 1))
    sim.add_node(TARGET, lambda n, d: TargetNode(n))

    def kill_master(s):
        if "q0" in s.alive():
            s.kill("q0")
            for n in names[1:]:
                s.schedule(
                    s.now + rng.uniform(0.005, 0.05),
                    lambda s2, n=n: n in s2.alive() and s2.call(n, "member_down", "q0"),
                )

    sim.schedule(rng.uniform(0.02, 0.3), kill_master)
    if rng.random() < 0.3:

        def bounce_router(s):
            s.kill("fe")
            s.schedule(s.now + rng.uniform(0.01, 0.2), lambda s2: s2.restart("fe"))

        sim.schedule(rng.uniform(0.02, 0.5), bounce_router)


@pytest.mark.parametrize("seed", range(150), ids=lambda s: f"seed={s}")
def test_refused_publishes_are_dead_lettered_once_across_failover(seed):
    """``x-overflow=reject-publish-dlx`` on a queue that takes nothing
    (``x-max-length`` 0): every publish is refused and dead-lettered
    (reason ``maxlen``) while the master is killed (and sometimes the
    router restarted).  Each publish ends in the target exactly once: a
    nack leaves only once the refused message's dead-letter records are
    replicated, and a publish whose refusal the new master never heard of
    is refused and dead-lettered again by it.  A publish resent after the
    failover whose refusal the new master did hear of is nacked again and
    not dead-lettered a second time: no publish is ever acked (no queue
    holds any), every one is nacked."""
    rng = random.Random(seed)
    replicas = rng.choice([2, 3, 3])
    total = rng.choice([40, 80])
    sim, names = build(
        seed,
        replicas=replicas,
        total=0,
        fifo=rng.random() < 0.5,
        consumer=False,
        arguments={"x-dead-letter-exchange": "dlx", "x-max-length": 0, "x-overflow": "reject-publish-dlx"},
    )
    _refusing_run(sim, names, total, rng)

    pub = sim.core("pub2")
    target = sim.core(TARGET).replica

    def quiet():
        alive = [sim.core(n).replica for n in names if n in sim.alive()]
        return (
            pub.done()
            and "fe" in sim.alive()
            and all(r.bq.message_count == 0 and r.bq.dead_letter_count == 0 for r in alive)
            and target.bq.message_count >= total
        )

    assert sim.run_until(quiet, timeout=120), (
        f"not quiet: nacked {len(pub.nacked)} confirmed {len(pub.confirmed)} of {total}, target holds "
        f"{target.bq.message_count}, replicas={[sim.core(n).replica.info() for n in names if n in sim.alive()]}"
    )
    sim.run_for(DEAD_LETTER_RETRY + 1.0)
    assert not pub.confirmed, f"acked, though no queue holds them: {sorted(pub.confirmed)[:10]}"
    assert pub.nacked == set(range(1, total + 1))
    msgs = [target.bq.get(o) for o in target.bq.ready_offsets()]
    bodies = collections.Counter(m.body for m in msgs)
    assert set(bodies) == {f"m{s}".encode() for s in range(1, total + 1)}, "a refused publish was lost"
    assert max(bodies.values()) == 1, f"doubled: {[b for b, k in bodies.items() if k > 1][:10]}"
    assert all(_reason(m.properties) == "maxlen" for m in msgs)


def test_the_seeds_exercise_resends():
    """Some seeds must make the target see a dead-lettered message twice (a
    master's resend after a failover or a router restart) and drop it: else
    the de-duplication above was never tested."""
    for seed in range(40):
        if seed not in DUPLICATES:
            test_dead_letters_survive_failover(seed)
    assert sum(1 for s in range(40) if DUPLICATES[s] > 0) >= 3, DUPLICATES


@pytest.mark.parametrize("seed", range(150), ids=lambda s: f"seed={s}")
def test_refused_and_accepted_publishes_across_failover(seed):
    """``x-overflow=reject-publish-dlx`` with a small ``x-max-length`` and a
    consumer draining the queue: one publisher's publishes are accepted and
    refused by turns while the master is killed (and sometimes the router
    restarted).  An acked publish was consumed (or is still held) and never
    dead-lettered; a nacked one is in the target exactly once (reason
    ``maxlen``) -- a resend of a refused publish to the new master is nacked
    again without a second dead-lettering -- and was consumed only from a
    master that died with it (it delivered it before its mirrors held it;
    the resend was refused)."""
    rng = random.Random(seed)
    replicas = rng.choice([2, 3, 3])
    total = rng.choice([60, 120])
    sim, names = build(
        seed,
        replicas=replicas,
        total=0,
        fifo=rng.random() < 0.5,
        consumer=True,
        arguments={
            "x-dead-letter-exchange": "dlx",
            "x-max-length": rng.choice([1, 2, 5]),
            "x-overflow": "reject-publish-dlx",
        },
    )
    _refusing_run(sim, names, total, rng)

    pub, con = sim.core("pub2"), sim.core("con")
    target = sim.core(TARGET).replica

    def quiet():
        alive = [sim.core(n).replica for n in names if n in sim.alive()]
        return (
            pub.done()
            and "fe" in sim.alive()
            and all(r.bq.message_count == 0 and r.bq.dead_letter_count == 0 for r in alive)
            and target.bq.message_count >= len(pub.nacked)
        )

    assert sim.run_until(quiet, timeout=120), (
        f"not quiet: nacked {len(pub.nacked)} confirmed {len(pub.confirmed)} of {total}, target holds "
        f"{target.bq.message_count}"
    )
    sim.run_for(DEAD_LETTER_RETRY + 1.0)

    def body(s):
        return f"m{s}".encode()  # PublisherNode's bodies

    assert pub.confirmed | pub.nacked == set(range(1, total + 1)) and not pub.confirmed & pub.nacked
    dead = collections.Counter(target.bq.get(o).body for o in target.bq.ready_offsets())
    consumed = {d.body for _t, d in con.received}
    assert max(dead.values(), default=1) == 1, f"doubled: {[b for b, k in dead.items() if k > 1][:10]}"
    assert {body(s) for s in pub.confirmed} <= consumed, "an acked publish was never consumed"
    assert not {body(s) for s in pub.confirmed} & set(dead), "an acked publish was dead-lettered"
    assert set(dead) == {body(s) for s in pub.nacked}, "a nacked publish was not dead-lettered (or one too many was)"
    # a master delivers what it accepted before its mirrors hold it: such a
    # publish, lost with that master, is resent to the next one, which may
    # refuse (nack and dead-letter) it.  Only that way may a nacked publish
    # have been consumed: from a master that died afterwards
    nacked = {body(s) for s in pub.nacked}
    for t, d in con.received:
        if d.body in nacked:
            assert any(n == d.epoch and tk >= t - sim.max_delay for tk, n in sim.kills), (
                f"a nacked publish was consumed: {d.body!r} from {d.epoch} at {t}, which did not die"
            )
    assert all(_reason(target.bq.get(o).properties) == "maxlen" for o in target.bq.ready_offsets())
