"""The registry state machine: transactions, preconditions, bad input."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrorq.mnesia_like.registry import Registry, TxnError, check_txn


def q(name, **kw):
    return {"name": name, "vhost": "/", **kw}


def put(table, key, record):
    return {"op": "put", "table": table, "key": key, "record": record}


def test_put_get_update_delete_and_changes():
    r = Registry()
    res = r.apply({"ops": [put("amqqueue", ["/", "q1"], q("q1", durable=True))]})
    assert res.ok and res.changes[0].old is None and res.changes[0].new["durable"] is True
    assert r.get("amqqueue", ("/", "q1"))["slave_pids"] == []  # default filled
    res = r.apply({"ops": [{"op": "update", "table": "amqqueue", "key": ["/", "q1"], "fields": {"pid": "node2"}}]})
    assert res.ok and res.changes[0].old["pid"] is None and res.changes[0].new["pid"] == "node2"
    assert r.apply({"ops": [{"op": "delete", "table": "amqqueue", "key": ["/", "q1"]}]}).ok
    assert r.get("amqqueue", ["/", "q1"]) is None


def test_gm_group_version_precondition_lets_one_view_change_win():
    r = Registry()
    r.apply({"ops": [put("gm_group", "g", {"name": "g", "version": 1, "members": ["a", "b", "c"]})]})

    def change(members):
        return {
            "checks": [{"table": "gm_group", "key": "g", "field": "version", "equals": 1}],
            "ops": [{"op": "update", "table": "gm_group", "key": "g", "fields": {"version": 2, "members": members}}],
        }

    first, second = r.apply(change(["a", "c"])), r.apply(change(["a", "b"]))
    assert first.ok and not second.ok
    assert "version is 2, expected 1" in second.error
    assert r.get("gm_group", "g")["members"] == ["a", "c"]


def test_failed_precondition_or_op_applies_nothing():
    r = Registry()
    txn = {
        "checks": [{"table": "vhost", "key": "/", "absent": True}],
        "ops": [
            put("vhost", "/", {"name": "/"}),
            {"op": "update", "table": "user", "key": "nobody", "fields": {"tags": []}},
        ],
    }
    res = r.apply(txn)
    assert not res.ok and "no such row" in res.error
    assert r.get("vhost", "/") is None and res.changes == []


@pytest.mark.parametrize(
    "txn, text",
    [
        ("nope", "is a mapping"),
        ({"ops": []}, "no ops"),
        ({"ops": [put("queues", "x", {})]}, "no table 'queues'"),
        ({"ops": [put("vhost", "/", {"name": "/", "colour": 1})]}, "unknown field 'colour'"),
        ({"ops": [put("gm_group", "g", {"name": "g", "members": []})]}, "missing field 'version'"),
        ({"ops": [put("gm_group", "g", {"name": "g", "version": "1", "members": []})]}, "field 'version' must be int"),
        ({"ops": [put("vhost", "/", {"name": "other"})]}, "does not match"),
        ({"ops": [put("amqqueue", "q1", q("q1"))]}, "key must be (vhost, name)"),
        ({"ops": [{"op": "upsert", "table": "vhost", "key": "/"}]}, "put/update/delete"),
        ({"ops": [{"op": "update", "table": "vhost", "key": "/", "fields": {"name": "x"}}]}, "key field 'name'"),
        ({"checks": [{"table": "vhost", "key": "/"}], "ops": [put("vhost", "/", {"name": "/"})]}, "exactly one of"),
        ({"extra": 1, "ops": [put("vhost", "/", {"name": "/"})]}, "unknown keys"),
    ],
)
def test_malformed_transactions_are_named_and_apply_nothing(txn, text):
    with pytest.raises(TxnError) as e:
        check_txn(txn)
    assert text in str(e.value)
    r = Registry()
    res = r.apply(txn)
    assert not res.ok and text in res.error
    assert all(not rows for rows in r.tables.values())


ops = st.lists(
    st.one_of(
        st.builds(lambda n: put("vhost", n, {"name": n}), st.sampled_from("abc")),
        st.builds(lambda n: {"op": "delete", "table": "vhost", "key": n}, st.sampled_from("abc")),
        st.builds(
            lambda n, v: put("gm_group", n, {"name": n, "version": v, "members": [n]}),
            st.sampled_from("xy"),
            st.integers(0, 3),
        ),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(ops, max_size=12))
def test_replicas_applying_the_same_log_agree_and_snapshots_round_trip(log):
    a, b = Registry(), Registry()
    for i, txn_ops in enumerate(log):
        txn = {"ops": txn_ops}
        assert a.apply(txn) == b.apply(txn)
        if i % 3 == 0:
            b = Registry.restore(b.snapshot())
    assert a.tables == b.tables and a.applied == b.applied
