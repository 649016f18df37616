"""The AMQP listener: one Thespian actor per node owning the AMQP port and every client socket.

Shell choice.  The brief offered two shells: a Thespian actor watching its
sockets (``ThespianWatch``), or a per-node asyncio process that talks to the
actors in batches.  This is the first: the actor *is* a Thespian endpoint, so
a queue master's replies (confirms, deliveries) come straight to it and its
publishes go straight to the masters -- one hop each way, no bridge process
and no second serialisation.  An asyncio process would need its own
Thespian endpoint anyway to hear masters (an ``ActorSystem`` handle outside
an actor only gets answers to ``ask``), i.e. one more hop per batch.  Not
measured side by side (time); the per-hop figures in DESIGN.md (~1-3 ms per
Thespian message, batching per hop) are what decided it, and bench/amqp.py
measures the result.

What the shell does (nothing else -- the protocol is in
:mod:`mirrorq.amqp.connection`):

* accepts connections on the node's ``amqp_port``; every socket is
  non-blocking; each ``receiveMessage`` returns a ``ThespianWatch`` of the
  listening socket and of every client socket whose connection
  ``wants_read()`` (a connection with too many unconfirmed publishes is not
  read: TCP back-pressure on the publisher);
* reads what is ready (up to :data:`READ_CHUNK` per socket per wakeup) into
  the connection core, and performs its actions: bytes are written
  non-blocking (the rest is kept and retried every :data:`RETRY_WRITE`
  seconds), ``Send`` goes to the queue master's actor (the core already made
  one message per queue per read: batch per hop), registry transactions and
  queue declares go to the node agent / queue manager;
* keeps the :class:`~mirrorq.amqp.topology.Topology` cache: a full read of
  its tables at start, then the registry's change notifications
  (``RegistrySubscribe``); a change of a queue's ``pid`` (a promotion) is
  passed to every connection using that queue, which resends its
  unconfirmed publishes and re-registers its consumers there.  A snapshot
  reset reloads every table;
* routes masters' replies to the connection whose channel uid they carry
  (``uid_base = connection number << 32``).

Registry requests (reads and transactions) go one at a time, in order: the
agent's answers carry no request id.  Queue declares are matched to their
answers by queue name.  A connection that fails inside the core is closed
with 541 by the core itself; a socket error closes the socket and releases
what the connection held (its channels are closed at their masters, which
requeue their unacked messages).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from thespian.actors import Actor, ActorExitRequest, ThespianWatch, WakeupMessage, WatchMessage

from mirrorq.amqp import connection as cn
from mirrorq.amqp.topology import TABLES, Topology
from mirrorq.node.addresses import address_host_port
from mirrorq.node.messages import RegistryChanges, RegistryGet, RegistryResult, RegistryRows, RegistrySubscribe, RegistryTxn
from mirrorq.queue_process import messages as qm
from mirrorq.queue_process.actor import address_of
from mirrorq.queue_process.manager import DeclareQueue, DeclareResult
from mirrorq.sansio import CancelTimer, Emit, Send, SetTimer

LISTENER_GLOBAL_NAME = "mirrorq.amqp_listener"
READ_CHUNK = 1 << 18
RETRY_WRITE = 0.005
TICK = 0.1
_REPLIES = (qm.Confirm, qm.Deliveries, qm.GetEmpty, qm.ConsumerCancelled, qm.CommandResult, qm.NotMaster, qm.NewMaster)


@dataclass
class ListenerInit:
    config: dict
    agent: Any
    manager: Any


@dataclass
class ListenerReady:
    ok: bool
    port: int = 0
    error: str = ""


@dataclass
class ListenerStatusQuery:
    pass


class _Client:
    __slots__ = ("no", "sock", "conn", "out", "timers", "peer")

    def __init__(self, no: int, sock: socket.socket, conn: cn.Connection, peer: str) -> None:
        self.no, self.sock, self.conn, self.peer = no, sock, conn, peer
        self.out = bytearray()
        self.timers: dict = {}


class AMQPListener(Actor):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lsock: socket.socket | None = None
        self.clients: dict[int, _Client] = {}  # fileno -> client
        self.by_no: dict[int, _Client] = {}
        self.next_no = 0
        self.topo = Topology()
        self.reg_queue: list = []
        self.declares: list = []  # (client no, tag, (vhost, name))
        self.ticking = False
        self.retrying = False
        self.stats = {"accepted": 0, "closed": 0, "read_bytes": 0, "sends": 0}

    # ---- Thespian ---------------------------------------------------------------------
    def receiveMessage(self, msg, sender):
        if isinstance(msg, ListenerInit):
            self._init(msg, sender)
        elif self.lsock is None:
            return None
        elif isinstance(msg, WatchMessage):
            self._ready(msg.ready)
        elif isinstance(msg, _REPLIES):
            self._reply(msg, sender)
        elif isinstance(msg, WakeupMessage):
            self._wakeup(msg.payload)
        elif isinstance(msg, RegistryChanges):
            self._changes(msg)
        elif isinstance(msg, (RegistryRows, RegistryResult)):
            self._registry_answer(msg)
        elif isinstance(msg, DeclareResult):
            self._declared(msg)
        elif isinstance(msg, ListenerStatusQuery):
            self.send(sender, {"connections": len(self.clients), **self.stats,
                               "tables": sorted(self.topo.loaded)})
        elif isinstance(msg, ActorExitRequest):
            for c in list(self.clients.values()):
                self._drop(c, "node stopping")
            self.lsock.close()
            return None
        return self._watch()

    def _watch(self) -> ThespianWatch:
        fds = [self.lsock.fileno()] if self.lsock is not None else []
        fds += [fd for fd, c in self.clients.items() if c.conn.wants_read()]
        return ThespianWatch(fds)

    def _init(self, msg: ListenerInit, sender) -> None:
        cfg = msg.config
        self.agent, self.manager = msg.agent, msg.manager
        self.node = cfg["name"]
        hp = address_host_port(self.myAddress)
        self.dst = f"{hp[0]}:{hp[1]}"
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((cfg.get("host", "127.0.0.1"), int(cfg["amqp_port"])))
            s.listen(128)
            s.setblocking(False)
        except OSError as e:
            self.send(sender, ListenerReady(False, error=f"AMQP port {cfg.get('amqp_port')}: {e.strerror or e}"))
            return
        self.lsock = s
        self.send(self.agent, RegistrySubscribe(TABLES))
        for t in TABLES:
            self._registry(("get", t))
        self.send(sender, ListenerReady(True, s.getsockname()[1]))

    # ---- sockets ------------------------------------------------------------------------------
    def _ready(self, ready: list) -> None:
        for fd in ready:
            if self.lsock is not None and fd == self.lsock.fileno():
                self._accept()
                continue
            c = self.clients.get(fd)
            if c is None:
                continue
            try:
                data = c.sock.recv(READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                self._drop(c, f"read error: {e}")
                continue
            if not data:
                self._drop(c, "client closed the socket")
                continue
            self.stats["read_bytes"] += len(data)
            self._do(c, c.conn.data_received(time.monotonic(), data))

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self.lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.next_no += 1
            no = self.next_no
            conn = cn.Connection(self.topo, dst=self.dst, conn_id=f"{self.node}.{no}", uid_base=no << 32,
                                 peer_host=addr[0], node=self.node)
            c = _Client(no, sock, conn, addr[0])
            self.clients[sock.fileno()] = c
            self.by_no[no] = c
            self.stats["accepted"] += 1
            self._do(c, conn.start(time.monotonic()))

    def _drop(self, c: _Client, reason: str) -> None:
        fd = c.sock.fileno()
        if self.clients.get(fd) is c:
            del self.clients[fd]
        self.by_no.pop(c.no, None)
        self._do(c, c.conn.connection_lost(time.monotonic()), dropping=True)
        try:
            c.sock.close()
        except OSError:
            pass
        self.stats["closed"] += 1

    def _write(self, c: _Client, data: bytes) -> bool:
        if self.by_no.get(c.no) is not c:
            return False
        if c.out:
            c.out += data
            return self._try_write(c)
        try:
            n = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._drop(c, f"write error: {e}")
            return False
        if n < len(data):
            c.out += data[n:]
            self._retry_soon()
        return True

    def _try_write(self, c: _Client) -> bool:
        while c.out:
            try:
                n = c.sock.send(c.out)
            except (BlockingIOError, InterruptedError):
                self._retry_soon()
                return True
            except OSError as e:
                self._drop(c, f"write error: {e}")
                return False
            del c.out[:n]
        return True

    def _retry_soon(self) -> None:
        if not self.retrying:
            self.retrying = True
            self.wakeupAfter(RETRY_WRITE, payload="write")

    # ---- the core's actions ----------------------------------------------------------------
    def _do(self, c: _Client, actions: list, dropping: bool = False) -> None:
        for a in actions:
            if isinstance(a, Send):
                self.stats["sends"] += 1
                self.send(address_of(a.dst), a.msg)
            elif isinstance(a, Emit):
                ev = a.event
                if isinstance(ev, cn.Write):
                    if not dropping and not self._write(c, ev.data):
                        dropping = True
                elif isinstance(ev, cn.CloseTransport):
                    if not dropping:
                        self._try_write(c)
                        dropping = True
                        self._drop(c, ev.reason)
                elif isinstance(ev, cn.RegistryRequest):
                    self._registry(("txn", ev.txn, c.no, ev.tag))
                elif isinstance(ev, cn.RefreshRequest):
                    for i, t in enumerate(ev.tables):
                        self._registry(("rget", t, c.no, ev.tag, i == len(ev.tables) - 1))
                elif isinstance(ev, cn.DeclareRequest):
                    self.declares.append((c.no, ev.tag, (ev.spec["vhost"], ev.spec["name"])))
                    self.send(self.manager, DeclareQueue(dict(ev.spec), tuple(ev.nodes)))
            elif isinstance(a, SetTimer):
                c.timers[a.key] = time.monotonic() + a.delay
                self._tick_soon()
            elif isinstance(a, CancelTimer):
                c.timers.pop(a.key, None)

    def _tick_soon(self) -> None:
        if not self.ticking:
            self.ticking = True
            self.wakeupAfter(TICK, payload="tick")

    def _wakeup(self, payload: Any) -> None:
        if payload == "write":
            self.retrying = False
            for c in list(self.clients.values()):
                if c.out:
                    self._try_write(c)
        elif payload == "tick":
            self.ticking = False
            now = time.monotonic()
            for c in list(self.by_no.values()):
                for key, at in sorted(c.timers.items(), key=lambda kv: kv[1]):
                    if at <= now and c.timers.get(key) == at and self.by_no.get(c.no) is c:
                        del c.timers[key]
                        self._do(c, c.conn.timer(now, key))
            if any(c.timers for c in self.by_no.values()):
                self._tick_soon()

    # ---- masters' replies ---------------------------------------------------------------------
    def _reply(self, msg: Any, sender) -> None:
        now = time.monotonic()
        if isinstance(msg, (qm.NewMaster, qm.NotMaster)):
            for c in list(self.by_no.values()):
                self._do(c, c.conn.receive(now, sender, msg))
            return
        cid = getattr(msg, "channel", None) or getattr(msg, "publisher", None)
        try:
            uid = qm.channel_id(cid)[1]
        except ValueError:
            return
        c = self.by_no.get(uid >> 32) if isinstance(uid, int) else None
        if c is not None:
            self._do(c, c.conn.receive(now, sender, msg))

    # ---- registry ------------------------------------------------------------------------------
    def _registry(self, req: tuple) -> None:
        self.reg_queue.append(req)
        if len(self.reg_queue) == 1:
            self._registry_send()

    def _registry_send(self) -> None:
        req = self.reg_queue[0]
        if req[0] == "get":
            self.send(self.agent, RegistryGet(req[1]))
        elif req[0] == "rget":
            self.send(self.agent, RegistryGet(req[1], linearizable=True))
        else:
            self.send(self.agent, RegistryTxn(req[1]))

    def _registry_answer(self, msg: Any) -> None:
        if not self.reg_queue:
            return
        req = self.reg_queue[0]
        if (req[0] in ("get", "rget")) != isinstance(msg, RegistryRows):
            return  # not the answer we wait for
        self.reg_queue.pop(0)
        if self.reg_queue:
            self._registry_send()
        if req[0] == "rget":
            if msg.ok:
                self.topo.load(req[1], msg.rows)
                if req[1] == "amqqueue":
                    self._masters_changed([(r["vhost"], r["name"], None, r) for r in msg.rows])
            c = self.by_no.get(req[2])
            if req[4] and c is not None:  # the last table: route the publish now
                self._do(c, c.conn.registry_result(time.monotonic(), req[3], msg.ok, msg.error))
            return
        if req[0] == "get":
            if msg.ok:
                self.topo.load(req[1], msg.rows)
                if req[1] == "amqqueue":
                    self._masters_changed([(r["vhost"], r["name"], None, r) for r in msg.rows])
            else:
                self._registry(req)  # retry (the registry may not be ready yet)
            return
        c = self.by_no.get(req[2])
        if c is not None:
            self._do(c, c.conn.registry_result(time.monotonic(), req[3], msg.ok, msg.error))

    def _changes(self, msg: RegistryChanges) -> None:
        if msg.changes is None:
            for t in TABLES:
                self._registry(("get", t))
            return
        self._masters_changed(self.topo.apply(msg.changes))

    def _masters_changed(self, moved: list) -> None:
        now = time.monotonic()
        for vhost, name, old, new in moved:
            if new is not None and (old or {}).get("pid") == new.get("pid") and old is not None:
                continue
            for c in list(self.by_no.values()):
                self._do(c, c.conn.queue_moved(now, vhost, name, new))

    def _declared(self, msg: DeclareResult) -> None:
        if not self.declares:
            return
        idx = 0
        if msg.ok and msg.record:
            key = (msg.record.get("vhost"), msg.record.get("name"))
            idx = next((i for i, d in enumerate(self.declares) if d[2] == key), 0)
        else:
            idx = next((i for i, d in enumerate(self.declares) if f"'{d[2][1]}'" in (msg.error or "")), 0)
        no, tag, _ = self.declares.pop(idx)
        c = self.by_no.get(no)
        if c is not None:
            self._do(c, c.conn.declare_result(time.monotonic(), tag, msg.ok, msg.record, msg.error))
