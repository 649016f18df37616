"""The internal client: drive mirrored queues from tests, benches and the demo.

Not a public protocol (that is AMQP, [amqp]); a thin external handle on a
:class:`~mirrorq.queues.channel_actor.ChannelActor` that it creates
on the node it connects to::

    with InternalClient(admin_port) as c:
        c.declare_queue("orders", durable=True)
        c.open("orders")
        c.publish("orders", [b"x" * 1024] * 1000)
        c.wait_confirms("orders", timeout=30)
        c.consume("orders", prefetch=200)
        msgs = c.fetch_until("orders", 1000, timeout=30)

Every call is a request/response with the channel actor; publishes are
asynchronous (the actor keeps them until confirmed and resends them to a
new master after a failover).  Errors come back as :class:`ClientError`
naming the command and the cause.  ``close()`` stops the channel actor.
"""

from __future__ import annotations

import time
from typing import Any

from thespian.actors import ActorExitRequest

from mirrorq.node.client import NodeClient
from mirrorq.queues.channel_actor import ChannelInit, Cmd, Reply
from mirrorq.queues.manager import MANAGER_GLOBAL_NAME


class ClientError(RuntimeError):
    pass


class InternalClient:
    def __init__(self, admin_port: int, host: str = "127.0.0.1", timeout: float = 10.0):
        self.timeout = timeout
        self.rid = 0  # request ids of the asks (Cmd.rid, echoed in Reply.rid)
        nc = NodeClient(admin_port, host)
        self.nc: NodeClient | None = nc  # None once closed
        try:
            asys = nc.asys
            self.manager = asys.createActor("mirrorq.queues.manager.QueueManager", globalName=MANAGER_GLOBAL_NAME)
            self.actor = asys.createActor("mirrorq.queues.channel_actor.ChannelActor")
            r = asys.ask(self.actor, ChannelInit(nc.agent, self.manager), timeout)
            if not isinstance(r, Reply) or not r.ok:
                raise ClientError(f"channel actor on port {admin_port} did not start: {r!r}")
        except BaseException:
            nc.close()
            raise

    @property
    def _node(self) -> NodeClient:
        if self.nc is None:
            raise ClientError("the client is closed")
        return self.nc

    def _ask(self, op: str, queue: str = "", timeout: float | None = None, **args: Any) -> Any:
        wait = self.timeout if timeout is None else timeout
        self.rid += 1
        rid = self.rid
        deadline = time.monotonic() + wait
        asys = self._node.asys
        r = asys.ask(self.actor, Cmd(op, queue, args, rid), wait)
        # an answer to an earlier ask that timed out arrives late: not ours
        while isinstance(r, Reply) and r.rid != rid and time.monotonic() < deadline:
            r = asys.listen(max(0.0, deadline - time.monotonic()))
        if r is None or (isinstance(r, Reply) and r.rid != rid):
            raise ClientError(f"{op} {queue}: no answer within {wait}s")
        if not isinstance(r, Reply):
            raise ClientError(f"{op} {queue}: unexpected answer {r!r}")
        if not r.ok:
            raise ClientError(r.error or f"{op} {queue} failed")
        return r.value

    def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        arguments: dict | None = None,
        nodes=(),
        vhost: str = "/",
        timeout: float = 15.0,
    ) -> dict:
        spec = {
            "name": name,
            "vhost": vhost,
            "durable": durable,
            "auto_delete": False,
            "exclusive_owner": None,
            "arguments": dict(arguments or {}),
        }
        return self._ask("declare", name, timeout=timeout, spec=spec, nodes=tuple(nodes))

    def open(self, queue: str, vhost: str = "/") -> str:
        """Attach to a queue; returns its master (GM member name)."""
        return self._ask("open", queue, vhost=vhost)

    def publish(
        self, queue: str, bodies: list[bytes], *, persistent: bool = True, properties: dict | None = None
    ) -> int:
        """Send publishes (confirmed later); returns the last publish seq."""
        return self._ask("publish", queue, bodies=list(bodies), persistent=persistent, properties=properties)

    def confirms(self, queue: str) -> dict:
        return self._ask("confirms", queue)

    def wait_confirms(self, queue: str, timeout: float = 30.0, poll: float = 0.02) -> dict:
        """Poll until every publish is confirmed or nacked; returns the counts."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.confirms(queue)
            if st["unconfirmed"] == 0 or time.monotonic() > deadline:
                return st
            time.sleep(poll)  # polling interval of a condition with a deadline

    def consume(self, queue: str, *, tag: str = "ctag", prefetch: int = 0, arguments: dict | None = None) -> None:
        self._ask("consume", queue, tag=tag, prefetch=prefetch, arguments=dict(arguments or {}))

    def fetch(self, queue: str, max: int = 1000) -> list:
        """Deliveries received so far (acked as they are handed over):
        ``(msg_id, body, redelivered, epoch)``."""
        return self._ask("fetch", queue, max=max)

    def fetch_until(self, queue: str, count: int, timeout: float = 30.0, idle: float | None = None) -> list:
        """Fetch until ``count`` deliveries arrived or ``timeout``; with ``idle``,
        also stop once nothing arrived for ``idle`` seconds."""
        out: list = []
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while len(out) < count and time.monotonic() < deadline:
            got = self.fetch(queue, 5000)
            if got:
                out.extend(got)
                last = time.monotonic()
            elif idle is not None and time.monotonic() - last > idle:
                break
            else:
                time.sleep(0.01)  # polling interval of a condition with a deadline
        return out

    def info(self, queue: str, timeout: float | None = None) -> dict:
        """The master's view of the queue (no answer while it has no live master)."""
        return self._ask("info", queue, timeout=timeout)

    def command(self, queue: str, command: str, timeout: float | None = None, **args: Any) -> Any:
        """A queue command run by its master: "sync", "cancel_sync", "purge", "delete", "info"."""
        return self._ask("command", queue, timeout=timeout, command=command, args=args)

    def close(self) -> None:
        if self.nc is None:
            return
        try:
            self.nc.asys.tell(self.actor, ActorExitRequest())
        finally:
            self.nc.close()
            self.nc = None

    def __enter__(self) -> InternalClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
