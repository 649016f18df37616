"""Where a mirrored queue's replicas live, and how to get them there safely.

Pure functions, no I/O, no clock.  Three questions:

1. :func:`choose_master` -- on which node does a *new* queue's master start?
   By ``queue-master-locator`` (the policy key, or an override such as the
   queue argument ``x-queue-master-locator``):
   ``client-local`` (default, as in RabbitMQ) the declaring node;
   ``min-masters`` the up node hosting fewest masters (counts passed in; ties
   by node name); ``random`` a node drawn with the seeded ``random.Random``
   passed in (from the up nodes in sorted order, so a seed replays).
2. :func:`compute_mirrors` -- given the queue's effective policy definition,
   its master's node, the nodes that are up and its current mirrors, what
   :class:`Placement` (master + mirror nodes) do we want?

   * no ``ha-mode`` (or no policy): the master alone;
   * ``all``: every up node;
   * ``exactly`` N: the master and N-1 mirrors (fewer if fewer nodes are up).
     Existing live mirrors are kept, synchronised ones first, then by age
     (RabbitMQ keeps the oldest); the rest is filled from the other up nodes
     in a deterministic order: sorted by name, rotated by a CRC32 of
     ``spread_key`` (pass the queue name to spread queues over the cluster;
     RabbitMQ shuffles instead).  A mirror whose node is down is dead, so a
     new one is placed elsewhere;
   * ``nodes`` [list]: the listed nodes that are up (unknown names are just
     never up).  If the master's node is not listed, RabbitMQ keeps the
     master until a mirror on a listed node is synchronised and then moves
     the master there; so do we: the placement keeps the current master
     (with mirrors on every listed up node) until one of those mirrors is
     synchronised, and only then names it master (the first such node in
     policy-list order, as RabbitMQ).  Unlike RabbitMQ (any synchronised
     mirror will do there), the replacement must be a synchronised mirror on
     a *listed* node, so the move never loses messages; and :func:`plan`
     moves the master only once the new placement's mirrors are all
     synchronised too.  No listed node up: the master alone.

   If the master's node is down, the master is dead: whatever the mode (even
   with the policy gone, a leftover mirror is all that holds the data) the
   placement names the mirror that takes over (:func:`promotion_candidate`):
   the oldest synchronised live mirror; with ``ha-promote-on-failure: always``
   (RabbitMQ's default) the oldest live mirror if none is synchronised;
   with ``when-synced``, nobody, and the placement keeps the dead master
   (the queue is unavailable until its node returns).  RabbitMQ promotes the
   oldest live mirror even when a younger one is synchronised; we prefer a
   synchronised one.
3. :func:`plan` -- the steps that move the current replicas towards a
   placement: :class:`StartMirror`, :class:`StopMirror`,
   :class:`TransferMaster` (a live master hands over to a synchronised mirror
   and stops) and :class:`PromoteMirror` (the master is dead; a mirror takes
   over).  Apply them in order, let time pass (mirrors synchronise), compute
   the placement again and re-plan until the plan is empty.

Guarantees of :func:`plan`
    * Safety: no step ever takes the queue from >= 1 synchronised replica
      (a live master counts as one) to zero.  Stops never touch the master;
      the master moves only to a mirror that is synchronised *now*
      (``TransferMaster``), or, when it is already dead, by promotion.
    * Make before break: a synchronised replica that is no longer wanted --
      a mirror, or the master when it moves -- goes only once every wanted
      mirror is running and synchronised (unsynchronised unwanted mirrors go
      at once).  Hence, with ``T`` the number of up nodes in the placement,
      no step takes the count of synchronised replicas from ``s`` to below
      ``min(s, T)``: redundancy never drops below what the policy wants.
    * Steps only name nodes that are up.  The plan is empty exactly when
      nothing can be done now; with mirrors synchronising between rounds and
      the set of up nodes fixed, at most three rounds do something (promote;
      start; transfer and stop) and the fourth plan is empty; the replicas
      are then the placement.

Assumptions
    ``current`` lists mirrors oldest first (the ``slave_pids`` order of the
    ``amqqueue`` record) with their synchronised flags.  A replica whose node
    is not in ``nodes_up`` is dead; the plan ignores it (removing it from the
    record is the death handling's job, as in RabbitMQ, and it must be done
    before that node counts as up again: a stale entry for an up node is
    taken for a live mirror).  Whoever applies a
    ``StartMirror`` sees the new mirror unsynchronised until sync completes
    (``ha-sync-mode: automatic``) or an operator syncs it (``manual``); the
    plan waits for that and never forces it.  Controlled shutdown
    (``ha-promote-on-shutdown``) is decided by the queue process, not here.

Failure
    Malformed input (a non-string node, a mirror listed twice or on the
    master's node, an invalid definition, a locator without the counts or rng
    it needs, a declaring node that is down) raises ``ValueError`` (a
    :class:`~mirrorq.policy.records.PolicyValidationError` for definitions)
    naming what was wrong.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mirrorq.classic.promotion import elect_master
from mirrorq.policy.records import QUEUE_MASTER_LOCATORS, validate_definition

__all__ = [
    "Placement",
    "PromoteMirror",
    "Replica",
    "ReplicaSet",
    "StartMirror",
    "Step",
    "StopMirror",
    "TransferMaster",
    "choose_master",
    "compute_mirrors",
    "plan",
    "plan_for",
    "promotion_candidate",
]


# --------------------------------------------------------------------------
# data


def _check_node(node: Any, what: str) -> str:
    if not isinstance(node, str) or not node:
        raise ValueError(f"{what} must be a non-empty node name string; {node!r} given")
    return node


@dataclass(frozen=True)
class Replica:
    """A mirror on ``node``; ``synchronised`` if it holds every message."""

    node: str
    synchronised: bool = False

    def __post_init__(self) -> None:
        _check_node(self.node, "Replica.node")
        if not isinstance(self.synchronised, bool):
            raise ValueError(f"Replica.synchronised must be a bool; {self.synchronised!r} given")


ReplicaLike = Replica | tuple[str, bool]


def _coerce_replicas(replicas: Iterable[ReplicaLike], master: str | None) -> tuple[Replica, ...]:
    out: list[Replica] = []
    seen: set[str] = set()
    for r in replicas:
        if not isinstance(r, Replica):
            if isinstance(r, (tuple, list)) and len(r) == 2:
                r = Replica(r[0], r[1])
            else:
                raise ValueError(f"a replica must be a Replica or a (node, synchronised) pair; {r!r} given")
        if r.node in seen:
            raise ValueError(f"node {r.node!r} is listed twice among the mirrors")
        if r.node == master:
            raise ValueError(f"node {r.node!r} hosts the master and cannot also hold a mirror")
        seen.add(r.node)
        out.append(r)
    return tuple(out)


@dataclass(frozen=True)
class ReplicaSet:
    """Where a queue's replicas are now: master node + mirrors, oldest first."""

    master: str
    mirrors: tuple[Replica, ...] = ()

    def __post_init__(self) -> None:
        _check_node(self.master, "ReplicaSet.master")
        object.__setattr__(self, "mirrors", _coerce_replicas(self.mirrors, self.master))


