"""The queue manager core driven by hand: bad input, queue commands, host deaths.

The distributed behaviour (declares, placement, recovery) is simulated in
``test_manager_sim.py``; these are the core's local rules, one turn at a time.
"""

from __future__ import annotations

import random

import pytest

from mirrorq.node.messages import NodeStatus, RegistryChanges, RegistryGet, RegistryResult, RegistryRows, RegistryTxn
from mirrorq.queues.control import ExitReplica, ReplicaExited, ReplicaInit, ReplicaStarted, ReplicaStartFailed
from mirrorq.queues.manager_core import (
    DeclareQueue,
    DeclareResult,
    ManagerLog,
    OpsTimeout,
    QueueManagerCore,
    QueueOps,
    QueueOpsResult,
    StartReplica,
    StartReplicaDone,
)
from mirrorq.queues.messages import CommandResult, QueueCommand
from mirrorq.sansio import Emit, Send, SetTimer

MASTER_B = "b/10.0.0.2:4000/u1"


def core(**kw) -> QueueManagerCore:
    args = dict(agent="agent", hosts=("host0",), data_dir="/data", rng=random.Random(1))
    args.update(kw)
    return QueueManagerCore("a", "10.0.0.1:5000", **args)


def sends(actions, dst=None) -> list:
    return [a.msg for a in actions if isinstance(a, Send) and (dst is None or a.dst == dst)]


def logs(actions) -> list[ManagerLog]:
    return [a.event for a in actions if isinstance(a, Emit) and isinstance(a.event, ManagerLog)]


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"agent": ""}, "agent"),
        ({"hosts": ()}, "hosts"),
        ({"hosts": "host0"}, "hosts"),
        ({"hosts": ("host0", "")}, "every host"),
        ({"rng": 7}, "rng"),
        ({"data_dir": None}, "data_dir"),
        ({"start_timeout": 0}, "start_timeout"),
        ({"placement_retry": True}, "placement_retry"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kw, named):
    with pytest.raises(ValueError, match=named):
        core(**kw)


def test_a_declare_without_a_name_is_answered_with_an_error_at_once():
    m = core()
    m.start(0.0)
    out = m.receive(1.0, "ch", DeclareQueue({"durable": True}))
    (answer,) = sends(out, "ch")
    assert isinstance(answer, DeclareResult) and not answer.ok
    assert "a declare needs a queue name" in answer.error
    assert not m.declares and not sends(out, "agent")


def test_an_unexpected_message_is_logged_once_and_ignored():
    m = core()
    m.start(0.0)
    first = m.receive(1.0, "x", "hello")
    second = m.receive(2.0, "x", "again")
    assert [e.event for e in logs(first)] == ["unexpected_message"] and not logs(second)
    assert not sends(first) and not sends(second)


def _rows_answer(m: QueueManagerCore, out: list, table: str, rows: list, now: float) -> list:
    """Answer the core's read of ``table`` found in ``out`` with ``rows``."""
    (get,) = [g for g in sends(out, "agent") if isinstance(g, RegistryGet) and g.table == table]
    return m.receive(now, "agent", RegistryRows(True, rows, ref=get.ref))


