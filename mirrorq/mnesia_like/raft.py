"""A sans-IO Raft core: the consensus under mirrorq's replicated registry.

One :class:`RaftNode` is one Raft server.  It follows :mod:`mirrorq.sansio`:
``start(now)``, ``receive(now, src, msg)``, ``timer(now, key)`` and the
entry points below take the time and return actions (``Send``, ``SetTimer``,
``CancelTimer``, ``Emit``).  Durable state lives in a
:class:`~mirrorq.mnesia_like.raft_log.RaftLog`; randomness comes from the
``random.Random`` the caller hands in, so runs in the simulator replay by seed.

Protocol (Ongaro's Raft, with the engineering of seed 002)
---------------------------------------------------------
* **Terms.**  A message carrying a higher term makes the receiver adopt it
  (forgetting its vote) and become a follower; a lower term is refused with
  the receiver's term in the reply.  Term and vote are durable before any
  reply that depends on them leaves: every entry point that wrote ends its
  actions with ``Persist`` (mirrorq.sansio), which the driver carries out
  -- :meth:`RaftNode.persist`, one ``log.flush()`` -- before the sends of
  the turn leave (group fsync, one flush per batch), the leader's appends
  excepted (next point).
* **Durability and sends** (Raft thesis 10.2.1; etcd's asynchronous storage
  writes).  With ``early_appends`` the leader's ``AppendEntries`` are
  ``Send(..., early=True)``: they may leave before the leader's own fsync of
  the entries they carry, so the followers write and fsync while the leader
  does.  They depend on no write of the turn: the leader counts its own log
  in the commit quorum only up to what it knows durable (``persist``, or
  :meth:`RaftNode.persisted` when the driver flushed the log its own way,
  returns the commits that unblocks), so an entry commits only once a
  majority holds it on disk, and a leader that loses the power before its
  fsync lost an entry no majority held without it (a new leader may commit
  it from the followers' copies, or overwrite it where it was never
  committed).  Only an ``AppendEntries`` of a term already durable is early
  (a leader elected in the turn that raised its term, a lone voter, waits:
  a restart without that term could lead it again with another log).
  Everything else still waits for the turn's ``Persist``: a follower's
  ``AppendEntriesReply`` (its acknowledgement claims the entries on disk),
  votes and replies carrying a new term, ``InstallSnapshot`` traffic, and
  whatever the application sends (a commit's replies).  Without
  ``early_appends`` (the registry) every send waits for the ``Persist``,
  and the leader counts its whole log.
* **Election.**  A voter that hears nothing from a leader for a randomised
  election timeout (uniform in ``election_timeout``) first runs a *pre-vote*
  round (``RequestVote(pre_vote=True)`` for ``term + 1``, no state changed);
  only with a majority of pre-votes does it increment its term and ask for
  real votes.  A vote is granted once per term, to a candidate whose log is at
  least as up to date (last term, then last index).  **Lease guard** (seed
  002, 2.4): a server that heard from a live leader less than the minimum
  election timeout ago -- or is the leader -- refuses both kinds of vote and
  does not adopt the candidate's term, so a removed or partitioned server
  cannot disrupt a working cluster.  Learners and servers outside the latest
  configuration never campaign.  ``leader_lost`` (a hint from the node
  agents' failure detector that the leader's node is down) drops the lease
  and campaigns within a fifth of the minimum election timeout.
* **Replication.**  The leader appends a no-op on election, then replicates
  with ``AppendEntries`` carrying at most ``max_entries_per_message`` entries
  and ``max_bytes_per_message`` of them (estimated with ``entry_size``; an
  entry bigger than that goes alone), *pipelined*: ``next_index`` advances
  optimistically as messages leave, without waiting for replies, so a
  follower writes and fsyncs one batch while the next is on its way.  The
  **in-flight window** bounds that per follower: at most ``max_inflight``
  AppendEntries carrying entries and ``max_inflight_bytes`` of their
  entries (estimated as for ``max_bytes_per_message``; a message starts
  only while the follower is under both, so the bytes may exceed it by one
  message) sent and not yet acknowledged; a full window waits for an
  acknowledgement (or the resend below, which starts the window over).
  A rejection (log mismatch) carries a hint
  (follower's last index + 1, or the first index of the conflicting term) and
  puts that follower in *probe* mode: one message at a time until one
  succeeds.  Unacknowledged data is resent after a heartbeat interval without
  progress.  Followers truncate only at a real conflict (same index, other
  term), so reordered or duplicated messages are harmless.
* **Commit.**  The leader commits the highest index stored on a majority of
  the voters of its latest configuration, but only if that entry is of its own
  term (earlier entries commit with it).  Followers learn the commit index
  from ``AppendEntries``, capped at the last index the message proved they
  match; when its commit index advances the leader tells every replicating
  follower (an entry-less ``AppendEntries``), so followers apply a commit
  one hop after the leader, not a heartbeat later: at once, or, with
  ``commit_notice_delay`` > 0, that long after the commit unless an
  ``AppendEntries`` carrying it left meanwhile (under a steady stream the
  next append tells, and a follower handles one message per entry, not
  two).  Committed
  entries are emitted in index order, exactly once per incarnation:
  ``Emit(Committed(index, term, command))``.  No-op and configuration
  entries are not emitted as ``Committed``; a committed
  configuration yields ``Emit(MembershipCommitted(index, config))``.
* **Proposals.**  ``propose`` on the leader appends and emits
  ``ProposalAccepted(pid, index, term)``; when that index is later applied the
  node emits ``ProposalCommitted(pid, ...)`` (after the ``Committed`` event)
  if the applied entry has the proposal's term, else ``ProposalLost`` (another
  entry won that index).  If a snapshot jumps over the index the outcome is
  ``ProposalUnknown`` (the application must be idempotent there, as seed 002
  warns).  ``propose`` anywhere else emits ``NotLeader(pid, leader_hint)``.
  Proposal tracking is volatile: it dies with the process.
* **Membership** (single-server changes, configurations take effect when
  appended, not when committed).  ``add_server`` first adds the server as a
  *learner*; any leader promotes a learner to voter, one change at a time,
  once the learner's match index is within ``catchup_margin`` of the leader's
  last index.  ``remove_server`` drops a voter or learner; a leader that
  removed itself keeps leading (not counting itself) until the change commits,
  then steps down; if it loses its leadership before that, it may still
  campaign (counting only the latest configuration's votes) while the
  removal is uncommitted, or a peer behind it could never win an election.
  A change is refused (``ConfigChangeRejected``) while another one is
  uncommitted or before the leader has committed an entry of its own term (the known single-server-change fix).
* **Snapshots.**  The application calls ``compact(now, index, data)`` with its
  state after applying ``index``; the core stores ``Snapshot(index, term,
  config, data)`` and drops the log up to ``index``.  A follower whose needed
  entries are gone receives the snapshot by ``InstallSnapshot``: its data
  pickled (as a message carrying it whole would have been) and sent in
  chunks of at most ``max_bytes_per_message``, one at a time, each answered
  with the bytes the follower holds (``InstallSnapshotReply.offset``); the
  leader sends on from there, resends after a minimum election timeout
  without reply, and starts again from byte 0 when it has compacted since.
  A follower keeps the chunks of one snapshot (a chunk that is not the
  next one is answered, not kept; one at offset 0 starts over) and, once
  it has them all, installs it and emits ``ApplySnapshot(index, term,
  data)``: the application replaces its state.  On restart a stored
  snapshot is handed out the same way, then entries after it are emitted as
  they are (re)committed.  An application that must keep reading the log
  below its state's index (a quorum queue's bodies live in the entries that
  enqueued them) calls ``checkpoint(now, index, data)`` instead: the state
  is stored aside, and ``promote(now, index)`` later makes it the snapshot,
  as ``compact`` would have at that index.
* **Linearizable reads** (``read_index``): the leader records its commit index,
  sends a heartbeat round and answers ``ReadReady(rid, index)`` once a
  majority of voters acknowledged a message sent after the request; the state
  machine has then applied at least ``index``.  A leader that has not yet
  committed in its term defers the read until it has.  Losing leadership
  answers ``NotLeader(rid, hint)``.
* **Check quorum.**  A leader that has not heard from a majority of voters
  within the maximum election timeout steps down, so a minority-side leader
  stops serving.

Assumptions: messages may be lost, delayed, duplicated and reordered, never
forged; ``RaftLog.flush()`` makes writes durable; servers are named by the
same strings everywhere; all servers are built with the same bootstrap
``voters`` (the configuration "at index 0"; a joining server is built with
them too and stays passive until a configuration makes it a learner/voter).

Failure behaviour: safety (election safety, log matching, leader
completeness, state-machine safety) holds under any crash / partition / loss
pattern; progress needs a majority of voters up and connected.  A message that
is not a Raft message or is malformed is ignored with
``Emit(MessageIgnored(src, reason))`` (a network peer cannot crash us).
Misuse of the entry points by the local application (wrong types, compact
beyond what was applied, unknown timer) raises ``ValueError``/``TypeError``.
An invariant broken by a bug (two leaders in a term, a committed entry
overwritten) raises :class:`RaftInvariantError` rather than diverge silently.
"""

