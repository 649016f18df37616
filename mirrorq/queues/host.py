"""The queue host: one actor process running many queue replicas.

A node runs a small, fixed number of queue hosts (``queue_hosts`` in the
node's config, default its number of cores), created by its queue manager;
each queue's replica on the node lives in host ``stable_hash(vhost, name) %
queue_hosts`` (:func:`host_index`).  The replica stays the unit of the
design -- its own GM member, its own store, its own promotion -- only its
process is shared (:class:`~mirrorq.classic.actor.HostedReplica`).

Protocol
--------
*Routing.*  A replica is named by its GM member name ``node/host:port/uid``
(``host:port`` is the host's).  A message posted to that name arrives as
:class:`~mirrorq.node.posting.ToReplica` and goes to that replica; a GM
frame goes to the member it names (``GMFrame.dst``); a registry answer goes
to the replica whose request it answers (the host stamps every registry
request of a replica with ``ref = (REF_TAG, slot id, the replica's own ref)``,
the agent echoes it, the host hands the replica its own ref back);
``gm_group`` changes go to the replicas of the group they change (the host
subscribes once for all its replicas); node events and actor deaths go to
every replica.  A client request (it names a channel) for a replica that is
not here any more is answered ``NotMaster(master=None)``, so the channel
looks the master up again; anything else for it is dropped, as Thespian
drops what is sent to an actor that exited.

*Turns.*  One Thespian message handled is one turn for every replica it
touched: at its end each of them frames its GM broadcasts and flushes its
store (:meth:`HostedReplica.end_turn`), then everything posted in the turn
leaves, one bundle per destination actor whatever the number of replicas
(:class:`~mirrorq.node.posting.PostingActor`): the GM frames, sync batches
and registry requests of all the host's queues toward one peer travel
together.  Replicas the turn did not touch cost nothing.

*Timers.*  Replicas' timers live in one heap; the host keeps one Thespian
wakeup armed, for the earliest.  Timers of half a second or more fall on
a grid (:data:`TIMER_GRIDS`: 0.1 s, and 0.5 s for 2 s or more), so the
heartbeats and retries of many replicas fire in one turn and leave as one
bundle per peer host: an idle quorum queue's 2 s heartbeats cost each pair
of hosts two bundles a second, whatever the number of queues.  Idle
classic replicas arm no timers (GM ticks only while a broadcast is
outstanding); an idle quorum queue's leader heartbeats its followers every
2 s (:data:`mirrorq.quorum.hosted.RAFT_OPTIONS`).

*Group fsync.*  A replica does not fsync its store itself: at the end of
its turn it hands its writes to the OS (a quorum member's Raft log:
``FileRaftLog.write_out``; a classic replica's segments:
``BackingQueue.flush_turn(sync_later)``) and the host makes every such
file of the turn durable at once
(:func:`~mirrorq.store.group_sync.sync_files`: one ``syncfs`` per
filesystem instead of one fsync per replica).  A replica's posts are held
by its :class:`ReplicaPort` until then: they leave after the sync, or
never, if the sync of one of its files failed (it is stopped as crashed:
its GM frames and Raft acks would claim writes that may not be on disk).
A replica that asked to be told (``then``) is told once its files are
synced, still within the turn, and what it posts then leaves with the rest
(if that wrote again, another sync round follows).  Posts a replica makes
with ``post_early`` -- a quorum leader's ``AppendEntries``, which depend on
no write of the turn (:mod:`mirrorq.mnesia_like.raft`) -- are not held:
the host transmits them before it syncs (:meth:`PostingActor.transmit_now`:
only to their peer hosts, to which the host itself posts nothing that
waits for a sync), so a follower's fsync overlaps the leader's.

*Paused (pause_minority).*  While its node is in a minority of the
cluster, or its agent's majority lease has lapsed (:mod:`mirrorq.node.lease`,
read with a fresh monotonic time at the start of every message handled, so
a host resumed after a stop acts on it before anything else), the host
serves no client:
every client request for its replicas (publishes, consumes, gets, acks,
commands) waits, in order, up to :data:`MAX_PAUSED_REQUESTS`; one past that
is answered ``NotMaster`` (nothing of it done; the channel waits for the
queue's record to name a master).  So no master here confirms or delivers
in answer to a client while the majority may be promoting a mirror
elsewhere.  When the node hears a majority again, a classic replica's
waiting requests, and those that come meanwhile for it or for any replica
that was master when the host paused, wait on until a
linearizable read of its queue record (through the Raft leader) says
whether it is still the master: then they are handed on in the order they
came; if the majority replaced it they are answered ``NotMaster`` (the
channel already sent, or will send, what they carried to the new master
when it learns of it).  A quorum member's are handed on at once: Raft
keeps a deposed leader from committing.  GM frames, sync and registry
traffic go on while paused: they are how the node rejoins.

*Crash isolation.*  An exception raised by one replica's code (a diverged
mirror, a bug) stops that replica only: logged with its traceback, its store
closed without a flush, the host proposes the group's view without it until
a view without it is installed (so the survivors promote or carry on), and
the manager hears :class:`~mirrorq.classic.actor.ReplicaExited`; the
converger then starts the queue's replica on this node again, which rejoins
and syncs.  The host's other replicas carry on.

Guarantees: a message posted to a replica reaches it in the order posted
(one sender: the outbox's order; the host hands a bundle's messages on in
order); no replica sees another's registry answers or frames.

Failure: the host process dying takes its replicas with it, like a node
losing their processes; its manager recreates the host and the queues'
recovery and placement bring the replicas back.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from thespian.actors import ActorExitRequest, PoisonMessage, WakeupMessage

from mirrorq.classic.actor import LEAVE_RETRY, HostedReplica
from mirrorq.gm.core import ProposeView
from mirrorq.gm.messages import GMFrame
from mirrorq.gm.shell import GM_TABLE, propose_txn
from mirrorq.node.addresses import address_text
from mirrorq.node.lease import LeaseReader
from mirrorq.node.log import NodeLog
from mirrorq.node.messages import (
    ActorDown,
    NodeEvent,
    RegistryChanges,
    RegistryGet,
    RegistryResult,
    RegistryRows,
    RegistrySubscribe,
    RegistryTxn,
    Subscribe,
)
from mirrorq.node.posting import PostingActor, ToReplica
from mirrorq.queues import messages as qm
from mirrorq.queues.control import (
    FrontEndAt,
    ReplicaExited,
    ReplicaInit,
    ReplicaStarted,
    ReplicaStartFailed,
    group_name,
    host_index,
)
from mirrorq.quorum.hosted import MEMBER_TABLE, HostedQuorum
from mirrorq.store.group_sync import sync_files

REF_TAG = "mirrorq.host"
#: client requests a paused host keeps for its replicas (beyond: NotMaster)
MAX_PAUSED_REQUESTS = 4096
#: (delay, grid): a timer of at least ``delay`` seconds fires on the first
#: multiple of ``grid`` seconds at or after its time (up to ``grid`` later);
#: shorter timers are exact.  A grid is at most a quarter of the delay.
TIMER_GRIDS = ((2.0, 0.5), (0.5, 0.1))
_TIMER = "mirrorq.host.timer"
_EVICT = "mirrorq.host.evict"
_RESUME = "mirrorq.host.resume"
#: seconds before a resumed host asks the leader again whether a replica is still master
RESUME_RETRY = 0.2


def fire_at(now: float, delay: float) -> float:
    """When a timer armed at ``now`` for ``delay`` seconds fires: long
    timers (heartbeats, elections, retries) on a shared grid
    (:data:`TIMER_GRIDS`), so many replicas' fire in the same turn and their
    messages to one peer leave as one bundle."""
    at = now + max(0.0, delay)
    grid = next((g for d, g in TIMER_GRIDS if delay >= d), None)
    return at if grid is None else math.ceil(at / grid) * grid


def default_hosts() -> int:
    return max(1, os.cpu_count() or 1)


@dataclass
class HostInit:
    data_dir: str
    node: str
    agent: Any
    manager: Any
    index: int = 0


@dataclass
class FailReplica:
    """Test-only, honoured when MIRRORQ_TEST_HOOKS=1 in the node's
    environment: posted to a replica, makes its code raise in its host (the
    crash isolation path)."""


@dataclass
class HostReady:
    """From a new queue host to its manager (which learns its TCP address)."""

    index: int


class ReplicaPort:
    """What one hosted replica (and its GM shell) sees of its host."""

    def __init__(self, host: QueueHost, sid: int, hold: bool = False) -> None:
        self.host = host
        self.sid = sid
        self.myAddress = host.myAddress
        self.log = host.log
        #: ``hold``: the replica's posts wait for the end of the turn, and
        #: leave only if the files it wrote in the turn were synced
        #: (:meth:`sync_at_end_of_turn`; a quorum member's Raft acks and
        #: confirms claim its log is on disk)
        self.held: list | None = [] if hold else None

    @property
    def now(self) -> float:
        return self.host.now

    @property
    def host_address(self) -> str:
        """This host's ``"host:port"`` (the middle of its replicas' names)."""
        return address_text(self.host.myAddress)

    @property
    def front_end(self) -> str | None:
        """The node's AMQP front end (where a master dead-letters), if known yet."""
        return self.host.front_end

    def post(self, dst: Any, msg: Any) -> None:
        if isinstance(msg, (Subscribe, RegistrySubscribe)):
            return  # the host subscribed once for all its replicas
        if isinstance(msg, (RegistryGet, RegistryTxn)):
            msg = replace(msg, ref=(REF_TAG, self.sid, msg.ref))
        if self.held is None:
            self.host.post(dst, msg)
            return
        if not self.held:
            self.host.holding[self.sid] = self
        self.held.append((dst, msg))

    send = post

    def answer(self, sender: Any, msg: Any) -> None:
        self.host.answer(sender, msg)

    def wakeupAfter(self, delay: Any, payload: Any = None) -> None:
        if hasattr(delay, "total_seconds"):
            delay = delay.total_seconds()
        self.host.timer(self.sid, float(delay), payload)

    def exit(self, reason: str) -> None:
        self.host.replica_gone(self.sid, reason)

    def sync_at_end_of_turn(self, *fds: int, then: Any = None) -> None:
        """What this replica wrote to ``fds`` must be durable before its posts
        of this turn leave: the host syncs them with the turn's other files,
        then calls ``then()`` (if given) before those posts leave."""
        mine = self.host.unsynced.setdefault(self.sid, [])
        mine.extend(fd for fd in fds if fd not in mine)
        if then is not None:
            self.host.after_sync[self.sid] = then

    def post_early(self, dst: Any, msg: Any) -> None:
        """Post ``msg`` to ``dst`` (another queue host's replica) to leave
        before this turn's sync: it depends on no write of the turn."""
        self.host.post(dst, msg)
        self.host.early.add(dst)


