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


@dataclass
class Subscribe:
    """A local actor wants NodeEvent / ActorDown notifications."""


@dataclass
class Unsubscribe:
    pass


@dataclass
class NodeEvent:
    """``kind`` is "up" or "down"; ``reason`` says why a node went down."""

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


@dataclass
class PrepareStop:
    """Graceful stop: tell peers we leave, then answer; mirrorctl then shuts
    the actor system down."""


@dataclass
class Stopping:
    name: str
