"""The queue manager actor: the Thespian shell around :class:`~.manager_core.QueueManagerCore`.

One per node, global name ``mirrorq.queue_manager`` (created by the node
daemon, initialised with :class:`ManagerInit`).  What the manager does --
declares, placement, recovery, queue commands, and what it guarantees -- is
the core's (:mod:`mirrorq.queues.manager_core`); this actor only
translates:

* *Addresses.*  The core names the node agent ``AGENT`` and the node's
  queue hosts ``mirrorq.queue_host#<index>``; the shell creates the hosts
  (its children, ``queue_hosts`` of them, default the number of cores),
  learns their TCP addresses from :class:`~.host.HostReady`, creates a host
  again when Thespian reports it exited (and tells the core,
  ``host_exited``), and fills the agent's address into the
  :class:`~.control.ReplicaInit` it hands a host.  A message from a
  mirrorq actor (it came in a bundle) has the sender's ``"host:port"`` as
  its ``src``, and the core's sends to such names -- peer managers, replicas
  by member name, channels -- are posted
  (:class:`~mirrorq.node.posting.PostingActor`).  A request asked from
  outside the node (a tool's ``ask``: :class:`DeclareQueue`,
  :class:`QueueOps`, :class:`QuorumMembers`, :class:`ManagerStatusQuery`) gets a one-time name the
  core answers to; that answer goes with a plain ``send``.
* *Time.*  One clock per turn: wall-clock seconds (``time.time``; the core's
  claim rows carry it and are compared across nodes).  ``SetTimer`` and
  ``CancelTimer`` go to a :class:`~mirrorq.node.timers.TimerTable`: one
  Thespian wakeup armed for the earliest deadline, none for a cancelled or
  replaced timer.
* *Logs.*  :class:`~.manager_core.ManagerLog` goes to the node's log
  (component ``queue_manager``).

Failure: a send the core asks for to a name that is no address (a malformed
member name in a record) is logged and dropped.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any

from thespian.actors import ActorSystemMessage, ChildActorExited, WakeupMessage

from mirrorq.node.addresses import address_host_port, address_key, address_text
from mirrorq.node.log import NodeLog
from mirrorq.node.posting import PostingActor
from mirrorq.node.timers import TimerTable
from mirrorq.queues.control import FrontEndAt, ReplicaInit
from mirrorq.queues.host import HostInit, HostReady, default_hosts
from mirrorq.queues.manager_core import (
    DeclareQueue,
    DeclareResult,
    ManagerLog,
    ManagerStatusQuery,
    QueueManagerCore,
    QueueOps,
    QueueOpsResult,
    QuorumMembers,
    QuorumMembersResult,
    StartReplica,
    StartReplicaDone,
)
from mirrorq.sansio import CancelTimer, Emit, Send, SetTimer

__all__ = [
    "DeclareQueue",
    "DeclareResult",
    "MANAGER_GLOBAL_NAME",
    "ManagerInit",
    "ManagerStatusQuery",
    "QueueManager",
    "QueueOps",
    "QueueOpsResult",
    "QuorumMembers",
    "QuorumMembersResult",
    "StartReplica",
    "StartReplicaDone",
]

MANAGER_GLOBAL_NAME = "mirrorq.queue_manager"
AGENT = "mirrorq.node_agent"  # the core's name for the node agent
_HOST = "mirrorq.queue_host#"  # + index: the core's names for the queue hosts
_ASK = "mirrorq.ask#"  # + n: a request asked from outside the node, until answered
_TIMER = "mirrorq.manager.timer"
#: requests from outside the node that the core answers (once)
_ASKED = (DeclareQueue, QueueOps, QuorumMembers, ManagerStatusQuery)


@dataclass
class ManagerInit:
    config: dict
    agent: Any


class QueueManager(PostingActor):
    clock = staticmethod(time.time)  # the core's clock (see the module docstring)

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.core: QueueManagerCore | None = None
        self.cfg: dict = {}
        self.agent: Any = None
        self.hosts: list = []  # the node's queue hosts (index: host_index)
        self.host_keys: dict[str, int] = {}  # a host's address key -> its index
        self.asks: dict[str, Any] = {}  # one-time name -> the address that asked
        self.next_ask = 0
        self.timers = TimerTable()  # the core's timer key -> deadline, behind one wakeup
        self.front_end: FrontEndAt | None = None  # where the node's masters dead-letter (for new hosts)

    def on_message(self, msg: Any, sender: Any) -> None:
        if isinstance(msg, ManagerInit):
            if self.core is None:
                self._init(msg)
            return
        if self.core is None:
            return
        if isinstance(msg, WakeupMessage):
            p = msg.payload
            if isinstance(p, tuple) and len(p) == 2 and p[0] == _TIMER:
                self.timers.fired(p[1])
                keys, at = self.timers.due(self.now)
                self._arm(at)
                for key in keys:
                    self._run(self.core.timer(self.now, key))
            return
        if isinstance(msg, FrontEndAt):
            self.front_end = msg
            for h in self.hosts:
                if h is not None:
                    self.post(h, msg)
            return
        if isinstance(msg, HostReady):
            if 0 <= msg.index < len(self.hosts) and address_host_port(sender):
                self.hosts[msg.index] = sender
                self.host_keys[address_key(sender)] = msg.index
            return
        if isinstance(msg, ChildActorExited):
            index = self.host_keys.pop(address_key(msg.childAddress), None)
            if index is not None:  # a queue host died: its replicas with it
                self._run(self.core.host_exited(self.now, index))
                self._create_host(index)
            return
        if isinstance(msg, ActorSystemMessage):
            return  # exit requests and the like: nothing for the core
        self._run(self.core.receive(self.now, self._src(msg, sender), msg))

    def _init(self, msg: ManagerInit) -> None:
        self.cfg, self.agent = msg.config, msg.agent
        node = self.cfg["name"]
        self.log = NodeLog(self.cfg["data_dir"], node, "queue_manager")
        n = int(self.cfg.get("queue_hosts") or default_hosts())
        self.hosts = [None] * n
        for i in range(n):
            self._create_host(i)
        self.core = QueueManagerCore(
            node,
            address_text(self.myAddress),
            agent=AGENT,
            hosts=tuple(f"{_HOST}{i}" for i in range(n)),
            data_dir=self.cfg["data_dir"],
            rng=random.Random(),
            node_fields={
                "admin": f"{self.cfg['host']}:{self.cfg['admin_port']}",
                "amqp_port": int(self.cfg.get("amqp_port") or 0),
            },
        )
        self._run(self.core.start(self.now))

    def _create_host(self, index: int) -> None:
        addr = self.createActor("mirrorq.queues.host.QueueHost")
        self.hosts[index] = addr
        self.send(addr, HostInit(self.cfg["data_dir"], self.cfg["name"], self.agent, self.myAddress, index))
        if self.front_end is not None:
            self.send(addr, self.front_end)

    # ---- translation ---------------------------------------------------------------------
    def _src(self, msg: Any, sender: Any) -> str | None:
        """The core's name for ``sender``: its ``host:port`` if it posts (a
        mirrorq actor), a one-time name if it asked from outside."""
        if self.bundled:
            hp = address_host_port(sender)
            if hp is not None:
                return f"{hp[0]}:{hp[1]}"
        if isinstance(msg, _ASKED):
            self.next_ask += 1
            name = f"{_ASK}{self.next_ask}"
            self.asks[name] = sender
            return name
        return None

    def _run(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Send):
                self._deliver(a.dst, a.msg)
            elif isinstance(a, SetTimer):
                self._arm(self.timers.set(a.key, self.now + a.delay))
            elif isinstance(a, CancelTimer):
                self.timers.cancel(a.key)
            elif isinstance(a, Emit) and isinstance(a.event, ManagerLog):
                self.log(a.event.event, level=a.event.level, **a.event.fields)

    def _arm(self, at: float | None) -> None:
        if at is not None:
            self.wakeupAfter(max(0.0, at - self.now), payload=(_TIMER, at))

    def _deliver(self, dst: str, msg: Any) -> None:
        if dst == AGENT:
            self.post(self.agent, msg)
        elif dst.startswith(_HOST):
            if isinstance(msg, ReplicaInit):
                msg = replace(msg, agent=self.agent)
            self.post(self.hosts[int(dst[len(_HOST) :])], msg)
        elif dst.startswith(_ASK):
            addr = self.asks.pop(dst, None)
            if addr is not None:
                self.send(addr, msg)
        else:
            try:
                self.post(dst, msg)
            except ValueError as e:
                self.log("bad_destination", level="warning", dst=dst, message=type(msg).__name__, error=str(e))
