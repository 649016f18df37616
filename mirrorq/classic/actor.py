"""A hosted queue replica: the shell around one QueueReplica inside a queue host.

A node runs its queue replicas (masters and mirrors) in a few queue-host
actors (:mod:`mirrorq.queues.host`); each replica is a
:class:`HostedReplica`: the queue's GM member and queue behaviour
(:class:`~mirrorq.classic.replica.QueueReplica`) behind the GM shell
(:class:`~mirrorq.gm.shell.GMShell`), which carries GM frames, timers, views
(registry ``gm_group``) and node deaths.  The replica only translates:

* its name is its GM member name ``node/host:port/uid`` (``host:port`` is
  its host's); whatever is posted to that name reaches it through its host
  (:class:`~mirrorq.node.posting.ToReplica`), so channels, mirrors and
  managers address a replica, never a process;
* one turn of the host is one Thespian message: the channel and sync
  messages it brings this replica go to ``replica.receive_many`` at once
  (the master broadcasts what they did as one GM payload); at the end of
  the turn GM's buffered broadcasts are framed, the store is written and
  the files owing an fsync handed to the host, which syncs every
  replica's of the turn at once (durable before forwarded; see
  :mod:`mirrorq.queues.host`, *Group fsync*), and only then do
  the turn's posts leave, one bundle per destination actor for all
  the host's replicas (the flush is the core's ``Persist`` action at the end
  of its turn, :mod:`mirrorq.sansio`, as in the simulator);
* one clock per turn: the host's ``now`` (wall-clock seconds, since message
  deadlines are stored in the log and replicated), handed to every entry
  point of the replica, GM shell included;
* no ghost consumers: when a node dies the master probes every front end
  its channels live on; a front end the host's outbox gives up on
  (transmits refused: nothing listens there) takes its channels with it --
  consumers removed, unacked messages requeued -- as a closed channel does;
* the ``amqqueue`` record is kept by the master with the record upkeep
  (:mod:`mirrorq.queues.record_upkeep`): after a promotion, every view
  change and every sync the shell tells it what the record should say
  (``pid``, ``slave_pids``, ``sync_slave_pids``, ``gm_pids``, ``state``;
  the whole row, with the declare's policy, for when there is none),
  fenced by the master's GM view version (a deposed master's late write is
  refused); it reads the row and writes what differs, re-reading on its
  timer (one wakeup chain, a generation per timer) until the registry
  shows it.  A replica that is no longer master, stopped or handing over
  releases it; a refused write is logged (``record_write_refused``).

The replica's store lives in ``<data_dir>/queues/<vhost>/<name>`` (names
percent-encoded), so a restarted node finds it again.
"""

from __future__ import annotations

import os
import shutil
import urllib.parse
from dataclasses import dataclass
from typing import Any

from thespian.actors import WakeupMessage

from mirrorq.classic import amqqueue as aq
from mirrorq.classic import confirm_probe, sync
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.classic.coordinator import Coordinator, SyncState
from mirrorq.classic.replica import (
    HandingOver,
    HandOverRefused,
    MasterKnown,
    Promoted,
    QueueDown,
    QueueGone,
    QueueReplica,
    QueueSpec,
    ReplicaStopped,
)
from mirrorq.gm.core import ProposeView
from mirrorq.gm.shell import TURN_MEMBER_DEFAULTS, GMCallbacks, GMShell, parse_member_name, propose_txn
from mirrorq.node.addresses import address_from_text
from mirrorq.node.messages import NodeEvent, RegistryTxn
from mirrorq.queues import messages as qm
from mirrorq.queues import record_upkeep
from mirrorq.queues.control import (
    ExitReplica,
    FoundGroup,
    MasterHandOver,
    ReplicaInit,
    SetPolicy,
    StopReplica,
    group_name,
)
from mirrorq.store import corruption
from mirrorq.store.segment_log import CorruptRecord

GM_OPTIONS = dict(TURN_MEMBER_DEFAULTS)
_RECORD = "mirrorq.record"  # the wakeup payload tag of the record upkeep's retry timer
EXIT_DELAY = 1.0
LEAVE_RETRY = 0.3  # a leaving replica proposes the view without itself this often until it is out