from __future__ import annotations

import pickle
import random
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mirrorq.bounds import MAX_BATCH_BYTES, MESSAGE_BYTES, plain_size
from mirrorq.mnesia_like.raft_log import (
    COMMAND,
    CONFIG,
    NOOP,
    Config,
    Entry,
    FileRaftLog,
    MemoryRaftLog,
    RaftLog,
    RaftLogCorrupt,
    Snapshot,
)
from mirrorq.sansio import Action, CancelTimer, Emit, Persist, Send, SetTimer

__all__ = [
    "RaftNode",
    "RaftInvariantError",
    "Config",
    "Entry",
    "Snapshot",
    "RaftLog",
    "MemoryRaftLog",
    "FileRaftLog",
    "RaftLogCorrupt",
    "NOOP",
    "COMMAND",
    "CONFIG",
    "RequestVote",
    "RequestVoteReply",
    "AppendEntries",
    "AppendEntriesReply",
    "InstallSnapshot",
    "InstallSnapshotReply",
    "Committed",
    "ApplySnapshot",
    "ProposalAccepted",
    "ProposalCommitted",
    "ProposalLost",
    "ProposalUnknown",
    "NotLeader",
    "ReadReady",
    "ConfigChangeRejected",
    "MembershipCommitted",
    "LeaderChanged",
    "MessageIgnored",
    "FOLLOWER",
    "PRE_CANDIDATE",
    "CANDIDATE",
    "LEADER",
    "ELECTION_TIMER",
    "HEARTBEAT_TIMER",
    "QUORUM_TIMER",
    "COMMIT_TIMER",
]

#: what an AppendEntries counts per entry besides its command (mirrorq.bounds)
_ENTRY_BYTES = 32

FOLLOWER = "follower"
PRE_CANDIDATE = "pre_candidate"
CANDIDATE = "candidate"
LEADER = "leader"

ELECTION_TIMER = ("raft", "election")
HEARTBEAT_TIMER = ("raft", "heartbeat")
QUORUM_TIMER = ("raft", "check_quorum")
COMMIT_TIMER = ("raft", "commit_notice")


class RaftInvariantError(RuntimeError):
    """A Raft safety invariant was about to be broken (a bug, never input)."""


# ---- messages -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RequestVote:
    term: int
    candidate: str
    last_log_index: int
    last_log_term: int
    pre_vote: bool = False


@dataclass(frozen=True, slots=True)
class RequestVoteReply:
    term: int
    granted: bool
    pre_vote: bool = False


@dataclass(frozen=True, slots=True)
class AppendEntries:
    term: int
    leader: str
    prev_index: int
    prev_term: int
    entries: tuple[Entry, ...]  # indexes prev_index+1, prev_index+2, ...
    commit: int
    seq: int  # heartbeat round, echoed for ReadIndex
    #: the sender's estimate of the entries' size (for transports' batching; never trusted)
    nbytes: int = field(default=0, compare=False)

    def wire_size(self) -> int:
        return MESSAGE_BYTES + self.nbytes


@dataclass(frozen=True, slots=True)
class AppendEntriesReply:
    term: int
    success: bool
    index: int  # success: last index known to match; failure: prev_index refused
    hint: int  # failure: where the leader should retry
    seq: int


@dataclass(frozen=True, slots=True)
class InstallSnapshot:
    """Bytes ``[offset, offset + len(chunk))`` of the pickled data of the
    snapshot ``(index, snap_term, config)``, ``size`` bytes in all."""

    term: int
    leader: str
    index: int
    snap_term: int
    config: Config
    offset: int
    size: int
    chunk: bytes
    seq: int

    def wire_size(self) -> int:
        return MESSAGE_BYTES + len(self.chunk)


@dataclass(frozen=True, slots=True)
class InstallSnapshotReply:
    """``index``: the follower's snapshot once installed (0 while it
    receives one); ``offset``: the bytes it holds of snapshot ``receiving``
    (the leader sends on from there)."""

    term: int
    index: int
    seq: int
    offset: int = 0
    receiving: int = 0


@dataclass(slots=True)
class _Incoming:
    """A snapshot a follower is receiving, chunk by chunk."""

    term: int
    index: int
    snap_term: int
    config: Config
    size: int
    data: bytearray


# ---- events (Emit payloads) -------------------------------------------------
@dataclass(frozen=True, slots=True)
class Committed:
    index: int
    term: int
    command: Any


@dataclass(frozen=True, slots=True)
class ApplySnapshot:
    index: int
    term: int
    data: Any


@dataclass(frozen=True, slots=True)
class ProposalAccepted:
    pid: Any
    index: int
    term: int


@dataclass(frozen=True, slots=True)
class ProposalCommitted:
    pid: Any
    index: int
    term: int


@dataclass(frozen=True, slots=True)
class ProposalLost:
    pid: Any
    index: int
    term: int


@dataclass(frozen=True, slots=True)
class ProposalUnknown:
    pid: Any
    index: int
    term: int


@dataclass(frozen=True, slots=True)
class NotLeader:
    request_id: Any
    leader_hint: str | None


@dataclass(frozen=True, slots=True)
class ReadReady:
    request_id: Any
    index: int


@dataclass(frozen=True, slots=True)
class ConfigChangeRejected:
    request_id: Any
    reason: str


@dataclass(frozen=True, slots=True)
class MembershipCommitted:
    index: int
    config: Config


