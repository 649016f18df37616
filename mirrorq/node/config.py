"""Node configuration: one YAML file per node.

Keys (all but ``name`` optional)::

    name: node1                 # unique node name: letters, digits, - _ . @; the node's
                                # identity in the cluster (it stays when host changes)
    host: 127.0.0.1             # this node's address: every listener (admin, actors,
                                # AMQP, management) binds it, peers and tools reach the
                                # node there; never a wildcard (0.0.0.0).  It may change
                                # across restarts (peers learn it from the node)
    admin_port: 19500           # Thespian admin port: with host, where peers find the node
    amqp_port: 5672             # AMQP 0-9-1 listener
    management_port: 15672      # HTTP management API, /metrics and the ring page
                                # (mirrorq.mgmt); default amqp_port + 10000, as
                                # RabbitMQ's 5672 -> 15672; 0: no management server
    amqps_port: 5671            # AMQP over TLS (RabbitMQ's listeners.ssl.default);
                                # default 0: no TLS listener.  Needs ssl_options:
    ssl_options:                # RabbitMQ's names (mirrorq.amqp.tls)
      cacertfile: /etc/mirrorq/ca.pem      # CAs client certificates must chain to
      certfile: /etc/mirrorq/server.pem    # this node's certificate
      keyfile: /etc/mirrorq/server.key     # its key (password: PASS if encrypted)
      verify: verify_peer       # verify_none (default: no client certificate asked)
                                # | verify_peer (needs cacertfile)
      fail_if_no_peer_cert: true  # with verify_peer: refuse clients without one
    data_dir: /var/lib/mirrorq/node1   # this node's own directory (default ~/.mirrorq/NAME)
    secret_file: /etc/mirrorq/cluster.secret  # the cluster's shared secret (required to
                                # start; mode 0600; the same on every node: mirrorq.node.wire)
    seeds: ["10.0.0.2:19500"]   # admin addresses (host:port) of other nodes
    heartbeat_interval: 0.2     # seconds between heartbeats
    heartbeat_timeout: 1.5      # silence after which a peer is reported down
    cluster_nodes: [node1, node2, node3]  # the registry's initial Raft voters
                                # (the same list on every node; default: just this node).
                                # A node NOT in the list *joins* an existing cluster:
                                # it never campaigns and is added to the Raft
                                # configuration by the leader (see mirrorq.node.agent)
    registry_snapshot_every: 1000   # registry log entries between snapshots
    amqp_shell: watch           # the AMQP socket shell: watch (a Thespian actor
                                # watching its sockets, mirrorq.amqp.listener) or
                                # asyncio (a per-node asyncio process behind a bridge
                                # actor, mirrorq.amqp.aio_shell); see listener.py
    cluster_partition_handling: pause_minority   # RabbitMQ's name: pause_minority
                                # (default: a node that hears no majority of the
                                # registry's voters stops serving its clients and
                                # queues until it does; clusters of 3+ voters) or
                                # ignore (every side goes on serving)
    queue_hosts: 2              # queue-host actor processes running this node's queue
                                # replicas (default: the number of cores); every node
                                # of a cluster should use the same number
    max_message_size: 16777216  # the largest AMQP message body this node's front end
                                # accepts, in bytes (RabbitMQ's max_message_size; default
                                # 16 MiB, at most 32 MiB: mirrorq.bounds).  A publish
                                # announcing a bigger body is refused with
                                # 406 PRECONDITION_FAILED naming the limit
    vm_memory_high_watermark: 0.4   # resource alarms (mirrorq.node.alarms), RabbitMQ's:
                                # a fraction of RAM, or {absolute: 1GiB}; above it the
                                # memory alarm blocks the cluster's publishers
    disk_free_limit: 50MB       # bytes, "50MB", {absolute: SIZE} or {mem_relative: 1.0};
                                # free space of data_dir's file system below it: disk alarm

A bad file raises :class:`ConfigError` whose message names the file and the key
(``ssl_options.keyfile`` for one of ssl_options: the files must exist, be
readable and load -- a certificate with a key that does not match is refused
here, not at the first client).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mirrorq.amqp.tls import TLSOptionsError, check_options, server_context
from mirrorq.bounds import DEFAULT_MAX_MESSAGE_SIZE, check_max_message_size
from mirrorq.node.alarms import (
    DEFAULT_DISK_FREE_LIMIT,
    DEFAULT_MEMORY_WATERMARK,
    parse_disk_free_limit,
    parse_memory_watermark,
)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
DEFAULT_ADMIN_PORT = 19500
DEFAULT_AMQP_PORT = 5672
#: the management port is the AMQP port plus this (RabbitMQ's 5672 -> 15672)
MANAGEMENT_PORT_OFFSET = 10000


def default_management_port(amqp_port: int) -> int:
    """RabbitMQ's convention: the AMQP port + 10000 (0, no server, past 65535)."""
    port = amqp_port + MANAGEMENT_PORT_OFFSET
    return port if port < 65536 else 0


