"""The bridge between the asyncio AMQP shell and the node's actors.

A process outside an actor system cannot *receive* Thespian messages (an
``ActorSystem`` handle only gets answers to ``ask``), so the asyncio shell
(:mod:`mirrorq.amqp.aio_shell`) reaches the actors through
:class:`AMQPBridge`, a dumb relay actor in the node's actor system:

* the bridge creates a ``socketpair`` and starts the shell process with one
  end (``pass_fds``; no listening port, so nothing else on the machine can
  write to it -- what crosses it is pickled);
* the shell sends, at most once per event-loop turn, ONE frame carrying
  every actor message of that turn: ``[(dst, msg), ...]`` where ``dst`` is
  an actor's ``"host:port"``, :data:`AGENT` or :data:`MANAGER`; the bridge
  posts each (:class:`~mirrorq.node.posting.PostingActor`: one bundle per
  destination per turn, one in flight, the rest coalescing);
* once it has posted what the frames it read carried, the bridge answers
  ``[(CREDIT, frames)]``: the shell keeps at most
  :data:`~mirrorq.amqp.aio_shell.BRIDGE_WINDOW` frames unanswered and holds
  its clients' bytes meanwhile;
* every message actors send the bridge in one turn (masters' replies,
  registry answers and changes, declare results) goes to the shell as one
  frame ``[(src, msg), ...]``.

The bridge's own address is the front end's ``dst``: masters reply to it.

Framing (:func:`encode` / :class:`Decoder`): a 4-byte big-endian length,
then a pickled list.  A length above :data:`MAX_FRAME`, a payload that does
not unpickle, or one that is not a list raises :class:`BridgeFramingError`
(the reader then drops the link: the two ends are one program, so a bad
frame is a bug, not input to tolerate).  What one side has for the other
in a turn leaves in frames of at most
:data:`~mirrorq.bounds.MAX_BATCH_BYTES` of messages (:func:`frames`,
estimated with :func:`~mirrorq.bounds.size_of`; a bigger message alone),
so no frame outgrows :data:`MAX_FRAME`, the largest message between two
processes (:data:`~mirrorq.bounds.MAX_WIRE_BYTES`).

Control items (never sent to actors): the shell's first frame is
``[(READY, port)]`` or ``[(FAILED, text)]`` (answered to the daemon's
``ListenerInit`` as ``ListenerReady``); ``(STATUS, None)`` asks the shell
for its status, answered ``(STATUS, dict)``; ``(QUERY, FrontEndQuery)``
(a tool's: list or close connections) is answered ``(QUERY,
FrontEndAnswer)``, in order.

Fails: if the shell process exits (or its end of the socket closes) the
bridge logs it and exits with the node's AMQP front end gone
(``ActorExitRequest`` to itself; the node is otherwise unaffected); if the
bridge goes away the shell sees end-of-file and exits.  A stopping node
sends the bridge ``ActorExitRequest``: it terminates the shell (SIGTERM,
then SIGKILL after :data:`STOP_GRACE` seconds).  The shell process is
in the node's process group (started from an actor process, which is), so
killing the node's group kills it too.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
from collections import deque
from typing import Any

from mirrorq.bounds import MAX_WIRE_BYTES, batches, size_of

HEADER = struct.Struct(">I")
MAX_FRAME = MAX_WIRE_BYTES
AGENT = "@agent"
MANAGER = "@manager"
READY = "@ready"
FAILED = "@failed"
STATUS = "@status"
QUERY = "@query"
CREDIT = "@credit"
READ_CHUNK = 1 << 20
RETRY_WRITE = 0.005
STOP_GRACE = 2.0


class BridgeFramingError(ValueError):
    pass


def frames(items: list) -> list[bytes]:
    """``items`` (pairs ``(dst or src, message)``) as frames, in order, each
    of at most MAX_BATCH_BYTES of messages (a bigger message alone)."""
    return [encode(run) for run in batches(items, _item_size)]


def _item_size(item: tuple) -> int:
    return size_of(item[1])


def encode(items: list) -> bytes:
    """One frame carrying ``items`` (a list of pairs)."""
    if not isinstance(items, list):
        raise BridgeFramingError(f"a bridge frame carries a list, got {type(items).__name__}")
    payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_FRAME:
        raise BridgeFramingError(f"bridge frame of {len(payload)} bytes exceeds MAX_FRAME ({MAX_FRAME})")
    return HEADER.pack(len(payload)) + payload


class Decoder:
    """Splits a byte stream into frames; :meth:`feed` returns the complete ones' lists."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[list]:
        self.buf += data
        out = []
        buf = self.buf
        pos = 0
        while len(buf) - pos >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, pos)
            if n > self.max_frame:
                raise BridgeFramingError(f"bridge frame length {n} exceeds the maximum ({self.max_frame})")
            if len(buf) - pos - HEADER.size < n:
                break
            start = pos + HEADER.size
            try:
                items = pickle.loads(buf[start : start + n])
            except Exception as e:
                raise BridgeFramingError(
                    f"bridge frame of {n} bytes does not unpickle: {type(e).__name__}: {e}"
                ) from None
            if not isinstance(items, list):
                raise BridgeFramingError(f"a bridge frame carries a list, got {type(items).__name__}")
            out.append(items)
            pos = start + n
        if pos:
            del buf[:pos]
        return out


