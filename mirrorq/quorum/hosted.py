"""A hosted quorum-queue member: the shell around one QuorumReplica inside a queue host.

A quorum queue's members live in the same queue hosts as classic replicas
(:mod:`mirrorq.queues.host`), one :class:`HostedQuorum` per member,
so many queues' Raft groups share a node's few host processes and the
Raft traffic of all of them between two hosts travels in one bundle per
turn (:class:`~mirrorq.node.posting.PostingActor`).  The protocol is the
core's (:mod:`mirrorq.quorum.replica`); this shell only translates.

Names
-----
* A member's **stable name** ``node/quorum/uid`` is its Raft identity for
  ever (the group's voters; epochs ``name#term``); it survives restarts of
  its node.  Its **address** ``node/host:port/uid`` names it in this life
  of its host: posts to it reach it through the host (``ToReplica``).
* Each member puts its row ``quorum_member[group, stable] = {node, dst}``
  when it starts, and reads its peers' rows (again after a registry
  snapshot reset) -- except the members of a new queue: the declaring
  queue manager puts all their rows in one transaction once every one has
  started, and they learn their peers from it; the host hands it every change of its group's rows (the
  host subscribes once for all), and every Raft message carries its
  sender's address, so a peer that restarted on a new port is found again
  by its row or by its first message, whichever comes first.  A Raft message to
  a peer whose address is not known yet is dropped: Raft's own resends
  (heartbeats, elections) carry on once it is.
* Raft messages travel as :class:`QuorumFrame` ``(src, msg)``: the host
  delivers them by address, the core gets the sender's stable name.

The record
----------
The leader keeps the queue's ``amqqueue`` row with the record upkeep
(:mod:`mirrorq.queues.record_upkeep`): when it wins an election and
whenever a configuration commits (``MembershipCommitted``) it tells the
upkeep what the row should say -- ``type = "quorum"``, ``members`` (every
member of the committed Raft configuration, voters and learners, in the
declare's order then additions), ``bootstrap`` (the group's first voters),
``pid`` = its epoch and ``leader_dst`` = its address (what front ends send
to) -- fenced by its term.  The upkeep reads the row and puts the whole
row while ``pid``, ``leader_dst`` or ``members`` differ, each put checked
against the row it read (``pid`` as read, or absent), and never over a row
whose ``pid`` is an epoch of a higher term: a deposed leader's late put is
refused (``quorum_record_write_failed``), and once it reads its
successor's epoch it stops (``quorum_record_superseded``).  A member that
stops leading releases the upkeep.  A leader that removed itself has the
row written without a leader (``pid`` and ``leader_dst`` None, fenced by
the term it led) as it steps down; that write goes on until done, or until
a leader is known.  Deleting the queue (``QueueCommand("delete")`` at the
leader) releases the upkeep and removes the queue's rows; every member
whose own ``quorum_member`` row disappears drops its log and exits.

Membership
----------
* The Raft configuration decides who is a member; the shell follows it:
  the members it needs addresses of are the latest configuration's (plus
  those named at its start), read from ``quorum_member`` when a
  configuration commits, so a member's peer list never depends on the
  declare's list alone.
* A member keeps the group's **bootstrap** voters (the configuration at
  index 0, the same on every member) in ``bootstrap.json`` in its directory,
  written when it is created and read on every later start: a recovery
  (whose ``voters`` are the record's members) builds its Raft node with the
  bootstrap every other member has.  A **joining** member (``quorum["join"]``,
  started by the queue manager before the leader adds it) is built with the
  record's ``bootstrap`` and named ``members`` to find the leader; it is no
  voter of its own bootstrap, so it stays passive until the leader's
  configuration names it.
* **Removal**: when a configuration leaving members out commits, the leader
  deletes those members' ``quorum_member`` rows in the transaction that
  writes the record's new members (the upkeep's deletes: until one of its
  writes commits, every record write of a leader deletes the rows of
  members of earlier configurations its log holds that the latest and the
  committed ones leave out, so a new leader finishes what a dead one did
  not); a member seeing its own row go stops and removes its
  log, and the queue manager, which sees the record of the same
  transaction, does not start it again.  The leader refuses ``add_member`` of a member
  on a node that already has one (406).  A removed member whose node is
  down when its row goes keeps its directory until removed by hand (it is
  not restarted: recovery starts only the record's members).

Turns, time, durability
-----------------------
One host turn is one turn of the core: its ``end_turn(now)`` proposes the
turn's requests as one entry; a ``Persist`` the core asked for in the turn
is carried out at the end of the turn (the member's log written out, then
synced with the host's other files of the turn), before anything posted in
the turn leaves -- except the sends the core marks ``early`` (the leader's
``AppendEntries``, :mod:`mirrorq.mnesia_like.raft`), which the host
transmits before it syncs, so the followers write and fsync while the
leader does.  Once the sync is done the host tells the member
(:meth:`HostedQuorum.synced` -> the core's ``persisted``), and what that
unblocks (a lone voter's commit) is carried out in the same turn.  ``now`` is the host's one clock per
turn (wall-clock seconds: the leader's ``now`` is stored in entries and
drives TTLs).  Timers are the host's heap, with a generation so a
cancelled or re-armed timer's old wakeup is ignored.

Liveness: a ``NodeEvent`` "down" naming the leader's node tells the core
``leader_lost`` (an election starts without waiting for the timeout); the
channels of a front end the host's outbox gives up on (its node died) go
``down`` (``dst_down``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

from thespian.actors import WakeupMessage

from mirrorq.mnesia_like.raft import ELECTION_TIMER, LeaderChanged, MembershipCommitted, MessageIgnored
from mirrorq.mnesia_like.raft_log import FileRaftLog
from mirrorq.node.addresses import address_key
from mirrorq.node.messages import NodeEvent, RegistryChanges, RegistryGet, RegistryResult, RegistryRows, RegistryTxn
from mirrorq.queues import messages as wire
from mirrorq.queues.control import ExitReplica, ReplicaInit, StopReplica, group_name
from mirrorq.queues.messages import epoch, epoch_member
from mirrorq.queues.record_upkeep import (
    RETRY_TIMER,
    RecordUpkeep,
    RowKey,
    Superseded,
    TermFence,
    UpkeepDone,
    UpkeepDriver,
    Wanted,
    WriteRefused,
    is_answer,
)
from mirrorq.quorum.replica import QuorumReplica
from mirrorq.sansio import CancelTimer, Emit, Persist, Send, SetTimer

MEMBER_TABLE = "quorum_member"
#: Raft timing of quorum queues: many groups per host, so an idle group's
#: heartbeats are sparse (every 2 s); a dead leader's node is reported by
#: node liveness (``leader_lost``: an election at once), so the election
#: timeout (5-8 s) only covers a leader that stops answering on a live node;
#: after ``leader_lost`` members campaign within 0.1 s (and again until one wins);
#: followers learn a commit from the next append, or 50 ms after it (they do
#: not serve: one message per entry for them instead of two, the commit notice)
RAFT_OPTIONS = {
    "election_timeout": (5.0, 8.0),
    "heartbeat_interval": 2.0,
    "lost_leader_delay": 0.1,
    "commit_notice_delay": 0.05,
}
MEMBER_RETRY = 0.5  # a member puts its quorum_member row again this long after the registry refused it
_TIMER = "mirrorq.quorum.timer"
_RECORD = "mirrorq.quorum.record"  # the wakeup payload tag of the record upkeep's retry timer
_MEMBER = "mirrorq.quorum.member_row"
BOOTSTRAP_FILE = "bootstrap.json"
REQUESTS = (
    wire.Publish,
    wire.Consume,
    wire.Cancel,
    wire.Settle,
    wire.Get,
    wire.ChannelClosed,
    wire.QueueCommand,
    wire.DeadLetterDone,
)


@dataclass
class QuorumFrame:
    """A Raft message between two members of one quorum queue."""

    src: str  # the sender's stable name
    msg: Any
    src_dst: str = ""  # the sender's address (a peer that restarted is found by its first message)


def stable_name(node: str, uid: str | None = None) -> str:
    return f"{node}/quorum/{uid or uuid.uuid4().hex[:16]}"


def is_stable_name(name: Any) -> bool:
    return isinstance(name, str) and name.count("/") == 2 and name.split("/")[1] == "quorum"


def is_quorum(spec: dict) -> bool:
    """Whether a declare's spec or an ``amqqueue`` row is a quorum queue's."""
    if spec.get("type") == "quorum":
        return True
    return str((spec.get("arguments") or {}).get("x-queue-type", "")) == "quorum"


def node_of(name: str) -> str:
    return name.split("/", 1)[0]


def member_dir(data_dir: str, vhost: str, name: str, member: str) -> str:
    q = lambda s: urllib.parse.quote(s, safe="")  # noqa: E731
    return os.path.join(data_dir, "quorum", q(vhost), q(name), q(member.rsplit("/", 1)[1]))


def record_of(
    spec: dict, members: list, pid: str | None, leader_dst: str | None, bootstrap: list | None = None
) -> dict:
    """The queue's ``amqqueue`` row as its leader writes it: ``members`` are
    those of the committed Raft configuration (voters and learners),
    ``bootstrap`` the group's first voters (what a joining member is built
    with)."""
    return {
        "name": spec["name"],
        "vhost": spec.get("vhost", "/"),
        "durable": True,
        "auto_delete": False,
        "exclusive_owner": None,
        "arguments": dict(spec.get("arguments") or {}),
        "pid": pid,
        "slave_pids": [v for v in members if epoch_member(pid or "") != v],
        "policy": spec.get("policy"),
        "incarnation": spec.get("incarnation", ""),
        "type": "quorum",
        "members": list(members),
        "bootstrap": list(bootstrap or members),
        "leader_dst": leader_dst,
    }


class HostedQuorum:
    """One quorum-queue member inside a queue host (see the module docstring).
    ``port`` is what it sees of the host (``post``, ``wakeupAfter``,
    ``myAddress``, ``now``, ``exit``, ``log``)."""

    def __init__(self, port: Any) -> None:
        self.port = port
        self.core: QuorumReplica | None = None
        self.member: str | None = None  # the address (what the host routes by)
        self.stable: str | None = None
        self.spec: Any = None
        self.group: str | None = None
        self.peers: dict[str, str] = {}  # stable name -> address
        self.timers: dict = {}  # core timer key -> generation
        self.gen = 0
        self.persist_due = False
        self.record_epoch: str | None = None  # the epoch this member wants in the row (it leads)
        self.record_term = 0  # the term it leads (or led, stepping down): its upkeep's fence
        self.stepping_down = False  # it removed itself: its upkeep writes the row without a leader
        self.upkeep: RecordUpkeep | None = None  # the amqqueue record's (made by init)
        self.record_driver = UpkeepDriver(
            self.post, lambda delay, token: self.port.wakeupAfter(delay, (_RECORD, token))
        )
        self._closed = False
        self.campaign = False  # a new queue's first member: campaign as soon as it knows its peers
        self.hints: set[str] = set()  # members named at start (a joiner's way to its group's leader)
        self.order: list[str] = []  # the record's member order (the declare's, additions after)

    # ---- start ---------------------------------------------------------------------------
    def init(self, msg: ReplicaInit) -> str:
        spec = dict(msg.spec)
        q = msg.quorum or {}
        self.stable, given = str(q["member"]), [str(v) for v in q["voters"]]
        join = bool(q.get("join"))
        if not join and self.stable not in given:
            raise ValueError(f"quorum member {self.stable!r} is not one of the voters {given!r}")
        self.spec = _Spec(spec)
        self.node, self.agent = msg.node, msg.agent
        self.group = group_name(self.spec.vhost, self.spec.name)
        self.directory = member_dir(msg.data_dir, self.spec.vhost, self.spec.name, self.stable)
        if msg.fresh and os.path.isdir(self.directory):
            shutil.rmtree(self.directory)
        host = self.port.host_address
        self.member = f"{self.node}/{host}/{self.stable.rsplit('/', 1)[1]}"
        self.upkeep = RecordUpkeep(self.stable, self.agent, (self.spec.vhost, self.spec.name))
        self.log = FileRaftLog(self.directory)
        voters = self._bootstrap(given)
        self.hints = {str(m) for m in q.get("members") or given} | set(voters)
        self.order = [str(m) for m in q.get("members") or given]
        self.core = QuorumReplica(
            self.stable,
            self.spec.name,
            self.log,
            random.Random(),
            voters=voters,
            address=self.member,
            arguments=self.spec.arguments,
            raft_options=RAFT_OPTIONS,
            vhost=self.spec.vhost,
            incarnation=self.spec.incarnation,
        )
        self.peers[self.stable] = self.member
        # the declaring node's member (listed first: RabbitMQ's client-local
        # leader) of a new queue stands for election as soon as it can reach
        # its peers, instead of after an election timeout
        self.campaign = not msg.recover and not join and voters[0] == self.stable and len(voters) > 1
        if msg.recover or join:
            self._put_member_row()
            self._read_peers()
        # else a new queue's member: the declaring queue manager puts every
        # member's row in one transaction once all have started (the host hands it
        # the changes), so none writes its own or reads its peers' now
        self._do(self.core.start(self.port.now))
        self.port.log(
            "quorum_member_started",
            queue=self.spec.name,
            member=self.stable,
            dst=self.member,
            voters=voters,
            join=join,
            last_index=self.log.last_index,
        )
        return self.member

    def _bootstrap(self, given: list) -> list:
        """The group's bootstrap voters (the Raft configuration at index 0,
        the same on every member for ever): kept in the member's directory
        when it is created, read back on every later start (``given`` --
        the record's members on a recovery -- only for a member that has no
        such file)."""
        path = os.path.join(self.directory, BOOTSTRAP_FILE)
        try:
            with open(path) as f:
                voters = [str(v) for v in json.load(f)["voters"]]
            if voters:
                return voters
        except (OSError, ValueError, KeyError, TypeError):
            pass
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"voters": list(given)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return list(given)

    def _started(self) -> QuorumReplica:
        """The replica :meth:`init` built.  Everything but ``init`` runs after
        it returned: the host hands a member input only then, and closes one
        whose ``init`` failed."""
        if self.core is None:
            raise RuntimeError("this quorum member was used before init() built its replica")
        return self.core

    # ---- the host's services ---------------------------------------------------------------
    def post(self, dst: Any, msg: Any) -> None:
        self.port.post(dst, msg)

    # ---- input -------------------------------------------------------------------------------
    def on_message(self, msg: Any, sender: Any) -> None:
        if self._closed or self.core is None:
            return
        now = self.port.now
        if isinstance(msg, QuorumFrame):
            if msg.src_dst:
                self._peer(msg.src, msg.src_dst)
            return self._do(self.core.receive(now, msg.src, msg.msg))
        if isinstance(msg, wire.QueueCommand) and msg.command == "delete":
            return self._delete(msg)
        if isinstance(msg, wire.QueueCommand) and msg.command == "add_member" and self._node_taken(msg):
            return
        if isinstance(msg, REQUESTS):
            return self._do(self.core.receive(now, _text(sender), msg))
        if isinstance(msg, WakeupMessage):
            p = msg.payload
            if isinstance(p, tuple) and len(p) == 3 and p[0] == _TIMER and self.timers.get(p[1]) == p[2]:
                del self.timers[p[1]]
                self._do(self.core.timer(now, p[1]))
            elif isinstance(p, tuple) and len(p) == 2 and p[0] == _RECORD and self.record_driver.fired(p[1]):
                self._record(lambda up: up.timer(now, RETRY_TIMER))
            elif p == _MEMBER:
                self._put_member_row()
            return
        if is_answer(msg):
            return self._record(lambda up: up.receive(now, "agent", msg))
        if isinstance(msg, RegistryRows):
            return self._rows(msg)
        if isinstance(msg, RegistryResult):
            if msg.ref == _MEMBER and not msg.ok:
                self.port.wakeupAfter(MEMBER_RETRY, _MEMBER)
            return
        if isinstance(msg, RegistryChanges):
            return self._changes(msg)
        if isinstance(msg, NodeEvent) and msg.kind == "down":
            leader = self.core.raft.leader_id
            if leader is not None and node_of(leader) == msg.node and leader != self.stable:
                self._do(self.core.leader_lost(now, leader))
            return
        if isinstance(msg, (StopReplica, ExitReplica)):
            return self.stop("asked to stop")

    def dst_down(self, dst: str) -> None:
        """The host's outbox gave up on ``dst``: a front end gone (its channels
        go down) or a peer's old address (Raft resends once it is known again)."""
        if self.core is not None and not self._closed:
            self._do(self.core.dst_down(self.port.now, dst))

    def end_turn(self) -> None:
        if self._closed or self.core is None:
            return
        self.core.dead_letters.dst = self.port.front_end  # the node's router (FrontEndAt may come late)
        self._do(self.core.end_turn(self.port.now))
        self._write_out()

    def _write_out(self) -> None:
        if self.persist_due:
            self.persist_due = False
            fd = self.log.write_out()  # the host syncs every group's log of the turn at once
            if fd is not None:
                self.port.sync_at_end_of_turn(fd, then=self.synced)

    def synced(self) -> None:
        """The host synced what this member wrote in the turn: the core counts it."""
        if self._closed or self.core is None:
            return
        self._do(self.core.persisted(self.port.now))
        self._write_out()  # (a lone voter's commit may have proposed again)

    def stop(self, reason: str, remove: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if remove:
                self.log.close()
                shutil.rmtree(self.directory, ignore_errors=True)
            else:
                self._started().persist(self.port.now)
                self.log.close()
        finally:
            self.port.exit(reason)

    # ---- the core's actions ----------------------------------------------------------------
    def _do(self, actions: list) -> None:
        for a in actions:
            t = type(a)
            if t is Send:
                self._send(a.dst, a.msg, a.early)
            elif t is Persist:
                self.persist_due = True
            elif t is SetTimer:
                self.gen += 1
                self.timers[a.key] = self.gen
                self.port.wakeupAfter(a.delay, (_TIMER, a.key, self.gen))
            elif t is CancelTimer:
                self.timers.pop(a.key, None)
            elif t is Emit:
                ev = a.event
                if isinstance(ev, LeaderChanged):
                    self._leader_changed(ev)
                elif isinstance(ev, MembershipCommitted):
                    self._membership(ev)
                elif isinstance(ev, MessageIgnored):
                    self.port.log(
                        "quorum_message_ignored",
                        level="warning",
                        queue=self.spec.name,
                        src=str(ev.src),
                        reason=str(ev.reason),
                    )

    def _send(self, dst: Any, msg: Any, early: bool = False) -> None:
        if is_stable_name(dst):  # a Raft message to a peer
            addr = self.peers.get(dst)
            if addr is not None:
                stable, member = self.stable, self.member
                assert stable is not None and member is not None  # set by init, before the core acts
                frame = QuorumFrame(stable, msg, member)
                if early:
                    self.port.post_early(addr, frame)  # leaves before the turn's sync
                else:
                    self.post(addr, frame)
            return
        self.post(dst, msg)  # a channel's front end, or a member's address

    # ---- peers' addresses --------------------------------------------------------------------
    def _rows(self, msg: RegistryRows) -> None:
        if not msg.ok:
            return
        for row in msg.rows:
            if row.get("group") == self.group and row.get("member"):
                self._peer(row["member"], row.get("dst"))

    def _changes(self, msg: RegistryChanges) -> None:
        if msg.changes is None:  # a registry snapshot reset: read the peers' rows again
            return self._read_peers()
        for table, key, _old, new in msg.changes:
            if table != MEMBER_TABLE or not isinstance(key, (list, tuple)) or len(key) != 2:
                continue
            if new is None:
                if key[1] == self.stable:  # removed from the group, or the queue deleted: this member goes
                    self.port.log("quorum_member_deleted", queue=self.spec.name, member=self.stable)
                    return self.stop("removed from the queue's group (or the queue deleted)", remove=True)
                self.peers.pop(key[1], None)
            else:
                self._peer(key[1], new.get("dst"))

    def _put_member_row(self) -> None:
        """This member's address in ``quorum_member``; put again until the
        registry says it took it (a put lost to a registry leader change
        would leave peers sending to this member's previous life)."""
        group, stable, member = self.group, self.stable, self.member
        assert group is not None and stable is not None and member is not None  # set by init, before any put
        self.post(
            self.agent,
            RegistryTxn({"ops": [member_row_put(group, stable, self.node, member)]}, ref=_MEMBER),
        )

    def _known(self) -> set[str]:
        """The members this one needs addresses of: its configuration's (the
        latest, maybe uncommitted) and those named at its start."""
        raft = self._started().raft
        return (
            set((raft.config if raft.configurations else raft.bootstrap).members) | self.hints
        )  # (before start: bootstrap)

    def _read_peers(self, only: Any = None) -> None:
        for v in sorted(self._known() if only is None else only):
            if v != self.stable:
                self.post(self.agent, RegistryGet(MEMBER_TABLE, [self.group, v]))

    def _peer(self, stable: str, dst: Any) -> None:
        """``stable``'s address: from its row (of this queue's group) or its
        own Raft message."""
        if stable != self.stable and is_stable_name(stable) and isinstance(dst, str) and self.peers.get(stable) != dst:
            self.peers[stable] = dst
            self.port.log("quorum_peer", queue=self.spec.name, member=self.stable, peer=stable, dst=dst)
            core = self._started()
            raft = core.raft
            if self.campaign and raft.configurations and all(v in self.peers for v in raft.config.voters):
                self.campaign = False
                if core.raft.term == 0:
                    self._do(core.timer(self.port.now, ELECTION_TIMER))

    # ---- membership ----------------------------------------------------------------------------
    def _node_taken(self, msg: wire.QueueCommand) -> bool:
        """The leader refuses to add a member on a node that has one (answered here)."""
        member = (msg.args or {}).get("member")
        core = self._started()
        if core.led_term is None or not isinstance(member, str):
            return False
        taken = [m for m in core.raft.config.members if m != member and node_of(m) == node_of(member)]
        if not taken:
            return False
        ch = msg.channel
        self.post(
            ch[0],
            wire.CommandResult(
                self.spec.name,
                ch,
                msg.request_id,
                False,
                code=406,
                error=f"node {node_of(member)} already has a member of queue '{self.spec.name}': {taken[0]}",
            ),
        )
        return True

    def _membership(self, ev: MembershipCommitted) -> None:
        """A configuration is committed: find the new members' addresses; the
        leader (or the leader that just removed itself) writes the record's
        members and deletes the removed members' rows (each stops and drops
        its log when it sees its row go)."""
        members = set(ev.config.members)
        self.port.log(
            "quorum_membership",
            queue=self.spec.name,
            member=self.stable,
            index=ev.index,
            voters=list(ev.config.voters),
            learners=list(ev.config.learners),
        )
        self._read_peers(members - set(self.peers))
        if self.record_epoch is None:
            return
        if self.stable not in members:  # this leader removed itself: it steps down now
            self.record_epoch = None
            self.stepping_down = True
        self._keep_record()

    def _removed(self) -> set[str]:
        """Members of any configuration this member's log holds (and those
        named at its start) that the latest and the committed configuration
        both leave out."""
        raft = self._started().raft
        ever = {m for _, cfg in raft.configurations for m in cfg.members} | self.hints
        return ever - set(raft.config.members) - set(raft.committed_config.members)

    # ---- the record (kept by the leader: mirrorq.queues.record_upkeep) -----------------------
    def _leader_changed(self, ev: LeaderChanged) -> None:
        self.port.log("quorum_leader_changed", queue=self.spec.name, member=self.stable, term=ev.term, leader=ev.leader)
        if ev.leader == self.stable:
            assert self.stable is not None  # set by init; a leader change comes from the core after it
            self.record_epoch = epoch(self.stable, ev.term)
            self.record_term = ev.term
            self.stepping_down = False
            self.port.log("quorum_leader", queue=self.spec.name, member=self.stable, term=ev.term)
            self._keep_record()
        else:
            self.record_epoch = None
            if ev.leader is not None or not self.stepping_down:  # (stepping down: its last write goes on)
                self._release_record()

    def _record_members(self) -> list[str]:
        """The committed configuration's members, in the record's order
        (the declare's, then additions)."""
        committed = set(self._started().raft.committed_config.members)
        self.order = [m for m in self.order if m in committed] + sorted(committed - set(self.order))
        return list(self.order)

    def _keep_record(self) -> None:
        """Tell the upkeep what the record should say: this leader's epoch
        and address (none when it removed itself), the committed members,
        fenced by its term; every write deletes the rows of the members
        removed since (whoever sees a removed member's row go sees the
        record without it: the queue manager never recovers it)."""
        members = self._record_members()
        pid, dst = (None, None) if self.stepping_down else (self.record_epoch, self.member)
        row = record_of(self.spec.as_dict(), members, pid, dst, list(self._started().raft.bootstrap.voters))
        gone = tuple(RowKey(MEMBER_TABLE, (str(self.group), m)) for m in sorted(self._removed()))
        fields = {"pid": pid, "leader_dst": dst, "members": members}
        wanted = Wanted(fields, row, TermFence(self.record_term), whole=True, deletes=gone)
        self._record(lambda up: up.keep(self.port.now, wanted))

    def _release_record(self) -> None:
        self.stepping_down = False
        if self.upkeep is not None:
            self._record_actions(self.upkeep.release(self.port.now))

    def _record(self, event: Any) -> None:
        """Hand the upkeep an event while this member keeps the record (it
        leads, or steps down), else release it; carry out its actions."""
        if self.upkeep is None:
            return
        if self.record_epoch is None and not self.stepping_down:
            return self._release_record()
        self._record_actions(event(self.upkeep))

    def _record_actions(self, actions: list) -> None:
        for ev in self.record_driver.carry_out(actions):
            if isinstance(ev, UpkeepDone):
                self.stepping_down = False
            elif isinstance(ev, WriteRefused):  # read again and written again on the record timer
                self.port.log(
                    "quorum_record_write_failed",
                    level="warning",
                    queue=self.spec.name,
                    member=self.stable,
                    error=ev.error,
                )
            elif isinstance(ev, Superseded):  # a newer leader's row: never written over
                self.stepping_down = False
                self.port.log("quorum_record_superseded", queue=self.spec.name, member=self.stable, pid=ev.pid)

    # ---- delete --------------------------------------------------------------------------------
    def _delete(self, msg: wire.QueueCommand) -> None:
        ch = msg.channel
        core = self._started()
        if core.led_term is None:
            self.post(ch[0], wire.NotMaster(self.spec.name, core.leader_epoch(), msg))
            return
        m = core.machine
        args = msg.args or {}
        if args.get("if_unused") and len(m.rotation):
            self.post(
                ch[0],
                wire.CommandResult(
                    self.spec.name,
                    ch,
                    msg.request_id,
                    False,
                    error=f"PRECONDITION_FAILED - queue '{self.spec.name}' in use",
                    code=406,
                ),
            )
            return
        if args.get("if_empty") and m.message_count:
            self.post(
                ch[0],
                wire.CommandResult(
                    self.spec.name,
                    ch,
                    msg.request_id,
                    False,
                    error=f"PRECONDITION_FAILED - queue '{self.spec.name}' not empty",
                    code=406,
                ),
            )
            return
        s = self.spec
        ops = [
            {"op": "delete", "table": "amqqueue", "key": [s.vhost, s.name]},
            {"op": "delete", "table": "queue_claim", "key": [s.vhost, s.name]},
        ]
        everyone = self._known() | {m for _, cfg in core.raft.configurations for m in cfg.members}
        ops += [{"op": "delete", "table": MEMBER_TABLE, "key": [self.group, v]} for v in sorted(everyone)]
        self.post(self.agent, RegistryTxn({"ops": ops}))
        self.record_epoch = None
        self._release_record()  # the row goes: nothing writes it again
        self.post(ch[0], wire.CommandResult(self.spec.name, ch, msg.request_id, True, m.message_count))


class _Spec:
    """The declare's fields a member keeps (and the leader writes back)."""

    def __init__(self, spec: dict) -> None:
        self.name = str(spec["name"])
        self.vhost = str(spec.get("vhost", "/"))
        self.arguments = dict(spec.get("arguments") or {})
        self.incarnation = str(spec.get("incarnation", ""))
        self.policy = spec.get("policy")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "vhost": self.vhost,
            "arguments": self.arguments,
            "incarnation": self.incarnation,
            "policy": self.policy,
        }


def member_row_put(group: str, stable: str, node: str, dst: str) -> dict:
    """The registry op that records member ``stable``'s address ``dst``."""
    return {
        "op": "put",
        "table": MEMBER_TABLE,
        "key": [group, stable],
        "record": {"group": group, "member": stable, "node": node, "dst": dst},
    }


def _text(sender: Any) -> str:
    return address_key(sender) if sender is not None else ""
