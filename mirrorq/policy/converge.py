"""Placement that converges: what one node's queue manager does about mirrors.

Sans-IO.  :class:`Converger` is the decision half of the per-node queue
manager (:mod:`mirrorq.queues.manager`); the manager reads the
registry, calls :meth:`Converger.converge` and performs the actions it gets
back.  :func:`declare_placement` chooses where a new queue's founders go.

Protocol
--------
* **Who acts.**  Exactly one node acts for a queue: the node that hosts its
  master (the node of ``amqqueue.pid``).  RabbitMQ does the same (the master's
  node runs ``rabbit_mirror_queue_misc:update_mirrors``).  While the master's
  node is down nobody acts: GM promotes a mirror, the promotion rewrites
  ``pid``, and the new master's node takes over.  Two nodes can both believe
  they host the master only for the instant a promotion is being recorded;
  what they do then is idempotent (start on a node that already holds a
  replica: the target manager answers with the existing one; stop of a member
  that already left: nothing happens).
* **What it does.**  For each queue it acts for, the effective policy
  (:func:`~mirrorq.policy.matching.match`) and the queue's replicas as the
  record lists them (``slave_pids`` oldest first, synchronised when also in
  ``sync_slave_pids``) go into :func:`~mirrorq.policy.placement.plan_for`;
  the plan's steps become actions:

  - :class:`StartMirrorOn` -- ask the manager on ``node`` to start a replica
    that joins the queue's GM group unsynchronised (``StartReplica(join)``);
  - :class:`StopMirrorMember` -- ask the mirror ``member`` to leave the group
    and exit (``StopReplica``);
  - :class:`RecordPolicy` -- write the applied policy's name into
    ``amqqueue.policy``;
  - :class:`PushDefinition` -- tell every replica of the queue the effective
    definition (``SetPolicy``: ``ha-sync-mode``, ``ha-promote-on-failure``,
    ``ha-confirm-mode``...) whenever it or the set of replicas changed since
    this converger last told them (new mirrors get it in ``ReplicaInit``;
    :meth:`Converger.told` records what a declare's founders were started
    with, so a new queue costs no ``SetPolicy`` round);
  - :class:`TransferMasterTo` -- the plan moves the master (ha-mode ``nodes``
    without the master's node): the live master hands over to its
    synchronised mirror on that node and leaves (``MasterHandOver``); until
    the record shows the new master nothing synchronised is stopped (see
    :func:`~mirrorq.policy.placement.plan`).

  ``PromoteMirror`` never reaches here (the master's node is down, so this
  node does not act); promotion is GM's.
* **Pinned queues.**  A queue declared with the queue arguments
  ``x-ha-policy`` (``all`` | ``nodes``) and ``x-ha-policy-params`` -- RabbitMQ
  2.x's way to mirror by declaration, which mirrorq keeps for callers that
  name the nodes themselves (``DeclareQueue(nodes=...)``) -- is placed by its
  arguments whatever policy matches; the other ``ha-*`` keys (sync mode,
  promotion) still come from the matching policy.
* **Idempotence.**  An action in flight is not repeated: a start until the
  record lists a mirror on that node, a stop until the member is gone from the
  record, a policy write until the record shows it -- or until ``retry_after``
  seconds passed (the request or its answer was lost; the node died), after
  which it is issued again.  Calling ``converge`` as often as one likes
  (every registry change, every node event, every tick) is therefore safe.
* **Record hygiene.**  A second mirror listed on one node, or a mirror on the
  master's node (leftovers of a crash), is surplus: stopped (if its node is
  up), the first one listed is kept.

Guarantees (inherited from :func:`~mirrorq.policy.placement.plan`, which
sees the record): no action takes a queue from >= 1 synchronised replica to
none; synchronised surplus goes only after every wanted mirror runs and is
synchronised.  With a fixed set of up nodes, starts that land, and mirrors
that synchronise, the record reaches the policy's placement and ``converge``
then returns nothing (property-tested in ``tests/test_policy_converge.py``).

Assumptions
    ``nodes_up`` is this node's view of which nodes are up and can host a
    replica (their manager is known).  The record's replica lists are kept
    current by the master (GM view changes, sync progress) and dead members
    are removed from them on node death before that node is up again.

Failure
    A malformed queue row (``pid`` that is not a GM member name) is skipped
    and reported with :class:`BadRecord`; nothing else raises for registry
    contents.  Bad arguments (non-positive ``retry_after``) raise
    ``ValueError``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mirrorq.policy.matching import match
from mirrorq.policy.placement import (
    PromoteMirror,
    Replica,
    ReplicaSet,
    StartMirror,
    StopMirror,
    TransferMaster,
    choose_master,
    compute_mirrors,
    plan_for,
)
from mirrorq.policy.records import Policy, PolicyValidationError, validate_definition

__all__ = [
    "BadRecord",
    "Converger",
    "TransferMasterTo",
    "PushDefinition",
    "RecordPolicy",
    "StartMirrorOn",
    "StopMirrorMember",
    "declare_placement",
    "node_of",
    "replicas_of",
]

SPEC_FIELDS = ("name", "vhost", "durable", "auto_delete", "exclusive_owner", "arguments", "incarnation")


# ---------------------------------------------------------------------- actions
@dataclass(frozen=True)
class StartMirrorOn:
    vhost: str
    name: str
    node: str
    spec: dict[str, Any]  # what the new replica needs: name, vhost, durable, ...
    definition: dict[str, Any] | None = None  # the effective policy definition ({} if none)
    members: tuple[str, ...] = ()  # the queue's replicas now (record's gm_pids): a replica not among them is stale

    def __hash__(self) -> int:
        return hash((self.vhost, self.name, self.node))


@dataclass(frozen=True)
class PushDefinition:
    vhost: str
    name: str
    members: tuple[str, ...]  # every replica: the master first
    definition: dict[str, Any]

    def __hash__(self) -> int:
        return hash((self.vhost, self.name, self.members))


@dataclass(frozen=True)
class StopMirrorMember:
    vhost: str
    name: str
    node: str
    member: str


@dataclass(frozen=True)
class RecordPolicy:
    vhost: str
    name: str
    policy: str | None


@dataclass(frozen=True)
class TransferMasterTo:
    """Ask the live master ``member`` to hand over to its synchronised mirror on ``node``."""

    vhost: str
    name: str
    node: str
    member: str


@dataclass(frozen=True)
class BadRecord:
    vhost: str
    name: str
    error: str


Action = StartMirrorOn | StopMirrorMember | RecordPolicy | PushDefinition | TransferMasterTo | BadRecord

#: an action in flight: (kind, vhost, name, what) -- kind "start" / "transfer": what is a node;
#: "stop": a member; "policy": the policy name written (None: none applies)
_FlightKey = tuple[str, str, str, str | None]
#: what was last pushed to a queue's replicas: (the definition as JSON, the replicas)
_Signature = tuple[str, tuple[str, ...]]


# ---------------------------------------------------------------------- records
def node_of(member: object) -> str:
    """The node hosting GM member ``member`` ("node/host:port/uid")."""
    if not isinstance(member, str):
        raise ValueError(f"a GM member name is a string, got {member!r}")
    node, sep, rest = member.partition("/")
    if not node or not sep or not rest:
        raise ValueError(f"{member!r} is not a GM member name (node/host:port/uid)")
    return node


def replicas_of(row: Mapping[str, Any]) -> tuple[ReplicaSet, dict[str, str], list[tuple[str, str]]]:
    """``(replica set, {mirror node: member}, surplus [(node, member)])`` of an
    ``amqqueue`` row.  Surplus: a second mirror on one node, or a mirror on
    the master's node (the first one listed is kept).  ``ValueError`` if the
    row names no master or a malformed member."""
    pid = row.get("pid")
    if not pid:
        raise ValueError(f"queue {row.get('name')!r} has no master (pid) in its record")
    master = node_of(pid)
    synced = set(row.get("sync_slave_pids") or ())
    mirrors: list[Replica] = []
    members: dict[str, str] = {}
    surplus: list[tuple[str, str]] = []
    for m in row.get("slave_pids") or ():
        n = node_of(m)
        if n == master or n in members:
            surplus.append((n, m))
            continue
        members[n] = m
        mirrors.append(Replica(n, m in synced))
    return ReplicaSet(master, tuple(mirrors)), members, surplus


def argument_definition(arguments: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The placement a queue's own arguments ask for (``x-ha-policy`` and
    ``x-ha-policy-params``), as a validated definition, or ``None``.
    :class:`~mirrorq.policy.records.PolicyValidationError` if they are bad."""
    if not arguments or "x-ha-policy" not in arguments:
        if arguments and "x-ha-policy-params" in arguments:
            raise PolicyValidationError("x-ha-policy-params", "x-ha-policy-params given without x-ha-policy")
        return None
    mode = arguments["x-ha-policy"]
    if mode not in ("all", "nodes"):
        raise PolicyValidationError("x-ha-policy", f"x-ha-policy must be 'all' or 'nodes'; {mode!r} given")
    d: dict[str, Any] = {"ha-mode": mode}
    if "x-ha-policy-params" in arguments:
        d["ha-params"] = arguments["x-ha-policy-params"]
    return validate_definition(d)


