"""mirrorctl's policy and queue commands: argument handling and output.

The node is replaced by ``FakeSession``: transactions and reads go to the
real registry state machine (:class:`~mirrorq.mnesia_like.registry.Registry`),
queue commands return what each test says the masters answer, and every
call is recorded so the tests can check what would have been sent.
"""

from __future__ import annotations

import json

import pytest

import ctl.mirrorctl as mc
from mirrorq.admin import ops
from mirrorq.mnesia_like.registry import Registry
from mirrorq.node.messages import RegistryResult


class FakeSession:
    def __init__(self, registry: Registry, up=("node1", "node2", "node3"), answers=None):
        self.registry = registry
        self.up = set(up)
        self.answers = answers or {}  # (command, name) -> (ok, value, error)
        self.calls: list = []

    def txn(self, txn, timeout=None, idempotent=False):
        self.calls.append(("txn", txn))
        self.idempotent = idempotent
        res = self.registry.apply(txn)
        return RegistryResult(res.ok, res.error)

    def rows(self, table):
        return self.registry.select(table)

    def nodes_up(self):
        return set(self.up)

    def queue_ops(self, command, queues, args=None, timeout=5.0):
        self.calls.append(("ops", command, list(queues), timeout))
        out = []
        for vhost, name in queues:
            ok, value, error = self.answers.get((command, name), (False, None, "no answer"))
            out.append({"vhost": vhost, "name": name, "ok": ok, "value": value, "error": error})
        return out

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture
def session(monkeypatch):
    s = FakeSession(Registry())
    monkeypatch.setattr(mc, "connect", lambda args: s)
    return s


def run(*argv):
    return mc.main(["--data-dir", "/nonexistent-mirrorq", *argv])


def member(node, port):
    return f"{node}/127.0.0.1:{port}/u{port}"


def put_queue(reg, name, pid, slaves=(), synced=(), policy=None, vhost="/"):
    rec = {
        "name": name,
        "vhost": vhost,
        "pid": pid,
        "slave_pids": list(slaves),
        "sync_slave_pids": list(synced),
        "policy": policy,
    }
    assert reg.apply({"ops": [{"op": "put", "table": "amqqueue", "key": [vhost, name], "record": rec}]}).ok


# ================================================================ policies


def test_set_policy_writes_the_policy_and_says_so(session, capsys):
    rc = run(
        "set_policy",
        "-p",
        "/",
        "--priority",
        "3",
        "--apply-to",
        "queues",
        "ha-two",
        "^two\\.",
        '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}',
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert out.strip() == (
        'Setting policy "ha-two" for pattern "^two\\." to '
        '"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}" '
        'with priority "3" for vhost "/" ...'
    )
    (row,) = session.registry.select("policy")
    assert row == {
        "vhost": "/",
        "name": "ha-two",
        "pattern": "^two\\.",
        "priority": 3,
        "apply_to": "queues",
        "definition": {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"},
    }


def test_set_policy_json_output(session, capsys):
    assert run("--formatter", "json", "set_policy", "-p", "v1", "all", ".*", '{"ha-mode":"all"}') == 0
    assert json.loads(capsys.readouterr().out) == {
        "vhost": "v1",
        "name": "all",
        "pattern": ".*",
        "definition": {"ha-mode": "all"},
        "priority": 0,
        "apply_to": "all",
    }


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["p", ".*", '{"ha-params":2}'], "ha-mode must be specified"),
        (["p", ".*", '{"ha-mode":"exactly"}'], "needs ha-params"),
        (["p", ".*", '{"ha-mode":"exactly","ha-params":0}'], "integer >= 1"),
        (["p", ".*", '{"ha-mode":"nodes","ha-params":[]}'], "non-empty list"),
        (["p", ".*", '{"ha-mode":"all","ha-sync-mode":"sometimes"}'], "ha-sync-mode must be one of"),
        (["p", ".*", '{"ha-mode":"all","ha-sync-batch-size":0}'], "ha-sync-batch-size"),
        (["p", ".*", '{"ha-mode":"all","ha-promote-on-failure":"never"}'], "ha-promote-on-failure"),
        (["p", ".*", '{"queue-master-locator":"nearest"}'], "queue-master-locator"),
        (["p", ".*", '{"ha-mode":"all","ha-confirm-mode":"maybe"}'], "ha-confirm-mode"),
        (["p", "([", '{"ha-mode":"all"}'], "not a valid regular expression"),
        (["p", ".*", "{ha-mode: all}"], "not valid JSON"),
        (["p", ".*", "{}"], "no policy provided"),
        (["p", ".*", '{"max-length":1}'], "not a recognised policy setting"),
    ],
)
def test_set_policy_validation_errors_write_nothing(session, capsys, argv, fragment):
    rc = run("set_policy", *argv)
    err = capsys.readouterr().err
    assert rc == 70
    assert err.startswith("mirrorctl: error: Validation failed: ") and fragment in err, err
    assert session.registry.select("policy") == [] and session.calls == []


