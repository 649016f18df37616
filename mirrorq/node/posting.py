"""PostingActor: the Thespian shell of :mod:`mirrorq.outbox` for mirrorq's actors.

A mirrorq actor derives from :class:`PostingActor` and implements
``on_message(msg, sender)`` instead of ``receiveMessage``.  It sends to
other mirrorq actors with :meth:`PostingActor.post` (ordered, coalescing,
one bundle in flight per destination, retried on failure: the protocol is
in :mod:`mirrorq.outbox`) and keeps ``self.send`` for answers to tools that
``ask`` from outside the node (they do not unpack bundles).

One *turn* is one Thespian message handled: every message of a received
:class:`~mirrorq.outbox.Bundle` (in order) or a single plain message.  At
the end of a turn the actor's :meth:`end_turn` runs (a queue replica makes
its store durable there: one fsync per turn) and only THEN does anything
posted during the turn leave.  A transmit that completes between turns
starts the next bundle for that destination at once (from Thespian's
completion callback); one that completes during a turn leaves its
successor to the end of the turn, so no message posted in a turn can
overtake that turn's ``end_turn``.

Transmits use Thespian's ``TransmitIntent`` with success and failure
callbacks (``Actor._myRef._send_intent``: the documented ``Actor.send``
has no outcome), with a bounded period so a transmit stuck on a silent
peer fails and is retried instead of waiting Thespian's default five
minutes.

An actor on the hot path (``fast_links = True``: the queue hosts, the AMQP
front end) sends its bundles on direct links (:mod:`mirrorq.node.link`,
shell: :class:`LinkSockets`) wherever one is up, Thespian otherwise.  A
transmit on a link is done once its bytes are in the socket (while the
link has room for unacknowledged bundles); a link that breaks, stays
silent (no ACK for :data:`TRANSMIT_PERIOD`) or whose bytes the peer's
kernel stops acknowledging (:data:`LINK_USER_TIMEOUT`) hands its
unacknowledged bundles back to the outbox, which replays them in order,
through Thespian or the next link.  Acks owed go out in
front of the next bundle to that peer, or after :data:`ACK_DELAY` when
none comes.  Link
sockets are watched with ``ThespianWatch``: a subclass that watches sockets
of its own names them in :meth:`PostingActor.watching`.  ``MIRRORQ_LINKS=0``
in a node's environment turns links off (Thespian carries everything).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
import traceback
import uuid
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from thespian.actors import Actor, ActorAddress, ActorExitRequest, ThespianWatch, WakeupMessage, WatchMessage
from thespian.system.transport import SendStatus, TransmitIntent

from mirrorq.node import wire
from mirrorq.node.addresses import address_from_text, address_host_port, address_key, address_text, member_host
from mirrorq.node.link import NONCE_LEN, Link, LinkError
from mirrorq.node.log import NodeLog
from mirrorq.outbox import Bundle, Inbox, Outbox


@dataclass
class ToReplica:
    """A message for one queue replica (``member``, its GM member name) of
    the queue host it lives in; the host answers the sender with
    ``NotMaster`` (for a client request) or drops it if no such replica
    lives there any more."""

    member: str
    msg: Any


#: a transmit that has not completed after this long fails (and is retried)
TRANSMIT_PERIOD = timedelta(seconds=10)
#: a plain send (:meth:`PostingActor.send`: an answer to a tool, a status probe)
#: that has not completed after this long fails; Thespian's default is five minutes
SEND_PERIOD = timedelta(seconds=10)
#: Thespian's cap on transmits in progress in one process.  Past it every new
#: transmit waits in one FIFO, whatever its destination: transmits held by a
#: silent peer (until their period ends) then hold up those to live peers.
#: Thespian's default is 20; the bounds above keep a process's transmits in
#: progress to about one per destination plus the plain sends of one
#: ``SEND_PERIOD``, far below this, so the FIFO is never where a send waits.
MAX_PENDING_TRANSMITS = 1000
_RETRY = "mirrorq.outbox.retry"
_LINK_CHECK = "mirrorq.link.check"
_LINK_WRITE = "mirrorq.link.write"
_LINK_ACK = "mirrorq.link.ack"
#: an ACK owed and not paid by a bundle to that peer goes alone after this long (it only
#: frees the sender's copies, which ACK_EVERY bounds): every alone ACK is a wakeup of the
#: receiver's timer and of the sender, turns a lone publisher's chain shares its cores with
ACK_DELAY = 0.25
#: a link whose handshake has not completed after this long is closed
HANDSHAKE_PERIOD = 5.0
#: seconds between link checks while a link has a bundle or a handshake pending
LINK_CHECK_EVERY = 1.0
#: after a link to a peer failed to form or broke, no new one for this long
LINK_BACKOFF = 1.0
#: a link socket whose bytes the peer's kernel has not acknowledged for this long is
#: closed by the kernel (TCP_USER_TIMEOUT), and the link with it: its bundles replay.
#: Without it a link that had bytes in flight when a silent cut began keeps TCP's
#: retransmission backoff (up to two minutes between tries) past the heal, and what
#: is written on it after the heal waits for the next try
LINK_USER_TIMEOUT = 5.0
#: a partial write to a link is retried after this long (ThespianWatch only watches reads)
LINK_WRITE_RETRY = 0.002
READ_CHUNK = 1 << 20


class RecvBuffer:
    """Reads from sockets into one buffer kept for the process's life.

    ``sock.recv(n)`` allocates ``n`` bytes before it reads; for a chunk
    above glibc's mmap threshold (128 KiB) that is an ``mmap``, a shrink
    (``mremap``) to what came and an ``munmap`` when the bytes die, three
    system calls and page faults per read, and a read that finds nothing
    pays for the allocation too.  :meth:`recv` reads into the kept buffer
    and copies out what came.  What it returns is a copy, so one buffer
    serves every socket a single-threaded reader reads."""

    def __init__(self, size: int = READ_CHUNK) -> None:
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)

    def recv(self, sock: socket.socket) -> bytes:
        """What ``sock.recv(size)`` returns (``b""`` at end of stream), raising
        what it raises."""
        n = sock.recv_into(self._buf)
        return bytes(self._view[:n])


#: every link socket of this process, closed in a child Thespian forks from it
#: (the child must not keep its parent's connections open)
_OPEN_SOCKETS: weakref.WeakSet[socket.socket] = weakref.WeakSet()


def _close_inherited() -> None:
    for s in list(_OPEN_SOCKETS):
        try:
            s.close()
        except OSError:
            pass
    _OPEN_SOCKETS.clear()


os.register_at_fork(after_in_child=_close_inherited)


def accept_ready(lsock: socket.socket, at_most: int = 64) -> list[tuple[socket.socket, Any]]:
    """Accept what waits on a non-blocking listen socket: ``(socket, address)``
    pairs, each socket non-blocking with TCP_NODELAY."""
    out = []
    for _ in range(at_most):
        try:
            s, addr = lsock.accept()
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out.append((s, addr))
    return out


def install_transmit_bounds() -> None:
    """Raise Thespian's cap on transmits in progress (:data:`MAX_PENDING_TRANSMITS`)
    in this process and the processes it forks later.  Idempotent."""
    import thespian.system.transport.asyncTransportBase as atb

    atb.MAX_PENDING_TRANSMITS = MAX_PENDING_TRANSMITS


def transmits_in_progress(actor: Actor) -> tuple[int, int]:
    """``(in progress, waiting in Thespian's FIFO)`` of ``actor``'s process."""
    tr = getattr(actor._myRef, "transport", None)
    return getattr(tr, "_aTB_numPendingTransmits", 0), len(getattr(tr, "_aTB_queuedPendingTransmits", ()))


def links_enabled() -> bool:
    return os.environ.get("MIRRORQ_LINKS", "1") != "0"


def link_socket_options(s: socket.socket) -> None:
    """A link socket's options: non-blocking, TCP_NODELAY, :data:`LINK_USER_TIMEOUT`."""
    s.setblocking(False)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(LINK_USER_TIMEOUT * 1000))


