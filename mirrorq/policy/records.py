"""Policy records and their validation (``rabbitmqctl set_policy``).

A policy is ``(vhost, name, pattern, definition, priority, apply-to)``, as in
RabbitMQ::

    rabbitmqctl set_policy [-p vhost] name pattern definition [priority]

The registry stores policies in its ``policy`` table (key ``(vhost, name)``)
as the plain dictionaries of :meth:`Policy.to_dict` (strings, integers,
lists, dicts: msgpack-friendly; fields ``vhost name pattern definition
priority apply_to``, the table's column names) and turns them back with
:meth:`Policy.from_dict`, which also takes RabbitMQ's spelling ``apply-to``
(as found in JSON exports of ``rabbitmqctl list_policies`` / definitions).

Guarantees
    * A :class:`Policy` object is always valid: the constructor validates
      every field and the definition, and ``from_dict`` goes through the
      constructor.  Policies are immutable (frozen dataclass, read-only
      definition mapping) and hashable, so they can be shared and cached.
    * ``Policy.from_dict(p.to_dict()) == p`` for every policy ``p``.
    * Every rejected input raises :class:`PolicyValidationError` (a
      ``ValueError``) whose message names the offending field or definition
      key, the value given and what would have been accepted; ``.key`` holds
      the name of that field/key.

Validation rules (RabbitMQ's ``rabbit_policy`` and
``rabbit_mirror_queue_misc:validate_policy``, plus two keys of our own)
    * ``vhost`` and ``name``: non-empty strings.
    * ``pattern``: a string that compiles as a Python regular expression.
      Matching is a *search* (RabbitMQ calls ``re:run``), see
      :mod:`mirrorq.policy.matching`.
    * ``priority``: an integer (default 0; ``bool`` is refused).
    * ``apply-to``: ``queues``, ``exchanges`` or ``all`` (default ``all``).
    * ``definition``: a non-empty mapping with string keys (RabbitMQ: "no
      policy provided"); every key must be one we know: RabbitMQ rejects
      unknown keys ("... are not recognised policy settings"), so do we.
    * Any ``ha-*`` key without ``ha-mode`` is an error.
    * ``ha-mode``: ``all`` (takes no ``ha-params``), ``exactly`` (``ha-params``
      an integer >= 1 that counts the master), ``nodes`` (``ha-params`` a
      non-empty list of node-name strings; unknown node names are allowed).
    * ``ha-sync-mode``: ``automatic`` | ``manual``.
    * ``ha-sync-batch-size``: integer > 0.
    * ``ha-promote-on-shutdown``: ``when-synced`` | ``always``.
    * ``ha-promote-on-failure``: ``always`` | ``when-synced``.
    * ``queue-master-locator``: ``min-masters`` | ``client-local`` | ``random``.
    * ``dead-letter-exchange``, ``dead-letter-routing-key``: strings (a
      queue's own ``x-dead-letter-*`` arguments win over them).
    * ours: ``ha-confirm-mode``: ``sync`` | ``async``;
      ``ha-confirm-timeout``: integer milliseconds > 0;
      ``ha-deliver-mode``: ``immediate`` | ``replicated`` (a queue's own
      ``x-ha-deliver-mode`` argument wins over it).

Assumptions
    Definitions come from JSON or msgpack, so node lists may arrive as lists
    or tuples; they are normalised to tuples inside the record and back to
    lists by ``to_dict``.

Failure
    Validation never partially succeeds: the first broken rule (checked in a
    fixed order: fields, then ``ha-mode`` presence, ``ha-mode``,
    ``ha-params``, the other keys) raises and nothing is built.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mirrorq.queues import semantics as _semantics

__all__ = [
    "APPLY_TO",
    "DEFINITION_KEYS",
    "HA_MODES",
    "QUEUE_MASTER_LOCATORS",
    "Definition",
    "Policy",
    "PolicyValidationError",
    "validate_definition",
]

HA_MODES = ("all", "exactly", "nodes")
HA_SYNC_MODES = ("automatic", "manual")
HA_PROMOTE_ON_SHUTDOWN = ("when-synced", "always")
HA_PROMOTE_ON_FAILURE = ("always", "when-synced")
QUEUE_MASTER_LOCATORS = ("min-masters", "client-local", "random")
HA_CONFIRM_MODES = ("sync", "async")
HA_DELIVER_MODES = _semantics.HA_DELIVER_MODES
APPLY_TO = ("queues", "exchanges", "all")

#: Every definition key we accept, in the order they are validated.
DEFINITION_KEYS = (
    "ha-mode",
    "ha-params",
    "ha-sync-mode",
    "ha-sync-batch-size",
    "ha-promote-on-shutdown",
    "ha-promote-on-failure",
    "ha-confirm-mode",
    "ha-confirm-timeout",
    "ha-deliver-mode",
    "queue-master-locator",
    "dead-letter-exchange",
    "dead-letter-routing-key",
)


class PolicyValidationError(ValueError):
    """A policy field or definition key is invalid; ``key`` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise PolicyValidationError(key, f"{key} must be one of {choices}; {value!r} given")


