"""The registry state machine: tables, transactions, snapshots.

This is what every node applies, in the same order, from the Raft log (see
``raft.py``).  It is deterministic and pure: a command in, a result and a
list of changes out.

Transactions
------------
A transaction is a plain dict (msgpack-friendly)::

    {"checks": [...], "ops": [...]}

``checks`` are preconditions, all evaluated against the state *before* the
transaction; if any fails, nothing is applied:

* ``{"table": T, "key": K, "absent": True}``   the row does not exist
* ``{"table": T, "key": K, "exists": True}``   the row exists
* ``{"table": T, "key": K, "field": F, "equals": V}``  the row exists and F == V
  (e.g. "gm_group version is V": a GM view change wins only once)

``ops`` are applied in order:

* ``{"op": "put", "table": T, "key": K, "record": {...}}``  insert or replace
* ``{"op": "update", "table": T, "key": K, "fields": {...}}``  merge into an
  existing row (an error if it does not exist)
* ``{"op": "delete", "table": T, "key": K}``  remove (no error if absent)

A malformed transaction (unknown table, malformed record, unknown op) is
rejected as a whole with an error naming what was wrong: by
:func:`check_txn` on the proposing node before it ever reaches the log, and
again, identically on every replica, by :meth:`Registry.apply`.

Guarantees: replicas that apply the same sequence hold the same tables and
return the same results; a rejected transaction changes nothing.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from mirrorq.mnesia_like.tables import SCHEMAS, SchemaError, check_table, normalize_key, validate
from mirrorq.packing import pack


class TxnError(ValueError):
    pass


@dataclass(frozen=True)
class Change:
    table: str
    key: tuple
    old: dict | None
    new: dict | None


@dataclass
class TxnResult:
    ok: bool
    error: str = ""
    changes: list[Change] = field(default_factory=list)


def check_txn(txn: Any) -> None:
    """Raise TxnError if ``txn`` is malformed (before any state is consulted)."""
    if not isinstance(txn, dict):
        raise TxnError(f"a transaction is a mapping with 'checks' and 'ops', got {type(txn).__name__}")
    extra = set(txn) - {"checks", "ops"}
    if extra:
        raise TxnError(f"transaction has unknown keys: {sorted(extra)}")
    checks, ops = txn.get("checks", []), txn.get("ops", [])
    if not isinstance(checks, (list, tuple)) or not isinstance(ops, (list, tuple)):
        raise TxnError("'checks' and 'ops' must be lists")
    if not ops:
        raise TxnError("transaction has no ops")
    try:
        for i, c in enumerate(checks):
            if not isinstance(c, dict) or "table" not in c or "key" not in c:
                raise TxnError(f"check #{i} needs 'table' and 'key': {c!r}")
            normalize_key(c["table"], c["key"])
            kinds = [k for k in ("absent", "exists", "equals") if k in c]
            if len(kinds) != 1:
                raise TxnError(f"check #{i} needs exactly one of absent/exists/equals: {c!r}")
            if kinds == ["equals"] and c.get("field") not in SCHEMAS[c["table"]][1]:
                raise TxnError(f"check #{i}: table {c['table']} has no field {c.get('field')!r}")
        for i, op in enumerate(ops):
            if not isinstance(op, dict) or op.get("op") not in ("put", "update", "delete"):
                raise TxnError(f"op #{i} must be put/update/delete: {op!r}")
            if "table" not in op or "key" not in op:
                raise TxnError(f"op #{i} needs 'table' and 'key': {op!r}")
            key = normalize_key(op["table"], op["key"])
            if op["op"] == "put":
                validate(op["table"], key, op.get("record"))
            elif op["op"] == "update":
                fields = op.get("fields")
                if not isinstance(fields, dict) or not fields:
                    raise TxnError(f"op #{i}: update needs a non-empty 'fields' mapping")
                known = SCHEMAS[op["table"]][1]
                for f in fields:
                    if f not in known:
                        raise TxnError(f"op #{i}: table {op['table']} has no field {f!r}")
                    if f in SCHEMAS[op["table"]][0]:
                        raise TxnError(f"op #{i}: key field {f!r} cannot be updated")
    except SchemaError as e:
        raise TxnError(str(e)) from None


class Registry:
    def __init__(self) -> None:
        self.tables: dict[str, dict[tuple, dict]] = {t: {} for t in SCHEMAS}
        self.applied = 0  # how many transactions (ok or not) were applied

    # ---- reads (local) ----------------------------------------------------------
    # A transaction replaces rows, it never changes a stored row in place
    # (apply stages copies), so a row read stays what it was when read.
    # Readers get deep copies to change as they like; ``copy=False`` is for
    # a reader that only serializes the rows (the node agent answering
    # another process): the serialization is the copy.
    def get(self, table: str, key: Any, copy: bool = True) -> dict | None:
        row = self.tables[table].get(normalize_key(table, key))
        return _copy.deepcopy(row) if row is not None and copy else row

    def select(self, table: str, where: Callable[[dict], bool] | None = None, copy: bool = True) -> list[dict]:
        check_table(table)
        rows = [self.tables[table][k] for k in sorted(self.tables[table])]
        return [_copy.deepcopy(r) if copy else r for r in rows if where is None or where(r)]

    # ---- writes (from the log) ------------------------------------------------------
    def apply(self, txn: Any) -> TxnResult:
        self.applied += 1
        try:
            check_txn(txn)
        except TxnError as e:
            return TxnResult(False, str(e))
        for c in txn.get("checks", []):
            table, key = c["table"], normalize_key(c["table"], c["key"])
            row = self.tables[table].get(key)
            if "absent" in c and row is not None:
                return TxnResult(False, f"precondition failed: {table} {key} exists")
            if "exists" in c and row is None:
                return TxnResult(False, f"precondition failed: {table} {key} does not exist")
            if "equals" in c:
                if row is None:
                    return TxnResult(False, f"precondition failed: {table} {key} does not exist")
                if row.get(c["field"]) != c["equals"]:
                    return TxnResult(
                        False,
                        f"precondition failed: {table} {key} {c['field']} is {row.get(c['field'])!r}, "
                        f"expected {c['equals']!r}",
                    )
        # stage on copies: an update of a missing row fails the whole txn
        staged: dict[tuple[str, tuple], dict | None] = {}
        for op in txn["ops"]:
            table, key = op["table"], normalize_key(op["table"], op["key"])
            cur = staged[(table, key)] if (table, key) in staged else self.tables[table].get(key)
            if op["op"] == "put":
                staged[(table, key)] = validate(table, key, op["record"])
            elif op["op"] == "delete":
                staged[(table, key)] = None
            else:
                if cur is None:
                    return TxnResult(False, f"update of {table} {key}: no such row")
                merged = dict(cur)
                merged.update(op["fields"])
                try:
                    staged[(table, key)] = validate(table, key, merged)
                except SchemaError as e:
                    return TxnResult(False, str(e))
        changes = []
        for (table, key), new in staged.items():
            old = self.tables[table].get(key)
            if new is None:
                if old is None:
                    continue
                del self.tables[table][key]
            else:
                self.tables[table][key] = new
            changes.append(Change(table, key, old, new))
        return TxnResult(True, "", changes)

    # ---- snapshots -----------------------------------------------------------------
    def snapshot(self) -> bytes:
        body = {t: [[list(k), r] for k, r in sorted(rows.items())] for t, rows in self.tables.items()}
        return pack({"applied": self.applied, "tables": body})

    @classmethod
    def restore(cls, blob: bytes) -> Registry:
        data = msgpack.unpackb(blob, raw=False)
        reg = cls()
        reg.applied = data["applied"]
        for t, rows in data["tables"].items():
            check_table(t)
            reg.tables[t] = {tuple(k): r for k, r in rows}
        return reg
