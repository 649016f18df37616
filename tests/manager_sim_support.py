"""Test support: three nodes' queue managers in the simulator.

A mirrorq node is three simulated actors, killed and restarted together:

* ``<n>`` -- :class:`SimAgent`, the node agent in miniature around the real
  cores: the registry server (:class:`~mirrorq.mnesia_like.server.RegistryServer`,
  Raft underneath, its log on the simulated disk) and membership
  (:class:`~mirrorq.node.membership.Membership`).  Like the real agent it
  answers ``RegistryGet`` from the local tables, submits a turn's
  ``RegistryTxn`` together and answers each with its ``ref``, sends
  ``RegistryChanges`` to table subscribers and ``NodeEvent`` to node-event
  subscribers, and answers ``StatusQuery``.
* ``<n>.mgr`` -- :class:`SimManager`: the real
  :class:`~mirrorq.queues.manager_core.QueueManagerCore`; what it
  sends to a replica (a GM member name) goes to the replica's host wrapped
  in :class:`~mirrorq.node.posting.ToReplica`, as the real shell's posting
  does.  Every ``FoundGroup`` it sends is also emitted as :class:`Placed`
  for the checkers.
* ``<n>-host:1`` -- :class:`StubHost`: a queue host whose replicas are
  stand-ins that do what the manager relies on and nothing more: answer
  ``ReplicaInit`` with ``ReplicaStarted``; the first founder creates the
  ``gm_group`` row (``FoundGroup``); a replica that heads the view it heard
  of keeps the ``amqqueue`` record with the real record upkeep
  (:class:`~mirrorq.queues.record_upkeep.RecordUpkeep`, fenced by that
  view's version, told again at every newer view it heads, released when
  it heads the view no more or leaves), as a promoted master does; its
  upkeep's events are emitted for the checkers; when a node goes down, the first
  replica of a view that survives proposes the view without that node's
  members (GM's promotion); a joining replica proposes the view with itself
  appended; a replica dropped from a view it was in, or told to exit, leaves
  (``ReplicaExited`` to its manager); ``StopReplica`` proposes the view
  without it, then leaves.  Its name is the ``host:port`` of its replicas'
  member names (``<n>/<n>-host:1/<uid>``).
* ``<n>.client<i>`` -- :class:`Client`: a channel of node ``n``; sends one
  ``DeclareQueue`` and keeps the answer.

Every link delivers in order while both ends live (the shells' posting is
ordered); links between two actors of one node never drop messages
(loopback), links between nodes drop with the simulator's ``drop``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from mirrorq.gm.core import ProposeView
from mirrorq.gm.names import GM_TABLE, create_txn, parse_member_name, propose_txn
from mirrorq.mnesia_like.raft import MemoryRaftLog, RaftNode
from mirrorq.mnesia_like.server import ReadDone, RegistryReset, RegistryServer, TableChanges, TxnDone
from mirrorq.node.membership import Heartbeat, Leave, Membership, NodeDown, NodeUp
from mirrorq.node.messages import (
    NodeEvent,
    NodeStatus,
    RegistryChanges,
    RegistryGet,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    RegistryTxn,
    StatusQuery,
    Subscribe,
)
from mirrorq.node.posting import ToReplica
from mirrorq.queues.control import (
    ExitReplica,
    FoundGroup,
    ReplicaExited,
    ReplicaInit,
    ReplicaStarted,
    StopReplica,
    group_name,
)
from mirrorq.queues.manager_core import DeclareQueue, DeclareResult, QueueManagerCore
from mirrorq.queues.record_upkeep import RETRY_TIMER, RecordUpkeep, ViewFence, Wanted, is_answer
from mirrorq.sansio import CancelTimer, Emit, Persist, Send, SetTimer
from mirrorq.simulator import Simulator

NODES = ("a", "b", "c")
RETRY = 0.5  # a stand-in replica repeats what has not shown in the registry this often
MEMBERSHIP = dict(interval=0.2, timeout=1.0)


def mgr(node: str) -> str:
    return f"{node}.mgr"


def host(node: str) -> str:
    return f"{node}-host:1"


def node_of_actor(name: str) -> str:
    """The mirrorq node a simulated actor belongs to."""
    return name.split(".", 1)[0].split("-", 1)[0]


@dataclass(frozen=True)
class Placed:
    """A manager sent ``FoundGroup``: it placed queue ``key`` on ``founders``."""

    key: tuple
    founders: tuple


# ---- the node agent ---------------------------------------------------------------------------
class SimAgent:
    def __init__(self, name: str, disk: dict, seed: int):
        disk["boots"] = disk.get("boots", 0) + 1
        self.name = name
        self.incarnation = disk["boots"]
        rng = random.Random(f"{seed}/{name}/{disk['boots']}")
        raft = RaftNode(
            name, MemoryRaftLog(disk), rng, voters=list(NODES), election_timeout=(0.3, 0.6), heartbeat_interval=0.1
        )
        self.registry = RegistryServer(name, raft, snapshot_every=200)
        self.membership = Membership(name, self.incarnation, [n for n in NODES if n != name], **MEMBERSHIP)
        self.subscribers: list[str] = []
        self.table_subscribers: dict[str, set] = {}
        self.requests: dict[int, tuple] = {}  # req id -> (requester, ref)
        self.next_request = 0
        self.txns: list = []  # this turn's transactions, submitted together
        self.reads: dict[int, RegistryGet] = {}  # linearizable reads waiting for the registry

    def start(self, now: float) -> list:
        return self._membership(now, self.membership.start(now)) + self._registry(now, self.registry.start(now))

    def receive(self, now: float, src: str, msg: Any) -> list:
        if src in NODES:
            if isinstance(msg, (Heartbeat, Leave)):
                return self._membership(now, self.membership.receive(now, src, msg))
            return self._registry(now, self.registry.receive(now, src, msg))
        if isinstance(msg, RegistryTxn):
            self.txns.append((self._request(src, msg.ref), "txn", msg.txn))
            return []
        if isinstance(msg, RegistryGet):
            if msg.linearizable:  # answered once the local tables are as new as the leader's commit
                self.reads[self._request(src, msg.ref)] = msg
                return self._registry(now, self.registry.read(now, self.next_request))
            return [Send(src, self._rows(msg))]
        if isinstance(msg, RegistrySubscribe):
            self.table_subscribers[src] = set(msg.tables)
            return []
        if isinstance(msg, Subscribe):
            if src not in self.subscribers:
                self.subscribers.append(src)
            return []
        if isinstance(msg, StatusQuery):
            return [Send(src, NodeStatus(self.name, self.incarnation, 0, 0, 0, 0, view=self.membership.view(now)))]
        raise TypeError(f"agent {self.name}: unexpected {msg!r} from {src}")

    def transact(self, now: float, txn: dict) -> list:
        """A transaction of the test's own (answered to nobody)."""
        self.txns.append((self._request(None, None), "txn", txn))
        return []

    def timer(self, now: float, key: Any) -> list:
        core, inner = key
        if core == "membership":
            return self._membership(now, self.membership.timer(now, inner))
        return self._registry(now, self.registry.timer(now, inner))

    def end_turn(self, now: float) -> list:
        items, self.txns = self.txns, []
        return self._registry(now, self.registry.submit(now, items)) if items else []

    def persist(self, now: float) -> None:
        self.registry.persist(now)

    def _request(self, src: str | None, ref: Any) -> int:
        self.next_request += 1
        self.requests[self.next_request] = (src, ref)
        return self.next_request

    def _rows(self, get: RegistryGet) -> RegistryRows:
        reg = self.registry.registry
        try:
            if get.key is None:
                return RegistryRows(True, reg.select(get.table), ref=get.ref)
            row = reg.get(get.table, get.key)
            return RegistryRows(True, [] if row is None else [row], ref=get.ref)
        except (ValueError, KeyError) as e:
            return RegistryRows(False, [], str(e), ref=get.ref)

    def _membership(self, now: float, actions: list) -> list:
        out: list = []
        for a in actions:
            if isinstance(a, SetTimer):
                out.append(SetTimer(("membership", a.key), a.delay))
            elif isinstance(a, Emit) and isinstance(a.event, (NodeUp, NodeDown)):
                up = isinstance(a.event, NodeUp)
                ev = NodeEvent("up" if up else "down", a.event.node, a.event.incarnation)
                out += [Send(s, ev) for s in self.subscribers]
                if not up:
                    out += self._registry(now, self.registry.peer_down(now, a.event.node))
            elif isinstance(a, Send):
                out.append(a)
        return out

    def _registry(self, now: float, actions: list) -> list:
        out: list = []
        for a in actions:
            if isinstance(a, SetTimer):
                out.append(SetTimer(("registry", a.key), a.delay))
            elif isinstance(a, (Send, Persist)):
                out.append(a)
            elif isinstance(a, Emit) and isinstance(a.event, TxnDone):
                src, ref = self.requests.pop(a.event.req_id, (None, None))
                if src is not None:
                    out.append(Send(src, RegistryResult(a.event.ok, a.event.error, ref)))
            elif isinstance(a, Emit) and isinstance(a.event, ReadDone):
                src, _ref = self.requests.pop(a.event.rid, (None, None))
                get = self.reads.pop(a.event.rid, None)
                if src is not None and get is not None:
                    out.append(
                        Send(src, self._rows(get) if a.event.ok else RegistryRows(False, [], a.event.error, get.ref))
                    )
            elif isinstance(a, Emit) and isinstance(a.event, TableChanges):
                out.append(a)  # kept for the checkers: the registry's history as this node applied it
                for sub, tables in self.table_subscribers.items():
                    mine = [(c.table, c.key, c.old, c.new) for c in a.event.changes if c.table in tables]
                    if mine:
                        out.append(Send(sub, RegistryChanges(mine)))
            elif isinstance(a, Emit) and isinstance(a.event, RegistryReset):
                out.append(a)
                out += [Send(sub, RegistryChanges(None)) for sub in self.table_subscribers]
        return out