def _positive_int(key: str, value: Any, what: str = "an integer > 0") -> None:
    if not _is_int(value) or value <= 0:
        raise PolicyValidationError(key, f"{key} must be {what}; {value!r} given")


def _validate_ha_params(mode: str, params: Any, present: bool) -> Any:
    """Check ``ha-params`` against ``ha-mode``; return the normalised value."""
    if mode == "all":
        if present:
            raise PolicyValidationError("ha-params", f'ha-mode "all" does not take ha-params; {params!r} given')
        return None
    if mode == "exactly":
        if not present:
            raise PolicyValidationError(
                "ha-params",
                'ha-mode "exactly" needs ha-params: an integer >= 1 (the number of replicas, counting the master)',
            )
        if not _is_int(params) or params < 1:
            raise PolicyValidationError(
                "ha-params",
                f'ha-mode "exactly" takes an integer >= 1 as ha-params (counting the master); {params!r} given',
            )
        return params
    # mode == "nodes"
    if not present:
        raise PolicyValidationError("ha-params", 'ha-mode "nodes" needs ha-params: a non-empty list of node names')
    if not isinstance(params, (list, tuple)):
        raise PolicyValidationError(
            "ha-params", f'ha-mode "nodes" takes a list of node names as ha-params; {params!r} given'
        )
    if not params:
        raise PolicyValidationError(
            "ha-params", 'ha-mode "nodes" needs a non-empty list of node names as ha-params; [] given'
        )
    bad = [p for p in params if not isinstance(p, str) or not p]
    if bad:
        raise PolicyValidationError(
            "ha-params", f'ha-mode "nodes" takes a list of non-empty strings as ha-params; not node names: {bad!r}'
        )
    return tuple(params)


def validate_definition(definition: Any) -> dict[str, Any]:
    """Validate a policy definition; return a normalised plain copy.

    Raises :class:`PolicyValidationError` naming the first broken rule.
    ``ha-params`` of mode ``nodes`` comes back as a tuple.
    """
    if not isinstance(definition, Mapping):
        raise PolicyValidationError("definition", f"definition must be a dictionary; {type(definition).__name__} given")
    if not definition:
        raise PolicyValidationError("definition", "definition is empty: no policy provided")
    for key in definition:
        if not isinstance(key, str):
            raise PolicyValidationError("definition", f"definition keys must be strings; {key!r} given")
    unknown = sorted(k for k in definition if k not in DEFINITION_KEYS)
    if unknown:
        raise PolicyValidationError(
            unknown[0],
            f"{', '.join(repr(k) for k in unknown)} "
            f"{'is not a' if len(unknown) == 1 else 'are not'} recognised policy "
            f"setting{'' if len(unknown) == 1 else 's'}; known keys: {', '.join(DEFINITION_KEYS)}",
        )

    out: dict[str, Any] = {}
    ha_keys = sorted(k for k in definition if k.startswith("ha-"))
    if ha_keys and "ha-mode" not in definition:
        raise PolicyValidationError("ha-mode", f"ha-mode must be specified to use {', '.join(ha_keys)}")
    if "ha-mode" in definition:
        mode = definition["ha-mode"]
        _one_of("ha-mode", mode, HA_MODES)
        out["ha-mode"] = mode
        params = _validate_ha_params(mode, definition.get("ha-params"), "ha-params" in definition)
        if params is not None:
            out["ha-params"] = params
    if "ha-sync-mode" in definition:
        _one_of("ha-sync-mode", definition["ha-sync-mode"], HA_SYNC_MODES)
        out["ha-sync-mode"] = definition["ha-sync-mode"]
    if "ha-sync-batch-size" in definition:
        _positive_int("ha-sync-batch-size", definition["ha-sync-batch-size"])
        out["ha-sync-batch-size"] = definition["ha-sync-batch-size"]
    if "ha-promote-on-shutdown" in definition:
        _one_of("ha-promote-on-shutdown", definition["ha-promote-on-shutdown"], HA_PROMOTE_ON_SHUTDOWN)
        out["ha-promote-on-shutdown"] = definition["ha-promote-on-shutdown"]
    if "ha-promote-on-failure" in definition:
        _one_of("ha-promote-on-failure", definition["ha-promote-on-failure"], HA_PROMOTE_ON_FAILURE)
        out["ha-promote-on-failure"] = definition["ha-promote-on-failure"]
    if "ha-confirm-mode" in definition:
        _one_of("ha-confirm-mode", definition["ha-confirm-mode"], HA_CONFIRM_MODES)
        out["ha-confirm-mode"] = definition["ha-confirm-mode"]
    if "ha-confirm-timeout" in definition:
        _positive_int("ha-confirm-timeout", definition["ha-confirm-timeout"], "an integer number of milliseconds > 0")
        out["ha-confirm-timeout"] = definition["ha-confirm-timeout"]
    if "ha-deliver-mode" in definition:
        _one_of("ha-deliver-mode", definition["ha-deliver-mode"], HA_DELIVER_MODES)
        out["ha-deliver-mode"] = definition["ha-deliver-mode"]
    if "queue-master-locator" in definition:
        _one_of("queue-master-locator", definition["queue-master-locator"], QUEUE_MASTER_LOCATORS)
        out["queue-master-locator"] = definition["queue-master-locator"]
    for key in ("dead-letter-exchange", "dead-letter-routing-key"):
        if key in definition:
            if not isinstance(definition[key], str):
                raise PolicyValidationError(key, f"{key} must be a string; {definition[key]!r} given")
            out[key] = definition[key]
    return out


