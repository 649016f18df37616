"""When a classic mirrored queue's master hands a message to a consumer
(mirrorq.classic.coordinator): at once by default, before its mirrors hold
it; with ``ha-deliver-mode: replicated`` only once they do; and either way
a channel's deliveries never overtake a held reply to that channel (a
basic.get answer waits for replication)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from queue_sim_support import QUEUE, REGISTRY, Watch, build

from mirrorq.classic import coordinator as co
from mirrorq.queues import channel as chmod
from mirrorq.queues.messages import Deliveries
from mirrorq.sansio import Emit, Send, SetTimer


def _spy_sends(monkeypatch) -> list[tuple[int, int]]:
    """(highest offset of a consumer Deliveries, replicated_offset) as each leaves the master."""
    seen: list[tuple[int, int]] = []
    numbered = co.Coordinator._numbered

    def spy(self, m):
        out = numbered(self, m)
        if isinstance(out, Deliveries) and out.request_id is None:
            seen.append((max(it[1] for it in out.items), self.replicated_offset))
        return out

    monkeypatch.setattr(co.Coordinator, "_numbered", spy)
    return seen


@pytest.mark.parametrize("policy", [None, {"ha-mode": "all", "ha-deliver-mode": "replicated"}])
def test_deliveries_leave_before_the_ring_round_unless_replicated_mode(monkeypatch, policy):
    seen = _spy_sends(monkeypatch)
    sim, _names = build(3, replicas=3, total=200, policy=policy, prefetch=1000)  # a consumer that waits
    pub, con = sim.core("pub"), sim.core("con")
    assert sim.run_until(lambda: pub.done() and len({d.msg_id for _, d in con.received}) == 200, timeout=30)
    early = sum(1 for top, replicated in seen if top >= replicated)
    if policy is None:
        assert early > len(seen) // 2, (early, len(seen))  # most leave before their round completes
    else:
        assert seen and early == 0


class GettingConsumer:
    """A consumer (prefetch 5, acks after a while) whose channel also asks
    basic.get every few ms; records the offsets it is handed, in the order
    its channel hands them over (deliveries and get answers alike)."""

    def __init__(self, name: str, master: str, rng: random.Random):
        self.ch = chmod.QueueChannel((name, 1), QUEUE, master, master)
        self.rng = rng
        self.got: list[int] = []
        self.gets = 0
        self.to_ack: list[chmod.Delivery] = []

    def start(self, now: float) -> list:
        return [Send(REGISTRY, Watch()), SetTimer("get", 0.002), SetTimer("ack", 0.005)] + self.ch.consume(
            now, "c1", prefetch=5
        )

    def receive(self, now: float, src: str, msg: Any) -> list:
        out = []
        for a in self.ch.receive(now, src, msg):
            if isinstance(a, Emit) and isinstance(a.event, chmod.Delivery):
                self.got.append(a.event.offset)
                self.to_ack.append(a.event)
            elif isinstance(a, Emit) and isinstance(a.event, chmod.GetResult):
                if a.event.delivery is not None:
                    self.gets += 1
                    self.got.append(a.event.delivery.offset)
            elif not isinstance(a, Emit):
                out.append(a)
        return out

    def timer(self, now: float, key: Any) -> list:
        if key == "get":
            return self.ch.get(now, no_ack=True)[1] + [SetTimer("get", self.rng.uniform(0.001, 0.004))]
        acks, self.to_ack = self.to_ack, []
        out = self.ch.settle(now, acks[0].epoch, ack=[d.offset for d in acks]) if acks else []
        return out + [SetTimer("ack", self.rng.uniform(0.002, 0.01))]

    def end_turn(self, now: float) -> list:
        return self.ch.flush(now)


def _run_getting(seed: int) -> GettingConsumer:
    sim, _names = build(seed, replicas=3, total=150, consumer=False, fifo=seed % 2 == 0)
    sim.add_node("gc", lambda n, d: GettingConsumer(n, "q0", random.Random(seed)))
    gc, pub = sim.core("gc"), sim.core("pub")
    assert sim.run_until(lambda: pub.done() and len(gc.got) == 150, timeout=30), (len(gc.got), pub.done())
    return gc


@pytest.mark.parametrize("seed", range(10), ids=lambda s: f"seed={s}")
def test_deliveries_never_overtake_a_held_get_answer(seed):
    """Gets and deliveries both take the queue's head, so a channel handed
    them in the master's order sees offsets rising; a get answer waits for
    replication and the deliveries made after it wait behind it."""
    gc = _run_getting(seed)
    assert gc.gets > 0 and len(gc.got) > gc.gets  # both paths ran
    assert gc.got == sorted(gc.got)


def test_the_order_check_sees_deliveries_that_overtake_a_get_answer(monkeypatch):
    """Control: a master that lets deliveries leave past a held get answer
    (it counts no reply but deliveries as held) hands them out of order."""
    monkeypatch.setattr(co, "_bound_channel", lambda m: None)
    out_of_order = 0
    for seed in range(10):
        got = _run_getting(seed).got
        out_of_order += got != sorted(got)
    assert out_of_order > 0