# ---- the queue manager -------------------------------------------------------------------------
class SimManager:
    def __init__(self, node: str, seed: int, boots: int, **kw: Any):
        self.core = QueueManagerCore(
            node,
            mgr(node),
            agent=node,
            hosts=(host(node),),
            data_dir="",
            rng=random.Random(f"{seed}/{node}/manager/{boots}"),
            **kw,
        )

    def _route(self, actions: list) -> list:
        out = []
        for a in actions:
            if isinstance(a, Send) and "/" in a.dst:  # a replica, by member name: through its host
                ref = parse_member_name(a.dst)
                if isinstance(a.msg, FoundGroup):
                    d = next(d for d in self.core.declares.values() if d.founders == tuple(a.msg.founders))
                    out.append(Emit(Placed(tuple(d.key), tuple(a.msg.founders))))
                a = Send(f"{ref.host}:{ref.port}", ToReplica(a.dst, a.msg))
            out.append(a)
        return out

    def start(self, now: float) -> list:
        return self._route(self.core.start(now))

    def receive(self, now: float, src: str, msg: Any) -> list:
        return self._route(self.core.receive(now, src, msg))

    def timer(self, now: float, key: Any) -> list:
        return self._route(self.core.timer(now, key))


# ---- the queue host with stand-in replicas -------------------------------------------------------
@dataclass
class StubReplica:
    member: str
    spec: dict
    joining: bool = False
    recover: bool = False
    had_view: bool = False
    leaving: bool = False
    founders: tuple = ()  # FoundGroup's, until the group exists
    upkeep: RecordUpkeep | None = None  # its record's, while it heads a view
    kept_version: int | None = None  # the view version its upkeep was told of

    @property
    def key(self) -> tuple:
        return (self.spec["vhost"], self.spec["name"])

    @property
    def group(self) -> str:
        return group_name(*self.key)


