"""Helper processes a node's actors start (the asyncio AMQP shell, the management server).

Such a process is started from an actor's process with ``subprocess``, so
it is in the node's process group and dies with a killed node.  It runs the
node's own code (:func:`code_env` puts the directory this package was
imported from first on ``PYTHONPATH``), talks to its actor through one end
of a ``socketpair``, and is stopped by :func:`stop` (the socket closed --
the child exits on end-of-file -- then SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import os
import socket
import subprocess

#: seconds a child has to exit on SIGTERM before SIGKILL
STOP_GRACE = 2.0


def code_env(extra: dict | None = None) -> dict:
    """This process's environment with the node's code first on ``PYTHONPATH``, plus ``extra``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def close(sock: socket.socket | None) -> None:
    if sock is not None:
        try:
            sock.close()
        except OSError:
            pass


def stop(sock: socket.socket | None, proc: subprocess.Popen | None, grace: float = STOP_GRACE) -> None:
    """Close our end of the pair and end the process (SIGTERM, SIGKILL past ``grace``), reaped."""
    close(sock)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)
