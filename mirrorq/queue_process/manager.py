"""The queue manager: one per node; declares queues, places mirrors, recovers replicas.

Global name ``mirrorq.queue_manager`` on every node (created by the node
daemon).  It registers its address in the registry's ``node`` table (field
``manager``) so that managers find each other without any convention.

Declare (:class:`DeclareQueue`, from a channel on any node)
    If ``amqqueue`` already has the queue, the answer is its record.
    Otherwise the manager claims the name (a ``queue_claim`` row put only if
    none exists: a registry transaction, so of concurrent declares of one
    queue -- two clients on two nodes -- exactly one places it); the others
    wait for the winner's record and answer with it.  A claim older than
    :data:`CLAIM_STALE` (its declarer died) is taken over; the claim of a
    placed queue is deleted with the queue's record when the queue is
    deleted, that of a failed declare when it fails.  Then the founders are chosen: the nodes the request names, if it
    names any (tests; the queue then carries the arguments ``x-ha-policy:
    nodes`` and ``x-ha-policy-params: [those nodes]`` and placement keeps it
    on them, see :mod:`mirrorq.policy.converge`); else by policy (:func:`mirrorq.policy.converge.declare_placement`):
    the master by ``queue-master-locator`` (the queue argument
    ``x-queue-master-locator`` overrides it; default client-local), mirrors
    as the matching policy's ``ha-mode`` wants, among the nodes this node
    sees up; no matching policy: the master alone (RabbitMQ).  The manager
    asks the managers of those nodes to start a replica each
    (:class:`StartReplica`), sends the founders' list to the first one (it
    creates the ``gm_group`` row), and answers once the founders' master --
    the first founder, which promotes itself through the promotion protocol
    -- has written the ``amqqueue`` record.

Placement that converges (:mod:`mirrorq.policy.converge`)
    The manager subscribes to the registry tables ``policy``, ``amqqueue``
    and ``node`` and to its agent's node up/down events; on each (debounced
    by ``CONVERGE_DELAY``) and on every tick it reads those tables locally
    and runs its :class:`~mirrorq.policy.converge.Converger`: for every queue
    whose master is on *this* node (exactly one node acts per queue), the
    plan's steps become ``StartReplica(join=True)`` to the target node's
    manager (the replica joins the GM group unsynchronised and syncs),
    ``StopReplica`` to a surplus mirror, ``SetPolicy`` to every replica when
    the effective definition (or the replica set) changed, and an
    ``amqqueue.policy`` update.
    The set of up nodes is the membership view of this node (``StatusQuery``
    each tick, ``NodeEvent`` in between) restricted to nodes whose manager is
    registered.

Queue commands for tools (:class:`QueueOps`)
    mirrorctl asks any node's manager to run ``info``, ``sync``,
    ``cancel_sync`` (or any other :class:`~.messages.QueueCommand`) on the
    masters of some queues; the manager finds each master in ``amqqueue``,
    sends the command, and answers one :class:`QueueOpsResult` once every
    master answered or ``QueueOps.timeout`` passed (a master that did not
    answer is an error naming it).

Recovery (after a node restart)
    Every ``RECOVER_EVERY`` seconds the manager reads ``amqqueue`` and
    ``gm_group`` locally.  A durable queue whose last GM view starts with a
    member of this node that is not running here any more (the first member
    is the master, or the mirror that was to be promoted: nobody took over,
    because the whole cluster stopped or this node came back before a mirror
    was promoted), is recovered from the store on disk: a new replica founds a
    new view ``{itself}`` by a registry transaction conditioned on the view
    version it read, so of a recovery and a concurrent promotion exactly one
    wins (the loser's members find themselves removed and stop).  Mirrors'
    stores are not reused here: a mirror rejoins through placement + sync.

Failure: a peer manager that does not answer a StartReplica within
``START_TIMEOUT`` makes the declare fail with an error naming the node.  A
placement start or stop whose effect the record does not show is repeated
after the converger's ``retry_after``.  A master move (ha-mode ``nodes``
without the master's node) is a ``MasterHandOver`` to the master, which hands
over to its synchronised mirror on the first listed node and exits
(:meth:`~mirrorq.queue_process.replica.QueueReplica.hand_over`); one that
does not show in the record is asked for again after ``retry_after``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from thespian.actors import ActorExitRequest, ChildActorExited, WakeupMessage

from mirrorq.gm.shell import parse_member_name
from mirrorq.node.addresses import address_host_port, address_key
from mirrorq.node.log import NodeLog
from mirrorq.node.posting import PostingActor
from mirrorq.node.registry_client import RegistryClient
from mirrorq.node.messages import (
    NodeEvent,
    NodeStatus,
    RegistryChanges,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    StatusQuery,
    Subscribe,
)
from mirrorq.amqp.topology import deleted_queues, queue_binding_deletes
from mirrorq.mnesia_like.tables import key_of
from mirrorq.policy import converge as cv
from mirrorq.policy.matching import match
from mirrorq.policy.store import policies_from_rows
from mirrorq.queue_process.actor import (
    ExitReplica,
    MasterHandOver,
    FoundGroup,
    ReplicaExited,
    ReplicaInit,
    ReplicaStarted,
    SetPolicy,
    StopReplica,
    address_of,
    group_name,
)
from mirrorq.queue_process.host import HostInit, HostReady, default_hosts, host_index
from mirrorq.queue_process.messages import CommandResult, NotMaster, QueueCommand

MANAGER_GLOBAL_NAME = "mirrorq.queue_manager"
RECOVER_EVERY = 1.0
REQUEST_TIMEOUT = 5.0  # a registry request the agent did not answer is given up
START_TIMEOUT = 10.0
CLAIM_STALE = 2 * START_TIMEOUT  # a queue_claim this old belongs to a declare that died
CONVERGE_DELAY = 0.05
PLACEMENT_RETRY = 15.0
MIRRORED_TABLES = ("policy", "amqqueue", "node")  # subscribed to, and kept here
SLOW_TICK = 5  # ticks between periodic scans of every queue


@dataclass
class ManagerInit:
    config: dict
    agent: Any


@dataclass
class DeclareQueue:
    spec: dict  # name, vhost, durable, auto_delete, exclusive_owner, arguments
    nodes: tuple = ()  # () = every member node


@dataclass
class DeclareResult:
    ok: bool
    record: dict = field(default_factory=dict)
    error: str = ""


@dataclass
class StartReplica:
    spec: dict
    request: int
    fresh: bool = False
    join: bool = False  # join the running group as an unsynchronised mirror
    recover: bool = False  # a durable queue coming back after a restart
    policy: dict = field(default_factory=dict)  # the effective policy definition
    members: tuple = ()  # join: the queue's replicas now; a local replica not among them is stale


@dataclass
class QueueOps:
    """From a tool: run ``command`` on the masters of ``queues``
    (``[(vhost, name), ...]``); answered with :class:`QueueOpsResult`."""

    command: str
    queues: tuple
    args: dict = field(default_factory=dict)
    timeout: float = 5.0


@dataclass
class QueueOpsResult:
    """One dict per queue asked, in order: vhost, name, ok, value, error."""

    results: list


@dataclass
class ManagerStatusQuery:
    pass


class QueueManager(PostingActor):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.cfg: dict | None = None
        self.replicas: dict[tuple, tuple] = {}  # (vhost, name) -> (host address, member)
        self.hosts: list = []  # the node's queue hosts (index: host_index)
        self.host_keys: dict[str, int] = {}  # a host's address key -> its index
        self.pending_start: dict[Any, tuple] = {}  # token -> (requester, request, key, host)
        self.start_after_exit: dict[str, tuple] = {}  # stale replica's member -> (StartReplica, requester)
        self.declares: dict[int, dict] = {}
        self.next_request = 0
        self.next_token = 0
        self.tried_recovery: set[str] = set()
        self.recovering: dict[str, dict] = {}  # new member -> row info
        self.registered = False
        self.converger: cv.Converger | None = None
        self.nodes_view: set[str] = set()  # nodes this node's membership sees up
        self.managers_seen: dict[str, str] = {}  # node -> its queue manager's address, as last read
        self.converge_scheduled = False
        self.converge_running = False
        self.converge_again = False
        self.placement_starts: dict[int, tuple] = {}  # request -> (queue key, node)
        self.ops: dict[int, dict] = {}  # QueueOps in progress
        self.op_requests: dict[int, tuple] = {}  # QueueCommand request id -> (ops id, index)
        self.rng = random.Random()
        self.mirror: dict[str, dict] = {t: {} for t in MIRRORED_TABLES}  # table -> key -> row
        self.mirror_loaded: set[str] = set()
        self.mirror_asked: dict[str, float] = {}  # table -> when its load was asked for
        self.ticks = 0
        self.queue_count = 0
        self.registry = RegistryClient("queue_manager", REQUEST_TIMEOUT)
        self.warned: set = set()

    def on_message(self, msg, sender):
        if isinstance(msg, ManagerInit):
            self.cfg, self.agent = msg.config, msg.agent
            self.node = self.cfg["name"]
            self.log = NodeLog(self.cfg["data_dir"], self.node, "queue_manager")
            hp = address_host_port(self.myAddress)
            self.dst = f"{hp[0]}:{hp[1]}" if hp else ""
            self.converger = cv.Converger(self.node, retry_after=PLACEMENT_RETRY)
            self.nodes_view = {self.node}
            n = int(self.cfg.get("queue_hosts") or default_hosts())
            self.hosts = [None] * n
            for i in range(n):
                self._create_host(i)
            self.post(self.agent, Subscribe())
            self.post(self.agent, RegistrySubscribe(MIRRORED_TABLES))
            self._mirror_load()
            self.post(self.agent, StatusQuery())
            self._register()
            self.wakeupAfter(RECOVER_EVERY, payload="tick")
            return
        if self.cfg is None:
            return
        if isinstance(msg, WakeupMessage):
            if msg.payload == "tick":
                self._tick()
                self.wakeupAfter(RECOVER_EVERY, payload="tick")
            elif msg.payload == "converge":
                self.converge_scheduled = False
                self._converge_start()
            elif isinstance(msg.payload, tuple) and msg.payload[0] == "ops-timeout":
                self._ops_timeout(msg.payload[1])
            elif isinstance(msg.payload, tuple) and msg.payload[0] == "declare-timeout":
                self._declare_failed(msg.payload[1], "timed out waiting for replicas / the master's record")
            elif isinstance(msg.payload, tuple) and msg.payload[0] == "declare-poll":
                if msg.payload[1] in self.declares:
                    d = self.declares[msg.payload[1]]
                    self._get("amqqueue", ("declare-record", msg.payload[1]), [d["spec"]["vhost"], d["spec"]["name"]])
            return
        if isinstance(msg, tuple) and len(msg) == 2 and isinstance(msg[1], ReplicaStarted):
            return self._declare_reply(msg[0], msg[1])
        if isinstance(msg, StartReplica):
            return self._start_replica(msg, sender)
        if isinstance(msg, ReplicaStarted):
            return self._replica_started(msg, sender)
        if isinstance(msg, DeclareQueue):
            return self._declare(msg, sender)
        if isinstance(msg, RegistryRows):
            return self._rows(msg)
        if isinstance(msg, RegistryResult):
            return self._result(msg)
        if isinstance(msg, RegistryChanges):
            self._mirror_changes(msg.changes)
            # a queue deleted by its master on this node: remove its bindings (AMQP front end's rows)
            for vhost, name in deleted_queues(msg.changes or (), self.node):
                self._get("binding", ("unbind-deleted", vhost, name))
            self._declare_changes(msg.changes or ())
            return self._schedule_converge()
        if isinstance(msg, NodeEvent):
            if msg.kind == "up":
                self.nodes_view.add(msg.node)
            elif msg.kind == "down" and msg.node != self.node:
                self.nodes_view.discard(msg.node)
            return self._schedule_converge()
        if isinstance(msg, NodeStatus):
            self.nodes_view = {n for n, v in msg.view.items() if v.get("state") == "up"} | {self.node}
            return
        if isinstance(msg, QueueOps):
            return self._queue_ops(msg, sender)
        if isinstance(msg, CommandResult):
            return self._op_answer(msg.request_id, msg.ok, msg.value, msg.error)
        if isinstance(msg, NotMaster):
            req = msg.request
            rid = getattr(req, "request_id", None)
            if rid is not None:
                self._op_answer(rid, False, None, f"the replica asked is not the master (master: {msg.master})")
            return
        if isinstance(msg, HostReady):
            if 0 <= msg.index < len(self.hosts) and address_host_port(sender):
                self.hosts[msg.index] = sender
                self.host_keys[address_key(sender)] = msg.index
            return
        if isinstance(msg, ReplicaExited):
            return self._replica_exited(msg.member, msg.key, msg.reason)
        if isinstance(msg, ChildActorExited):
            index = self.host_keys.pop(address_key(msg.childAddress), None)
            if index is not None:  # a queue host died: its replicas with it
                self.log("queue_host_exited", level="warning", host=index)
                for key, (_addr, member) in list(self.replicas.items()):
                    if host_index(key[0], key[1], len(self.hosts)) == index:
                        self._replica_exited(member, key, "its queue host exited")
                self._create_host(index)
            return
        if isinstance(msg, ManagerStatusQuery):
            self.answer(sender, {"node": self.node, "registered": self.registered,
                               "replicas": {f"{k[0]}/{k[1]}": v[1] for k, v in self.replicas.items()}})
            return
        if isinstance(msg, ActorExitRequest):
            return

    # ---- registration -------------------------------------------------------------
    def _register(self) -> None:
        hp = address_host_port(self.myAddress)
        row = {
            "name": self.node,
            "admin": f"{self.cfg['host']}:{self.cfg['admin_port']}",
            "amqp_port": int(self.cfg.get("amqp_port") or 0),
            "state": "member",
            "manager": f"{hp[0]}:{hp[1]}",
        }
        self._txn({"ops": [{"op": "put", "table": "node", "key": [self.node], "record": row}]}, ("register",))

    # ---- registry plumbing: requests with ids (any number outstanding) ------------------
    def _txn(self, txn: dict, tag: tuple) -> None:
        self.post(self.agent, self.registry.txn(time.monotonic(), txn, ("txn", tag)))

    def _get(self, table: str, tag: tuple, key: Any = None) -> None:
        self.post(self.agent, self.registry.get(time.monotonic(), table, key, ("get", tag)))

    def _result(self, msg: RegistryResult) -> None:
        ctx = self.registry.answer(msg)
        if ctx is None or ctx[0] != "txn":
            return
        tag = ctx[1]
        if tag[0] == "register":
            if msg.ok:
                self.registered = True
                self.log("manager_registered")
            else:
                self.wakeupAfter(0.2, payload="tick")  # retried from _tick
        elif tag[0] == "recover":
            self._recover_result(tag[1], msg)
        elif tag[0] == "claim":
            self._claimed(tag[1], msg.ok)
        elif tag[0] == "policy":
            if not msg.ok:
                self.log("policy_record_failed", level="warning", queue=list(tag[1]), error=msg.error)

    def _rows(self, msg: RegistryRows) -> None:
        ctx = self.registry.answer(msg)
        if ctx is None or ctx[0] != "get":
            return
        tag = ctx[1]
        if tag[0] == "mirror-load":
            self._mirror_loaded(tag[1], msg.rows if msg.ok else None)
        elif tag[0] == "scan-queues":
            self._scan(msg.rows if msg.ok else None, tag)
        elif tag[0] == "scan-groups":
            self._scan_groups(msg.rows if msg.ok else None, tag[1])
        elif tag[0] == "declare-nodes":
            self._declare_nodes(tag[1], msg.rows if msg.ok else [])
        elif tag[0] == "declare-check":
            self._declare_check(tag[1], msg.rows if msg.ok else [])
        elif tag[0] == "declare-record":
            self._declare_record(tag[1], msg.rows if msg.ok else [])
        elif tag[0] == "claim-read":
            self._claim_rows(tag[1], msg.rows if msg.ok else [])
        elif tag[0] == "unbind-deleted":
            ops = queue_binding_deletes(msg.rows if msg.ok else [], tag[1], tag[2])
            if ops:
                self._txn({"ops": ops}, ("unbind-deleted",))
            if not msg.ok:
                self.log("unbind_deleted_failed", level="warning", queue=[tag[1], tag[2]], error=msg.error)
        elif tag[0] == "declare-policies":
            self._declare_policies(tag[1], msg.rows if msg.ok else [])
        elif tag[0] == "conv-policy":
            self._get("node", ("conv-node", msg.rows if msg.ok else None))
        elif tag[0] == "conv-node":
            self._get("amqqueue", ("conv-queues", tag[1], msg.rows if msg.ok else None))
        elif tag[0] == "conv-queues":
            self._converge(tag[1], tag[2], msg.rows if msg.ok else None)
        elif tag[0] == "ops-queues":
            self._ops_rows(tag[1], msg.rows if msg.ok else None, msg.error)

    # ---- replicas on this node -------------------------------------------------------
    def _create_host(self, index: int) -> None:
        addr = self.createActor("mirrorq.queue_process.host.QueueHost")
        self.hosts[index] = addr
        self.send(addr, HostInit(self.cfg["data_dir"], self.node, self.agent, self.myAddress, index))

    def _host_for(self, key: tuple) -> Any:
        return self.hosts[host_index(key[0], key[1], len(self.hosts))]

    def _replica_exited(self, member: str, key: tuple, reason: str) -> None:
        waiting = self.start_after_exit.pop(member, None)
        if self.replicas.get(key, (None, None))[1] == member:
            del self.replicas[key]
            self.log("replica_exited", level="warning" if reason.startswith("crashed") else "info",
                     queue=list(key), member=member, reason=reason)
        if waiting is not None:
            self._start_replica(*waiting)

    def _start_replica(self, msg: StartReplica, requester) -> None:
        key = (msg.spec.get("vhost", "/"), msg.spec["name"])
        if msg.join:
            if key in self.replicas:  # idempotent: this node already hosts one
                addr, member = self.replicas[key]
                if not msg.members or member in msg.members:
                    if requester is not None:
                        self.post(requester, (msg.request, ReplicaStarted(member, self.node, 0)))
                    return
                # a leftover that is not in the queue's group (a founder of a
                # declare that failed, a replica of a view that moved on without
                # it): it would be reported started for ever and never join
                # (its store is the queue's directory here: the new one starts once it has exited)
                self.log("stale_replica_replaced", queue=list(key), member=member)
                del self.replicas[key]
                self.start_after_exit[member] = (msg, requester)
                self.post(member, ExitReplica())
                return
            if any((m.spec.get("vhost", "/"), m.spec["name"]) == key for m, _ in self.start_after_exit.values()):
                return  # a stale one is stopping; the new one starts when it has gone
            if any(p[2] == key for p in self.pending_start.values()):
                return  # one is starting; its requester hears about it
        addr = self._host_for(key)
        self.next_token += 1
        self.pending_start[self.next_token] = (requester, msg.request, key, addr)
        self.post(addr, ReplicaInit(dict(msg.spec), self.cfg["data_dir"], self.node, self.agent, msg.fresh,
                                    self.next_token, join=msg.join, recover=msg.recover,
                                    policy=dict(msg.policy or {})))

    def _replica_started(self, msg: ReplicaStarted, child) -> None:
        pend = self.pending_start.pop(msg.token, None)
        if pend is None:
            return
        requester, request, key, addr = pend
        self.replicas[key] = (child if address_host_port(child) else addr, msg.member)
        self.log("replica_created", queue=list(key), member=msg.member)
        if requester is not None:
            self.post(requester, (request, msg))
        else:
            self._recovered_replica(request, msg)

    # ---- declare ---------------------------------------------------------------------------
    def _declare(self, msg: DeclareQueue, sender) -> None:
        spec = dict(msg.spec)
        spec.setdefault("vhost", "/")
        if msg.nodes and "x-ha-policy" not in (spec.get("arguments") or {}):
            # named nodes pin the placement (RabbitMQ 2.x's declaration arguments)
            spec["arguments"] = {**(spec.get("arguments") or {}),
                                 "x-ha-policy": "nodes", "x-ha-policy-params": list(msg.nodes)}
        self.next_request += 1
        rid = self.next_request
        self.declares[rid] = {"spec": spec, "sender": sender, "bundled": self.bundled, "nodes": tuple(msg.nodes),
                              "started": {}, "want": ()}
        self._get("amqqueue", ("declare-check", rid), [spec["vhost"], spec["name"]])
        self.wakeupAfter(START_TIMEOUT, payload=("declare-timeout", rid))

    def _declare_check(self, rid: int, rows: list) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if rows and rows[0].get("pid"):
            self._declare_done(rid, DeclareResult(True, rows[0]))
            return
        self._claim(rid, None)

    def _claim(self, rid: int, stale: dict | None) -> None:
        """Claim the queue's name for this declare (or take over ``stale``)."""
        d = self.declares[rid]
        key = [d["spec"]["vhost"], d["spec"]["name"]]
        claim = {"vhost": key[0], "name": key[1], "node": self.node, "request": rid, "time": time.time()}
        if stale is None:
            checks = [{"table": "queue_claim", "key": key, "absent": True}]
        else:
            checks = [{"table": "queue_claim", "key": key, "field": "time", "equals": stale["time"]}]
        self._txn({"checks": checks, "ops": [{"op": "put", "table": "queue_claim", "key": key, "record": claim}]},
                  ("claim", rid))

    def _claimed(self, rid: int, ok: bool) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if ok:
            d["claimed"] = True
            if d["nodes"]:
                self._get("node", ("declare-nodes", rid))
            else:
                self._get("policy", ("declare-policies", rid))
            return
        # another declare of this queue holds the name: answer with its record (or take a dead one's claim over)
        key = [d["spec"]["vhost"], d["spec"]["name"]]
        self._get("queue_claim", ("claim-read", rid), key)

    def _claim_rows(self, rid: int, rows: list) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if rows and time.time() - float(rows[0].get("time", 0)) > CLAIM_STALE:
            self.log("queue_claim_taken_over", queue=d["spec"]["name"], from_node=rows[0].get("node"))
            self._claim(rid, rows[0])
            return
        if not rows:
            self._claim(rid, None)  # released meanwhile: claim it (the record may exist now: checked after)
            return
        d["other"] = True  # its record answers this declare
        self.wakeupAfter(0.05, payload=("declare-poll", rid))

    def _declare_policies(self, rid: int, rows: list) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        policies, errors = policies_from_rows(rows)
        for e in errors:
            self._warn_once(("bad-policy", e), "policy_invalid", error=e)
        d["policy"] = match(policies, d["spec"]["vhost"], d["spec"]["name"], "queue")
        self._get("node", ("declare-nodes", rid))

    def _declare_nodes(self, rid: int, rows: list) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        managers = {r["name"]: r.get("manager") for r in rows if r.get("manager")}
        want = list(d["nodes"])
        if not want:  # by policy (see the module docstring)
            up = (self.nodes_view & set(managers)) | {self.node}
            arguments = d["spec"].get("arguments") or {}
            try:
                want = cv.declare_placement(
                    d.get("policy"), self.node, up, queue_name=d["spec"]["name"],
                    masters_per_node=getattr(self, "masters_per_node", {}), rng=self.rng,
                    locator=arguments.get("x-queue-master-locator"), arguments=arguments)
            except ValueError as e:
                self._declare_failed(rid, str(e))
                return
        missing = [n for n in want if n not in managers]
        if missing:
            self._declare_failed(rid, f"no queue manager known on node(s) {', '.join(missing)}")
            return
        d["want"] = tuple(want)
        try:
            definition = cv.effective_placement_definition(d.get("policy"), d["spec"].get("arguments")) or {}
        except ValueError as e:
            self._declare_failed(rid, str(e))
            return
        for n in want:
            self.post(address_of(managers[n]), StartReplica(d["spec"], rid, policy=definition))

    def _declare_reply(self, rid: int, started: ReplicaStarted) -> None:
        d = self.declares.get(rid)
        if d is None:
            placed = self.placement_starts.pop(rid, None)
            if placed is not None:
                self.log("mirror_started", queue=list(placed[0]), node=started.node, member=started.member)
            return
        d["started"][started.node] = started.member
        if set(d["started"]) >= set(d["want"]):
            founders = tuple(d["started"][n] for n in d["want"])
            self.post(founders[0], FoundGroup(founders))
            d["founders"] = founders
            self.wakeupAfter(0.1, payload=("declare-poll", rid))

    def _declare_changes(self, changes: list) -> None:
        """A declare waiting for its queue's record hears of it as soon as
        the registry applies it (the poll is the fallback)."""
        if not self.declares:
            return
        waiting = {(d["spec"]["vhost"], d["spec"]["name"]): rid for rid, d in self.declares.items() if "founders" in d or d.get("other")}
        for table, key, _old, new in changes:
            if table == "amqqueue" and new is not None and isinstance(key, (list, tuple)) and len(key) == 2:
                rid = waiting.get((key[0], key[1]))
                if rid is not None and new.get("pid"):
                    self._declare_record(rid, [new], poll=False)

    def _declare_record(self, rid: int, rows: list, poll: bool = True) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if rows and rows[0].get("pid") and d.get("other"):
            self._declare_done(rid, DeclareResult(True, dict(rows[0])))  # the concurrent declare placed it
        elif rows and rows[0].get("pid") in d.get("founders", ()):
            record = dict(rows[0])
            policy = d.get("policy")
            if policy is not None and record.get("policy") != policy.name:
                key = [record["vhost"], record["name"]]
                self._txn({"checks": [{"table": "amqqueue", "key": key, "exists": True}],
                           "ops": [{"op": "update", "table": "amqqueue", "key": key,
                                    "fields": {"policy": policy.name}}]}, ("policy", tuple(key)))
                record["policy"] = policy.name
            self._declare_done(rid, DeclareResult(True, record))
        elif poll:
            self.wakeupAfter(0.05, payload=("declare-poll", rid))

    def _declare_done(self, rid: int, result: DeclareResult) -> None:
        d = self.declares.pop(rid, None)
        if d is not None:
            self.tell(d["sender"], result, d["bundled"])
            # a placed queue keeps its claim until it is deleted (deleted with
            # its record: one transaction fewer per declare); a failed declare frees the name
            if d.get("claimed") and not result.ok:
                key = [d["spec"]["vhost"], d["spec"]["name"]]
                self._txn({"checks": [{"table": "queue_claim", "key": key, "field": "request", "equals": rid},
                                      {"table": "queue_claim", "key": key, "field": "node", "equals": self.node}],
                           "ops": [{"op": "delete", "table": "queue_claim", "key": key}]}, ("unclaim", rid))

    def _declare_failed(self, rid: int, why: str) -> None:
        d = self.declares.get(rid)
        if d is not None:
            self.log("declare_failed", level="error", queue=d["spec"]["name"], error=why)
            self._declare_done(rid, DeclareResult(False, {}, f"queue '{d['spec']['name']}': {why}"))

    # ---- recovery ----------------------------------------------------------------------------
    def _tick(self) -> None:
        self.post(self.agent, StatusQuery())
        for kind, tag in self.registry.expired(time.monotonic()):
            # the agent never answered (e.g. the request was buffered while
            # this node was joining and then dropped)
            self.log("registry_request_timeout", level="warning", request=kind, tag=str(tag))
        if not self.registered:
            if not any(kind == "txn" and tag[:1] == ("register",) for kind, tag in self.registry.pending()):
                self._register()
            return
        # the periodic scan and placement round (recovery, placement retries)
        # run every SLOW_TICK; changes and node events run placement at once
        self.ticks += 1
        self._mirror_load()
        if self.ticks % SLOW_TICK == 1 or self.recovering:
            if "amqqueue" in self.mirror_loaded:
                q = self.mirror["amqqueue"]
                self._scan([q[k] for k in sorted(q)], ("scan-queues",))
            else:
                self._get("amqqueue", ("scan-queues",))
            self._schedule_converge()

    def _scan(self, rows: list | None, tag: tuple) -> None:
        durable = [r for r in rows or () if r.get("durable") and (r["vhost"], r["name"]) not in self.replicas]
        if durable:
            self._get("gm_group", ("scan-groups", durable))

    def _scan_groups(self, groups: list | None, rows: list) -> None:
        """Recover the queues whose GM view is led by a member of this node
        that is not running any more (see the module docstring)."""
        if groups is None:
            return
        by_name = {g["name"]: g for g in groups}
        hosted = {m for _, m in self.replicas.values()}
        for row in rows:
            g = by_name.get(group_name(row["vhost"], row["name"]))
            if g is None or not g["members"]:
                continue
            first = g["members"][0]
            try:
                ref = parse_member_name(first)
            except ValueError:
                continue
            if ref.node != self.node or first in hosted or first in self.tried_recovery:
                continue
            self.tried_recovery.add(first)
            self.next_request += 1
            self.recovering[self.next_request] = {"row": row, "version": g["version"]}
            spec = {k: row[k] for k in ("name", "vhost", "durable", "auto_delete", "exclusive_owner", "arguments")}
            self.log("recovering_queue", queue=row["name"], old_member=first, view_version=g["version"])
            self._start_replica(StartReplica(spec, self.next_request, recover=True), None)

    def _recovered_replica(self, request: int, started: ReplicaStarted) -> None:
        rec = self.recovering.get(request)
        if rec is None:
            return
        rec["member"] = started.member
        row = rec["row"]
        g = group_name(row["vhost"], row["name"])
        txn = {
            "checks": [{"table": "gm_group", "key": [g], "field": "version", "equals": rec["version"]}],
            "ops": [{"op": "put", "table": "gm_group", "key": [g], "record": {"name": g, "version": rec["version"] + 1, "members": [started.member]}}],
        }
        self._txn(txn, ("recover", request))

    def _recover_result(self, request: int, msg: RegistryResult) -> None:
        rec = self.recovering.pop(request, None)
        if rec is None:
            return
        if msg.ok:
            self.log("queue_recovered", queue=rec["row"]["name"], member=rec.get("member"))
        else:
            self.log("queue_recovery_lost", level="warning", queue=rec["row"]["name"], error=msg.error)
            key = (rec["row"]["vhost"], rec["row"]["name"])
            entry = self.replicas.pop(key, None)
            if entry is not None:
                self.post(entry[1], ExitReplica())


    # ---- placement -------------------------------------------------------------------------
    def _warn_once(self, key: tuple, event: str, **fields: Any) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self.log(event, level="warning", **fields)

    def _schedule_converge(self) -> None:
        if not self.converge_scheduled:
            self.converge_scheduled = True
            # a round reads and plans every queue: with many queues, batch more changes per round
            self.wakeupAfter(CONVERGE_DELAY + self.queue_count / 5000, payload="converge")

    def _converge_start(self) -> None:
        if self.converge_running:  # one round at a time; another follows
            self.converge_again = True
            return
        if all(t in self.mirror_loaded for t in MIRRORED_TABLES):
            # the subscribed tables as of the last change heard: no registry read
            rows = {t: [self.mirror[t][k] for k in sorted(self.mirror[t])] for t in MIRRORED_TABLES}
            self._converge(rows["policy"], rows["node"], rows["amqqueue"])
            return
        self.converge_running = True
        self._get("policy", ("conv-policy",))

    # ---- the subscribed tables, kept here from the registry's changes ---------------------------
    def _mirror_load(self) -> None:
        now = time.monotonic()
        for t in MIRRORED_TABLES:
            if t not in self.mirror_loaded and now - self.mirror_asked.get(t, float("-inf")) > REQUEST_TIMEOUT:
                self.mirror_asked[t] = now
                self._get(t, ("mirror-load", t))

    def _mirror_loaded(self, table: str, rows: list | None) -> None:
        if rows is None:
            self.mirror_asked.pop(table, None)
            return  # asked again on the next tick
        # the read answers a snapshot newer than every change heard before it
        # (the agent sends both in order): it replaces the table
        self.mirror[table] = {key_of(table, r): r for r in rows}
        self.mirror_loaded.add(table)
        self.mirror_asked.pop(table, None)

    def _mirror_changes(self, changes: list | None) -> None:
        if changes is None:  # the registry was reset from a snapshot: load again
            self.mirror_loaded.clear()
            self.mirror_asked.clear()
            self._mirror_load()
            return
        for table, key, _old, new in changes:
            if table in self.mirror_loaded:
                k = tuple(key) if isinstance(key, (list, tuple)) else (key,)
                if new is None:
                    self.mirror[table].pop(k, None)
                else:
                    self.mirror[table][k] = new

    def _converge(self, policy_rows: list | None, node_rows: list | None, queue_rows: list | None) -> None:
        self.converge_running = False
        if self.converge_again:
            self.converge_again = False
            self._schedule_converge()
        if policy_rows is None or node_rows is None or queue_rows is None:
            return
        policies, errors = policies_from_rows(policy_rows)
        for e in errors:
            self._warn_once(("bad-policy", e), "policy_invalid", error=e)
        managers = {r["name"]: r.get("manager") for r in node_rows if r.get("manager")}
        for n, addr in managers.items():
            if self.managers_seen.get(n, addr) != addr:
                self.converger.forget_node(n)  # restarted: what we sent its old manager is lost
        self.managers_seen = dict(managers)
        counts: dict[str, int] = {}
        for r in queue_rows:
            try:
                if r.get("pid"):
                    n = cv.node_of(r["pid"])
                    counts[n] = counts.get(n, 0) + 1
            except ValueError:
                pass
        self.masters_per_node = counts
        self.queue_count = len(queue_rows)
        up = (self.nodes_view & set(managers)) | {self.node}
        for a in self.converger.converge(time.monotonic(), queue_rows, policies, up):
            self._placement_action(a, managers)

    def _placement_action(self, a: Any, managers: dict) -> None:
        if isinstance(a, cv.StartMirrorOn):
            if a.node not in managers:
                return
            self.next_request += 1
            self.placement_starts[self.next_request] = ((a.vhost, a.name), a.node)
            self.log("start_mirror", queue=[a.vhost, a.name], node=a.node)
            self.post(address_of(managers[a.node]),
                      StartReplica(dict(a.spec), self.next_request, join=True, policy=dict(a.definition or {}),
                                   members=tuple(a.members)))
        elif isinstance(a, cv.StopMirrorMember):
            self.log("stop_mirror", queue=[a.vhost, a.name], node=a.node, member=a.member)
            self.post(a.member, StopReplica())
        elif isinstance(a, cv.RecordPolicy):
            key = [a.vhost, a.name]
            self.log("queue_policy", queue=key, policy=a.policy)
            self._txn({"checks": [{"table": "amqqueue", "key": key, "exists": True}],
                       "ops": [{"op": "update", "table": "amqqueue", "key": key, "fields": {"policy": a.policy}}]},
                      ("policy", tuple(key)))
        elif isinstance(a, cv.PushDefinition):
            self.log("queue_definition", queue=[a.vhost, a.name], definition=a.definition, replicas=len(a.members))
            for m in a.members:
                try:
                    self.post(m, SetPolicy(dict(a.definition)))
                except ValueError:
                    pass
        elif isinstance(a, cv.TransferMasterTo):
            self.log("master_transfer", queue=[a.vhost, a.name], node=a.node, master=a.member)
            self.post(a.member, MasterHandOver(a.node))
        elif isinstance(a, cv.BadRecord):
            self._warn_once(("bad-record", a.vhost, a.name), "queue_record_invalid", queue=[a.vhost, a.name], error=a.error)

    # ---- queue commands for tools -----------------------------------------------------------
    def _queue_ops(self, msg: QueueOps, sender) -> None:
        self.next_request += 1
        rid = self.next_request
        queues = [tuple(q) for q in msg.queues]
        self.ops[rid] = {"sender": sender, "bundled": self.bundled, "msg": msg, "queues": queues,
                         "results": [None] * len(queues)}
        if not queues:
            return self._ops_finish(rid)
        self._get("amqqueue", ("ops-queues", rid))
        self.wakeupAfter(max(0.1, float(msg.timeout)), payload=("ops-timeout", rid))

    def _ops_rows(self, rid: int, rows: list | None, error: str) -> None:
        op = self.ops.get(rid)
        if op is None:
            return
        if rows is None:
            for i, (vhost, name) in enumerate(op["queues"]):
                op["results"][i] = _op_result(vhost, name, False, None, f"registry read failed: {error}")
            return self._ops_finish(rid)
        by_key = {(r["vhost"], r["name"]): r for r in rows}
        msg: QueueOps = op["msg"]
        for i, (vhost, name) in enumerate(op["queues"]):
            row = by_key.get((vhost, name))
            if row is None:
                op["results"][i] = _op_result(vhost, name, False, None, f"no queue '{name}' in vhost '{vhost}'")
                continue
            pid = row.get("pid")
            try:
                master_node = cv.node_of(pid)
            except ValueError:
                op["results"][i] = _op_result(vhost, name, False, None, f"queue '{name}' in vhost '{vhost}' has no master")
                continue
            if master_node not in self.nodes_view:
                op["results"][i] = _op_result(vhost, name, False, None,
                                              f"queue '{name}' in vhost '{vhost}': its master's node {master_node} is down")
                continue
            self.next_request += 1
            self.op_requests[self.next_request] = (rid, i)
            self.post(pid, QueueCommand(name, (self.dst, 0), self.next_request, msg.command, dict(msg.args)))
        self._ops_maybe_done(rid)

    def _op_answer(self, request_id: int, ok: bool, value: Any, error: str) -> None:
        where = self.op_requests.pop(request_id, None)
        if where is None:
            return
        rid, i = where
        op = self.ops.get(rid)
        if op is None:
            return
        vhost, name = op["queues"][i]
        op["results"][i] = _op_result(vhost, name, ok, value, error)
        self._ops_maybe_done(rid)

    def _ops_maybe_done(self, rid: int) -> None:
        op = self.ops.get(rid)
        if op is not None and all(r is not None for r in op["results"]):
            self._ops_finish(rid)

    def _ops_timeout(self, rid: int) -> None:
        op = self.ops.get(rid)
        if op is None:
            return
        for i, r in enumerate(op["results"]):
            if r is None:
                vhost, name = op["queues"][i]
                op["results"][i] = _op_result(vhost, name, False, None,
                                              f"the master of queue '{name}' in vhost '{vhost}' did not answer "
                                              f"{op['msg'].command!r} within {op['msg'].timeout:g}s")
        self._ops_finish(rid)

    def _ops_finish(self, rid: int) -> None:
        op = self.ops.pop(rid, None)
        if op is None:
            return
        for k in [k for k, v in self.op_requests.items() if v[0] == rid]:
            del self.op_requests[k]
        self.tell(op["sender"], QueueOpsResult(list(op["results"])), op["bundled"])


def _op_result(vhost: str, name: str, ok: bool, value: Any, error: str) -> dict:
    return {"vhost": vhost, "name": name, "ok": bool(ok), "value": value, "error": error or ""}