# ---- the relay actor ------------------------------------------------------------------------
from thespian.actors import ActorExitRequest, ThespianWatch, WakeupMessage, WatchMessage  # noqa: E402

from mirrorq.amqp.frontend import FrontEndQuery, LinkLost  # noqa: E402
from mirrorq.amqp.listener import ListenerInit, ListenerReady, ListenerStatusQuery  # noqa: E402
from mirrorq.node import child  # noqa: E402
from mirrorq.node.addresses import address_host_port, address_key  # noqa: E402
from mirrorq.node.log import NodeLog  # noqa: E402
from mirrorq.node.posting import PostingActor, RecvBuffer  # noqa: E402

START_TIMEOUT = 10.0


class AMQPBridge(PostingActor):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.decoder = Decoder()
        self.rbuf = RecvBuffer(READ_CHUNK)
        self.pending: deque = deque()  # (dst, msg) to send to actors
        self.uncredited = 0  # frames read whose sends are not all out
        self.out = bytearray()
        self.retrying = False
        self.starter = None  # who waits for ListenerReady
        self.status_askers: list = []
        self.query_askers: deque = deque()  # tools waiting for a FrontEndQuery answer, in order
        self.log: NodeLog | None = None
        self.stats = {"frames_in": 0, "frames_out": 0, "sent": 0, "relayed": 0}
        self.relay: list = []  # actors' messages of this turn, for the shell

    def receiveMessage(self, msg, sender):
        super().receiveMessage(msg, sender)
        return self._watch()

    def end_turn(self) -> None:
        if self.relay and self.sock is not None:
            items, self.relay = self.relay, []
            self._to_shell(items)

    def on_message(self, msg, sender):
        if isinstance(msg, ListenerInit):
            self._init(msg, sender)
        elif self.sock is None:
            return None
        elif isinstance(msg, WatchMessage):
            self._read(self.sock)
        elif isinstance(msg, WakeupMessage):
            if msg.payload == "write":
                self.retrying = False
                self._flush()
            elif msg.payload == "start" and self.starter is not None:
                self._failed(f"the asyncio shell did not start within {START_TIMEOUT:.0f}s")
        elif isinstance(msg, ListenerStatusQuery):
            self.status_askers.append(sender)
            self._to_shell([(STATUS, None)])
        elif isinstance(msg, FrontEndQuery):
            self.query_askers.append(sender)
            self._to_shell([(QUERY, msg)])
        elif isinstance(msg, ActorExitRequest):
            self._stop()
            return None
        else:  # a reply, registry answer or change, declare result: the shell's business
            self.stats["relayed"] += 1
            self.relay.append((address_key(sender), msg))
        return None

    def outbox_gave_up(self, dst: str) -> None:
        """What was posted to ``dst`` is dropped: the shell's front end hears of it."""
        if self.sock is not None:
            self.as_turn(lambda: self.relay.append((None, LinkLost(dst))))

    def _watch(self):
        if self.sock is None:
            return ThespianWatch([])
        return ThespianWatch([self.sock.fileno()])

    # ---- start / stop -------------------------------------------------------------------
    def _init(self, msg: ListenerInit, sender) -> None:
        cfg = msg.config
        self.agent, self.manager = msg.agent, msg.manager
        self.log = NodeLog(cfg.get("data_dir") or ".", cfg["name"], "amqp-bridge")
        hp = address_host_port(self.myAddress)
        assert hp is not None  # the bridge runs in a TCP actor system: its address has a host and port
        mine, theirs = socket.socketpair()
        env = child.code_env()
        out_path = os.path.join(cfg.get("data_dir") or ".", "aio_shell.out")
        try:
            with open(out_path, "ab") as out:
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "mirrorq.amqp.aio_shell",
                        "--fd",
                        str(theirs.fileno()),
                        "--dst",
                        f"{hp[0]}:{hp[1]}",
                        "--config",
                        json.dumps(cfg),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    pass_fds=(theirs.fileno(),),
                    env=env,
                    close_fds=True,
                )
        except OSError as e:
            mine.close()
            theirs.close()
            self.send(sender, ListenerReady(False, error=f"cannot start the asyncio shell: {e}"))
            return
        theirs.close()
        mine.setblocking(False)
        self.sock = mine
        self.starter = sender
        self.log("aio_shell_started", shell_pid=self.proc.pid)
        self.wakeupAfter(START_TIMEOUT, payload="start")

    def _failed(self, error: str) -> None:
        if self.starter is not None:
            self.send(self.starter, ListenerReady(False, error=error))
            self.starter = None
        log = self.log
        assert log is not None  # set by _init, before the socket whose failures come here
        log("aio_shell_failed", level="error", error=error)
        self._stop()
        self.send(self.myAddress, ActorExitRequest())

    def _stop(self) -> None:
        sock, p, self.sock, self.proc = self.sock, self.proc, None, None
        child.stop(sock, p, STOP_GRACE)

    # ---- the socket -------------------------------------------------------------------
    def _read(self, sock: socket.socket) -> None:
        """Read from the shell's socket (``self.sock``)."""
        for _ in range(16):
            try:
                data = self.rbuf.recv(sock)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                return self._failed(f"the asyncio shell's socket failed: {e}")
            if not data:
                code = self.proc.poll() if self.proc is not None else None
                return self._failed(f"the asyncio shell went away (exit code {code})")
            try:
                frames = self.decoder.feed(data)
            except BridgeFramingError as e:
                return self._failed(str(e))
            for items in frames:
                self.stats["frames_in"] += 1
                self.uncredited += 1
                for dst, m in items:
                    if dst == READY:
                        if self.starter is not None:
                            self.send(self.starter, ListenerReady(True, int(m)))
                            self.starter = None
                    elif dst == FAILED:
                        return self._failed(str(m))
                    elif dst == QUERY:
                        if self.query_askers:
                            self.send(self.query_askers.popleft(), m)
                    elif dst == STATUS:
                        for asker in self.status_askers:
                            self.send(asker, {**m, "bridge": dict(self.stats)})
                        self.status_askers = []
                    else:
                        self.pending.append((dst, m))
            if len(data) < READ_CHUNK:
                break
        self._pump()

    def _pump(self) -> None:
        n = 0
        while self.pending:
            dst, m = self.pending.popleft()
            self.post(self.agent if dst == AGENT else self.manager if dst == MANAGER else dst, m)
            n += 1
        self.stats["sent"] += n
        if self.uncredited:
            n, self.uncredited = self.uncredited, 0
            self._to_shell([(CREDIT, n)])

    def _to_shell(self, items: list) -> None:
        for f in frames(items):
            self.out += f
            self.stats["frames_out"] += 1
        self._flush()

    def _flush(self) -> None:
        while self.out and self.sock is not None:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                if not self.retrying:
                    self.retrying = True
                    self.wakeupAfter(RETRY_WRITE, payload="write")
                return
            except OSError as e:
                return self._failed(f"the asyncio shell's socket failed: {e}")
            del self.out[:n]
