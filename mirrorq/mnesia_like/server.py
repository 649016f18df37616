"""The registry server of one node: Raft underneath, the registry on top.

Sans-IO (see :mod:`mirrorq.sansio`); the node agent is its shell.

Protocol
--------
* ``transact(now, req_id, txn)`` from any node.  A malformed transaction is
  refused at once (``TxnDone(req_id, False, error)``), so it never reaches the
  log.  On the leader it is proposed; elsewhere it is forwarded to the known
  leader (``Forward``), which proposes it on the origin's behalf and answers
  with ``Reply``.  Many requests that arrive together are proposed as one
  batch (one flush, one AppendEntries per follower).
* **Group commit** (``max_inflight_batches``, 0 = off): while that many
  proposal batches are replicating and not yet applied, the leader holds new
  requests and proposes everything held as one batch as soon as one applies.
  Held requests were never proposed, so if leadership is lost they are
  answered ``ok=False`` "not the registry leader" (definitely not committed).
* A proposal is answered when its entry is *applied* on the leader, with the
  registry's result (a failed precondition is ``ok=False`` with the reason).
  An entry that lost its index (leader change), or a request with no leader
  known, or whose leader stepped down, is answered ``ok=False`` with a reason
  saying so: the caller may retry.  No answer is ever "ok" for a transaction
  that was not committed.  A forwarded request whose leader changes before
  answering is answered ``ok=False`` "outcome unknown" as soon as this node
  learns of the change (it may or may not have been committed: retry only
  what is idempotent or guarded by a precondition).
* Every node applies committed transactions in log order; changes are
  emitted as ``TableChanges(changes)`` for the node's subscribers.  An
  installed snapshot replaces the tables and emits ``RegistryReset()``.
* Every ``snapshot_every`` applied entries the server hands Raft a snapshot
  of the registry (log compaction); a lagging node catches up through
  ``InstallSnapshot``.
* ``read(now, rid)`` asks for a linearizable read (Raft ReadIndex): answered
  with ``ReadDone(rid, True)`` once the local registry is at least as new as
  the leader's commit at the time of the request, after which a local read is
  linearizable.  Plain local reads need no call.
* ``forget_node(now, req_id, node)`` removes a (dead) node from the Raft
  configuration (leader only; elsewhere forwarded like a transaction) and, in
  the entry right after, deletes its ``node`` table row if there is one.  It
  is answered when that delete is applied (so the configuration change, the
  entry before it, is committed too); a refused change (unknown node, another
  change in flight, last voter) is answered ``ok=False`` with Raft's reason.
  The caller (the node agent) refuses to forget a node it sees up.
* **Joining.**  A server is *joining* while it is in no configuration it
  knows of and its Raft log is empty: a brand-new node whose name is not in
  the bootstrap voters.  ``join_requests(now, peers)`` returns a
  ``JoinRequest`` to each of ``peers`` (the shell calls it periodically with
  the nodes its membership sees up); the leader answers by ``add_server``
  (learner first; Raft promotes it to voter once caught up), everyone else
  ignores it.  A refused add (another change in flight) is simply asked again
  on the next round.  A server that was a member and was forgotten has a
  non-empty log, so it never asks: it stays passive (it cannot campaign
  successfully while the cluster has a live leader: pre-vote and the lease
  guard) until its data dir is reset.

A node in a minority partition cannot commit, so it can answer no write
``ok``: that is what keeps views from splitting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mirrorq.mnesia_like import raft as r
from mirrorq.mnesia_like.registry import Change, Registry, TxnError, check_txn
from mirrorq.sansio import Emit, Send, SetTimer

WAIT_TIMER = ("registry", "wait")
FORWARD_TIMER = ("registry", "forwarded")
FORWARD_TIMEOUT = 5.0  # a forwarded request the leader never answers (lost on the way) is given up


# ---- messages between registry servers --------------------------------------------
@dataclass(frozen=True)
class Forward:
    items: tuple  # ((req_id, kind, payload), ...) kind: "txn" | "forget"


@dataclass(frozen=True)
class JoinRequest:
    """From a joining server to the nodes it sees up: please add me."""


@dataclass(frozen=True)
class Reply:
    req_id: Any
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class ReadAsk:
    """A follower's linearizable read: "what is your read index?"."""

    rid: Any