def test_set_policy_argument_errors(session, capsys):
    with pytest.raises(SystemExit) as e:
        run("set_policy", "--apply-to", "bindings", "p", ".*", '{"ha-mode":"all"}')
    assert e.value.code == 64 and "invalid choice: 'bindings'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run("set_policy", "--priority", "high", "p", ".*", '{"ha-mode":"all"}')
    assert e.value.code == 64 and "invalid int value: 'high'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        run("set_policy", "p", ".*")
    assert e.value.code == 64 and "definition" in capsys.readouterr().err


def test_clear_policy(session, capsys):
    run("set_policy", "ha", ".*", '{"ha-mode":"all"}')
    run("set_policy", "-p", "v2", "ha", ".*", '{"ha-mode":"all"}')
    capsys.readouterr()
    assert run("clear_policy", "ha") == 0
    assert capsys.readouterr().out.strip() == 'Clearing policy "ha" on vhost "/" ...'
    assert [(r["vhost"], r["name"]) for r in session.registry.select("policy")] == [("v2", "ha")]
    assert run("clear_policy", "ha") == 70
    assert "no policy 'ha' in vhost '/' (Parameter does not exist)" in capsys.readouterr().err
    assert run("--formatter", "json", "clear_policy", "-p", "v2", "ha") == 0
    assert json.loads(capsys.readouterr().out) == {"vhost": "v2", "name": "ha", "cleared": True}


def test_list_policies_table_and_json(session, capsys):
    run("set_policy", "--priority", "2", "b-pol", "^b", '{"ha-mode":"exactly","ha-params":2}')
    run("set_policy", "--apply-to", "queues", "a-pol", "^a", '{"ha-mode":"all"}')
    run("set_policy", "-p", "other", "c-pol", "^c", '{"ha-mode":"all"}')
    capsys.readouterr()
    assert run("--formatter", "json", "list_policies") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [
        {
            "vhost": "/",
            "name": "a-pol",
            "pattern": "^a",
            "apply-to": "queues",
            "definition": {"ha-mode": "all"},
            "priority": 0,
        },
        {
            "vhost": "/",
            "name": "b-pol",
            "pattern": "^b",
            "apply-to": "all",
            "definition": {"ha-mode": "exactly", "ha-params": 2},
            "priority": 2,
        },
    ]
    assert run("list_policies", "-p", "other") == 0
    out = capsys.readouterr().out
    assert out.startswith('Listing policies for vhost "other" ...')
    for word in ("vhost", "name", "pattern", "apply-to", "definition", "priority", "c-pol", '{"ha-mode":"all"}'):
        assert word in out
    assert "a-pol" not in out


# ================================================================ queues


@pytest.fixture
def queues(session):
    reg = session.registry
    assert reg.apply(
        {
            "ops": [
                {
                    "op": "put",
                    "table": "policy",
                    "key": ["/", "ha"],
                    "record": {
                        "vhost": "/",
                        "name": "ha",
                        "pattern": "^q",
                        "definition": {"ha-mode": "exactly", "ha-params": 3},
                    },
                }
            ]
        }
    ).ok
    put_queue(reg, "q1", member("node1", 1), [member("node2", 2), member("node3", 3)], [member("node2", 2)], "ha")
    put_queue(reg, "q2", member("node3", 4), policy=None)
    put_queue(reg, "q3", member("node4", 5), [member("node1", 6)], [member("node1", 6)], "ha")  # node4 down
    put_queue(reg, "other", member("node1", 7), vhost="v2")
    info = {"messages": 10, "messages_ready": 7, "messages_unacknowledged": 3, "consumers": 1}
    session.answers = {
        ("info", "q1"): (
            True,
            dict(info, sync={member("node2", 2): "synchronised", member("node3", 3): "syncing 42"}),
            "",
        ),
        ("info", "q2"): (True, dict(info, messages=0, sync={}), ""),
    }
    return session


ALL_ITEMS = list(ops.QUEUE_ITEMS)