@dataclass
class ReplicaInfoQuery:
    pass


@dataclass
class ReplicaInfo:
    info: dict


def queue_dir(data_dir: str, vhost: str, name: str, durable: bool = True) -> str:
    """Where a queue's replica keeps its log: under ``queues`` for a durable
    queue, under :data:`TRANSIENT_DIR` (wiped when the node starts, and when
    the replica opens) for a non-durable one."""
    q = lambda s: urllib.parse.quote(s, safe="")  # noqa: E731
    return os.path.join(data_dir, "queues" if durable else TRANSIENT_DIR, q(vhost), q(name))


TRANSIENT_DIR = "transient"  # non-durable queues' logs: paged out, never fsync'd, never recovered


address_of = address_from_text  # a channel's or replica's dst ("host:port") as a Thespian address

#: what goes to the replica core (batched per turn: ``receive_many``)
QUEUE_MESSAGES = (
    qm.Publish,
    qm.Consume,
    qm.Cancel,
    qm.Settle,
    qm.Get,
    qm.ChannelClosed,
    qm.QueueCommand,
    sync.SyncRequest,
    sync.SyncAck,
    sync.SyncDone,
    sync.SyncStart,
    sync.SyncBatch,
    sync.SyncRetry,
    sync.SyncWait,
    sync.SyncInvite,
    sync.SyncCancelled,
    confirm_probe.ProgressQuery,
    confirm_probe.Progress,
    qm.DeadLetterDone,
)