def test_queue_ops_answers_each_queue_once_masters_down_and_silent_named():
    m = core()
    m.start(0.0)
    m.receive(0.1, "agent", NodeStatus("a", 1, 0, 0, 0, 0, view={"a": {"state": "up"}, "b": {"state": "up"}}))
    out = m.receive(1.0, "ctl", QueueOps("info", (("/", "q1"), ("/", "q2"), ("/", "q3"), ("/", "gone")), timeout=2.0))
    assert SetTimer in {type(a) for a in out}
    rows = [
        {"vhost": "/", "name": "q1", "pid": MASTER_B},
        {"vhost": "/", "name": "q2", "pid": "c/10.0.0.3:4000/u2"},  # node c: not up
        {"vhost": "/", "name": "q3", "pid": MASTER_B},
    ]
    out = _rows_answer(m, out, "amqqueue", rows, 1.1)
    commands = {c.queue: c for c in sends(out, MASTER_B) if isinstance(c, QueueCommand)}
    assert sorted(commands) == ["q1", "q3"] and commands["q1"].channel == ("10.0.0.1:5000", 0)
    q1, q3 = commands["q1"], commands["q3"]
    out = m.receive(1.2, "10.0.0.2:4000", CommandResult("q1", q1.channel, q1.request_id, True, {"messages": 3}))
    assert not sends(out, "ctl")  # q3 has not answered yet
    (rid,) = m.ops
    out = m.timer(3.0, OpsTimeout(rid))
    (result,) = sends(out, "ctl")
    assert isinstance(result, QueueOpsResult)
    by_name = {r["name"]: r for r in result.results}
    assert [r["name"] for r in result.results] == ["q1", "q2", "q3", "gone"]
    assert by_name["q1"]["ok"] and by_name["q1"]["value"] == {"messages": 3}
    assert "its master's node c is down" in by_name["q2"]["error"]
    assert "did not answer 'info' within 2s" in by_name["q3"]["error"]
    assert "no queue 'gone' in vhost '/'" in by_name["gone"]["error"]
    assert not m.ops and not m.op_requests
    # a late answer finds nothing to complete
    assert not sends(m.receive(3.5, "10.0.0.2:4000", CommandResult("q3", q3.channel, q3.request_id, True, {})))


def test_a_dead_host_takes_its_replicas_and_unanswered_starts_with_it():
    m = core(hosts=("host0", "host1"))
    m.start(0.0)
    starts = []
    for i, name in enumerate(("q1", "q2", "q3", "q4")):
        out = m.receive(1.0, "peer", StartReplica({"vhost": "/", "name": name}, request=i, join=True))
        (init,) = [s for s in sends(out) if isinstance(s, ReplicaInit)]
        starts.append((name, init, next(a.dst for a in out if isinstance(a, Send))))
    # every start but the last is answered
    for _name, init, _host in starts[:-1]:
        out = m.receive(1.1, "host", ReplicaStarted(f"a/10.0.0.1:600{init.token}/r", "a", init.token))
        (done,) = sends(out, "peer")
        assert isinstance(done, StartReplicaDone) and done.member.endswith("/r")
    dead = starts[-1][2]
    index = ("host0", "host1").index(dead)
    out = m.host_exited(2.0, index)
    assert sorted(k[1] for k in m.replicas) == sorted(n for n, _i, h in starts[:-1] if h != dead)
    assert all(p.host != index for p in m.pending_start.values())
    assert [e.event for e in logs(out)][0] == "queue_host_exited"
    # the start the dead host never answered may be asked again, and goes out again
    out = m.receive(3.0, "peer", StartReplica({"vhost": "/", "name": starts[-1][0]}, request=9, join=True))
    assert [s for s in sends(out) if isinstance(s, ReplicaInit)]


def test_a_start_that_failed_on_its_host_does_not_block_the_next_one():
    """A host that could not open a replica's store answers ReplicaStartFailed:
    the start is forgotten, so a later start of that queue goes out (before,
    every later start waited for ever on the failed one's answer)."""
    m = core()
    m.start(0.0)
    out = m.receive(1.0, "peer", StartReplica({"vhost": "/", "name": "q"}, request=1, join=True))
    (init,) = [s for s in sends(out) if isinstance(s, ReplicaInit)]
    out = m.receive(1.1, "peer", StartReplica({"vhost": "/", "name": "q"}, request=2, join=True))
    assert not [s for s in sends(out) if isinstance(s, ReplicaInit)]  # one is starting already
    out = m.receive(1.2, "host0", ReplicaStartFailed(init.token, ("/", "q"), "StoreError: LOCK held"))
    assert [e.event for e in logs(out)] == ["replica_start_failed"]
    assert not m.pending_start
    out = m.receive(1.3, "peer", StartReplica({"vhost": "/", "name": "q"}, request=3, join=True))
    assert [s for s in sends(out) if isinstance(s, ReplicaInit)]


