"""Quorum queue membership on a real 3-node cluster: ``mirrorctl
add_member`` / ``delete_member`` / ``grow`` / ``shrink`` / ``quorum_status``.

A queue declared on two nodes (``x-quorum-initial-group-size: 2``) with
confirmed messages gets a member on the third node, which catches up
(quorum_status: three voters, its lag 0, its applied index the leader's);
then the leader's node is killed and the queue keeps confirming and
delivering (the new member is part of the majority) with no confirmed
message lost.  delete_member removes a member (its log goes with it);
the refusals carry rabbitmqctl's exit codes; shrink then grow on a node
round-trips every quorum queue's membership, messages intact, and a joined
member comes back from its log when its node restarts.
"""

from __future__ import annotations

import contextlib
import io

import conftest
import pytest
from conftest import wait_for

pika = pytest.importorskip("pika")

pytestmark = pytest.mark.cluster

QUORUM = {"x-queue-type": "quorum"}


@pytest.fixture(scope="module")
def cluster():
    with conftest.running_cluster(3) as c:
        yield c


def _channel(c, node: int = 0, confirm: bool = True):
    return c.channel(node, confirm)


def _publish(c, node: int, name: str, bodies) -> None:
    """Every publish confirmed (a BlockingChannel publish raises on a nack or a lost channel)."""
    with _channel(c, node) as ch:
        for b in bodies:
            ch.basic_publish("", name, str(b).encode(), pika.BasicProperties(delivery_mode=2))


def _consume_all(c, node: int, name: str, n: int) -> list[int]:
    got: list[int] = []
    with _channel(c, node) as ch:
        ch.basic_qos(prefetch_count=100)
        for method, _p, body in ch.consume(name, inactivity_timeout=15):
            assert method is not None, f"stalled after {len(got)} of {n} messages"
            got.append(int(body))
            ch.basic_ack(method.delivery_tag)
            if len(got) == n:
                break
        ch.cancel()
    return got


def _status(c, name: str, via: str) -> list[dict]:
    return c.json("quorum_status", "-n", via, name)


def _members(c, name: str, via: str = "node1") -> list[str]:
    rows = c.json("list_queues", "-n", via, "name", "members")
    return next((r["members"] for r in rows if r["name"] == name), [])


def _caught_up(rows: list[dict], nodes: list[str]):
    by = {r["Node Name"]: r for r in rows}
    leader = next((r for r in rows if r["Raft State"] == "leader"), None)
    ok = (
        sorted(by) == sorted(nodes)
        and leader is not None
        and all(
            by[n]["Membership"] == "voter" and by[n]["Lag"] == 0 and by[n]["Last Applied"] == leader["Last Applied"]
            for n in nodes
        )
    )
    return ok, rows


