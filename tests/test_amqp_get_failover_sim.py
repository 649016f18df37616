"""basic.get across a master failover, in the simulator (issue #7 gap 5).

A getter issues gets one at a time (as a blocking client does) through a
:class:`~mirrorq.queues.channel.QueueChannel` while a publisher fills
a mirrored queue and the master is killed at a random moment.  Checks:

* every get gets exactly one answer (none is lost with the dead master, none
  is answered twice to the client);
* with acknowledged gets, every confirmed message is obtained at least once
  (a late answer of the old master may repeat one, redelivered);
* the survivors end empty: a duplicate answer's message was given back.

Replay a seed: ``pytest 'tests/test_amqp_get_failover_sim.py::test_get_survives_failover[seed=3]'``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from gm_registry_oracle import REGISTRY
from queue_sim_support import QUEUE, PublisherNode, QueueRegistry, ReplicaNode, Watch

from mirrorq.queues import channel as chmod
from mirrorq.sansio import Emit, Send, SetTimer
from mirrorq.simulator import Simulator


class GetterNode:
    def __init__(self, name: str, master: str, rng: random.Random, no_ack: bool) -> None:
        self.ch = chmod.QueueChannel((name, 1), QUEUE, master, master)
        self.rng = rng
        self.no_ack = no_ack
        self.issued: list[int] = []
        self.answers: dict[int, int] = {}
        self.got: list[chmod.Delivery] = []
        self.outstanding: int | None = None

    def start(self, now: float) -> list:
        return [Send(REGISTRY, Watch()), SetTimer("get", 0.001)]

    def timer(self, now: float, key: Any) -> list:
        if self.outstanding is not None:
            return []
        rid, acts = self.ch.get(now, self.no_ack)
        self.issued.append(rid)
        self.outstanding = rid
        return acts

    def receive(self, now: float, src: str, msg: Any) -> list:
        out = []
        for a in self.ch.receive(now, src, msg):
            if isinstance(a, Emit) and isinstance(a.event, chmod.GetResult):
                ev = a.event
                self.answers[ev.request_id] = self.answers.get(ev.request_id, 0) + 1
                if ev.request_id == self.outstanding:
                    self.outstanding = None
                if ev.delivery is not None:
                    self.got.append(ev.delivery)
                    if not self.no_ack:
                        out += self.ch.settle(now, ev.delivery.epoch, ack=[ev.delivery.offset])
                out.append(SetTimer("get", self.rng.uniform(0.0005, 0.004)))
            elif not isinstance(a, Emit):
                out.append(a)
        return out

    def end_turn(self, now: float) -> list:
        return self.ch.flush(now)


def build(seed: int, replicas: int, total: int, no_ack: bool, fifo: bool) -> tuple[Simulator, tuple]:
    sim = Simulator(seed, min_delay=0.0005, max_delay=0.004, fifo=fifo)
    names = tuple(f"q{i}" for i in range(replicas))
    rng = random.Random(seed * 31 + 7)
    sim.add_node(REGISTRY, lambda n, d: QueueRegistry(names, "q0"))
    for nm in names:
        sim.add_node(nm, lambda n, d: ReplicaNode(n, "q0"))
    sim.add_node("pub", lambda n, d: PublisherNode(n, "q0", total, rng))
    sim.add_node("get", lambda n, d: GetterNode(n, "q0", rng, no_ack))
    return sim, names


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"seed={s}")
def test_get_survives_failover(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3])
    total = 60
    no_ack = seed % 4 == 3
    sim, names = build(seed, replicas, total, no_ack, fifo=rng.random() < 0.5)
    t_kill = rng.uniform(0.01, 0.15)

    def kill(s):
        s.kill("q0")
        for n in names[1:]:
            s.schedule(s.now + rng.uniform(0.005, 0.05), lambda s2, n=n: s2.call(n, "member_down", "q0"))

    sim.schedule(t_kill, kill)
    pub, getter = sim.core("pub"), sim.core("get")

    def quiet():
        if not pub.done() or getter.outstanding is not None:
            return False
        alive = [sim.core(n).replica for n in names if n in sim.alive()]
        masters = [r for r in alive if r.is_master]
        return len(masters) == 1 and masters[0].bq.ready_count == 0 and masters[0].bq.unacked_count == 0

    ok = sim.run_until(quiet, timeout=30)
    assert ok, (
        f"not quiet: outstanding get {getter.outstanding} pending={list(getter.ch.pending_gets)} "
        f"confirmed={len(pub.confirmed)}/{total} got={len(getter.got)} master={getter.ch.master}"
    )
    assert set(getter.answers) == set(getter.issued)
    assert all(n == 1 for n in getter.answers.values()), {r: n for r, n in getter.answers.items() if n != 1}
    assert pub.confirmed == set(range(1, total + 1))
    got_ids = [d.msg_id for d in getter.got]
    if not no_ack:
        missing = {f"pub|1|{s}" for s in pub.confirmed} - set(got_ids)
        assert not missing, f"confirmed messages never obtained by a get: {sorted(missing)[:10]}"
    for i, mid in enumerate(got_ids):
        if mid in got_ids[:i]:
            later = [d for d in getter.got if d.msg_id == mid][1:]
            assert all(d.redelivered for d in later), f"{mid} obtained again without redelivered=true"
