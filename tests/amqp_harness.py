"""Test support: one AMQP :class:`Connection` core driven in-process.

* :class:`LocalMaster` answers the queue wire messages with the real
  classic-queue semantics (:class:`~mirrorq.classic.amqqueue.AMQQueue`
  on an in-memory backing queue), without replication: the AMQP state
  machine is under test here, mirroring is tested in the queue and cluster
  tests.
* :class:`Harness` plays the shell: bytes from a pamqp-speaking client into
  the core, the core's sends to local masters and their replies back,
  registry transactions applied to the topology, queue declares answered.
  Everything runs to quiescence synchronously; ``now`` is a virtual clock.
"""

from __future__ import annotations

from typing import Any

from pamqp import body as B
from pamqp import commands as C
from pamqp import frame as F
from pamqp import header as H

from mirrorq.amqp import connection as cn
from mirrorq.amqp.topology import Topology
from mirrorq.classic import amqqueue as aq
from mirrorq.classic.backing_queue import BackingQueue
from mirrorq.queues import messages as qm
from mirrorq.queues import semantics
from mirrorq.sansio import CancelTimer, Emit, Send, SetTimer

FE_DST = "fe:1"


class LocalMaster:
    def __init__(self, index: int, spec: dict) -> None:
        self.spec = spec
        self.member = f"n1/m{index}:1/u{index}"
        self.dst = self.member  # a replica is addressed by its member name (its host routes it)
        bq = BackingQueue(None, durable=False, max_priority=int(spec["arguments"].get("x-max-priority") or 0))
        self.q = aq.AMQQueue(
            spec["name"],
            bq,
            durable=False,
            auto_delete=spec["auto_delete"],
            exclusive_owner=spec["exclusive_owner"],
            arguments=dict(spec["arguments"]),
        )
        self.deleted = False

    def handle(self, now: float, msg: Any) -> list:
        """-> [(dst, reply)]"""
        out: list = []
        name = self.spec["name"]
        try:
            if isinstance(msg, qm.Publish):
                pub = qm.channel_id(msg.publisher)
                acks, nacks = [], []
                for seq, body, props, persistent in msg.items:
                    evs = self.q.publish(now, pub, seq, f"{pub}|{seq}", body, props, persistent)
                    if any(isinstance(e, Emit) and isinstance(e.event, aq.PublishRejected) for e in evs):
                        nacks.append(seq)
                    else:
                        acks.append(seq)
                    out += self._events(evs)
                out.append((pub[0], qm.Confirm(name, pub, tuple(acks), tuple(nacks), "full" if nacks else "")))
            elif isinstance(msg, qm.Consume):
                ch = qm.channel_id(msg.channel)
                out += self._events(
                    self.q.consume(
                        now,
                        ch,
                        msg.consumer_tag,
                        no_ack=msg.no_ack,
                        prefetch=msg.prefetch,
                        exclusive=msg.exclusive,
                        arguments=dict(msg.arguments),
                        lookahead=msg.lookahead,
                    )
                )
                if msg.request_id is not None:
                    # after the deliveries the consume caused (the connection must hold them until consume-ok)
                    out.append((ch[0], qm.CommandResult(name, ch, msg.request_id, True)))
            elif isinstance(msg, qm.Cancel):
                out += self._events(self.q.cancel(now, qm.channel_id(msg.channel), msg.consumer_tag))
            elif isinstance(msg, qm.Settle):
                ch = qm.channel_id(msg.channel)
                if msg.ack:
                    out += self._events(self.q.ack(now, ch, list(msg.ack)))
                if msg.requeue or msg.release:  # a classic queue requeues both, as the coordinator does
                    out += self._events(self.q.reject(now, ch, list(msg.requeue) + list(msg.release), True))
                if msg.discard:
                    out += self._events(self.q.reject(now, ch, list(msg.discard), False))
                if msg.credit:
                    out += self._events(self.q.link_credit(now, ch, list(msg.credit)))
            elif isinstance(msg, qm.Get):
                out += self._events(self.q.get(now, qm.channel_id(msg.channel), msg.request_id, msg.no_ack))
            elif isinstance(msg, qm.ChannelClosed):
                out += self._events(self.q.channel_down(now, qm.channel_id(msg.channel)))
            elif isinstance(msg, qm.QueueCommand):
                ch = qm.channel_id(msg.channel)
                if msg.command == "info":
                    v = self.q.info()
                    out.append(
                        (
                            ch[0],
                            qm.CommandResult(
                                name,
                                ch,
                                msg.request_id,
                                True,
                                {"messages_ready": v.get("messages_ready", 0), "consumers": v.get("consumers", 0)},
                            ),
                        )
                    )
                else:
                    try:
                        if msg.command == "purge":
                            value, evs = self.q.purge(now)
                        else:
                            value, evs = self.q.delete(
                                now, if_unused=bool(msg.args.get("if_unused")), if_empty=bool(msg.args.get("if_empty"))
                            )
                            self.deleted = True
                    except semantics.AMQPError as e:
                        out.append(
                            (ch[0], qm.CommandResult(name, ch, msg.request_id, False, error=str(e), code=e.reply_code))
                        )
                    else:
                        out += self._events(evs)
                        out.append((ch[0], qm.CommandResult(name, ch, msg.request_id, True, value)))
        except semantics.AMQPError as e:
            ch = qm.channel_id(getattr(msg, "channel", None) or msg.publisher)
            rid = getattr(msg, "request_id", None)
            out.append(
                (ch[0], qm.CommandResult(name, ch, -1 if rid is None else rid, False, error=str(e), code=e.reply_code))
            )
        return out

    def _events(self, actions: list) -> list:
        out = []
        name = self.spec["name"]
        for a in actions:
            if not isinstance(a, Emit):
                continue
            ev = a.event
            if isinstance(ev, aq.Deliver):
                m = ev.message
                out.append(
                    (
                        ev.channel[0],
                        qm.Deliveries(
                            name,
                            ev.channel,
                            self.member,
                            ((ev.consumer_tag, m.offset, m.msg_id, m.body, m.properties, ev.redelivered),),
                        ),
                    )
                )
            elif isinstance(ev, aq.GetOk):
                m = ev.message
                out.append(
                    (
                        ev.channel[0],
                        qm.Deliveries(
                            name,
                            ev.channel,
                            self.member,
                            ((None, m.offset, m.msg_id, m.body, m.properties, ev.redelivered),),
                            ev.request_id,
                            ev.message_count,
                        ),
                    )
                )
            elif isinstance(ev, aq.GetEmpty):
                out.append((ev.channel[0], qm.GetEmpty(name, ev.channel, ev.request_id)))
            elif isinstance(ev, aq.ConsumerCancelled):
                out.append((ev.channel[0], qm.ConsumerCancelled(name, ev.channel, ev.consumer_tag, ev.reason)))
        return out