AMQP_SHELLS = ("watch", "asyncio")
#: addresses that name no one host: a node binds and advertises ``host``, so it must be its own
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*")
PARTITION_HANDLING = ("pause_minority", "ignore")
DEFAULT_AMQP_SHELL = "watch"


class ConfigError(ValueError):
    def __init__(self, source: str, key: str | None, message: str):
        self.source, self.key = source, key
        where = f"key '{key}': " if key else ""
        super().__init__(f"config error in {source}: {where}{message}")


@dataclass(frozen=True)
class NodeConfig:
    name: str
    host: str = "127.0.0.1"
    admin_port: int = DEFAULT_ADMIN_PORT
    amqp_port: int = DEFAULT_AMQP_PORT
    management_port: int = DEFAULT_AMQP_PORT + MANAGEMENT_PORT_OFFSET  # 0: none
    data_dir: str = ""
    seeds: tuple[str, ...] = field(default_factory=tuple)
    heartbeat_interval: float = 0.2
    heartbeat_timeout: float = 1.5
    queue_hosts: int = 0  # 0: the number of cores
    cluster_nodes: tuple[str, ...] = field(default_factory=tuple)
    registry_snapshot_every: int = 1000
    amqp_shell: str = DEFAULT_AMQP_SHELL
    secret_file: str = ""
    amqps_port: int = 0  # 0: no TLS listener
    ssl_options: dict = field(default_factory=dict, hash=False)  # mirrorq.amqp.tls
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    cluster_partition_handling: str = "pause_minority"
    vm_memory_high_watermark: Any = field(default=DEFAULT_MEMORY_WATERMARK, hash=False)  # as written
    disk_free_limit: Any = field(default=DEFAULT_DISK_FREE_LIMIT, hash=False)  # as written

    @property
    def joins(self) -> bool:
        """True for a node added to a running cluster: it is not one of the
        registry's initial voters, the Raft leader adds it."""
        return bool(self.cluster_nodes) and self.name not in self.cluster_nodes

    @property
    def admin_address(self) -> str:
        return f"{self.host}:{self.admin_port}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["seeds"] = list(self.seeds)
        d["cluster_nodes"] = list(self.cluster_nodes)
        if not self.amqps_port and not self.ssl_options:
            del d["amqps_port"], d["ssl_options"]  # the plain node's file stays as it was
        return d

    def dump(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises ValueError naming the text."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port")
    return host, int(port)