@dataclass(frozen=True)
class Placement:
    """Where a queue's replicas should be: master node + mirror nodes."""

    master: str
    mirrors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_node(self.master, "Placement.master")
        mirrors = tuple(self.mirrors)
        for n in mirrors:
            _check_node(n, "Placement mirror")
        if len(set(mirrors)) != len(mirrors) or self.master in mirrors:
            raise ValueError(f"placement nodes must be distinct: master {self.master!r}, mirrors {list(mirrors)!r}")
        object.__setattr__(self, "mirrors", mirrors)

    @property
    def nodes(self) -> frozenset[str]:
        return frozenset((self.master, *self.mirrors))


@dataclass(frozen=True)
class StartMirror:
    """Start a mirror on ``node``; it joins unsynchronised."""

    node: str


@dataclass(frozen=True)
class StopMirror:
    """Stop the mirror on ``node``."""

    node: str


@dataclass(frozen=True)
class TransferMaster:
    """The live master hands over to the synchronised mirror on ``node``, then stops."""

    node: str


@dataclass(frozen=True)
class PromoteMirror:
    """The master is dead: the mirror on ``node`` becomes master."""

    node: str


Step = StartMirror | StopMirror | TransferMaster | PromoteMirror


def _up_nodes(nodes_up: Iterable[str]) -> list[str]:
    if isinstance(nodes_up, str):
        raise ValueError(f"nodes_up must be a collection of node names, not the string {nodes_up!r}")
    return sorted({_check_node(n, "an up node") for n in nodes_up})


