"""The node agent: the Thespian actor shell around the membership core.

One per node, created by the node daemon under the global name
``mirrorq.node_agent``.  It

* runs :class:`mirrorq.node.membership.Membership` (its timers and the
  registry's in one :class:`~mirrorq.node.timers.TimerTable`: one
  ``wakeupAfter`` armed for the earliest deadline, none for a Raft election
  timer every ``AppendEntries`` re-arms; messages as :class:`PeerEnvelope`);
* finds other nodes by asking their Thespian *admin* (fixed ``host:port``, from
  the seed list, from peers remembered in ``peers.json``, or learnt from a
  heartbeat) for its status: the reply names the node (capability
  ``mirrorq.node``) and gives its agent's address (global actors).  No
  Thespian convention is used, so nothing depends on any one node staying up;
* is the parent of every local actor (:class:`CreateLocal`) and relays
  ``ChildActorExited`` as :class:`ActorDown`;
* publishes node up/down to local subscribers as :class:`NodeEvent`;
* runs the node's resource alarms (:class:`mirrorq.node.alarms.Alarms`):
  measures the node's memory (:func:`~mirrorq.node.daemon.group_rss` of its
  process group) every :data:`~mirrorq.node.alarms.CHECK_INTERVAL` seconds
  and the free space of its data dir's file system as often as the core's
  ``disk_check_interval`` says (down to 0.1 s near the limit), exchanges alarm
  states with the peer agents (channel ``alarms``), logs ``alarm_set`` /
  ``alarm_cleared`` and tells its :class:`AlarmSubscribe` subscribers (the
  AMQP front end) every change of the cluster's alarms
  (:class:`ResourceAlarms`); :class:`SetResourceLimit` changes a limit;
* hosts the node's registry server (Raft + tables, ``mirrorq.mnesia_like``):
  its peer traffic rides in :class:`PeerEnvelope` on channel ``registry``;
  local actors and tools use :class:`RegistryTxn`, :class:`RegistryGet`,
  :class:`RegistrySubscribe`, :class:`RegistryForget`.

Registry membership (the Raft configuration follows cluster join)
-----------------------------------------------------------------
* Every node is built with the same bootstrap voters, ``cluster_nodes`` from
  its node.yaml.  A node that is not in that list is a *joiner* (e.g. added
  by ``mirrorctl add_node``): it is never a voter in any configuration it
  knows, so it never campaigns and starts no registry of its own.
* While its Raft log is empty and it is in no configuration, the joiner sends
  ``JoinRequest`` (channel ``registry``) to every node its membership sees up,
  on every probe round (``PROBE_INTERVAL``) and at each ``NodeUp``.  The Raft
  leader answers with ``add_server``: the joiner becomes a learner, receives
  the log (or a snapshot), and the leader promotes it to voter once it is
  within ``catchup_margin`` entries (raft.py).  Followers ignore the request,
  and a leader refusing (another change in flight) is simply asked again.
  From then on the joiner serves local reads from its replica and forwards
  writes to the leader like any member.
* Requests are only ever *asked for* by the joiner; the leader never adds a
  node on its own.  So a node removed with ``forget_cluster_node`` that comes
  back (its log is not empty) does not ask and is not re-added: it stays a
  passive outsider (its pre-votes are refused while the cluster has a live
  leader, the lease guard), as RabbitMQ refuses a forgotten node until it is
  reset.  Wiping its data dir makes it a joiner again (if its name is not one
  of the bootstrap voters).
* ``RegistryForget(node)`` is refused here when this node's membership sees
  ``node`` up (or it is this node); otherwise the registry removes it from
  the configuration and deletes its ``node`` table row (server.py).

Transport: the agent is a :class:`~mirrorq.node.posting.PostingActor`:
everything it sends to mirrorq actors (peer agents, subscribers, answers to
local actors) is posted (ordered, one bundle in flight per destination, so
heartbeats never sit behind a pile of queued sends and the agent never
enters Thespian's tx-only mode); answers to tools asking from outside go
with a plain ``send``.  A transmit to a peer's agent that Thespian reports
dead (connection refused) is what a dead letter used to tell: the
membership core probes, and a second refusal marks the peer down.

Write coalescing: :class:`RegistryTxn` requests of a turn (one Thespian
message: a bundle may carry many) are submitted together at the end of the
turn: one Raft proposal batch (one fsync, one AppendEntries per follower),
or one ``Forward`` to the leader, for all of them.  On the leader, the registry server adds group
commit: with ``REGISTRY_MAX_INFLIGHT_BATCHES`` batches replicating, new
requests wait for one of them to commit and then go together.  Thespian's
per-message cost, not fsync, is what limits writes/s here, so fewer, larger
AppendEntries is what makes concurrent writers scale (bench/registry.py).

Sends to a dead node's agent are silent in Thespian; to keep them from piling
up, a peer that is down gets at most one heartbeat per ``PROBE_INTERVAL``,
alongside a status probe of its admin (which finds its new agent after a
restart).

A registry persist the disk refuses (``ENOSPC`` on a full disk) never
raises out of a turn: the Raft core's actions of that turn and of every
later registry call wait, in order, and the persist is tried again every
:data:`PERSIST_RETRY` seconds (``registry_persist_failed`` /
``registry_persist_recovered`` in node.log); nothing that depends on an
entry leaves before it is durable.  What waits is bounded
(:data:`MAX_HELD_REGISTRY_ACTIONS`, :func:`trim_held`): a timer keeps its
last setting, and past the bound the oldest Raft sends are dropped, as a
lossy network would (the count is logged at recovery).

Bounded waits (the agent carries the heartbeats and the registry's Raft
traffic: nothing may hold them up).  A peer cut off silently (packets
dropped, no reset) holds every transmit to it until the transmit's period
ends, and Thespian lets a process have only so many transmits in progress
before every further one, to any destination, waits in one FIFO.  So each
wait on a peer has a bound: a bundle to a peer's agent is one transmit in
progress (the outbox), failing after ``TRANSMIT_PERIOD``; a status probe of
a peer's admin is one transmit in progress per admin (``probing``), failing
after :data:`PROBE_PERIOD`; a plain send fails after ``SEND_PERIOD``
(:mod:`mirrorq.node.posting`).  The agent's transmits in progress stay at
about one per peer, however long a cut lasts, and the status reports them
(``transmits``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Hashable, Iterable
from datetime import timedelta
from typing import Any, TypedDict, cast

from thespian.actors import (
    ActorAddress,
    ActorExitRequest,
    ChildActorExited,
    PoisonMessage,
    WakeupMessage,
)
from thespian.system.messages.status import Thespian_StatusReq, Thespian_SystemStatus
from thespian.system.transport import TransmitIntent

from mirrorq.mnesia_like import raft as raftmod
from mirrorq.mnesia_like.raft_log import FileRaftLog
from mirrorq.mnesia_like.server import (
    JoinRefused,
    JoinStarted,
    ReadDone,
    RegistryReset,
    RegistryServer,
    TableChanges,
    TxnDone,
)
from mirrorq.node import alarms as alarmsmod
from mirrorq.node.addresses import address_from_text, address_key
from mirrorq.node.config import NodeConfig, from_mapping
from mirrorq.node.daemon import group_rss
from mirrorq.node.lease import LeaseWriter
from mirrorq.node.log import NodeLog
from mirrorq.node.membership import KnownPeers, Membership, NodeDown, NodeUp, QuorumLost, QuorumRegained
from mirrorq.node.messages import (
    AGENT_GLOBAL_NAME,
    NODE_CAPABILITY,
    ActorDown,
    AlarmSubscribe,
    BlockPeers,
    Created,
    CreateLocal,
    NodeEvent,
    NodeInit,
    NodeReady,
    NodeStatus,
    PeerEnvelope,
    PrepareStop,
    RegistryChanges,
    RegistryForget,
    RegistryGet,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    RegistryTxn,
    ResourceAlarms,
    ResourceLimitResult,
    SetResourceLimit,
    StatusQuery,
    Stopping,
    Subscribe,
    Unsubscribe,
)
from mirrorq.node.posting import PostingActor, transmits_in_progress
from mirrorq.node.timers import TimerTable
from mirrorq.sansio import Action, CancelTimer, Emit, Persist, Send, SetTimer

PROBE_INTERVAL = 1.0
#: a status probe of a peer's admin not delivered after this long fails; one
#: probe per admin is in progress at a time, so a silent admin holds one transmit
PROBE_PERIOD = timedelta(seconds=2 * PROBE_INTERVAL)
_PROBE = "agent.probe"
_ALARMS = "agent.alarms"
_PERSIST = "agent.persist"
#: seconds between two tries of a registry persist the disk refused
PERSIST_RETRY = 0.5
#: registry actions held while the disk refuses a persist: past this many, each
#: timer keeps only its last setting and the oldest Raft sends are dropped
#: (:func:`trim_held`; Raft tolerates lost messages and resends what matters once
#: the persist goes through)
MAX_HELD_REGISTRY_ACTIONS = 10_000
_TIMERS = "agent.timers"
RAFT_ELECTION_TIMEOUT = (0.5, 1.0)
#: a registry fsync longer than this is logged (registry_persist_slow)
SLOW_PERSIST = 0.25
RAFT_HEARTBEAT = 0.1
# group commit on the leader: at most this many proposal batches replicating
# at once; requests arriving meanwhile wait and go as one batch (see server.py)
REGISTRY_MAX_INFLIGHT_BATCHES = 2


admin_address = address_from_text


def _total_memory() -> int:
    """The machine's RAM in bytes (what a relative memory watermark is a fraction of)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class Partition(TypedDict, total=False):
    """``cluster_partition_handling`` and what it decided (:attr:`NodeStatus.partition`)."""

    handling: str
    paused: bool
    sees: list[str]  # the voters heard
    cluster: list[str]  # the voters
    since: float


