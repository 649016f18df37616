"""The queue replica actor: the Thespian shell around a QueueReplica.

One actor per replica of a queue (master or mirror): one OS process that
hosts the queue's GM member and the queue behaviour
(:class:`~mirrorq.queue_process.replica.QueueReplica`), through the GM shell
(:class:`~mirrorq.gm.shell.GMShell`), which carries GM frames, timers, views
(registry ``gm_group``) and node deaths.  The actor only translates:

* channel messages (:mod:`.messages`) -> ``replica.receive``;
* the replica's sends to channels (``dst`` is ``"host:port"`` of the channel's
  actor or external system) -> ``self.send``;
* ``Promoted`` -> a registry transaction on ``amqqueue`` (pid, slave_pids,
  gm_pids), repeated until a read shows it applied.

The replica's store lives in ``<data_dir>/queues/<vhost>/<name>`` (names
percent-encoded), so a restarted node finds it again.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from thespian.actors import Actor, ActorExitRequest, WakeupMessage

from mirrorq.gm.shell import SHELL_MEMBER_DEFAULTS, GMCallbacks, GMShell, address_host_port, member_address
from mirrorq.node.log import NodeLog
from mirrorq.node.messages import RegistryGet, RegistryRows, RegistryTxn
from mirrorq.queue_process import messages as qm
from mirrorq.queue_process.backing_queue import BackingQueue
from mirrorq.queue_process.replica import MasterKnown, Promoted, QueueReplica, QueueSpec, ReplicaStopped
from mirrorq.sansio import Emit, Send

GM_OPTIONS = dict(SHELL_MEMBER_DEFAULTS)
RECORD_RETRY = 0.5


@dataclass
class ReplicaInit:
    spec: dict  # QueueSpec fields
    data_dir: str
    node: str
    agent: Any
    fresh: bool = False  # True: start with an empty store (a mirror that rejoins)
    token: int = 0  # echoed in ReplicaStarted


@dataclass
class ReplicaStarted:
    member: str
    node: str
    token: int = 0


@dataclass
class FoundGroup:
    """Sent to the first founder: create the group's gm_group row."""

    founders: tuple


@dataclass
class ReplicaInfoQuery:
    pass


@dataclass
class ReplicaInfo:
    info: dict


def queue_dir(data_dir: str, vhost: str, name: str) -> str:
    q = lambda s: urllib.parse.quote(s, safe="")  # noqa: E731
    return os.path.join(data_dir, "queues", q(vhost), q(name))


def group_name(vhost: str, name: str) -> str:
    return f"queue:{vhost}/{name}"


def address_of(dst: str) -> Any:
    """A channel's ``dst`` ("host:port") as a Thespian address."""
    host, _, port = dst.rpartition(":")
    return member_address(f"-/{host}:{port}/-")


