"""A registry client: requests to the node agent's registry with ids.

Sans-IO: the caller posts the requests it builds and hands back the answers
it receives.  Every :class:`~mirrorq.node.messages.RegistryGet` and
:class:`~mirrorq.node.messages.RegistryTxn` carries ``ref = (tag, n)``; the
agent echoes it in the :class:`~mirrorq.node.messages.RegistryRows` or
:class:`~mirrorq.node.messages.RegistryResult`, so any number of requests
may be outstanding at once and each answer finds the context it was asked
with, whatever the order answers come in.

Guarantees: an answer is matched to exactly one request (the one whose ref
it echoes) and only once; an answer with a foreign or unknown ref is not
taken (:meth:`RegistryClient.answer` returns None) -- it belongs to someone
else or to a request given up.  Assumes the agent echoes refs unchanged.
Failure: a request the agent never answers (it was dropped while its node
joined, or the agent restarted) is given up after ``timeout`` seconds by
:meth:`RegistryClient.expired`, which returns its context so the caller can
retry or fail what waited on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mirrorq.node.messages import RegistryGet, RegistryResult, RegistryRows, RegistryTxn


class RegistryClient:
    def __init__(self, tag: str, timeout: float = 5.0) -> None:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"a registry client needs a non-empty tag, got {tag!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.tag = tag
        self.timeout = float(timeout)
        self._next = 0
        self._pending: dict[int, tuple[float, Any]] = {}  # n -> (sent at, context)

    def get(self, now: float, table: str, key: Any, context: Any, linearizable: bool = False) -> RegistryGet:
        return RegistryGet(table, key, linearizable, ref=self._ref(now, context))

    def txn(self, now: float, txn: dict, context: Any) -> RegistryTxn:
        return RegistryTxn(txn, ref=self._ref(now, context))

    def answer(self, msg: RegistryRows | RegistryResult) -> Any:
        """The context of the request ``msg`` answers (taken: a second answer
        finds nothing), or None if it is not an answer to this client."""
        ref = getattr(msg, "ref", None)
        if not (isinstance(ref, (tuple, list)) and len(ref) == 2 and ref[0] == self.tag):
            return None
        entry = self._pending.pop(ref[1], None)
        return None if entry is None else entry[1]

    def expired(self, now: float) -> list:
        """Give up the requests unanswered for ``timeout``; their contexts, oldest first."""
        gone = [n for n, (at, _) in self._pending.items() if now - at > self.timeout]
        return [self._pending.pop(n)[1] for n in gone]

    def pending(self) -> Iterator[Any]:
        """Contexts of the outstanding requests, oldest first."""
        return (ctx for _, ctx in self._pending.values())

    def __len__(self) -> int:
        return len(self._pending)

    def _ref(self, now: float, context: Any) -> tuple:
        self._next += 1
        self._pending[self._next] = (now, context)
        return (self.tag, self._next)
