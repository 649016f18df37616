"""What a queue manager, its queue hosts and the replicas in them say to each other.

Plain data (no transport): the manager's core (:mod:`mirrorq.queues.manager_core`)
builds and reads these; the queue host (:mod:`mirrorq.queues.host`)
and the hosted replica (:mod:`mirrorq.classic.actor`) carry them out.

* :class:`ReplicaInit` -- manager to the queue host of the queue
  (:func:`host_index`): start a replica; answered :class:`ReplicaStarted`
  (its GM member name) with the request's ``token``.
* :class:`FoundGroup` -- to the first founder of a new queue: create the
  group's ``gm_group`` row with the founders (it then promotes itself and
  writes the queue's ``amqqueue`` record).
* :class:`SetPolicy`, :class:`StopReplica`, :class:`MasterHandOver`,
  :class:`ExitReplica` -- placement's orders to one replica.
* :class:`ReplicaExited` -- host to manager: a replica left the host.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any


def group_name(vhost: str, name: str) -> str:
    return f"queue:{vhost}/{name}"


def host_index(vhost: str, name: str, hosts: int) -> int:
    """Which of a node's ``hosts`` queue hosts runs queue (vhost, name): a
    stable hash, the same on every node and after a restart."""
    if hosts <= 0:
        raise ValueError(f"a node needs at least one queue host, got {hosts}")
    return zlib.crc32(f"{vhost}\0{name}".encode()) % hosts


@dataclass
class ReplicaInit:
    spec: dict  # QueueSpec fields
    data_dir: str
    node: str
    agent: Any
    fresh: bool = False  # True: start with an empty store
    token: int = 0  # echoed in ReplicaStarted
    join: bool = False  # join the running group as a new (unsynchronised) mirror
    recover: bool = False  # a durable queue coming back after a restart: drop transient messages
    policy: dict = field(default_factory=dict)  # effective policy definition (ha-sync-mode...)
    policy_name: str | None = None  # the policy's name, for the master's first record
    #: a quorum queue's member: {"member": its stable name, "voters": [the group's members]}
    quorum: dict | None = None


@dataclass(frozen=True)
class FrontEndAt:
    """From a node's AMQP front end to its queue manager, which passes it on
    to every queue host: where the node's masters send what they
    dead-letter (``QueueReplica.dead_letter_dst``)."""

    dst: str


@dataclass
class SetPolicy:
    definition: dict


@dataclass
class StopReplica:
    """Leave the queue's group (a registry view change without this member) and exit."""


@dataclass
class MasterHandOver:
    """To a queue's master: hand over to the synchronised mirror on ``node``
    (placement's TransferMaster), then leave and exit."""

    node: str


@dataclass
class ExitReplica:
    """To a replica: close the store and leave the host at once, without
    leaving the group (what a killed replica process did)."""


@dataclass
class ReplicaExited:
    """From a queue host to its manager: ``member`` of queue ``key`` (vhost,
    name) is gone from the host (``reason``: exited, deleted, crashed...)."""

    member: str
    key: tuple
    reason: str


@dataclass
class ReplicaStarted:
    member: str
    node: str
    token: int = 0


@dataclass
class ReplicaStartFailed:
    """From a queue host to its manager: the ``ReplicaInit`` with ``token``
    (for queue ``key``) started nothing (``reason``: its store could not be
    opened, or was found corrupt and reported)."""

    token: int
    key: tuple
    reason: str


@dataclass
class FoundGroup:
    """Sent to the first founder: create the group's gm_group row."""

    founders: tuple