@dataclass(frozen=True, slots=True)
class LeaderChanged:
    term: int
    leader: str | None


@dataclass(frozen=True, slots=True)
class MessageIgnored:
    src: str
    reason: str


class _Progress:
    __slots__ = (
        "match",
        "next",
        "state",
        "acked_seq",
        "heard",
        "progress_at",
        "snapshot_at",
        "told_commit",
        "snap_index",
        "snap_offset",
        "inflight",
        "inflight_bytes",
    )

    def __init__(self, next_index: int, now: float):
        self.match = 0
        self.next = next_index
        self.state = "replicate"  # or "probe" (one message at a time) or "snapshot"
        self.acked_seq = 0
        self.heard = now
        self.progress_at = now
        self.snapshot_at = -1e300
        self.told_commit = 0  # the highest commit index sent to this peer
        self.snap_index = 0  # the snapshot being sent to this peer ...
        self.snap_offset = 0  # ... and the bytes of it the peer holds
        #: (last index, entry bytes) of each AppendEntries with entries sent and not yet
        #: acknowledged, in order (the in-flight window), and their bytes
        self.inflight: deque[tuple[int, int]] = deque()
        self.inflight_bytes = 0

    def window_full(self, count: int, nbytes: int) -> bool:
        return len(self.inflight) >= count or self.inflight_bytes >= nbytes

    def acked(self, index: int) -> None:
        """The peer holds everything up to ``index``: what it answers leaves the window."""
        q = self.inflight
        while q and q[0][0] <= index:
            self.inflight_bytes -= q.popleft()[1]

    def reset_window(self) -> None:
        self.inflight.clear()
        self.inflight_bytes = 0


def _is_int(x: Any) -> bool:
    return type(x) is int and x >= 0