class StubHost:
    """``promote_after``: how long after a node-down event the survivors act
    on it (GM's own detection and proposal take that long)."""

    def __init__(self, node: str, disk: dict, promote_after: float = 0.0):
        disk["boots"] = disk.get("boots", 0) + 1
        self.promote_after = promote_after
        self.node = node
        self.name = host(node)
        self.boot = disk["boots"]
        self.agent = node
        self.manager = mgr(node)
        self.replicas: dict[str, StubReplica] = {}
        self.views: dict[str, dict] = {}  # group -> the newest row heard of
        self.dead: dict[str, float] = {}  # member on a node reported down -> when to act on it
        self.down_nodes: set[str] = set()
        self.proposed: dict[tuple, tuple] = {}  # (group, member, why) -> (view version proposed against, when)
        self.requests: dict[int, Any] = {}
        self.next = 0
        self.uid = 0
        self.now = 0.0

    def start(self, now: float) -> list:
        self.now = now
        return [
            Send(self.agent, Subscribe()),
            Send(self.agent, RegistrySubscribe((GM_TABLE,))),
            SetTimer("tick", RETRY),
        ]

    def timer(self, now: float, key: Any) -> list:
        self.now = now
        if isinstance(key, tuple) and key[0] == "upkeep":  # a replica's record upkeep
            r = self.replicas.get(key[1])
            return [] if r is None or r.upkeep is None else self._upkept(r, r.upkeep.timer(now, RETRY_TIMER))
        if key != "tick":  # ("act", node): deaths reported promote_after ago are acted on
            return [a for g in sorted(self.views) for a in self._react(g)]
        # what GM and the master repeat until it shows: the group's creation,
        # proposals, the record (each reads the view again, then acts)
        out: list = [SetTimer("tick", RETRY)]
        for r in sorted(self.replicas.values(), key=lambda r: r.member):
            if r.founders and self.views.get(r.group) is None:
                out += self._ask(RegistryTxn(create_txn(r.group, r.founders)), lambda m, g=r.group: self._read_view(g))
        for g in sorted({r.group for r in self.replicas.values()}):
            out += self._read_view(g)
        return out

    def receive(self, now: float, src: str, msg: Any) -> list:
        self.now = now
        if isinstance(msg, ReplicaInit):
            return self._init(msg, src)
        if isinstance(msg, ToReplica):
            r = self.replicas.get(msg.member)
            return [] if r is None else self._order(r, msg.msg)
        if is_answer(msg):
            r = self.replicas.get(msg.ref.owner)
            return [] if r is None or r.upkeep is None else self._upkept(r, r.upkeep.receive(now, src, msg))
        if isinstance(msg, (RegistryRows, RegistryResult)):
            cb = self.requests.pop(msg.ref, None) if isinstance(msg.ref, int) else None
            return cb(msg) if cb is not None else []
        if isinstance(msg, RegistryChanges):
            if msg.changes is None:
                return [a for g in sorted({r.group for r in self.replicas.values()}) for a in self._read_view(g)]
            out: list = []
            for table, key, _old, new in msg.changes:
                if table == GM_TABLE:
                    out += self._view(key[0] if isinstance(key, (list, tuple)) else key, new)
            return out
        if isinstance(msg, NodeEvent):
            if msg.kind == "down":
                self.down_nodes.add(msg.node)
                for row in self.views.values():
                    self._suspect((row or {}).get("members", ()))
                return [SetTimer(("act", msg.node), self.promote_after)]
            self.down_nodes.discard(msg.node)
        return []

    # ---- requests to the agent ------------------------------------------------------------
    def _ask(self, msg: Any, cb: Any) -> list:
        self.next += 1
        self.requests[self.next] = cb
        msg.ref = self.next
        return [Send(self.agent, msg)]

    def _read_view(self, group: str) -> list:
        # no row is no news (a local replica that has not applied the create yet): only a change deletes
        return self._ask(
            RegistryGet(GM_TABLE, [group]), lambda m: self._view(group, m.rows[0]) if m.ok and m.rows else []
        )

    def _propose(self, group: str, version: int, members: tuple) -> list:
        return self._ask(RegistryTxn(propose_txn(group, ProposeView(version, members))), lambda m: [])

    # ---- replicas ----------------------------------------------------------------------------
    def _init(self, msg: ReplicaInit, src: str) -> list:
        self.uid += 1
        member = f"{self.node}/{self.name}/r{self.boot}x{self.uid}"
        spec = {"vhost": "/", **msg.spec}
        r = self.replicas[member] = StubReplica(member, spec, joining=msg.join, recover=msg.recover)
        return [Send(src, ReplicaStarted(member, self.node, msg.token))] + self._read_view(r.group)

    def _order(self, r: StubReplica, msg: Any) -> list:
        if isinstance(msg, FoundGroup):
            r.founders = tuple(msg.founders)
            return self._ask(RegistryTxn(create_txn(r.group, r.founders)), lambda m: self._read_view(r.group))
        if isinstance(msg, ExitReplica):
            return self._exit(r, "exit requested")
        if isinstance(msg, StopReplica):
            r.leaving = True
            return self._react(r.group)
        return []  # SetPolicy, MasterHandOver, queue commands: nothing a stand-in does

    def _exit(self, r: StubReplica, reason: str) -> list:
        if self.replicas.pop(r.member, None) is None:
            return []
        return self._release(r) + [Send(self.manager, ReplicaExited(r.member, r.key, reason))]

    def _view(self, group: str, row: dict | None) -> list:
        old = self.views.get(group)
        if row is not None and old is not None and row["version"] < old["version"]:
            return []  # an older read than a change already heard
        self.views[group] = row
        self._suspect((row or {}).get("members", ()))
        return self._react(group)

    def _suspect(self, members: Any) -> None:
        """Members on a node that is down are dead (a node that comes back
        is a new incarnation: its old members stay dead)."""
        for m in members:
            if parse_member_name(m).node in self.down_nodes:
                self.dead.setdefault(m, self.now + self.promote_after)

    def _react(self, group: str) -> list:
        row = self.views.get(group)
        out: list = []
        for r in [r for r in self.replicas.values() if r.group == group]:
            members = tuple((row or {}).get("members", ()))
            if r.member not in members:
                if r.had_view or r.leaving:
                    out += self._exit(r, "removed from the view" if not r.leaving else "left")
                elif r.joining and row is not None:
                    out += self._once(group, r, "join", row["version"], members + (r.member,))
                continue
            r.had_view, r.joining = True, False
            if r.leaving:
                out += self._once(group, r, "leave", row["version"], tuple(m for m in members if m != r.member))
                continue
            alive = tuple(m for m in members if self.dead.get(m, float("inf")) > self.now)
            if alive != members and alive and alive[0] == r.member:
                out += self._once(group, r, "promote", row["version"], alive)  # GM: drop the dead
            if members[0] == r.member:
                out += self._keep_record(r, row["version"], members)
            else:
                out += self._release(r)
        return out

    def _once(self, group: str, r: StubReplica, why: str, version: int, members: tuple) -> list:
        """Propose, unless the same proposal went out less than RETRY ago."""
        last = self.proposed.get((group, r.member, why))
        if not members or (last is not None and last[0] == version and self.now - last[1] < RETRY):
            return []
        self.proposed[(group, r.member, why)] = (version, self.now)
        return self._propose(group, version, members)

    def _keep_record(self, r: StubReplica, version: int, members: tuple) -> list:
        """What a promoted master does at every view it heads: tell its
        record upkeep what the record should say, fenced by that view."""
        if r.kept_version == version:
            return []
        r.kept_version = version
        if r.upkeep is None:
            r.upkeep = RecordUpkeep(r.member, self.agent, r.key)
        fields = {
            "pid": r.member,
            "slave_pids": list(members[1:]),
            "sync_slave_pids": list(members[1:]),
            "gm_pids": list(members),
            "state": "live",
        }
        s = r.spec
        row = {
            "name": s["name"],
            "vhost": s["vhost"],
            "durable": bool(s.get("durable")),
            "auto_delete": bool(s.get("auto_delete")),
            "exclusive_owner": s.get("exclusive_owner"),
            "arguments": dict(s.get("arguments") or {}),
            **fields,
        }
        return self._upkept(r, r.upkeep.keep(self.now, Wanted(fields, row, ViewFence(r.group, version))))

    def _release(self, r: StubReplica) -> list:
        """It heads no view any more (or leaves): its upkeep stops."""
        r.kept_version = None
        return [] if r.upkeep is None else self._upkept(r, r.upkeep.release(self.now))

    def _upkept(self, r: StubReplica, actions: list) -> list:
        """The upkeep's actions as this host's: its timer under the
        replica's name, its events emitted for the checkers."""
        out: list = []
        for a in actions:
            if isinstance(a, SetTimer):
                out.append(SetTimer(("upkeep", r.member), a.delay))
            elif isinstance(a, CancelTimer):
                out.append(CancelTimer(("upkeep", r.member)))
            else:
                out.append(a)
        return out