class HostedReplica(GMCallbacks):
    """One queue replica inside a queue host: its GM shell, its queue core
    and its store.  ``port`` is what it sees of the host (a
    :class:`~mirrorq.queues.host.ReplicaPort`: ``post``, ``send``,
    ``answer``, ``wakeupAfter``, ``myAddress``, ``now``, ``exit``)."""

    def __init__(self, port: Any) -> None:
        self.port = port
        self.shell: GMShell | None = None
        self.replica: QueueReplica | None = None
        self.spec: QueueSpec | None = None
        self.policy_name: str | None = None  # ReplicaInit.policy_name
        self.member: str | None = None
        self.upkeep: record_upkeep.RecordUpkeep | None = None  # the amqqueue record's (made when first kept)
        self._record_driver = record_upkeep.UpkeepDriver(
            self.post, lambda delay, token: self.wakeupAfter(delay, payload=(_RECORD, token))
        )
        self._batch: list = []
        self._leaving = False
        self._closed = False

    # the parts :meth:`init` makes: every message but the first comes after it
    @property
    def rep(self) -> QueueReplica:
        """The queue core (made by :meth:`init`)."""
        if self.replica is None:
            raise RuntimeError("the hosted replica has no queue core yet: ReplicaInit not handled")
        return self.replica

    @property
    def qspec(self) -> QueueSpec:
        """The queue's spec (set by :meth:`init`)."""
        if self.spec is None:
            raise RuntimeError("the hosted replica has no queue spec yet: ReplicaInit not handled")
        return self.spec

    @property
    def gm(self) -> GMShell:
        """The GM shell (made by :meth:`init`)."""
        if self.shell is None:
            raise RuntimeError("the hosted replica has no GM shell yet: ReplicaInit not handled")
        return self.shell

    # the host's services, under the names the shell code below uses
    @property
    def now(self) -> float:
        return self.port.now

    def post(self, dst: Any, msg: Any) -> None:
        self.port.post(dst, msg)

    def wakeupAfter(self, delay: float, payload: Any = None) -> None:
        self.port.wakeupAfter(delay, payload)

    # ---- input (the host routes a message here) -------------------------------------------
    def on_message(self, msg, sender):
        if self.shell is None or self._closed:
            return
        if isinstance(msg, WakeupMessage) and msg.payload == "exit":
            return self.stop("exited")
        if isinstance(msg, QUEUE_MESSAGES):
            self._batch.append(msg)  # handled together (receive_many), in order with the rest
            return
        self._run_batch()
        if isinstance(msg, WakeupMessage) and isinstance(msg.payload, tuple) and msg.payload[:1] == (_RECORD,):
            return self._record_wakeup(msg.payload)
        if isinstance(msg, WakeupMessage) and msg.payload == "leave":
            return self._leave()
        if record_upkeep.is_answer(msg):
            return self._record(lambda up: up.receive(self.now, "agent", msg))
        if self.shell.handle(msg, sender):
            return
        if isinstance(msg, NodeEvent) and msg.kind in ("down", "up") and self.rep.is_master:
            # a node died: are the front ends our channels live on still there?
            # (a refused transmit gives them up: dst_down); a node came back
            # (after a partition): which of our channels there are still open?
            master = self.rep.behaviour
            assert isinstance(master, Coordinator)  # is_master: the behaviour is the master's
            for dst in master.channel_dsts():
                self.post(dst, qm.FrontEndProbe(self.rep.member))
            return
        if isinstance(msg, qm.FrontEndChannels):
            if self.rep.is_master and not self._closed:
                self.gm.run(self.rep.channels_live(self.now, msg.dst, msg.keys))
            return
        now = self.now
        if isinstance(msg, FoundGroup):
            self.shell.create(msg.founders)
        elif isinstance(msg, ReplicaInfoQuery):
            self.port.answer(sender, ReplicaInfo(self.rep.info()))
        elif isinstance(msg, SetPolicy):
            self.gm.run(self.rep.set_policy(now, msg.definition))
        elif isinstance(msg, StopReplica):
            self._leave()
        elif isinstance(msg, MasterHandOver):
            self._hand_over(now, msg.node)
        elif isinstance(msg, ExitReplica):
            self.stop("exit requested")

    def _run_batch(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.gm.run(self.rep.receive_many(self.now, batch))

    def dst_down(self, dst: str) -> None:
        """Nothing listens at ``dst`` any more: if channels of ours lived there
        (a front end whose node or process died), they are gone."""
        if self.replica is not None and self.shell is not None and self.replica.is_master and not self._closed:
            self.shell.run(self.replica.dst_down(self.now, dst))

    def end_turn(self) -> None:
        """Frames of the turn are posted, then the store made durable; the
        posts leave after the host's turn ends (durable before forwarded)."""
        if self.shell is None or self._closed:
            return
        self._run_batch()
        self.shell.end_turn()  # ends with the core's Persist: the store is flushed before the host's posts leave

    def stop(self, reason: str, graceful: bool = True) -> None:
        """Close the store and leave the host (a master says it leaves
        gracefully first, unless the replica failed)."""
        if self._closed:
            return
        if self.replica is not None and not self.replica.bq.log.closed:
            try:
                if graceful and self.shell is not None:
                    self._run_batch()
                    self.shell.run(self.replica.shutdown(self.now))
                    self.shell.end_turn()
            finally:
                self.replica.bq.close(flush=graceful)
        self._closed = True
        self.port.exit(reason)

    def init(self, msg: ReplicaInit) -> str | None:
        """Open the store and start the GM member; its name, or None if the
        store is corrupt and cannot be used (reported)."""
        spec = QueueSpec(**msg.spec)
        self.spec = spec
        self.policy_name = msg.policy_name
        self.node = msg.node
        self.agent = msg.agent
        self.log = self.port.log
        directory = queue_dir(msg.data_dir, spec.vhost, spec.name, spec.durable)

        def open_bq(fresh: bool = False) -> BackingQueue:
            if (fresh or not spec.durable) and os.path.isdir(directory):
                shutil.rmtree(directory)
            return BackingQueue(
                directory,
                durable=spec.durable,
                fsync=spec.durable,
                max_priority=int(spec.arguments.get("x-max-priority") or 0),
            )

        try:
            bq = open_bq(msg.fresh)
        except CorruptRecord as e:  # reported, quarantined; a joining mirror resyncs (corruption.py)
            if not corruption.handle(
                e,
                directory=directory,
                vhost=spec.vhost,
                name=spec.name,
                node=msg.node,
                joining=msg.join,
                log=self.log,
                send_txn=lambda t: self.post(msg.agent, RegistryTxn(t)),
            ):
                return None
            bq = open_bq(True)
        if spec.durable and msg.recover:
            bq.drop_transient()  # a durable queue coming back keeps its persistent messages only
            bq.flush()

        def core(name: str) -> QueueReplica:
            self.member = name
            # the replica's dst is its member name: posts to it reach it through its host (ToReplica)
            self.replica = QueueReplica(
                name,
                name,
                spec,
                bq,
                master=None,
                now=self.now,
                gm_options=GM_OPTIONS,
                joining=msg.join,
                bq_factory=open_bq,
                policy=msg.policy,
                log=self.log,
            )
            self.replica.dead_letter_dst = getattr(self.port, "front_end", None)
            return self.replica

        self.shell = GMShell(
            self.port,
            group_name(spec.vhost, spec.name),
            self,
            agent=msg.agent,
            node=msg.node,
            core_factory=core,
            clock=lambda: self.now,
        )
        # durable before forwarded: the store is flushed once per turn (end_turn),
        # and its fsync is the host's, with the turn's other replicas' files
        self.rep.defer_flush = True
        self.rep.sync_later = lambda fds: self.port.sync_at_end_of_turn(*fds)
        # a declare's founder (not a joiner, not a recovery): its group's row
        # comes after every founder started, by the host's subscription
        self.shell.start(read_row=msg.join or msg.recover)
        if msg.join:
            self.shell.join()
        self.log("replica_started", queue=spec.name, member=self.shell.name, messages=bq.message_count, join=msg.join)
        return self.shell.name

    def _deleted(self, ev) -> None:
        """The queue is gone: the master removes its records; every replica
        drops its store and exits."""
        s = self.qspec
        self.log("queue_deleted", queue=s.name, reason=ev.reason, role=self.rep.behaviour.role)
        if isinstance(ev, aq.QueueDeleted):
            self.post(
                self.agent,
                RegistryTxn(
                    {
                        "ops": [
                            {"op": "delete", "table": "amqqueue", "key": [s.vhost, s.name]},
                            {"op": "delete", "table": "gm_group", "key": [self.gm.group]},
                            # the declare's claim on the name (kept while the queue lives): the name is free again
                            {"op": "delete", "table": "queue_claim", "key": [s.vhost, s.name]},
                        ]
                    }
                ),
            )
        self._release_record()
        self.rep.stopped = True  # serves nothing more; its store goes now
        self.rep.bq.close(flush=False)
        directory = self.rep.bq.log.directory
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
        # leave the host a little later: the "deleted" broadcast and the
        # registry transaction are still on their way
        self.wakeupAfter(EXIT_DELAY, payload="exit")

    def _hand_over(self, now: float, node: str) -> None:
        view = self.gm.view
        on_node = []
        for m in view.members if view is not None else ():
            try:
                if parse_member_name(m).node == node:
                    on_node.append(m)
            except ValueError:
                continue
        synced = [m for m in on_node if m in self.rep.synced_members]
        target = (synced or on_node or [f"(no member on {node})"])[0]
        self.gm.run(self.rep.hand_over(now, target))

    def _leave(self) -> None:
        """Leave the group, then exit: propose the view without this replica
        and propose again, against whatever view is current, until one
        without it is installed.  (Exiting after one proposal left a member
        in the view for ever when two mirrors left at once -- a policy
        cleared -- and one proposal lost to the other: nobody removes a
        member whose node is up, and no round completed again.)"""
        if not self._leaving:
            self._leaving = True
            self.log("replica_leaving", queue=self.qspec.name, member=self.rep.member)
        view = self.gm.view
        if view is None or self.rep.member not in view or self.gm.removed:
            self.wakeupAfter(EXIT_DELAY, payload="exit")  # gone from the view: the last sends leave first
            return
        rest = tuple(m for m in view.members if m != self.rep.member)
        if not rest:
            self.wakeupAfter(EXIT_DELAY, payload="exit")
            return
        self.post(self.agent, RegistryTxn(propose_txn(self.gm.group, ProposeView(view.version, rest))))
        self.wakeupAfter(LEAVE_RETRY, payload="leave")

    # ---- GM shell host hooks -----------------------------------------------------------
    def gm_host_send(self, dst: Any, msg: Any) -> None:
        self.post(dst if isinstance(dst, str) else address_of(dst), msg)

    def gm_event(self, ev: Any) -> None:
        if isinstance(ev, Promoted):
            self.log("promoted", queue=self.qspec.name, member=ev.member)
            self._want_record()
        elif isinstance(ev, SyncState):
            self._want_record()
        elif isinstance(ev, (aq.QueueDeleted, QueueGone)):
            self._deleted(ev)
        elif isinstance(ev, QueueDown):
            self.log("queue_down", level="warning", queue=self.qspec.name, reason=ev.reason)
        elif isinstance(ev, MasterKnown):
            self.log("master_known", queue=self.qspec.name, master=ev.member)
        elif isinstance(ev, ReplicaStopped):
            self.log("replica_stopped", level="warning", queue=self.qspec.name, reason=ev.reason)
        elif isinstance(ev, HandingOver):
            # the view without us is proposed; the survivors elect the target
            self.log("master_handed_over", queue=self.qspec.name, member=self.rep.member, target=ev.target)
            self._release_record()
            self.wakeupAfter(EXIT_DELAY, payload="exit")
        elif isinstance(ev, HandOverRefused):
            pass  # the core logged why; placement asks again later

    # ---- the amqqueue record (kept by the master: mirrorq.queues.record_upkeep) ----------
    def gm_members_changed(self, view, births, deaths) -> None:
        if self.replica is not None and self.replica.is_master:
            self._want_record()

    def _keeps_record(self) -> bool:
        """Whether this replica keeps the record: a master, serving, not handing over."""
        rep = self.replica
        return rep is not None and rep.is_master and not rep.stopped and rep.handover is None

    def _wanted(self) -> record_upkeep.Wanted:
        """What the record should say: this master, its view's members in
        ring order (synchronised ones named), fenced by its view."""
        view = self.gm.view
        members = list(view.members) if view is not None else [self.rep.member]
        me = self.rep.member
        fields = {
            "pid": me,
            "slave_pids": [m for m in members if m != me],
            "sync_slave_pids": [m for m in members if m != me and m in self.rep.synced_members],
            "gm_pids": members,
            "state": "live",
        }
        s = self.qspec
        row = {
            "name": s.name,
            "vhost": s.vhost,
            "durable": s.durable,
            "auto_delete": s.auto_delete,
            "exclusive_owner": s.exclusive_owner,
            "arguments": dict(s.arguments),
            "incarnation": s.incarnation,
            **fields,
        }
        if self.policy_name is not None:
            row["policy"] = self.policy_name  # the declare's policy: no second write to name it
        fence = record_upkeep.ViewFence(self.gm.group, None if view is None else view.version)
        return record_upkeep.Wanted(fields, row, fence)

    def _want_record(self) -> None:
        """The record should change (a view change, a promotion, a sync): the
        upkeep reads it now and writes what differs."""
        if self._keeps_record():
            self._record(lambda up: up.keep(self.now, self._wanted()))

    def _release_record(self) -> None:
        if self.upkeep is not None:
            self._record_actions(self.upkeep.release(self.now))

    def _record_wakeup(self, payload: tuple) -> None:
        if self._record_driver.fired(payload[1]):
            self._record(lambda up: up.timer(self.now, record_upkeep.RETRY_TIMER))

    def _record(self, event) -> None:
        """Hand the upkeep an event while this replica keeps the record (else
        it is released) and carry out its actions."""
        if self.upkeep is None:
            self.upkeep = record_upkeep.RecordUpkeep(self.rep.member, self.agent, (self.qspec.vhost, self.qspec.name))
        if not self._keeps_record():
            return self._release_record()
        self._record_actions(event(self.upkeep))

    def _record_actions(self, actions: list) -> None:
        for ev in self._record_driver.carry_out(actions):
            if isinstance(ev, record_upkeep.WriteRefused):
                self.log("record_write_refused", level="info", queue=self.qspec.name, error=ev.error)
