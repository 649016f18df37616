"""The asyncio AMQP shell: one process per node serving the AMQP port with asyncio.

``python -m mirrorq.amqp.aio_shell --fd FD --dst HOST:PORT --config JSON`` --
started by :class:`mirrorq.amqp.bridge.AMQPBridge` (node config
``amqp_shell: asyncio``), never by hand: ``FD`` is its end of the bridge's
socketpair, ``dst`` the bridge actor's address (where masters reply).

It runs an asyncio server on the node's ``amqp_port`` and drives one
:class:`~mirrorq.amqp.connection.Connection` core per client through the
shared :class:`~mirrorq.amqp.frontend.FrontEnd`, exactly as the
ThespianWatch listener does; what differs is transport only:

* client sockets are asyncio transports; a connection whose core does not
  ``wants_read()`` (too many unconfirmed publishes, or blocked by a
  resource alarm) is paused (``pause_reading``); after every batch from
  the bridge each paused client is checked again, and after a change of
  the resource alarms every client;
* every message for an actor made during one event-loop turn (all clients'
  publishes, settles, registry requests) leaves in ONE bridge frame, or in
  several if it holds more than :data:`~mirrorq.bounds.MAX_BATCH_BYTES`
  (:func:`mirrorq.amqp.bridge.frames`), flushed by a ``call_soon``
  callback scheduled by the turn's first message; what the bridge relays
  back is handed to the front end in arrival order;
* once :data:`BRIDGE_WINDOW` frames are on their way (not yet answered
  by the bridge's ``CREDIT``) nothing more is flushed: meanwhile what
  clients send is held (up to :data:`HOLD_MAX` bytes per client, then its
  reading pauses) and fed to
  the cores when credit comes back, all of it at once -- so a busy bridge
  gets few, large batches (one ``Publish`` per queue for many reads), as the
  watch listener gets them from the kernel's socket buffer.  Without this
  the fast asyncio reader cuts the stream into many small batches, one
  Thespian send each (tests/test_amqp_bridge.py: 200 pipelined publishes
  went as 200 ``Publish`` messages; with a busy bridge they go as <= 50).

* the node's majority lease (:mod:`mirrorq.node.lease`) is read before the
  front end handles anything (a client's bytes, what the bridge relays, a
  tick), as the watch listener reads it before each message: a node in a
  minority serves no client request from the moment its lease lapses;
* what waits to be written to a client is the transport's buffer; once it
  is down to :data:`~mirrorq.amqp.connection.CLIENT_BACKLOG`
  (``resume_writing``) the front end gives the masters their link credit
  back (:meth:`~mirrorq.amqp.frontend.FrontEnd.drained`).

AMQPS (node config ``amqps_port`` + ``ssl_options``): a second server on
that port with the :func:`mirrorq.amqp.tls.server_context` context
(asyncio's own TLS transport); its clients are opened in the front end once
their handshake completed, with ``ssl`` true and their TLS info items.  A
failed handshake never reaches the front end (asyncio closes the socket).

Measured against the watch shell: see :mod:`mirrorq.amqp.listener`.

It writes its log to ``<data_dir>/node.log`` (component ``aio-shell``) and
its stdout/stderr go to ``<data_dir>/aio_shell.out``.  It exits when the
bridge's socket closes (the bridge actor or the node went away) and on
SIGTERM; it reports a port it cannot bind as ``(FAILED, text)`` and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
import time
from typing import Any, cast

from mirrorq.amqp import bridge as br
from mirrorq.amqp.connection import CLIENT_BACKLOG
from mirrorq.amqp.frontend import TICK, FrontEnd
from mirrorq.amqp.tls import TLSOptionsError, peer_info, server_context
from mirrorq.node.lease import PAUSED, LeaseReader
from mirrorq.node.log import NodeLog
from mirrorq.node.messages import ResourceAlarms

BRIDGE_WINDOW = 1
HOLD_MAX = 1 << 20
#: how long a client sent connection.close-ok has to close its socket (see CloseTransport.linger)
LINGER = 5.0


class _ClientProtocol(asyncio.Protocol):
    def __init__(self, shell: AioShell, port: int = 0, tls: bool = False) -> None:
        self.shell = shell
        self.port, self.tls = port, tls
        self.no = 0
        self.transport: asyncio.Transport | None = None
        self.held = bytearray()
        self.paused = False
        self.lingering = False  # answered with close-ok: what comes is dropped until the client closes

    @property
    def connected_transport(self) -> asyncio.Transport:
        """The transport, once asyncio made the connection (every client in
        :attr:`AioShell.clients` has it: :meth:`connection_made` adds it)."""
        if self.transport is None:
            raise RuntimeError("the client's connection is not made yet")
        return self.transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream server hands its protocols a (read-write) Transport
        transport = self.transport = cast(asyncio.Transport, transport)
        # resume_writing once what waits for the client is down to CLIENT_BACKLOG
        transport.set_write_buffer_limits(high=2 * CLIENT_BACKLOG, low=CLIENT_BACKLOG)
        peer = transport.get_extra_info("peername") or ("?", 0)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.no = self.shell.fe.next_no + 1
        self.shell.clients[self.no] = self
        opened = self.shell.fe.open(
            time.monotonic(), peer[0], int(peer[1]) if len(peer) > 1 else 0, port=self.port or None, ssl=self.tls
        )
        assert opened == self.no, (opened, self.no)
        sslobj = transport.get_extra_info("ssl_object") if self.tls else None
        if sslobj is not None:  # asyncio calls connection_made once the handshake is done
            self.shell.fe.tls_established(self.no, peer_info(sslobj))

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        shell = self.shell
        if shell.inflight < BRIDGE_WINDOW and not self.held:
            now = time.monotonic()
            shell.follow_lease(now)
            shell.fe.data(now, self.no, data)
            shell.check_reading(self)
            return
        if not self.held:
            shell.holding.append(self)
        self.held += data
        if len(self.held) >= HOLD_MAX:
            shell.pause(self)

    def feed_held(self, now: float) -> None:
        data, self.held = bytes(self.held), bytearray()
        self.shell.follow_lease(now)
        if self.shell.clients.get(self.no) is self:
            self.shell.fe.data(now, self.no, data)
            self.shell.check_reading(self)

    def resume_writing(self) -> None:
        if self.shell.clients.get(self.no) is self:
            self.shell.fe.drained(time.monotonic(), self.no)

    def connection_lost(self, exc: Exception | None) -> None:
        self.shell.clients.pop(self.no, None)
        self.held = bytearray()
        self.shell.fe.lost(time.monotonic(), self.no)


class _BridgeProtocol(asyncio.Protocol):
    def __init__(self, shell: AioShell) -> None:
        self.shell = shell
        self.decoder = br.Decoder()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except br.BridgeFramingError as e:
            self.shell.log("bridge_framing_error", level="error", error=str(e))
            self.shell.stop(1)
            return
        for items in frames:
            self.shell.from_bridge(items)

    def connection_lost(self, exc: Exception | None) -> None:
        self.shell.log("bridge_closed", error=str(exc) if exc else "")
        self.shell.stop(0)


class AioShell:
    """The asyncio shell; the front end's host (:class:`~mirrorq.amqp.frontend.FrontEndHost`)."""

    def __init__(self, cfg: dict, dst: str) -> None:
        self.cfg = cfg
        self.log = NodeLog(cfg.get("data_dir") or ".", cfg["name"], "aio-shell")
        self.fe = FrontEnd(
            self,
            node=cfg["name"],
            dst=dst,
            amqp_host=cfg.get("host", "127.0.0.1"),
            amqp_port=int(cfg["amqp_port"]),
            max_message_size=cfg.get("max_message_size"),
        )
        self.clients: dict[int, _ClientProtocol] = {}
        self.lease = LeaseReader(cfg.get("data_dir") or ".")
        self.outbox: list = []
        self.inflight = 0  # bridge frames not yet credited
        self.holding: list[_ClientProtocol] = []  # clients with held bytes, in arrival order
        self.ticking = False
        self.bridge: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.done: asyncio.Future | None = None
        self.stats = {"bridge_frames_out": 0, "bridge_frames_in": 0, "held_feeds": 0}

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop :meth:`run` runs on."""
        if self.loop is None:
            raise RuntimeError("the asyncio shell is not running yet (run sets its loop)")
        return self.loop

    async def run(self, fd: int) -> int:
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        sock = socket.socket(fileno=fd)
        self.bridge, _ = await self.loop.connect_accepted_socket(lambda: _BridgeProtocol(self), sock=sock)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stop, 0)
        host, port = self.cfg.get("host", "127.0.0.1"), int(self.cfg["amqp_port"])
        try:
            server = await self.loop.create_server(
                lambda: _ClientProtocol(self), host, port, reuse_address=True, backlog=128
            )
        except OSError as e:
            self.bridge.write(br.encode([(br.FAILED, f"AMQP port {port}: {e.strerror or e}")]))
            await asyncio.sleep(0)
            return 1
        tls_server = None
        if self.cfg.get("amqps_port"):
            tls_port = int(self.cfg["amqps_port"])
            try:
                ctx = server_context(self.cfg.get("ssl_options") or {})
                tls_server = await self.loop.create_server(
                    lambda: _ClientProtocol(self, tls_port, True),
                    host,
                    tls_port,
                    reuse_address=True,
                    backlog=128,
                    ssl=ctx,
                )
            except (TLSOptionsError, OSError) as e:
                what = f"{e.key}: {e}" if isinstance(e, TLSOptionsError) else f"port {tls_port}: {e.strerror or e}"
                server.close()
                self.bridge.write(br.encode([(br.FAILED, f"AMQPS {what}")]))
                await asyncio.sleep(0)
                return 1
        self.fe.start()
        self._queue(br.READY, server.sockets[0].getsockname()[1])
        self.log("aio_shell_listening", port=port, amqps_port=self.cfg.get("amqps_port") or 0)
        code = await self.done
        server.close()
        if tls_server is not None:
            tls_server.close()
        for c in list(self.clients.values()):
            c.connected_transport.abort()
        return code

    def stop(self, code: int) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(code)

    # ---- the bridge ------------------------------------------------------------------------
    def _queue(self, dst: str, msg: Any) -> None:
        if not self.outbox:
            self.event_loop.call_soon(self._flush_bridge)
        self.outbox.append((dst, msg))

    def _flush_bridge(self) -> None:
        if self.inflight >= BRIDGE_WINDOW or not self.outbox:
            return  # sent when credit comes back
        items, self.outbox = self.outbox, []
        if self.bridge is not None and not self.bridge.is_closing():
            for f in br.frames(items):
                self.bridge.write(f)
                self.inflight += 1
                self.stats["bridge_frames_out"] += 1

    def follow_lease(self, now: float) -> None:
        """Read the majority lease before handling anything (mirrorq.node.lease)."""
        self.fe.follow_lease(now, self.lease.state(now) == PAUSED)

    def from_bridge(self, items: list) -> None:
        self.stats["bridge_frames_in"] += 1
        now = time.monotonic()
        self.follow_lease(now)
        alarms = False  # the cluster's resource alarms changed: any client may be blocked or unblocked
        for src, msg in items:
            if src == br.CREDIT:
                self.inflight -= int(msg)
            elif src == br.QUERY:
                self._queue(br.QUERY, self.fe.query(now, msg))
            elif src == br.STATUS:
                self._queue(
                    br.STATUS,
                    {**self.fe.status(), **self.stats, "paused": sum(c.paused for c in self.clients.values())},
                )
            else:
                alarms = alarms or isinstance(msg, ResourceAlarms)
                self.fe.message(now, src, msg)
        if self.inflight < BRIDGE_WINDOW:
            holding, self.holding = self.holding, []
            if holding:
                self.stats["held_feeds"] += 1
            for c in holding:
                c.feed_held(now)
            if self.outbox:
                self._flush_bridge()
        for c in list(self.clients.values()):
            if c.paused or alarms:
                self.check_reading(c)

    def pause(self, c: _ClientProtocol) -> None:
        if not c.paused:
            c.paused = True
            c.connected_transport.pause_reading()

    def check_reading(self, c: _ClientProtocol) -> None:
        """Pause a client whose core does not want more (too many
        unconfirmed publishes) or whose held bytes are many; resume it
        when neither holds any more."""
        want = self.fe.wants_read(c.no) and len(c.held) < HOLD_MAX
        if c.paused and want:
            c.paused = False
            c.connected_transport.resume_reading()
        elif not c.paused and not want and self.clients.get(c.no) is c:
            self.pause(c)

    # ---- FrontEndHost --------------------------------------------------------------------------
    def fe_write(self, no: int, data: bytes) -> bool:
        c = self.clients.get(no)
        if c is None or c.connected_transport.is_closing():
            return False
        c.connected_transport.write(data)
        return True

    def fe_close(self, no: int, reason: str, linger: bool = False) -> None:
        c = self.clients.pop(no, None)
        if c is None:
            return
        if linger:  # the client closes the socket; we do after LINGER seconds if it does not
            c.lingering = True
            c.held = bytearray()
            if c.paused:
                c.paused = False
                c.connected_transport.resume_reading()
            self.event_loop.call_later(LINGER, c.connected_transport.close)
            return
        c.connected_transport.close()  # after what is buffered is written

    def fe_send(self, dst: str, msg: Any) -> None:
        self._queue(dst, msg)

    def fe_backlog(self, no: int) -> int:
        c = self.clients.get(no)
        return c.transport.get_write_buffer_size() if c is not None and c.transport is not None else 0

    def fe_agent(self, msg: Any) -> None:
        self._queue(br.AGENT, msg)

    def fe_manager(self, msg: Any) -> None:
        self._queue(br.MANAGER, msg)

    def fe_tick_soon(self) -> None:
        if not self.ticking:
            self.ticking = True
            self.event_loop.call_later(TICK, self._tick)

    def fe_log(self, event: str, level: str, fields: dict) -> None:
        self.log(event, level=level, **fields)

    def _tick(self) -> None:
        self.ticking = False
        now = time.monotonic()
        self.follow_lease(now)
        self.fe.tick(now)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mirrorq.amqp.aio_shell")
    ap.add_argument("--fd", type=int, required=True, help="this end of the bridge's socketpair")
    ap.add_argument("--dst", required=True, help="the bridge actor's host:port")
    ap.add_argument("--config", required=True, help="the node's config as JSON")
    a = ap.parse_args(argv)
    cfg = json.loads(a.config)
    shell = AioShell(cfg, a.dst)
    try:
        return asyncio.run(shell.run(a.fd))
    except Exception as e:
        shell.log("aio_shell_crashed", level="error", error=f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    from mirrorq.stack_room import run_with_room

    sys.exit(run_with_room(main))