class _Conn:
    __slots__ = ("sock", "fd", "link", "expect", "since", "waiting")

    def __init__(self, sock: socket.socket, link: Link, expect: str | None, since: float) -> None:
        self.sock, self.link, self.expect, self.since = sock, link, expect, since
        self.fd = sock.fileno()
        #: seq of the transmit sent on it and not yet reported done (its bytes
        #: still in ``link.out``, or the link's unacknowledged bundles at their limit)
        self.waiting: int | None = None


class LinkSockets:
    """The socket shell of :class:`mirrorq.node.link.Link` for one actor:
    its listen socket, its links, which link it sends to each peer on.
    Its times are ``time.monotonic()`` (whatever clock the actor's cores use)."""

    def __init__(self, actor: PostingActor, host: str, me: str, keys: list[bytes]) -> None:
        self.actor, self.host, self.me, self.keys = actor, host, me, keys
        self.lsock: socket.socket | None = None
        self.port = 0
        self.conns: dict[int, _Conn] = {}
        self.send_on: dict[str, _Conn] = {}  # peer -> the up link bundles to it go on
        self.backoff: dict[str, float] = {}  # peer -> no new link before
        self.check_armed = False
        self.write_armed = False
        self.ack_armed = False
        #: ``(peer, seq)`` of transmits done, for the actor to report (:meth:`take_done`)
        self.done: list[tuple[str, int]] = []
        self.stats = {"linked": 0, "closed": 0, "bundles_out": 0, "bundles_in": 0, "refused": 0}
        self.rbuf = RecvBuffer()

    # ---- listening / connecting ------------------------------------------------------
    def listen_port(self) -> int:
        """The port peers connect to (opened on first use; 0 if it cannot be)."""
        if self.lsock is None and self.port == 0:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((self.host, 0))
                s.listen(64)
                s.setblocking(False)
            except OSError as e:
                s.close()
                self.port = -1
                self.actor.link_event("link_listen_failed", error=str(e))
                return 0
            _OPEN_SOCKETS.add(s)
            self.lsock, self.port = s, s.getsockname()[1]
        return max(self.port, 0)

    def offer(self, peer: str, port: int, now: float) -> None:
        """``peer`` sent through Thespian and listens for links on ``port``."""
        if peer in self.send_on or self.backoff.get(peer, 0.0) > now:
            return
        if any(c.expect == peer for c in self.conns.values()):
            return  # a connect in progress
        host = peer.rsplit(":", 1)[0]
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        link_socket_options(s)
        err = s.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            s.close()
            self.backoff[peer] = now + LINK_BACKOFF
            return
        _OPEN_SOCKETS.add(s)
        c = _Conn(s, Link(self.me, self.keys, connector=True, nonce=os.urandom(NONCE_LEN)), peer, now)
        self.conns[c.fd] = c
        self._arm_check()

    def _accept(self, lsock: socket.socket, now: float) -> None:
        for s, _addr in accept_ready(lsock):
            _OPEN_SOCKETS.add(s)
            link_socket_options(s)
            c = _Conn(s, Link(self.me, self.keys, connector=False, nonce=os.urandom(NONCE_LEN)), None, now)
            self.conns[c.fd] = c
            self._flush(c)
            self._arm_check()

    # ---- what the actor watches and reads ------------------------------------------------
    def fds(self) -> list[int]:
        out = [c.fd for c in self.conns.values()]
        if self.lsock is not None:
            out.append(self.lsock.fileno())
        return out

    def ready(self, fds: list, now: float) -> tuple[list, list]:
        """Read the ready link sockets: ``(bundles, rest)`` -- ``(peer,
        bundle)`` read in order, and the ready fds that are not the links'
        (the subclass's).  Transmits this made done wait in :attr:`done`."""
        bundles: list = []
        rest: list = []
        lsock = self.lsock
        lfd = lsock.fileno() if lsock is not None else -1
        for fd in fds:
            if lsock is not None and fd == lfd:
                self._accept(lsock, now)
                continue
            c = self.conns.get(fd)
            if c is None:
                rest.append(fd)
                continue
            self._read(c, bundles)
        return bundles, rest

    def take_done(self) -> list[tuple[str, int]]:
        """The transmits done since the last call (``(peer, seq)``)."""
        done, self.done = self.done, []
        return done

    def _read(self, c: _Conn, bundles: list) -> None:
        eof = None
        while True:
            try:
                data = self.rbuf.recv(c.sock)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                eof = f"read error: {e}"
                break
            if not data:
                eof = "closed by the peer"
                break
            try:
                r = c.link.receive(data)
            except LinkError as e:
                self.stats["refused"] += 1
                self.actor.link_event("link_refused", level="warning", peer=c.link.peer or c.expect, error=str(e))
                self.close(c, str(e))
                return
            if r.up:
                peer = c.link.peer
                assert peer is not None  # the handshake that brought the link up named the peer
                if c.expect is not None and peer != c.expect:
                    self.close(c, f"the peer at the port {c.expect} named is {peer}")
                    return
                self.stats["linked"] += 1
                self.send_on.setdefault(peer, c)
            if r.acked:
                self._settle(c)
            if r.bundles:
                self.stats["bundles_in"] += len(r.bundles)
                bundles.extend((c.link.peer, b) for b in r.bundles)
            if len(data) < READ_CHUNK:
                break
        if c.link.out:
            self._flush(c)
        if eof is not None and c.fd in self.conns:
            self.close(c, eof)

    # ---- sending -------------------------------------------------------------------------
    def transmit(self, dst: str, b: Bundle, now: float) -> bool | None:
        """Send ``b`` on the link to ``dst`` if one is up: True if the
        transmit is done already (its bytes are in the socket and the link
        has room), False if it completes later (``done`` from :meth:`ready`
        or :meth:`wakeup`, or the link breaks and replays it); None if no
        link to ``dst`` is up."""
        c = self.send_on.get(dst)
        if c is None:
            return None
        try:
            c.link.send_bundle(b, now)
        except LinkError as e:  # too big for a frame
            if not c.link.unacked:
                return None  # nothing of this peer's is on the link: Thespian may carry it
            # what the link holds must arrive first: close it, replaying them and then b
            c.link.unacked.append((b, 0, now))
            c.waiting = b.seq
            self.close(c, str(e))
            return False
        self.stats["bundles_out"] += 1
        self._flush(c)
        self._arm_check()
        if c.fd not in self.conns:
            return False  # the write broke the link: its close handed ``b`` back for replay
        if not c.link.out and c.link.room():
            return True
        c.waiting = b.seq
        return False

    def _settle(self, c: _Conn) -> None:
        """``c``'s waiting transmit is done once its bytes left and acks made room."""
        if c.waiting is not None and not c.link.out and c.link.room():
            peer = c.link.peer
            assert peer is not None  # a transmit waits only on a link that is up (send_on)
            self.done.append((peer, c.waiting))
            c.waiting = None

    def after_turn(self) -> None:
        """Acks owed and not paid by a bundle this turn: written now if
        enough are owed, else after :data:`ACK_DELAY`."""
        later = False
        for c in list(self.conns.values()):
            if c.link.owed:
                if c.link.ack_due():
                    c.link.write_ack()
                    self._flush(c)
                else:
                    later = True
        if later and not self.ack_armed:
            self.ack_armed = True
            self.actor.wakeupAfter(ACK_DELAY, payload=_LINK_ACK)

    def _flush(self, c: _Conn) -> None:
        data = c.link.take()
        if not data:
            self._settle(c)
            return
        try:
            n = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            c.link.unsent(data)
            self.close(c, f"write error: {e}")
            return
        if n < len(data):
            c.link.unsent(data[n:])
            if not self.write_armed:
                self.write_armed = True
                self.actor.wakeupAfter(LINK_WRITE_RETRY, payload=_LINK_WRITE)
        else:
            self._settle(c)

    # ---- timers ----------------------------------------------------------------------------
    def _arm_check(self) -> None:
        if not self.check_armed:
            self.check_armed = True
            self.actor.wakeupAfter(LINK_CHECK_EVERY, payload=_LINK_CHECK)

    def wakeup(self, payload: str, now: float) -> None:
        """A link timer fired (transmits it made done wait in :attr:`done`)."""
        if payload == _LINK_WRITE:
            self.write_armed = False
            for c in list(self.conns.values()):
                if c.link.out and c.fd in self.conns:
                    self._flush(c)
            return
        if payload == _LINK_ACK:
            self.ack_armed = False
            for c in list(self.conns.values()):
                if c.link.write_ack():
                    self._flush(c)
            return
        self.check_armed = False
        period = TRANSMIT_PERIOD.total_seconds()
        for c in list(self.conns.values()):
            if not c.link.up and now - c.since > HANDSHAKE_PERIOD:
                self.close(c, "no handshake")
            elif c.link.unacked and now - c.link.unacked[0][2] > period:
                self.close(c, f"no ACK for {period:.0f}s")
        if any(not c.link.up or c.link.unacked for c in self.conns.values()):
            self._arm_check()

    # ---- closing ---------------------------------------------------------------------------
    def close(self, c: _Conn, why: str) -> None:
        """Close one link; the bundles it holds unacknowledged go back to the
        outbox for replay (through Thespian or another link)."""
        if self.conns.pop(c.fd, None) is None:
            return
        _OPEN_SOCKETS.discard(c.sock)
        try:
            c.sock.close()
        except OSError:
            pass
        self.stats["closed"] += 1
        peer = c.link.peer or c.expect
        if peer is not None:
            self.backoff[peer] = time.monotonic() + LINK_BACKOFF
            if self.send_on.get(peer) is c:
                del self.send_on[peer]
                for other in self.conns.values():
                    if other.link.up and other.link.peer == peer:
                        self.send_on[peer] = other
                        break
        if c.link.up:
            self.actor.link_event("link_closed", peer=peer, reason=why)
        held = [b for b, _n, _t in c.link.unacked]
        c.link.unacked.clear()
        seqs = {b.seq for b in held}
        if self.done and seqs:  # a transmit reported done but not yet acknowledged is replayed instead
            self.done = [(p, s) for p, s in self.done if p != peer or s not in seqs]
        if c.waiting is not None and c.waiting not in seqs and peer is not None:
            self.done.append((peer, c.waiting))  # acknowledged already: done
        c.waiting = None
        if held and peer is not None:
            self.actor._replay(peer, held)

    def close_all(self) -> None:
        for c in list(self.conns.values()):
            self.close(c, "actor stopping")
        if self.lsock is not None:
            _OPEN_SOCKETS.discard(self.lsock)
            self.lsock.close()
            self.lsock = None
        self.port = -1  # no link is offered any more