class Definition(Mapping[str, Any]):
    """A validated, read-only, hashable, picklable policy definition."""

    __slots__ = ("_items",)
    _items: dict[str, Any]

    def __init__(self, definition: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_items", validate_definition(definition))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a policy Definition is read-only")

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Definition):
            return self._items == other._items
        if isinstance(other, Mapping):
            try:
                return self._items == Definition(other)._items
            except PolicyValidationError:
                return False
        return NotImplemented

    def __repr__(self) -> str:
        return f"Definition({self.to_dict()!r})"

    def __reduce__(self) -> tuple[type[Definition], tuple[dict[str, Any]]]:
        return (Definition, (self.to_dict(),))

    def to_dict(self) -> dict[str, Any]:
        """A plain ``dict`` copy (tuples back to lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._items.items()}


@dataclass(frozen=True)
class Policy:
    """One policy record; always valid (see the module docstring)."""

    vhost: str
    name: str
    pattern: str
    definition: Definition
    priority: int = 0
    apply_to: str = "all"
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for fname in ("vhost", "name"):
            value = getattr(self, fname)
            if not isinstance(value, str) or not value:
                raise PolicyValidationError(fname, f"policy {fname} must be a non-empty string; {value!r} given")
        if not isinstance(self.pattern, str):
            raise PolicyValidationError("pattern", f"pattern must be a string; {self.pattern!r} given")
        try:
            regex = re.compile(self.pattern)
        except re.error as exc:
            raise PolicyValidationError(
                "pattern", f"pattern {self.pattern!r} is not a valid regular expression: {exc}"
            ) from None
        if not _is_int(self.priority):
            raise PolicyValidationError("priority", f"priority must be an integer; {self.priority!r} given")
        _one_of("apply-to", self.apply_to, APPLY_TO)
        definition = self.definition
        if not isinstance(definition, Definition):
            definition = Definition(definition)
        object.__setattr__(self, "definition", definition)
        object.__setattr__(self, "_regex", regex)

    def __reduce__(self) -> tuple[Callable[[Mapping[str, Any]], Policy], tuple[dict[str, Any]]]:
        return (Policy.from_dict, (self.to_dict(),))

    @property
    def regex(self) -> re.Pattern[str]:
        """The compiled pattern."""
        return self._regex

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, for the registry (msgpack) and the CLI (JSON)."""
        return {
            "vhost": self.vhost,
            "name": self.name,
            "pattern": self.pattern,
            "definition": self.definition.to_dict(),
            "priority": self.priority,
            "apply_to": self.apply_to,
        }

    _DICT_KEYS = ("vhost", "name", "pattern", "definition", "priority", "apply_to", "apply-to")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """Inverse of :meth:`to_dict`; ``priority`` and ``apply_to`` may be absent.

        ``apply-to`` (RabbitMQ's spelling) is accepted in place of ``apply_to``.
        """
        if not isinstance(data, Mapping):
            raise PolicyValidationError("policy", f"a policy record must be a dictionary; {type(data).__name__} given")
        unknown = sorted(str(k) for k in data if k not in cls._DICT_KEYS)
        if unknown:
            raise PolicyValidationError(
                unknown[0], f"unknown policy record field(s) {unknown}; expected {list(cls._DICT_KEYS)}"
            )
        if "apply_to" in data and "apply-to" in data:
            raise PolicyValidationError("apply_to", "give apply_to or apply-to, not both")
        for required in ("vhost", "name", "pattern", "definition"):
            if required not in data:
                raise PolicyValidationError(required, f"policy record is missing the field {required!r}")
        return cls(
            vhost=data["vhost"],
            name=data["name"],
            pattern=data["pattern"],
            definition=data["definition"],
            priority=data.get("priority", 0),
            apply_to=data.get("apply_to", data.get("apply-to", "all")),
        )