class RaftNode:
    """One Raft server (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        log: RaftLog,
        rng: random.Random,
        *,
        voters: Iterable[str],
        election_timeout: tuple[float, float] = (0.15, 0.30),
        heartbeat_interval: float = 0.05,
        max_entries_per_message: int = 512,
        max_bytes_per_message: int = MAX_BATCH_BYTES,
        entry_size: Callable[[Any], int] = plain_size,
        max_messages_per_send: int = 4,
        max_inflight: int = 64,
        max_inflight_bytes: int = 4 * MAX_BATCH_BYTES,
        catchup_margin: int = 64,
        pre_vote: bool = True,
        check_quorum: bool = True,
        lost_leader_delay: float | None = None,
        early_appends: bool = False,
        commit_notice_delay: float = 0.0,
    ):
        if not isinstance(node_id, str) or not node_id:
            raise TypeError(f"node_id must be a non-empty str, got {node_id!r}")
        if not isinstance(log, RaftLog):
            raise TypeError(f"log must be a RaftLog, got {type(log).__name__}")
        if not isinstance(rng, random.Random):
            raise TypeError(f"rng must be a random.Random, got {type(rng).__name__}")
        lo, hi = election_timeout
        if not 0 < lo <= hi:
            raise ValueError(f"election_timeout must be (min, max) with 0 < min <= max, got {election_timeout!r}")
        if not 0 < heartbeat_interval < lo:
            raise ValueError(f"heartbeat_interval {heartbeat_interval!r} must be in (0, election min {lo})")
        if (
            min(max_entries_per_message, max_messages_per_send, max_bytes_per_message, max_inflight, max_inflight_bytes)
            < 1
            or catchup_margin < 0
        ):
            raise ValueError(
                "max_entries_per_message, max_bytes_per_message, max_messages_per_send, max_inflight, "
                "max_inflight_bytes must be >= 1, catchup_margin >= 0"
            )
        self.id = node_id
        self.log = log
        self.rng = rng
        self.bootstrap = Config(tuple(sorted(voters)))
        if not self.bootstrap.voters:
            raise ValueError("voters (the bootstrap configuration) must not be empty")
        self.election_min, self.election_max = float(lo), float(hi)
        self.heartbeat_interval = float(heartbeat_interval)
        self.max_entries = max_entries_per_message
        self.max_bytes = max_bytes_per_message
        self.entry_size = entry_size
        self.max_msgs = max_messages_per_send
        #: the in-flight window per follower (module docstring: Replication)
        self.max_inflight = max_inflight
        self.max_inflight_bytes = max_inflight_bytes
        self.catchup_margin = catchup_margin
        self.pre_vote = pre_vote
        #: the longest wait before a campaign once the leader's node is known dead
        #: (``leader_lost``), and between campaigns until a leader is known
        self.lost_leader_delay = self.election_min / 5 if lost_leader_delay is None else float(lost_leader_delay)
        if not 0 < self.lost_leader_delay <= self.election_min:
            raise ValueError(f"lost_leader_delay must be in (0, election_min], got {lost_leader_delay!r}")
        self.check_quorum = check_quorum
        #: the leader's AppendEntries leave before its own persist (module docstring)
        self.early_appends = bool(early_appends)
        #: how long a leader may wait to tell followers a commit (module docstring: Commit)
        self.commit_notice_delay = float(commit_notice_delay)
        if not 0.0 <= self.commit_notice_delay < self.heartbeat_interval:
            raise ValueError(f"commit_notice_delay must be in [0, heartbeat_interval), got {commit_notice_delay!r}")
        self._notice_armed = False

        self.role = FOLLOWER
        self.leader_id: str | None = None
        self.commit_index = 0
        self.applied_index = 0
        self._started = False
        self._configs: list[tuple[int, Config]] = []
        self._votes: set[str] = set()
        self._leader_contact = -1e300
        self._hurry = False  # leader_lost: campaigns are retried soon until a leader is known
        self._peers: dict[str, _Progress] = {}
        self._seq = 0
        self._pending: dict[int, tuple[Any, int]] = {}
        self._reads: list[tuple[Any, int, int]] = []  # (rid, index, seq) awaiting quorum
        self._deferred_reads: list[Any] = []  # before the leader committed in its term
        self._now = 0.0
        # (index, term, config, pickled data) of the snapshot being sent
        self._snap_blob: tuple[int, int, Config, bytes] | None = None
        self._incoming: _Incoming | None = None  # a snapshot being received
        #: the last index of our log known durable and unchanged since (early_appends:
        #: what the leader counts of its own log), and the term known durable
        self._durable_index = 0
        self._durable_term = 0

    # ---- read-only views ------------------------------------------------
    @property
    def term(self) -> int:
        return self.log.term

    @property
    def config(self) -> Config:
        """The latest configuration in the log (in effect, maybe uncommitted)."""
        return self._configs[-1][1]

    @property
    def committed_config(self) -> Config:
        for index, cfg in reversed(self._configs):
            if index <= self.commit_index:
                return cfg
        return self._configs[0][1]

    @property
    def last_index(self) -> int:
        return self.log.last_index

    @property
    def configurations(self) -> tuple[tuple[int, Config], ...]:
        """The configurations the log holds, ``(index, config)`` in index
        order, from the snapshot's (or the bootstrap at 0) to the latest."""
        return tuple(self._configs)

    def match_indexes(self) -> dict[str, int]:
        """On the leader: the highest index known to be stored on each other
        member of the latest configuration (empty elsewhere)."""
        if self.role != LEADER:
            return {}
        return {peer: p.match for peer, p in sorted(self._peers.items())}

    def is_leader(self) -> bool:
        return self.role == LEADER

    # ---- sansio contract --------------------------------------------------
    def start(self, now: float) -> list[Action]:
        if self._started:
            raise RuntimeError(f"raft node {self.id!r} already started")
        self._started = True
        self._now = now
        out: list[Action] = []
        snap = self.log.snapshot
        if snap is not None:
            self._configs = [(snap.index, snap.config)]
            self.commit_index = self.applied_index = snap.index
            out.append(Emit(ApplySnapshot(snap.index, snap.term, snap.data)))
            out.append(Emit(MembershipCommitted(snap.index, snap.config)))
        else:
            self._configs = [(0, self.bootstrap)]
        self._configs.extend(self.log.config_entries(self.log.snapshot_index + 1))
        self._durable_index, self._durable_term = self.log.last_index, self.log.term
        self._arm_election(out)
        return out

    def receive(self, now: float, src: str, msg: Any) -> list[Action]:
        self._check_started()
        self._now = now
        out: list[Action] = []
        handler = self._handlers.get(type(msg))
        if handler is None:
            out.append(Emit(MessageIgnored(src, f"not a raft message: {type(msg).__name__}")))
            return out
        reason = self._malformed(src, msg)
        if reason is not None:
            out.append(Emit(MessageIgnored(src, f"malformed {type(msg).__name__}: {reason}")))
            return out
        handler(self, src, msg, out)
        out.append(Persist())  # the log's writes durable before any of these actions' sends leave
        return out

    def timer(self, now: float, key: Hashable) -> list[Action]:
        self._check_started()
        self._now = now
        out: list[Action] = []
        if key == ELECTION_TIMER:
            self._on_election_timeout(out)
        elif key == HEARTBEAT_TIMER:
            if self.role == LEADER:
                self._heartbeat(out, resend=True)
                out.append(SetTimer(HEARTBEAT_TIMER, self.heartbeat_interval))
        elif key == QUORUM_TIMER:
            if self.role == LEADER:
                self._check_quorum(out)
        elif key == COMMIT_TIMER:
            self._notice_armed = False
            if self.role == LEADER:
                self._tell_commit(out, now=True)
        else:
            raise ValueError(f"raft node {self.id!r}: unknown timer key {key!r}")
        out.append(Persist())  # the log's writes durable before any of these actions' sends leave
        return out

    def leader_lost(self, now: float, node: str) -> list[Action]:
        """A failure detector outside Raft (the node agents' membership) says
        ``node`` is down.  If it is this follower's leader, forget its lease
        and campaign after a short random delay (up to ``lost_leader_delay``,
        by default a fifth of the minimum election timeout) instead of
        waiting for the election timeout; until
        a leader is known again, a campaign that does not win (a voter still
        in the dead leader's lease refuses its pre-vote) is retried after
        such a short delay too, not after a whole election timeout.  Only
        liveness changes: a wrong hint costs at most a refused pre-vote (the
        voters that still hear the leader keep their lease)."""
        self._check_started()
        self._now = now
        out: list[Action] = []
        if self.role != LEADER and node != self.id and self.leader_id == node:
            self._leader_contact = float("-inf")
            self._set_leader(None, out)
            self._hurry = True
            out.append(SetTimer(ELECTION_TIMER, self.rng.uniform(0.0, self.lost_leader_delay)))
        return out

    # ---- application entry points ------------------------------------------
    def propose(self, now: float, command: Any, pid: Any = None) -> list[Action]:
        """Replicate ``command``; see the module docstring for the events."""
        return self.propose_batch(now, [(pid, command)])

    def propose_batch(self, now: float, items: Iterable[tuple[Any, Any]]) -> list[Action]:
        """Propose many ``(pid, command)`` pairs: one flush, one
        AppendEntries round for all of them."""
        self._check_started()
        self._now = now
        out: list[Action] = []
        items = list(items)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"propose_batch wants (pid, command) pairs, got {item!r}")
        if self.role != LEADER:
            out.extend(Emit(NotLeader(pid, self.leader_id)) for pid, _ in items)
            return out
        for pid, command in items:
            e = self._leader_append(COMMAND, command)
            if pid is not None:
                self._pending[e.index] = (pid, e.term)
            out.append(Emit(ProposalAccepted(pid, e.index, e.term)))
        self._replicate(out)
        self._maybe_commit(out)
        out.append(Persist())  # the log's writes durable before any of these actions' sends leave
        return out

    def persist(self, now: float) -> list[Action]:
        """Carry out ``Persist``: make the log's writes durable (one flush);
        returns what that unblocks (:meth:`persisted`)."""
        self.log.flush()
        return self.persisted(now)

    def persisted(self, now: float) -> list[Action]:
        """The driver made every write of the log so far durable (its own
        way: a host's group fsync): with ``early_appends`` the leader now
        counts its whole log toward commit; returns the commits (events,
        commit notices to followers) that makes."""
        self._check_started()
        self._now = now
        self._durable_index, self._durable_term = self.log.last_index, self.log.term
        out: list[Action] = []
        if self.early_appends and self.role == LEADER:
            self._maybe_commit(out)
        return out

    def read_index(self, now: float, rid: Any) -> list[Action]:
        """Linearizable read barrier: ``ReadReady(rid, index)`` once the
        local state (applied >= index) may be read, or ``NotLeader``."""
        self._check_started()
        self._now = now
        out: list[Action] = []
        if self.role != LEADER:
            out.append(Emit(NotLeader(rid, self.leader_id)))
        elif self.log.term_at(self.commit_index) != self.term:
            self._deferred_reads.append(rid)
        else:
            self._start_reads([rid], out)
        return out

    def add_server(self, now: float, node: str, rid: Any = None) -> list[Action]:
        """Add ``node`` as a learner; it is promoted to voter once caught up."""
        if not isinstance(node, str) or not node:
            raise TypeError(f"add_server: node must be a non-empty str, got {node!r}")
        return self._change(now, rid, node, add=True)

    def remove_server(self, now: float, node: str, rid: Any = None) -> list[Action]:
        if not isinstance(node, str) or not node:
            raise TypeError(f"remove_server: node must be a non-empty str, got {node!r}")
        return self._change(now, rid, node, add=False)

    def compact(self, now: float, index: int, data: Any) -> list[Action]:
        """The application's state after applying ``index`` is ``data``:
        snapshot it and drop the log up to ``index``."""
        self._check_started()
        self._now = now
        if not isinstance(index, int) or index > self.applied_index:
            raise ValueError(f"compact: index {index!r} is beyond the applied index {self.applied_index}")
        if index <= self.log.snapshot_index:
            return []  # nothing new to compact
        term = self._term_at(index)
        self.log.install_snapshot(Snapshot(index, term, self._config_at(index), data))
        self._trim_configs(index)
        return [Persist()]

    def checkpoint(self, now: float, index: int, data: Any) -> list[Action]:
        """The application's state after applying ``index`` is ``data``:
        keep it as a checkpoint (:class:`RaftLog`'s), to be made the
        snapshot by :meth:`promote` once the application no longer needs
        the log up to ``index``."""
        self._check_started()
        self._now = now
        if not isinstance(index, int) or index > self.applied_index:
            raise ValueError(f"checkpoint: index {index!r} is beyond the applied index {self.applied_index}")
        if index <= self.log.snapshot_index:
            return []
        self.log.save_checkpoint(Snapshot(index, self._term_at(index), self._config_at(index), data))
        return []

    def promote(self, now: float, index: int) -> list[Action]:
        """Make the checkpoint at ``index`` the snapshot and drop the log up
        to ``index`` (as :meth:`compact` would have then)."""
        self._check_started()
        self._now = now
        if index <= self.log.snapshot_index:
            self.log.drop_checkpoint(index)
            return []
        self.log.promote_checkpoint(index)
        self._trim_configs(index)
        return [Persist()]

    # ---- internals: helpers ---------------------------------------------------
    def _check_started(self) -> None:
        if not self._started:
            raise RuntimeError(f"raft node {self.id!r}: call start() first")

    def _term_at(self, index: int) -> int:
        """The term of ``index``, which the log holds (from its snapshot's
        index to its last)."""
        term = self.log.term_at(index)
        if term is None:
            raise RaftInvariantError(
                f"{self.id}: no term at index {index} (the log holds {self.log.snapshot_index}..{self.log.last_index})"
            )
        return term

    def _config_at(self, index: int) -> Config:
        for i, cfg in reversed(self._configs):
            if i <= index:
                return cfg
        raise RaftInvariantError(f"{self.id}: no configuration known at index {index}")

    def _trim_configs(self, index: int) -> None:
        base = self._config_at(index)
        self._configs = [(index, base)] + [(i, c) for i, c in self._configs if i > index]

    def _arm_election(self, out: list[Action]) -> None:
        if self._hurry:  # the leader's node is known dead: campaign again soon, until a leader is known
            out.append(SetTimer(ELECTION_TIMER, self.rng.uniform(self.lost_leader_delay / 2, self.lost_leader_delay)))
            return
        out.append(SetTimer(ELECTION_TIMER, self.rng.uniform(self.election_min, self.election_max)))

    def _in_lease(self) -> bool:
        if self.role == LEADER:
            return True
        return self.leader_id is not None and self._now - self._leader_contact < self.election_min

    def _set_leader(self, leader: str | None, out: list[Action]) -> None:
        if leader is not None:
            self._hurry = False
        if leader != self.leader_id:
            self.leader_id = leader
            out.append(Emit(LeaderChanged(self.term, leader)))

    def _become_follower(self, term: int, leader: str | None, out: list[Action]) -> None:
        was_leader = self.role == LEADER
        if term > self.term:
            self.log.set_hard_state(term, None)
        self.role = FOLLOWER
        self._votes = set()
        if was_leader:
            self._peers = {}
            self._snap_blob = None
            out.append(CancelTimer(HEARTBEAT_TIMER))
            out.append(CancelTimer(QUORUM_TIMER))
            if self._notice_armed:
                self._notice_armed = False
                out.append(CancelTimer(COMMIT_TIMER))
            for rid, _, _ in self._reads:
                out.append(Emit(NotLeader(rid, leader)))
            for rid in self._deferred_reads:
                out.append(Emit(NotLeader(rid, leader)))
            self._reads, self._deferred_reads = [], []
        self._set_leader(leader, out)
        self._arm_election(out)

    def _log_up_to_date(self, last_index: int, last_term: int) -> bool:
        my_last = self.log.last_index
        my_term = self.log.term_at(my_last)
        return (last_term, last_index) >= (my_term, my_last)

    # ---- elections --------------------------------------------------------------
    def _on_election_timeout(self, out: list[Action]) -> None:
        if self.role == LEADER:
            return
        if not self._may_campaign():
            self._arm_election(out)  # learners and outsiders never campaign
            return
        if self.leader_id is not None:
            self._set_leader(None, out)
        if self.pre_vote:
            self.role = PRE_CANDIDATE
            self._votes = {self.id}
            self._ask_votes(self.term + 1, True, out)
            self._arm_election(out)
            if self.config.quorum(self._votes):
                self._start_election(out)
        else:
            self._start_election(out)

    def _may_campaign(self) -> bool:
        """A voter of the latest configuration campaigns; so does a member
        that an uncommitted configuration removes while the committed one
        still counts it as a voter (a leader that removed itself and lost its
        leadership before the change committed): it may hold the only copy
        of the change, and a peer whose log is behind it can never win its
        vote, so it must be able to win (counting the votes of the latest
        configuration, not its own), commit the change and step down."""
        if self.id in self.config.voters:
            return True
        return self._configs[-1][0] > self.commit_index and self.id in self.committed_config.voters

    def _start_election(self, out: list[Action]) -> None:
        self.log.set_hard_state(self.term + 1, self.id)
        self.role = CANDIDATE
        self._votes = {self.id}
        self._ask_votes(self.term, False, out)
        self._arm_election(out)
        if self.config.quorum(self._votes):
            self._become_leader(out)

    def _ask_votes(self, term: int, pre_vote: bool, out: list[Action]) -> None:
        last = self.log.last_index
        msg = RequestVote(term, self.id, last, self._term_at(last), pre_vote)
        for v in self.config.voters:
            if v != self.id:
                out.append(Send(v, msg))

    def _on_request_vote(self, src: str, msg: RequestVote, out: list[Action]) -> None:
        if msg.pre_vote:
            granted = (
                msg.term > self.term
                and not self._in_lease()
                and self._log_up_to_date(msg.last_log_index, msg.last_log_term)
            )
            out.append(Send(src, RequestVoteReply(self.term, granted, True)))
            return
        if msg.term > self.term:
            if self._in_lease():
                out.append(Send(src, RequestVoteReply(self.term, False, False)))
                return
            self._become_follower(msg.term, None, out)
        granted = False
        if (
            msg.term == self.term
            and self.log.voted_for in (None, msg.candidate)
            and self.role == FOLLOWER
            and self._log_up_to_date(msg.last_log_index, msg.last_log_term)
        ):
            granted = True
            self.log.set_hard_state(self.term, msg.candidate)
            self._arm_election(out)
        out.append(Send(src, RequestVoteReply(self.term, granted, False)))

    def _on_request_vote_reply(self, src: str, msg: RequestVoteReply, out: list[Action]) -> None:
        if msg.term > self.term and not msg.granted:
            self._become_follower(msg.term, None, out)
            return
        if not msg.granted:
            return
        if msg.pre_vote and self.role == PRE_CANDIDATE:
            self._votes.add(src)
            if self.config.quorum(self._votes):
                self._start_election(out)
        elif not msg.pre_vote and self.role == CANDIDATE and msg.term == self.term:
            self._votes.add(src)
            if self.config.quorum(self._votes):
                self._become_leader(out)

    def _become_leader(self, out: list[Action]) -> None:
        self.role = LEADER
        self._votes = set()
        out.append(CancelTimer(ELECTION_TIMER))
        self._set_leader(self.id, out)
        self._peers = {}
        self._sync_peers()
        self._leader_append(NOOP, None)
        self._replicate(out)
        self._maybe_commit(out)
        out.append(SetTimer(HEARTBEAT_TIMER, self.heartbeat_interval))
        if self.check_quorum:
            out.append(SetTimer(QUORUM_TIMER, self.election_max))

    # ---- leader: replication ------------------------------------------------------
    def _sync_peers(self) -> None:
        members = [m for m in self.config.members if m != self.id]
        for m in members:
            if m not in self._peers:
                self._peers[m] = _Progress(self.log.last_index + 1, self._now)
        for m in [m for m in self._peers if m not in members]:
            del self._peers[m]

    def _leader_append(self, kind: int, data: Any) -> Entry:
        e = Entry(self.log.last_index + 1, self.term, kind, data)
        self.log.append((e,))
        if kind == CONFIG:
            self._configs.append((e.index, data))
            self._sync_peers()
        return e

    def _replicate(self, out: list[Action]) -> None:
        for peer in sorted(self._peers):
            p = self._peers[peer]
            if p.state == "replicate" and p.next <= self.log.last_index:
                self._send_append(peer, p, out)

    def _window_full(self, p: _Progress) -> bool:
        return p.state == "replicate" and p.window_full(self.max_inflight, self.max_inflight_bytes)

    def _send_append(self, peer: str, p: _Progress, out: list[Action]) -> None:
        if p.state == "snapshot":
            return
        log = self.log
        if p.next <= log.snapshot_index:
            self._send_snapshot(peer, p, out)
            return
        last = log.last_index
        for _ in range(self.max_msgs):
            if self._window_full(p):
                return  # an acknowledgement (or a resend after no progress) sends on
            prev = p.next - 1
            hi = min(last, prev + self.max_entries)
            entries = log.entries(p.next, hi + 1) if hi > prev else ()
            nbytes = 0
            for k, e in enumerate(entries):
                n = _ENTRY_BYTES + (self.entry_size(e.data) if e.kind == COMMAND else 0)
                if k and nbytes + n > self.max_bytes:
                    entries = entries[:k]
                    hi = prev + k
                    break
                nbytes += n
            out.append(
                Send(
                    peer,
                    AppendEntries(
                        self.term, self.id, prev, self._term_at(prev), entries, self.commit_index, self._seq, nbytes
                    ),
                    self._early(),
                )
            )
            p.told_commit = max(p.told_commit, min(self.commit_index, hi))
            if p.state == "probe":
                return  # next stays put until a reply; a heartbeat resends
            if entries:
                p.inflight.append((hi, nbytes))
                p.inflight_bytes += nbytes
            p.next = hi + 1
            if p.next > last:
                return

    def _send_snapshot(self, peer: str, p: _Progress, out: list[Action]) -> None:
        """The next chunk of the snapshot to ``peer`` (from where it stands)."""
        index = self.log.snapshot_index
        p.state = "snapshot"
        p.reset_window()
        p.snapshot_at = self._now
        if p.snap_index != index:
            p.snap_index, p.snap_offset = index, 0
        blob = self._snap_blob
        if blob is None or blob[0] != index:  # the log may read a snapshot from disk: once per snapshot
            snap = self.log.snapshot
            if snap is None:
                raise RaftInvariantError(f"{self.id}: a snapshot to send at {index}, but the log holds none")
            blob = self._snap_blob = (
                snap.index,
                snap.term,
                snap.config,
                pickle.dumps(snap.data, protocol=pickle.HIGHEST_PROTOCOL),
            )
        _, snap_term, config, data = blob
        off = min(p.snap_offset, len(data))
        chunk = data[off : off + self.max_bytes]
        out.append(
            Send(peer, InstallSnapshot(self.term, self.id, index, snap_term, config, off, len(data), chunk, self._seq))
        )

    def _send_heartbeat(self, peer: str, p: _Progress, out: list[Action]) -> None:
        prev = max(p.match, self.log.snapshot_index)
        prev = min(prev, self.log.last_index)
        out.append(
            Send(
                peer,
                AppendEntries(
                    self.term, self.id, prev, self._term_at(prev), (), min(self.commit_index, prev), self._seq
                ),
                self._early(),
            )
        )
        p.told_commit = max(p.told_commit, min(self.commit_index, prev))

    def _early(self) -> bool:
        """Whether the leader's AppendEntries may leave before the turn's
        Persist: with ``early_appends``, once its term is durable."""
        return self.early_appends and self._durable_term == self.log.term

    def _heartbeat(self, out: list[Action], resend: bool) -> None:
        self._seq += 1
        now = self._now
        for peer in sorted(self._peers):
            p = self._peers[peer]
            if resend:
                if p.state == "probe":
                    self._send_append(peer, p, out)
                    continue
                if p.state == "snapshot" and now - p.snapshot_at >= self.election_min:
                    self._send_snapshot(peer, p, out)
                    continue
                if p.state == "replicate" and p.match < p.next - 1 and now - p.progress_at >= self.heartbeat_interval:
                    p.next = p.match + 1  # no progress: resend what is in flight
                    p.reset_window()
                    self._send_append(peer, p, out)
                    continue
            self._send_heartbeat(peer, p, out)

    def _replying_peer(self, src: str, msg: Any, out: list[Action]) -> _Progress | None:
        """What every reply to the leader does first: a newer term makes us a
        follower; a stale reply, or one while not leader, is dropped; else the
        peer was heard from.  Returns the peer's progress, or None."""
        if msg.term > self.term:
            self._become_follower(msg.term, None, out)
            return None
        if msg.term < self.term or self.role != LEADER:
            return None
        p = self._peers.get(src)
        if p is None:
            return None
        p.heard = self._now
        if msg.seq > p.acked_seq:
            p.acked_seq = msg.seq
        return p

    def _on_append_reply(self, src: str, msg: AppendEntriesReply, out: list[Action]) -> None:
        p = self._replying_peer(src, msg, out)
        if p is None:
            return
        if msg.success:
            if msg.index > self.log.last_index:
                out.append(Emit(MessageIgnored(src, f"acknowledged index {msg.index} beyond our log")))
                return
            if msg.index > p.match:
                p.match = msg.index
                p.progress_at = self._now
            p.acked(msg.index)
            if p.next <= p.match:
                p.next = p.match + 1
            if p.state != "snapshot" or p.match >= self.log.snapshot_index:
                p.state = "replicate"
            if p.state == "replicate" and p.next <= self.log.last_index:
                self._send_append(src, p, out)
            self._maybe_commit(out)
            self._maybe_promote(out)
        else:
            if p.state == "snapshot" or msg.index <= p.match:
                pass  # stale, or waiting for InstallSnapshot to land
            elif p.state == "probe" and msg.index != p.next - 1:
                pass  # answer to an older probe
            else:
                p.next = max(p.match + 1, min(msg.hint, msg.index))
                p.state = "probe"
                p.reset_window()
                self._send_append(src, p, out)
        if self._reads:
            self._confirm_reads(out)

    def _on_snapshot_reply(self, src: str, msg: InstallSnapshotReply, out: list[Action]) -> None:
        p = self._replying_peer(src, msg, out)
        if p is None:
            return
        if msg.index > p.match and msg.index <= self.log.last_index:
            p.match = msg.index
            p.progress_at = self._now
        if p.state == "snapshot":
            snap_index = self.log.snapshot_index
            if p.match < snap_index and msg.index == 0:
                # a chunk answered: send on from what the peer holds of this snapshot
                if msg.receiving == snap_index and msg.receiving == p.snap_index:
                    if msg.offset > p.snap_offset:
                        p.progress_at = self._now
                    p.snap_offset = msg.offset
                else:
                    p.snap_index, p.snap_offset = snap_index, 0
                self._send_snapshot(src, p, out)
            else:
                p.state = "replicate"
                p.next = p.match + 1
                p.snap_index = p.snap_offset = 0
                if not any(q.state == "snapshot" for q in self._peers.values()):
                    self._snap_blob = None
                self._send_append(src, p, out)
        self._maybe_commit(out)
        self._maybe_promote(out)
        if self._reads:
            self._confirm_reads(out)

    def _maybe_commit(self, out: list[Action]) -> None:
        voters = self.config.voters
        own = min(self._durable_index, self.log.last_index) if self.early_appends else self.log.last_index
        matches = sorted((own if v == self.id else (self._peers[v].match if v in self._peers else 0)) for v in voters)
        n = matches[(len(matches) - 1) // 2]  # highest index held by a majority
        if n > self.commit_index and self.log.term_at(n) == self.term:
            self.commit_index = n
            self._apply(out)
        self._tell_commit(out)

    def _tell_commit(self, out: list[Action], now: bool = False) -> None:
        """Followers learn a commit index as soon as they can use it (what
        they hold of it), not at the next heartbeat: what they apply
        (registry notifications on their nodes) would otherwise lag a commit
        by up to a heartbeat interval.  A follower whose acknowledgement
        comes after the commit is told when it comes.  With a
        ``commit_notice_delay`` they are told that long later (``now``: the
        timer fired), by whatever append carries it first."""
        if self.role != LEADER:
            return
        for peer in sorted(self._peers):
            p = self._peers[peer]
            if p.state == "replicate" and min(self.commit_index, p.match) > p.told_commit:
                if self.commit_notice_delay and not now:
                    if not self._notice_armed:
                        self._notice_armed = True
                        out.append(SetTimer(COMMIT_TIMER, self.commit_notice_delay))
                    return
                self._send_heartbeat(peer, p, out)

    def _check_quorum(self, out: list[Action]) -> None:
        horizon = self._now - self.election_max
        active = {peer for peer, p in self._peers.items() if p.heard > horizon}
        active.add(self.id)
        if not self.config.quorum(active):
            self._become_follower(self.term, None, out)
            return
        out.append(SetTimer(QUORUM_TIMER, self.election_max))

    # ---- membership ---------------------------------------------------------------------
    def _change(self, now: float, rid: Any, node: str, add: bool) -> list[Action]:
        self._check_started()
        self._now = now
        out: list[Action] = []
        if self.role != LEADER:
            out.append(Emit(NotLeader(rid, self.leader_id)))
            return out
        cfg = self.config
        reason = None
        if self._configs[-1][0] > self.commit_index:
            reason = "another membership change is not committed yet"
        elif self.log.term_at(self.commit_index) != self.term:
            reason = "the leader has not committed an entry of its term yet; retry"
        elif add and node in cfg.members:
            reason = f"{node!r} is already a member"
        elif not add and node not in cfg.members:
            reason = f"{node!r} is not a member"
        elif not add and cfg.voters == (node,):
            reason = f"{node!r} is the last voter"
        if reason is not None:
            out.append(Emit(ConfigChangeRejected(rid, reason)))
            return out
        if add:
            new = Config(cfg.voters, tuple(sorted(cfg.learners + (node,))))
        else:
            new = Config(tuple(v for v in cfg.voters if v != node), tuple(x for x in cfg.learners if x != node))
        e = self._leader_append(CONFIG, new)
        if rid is not None:
            self._pending[e.index] = (rid, e.term)
        out.append(Emit(ProposalAccepted(rid, e.index, e.term)))
        self._replicate(out)
        self._maybe_commit(out)
        out.append(Persist())  # the log's writes durable before any of these actions' sends leave
        return out

    def _maybe_promote(self, out: list[Action]) -> None:
        cfg = self.config
        if (
            not cfg.learners
            or self._configs[-1][0] > self.commit_index
            or self.log.term_at(self.commit_index) != self.term
        ):
            return
        for learner in cfg.learners:
            p = self._peers.get(learner)
            if p is not None and p.match >= self.log.last_index - self.catchup_margin:
                new = Config(tuple(sorted(cfg.voters + (learner,))), tuple(x for x in cfg.learners if x != learner))
                self._leader_append(CONFIG, new)
                self._replicate(out)
                self._maybe_commit(out)
                return

    # ---- followers ---------------------------------------------------------------------
    def _on_append(self, src: str, msg: AppendEntries, out: list[Action]) -> None:
        if msg.term < self.term:
            out.append(Send(src, AppendEntriesReply(self.term, False, msg.prev_index, 0, msg.seq)))
            return
        if msg.term == self.term and self.role == LEADER:
            raise RaftInvariantError(f"{self.id}: two leaders in term {self.term}: {self.id} and {src}")
        if msg.term > self.term or self.role != FOLLOWER or self.leader_id != src:
            self._become_follower(msg.term, src, out)
        else:
            self._arm_election(out)
        self._leader_contact = self._now
        log = self.log
        prev, prev_term, entries = msg.prev_index, msg.prev_term, msg.entries
        base = log.snapshot_index
        if prev < base:
            skip = base - prev
            if skip >= len(entries):
                out.append(Send(src, AppendEntriesReply(self.term, True, prev + len(entries), 0, msg.seq)))
                return
            if entries[skip - 1].term != log.snapshot_term:
                raise RaftInvariantError(f"{self.id}: leader {src} disagrees with our snapshot at {base}")
            entries = entries[skip:]
            prev, prev_term = base, log.snapshot_term
        last = log.last_index
        if prev > last:
            out.append(Send(src, AppendEntriesReply(self.term, False, msg.prev_index, last + 1, msg.seq)))
            return
        my_term = log.term_at(prev)
        if my_term != prev_term:
            hint = prev
            floor = max(self.commit_index, base) + 1
            while hint > floor and log.term_at(hint - 1) == my_term:
                hint -= 1
            out.append(Send(src, AppendEntriesReply(self.term, False, msg.prev_index, hint, msg.seq)))
            return
        # find the first entry that is new or conflicting
        k = 0
        n = len(entries)
        while k < n:
            e = entries[k]
            if e.index > last or log.term_at(e.index) != e.term:
                break
            k += 1
        if k < n:
            first = entries[k].index
            if first <= last:  # conflict: truncate from there
                if first <= self.commit_index:
                    raise RaftInvariantError(
                        f"{self.id}: leader {src} would overwrite committed entry {first} (commit {self.commit_index})"
                    )
                if self._configs[-1][0] >= first:
                    self._configs = [(i, c) for i, c in self._configs if i < first]
                self._durable_index = min(self._durable_index, first - 1)
            new = entries[k:]
            log.append(new)
            for e in new:
                if e.kind == CONFIG:
                    self._configs.append((e.index, e.data))
        match = prev + n
        self._incoming = None  # the leader replicates to us: it sends us no snapshot
        if msg.commit > self.commit_index:
            c = min(msg.commit, match)
            if c > self.commit_index:
                self.commit_index = c
                self._apply(out)
        out.append(Send(src, AppendEntriesReply(self.term, True, match, 0, msg.seq)))

    def _on_install_snapshot(self, src: str, msg: InstallSnapshot, out: list[Action]) -> None:
        if msg.term < self.term:
            out.append(Send(src, InstallSnapshotReply(self.term, 0, msg.seq)))
            return
        if msg.term == self.term and self.role == LEADER:
            raise RaftInvariantError(f"{self.id}: two leaders in term {self.term}: {self.id} and {src}")
        if msg.term > self.term or self.role != FOLLOWER or self.leader_id != src:
            self._become_follower(msg.term, src, out)
        else:
            self._arm_election(out)
        self._leader_contact = self._now
        if msg.index <= self.commit_index:
            self._incoming = None
            out.append(Send(src, InstallSnapshotReply(self.term, msg.index, msg.seq)))  # nothing we need
            return
        inc = self._incoming
        if msg.offset == 0:
            inc = self._incoming = _Incoming(msg.term, msg.index, msg.snap_term, msg.config, msg.size, bytearray())
        if inc is not None and (inc.term, inc.index, inc.snap_term, inc.size) != (
            msg.term,
            msg.index,
            msg.snap_term,
            msg.size,
        ):
            inc = None  # a chunk of another snapshot than the one we hold the start of
        if inc is None or msg.offset != len(inc.data):
            # not the next chunk of the snapshot we hold the start of: say where we stand
            held = len(inc.data) if inc is not None else 0
            out.append(Send(src, InstallSnapshotReply(self.term, 0, msg.seq, held, msg.index)))
            return
        inc.data += msg.chunk
        if len(inc.data) < inc.size:
            out.append(Send(src, InstallSnapshotReply(self.term, 0, msg.seq, len(inc.data), msg.index)))
            return
        self._incoming = None
        snap = Snapshot(inc.index, inc.snap_term, inc.config, pickle.loads(inc.data))
        if snap.index > self.commit_index:
            self.log.install_snapshot(snap)
            self._durable_index = min(self._durable_index, snap.index)
            self._configs = [(snap.index, snap.config)] + self.log.config_entries(snap.index + 1)
            self.commit_index = self.applied_index = snap.index
            out.append(Emit(ApplySnapshot(snap.index, snap.term, snap.data)))
            out.append(Emit(MembershipCommitted(snap.index, snap.config)))
            for index in sorted(i for i in self._pending if i <= snap.index):
                pid, term = self._pending.pop(index)
                out.append(Emit(ProposalUnknown(pid, index, term)))
        out.append(Send(src, InstallSnapshotReply(self.term, snap.index, msg.seq)))

    # ---- applying ----------------------------------------------------------------------
    def _apply(self, out: list[Action]) -> None:
        log = self.log
        step_down = False
        while self.applied_index < self.commit_index:
            i = self.applied_index + 1
            e = log.entry(i)
            self.applied_index = i
            if e.kind == COMMAND:
                out.append(Emit(Committed(i, e.term, e.data)))
            elif e.kind == CONFIG:
                out.append(Emit(MembershipCommitted(i, e.data)))
                if self.role == LEADER and self.id not in e.data.voters and self._configs[-1][0] == i:
                    step_down = True
            if self._pending:
                pending = self._pending.pop(i, None)
                if pending is not None:
                    pid, term = pending
                    event = ProposalCommitted if term == e.term else ProposalLost
                    out.append(Emit(event(pid, i, term)))
        if self.role == LEADER:
            if self._deferred_reads and log.term_at(self.commit_index) == self.term:
                rids, self._deferred_reads = self._deferred_reads, []
                self._start_reads(rids, out)
            if step_down:
                self._become_follower(self.term, None, out)

    # ---- reads ---------------------------------------------------------------------------
    def _start_reads(self, rids: list[Any], out: list[Action]) -> None:
        self._heartbeat(out, resend=False)
        for rid in rids:
            self._reads.append((rid, self.commit_index, self._seq))
        self._confirm_reads(out)

    def _confirm_reads(self, out: list[Action]) -> None:
        cfg = self.config
        keep: list[tuple[Any, int, int]] = []
        for rid, index, seq in self._reads:
            acked = [peer for peer, p in self._peers.items() if p.acked_seq >= seq]
            acked.append(self.id)
            if cfg.quorum(acked):
                out.append(Emit(ReadReady(rid, index)))
            else:
                keep.append((rid, index, seq))
        self._reads = keep

    # ---- validation -----------------------------------------------------------------------
    def _malformed(self, src: str, msg: Any) -> str | None:
        if not isinstance(src, str) or not src:
            return f"bad source {src!r}"
        if src == self.id:
            return "message from ourselves"
        if not _is_int(msg.term):
            return f"term {msg.term!r} is not a non-negative int"
        t = type(msg)
        if t is AppendEntries:
            if msg.leader != src:
                return f"leader {msg.leader!r} is not the sender {src!r}"
            if not (_is_int(msg.prev_index) and _is_int(msg.prev_term) and _is_int(msg.commit) and _is_int(msg.seq)):
                return "indexes must be non-negative ints"
            if not isinstance(msg.entries, tuple):
                return "entries must be a tuple"
            i = msg.prev_index
            t_prev = msg.prev_term
            for e in msg.entries:
                i += 1
                if type(e) is not Entry or e.index != i or not (t_prev <= e.term <= msg.term):
                    return f"entry {e!r} out of sequence at index {i}"
                if e.kind == CONFIG and type(e.data) is not Config:
                    return f"config entry {i} does not hold a Config"
                t_prev = e.term
        elif t is RequestVote:
            if msg.candidate != src:
                return f"candidate {msg.candidate!r} is not the sender {src!r}"
            if not (_is_int(msg.last_log_index) and _is_int(msg.last_log_term)):
                return "last log index/term must be non-negative ints"
        elif t is AppendEntriesReply:
            if not (_is_int(msg.index) and _is_int(msg.hint) and _is_int(msg.seq)):
                return "index/hint/seq must be non-negative ints"
        elif t is InstallSnapshot:
            if msg.leader != src:
                return f"leader {msg.leader!r} is not the sender {src!r}"
            if not (_is_int(msg.index) and _is_int(msg.snap_term)) or type(msg.config) is not Config:
                return f"bad snapshot {msg.index!r}/{msg.snap_term!r}/{msg.config!r}"
            if not (
                _is_int(msg.offset)
                and _is_int(msg.size)
                and type(msg.chunk) is bytes
                and msg.offset + len(msg.chunk) <= msg.size
            ):
                return (
                    f"bad chunk: {len(msg.chunk) if isinstance(msg.chunk, bytes) else msg.chunk!r} bytes "
                    f"at {msg.offset!r} of {msg.size!r}"
                )
            if not _is_int(msg.seq):
                return "seq must be a non-negative int"
        elif t is InstallSnapshotReply:
            if not (_is_int(msg.index) and _is_int(msg.seq) and _is_int(msg.offset) and _is_int(msg.receiving)):
                return "index/seq/offset/receiving must be non-negative ints"
        return None

    #: each handler takes the message class it is keyed by
    _handlers: ClassVar[dict[type, Callable[[RaftNode, str, Any, list[Action]], None]]] = {
        RequestVote: _on_request_vote,
        RequestVoteReply: _on_request_vote_reply,
        AppendEntries: _on_append,
        AppendEntriesReply: _on_append_reply,
        InstallSnapshot: _on_install_snapshot,
        InstallSnapshotReply: _on_snapshot_reply,
    }