def _rc(c, *argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = c.ctl(*argv)
    return rc, err.getvalue()


def test_add_member_catches_up_and_the_queue_survives_losing_an_original_member(cluster):
    c = cluster
    name = "qqm.grow"
    with _channel(c, 0) as ch:
        ch.queue_declare(name, durable=True, arguments={**QUORUM, "x-quorum-initial-group-size": 2})
    assert _members(c, name) == ["node1", "node2"]
    _publish(c, 0, name, range(300))
    out = c.json("add_member", name, "node3")
    assert out["result"] == "ok" and sorted(out["members"]) == ["node1", "node2", "node3"]
    assert sorted(_members(c, name)) == ["node1", "node2", "node3"]
    rows = wait_for(
        lambda: _caught_up(_status(c, name, "node3"), ["node1", "node2", "node3"]), 30, "the new member caught up"
    )
    leader = next(r["Node Name"] for r in rows if r["Raft State"] == "leader")
    assert leader in ("node1", "node2")
    # the ring view shows the group too
    ring = c.json("ring")
    (line,) = [r for r in ring if r["name"] == name]
    assert sorted(m["node"] for m in line["ring"]) == ["node1", "node2", "node3"]
    # an original member's node dies -- the leader's: the new member makes the majority
    assert c.cluster.kill_node(leader)
    alive = 2 if leader != "node3" else 1
    via = "node3"
    wait_for(
        lambda: (any(r["Raft State"] == "leader" for r in _status(c, name, via)), _status(c, name, via)),
        30,
        "a new leader",
    )
    _publish(c, alive, name, range(300, 400))
    got = _consume_all(c, alive, name, 400)
    assert sorted(got) == list(range(400))  # every confirmed message, once (a leader change may redeliver)
    c.cluster.start_node(leader)
    wait_for(
        lambda: _caught_up(_status(c, name, "node1"), ["node1", "node2", "node3"]),
        60,
        f"{leader}'s member back and caught up",
    )


def test_delete_member_refusals_and_shrink_grow_round_trip(cluster):
    c = cluster
    name, single = "qqm.shrink", "qqm.single"
    with _channel(c, 0) as ch:
        ch.queue_declare(name, durable=True, arguments=QUORUM)
        ch.queue_declare(single, durable=True, arguments={**QUORUM, "x-quorum-initial-group-size": 1})
        ch.queue_declare("qqm.classic", durable=True)
    _publish(c, 0, name, range(50))
    assert sorted(_members(c, name)) == ["node1", "node2", "node3"]
    # refusals, with rabbitmqctl's exit codes
    rc, err = _rc(c, "add_member", name, "node3")
    assert rc == 70 and "already has a member on node node3" in err
    rc, err = _rc(c, "add_member", name, "node9")
    assert rc == 69 and "node node9 is not a member of the cluster" in err
    rc, err = _rc(c, "add_member", "qqm.nope", "node2")
    assert rc == 70 and "no queue 'qqm.nope'" in err
    rc, err = _rc(c, "add_member", "qqm.classic", "node2")
    assert rc == 70 and "not a quorum queue" in err
    rc, err = _rc(c, "delete_member", single, "node1")
    assert rc == 70 and "is the last member" in err
    # delete_member: the member goes, its log with it
    assert sorted(c.json("delete_member", name, "node2")["members"]) == ["node1", "node3"]
    assert sorted(_members(c, name)) == ["node1", "node3"]
    wait_for(
        lambda: (
            not list(c.data_dir.glob(f"node2/quorum/*/{name}/*")),
            list(c.data_dir.glob(f"node2/quorum/*/{name}/*")),
        ),
        15,
        "node2's member's log removed",
    )
    rc, err = _rc(c, "delete_member", name, "node2")
    assert rc == 70 and "has no member on node node2" in err
    # shrink node3: off every quorum queue with another member; grow node3: back on every one
    shrunk = {(r["name"], r["result"]) for r in c.json("shrink", "node3")}
    assert (name, "ok") in shrunk and single not in {n for n, _ in shrunk}
    assert sorted(_members(c, name)) == ["node1"]
    grown = {r["name"]: r for r in c.json("grow", "node3", "all", "--queue-pattern", "^qqm[.]")}
    assert grown[name]["result"] == "ok" and grown[name]["size"] == 2
    assert grown[single]["result"] == "ok" and grown[single]["size"] == 2
    assert "qqm.classic" not in grown
    assert sorted(_members(c, name)) == ["node1", "node3"] and sorted(_members(c, single)) == ["node1", "node3"]
    wait_for(lambda: _caught_up(_status(c, name, "node2"), ["node1", "node3"]), 30, "node3's new member caught up")
    # a joined member comes back from its log after its node restarts (recovery from the record's members,
    # Raft built with the group's bootstrap kept in its directory)
    assert c.cluster.kill_node("node3")
    c.cluster.start_node("node3")
    wait_for(
        lambda: _caught_up(_status(c, name, "node2"), ["node1", "node3"]), 60, "node3's member back after its restart"
    )
    assert c.json("grow", "node3") == []  # nothing left to grow
    # node1's member goes: the queue lives on node3's new member alone, every message there
    assert sorted(c.json("delete_member", name, "node1")["members"]) == ["node3"]
    assert sorted(_consume_all(c, 2, name, 50)) == list(range(50))
