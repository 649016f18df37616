"""The history of a nemesis run: JSON lines, one object per operation.

Format (one JSON object per line, in the order the runner saw them)::

    {"type": "invoke"|"ok"|"fail"|"info", "f": F, "value": V, "process": P,
     "time": T, "node": N, ...}

* ``type``: ``invoke`` when a client starts an operation; ``ok`` when it
  definitely happened; ``fail`` when it definitely did not (a nack, a
  declare refused); ``info`` when the outcome is unknown (the connection
  died, the client's own deadline passed: ``"error": "timeout"``).  Every
  ``invoke`` of a publish or declare is followed by exactly one completion
  from the same ``process`` with the same ``value``.
* ``f``: ``publish`` (value: the message id ``"<publisher>-<seq>"``; also
  ``publisher`` and ``seq``), ``consume`` (a delivery; only ``ok`` records,
  at delivery, before the one ``basic.ack`` of that message; also
  ``redelivered``), ``declare`` (value: the queue name), ``connect`` (value:
  the node; ``ok``/``fail``), and the nemesis' own operations, all ``info``
  from ``process`` ``"nemesis"``: ``kill``, ``stop``, ``start``, ``pause``,
  ``resume``, ``partition`` (``value``: the groups, ``mode``: drop|reset),
  ``heal``, ``replicas-restored`` (``value``: seconds since the heal).
* ``time``: seconds since the epoch (``time.time()``, float) when the runner
  recorded it; ``node``: the node a client operation went to.
* Extra keys may appear (``error``, ``latency``); readers ignore what they do
  not know.

:class:`HistoryWriter` appends records from many threads (one lock, one
line per write, flushed), :func:`read` loads a file back.  The Spark audit
(``mirrorq/spark``) reads the same files.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any


class HistoryWriter:
    def __init__(self, path: str | None = None):
        self.path = path
        self._f = open(path, "a", buffering=1) if path else None
        self._lock = threading.Lock()
        self.ops: list[dict] = []

    def record(self, type_: str, f: str, value: Any = None, **extra: Any) -> dict:
        op = {"type": type_, "f": f, "value": value, "time": time.time(), **extra}
        with self._lock:
            self.ops.append(op)
            if self._f is not None:
                self._f.write(json.dumps(op, default=str) + "\n")
        return op

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def excerpt(ops: Iterable[dict], values: set, around: int = 0) -> Iterator[dict]:
    """The operations that concern ``values`` (for a report)."""
    for op in ops:
        if op.get("value") in values:
            yield op