class PostingActor(Actor):
    """Base class: bundles in, posts out (see the module docstring).

    ``self.now`` is read from ``clock`` once when a turn starts: the one
    time every core called during the turn is handed."""

    clock = staticmethod(time.monotonic)

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.now = self.clock()
        self._outbox: Outbox | None = None
        self._inbox = Inbox()
        self._addrs: dict[str, ActorAddress] = {}
        self._in_turn = False
        self._retry_armed: float | None = None
        #: the message being handled came in a Bundle: its sender is a
        #: PostingActor (answer with post); else a tool's ask (answer with send)
        self.bundled = False
        self._links: LinkSockets | None = None
        self._links_tried = False

    #: send bundles on direct links (:mod:`mirrorq.node.link`) where one is up
    fast_links = False

    # ---- what subclasses implement ----------------------------------------------------
    def on_message(self, msg: Any, sender: Any) -> Any:
        """Handle one message (from a bundle or alone); may return a
        ``ThespianWatch`` (the last one of a turn is returned to Thespian)."""
        raise NotImplementedError

    def end_turn(self) -> None:
        """Called once at the end of every turn, before posted messages leave."""

    def watching(self) -> list[int]:
        """Hook: file descriptors of the subclass's own to watch (their
        readiness comes to ``on_message`` as a ``WatchMessage``)."""
        return []

    def link_event(self, event: str, level: str = "info", **fields: Any) -> None:
        """Hook: something happened to a link (logged with the actor's ``log`` if it has one)."""
        log = getattr(self, "log", None)
        if callable(log):
            try:
                log(event, level=level, **fields)
            except Exception:
                pass

    # ---- posting ----------------------------------------------------------------------
    @property
    def outbox(self) -> Outbox:
        if self._outbox is None:
            self._outbox = Outbox(f"{address_text(self.myAddress)}/{uuid.uuid4().hex[:12]}")
        return self._outbox

    def post(self, dst: Any, msg: Any) -> None:
        """Queue ``msg`` for the mirrorq actor ``dst`` (an ``ActorAddress`` or
        its ``"host:port"`` text) or for the queue replica named ``dst`` (a
        GM member name: the message goes to its queue host wrapped in a
        :class:`ToReplica`); it leaves at the end of the turn (or when the
        bundle in flight to that actor completes)."""
        if isinstance(dst, str):
            host = member_host(dst)
            if host is not None:
                msg, key = ToReplica(dst, msg), host
            else:
                key = dst
        else:
            hp = address_host_port(dst)
            if hp is None:
                # a child just created: its address is local until it reports in
                # (Thespian holds sends to it meanwhile); nothing to order it with
                self.send(dst, msg)
                return
            key = f"{hp[0]}:{hp[1]}"
            self._addrs.setdefault(key, dst)
        self.outbox.post(key, msg)
        if not self._in_turn:
            self._transmit_ready()  # posted from outside a turn (a callback): go now

    def transmit_now(self, dsts: Iterable[str]) -> None:
        """During a turn: transmit what waits for the actors of ``dsts``
        (named as :meth:`post` names them: text addresses or replica names)
        now instead of after ``end_turn`` -- for a subclass whose end of turn
        has posted, to those actors, only what depends on nothing it has
        still to do (a quorum leader's appends, before the host's fsync)."""
        if self._outbox is None:
            return
        keys = {member_host(d) or d for d in dsts}
        for dst, b in self._outbox.take(time.monotonic(), only=keys):
            self._transmit(dst, b)

    def as_turn(self, fn: Any) -> None:
        """Run ``fn()`` as a turn of its own when called from outside one (a
        transport callback): ``end_turn`` runs after it, then its posts leave."""
        if self._in_turn:
            fn()
            return
        self._run_turn(fn, None)

    def send(self, targetAddr: Any, msg: Any) -> None:
        """Thespian's ``send`` with a deadline: the transmit fails after
        :data:`SEND_PERIOD` instead of Thespian's five minutes (a failure to
        deliver goes to the dead letters, as ``Actor.send``'s does)."""
        ref = self._myRef
        ref._send_intent(TransmitIntent(targetAddr, msg, onError=ref.actor_send_fail, maxPeriod=SEND_PERIOD))

    def tell(self, dst: Any, msg: Any, bundled: bool) -> None:
        """``post`` to a PostingActor (``bundled``), plain ``send`` to anyone
        else (a tool asking from outside the node)."""
        if bundled:
            self.post(dst, msg)
        else:
            self.send(dst, msg)

    def answer(self, sender: Any, msg: Any) -> None:
        """Answer the message being handled the way it came (:meth:`tell`)."""
        self.tell(sender, msg, self.bundled)

    # ---- Thespian -----------------------------------------------------------------------
    def receiveMessage(self, msg: Any, sender: Any) -> Any:
        links = self._links if self._links is not None else self._start_links()
        if links is not None:
            if isinstance(msg, WatchMessage):
                return self._with_watch(self._link_ready(links, msg, sender))
            if isinstance(msg, WakeupMessage) and msg.payload in (_LINK_CHECK, _LINK_WRITE, _LINK_ACK):
                self.now = self.clock()
                links.wakeup(msg.payload, time.monotonic())
                self._links_done()
                return self._with_watch(None)
        return self._with_watch(self._turn(msg, sender))

    def _run_turn(self, fn: Any, msg: Any) -> Any:
        """One turn: ``fn()`` (handling ``msg``), then ``end_turn``, then
        what the turn posted leaves, then the log lines of the turn are
        written (a :class:`NodeLog` as ``self.log``: held during the turn)."""
        log = getattr(self, "log", None)
        log = log if isinstance(log, NodeLog) else None
        if log is not None:
            log.hold()
        try:
            self._in_turn = True
            self.now = self.clock()
            try:
                result = fn()
                try:
                    self.end_turn()
                except Exception as e:
                    self.message_failed(msg, e)  # logged; raising would make Thespian retry a bundle the inbox drops
            finally:
                self._in_turn = False
            self._transmit_ready()
            if self._links is not None:
                self._links.after_turn()
                self._links_done()
        finally:
            if log is not None:
                log.release()
        return result

    def _turn(self, msg: Any, sender: Any) -> Any:
        return self._run_turn(lambda: self._handle(msg, sender), msg)

    def _handle(self, msg: Any, sender: Any) -> Any:
        if isinstance(msg, Bundle):
            if msg.link and self._links is not None:
                self._links.offer(address_key(sender), msg.link, time.monotonic())
            return self._bundle(msg, sender)
        if isinstance(msg, WakeupMessage) and msg.payload == _RETRY:
            self._retry_armed = None
            if self._outbox is not None:
                for dst, b in self._outbox.due(time.monotonic()):
                    self._transmit(dst, b)
                self._arm_retry()
            return None
        result = self._one(msg, sender)
        if isinstance(msg, ActorExitRequest) and self._links is not None:
            self._links.close_all()
        return result

    def _bundle(self, b: Bundle, sender: Any) -> Any:
        result = None
        if self._inbox.accept(b):
            self.bundled = True
            try:
                for m in b.msgs:
                    result = self._one(m, sender)
            finally:
                self.bundled = False
        return result

    def _link_ready(self, links: LinkSockets, msg: WatchMessage, sender: Any) -> Any:
        """Link sockets ready: transmits that acks made room for complete
        (outside a turn, like Thespian's callbacks), the bundles read are handled as ONE
        turn, together with the subclass's own ready sockets."""
        bundles, rest = links.ready(msg.ready, time.monotonic())
        if rest:  # a link closed outside a turn may have left its fd number to a socket of Thespian's
            mine = set(self.watching())
            rest = [fd for fd in rest if fd in mine]
        self._links_done()
        if not bundles and not rest:
            return None

        def handle() -> Any:
            result = None
            for peer, b in bundles:
                result = self._bundle(b, self._addr(peer))
            if rest:
                result = self._one(WatchMessage(rest), sender)
            return result

        return self._run_turn(handle, msg)

    def _with_watch(self, result: Any) -> Any:
        fds = self.watching()
        if self._links is not None:
            fds = fds + self._links.fds()
        if isinstance(result, ThespianWatch):
            fds = fds + list(result.filenos)
        elif not fds:
            return result
        return ThespianWatch(fds)

    def _start_links(self) -> LinkSockets | None:
        if self._links_tried or not self.fast_links:
            return None
        self._links_tried = True
        hp = address_host_port(self.myAddress)
        keys = list(wire.serializer().keys)
        if hp is None or not keys or not links_enabled():
            return None
        self._links = LinkSockets(self, hp[0], f"{hp[0]}:{hp[1]}", keys)
        return self._links

    def _one(self, msg: Any, sender: Any) -> Any:
        """One message: a failure is logged and stops only this message (the
        rest of its bundle is handled; Thespian would retry the whole bundle,
        which the inbox then drops as a duplicate)."""
        try:
            return self.on_message(msg, sender)
        except Exception as e:
            self.message_failed(msg, e)
            return None

    def message_failed(self, msg: Any, exc: BaseException) -> None:
        """Hook: handling ``msg`` raised ``exc`` (default: logged)."""
        text = "".join(traceback.format_exception(exc))
        what = "a callback's turn" if msg is None else type(msg).__name__
        logging.getLogger("mirrorq").error("%s failed on %s: %s", type(self).__name__, what, text)
        log = getattr(self, "log", None)
        if callable(log):
            try:
                log(
                    "message_failed",
                    level="error",
                    actor=type(self).__name__,
                    message=what,
                    error=f"{type(exc).__name__}: {exc}",
                    traceback=text[-4000:],
                )
            except Exception:
                pass

    # ---- transmits ------------------------------------------------------------------------
    def _transmit_ready(self) -> None:
        if self._outbox is None:
            return
        for dst, b in self._outbox.take(time.monotonic()):
            self._transmit(dst, b)

    def _addr(self, dst: str) -> ActorAddress:
        a = self._addrs.get(dst)
        if a is None:
            a = self._addrs[dst] = address_from_text(dst)
        return a

    def _transmit(self, dst: str, b: Bundle) -> None:
        links = self._links
        if links is not None:
            sent = links.transmit(dst, b, time.monotonic())
            if sent is not None:
                if sent:
                    self._done(dst, b.seq, None)
                self._links_done()
                return
            port = links.listen_port()
            if port:
                b = replace(b, link=port)  # the receiver connects back; same seq, same messages
        seq = b.seq

        def ok(_result: Any, _intent: Any) -> None:
            self._done(dst, seq, None)

        def err(result: Any, _intent: Any) -> None:
            self._done(dst, seq, result)

        self._myRef._send_intent(
            TransmitIntent(self._addr(dst), b, onSuccess=ok, onError=err, maxPeriod=TRANSMIT_PERIOD)
        )

    def _done(self, dst: str, seq: int, failure: Any) -> None:
        ob = self._outbox
        assert ob is not None  # a transmit is made of a bundle the outbox handed out
        now = time.monotonic()
        if failure is None:
            # during a turn the successor waits for the end of the turn (end_turn first)
            for d, b in ob.sent(dst, seq, now, start_next=not self._in_turn):
                self._transmit(d, b)
            return
        dead = failure == SendStatus.DeadTarget
        delay = ob.failed(dst, seq, now, dead=dead)
        if not self._in_turn:
            self.now = self.clock()  # the hooks below may run cores: hand them a current time
        self.transmit_failed(dst, dead)
        if delay is None:
            self.outbox_gave_up(dst)
        else:
            self._arm_retry()

    def _links_done(self) -> None:
        """Report the transmits the links made done (outside a turn, like
        Thespian's callbacks; during one, their successors wait for its end)."""
        links = self._links
        while links is not None and links.done:
            for peer, seq in links.take_done():
                self._done(peer, seq, None)

    def _replay(self, dst: str, bundles: list) -> None:
        """A link to ``dst`` broke holding ``bundles`` unacknowledged: the
        outbox sends them again, in order, before anything newer (at the end
        of the turn when this is one)."""
        if self._outbox is None:
            return
        self._outbox.replay(dst, bundles)
        if not self._in_turn:
            self._transmit_ready()

    def _arm_retry(self) -> None:
        at = self._outbox.next_retry() if self._outbox is not None else None
        if at is None or (self._retry_armed is not None and self._retry_armed <= at):
            return
        self._retry_armed = at
        self.wakeupAfter(max(0.0, at - time.monotonic()), payload=_RETRY)

    def transmit_failed(self, dst: str, dead: bool) -> None:
        """Hook: a transmit to ``dst`` failed (``dead``: nothing listens there);
        it will be retried (see :mod:`mirrorq.outbox`)."""

    def outbox_gave_up(self, dst: str) -> None:
        """Hook: ``dst`` was given up (dead); its pending messages were dropped."""