class Harness:
    """One connection, its client side speaking pamqp frames."""

    def __init__(
        self, *, peer_host: str = "127.0.0.1", topology: Topology | None = None, heartbeat: int = 60, **conn_kw: Any
    ) -> None:
        self.now = 0.0
        self.topo = topology or Topology()
        self.conn = cn.Connection(
            self.topo,
            dst=FE_DST,
            conn_id="n1.1",
            uid_base=1 << 32,
            peer_host=peer_host,
            node="n1",
            heartbeat=heartbeat,
            **conn_kw,
        )
        self.masters: dict[str, LocalMaster] = {}  # dst -> master
        self.by_queue: dict[str, LocalMaster] = {}
        self.inbox = bytearray()  # bytes the server wrote
        self.closed: str | None = None
        self.linger: bool | None = None  # the last CloseTransport's
        self.timers: dict = {}
        self.registry_log: list = []
        self.hold_registry = False
        self.held: list = []
        self.refreshes = 0
        self.elsewhere: list = []  # (table, record) committed through another node, not seen here yet
        self._run(self.conn.start(self.now))

    # ---- the shell --------------------------------------------------------------------
    def _run(self, actions: list) -> None:
        work = list(actions)
        while work:
            a = work.pop(0)
            if isinstance(a, Emit):
                ev = a.event
                if isinstance(ev, cn.Write):
                    self.inbox += ev.data
                elif isinstance(ev, cn.CloseTransport):
                    self.closed = ev.reason
                    self.linger = ev.linger
                elif isinstance(ev, cn.RegistryRequest):
                    if self.hold_registry:
                        self.held.append(ev)
                    else:
                        work += self._registry(ev)
                elif isinstance(ev, cn.DeclareRequest):
                    work += self._declare(ev)
                elif isinstance(ev, cn.RefreshRequest):
                    # a linearizable re-read: what other nodes committed becomes visible
                    self.refreshes += 1
                    for table, rec in self.elsewhere:
                        self.topo.put(table, rec)
                    self.elsewhere = []
                    work += self.conn.registry_result(self.now, ev.tag, True, "")
            elif isinstance(a, Send):
                m = self.masters.get(a.dst)
                if m is None:
                    continue
                for dst, reply in m.handle(self.now, a.msg):
                    if dst == FE_DST:
                        work += self.conn.receive(self.now, m.dst, reply)
            elif isinstance(a, SetTimer):
                self.timers[a.key] = self.now + a.delay
            elif isinstance(a, CancelTimer):
                self.timers.pop(a.key, None)

    def release_registry(self) -> None:
        held, self.held, self.hold_registry = self.held, [], False
        for ev in held:
            self._run(self._registry(ev))

    def _registry(self, ev: cn.RegistryRequest) -> list:
        self.registry_log.append(ev.txn)
        for op in ev.txn["ops"]:
            if op["op"] == "put":
                self.topo.put(op["table"], op["record"])
            else:
                self.topo.delete(op["table"], tuple(op["key"]))
        return self.conn.registry_result(self.now, ev.tag, True, "")

    def _declare(self, ev: cn.DeclareRequest) -> list:
        spec = dict(ev.spec)
        key = spec["name"]
        m = self.by_queue.get(key)
        if m is None or m.deleted:
            m = LocalMaster(len(self.masters) + 1, spec)
            self.masters[m.dst] = m
            self.by_queue[key] = m
        rec = dict(spec, pid=m.member, slave_pids=[], sync_slave_pids=[], gm_pids=[m.member], policy=None, state="live")
        self.topo.put("amqqueue", rec)
        return self.conn.declare_result(self.now, ev.tag, True, rec, "")

    def advance(self, dt: float) -> None:
        self.now += dt
        while True:
            due = sorted((t, k) for k, t in self.timers.items() if t <= self.now)
            if not due:
                return
            _, key = due[0]
            del self.timers[key]
            self._run(self.conn.timer(self.now, key))

    # ---- the client -------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        self._run(self.conn.data_received(self.now, data))

    def send(self, channel: int, *frames: Any) -> None:
        self.send_raw(b"".join(F.marshal(f, channel) for f in frames))

    def publish(
        self,
        channel: int,
        body: bytes,
        exchange: str = "",
        routing_key: str = "",
        *,
        mandatory: bool = False,
        properties: C.Basic.Properties | None = None,
        frame_max: int = 131072,
    ) -> bytes:
        data = F.marshal(C.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory), channel)
        data += F.marshal(H.ContentHeader(0, len(body), properties or C.Basic.Properties()), channel)
        step = frame_max - 8
        for i in range(0, len(body), step):
            data += F.marshal(B.ContentBody(body[i : i + step]), channel)
        return data

    def frames(self) -> list[tuple[int, Any]]:
        """Decode and consume what the server wrote: [(channel, frame)]."""
        out = []
        while self.inbox:
            if self.inbox[:4] == b"AMQP":
                out.append((0, bytes(self.inbox[:8])))
                del self.inbox[:8]
                continue
            n, ch, value = F.unmarshal(bytes(self.inbox))
            del self.inbox[:n]
            out.append((ch, value))
        return out

    def methods(self) -> list[tuple[int, str]]:
        return [(ch, getattr(v, "name", type(v).__name__)) for ch, v in self.frames()]

    def handshake(
        self,
        user: str = "guest",
        password: str = "guest",
        vhost: str = "/",
        *,
        frame_max: int = 131072,
        heartbeat: int = 0,
        cancel_notify: bool = True,
        blocked_notify: bool = False,
    ) -> None:
        """Open the connection; the client announces capability
        ``consumer_cancel_notify`` (as pika, aio-pika and py-amqp do) unless
        ``cancel_notify`` is false, and ``connection.blocked`` if ``blocked_notify``."""
        self.send_raw(cn.PROTOCOL_HEADER)
        fr = self.frames()
        assert isinstance(fr[0][1], C.Connection.Start), fr
        caps = {"consumer_cancel_notify": cancel_notify, "connection.blocked": blocked_notify}
        props = {"capabilities": {k: True for k, on in caps.items() if on}} if any(caps.values()) else {}
        self.send(0, C.Connection.StartOk(client_properties=props, response=f"\0{user}\0{password}"))
        fr = self.frames()
        assert isinstance(fr[0][1], C.Connection.Tune), fr
        self.send(0, C.Connection.TuneOk(2047, frame_max, heartbeat), C.Connection.Open(vhost))
        fr = self.frames()
        assert isinstance(fr[-1][1], C.Connection.OpenOk), fr

    def open_channel(self, n: int = 1) -> None:
        self.send(n, C.Channel.Open())
        assert self.methods() == [(n, "Channel.OpenOk")]
