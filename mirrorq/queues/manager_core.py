"""The queue manager's core: declares queues, places mirrors, recovers replicas.

Sans-IO (:mod:`mirrorq.sansio`): one :class:`QueueManagerCore` per node,
driven by the Thespian shell :mod:`mirrorq.queues.manager` in a node
and by :mod:`mirrorq.simulator` in tests.  It names everything it talks to by
a string handed in or read from the registry:

* ``agent`` -- the node agent: registry reads and transactions
  (:class:`~mirrorq.node.messages.RegistryGet` /
  :class:`~mirrorq.node.messages.RegistryTxn` with request ids, through a
  :class:`~mirrorq.node.registry_client.RegistryClient`), the subscriptions
  (``RegistrySubscribe`` to :data:`MIRRORED_TABLES`, ``Subscribe`` to node
  events) and ``StatusQuery``;
* ``hosts`` -- the node's queue hosts: a queue's replica is started in host
  ``hosts[host_index(vhost, name, len(hosts))]`` (:class:`ReplicaInit`);
* peer managers -- by the ``manager`` field of their ``node`` row (this
  manager registers ``me`` there; what it sends ``me`` -- a declare's start
  of the local founder and its answer -- is handled in the same call, no
  hop);
* replicas -- by their GM member names (the driver routes a message for a
  member to the actor hosting it);
* requesters -- whatever ``src`` the driver handed in with a request; the
  answer is a ``Send`` to that ``src``.

Entry points: ``start(now)``, ``receive(now, src, msg)``, ``timer(now,
key)``, and ``host_exited(now, index)`` (the driver saw queue host ``index``
die; it starts a new one itself).  Every one returns actions: ``Send``,
``SetTimer``/``CancelTimer``, and ``Emit(ManagerLog)`` for the node's log.
The manager writes nothing to disk; ``now`` must be wall-clock seconds,
because claim rows carry it and are compared across nodes (below).

Protocol
--------
Declare (:class:`DeclareQueue`, from a channel on any node)
    If ``amqqueue`` already has the queue, the answer is its record.
    Otherwise the manager claims the name (a ``queue_claim`` row put only if
    none exists: a registry transaction, so of concurrent declares of one
    queue -- two clients on two nodes -- exactly one places it; a claim
    whose answer was lost is settled by reading the claim row); the others
    wait for the winner's record and answer with it.  A claim older than
    :data:`CLAIM_STALE` (its declarer died) is taken over; the claim of a
    placed queue is deleted with the queue's record when the queue is
    deleted, that of a failed declare when it fails.  Then the founders are
    chosen: the nodes the request names, if it names any (tests; the queue
    then carries the arguments ``x-ha-policy: nodes`` and
    ``x-ha-policy-params: [those nodes]`` and placement keeps it on them, see
    :mod:`mirrorq.policy.converge`); else by policy
    (:func:`mirrorq.policy.converge.declare_placement`): the master by
    ``queue-master-locator`` (the queue argument ``x-queue-master-locator``
    overrides it; default client-local), mirrors as the matching policy's
    ``ha-mode`` wants, among the nodes this node sees up; no matching policy:
    the master alone (RabbitMQ).  The manager asks the managers of those
    nodes to start a replica each (:class:`StartReplica`, answered
    :class:`StartReplicaDone`), sends the founders' list to the first one
    (:class:`FoundGroup`: it creates the ``gm_group`` row), and answers once
    the founders' master -- the first founder, which promotes itself through
    the promotion protocol -- has written the ``amqqueue`` record (heard from
    the ``amqqueue`` subscription, or read every :data:`DECLARE_POLL`; once
    the manager holds its copy of ``amqqueue`` the subscription is the way
    and the copy is looked at every :data:`DECLARE_POLL_SUBSCRIBED`).  The
    declare's reads of ``amqqueue``, ``policy`` and ``node`` come from the
    manager's copy of those tables once loaded (below), not from the agent.

Declare of a quorum queue (``x-queue-type: quorum``)
    After the claim, the members are chosen (:meth:`_declare_quorum`): one
    per node up, the declaring node first, at most
    ``x-quorum-initial-group-size``; each gets a stable name
    ``node/quorum/uid`` and a :class:`StartReplica` with the whole voter
    list (and the matching policy's name, for the record); once every
    member has started, the manager puts their ``quorum_member`` rows
    (addresses) in one transaction, retried until it commits, from which
    they find each other; the elected leader writes the ``amqqueue`` record (``type:
    quorum``, ``members``, ``pid`` its epoch ``member#term``, ``leader_dst``)
    and the declare answers once a record's pid names one of the voters.
    Policies' ha-* keys and placement never touch quorum queues (their
    membership is the Raft group's, :mod:`mirrorq.quorum.hosted`).

Placement that converges (:mod:`mirrorq.policy.converge`)
    The manager keeps a copy of the registry tables ``policy``, ``amqqueue``
    and ``node`` (read once, then kept from the subscription's changes; read
    again after a registry snapshot reset) and hears its agent's node up/down
    events; on each (debounced by :data:`CONVERGE_DELAY`, longer with many
    queues) and every :data:`SLOW_TICK` ticks it runs its
    :class:`~mirrorq.policy.converge.Converger` on that copy: for every queue
    whose master is on *this* node and runs here (exactly one node acts per
    queue; a record naming a master of this node that is not among the
    replicas running here -- it died with a previous life of the node, or
    this copy of the table predates its promotion elsewhere -- is acted on by
    nobody), the plan's steps become ``StartReplica(join=True)`` to the target node's
    manager (the replica joins the GM group unsynchronised and syncs),
    ``StopReplica`` to a surplus mirror, ``SetPolicy`` to every replica when
    the effective definition (or the replica set) changed, and an
    ``amqqueue.policy`` update.  The set of up nodes is the membership view
    of this node (``StatusQuery`` each tick, ``NodeEvent`` in between)
    restricted to nodes whose manager is registered.

Replicas on this node (:class:`StartReplica` from any manager)
    A start goes to the queue's host as :class:`ReplicaInit`; the host's
    :class:`ReplicaStarted` is answered to the requester.  A joining start
    for a queue that already has a replica here is answered with it, unless
    the request lists the queue's members and it is not among them (a
    leftover of a failed declare, or of a view that moved on without it): it
    is told to exit and the new one starts once it has
    (:class:`ReplicaExited`).

Queue commands for tools (:class:`QueueOps`)
    mirrorctl asks any node's manager to run ``info``, ``sync``,
    ``cancel_sync`` (or any other :class:`~.messages.QueueCommand`) on the
    masters of some queues; the manager finds each master in ``amqqueue``,
    sends the command, and answers one :class:`QueueOpsResult` once every
    master answered or ``QueueOps.timeout`` passed (a master that did not
    answer is an error naming it).

Quorum queue membership for tools (:class:`QuorumMembers`)
    mirrorctl asks any node's manager.  ``status``: the manager reads the
    queue's record and each member's ``quorum_member`` row and asks every
    member on a node up for ``member_status`` (any member answers: its Raft
    state, term, indexes); the answer lists every member of the record, a
    member on a node down, without a row or silent within the timeout
    saying so.  ``add``: after checking the queue (exists, is a quorum
    queue), the node (registered, up) and that it has no member there, the
    manager asks the node's manager to start a joining member (a new stable
    name; ``quorum = {"member", "voters": the record's bootstrap, "members":
    the record's members, "join": True}``), then sends ``add_member`` to the
    leader the record names; the leader answers once the member is a voter
    of the committed configuration.  ``delete``: the member of that node
    (not the last one) is named to the leader's ``delete_member``.  A
    ``NotMaster`` (leader changed) or a record naming no live leader reads
    the record again after a short pause and asks again (the leader's
    commands are idempotent), until the request's timeout, which answers an
    error naming what was waited for.  Failures carry a ``reason`` for
    tools (:class:`QuorumMembersResult`).  A member started for an ``add``
    that never reached the leader stays on its node (a later ``add`` on that
    node reuses it: a joining start is answered with the replica that runs).

Recovery (after a node restart)
    Every :data:`RECOVER_EVERY` seconds (while a recovery is under way;
    every :data:`SLOW_TICK` ticks otherwise) the manager reads ``amqqueue``
    (its copy) and ``gm_group`` (from the agent).  A durable queue whose last
    GM view starts with a member of this node that is not running here any
    more (the first member is the master, or the mirror that was to be
    promoted: nobody took over, because the whole cluster stopped or this
    node came back before a mirror was promoted), is recovered from the
    store on disk: a new replica founds a new view ``{itself}`` by a registry
    transaction conditioned on the view version it read, so of a recovery and
    a concurrent promotion exactly one wins (the loser's members find
    themselves removed and stop; a recovery that lost tells its new replica
    to exit).  A recovery transaction that fails or goes unanswered is
    settled by a linearizable read of the group: the new replica in the view
    is a win (the answer was lost), a version moved on without it a loss, an
    unchanged version sends the same conditioned transaction again.  Each
    old member is recovered at most once per life of the manager.  Mirrors'
    stores are not reused here: a mirror rejoins through placement + sync.
    A quorum queue whose record lists a member of this node that does not
    run here is started again under the same stable name, from its Raft log
    (:meth:`_scan_quorum`): Raft, not the registry, decides its role.

Registration
    At start, the manager puts its ``node`` row (``manager`` = ``me``, plus
    the shell's fields) and puts it again on each tick until a put succeeds.

Guarantees
----------
* Of concurrent declares of one queue (any nodes) at most one places it
  (sends :class:`FoundGroup`), and every declare that answers ``ok`` answers
  with the record of that placement (the same ``pid``).
* Every declare is answered exactly once, within :data:`START_TIMEOUT`: with
  the record, or with an error that names the queue (``queue 'name': ...``)
  and the cause -- the node(s) whose manager did not answer a
  :class:`StartReplica`, the master that did not write its record, the
  concurrent declare's node, the registry, a bad policy or argument.
* A recovery founds a new view only by a transaction conditioned on the view
  version it read: it never overwrites a view it did not see.
* :class:`QueueOps` and :class:`QuorumMembers` are answered exactly once,
  within their ``timeout``.

Assumptions
-----------
* The agent answers registry requests by echoing their ``ref``, and sends a
  table read's rows after every change to that table it sent before (a read
  is a snapshot at least as new as every change heard before it).
* Delivery between managers is best effort (lost when a node dies); a peer
  manager's address changes when it restarts (the node row tells).
* Clocks of the nodes agree to well within :data:`CLAIM_STALE`.

Failure
-------
A peer manager that does not answer a StartReplica within
:data:`START_TIMEOUT` makes the declare fail with an error naming its node;
the founders that did start are leftovers that placement replaces.  A
placement start or stop whose effect the record does not show is repeated
after the converger's ``retry_after``.  A master move (ha-mode ``nodes``
without the master's node) is a ``MasterHandOver`` to the master, which
hands over to its synchronised mirror on the first listed node and exits
(:meth:`~mirrorq.classic.replica.QueueReplica.hand_over`); one that
does not show in the record is asked for again after ``retry_after``.  A
registry request the agent does not answer is given up after
:data:`REQUEST_TIMEOUT` (logged; a declare waiting on it times out, a table
copy is read again).  A queue host that dies takes its replicas with it:
they are forgotten (placement and recovery start them again), and so are the
starts it had not answered.  Bad constructor arguments raise ``ValueError``
naming the argument; messages of unknown types are logged and ignored.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mirrorq.amqp.topology import deleted_queues, queue_binding_deletes
from mirrorq.gm.names import GM_TABLE, parse_member_name
from mirrorq.mnesia_like.tables import key_of
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
from mirrorq.node.registry_client import RegistryClient
from mirrorq.policy import converge as cv
from mirrorq.policy.matching import match
from mirrorq.policy.store import policies_from_rows
from mirrorq.queues.control import (
    ExitReplica,
    FoundGroup,
    MasterHandOver,
    ReplicaExited,
    ReplicaInit,
    ReplicaStarted,
    ReplicaStartFailed,
    SetPolicy,
    StopReplica,
    group_name,
    host_index,
)
from mirrorq.queues.messages import CommandResult, NotMaster, QueueCommand, epoch_member
from mirrorq.quorum.hosted import MEMBER_TABLE, is_quorum, member_row_put, stable_name
from mirrorq.sansio import Action, CancelTimer, Emit, Send, SetTimer

RECOVER_EVERY = 1.0  # the tick
REQUEST_TIMEOUT = 5.0  # a registry request the agent did not answer is given up
START_TIMEOUT = 10.0  # a declare not placed by then is answered with an error
CLAIM_STALE = 2 * START_TIMEOUT  # a queue_claim this old belongs to a declare that died
CONVERGE_DELAY = 0.05
PLACEMENT_RETRY = 15.0
DECLARE_POLL = 0.05  # a declare waiting for a record reads it this often (the subscription is faster)
DECLARE_POLL_SUBSCRIBED = 1.0  # ... and looks at the table's copy this often once it holds one
REGISTER_RETRY = 0.2
MIRRORED_TABLES = ("policy", "amqqueue", "node")  # subscribed to, and kept here
SLOW_TICK = 5  # ticks between periodic scans of every queue


def _pid_member(pid: str) -> str:
    """The member a record's ``pid`` names: a classic master's GM member
    name, or the member of a quorum leader's epoch ``member#term``."""
    return epoch_member(pid) if "#" in pid else pid


