"""Policies in the registry: the ``policy`` table's transactions and reads.

Sans-IO helpers shared by ``mirrorctl`` and the queue managers.

Guarantees
    * :func:`set_policy_txn` validates the whole policy first
      (:class:`~mirrorq.policy.records.Policy`); an invalid policy raises
      :class:`~mirrorq.policy.records.PolicyValidationError` and no
      transaction exists, so nothing is written.  A valid one becomes one
      ``put`` on ``policy`` at key ``(vhost, name)``: setting an existing
      policy replaces it (``rabbitmqctl set_policy`` does the same).
    * :func:`clear_policy_txn` deletes conditioned on the row existing, so
      clearing a policy that is not there fails as a whole, and the caller
      can say so (RabbitMQ: "Parameter does not exist").
    * :func:`policies_from_rows` turns table rows back into ``Policy``
      objects; a row that no longer validates (written by another version)
      is reported, not silently used.

Assumptions
    Rows come from the registry, whose schema (``mirrorq.mnesia_like.tables``)
    already checked field types.

Failure
    Bad arguments raise ``PolicyValidationError`` (a ``ValueError``) naming
    the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from mirrorq.policy.records import Policy, PolicyValidationError

__all__ = [
    "TABLE",
    "clear_policy_txn",
    "definition_json",
    "parse_definition",
    "policies_from_rows",
    "policy_listing",
    "set_policy_txn",
]

TABLE = "policy"


def parse_definition(text: str) -> dict[str, Any]:
    """A definition given on the command line: a JSON object."""
    if not isinstance(text, str):
        raise PolicyValidationError("definition", f"definition must be JSON text; {text!r} given")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PolicyValidationError(
            "definition", f"definition is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {text!r}"
        ) from None
    if not isinstance(value, dict):
        raise PolicyValidationError(
            "definition", f'definition must be a JSON object such as \'{{"ha-mode":"all"}}\'; {text!r} given'
        )
    return value


def definition_json(definition: Mapping[str, Any]) -> str:
    """Compact JSON, keys in the order given (as rabbitmqctl prints them)."""
    return json.dumps(dict(definition), separators=(",", ":"))


def set_policy_txn(policy: Policy) -> dict[str, Any]:
    if not isinstance(policy, Policy):
        raise PolicyValidationError("policy", f"a Policy is required; {policy!r} given")
    return {"ops": [{"op": "put", "table": TABLE, "key": [policy.vhost, policy.name], "record": policy.to_dict()}]}


def clear_policy_txn(vhost: str, name: str) -> dict[str, Any]:
    for field, value in (("vhost", vhost), ("name", name)):
        if not isinstance(value, str) or not value:
            raise PolicyValidationError(field, f"policy {field} must be a non-empty string; {value!r} given")
    key = [vhost, name]
    return {
        "checks": [{"table": TABLE, "key": key, "exists": True}],
        "ops": [{"op": "delete", "table": TABLE, "key": key}],
    }


def policies_from_rows(rows: Iterable[Mapping[str, Any]]) -> tuple[list[Policy], list[str]]:
    """``(policies, errors)``: every row that is a valid policy, and one line
    per row that is not (naming vhost, name and the broken rule)."""
    out: list[Policy] = []
    errors: list[str] = []
    for row in rows:
        try:
            out.append(Policy.from_dict(row))
        except (PolicyValidationError, TypeError) as e:
            errors.append(f"policy {row.get('name')!r} in vhost {row.get('vhost')!r} is invalid: {e}")
    return out, errors


def policy_listing(policies: Iterable[Policy], vhost: str | None) -> list[dict[str, Any]]:
    """Rows of ``list_policies`` (rabbitmqctl's columns: vhost, name, pattern,
    apply-to, definition, priority), of one vhost (``None``: all), by name."""
    rows = []
    for p in sorted(policies, key=lambda p: (p.vhost, p.name)):
        if vhost is not None and p.vhost != vhost:
            continue
        rows.append(
            {
                "vhost": p.vhost,
                "name": p.name,
                "pattern": p.pattern,
                "apply-to": p.apply_to,
                "definition": p.definition.to_dict(),
                "priority": p.priority,
            }
        )
    return rows
