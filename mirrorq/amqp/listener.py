"""The AMQP listener: one Thespian actor per node owning the AMQP port and every client socket.

Two shells drive the same cores through the same
:class:`~mirrorq.amqp.frontend.FrontEnd`: this one, a Thespian actor
watching its sockets (``ThespianWatch``; node config ``amqp_shell: watch``,
the default), and :mod:`mirrorq.amqp.aio_shell`, a per-node asyncio process
reaching the actors through the relay actor :mod:`mirrorq.amqp.bridge`
(``amqp_shell: asyncio``).  ``watch`` is the default because it is one
process and one hop fewer per node (a master's reply comes straight to it),
with no bridge to keep alive; the measurements behind the choice are in
bench/README.md ("The AMQP shells: watch and asyncio").

What the shell does (nothing else -- the protocol is in
:mod:`mirrorq.amqp.connection`):

* accepts connections on the node's ``amqp_port``; every socket is
  non-blocking; each ``receiveMessage`` returns a ``ThespianWatch`` of the
  listening socket and of every client socket whose connection
  ``wants_read()`` (a connection with too many unconfirmed publishes, or
  blocked by a resource alarm, is not read: TCP back-pressure on the
  publisher; the watch is made again after every message, so a
  connection unblocked by the agent's message is read in the next turn);
* reads what is ready (up to :data:`READ_CHUNK` per socket per wakeup) into
  the connection core -- and, while the connection is mid-message
  (``FrontEnd.mid_message``: pika writes a publish's method, header and
  body frames in three sends, and the first often wakes us alone), yields
  the CPU once and reads again, up to :data:`READ_AGAIN` times, never
  waiting: the rest is read in this turn rather than in another -- and
  performs its actions: bytes are written
  non-blocking (the rest is kept and retried every :data:`RETRY_WRITE`
  seconds), ``Send`` goes to the queue master's actor (the core already made
  one message per queue per read: batch per hop), registry transactions and
  queue declares go to the node agent / queue manager;
* hands the rest to :class:`~mirrorq.amqp.frontend.FrontEnd` (moved there
  so the asyncio shell shares it): the topology cache and its change
  notifications (a promotion reaches every connection using the queue,
  which resends its unconfirmed publishes and re-registers its consumers),
  routing masters' replies by channel uid, registry requests one at a
  time in order, declares matched by queue name, connection timers.

AMQPS (node config ``amqps_port`` + ``ssl_options``, see
:mod:`mirrorq.amqp.tls`): a second listening socket; each of its clients
gets a :class:`~mirrorq.amqp.tls.TLSSession` (an ``ssl.SSLObject`` on
memory BIOs, so the watch loop stays non-blocking) between the socket and
the connection core: what is read is decrypted before the core sees it,
what the core writes is encrypted.  The connection is opened in the front
end at accept (so the AMQP handshake timeout also bounds a TLS handshake
that never completes) with ``ssl`` true; its TLS info items are handed over
when the handshake completes.  A failed handshake (e.g. no client
certificate under ``fail_if_no_peer_cert``) sends the TLS alert, closes the
socket and leaves one ``amqps_handshake_failed`` line in node.log.  A
connection the core closes gets a close_notify after its last bytes.

A client whose connection.close we answered with close-ok closes the
socket itself (AMQP; RabbitMQ waits for it too): the socket is kept open,
what arrives is dropped, until the client closes it (a TLS client's
close_notify is answered with ours) or :data:`LINGER` seconds pass
(``CloseTransport.linger``).

A connection that fails inside the core is closed with 541 by the core
itself; a socket error closes the socket and releases what the connection
held (its channels are closed at their masters, which requeue their
unacked messages).
"""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from thespian.actors import ActorExitRequest, ThespianWatch, WakeupMessage, WatchMessage

from mirrorq.amqp.connection import CLIENT_BACKLOG
from mirrorq.amqp.frontend import FRONTEND_MESSAGES, TICK, FrontEnd, FrontEndQuery, LinkLost
from mirrorq.amqp.tls import TLSOptionsError, TLSSession, server_context
from mirrorq.node.addresses import address_host_port
from mirrorq.node.lease import PAUSED, LeaseReader
from mirrorq.node.log import NodeLog
from mirrorq.node.posting import PostingActor, RecvBuffer, accept_ready

