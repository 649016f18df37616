"""A deterministic network simulator for mirrorq's sans-IO cores.

Every GM, Raft, membership and queue test that is about distribution runs its
cores here: one process, virtual time, a seeded PRNG deciding every delay,
drop and reordering.  The same seed gives the same run, event for event, so a
failing seed is replayed by number.

Model
-----
* A *node* is a named core built by ``factory(name, disk)``.  ``disk`` is a
  dict that survives :meth:`Simulator.kill` / :meth:`Simulator.restart`: it is
  the simulated durable storage (what a core writes there is "fsync'd" at
  once).  Everything else in the core is lost on a kill.
* Files: a core that keeps its stores in files (a ``BackingQueue``'s
  ``SegmentLog``, a ``FileRaftLog``) runs them on the node's simulated disk,
  ``mirrorq.simdisk.of(disk)`` (a :class:`~mirrorq.simdisk.SimDisk` kept in
  the dict), handed to them as ``fs=``.  A kill is then a power loss of the
  node's machine: after the core's ``crash()``, :meth:`Simulator.kill` calls
  the disk's ``crash`` with :attr:`Simulator.rng`, which keeps what was
  fsynced -- file data after the file's fsync, a created, renamed or deleted
  name after its directory's fsync -- and of the rest a random in-order
  prefix per file, the next write possibly torn (a random prefix of its
  bytes, its size maybe committed without its data), and of the unsynced
  directory changes a random in-order prefix.  Reads see every write until
  then.  Deterministic per seed like the rest (see :mod:`mirrorq.simdisk`).
* ``wire(dst, msg)``, when given, is what crossing the network makes of a
  message (the production codec: GM frames through msgpack arrive with
  tuples where the sender had lists); without it messages arrive as sent.
* ``Send`` actions become messages with a delay drawn uniformly from
  ``[min_delay, max_delay]``; independent delays reorder messages unless
  ``fifo=True`` (per ordered pair of nodes, as one TCP connection would).  A
  message is dropped with probability ``drop`` (not on a link for which
  ``lossless(src, dst)`` holds: two actors of one machine, say); it is also lost if the link is
  partitioned when it is sent or when it would arrive, or if its destination
  died (or restarted) in between -- or its source, if the kill said
  ``lose_sent``.
* ``SetTimer``/``CancelTimer`` are exact in virtual time; timers die with the
  incarnation that set them.
* ``Emit`` actions are recorded in :attr:`Simulator.emitted` as
  ``(time, node, event)`` for checkers; :attr:`Simulator.starts` marks where in
  that list each life of a node began, :attr:`Simulator.kills` when each
  kill happened.
* Turns: every start, delivery, timer and :meth:`Simulator.call` is one turn
  of the node, as one Thespian message is one turn of an actor; a core that
  has ``end_turn(now)`` gets it called after each turn (what the actor shells
  do), and its actions are carried out too.  The turn's ``Send`` actions
  leave when the turn ends, after its ``Persist`` actions (the core's
  ``persist(now)``, called when met; the actions it returns are carried
  out then), as the actor shells post them: the durability path of
  production.  A ``Send`` marked ``early`` leaves when met, before any
  ``Persist`` that follows it: a kill inside that persist (a test's core
  may cut the power there) finds it already on the network.  A kill loses whatever a core wrote and did
  not persist (its store's unflushed buffer dies with the core object); a
  core with ``crash()`` gets it called on a kill, to let go of what the OS
  takes back from a dead process (file locks), flushing nothing.

Determinism rules for cores: take randomness only from an ``random.Random``
handed in by the test (``sim.rng`` derived), never from the global PRNG, and
never iterate over a ``set`` of strings to decide what to send (string hashing
is salted per process); iterate sorted.

Replaying: tests parametrize over seed numbers (``test_x[seed=137]``), so a
failure is re-run alone with ``pytest 'tests/...::test_x[seed=137]'``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mirrorq.sansio import CancelTimer, Emit, Persist, Send, SetTimer
from mirrorq.simdisk import DISK_KEY, SimDisk

Factory = Callable[[str, dict], Any]


@dataclass
class _Node:
    factory: Factory
    disk: dict = field(default_factory=dict)
    core: Any = None
    alive: bool = False
    incarnation: int = 0
    timers: dict = field(default_factory=dict)  # key -> generation


@dataclass
class Stats:
    sent: int = 0
    delivered: int = 0
    dropped: int = 0
    timers: int = 0
    persists: int = 0
    early: int = 0  # sends that left before their turn's persists (Send.early)


class Simulator:
    def __init__(
        self,
        seed: int,
        *,
        drop: float = 0.0,
        min_delay: float = 0.001,
        max_delay: float = 0.010,
        fifo: bool = False,
        trace: bool = False,
        lossless: Callable[[str, str], bool] | None = None,
        wire: Callable[[str, Any], Any] | None = None,
    ):
        self.seed = seed
        self.rng = random.Random(seed)
        self.drop = drop
        self.min_delay = min_delay
        self.max_delay = max_delay
        self.fifo = fifo
        self.lossless = lossless
        self.wire = wire
        self.now = 0.0
        self.nodes: dict[str, _Node] = {}
        self.emitted: list[tuple[float, str, Any]] = []
        # (len(emitted) at the time, node, incarnation) for every start: lets a
        # checker tell which life of a node emitted what.
        self.starts: list[tuple[int, str, int]] = []
        self.kills: list[tuple[float, str]] = []  # (time, node) of every kill, for checkers
        self.stats = Stats()
        self.trace: list[str] | None = [] if trace else None
        self._queue: list = []
        self._seq = 0
        self._groups: list[frozenset[str]] | None = None
        self._link_clock: dict[tuple[str, str], float] = {}
        self._timer_gen = 0
        self._held: list[tuple[str, str, Any]] | None = None  # the current turn's sends

    # ---- topology -------------------------------------------------------
    def add_node(self, name: str, factory: Factory, *, start: bool = True) -> None:
        if name in self.nodes:
            raise ValueError(f"node {name!r} already exists")
        self.nodes[name] = _Node(factory)
        if start:
            self.start(name)

    def start(self, name: str) -> None:
        node = self.nodes[name]
        if node.alive:
            raise ValueError(f"node {name!r} is already running")
        node.incarnation += 1
        node.timers = {}
        node.core = node.factory(name, node.disk)
        node.alive = True
        self.starts.append((len(self.emitted), name, node.incarnation))
        self._log(f"start {name} #{node.incarnation}")
        self._turn(name, lambda core: core.start(self.now), end=False)

    def kill(self, name: str, *, lose_sent: bool = False) -> None:
        """Stop ``name``; its disk survives (its simulated disk, if it has
        one, as a power loss leaves it: see Model).  ``lose_sent``: what it
        sent that has not arrived yet is lost too (a process dying with its
        send buffers: a commit whose confirm never left)."""
        node = self.nodes[name]
        if not node.alive:
            return
        node.alive = False
        if lose_sent:
            before = len(self._queue)
            self._queue = [e for e in self._queue if not (e[2][0] == "msg" and e[2][1] == name)]
            heapq.heapify(self._queue)
            self.stats.dropped += before - len(self._queue)
        crash = getattr(node.core, "crash", None)
        if crash is not None:
            crash()  # what dies with a process (its files' locks and descriptors); nothing is flushed
        disk = node.disk.get(DISK_KEY)
        if isinstance(disk, SimDisk):
            disk.crash(self.rng)  # the machine loses power: what was not fsynced may be lost or torn
        node.core = None
        node.timers = {}
        self.kills.append((self.now, name))
        self._log(f"kill {name}")

    def restart(self, name: str) -> None:
        self.kill(name)
        self.start(name)

    def alive(self) -> list[str]:
        return [n for n, node in self.nodes.items() if node.alive]

    def core(self, name: str) -> Any:
        node = self.nodes[name]
        if not node.alive:
            raise ValueError(f"node {name!r} is not running")
        return node.core

    def partition(self, *groups: Iterable[str]) -> None:
        """Split the network: only nodes within one group can talk.  Nodes
        named in no group form one more group together."""
        named = [frozenset(g) for g in groups]
        rest = frozenset(self.nodes) - frozenset().union(*named)
        self._groups = named + ([rest] if rest else [])
        self._log(f"partition {[sorted(g) for g in self._groups]}")

    def heal(self) -> None:
        self._groups = None
        self._log("heal")

    def connected(self, a: str, b: str) -> bool:
        if self._groups is None or a == b:
            return True
        return any(a in g and b in g for g in self._groups)

    # ---- driving --------------------------------------------------------
    def call(self, name: str, method: str, *args: Any) -> None:
        """Call ``core.method(now, *args)`` on a live node and carry out the
        actions it returns."""
        self.core(name)
        self._turn(name, lambda core: getattr(core, method)(self.now, *args))

    def schedule(self, at: float, fn: Callable[[Simulator], None]) -> None:
        """Run ``fn(sim)`` at virtual time ``at`` (kills, partitions, calls)."""
        self._push(max(at, self.now), ("fn", fn))

    def run(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            self._step()
        self.now = max(self.now, until)

    def run_for(self, duration: float) -> None:
        self.run(self.now + duration)

    def run_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Run until ``predicate()`` holds (checked after every event) or
        ``timeout`` virtual seconds pass; return whether it held."""
        deadline = self.now + timeout
        if predicate():
            return True
        while self._queue and self._queue[0][0] <= deadline:
            self._step()
            if predicate():
                return True
        self.now = max(self.now, deadline)
        return predicate()

    def events(self, node: str | None = None, kind: type | None = None) -> list:
        return [
            (t, n, e)
            for (t, n, e) in self.emitted
            if (node is None or n == node) and (kind is None or isinstance(e, kind))
        ]

    # ---- internals ------------------------------------------------------
    def _push(self, at: float, item: tuple) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (at, self._seq, item))

    def _step(self) -> None:
        at, _, item = heapq.heappop(self._queue)
        self.now = at
        kind = item[0]
        if kind == "msg":
            _, src, dst, inc, msg = item
            node = self.nodes[dst]
            if not node.alive or node.incarnation != inc or not self.connected(src, dst):
                self.stats.dropped += 1
                return
            self.stats.delivered += 1
            self._log(f"{src}->{dst} {msg!r}")
            self._turn(dst, lambda core: core.receive(self.now, src, msg))
        elif kind == "timer":
            _, name, inc, key, gen = item
            node = self.nodes[name]
            if not node.alive or node.incarnation != inc or node.timers.get(key) != gen:
                return
            del node.timers[key]
            self.stats.timers += 1
            self._turn(name, lambda core: core.timer(self.now, key))
        elif kind == "fn":
            item[1](self)

    def _turn(self, name: str, entry: Callable[[Any], Any], end: bool = True) -> None:
        """One turn of ``name``: ``entry(core)``, then ``end_turn``; the turn's
        sends leave at its end (after its Persist actions)."""
        node = self.nodes[name]
        outer, self._held = self._held, []
        try:
            self._apply(name, entry(node.core))
            end_turn = getattr(node.core, "end_turn", None) if end and node.alive else None
            if end_turn is not None:
                self._apply(name, end_turn(self.now))
            held = self._held
        finally:
            self._held = outer
        for src, dst, msg in held:
            if self.nodes[src].alive:
                self._send(src, dst, msg)

    def _apply(self, name: str, actions: Iterable[Any] | None) -> None:
        node = self.nodes[name]
        for action in actions or ():
            if not node.alive:
                return
            if isinstance(action, Send):
                if self._held is not None and not action.early:
                    self._held.append((name, action.dst, action.msg))
                else:
                    self.stats.early += action.early
                    self._send(name, action.dst, action.msg)
            elif isinstance(action, Persist):
                self.stats.persists += 1
                self._apply(name, node.core.persist(self.now))
            elif isinstance(action, SetTimer):
                self._timer_gen += 1
                node.timers[action.key] = self._timer_gen
                self._push(
                    self.now + action.delay,
                    ("timer", name, node.incarnation, action.key, self._timer_gen),
                )
            elif isinstance(action, CancelTimer):
                node.timers.pop(action.key, None)
            elif isinstance(action, Emit):
                self.emitted.append((self.now, name, action.event))
            else:
                raise TypeError(f"core {name!r} returned an unknown action {action!r}")

    def _send(self, src: str, dst: str, msg: Any) -> None:
        self.stats.sent += 1
        target = self.nodes.get(dst)
        if target is None or not target.alive or not self.connected(src, dst):
            self.stats.dropped += 1
            return
        if self.drop and not (self.lossless and self.lossless(src, dst)) and self.rng.random() < self.drop:
            self.stats.dropped += 1
            return
        if self.wire is not None:
            msg = self.wire(dst, msg)  # what the production codec hands the receiver
        at = self.now + self.rng.uniform(self.min_delay, self.max_delay)
        if self.fifo:
            link = (src, dst)
            at = max(at, self._link_clock.get(link, 0.0))
            self._link_clock[link] = at
        self._push(at, ("msg", src, dst, target.incarnation, msg))

    def _log(self, line: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.now:.6f} {line}")
