"""The management server process: ``python -m mirrorq.mgmt.server --fd FD --config JSON``.

Started by :class:`mirrorq.mgmt.supervisor.MgmtSupervisor`, never by hand:
``FD`` is its end of the supervisor's socketpair, ``--config`` the node's
config.  It serves :func:`mirrorq.mgmt.api.build_app` on the node's
``host:management_port`` with aiohttp, talking to the node's actors as a
tool does (:class:`~mirrorq.mgmt.source.NodeSource`; the cluster secret
comes from ``$MIRRORQ_SECRET_FILE``, which the supervisor sets).

It writes ``{"ready": port}`` (or ``{"failed": text}`` and exits 1: the
port cannot be bound) as one JSON line on ``FD``, and exits when ``FD``
reaches end-of-file (the supervisor, or the whole node, went away) or on
SIGTERM.  Logs: one JSON line per request (``http_request``: method,
path, status, user, peer, ms) in ``<data_dir>/mgmt.log``; its start,
stop and internal errors in ``node.log`` (component ``mgmt``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys

from aiohttp import web

from mirrorq.mgmt.api import build_app
from mirrorq.mgmt.source import NodeSource
from mirrorq.node.log import NodeLog

ACCESS_LOG = "mgmt.log"


def _tell(sock: socket.socket, msg: dict) -> None:
    try:
        sock.sendall((json.dumps(msg) + "\n").encode())
    except OSError:
        pass


async def serve(cfg: dict, sock: socket.socket) -> int:
    data_dir = cfg.get("data_dir") or "."
    events = NodeLog(data_dir, cfg["name"], "mgmt")
    access = NodeLog(data_dir, cfg["name"], "mgmt", filename=ACCESS_LOG)

    def log(event: str, level: str = "info", **fields) -> None:
        (access if event == "http_request" else events)(event, level, **fields)

    source = NodeSource(cfg, warn=lambda text: events("mgmt_policy_row_invalid", "warning", error=text))
    runner = web.AppRunner(build_app(source, log), access_log=None, handle_signals=False)
    await runner.setup()
    host, port = cfg.get("host") or "127.0.0.1", int(cfg["management_port"])
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        failure = f"cannot listen on {host}:{port}: {e.strerror or e}"
        events("mgmt_listen_failed", "error", error=failure)
        _tell(sock, {"failed": failure})
        await runner.cleanup()
        return 1
    events("mgmt_listening", host=host, port=port, pid=os.getpid())
    _tell(sock, {"ready": port})

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    why = {"reason": ""}

    def supervisor_readable() -> None:
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            why["reason"] = "supervisor gone"
            stop.set()

    def terminated() -> None:
        why["reason"] = "SIGTERM"
        stop.set()

    sock.setblocking(False)
    loop.add_reader(sock.fileno(), supervisor_readable)
    loop.add_signal_handler(signal.SIGTERM, terminated)
    await stop.wait()
    loop.remove_reader(sock.fileno())
    events("mgmt_stopping", reason=why["reason"])
    await runner.cleanup()
    await asyncio.to_thread(source.close)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mirrorq.mgmt.server")
    p.add_argument("--fd", type=int, required=True, help="this process's end of the supervisor's socketpair")
    p.add_argument("--config", required=True, help="the node's config (JSON)")
    a = p.parse_args(argv)
    cfg = json.loads(a.config)
    os.environ.setdefault("THESPIAN_BASE_IPADDR", cfg.get("host") or "127.0.0.1")
    sock = socket.socket(fileno=a.fd)
    return asyncio.run(serve(cfg, sock))


if __name__ == "__main__":
    sys.exit(main())
