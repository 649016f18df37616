"""The largest message each hop between two mirrorq processes makes, by type.

Runs the sans-IO cores (no cluster, no Thespian) through the situations
that make messages grow, and prints the largest message of each type as it
would travel: pickled (what Thespian and the direct links carry), a GM
``Activity`` as its frame body (msgpack, :func:`mirrorq.gm.messages.encode`),
an outbox ``Bundle`` as the sum of its messages pickled one by one.

Situations (``--size`` bytes per message body, default 4 KiB):

* ``mirrored``: a 3-replica classic mirrored queue in the simulator; a
  publisher without a consumer publishes ``--messages`` as fast as its
  channel lets it while the last mirror is cut off for 2 s, then an
  unlimited-prefetch consumer drains the queue.  Shows the channel's
  ``Publish``, GM activities (forwarded publishes, the catch-up after the
  cut), the master's ``Deliveries`` and sync batches.
* ``outbox``: what one bundle holds when an actor posts while its bundle to
  that destination is in flight (``Publish`` messages of the size the
  ``mirrored`` run's channel made).
* ``quorum``: a 3-member quorum queue in the simulator whose third member
  is cut off while ``--messages`` are published, then catches up: by
  ``AppendEntries``, and in a second run,
  by ``InstallSnapshot`` (snapshots every 2 entries).
* ``amqp``: the bounds (:mod:`mirrorq.bounds`) and which bodies the
  segment log can store.

Usage: ``.venv/bin/python bench/message_sizes.py [--messages N] [--size BYTES]``
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import sys
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from mirrorq.gm import messages as gm_messages  # noqa: E402
from mirrorq.gm.core import Activity  # noqa: E402
from mirrorq.mnesia_like.raft import MemoryRaftLog  # noqa: E402
from mirrorq.outbox import Outbox  # noqa: E402
from mirrorq.queues import channel as chmod  # noqa: E402
from mirrorq.queues import messages as qm  # noqa: E402
from mirrorq.sansio import Emit, Send, SetTimer  # noqa: E402
from mirrorq.simulator import Simulator  # noqa: E402

MiB = 1 << 20


def wire_size(msg: Any) -> int:
    if isinstance(msg, Activity):
        return len(gm_messages.encode([msg]))
    return len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


class Sizes:
    def __init__(self) -> None:
        self.largest: dict[str, int] = defaultdict(int)
        self.count: dict[str, int] = defaultdict(int)

    def note(self, kind: str, size: int) -> None:
        self.count[kind] += 1
        self.largest[kind] = max(self.largest[kind], size)

    def watch(self, sim: Simulator) -> None:
        send = sim._send

        def measured(src: str, dst: str, msg: Any) -> None:
            self.note(type(msg).__name__, wire_size(msg))
            send(src, dst, msg)

        sim._send = measured


class FastPublisher:
    """Publishes ``total`` bodies of ``size`` bytes, ``burst`` per millisecond."""

    def __init__(self, name: str, master: str, total: int, size: int, burst: int, publishes: list) -> None:
        self.ch = chmod.QueueChannel((name, 1), "q", master, master)
        self.total, self.size, self.burst = total, size, burst
        self.publishes = publishes  # every Publish the channel sent

    def _sent(self, actions: list) -> list:
        for a in actions:
            if isinstance(a, Send) and isinstance(a.msg, qm.Publish):
                self.publishes.append(a.msg)
        return actions

    def start(self, now: float) -> list:
        return [SetTimer("pub", 0.001)]

    def timer(self, now: float, key: Any) -> list:
        left = self.total - (self.ch.next_seq - 1)
        if left <= 0:
            return []
        n = min(left, self.burst)
        items = [(os.urandom(8) + bytes(self.size - 8), {"delivery_mode": 2}, True) for _ in range(n)]
        return self._sent(self.ch.publish(now, items)) + [SetTimer("pub", 0.001)]

    def receive(self, now: float, src: str, msg: Any) -> list:
        return self._sent([a for a in self.ch.receive(now, src, msg) if not isinstance(a, Emit)])

    def end_turn(self, now: float) -> list:
        return self.ch.flush(now)


class Drainer:
    """An unlimited-prefetch consumer that acks everything it gets."""

    def __init__(self, name: str, master: str) -> None:
        self.ch = chmod.QueueChannel((name, 1), "q", master, master)
        self.got = 0

    def start(self, now: float) -> list:
        return self.ch.consume(now, "c", prefetch=0)

    def receive(self, now: float, src: str, msg: Any) -> list:
        out = []
        for a in self.ch.receive(now, src, msg):
            if isinstance(a, Emit) and isinstance(a.event, chmod.Delivery):
                self.got += 1
                out += self.ch.settle(now, a.event.epoch, ack=[a.event.offset])
            elif not isinstance(a, Emit):
                out.append(a)
        return out

    def timer(self, now: float, key: Any) -> list:
        return []

    def end_turn(self, now: float) -> list:
        return self.ch.flush(now)


def mirrored(total: int, size: int, sizes: Sizes) -> list:
    from queue_sim_support import REGISTRY, QueueRegistry, ReplicaNode

    sim = Simulator(1, min_delay=0.0005, max_delay=0.004, fifo=True)
    names = ("q0", "q1", "q2")
    sim.add_node(REGISTRY, lambda n, d: QueueRegistry(names, "q0"))
    for nm in names:
        sim.add_node(nm, lambda n, d: ReplicaNode(n, "q0"))
    publishes: list = []
    sim.add_node("pub", lambda n, d: FastPublisher(n, "q0", total, size, 200, publishes))
    sizes.watch(sim)
    sim.run_for(0.05)
    everyone = [REGISTRY, "q0", "q1", "pub"]
    sim.partition(everyone, ["q2"])
    sim.run_for(2.0)
    sim.heal()
    sim.run_until(lambda: sim.core("pub").ch.next_seq - 1 == total and not sim.core("pub").ch.unconfirmed, 60.0)
    sim.add_node("con", lambda n, d: Drainer(n, "q0"))
    sim.run_until(lambda: sim.core("con").got >= total, 60.0)
    return publishes


def outbox(publishes: list, sizes: Sizes) -> None:
    """An actor posting the channel's Publish messages to one destination
    while its bundle there is in flight: the next bundle takes them all."""
    ob = Outbox("fe:1/x")
    ob.post("master:2", publishes[0])
    ob.take(0.0)  # in flight
    for p in publishes[1:]:
        ob.post("master:2", p)
    ob.sent("master:2", 1, 0.0, start_next=False)
    for _dst, b in ob.take(0.0):
        sizes.note("Bundle", sum(wire_size(m) for m in b.msgs))


class QuorumMember:
    def __init__(self, name: str, disk: dict, voters: tuple, snapshot_every: int) -> None:
        from mirrorq.quorum.replica import QuorumReplica

        self.r = QuorumReplica(
            name,
            "qq",
            MemoryRaftLog(disk),
            random.Random(name),
            voters=voters,
            arguments={},
            snapshot_every=snapshot_every,
        )

    def start(self, now):
        return self.r.start(now)

    def receive(self, now, src, msg):
        return self.r.receive(now, src, msg)

    def timer(self, now, key):
        return self.r.timer(now, key)

    def end_turn(self, now):
        return self.r.end_turn(now)

    def persist(self, now):
        return self.r.persist(now)


def quorum(total: int, size: int, sizes: Sizes, snapshot_every: int) -> None:
    """Members a, b, c; c is cut off while the leader takes ``total``
    publishes, then comes back and is caught up."""
    sim = Simulator(3, min_delay=0.0005, max_delay=0.004, fifo=True)
    voters = ("a", "b", "c")
    for nm in voters:
        sim.add_node(nm, lambda n, d: QuorumMember(n, d, voters, snapshot_every))
    sim.partition(["a", "b", "pub"], ["c"])
    sim.run_until(lambda: any(sim.core(m).r.led_term is not None for m in ("a", "b")), 30.0)
    leader = next(m for m in ("a", "b") if sim.core(m).r.led_term is not None)
    publishes: list = []
    sim.add_node("pub", lambda n, d: FastPublisher(n, leader, total, size, 200, publishes))
    sim.core("pub").ch.queue = "qq"
    sizes.watch(sim)
    sim.run_until(lambda: sim.core("pub").ch.next_seq - 1 == total and not sim.core("pub").ch.unconfirmed, 120.0)
    sim.heal()
    sim.run_until(lambda: sim.core("c").r.raft.applied_index >= sim.core(leader).r.raft.applied_index, 60.0)


def amqp(sizes: Sizes) -> None:
    from mirrorq import bounds
    from mirrorq.classic.backing_queue import BackingQueue

    print(
        f"AMQP front end: max_message_size {bounds.DEFAULT_MAX_MESSAGE_SIZE / MiB:.0f} MiB by default, "
        f"at most {bounds.MAX_MESSAGE_SIZE_LIMIT / MiB:.0f} MiB; batches {bounds.MAX_BATCH_BYTES / MiB:.0f} MiB; "
        f"largest message between processes {bounds.MAX_WIRE_BYTES / MiB:.0f} MiB"
    )
    bq = BackingQueue(None, durable=False)
    for mib in (16, 32, 65):
        try:
            bq.publish(f"m{mib}", bytes(mib * MiB), {}, True)
            print(f"  a {mib} MiB body: stored")
        except Exception as e:  # noqa: BLE001 -- reported
            print(f"  a {mib} MiB body: refused by the segment log: {type(e).__name__}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args()
    sizes = Sizes()
    publishes = mirrored(args.messages, args.size, sizes)
    outbox(publishes, sizes)
    quorum(args.messages, args.size, sizes, 10**9)
    snap = Sizes()
    quorum(args.messages, args.size, snap, 2)
    sizes.note("InstallSnapshot", snap.largest.get("InstallSnapshot", 0))
    print(f"{args.messages} messages of {args.size} bytes")
    print(f"{'message':<20} {'count':>8} {'largest':>14}")
    for kind in sorted(sizes.largest, key=lambda k: -sizes.largest[k]):
        print(f"{kind:<20} {sizes.count[kind]:>8} {sizes.largest[kind] / MiB:>10.2f} MiB")
    amqp(sizes)


if __name__ == "__main__":
    main()