# ---- the protocol's messages ------------------------------------------------------------
@dataclass
class DeclareQueue:
    spec: dict[str, Any]  # name, vhost, durable, auto_delete, exclusive_owner, arguments
    nodes: tuple[str, ...] = ()  # () = every member node


@dataclass
class DeclareResult:
    ok: bool
    record: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class StartReplica:
    spec: dict[str, Any]
    request: int
    fresh: bool = False
    join: bool = False  # join the running group as an unsynchronised mirror
    recover: bool = False  # a durable queue coming back after a restart
    policy: dict[str, Any] = field(default_factory=dict)  # the effective policy definition
    members: tuple[str, ...] = ()  # join: the queue's replicas now; a local replica not among them is stale
    policy_name: str | None = None  # a declare's: the master's first record names it (no second write)
    quorum: dict[str, Any] | None = None  # a quorum queue's member: {"member": stable name, "voters": [...]}


@dataclass
class StartReplicaDone:
    """The answer to :class:`StartReplica` ``request``: the replica
    ``member`` runs on ``node``."""

    request: int
    member: str
    node: str


@dataclass
class QueueOps:
    """From a tool: run ``command`` on the masters of ``queues``
    (``[(vhost, name), ...]``); answered with :class:`QueueOpsResult`."""

    command: str
    queues: tuple[Sequence[str], ...]
    args: dict[str, Any] = field(default_factory=dict)
    timeout: float = 5.0


@dataclass
class QueueOpsResult:
    """One dict per queue asked, in order: vhost, name, ok, value, error."""

    results: list[dict[str, Any]]


@dataclass
class QuorumMembers:
    """From a tool: ``action`` on quorum queue ``name``: ``status`` (every
    member's Raft state), ``add`` (a member on ``node``) or ``delete`` (the
    member on ``node``); answered with :class:`QuorumMembersResult` within
    ``timeout``."""

    action: str
    vhost: str
    name: str
    node: str = ""
    timeout: float = 30.0


@dataclass
class QuorumMembersResult:
    """``value``: status -- one dict per member (the record's order); add /
    delete -- the member and the committed members.  ``reason`` names a
    failure for tools: not_found, not_quorum, no_node, node_down, exists,
    not_member, last_member, refused, timeout, bad_request."""

    ok: bool
    value: Any = None
    error: str = ""
    reason: str = ""


@dataclass
class ManagerStatusQuery:
    """Answered with ``{"node", "registered", "replicas": {"vhost/name": member}}``."""


# ---- what the core hands its driver ---------------------------------------------------------
@dataclass(frozen=True)
class ManagerLog:
    """A line for the node's log: ``event`` with ``fields`` at ``level``."""

    event: str
    level: str = "info"
    fields: dict[str, Any] = field(default_factory=dict)


# ---- timer keys ---------------------------------------------------------------------------
TICK = "tick"
CONVERGE = "converge"


@dataclass(frozen=True)
class DeclareTimeout:
    request: int


@dataclass(frozen=True)
class DeclarePoll:
    request: int


@dataclass(frozen=True)
class OpsTimeout:
    request: int


@dataclass(frozen=True)
class QuorumOpTimeout:
    request: int


@dataclass(frozen=True)
class QuorumOpRetry:
    request: int


# ---- internal state --------------------------------------------------------------------------
@dataclass
class _Declare:
    spec: dict[str, Any]
    src: str | None  # the requester answered (None: nobody)
    nodes: tuple[str, ...]  # named by the request (pinned), or ()
    started: dict[str, str] = field(default_factory=dict)  # node -> member
    want: tuple[str, ...] = ()  # the founders' nodes, master first (once chosen)
    founders: tuple[str, ...] = ()  # their members (once all started and FoundGroup sent)
    claimed: bool = False
    holder: str | None = None  # the node of the concurrent declare holding the name
    registry_error: str = ""  # why the registry last refused the claim
    policy: Any = None
    definition: dict[str, Any] | None = None  # the effective definition the founders were started with
    quorum: bool = False  # a quorum queue: founders are its voters (stable names)

    @property
    def key(self) -> list[str]:
        return [self.spec["vhost"], self.spec["name"]]