class NodeAgent(PostingActor):
    """The node agent (see the module docstring).

    ``cfg`` is None until the daemon's :class:`NodeInit`; :meth:`_init` then
    sets every attribute declared below.  Nothing else runs before that:
    :meth:`on_message`, :meth:`end_turn` and :meth:`transmit_failed` return
    while ``cfg`` is None."""

    incarnation: int
    log: NodeLog
    subscribers: list[tuple[ActorAddress, bool]]  # (address, bundled)
    children: list[tuple[ActorAddress, str]]  # (address, label); ActorAddress is not hashable
    timers: TimerTable
    contacts: dict[str, tuple[ActorAddress, str]]  # name -> (agent address, admin "host:port")
    last_down_send: dict[str, float]
    peers_file: str
    remembered: dict[str, str]  # name -> admin "host:port" (peers.json)
    pause_minority: bool
    lease: LeaseWriter
    partition: Partition
    core: Membership
    blocked: set[str]
    probing: set[str]
    requests: dict[int, tuple[ActorAddress, RegistryGet | RegistryTxn | None, bool]]
    next_request: int
    table_subscribers: dict[str, tuple[ActorAddress, set[str], bool]]  # address key -> (address, tables, bundled)
    txn_buffer: list[tuple[int, str, dict[str, Any]]]  # (request id, "txn", transaction)
    unpersisted: list[Action]
    held_dropped: int
    persist_failed: str
    persist_retrying: bool
    registry: RegistryServer
    alarms: alarmsmod.Alarms
    alarm_subscribers: dict[str, tuple[ActorAddress, bool]]
    disk_unknown: bool
    mem_checked: float

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.cfg: NodeConfig | None = None

    @property
    def config(self) -> NodeConfig:
        """``cfg``, once :class:`NodeInit` set it."""
        if self.cfg is None:
            raise RuntimeError("the node agent has no configuration yet (no NodeInit)")
        return self.cfg

    # ---- dispatch -----------------------------------------------------
    def end_turn(self) -> None:
        if self.cfg is not None and self.txn_buffer:
            items, self.txn_buffer = self.txn_buffer, []
            self._run(self.registry.submit(time.monotonic(), items), "registry")

    def transmit_failed(self, dst: str, dead: bool) -> None:
        """A refused transmit to a peer's agent: nothing listens at that address
        any more; the membership core probes, a second refusal marks it down."""
        if not dead or self.cfg is None:
            return
        name = next((n for n, c in self.contacts.items() if address_key(c[0]) == dst), None)
        if name is not None and self.core.is_up(name):
            self.log("peer_unreachable", level="warning", peer=name)
            self._run(self.core.unreachable(time.monotonic(), name))

    def on_message(self, msg: Any, sender: ActorAddress) -> None:
        if isinstance(msg, NodeInit):
            return self._init(msg, sender)
        if self.cfg is None:
            return  # not initialised yet: nothing to say
        if isinstance(msg, PeerEnvelope):
            if msg.src in self.blocked:
                return
            self._contact(msg.src, sender, msg.admin)
            if msg.channel == "registry":
                self._run(self.registry.receive(time.monotonic(), msg.src, msg.msg), "registry")
            elif msg.channel == "alarms":
                self._run(self.alarms.receive(time.monotonic(), msg.src, msg.msg), "alarms")
            else:
                self._run(self.core.receive(time.monotonic(), msg.src, msg.msg))
        elif isinstance(msg, WakeupMessage):
            self._wakeup(msg.payload)
        elif isinstance(msg, Thespian_SystemStatus):
            self._status_reply(msg)
        elif isinstance(msg, StatusQuery):
            self.answer(sender, self._status())
        elif isinstance(msg, Subscribe):
            if all(s != sender for s, _ in self.subscribers):
                self.subscribers.append((sender, self.bundled))
        elif isinstance(msg, Unsubscribe):
            self.subscribers = [(s, b) for s, b in self.subscribers if s != sender]
        elif isinstance(msg, AlarmSubscribe):
            self.alarm_subscribers[address_key(sender)] = (sender, self.bundled)
            self.answer(sender, ResourceAlarms(self.alarms.union))
        elif isinstance(msg, SetResourceLimit):
            self.answer(sender, self._set_limit(msg))
        elif isinstance(msg, CreateLocal):
            addr = self.createActor(msg.actor_class)
            self.children.append((addr, msg.label))
            if msg.init is not None:
                self.send(addr, msg.init)
            self.answer(sender, Created(msg.label, addr))
        elif isinstance(msg, ChildActorExited):
            entry = next((c for c in self.children if c[0] == msg.childAddress), None)
            if entry is not None:
                self.children.remove(entry)
                label = entry[1]
                self.alarm_subscribers.pop(address_key(msg.childAddress), None)
                self.log("actor_down", label=label)
                self._publish(ActorDown(msg.childAddress, label))
        elif isinstance(msg, RegistryTxn):
            self.txn_buffer.append((self._request(sender, msg), "txn", msg.txn))  # submitted at the end of the turn
        elif isinstance(msg, RegistryForget):
            refusal = self._forget_refusal(msg.node)
            if refusal:
                self.answer(sender, RegistryResult(False, refusal))
            else:
                rid = self._request(sender, None)
                self.log("forget_cluster_node", node=msg.node)
                self._run(self.registry.forget_node(time.monotonic(), rid, msg.node), "registry")
        elif isinstance(msg, RegistryGet):
            if msg.linearizable:
                rid = self._request(sender, msg)
                self._run(self.registry.read(time.monotonic(), rid), "registry")
            else:
                self.answer(sender, self._rows(msg))
        elif isinstance(msg, RegistrySubscribe):
            self.table_subscribers[address_key(sender)] = (sender, set(msg.tables), self.bundled)
        elif isinstance(msg, BlockPeers):
            if os.environ.get("MIRRORQ_TEST_HOOKS") == "1":
                self.blocked = set(msg.nodes)
                self.log("test_block_peers", level="warning", nodes=sorted(self.blocked))
                self.answer(sender, RegistryResult(True))
            else:
                self.answer(sender, RegistryResult(False, "test hooks are off (MIRRORQ_TEST_HOOKS=1)"))
        elif isinstance(msg, PrepareStop):
            self.log("leaving")
            self._run(self.core.leave(time.monotonic()))
            self.answer(sender, Stopping(self.config.name))
        elif isinstance(msg, ActorExitRequest):
            if not self.core.leaving:
                self._run(self.core.leave(time.monotonic()))
            self.log("stopped")
        elif isinstance(msg, PoisonMessage):
            self.log("poison_message", level="warning", message=repr(msg.poisonMessage)[:200])

    # ---- setup ----------------------------------------------------------
    def _init(self, msg: NodeInit, sender: ActorAddress) -> None:
        if self.cfg is not None:
            self.answer(sender, self._ready())
            return
        self.cfg = from_mapping(msg.config, "<NodeInit>")
        self.incarnation = time.time_ns()
        self.log = NodeLog(self.cfg.data_dir, self.cfg.name, "node_agent")
        self.subscribers = []
        self.children = []
        self.timers = TimerTable()  # (channel, the core's key) -> deadline, behind one wakeup
        self.contacts = {}
        self.last_down_send = {}
        self.peers_file = os.path.join(self.cfg.data_dir, "peers.json")
        self.remembered = self._load_peers()
        # a joiner's bootstrap voters are the cluster's (it is not among them)
        voters = list(self.cfg.cluster_nodes) or [self.cfg.name]
        self.pause_minority = self.cfg.cluster_partition_handling == "pause_minority"
        self.lease = LeaseWriter(self.cfg.data_dir)
        self.partition = {
            "handling": self.cfg.cluster_partition_handling,
            "paused": False,
            "sees": [self.cfg.name],
            "since": time.time(),
        }
        self.core = Membership(
            self.cfg.name,
            self.incarnation,
            (),
            interval=self.cfg.heartbeat_interval,
            timeout=self.cfg.heartbeat_timeout,
            cluster=voters if self.pause_minority else (),
        )
        self.blocked = set()
        self.probing = set()  # admins with a status probe in progress
        self.requests = {}  # req id -> (requester, its RegistryGet/RegistryTxn or None, bundled)
        self.next_request = 0
        self.table_subscribers = {}
        self.txn_buffer = []
        self.unpersisted = []  # registry actions waiting for a persist the disk refused
        self.held_dropped = 0  # Raft sends of those dropped by trim_held (logged at recovery)
        self.persist_failed = ""  # why the last registry persist failed ("" if it did not)
        self.persist_retrying = False
        raft = raftmod.RaftNode(
            self.cfg.name,
            FileRaftLog(os.path.join(self.cfg.data_dir, "raft")),
            __import__("random").Random(),
            voters=voters,
            election_timeout=RAFT_ELECTION_TIMEOUT,
            heartbeat_interval=RAFT_HEARTBEAT,
        )
        self.registry = RegistryServer(
            self.cfg.name,
            raft,
            snapshot_every=self.cfg.registry_snapshot_every,
            max_inflight_batches=REGISTRY_MAX_INFLIGHT_BATCHES,
        )
        self.alarms = alarmsmod.Alarms(
            self.cfg.name,
            self.incarnation,
            _total_memory(),
            memory=self.cfg.vm_memory_high_watermark,
            disk=self.cfg.disk_free_limit,
        )
        self.alarm_subscribers = {}  # address key -> (address, bundled)
        self.disk_unknown = False  # the last statvfs of the data dir failed
        self.mem_checked = float("-inf")  # when the memory was last measured
        self.log(
            "started",
            incarnation=self.incarnation,
            admin=self.cfg.admin_address,
            seeds=list(self.cfg.seeds),
            remembered=self.remembered,
            voters=voters,
            joins=self.cfg.joins,
            mem_limit=self.alarms.mem_limit,
            disk_free_limit=self.alarms.disk_free_limit,
        )
        self._check_alarms()
        self._run(self.core.start(time.monotonic()))
        self._renew_lease(time.monotonic())
        self._run(self.registry.start(time.monotonic()), "registry")
        self._probe()
        self.answer(sender, self._ready())

    def _ready(self) -> NodeReady:
        return NodeReady(self.config.name, os.getpid(), os.getpgid(0), self.incarnation)

    def _load_peers(self) -> dict[str, str]:
        try:
            with open(self.peers_file) as f:
                data = json.load(f)
            return {str(k): str(v) for k, v in data.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    # ---- core actions -------------------------------------------------------
    def _run(self, actions: Iterable[Action] | None, channel: str = "membership") -> None:
        now = time.monotonic()
        actions = list(actions or ())
        if channel == "registry" and (self.unpersisted or any(isinstance(a, Persist) for a in actions)):
            # the log's writes are made durable before any of these actions is carried out
            self.unpersisted += actions
            if not self._persist_registry(now):
                if len(self.unpersisted) > MAX_HELD_REGISTRY_ACTIONS:
                    self.unpersisted, dropped = trim_held(self.unpersisted, MAX_HELD_REGISTRY_ACTIONS)
                    self.held_dropped += dropped
                return  # held, in order, until a persist goes through
            actions, self.unpersisted = self.unpersisted, []
        for a in actions:
            if isinstance(a, Send):
                self._send_peer(now, a.dst, a.msg, channel)
            elif isinstance(a, SetTimer):
                self._arm(now, self.timers.set((channel, a.key), now + a.delay))
            elif isinstance(a, CancelTimer):
                self.timers.cancel((channel, a.key))
            elif isinstance(a, Emit):
                if channel == "registry":
                    self._registry_event(a.event)
                elif channel == "alarms":
                    self._alarm_event(a.event)
                else:
                    self._emit(a.event)

    def _persist_registry(self, now: float) -> bool:
        """Make the registry's log durable; False if the disk refused (a full
        disk): the actions wait in :attr:`unpersisted` and the persist is
        tried again every :data:`PERSIST_RETRY` seconds (the Raft log keeps
        what it could not write and writes it at the next try)."""
        try:
            self.registry.persist(now)
        except OSError as e:
            if not self.persist_failed:
                self.log(
                    "registry_persist_failed",
                    level="error",
                    data_dir=self.config.data_dir,
                    error=f"{type(e).__name__}: {e}",
                    held=len(self.unpersisted),
                )
            self.persist_failed = str(e)
            if not self.persist_retrying:
                self.persist_retrying = True
                self.wakeupAfter(PERSIST_RETRY, payload=_PERSIST)
            return False
        took = time.monotonic() - now
        if took > SLOW_PERSIST:  # the agent's turn waited on the disk: heartbeats and the lease waited too
            self.log("registry_persist_slow", level="warning", seconds=round(took, 3))
        if self.persist_failed:
            self.log(
                "registry_persist_recovered",
                held=len(self.unpersisted),
                dropped=self.held_dropped,
                error=self.persist_failed,
            )
            self.persist_failed = ""
            self.held_dropped = 0
        return True

    def _send_peer(self, now: float, dst: str, msg: Any, channel: str = "membership") -> None:
        contact = self.contacts.get(dst)
        if contact is None or dst in self.blocked:
            return  # name learnt by gossip only: the probe will find its address
        if not self.core.is_up(dst) and not self.core.leaving:
            if now - self.last_down_send.get(dst, float("-inf")) < PROBE_INTERVAL:
                return
            self.last_down_send[dst] = now
        self.post(contact[0], PeerEnvelope(self.config.name, self.config.admin_address, msg, channel))

    def _emit(self, ev: Any) -> None:
        if isinstance(ev, NodeUp):
            self.log("node_up", peer=ev.node, incarnation=ev.incarnation)
            self._publish(NodeEvent("up", ev.node, ev.incarnation))
            self._run(self.alarms.node_up(time.monotonic(), ev.node, ev.incarnation), "alarms")
            self._ask_to_join()
        elif isinstance(ev, NodeDown):
            self.log("node_down", level="warning", peer=ev.node, incarnation=ev.incarnation, reason=ev.reason)
            self._publish(NodeEvent("down", ev.node, ev.incarnation, ev.reason))
            self._run(self.alarms.node_down(time.monotonic(), ev.node, ev.incarnation), "alarms")
            self._run(self.registry.peer_down(time.monotonic(), ev.node), "registry")
        elif isinstance(ev, KnownPeers):
            self._save_peers()
        elif isinstance(ev, (QuorumLost, QuorumRegained)):
            self._quorum(ev)

    # ---- pause_minority -------------------------------------------------------------
    def _quorum(self, ev: QuorumLost | QuorumRegained) -> None:
        """The node lost or regained a majority of the registry's voters: the
        lease first (every serving process reads it each turn), then the log
        line and the node event (which wakes idle processes)."""
        paused = isinstance(ev, QuorumLost)
        self.partition.update(
            {"paused": paused, "sees": list(ev.sees), "cluster": list(ev.cluster), "since": time.time()}
        )
        if paused:
            self.lease.write(0.0)
            reason = self._minority_reason()
            self.log(
                "minority",
                level="warning",
                sees=list(ev.sees),
                cluster=list(ev.cluster),
                handling="pause_minority",
                reason=reason,
            )
            self._publish(NodeEvent("paused", self.config.name, self.incarnation, reason))
        else:
            self._renew_lease(time.monotonic())
            self.log("majority", sees=list(ev.sees), cluster=list(ev.cluster))
            self._publish(NodeEvent("resumed", self.config.name, self.incarnation))

    def _minority_reason(self) -> str:
        p = self.partition
        return (
            f"node {self.config.name} is in a minority (pause_minority): it reaches "
            f"{', '.join(p['sees'])} of the cluster {', '.join(p.get('cluster', []))}"
        )

    def _renew_lease(self, now: float) -> None:
        """While a majority is heard, the lease runs a heartbeat timeout (less one interval) ahead
        (mirrorq.node.lease); with pause_minority off, or with fewer than
        three voters, it never ends."""
        if not self.pause_minority or len(self.core.cluster) < 3:
            if self.lease.until != float("inf"):
                self.lease.write(float("inf"))
        elif not self.core.in_minority:
            late = now - self.lease.until
            if late > 0 and self.lease.until > 0:
                # the serving processes found the node paused meanwhile: the agent did not run
                self.log("lease_renewed_late", level="warning", late=round(late, 3))
            # it ends before the peers can report this node down (a timeout after its last
            # heartbeat, which left in this tick at the latest): mirrorq.node.lease
            self.lease.write(now + self.config.heartbeat_timeout - self.config.heartbeat_interval)

    def _publish(self, event: NodeEvent | ActorDown) -> None:
        for s, bundled in self.subscribers:
            self.tell(s, event, bundled)

    def _save_peers(self) -> None:
        peers = dict(self.remembered)
        peers.update({n: c[1] for n, c in self.contacts.items()})
        if peers == self.remembered:
            return
        self.remembered = peers
        tmp = self.peers_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(peers, f, sort_keys=True)
        os.replace(tmp, self.peers_file)

    def _contact(self, name: str, agent: ActorAddress, admin: str) -> None:
        if name == self.config.name:
            return
        old = self.contacts.get(name)
        if old is None or old[0] != agent or old[1] != admin:
            self.contacts[name] = (agent, admin)
            if old is None or old[1] != admin:
                self._save_peers()

    # ---- resource alarms ---------------------------------------------------------
    def _check_alarms(self, rearm: bool = True, memory: bool = False) -> None:
        """Measure the node's free disk space, and its memory when it is time
        (or ``memory``), and hand them to the alarm core."""
        now = time.monotonic()
        mem: int | None = None
        if memory or now - self.mem_checked >= alarmsmod.CHECK_INTERVAL:
            self.mem_checked = now
            try:
                mem = group_rss(os.getpgid(0))
            except OSError:
                pass
        try:
            st = os.statvfs(self.config.data_dir)
            disk: int | None = st.f_bavail * st.f_frsize
        except OSError as e:
            disk = None
            if not self.disk_unknown:  # logged once until it can be read again
                self.log("disk_free_unknown", level="warning", data_dir=self.config.data_dir, error=str(e))
        self.disk_unknown = disk is None
        self._run(self.alarms.check(now, mem, disk), "alarms")
        if rearm:
            self.wakeupAfter(self.alarms.disk_check_interval(), payload=_ALARMS)

    def _set_limit(self, msg: SetResourceLimit) -> ResourceLimitResult:
        try:
            self.alarms.set_limit(msg.resource, msg.setting)
        except ValueError as e:
            return ResourceLimitResult(False, str(e))
        key = "vm_memory_high_watermark" if msg.resource == alarmsmod.MEMORY else "disk_free_limit"
        self.log(
            "resource_limit_set",
            key=key,
            setting=msg.setting,
            limit=self.alarms.mem_limit if msg.resource == alarmsmod.MEMORY else self.alarms.disk_free_limit,
        )
        self._check_alarms(rearm=False, memory=True)
        return ResourceLimitResult(True, alarms=self.alarms.status())

    def _alarm_event(self, ev: Any) -> None:
        if isinstance(ev, alarmsmod.ClusterAlarms):
            for sub, bundled in self.alarm_subscribers.values():
                self.tell(sub, ResourceAlarms(ev.alarms), bundled)
        elif isinstance(ev, alarmsmod.AlarmSet):
            self.log("alarm_set", level="warning", alarm_node=ev.node, resource=ev.resource, **dict(ev.figures))
        elif isinstance(ev, alarmsmod.AlarmCleared):
            extra = {"reason": ev.reason} if ev.reason else {}
            self.log(
                "alarm_cleared", level="info", alarm_node=ev.node, resource=ev.resource, **dict(ev.figures), **extra
            )

    # ---- timers and discovery ------------------------------------------------
    def _wakeup(self, payload: Any) -> None:
        if payload == _PROBE:
            self._probe()
            return
        if payload == _ALARMS:
            self._check_alarms()
            return
        if payload == _PERSIST:
            self.persist_retrying = False
            self._run([], "registry")
            return
        if not (isinstance(payload, tuple) and len(payload) == 2 and payload[0] == _TIMERS):
            return
        self.timers.fired(payload[1])
        now = time.monotonic()
        keys, at = self.timers.due(now)
        self._arm(now, at)
        # every key the agent sets is (channel, the core's key): see _run
        for channel, key in cast("list[tuple[str, Hashable]]", keys):
            if channel == "registry":
                self._run(self.registry.timer(now, key), "registry")
            else:
                self._run(self.core.timer(now, key))
                self._renew_lease(now)

    def _arm(self, now: float, at: float | None) -> None:
        if at is not None:
            self.wakeupAfter(max(0.0, at - now), payload=(_TIMERS, at))

    # ---- registry ------------------------------------------------------------------
    def _request(self, sender: ActorAddress, get: RegistryGet | RegistryTxn | None) -> int:
        self.next_request += 1
        self.requests[self.next_request] = (sender, get, self.bundled)
        return self.next_request

    def _rows(self, get: RegistryGet) -> RegistryRows:
        try:
            reg = self.registry.registry
            # no copies: the answer goes to another process, serialized (see Registry.get)
            if get.key is None:
                return RegistryRows(True, reg.select(get.table, copy=False), ref=get.ref)
            row = reg.get(get.table, get.key, copy=False)
            return RegistryRows(True, [] if row is None else [row], ref=get.ref)
        except (ValueError, KeyError) as e:
            return RegistryRows(False, [], str(e), ref=get.ref)

    def _registry_event(self, ev: Any) -> None:
        if isinstance(ev, TxnDone):
            sender, req, bundled = self.requests.pop(ev.req_id, (None, None, False))
            if sender is not None:
                self.tell(sender, RegistryResult(ev.ok, ev.error, getattr(req, "ref", None)), bundled)
        elif isinstance(ev, ReadDone):
            sender, get, bundled = self.requests.pop(ev.rid, (None, None, False))
            if sender is not None:
                assert isinstance(get, RegistryGet)  # a read's request holds its RegistryGet (on_message)
                self.tell(sender, self._rows(get) if ev.ok else RegistryRows(False, [], ev.error, get.ref), bundled)
        elif isinstance(ev, (TableChanges, RegistryReset)):
            if isinstance(ev, RegistryReset):
                self.log("registry_snapshot_installed", applied=self.registry.raft.applied_index)
            for sub, tables, bundled in self.table_subscribers.values():
                if isinstance(ev, RegistryReset):
                    self.tell(sub, RegistryChanges(None), bundled)
                else:
                    mine = [(c.table, c.key, c.old, c.new) for c in ev.changes if c.table in tables]
                    if mine:
                        self.tell(sub, RegistryChanges(mine), bundled)
        elif isinstance(ev, raftmod.LeaderChanged):
            self.log("registry_leader", term=ev.term, leader=ev.leader)
        elif isinstance(ev, raftmod.MembershipCommitted):
            self.log(
                "registry_config", index=ev.index, voters=list(ev.config.voters), learners=list(ev.config.learners)
            )
            if self.pause_minority:
                self._run(self.core.set_cluster(time.monotonic(), ev.config.voters))
                self._renew_lease(time.monotonic())
        elif isinstance(ev, JoinStarted):
            self.log("registry_join_started", node=ev.node)
        elif isinstance(ev, JoinRefused):
            self.log("registry_join_deferred", node=ev.node, reason=ev.reason)
        elif isinstance(ev, raftmod.MessageIgnored):
            self.log("registry_message_ignored", level="warning", src=ev.src, reason=ev.reason)

    def _forget_refusal(self, node: object) -> str:
        if not isinstance(node, str) or not node:
            return f"forget_cluster_node: a node name is required, got {node!r}"
        if node == self.config.name:
            return f"{node} is the node handling this request, so it is up; ask another node, after stopping {node}"
        if self.core.is_up(node):
            return f"{node} is up (as seen by {self.config.name}); stop it before forget_cluster_node"
        cfg = self.registry.raft.config
        if node not in cfg.members:
            return (
                f"{node} is not a member of the registry's Raft configuration "
                f"(voters: {', '.join(cfg.voters)}; learners: {', '.join(cfg.learners) or 'none'})"
            )
        return ""

    def _ask_to_join(self) -> None:
        if self.registry.joining:
            up = [n for n in self.contacts if self.core.is_up(n)]
            self._run(self.registry.join_requests(time.monotonic(), up), "registry")

    def _probe(self) -> None:
        """Ask the admins of every seed and every known node that is not up
        who they are; replies arrive as Thespian_SystemStatus."""
        targets = set(self.config.seeds) | set(self.remembered.values())
        up_admins = {c[1] for n, c in self.contacts.items() if self.core.is_up(n)}
        for admin in sorted(targets - up_admins - {self.config.admin_address} - self.probing):
            try:
                addr = admin_address(admin)
            except ValueError:
                self.log("bad_seed", level="error", seed=admin)
                continue
            self.probing.add(admin)

            def over(_result: Any, _intent: Any, admin: str = admin) -> None:
                self.probing.discard(admin)

            self._myRef._send_intent(
                TransmitIntent(addr, Thespian_StatusReq(), onSuccess=over, onError=over, maxPeriod=PROBE_PERIOD)
            )
        if not self.core.leaving:
            self._ask_to_join()
            self.wakeupAfter(PROBE_INTERVAL, payload=_PROBE)

    def _status_reply(self, st: Thespian_SystemStatus) -> None:
        caps = getattr(st, "capabilities", None) or {}
        name = caps.get(NODE_CAPABILITY)
        agent = dict(getattr(st, "globalActors", None) or {}).get(AGENT_GLOBAL_NAME)
        port = caps.get("Admin Port")
        if not name or agent is None or not port or name == self.config.name:
            return
        host = caps.get("mirrorq.host", self.config.host)
        self._contact(name, agent, f"{host}:{port}")
        # it may have restarted with a new agent: greet it now
        self.last_down_send.pop(name, None)
        self._run(self.core.introduce(time.monotonic(), name))

    def _status(self) -> NodeStatus:
        return NodeStatus(
            name=self.config.name,
            incarnation=self.incarnation,
            pid=os.getpid(),
            pgid=os.getpgid(0),
            admin_port=self.config.admin_port,
            amqp_port=self.config.amqp_port,
            view=self.core.view(time.monotonic()),
            registry={
                "role": self.registry.raft.role,
                "term": self.registry.raft.term,
                "leader": self.registry.raft.leader_id,
                "commit_index": self.registry.raft.commit_index,
                "applied_index": self.registry.raft.applied_index,
                "voters": list(self.registry.raft.config.voters),
                "learners": list(self.registry.raft.config.learners),
                "joining": self.registry.joining,
            },
            transmits=transmits_in_progress(self),
            partition=dict(self.partition, cluster=list(self.core.cluster)),
            alarms=self.alarms.status(),
            config=self.config.to_dict(),
            peers={**self.remembered, **{n: c[1] for n, c in self.contacts.items()}},
        )


def trim_held(actions: list[Action], bound: int) -> tuple[list[Action], int]:
    """Registry actions held for a persist, cut down toward ``bound``: of the
    timer actions (SetTimer, CancelTimer) of one key only the last stays
    (carried out in order, it alone decides the timer); then, while more
    than ``bound`` remain, the oldest Sends go (a lost Raft message is one
    Raft already survives).  Persists and emitted events all stay, in
    order.  Returns (what stays, how many Sends were dropped)."""
    last: dict[Hashable, int] = {}
    for k, a in enumerate(actions):
        if isinstance(a, (SetTimer, CancelTimer)):
            last[a.key] = k
    kept = [a for k, a in enumerate(actions) if not isinstance(a, (SetTimer, CancelTimer)) or last[a.key] == k]
    excess = len(kept) - bound
    if excess <= 0:
        return kept, 0
    sends = sum(1 for a in kept if isinstance(a, Send))
    drop = min(excess, sends)
    out: list[Action] = []
    dropped = 0
    for a in kept:
        if dropped < drop and isinstance(a, Send):
            dropped += 1
            continue
        out.append(a)
    return out, dropped
