"""Messages between node agents, local actors and mirrorctl.

They travel pickled by Thespian between processes on loopback; keep them
small, plain and versionless (all nodes of a cluster run the same code).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

AGENT_GLOBAL_NAME = "mirrorq.node_agent"
NODE_CAPABILITY = "mirrorq.node"


@dataclass
class NodeInit:
    """From the node daemon to its freshly created agent."""

    config: dict


@dataclass
class NodeReady:
    name: str
    pid: int
    pgid: int
    incarnation: int


@dataclass
class PeerEnvelope:
    """A membership message between node agents, with the sender's contact:
    its node name and admin address (``host:port``, stable across restarts)."""

    src: str
    admin: str
    msg: Any
    channel: str = "membership"  # or "registry"


@dataclass
class Subscribe:
    """A local actor wants NodeEvent / ActorDown notifications."""


@dataclass
class Unsubscribe:
    pass


@dataclass
class NodeEvent:
    """``kind`` is "up" or "down" (``node`` went up or down; ``reason`` says
    why), or "paused" / "resumed": this node lost or regained a majority
    of the cluster (``reason`` says what it reaches; mirrorq.node.lease)."""

    kind: str
    node: str
    incarnation: int
    reason: str = ""


@dataclass
class ActorDown:
    """A local actor created through the agent exited."""

    address: Any
    label: str


@dataclass
class CreateLocal:
    """Ask the agent to create a local actor (the agent is the parent of every
    local actor, so it hears when one dies)."""

    actor_class: str
    label: str
    init: Any = None


@dataclass
class Created:
    label: str
    address: Any


@dataclass
class StatusQuery:
    pass


@dataclass
class NodeStatus:
    name: str
    incarnation: int
    pid: int
    pgid: int
    admin_port: int
    amqp_port: int
    view: dict = field(default_factory=dict)
    registry: dict = field(default_factory=dict)
    #: the agent process's Thespian transmits ``(in progress, waiting in Thespian's FIFO)``
    transmits: tuple = (0, 0)
    #: ``cluster_partition_handling`` and what it decided: ``paused`` (in a
    #: minority), ``sees`` (the voters heard), ``cluster`` (the voters), ``since``
    partition: dict = field(default_factory=dict)
    #: resource alarms (mirrorq.node.alarms.Alarms.status): this node's memory and
    #: disk figures, limits and alarms, and ``alarms``, every alarm in the cluster
    alarms: dict = field(default_factory=dict)
    #: the node's config as it started (NodeConfig.to_dict): a tool on another
    #: host learns its ports and address from it (mirrorq.admin.remote)
    config: dict = field(default_factory=dict)
    #: the admin address ("host:port") of every peer this node has heard of, by name
    peers: dict = field(default_factory=dict)


@dataclass
class AlarmSubscribe:
    """A local actor (an AMQP front end) wants :class:`ResourceAlarms`: the
    alarms in effect now, and again at every change."""


@dataclass
class ResourceAlarms:
    """Every resource alarm in effect in the cluster, as this node sees it:
    sorted ``(node, resource)`` pairs, resource "memory" or "disk"
    (:mod:`mirrorq.node.alarms`)."""

    alarms: tuple = ()


@dataclass
class SetResourceLimit:
    """From a tool: change this node's ``vm_memory_high_watermark``
    (``resource`` "memory") or ``disk_free_limit`` ("disk") until it
    restarts; ``setting`` as node.yaml takes it.  Answered with
    :class:`ResourceLimitResult` after a check with the new limit."""

    resource: str
    setting: Any


@dataclass
class ResourceLimitResult:
    ok: bool
    error: str = ""
    alarms: dict = field(default_factory=dict)  # the node's figures after the check (NodeStatus.alarms)


@dataclass
class PrepareStop:
    """Graceful stop: tell peers we leave, then answer; mirrorctl then shuts
    the actor system down."""


@dataclass
class Stopping:
    name: str


# ---- the registry, as local actors and tools use it --------------------------------
@dataclass
class RegistryTxn:
    """Run a transaction (see mirrorq.mnesia_like.registry); answered with
    RegistryResult once committed and applied, or refused."""

    txn: dict
    ref: Any = None  # echoed in the RegistryResult: tells a requester's answers apart


@dataclass
class RegistryForget:
    """Remove a (dead) node from the registry's Raft configuration."""

    node: str


@dataclass
class RegistryResult:
    ok: bool
    error: str = ""
    ref: Any = None  # the request's ref


@dataclass
class RegistryGet:
    """Read a table (all rows, or the row at ``key``).  ``linearizable``
    confirms with the Raft leader first."""

    table: str
    key: Any = None
    linearizable: bool = False
    ref: Any = None  # echoed in the RegistryRows


@dataclass
class RegistryRows:
    ok: bool
    rows: list
    error: str = ""
    ref: Any = None  # the request's ref


@dataclass
class RegistrySubscribe:
    """Get RegistryChanges for these tables after every apply."""

    tables: tuple


@dataclass
class RegistryChanges:
    changes: list[tuple[str, Any, Any, Any]] | None  # [(table, key, old, new)], or None after a snapshot reset


@dataclass
class BlockPeers:
    """Test-only (honoured when MIRRORQ_TEST_HOOKS=1 in the node's
    environment): drop all traffic to and from these nodes, as a partition."""

    nodes: tuple
