"""A cluster reached through one node's address, for tools on any host
(``mirrorctl --address HOST:ADMIN_PORT``).

:class:`~mirrorq.admin.cluster.Cluster` knows a local cluster by its data
dir (layout, node.yaml files, node.pid files).  A cluster whose nodes run on
other hosts (each under ``mirrorq-server``) has none of that here: what a
tool knows is one node's admin address and the cluster's secret.
:class:`RemoteCluster` answers the same questions from the nodes
themselves: the entry node's status names the nodes it has heard of and
their admin addresses (``NodeStatus.peers``), and each node's status carries
the config it runs with (``NodeStatus.config``).  So every command that
works through a session with a node (listings, policies, users, queues,
``cluster_status``, ``status``, ``forget_cluster_node``) works remotely;
starting and stopping a node is its host's business (``systemctl``) and is
refused here.

The secret: ``--secret-file``, else ``$MIRRORQ_SECRET_FILE`` (what
:func:`mirrorq.node.wire.use_environment` reads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mirrorq.admin.cluster import Cluster, ClusterError, NodeUnavailable
from mirrorq.node import wire
from mirrorq.node.client import NodeClient, NodeUnreachable
from mirrorq.node.config import NodeConfig, parse_address

#: seconds a node has to answer a status ask
STATUS_TIMEOUT = 3.0


def _config(d: dict) -> NodeConfig:
    """The NodeConfig a node reported (not checked again here: its files are on its host)."""
    known = set(NodeConfig.__dataclass_fields__)
    kw: dict[str, Any] = {k: v for k, v in d.items() if k in known}
    for k in ("seeds", "cluster_nodes"):
        kw[k] = tuple(kw.get(k) or ())
    return NodeConfig(**kw)


class RemoteCluster(Cluster):
    """The cluster of the node at ``address`` (``host:admin_port``)."""

    def __init__(self, address: str, secret_file: str | None = None):
        try:
            self.entry = parse_address(address)
        except ValueError as e:
            raise ClusterError(f"--address: {e}") from None
        path = secret_file or ""
        if path:
            try:
                wire.use_secret_file(path)
            except (OSError, ValueError) as e:
                raise ClusterError(f"--secret-file: {e}") from None
        elif not any(p and os.path.exists(p) for p in os.environ.get(wire.ENV, "").split(os.pathsep)):
            raise ClusterError(
                f"a remote node needs the cluster's secret: --secret-file PATH or ${wire.ENV} "
                "(a copy of the nodes' secret_file)"
            )
        super().__init__(Path(f"/nonexistent/mirrorq-remote/{address}"))
        self._statuses: dict[str, Any] = {}
        self._addresses: dict[str, tuple[str, int]] = {}
        st = self._ask(*self.entry)
        if st is None:
            raise NodeUnavailable(f"no mirrorq node answers on {address}")
        self.entry_name = st.name
        self._learn(st)

    def __post_init__(self) -> None:  # the data dir is a placeholder: no secret to read there
        pass

    def _ask(self, host: str, port: int):
        try:
            with NodeClient(port, host) as c:
                return c.status(STATUS_TIMEOUT)
        except NodeUnreachable:
            return None

    def _learn(self, st: Any) -> None:
        self._statuses[st.name] = st
        host = (st.config or {}).get("host") or self.entry[0]
        self._addresses[st.name] = (host, int(st.admin_port))
        for name, admin in (getattr(st, "peers", None) or {}).items():
            if name not in self._addresses:
                try:
                    self._addresses[name] = parse_address(admin)
                except ValueError:
                    pass

    # ---- what Cluster reads from files ---------------------------------------------------
    def exists(self) -> bool:
        return True

    def node_names(self) -> list[str]:
        st = self._statuses[self.entry_name]
        names = set(st.view) | {st.name} | set(st.registry.get("voters", [])) | set(st.registry.get("learners", []))
        return sorted(names)

    def session_order(self) -> list[str]:
        """The node ``--address`` named first: a command goes to the node the
        user addressed (the others only if it cannot serve, e.g. paused)."""
        return [self.entry_name, *(n for n in self.node_names() if n != self.entry_name)]

    def config_path(self, name: str) -> Path:
        names = self.node_names()
        if name not in names:
            raise NodeUnavailable(f"unknown node {name!r} (known: {', '.join(names)})")
        return Path(f"{name}@{':'.join(map(str, self.admin_address(name)))}")

    def config(self, name: str) -> NodeConfig:
        self.config_path(name)
        st = self.status(name)
        if st is None or not getattr(st, "config", None):
            host, port = self.admin_address(name)
            return NodeConfig(name=name, host=host, admin_port=port)
        return _config(st.config)

    def admin_address(self, name: str) -> tuple[str, int]:
        if name not in self._addresses:
            raise NodeUnavailable(f"node {name}: its address is not known to {self.entry_name}")
        return self._addresses[name]

    def status(self, name: str, timeout: float = STATUS_TIMEOUT):
        if name not in self._addresses:
            return None
        st = self._ask(*self._addresses[name])
        if st is not None and st.name == name:
            self._learn(st)
            return st
        return None

    def pid_info(self, name: str) -> dict[str, Any] | None:
        st = self.status(name)
        if st is None:
            return None
        host, port = self.admin_address(name)
        return {"name": name, "pgid": st.pgid, "admin_port": port, "amqp_port": st.amqp_port, "host": host}

    def is_running(self, name: str) -> bool:
        return self.status(name) is not None

    # ---- what only the node's own host can do -------------------------------------------------
    def _local_only(self, what: str, name: str) -> ClusterError:
        return ClusterError(
            f"{what} {name}: the node runs on another host; use its service there "
            "(systemctl start|stop mirrorq, or mirrorq-server --config ...)"
        )

    def start_node(self, name: str, timeout: float | None = None) -> dict:
        raise self._local_only("start_node", name)

    def stop_node(self, name: str, timeout: float = 10.0) -> bool:
        raise self._local_only("stop_node", name)

    def kill_node(self, name: str) -> bool:
        raise self._local_only("kill_node", name)
