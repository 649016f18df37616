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
  configuration (leader only; elsewhere forwarded like a transaction).

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


# ---- messages between registry servers --------------------------------------------
@dataclass(frozen=True)
class Forward:
    items: tuple  # ((req_id, kind, payload), ...) kind: "txn" | "forget"


@dataclass(frozen=True)
class Reply:
    req_id: Any
    ok: bool
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
    registry: Registry = field(default_factory=Registry)

    def __post_init__(self) -> None:
        # log index -> (pid, term) of a proposal awaiting apply: answered from
        # the entry applied at that index only if it has the proposal's term
        self._accepted: dict[int, tuple[Any, int]] = {}
        self._snap_at = 0
        self._forgets: dict[Any, str] = {}  # pid -> node being removed
        # requests made while no leader was known: (deadline, req_id, kind, payload)
        self._waiting: list[tuple[float, Any, str, Any]] = []
        # requests forwarded to a leader and not answered yet: req_id -> leader
        self._forwarded: dict[Any, str] = {}

    @property
    def leader(self) -> str | None:
        return self.raft.leader_id

    # ---- sans-IO entry points ---------------------------------------------------
    def start(self, now: float) -> list:
        return self._process(now, self.raft.start(now))

    def timer(self, now: float, key) -> list:
        if key == WAIT_TIMER:
            return self._retry_waiting(now)
        return self._process(now, self.raft.timer(now, key))

    def receive(self, now: float, src: str, msg: Any) -> list:
        if isinstance(msg, Forward):
            return self._propose(now, [((src, req_id), kind, payload) for req_id, kind, payload in msg.items])
        if isinstance(msg, Reply):
            if self._forwarded.pop(msg.req_id, None) is None:
                return []  # already answered (its leader changed meanwhile)
            return [Emit(TxnDone(msg.req_id, msg.ok, msg.error))]
        return self._process(now, self.raft.receive(now, src, msg))

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
        for q, _k, _p in good:
            self._forwarded[q] = leader
        return out + [Send(leader, Forward(tuple(good)))]

    def _retry_waiting(self, now: float) -> list:
        waiting, self._waiting = self._waiting, []
        out: list = []
        if self.raft.is_leader() or (self.leader and self.leader != self.name):
            return self.submit(now, [(q, k, p) for _d, q, k, p in waiting])
        for deadline, q, k, p in waiting:
            if deadline <= now:
                out.append(Emit(TxnDone(q, False, f"no registry leader within {self.leader_wait}s "
                                                  "(election, or this node is in a minority)")))
            else:
                self._waiting.append((deadline, q, k, p))
        if self._waiting:
            out.append(SetTimer(WAIT_TIMER, 0.05))
        return out

    def read(self, now: float, rid: Any) -> list:
        return self._process(now, self.raft.read_index(now, ("read", rid)))

    # ---- internals ------------------------------------------------------------------
    def _answer(self, pid: Any, ok: bool, error: str = "") -> list:
        origin, req_id = pid
        if origin == self.name:
            return [Emit(TxnDone(req_id, ok, error))]
        return [Send(origin, Reply(req_id, ok, error))]

    def _propose(self, now: float, items: list[tuple[Any, str, Any]]) -> list:
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
                self._forgets[pid] = payload
                out += self._process(now, self.raft.remove_server(now, payload, rid=pid))
        if txns:
            out += self._process(now, self.raft.propose_batch(now, txns))
        return out

    def _process(self, now: float, actions: list) -> list:
        out: list = []
        for a in actions:
            if not isinstance(a, Emit):
                out.append(a)
                continue
            ev = a.event
            if isinstance(ev, r.ProposalAccepted):
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
                    out.append(Emit(ReadDone(rid[1], False, f"not the registry leader (leader: {ev.leader_hint})")))
                elif rid in self._forgets:
                    del self._forgets[rid]
                    out += self._answer(rid, False, "leader stepped down; retry")
            elif isinstance(ev, r.ReadReady):
                out.append(Emit(ReadDone(ev.request_id[1], True)))
            elif isinstance(ev, r.ApplySnapshot):
                self.registry = Registry.restore(ev.data)
                self._snap_at = ev.index
                out.append(Emit(RegistryReset()))
            elif isinstance(ev, r.ConfigChangeRejected):
                if self._forgets.pop(ev.request_id, None) is not None:
                    out += self._answer(ev.request_id, False, f"membership change refused: {ev.reason}")
            elif isinstance(ev, r.MembershipCommitted):
                for pid, node in list(self._forgets.items()):
                    if node not in ev.config.voters and node not in ev.config.learners:
                        del self._forgets[pid]
                        out += self._answer(pid, True)
            else:
                if isinstance(ev, r.LeaderChanged):
                    # a leader that was forwarded a request and is no longer
                    # the leader may never answer: say so now, outcome unknown
                    if ev.leader != self.name:
                        for index, (pid, _term) in sorted(self._accepted.items()):
                            out += self._answer(pid, False, "registry leader stepped down before commit; "
                                                            "outcome unknown, retry")
                        self._accepted.clear()
                    for q, was in list(self._forwarded.items()):
                        if was != ev.leader:
                            del self._forwarded[q]
                            out.append(Emit(TxnDone(q, False, f"registry leader {was} changed before answering; "
                                                              "outcome unknown, retry")))
                out.append(a)  # LeaderChanged, MessageIgnored...: for the shell's log
        if self.raft.applied_index - self._snap_at >= self.snapshot_every:
            self._snap_at = self.raft.applied_index
            out += self._process(now, self.raft.compact(now, self.raft.applied_index, self.registry.snapshot()))
        return out