def effective_placement_definition(policy: Policy | None, arguments: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The definition placement uses: the policy's, with ``ha-mode`` and
    ``ha-params`` replaced by the queue's ``x-ha-policy`` arguments if set."""
    pinned = argument_definition(arguments)
    base = None if policy is None else policy.definition.to_dict()
    if pinned is None:
        return base
    rest = {k: v for k, v in (base or {}).items() if k not in ("ha-mode", "ha-params")}
    return {**rest, **pinned}


def spec_of(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in SPEC_FIELDS if k in row}


# ---------------------------------------------------------------------- declare
def declare_placement(
    policy: Policy | None,
    declaring_node: str,
    nodes_up: Iterable[str],
    *,
    queue_name: str,
    masters_per_node: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
    locator: str | None = None,
    arguments: Mapping[str, Any] | None = None,
) -> list[str]:
    """The founders of a new queue, master first: the master by locator
    (``locator`` -- the queue argument ``x-queue-master-locator`` -- overrides
    the policy's), then the mirrors the policy wants.  Founders start empty, so
    they are all synchronised from the start.  No policy: the master alone
    (RabbitMQ: a queue no policy matches is not mirrored).  With ``ha-mode:
    nodes`` the master is chosen among the listed nodes that are up (the
    first listed one when the declaring node is not listed and the locator
    is client-local), so a new queue never starts with a master to move."""
    defn = effective_placement_definition(policy, arguments)
    up = sorted(set(nodes_up))
    candidates = up
    if defn and defn.get("ha-mode") == "nodes":
        # a new queue starts on a listed node (nothing to move later), if one is up
        listed_up = [n for n in dict.fromkeys(defn["ha-params"]) if n in up]
        if listed_up:
            candidates = listed_up
            loc = locator if locator is not None else defn.get("queue-master-locator", "client-local")
            if loc == "client-local" and declaring_node not in listed_up:
                declaring_node = listed_up[0]
    master = choose_master(
        defn, declaring_node, candidates, masters_per_node=masters_per_node, rng=rng, locator=locator
    )
    placement = compute_mirrors(defn, master, up, (), spread_key=queue_name)
    return [placement.master, *placement.mirrors]


# ---------------------------------------------------------------------- converge
class Converger:
    """The placement decisions of the queue manager on ``node`` (see module doc)."""

    def __init__(self, node: str, *, retry_after: float = 15.0) -> None:
        if not isinstance(node, str) or not node:
            raise ValueError(f"node must be a non-empty string; {node!r} given")
        if not isinstance(retry_after, (int, float)) or retry_after <= 0:
            raise ValueError(f"retry_after must be a positive number of seconds; {retry_after!r} given")
        self.node = node
        self.retry_after = float(retry_after)
        # in-flight actions -> the time after which they may be issued again
        self.in_flight: dict[_FlightKey, float] = {}
        # (vhost, name) -> (definition, members) last pushed to the replicas
        self.pushed: dict[tuple[str, str], _Signature] = {}

    def acts_for(self, row: Mapping[str, Any]) -> bool:
        pid = row.get("pid")
        if not pid:
            return False
        try:
            return node_of(pid) == self.node
        except ValueError:
            return False

    def converge(
        self, now: float, queues: Iterable[Mapping[str, Any]], policies: Iterable[Policy], nodes_up: Iterable[str]
    ) -> list[Action]:
        """Actions for every queue whose master is on this node."""
        policies = list(policies)
        up = sorted(set(nodes_up) | {self.node})
        actions: list[Action] = []
        seen: set[tuple[str, str]] = set()
        for row in queues:
            if not self.acts_for(row):
                continue
            key = (row["vhost"], row["name"])
            seen.add(key)
            actions += self._queue(now, row, policies, up)
        # forget in-flight entries of queues this node no longer acts for
        for k in [k for k in self.in_flight if (k[1], k[2]) not in seen]:
            del self.in_flight[k]
        for q in [q for q in self.pushed if q not in seen]:
            del self.pushed[q]
        return actions

    def told(self, row: Mapping[str, Any], definition: Mapping[str, Any]) -> None:
        """Every replica the record ``row`` lists was started with
        ``definition`` (the founders of a declare): no ``PushDefinition`` for
        the queue until the definition or the replicas change."""
        self.pushed[(row["vhost"], row["name"])] = self._signature(row, definition)

    @staticmethod
    def _signature(row: Mapping[str, Any], definition: Mapping[str, Any]) -> _Signature:
        return json.dumps(dict(definition), sort_keys=True), (row["pid"], *(row.get("slave_pids") or ()))

    def forget_node(self, node: str) -> None:
        """``node`` restarted (its queue manager has a new address): starts
        sent to it went to its old manager and are lost, so they may be
        issued again at once."""
        for k in [k for k in self.in_flight if k[0] == "start" and k[3] == node]:
            del self.in_flight[k]

    # ---- one queue -----------------------------------------------------------
    def _issue(self, now: float, key: _FlightKey) -> bool:
        """True if the action ``key`` may be issued now (and mark it in flight)."""
        until = self.in_flight.get(key)
        if until is not None and now < until:
            return False
        self.in_flight[key] = now + self.retry_after
        return True

    def _queue(self, now: float, row: Mapping[str, Any], policies: list[Policy], up: list[str]) -> list[Action]:
        vhost, name = row["vhost"], row["name"]
        try:
            current, members, surplus = replicas_of(row)
        except ValueError as e:
            return [BadRecord(vhost, name, str(e))]
        listed = set(row.get("slave_pids") or ())
        policy = match(policies, vhost, name, "queue")
        applied = None if policy is None else policy.name
        # what the record now shows (or no longer wants) is no longer in flight
        for k in [k for k in self.in_flight if k[1:3] == (vhost, name)]:
            if (
                (k[0] == "start" and k[3] in members)
                or (k[0] == "stop" and k[3] not in listed)
                or (k[0] == "policy" and (row.get("policy") == k[3] or k[3] != applied))
            ):
                del self.in_flight[k]

        actions: list[Action] = []
        if row.get("policy") != applied and self._issue(now, ("policy", vhost, name, applied)):
            actions.append(RecordPolicy(vhost, name, applied))

        up_set = set(up)
        for node, member in surplus:
            if node in up_set and self._issue(now, ("stop", vhost, name, member)):
                actions.append(StopMirrorMember(vhost, name, node, member))

        try:
            defn = effective_placement_definition(policy, row.get("arguments"))
        except PolicyValidationError as e:
            return actions + [BadRecord(vhost, name, str(e))]
        defn = defn or {}
        everyone = (row["pid"], *(row.get("slave_pids") or ()))
        signature = self._signature(row, defn)
        if self.pushed.get((vhost, name)) != signature:
            self.pushed[(vhost, name)] = signature
            actions.append(PushDefinition(vhost, name, everyone, dict(defn)))
        for step in plan_for(defn or None, current, up, spread_key=name):
            if isinstance(step, StartMirror):
                if self._issue(now, ("start", vhost, name, step.node)):
                    members_now = tuple(row.get("gm_pids") or everyone)
                    actions.append(StartMirrorOn(vhost, name, step.node, spec_of(row), dict(defn), members_now))
            elif isinstance(step, StopMirror):
                member = members[step.node]
                if self._issue(now, ("stop", vhost, name, member)):
                    actions.append(StopMirrorMember(vhost, name, step.node, member))
            elif isinstance(step, TransferMaster):
                if self._issue(now, ("transfer", vhost, name, step.node)):
                    actions.append(TransferMasterTo(vhost, name, step.node, row["pid"]))
            elif isinstance(step, PromoteMirror):  # pragma: no cover - master is here, so up
                continue
        return actions
