"""Structured per-node logs: JSON lines in ``<data_dir>/node.log``.

A component with a log of its own that would drown node.log (the management
server's access log) passes another ``filename`` in the same directory.

Every actor process of a node appends to the same file (O_APPEND; one line
per write, well under PIPE_BUF for ordinary records), never to stdout.
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
        os.write(self._fd, (json.dumps(rec, default=str) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read(data_dir: str, filename: str = "node.log") -> list[dict]:
    """All records of a node's log, oldest first (for tests and tools)."""
    path = os.path.join(data_dir, filename)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
