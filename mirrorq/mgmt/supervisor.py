"""The actor that keeps a node's management server process running.

Created by the node daemon (global name :data:`SUPERVISOR_GLOBAL_NAME`)
after the AMQP listener and told :class:`MgmtInit` (the node's config); the
daemon does not wait for the server, so a node's start does not pay the
server's imports.  The supervisor:

* makes a ``socketpair`` and starts ``python -m mirrorq.mgmt.server`` with
  one end (``pass_fds``), the same ``PYTHONPATH`` root as the node's code,
  ``$MIRRORQ_SECRET_FILE`` naming the cluster secret (the server talks to
  the node's actors as a tool does) and its output in
  ``<data_dir>/mgmt.out``.  The process is a child of this actor's process,
  so it is in the node's process group: ``kill_node`` (SIGKILL of the group)
  kills it with the node;
* watches its end of the pair (``ThespianWatch``): the server writes one JSON
  line ``{"ready": port}`` or ``{"failed": text}``; end-of-file means the
  process is gone.  It is then reaped and started again after a backoff
  (:data:`RESTART_MIN` doubling to :data:`RESTART_MAX`; back to the minimum
  once a server lived :data:`STABLE_AFTER` seconds).  A port taken by
  someone else is one such failure: the node keeps serving AMQP and the
  supervisor keeps trying;
* on ``ActorExitRequest`` (a graceful node stop shuts the actor system
  down) closes its end -- the server exits on end-of-file -- and terminates
  the process (SIGTERM, then SIGKILL after :data:`STOP_GRACE` seconds);
* answers :class:`MgmtStatusQuery` with a dict (pid, port, ready, starts,
  last exit) for tools and tests.

Every start, readiness, exit and restart is a ``node.log`` line (component
``mgmt-supervisor``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from thespian.actors import Actor, ActorExitRequest, ThespianWatch, WakeupMessage, WatchMessage

from mirrorq.node import child
from mirrorq.node.log import NodeLog

SUPERVISOR_GLOBAL_NAME = "mirrorq.mgmt_supervisor"
RESTART_MIN = 0.5
RESTART_MAX = 30.0
STABLE_AFTER = 60.0
STOP_GRACE = 2.0
_RESTART = "mirrorq.mgmt.restart"


@dataclass
class MgmtInit:
    config: dict


@dataclass
class MgmtStatusQuery:
    pass


def server_command(fd: int, config: dict) -> list[str]:
    return [sys.executable, "-m", "mirrorq.mgmt.server", "--fd", str(fd), "--config", json.dumps(config)]


class MgmtSupervisor(Actor):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.cfg: dict[str, Any] | None = None
        self.log: NodeLog | None = None
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.buf = b""
        self.ready_port: int | None = None
        self.started_at = 0.0
        self.starts = 0
        self.backoff = RESTART_MIN
        self.restart_armed = False
        self.last_exit: dict | None = None
        self.stopping = False

    @property
    def node_log(self) -> NodeLog:
        """The node.log writer, once :class:`MgmtInit` opened it."""
        if self.log is None:
            raise RuntimeError("the management supervisor has no log yet (no MgmtInit)")
        return self.log

    def receiveMessage(self, msg: Any, sender: Any) -> ThespianWatch | None:
        if isinstance(msg, MgmtInit):
            if self.cfg is None:
                self.cfg = dict(msg.config)
                self.log = NodeLog(self.cfg.get("data_dir") or ".", self.cfg["name"], "mgmt-supervisor")
                self._start()
        elif isinstance(msg, WatchMessage):
            if self.sock is not None:
                self._read(self.sock)
        elif isinstance(msg, WakeupMessage):
            if msg.payload == _RESTART:
                self.restart_armed = False
                if self.proc is None and not self.stopping:
                    self._start()
        elif isinstance(msg, MgmtStatusQuery):
            self.send(
                sender,
                {
                    "pid": self.proc.pid if self.proc is not None else None,
                    "port": self.cfg.get("management_port") if self.cfg else None,
                    "ready": self.ready_port is not None,
                    "starts": self.starts,
                    "last_exit": self.last_exit,
                },
            )
        elif isinstance(msg, ActorExitRequest):
            self.stopping = True
            self._stop()
            return None
        return ThespianWatch([self.sock.fileno()]) if self.sock is not None else None

    # ---- the process ----------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.cfg
        assert cfg is not None  # MgmtInit set it: the first start follows it, every restart follows a start
        mine, theirs = socket.socketpair()
        env = child.code_env({"MIRRORQ_SECRET_FILE": cfg["secret_file"]} if cfg.get("secret_file") else None)
        out_path = os.path.join(cfg.get("data_dir") or ".", "mgmt.out")
        try:
            with open(out_path, "ab") as out:
                self.proc = subprocess.Popen(
                    server_command(theirs.fileno(), cfg),
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
            self.node_log("mgmt_start_failed", level="error", error=str(e))
            self._schedule_restart()
            return
        theirs.close()
        mine.setblocking(False)
        self.sock, self.buf, self.ready_port = mine, b"", None
        self.started_at = time.monotonic()
        self.starts += 1
        self.node_log("mgmt_started", server_pid=self.proc.pid, port=cfg.get("management_port"), start=self.starts)

    def _read(self, sock: socket.socket) -> None:
        """Read what the server wrote on its end of the pair (``self.sock``)."""
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            return self._exited()
        proc = self.proc
        assert proc is not None  # started with the socket (_start), forgotten with it
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if "ready" in m:
                self.ready_port = int(m["ready"])
                self.node_log("mgmt_ready", server_pid=proc.pid, port=self.ready_port)
            elif "failed" in m:
                self.node_log("mgmt_failed", level="error", server_pid=proc.pid, error=str(m["failed"]))

    def _exited(self) -> None:
        """The server's end closed: it is gone (or going); reap it, start another later."""
        self._close_sock()
        p, self.proc = self.proc, None
        code = None
        if p is not None:
            try:
                code = p.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:  # closed its end but lives on: end it
                p.kill()
                code = p.wait(STOP_GRACE)
        lived = time.monotonic() - self.started_at
        if lived >= STABLE_AFTER:
            self.backoff = RESTART_MIN
        self.last_exit = {"code": code, "lived": round(lived, 3)}
        self.node_log("mgmt_exited", level="warning", exit_code=code, lived=round(lived, 3), restart_in=self.backoff)
        if not self.stopping:
            self._schedule_restart()

    def _schedule_restart(self) -> None:
        if self.restart_armed:
            return
        self.restart_armed = True
        self.wakeupAfter(self.backoff, payload=_RESTART)
        self.backoff = min(RESTART_MAX, self.backoff * 2)

    def _close_sock(self) -> None:
        child.close(self.sock)
        self.sock = None

    def _stop(self) -> None:
        sock, p, self.sock, self.proc = self.sock, self.proc, None, None
        child.stop(sock, p, STOP_GRACE)
        if self.log is not None and p is not None:
            self.log("mgmt_stopped", server_pid=p.pid)
