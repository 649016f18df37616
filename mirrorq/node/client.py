"""Talk to a running node from outside (mirrorctl, tests, benchmarks).

Thespian's ``ActorSystem(...)`` *starts* an admin when none answers on the
port; a tool asking a dead node must never do that.  :class:`NodeClient` uses
a system base whose admin start is refused, so a dead node is a clear
:class:`NodeUnreachable`, never a stray admin.

The node answers to the client's own Thespian listen socket, so that socket
must be on an address the node can reach: the local address of the
connection the client opens to check the node's port (on the node's machine
and for a node on loopback, the node's own address; from another host, this
host's address on the route to it).  The client binds and advertises that
address (``THESPIAN_BASE_IPADDR`` and :func:`mirrorq.node.wire.install`'s
bind host are set for each client before its transport starts), never the
node's address, which is not this host's when the node runs elsewhere.
"""

from __future__ import annotations

import os
import socket
import types
from typing import Any

from thespian.actors import ActorAddress, ActorSystem
from thespian.system import multiprocTCPBase
from thespian.system.transport import ExternalInterfaceTransportInit
from thespian.system.transport.IPBase import TCPv4ActorAddress
from thespian.system.transport.TCPTransport import TCPTransport

from mirrorq.node import wire
from mirrorq.node.messages import AGENT_GLOBAL_NAME, NodeStatus, PrepareStop, StatusQuery, Stopping


class NodeUnreachable(Exception):
    pass


#: capability naming the host of the admin a client talks to (read by _NodeAdminTransport)
ADMIN_HOST = "mirrorq.admin_host"


class _NodeAdminTransport(TCPTransport):
    """Thespian's TCP transport for an external client whose admin is at
    ``capabilities[ADMIN_HOST]``: Thespian itself puts an external client's
    admin at the client's own base address (``THESPIAN_BASE_IPADDR``), i.e.
    on the client's machine, and checks that one runs by trying to bind its
    port there, neither of which holds for a node on another host."""

    def __init__(self, initType: Any, *args: Any) -> None:
        super().__init__(initType, *args)
        if isinstance(initType, ExternalInterfaceTransportInit):
            self._adminAddr = self.getAdminAddr(args[0])

    @staticmethod
    def getAdminAddr(capabilities: dict) -> ActorAddress:  # noqa: N802 -- Thespian's name
        host = capabilities.get(ADMIN_HOST)
        if not host:
            return TCPTransport.getAdminAddr(capabilities)
        return ActorAddress(TCPv4ActorAddress(host, capabilities["Admin Port"], external=True))

    @staticmethod
    def probeAdmin(addr: ActorAddress) -> bool:  # noqa: N802 -- Thespian's name
        """Something listens at the admin's address (connect, not bind: it may be another host's)."""
        host, port = addr.addressDetails.sockname[:2]
        return local_address_to(host, port) is not None


class _ClientOnlyBase(multiprocTCPBase.ActorSystemBase):
    transportType = _NodeAdminTransport

    def _startAdmin(self, adminAddr, addrOfStarter, capabilities, logDefs):
        raise NodeUnreachable(f"no node answers on admin port {capabilities.get('Admin Port')}")


def local_address_to(host: str, port: int, timeout: float = 1.0) -> str | None:
    """This host's address on a TCP connection to ``host:port``; None if
    nothing answers there."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            return str(s.getsockname()[0])
    except OSError:
        return None


class NodeClient:
    """A short-lived external connection to one node's admin and agent."""

    def __init__(self, admin_port: int, host: str = "127.0.0.1"):
        local = local_address_to(host, admin_port)
        if local is None:
            raise NodeUnreachable(f"no node answers on {host}:{admin_port}")
        # the node answers to our listen socket: on the address that reaches it
        os.environ["THESPIAN_BASE_IPADDR"] = local
        # sign what we send with the secrets this process knows (mirrorq.admin.cluster.Cluster
        # loads its data dir's; $MIRRORQ_SECRET_FILE names more), bind our own
        # listen socket to that address only: mirrorq.node.wire
        wire.use_environment(bind_host=local)
        caps = {"Admin Port": admin_port, ADMIN_HOST: host}
        base = _ClientOnlyBase(types.SimpleNamespace(capabilities=caps))
        self.asys = ActorSystem(base, caps, transientUnique=True)
        self._agent = None

    @property
    def agent(self):
        if self._agent is None:
            self._agent = self.asys.createActor("mirrorq.node.agent.NodeAgent", globalName=AGENT_GLOBAL_NAME)
        return self._agent

    def ask(self, msg: Any, timeout: float = 3.0) -> Any:
        return self.asys.ask(self.agent, msg, timeout)

    def status(self, timeout: float = 3.0) -> NodeStatus:
        st = self.ask(StatusQuery(), timeout)
        if not isinstance(st, NodeStatus):
            raise NodeUnreachable(f"node agent did not answer a status query within {timeout}s")
        return st

    def prepare_stop(self, timeout: float = 3.0) -> bool:
        return isinstance(self.ask(PrepareStop(), timeout), Stopping)

    def shutdown_system(self) -> None:
        """Graceful stop of the whole actor system (all the node's actors)."""
        self.asys.shutdown()
        self.asys = None

    def close(self) -> None:
        if self.asys is not None:
            base = self.asys._systemBase
            self.asys._systemBase = None  # never let ActorSystem.shutdown reach the node
            try:
                base.transport.close()
            except Exception:
                pass
            self.asys = None

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
