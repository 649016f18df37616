"""Talk to a running node from outside (mirrorctl, tests, benchmarks).

Thespian's ``ActorSystem(...)`` *starts* an admin when none answers on the
port; a tool asking a dead node must never do that.  :class:`NodeClient` uses
a system base whose admin start is refused, so a dead node is a clear
:class:`NodeUnreachable`, never a stray admin.
"""

from __future__ import annotations

import os
import socket
import types
from typing import Any

from thespian.actors import ActorSystem
from thespian.system import multiprocTCPBase

from mirrorq.node import wire
from mirrorq.node.messages import AGENT_GLOBAL_NAME, NodeStatus, PrepareStop, StatusQuery, Stopping


class NodeUnreachable(Exception):
    pass


class _ClientOnlyBase(multiprocTCPBase.ActorSystemBase):
    def _startAdmin(self, adminAddr, addrOfStarter, capabilities, logDefs):
        raise NodeUnreachable(f"no node answers on admin port {capabilities.get('Admin Port')}")


def _port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class NodeClient:
    """A short-lived external connection to one node's admin and agent."""

    def __init__(self, admin_port: int, host: str = "127.0.0.1"):
        if not _port_open(host, admin_port):
            raise NodeUnreachable(f"no node answers on {host}:{admin_port}")
        os.environ.setdefault("THESPIAN_BASE_IPADDR", host)
        # sign what we send with the secrets this process knows (mirrorq.admin.cluster.Cluster
        # loads its data dir's; $MIRRORQ_SECRET_FILE names more), bind our own
        # listen socket to the node's address only: mirrorq.node.wire
        wire.use_environment(bind_host=host)
        caps = {"Admin Port": admin_port}
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
