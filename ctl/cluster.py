"""A local cluster on loopback, described by ``<data_dir>/cluster.yaml``.

The data dir holds the layout (``cluster.yaml``: node names and config files)
and one directory per node with its ``node.yaml``, ``node.pid``, ``node.log``,
``daemon.out`` and ``thespian.log``.  Every command finds the cluster through
its data dir, so nothing here keeps state in memory between commands.

Nodes are started as detached daemons (``python -m mirrorq.node.daemon``);
a node is stopped gracefully by announcing its leave and shutting its actor
system down, killed by SIGKILL of its whole process group (the admin's
group: killing only the admin would orphan its actor processes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from mirrorq.node import daemon
from mirrorq.node.client import NodeClient, NodeUnreachable
from mirrorq.node.config import ConfigError, NodeConfig, load

DEFAULT_DATA_DIR = "~/.mirrorq"
DEFAULT_BASE_PORT = 19500
DEFAULT_AMQP_BASE_PORT = 5672
LAYOUT = "cluster.yaml"


class ClusterError(Exception):
    """A user-facing failure: one line, non-zero exit."""


def resolve_data_dir(arg: str | None) -> Path:
    raw = arg or os.environ.get("MIRRORQ_DATA_DIR") or DEFAULT_DATA_DIR
    return Path(raw).expanduser().resolve()


@dataclass
class Cluster:
    data_dir: Path

    # ---- layout ---------------------------------------------------------
    @property
    def layout_path(self) -> Path:
        return self.data_dir / LAYOUT

    def exists(self) -> bool:
        return self.layout_path.exists()

    def node_names(self) -> list[str]:
        if not self.exists():
            raise ClusterError(f"no cluster in {self.data_dir} (run: mirrorctl cluster start --data-dir {self.data_dir})")
        try:
            layout = yaml.safe_load(self.layout_path.read_text())
            return [str(n) for n in layout["nodes"]]
        except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
            raise ClusterError(f"{self.layout_path} is not a valid cluster layout: {e}") from None

    def config_path(self, name: str) -> Path:
        names = self.node_names()
        if name not in names:
            raise ClusterError(f"unknown node {name!r} (known: {', '.join(names)})")
        return self.data_dir / name / "node.yaml"

    def config(self, name: str) -> NodeConfig:
        try:
            return load(self.config_path(name))
        except ConfigError as e:
            raise ClusterError(str(e)) from None

    def create(
        self,
        n: int,
        base_port: int,
        amqp_base_port: int,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        registry_snapshot_every: int = 1000,
    ) -> list[str]:
        if n < 1:
            raise ClusterError(f"--nodes must be at least 1, got {n}")
        for port in (base_port, amqp_base_port):
            if not 0 < port or port + n > 65535:
                raise ClusterError(f"port range {port}..{port + n - 1} is not valid")
        try:
            daemon.check_data_dir(str(self.data_dir))
        except daemon.StartError as e:
            raise ClusterError(str(e)) from None
        names = [f"node{i + 1}" for i in range(n)]
        seeds = [f"127.0.0.1:{base_port + i}" for i in range(n)]
        for i, name in enumerate(names):
            cfg = NodeConfig(
                name=name,
                host="127.0.0.1",
                admin_port=base_port + i,
                amqp_port=amqp_base_port + i,
                data_dir=str(self.data_dir / name),
                seeds=tuple(s for j, s in enumerate(seeds) if j != i),
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
                cluster_nodes=tuple(names),
                registry_snapshot_every=registry_snapshot_every,
            )
            (self.data_dir / name).mkdir(parents=True, exist_ok=True)
            cfg.dump(self.data_dir / name / "node.yaml")
        self.layout_path.write_text(yaml.safe_dump({"nodes": names}))
        return names

    # ---- processes --------------------------------------------------------
    def pid_info(self, name: str) -> dict | None:
        return daemon.read_pid_file(str(self.data_dir / name))

    def is_running(self, name: str) -> bool:
        info = self.pid_info(name)
        return bool(info) and daemon.process_group_alive(int(info["pgid"]))

    def start_node(self, name: str) -> dict:
        cfg_path = self.config_path(name)
        if self.is_running(name):
            raise ClusterError(f"node {name} is already running")
        out_path = self.data_dir / name / "daemon.out"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "mirrorq.node.daemon", str(cfg_path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                timeout=daemon.START_TIMEOUT + 30,
                env={**os.environ, "THESPIAN_BASE_IPADDR": "127.0.0.1"},
            )
        except subprocess.TimeoutExpired:
            self.kill_node(name)
            self._forget_pid(name)
            raise ClusterError(f"node {name} did not finish starting; see {out_path}") from None
        if proc.returncode != 0:
            msg = proc.stderr.decode(errors="replace").strip().splitlines()
            if not msg and out_path.exists():
                msg = [l for l in out_path.read_text(errors="replace").splitlines() if l.startswith("mirrorq node:")]
            line = msg[-1] if msg else f"node {name} failed to start (exit {proc.returncode}); see {out_path}"
            raise ClusterError(line.removeprefix("mirrorq node: "))
        info = self.pid_info(name)
        if not info:
            raise ClusterError(f"node {name} started but wrote no pid file; see {out_path}")
        return info

    def kill_node(self, name: str) -> bool:
        """SIGKILL the node's whole process group; True if it was running."""
        self.config_path(name)  # unknown names are an error
        info = self.pid_info(name)
        if not info or not daemon.process_group_alive(int(info["pgid"])):
            return False
        if not daemon.kill_group(int(info["pgid"])):
            raise ClusterError(f"node {name}: process group {info['pgid']} survived SIGKILL")
        return True

    def stop_node(self, name: str, timeout: float = 10.0) -> bool:
        """Graceful stop: announce the leave, shut the actor system down, wait
        for the process group to end (SIGKILL it past ``timeout``)."""
        self.config_path(name)
        info = self.pid_info(name)
        if not info or not daemon.process_group_alive(int(info["pgid"])):
            self._forget_pid(name)
            return False
        pgid = int(info["pgid"])
        try:
            client = NodeClient(int(info["admin_port"]))
            try:
                client.prepare_stop()
                client.shutdown_system()
            finally:
                client.close()
        except (NodeUnreachable, Exception):
            pass  # fall through to the kill below
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and daemon.process_group_alive(pgid):
            time.sleep(0.05)
        if daemon.process_group_alive(pgid):
            daemon.kill_group(pgid)
        self._forget_pid(name)
        return True

    def stop_all(self) -> None:
        """Stop every node gracefully, then SIGKILL any process group that is
        still there: what every tool and test that starts a cluster ends with."""
        if not self.exists():
            return
        for n in self.node_names():
            try:
                self.stop_node(n)
            finally:
                info = self.pid_info(n)
                if info:
                    daemon.kill_group(int(info["pgid"]))
                self._forget_pid(n)

    def _forget_pid(self, name: str) -> None:
        try:
            os.remove(daemon.pid_file(str(self.data_dir / name)))
        except FileNotFoundError:
            pass

    # ---- queries ----------------------------------------------------------
    def status(self, name: str, timeout: float = 3.0):
        info = self.pid_info(name)
        if not info or not daemon.process_group_alive(int(info["pgid"])):
            return None
        try:
            with NodeClient(int(info["admin_port"])) as c:
                return c.status(timeout)
        except NodeUnreachable:
            return None

    def wait_all_up(self, names: list[str], timeout: float) -> dict:
        """Poll until every node in ``names`` sees every other one up."""
        deadline = time.monotonic() + timeout
        views: dict = {}
        while True:
            views = {n: self.status(n) for n in names}
            if all(
                st is not None and all(st.view.get(m, {}).get("state") == "up" for m in names)
                for st in views.values()
            ):
                return views
            if time.monotonic() > deadline:
                missing = {
                    n: sorted(m for m in names if not (st and st.view.get(m, {}).get("state") == "up"))
                    for n, st in views.items()
                }
                raise ClusterError(f"nodes did not all see each other within {timeout:.0f}s: {missing}")
            time.sleep(0.1)
