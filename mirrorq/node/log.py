"""Structured per-node logs: JSON lines in ``<data_dir>/node.log``.

A component with a log of its own that would drown node.log (the management
server's access log) passes another ``filename`` in the same directory.

Every actor process of a node appends to the same file (O_APPEND), never to
stdout.  Outside :meth:`NodeLog.hold` every line is one write; between
``hold`` and ``release`` lines are kept and written together, in one write,
at ``release`` (a node process holds its lines during a turn and writes them
once the turn's messages have left, so logging is off the path of a
message: :meth:`mirrorq.node.posting.PostingActor._run_turn`).

A write the file system refuses (a full disk) never raises out of a log
call: the lines are dropped and counted, and the first write that succeeds
again starts with a ``log_lines_dropped`` record (how many, the error).  A
line a full disk cut short is ended there (the next write starts on a new
line), and :func:`read` skips it.
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
        self._dropped = 0  # lines the file system refused since the last write that went through
        self._drop_error = ""
        self._torn = False  # the last write was cut short: the next one starts a new line

    def hold(self) -> None:
        """Keep lines until :meth:`release`."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Write the lines kept since :meth:`hold` (one write) and stop keeping."""
        held, self._held = self._held, None
        if held:
            self._write(b"".join(held), len(held))

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
            self._write(line, 1)

    def _write(self, data: bytes, lines: int) -> None:
        head = b"\n" if self._torn else b""
        if self._dropped:
            note = {"ts": round(time.time(), 6), "node": self.node, "pid": os.getpid(), "component": self.component,
                    "level": "warning", "event": "log_lines_dropped", "count": self._dropped, "error": self._drop_error}
            head += (json.dumps(note) + "\n").encode()
        data = head + data
        try:
            n = os.write(self._fd, data)
        except OSError as e:
            self._dropped += lines
            self._drop_error = e.strerror or str(e)
            return
        self._torn = n < len(data)
        if not self._torn:
            self._dropped = 0
            return
        # the file system took only part of it (a full disk): the rest is dropped
        self._dropped = (self._dropped + lines) if n < len(head) else data.count(b"\n", n)
        self._drop_error = "the write was cut short (no space left on the device)"

    def close(self) -> None:
        self.release()
        os.close(self._fd)


def read(data_dir: str, filename: str = "node.log") -> list[dict]:
    """All records of a node's log, oldest first (for tests and tools)."""
    path = os.path.join(data_dir, filename)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line a full disk cut short (see the module docstring)
    return out
