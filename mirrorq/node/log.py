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
call: the lines are kept (up to :data:`BACKLOG_BYTES`; past that they are
dropped and counted) and written, with their own times, before the next
line once a write goes through again, after a ``log_lines_dropped`` record
if any were dropped (how many, the error).  A line a full disk cut short is
ended there (the next write starts on a new line) and skipped by
:func:`read`; the whole line is kept with the refused ones and written again.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

#: bytes of log lines a process keeps while the file system refuses them
BACKLOG_BYTES = 256 * 1024


class NodeLog:
    def __init__(self, data_dir: str, node: str, component: str, filename: str = "node.log"):
        self.path = os.path.join(data_dir, filename)
        self.node, self.component = node, component
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._held: list[bytes] | None = None
        self._backlog = bytearray()  # whole lines the file system refused, to write first
        self._dropped = 0  # lines lost (past BACKLOG_BYTES, or cut short) since the last write that went through
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
            note = {
                "ts": round(time.time(), 6),
                "node": self.node,
                "pid": os.getpid(),
                "component": self.component,
                "level": "warning",
                "event": "log_lines_dropped",
                "count": self._dropped,
                "error": self._drop_error,
            }
            head += (json.dumps(note) + "\n").encode()
        body = bytes(self._backlog) + data
        try:
            n = os.write(self._fd, head + body)
        except OSError as e:
            self._drop_error = e.strerror or str(e)
            self._keep(data, lines)
            return
        self._torn = n < len(head) + len(body)
        if not self._torn:
            self._dropped = 0
            self._backlog.clear()
            return
        # the file system took only part of it (a full disk): the line cut short is kept whole with the rest
        self._drop_error = "the write was cut short (no space left on the device)"
        written = n - len(head)
        if written <= 0:
            self._keep(data, lines)
            return
        rest = body[body.rfind(b"\n", 0, written) + 1 :]
        self._dropped = 0
        self._backlog.clear()
        self._keep(rest, rest.count(b"\n"))

    def _keep(self, data: bytes, lines: int) -> None:
        """Keep refused lines to write later, as long as the backlog has room."""
        if len(self._backlog) + len(data) <= BACKLOG_BYTES:
            self._backlog += data
        else:
            self._dropped += lines

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