def test_while_a_stale_replica_exits_no_other_start_opens_its_store():
    """A join that replaces a stale replica waits for its exit; meanwhile
    neither another join nor a recovery may start one (two replicas would
    race for the queue's store), and once it exited exactly one start goes."""
    m = core()
    m.start(0.0)
    out = m.receive(1.0, "peer", StartReplica({"vhost": "/", "name": "q"}, request=1, join=True))
    (init,) = [s for s in sends(out) if isinstance(s, ReplicaInit)]
    stale = "a/10.0.0.1:6000/old"
    m.receive(1.1, "host0", ReplicaStarted(stale, "a", init.token))
    out = m.receive(2.0, "peer", StartReplica({"vhost": "/", "name": "q"}, request=2, join=True, members=("b/x/y",)))
    assert [type(s) for s in sends(out, stale)] == [ExitReplica]
    assert m._starting(("/", "q"))
    out = m.receive(2.1, "peer", StartReplica({"vhost": "/", "name": "q"}, request=3, join=True, members=("b/x/y",)))
    assert not [s for s in sends(out) if isinstance(s, ReplicaInit)]
    out = m.receive(2.2, "host0", ReplicaExited(stale, ("/", "q"), "exit requested"))
    assert len([s for s in sends(out) if isinstance(s, ReplicaInit)]) == 1