def _definition(policy_definition: Mapping[str, Any] | None) -> dict[str, Any]:
    if policy_definition is None:
        return {}
    return validate_definition(policy_definition)


def _candidate_order(up: Sequence[str], spread_key: str | None) -> list[str]:
    if not up or spread_key is None:
        return list(up)
    k = zlib.crc32(spread_key.encode("utf-8")) % len(up)
    return list(up[k:]) + list(up[:k])


# --------------------------------------------------------------------------
# master choice


def choose_master(
    policy_definition: Mapping[str, Any] | None,
    declaring_node: str,
    nodes_up: Iterable[str],
    *,
    masters_per_node: Mapping[str, int] | None = None,
    rng: random.Random | None = None,
    locator: str | None = None,
) -> str:
    """The node for a new queue's master (see the module docstring).

    ``locator`` overrides the policy's ``queue-master-locator``.
    """
    defn = _definition(policy_definition)
    loc = locator if locator is not None else defn.get("queue-master-locator", "client-local")
    if loc not in QUEUE_MASTER_LOCATORS:
        raise ValueError(f"queue-master-locator must be one of {list(QUEUE_MASTER_LOCATORS)}; {loc!r} given")
    up = _up_nodes(nodes_up)
    if not up:
        raise ValueError("no node is up: cannot place a queue master")
    if loc == "client-local":
        _check_node(declaring_node, "declaring_node")
        if declaring_node not in up:
            raise ValueError(f"client-local: the declaring node {declaring_node!r} is not up")
        return declaring_node
    if loc == "min-masters":
        if masters_per_node is None:
            raise ValueError("min-masters needs masters_per_node (masters hosted per node)")
        for n, c in masters_per_node.items():
            if not isinstance(c, int) or isinstance(c, bool) or c < 0:
                raise ValueError(f"masters_per_node[{n!r}] must be an integer >= 0; {c!r} given")
        return min(up, key=lambda n: (masters_per_node.get(n, 0), n))
    # random
    if rng is None:
        raise ValueError("the random locator needs a seeded random.Random (rng)")
    return rng.choice(up)


# --------------------------------------------------------------------------
# desired placement


def promotion_candidate(
    mirrors: Iterable[ReplicaLike], nodes_up: Iterable[str], promote_on_failure: str = "always"
) -> str | None:
    """The mirror to promote when the master dies, or ``None``: the
    election rule of the promotion protocol
    (:func:`mirrorq.classic.promotion.elect_master`) over the live
    mirrors, oldest first -- the oldest live synchronised mirror; failing
    that, with ``always``, the oldest live mirror; with ``when-synced``,
    nobody.
    """
    if promote_on_failure not in ("always", "when-synced"):
        raise ValueError(f"promote_on_failure must be 'always' or 'when-synced'; {promote_on_failure!r} given")
    up = set(_up_nodes(nodes_up))
    live = [r for r in _coerce_replicas(mirrors, None) if r.node in up]
    synced = {r.node: r.synchronised for r in live}
    return elect_master([r.node for r in live], lambda n: synced[n], promote_on_failure == "always")