def _client_request(msg: Any) -> bool:
    """A channel's request to a queue (it names both)."""
    return hasattr(msg, "channel") and hasattr(msg, "queue")


class QueueHost(PostingActor):
    clock = staticmethod(time.time)  # the replicas' clock: message deadlines are wall-clock times
    fast_links = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.cfg: HostInit | None = None
        self.slots: dict[int, HostedReplica | HostedQuorum] = {}
        self.by_member: dict[str, int] = {}
        self.by_group: dict[str, set[int]] = {}
        self.next_sid = 0
        self.touched: set[int] = set()
        self.timers: list[tuple] = []
        self.timer_seq = 0
        self.wake_at: float | None = None
        self.evicting: dict[str, str] = {}  # member -> group: crashed replicas being removed from their views
        self.counters = {"misrouted": 0, "crashed": 0}
        self.front_end: str | None = None  # FrontEndAt
        self.unsynced: dict[int, list[int]] = {}  # sid -> files it wrote this turn, synced at the turn's end
        self.holding: dict[int, ReplicaPort] = {}  # sid -> its port, holding posts until the turn's sync
        self.after_sync: dict[int, Any] = {}  # sid -> what to call once its files of the turn are synced
        self.early: set[str] = set()  # replicas posted to early this turn (ReplicaPort.post_early)
        self.lease: LeaseReader | None = None
        self.paused = False
        #: client requests that came while paused: (member, request, sender, bundled), in order
        self.paused_requests: list[tuple[str, Any, Any, bool]] = []
        #: after a pause: a classic replica's requests, held until the Raft leader's
        #: copy of its queue record says whether it is still the master
        self.verifying: dict[str, list] = {}
        #: replicas the leader's record showed replaced while paused (until they stop)
        self.deposed: set[str] = set()

    @property
    def config(self) -> HostInit:
        """The host's :class:`HostInit` (every other message waits for it)."""
        if self.cfg is None:
            raise RuntimeError("queue host used before its HostInit")
        return self.cfg

    # ---- Thespian ------------------------------------------------------------------------
    def on_message(self, msg: Any, sender: Any) -> Any:
        if isinstance(msg, HostInit):
            self.cfg = msg
            self.log = NodeLog(msg.data_dir, msg.node, f"queue_host{msg.index}")
            self.post(msg.agent, Subscribe())
            self.post(msg.agent, RegistrySubscribe((GM_TABLE, MEMBER_TABLE)))
            self.post(msg.manager, HostReady(msg.index))
            self.lease = LeaseReader(msg.data_dir)
            return
        if self.cfg is None:
            return
        if self.lease is not None and self.lease.paused(time.monotonic()) != self.paused:
            self._pause_changed()  # a minority, or a lapse of the agent's lease: hold, then check
        if isinstance(msg, ToReplica):
            if (self.paused or msg.member in self.verifying) and _client_request(msg.msg):
                return self._hold_request(msg.member, msg.msg, sender)
            if msg.member in self.deposed and _client_request(msg.msg):
                if msg.member not in self.by_member:
                    self.deposed.discard(msg.member)  # gone now: answered as such below
                elif not isinstance(msg.msg, qm.Settle):
                    return self.answer(sender, qm.NotMaster(msg.msg.queue, None, msg.msg))
                else:
                    return None
            return self._to_replica(msg.member, msg.msg, sender)
        if isinstance(msg, FrontEndAt):
            self.front_end = msg.dst
            for r in self.slots.values():
                if isinstance(r, HostedReplica) and r.replica is not None:
                    r.replica.dead_letter_dst = msg.dst
            return
        if isinstance(msg, GMFrame):
            sid = self.by_member.get(msg.dst)
            if sid is None:
                self.counters["misrouted"] += 1
                return
            return self._deliver(sid, msg, sender)
        if isinstance(msg, (RegistryRows, RegistryResult)):
            ref = msg.ref
            if isinstance(ref, tuple) and len(ref) == 3 and ref[0] == REF_TAG and ref[1] in self.slots:
                return self._deliver(ref[1], replace(msg, ref=ref[2]), sender)
            if isinstance(ref, tuple) and len(ref) == 2 and ref[0] == _EVICT:
                return self._evict_answer(ref[1], msg)
            if isinstance(ref, tuple) and len(ref) == 2 and ref[0] == _RESUME and isinstance(msg, RegistryRows):
                return self._verified(ref[1], msg)
            return
        if isinstance(msg, WakeupMessage):
            if msg.payload == _TIMER:
                return self._timers_due()
            if isinstance(msg.payload, tuple) and msg.payload[0] == _RESUME:
                return self._verify(msg.payload[1]) if msg.payload[1] in self.verifying else None
            if isinstance(msg.payload, tuple) and msg.payload[0] == _EVICT:
                return self._evict(msg.payload[1])
            return
        if isinstance(msg, ReplicaInit):
            return self._start(msg, sender)
        if isinstance(msg, RegistryChanges):
            return self._changes(msg, sender)
        if isinstance(msg, (NodeEvent, ActorDown)):
            for sid in list(self.slots):
                self._deliver(sid, msg, sender)
            return
        if isinstance(msg, ActorExitRequest):
            for sid in list(self.slots):
                self._guard(sid, lambda r: r.stop("host stopping"))
            return
        if isinstance(msg, PoisonMessage):
            self.log("poison_message", level="warning", message=repr(msg.poisonMessage)[:200])

    def end_turn(self) -> None:
        touched, self.touched = self.touched, set()
        for sid in touched:
            if sid in self.slots:
                self._guard(sid, lambda r: r.end_turn())
        if self.early:  # quorum leaders' appends: on their way before the sync
            early, self.early = self.early, set()
            self.transmit_now(early)
        while self.unsynced:  # group fsync, before the posts that depend on it
            files, self.unsynced = self.unsynced, {}
            failed = sync_files({(sid, fd): fd for sid, fds in files.items() if sid in self.slots for fd in fds})
            crashed = {sid: e for (sid, _), e in failed.items()}
            for sid, e in crashed.items():
                self._crash(sid, e)
            then, self.after_sync = self.after_sync, {}
            for sid, fn in then.items():
                if sid in self.slots and sid not in crashed:
                    self._guard(sid, lambda r, fn=fn: fn())
            # (what they wrote then is synced in another round: a lone voter's commit proposing again)
        self.early.clear()  # posted after the sync: they leave with the rest
        holding, self.holding = self.holding, {}
        for port in holding.values():
            self._release(port)

    def _release(self, port: ReplicaPort, keep_holding: bool = True) -> None:
        """The posts ``port`` held this turn leave (in the order posted)."""
        held, port.held = port.held, ([] if keep_holding else None)
        for dst, msg in held or ():
            self.post(dst, msg)

    def outbox_gave_up(self, dst: str) -> None:
        def gone() -> None:
            for sid in list(self.slots):
                self._deliver_call(sid, lambda r: r.dst_down(dst))

        self.as_turn(gone)

    # ---- replicas ----------------------------------------------------------------------------
    def _start(self, msg: ReplicaInit, sender: Any) -> None:
        self.next_sid += 1
        sid = self.next_sid
        port = ReplicaPort(self, sid, hold=True)
        r = HostedQuorum(port) if msg.quorum else HostedReplica(port)
        self.slots[sid] = r
        self.touched.add(sid)
        key = (msg.spec.get("vhost", "/"), msg.spec.get("name"))
        try:
            member = r.init(msg)
        except Exception as e:
            self._crash(sid, e)
            self.post(sender, ReplicaStartFailed(msg.token, key, f"{type(e).__name__}: {e}"))
            return
        if member is None:  # a corrupt store, reported
            self.slots.pop(sid, None)
            self.post(sender, ReplicaStartFailed(msg.token, key, "its store is corrupt (reported)"))
            return
        self.by_member[member] = sid
        group = _group_of(r)
        assert group is not None  # init made its GM shell (a quorum member: its group)
        self.by_group.setdefault(group, set()).add(sid)
        self.post(sender, ReplicaStarted(member, msg.node, msg.token))

    # ---- pause_minority ------------------------------------------------------------------------
    def _pause_changed(self) -> None:
        self.paused = not self.paused
        if self.paused:
            self.log(
                "host_paused",
                level="warning",
                replicas=len(self.slots),
                why=self.lease.state(time.monotonic()) if self.lease is not None else None,
            )
            return
        waiting, self.paused_requests = self.paused_requests, []
        self.log("host_resumed", requests=len(waiting))
        by_member: dict[str, list] = {}
        for item in waiting:
            by_member.setdefault(item[0], []).append(item)
        for r in self.slots.values():
            if isinstance(r, HostedReplica) and r.spec is not None and r.replica is not None and r.replica.is_master:
                by_member.setdefault(r.replica.member, [])
        for member, items in by_member.items():
            sid = self.by_member.get(member)
            slot = self.slots.get(sid) if sid is not None else None
            if isinstance(slot, HostedReplica) and slot.spec is not None:
                # a classic master the majority may have replaced meanwhile: ask the leader first
                self.verifying[member] = items
                self._verify(member)
            else:
                self._hand_on(items)  # gone (answered as such), or a quorum member (Raft decides)

    def _verify(self, member: str) -> None:
        r = self.slots.get(self.by_member.get(member, -1))
        if r is None or r.spec is None:
            self._hand_on(self.verifying.pop(member, []))
            return
        self.post(
            self.config.agent,
            RegistryGet("amqqueue", [r.spec.vhost, r.spec.name], linearizable=True, ref=(_RESUME, member)),
        )

    def _verified(self, member: str, msg: RegistryRows) -> None:
        items = self.verifying.get(member)
        if items is None:
            return
        if not msg.ok:  # no leader yet: ask again
            self.wakeupAfter(RESUME_RETRY, payload=(_RESUME, member))
            return
        del self.verifying[member]
        master = msg.rows[0].get("pid") if msg.rows else None
        sid = self.by_member.get(member)
        if sid is None or master == member:
            if sid is not None:
                spec = self.slots[sid].spec
                assert spec is not None  # verifying holds classic replicas that have one (_pause_changed)
                self.log("master_confirmed", queue=spec.name, member=member, requests=len(items))
            self._hand_on(items)  # to the master, or answered as for a replica that is gone
            return
        # replaced while paused: it serves no client until it learns so and stops
        self.deposed.add(member)
        self.log("held_requests_dropped", member=member, requests=len(items), master=master)

        def refuse(_member: str, inner: Any, sender: Any) -> None:
            if not isinstance(inner, qm.Settle):
                self.answer(sender, qm.NotMaster(inner.queue, master, inner))

        self._each_as_it_came(items, refuse)

    def _hand_on(self, items: list) -> None:
        self._each_as_it_came(items, self._to_replica)

    def _each_as_it_came(self, items: list, fn: Any) -> None:
        """``fn(member, request, sender)`` for held requests, each answered the
        way it came (posted or sent: ``bundled``)."""
        bundled = self.bundled
        try:
            for member, inner, sender, self.bundled in items:
                fn(member, inner, sender)
        finally:
            self.bundled = bundled

    def _hold_request(self, member: str, inner: Any, sender: Any) -> None:
        held = self.verifying.get(member, self.paused_requests)
        if len(held) < MAX_PAUSED_REQUESTS:
            held.append((member, inner, sender, self.bundled))
        elif not isinstance(inner, qm.Settle):
            self.answer(sender, qm.NotMaster(inner.queue, None, inner))

    def _to_replica(self, member: str, inner: Any, sender: Any) -> None:
        sid = self.by_member.get(member)
        if sid is not None and isinstance(inner, FailReplica):
            if os.environ.get("MIRRORQ_TEST_HOOKS") == "1":
                self._deliver_call(sid, _fail)
            return
        if sid is not None:
            return self._deliver(sid, inner, sender)
        self.counters["misrouted"] += 1
        if _client_request(inner) and not isinstance(inner, qm.Settle):
            # a client request for a replica that is gone: look the master up again
            self.answer(sender, qm.NotMaster(inner.queue, None, inner))

    def _deliver(self, sid: int, msg: Any, sender: Any) -> None:
        self._deliver_call(sid, lambda r: r.on_message(msg, sender))

    def _deliver_call(self, sid: int, fn: Any) -> None:
        if sid in self.slots:
            self.touched.add(sid)
            self._guard(sid, fn)

    def _guard(self, sid: int, fn: Any) -> None:
        """Run ``fn(replica)``; an exception stops that replica only."""
        r = self.slots.get(sid)
        if r is None:
            return
        try:
            fn(r)
        except Exception as e:
            self._crash(sid, e)

    def _changes(self, msg: RegistryChanges, sender: Any) -> None:
        if msg.changes is None:  # a registry snapshot reset: every replica reads its view again
            for sid in list(self.slots):
                self._deliver(sid, msg, sender)
            return
        per: dict[int, list] = {}
        for change in msg.changes:
            table, key = change[0], change[1]
            if table == MEMBER_TABLE and isinstance(key, (list, tuple)) and len(key) == 2:
                k = key[0]  # (group, member): for the group's members here
            elif table == GM_TABLE:
                k = key[0] if isinstance(key, (list, tuple)) and len(key) == 1 else key
            else:
                continue
            for sid in self.by_group.get(k, ()):
                per.setdefault(sid, []).append(change)
        for sid, changes in per.items():
            self._deliver(sid, RegistryChanges(changes), sender)

    def replica_gone(self, sid: int, reason: str) -> None:
        """A replica left the host (exited, deleted, stopped, crashed)."""
        r = self.slots.pop(sid, None)
        if r is None:
            return
        self.touched.discard(sid)
        self.unsynced.pop(sid, None)  # a replica that stops flushes its log itself
        port = self.holding.pop(sid, None)
        if port is not None:
            self._release(port, keep_holding=False)  # its last answers (a crash dropped them already)
        if r.member is not None:
            self.by_member.pop(r.member, None)
        group = _group_of(r)
        if group is not None:
            g = self.by_group.get(group)
            if g is not None:
                g.discard(sid)
                if not g:
                    del self.by_group[group]
        key = (r.spec.vhost, r.spec.name) if r.spec is not None else ("", "")
        self.log("replica_exited", queue=list(key), member=r.member, reason=reason)
        if r.member is not None:
            self.post(self.config.manager, ReplicaExited(r.member, key, reason))

    def _crash(self, sid: int, exc: BaseException) -> None:
        import traceback

        r = self.slots.get(sid)
        if r is None:
            return
        self.counters["crashed"] += 1
        self.unsynced.pop(sid, None)
        port = self.holding.pop(sid, None)
        if port is not None:
            port.held = []  # what it posted this turn never leaves: it may claim writes that are not durable
        text = "".join(traceback.format_exception(exc))
        self.log(
            "replica_crashed",
            level="error",
            queue=[r.spec.vhost, r.spec.name] if r.spec else None,
            member=r.member,
            error=f"{type(exc).__name__}: {exc}",
            traceback=text[-4000:],
        )
        try:
            if isinstance(r, HostedQuorum):
                r.log.close()  # unflushed writes are lost, as in a crash; Raft brings it up to date
            elif r.replica is not None and not r.replica.bq.log.closed:
                r.replica.bq.close(flush=False)
        except Exception:
            pass
        r._closed = True
        if r.member is not None and isinstance(r, HostedReplica) and r.shell is not None:
            self.evicting[r.member] = r.shell.group
            self._evict(r.member)
        self.replica_gone(sid, f"crashed: {type(exc).__name__}: {exc}")

    # ---- removing a crashed replica from its group's view ------------------------------------
    def _evict(self, member: str) -> None:
        group = self.evicting.get(member)
        if group is not None:
            self.post(self.config.agent, RegistryGet(GM_TABLE, group, ref=(_EVICT, member)))

    def _evict_answer(self, member: str, msg: Any) -> None:
        group = self.evicting.get(member)
        if group is None or not isinstance(msg, RegistryRows):
            return  # a proposal's result: the next read tells
        rows = msg.rows if msg.ok else None
        if rows is not None and (not rows or member not in rows[0].get("members", ())):
            del self.evicting[member]  # out of the view (or the group is gone)
            return
        if rows:
            row = rows[0]
            rest = tuple(m for m in row["members"] if m != member)
            if rest:
                self.post(
                    self.config.agent,
                    RegistryTxn(propose_txn(group, ProposeView(int(row["version"]), rest)), ref=(_EVICT, member)),
                )
            else:
                del self.evicting[member]  # it was the only member: the queue is down until recovery
                return
        self.wakeupAfter(LEAVE_RETRY, payload=(_EVICT, member))

    # ---- timers -------------------------------------------------------------------------------
    def timer(self, sid: int, delay: float, payload: Any) -> None:
        at = fire_at(self.now, delay)
        self.timer_seq += 1
        heapq.heappush(self.timers, (at, self.timer_seq, sid, payload, delay))
        if self.wake_at is None or at < self.wake_at:
            self.wake_at = at
            self.wakeupAfter(max(0.0, at - time.time()), payload=_TIMER)

    def _timers_due(self) -> None:
        """Fire the timers due by this turn's ``now``; timers they arm wait
        for a later turn (a core sees time move between its timers, as with
        one Thespian wakeup each)."""
        now = self.now
        if self.wake_at is not None and self.wake_at <= now + 0.001:
            self.wake_at = None
        due = []
        while self.timers and self.timers[0][0] <= now + 0.001:
            due.append(heapq.heappop(self.timers))
        for _at, _seq, sid, payload, delay in due:
            if sid in self.slots:
                self._deliver(sid, WakeupMessage(delay, payload), None)
        if self.timers and (self.wake_at is None or self.timers[0][0] < self.wake_at):
            self.wake_at = self.timers[0][0]
            self.wakeupAfter(max(0.0, self.wake_at - time.time()), payload=_TIMER)


def _group_of(r: HostedReplica | HostedQuorum) -> str | None:
    """The registry group whose changes go to replica ``r``: its GM group, or
    its quorum queue's group."""
    if isinstance(r, HostedQuorum):
        return r.group
    return r.shell.group if r.shell is not None else None


def _fail(replica: HostedReplica) -> None:
    raise RuntimeError(f"FailReplica (test hook) for {replica.member}")


__all__ = [
    "FailReplica",
    "HostInit",
    "HostReady",
    "QueueHost",
    "ReplicaPort",
    "default_hosts",
    "host_index",
    "group_name",
]