def test_list_queues_json_every_item(queues, capsys):
    assert run("--formatter", "json", "list_queues", *ALL_ITEMS) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["q1", "q2", "q3"]
    q1, q2, q3 = rows
    assert q1 == {
        "name": "q1",
        "durable": False,
        "auto_delete": False,
        "exclusive": False,
        "arguments": {},
        "pid": "node1",
        "slave_pids": ["node2", "node3"],
        "synchronised_slave_pids": ["node2"],
        "messages": 10,
        "messages_ready": 7,
        "messages_unacknowledged": 3,
        "consumers": 1,
        "policy": "ha",
        "effective_policy_definition": {"ha-mode": "exactly", "ha-params": 3},
        "state": "syncing 42",
        "type": "classic",
        "leader": "node1",
        "members": ["node1", "node2", "node3"],
        "online": ["node1", "node2", "node3"],
    }
    assert q2["state"] == "running" and q2["messages"] == 0 and q2["policy"] is None
    assert q2["effective_policy_definition"] == {} and q2["slave_pids"] == []
    # q3's master's node is down: no live numbers, state down, and its master was not asked
    assert q3["state"] == "down" and q3["messages"] is None and q3["pid"] == "node4"
    assert q3["leader"] == "node4" and "node4" in q3["members"] and "node4" not in q3["online"]
    (call,) = [c for c in queues.calls if c[0] == "ops"]
    assert call[1] == "info" and call[2] == [("/", "q1"), ("/", "q2")]


def test_list_queues_default_items_table_and_vhost(queues, capsys):
    assert run("list_queues") == 0
    out = capsys.readouterr().out
    assert out.startswith("Listing queues for vhost / ...")
    assert "name" in out and "messages" in out and "q1" in out and "10" in out and "other" not in out
    assert "pid" not in out
    assert run("--formatter", "json", "list_queues", "-p", "v2", "name", "pid") == 0
    assert json.loads(capsys.readouterr().out) == [{"name": "other", "pid": "node1"}]


def test_list_queues_without_live_items_asks_no_master(queues, capsys):
    assert run("--formatter", "json", "list_queues", "name", "pid", "slave_pids", "policy") == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0] == {"name": "q1", "pid": "node1", "slave_pids": ["node2", "node3"], "policy": "ha"}
    assert not [c for c in queues.calls if c[0] == "ops"]


def test_list_queues_table_shows_nodes_and_state(queues, capsys):
    assert run("list_queues", "name", "pid", "slave_pids", "state") == 0
    out = capsys.readouterr().out
    assert "[node2, node3]" in out and "syncing 42" in out and "down" in out


def test_list_queues_unknown_item(queues, capsys):
    assert run("list_queues", "name", "colour") == 64
    err = capsys.readouterr().err
    assert "Info key(s) colour are not supported" in err and "synchronised_slave_pids" in err


def test_list_queues_master_not_answering_is_down(queues, capsys):
    del queues.answers[("info", "q2")]
    assert run("--formatter", "json", "list_queues", "name", "state", "messages") == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["q2"] == {"name": "q2", "state": "down", "messages": None}


@pytest.mark.parametrize(
    "state,expected",
    [
        ("synchronised", "running"),
        ("unsynchronised", "running"),  # waiting for a manual sync_queue: not syncing
        ("syncing", "syncing 0"),
        ("syncing 1234", "syncing 1234"),
        ({"state": "syncing", "sent": 7}, "syncing 7"),
        ({"state": "synchronised", "transferred": 100}, "running"),
    ],
)
def test_queue_state_from_sync_info(state, expected):
    rec = {"pid": member("node1", 1)}
    info = {"ok": True, "value": {"sync": {member("node2", 2): state}}}
    assert ops.queue_state(rec, info, {"node1", "node2"}) == expected
    assert ops.queue_state(rec, info, {"node2"}) == "down"
    assert ops.queue_state(rec, {"ok": False}, {"node1"}) == "down"


def test_sync_and_cancel_sync(queues, capsys):
    queues.answers[("sync", "q1")] = (True, None, "")
    assert run("sync_queue", "q1") == 0
    assert capsys.readouterr().out.strip() == "Synchronising queue 'q1' in vhost '/' ..."
    assert queues.calls[-1] == ("ops", "sync", [("/", "q1")], mc.QUEUE_OP_TIMEOUT)
    queues.answers[("cancel_sync", "q1")] = (True, {"cancelled": ["node3"]}, "")
    assert run("--formatter", "json", "cancel_sync_queue", "-t", "2", "q1") == 0
    assert json.loads(capsys.readouterr().out) == {
        "vhost": "/",
        "name": "q1",
        "command": "cancel_sync",
        "result": {"cancelled": ["node3"]},
    }
    assert queues.calls[-1] == ("ops", "cancel_sync", [("/", "q1")], 2.0)


def test_sync_errors_are_reported(queues, capsys):
    queues.answers[("sync", "nope")] = (False, None, "no queue 'nope' in vhost '/'")
    assert run("sync_queue", "nope") == 70
    assert "sync of queue 'nope' in vhost '/' failed: no queue 'nope' in vhost '/'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("sync_queue")


def test_commands_without_a_cluster_fail_clearly(capsys, tmp_path):
    assert mc.main(["--data-dir", str(tmp_path), "list_policies"]) == 69
    assert f"no cluster in {tmp_path}" in capsys.readouterr().err