class QueueReplicaActor(GMCallbacks, Actor):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.shell: GMShell | None = None
        self.replica: QueueReplica | None = None
        self._record_pending = False

    # ---- Thespian -------------------------------------------------------------------
    def receiveMessage(self, msg, sender):
        if isinstance(msg, ReplicaInit):
            return self._init(msg, sender)
        if self.shell is None:
            return
        if isinstance(msg, ActorExitRequest):
            if self.replica is not None:
                self.replica.bq.close()
            return
        if isinstance(msg, WakeupMessage) and msg.payload == "record":
            return self._check_record()
        if isinstance(msg, RegistryRows) and self._record_pending and not self.shell.handle(msg, sender):
            return self._record_rows(msg)
        if self.shell.handle(msg, sender):
            return
        if isinstance(msg, FoundGroup):
            self.shell.create(msg.founders)
        elif isinstance(msg, ReplicaInfoQuery):
            self.send(sender, ReplicaInfo(self.replica.info()))
        elif isinstance(msg, (qm.Publish, qm.Consume, qm.Cancel, qm.Settle, qm.Get, qm.ChannelClosed, qm.QueueCommand)):
            self.shell.run(self.replica.receive(time.time(), None, msg))

    def _init(self, msg: ReplicaInit, sender) -> None:
        spec = QueueSpec(**msg.spec)
        self.spec = spec
        self.node = msg.node
        self.agent = msg.agent
        self.log = NodeLog(msg.data_dir, msg.node, "queue")
        directory = queue_dir(msg.data_dir, spec.vhost, spec.name)
        if msg.fresh and os.path.isdir(directory):
            import shutil

            shutil.rmtree(directory)
        bq = BackingQueue(directory if spec.durable else None, durable=spec.durable)
        if not spec.durable:
            pass
        else:
            bq.drop_transient()  # a durable queue coming back keeps its persistent messages only
        host, port = _my_host_port(self)
        self.dst = f"{host}:{port}"

        def core(name: str) -> QueueReplica:
            self.replica = QueueReplica(name, self.dst, spec, bq, master=None, now=time.time(), gm_options=GM_OPTIONS)
            return self.replica

        self.shell = GMShell(self, group_name(spec.vhost, spec.name), self, agent=msg.agent, node=msg.node, core_factory=core)
        self.shell.start()
        self.log("replica_started", queue=spec.name, member=self.shell.name, messages=bq.message_count)
        self.send(sender, ReplicaStarted(self.shell.name, msg.node, msg.token))

    # ---- GM shell host hooks -----------------------------------------------------------
    def gm_host_send(self, dst: Any, msg: Any) -> None:
        self.send(address_of(dst), msg)

    def gm_event(self, ev: Any) -> None:
        if isinstance(ev, Promoted):
            self.log("promoted", queue=self.spec.name, member=ev.member)
            self._record_pending = True
            self._write_record()
        elif isinstance(ev, MasterKnown):
            self.log("master_known", queue=self.spec.name, master=ev.member)
        elif isinstance(ev, ReplicaStopped):
            self.log("replica_stopped", level="warning", queue=self.spec.name, reason=ev.reason)

    # ---- the amqqueue record ------------------------------------------------------------
    def _write_record(self) -> None:
        view = self.shell.view
        members = list(view.members) if view is not None else [self.replica.member]
        slaves = [m for m in members if m != self.replica.member]
        s = self.spec
        row = {
            "name": s.name,
            "vhost": s.vhost,
            "durable": s.durable,
            "auto_delete": s.auto_delete,
            "exclusive_owner": s.exclusive_owner,
            "arguments": dict(s.arguments),
            "pid": self.replica.member,
            "slave_pids": slaves,
            "sync_slave_pids": slaves,
            "gm_pids": members,
            "state": "live",
        }
        self.send(self.agent, RegistryTxn({"ops": [{"op": "put", "table": "amqqueue", "key": [s.vhost, s.name], "record": row}]}))
        self.wakeupAfter(RECORD_RETRY, payload="record")

    def _check_record(self) -> None:
        if self._record_pending:
            self.send(self.agent, RegistryGet("amqqueue", [self.spec.vhost, self.spec.name]))
            self.wakeupAfter(RECORD_RETRY, payload="record")

    def _record_rows(self, msg: RegistryRows) -> None:
        if msg.ok and msg.rows and msg.rows[0].get("pid") == self.replica.member:
            self._record_pending = False
        elif self.replica.is_master:
            self._write_record()


def _my_host_port(actor: Actor) -> tuple[str, int]:
    hp = address_host_port(actor.myAddress)
    if hp is None:
        raise ValueError(f"not a TCP actor address: {actor.myAddress!r}")
    return hp


def dst_of(address: Any) -> str:
    """The ``dst`` text ("host:port") of a Thespian TCP address (for channel ids)."""
    hp = address_host_port(address)
    if hp is None:
        raise ValueError(f"not a TCP actor address: {address!r}")
    return f"{hp[0]}:{hp[1]}"
