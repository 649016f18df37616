"""Structured per-node logs: JSON lines in ``<data_dir>/node.log``.

A component with a log of its own that would drown node.log (the management
server's access log) passes another ``filename`` in the same directory.

Every actor process of a node appends to the same file (O_APPEND), never to
stdout.  Outside :meth:`NodeLog.hold` every line is one write; between
``hold`` and ``release`` lines are kept and written together, in one write,
at ``release`` (a node process holds its lines during a turn and writes them
once the turn's messages have left, so logging is off the path of a
message: :meth:`mirrorq.node.posting.PostingActor._run_turn`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


class NodeLog:
    def __init__(self, data_dir: str, node: str, component: str, filename: str = "node.log"):
        self.path = os.path.join(data_dir, filename)
        self.node, self.component = node, component
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._held: list[bytes] | None = None

    def hold(self) -> None:
        """Keep lines until :meth:`release`."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Write the lines kept since :meth:`hold` (one write) and stop keeping."""
        held, self._held = self._held, None
        if held:
            os.write(self._fd, b"".join(held))

    def __call__(self, event: str, level: str = "info", **fields: Any) -> None:
        rec = {
            "ts": round(time.time(), 6),
            "node": self.node,
            "pid": os.getpid(),
            "component": self.component,
            "level": level,
            "event": event,
        }
        rec.update(fields)
        line = (json.dumps(rec, default=str) + "\n").encode()
        if self._held is not None:
            self._held.append(line)
        else:
            os.write(self._fd, line)

    def close(self) -> None:
        self.release()
        os.close(self._fd)


def read(data_dir: str, filename: str = "node.log") -> list[dict]:
    """All records of a node's log, oldest first (for tests and tools)."""
    path = os.path.join(data_dir, filename)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
