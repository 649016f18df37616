"""The Spark side's view of one mirrored queue: bounds, range reads, commits, publishes.

:class:`QueueHandle` speaks :mod:`mirrorq.amqp.stream`'s extensions through
:mod:`mirrorq.amqp.client` to any node of the cluster (every node routes to the
queue's master).  It fails over on its own: a call that meets a lost
connection, a silent master (a request in flight to a master that died is
never answered) or a queue without a master yet (404 during a promotion)
is retried on the next node until ``timeout`` runs out; refusals that
retrying cannot fix (403 another consumer, 406 a bad range) are raised at
once with the broker's text.  Offsets are the log's and mean the same
message on every replica, so a range read cut by a failover resumes on the
new master right after the last offset it returned.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from mirrorq.amqp.client import AmqpError, BlockingClient, ChannelError, Delivery

CALL_TIMEOUT = 8.0  # s: one request (a read chunk of <= 4 MiB, a commit's replication)
FAILOVER_TIMEOUT = 60.0  # s: how long a call keeps trying other nodes
READ_CHUNK = 20000  # messages asked per range-read call (the broker also stops at 4 MiB of bodies)


class QueueError(RuntimeError):
    """A refusal naming what was wrong (403, 406...): retrying will not help."""


def parse_nodes(nodes: str | list) -> list[tuple[str, int]]:
    if isinstance(nodes, str):
        nodes = [n for n in nodes.replace(";", ",").split(",") if n.strip()]
    out = []
    for n in nodes:
        host, _, port = str(n).strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"option 'nodes': expected host:port[,host:port...], got {n!r}")
        out.append((host, int(port)))
    if not out:
        raise ValueError("option 'nodes' is required: host:port[,host:port...] of the cluster's AMQP listeners")
    return out


class QueueHandle:
    def __init__(
        self,
        nodes: str | list,
        queue: str,
        *,
        vhost: str = "/",
        user: str = "guest",
        password: str = "guest",
        timeout: float = FAILOVER_TIMEOUT,
        start_node: int = 0,
    ):
        self.nodes = parse_nodes(nodes)
        self.queue, self.vhost, self.user, self.password = queue, vhost, user, password
        self.timeout = timeout
        self._i = start_node % len(self.nodes)
        self._client: BlockingClient | None = None
        self.failovers = 0

    # ---- connection and retry --------------------------------------------------------
    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _connect(self, deadline: float) -> BlockingClient:
        if self._client is None or self._client.closed:
            host, port = self.nodes[self._i]
            self._client = BlockingClient(
                host, port, user=self.user, password=self.password, vhost=self.vhost, deadline=deadline
            )
        return self._client

    def call(self, fn: Callable[[BlockingClient, float], Any], what: str) -> Any:
        end = time.monotonic() + self.timeout
        last: Exception | None = None
        while time.monotonic() < end:
            try:
                c = self._connect(min(end, time.monotonic() + CALL_TIMEOUT))
                return fn(c, min(end, time.monotonic() + CALL_TIMEOUT))
            except ChannelError as e:
                self.close()
                if e.code in (403, 405, 406, 530, 540):
                    raise QueueError(f"{what} on queue '{self.queue}': {e.text}") from None
                last = e  # 404 (no master during a promotion), 541...: try again
            except (AmqpError, OSError) as e:
                self.close()
                last = e
            self.failovers += 1
            self._i = (self._i + 1) % len(self.nodes)
            time.sleep(0.2)  # back off before the next node: a promotion takes about a second
        raise QueueError(
            f"{what} on queue '{self.queue}' failed on every node for {self.timeout:.0f} s; last error: {last}"
        )

    # ---- operations ---------------------------------------------------------------------
    def _control(self, args: dict, what: str) -> dict:
        def fn(c: BlockingClient, deadline: float) -> dict:
            got = c.stream(self.queue, args, deadline, no_ack=True)
            if len(got) != 1:
                raise AmqpError(0, f"{what}: expected one answer, got {len(got)}")
            return json.loads(got[0].body)

        return self.call(fn, what)

    def bounds(self, start: int | None = None, max_messages: int | None = None, until: int | None = None) -> dict:
        args: dict = {"x-stream-control": "bounds"}
        if until is not None:
            args["x-stream-end-offset"] = int(until)
        if start is not None:
            args["x-stream-offset"] = int(start)
        if max_messages is not None:
            args["x-stream-max-messages"] = int(max_messages)
        return self._control(args, "bounds")

    def list_queues(self, pattern: str | None = None) -> list[str]:
        """The vhost's range-readable queues (whose name ``pattern`` matches whole), sorted."""
        args: dict = {"x-stream-control": "queues"}
        if pattern is not None:
            args["x-stream-queue-pattern"] = pattern
        return list(self._control(args, "list queues")["queues"])

    def commit(self, end: int) -> dict:
        """Remove every message below ``end``; returns once replicated (idempotent)."""
        return self._control({"x-stream-control": "commit", "x-stream-commit-offset": int(end)}, f"commit below {end}")

    def read(self, start: int, end: int, chunk: int = READ_CHUNK) -> Iterator[Delivery]:
        """The live messages at offsets in ``[start, end)``, in offset order,
        removing nothing; a failover resumes after the last one returned."""
        for got in self.read_chunks(start, end, chunk):
            yield from got

    def read_chunks(self, start: int, end: int, chunk: int = READ_CHUNK) -> Iterator[list[Delivery]]:
        """:meth:`read`, one list per range-read call."""
        pos = start
        while pos < end:
            args = {"x-stream-offset": pos, "x-stream-end-offset": end, "x-stream-max-messages": chunk}

            def fn(c: BlockingClient, d: float, args: dict[str, Any] = args) -> list[Delivery]:
                return c.stream(self.queue, args, d, no_ack=True)

            got = self.call(fn, f"range read [{pos}, {end})")
            if not got:
                return
            yield got
            pos = offset_of(got[-1]) + 1

    def publish(self, messages: list, exchange: str = "", routing_key: str | None = None) -> int:
        """Publish with confirms; every publish must be confirmed (a nack or
        a lost connection raises after retrying the whole batch, which is
        safe only for messages carrying a publisher ref)."""
        rk = self.queue if routing_key is None else routing_key
        return self.call(lambda c, d: c.publish_confirmed(exchange, rk, messages, d + 30.0), "publish")


def offset_of(d: Delivery) -> int:
    h = d.properties.headers or {}
    o = h.get("x-stream-offset")
    if not isinstance(o, int):
        raise AmqpError(0, f"a range read delivery without an x-stream-offset header: {h!r}")
    return o
