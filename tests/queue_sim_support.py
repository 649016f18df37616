"""Test support: a mirrored queue in the simulator.

Nodes:
* ``registry``: :class:`QueueRegistry`, the GM registry oracle of
  ``gm_registry_oracle`` plus the amqqueue master record: replicas report a
  promotion (``MasterIs``) and clients that ``Watch`` get ``NewMaster``.
* ``q0``, ``q1``...: :class:`ReplicaNode`, a :class:`QueueReplica` (GM member
  + queue) wired to the registry; ``q0`` is the founding master.
* ``pub``: :class:`PublisherNode`, publishes N messages in random batches
  through a :class:`QueueChannel`.
* ``con``: :class:`ConsumerNode`, consumes with a prefetch and acks after a
  random delay, recording every delivery.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from gm_registry_oracle import REGISTRY, Propose, Push, PushAck, RegistryOracle, Subscribe

from mirrorq import simdisk
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.classic.replica import Promoted, QueueReplica, QueueSpec
from mirrorq.gm.core import ProposeView
from mirrorq.queues import channel as chmod
from mirrorq.queues.messages import NewMaster
from mirrorq.sansio import Emit, Send, SetTimer

QUEUE = "q"


@dataclass(frozen=True)
class MasterIs:
    member: str
    dst: Any


@dataclass(frozen=True)
class Watch:
    pass


class QueueRegistry(RegistryOracle):
    """``master`` None: none yet (a declared queue's founders elect one and
    say so with ``MasterIs``; watchers hear of it then)."""

    def __init__(self, members: tuple[str, ...], master: str | None):
        super().__init__(members)
        self.master = master
        self.watchers: set[str] = set()
        self.master_history = [] if master is None else [master]

    def receive(self, now: float, src: str, msg: Any) -> list:
        if isinstance(msg, Watch):
            self.watchers.add(src)
            return [] if self.master is None else [Send(src, NewMaster(QUEUE, self.master, self.master))]
        if isinstance(msg, MasterIs):
            if msg.member != self.master:
                self.master = msg.member
                self.master_history.append(msg.member)
            return [Send(w, NewMaster(QUEUE, self.master, msg.dst)) for w in sorted(self.watchers)]
        return super().receive(now, src, msg)


def gm_wire(dst: str, msg: Any) -> Any:
    """A GM frame as the member ``dst`` gets it from another node: through
    GM's codec (msgpack: lists arrive as tuples, ``dst``'s own pubs left
    out), as :mod:`mirrorq.gm.shell` sends it; other messages as sent."""
    from mirrorq.gm import messages as gmm
    from mirrorq.gm.core import Activity, Nudge

    if isinstance(msg, (Activity, Nudge)):
        return gmm.decode(gmm.encode([msg], dst))[0]
    return msg


class ReplicaNode:
    """``directory``: a durable store (kept across a kill, as a disk is);
    None: in memory.  ``disk``: the simulator node's disk dict, whose
    simulated disk (``mirrorq.simdisk.of``) holds the directory (a kill is a
    power loss: what was not fsynced may be lost or torn); without it the
    directory is a real one.  ``joining``: join the group as a new mirror."""

    def __init__(
        self,
        name: str,
        master: str | None,
        *,
        arguments: dict | None = None,
        directory=None,
        joining: bool = False,
        policy: dict | None = None,
        disk: dict | None = None,
    ):
        durable = directory is not None
        fs = None if disk is None else simdisk.of(disk)

        def open_bq(fresh: bool = False):
            if durable and fresh:
                if fs is None:
                    import shutil

                    shutil.rmtree(directory, ignore_errors=True)
                elif fs.exists(directory):
                    for name in fs.listdir(directory):
                        fs.unlink(f"{directory}/{name}")
            if not durable:
                return BackingQueue(None, durable=False)
            if fs is None:
                return BackingQueue(directory, durable=True, fsync=False)
            return BackingQueue(directory, durable=True, fs=fs)  # fsyncs as production does

        spec = QueueSpec(QUEUE, durable=durable, arguments=dict(arguments or {}))
        self.replica = QueueReplica(
            name,
            name,
            spec,
            open_bq(),
            master=master,
            joining=joining,
            bq_factory=open_bq,
            policy=policy,
            # flushed at the end of each turn and acks riding on later traffic, as in production
            gm_options={"flush_interval": None, "tick_interval": 0.2, "ack_delay": 0.02},
        )
        # the production durability path: one store flush per turn, as the
        # turn's Persist action, before the turn's sends leave (mirrorq.sansio)
        self.replica.defer_flush = True
        #: the next offset of the store it opened: what survived the last crash of its disk
        self.opened_next = self.replica.bq.log.next_offset
        self.joining = joining
        self.heard = False

    def _out(self, actions: list) -> list:
        res = []
        for a in actions:
            res.append(a)
            if isinstance(a, Emit):
                if isinstance(a.event, ProposeView):
                    res.append(Send(REGISTRY, Propose(a.event.expected_version, a.event.members)))
                elif isinstance(a.event, Promoted):
                    res.append(Send(REGISTRY, MasterIs(a.event.member, a.event.dst)))
        return res

    def start(self, now: float) -> list:
        actions = self.replica.start(now) + [Send(REGISTRY, Subscribe())]
        if self.joining:
            actions += self.replica.join(now)
        return self._out(actions)

    def receive(self, now: float, src: str, msg: Any) -> list:
        if src == REGISTRY and isinstance(msg, Push):
            return self._out(self.replica.install_view(now, msg.view) + [Send(REGISTRY, PushAck(msg.view.version))])
        return self._out(self.replica.receive(now, src, msg))

    def timer(self, now: float, key: Any) -> list:
        return self._out(self.replica.timer(now, key))

    def end_turn(self, now: float) -> list:
        return self._out(self.replica.end_turn(now))

    def persist(self, now: float) -> None:
        self.replica.persist(now)

    def crash(self) -> None:
        self.replica.bq.close(flush=False)  # a killed process: unpersisted writes are gone, the lock is free

    def member_down(self, now: float, name: str) -> list:
        return self._out(self.replica.member_down(now, name))

    def dst_down(self, now: float, dst: str) -> list:
        return self._out(self.replica.dst_down(now, dst))

    def shutdown(self, now: float) -> list:
        return self._out(self.replica.shutdown(now))

    def hand_over(self, now: float, target: str) -> list:
        return self._out(self.replica.hand_over(now, target))


def _first_master(node: Any, src: str, msg: Any) -> bool:
    """A client waiting for the declare's answer (``wait_master``) hears the
    first master: it starts now, as an application does once its declare
    returns."""
    if node.wait_master and src == REGISTRY and isinstance(msg, NewMaster):
        node.wait_master = False
        return True
    return False


class PublisherNode:
    def __init__(self, name: str, master: str, total: int, rng: random.Random, *, wait_master: bool = False):
        self.ch = chmod.QueueChannel((name, 1), QUEUE, master, master)
        self.total = total
        self.rng = rng
        self.wait_master = wait_master
        self.confirmed: set[int] = set()
        self.nacked: set[int] = set()
        self.confirm_times: dict[int, float] = {}

    def start(self, now: float) -> list:
        return [Send(REGISTRY, Watch())] + ([] if self.wait_master else [SetTimer("pub", 0.001)])

    def timer(self, now: float, key: Any) -> list:
        left = self.total - (self.ch.next_seq - 1)
        if left <= 0:
            return []
        n = min(left, self.rng.randint(1, 20))
        items = [(f"m{self.ch.next_seq + i}".encode(), {}, True) for i in range(n)]
        return self.ch.publish(now, items) + [SetTimer("pub", self.rng.uniform(0.001, 0.01))]

    def receive(self, now: float, src: str, msg: Any) -> list:
        out = [SetTimer("pub", 0.001)] if _first_master(self, src, msg) else []
        for a in self.ch.receive(now, src, msg):
            if isinstance(a, Emit) and isinstance(a.event, chmod.Confirmed):
                for s in a.event.seqs:
                    self.confirmed.add(s)
                    self.confirm_times[s] = now
            elif isinstance(a, Emit) and isinstance(a.event, chmod.Nacked):
                self.nacked.update(a.event.seqs)
            out.append(a)
        return out

    def done(self) -> bool:
        return self.ch.next_seq - 1 == self.total and not self.ch.unconfirmed

    def end_turn(self, now: float) -> list:
        return self.ch.flush(now)


class ConsumerNode:
    def __init__(
        self,
        name: str,
        master: str,
        rng: random.Random,
        *,
        prefetch: int = 10,
        arguments: dict | None = None,
        wait_master: bool = False,
    ):
        self.ch = chmod.QueueChannel((name, 1), QUEUE, master, master)
        self.wait_master = wait_master
        self.rng = rng
        self.prefetch = prefetch
        self.arguments = dict(arguments or {})
        self.received: list[tuple[float, chmod.Delivery]] = []
        self.to_ack: list[chmod.Delivery] = []
        self.cancelled: list = []
        self._armed = False

    def start(self, now: float) -> list:
        if self.wait_master:
            return [Send(REGISTRY, Watch())]
        return [Send(REGISTRY, Watch())] + self.ch.consume(now, "c1", prefetch=self.prefetch, arguments=self.arguments)

    def receive(self, now: float, src: str, msg: Any) -> list:
        first = _first_master(self, src, msg)
        out = []
        for a in self.ch.receive(now, src, msg):
            if isinstance(a, Emit) and isinstance(a.event, chmod.Delivery):
                self.received.append((now, a.event))
                self.to_ack.append(a.event)
                if not self._armed:
                    self._armed = True
                    out.append(SetTimer("ack", self.rng.uniform(0.0, 0.01)))
            elif isinstance(a, Emit) and isinstance(a.event, chmod.Cancelled):
                self.cancelled.append((now, a.event))
                if not self.ch.consumers:
                    # told of the cancel, the client consumes again (as pika users do)
                    out += self.ch.consume(now, f"c{len(self.cancelled) + 1}", prefetch=self.prefetch)
            else:
                out.append(a)
        if first:
            out += self.ch.consume(now, "c1", prefetch=self.prefetch, arguments=self.arguments)
        return out

    def timer(self, now: float, key: Any) -> list:
        self._armed = False
        by_epoch: dict[str, list[int]] = {}
        for d in self.to_ack:
            by_epoch.setdefault(d.epoch, []).append(d.offset)
        self.to_ack = []
        out = []
        for epoch, offsets in by_epoch.items():
            out += self.ch.settle(now, epoch, ack=offsets)
        return out

    def end_turn(self, now: float) -> list:
        return self.ch.flush(now)  # the turn's settlements: one Settle per master (as the AMQP front end does)


class Operator:
    """Sends queue commands (sync_queue, cancel_sync_queue) to the master."""

    def __init__(self, name: str):
        self.ch = chmod.QueueChannel((name, 1), QUEUE, None)
        self.results: list = []

    def start(self, now: float) -> list:
        return [Send(REGISTRY, Watch())]

    def command(self, now: float, command: str) -> list:
        if self.ch.master_dst is None:
            return []
        return self.ch.command(now, command)[1]

    def receive(self, now: float, src: str, msg: Any) -> list:
        out = []
        for a in self.ch.receive(now, src, msg):
            if isinstance(a, Emit) and isinstance(a.event, chmod.CommandDone):
                self.results.append((now, a.event))
            elif not isinstance(a, Emit):
                out.append(a)
        return out

    def timer(self, now: float, key: Any) -> list:
        return []


def build(
    seed: int,
    *,
    replicas: int = 3,
    total: int = 300,
    drop: float = 0.0,
    fifo: bool = True,
    consumer_args=None,
    directory=None,
    policy: dict | None = None,
    arguments: dict | None = None,
    consumer: bool = True,
    founded: bool = False,
    prefetch: int = 10,
):
    """``founded``: the replicas start as a declare starts them (no master
    known; the founding view elects ``q0``), else ``q0`` starts as master.
    ``directory``: durable stores, in ``directory/<replica>`` on each
    replica's simulated disk (a kill is a power loss); None: in memory."""
    from mirrorq.simulator import Simulator

    sim = Simulator(seed, drop=drop, min_delay=0.0005, max_delay=0.004, fifo=fifo, wire=gm_wire)
    names = tuple(f"q{i}" for i in range(replicas))
    master = names[0]
    rng = random.Random(seed * 7919 + 1)
    sim.add_node(REGISTRY, lambda n, d: QueueRegistry(names, None if founded else master))
    for nm in names:
        sim.add_node(
            nm,
            lambda n, d: ReplicaNode(
                n,
                None if founded else master,
                directory=None if directory is None else f"{directory}/{n}",
                policy=policy,
                arguments=arguments,
                disk=d,
            ),
        )
    sim.add_node("pub", lambda n, d: PublisherNode(n, master, total, rng, wait_master=founded))
    if consumer:
        sim.add_node(
            "con",
            lambda n, d: ConsumerNode(n, master, rng, prefetch=prefetch, arguments=consumer_args, wait_master=founded),
        )
    return sim, names
