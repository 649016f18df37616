"""Policies in the registry: transactions applied to the real registry state machine."""

from __future__ import annotations

import pytest

from mirrorq.mnesia_like.registry import Registry
from mirrorq.policy.records import Policy, PolicyValidationError
from mirrorq.policy.store import (
    clear_policy_txn,
    definition_json,
    parse_definition,
    policies_from_rows,
    policy_listing,
    set_policy_txn,
)


def P(name, pattern="^ha\\.", defn=None, priority=0, vhost="/", apply_to="all"):
    return Policy(vhost, name, pattern, defn or {"ha-mode": "all"}, priority, apply_to)


def test_parse_definition():
    assert parse_definition('{"ha-mode":"exactly","ha-params":2}') == {"ha-mode": "exactly", "ha-params": 2}
    with pytest.raises(PolicyValidationError, match="not valid JSON") as e:
        parse_definition("{ha-mode: all}")
    assert e.value.key == "definition"
    with pytest.raises(PolicyValidationError, match="JSON object"):
        parse_definition('["ha-mode"]')


def test_set_replaces_and_round_trips_through_the_registry():
    reg = Registry()
    assert reg.apply(set_policy_txn(P("ha", priority=1))).ok
    assert reg.apply(set_policy_txn(P("ha", pattern="^x", defn={"ha-mode": "exactly", "ha-params": 2}))).ok
    policies, errors = policies_from_rows(reg.select("policy"))
    assert errors == []
    assert policies == [P("ha", pattern="^x", defn={"ha-mode": "exactly", "ha-params": 2})]


def test_clear_needs_the_policy_to_exist():
    reg = Registry()
    reg.apply(set_policy_txn(P("ha")))
    reg.apply(set_policy_txn(P("ha", vhost="other")))
    res = reg.apply(clear_policy_txn("/", "nope"))
    assert not res.ok and "precondition failed" in res.error
    assert reg.apply(clear_policy_txn("/", "ha")).ok
    assert [(r["vhost"], r["name"]) for r in reg.select("policy")] == [("other", "ha")]
    with pytest.raises(PolicyValidationError, match="vhost"):
        clear_policy_txn("", "ha")
    with pytest.raises(PolicyValidationError, match="Policy is required"):
        set_policy_txn({"name": "ha"})


def test_invalid_rows_are_reported_not_used():
    rows = [
        P("good").to_dict(),
        {
            "vhost": "/",
            "name": "bad",
            "pattern": "(",
            "definition": {"ha-mode": "all"},
            "priority": 0,
            "apply_to": "all",
        },
    ]
    policies, errors = policies_from_rows(rows)
    assert [p.name for p in policies] == ["good"]
    assert len(errors) == 1 and "'bad'" in errors[0] and "regular expression" in errors[0]


def test_listing_columns_vhost_filter_and_order():
    ps = [P("b", priority=5), P("a"), P("c", vhost="v2")]
    rows = policy_listing(ps, "/")
    assert [r["name"] for r in rows] == ["a", "b"]
    assert list(rows[0]) == ["vhost", "name", "pattern", "apply-to", "definition", "priority"]
    assert rows[1]["priority"] == 5 and rows[1]["definition"] == {"ha-mode": "all"}
    assert [r["vhost"] for r in policy_listing(ps, None)] == ["/", "/", "v2"]
    assert definition_json({"ha-mode": "nodes", "ha-params": ["a"]}) == '{"ha-mode":"nodes","ha-params":["a"]}'
