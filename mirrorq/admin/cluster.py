"""A local cluster on loopback, described by ``<data_dir>/cluster.yaml``.

The data dir holds the layout (``cluster.yaml``: node names and config files)
and one directory per node with its ``node.yaml``, ``node.pid``, ``node.log``,
``daemon.out`` and ``thespian.log``.  Every command finds the cluster through
its data dir, so nothing here keeps state in memory between commands.

``add_node`` grows a running cluster by one node: its node.yaml lists the
existing nodes as seeds and the cluster's initial voters as
``cluster_nodes`` (which do not include it), so it *joins*: the registry's
Raft leader adds it (see mirrorq.node.agent).  ``forget_node`` removes a
dead node from the registry's Raft configuration through any live node
(rabbitmqctl forget_cluster_node); the node's directory stays in the layout,
so it can still be started (it then stays outside the registry).

Nodes are started as detached daemons (``python -m mirrorq.node.daemon``);
a node is stopped gracefully by announcing its leave and shutting its actor
system down, killed by SIGKILL of its whole process group (the admin's
group: killing only the admin would orphan its actor processes).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mirrorq.node import daemon, wire
from mirrorq.node.client import NodeClient, NodeUnreachable
from mirrorq.node.config import (
    AMQP_SHELLS,
    DEFAULT_AMQP_SHELL,
    MANAGEMENT_PORT_OFFSET,
    NAME_RE,
    ConfigError,
    NodeConfig,
    load,
)
from mirrorq.node.messages import RegistryForget, RegistryResult

DEFAULT_DATA_DIR = "~/.mirrorq"
DEFAULT_BASE_PORT = 19500
DEFAULT_AMQP_BASE_PORT = 5672
LAYOUT = "cluster.yaml"


class ClusterError(Exception):
    """A user-facing failure: one line, non-zero exit.  ``exit_code`` is
    rabbitmqctl's (sysexits.h): 70 EX_SOFTWARE unless a subclass says
    otherwise."""

    exit_code = 70


class UsageError(ClusterError):
    """Bad arguments (EX_USAGE)."""

    exit_code = 64


class NodeUnavailable(ClusterError):
    """No node to talk to: no cluster, an unknown node, a node not running
    or not answering (EX_UNAVAILABLE)."""

    exit_code = 69


class NotFound(ClusterError):
    """The operation names a user, vhost, policy, queue... that does not
    exist (an HTTP API answers 404)."""


class Invalid(ClusterError):
    """The operation's input is not valid: a policy definition, a regular
    expression, a missing password (an HTTP API answers 400)."""


class AccessRefused(ClusterError):
    """The broker refused the user: a login, a vhost, a permission (EX_NOPERM;
    an HTTP API answers 401, as RabbitMQ's does)."""

    exit_code = 77


class CommandTimeout(ClusterError):
    """The node did not finish the operation within ``--timeout`` (EX_TEMPFAIL)."""

    exit_code = 75


def resolve_data_dir(arg: str | None) -> Path:
    raw = arg or os.environ.get("MIRRORQ_DATA_DIR") or DEFAULT_DATA_DIR
    return Path(raw).expanduser().resolve()


@dataclass
class Cluster:
    data_dir: Path
    #: the AMQP shell of the nodes :meth:`create` writes (``watch`` or
    #: ``asyncio``; None: the config default); ``create(amqp_shell=...)`` overrides
    amqp_shell: str | None = None
    #: ``launch_prefix(name) -> argv`` put before the node daemon's command
    #: line (the nemesis runs each node inside its own cgroup this way); None: nothing
    launch_prefix: Any = None

    def __post_init__(self) -> None:
        # this process talks to the nodes: sign with the cluster's secret
        wire.use_data_dir(self.data_dir)

    @property
    def secret_path(self) -> Path:
        return self.data_dir / wire.SECRET_FILE

    # ---- layout ---------------------------------------------------------
    @property
    def layout_path(self) -> Path:
        return self.data_dir / LAYOUT

    def exists(self) -> bool:
        return self.layout_path.exists()

    def session_order(self) -> list[str]:
        """The nodes a tool tries, in order, when no node is named: the
        layout's order here (a remote cluster puts the addressed node first)."""
        return self.node_names()

    def node_names(self) -> list[str]:
        if not self.exists():
            raise NodeUnavailable(
                f"no cluster in {self.data_dir} (run: mirrorctl cluster start --data-dir {self.data_dir})"
            )
        try:
            layout = yaml.safe_load(self.layout_path.read_text())
            return [str(n) for n in layout["nodes"]]
        except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
            raise ClusterError(f"{self.layout_path} is not a valid cluster layout: {e}") from None

    def config_path(self, name: str) -> Path:
        names = self.node_names()
        if name not in names:
            raise NodeUnavailable(f"unknown node {name!r} (known: {', '.join(names)})")
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
        amqp_shell: str | None = None,
        management_base_port: int | None = None,
    ) -> list[str]:
        """Write the layout and every node's node.yaml: node i gets
        ``base_port + i`` (admin), ``amqp_base_port + i`` and
        ``management_base_port + i`` (HTTP management; None: the AMQP
        port + 10000 as RabbitMQ's 15672, or, where that would reach the
        kernel's ephemeral range, a free block below it; 0: none)."""
        if n < 1:
            raise UsageError(f"--nodes must be at least 1, got {n}")
        shell = amqp_shell or self.amqp_shell or DEFAULT_AMQP_SHELL
        if shell not in AMQP_SHELLS:
            raise ClusterError(f"amqp shell must be one of {', '.join(AMQP_SHELLS)}, got {shell!r}")
        if management_base_port is None:
            management_base_port = amqp_base_port + MANAGEMENT_PORT_OFFSET
            ours = set(range(base_port, base_port + n)) | set(range(amqp_base_port, amqp_base_port + n))
            for _ in range(20):
                block = set(range(management_base_port, management_base_port + n))
                if (
                    not (block & ours)
                    and block_free(management_base_port, n)
                    and (management_base_port + n <= PORT_HI or amqp_base_port + n > PORT_HI)
                ):
                    break
                management_base_port = free_port_block(n)
        for port in (base_port, amqp_base_port, management_base_port or 1):
            if not 0 < port or port + n > 65535:
                raise ClusterError(f"port range {port}..{port + n - 1} is not valid")
        try:
            daemon.check_data_dir(str(self.data_dir))
        except daemon.StartError as e:
            raise ClusterError(str(e)) from None
        names = [f"node{i + 1}" for i in range(n)]
        seeds = [f"127.0.0.1:{base_port + i}" for i in range(n)]
        secret = wire.create_secret(self.data_dir)
        wire.use_data_dir(self.data_dir)
        for i, name in enumerate(names):
            cfg = NodeConfig(
                name=name,
                host="127.0.0.1",
                admin_port=base_port + i,
                amqp_port=amqp_base_port + i,
                management_port=management_base_port + i if management_base_port else 0,
                data_dir=str(self.data_dir / name),
                seeds=tuple(s for j, s in enumerate(seeds) if j != i),
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
                cluster_nodes=tuple(names),
                registry_snapshot_every=registry_snapshot_every,
                amqp_shell=shell,
                secret_file=str(secret),
            )
            (self.data_dir / name).mkdir(parents=True, exist_ok=True)
            cfg.dump(self.data_dir / name / "node.yaml")
        self.layout_path.write_text(yaml.safe_dump({"nodes": names}))
        return names

    def add_node(
        self,
        name: str | None = None,
        admin_port: int | None = None,
        amqp_port: int | None = None,
        start: bool = True,
        management_port: int | None = None,
    ) -> str:
        """Write a new node's node.yaml (seeds: every existing node; joins the
        registry) and add it to the layout; start it unless ``start`` is
        False.  A start that fails leaves no trace of the node."""
        names = self.node_names()
        if name is None:
            k = len(names) + 1
            while f"node{k}" in names:
                k += 1
            name = f"node{k}"
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ClusterError(f"bad node name {name!r}: 1-64 of letters, digits, - _ . @")
        if name in names:
            raise ClusterError(f"node {name} already exists in {self.data_dir}")
        cfgs = [self.config(n) for n in names]
        taken = (
            {c.admin_port for c in cfgs}
            | {c.amqp_port for c in cfgs}
            | {c.management_port for c in cfgs}
            | {c.amqps_port for c in cfgs if c.amqps_port}
        )
        for port, what in ((admin_port, "admin"), (amqp_port, "amqp"), (management_port, "management")):
            if (
                port is not None
                and not (what == "management" and port == 0)
                and (not 0 < port < 65536 or port in taken)
            ):
                raise ClusterError(f"{what} port {port} is not valid or is used by another node")

        def next_free(start_at: int) -> int:
            p = start_at
            while p in taken:
                p += 1
            if p > 65535:
                raise ClusterError("no free port above the cluster's ports")
            return p

        if admin_port is None:
            admin_port = next_free(max(c.admin_port for c in cfgs) + 1)
        taken.add(admin_port)
        if amqp_port is None:
            amqp_port = next_free(max(c.amqp_port for c in cfgs) + 1)
        taken.add(amqp_port)
        if management_port is None:  # the others have one: the next above theirs
            mgmt = [c.management_port for c in cfgs if c.management_port]
            management_port = next_free(max(mgmt) + 1) if mgmt else 0
        if len({admin_port, amqp_port, management_port}) < 3:
            raise ClusterError(
                f"admin, amqp and management ports must differ: {admin_port}, {amqp_port}, {management_port}"
            )
        t = cfgs[0]
        voters = t.cluster_nodes or (t.name,)
        cfg = NodeConfig(
            name=name,
            host=t.host,
            admin_port=admin_port,
            amqp_port=amqp_port,
            management_port=management_port,
            data_dir=str(self.data_dir / name),
            seeds=tuple(c.admin_address for c in cfgs),
            heartbeat_interval=t.heartbeat_interval,
            heartbeat_timeout=t.heartbeat_timeout,
            cluster_nodes=tuple(voters),
            registry_snapshot_every=t.registry_snapshot_every,
            amqp_shell=t.amqp_shell,
            secret_file=t.secret_file,
        )
        node_dir = self.data_dir / name
        if node_dir.exists():
            raise ClusterError(f"{node_dir} already exists; remove it or pick another name")
        node_dir.mkdir(parents=True)
        cfg.dump(node_dir / "node.yaml")
        self.layout_path.write_text(yaml.safe_dump({"nodes": names + [name]}))
        if start:
            try:
                self.start_node(name)
            except BaseException:
                self.kill_node(name)
                self._forget_pid(name)
                self.layout_path.write_text(yaml.safe_dump({"nodes": names}))
                shutil.rmtree(node_dir, ignore_errors=True)
                raise
        return name

    def forget_node(self, name: str, via: str | None = None, timeout: float = 10.0) -> str:
        """rabbitmqctl forget_cluster_node: remove the dead node ``name``
        from the registry's Raft configuration, through ``via`` (else any
        live node).  Returns the node that handled it."""
        names = self.node_names()
        if via is not None:
            self.config_path(via)
            candidates = [via]
        else:
            candidates = [n for n in names if n != name and self.is_running(n)]
        st = None
        for n in candidates:
            st = self.status(n)
            if st is not None:
                via = n
                break
        if st is None:
            raise ClusterError(f"no live node to ask (tried: {', '.join(candidates) or 'none running'})")
        assert via is not None  # the node st came from (given, or set with st in the loop)
        if name == via:
            raise ClusterError(f"cannot forget {name} through itself: it is running")
        members = list(st.registry.get("voters", [])) + list(st.registry.get("learners", []))
        if name not in members:
            if name not in names:
                raise ClusterError(f"unknown node {name!r} (registry members: {', '.join(members)})")
            raise ClusterError(
                f"{name} is not a member of the registry's Raft configuration (members: {', '.join(members)})"
            )
        if name in names and self.is_running(name):
            raise ClusterError(f"node {name} is running; stop it before forget_cluster_node")
        if st.view.get(name, {}).get("state") == "up":
            raise ClusterError(f"node {name} is up (as seen by {via}); stop it before forget_cluster_node")
        info = self.pid_info(via)
        if info is None:  # it stopped (its pid file went) since it answered its status
            raise ClusterError(f"node {via} is not running any more (no pid file); ask again")
        try:
            with self.client(via) as c:
                res = c.ask(RegistryForget(name), timeout)
        except NodeUnreachable as e:
            raise ClusterError(f"node {via} is not reachable: {e}") from None
        if not isinstance(res, RegistryResult):
            raise ClusterError(f"node {via} did not answer forget_cluster_node {name} within {timeout:.0f}s")
        if not res.ok:
            raise ClusterError(f"forget_cluster_node {name} failed: {res.error}")
        return via

    # ---- processes --------------------------------------------------------
    def pid_info(self, name: str) -> dict[str, Any] | None:
        return daemon.read_pid_file(str(self.data_dir / name))

    def admin_address(self, name: str) -> tuple[str, int]:
        """``(host, admin port)`` of running node ``name``: what its node.pid
        recorded (the address it started with), else its config's."""
        info = self.pid_info(name) or {}
        if "admin_port" in info:
            return str(info.get("host") or self.config(name).host), int(info["admin_port"])
        cfg = self.config(name)
        return cfg.host, cfg.admin_port

    def client(self, name: str) -> NodeClient:
        """A :class:`NodeClient` of node ``name``, at the address it runs on
        (raises :class:`NodeUnreachable`)."""
        host, port = self.admin_address(name)
        return NodeClient(port, host)

    def is_running(self, name: str) -> bool:
        info = self.pid_info(name)
        if not info:
            return False
        return daemon.process_group_alive(int(info["pgid"]))

    def start_node(self, name: str, timeout: float | None = None) -> dict:
        """Start node ``name`` (its daemon exits once the node runs).  Past
        ``timeout`` (default: the daemon's own start timeout + 30 s) the
        daemon gets SIGTERM, on which it kills everything it started, then
        SIGKILL; the node's recorded process group is killed too.  A failed
        start leaves nothing running."""
        cfg_path = self.config_path(name)
        if self.is_running(name):
            raise ClusterError(f"node {name} is already running")
        out_path = self.data_dir / name / "daemon.out"
        prefix = list(self.launch_prefix(name)) if self.launch_prefix is not None else []
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "mirrorq.node.daemon", str(cfg_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, "THESPIAN_BASE_IPADDR": "127.0.0.1"},
        )
        try:
            _, err = proc.communicate(timeout=daemon.START_TIMEOUT + 30 if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # the daemon kills what it started, then exits
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            self.kill_node(name)
            self._forget_pid(name)
            raise ClusterError(f"node {name} did not finish starting; see {out_path}") from None
        except BaseException:
            proc.kill()
            proc.communicate()
            self.kill_node(name)
            self._forget_pid(name)
            raise
        if proc.returncode != 0:
            left = self.pid_info(name)
            if left and left.get("starting"):  # recorded mid-start by this daemon: never a running node's
                self.kill_node(name)
                self._forget_pid(name)
            msg = err.decode(errors="replace").strip().splitlines()
            if not msg and out_path.exists():
                msg = [ln for ln in out_path.read_text(errors="replace").splitlines() if ln.startswith("mirrorq node:")]
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
        if info and info.get("starting") and info.get("daemon_pid"):
            # a daemon still starting (or stuck) holds its own session: kill it too
            # (by the pid it recorded, and only if it still runs our daemon module)
            dpid = int(info["daemon_pid"])
            try:
                with open(f"/proc/{dpid}/cmdline", "rb") as f:
                    if b"mirrorq.node.daemon" in f.read():
                        os.kill(dpid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
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
        if info and info.get("starting"):  # never finished starting: nothing to stop gracefully
            was = self.kill_node(name)
            self._forget_pid(name)
            return was
        if not info or not daemon.process_group_alive(int(info["pgid"])):
            self._forget_pid(name)
            return False
        pgid = int(info["pgid"])
        try:
            client = self.client(name)
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
            with self.client(name) as c:
                return c.status(timeout)
        except NodeUnreachable:
            return None

    def manager_registered(self, name: str, timeout: float = 3.0) -> bool:
        """Has node ``name``'s queue manager put its address in the registry
        (so that other nodes can place queue replicas on it)?"""
        from mirrorq.queues.manager import MANAGER_GLOBAL_NAME, ManagerStatusQuery

        info = self.pid_info(name)
        if not info or not daemon.process_group_alive(int(info["pgid"])):
            return False
        try:
            with self.client(name) as c:
                mgr = c.asys.createActor("mirrorq.queues.manager.QueueManager", globalName=MANAGER_GLOBAL_NAME)
                st = c.asys.ask(mgr, ManagerStatusQuery(), timeout)
        except NodeUnreachable:
            return False
        return isinstance(st, dict) and bool(st.get("registered"))

    def wait_all_up(self, names: list[str], timeout: float, managers: bool = True) -> dict:
        """Poll until every node in ``names`` sees every other one up and,
        with ``managers``, every node's queue manager is registered (a fresh
        cluster can place queue replicas on every node).  A node outside the
        registry (forgotten) never registers: pass ``managers=False``."""
        deadline = time.monotonic() + timeout
        views: dict = {}
        while True:
            views = {n: self.status(n) for n in names}
            if all(
                st is not None and all(st.view.get(m, {}).get("state") == "up" for m in names) for st in views.values()
            ) and (not managers or all(self.manager_registered(n) for n in names)):
                return views
            if time.monotonic() > deadline:
                missing = {
                    n: sorted(m for m in names if not (st and st.view.get(m, {}).get("state") == "up"))
                    for n, st in views.items()
                }
                if any(missing.values()):
                    raise ClusterError(f"nodes did not all see each other within {timeout:.0f}s: {missing}")
                late = [n for n in names if not self.manager_registered(n)]
                raise ClusterError(f"the queue managers of {', '.join(late)} did not register within {timeout:.0f}s")
            time.sleep(0.1)


#: ports the launcher, the tests and the benches pick: below the kernel's
#: ephemeral range (net.ipv4.ip_local_port_range starts at 32768), so an
#: outgoing connection's source port can never take a port we picked
PORT_LO, PORT_HI = 10000, 32000


def block_free(base: int, n: int) -> bool:
    """Can ports base..base+n-1 all be bound (on 0.0.0.0) right now?"""
    import socket

    if base < 1 or base + n > 65536:
        return False
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", p))
            socks.append(s)
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port_block(n: int, start: int = PORT_LO, end: int = PORT_HI, rng=None) -> int:
    """First port p of a random block such that p..p+n-1 are all free on
    loopback and 0.0.0.0 (a launcher's --base-port when several clusters share
    a machine: tests, benches).  A caller that already took a block passes
    ``start`` just above it; when less than 100 ports are left above
    ``start``, the block is drawn from the whole range instead, avoiding the
    200 ports below ``start`` (where the caller's block is)."""
    import random

    rng = rng or random.Random()
    avoid = None
    if end - n - start < 100:
        avoid = (start - 200, start)
        start = PORT_LO
    if end - n <= start:
        raise RuntimeError(f"no room for {n} ports between {start} and {end}")
    for _ in range(200):
        base = rng.randrange(start, end - n)
        if avoid and base < avoid[1] and base + n > avoid[0]:
            continue
        if block_free(base, n):
            return base
    raise RuntimeError(f"no block of {n} free ports between {start} and {end}")


def poll(pred, timeout: float, step: float = 0.05):
    """Call ``pred`` until it returns something truthy or ``timeout`` passes;
    returns its last value (a condition with a deadline, never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(step)  # polling interval of a condition with a deadline


def wait_until(pred, timeout: float, what: str, step: float = 0.05):
    """:func:`poll`, raising TimeoutError naming ``what`` when it times out."""
    v = poll(pred, timeout, step)
    if not v:
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
    return v
