"""The queue manager core driven by hand: bad input, queue commands, host deaths.

The distributed behaviour (declares, placement, recovery) is simulated in
``test_manager_sim.py``; these are the core's local rules, one turn at a time.
"""

from __future__ import annotations

import random

import pytest

from mirrorq.node.messages import NodeStatus, RegistryGet, RegistryResult, RegistryRows, RegistryTxn
from mirrorq.queue_process.control import ReplicaInit, ReplicaStarted
from mirrorq.queue_process.manager_core import (
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
from mirrorq.queue_process.messages import CommandResult, QueueCommand
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


@pytest.mark.parametrize("kw, named", [
    ({"agent": ""}, "agent"),
    ({"hosts": ()}, "hosts"),
    ({"hosts": "host0"}, "hosts"),
    ({"hosts": ("host0", "")}, "every host"),
    ({"rng": 7}, "rng"),
    ({"data_dir": None}, "data_dir"),
    ({"start_timeout": 0}, "start_timeout"),
    ({"placement_retry": True}, "placement_retry"),
])
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
    rows = [{"vhost": "/", "name": "q1", "pid": MASTER_B},
            {"vhost": "/", "name": "q2", "pid": "c/10.0.0.3:4000/u2"},  # node c: not up
            {"vhost": "/", "name": "q3", "pid": MASTER_B}]
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
    for name, init, _host in starts[:-1]:
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


def test_registration_is_put_again_until_it_succeeds():
    m = core(node_fields={"admin": "10.0.0.1:1900", "amqp_port": 5672})
    out = m.start(0.0)
    (txn,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    row = txn.txn["ops"][0]["record"]
    assert row == {"admin": "10.0.0.1:1900", "amqp_port": 5672, "name": "a", "state": "member",
                   "manager": "10.0.0.1:5000"}
    out = m.receive(0.1, "agent", RegistryResult(False, "not the registry leader", ref=txn.ref))
    assert SetTimer("tick", 0.2) in out and not m.registered
    out = m.timer(0.3, "tick")
    (again,) = [t for t in sends(out, "agent") if isinstance(t, RegistryTxn)]
    m.receive(0.4, "agent", RegistryResult(True, ref=again.ref))
    assert m.registered