LISTENER_GLOBAL_NAME = "mirrorq.amqp_listener"
READ_CHUNK = 1 << 18
#: reads more in the same turn while a client is mid-message (FrontEnd.mid_message), at most
READ_AGAIN = 3
RETRY_WRITE = 0.005
#: how long a socket whose client was sent connection.close-ok stays open for the client to close it
LINGER = 5.0


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
    __slots__ = ("no", "sock", "out", "peer", "tls")

    def __init__(self, no: int, sock: socket.socket, peer: str, tls: TLSSession | None = None) -> None:
        self.no, self.sock, self.peer, self.tls = no, sock, peer, tls
        self.out = bytearray()


class AMQPListener(PostingActor):
    """The ThespianWatch shell; the front end's host (:class:`~mirrorq.amqp.frontend.FrontEndHost`).

    A turn is one Thespian message: sockets ready to read, or a bundle of
    masters' replies; everything the turn sends to one actor (publishes,
    settlements, consumes of every connection) leaves as one bundle."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.lsock: socket.socket | None = None
        self.tls_lsock: socket.socket | None = None  # amqps_port
        self.tls_ctx: ssl.SSLContext | None = None
        self.clients: dict[int, _Client] = {}  # fileno -> client
        self.by_no: dict[int, _Client] = {}
        self.fe: FrontEnd | None = None
        self.ticking = False
        self.retrying = False
        # fd -> (client, deadline): sockets answered with close-ok, left for
        # the client to close (CloseTransport.linger); what they send is dropped
        self.lingering: dict[int, tuple[_Client, float]] = {}
        self.linger_wakeup = False
        self.rbuf = RecvBuffer(READ_CHUNK)

    fast_links = True

    @property
    def frontend(self) -> FrontEnd:
        """The front end, once :class:`ListenerInit` opened the AMQP port."""
        if self.fe is None:
            raise RuntimeError("the AMQP listener is not started yet (no ListenerInit)")
        return self.fe

    # ---- Thespian ---------------------------------------------------------------------
    def watching(self) -> list[int]:
        return self._watch().filenos if self.lsock is not None else []

    def on_message(self, msg: Any, sender: Any) -> None:
        if isinstance(msg, ListenerInit):
            self._init(msg, sender)
            return None
        if self.lsock is None:
            return None
        self.frontend.follow_lease(self.now, self.lease.state(self.now) == PAUSED)  # before anything of this turn
        if isinstance(msg, WatchMessage):
            self._ready(msg.ready)
        elif isinstance(msg, FRONTEND_MESSAGES):
            self.frontend.message(self.now, sender, msg)
        elif isinstance(msg, WakeupMessage):
            self._wakeup(msg.payload)
        elif isinstance(msg, ListenerStatusQuery):
            self.answer(sender, {**self.frontend.status(), "outbox": dict(self.outbox.stats)})
        elif isinstance(msg, FrontEndQuery):
            self.answer(sender, self.frontend.query(self.now, msg))
        elif isinstance(msg, ActorExitRequest):
            for c in list(self.by_no.values()):
                self._drop(c, "node stopping")
            for fd in list(self.lingering):
                self._end_linger(fd)
            self.lsock.close()
            self.lsock = None
            if self.tls_lsock is not None:
                self.tls_lsock.close()
                self.tls_lsock = None
        return None

    def _watch(self) -> ThespianWatch:
        fds = [self.lsock.fileno()] if self.lsock is not None else []
        if self.tls_lsock is not None:
            fds.append(self.tls_lsock.fileno())
        fds += [fd for fd, c in self.clients.items() if self.frontend.wants_read(c.no)]
        fds += list(self.lingering)
        return ThespianWatch(fds)

    def _init(self, msg: ListenerInit, sender: Any) -> None:
        cfg = msg.config
        self.agent, self.manager = msg.agent, msg.manager
        hp = address_host_port(self.myAddress)
        host = cfg.get("host", "127.0.0.1")
        try:
            s = _listen(host, int(cfg["amqp_port"]))
        except OSError as e:
            self.answer(sender, ListenerReady(False, error=f"AMQP port {cfg.get('amqp_port')}: {e.strerror or e}"))
            return
        if cfg.get("amqps_port"):
            try:
                self.tls_ctx = server_context(cfg.get("ssl_options") or {})
                self.tls_lsock = _listen(host, int(cfg["amqps_port"]))
            except TLSOptionsError as e:
                s.close()
                self.answer(sender, ListenerReady(False, error=f"AMQPS: {e.key}: {e}"))
                return
            except OSError as e:
                s.close()
                self.answer(sender, ListenerReady(False, error=f"AMQPS port {cfg['amqps_port']}: {e.strerror or e}"))
                return
        self.lsock = s
        self.log = NodeLog(cfg.get("data_dir") or ".", cfg["name"], "amqp")
        assert hp is not None  # the listener runs in a TCP actor system: its address has a host and port
        self.fe = FrontEnd(
            self,
            node=cfg["name"],
            dst=f"{hp[0]}:{hp[1]}",
            amqp_host=cfg.get("host", "127.0.0.1"),
            amqp_port=s.getsockname()[1],
            max_message_size=cfg.get("max_message_size"),
        )
        self.lease = LeaseReader(cfg.get("data_dir") or ".")
        self.frontend.start()
        self.answer(sender, ListenerReady(True, s.getsockname()[1]))

    # ---- sockets ------------------------------------------------------------------------------
    def _ready(self, ready: list) -> None:
        for fd in ready:
            if self.lsock is not None and fd == self.lsock.fileno():
                self._accept(self.lsock)
                continue
            if self.tls_lsock is not None and fd == self.tls_lsock.fileno():
                self._accept(self.tls_lsock)
                continue
            if fd in self.lingering:
                self._linger_read(fd)
                continue
            c = self.clients.get(fd)
            if c is None:
                continue
            try:
                data = self.rbuf.recv(c.sock)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as e:
                self._drop(c, f"read error: {e}")
                continue
            if not data:
                if c.tls is not None and not c.tls.established:  # e.g. the client did not trust our certificate
                    self.log(
                        "amqps_handshake_failed",
                        level="warning",
                        peer=c.peer,
                        error="the client closed the connection during the TLS handshake",
                    )
                self._drop(c, "client closed the socket")
                continue
            if c.tls is not None:
                self._tls_data(c, c.tls, data)
                continue
            self.frontend.data(self.now, c.no, data)
            # the rest of a message the client is writing in pieces is often there by now:
            # read it in this turn rather than in another (a few tries, never waiting)
            for _ in range(READ_AGAIN):
                if not self.frontend.mid_message(c.no) or not self.frontend.wants_read(c.no):
                    break
                os.sched_yield()  # the client may be waiting for this CPU to write the rest
                try:
                    data = self.rbuf.recv(c.sock)
                except OSError:  # would block, or an error the next readiness reports
                    break
                if not data:
                    break
                self.frontend.data(self.now, c.no, data)

    def _tls_data(self, c: _Client, tls: TLSSession, data: bytes) -> None:
        """Bytes read from ``c``'s socket, through its TLS session ``tls`` (``c.tls``)."""
        r = tls.receive(data)
        if r.out and not self._write(c, r.out):
            return
        if r.error:
            self.log(
                "amqps_handshake_failed" if not tls.established else "amqps_tls_error",
                level="warning",
                peer=c.peer,
                error=r.error,
            )
            self._try_write(c)  # the alert, if the socket takes it now
            self._drop(c, r.error)
            return
        if r.established:
            self.frontend.tls_established(c.no, tls.peer_info())
        if r.plain:
            self.frontend.data(self.now, c.no, r.plain)
        if r.closed and self.by_no.get(c.no) is c:
            self._drop(c, "client closed the TLS session")

    def _accept(self, lsock: socket.socket) -> None:
        tls = lsock is self.tls_lsock
        ctx = self.tls_ctx
        assert ctx is not None or not tls  # the AMQPS socket is opened after its context (_init)
        port = lsock.getsockname()[1]
        for sock, addr in accept_ready(lsock):
            no = self.frontend.next_no + 1
            c = _Client(no, sock, addr[0], TLSSession(ctx) if tls and ctx is not None else None)
            self.clients[sock.fileno()] = c
            self.by_no[no] = c
            opened = self.frontend.open(self.now, addr[0], addr[1], port=port, ssl=tls)
            assert opened == no, (opened, no)

    def _drop(self, c: _Client, reason: str) -> None:
        """Close the socket and release the connection (the front end's
        ``lost``); idempotent."""
        self._forget(c)
        self.frontend.lost(self.now, c.no)

    def _forget(self, c: _Client) -> None:
        fd = c.sock.fileno()
        if self.clients.get(fd) is c:
            del self.clients[fd]
        if self.by_no.get(c.no) is c:
            del self.by_no[c.no]
            try:
                c.sock.close()
            except OSError:
                pass

    def _linger(self, c: _Client) -> None:
        """Keep ``c``'s socket (already forgotten by the front end) open for
        the client to close, at most :data:`LINGER` seconds."""
        fd = c.sock.fileno()
        if self.clients.get(fd) is c:
            del self.clients[fd]
        if self.by_no.get(c.no) is c:
            del self.by_no[c.no]
        self.lingering[fd] = (c, self.now + LINGER)
        if not self.linger_wakeup:
            self.linger_wakeup = True
            self.wakeupAfter(LINGER, payload="linger")

    def _linger_read(self, fd: int) -> None:
        c = self.lingering[fd][0]
        try:
            data = self.rbuf.recv(c.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._end_linger(fd)
        elif c.tls is not None:
            # a TLS client closes with close_notify and waits for ours (asyncio
            # does, up to 30 s): answer it, then close; what else comes is dropped
            r = c.tls.receive(data)
            c.out += r.out
            if r.closed or r.error:
                c.out += c.tls.close()
                self._end_linger(fd)
            elif c.out:
                self._try_write(c)

    def _end_linger(self, fd: int) -> None:
        c, _ = self.lingering.pop(fd)
        if c.out:
            self._try_write(c)
        try:
            c.sock.close()
        except OSError:
            pass

    def _write(self, c: _Client, data: bytes) -> bool:
        if self.by_no.get(c.no) is not c:
            return False
        if c.out:
            c.out += data
            return self._try_write(c, notify=False)  # the front end looks at the backlog itself
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

    def _try_write(self, c: _Client, notify: bool = True) -> bool:
        before = len(c.out) if notify else 0
        while c.out:
            try:
                n = c.sock.send(c.out)
            except (BlockingIOError, InterruptedError):
                self._retry_soon()
                break
            except OSError as e:
                if self.by_no.get(c.no) is not c:  # lingering: what it still had to send is lost
                    c.out.clear()
                    return False
                self._drop(c, f"write error: {e}")
                return False
            del c.out[:n]
        if len(c.out) <= CLIENT_BACKLOG < before and self.by_no.get(c.no) is c:
            self.frontend.drained(self.now, c.no)  # the client reads again: link credit goes back
        return True

    def _retry_soon(self) -> None:
        if not self.retrying:
            self.retrying = True
            self.wakeupAfter(RETRY_WRITE, payload="write")

    def _wakeup(self, payload: Any) -> None:
        if payload == "write":
            self.retrying = False
            for c in [*self.clients.values(), *(c for c, _ in self.lingering.values())]:
                if c.out:
                    self._try_write(c)
        elif payload == "linger":
            self.linger_wakeup = False
            for fd, (_, deadline) in list(self.lingering.items()):
                if deadline <= self.now:
                    self._end_linger(fd)
            if self.lingering:
                self.linger_wakeup = True
                self.wakeupAfter(max(0.05, min(d for _, d in self.lingering.values()) - self.now), payload="linger")
        elif payload == "tick":
            self.ticking = False
            self.frontend.tick(self.now)

    # ---- FrontEndHost ---------------------------------------------------------------------------
    def fe_write(self, no: int, data: bytes) -> bool:
        c = self.by_no.get(no)
        if c is None:
            return False
        if c.tls is not None:
            data = c.tls.send(data)
            if not data:
                return not c.tls.failed  # held until the handshake completes
        return self._write(c, data)

    def fe_close(self, no: int, reason: str, linger: bool = False) -> None:
        c = self.by_no.get(no)
        if c is None:
            return
        if linger:  # the client closes (it got close-ok); a TLS client sends its close_notify
            self._try_write(c)
            if self.by_no.get(c.no) is c:
                self._linger(c)
            return
        if c.tls is not None:
            bye = c.tls.close()
            if bye and not self._write(c, bye):
                return
        self._try_write(c)
        self._forget(c)

    def fe_backlog(self, no: int) -> int:
        c = self.by_no.get(no)
        return len(c.out) if c is not None else 0

    def fe_send(self, dst: str, msg: Any) -> None:
        self.post(dst, msg)

    def outbox_gave_up(self, dst: str) -> None:
        """What was posted to ``dst`` is dropped: the connections hear of it."""
        fe = self.fe
        if fe is not None:
            self.as_turn(lambda: fe.message(self.now, None, LinkLost(dst)))

    def fe_agent(self, msg: Any) -> None:
        self.post(self.agent, msg)

    def fe_manager(self, msg: Any) -> None:
        self.post(self.manager, msg)

    def fe_tick_soon(self) -> None:
        if not self.ticking:
            self.ticking = True
            self.wakeupAfter(TICK, payload="tick")

    def fe_log(self, event: str, level: str, fields: dict) -> None:
        self.log(event, level=level, **fields)


def _listen(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s