def compute_mirrors(
    policy_definition: Mapping[str, Any] | None,
    queue_master_node: str,
    nodes_up: Iterable[str],
    current_replicas: Iterable[ReplicaLike] = (),
    *,
    spread_key: str | None = None,
) -> Placement:
    """The desired :class:`Placement` (see the module docstring).

    ``current_replicas``: the queue's mirrors, oldest first, as
    :class:`Replica` or ``(node, synchronised)`` pairs.
    """
    defn = _definition(policy_definition)
    _check_node(queue_master_node, "queue_master_node")
    up = _up_nodes(nodes_up)
    up_set = set(up)
    live = [r for r in _coerce_replicas(current_replicas, queue_master_node) if r.node in up_set]
    mode = defn.get("ha-mode")
    master = queue_master_node

    if master not in up_set:
        # even an unmirrored queue (policy cleared) promotes a leftover mirror:
        # it holds the queue's data, the dead master holds nothing reachable
        cand = promotion_candidate(live, up, defn.get("ha-promote-on-failure", "always"))
        if cand is None:
            return Placement(master)
        master = cand
        live = [r for r in live if r.node != cand]

    if mode is None:
        return Placement(master)

    if mode == "all":
        keep = [r.node for r in live]
        fresh = [n for n in _candidate_order(up, spread_key) if n != master and n not in keep]
        return Placement(master, tuple(keep + fresh))

    if mode == "exactly":
        want = min(defn["ha-params"] - 1, len(up) - 1)
        # synchronised first, then by age (sorted() is stable)
        kept = [r.node for r in sorted(live, key=lambda r: not r.synchronised)][:want]
        fresh = [n for n in _candidate_order(up, spread_key) if n != master and n not in kept]
        return Placement(master, tuple(kept + fresh[: want - len(kept)]))

    # mode == "nodes"
    listed = list(dict.fromkeys(defn["ha-params"]))
    available = [n for n in listed if n in up_set]
    if not available:
        return Placement(master)
    if master in available:
        return Placement(master, tuple(n for n in available if n != master))
    synced = {r.node for r in live if r.synchronised}
    replacements = [n for n in available if n in synced]
    if replacements:
        new_master = replacements[0]
        return Placement(new_master, tuple(n for n in available if n != new_master))
    return Placement(master, tuple(available))


# --------------------------------------------------------------------------
# convergence plan


def plan(current: ReplicaSet, desired: Placement, nodes_up: Iterable[str]) -> list[Step]:
    """Steps that move ``current`` towards ``desired`` safely, to apply in order.

    See the module docstring for the guarantees.
    """
    if not isinstance(current, ReplicaSet):
        raise ValueError(f"current must be a ReplicaSet; {current!r} given")
    if not isinstance(desired, Placement):
        raise ValueError(f"desired must be a Placement; {desired!r} given")
    up = set(_up_nodes(nodes_up))
    live = {r.node: r for r in current.mirrors if r.node in up}

    if current.master not in up:
        # the master is dead: only a promotion can help, then re-plan
        if desired.master != current.master and desired.master in live:
            return [PromoteMirror(desired.master)]
        return []

    steps: list[Step] = []
    moving = desired.master != current.master
    wanted = ([desired.master] if moving else []) + list(desired.mirrors)
    for node in wanted:
        if node in up and node != current.master and node not in live:
            steps.append(StartMirror(node))

    # make before break: every wanted mirror (on an up node) runs and is
    # synchronised before anything synchronised goes away -- the old master
    # included, so a move never lowers redundancy below what is wanted
    wanted_synced = all(n in live and live[n].synchronised for n in desired.mirrors if n in up and n != current.master)
    transferred = False
    if moving:
        target = live.get(desired.master)
        if target is not None and target.synchronised and wanted_synced:
            steps.append(TransferMaster(desired.master))
            transferred = True

    starting = any(isinstance(s, StartMirror) for s in steps)
    made = not starting and wanted_synced and (not moving or transferred)
    for node, r in live.items():
        if node == desired.master or node in desired.mirrors:
            continue
        if not r.synchronised or made:
            steps.append(StopMirror(node))
    return steps


def plan_for(
    policy_definition: Mapping[str, Any] | None,
    current: ReplicaSet,
    nodes_up: Iterable[str],
    *,
    spread_key: str | None = None,
) -> list[Step]:
    """``plan(current, compute_mirrors(...), nodes_up)`` in one call."""
    nodes_up = list(nodes_up)
    desired = compute_mirrors(policy_definition, current.master, nodes_up, current.mirrors, spread_key=spread_key)
    return plan(current, desired, nodes_up)