# ---- clients ---------------------------------------------------------------------------------
class Client:
    """Sends one declare (``declare``) and keeps the answer with its time."""

    def __init__(self) -> None:
        self.sent_at: float | None = None
        self.manager: str | None = None
        self.spec: dict = {}
        self.answers: list[tuple[float, DeclareResult]] = []

    def declare(self, now: float, manager: str, spec: dict, nodes: tuple = ()) -> list:
        self.sent_at, self.manager, self.spec = now, manager, dict(spec)
        return [Send(manager, DeclareQueue(dict(spec), tuple(nodes)))]

    def start(self, now: float) -> list:
        return []

    def receive(self, now: float, src: str, msg: Any) -> list:
        self.answers.append((now, msg))
        return []

    def timer(self, now: float, key: Any) -> list:
        return []


# ---- the cluster ---------------------------------------------------------------------------------
class Cluster:
    """Three nodes (agent, manager, stub host each) in one simulator."""

    def __init__(
        self, seed: int, *, drop: float = 0.0, max_delay: float = 0.01, promote_after: float = 0.0, **manager_kw: Any
    ):
        self.seed = seed
        self.sim = Simulator(
            seed,
            drop=drop,
            min_delay=0.0005,
            max_delay=max_delay,
            fifo=True,
            lossless=lambda s, d: node_of_actor(s) == node_of_actor(d),
        )
        self.manager_kw = manager_kw
        self.boots: dict[str, int] = {}
        self.clients: dict[str, Client] = {}
        for n in NODES:
            self.sim.add_node(n, lambda name, disk: SimAgent(name, disk, seed), start=False)
            self.sim.add_node(host(n), lambda name, disk, n=n: StubHost(n, disk, promote_after), start=False)
            self.sim.add_node(mgr(n), self._manager_factory(n), start=False)
            self.start_node(n)

    def _manager_factory(self, node: str):
        def make(name: str, disk: dict) -> SimManager:
            disk["boots"] = disk.get("boots", 0) + 1
            return SimManager(node, self.seed, disk["boots"], **self.manager_kw)

        return make

    # ---- lives of nodes ------------------------------------------------------------------------
    def start_node(self, n: str) -> None:
        for actor in (n, host(n), mgr(n)):
            if not self.sim.nodes[actor].alive:
                self.sim.start(actor)

    def kill_node(self, n: str) -> None:
        for actor in (mgr(n), host(n), n):
            self.sim.kill(actor)

    def manager(self, n: str) -> QueueManagerCore:
        return self.sim.core(mgr(n)).core

    def agent(self, n: str) -> SimAgent:
        return self.sim.core(n)

    def host(self, n: str) -> StubHost:
        return self.sim.core(host(n))

    # ---- driving ---------------------------------------------------------------------------------
    def settle(self, timeout: float = 15.0) -> None:
        """Run until a registry leader is known everywhere and every manager is registered."""

        def ready() -> bool:
            return all(self.sim.nodes[a].alive for n in NODES for a in (n, mgr(n))) and all(
                self.agent(n).registry.leader is not None
                and self.manager(n).registered
                and self.manager(n).mirror_loaded == {"policy", "amqqueue", "node"}
                and len(self.manager(n).mirror["node"]) == len(NODES)
                and self.agent(n).membership.up_nodes() == sorted(NODES)
                for n in NODES
            )

        assert self.sim.run_until(ready, timeout), f"seed {self.seed}: the cluster did not settle\n{self.describe()}"

    def set_policy(self, name: str, pattern: str, definition: dict, through: str = "a") -> None:
        row = {
            "vhost": "/",
            "name": name,
            "pattern": pattern,
            "apply_to": "queues",
            "priority": 0,
            "definition": definition,
        }
        self.sim.call(
            through, "transact", {"ops": [{"op": "put", "table": "policy", "key": ["/", name], "record": row}]}
        )

    def declare(self, at: float, node: str, spec: dict, nodes: tuple = ()) -> str:
        """Schedule a declare on ``node``'s manager at ``at``; the client's name."""
        name = f"{node}.client{len(self.clients)}"  # a channel on that node
        self.clients[name] = client = Client()
        self.sim.add_node(name, lambda _n, _d: client)
        self.sim.schedule(at, lambda s: s.call(name, "declare", mgr(node), spec, nodes))
        return name

    def placements(self) -> list[tuple[float, str, Placed]]:
        return self.sim.events(kind=Placed)

    def record(self, key: tuple, node: str | None = None) -> dict | None:
        n = node or next(n for n in NODES if self.sim.nodes[n].alive)
        return self.agent(n).registry.registry.get("amqqueue", list(key))

    def view(self, key: tuple, node: str | None = None) -> dict | None:
        n = node or next(n for n in NODES if self.sim.nodes[n].alive)
        return self.agent(n).registry.registry.get(GM_TABLE, [group_name(*key)])

    def describe(self) -> str:
        lines = []
        for n in NODES:
            alive = self.sim.nodes[n].alive
            if not alive:
                lines.append(f"{n}: down")
                continue
            reg = self.agent(n).registry
            lines.append(f"{n}: leader={reg.leader} up={self.agent(n).membership.up_nodes()}")
            if self.sim.nodes[mgr(n)].alive:
                m = self.manager(n)
                lines.append(f"  manager registered={m.registered} replicas={m.replicas} declares={len(m.declares)}")
            if self.sim.nodes[host(n)].alive:
                lines.append(f"  host replicas={sorted(self.host(n).replicas)}")
        for t, node, ev in self.sim.emitted[-60:]:
            if not isinstance(ev, TableChanges):
                lines.append(f"  {t:.3f} {node} {ev}")
        return "\n".join(lines)
