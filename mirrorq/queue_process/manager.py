"""The queue manager: one per node; declares queues, starts and recovers replicas.

Global name ``mirrorq.queue_manager`` on every node (created by the node
daemon).  It registers its address in the registry's ``node`` table (field
``manager``) so that managers find each other without any convention.

Declare (:class:`DeclareQueue`, from a channel on any node)
    If ``amqqueue`` already has the queue, the answer is its record.
    Otherwise the manager asks the managers of the chosen nodes (all nodes
    that are members, the declaring node first, until policies choose:
    [policy-sync]) to start a replica each (:class:`StartReplica`), sends
    the founders' list to the first one (it creates the ``gm_group`` row),
    and answers once the founders' master -- the first founder, which
    promotes itself through the promotion protocol -- has written the
    ``amqqueue`` record.

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
    stores are not reused here: a mirror rejoins through sync ([policy-sync]),
    so after a full restart a queue runs unmirrored until then.

Failure: a peer manager that does not answer a StartReplica within
``START_TIMEOUT`` makes the declare fail with an error naming the node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from thespian.actors import Actor, ActorExitRequest, ChildActorExited, WakeupMessage

from mirrorq.gm.shell import address_host_port, member_address, parse_member_name
from mirrorq.node.log import NodeLog
from mirrorq.node.messages import RegistryGet, RegistryResult, RegistryRows, RegistryTxn
from mirrorq.queue_process.actor import FoundGroup, ReplicaInit, ReplicaStarted, address_of, group_name

MANAGER_GLOBAL_NAME = "mirrorq.queue_manager"
RECOVER_EVERY = 1.0
START_TIMEOUT = 10.0


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


@dataclass
class ManagerStatusQuery:
    pass


class QueueManager(Actor):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.cfg: dict | None = None
        self.replicas: dict[tuple, tuple] = {}  # (vhost, name) -> (address, member)
        self.children: dict[Any, tuple] = {}  # address -> (vhost, name)
        self.pending_start: dict[Any, tuple] = {}  # child address -> (requester, request)
        self.declares: dict[int, dict] = {}
        self.next_request = 0
        self.next_token = 0
        self.tried_recovery: set[str] = set()
        self.recovering: dict[str, dict] = {}  # new member -> row info
        self.registered = False

    def receiveMessage(self, msg, sender):
        if isinstance(msg, ManagerInit):
            self.cfg, self.agent = msg.config, msg.agent
            self.node = self.cfg["name"]
            self.log = NodeLog(self.cfg["data_dir"], self.node, "queue_manager")
            self._register()
            self.wakeupAfter(RECOVER_EVERY, payload="tick")
            return
        if self.cfg is None:
            return
        if isinstance(msg, WakeupMessage):
            if msg.payload == "tick":
                self._tick()
                self.wakeupAfter(RECOVER_EVERY, payload="tick")
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
        if isinstance(msg, ChildActorExited):
            key = self.children.pop(_key(msg.childAddress), None)
            if key is not None:
                self.log("replica_exited", level="warning", queue=list(key))
                if _key(self.replicas.get(key, (None,))[0]) == _key(msg.childAddress):
                    del self.replicas[key]
            return
        if isinstance(msg, ManagerStatusQuery):
            self.send(sender, {"node": self.node, "replicas": {f"{k[0]}/{k[1]}": v[1] for k, v in self.replicas.items()}})
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

    # ---- registry plumbing: one outstanding request at a time, in order -------------------
    def _txn(self, txn: dict, tag: tuple) -> None:
        self._queue_req(("txn", txn, tag))

    def _get(self, table: str, tag: tuple, key: Any = None) -> None:
        self._queue_req(("get", table, key, tag))

    def _queue_req(self, req: tuple) -> None:
        if not hasattr(self, "_reqs"):
            self._reqs = []
        self._reqs.append(req)
        if len(self._reqs) == 1:
            self._send_req()

    def _send_req(self) -> None:
        req = self._reqs[0]
        if req[0] == "txn":
            self.send(self.agent, RegistryTxn(req[1]))
        else:
            self.send(self.agent, RegistryGet(req[1], req[2]))

    def _pop_req(self) -> tuple:
        req = self._reqs.pop(0)
        if self._reqs:
            self._send_req()
        return req

    def _result(self, msg: RegistryResult) -> None:
        if not getattr(self, "_reqs", None) or self._reqs[0][0] != "txn":
            return
        req = self._pop_req()
        tag = req[2]
        if tag[0] == "register":
            if msg.ok:
                self.registered = True
                self.log("manager_registered")
            else:
                self.wakeupAfter(0.2, payload="tick")  # retried from _tick
        elif tag[0] == "recover":
            self._recover_result(tag[1], msg)

    def _rows(self, msg: RegistryRows) -> None:
        if not getattr(self, "_reqs", None) or self._reqs[0][0] != "get":
            return
        req = self._pop_req()
        tag = req[3]
        if tag[0] == "scan-queues":
            self._scan(msg.rows if msg.ok else None, tag)
        elif tag[0] == "scan-groups":
            self._scan_groups(msg.rows if msg.ok else None, tag[1])
        elif tag[0] == "declare-nodes":
            self._declare_nodes(tag[1], msg.rows if msg.ok else [])
        elif tag[0] == "declare-check":
            self._declare_check(tag[1], msg.rows if msg.ok else [])
        elif tag[0] == "declare-record":
            self._declare_record(tag[1], msg.rows if msg.ok else [])

    # ---- replicas on this node -------------------------------------------------------
    def _start_replica(self, msg: StartReplica, requester) -> None:
        key = (msg.spec.get("vhost", "/"), msg.spec["name"])
        addr = self.createActor("mirrorq.queue_process.actor.QueueReplicaActor")
        self.next_token += 1
        self.pending_start[self.next_token] = (requester, msg.request, key, addr)
        self.send(addr, ReplicaInit(dict(msg.spec), self.cfg["data_dir"], self.node, self.agent, msg.fresh, self.next_token))

    def _replica_started(self, msg: ReplicaStarted, child) -> None:
        pend = self.pending_start.pop(msg.token, None)
        if pend is None:
            return
        requester, request, key, addr = pend
        self.replicas[key] = (addr, msg.member)
        self.children[_key(addr)] = key
        self.log("replica_created", queue=list(key), member=msg.member)
        if requester is not None:
            self.send(requester, (request, msg))
        else:
            self._recovered_replica(request, msg)

    # ---- declare ---------------------------------------------------------------------------
    def _declare(self, msg: DeclareQueue, sender) -> None:
        spec = dict(msg.spec)
        spec.setdefault("vhost", "/")
        self.next_request += 1
        rid = self.next_request
        self.declares[rid] = {"spec": spec, "sender": sender, "nodes": tuple(msg.nodes), "started": {}, "want": ()}
        self._get("amqqueue", ("declare-check", rid), [spec["vhost"], spec["name"]])
        self.wakeupAfter(START_TIMEOUT, payload=("declare-timeout", rid))

    def _declare_check(self, rid: int, rows: list) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if rows and rows[0].get("pid"):
            self._declare_done(rid, DeclareResult(True, rows[0]))
            return
        self._get("node", ("declare-nodes", rid))

    def _declare_nodes(self, rid: int, rows: list) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        managers = {r["name"]: r.get("manager") for r in rows if r.get("manager")}
        want = list(d["nodes"])
        if not want:  # every node, this one first (RabbitMQ's client-local master)
            want = sorted(managers)
            if self.node in want:
                want.remove(self.node)
                want.insert(0, self.node)
        missing = [n for n in want if n not in managers]
        if missing:
            self._declare_failed(rid, f"no queue manager known on node(s) {', '.join(missing)}")
            return
        d["want"] = tuple(want)
        for n in want:
            self.send(address_of(managers[n]), StartReplica(d["spec"], rid))

    def _declare_reply(self, rid: int, started: ReplicaStarted) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        d["started"][started.node] = started.member
        if set(d["started"]) >= set(d["want"]):
            founders = tuple(d["started"][n] for n in d["want"])
            self.send(member_address(founders[0]), FoundGroup(founders))
            d["founders"] = founders
            self.wakeupAfter(0.1, payload=("declare-poll", rid))

    def _declare_record(self, rid: int, rows: list) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if rows and rows[0].get("pid") in d.get("founders", ()):
            self._declare_done(rid, DeclareResult(True, rows[0]))
        else:
            self.wakeupAfter(0.05, payload=("declare-poll", rid))

    def _declare_done(self, rid: int, result: DeclareResult) -> None:
        d = self.declares.pop(rid, None)
        if d is not None:
            self.send(d["sender"], result)

    def _declare_failed(self, rid: int, why: str) -> None:
        d = self.declares.get(rid)
        if d is not None:
            self.log("declare_failed", level="error", queue=d["spec"]["name"], error=why)
            self._declare_done(rid, DeclareResult(False, {}, f"queue '{d['spec']['name']}': {why}"))

    # ---- recovery ----------------------------------------------------------------------------
    def _tick(self) -> None:
        if not self.registered:
            self._register()
            return
        self._get("amqqueue", ("scan-queues",))

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
            self._start_replica(StartReplica(spec, self.next_request), None)

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
                self.send(entry[0], ActorExitRequest())


def _key(address: Any) -> str:
    """A hashable key for a Thespian address (ActorAddress is not hashable)."""
    hp = address_host_port(address)
    return f"{hp[0]}:{hp[1]}" if hp else str(address)