@dataclass
class _PendingStart:
    requester: str | None  # None: a recovery of this manager's own
    request: int
    key: tuple[str, str]
    host: int


@dataclass
class _Recovery:
    row: dict[str, Any]
    version: int  # of the view read
    member: str | None = None  # the new replica, once started
    checking: bool = False  # a read of the view is outstanding
    recheck: bool = False  # that read failed: the next tick reads again


@dataclass
class _Ops:
    src: str | None  # the requester answered (None: nobody)
    msg: QueueOps
    queues: list[tuple[str, ...]]
    results: list[Any]


@dataclass
class _QuorumOp:
    src: str | None
    msg: QuorumMembers
    stage: str = "reading the queue's record"  # what it waits for (a timeout names it)
    member: str | None = None  # add / delete: the member's stable name, once known
    starting: bool = False  # add: the new member's StartReplica is out
    status: dict[str, Any] = field(default_factory=dict)  # status: member -> its answer (or why none)
    members: list[str] = field(default_factory=list)  # status: the record's members


@dataclass
class _Request:
    """A registry request outstanding: ``what`` names it in logs,
    ``answer(msg)`` takes the agent's RegistryRows / RegistryResult,
    ``expired()`` (if any) runs when it is given up unanswered."""

    what: str
    answer: Callable[[Any], None]
    expired: Callable[[], None] | None = None


def _check_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"QueueManagerCore: {what} must be a non-empty string, got {value!r}")
    return value