def _port(source: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(source, key, f"must be a port number 1-65535, got {value!r}")
    return value


def _seconds(source: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(source, key, f"must be a positive number of seconds, got {value!r}")
    return float(value)


def from_mapping(raw: Any, source: str = "<config>") -> NodeConfig:
    if not isinstance(raw, dict):
        raise ConfigError(source, None, f"expected a mapping of keys, got {type(raw).__name__}")
    known = {f for f in NodeConfig.__dataclass_fields__}
    for key in raw:
        if key not in known:
            raise ConfigError(source, str(key), f"unknown key (known: {', '.join(sorted(known))})")
    if "name" not in raw:
        raise ConfigError(source, "name", "missing")
    name = raw["name"]
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(source, "name", f"must be 1-64 of letters, digits, - _ . @; got {name!r}")
    host = raw.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(source, "host", f"must be a host name or address, got {host!r}")
    if host in WILDCARD_HOSTS:
        raise ConfigError(
            source,
            "host",
            f"must be this node's own address (it binds it and its peers reach it there), not the wildcard {host!r}",
        )
    seeds = raw.get("seeds") or []
    if not isinstance(seeds, list):
        raise ConfigError(source, "seeds", f"must be a list of host:port, got {seeds!r}")
    for s in seeds:
        try:
            parse_address(s)
        except ValueError as e:
            raise ConfigError(source, "seeds", str(e)) from None
    cluster_nodes = raw.get("cluster_nodes") or []
    if not isinstance(cluster_nodes, list) or not all(isinstance(n, str) and NAME_RE.match(n) for n in cluster_nodes):
        raise ConfigError(source, "cluster_nodes", f"must be a list of node names, got {cluster_nodes!r}")
    if len(set(cluster_nodes)) != len(cluster_nodes):
        raise ConfigError(source, "cluster_nodes", f"has duplicate names: {cluster_nodes!r}")
    if cluster_nodes and name not in cluster_nodes and not seeds:
        raise ConfigError(
            source,
            "cluster_nodes",
            f"does not include this node ({name!r}), so it joins an existing cluster: "
            "it needs seeds (admin addresses of members) to find it",
        )
    snap = raw.get("registry_snapshot_every", 1000)
    if isinstance(snap, bool) or not isinstance(snap, int) or snap < 1:
        raise ConfigError(source, "registry_snapshot_every", f"must be a positive integer, got {snap!r}")
    queue_hosts = raw.get("queue_hosts", 0)
    if isinstance(queue_hosts, bool) or not isinstance(queue_hosts, int) or not 0 <= queue_hosts <= 64:
        raise ConfigError(
            source, "queue_hosts", f"must be an integer 1-64 (0: the number of cores), got {queue_hosts!r}"
        )
    handling = raw.get("cluster_partition_handling", "pause_minority")
    if handling not in PARTITION_HANDLING:
        raise ConfigError(
            source, "cluster_partition_handling", f"must be one of {', '.join(PARTITION_HANDLING)}, got {handling!r}"
        )
    try:
        max_message_size = check_max_message_size(raw.get("max_message_size", DEFAULT_MAX_MESSAGE_SIZE))
    except ValueError as e:
        raise ConfigError(source, "max_message_size", str(e)) from None
    watermark = raw.get("vm_memory_high_watermark", DEFAULT_MEMORY_WATERMARK)
    disk_free_limit = raw.get("disk_free_limit", DEFAULT_DISK_FREE_LIMIT)
    for key, parse, value in (
        ("vm_memory_high_watermark", parse_memory_watermark, watermark),
        ("disk_free_limit", parse_disk_free_limit, disk_free_limit),
    ):
        try:
            parse(value)
        except ValueError as e:
            raise ConfigError(source, key, str(e)) from None
    amqp_shell = raw.get("amqp_shell", DEFAULT_AMQP_SHELL)
    if amqp_shell not in AMQP_SHELLS:
        raise ConfigError(source, "amqp_shell", f"must be one of {', '.join(AMQP_SHELLS)}, got {amqp_shell!r}")
    secret_file = raw.get("secret_file") or ""
    if not isinstance(secret_file, str):
        raise ConfigError(source, "secret_file", f"must be a path, got {secret_file!r}")
    data_dir = raw.get("data_dir") or str(Path.home() / ".mirrorq" / name)
    if not isinstance(data_dir, str):
        raise ConfigError(source, "data_dir", f"must be a path, got {data_dir!r}")
    amqp_port = _port(source, "amqp_port", raw.get("amqp_port", DEFAULT_AMQP_PORT))
    management_port = raw.get("management_port", default_management_port(amqp_port))
    if not (type(management_port) is int and management_port == 0):  # 0: no management server
        management_port = _port(source, "management_port", management_port)
    amqps_port = raw.get("amqps_port", 0)
    if not (type(amqps_port) is int and amqps_port == 0):  # 0: no TLS listener
        amqps_port = _port(source, "amqps_port", amqps_port)
    ssl_options = raw.get("ssl_options") or {}
    if amqps_port and not ssl_options:
        raise ConfigError(source, "ssl_options", "missing: amqps_port needs at least certfile and keyfile")
    if ssl_options:
        try:
            ssl_options = check_options(ssl_options)
            server_context(ssl_options)  # the files load, the key matches the certificate
        except TLSOptionsError as e:
            raise ConfigError(source, e.key, str(e)) from None
    cfg = NodeConfig(
        name=name,
        host=host,
        admin_port=_port(source, "admin_port", raw.get("admin_port", DEFAULT_ADMIN_PORT)),
        amqp_port=amqp_port,
        management_port=management_port,
        data_dir=data_dir,
        seeds=tuple(str(s) for s in seeds),
        heartbeat_interval=_seconds(source, "heartbeat_interval", raw.get("heartbeat_interval", 0.2)),
        heartbeat_timeout=_seconds(source, "heartbeat_timeout", raw.get("heartbeat_timeout", 1.5)),
        cluster_nodes=tuple(cluster_nodes),
        registry_snapshot_every=snap,
        amqp_shell=amqp_shell,
        secret_file=secret_file,
        queue_hosts=queue_hosts,
        amqps_port=amqps_port,
        ssl_options=dict(ssl_options),
        max_message_size=max_message_size,
        cluster_partition_handling=handling,
        vm_memory_high_watermark=watermark,
        disk_free_limit=disk_free_limit,
    )
    if cfg.heartbeat_timeout <= 2 * cfg.heartbeat_interval:
        raise ConfigError(
            source,
            "heartbeat_timeout",
            f"must exceed twice heartbeat_interval ({cfg.heartbeat_interval}), got {cfg.heartbeat_timeout}",
        )
    if cfg.admin_port == cfg.amqp_port:
        raise ConfigError(source, "amqp_port", f"must differ from admin_port ({cfg.admin_port})")
    if cfg.management_port in (cfg.admin_port, cfg.amqp_port):
        raise ConfigError(
            source, "management_port", f"must differ from admin_port ({cfg.admin_port}) and amqp_port ({cfg.amqp_port})"
        )
    if cfg.amqps_port and cfg.amqps_port in (cfg.admin_port, cfg.amqp_port, cfg.management_port):
        raise ConfigError(
            source,
            "amqps_port",
            f"must differ from admin_port ({cfg.admin_port}), amqp_port ({cfg.amqp_port}) "
            f"and management_port ({cfg.management_port})",
        )
    return cfg


def load(path: str | os.PathLike) -> NodeConfig:
    source = str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(source, None, f"cannot read: {e.strerror or e}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(source, None, f"malformed YAML{at}: {problem}") from None
    return from_mapping(raw, source)