def test_registration_is_put_again_until_it_succeeds():
    m = core(node_fields={"admin": "10.0.0.1:1900", "amqp_port": 5672})
    out = m.start(0.0)
    (txn,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    row = txn.txn["ops"][0]["record"]
    assert row == {
        "admin": "10.0.0.1:1900",
        "amqp_port": 5672,
        "name": "a",
        "state": "member",
        "manager": "10.0.0.1:5000",
    }
    out = m.receive(0.1, "agent", RegistryResult(False, "not the registry leader", ref=txn.ref))
    assert SetTimer("tick", 0.2) in out and not m.registered
    out = m.timer(0.3, "tick")
    (again,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    m.receive(0.4, "agent", RegistryResult(True, ref=again.ref))
    assert m.registered


# ---- quorum queue membership for tools (QuorumMembers) ----------------------------------------
QA, QB = "a/quorum/u1", "b/quorum/u2"
LEADER_DST = "a/10.0.0.1:4000/u1"


def _quorum_core():
    m = core()
    m.start(0.0)
    view = {n: {"state": "up"} for n in ("a", "b", "c")}
    m.receive(0.1, "agent", NodeStatus("a", 1, 0, 0, 0, 0, view=view))
    return m


def _qrecord(**kw):
    rec = {
        "vhost": "/",
        "name": "qq",
        "type": "quorum",
        "durable": True,
        "arguments": {"x-queue-type": "quorum"},
        "pid": f"{QA}#3",
        "leader_dst": LEADER_DST,
        "members": [QA, QB],
        "bootstrap": [QA, QB],
    }
    rec.update(kw)
    return rec


NODES = [{"name": n, "manager": f"{n}-manager"} for n in ("a", "b", "c")]


def _answer(m, out, table, rows, now):
    return _rows_answer(m, out, table, rows, now)


def test_add_member_starts_the_joiner_with_the_bootstrap_then_asks_the_leader_and_retries_after_a_leader_change():
    from mirrorq.queues.manager_core import QuorumMembers, QuorumMembersResult
    from mirrorq.queues.messages import NotMaster

    m = _quorum_core()
    out = m.receive(1.0, "ctl", QuorumMembers("add", "/", "qq", "c", timeout=10.0))
    out = _answer(m, out, "amqqueue", [_qrecord()], 1.1)
    out = _answer(m, out, "node", NODES, 1.2)
    (start,) = sends(out, "c-manager")
    assert isinstance(start, StartReplica) and start.join
    assert start.quorum["join"] and start.quorum["voters"] == [QA, QB] and start.quorum["members"] == [QA, QB]
    assert start.quorum["member"].startswith("c/quorum/")
    uid = start.quorum["member"].rsplit("/", 1)[1]
    out = m.receive(1.3, "c-manager", StartReplicaDone(start.request, f"c/10.0.0.3:4000/{uid}", "c"))
    out = _answer(m, out, "amqqueue", [_qrecord()], 1.4)
    out = _answer(m, out, "node", NODES, 1.5)
    (cmd,) = sends(out, LEADER_DST)
    assert (cmd.command, cmd.args) == ("add_member", {"member": f"c/quorum/{uid}"})
    # the leader changed: the record is read again and the new leader asked (no second start)
    out = m.receive(1.6, "10.0.0.1:4000", NotMaster("qq", f"{QB}#4", cmd))
    (retry,) = [a.key for a in out if isinstance(a, SetTimer)]
    out = m.timer(1.9, retry)
    out = _answer(m, out, "amqqueue", [_qrecord(pid=f"{QB}#4", leader_dst="b/10.0.0.2:4000/u2")], 2.0)
    out = _answer(m, out, "node", NODES, 2.1)
    assert not sends(out, "c-manager")
    (cmd2,) = sends(out, "b/10.0.0.2:4000/u2")
    assert cmd2.args == {"member": f"c/quorum/{uid}"}
    value = {"member": f"c/quorum/{uid}", "members": [QA, QB, f"c/quorum/{uid}"]}
    out = m.receive(2.5, "10.0.0.2:4000", CommandResult("qq", cmd2.channel, cmd2.request_id, True, value))
    (res,) = sends(out, "ctl")
    assert isinstance(res, QuorumMembersResult) and res.ok and res.value == value
    assert not m.qops and not m.qop_requests


@pytest.mark.parametrize(
    "action, node, record, reason, words",
    [
        ("add", "a", None, "not_found", "no queue 'qq' in vhost '/'"),
        ("add", "c", {"type": None, "arguments": {}}, "not_quorum", "is not a quorum queue"),
        ("add", "z", {}, "no_node", "node z is not a member of the cluster"),
        ("add", "b", {}, "exists", "already has a member on node b"),
        ("delete", "c", {}, "not_member", "has no member on node c"),
        ("delete", "a", {"members": [QA]}, "last_member", "is the last member"),
        ("frobnicate", "a", {}, "bad_request", "action status, add or delete"),
    ],
)
def test_member_commands_refused_with_a_reason(action, node, record, reason, words):
    from mirrorq.queues.manager_core import QuorumMembers

    m = _quorum_core()
    out = m.receive(1.0, "ctl", QuorumMembers(action, "/", "qq", node))
    if reason != "bad_request":
        out = _answer(m, out, "amqqueue", [] if record is None else [_qrecord(**record)], 1.1)
        if reason not in ("not_found", "not_quorum"):
            out = _answer(m, out, "node", NODES, 1.2)
    (res,) = sends(out, "ctl")
    assert not res.ok and res.reason == reason and words in res.error, res
    assert not m.qops


def test_delete_member_asks_the_leader_and_a_down_node_cannot_take_a_new_member():
    from mirrorq.queues.manager_core import QuorumMembers

    m = _quorum_core()
    m.receive(
        0.2,
        "agent",
        NodeStatus("a", 1, 0, 0, 0, 0, view={"a": {"state": "up"}, "b": {"state": "up"}, "c": {"state": "down"}}),
    )
    out = m.receive(1.0, "ctl", QuorumMembers("delete", "/", "qq", "b"))
    out = _answer(m, out, "amqqueue", [_qrecord()], 1.1)
    out = _answer(m, out, "node", NODES, 1.2)
    (cmd,) = sends(out, LEADER_DST)
    assert (cmd.command, cmd.args) == ("delete_member", {"member": QB})
    out = m.receive(1.3, "x", CommandResult("qq", cmd.channel, cmd.request_id, False, error="nope", code=406))
    (res,) = sends(out, "ctl")
    assert not res.ok and res.reason == "refused" and "nope" in res.error
    out = m.receive(2.0, "ctl", QuorumMembers("add", "/", "qq", "c"))
    out = _answer(m, out, "amqqueue", [_qrecord()], 2.1)
    out = _answer(m, out, "node", NODES, 2.2)
    (res,) = sends(out, "ctl")
    assert res.reason == "node_down" and "node c is not running" in res.error


def test_quorum_status_asks_every_member_and_names_the_silent_and_the_down():
    from mirrorq.queues.manager_core import QuorumMembers, QuorumOpTimeout

    qc = "c/quorum/u3"
    m = _quorum_core()
    m.receive(
        0.2,
        "agent",
        NodeStatus("a", 1, 0, 0, 0, 0, view={"a": {"state": "up"}, "b": {"state": "up"}, "c": {"state": "down"}}),
    )
    out = m.receive(1.0, "ctl", QuorumMembers("status", "/", "qq", timeout=2.0))
    out = _answer(m, out, "amqqueue", [_qrecord(members=[QA, QB, qc])], 1.1)
    gets = [g for g in sends(out, "agent") if isinstance(g, RegistryGet)]
    assert sorted(g.key[1] for g in gets) == [QA, QB] and all(g.table == "quorum_member" for g in gets)
    dsts = {QA: LEADER_DST, QB: "b/10.0.0.2:4000/u2"}
    asked = {}
    for g in gets:
        out = m.receive(1.2, "agent", RegistryRows(True, [{"member": g.key[1], "dst": dsts[g.key[1]]}], ref=g.ref))
        (cmd,) = sends(out, dsts[g.key[1]])
        assert cmd.command == "member_status"
        asked[g.key[1]] = cmd
    out = m.receive(
        1.3,
        "x",
        CommandResult(
            "qq", asked[QA].channel, asked[QA].request_id, True, {"member": QA, "raft_state": "leader", "last_index": 9}
        ),
    )
    assert not sends(out, "ctl")
    out = m.timer(3.0, QuorumOpTimeout(next(iter(m.qops))))
    (res,) = sends(out, "ctl")
    assert res.ok and [s["member"] for s in res.value] == [QA, QB, qc]
    assert [s["raft_state"] for s in res.value] == ["leader", "timeout", "down"]


# ---- declares: reads from the table copies, no hop to itself, no SetPolicy round -----------------
HA_ALL = {
    "vhost": "/",
    "name": "ha",
    "pattern": "^q",
    "apply_to": "queues",
    "priority": 0,
    "definition": {"ha-mode": "all"},
}


def _declaring_core():
    """A manager of node a whose copies of policy, amqqueue and node are loaded
    (node a's manager row names this manager itself)."""
    m = core()
    out = m.start(0.0)
    m.receive(0.1, "agent", NodeStatus("a", 1, 0, 0, 0, 0, view={n: {"state": "up"} for n in "abc"}))
    out += m.timer(0.2, "tick")
    nodes = [{"name": "a", "manager": m.me}] + [{"name": n, "manager": f"{n}-manager"} for n in "bc"]
    for table, rows in (("policy", [HA_ALL]), ("node", nodes), ("amqqueue", [])):
        _rows_answer(m, out, table, rows, 0.3)
    return m


def test_a_declare_reads_its_tables_from_the_copies_and_starts_the_local_founder_without_a_hop():
    m = _declaring_core()
    out = m.receive(1.0, "fe", DeclareQueue({"name": "q1", "vhost": "/", "durable": True}))
    # no read of amqqueue: the claim goes out at once
    assert not [g for g in sends(out, "agent") if isinstance(g, RegistryGet)]
    (claim,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    out = m.receive(1.1, "agent", RegistryResult(True, ref=claim.ref))
    assert not [g for g in sends(out, "agent") if isinstance(g, RegistryGet)]  # policy and node: from the copies
    # b and c are asked to start a founder; a's own start is handled here: its host is told directly
    assert [type(x).__name__ for x in sends(out, "b-manager") + sends(out, "c-manager")] == ["StartReplica"] * 2
    assert not sends(out, m.me)
    (init,) = [x for x in sends(out, "host0") if isinstance(x, ReplicaInit)]
    assert init.policy == {"ha-mode": "all"} and init.policy_name == "ha"


def test_a_declared_queue_gets_no_set_policy_round_for_the_definition_its_founders_started_with():
    from mirrorq.queues.control import SetPolicy

    m = _declaring_core()
    out = m.receive(1.0, "fe", DeclareQueue({"name": "q1", "vhost": "/", "durable": True}))
    (claim,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    out = m.receive(1.1, "agent", RegistryResult(True, ref=claim.ref))
    (init,) = [x for x in sends(out, "host0") if isinstance(x, ReplicaInit)]
    request = next(x.request for x in sends(out, "b-manager"))
    out = m.receive(1.2, "host0", ReplicaStarted("a/h:1/u1", "a", init.token))
    out += m.receive(1.2, "b-manager", StartReplicaDone(request, "b/h:2/u2", "b"))
    out += m.receive(1.2, "c-manager", StartReplicaDone(request, "c/h:3/u3", "c"))
    assert [type(x).__name__ for x in sends(out, "a/h:1/u1")] == ["FoundGroup"]
    record = {
        "vhost": "/",
        "name": "q1",
        "durable": True,
        "pid": "a/h:1/u1",
        "policy": "ha",
        "slave_pids": ["b/h:2/u2", "c/h:3/u3"],
        "sync_slave_pids": ["b/h:2/u2", "c/h:3/u3"],
        "gm_pids": ["a/h:1/u1", "b/h:2/u2", "c/h:3/u3"],
        "state": "live",
    }
    out = m.receive(1.3, "agent", RegistryChanges([("amqqueue", ["/", "q1"], None, record)]))
    (result,) = sends(out, "fe")
    assert isinstance(result, DeclareResult) and result.ok
    out += m.timer(5.0, "converge")
    assert not [x for x in sends(out) if isinstance(x, SetPolicy)]
    # a changed definition is still pushed
    changed = {**HA_ALL, "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"}}
    out = m.receive(6.0, "agent", RegistryChanges([("policy", ["/", "ha"], HA_ALL, changed)]))
    out += m.timer(9.0, "converge")
    assert len([x for x in sends(out) if isinstance(x, SetPolicy)]) == 3


def test_a_quorum_declare_names_the_policy_in_the_members_spec():
    m = _declaring_core()
    out = m.receive(
        1.0, "fe", DeclareQueue({"name": "q2", "vhost": "/", "durable": True, "arguments": {"x-queue-type": "quorum"}})
    )
    (claim,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    out = m.receive(1.1, "agent", RegistryResult(True, ref=claim.ref))
    starts = [x for x in sends(out) if type(x).__name__ in ("StartReplica", "ReplicaInit")]
    assert len(starts) == 3 and all(s.spec["policy"] == "ha" for s in starts)
    # once every member started, their addresses go into quorum_member in one transaction
    (init,) = [x for x in sends(out, "host0") if isinstance(x, ReplicaInit)]
    request = next(x.request for x in sends(out, "b-manager"))
    voters = init.quorum["voters"]
    out = m.receive(1.2, "host0", ReplicaStarted("a/h:1/" + voters[0].rsplit("/", 1)[1], "a", init.token))
    out += m.receive(1.2, "b-manager", StartReplicaDone(request, "b/h:2/x", "b"))
    assert not [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]  # c has not started yet
    out = m.receive(1.3, "c-manager", StartReplicaDone(request, "c/h:3/y", "c"))
    (rows,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    assert [(op["table"], op["key"][1], op["record"]["dst"]) for op in rows.txn["ops"]] == [
        ("quorum_member", voters[0], "a/h:1/" + voters[0].rsplit("/", 1)[1]),
        ("quorum_member", voters[1], "b/h:2/x"),
        ("quorum_member", voters[2], "c/h:3/y"),
    ]
    # refused (a registry leader change): put again
    out = m.receive(1.4, "agent", RegistryResult(False, "leader changed", ref=rows.ref))
    assert [t.txn for t in sends(out, "agent") if isinstance(t, RegistryTxn)] == [rows.txn]
