"""Which policy applies to a queue or exchange: pattern matching and priority.

Guarantees
    * A policy matches an entity when all of these hold (``rabbit_policy:matches``):
      the policy's vhost equals the entity's vhost; its ``apply-to`` covers the
      entity's kind (``queues`` -> queues, ``exchanges`` -> exchanges, ``all``
      -> both); its pattern is found *anywhere* in the entity's name.  RabbitMQ
      calls ``re:run(Name, Pattern)``, which is a search, so ``"ha"`` matches
      ``"orders.ha.1"``; anchor with ``^``/``$`` to restrict.  We use
      ``re.search`` on the compiled pattern of the record.
    * At most one policy applies: the matching policy with the highest
      priority.
    * The choice is deterministic and the same on every node for the same
      set of policies, whatever order the registry lists them in.

Ties (documented choice)
    RabbitMQ sorts the matching policies with ``lists:sort/2`` and the
    comparator ``priority(A) >= priority(B)`` and takes the head.  The
    comparator looks at the priority only and ``lists:sort/2`` is stable, so
    among equal priorities RabbitMQ takes whichever policy its storage listed
    first.  The Mnesia table behind runtime parameters is a hash ``set``, so
    that order is unspecified, and RabbitMQ's documentation says so: "When
    multiple policies match an entity and they all have equal priorities,
    the effective one will be chosen undeterministically."  (With Khepri the
    listing comes out in key order for small vhosts, i.e. by name
    ascending, so the first name wins.)
    mirrorq must give one answer on every node, so it fixes the order RabbitMQ
    leaves open the way an ordered listing would: **highest priority first,
    then policy name ascending (code-point order, which equals Erlang's
    byte order of UTF-8 binaries); the first wins** -- for equal priorities
    the policy whose name sorts *first* applies.

Assumptions
    Policies are valid :class:`~mirrorq.policy.records.Policy` records; names
    are unique within a vhost (the registry keys policies by (vhost, name)).

Failure
    An unknown entity kind raises ``ValueError``.  Nothing else can fail:
    patterns were compiled when the record was built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mirrorq.policy.records import Policy

__all__ = ["KINDS", "effective_definition", "match", "match_all", "matches"]

#: Entity kinds a policy can apply to, and which ``apply-to`` values cover them.
KINDS = {"queue": ("queues", "all"), "exchange": ("exchanges", "all")}


def _check_kind(kind: str) -> tuple[str, ...]:
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"entity kind must be one of {sorted(KINDS)}; {kind!r} given") from None


def matches(policy: Policy, vhost: str, name: str, kind: str = "queue") -> bool:
    """Does ``policy`` match the entity ``name`` of ``kind`` in ``vhost``?"""
    covers = _check_kind(kind)
    return policy.vhost == vhost and policy.apply_to in covers and policy.regex.search(name) is not None


def _rank(policy: Policy) -> tuple[int, str]:
    return (-policy.priority, policy.name)


def match_all(policies: Iterable[Policy], vhost: str, name: str, kind: str = "queue") -> list[Policy]:
    """All matching policies, the one that applies first (see module docstring)."""
    _check_kind(kind)
    return sorted((p for p in policies if matches(p, vhost, name, kind)), key=_rank)


def match(policies: Iterable[Policy], vhost: str, name: str, kind: str = "queue") -> Policy | None:
    """The policy that applies to the entity, or ``None``."""
    winner = None
    for policy in policies:
        if matches(policy, vhost, name, kind) and (winner is None or _rank(policy) < _rank(winner)):
            winner = policy
    _check_kind(kind)
    return winner


def effective_definition(policies: Iterable[Policy], vhost: str, queue_name: str) -> dict[str, Any] | None:
    """The definition of the policy that applies to queue ``queue_name``.

    A plain ``dict`` (the winning policy's ``definition.to_dict()``), or
    ``None`` when no policy applies (RabbitMQ's ``undefined``): the queue is
    then not mirrored.
    """
    winner = match(policies, vhost, queue_name, "queue")
    return None if winner is None else winner.definition.to_dict()