@dataclass(frozen=True)
class ReadAnswer:
    rid: Any
    ok: bool
    index: int = 0
    error: str = ""


# ---- events for the shell -------------------------------------------------------
@dataclass(frozen=True)
class TxnDone:
    req_id: Any
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class TableChanges:
    changes: tuple[Change, ...]


@dataclass(frozen=True)
class RegistryReset:
    pass


@dataclass(frozen=True)
class JoinStarted:
    """The leader added ``node`` as a learner (it becomes a voter once caught up)."""

    node: str


@dataclass(frozen=True)
class JoinRefused:
    node: str
    reason: str


@dataclass(frozen=True)
class ReadDone:
    rid: Any
    ok: bool
    error: str = ""


@dataclass
class RegistryServer:
    name: str
    raft: r.RaftNode
    snapshot_every: int = 1000
    leader_wait: float = 2.0
    # group commit: with this many proposal batches replicating, the leader
    # holds new requests and proposes them as one batch when one of those
    # commits (0: no limit, every batch is proposed at once)
    max_inflight_batches: int = 0
    registry: Registry = field(default_factory=Registry)

    def __post_init__(self) -> None:
        # log index -> (pid, term) of a proposal awaiting apply: answered from
        # the entry applied at that index only if it has the proposal's term
        self._accepted: dict[int, tuple[Any, int]] = {}
        self._snap_at = 0
        # requests made while no leader was known: (deadline, req_id, kind, payload)
        self._waiting: list[tuple[float, Any, str, Any]] = []
        # requests forwarded to a leader and not answered yet: req_id -> leader
        self._forwarded: dict[Any, str] = {}  # request -> the leader it was forwarded to
        self._forward_deadline: dict[Any, float] = {}
        self._remote_reads: dict = {}  # our reads asked of the leader: rid -> that leader
        self._waiting_reads: list = []  # (read index, rid): served once applied up to it
        self._inflight: list[int] = []  # last log index of each proposed batch not yet applied
        self._held: list[tuple[Any, str, Any]] = []  # (pid, kind, payload) held by group commit

    @property
    def leader(self) -> str | None:
        return self.raft.leader_id

    @property
    def joining(self) -> bool:
        """In no known configuration and never given any entry: a new node
        waiting for the leader to add it (see the module docstring)."""
        raft = self.raft
        return self.name not in raft.config.members and raft.log.last_index == 0 and raft.log.snapshot is None

    def join_requests(self, now: float, peers) -> list:
        if not self.joining:
            return []
        return [Send(p, JoinRequest()) for p in sorted(set(peers)) if p != self.name]

    # ---- sans-IO entry points ---------------------------------------------------
    def start(self, now: float) -> list:
        return self._process(now, self.raft.start(now))

    def timer(self, now: float, key) -> list:
        if key == WAIT_TIMER:
            return self._retry_waiting(now)
        if key == FORWARD_TIMER:
            return self._expire_forwarded(now)
        return self._release(now, self._process(now, self.raft.timer(now, key)))

    def receive(self, now: float, src: str, msg: Any) -> list:
        if isinstance(msg, Forward):
            return self._propose(now, [((src, req_id), kind, payload) for req_id, kind, payload in msg.items])
        if isinstance(msg, JoinRequest):
            return self._on_join_request(now, src)
        if isinstance(msg, Reply):
            if self._forwarded.pop(msg.req_id, None) is None:
                return []  # already answered (its leader changed meanwhile)
            return [Emit(TxnDone(msg.req_id, msg.ok, msg.error))]
        if isinstance(msg, ReadAsk):
            return self._process(now, self.raft.read_index(now, ("rread", src, msg.rid)))
        if isinstance(msg, ReadAnswer):
            if self._remote_reads.pop(msg.rid, None) is None:
                return []
            if not msg.ok:
                return [Emit(ReadDone(msg.rid, False, msg.error))]
            self._waiting_reads.append((msg.index, msg.rid))
            return self._serve_reads()
        return self._serve_reads(self._release(now, self._process(now, self.raft.receive(now, src, msg))))

    def persist(self, now: float) -> None:
        """Carry out the Raft core's ``Persist`` (its actions pass through ours)."""
        self.raft.persist(now)

    def peer_down(self, now: float, node: str) -> list:
        """Membership saw ``node`` go down: if it led, elect a new leader now."""
        return self._process(now, self.raft.leader_lost(now, node))

    def transact(self, now: float, req_id: Any, txn: Any) -> list:
        return self.submit(now, [(req_id, "txn", txn)])

    def forget_node(self, now: float, req_id: Any, node: str) -> list:
        return self.submit(now, [(req_id, "forget", node)])

    def submit(self, now: float, items: list[tuple[Any, str, Any]]) -> list:
        """Many requests at once: ``[(req_id, "txn"|"forget", payload), ...]``."""
        out: list = []
        good = []
        for req_id, kind, payload in items:
            if kind == "txn":
                try:
                    check_txn(payload)
                except TxnError as e:
                    out.append(Emit(TxnDone(req_id, False, f"malformed transaction: {e}")))
                    continue
            elif kind != "forget" or not isinstance(payload, str):
                out.append(Emit(TxnDone(req_id, False, f"unknown request {kind!r}")))
                continue
            good.append((req_id, kind, payload))
        if not good:
            return out
        if self.raft.is_leader():
            return out + self._propose(now, [((self.name, q), k, p) for q, k, p in good])
        leader = self.leader
        if leader is None or leader == self.name:
            # an election is on: hold the requests a while (leader_wait)
            if not self._waiting:
                out.append(SetTimer(WAIT_TIMER, 0.05))
            self._waiting += [(now + self.leader_wait, q, k, p) for q, k, p in good]
            return out
        if not self._forward_deadline:
            out.append(SetTimer(FORWARD_TIMER, FORWARD_TIMEOUT))
        for q, _k, _p in good:
            self._forwarded[q] = leader
            self._forward_deadline[q] = now + FORWARD_TIMEOUT
        return out + [Send(leader, Forward(tuple(good)))]

    def _expire_forwarded(self, now: float) -> list:
        """Forwarded requests whose answer never came: the Forward or the
        Reply was lost (a peer restarted under our feet); the outcome is
        unknown, the caller retries."""
        out: list = []
        for q, deadline in sorted(self._forward_deadline.items(), key=lambda kv: kv[1]):
            if isinstance(q, tuple) and len(q) == 2 and q[0] == "read":
                rid = q[1]
                if rid not in self._remote_reads:
                    del self._forward_deadline[q]
                elif deadline <= now:
                    leader = self._remote_reads.pop(rid)
                    del self._forward_deadline[q]
                    out.append(Emit(ReadDone(rid, False, f"no answer from the registry leader {leader}; retry")))
                continue
            if q not in self._forwarded:
                del self._forward_deadline[q]
            elif deadline <= now:
                leader = self._forwarded.pop(q)
                del self._forward_deadline[q]
                out.append(
                    Emit(
                        TxnDone(
                            q,
                            False,
                            f"no answer from the registry leader {leader} within "
                            f"{FORWARD_TIMEOUT:g}s; outcome unknown, retry",
                        )
                    )
                )
        if self._forward_deadline:
            out.append(SetTimer(FORWARD_TIMER, max(0.05, min(self._forward_deadline.values()) - now)))
        return out

    def _retry_waiting(self, now: float) -> list:
        waiting, self._waiting = self._waiting, []
        out: list = []
        if self.raft.is_leader() or (self.leader and self.leader != self.name):
            return self.submit(now, [(q, k, p) for _d, q, k, p in waiting])
        for deadline, q, k, p in waiting:
            if deadline <= now:
                out.append(
                    Emit(
                        TxnDone(
                            q,
                            False,
                            f"no registry leader within {self.leader_wait}s (election, or this node is in a minority)",
                        )
                    )
                )
            else:
                self._waiting.append((deadline, q, k, p))
        if self._waiting:
            out.append(SetTimer(WAIT_TIMER, 0.05))
        return out

    def read(self, now: float, rid: Any) -> list:
        """A linearizable read: on the leader, Raft's ReadIndex; on a
        follower, the leader's read index, then wait until applied up to it
        (Raft's follower read).  ``ReadDone(rid)`` says when to read."""
        raft = self.raft
        if raft.is_leader() or not raft.leader_id:
            return self._process(now, raft.read_index(now, ("read", rid)))
        out: list = []
        if not self._forward_deadline:
            out.append(SetTimer(FORWARD_TIMER, FORWARD_TIMEOUT))
        self._remote_reads[rid] = raft.leader_id
        self._forward_deadline[("read", rid)] = now + FORWARD_TIMEOUT
        return out + [Send(raft.leader_id, ReadAsk(rid))]

    def _serve_reads(self, out: list | None = None) -> list:
        out = [] if out is None else out
        if self._waiting_reads:
            applied = self.raft.applied_index
            ready = [w for w in self._waiting_reads if w[0] <= applied]
            if ready:
                self._waiting_reads = [w for w in self._waiting_reads if w[0] > applied]
                out += [Emit(ReadDone(rid, True)) for _, rid in ready]
        return out

    # ---- internals ------------------------------------------------------------------
    def _on_join_request(self, now: float, src: str) -> list:
        raft = self.raft
        if not raft.is_leader() or src in raft.config.members:
            return []  # only the leader adds; a member asking again is a stale request
        acts = raft.add_server(now, src)
        refused = [a.event.reason for a in acts if isinstance(a, Emit) and isinstance(a.event, r.ConfigChangeRejected)]
        out = self._process(now, acts)
        out.append(Emit(JoinRefused(src, refused[0]) if refused else JoinStarted(src)))
        return out

    def _answer(self, pid: Any, ok: bool, error: str = "") -> list:
        origin, req_id = pid
        if origin == self.name:
            return [Emit(TxnDone(req_id, ok, error))]
        return [Send(origin, Reply(req_id, ok, error))]

    def _release(self, now: float, out: list) -> list:
        """Group commit: propose the held requests once a batch in flight applied."""
        applied = self.raft.applied_index
        self._inflight = [i for i in self._inflight if i > applied]
        if self._held and len(self._inflight) < self.max_inflight_batches:
            held, self._held = self._held, []
            out += self._propose(now, held)
        return out

    def _propose(self, now: float, items: list[tuple[Any, str, Any]]) -> list:
        if self.max_inflight_batches and self.raft.is_leader():
            self._inflight = [i for i in self._inflight if i > self.raft.applied_index]
            if len(self._inflight) >= self.max_inflight_batches:
                self._held += items
                return []
        if not self.raft.is_leader():
            hint = self.leader
            reason = f"not the registry leader (leader: {hint or 'unknown'}); retry"
            return [a for pid, _k, _p in items for a in self._answer(pid, False, reason)]
        out: list = []
        txns = []
        for pid, kind, payload in items:
            if kind == "txn":
                txns.append((pid, payload))
            else:
                acts = self.raft.remove_server(now, payload)
                refused = [
                    a.event.reason for a in acts if isinstance(a, Emit) and isinstance(a.event, r.ConfigChangeRejected)
                ]
                out += self._process(now, acts)
                if refused:
                    out += self._answer(pid, False, f"membership change refused: {refused[0]}")
                else:
                    # answered when this delete (the entry after the change) applies
                    txns.append((pid, {"ops": [{"op": "delete", "table": "node", "key": payload}]}))
        if txns:
            out += self._process(now, self.raft.propose_batch(now, txns))
            if self.raft.last_index > self.raft.applied_index:
                self._inflight.append(self.raft.last_index)
        return out

    def _process(self, now: float, actions: list) -> list:
        out: list = []
        for a in actions:
            if not isinstance(a, Emit):
                out.append(a)
                continue
            ev = a.event
            if isinstance(ev, r.ProposalAccepted):
                if ev.pid is not None:  # membership changes carry none (see _propose)
                    self._accepted[ev.index] = (ev.pid, ev.term)
            elif isinstance(ev, r.Committed):
                res = self.registry.apply(ev.command)
                if res.ok and res.changes:
                    out.append(Emit(TableChanges(tuple(res.changes))))
                accepted = self._accepted.pop(ev.index, None)
                if accepted is not None:
                    pid, term = accepted
                    if term == ev.term:
                        out += self._answer(pid, res.ok, res.error)
                    else:
                        out += self._answer(pid, False, "transaction lost to a leader change; retry")
            elif isinstance(ev, (r.ProposalLost, r.ProposalUnknown)):
                if self._accepted.get(ev.index, (None,))[0] == ev.pid:
                    del self._accepted[ev.index]
                    what = "lost to a leader change" if isinstance(ev, r.ProposalLost) else "of unknown outcome"
                    out += self._answer(ev.pid, False, f"transaction {what}; retry")
            elif isinstance(ev, r.NotLeader):
                rid = ev.request_id
                if isinstance(rid, tuple) and rid[:1] == ("read",):
                    out.append(
                        Emit(ReadDone(rid[1], False, f"not the registry leader (leader: {ev.leader_hint}); retry"))
                    )
                elif isinstance(rid, tuple) and rid[:1] == ("rread",):
                    out.append(
                        Send(
                            rid[1],
                            ReadAnswer(rid[2], False, 0, f"not the registry leader (leader: {ev.leader_hint}); retry"),
                        )
                    )
            elif isinstance(ev, r.ReadReady):
                rid = ev.request_id
                if rid[:1] == ("rread",):
                    out.append(Send(rid[1], ReadAnswer(rid[2], True, ev.index)))
                else:
                    out.append(Emit(ReadDone(rid[1], True)))
            elif isinstance(ev, r.ApplySnapshot):
                self.registry = Registry.restore(ev.data)
                self._snap_at = ev.index
                out.append(Emit(RegistryReset()))
            elif isinstance(ev, r.ConfigChangeRejected):
                pass  # answered by the caller of add_server / remove_server
            else:
                if isinstance(ev, r.LeaderChanged):
                    for rid, asked in sorted(self._remote_reads.items(), key=repr):
                        if asked != ev.leader:  # that leader's answer may never come
                            del self._remote_reads[rid]
                            out.append(Emit(ReadDone(rid, False, "registry leader changed; retry")))
                    if ev.leader != self.name:
                        self._inflight.clear()
                        held, self._held = self._held, []
                        for pid, _k, _p in held:  # never proposed: definitely not committed
                            out += self._answer(
                                pid, False, f"not the registry leader (leader: {ev.leader or 'unknown'}); retry"
                            )
                    # a leader that was forwarded a request and is no longer
                    # the leader may never answer: say so now, outcome unknown
                    if ev.leader != self.name:
                        for _index, (pid, _term) in sorted(self._accepted.items()):
                            out += self._answer(
                                pid, False, "registry leader stepped down before commit; outcome unknown, retry"
                            )
                        self._accepted.clear()
                    for q, was in list(self._forwarded.items()):
                        if was != ev.leader:
                            del self._forwarded[q]
                            out.append(
                                Emit(
                                    TxnDone(
                                        q,
                                        False,
                                        f"registry leader {was} changed before answering; outcome unknown, retry",
                                    )
                                )
                            )
                out.append(a)  # LeaderChanged, MessageIgnored...: for the shell's log
        if self.raft.applied_index - self._snap_at >= self.snapshot_every:
            self._snap_at = self.raft.applied_index
            out += self._process(now, self.raft.compact(now, self.raft.applied_index, self.registry.snapshot()))
        return out