class QueueManagerCore:
    """The queue manager of node ``node``, reachable at ``me`` (see the module docstring)."""

    def __init__(
        self,
        node: str,
        me: str,
        *,
        agent: str,
        hosts: Sequence[str],
        data_dir: str,
        rng: random.Random,
        node_fields: dict[str, Any] | None = None,
        start_timeout: float = START_TIMEOUT,
        placement_retry: float = PLACEMENT_RETRY,
    ) -> None:
        self.node = _check_name("node", node)
        self.me = _check_name("me", me)
        self.agent = _check_name("agent", agent)
        if isinstance(hosts, str) or not hosts:
            raise ValueError(f"QueueManagerCore: hosts must be a non-empty sequence of names, got {hosts!r}")
        self.hosts = tuple(_check_name("every host", h) for h in hosts)
        if not isinstance(data_dir, str):
            raise ValueError(f"QueueManagerCore: data_dir must be a string, got {data_dir!r}")
        if not isinstance(rng, random.Random):
            raise ValueError(f"QueueManagerCore: rng must be a random.Random, got {rng!r}")
        for what, v in (("start_timeout", start_timeout), ("placement_retry", placement_retry)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"QueueManagerCore: {what} must be a positive number of seconds, got {v!r}")
        self.data_dir = data_dir
        self.rng = rng
        self.start_timeout = float(start_timeout)
        self.claim_stale = 2 * self.start_timeout
        self.node_row = {**(node_fields or {}), "name": node, "state": "member", "manager": me}
        self.converger = cv.Converger(node, retry_after=placement_retry)
        self.registry = RegistryClient("queue_manager", REQUEST_TIMEOUT)

        self.replicas: dict[tuple[str, str], str] = {}  # (vhost, name) -> member running here
        self.pending_start: dict[int, _PendingStart] = {}  # token -> start asked of a host
        self.start_after_exit: dict[str, tuple[Any, ...]] = {}  # stale replica's member -> (StartReplica, requester)
        self.declares: dict[int, _Declare] = {}
        # request ids differ between lives of a manager (a late answer to a
        # previous life must not match a new request)
        self.next_request = rng.getrandbits(40)
        self.next_token = 0
        self.tried_recovery: set[str] = set()
        self.recovering: dict[int, _Recovery] = {}
        self.registered = False
        self.nodes_view: set[str] = {node}  # nodes this node's membership sees up
        self.managers_seen: dict[str, str] = {}  # node -> its queue manager's address, as last read
        self.masters_per_node: dict[str, int] = {}
        self.converge_scheduled = False
        self.converge_running = False
        self.converge_again = False
        self.placement_starts: dict[int, tuple[Any, ...]] = {}  # request -> (queue key, node)
        self.ops: dict[int, _Ops] = {}  # QueueOps in progress
        self.op_requests: dict[int, tuple[Any, ...]] = {}  # QueueCommand request id -> (ops id, index)
        self.qops: dict[int, _QuorumOp] = {}  # QuorumMembers in progress
        self.qop_requests: dict[int, tuple[Any, ...]] = {}  # QueueCommand request id -> (qop id, member)
        self.mirror: dict[str, dict[Any, dict[str, Any]]] = {t: {} for t in MIRRORED_TABLES}  # table -> key -> row
        self.mirror_loaded: set[str] = set()
        self.mirror_asked: dict[str, float] = {}  # table -> when its load was asked for
        self.ticks = 0
        self.queue_count = 0
        self.warned: set[tuple[Any, ...]] = set()
        self.now = 0.0
        self._out: list[Action] = []
        self._local: list[Any] = []  # messages this manager sent itself, handled before the turn ends

    # ---- entry points ---------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        self._begin(now)
        self._send(self.agent, Subscribe())
        self._send(self.agent, RegistrySubscribe(MIRRORED_TABLES))
        self._mirror_load()
        self._send(self.agent, StatusQuery())
        self._register()
        self._out.append(SetTimer(TICK, RECOVER_EVERY))
        return self._end()

    def receive(self, now: float, src: str | None, msg: Any) -> list[Action]:
        self._begin(now)
        self._dispatch(src, msg)
        return self._end()

    def _dispatch(self, src: str | None, msg: Any) -> None:
        if isinstance(msg, (RegistryRows, RegistryResult)):
            req = self.registry.answer(msg)
            if req is not None:
                req.answer(msg)
        elif isinstance(msg, RegistryChanges):
            self._changes(msg.changes)
        elif isinstance(msg, DeclareQueue):
            self._declare(msg, src)
        elif isinstance(msg, StartReplica):
            self._start_replica(msg, src)
        elif isinstance(msg, StartReplicaDone):
            self._start_done(msg)
        elif isinstance(msg, ReplicaStarted):
            self._replica_started(msg)
        elif isinstance(msg, ReplicaStartFailed):
            self._replica_start_failed(msg)
        elif isinstance(msg, ReplicaExited):
            self._replica_exited(msg.member, tuple(msg.key), msg.reason)
        elif isinstance(msg, NodeEvent):
            if msg.kind == "up":
                self.nodes_view.add(msg.node)
            elif msg.kind == "down" and msg.node != self.node:
                self.nodes_view.discard(msg.node)
            self._schedule_converge()
        elif isinstance(msg, NodeStatus):
            self.nodes_view = {n for n, v in msg.view.items() if v.get("state") == "up"} | {self.node}
        elif isinstance(msg, QueueOps):
            self._queue_ops(msg, src)
        elif isinstance(msg, QuorumMembers):
            self._qop_start(msg, src)
        elif isinstance(msg, CommandResult):
            if msg.request_id in self.qop_requests:
                self._qop_answer(msg)
            else:
                self._op_answer(msg.request_id, msg.ok, msg.value, msg.error)
        elif isinstance(msg, NotMaster):
            rid = getattr(msg.request, "request_id", None)
            if rid in self.qop_requests:
                self._qop_not_leader(rid, msg.master)
            elif rid is not None:
                self._op_answer(rid, False, None, f"the replica asked is not the master (master: {msg.master})")
        elif isinstance(msg, ManagerStatusQuery):
            self._send(
                src,
                {
                    "node": self.node,
                    "registered": self.registered,
                    "replicas": {f"{k[0]}/{k[1]}": m for k, m in self.replicas.items()},
                },
            )
        else:
            self._warn_once(("unexpected", type(msg).__name__), "unexpected_message", message=type(msg).__name__)

    def timer(self, now: float, key: Hashable) -> list[Action]:
        self._begin(now)
        if key == TICK:
            self._tick()
            self._out.append(SetTimer(TICK, RECOVER_EVERY))
        elif key == CONVERGE:
            self.converge_scheduled = False
            self._converge_start()
        elif isinstance(key, DeclareTimeout):
            self._declare_timed_out(key.request)
        elif isinstance(key, DeclarePoll):
            d = self.declares.get(key.request)
            if d is not None:
                self._read("amqqueue", "declare-record", lambda m: self._declare_record(key.request, _rows(m)), d.key)
        elif isinstance(key, OpsTimeout):
            self._ops_timeout(key.request)
        elif isinstance(key, QuorumOpTimeout):
            self._qop_timeout(key.request)
        elif isinstance(key, QuorumOpRetry) and key.request in self.qops:
            self._qop_read(key.request)
        return self._end()

    def host_exited(self, now: float, index: int) -> list[Action]:
        """Queue host ``index`` died: its replicas and the starts it had not
        answered are gone (the driver starts a new host)."""
        self._begin(now)
        self._log("queue_host_exited", level="warning", host=index)
        for token in [t for t, p in self.pending_start.items() if p.host == index]:
            del self.pending_start[token]
        for key, member in sorted(self.replicas.items()):
            if host_index(key[0], key[1], len(self.hosts)) == index:
                self._replica_exited(member, key, "its queue host exited")
        return self._end()

    # ---- actions ------------------------------------------------------------------------------
    def _begin(self, now: float) -> None:
        self.now = now
        self._out = []
        self._local = []

    def _end(self) -> list[Action]:
        while self._local:  # what this manager sent itself: handled in the same turn, no hop
            self._dispatch(self.me, self._local.pop(0))
        out, self._out = self._out, []
        return out

    def _send(self, dst: str | None, msg: Any) -> None:
        if dst == self.me:
            self._local.append(msg)
        elif dst is not None:
            self._out.append(Send(dst, msg))

    def _log(self, event: str, level: str = "info", **fields: Any) -> None:
        self._out.append(Emit(ManagerLog(event, level, fields)))

    def _warn_once(self, key: tuple[Any, ...], event: str, **fields: Any) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self._log(event, level="warning", **fields)

    def _request_id(self) -> int:
        self.next_request += 1
        return self.next_request

    # ---- registry requests (any number outstanding, matched by ref) -------------------------
    def _get(
        self,
        table: str,
        what: str,
        answer: Callable[[RegistryRows], None],
        key: Any = None,
        expired: Callable[[], None] | None = None,
        linearizable: bool = False,
    ) -> None:
        self._send(self.agent, self.registry.get(self.now, table, key, _Request(what, answer, expired), linearizable))

    def _read(self, table: str, what: str, answer: Callable[[RegistryRows], None], key: Any = None) -> None:
        """A plain (not linearizable) read: from the copy of a subscribed table
        once it is loaded (it is as new as the last change the agent sent,
        which is what the agent would answer but for changes on the way), else
        from the agent."""
        if table not in self.mirror_loaded:
            self._get(table, what, answer, key)
            return
        rows = self.mirror[table]
        if key is None:
            found = [rows[k] for k in sorted(rows)]
        else:
            row = rows.get(tuple(key) if isinstance(key, (list, tuple)) else (key,))
            found = [] if row is None else [row]
        answer(RegistryRows(True, [dict(r) for r in found]))

    def _txn(
        self,
        txn: dict[str, Any],
        what: str,
        answer: Callable[[RegistryResult], None] | None = None,
        expired: Callable[[], None] | None = None,
    ) -> None:
        self._send(self.agent, self.registry.txn(self.now, txn, _Request(what, answer or (lambda _m: None), expired)))

    # ---- registration ---------------------------------------------------------------------------
    def _register(self) -> None:
        self._txn(
            {"ops": [{"op": "put", "table": "node", "key": [self.node], "record": dict(self.node_row)}]},
            "register",
            self._registered,
        )

    def _registered(self, msg: RegistryResult) -> None:
        if msg.ok:
            self.registered = True
            self._log("manager_registered")
        else:
            self._out.append(SetTimer(TICK, REGISTER_RETRY))  # registered again from the tick

    # ---- the tick: registration, given-up requests, the periodic scan --------------------------
    def _tick(self) -> None:
        self._send(self.agent, StatusQuery())
        for req in self.registry.expired(self.now):
            # the agent never answered (e.g. the request was buffered while
            # this node was joining and then dropped)
            self._log("registry_request_timeout", level="warning", request=req.what)
            if req.expired is not None:
                req.expired()
        if not self.registered:
            if not any(req.what == "register" for req in self.registry.pending()):
                self._register()
            return
        # the periodic scan and placement round (recovery, placement retries)
        # run every SLOW_TICK; changes and node events run placement at once
        self.ticks += 1
        self._mirror_load()
        for request, rec in sorted(self.recovering.items()):
            if rec.recheck:
                rec.recheck = False
                self._recover_check(request)
        if self.ticks % SLOW_TICK == 1 or self.recovering:
            if "amqqueue" in self.mirror_loaded:
                q = self.mirror["amqqueue"]
                self._scan([q[k] for k in sorted(q)])
            else:
                self._get("amqqueue", "scan-queues", lambda m: self._scan(m.rows if m.ok else None))
            self._schedule_converge()

    # ---- the subscribed tables, kept here from the registry's changes --------------------------
    def _mirror_load(self) -> None:
        for t in MIRRORED_TABLES:
            if t not in self.mirror_loaded and self.now - self.mirror_asked.get(t, float("-inf")) > REQUEST_TIMEOUT:
                self.mirror_asked[t] = self.now

                def loaded(m: RegistryRows, t: str = t) -> None:
                    self._mirror_loaded(t, m.rows if m.ok else None)

                self._get(t, f"mirror-load {t}", loaded)

    def _mirror_loaded(self, table: str, rows: list[dict[str, Any]] | None) -> None:
        self.mirror_asked.pop(table, None)
        if rows is None:
            return  # asked again on the next tick
        # the read answers a snapshot newer than every change heard before it
        # (the agent sends both in order): it replaces the table
        self.mirror[table] = {key_of(table, r): r for r in rows}
        self.mirror_loaded.add(table)

    def _changes(self, changes: list[Any] | None) -> None:
        if changes is None:  # the registry was reset from a snapshot: load again
            self.mirror_loaded.clear()
            self.mirror_asked.clear()
            self._mirror_load()
            self._schedule_converge()
            return
        for table, key, _old, new in changes:
            if table in self.mirror_loaded:
                k = tuple(key) if isinstance(key, (list, tuple)) else (key,)
                if new is None:
                    self.mirror[table].pop(k, None)
                else:
                    self.mirror[table][k] = new
        # a queue deleted by its master on this node: remove its bindings (the AMQP front end's rows)
        for vhost, name in deleted_queues(changes, self.node):

            def unbind(m: RegistryRows, v: str = vhost, n: str = name) -> None:
                self._unbind(v, n, m)

            self._get("binding", "unbind-deleted", unbind)
        self._declare_changes(changes)
        self._schedule_converge()

    def _unbind(self, vhost: str, name: str, msg: RegistryRows) -> None:
        ops = queue_binding_deletes(msg.rows if msg.ok else [], vhost, name)
        if ops:
            self._txn({"ops": ops}, "unbind-deleted")
        if not msg.ok:
            self._log("unbind_deleted_failed", level="warning", queue=[vhost, name], error=msg.error)

    # ---- replicas on this node ---------------------------------------------------------------
    def _replica_exited(self, member: str, key: tuple[str, str], reason: str) -> None:
        waiting = self.start_after_exit.pop(member, None)
        if self.replicas.get(key) == member:
            del self.replicas[key]
            self._log(
                "replica_exited",
                level="warning" if reason.startswith("crashed") else "info",
                queue=list(key),
                member=member,
                reason=reason,
            )
        if waiting is not None:
            self._start_replica(*waiting)

    def _start_replica(self, msg: StartReplica, requester: str | None) -> None:
        key = (msg.spec.get("vhost", "/"), msg.spec["name"])
        if msg.join:
            if key in self.replicas:  # idempotent: this node already hosts one
                member = self.replicas[key]
                if not msg.members or member in msg.members:
                    self._send(requester, StartReplicaDone(msg.request, member, self.node))
                    return
                # a leftover that is not in the queue's group (a founder of a
                # declare that failed, a replica of a view that moved on without
                # it): it would be reported started for ever and never join
                # (its store is the queue's directory here: the new one starts once it has exited)
                self._log("stale_replica_replaced", queue=list(key), member=member)
                del self.replicas[key]
                self.start_after_exit[member] = (msg, requester)
                self._send(member, ExitReplica())
                return
            if self._starting(key):
                return  # one is starting, or starts when the stale one has gone; its requester hears about it
        index = host_index(key[0], key[1], len(self.hosts))
        self.next_token += 1
        self.pending_start[self.next_token] = _PendingStart(requester, msg.request, key, index)
        self._send(
            self.hosts[index],
            ReplicaInit(
                dict(msg.spec),
                self.data_dir,
                self.node,
                self.agent,
                msg.fresh,
                self.next_token,
                join=msg.join,
                recover=msg.recover,
                policy=dict(msg.policy or {}),
                policy_name=msg.policy_name,
                quorum=msg.quorum,
            ),
        )

    def _starting(self, key: tuple[str, str]) -> bool:
        """A replica of queue ``key`` is starting here, or starts once a
        stale one has exited: no other start may open its store meanwhile."""
        return any(p.key == key for p in self.pending_start.values()) or any(
            (m.spec.get("vhost", "/"), m.spec["name"]) == key for m, _ in self.start_after_exit.values()
        )

    def _replica_start_failed(self, msg: ReplicaStartFailed) -> None:
        """A host started nothing for a ReplicaInit: forget the start (or no
        later one of that queue would ever be asked for) and converge again."""
        pend = self.pending_start.pop(msg.token, None)
        if pend is None:
            return
        self._log("replica_start_failed", level="warning", queue=list(pend.key), reason=msg.reason)
        self.recovering.pop(pend.request, None)
        self._schedule_converge()

    def _replica_started(self, msg: ReplicaStarted) -> None:
        pend = self.pending_start.pop(msg.token, None)
        if pend is None:
            return
        self.replicas[pend.key] = msg.member
        self._log("replica_created", queue=list(pend.key), member=msg.member)
        if pend.requester is not None:
            self._send(pend.requester, StartReplicaDone(pend.request, msg.member, msg.node))
        else:
            self._recovered_replica(pend.request, msg.member)

    # ---- declare --------------------------------------------------------------------------------
    def _declare(self, msg: DeclareQueue, src: str | None) -> None:
        spec = dict(msg.spec)
        spec.setdefault("vhost", "/")
        if not isinstance(spec.get("name"), str) or not isinstance(spec["vhost"], str):
            self._send(
                src,
                DeclareResult(
                    False,
                    {},
                    f"queue {spec.get('name')!r}: a declare needs a queue name and a vhost (strings), got {spec!r}",
                ),
            )
            return
        if msg.nodes and "x-ha-policy" not in (spec.get("arguments") or {}):
            # named nodes pin the placement (RabbitMQ 2.x's declaration arguments)
            spec["arguments"] = {
                **(spec.get("arguments") or {}),
                "x-ha-policy": "nodes",
                "x-ha-policy-params": list(msg.nodes),
            }
        spec.setdefault("incarnation", f"{self.rng.getrandbits(64):016x}")
        rid = self._request_id()
        d = self.declares[rid] = _Declare(spec, src, tuple(msg.nodes))
        self._out.append(SetTimer(DeclareTimeout(rid), self.start_timeout))
        self._read("amqqueue", "declare-check", lambda m: self._declare_check(rid, _rows(m)), d.key)

    def _declare_poll(self) -> float:
        return DECLARE_POLL_SUBSCRIBED if "amqqueue" in self.mirror_loaded else DECLARE_POLL

    def _declare_check(self, rid: int, rows: list[dict[str, Any]]) -> None:
        if rid not in self.declares:
            return
        if rows and rows[0].get("pid"):
            self._declare_done(rid, DeclareResult(True, rows[0]))
            return
        self._claim(rid, None)

    def _claim(self, rid: int, stale: dict[str, Any] | None) -> None:
        """Claim the queue's name for this declare (or take over ``stale``)."""
        d = self.declares[rid]
        key = d.key
        claim = {"vhost": key[0], "name": key[1], "node": self.node, "request": rid, "time": self.now}
        if stale is None:
            checks = [{"table": "queue_claim", "key": key, "absent": True}]
        else:
            checks = [{"table": "queue_claim", "key": key, "field": "time", "equals": stale["time"]}]
        self._txn(
            {"checks": checks, "ops": [{"op": "put", "table": "queue_claim", "key": key, "record": claim}]},
            "claim",
            lambda m: self._claimed(rid, m.ok, m.error),
            expired=lambda: self._claimed(rid, False, "the claim went unanswered"),
        )

    def _claimed(self, rid: int, ok: bool, error: str = "") -> None:
        d = self.declares.get(rid)
        if d is None or d.claimed:
            return
        if not ok:
            d.registry_error = error
        if ok:
            d.claimed = True
            if d.nodes:
                self._read("node", "declare-nodes", lambda m: self._declare_nodes(rid, _rows(m)))
            else:
                self._read("policy", "declare-policies", lambda m: self._declare_policies(rid, _rows(m)))
            return
        # another declare of this queue holds the name: answer with its record (or take a dead one's claim over)
        self._get("queue_claim", "claim-read", lambda m: self._claim_rows(rid, _rows(m)), d.key)

    def _claim_rows(self, rid: int, rows: list[dict[str, Any]]) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if rows and rows[0].get("node") == self.node and rows[0].get("request") == rid:
            self._claimed(rid, True)  # its answer was lost: the claim is this declare's
            return
        if rows and self.now - float(rows[0].get("time", 0)) > self.claim_stale:
            self._log("queue_claim_taken_over", queue=d.spec["name"], from_node=rows[0].get("node"))
            self._claim(rid, rows[0])
            return
        if not rows:
            self._claim(rid, None)  # released meanwhile: claim it (the record may exist now: checked after)
            return
        d.holder = str(rows[0].get("node"))  # its record answers this declare
        self._out.append(SetTimer(DeclarePoll(rid), self._declare_poll()))

    def _declare_policies(self, rid: int, rows: list[dict[str, Any]]) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        policies, errors = policies_from_rows(rows)
        for e in errors:
            self._warn_once(("bad-policy", e), "policy_invalid", error=e)
        d.policy = match(policies, d.spec["vhost"], d.spec["name"], "queue")
        self._read("node", "declare-nodes", lambda m: self._declare_nodes(rid, _rows(m)))

    def _declare_nodes(self, rid: int, rows: list[dict[str, Any]]) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        managers = {r["name"]: r.get("manager") for r in rows if r.get("manager")}
        want = list(d.nodes)
        if not want:  # by policy (see the module docstring)
            up = (self.nodes_view & set(managers)) | {self.node}
            arguments = d.spec.get("arguments") or {}
            try:
                want = cv.declare_placement(
                    d.policy,
                    self.node,
                    up,
                    queue_name=d.spec["name"],
                    masters_per_node=self.masters_per_node,
                    rng=self.rng,
                    locator=arguments.get("x-queue-master-locator"),
                    arguments=arguments,
                )
            except ValueError as e:
                self._declare_failed(rid, str(e))
                return
        missing = [n for n in want if n not in managers]
        if missing:
            self._declare_failed(rid, f"no queue manager known on node(s) {', '.join(missing)}")
            return
        if is_quorum(d.spec):
            return self._declare_quorum(rid, managers)
        try:
            definition = cv.effective_placement_definition(d.policy, d.spec.get("arguments")) or {}
        except ValueError as e:
            self._declare_failed(rid, str(e))
            return
        d.want, d.definition = tuple(want), definition
        for n in want:
            self._send(
                managers[n],
                StartReplica(
                    d.spec, rid, policy=definition, policy_name=d.policy.name if d.policy is not None else None
                ),
            )

    def _declare_quorum(self, rid: int, managers: dict[str, Any]) -> None:
        """A quorum queue's members: this node first (``client-local``; with
        ``x-queue-leader-locator: balanced`` the node leading the fewest
        quorum queues first), then the other nodes up,
        ``x-quorum-initial-group-size`` of them (default every node up); each
        member is started with the whole voter list, and the first one stands
        for election at once (:mod:`mirrorq.quorum.hosted`)."""
        d = self.declares[rid]
        up = sorted((self.nodes_view & set(managers)) - {self.node})
        nodes = [self.node] + up
        arguments = d.spec.get("arguments") or {}
        if arguments.get("x-queue-leader-locator") == "balanced":  # the node leading fewest quorum queues first
            led: dict[str, int] = {}
            for row in self.mirror.get("amqqueue", {}).values():
                if is_quorum(row) and row.get("pid"):
                    n = str(row["pid"]).split("/", 1)[0]
                    led[n] = led.get(n, 0) + 1
            nodes.sort(key=lambda n: (led.get(n, 0), n != self.node, n))
        size = arguments.get("x-quorum-initial-group-size")
        if size is not None:
            nodes = nodes[: max(1, int(size))]
        voters = [stable_name(n, f"{self.rng.getrandbits(64):016x}") for n in nodes]
        d.want, d.quorum = tuple(nodes), True
        # the matching policy's name goes into the leader's first record (no second write to name it)
        spec = {**d.spec, "type": "quorum", "policy": d.policy.name if d.policy is not None else None}
        for n, v in zip(nodes, voters):
            self._send(managers[n], StartReplica(spec, rid, quorum={"member": v, "voters": voters}))
        d.founders = tuple(voters)

    def _start_done(self, msg: StartReplicaDone) -> None:
        if msg.request in self.qops:
            return self._qop_started(msg)
        d = self.declares.get(msg.request)
        if d is None:
            placed = self.placement_starts.pop(msg.request, None)
            if placed is not None:
                self._log("mirror_started", queue=list(placed[0]), node=msg.node, member=msg.member)
            return
        if d.quorum:
            d.started[msg.node] = msg.member  # the record comes from the elected leader
            if set(d.started) >= set(d.want):
                self._quorum_rows(msg.request)
                self._out.append(SetTimer(DeclarePoll(msg.request), 2 * self._declare_poll()))
            return
        if d.founders or msg.node not in d.want:
            return
        d.started[msg.node] = msg.member
        if set(d.started) >= set(d.want):
            d.founders = tuple(d.started[n] for n in d.want)
            self._send(d.founders[0], FoundGroup(d.founders))
            self._out.append(SetTimer(DeclarePoll(msg.request), 2 * self._declare_poll()))

    def _quorum_rows(self, rid: int) -> None:
        """Every member of a new quorum queue has started: their addresses
        in ``quorum_member``, one transaction (put again until it commits,
        while the declare waits)."""
        d = self.declares.get(rid)
        if d is None or not d.quorum:
            return
        group = group_name(d.spec.get("vhost", "/"), d.spec["name"])
        ops = [member_row_put(group, v, n, d.started[n]) for n, v in zip(d.want, d.founders)]

        def again(_m: Any = None) -> None:
            if rid in self.declares:
                self._quorum_rows(rid)

        self._txn({"ops": ops}, "quorum-rows", lambda m: None if m.ok else again(), expired=again)

    def _declare_changes(self, changes: list[Any]) -> None:
        """A declare waiting for its queue's record hears of it as soon as
        the registry applies it (the poll is the fallback)."""
        if not self.declares:
            return
        waiting = {tuple(d.key): rid for rid, d in self.declares.items() if d.founders or d.holder is not None}
        for table, key, _old, new in changes:
            if table == "amqqueue" and new is not None and isinstance(key, (list, tuple)) and len(key) == 2:
                rid = waiting.get((key[0], key[1]))
                if rid is not None and new.get("pid"):
                    self._declare_record(rid, [new], poll=False)

    def _declare_record(self, rid: int, rows: list[dict[str, Any]], poll: bool = True) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        if rows and rows[0].get("pid") and d.holder is not None:
            self._declare_done(rid, DeclareResult(True, dict(rows[0])))  # the concurrent declare placed it
        elif rows and rows[0].get("pid") and _pid_member(rows[0]["pid"]) in d.founders:
            record = dict(rows[0])
            policy = d.policy
            if policy is not None and record.get("policy") != policy.name:
                self._record_policy(record["vhost"], record["name"], policy.name)
                record["policy"] = policy.name
            if d.definition is not None:
                self.converger.told(record, d.definition)  # the founders started with it: no SetPolicy round
            self._declare_done(rid, DeclareResult(True, record))
        elif poll:
            self._out.append(SetTimer(DeclarePoll(rid), self._declare_poll()))

    def _declare_done(self, rid: int, result: DeclareResult) -> None:
        d = self.declares.pop(rid, None)
        if d is None:
            return
        self._out += [CancelTimer(DeclareTimeout(rid)), CancelTimer(DeclarePoll(rid))]
        self._send(d.src, result)
        # a placed queue keeps its claim until it is deleted (deleted with
        # its record: one transaction fewer per declare); a failed declare frees the name
        if d.claimed and not result.ok:
            key = d.key
            self._txn(
                {
                    "checks": [
                        {"table": "queue_claim", "key": key, "field": "request", "equals": rid},
                        {"table": "queue_claim", "key": key, "field": "node", "equals": self.node},
                    ],
                    "ops": [{"op": "delete", "table": "queue_claim", "key": key}],
                },
                "unclaim",
            )

    def _declare_failed(self, rid: int, why: str) -> None:
        d = self.declares.get(rid)
        if d is not None:
            self._log("declare_failed", level="error", queue=d.spec["name"], error=why)
            self._declare_done(rid, DeclareResult(False, {}, f"queue '{d.spec['name']}': {why}"))

    def _declare_timed_out(self, rid: int) -> None:
        d = self.declares.get(rid)
        if d is None:
            return
        within = f"within {self.start_timeout:g}s"
        if d.founders:
            master = d.founders[0]
            why = f"its master {master} (node {d.want[0]}) did not write the queue's record {within}"
        elif d.want:
            late = [n for n in d.want if n not in d.started]
            why = f"the queue manager of node(s) {', '.join(late)} did not answer StartReplica {within}"
        elif d.holder is not None:
            why = f"the concurrent declare of node {d.holder} holds the name and placed no queue {within}"
        elif d.registry_error:
            why = f"the registry did not take the claim on its name {within} ({d.registry_error})"
        else:
            why = f"the registry did not answer {within}"
        self._declare_failed(rid, why)

    # ---- recovery ----------------------------------------------------------------------------
    def _scan(self, rows: list[dict[str, Any]] | None) -> None:
        self._scan_quorum([r for r in rows or () if is_quorum(r)])
        rows = [r for r in rows or () if not is_quorum(r)]
        durable = [r for r in rows or () if r.get("durable") and (r["vhost"], r["name"]) not in self.replicas]
        if durable:
            self._get(GM_TABLE, "scan-groups", lambda m: self._scan_groups(m.rows if m.ok else None, durable))

    def _scan_quorum(self, rows: list[dict[str, Any]]) -> None:
        """Start again every member of this node that a quorum queue's record
        lists and that does not run here (after a restart: from its log)."""
        for row in rows:
            key = (row["vhost"], row["name"])
            if key in self.replicas or self._starting(key):
                continue
            members = [str(m) for m in row.get("members") or ()]
            mine = [m for m in members if m.split("/", 1)[0] == self.node]
            if not mine or mine[0] in self.tried_recovery:
                continue
            self.tried_recovery.add(mine[0])
            self._log("recovering_quorum_member", queue=row["name"], member=mine[0])
            spec = {**cv.spec_of(row), "type": "quorum"}
            self._start_replica(
                StartReplica(spec, self._request_id(), recover=True, quorum={"member": mine[0], "voters": members}),
                None,
            )

    def _scan_groups(self, groups: list[dict[str, Any]] | None, rows: list[dict[str, Any]]) -> None:
        """Recover the queues whose GM view is led by a member of this node
        that is not running any more (see the module docstring)."""
        if groups is None:
            return
        by_name = {g["name"]: g for g in groups}
        hosted = set(self.replicas.values())
        for row in rows:
            g = by_name.get(group_name(row["vhost"], row["name"]))
            if g is None or not g["members"]:
                continue
            first = g["members"][0]
            try:
                ref = parse_member_name(first)
            except ValueError:
                continue
            if (
                ref.node != self.node
                or first in hosted
                or first in self.tried_recovery
                or self._starting((row["vhost"], row["name"]))
            ):
                continue
            self.tried_recovery.add(first)
            request = self._request_id()
            self.recovering[request] = _Recovery(row, g["version"])
            spec = cv.spec_of(row)
            self._log("recovering_queue", queue=row["name"], old_member=first, view_version=g["version"])
            self._start_replica(StartReplica(spec, request, recover=True), None)

    def _recovered_replica(self, request: int, member: str) -> None:
        rec = self.recovering.get(request)
        if rec is None:
            return
        rec.member = member
        self._recover_txn(request)

    def _recover_txn(self, request: int) -> None:
        """Found the view ``{member}`` on the version read (and nothing else)."""
        rec = self.recovering[request]
        g = group_name(rec.row["vhost"], rec.row["name"])
        txn = {
            "checks": [{"table": GM_TABLE, "key": [g], "field": "version", "equals": rec.version}],
            "ops": [
                {
                    "op": "put",
                    "table": GM_TABLE,
                    "key": [g],
                    "record": {"name": g, "version": rec.version + 1, "members": [rec.member]},
                }
            ],
        }
        self._txn(
            txn,
            "recover",
            lambda m: self._recover_won(request) if m.ok else self._recover_check(request),
            expired=lambda: self._recover_check(request),
        )

    def _recover_check(self, request: int) -> None:
        """The transaction failed or went unanswered: a linearizable read of
        the group tells whether it founded the view (its answer may have been
        lost, or its own resend failed the version check), never will (the
        version moved on without it), or did not happen yet (sent again)."""
        rec = self.recovering.get(request)
        if rec is None or rec.checking:
            return
        rec.checking = True
        g = group_name(rec.row["vhost"], rec.row["name"])

        def unsure() -> None:  # no answer: the next tick asks again
            rec.checking, rec.recheck = False, True

        def answer(m: RegistryRows) -> None:
            rec.checking = False
            row = m.rows[0] if m.ok and m.rows else None
            if not m.ok:
                rec.recheck = True
            elif row is not None and rec.member in row.get("members", ()):
                self._recover_won(request)
            elif row is not None and row.get("version") == rec.version:
                self._recover_txn(request)
            else:
                self._recover_lost(request, "the view changed since it was read" if row else "the group is gone")

        self._get(GM_TABLE, "recover-check", answer, [g], linearizable=True, expired=unsure)

    def _recover_won(self, request: int) -> None:
        rec = self.recovering.pop(request, None)
        if rec is not None:
            self._log("queue_recovered", queue=rec.row["name"], member=rec.member, view_version=rec.version + 1)

    def _recover_lost(self, request: int, why: str) -> None:
        rec = self.recovering.pop(request, None)
        if rec is None:
            return
        self._log(
            "queue_recovery_lost",
            level="warning",
            queue=rec.row["name"],
            member=rec.member,
            view_version=rec.version,
            error=why,
        )
        key = (rec.row["vhost"], rec.row["name"])
        if self.replicas.get(key) == rec.member:
            del self.replicas[key]
            self._send(rec.member, ExitReplica())

    # ---- placement -------------------------------------------------------------------------
    def _schedule_converge(self) -> None:
        if not self.converge_scheduled:
            self.converge_scheduled = True
            # a round reads and plans every queue: with many queues, batch more changes per round
            self._out.append(SetTimer(CONVERGE, CONVERGE_DELAY + self.queue_count / 5000))

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

        def given_up() -> None:  # the round ends without acting
            self._converge(None, None, None)

        def queues(policy_rows: list[dict[str, Any]] | None, node_rows: list[dict[str, Any]] | None) -> None:
            self._get(
                "amqqueue",
                "converge-queues",
                lambda m: self._converge(policy_rows, node_rows, m.rows if m.ok else None),
                expired=given_up,
            )

        self._get(
            "policy",
            "converge-policy",
            lambda mp: self._get(
                "node",
                "converge-nodes",
                lambda mn: queues(mp.rows if mp.ok else None, mn.rows if mn.ok else None),
                expired=given_up,
            ),
            expired=given_up,
        )

    def _converge(
        self,
        policy_rows: list[dict[str, Any]] | None,
        node_rows: list[dict[str, Any]] | None,
        queue_rows: list[dict[str, Any]] | None,
    ) -> None:
        self.converge_running = False
        if self.converge_again:
            self.converge_again = False
            self._schedule_converge()
        if policy_rows is None or node_rows is None or queue_rows is None:
            return
        queue_rows = [r for r in queue_rows if not is_quorum(r)]  # Raft groups: no ha-* placement
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
        # a record naming a master of this node that does not run here (it
        # died with a previous life of this node, or this copy of the table
        # is older than its promotion elsewhere) is nobody's to act on here
        hosted = set(self.replicas.values())
        queue_rows = [r for r in queue_rows if not self._dead_master_here(r, hosted)]
        for a in self.converger.converge(self.now, queue_rows, policies, up):
            self._placement_action(a, managers)

    def _dead_master_here(self, row: dict[str, Any], hosted: set[str]) -> bool:
        pid = row.get("pid")
        if not pid:
            return False
        try:
            return cv.node_of(pid) == self.node and pid not in hosted
        except ValueError:
            return False

    def _record_policy(self, vhost: str, name: str, policy: str | None) -> None:
        key = [vhost, name]

        def done(m: RegistryResult) -> None:
            if not m.ok:
                self._log("policy_record_failed", level="warning", queue=key, error=m.error)

        self._txn(
            {
                "checks": [{"table": "amqqueue", "key": key, "exists": True}],
                "ops": [{"op": "update", "table": "amqqueue", "key": key, "fields": {"policy": policy}}],
            },
            "policy",
            done,
        )

    def _placement_action(self, a: Any, managers: dict[str, Any]) -> None:
        if isinstance(a, cv.StartMirrorOn):
            if a.node not in managers:
                return
            request = self._request_id()
            self.placement_starts[request] = ((a.vhost, a.name), a.node)
            self._log("start_mirror", queue=[a.vhost, a.name], node=a.node)
            self._send(
                managers[a.node],
                StartReplica(
                    dict(a.spec), request, join=True, policy=dict(a.definition or {}), members=tuple(a.members)
                ),
            )
        elif isinstance(a, cv.StopMirrorMember):
            self._log("stop_mirror", queue=[a.vhost, a.name], node=a.node, member=a.member)
            self._send(a.member, StopReplica())
        elif isinstance(a, cv.RecordPolicy):
            self._log("queue_policy", queue=[a.vhost, a.name], policy=a.policy)
            self._record_policy(a.vhost, a.name, a.policy)
        elif isinstance(a, cv.PushDefinition):
            self._log("queue_definition", queue=[a.vhost, a.name], definition=a.definition, replicas=len(a.members))
            for m in a.members:
                self._send(m, SetPolicy(dict(a.definition)))
        elif isinstance(a, cv.TransferMasterTo):
            self._log("master_transfer", queue=[a.vhost, a.name], node=a.node, master=a.member)
            self._send(a.member, MasterHandOver(a.node))
        elif isinstance(a, cv.BadRecord):
            self._warn_once(
                ("bad-record", a.vhost, a.name), "queue_record_invalid", queue=[a.vhost, a.name], error=a.error
            )

    # ---- queue commands for tools -----------------------------------------------------------
    def _queue_ops(self, msg: QueueOps, src: str | None) -> None:
        rid = self._request_id()
        queues = [tuple(q) for q in msg.queues]
        self.ops[rid] = _Ops(src, msg, queues, [None] * len(queues))
        if not queues:
            return self._ops_finish(rid)
        self._get("amqqueue", "ops-queues", lambda m: self._ops_rows(rid, m.rows if m.ok else None, m.error))
        self._out.append(SetTimer(OpsTimeout(rid), max(0.1, float(msg.timeout))))

    def _ops_rows(self, rid: int, rows: list[dict[str, Any]] | None, error: str) -> None:
        op = self.ops.get(rid)
        if op is None:
            return
        if rows is None:
            for i, (vhost, name) in enumerate(op.queues):
                op.results[i] = _op_result(vhost, name, False, None, f"registry read failed: {error}")
            return self._ops_finish(rid)
        by_key = {(r["vhost"], r["name"]): r for r in rows}
        for i, (vhost, name) in enumerate(op.queues):
            row = by_key.get((vhost, name))
            if row is None:
                op.results[i] = _op_result(vhost, name, False, None, f"no queue '{name}' in vhost '{vhost}'")
                continue
            pid = row.get("pid")
            try:
                master_node = cv.node_of(pid)
            except ValueError:
                op.results[i] = _op_result(vhost, name, False, None, f"queue '{name}' in vhost '{vhost}' has no master")
                continue
            if master_node not in self.nodes_view:
                op.results[i] = _op_result(
                    vhost,
                    name,
                    False,
                    None,
                    f"queue '{name}' in vhost '{vhost}': its master's node {master_node} is down",
                )
                continue
            request = self._request_id()
            self.op_requests[request] = (rid, i)
            dst = row.get("leader_dst") if is_quorum(row) else pid  # a quorum pid is an epoch
            self._send(dst, QueueCommand(name, (self.me, 0), request, op.msg.command, dict(op.msg.args)))
        self._ops_maybe_done(rid)

    def _op_answer(self, request_id: int, ok: bool, value: Any, error: str) -> None:
        where = self.op_requests.pop(request_id, None)
        if where is None:
            return
        rid, i = where
        op = self.ops.get(rid)
        if op is None:
            return
        vhost, name = op.queues[i]
        op.results[i] = _op_result(vhost, name, ok, value, error)
        self._ops_maybe_done(rid)

    def _ops_maybe_done(self, rid: int) -> None:
        op = self.ops.get(rid)
        if op is not None and all(r is not None for r in op.results):
            self._ops_finish(rid)

    def _ops_timeout(self, rid: int) -> None:
        op = self.ops.get(rid)
        if op is None:
            return
        for i, r in enumerate(op.results):
            if r is None:
                vhost, name = op.queues[i]
                op.results[i] = _op_result(
                    vhost,
                    name,
                    False,
                    None,
                    f"the master of queue '{name}' in vhost '{vhost}' did not answer "
                    f"{op.msg.command!r} within {op.msg.timeout:g}s",
                )
        self._ops_finish(rid)

    def _ops_finish(self, rid: int) -> None:
        op = self.ops.pop(rid, None)
        if op is None:
            return
        self._out.append(CancelTimer(OpsTimeout(rid)))
        for k in [k for k, v in self.op_requests.items() if v[0] == rid]:
            del self.op_requests[k]
        self._send(op.src, QueueOpsResult(list(op.results)))

    # ---- quorum queue membership for tools (QuorumMembers) -----------------------------------
    def _qop_start(self, msg: QuorumMembers, src: str | None) -> None:
        rid = self._request_id()
        self.qops[rid] = _QuorumOp(src, msg)
        if (
            msg.action not in ("status", "add", "delete")
            or not isinstance(msg.name, str)
            or not isinstance(msg.vhost, str)
            or (msg.action != "status" and (not isinstance(msg.node, str) or not msg.node))
        ):
            return self._qop_finish(
                rid,
                False,
                error=f"bad request {msg!r}: action status, add or delete (add and delete name a node)",
                reason="bad_request",
            )
        self._out.append(SetTimer(QuorumOpTimeout(rid), max(0.1, float(msg.timeout))))
        self._qop_read(rid)

    def _qop_read(self, rid: int) -> None:
        op = self.qops[rid]
        key = [op.msg.vhost, op.msg.name]
        self._get("amqqueue", "quorum-members-record", lambda m: self._qop_record(rid, m), key)

    def _qop_record(self, rid: int, m: RegistryRows) -> None:
        op = self.qops.get(rid)
        if op is None:
            return
        if not m.ok:  # asked again (the op's timeout bounds it)
            op.stage = f"the registry (reading the queue's record: {m.error})"
            self._out.append(SetTimer(QuorumOpRetry(rid), 0.2))
            return
        q = op.msg
        what = f"queue '{q.name}' in vhost '{q.vhost}'"
        if not m.rows:
            return self._qop_finish(rid, False, error=f"no {what}", reason="not_found")
        row = m.rows[0]
        if not is_quorum(row):
            return self._qop_finish(
                rid,
                False,
                error=f"{what} is not a quorum queue (type {row.get('type') or 'classic'})",
                reason="not_quorum",
            )
        members = [str(x) for x in row.get("members") or ()]
        if q.action == "status":
            return self._qop_status(rid, row, members)
        self._get("node", "quorum-members-nodes", lambda n: self._qop_nodes(rid, row, members, _rows(n)))

    def _qop_nodes(self, rid: int, row: dict[str, Any], members: list[str], nodes: list[dict[str, Any]]) -> None:
        op = self.qops.get(rid)
        if op is None:
            return
        q = op.msg
        what = f"queue '{q.name}' in vhost '{q.vhost}'"
        managers = {r["name"]: r.get("manager") for r in nodes if r.get("manager")}
        on_node = [x for x in members if x.split("/", 1)[0] == q.node]
        if q.node not in managers and not (q.action == "delete" and on_node):  # a forgotten node's member goes
            return self._qop_finish(
                rid,
                False,
                error=f"node {q.node} is not a member of the cluster (members: {', '.join(sorted(managers))})",
                reason="no_node",
            )
        if q.action == "delete":
            if op.member is not None and op.member not in members:  # a retry: the change is committed
                return self._qop_finish(rid, True, {"member": op.member, "members": members})
            if not on_node:
                return self._qop_finish(
                    rid,
                    False,
                    error=f"{what} has no member on node {q.node} (members: {', '.join(members)})",
                    reason="not_member",
                )
            if members == on_node[:1]:
                return self._qop_finish(
                    rid, False, error=f"{on_node[0]} is the last member of {what}", reason="last_member"
                )
            op.member = on_node[0]
            return self._qop_command(rid, row)
        if q.node not in self.nodes_view:
            return self._qop_finish(rid, False, error=f"node {q.node} is not running", reason="node_down")
        if op.member is not None:  # a retry after a leader change: the member is started
            return self._qop_command(rid, row)
        if on_node:
            return self._qop_finish(
                rid, False, error=f"{what} already has a member on node {q.node}: {on_node[0]}", reason="exists"
            )
        if op.starting:
            return
        op.starting, op.stage = True, f"the queue manager of node {q.node} (starting the new member)"
        bootstrap = [str(x) for x in row.get("bootstrap") or members]
        member = stable_name(q.node, f"{self.rng.getrandbits(64):016x}")
        spec = {**cv.spec_of(row), "type": "quorum"}
        self._send(
            managers[q.node],
            StartReplica(
                spec, rid, join=True, quorum={"member": member, "voters": bootstrap, "members": members, "join": True}
            ),
        )

    def _qop_started(self, msg: StartReplicaDone) -> None:
        """The new member runs on its node (a member of this queue that
        already ran there -- a previous try's -- answers instead): the
        leader adds it."""
        op = self.qops[msg.request]
        if op.member is not None:
            return
        node, _, rest = msg.member.partition("/")
        op.member = f"{node}/quorum/{rest.rsplit('/', 1)[-1]}"
        self._qop_read(msg.request)  # the leader as the record names it now

    def _qop_command(self, rid: int, row: dict[str, Any]) -> None:
        op = self.qops[rid]
        pid, dst = row.get("pid"), row.get("leader_dst")
        if not pid or not dst or cv.node_of(str(dst)) not in self.nodes_view:
            op.stage = "a leader of the queue (none is known to run)"
            self._out.append(SetTimer(QuorumOpRetry(rid), 0.25))
            return
        op.stage = f"the queue's leader {_pid_member(str(pid))} (committing the change)"
        request = self._request_id()
        self.qop_requests[request] = (rid, op.member)
        command = "add_member" if op.msg.action == "add" else "delete_member"
        self._send(dst, QueueCommand(op.msg.name, (self.me, 0), request, command, {"member": op.member}))

    def _qop_not_leader(self, request: int, hint: Any) -> None:
        rid, _member = self.qop_requests.pop(request)
        op = self.qops.get(rid)
        if op is not None:
            op.stage = f"a leader of the queue (the member asked is not; it names {hint})"
            self._out.append(SetTimer(QuorumOpRetry(rid), 0.2))

    def _qop_status(self, rid: int, row: dict[str, Any], members: list[str]) -> None:
        op = self.qops[rid]
        op.members, op.stage = members, "the members' status"
        group = group_name(op.msg.vhost, op.msg.name)
        for m in members:
            node = m.split("/", 1)[0]
            if node not in self.nodes_view:
                op.status[m] = {"member": m, "raft_state": "down", "error": f"node {node} is down"}
                continue

            def member_row(r: RegistryRows, m: str = m) -> None:
                self._qop_member_row(rid, m, r)

            self._get(MEMBER_TABLE, "quorum-status-member", member_row, [group, m])
        self._qop_status_maybe_done(rid)

    def _qop_member_row(self, rid: int, member: str, m: RegistryRows) -> None:
        op = self.qops.get(rid)
        if op is None:
            return
        dst = m.rows[0].get("dst") if m.ok and m.rows else None
        if not dst:
            op.status[member] = {"member": member, "raft_state": "noproc", "error": "no address registered"}
            return self._qop_status_maybe_done(rid)
        request = self._request_id()
        self.qop_requests[request] = (rid, member)
        self._send(dst, QueueCommand(op.msg.name, (self.me, 0), request, "member_status"))

    def _qop_answer(self, msg: CommandResult) -> None:
        rid, member = self.qop_requests.pop(msg.request_id)
        op = self.qops.get(rid)
        if op is None:
            return
        if op.msg.action == "status":
            op.status[member] = (
                dict(msg.value)
                if msg.ok and isinstance(msg.value, dict)
                else {"member": member, "raft_state": "noproc", "error": msg.error}
            )
            return self._qop_status_maybe_done(rid)
        if msg.ok:
            return self._qop_finish(rid, True, msg.value)
        self._qop_finish(rid, False, error=f"the leader refused: {msg.error}", reason="refused")

    def _qop_status_maybe_done(self, rid: int) -> None:
        op = self.qops[rid]
        if all(m in op.status for m in op.members):
            self._qop_finish(rid, True, [op.status[m] for m in op.members])

    def _qop_timeout(self, rid: int) -> None:
        op = self.qops.get(rid)
        if op is None:
            return
        if op.msg.action == "status" and op.members:
            for m in op.members:
                op.status.setdefault(
                    m, {"member": m, "raft_state": "timeout", "error": f"no answer within {op.msg.timeout:g}s"}
                )
            return self._qop_status_maybe_done(rid)
        self._qop_finish(
            rid,
            False,
            error=f"{op.msg.action} of a member of queue '{op.msg.name}' in vhost "
            f"'{op.msg.vhost}' did not complete within {op.msg.timeout:g}s: "
            f"waiting for {op.stage}",
            reason="timeout",
        )

    def _qop_finish(self, rid: int, ok: bool, value: Any = None, error: str = "", reason: str = "") -> None:
        op = self.qops.pop(rid, None)
        if op is None:
            return
        self._out += [CancelTimer(QuorumOpTimeout(rid)), CancelTimer(QuorumOpRetry(rid))]
        for k in [k for k, v in self.qop_requests.items() if v[0] == rid]:
            del self.qop_requests[k]
        if not ok:
            self._log(
                "quorum_members_failed",
                level="warning",
                action=op.msg.action,
                queue=op.msg.name,
                node=op.msg.node,
                error=error,
            )
        self._send(op.src, QuorumMembersResult(ok, value, error, reason))


def _rows(msg: RegistryRows) -> list[dict[str, Any]]:
    """The rows of a read, none if it failed."""
    return msg.rows if msg.ok else []


def _op_result(vhost: str, name: str, ok: bool, value: Any, error: str) -> dict[str, Any]:
    return {"vhost": vhost, "name": name, "ok": bool(ok), "value": value, "error": error or ""}
